"""Recorded-exit replay: record a checkpoint's per-token exit scores once, then give every mode of
a benchmark (and the simulator) the depths those scores decide, with the recorded output lengths.

    python -m infer.bench --model checkpoints/ouro-demo --r-min 4 --record-exits outputs/ouro-demo.exits.json
    python -m infer.bench --model ouro-1.4b-4l --load-format dummy --dtype bfloat16 \
        --replay-exits outputs/ouro-demo.exits.json --exit-threshold 0.6
    python -m infer.sim --model ouro-1.4b --replay-exits outputs/ouro-demo.exits.json

Recording runs the bench's requests once through CDB (refill, K = 1) under the engine's exit
policy and keeps, per decode token, the criterion's score after every loop step the exit tracker
read (looplm/policy.py). A live run at threshold q reads the scores up to each token's exit, so
replaying at q (and its r_min and lookahead) reproduces that run's depths exactly. Replaying at
another policy may need a score past a token's recorded exit: that is refused, by name. Recording
with `--r-min R_MAX` makes every token loop to r_max while its scores are read, so the file holds
every step's score and replays at any threshold / r_min / lookahead (the authors' benchmark does
the same: one full-depth teacher-forced pass per reference output). A greedy run with EOS ignored
is that teacher-forced pass: its tokens are the reference output.

Replay changes which loop step each token exits after, nothing else: the model math still runs on
the replaying model (which may be another checkpoint or dummy weights of another shape with the
same r_max), the tokens it samples are its own, and each request produces its recorded number of
tokens. The depths are derived before the run (`derive`, the same ExitTracker the engine runs) and
a `ForcedTracker` makes the scheduler exit each token after its depth.
"""
from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

from looplm.errors import ParamError
from looplm.policy import ExitPolicy, ExitTracker

from .workloads import FIRST_ID, Request

FORMAT = "looplm-exits/1"


def add_args(p, replay_help: str) -> None:
    """--replay-exits FILE and --pool on a command line (the bench's, the simulator's); `from_args` reads them."""
    p.add_argument("--replay-exits", type=Path, metavar="FILE", help=replay_help)
    p.add_argument("--pool", action="store_true",
                   help="with --replay-exits: replay all the file's workloads as one request stream, `all` (an "
                        "evaluation's tasks, served together as lm-eval sends them)")


def from_args(p, a) -> dict | None:
    """The recorded-exits file --replay-exits names (pooled under --pool), or None; a parser error for --pool
    without a file."""
    if a.pool and a.replay_exits is None:
        p.error("--pool needs --replay-exits FILE (it pools the file's workloads)")
    if a.replay_exits is None:
        return None
    doc = load(a.replay_exits)
    return pooled(doc) if a.pool else doc


class RecordingTracker(ExitTracker):
    """An ExitTracker that keeps every score it reads: `rows[i]` holds the scores after loop steps
    1, 2, ... of the sequence's i-th decode token (its output token i + 1; output 0 comes from the
    prefill at full depth)."""

    __slots__ = ("rows",)

    def __init__(self, policy: ExitPolicy):
        self.rows: list[list[float]] | None = None  # the constructor's reset is not a token
        super().__init__(policy)
        self.rows = []

    def reset(self) -> None:
        super().reset()
        if self.rows is not None:
            self.rows.append([])

    def after_step(self, s: int, score: float) -> bool:
        row = self.rows[-1]
        if s == len(row) + 1:  # the tracker reads each step once; a step at r_max is read without its score mattering
            row.append(float(score))
        return super().after_step(s, score)


class ForcedTracker(ExitTracker):
    """An ExitTracker whose i-th decode token leaves the loop after `depths[i]` steps, whatever the
    scores: it is closed from the start, so the scheduler only compares the step with `stop_at`."""

    __slots__ = ("depths", "token")

    def __init__(self, policy: ExitPolicy, depths: list[int]):
        self.depths, self.token = None, -1
        super().__init__(policy)
        self.depths = depths

    def reset(self) -> None:
        super().reset()
        if self.depths is not None:
            self.token += 1
            self.exit_at = self.stop_at = self.depths[self.token]
            self.open = False


class MissingScore(ParamError):
    pass


def derive(row: list[float], policy: ExitPolicy) -> int:
    """The exit depth the engine's tracker decides from one token's recorded scores."""
    t = ExitTracker(policy)
    s = 0
    while True:
        s += 1
        if t.open:
            if s < policy.r_max and s > len(row):
                raise MissingScore("replay_exits", f"the recording stops at step {len(row)} of this token, but "
                                                   f"{_describe(policy)} needs its score after step {s}")
            t.after_step(s, row[s - 1] if s <= len(row) else 0.0)
        if s >= t.stop_at:
            return s


def _describe(p: ExitPolicy) -> str:
    return f"{p.criterion} q={p.threshold} r_min={p.r_min}{' lookahead' if p.lookahead else ''}"


# ---------------------------------------------------------------------------------- the file
def record_block(rows: list[list[list[float]]], requests: list[Request]) -> list[dict]:
    """One workload's requests for the file: lengths and each decode token's scores."""
    return [{"prompt_len": q.prompt_len, "output_len": q.output_len, "scores": sc} for q, sc in zip(requests, rows)]


def write(path: Path, *, model: str, policy: ExitPolicy, model_r_min: int, kv_layout: str,
          workloads: dict[str, dict]) -> None:
    """`workloads`: name -> {"requests": record_block(...), plus what made them (scale, seed)}.
    `replay_r_min`, the r_min a replay uses unless given one: the recording's, or for a complete
    recording (r_min = r_max only to read every score) the checkpoint's own (`model_r_min`)."""
    complete = policy.adaptive and policy.r_min >= policy.r_max  # every step's score was read
    doc = {"format": FORMAT, "model": model, "criterion": policy.criterion, "threshold": policy.threshold,
           "r_min": policy.r_min, "r_max": policy.r_max, "lookahead": policy.lookahead, "kv_layout": kv_layout,
           "complete": complete, "replay_r_min": model_r_min if complete else policy.r_min, "workloads": workloads}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc) + "\n")


def load(path: Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ParamError("replay_exits", f"no such recorded-exits file: {path}") from None
    except json.JSONDecodeError as e:
        raise ParamError("replay_exits", f"{path} is not a recorded-exits file (not JSON: {e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ParamError("replay_exits", f"{path} is not a recorded-exits file (format {FORMAT!r}; "
                                         "write one with python -m infer.bench --record-exits FILE)")
    return doc


def engine_settings(doc: dict, base: dict) -> dict:
    """The engine settings of a replaying run: the recorded criterion, and the threshold and r_min
    given on the command line (`base`) or else the recorded ones (`replay_r_min`, see write). The engine then computes the
    criterion's scores as the recording run did (the same work), and its policy is the one the
    replayed depths are derived with."""
    return {**base, "exit_criterion": doc["criterion"],
            "exit_threshold": doc["threshold"] if base.get("exit_threshold") is None else base["exit_threshold"],
            "r_min": doc["replay_r_min"] if base.get("r_min") is None else base["r_min"]}


def replay_depths(doc: dict, workload: str, policy: ExitPolicy) -> list[list[int]]:
    """Per request, the exit depth of every output token under `policy` (index 0: the prefill's,
    r_max); a policy without exits (full depth) gives r_max everywhere."""
    if policy.r_max != doc["r_max"]:
        raise ParamError("replay_exits", f"the exits were recorded with r_max {doc['r_max']}, this engine runs "
                                         f"r_max {policy.r_max}")
    if not policy.adaptive:
        policy = None
    out = []
    for i, r in enumerate(requests_of(doc, workload)):
        try:
            if policy is None:  # (a full-depth recording, CB's, read no scores: output_len - 1 decode tokens)
                out.append([doc["r_max"]] * max(1, r["output_len"]))
            else:
                out.append([doc["r_max"]] + [derive(row, policy) for row in r["scores"]])
        except MissingScore as e:
            raise ParamError("replay_exits", f"{workload} request {i}: {e}; record with --r-min "
                                             f"{doc['r_max']} to replay any policy") from None
    return out


def requests_of(doc: dict, workload: str) -> list[dict]:
    ws = doc["workloads"]
    if workload not in ws:
        raise ParamError("replay_exits", f"no recorded exits for workload {workload!r}; the file has {sorted(ws)}")
    return ws[workload]["requests"]


POOLED = "all"


def pooled(doc: dict) -> dict:
    """The file with its workloads as one, `all`: every workload's requests in the file's order
    (an evaluation's tasks, which lm-eval sends to the model together)."""
    reqs = [r for w in doc["workloads"].values() for r in w["requests"]]
    return {**doc, "workloads": {POOLED: {"scale": None, "seed": None, "pooled": sorted(doc["workloads"]),
                                          "requests": reqs}}}


def make_replay_requests(doc: dict, workload: str, vocab_size: int, max_model_len: int, seed: int = 0
                         ) -> list[Request]:
    """The recorded requests' lengths with prompt ids drawn (by seed) from the replaying model's
    vocabulary: only lengths and depths are replayed."""
    rng = random.Random(f"replay:{workload}:{seed}")
    out = []
    for i, r in enumerate(requests_of(doc, workload)):
        p, o = r["prompt_len"], r["output_len"]
        if p + o > max_model_len:
            raise ParamError("replay_exits", f"{workload} request {i} needs {p + o} tokens of context "
                                             f"(prompt {p} + output {o}); this engine serves max_model_len "
                                             f"{max_model_len}")
        out.append(Request([rng.randrange(FIRST_ID, vocab_size) for _ in range(p)], o, p, o))
    return out


def depths_crc32(depths: list[list[int]]) -> int:
    """A digest of every token's exit depth: equal digests, equal depths (shown in the JSON)."""
    return zlib.crc32(json.dumps(depths).encode())
