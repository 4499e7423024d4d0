"""Progress for the command lines (`LLM.generate`, the bench, the demo, the latency sweep, lm-eval's
model): tqdm's bar on a terminal; in a log (CI, a pipe, a file) a plain line at most every
`every` seconds and one at the end, instead of thousands of carriage-return redraws. Pure Python."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class LogProgress:
    """tqdm's `update` / `close` as lines: `desc: n/total unit (p%) t s, r unit/s`."""

    def __init__(self, total: int, desc: str, unit: str, file: TextIO, every: float = 10.0):
        self.total, self.desc, self.unit, self.file, self.every = total, desc, unit, file, every
        self.n = 0
        self.t0 = self._last = time.monotonic()
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self._last >= self.every:
            self._line()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._line()

    def _line(self) -> None:
        now = time.monotonic()
        self._last, dt = now, now - self.t0
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        rate = f", {self.n / dt:.1f} {self.unit}/s" if dt > 0 else ""
        print(f"{self.desc}: {self.n}/{self.total} {self.unit}{pct} {dt:.0f} s{rate}", file=self.file, flush=True)


def progress(total: int, desc: str, unit: str = "it", file: TextIO | None = None, disable: bool = False,
             every: float = 10.0):
    """A progress bar over `total` units on `file` (default stderr): tqdm on a terminal, a
    `LogProgress` elsewhere; `disable` gives tqdm's silent bar (the same two methods)."""
    from tqdm.auto import tqdm
    stream = file if file is not None else sys.stderr
    if disable or stream.isatty():
        return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=disable)
    return LogProgress(total, desc, unit, stream, every)
