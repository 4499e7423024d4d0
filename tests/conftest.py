"""Test environment: no network, every cache inside the repo's ignored .cache folder."""
import os
from pathlib import Path

_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "test"
for var, sub in (("HF_HOME", "hf"), ("HF_DATASETS_CACHE", "hf/datasets"), ("WANDB_DIR", "wandb"),
                 ("WANDB_CACHE_DIR", "wandb/cache"), ("WANDB_DATA_DIR", "wandb/data"),
                 ("WANDB_CONFIG_DIR", "wandb/config"), ("MPLCONFIGDIR", "mpl")):
    os.environ.setdefault(var, str(_CACHE / sub))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # under `pytest -n N` each worker (and the servers it starts)
    # gets one intra-op thread, set before torch is imported: N workers x torch's default of one
    # thread per core oversubscribed CI's 2 cores (12m59s against 6m06s for the whole suite)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
