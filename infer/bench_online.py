"""`python -m infer.bench_online`: the online Poisson benchmark (infer/bench/online.py)."""
from infer.bench.online import main

if __name__ == "__main__":
    from looplm.cli import run

    run(main)
