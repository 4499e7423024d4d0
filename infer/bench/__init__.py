"""Measurement command lines over the shared library in infer/sim/ (workloads, replay, stats, report):
`python -m infer.bench` is the offline benchmark (offline.py); online.py, host.py, memory.py,
itl.py, prefix.py, speculative.py, capacity.py and replica_scaling.py are `python -m infer.bench.<name>`."""
