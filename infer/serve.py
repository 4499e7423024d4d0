"""`python -m infer.serve`: the OpenAI-compatible server (infer/serving/cli.py), the command users
type (as `vllm serve`); `--device emulated:h100` serves on the emulated device (infer/sim/emulated.py)."""
from infer.serving.cli import main

if __name__ == "__main__":
    from looplm.cli import run

    run(main)
