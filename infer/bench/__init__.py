"""Measurement: offline and online benchmarks, analytic bounds, the latency model and the simulator.
`python -m infer.bench` is the offline benchmark (offline.py)."""
