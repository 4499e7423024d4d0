"""The virtual device: the real engine on a device that is only a cost model, below serving and bench.

- cost.py: what a stage launch costs (the GPU roofline, the fitted latency model, the host table)
- dispatch.py: what issuing a launch costs the host (eager aten ops counted from the engine, graph replays)
- runner.py: SimRunner, the `Runner` on a virtual clock, and the exit-depth draws
- emulated.py: EmulatedRunner, SimRunner on the wall clock (the server's `--device emulated:h100`)
- simulate.py, __main__.py: the simulator (`python -m infer.sim`)
- latency.py (the stage latency model, `python -m infer.sim.latency`), bounds.py (analytic bounds),
  work.py (exact work counts from a trace)
- the library the benchmarks share with it: workloads.py (request traces, data/), replay.py
  (recorded exits), stats.py (raw records, summaries, intervals), report.py (tables, plots, JSON)"""
