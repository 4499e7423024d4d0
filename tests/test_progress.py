"""Progress output that suits a log (issue 37, deliverable 8): when the stream is not a terminal,
a plain line every few seconds and one at the end, never a carriage return."""
import io
import subprocess
import sys
from pathlib import Path

import pytest

from infer.engine import progress as P

ROOT = Path(__file__).resolve().parents[1]


def test_a_log_gets_lines_not_redraws(monkeypatch):
    clock = iter(range(0, 1000, 3))  # each monotonic() call 3 s after the last
    monkeypatch.setattr(P.time, "monotonic", lambda: next(clock))
    f = io.StringIO()
    bar = P.progress(100, "demo", "req", file=f, every=10)
    assert isinstance(bar, P.LogProgress)
    for _ in range(100):
        bar.update(1)
    bar.close()
    bar.close()  # (twice: still one last line)
    out = f.getvalue()
    assert "\r" not in out
    lines = out.splitlines()
    # ~3 s per update and a line at most every 10 s: one line per 4 updates, plus the last
    assert 20 <= len(lines) <= 30, len(lines)
    assert lines[-1].startswith("demo: 100/100 req (100%)")


def test_a_terminal_gets_tqdm():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    bar = P.progress(3, "x", file=Tty())
    assert not isinstance(bar, P.LogProgress)
    bar.close()


def test_disabled_is_silent():
    f = io.StringIO()
    bar = P.progress(3, "x", file=f, disable=True)
    bar.update(3)
    bar.close()
    assert f.getvalue() == ""


@pytest.mark.slow
def test_generate_in_a_pipe_writes_no_carriage_return():
    code = ("from infer import LLM, SamplingParams; "
            "LLM('ouro-tiny', kv_cache_tokens=512).generate([[1, 2, 3]] * 40, SamplingParams(max_tokens=2))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "generate: 40/40 req (100%)" in r.stderr, r.stderr[-500:]
