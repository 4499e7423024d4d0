#!/usr/bin/env bash
# Launch (or resume: re-running continues from the latest checkpoint) the two demo pretraining runs
# in the background, one CPU thread each. Logs: .cache/runs/<name>/train.log; history.json beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD WANDB_MODE=${WANDB_MODE:-offline} OMP_NUM_THREADS=1
mkdir -p .cache/runs/ouro-demo .cache/runs/huginn-demo
which=${1:-both}
if [[ $which == both || $which == ouro ]]; then
  nohup $PY train/pretrain.py --arch ouro --core 3 --r-max 4 --steps 1100 --gate-steps 400 --embed-std 1.0 --threads 1 \
    --run-dir .cache/runs/ouro-demo --save-to checkpoints/ouro-demo >> .cache/runs/ouro-demo/train.log 2>&1 &
  echo "ouro-demo pid $!"
fi
if [[ $which == both || $which == huginn ]]; then
  nohup $PY train/pretrain.py --arch huginn --prelude 1 --core 2 --coda 1 --r-max 8 --mean-depth 6 --min-depth 4 --bptt 4 \
    --steps 1200 --gate-steps 300 --threads 1 \
    --run-dir .cache/runs/huginn-demo --save-to checkpoints/huginn-demo >> .cache/runs/huginn-demo/train.log 2>&1 &
  echo "huginn-demo pid $!"
fi
