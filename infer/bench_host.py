"""`python -m infer.bench_host`: host time per stage with the model math removed (infer/bench/host.py)."""
from infer.bench.host import main

if __name__ == "__main__":
    main()
