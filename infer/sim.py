"""`python -m infer.sim`: the simulator (infer/bench/sim.py)."""
from infer.bench.sim import main

if __name__ == "__main__":
    from looplm.cli import run

    run(main)
