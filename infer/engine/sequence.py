"""A request's bookkeeping as it moves through the four queues, and two enums. Pure Python.

`Status` is where a request is in its life (vLLM V1's RequestStatus): waiting for admission,
running (it holds KV blocks and a state slot), preempted (stalled or swapped out), finished.
`Stage` is a launch kind, what the engine runs in one step: a prefill, a prelude, one core step, a
coda, CB's fused iteration, or a speculative draft-and-verify of a few sequences. A running
sequence's `stage` is the launch it takes part in next, whose queue holds it (PREFILL: its prompt
is being prefilled: in a separate prefill launch, or between two chunks under mixed prefill; CB's
fused iteration consumes the PRELUDE queue). A preempted sequence's `stage` is the queue it goes
back to; a waiting one's is PREFILL; a finished one keeps its last.

A `Sequence` has four parts, each written by one owner (vLLM V1's Request / KV cache manager /
scheduler state / output state; `OWNERS` names them and tests/test_sequence_owners.py checks every
write in infer/):
- the request: what was asked, with what the per-token loops derive from it (stop ids, the length
  limit, whether it samples or needs extras), fixed at creation (`LLMEngine.add_request`);
- its KV memory: block table, state slot and `room`, changed only by the BlockManager
  (block_manager.py: `allocate_seq`, `grow_seq`, `shrink_seq`, `free_seq`), which keeps `room`
  right with every table change; the scheduler decides when;
- the scheduler's state: its status, the queue it waits in, its loop step, its prompt chunk in
  flight, its exit tracker, why it finished (scheduler.py and its parts chunks.py, preemption.py;
  the output processor decides a stop's reason, `Scheduler.finish` records it);
- the output processor's state: tokens, exit depths, log-probs, text, times (output.py).
A *chunk* is always a span of prompt positions prefilled in one launch (mixed prefill); the k
positions a speculative stage verifies are a *window* (spec_plan.py).
"""
from __future__ import annotations

import enum
import time
from dataclasses import InitVar, dataclass, field

from looplm.policy import ExitPolicy, ExitTracker

from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # in the waiting queue, not admitted: holds no memory
    RUNNING = "running"  # admitted: holds its blocks and slot, in the queue of its `stage` (or prefilling in chunks)
    # preempted (preemption.py)
    STALLED = "stalled"  # holds its blocks and slot, waits for the block of its next row
    SWAPPED = "swapped"  # its KV and state are in host memory
    FINISHED = "finished"  # stopped or aborted: holds nothing (`finish_reason` says why)

    __hash__ = object.__hash__  # (as Stage's: identity)


class Stage(enum.Enum):
    PREFILL = "prefill"  # whole prompts at full depth; queue 1 (waiting)
    PRELUDE = "prelude"  # decode tokens -> loop state; queue 2
    CORE = "core"  # one loop step for items at mixed depths; queue 3
    CODA = "coda"  # exited tokens -> logits; queue 4
    FUSED = "fused"  # CB: prelude + r_max core steps + coda in one launch
    SPEC = "spec"  # self-speculation: draft + verify a window of positions per sequence (speculative.py); consumes queue 2

    # Members are singletons compared by identity, so identity is a valid hash; Enum's own
    # __hash__ is a Python-level hash(name), paid at every Stage-keyed lookup of every stage.
    __hash__ = object.__hash__

    @property
    def reads_tokens(self) -> bool:
        """The stage embeds each decode item's last token (its input comes with the batch)."""
        return self in (Stage.PRELUDE, Stage.FUSED)

    @property
    def emits(self) -> bool:
        """The stage ends with logits: a token is sampled for each of its sequences."""
        return self in (Stage.PREFILL, Stage.CODA, Stage.FUSED)


@dataclass(eq=False, slots=True)  # identity: queue membership tests must not compare every field; slots: the
# per-item hot loops (scheduler, engine, runner) read attributes from a fixed layout, not a dict
class Sequence:
    # ---- the request (set at creation, never written)
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    policy: ExitPolicy
    arrival_time: float = field(default_factory=time.perf_counter)
    text_prompt: str | None = None
    forced: list[int] | None = None  # teacher forcing: the output tokens are these (log-likelihoods)
    priority: int = 0  # scheduling_policy "priority": lower is admitted sooner and preempted later
    # how the request's EOS ids and context bound it (not kept): what the per-token loops read is
    # derived from them once, below
    eos_ids: InitVar[frozenset[int]] = frozenset()
    max_model_len: InitVar[int | None] = None
    stop_ids: frozenset = field(init=False)  # stop token ids (with the EOS ids unless ignore_eos)
    max_out: int = field(init=False)  # output tokens at which it stops for length (max_tokens, capped by the context)
    extras: bool = field(init=False)  # teacher-forced or asks for log-probs: OutputProcessor._extras handles its row
    sampled: bool = field(init=False)  # temperature > 0 and not teacher-forced
    # ---- the scheduler's state
    status: Status = Status.WAITING  # where it is in its life (the module docstring)
    stage: Stage = Stage.PREFILL  # RUNNING: the launch it takes part in next, whose queue holds it
    finish_reason: str | None = None
    # ---- its KV memory (written by block_manager.py only)
    blocks: list[int] = field(default_factory=list)  # KV block table
    # output tokens whose KV rows the block table holds (len(blocks) * block_size - prompt length):
    # the BlockManager sets it with every table change, so that the growth check after each token
    # is one comparison instead of three lengths (scheduler.postprocess)
    room: int = 0
    # row of the runner's per-sequence state buffers ("slot" alone means this; a KV layout's copies of
    # a row per loop depth are its "depth slots")
    slot: int = -1
    # ---- the scheduler's state (continued)
    step: int = 0  # loop steps done by the current decode token (or by the prompt chunk in flight)
    prefilled: int = 0  # mixed prefill: prompt positions whose KV is complete (chunks.py)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix caching: digests of full prompt blocks
    chunk: tuple[int, int] | None = None  # mixed prefill: the prompt positions [start, end) in flight
    step_scored: int = 0  # pipelined core: steps whose exit score the tracker has seen
    scheduled_time: float | None = None  # when it first left the waiting queue (vLLM's queue time ends)
    # the current token's exit decision (made at its first prelude, reset per token); a caller may
    # bring its own (a replay forcing recorded depths: LLMEngine.add_request(tracker=))
    tracker: ExitTracker | None = None
    # ---- the output processor's state
    output_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token (params.top_logprobs)
    prompt_logprobs: list[float | None] = field(default_factory=list)  # None for the first prompt token
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    text: str = ""  # detokenized output (when a tokenizer is attached)
    stop_checked: int = 0  # chars of `text` already searched for stop strings
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    forced_greedy: bool = True  # teacher forcing: every forced token so far was the argmax
    # on-device token re-entry (EngineConfig.async_scheduling): output tokens at the end of output_ids
    # whose ids are still on the device, unread by the host (a placeholder, -1, until
    # OutputProcessor.resolve reads them); 0 or 1. Their exit depths are known; their time, log-prob
    # and text come with the id.
    unread_ids: int = 0
    generator: object = None  # the request's torch.Generator (sampling with a seed)

    def __post_init__(self, eos_ids: frozenset[int], max_model_len: int | None) -> None:
        p = self.params
        self.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(eos_ids))
        self.max_out = p.max_tokens if max_model_len is None else min(p.max_tokens, max_model_len - len(self.prompt_ids))
        self.extras = self.forced is not None or bool(p.logprobs)
        self.sampled = p.temperature > 0 and self.forced is None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def position(self) -> int:
        """Position of the token being decoded (the last one produced)."""
        return self.num_tokens - 1

    @property
    def num_resolved(self) -> int:
        """Output tokens whose ids the host knows (what outputs and streams show)."""
        return len(self.output_ids) - self.unread_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def started(self) -> bool:
        """Admitted (prefilled or being prefilled): it holds KV memory and a state slot."""
        return self.slot >= 0 or bool(self.output_ids)

    def reserved_tokens(self, max_model_len: int) -> int:
        """KV rows the request can ever use: prompt + outputs, capped by the context."""
        return min(len(self.prompt_ids) + self.params.max_tokens, max_model_len)


# Who writes each part (tests/test_sequence_owners.py checks every assignment and list mutation of
# a Sequence field in infer/ against this). The request's fields are written by no one.
OWNERS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "request": (frozenset(), ("seq_id", "request_id", "prompt_ids", "params", "policy", "arrival_time",
                              "text_prompt", "forced", "priority", "stop_ids", "max_out", "extras", "sampled")),
    "kv": (frozenset({"infer/engine/block_manager.py"}), ("blocks", "room", "slot")),
    "scheduler": (frozenset({"infer/engine/scheduler.py", "infer/engine/chunks.py", "infer/engine/preemption.py"}),
                  ("status", "stage", "finish_reason", "step", "prefilled", "block_hashes", "chunk", "step_scored",
                   "tracker", "scheduled_time")),
    "output": (frozenset({"infer/engine/output.py"}),
               ("output_ids", "exit_depths", "logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs",
                "text", "stop_checked", "first_token_time", "finish_time", "token_times",
                "forced_greedy", "generator", "unread_ids")),
}
