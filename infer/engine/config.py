"""`EngineConfig`: every engine setting and its default, in one place, and how a setting left
unset is resolved against the checkpoint.

`LLM`, the lm-eval model, the server and every CLI build one of these (the CLIs generate their
flags and choices from it); nothing else states an engine default. Settings left at None are
filled by `resolve(model_cfg)` from the checkpoint's config.json (`kv_layout`, `exit_criterion`,
`exit_threshold`, `r_min`, `exit_lookahead`: what `train/shared_kv.py` writes), else from the
engine's defaults; an explicit value always wins. The engine keeps the resolved config
(`llm.config`, the server's /v1/models and the bench JSON show it).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields

import torch

from kv_layouts import DEFAULT_LAYOUT, LAYOUT_NAMES, layout_class
from looplm.config import CRITERIA, LoopConfig
from looplm.errors import ParamError
from looplm.policy import OUTPUT_CRITERIA, ExitPolicy

POLICIES = ("cb", "cdb")
CPU_KV_MEMORY = 512 * 2**20  # bytes of KV pool + state slots on a CPU when no pool size is given
PREFILL_MODES = ("mixed", "separate")
SCHEDULING_POLICIES = ("fcfs", "priority")
ATTENTION_BACKENDS = ("paged", "sdpa")


def _f(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineConfig:
    policy: str = _f("cdb", "cb (continuous batching, the baseline) or cdb")
    refill: bool = _f(True, "cdb: interleave stages (the paper's refill) instead of running cohorts; under "
                            "min_coda_batch=auto each coda's cost rule decides whether its exits re-enter the loop now "
                            "or the loop drains first (a coda held until the loop is empty is the cohort's schedule)")
    min_coda_batch: int | str = _f("auto", "cdb refill: exits that must wait before a coda runs (the paper's K), or "
                                      "auto: decided at each step from what launches cost (auto_coda.py)")
    kv_layout: str | None = _f(None, f"KV layout: {', '.join(LAYOUT_NAMES)} (S depth slots per core layer, step s "
                                     f"in slot min(s, S); S = 2 unless given); default: the checkpoint's, else "
                                     f"{DEFAULT_LAYOUT}")
    max_batch_size: int = _f(64, "sequences running at once (= state slots)")
    scheduling_policy: str = _f("fcfs", "fcfs: requests are admitted in arrival order; priority (vLLM's): by each "
                                        "request's priority (lower first, ties by arrival), and preemption takes the "
                                        "worst priority first")
    max_num_batched_tokens: int = _f(2048, "token budget per launch, as vLLM's: mixed prefill: "
                                           "prompt tokens + decode items per launch, longer prompts are chunked where "
                                           "exact; separate: prompt tokens per prefill batch (a longer prompt runs "
                                           "alone)")
    prefill: str = _f("mixed", "mixed: prompts (or chunks) ride in the decode launches (prelude / core / coda; CB: "
                               "the fused iteration); separate: whole prompts in prefill launches of their own")
    chunked_prefill: bool | None = _f(None, "mixed prefill: split prompts longer than the budget into chunks; "
                                            "default: on for the depth-indexed layouts; not exact (refused) with "
                                            "shared and first_then_shared, which keep prompts whole")
    enable_prefix_caching: bool | None = _f(None, "share the KV blocks of a prompt's leading full blocks with later "
                                                  "requests that start with the same tokens (LRU among free blocks); "
                                                  "default: on where exact (depth-indexed layouts, mixed prefill); "
                                                  "refused with shared and first_then_shared")
    kv_cache_tokens: int | None = _f(None, "KV pool size in tokens; default: sized from the device (see "
                                           "gpu_memory_utilization, kv_cache_memory)")
    kv_cache_bytes: int | None = _f(None, "KV pool size in bytes (instead of kv_cache_tokens)")
    kv_cache_memory: int | None = _f(None, "CPU: bytes of KV pool + state slots when no kv_cache_tokens / "
                                           f"kv_cache_bytes is given; default {CPU_KV_MEMORY >> 20} MiB")
    gpu_memory_utilization: float = _f(0.9, "CUDA: fraction of the device's memory for weights + activations + "
                                            "KV pool (the pool gets what a worst-case dummy stage leaves)")
    max_model_len: int | None = _f(None, "context cap (prompt + output); default: the checkpoint's, lowered to "
                                         "what the KV pool holds")
    block_size: int = _f(16, "KV rows per block")
    reserve_kv: bool = _f(False, "reserve prompt + max_tokens of KV at admission (no preemption) instead of "
                                 "blocks on demand")
    watermark: float = _f(0.01, "fraction of KV blocks that admission leaves free for running requests to grow")
    swap_space: int | None = _f(None, "host bytes for preempted (swapped-out) requests; default: the KV pool's "
                                      "size")
    exit_criterion: str | None = _f(None, "exit criterion; default: the checkpoint's")
    exit_threshold: float | None = _f(None, "exit threshold; default: the checkpoint's, else the criterion's")
    r_min: int | None = _f(None, "minimum exit depth; default: the checkpoint's")
    lookahead: bool | None = _f(None, "the exit signal after step s means 'exit after s+1'; default: the "
                                      "checkpoint's")
    full_depth: bool = _f(False, "disable exits (resolved: also True under a full-depth layout and policy cb)")
    pad_pow2: bool = _f(True, "pad decode batches to powers of two (static shapes for CUDA graphs)")
    cuda_graphs: bool | None = _f(None, "CUDA graphs for decode stages; default: on for CUDA devices")
    attention_backend: str | None = _f(None, "decode attention (vLLM's name): paged (FlexAttention over each item's own "
                                             "KV blocks, compiled on CUDA) or sdpa (gather every context to the "
                                             "batch's longest, then SDPA); default: paged on CUDA, sdpa elsewhere "
                                             "(eager FlexAttention on a CPU materialises its scores). Launches that "
                                             "carry prompt chunks and speculative stages gather either way")
    pipeline: bool | None = _f(None, "lookahead pipeline (launch step t before reading t-1's scores); default: "
                                     "on for CUDA with lookahead")
    async_scheduling: bool | None = _f(None, "on-device token re-entry (vLLM's name): a stage's sampled ids feed the "
                                             "next prelude on the device and the host reads them one launch later, "
                                             "so the GPU does not idle through sampling, output processing and "
                                             "scheduling; a stop found late discards the extra work; default: on "
                                             "for CUDA devices without speculative_tokens")
    speculative_tokens: int = _f(0, "self-speculative decoding: verify windows of k positions (the current token and "
                                    "k-1 tokens drafted at draft_depth loops) in one depth-major pass; greedy "
                                    "requests only, exact; 0 = off (refused with shared, first_then_shared and the "
                                    "kl / entropy_diff criteria)")
    draft_depth: int | None = _f(None, "speculation: the loop steps a draft token runs at most (the policy's own exit "
                                       "if earlier); below r_max; default: r_min (at least 1, at most r_max - 1)")
    speculative_max_batch: int = _f(8, "speculation runs only while at most this many sequences decode (and no "
                                       "prompt waits): with a full batch the device is busy anyway, and a "
                                       "rejected draft is wasted work")
    seed: int = _f(0, "seeds the generators of requests that bring none")
    trace: bool = _f(False, "record every step (stage, batch, context, seconds) in engine.trace")

    def __post_init__(self) -> None:
        # runs on the explicit values at construction and again on the filled-in values, since
        # resolve() builds its result with dataclasses.replace
        self.refuse()

    def refuse(self, cfg: LoopConfig | None = None, device: torch.device | str = "cpu", pol: ExitPolicy | None = None,
               full: bool = False, draft: int | None = None) -> None:
        """Every refusal of a setting, in one place (a ParamError naming the setting). Without a
        checkpoint (at construction): each setting's range and the settings that contradict each
        other. With one (`resolve`, on the explicit values, with the policy `pol`, exits disabled
        `full` and the draft depth `draft` it resolved): what the checkpoint or the device cannot
        serve."""
        if self.policy not in POLICIES:
            raise ParamError("policy", f"unknown policy {self.policy!r}; supported: {POLICIES}")
        if self.kv_layout is not None:
            layout_class(self.kv_layout)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ParamError("scheduling_policy", f"unknown scheduling_policy {self.scheduling_policy!r}; supported: "
                                                  f"{SCHEDULING_POLICIES}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ParamError("attention_backend", f"unknown attention_backend {self.attention_backend!r}; supported: "
                                                  f"{ATTENTION_BACKENDS}")
        if self.prefill not in PREFILL_MODES:
            raise ParamError("prefill", f"unknown prefill {self.prefill!r}; supported: {PREFILL_MODES}")
        check_chunking(self.kv_layout, self.chunked_prefill, self.prefill)
        check_prefix_caching(self.kv_layout, self.enable_prefix_caching, self.prefill)
        check_speculation(self.kv_layout, self.speculative_tokens, self.draft_depth)
        if self.refill == "auto":  # (its old default: it did what True does, min_coda_batch="auto" decides)
            raise ParamError("refill", "refill='auto' is refill=True (min_coda_batch='auto' decides whether a coda "
                                       "waits for the loop to drain): pass True or False")
        if not isinstance(self.refill, bool):
            raise ParamError("refill", f"refill must be True or False, got {self.refill!r}")
        if self.min_coda_batch != "auto" and (not isinstance(self.min_coda_batch, int) or self.min_coda_batch < 1):
            raise ParamError("min_coda_batch", f"min_coda_batch must be an integer >= 1 or 'auto', got "
                                               f"{self.min_coda_batch!r}")
        for name in ("max_batch_size", "max_num_batched_tokens", "block_size", "speculative_max_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ParamError(name, f"{name} must be an integer >= 1, got {v!r}")
        for name in ("kv_cache_tokens", "kv_cache_bytes", "kv_cache_memory", "max_model_len", "swap_space"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ParamError(name, f"{name} must be a positive integer, got {v!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ParamError("gpu_memory_utilization", f"gpu_memory_utilization must be in (0, 1], got "
                                                       f"{self.gpu_memory_utilization!r}")
        if not 0 <= self.watermark < 1:
            raise ParamError("watermark", f"watermark must be in [0, 1), got {self.watermark!r}")
        if self.async_scheduling and self.speculative_tokens:
            raise ParamError("async_scheduling", "async_scheduling=True does not combine with speculative_tokens: a "
                                                 "speculative stage drafts from the tokens on the host, so each "
                                                 "stage's ids must reach the host before the next is scheduled")
        if self.pipeline and self.lookahead is False:
            raise ParamError("pipeline", "pipeline=True needs lookahead=True (the exit signal must come one step "
                                         "early)")
        if cfg is None:
            return
        if self.lookahead is not None and pol.criterion in ("lookahead_gate", "preloop") and \
                self.lookahead != (pol.criterion == "lookahead_gate"):
            raise ParamError("lookahead", f"lookahead={self.lookahead} contradicts the {pol.criterion} criterion "
                                          "(the lookahead head always decides one step ahead; the preloop gate "
                                          "decides before the loop)")
        if self.max_model_len is not None and self.max_model_len > cfg.max_position:
            raise ParamError("max_model_len", f"max_model_len {self.max_model_len} exceeds the checkpoint's context "
                                              f"of {cfg.max_position} tokens")
        if self.cuda_graphs and torch.device(device).type != "cuda":
            raise ParamError("cuda_graphs", f"cuda_graphs=True needs a CUDA device, not {device}")
        if self.speculative_tokens:
            if not full and pol.criterion in OUTPUT_CRITERIA:
                raise ParamError("speculative_tokens", f"speculative_tokens is not exact with the {pol.criterion} "
                                                       "criterion: its per-step score runs the coda, which reads "
                                                       "earlier positions' final coda K/V that a depth-major "
                                                       "verification has not computed yet")
            if draft >= cfg.r_max:
                raise ParamError("draft_depth", f"draft_depth {draft} must be below the model's r_max {cfg.r_max} "
                                                "(a draft at full depth is the verifier itself)")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_kwargs(cls, kw: dict) -> EngineConfig:
        """A config from keyword arguments; an unknown name is a ParamError naming it."""
        unknown = sorted(set(kw) - set(cls.field_names()))
        if "max_prefill_tokens" in unknown:  # (its name until it was seen to count decode items too)
            raise ParamError("max_prefill_tokens", "max_prefill_tokens is now max_num_batched_tokens (vLLM's name: "
                                                   "the budget counts a launch's decode items too)")
        if unknown:
            raise ParamError(unknown[0], f"unknown engine setting {unknown[0]!r}; known: {', '.join(cls.field_names())}")
        return cls(**kw)

    def resolve(self, cfg: LoopConfig, device: torch.device | str = "cpu") -> EngineConfig:
        """Fill every setting left at None from the checkpoint, the device, then the engine's
        defaults: the one place each is decided. Only the pool-dependent settings (kv_cache_tokens,
        max_model_len, swap_space) are left for `memory.size_pool`, which measures the device."""
        on_cuda = torch.device(device).type == "cuda"
        layout = self.kv_layout or cfg.kv_layout or DEFAULT_LAYOUT
        depth_exact = layout_class(layout).depth_slots_exact
        lookahead = self.lookahead if self.lookahead is not None else bool(cfg.exit_lookahead)
        # the exit policy's defaults are filled here once (criterion, threshold, r_min); the engine's
        # ExitPolicy is then built from these fields (exit_policy)
        pol = ExitPolicy.from_config(cfg, criterion=self.exit_criterion, threshold=self.exit_threshold,
                                     r_min=self.r_min, lookahead=lookahead)
        full = self.full_depth or self.policy == "cb" or layout_class(layout).disables_exits
        draft = self.draft_depth or max(1, min(pol.r_min, cfg.r_max - 1))
        self.refuse(cfg, device, pol, full, draft)
        no_pool = self.kv_cache_tokens is None and self.kv_cache_bytes is None
        return dataclasses.replace(
            self, kv_layout=layout, draft_depth=draft, exit_criterion=pol.criterion, exit_threshold=pol.threshold, r_min=pol.r_min,
            lookahead=pol.lookahead, full_depth=full,
            max_model_len=self.max_model_len or cfg.max_position,
            chunked_prefill=_default(self.chunked_prefill, depth_exact and self.prefill == "mixed"),
            enable_prefix_caching=_default(self.enable_prefix_caching, depth_exact and self.prefill == "mixed"),
            cuda_graphs=_default(self.cuda_graphs, on_cuda),
            attention_backend=self.attention_backend or ("paged" if on_cuda else "sdpa"),
            **self.overlap(on_cuda, pol.lookahead),
            kv_cache_memory=self.kv_cache_memory or (CPU_KV_MEMORY if no_pool and not on_cuda else None))

    def overlap(self, on_cuda: bool, lookahead: bool) -> dict[str, bool]:
        """`pipeline` and `async_scheduling` where left None: on for CUDA, the lookahead pipeline with
        lookahead, on-device token re-entry without speculation (resolve; the simulator asks as a
        CUDA engine would, infer/sim/simulate.py)."""
        return {"pipeline": _default(self.pipeline, on_cuda and lookahead),
                "async_scheduling": _default(self.async_scheduling, on_cuda and not self.speculative_tokens)}

    def exit_policy(self, cfg: LoopConfig) -> ExitPolicy:
        """The engine-wide exit policy of a resolved config (built from its fields, no defaults)."""
        if self.full_depth:  # explicit: never a threshold value (Ouro's bf16 gate can saturate to 1.0)
            return ExitPolicy("none", None, cfg.r_max, cfg.r_max)
        return ExitPolicy(self.exit_criterion, self.exit_threshold, self.r_min, cfg.r_max, bool(self.lookahead))

    def max_launch_tokens(self) -> int:
        """The most tokens one launch of a resolved config can carry: what the CUDA memory budget
        (memory.cuda_budget) must measure. `max_num_batched_tokens` is the per-launch budget (prompt
        tokens + decode items under mixed prefill, prompt tokens of a prefill launch under
        separate), and admission keeps to it, with one exception each (chunks.py, scheduler.py):
        a prompt that does not fit is admitted alone rather than never, whole where prompts are
        not chunked (at most max_model_len - 1 tokens, beside the decode items under mixed
        prefill) and as one block's chunk where they are."""
        budget, decode = self.max_num_batched_tokens, self.max_batch_size if self.prefill == "mixed" else 0
        alone = self.block_size if self.chunked_prefill else self.max_model_len - 1
        return max(budget, decode + alone)

    def describe(self) -> dict:
        """The settings as a JSON-able dict (the server's /v1/models, bench JSON)."""
        return dataclasses.asdict(self)


def _default(value: bool | None, default: bool) -> bool:
    return default if value is None else value


def check_chunking(kv_layout: str | None, chunked_prefill: bool | None, prefill: str) -> None:
    if chunked_prefill and kv_layout is not None and not layout_class(kv_layout).depth_slots_exact:
        raise ParamError("chunked_prefill", f"chunked_prefill=True is not exact with kv_layout={kv_layout!r}: an "
                                            "earlier chunk's positions would be read at their final depth instead "
                                            "of the current loop step (in the depth slot that loop steps share); "
                                            "this layout keeps prompts whole")
    if chunked_prefill and prefill != "mixed":
        raise ParamError("chunked_prefill", "chunked_prefill needs prefill='mixed' (separate prefill runs whole "
                                            "prompts)")


def check_prefix_caching(kv_layout: str | None, enable: bool | None, prefill: str) -> None:
    if enable and kv_layout is not None and not layout_class(kv_layout).depth_slots_exact:
        raise ParamError("enable_prefix_caching", f"enable_prefix_caching=True is not exact with kv_layout="
                                                  f"{kv_layout!r}: in the depth slot that loop steps share, its cached "
                                                  "blocks hold each position's final loop step, while a fresh prefill "
                                                  "of the suffix reads the prefix there at the current step")
    if enable and prefill != "mixed":
        raise ParamError("enable_prefix_caching", "enable_prefix_caching needs prefill='mixed' (the separate prefill "
                                                  "stage runs whole prompts from position 0)")


def check_speculation(kv_layout: str | None, k: int, draft_depth: int | None) -> None:
    if not isinstance(k, int) or k < 0 or k == 1:
        raise ParamError("speculative_tokens", f"speculative_tokens must be 0 (off) or an integer >= 2 (positions "
                                               f"verified per window), got {k!r}")
    if draft_depth is not None and (not isinstance(draft_depth, int) or draft_depth < 1):
        raise ParamError("draft_depth", f"draft_depth must be an integer >= 1, got {draft_depth!r}")
    if k and kv_layout is not None and not layout_class(kv_layout).depth_slots_exact:
        raise ParamError("speculative_tokens", f"speculative_tokens is not exact with kv_layout={kv_layout!r}: a "
                                               "decoding token reads earlier positions at their final loop step in "
                                               "the depth slot that loop steps share, a depth-major verification "
                                               "at the current one")


def _kv_layout_arg(name: str) -> str:
    """argparse type of --kv-layout: a name layout_class accepts (first_then_shared:S has no fixed
    list of choices)."""
    try:
        layout_class(name)
    except ParamError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


_CHOICES = {"policy": POLICIES, "prefill": PREFILL_MODES, "exit_criterion": CRITERIA,
            "scheduling_policy": SCHEDULING_POLICIES, "attention_backend": ATTENTION_BACKENDS}
_TYPES = {"str": str, "int": int, "float": float}
def coda_batch_arg(v: str) -> int | str:
    """argparse type of --min-coda-batch: an integer, or auto."""
    if v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer >= 1 or auto, not {v!r}") from None


_FIELD_TYPES = {"kv_layout": _kv_layout_arg, "min_coda_batch": coda_batch_arg}  # validating types in place of choices
_METAVARS = {"kv_layout": "{" + ",".join(n.replace("[:S]", ",first_then_shared:S") for n in LAYOUT_NAMES) + "}"}


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("trace",)) -> None:
    """Add one `--flag` per EngineConfig field (type, choices and help from the field) to a CLI;
    unset flags stay None so that `engine_config_from_args` leaves them to EngineConfig."""
    g = parser.add_argument_group("engine (EngineConfig; unset: the checkpoint's value, else the default shown)")
    for f in fields(EngineConfig):
        if f.name in skip:
            continue
        flag, kind = "--" + f.name.replace("_", "-"), f.type.split(" | ")[0]
        shown = f" (default: {f.default})" if f.default is not None else ""
        if kind == "bool":
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f.metadata["help"] + shown)
        else:
            g.add_argument(flag, type=_FIELD_TYPES.get(f.name, _TYPES[kind]), default=None,
                           choices=_CHOICES.get(f.name), metavar=_METAVARS.get(f.name),
                           help=f.metadata["help"] + shown)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    """The EngineConfig fields that parsed `add_engine_args` flags set (unset flags are left out, so
    EngineConfig and the checkpoint decide them)."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if getattr(args, f.name, None) is not None}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**engine_kwargs_from_args(args))
