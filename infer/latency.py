"""`python -m infer.latency`: the stage latency model (infer/bench/latency.py)."""
from infer.bench.latency import main

if __name__ == "__main__":
    main()
