"""vLLM's request histograms for /metrics, under vLLM's names and bucket bounds (vllm/v1/metrics/
loggers.py), so that Grafana dashboards and benchmark harnesses written for vLLM read this server
too. Observed once per finished request, in the engine thread (AsyncEngine._finish); rendered by
metrics.py from a copy taken then. Pure Python: a few hundred integers."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from infer.engine.sequence import Sequence

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


def tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 series up to max_model_len (build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one +Inf (not cumulative)
    sum: float = 0.0

    def __post_init__(self):
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1  # le: a value on a bound counts in its bucket
        self.sum += v

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.sum)


# name -> (help, the histogram it shows); the order /metrics shows them in. vLLM V1 observes every
# inter-token interval under two names (the older and the newer), so two names show one histogram.
NAMES = {
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", "ttft"),
    "vllm:time_per_output_token_seconds": ("Histogram of time per output token in seconds.", "itl"),
    "vllm:inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", "itl"),
    "vllm:e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", "e2e"),
    "vllm:request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.", "queue"),
    "vllm:request_prompt_tokens": ("Number of prefill tokens processed.", "prompt"),
    "vllm:request_generation_tokens": ("Number of generation tokens processed.", "generation"),
}


class RequestHistograms:
    def __init__(self, max_model_len: int):
        tok = tokens_buckets(max_model_len)
        self.hists = {"ttft": Histogram(TTFT_BUCKETS), "itl": Histogram(TPOT_BUCKETS),
                      "e2e": Histogram(LATENCY_BUCKETS), "queue": Histogram(LATENCY_BUCKETS),
                      "prompt": Histogram(tok), "generation": Histogram(tok)}

    def observe(self, s: Sequence) -> None:
        """A finished request (its times are the engine's perf_counter stamps)."""
        h = self.hists
        if s.first_token_time is not None:
            h["ttft"].observe(s.first_token_time - s.arrival_time)
        for a, b in zip(s.token_times, s.token_times[1:]):
            h["itl"].observe(b - a)
        if s.finish_time is not None:
            h["e2e"].observe(s.finish_time - s.arrival_time)
        if s.scheduled_time is not None:
            h["queue"].observe(s.scheduled_time - s.arrival_time)
        h["prompt"].observe(len(s.prompt_ids))
        h["generation"].observe(len(s.output_ids))

    def copy(self) -> dict[str, Histogram]:
        return {k: v.copy() for k, v in self.hists.items()}


def render(hists: dict[str, Histogram], lab: str) -> list[str]:
    """Prometheus text lines (cumulative buckets, _sum, _count) with the label set `lab`."""
    out = []
    for name, (help_, key) in NAMES.items():
        h = hists[key]
        out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        total = 0
        for le, n in zip([*(str(float(b)) for b in h.bounds), "+Inf"], h.counts):
            total += n
            out.append(f'{name}_bucket{{{lab},le="{le}"}} {total}')
        out += [f"{name}_sum{{{lab}}} {h.sum:.9g}", f"{name}_count{{{lab}}} {total}"]
    return out
