"""`python -m infer.serve`: the OpenAI-compatible server (infer/serving/cli.py)."""
from infer.serving.cli import main

if __name__ == "__main__":
    from looplm.cli import run

    run(main)
