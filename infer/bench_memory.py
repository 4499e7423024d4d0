"""`python -m infer.bench_memory`: see infer/bench/memory.py."""
from infer.bench.memory import main

if __name__ == "__main__":
    main()
