"""One config dataclass for any P-C-Q looped LM, read from the real config.json of each family.

Two loop mechanics (`arch`): "ouro" (0-L-0, the normed output of a step is the next step's input)
and "huginn" (prelude, then the prelude output injected through an adapter at every step, coda).
Five families (`family`) fill them with their own layers and tensor names:
- ouro: Ouro-1.4B/2.6B(-Thinking), sandwich-norm layers, a stock exit gate;
- nanbeige: Nanbeige4.2 (`model_type` "nanbeige", `num_loops` passes), pre-norm Llama layers, no gate;
- huginn: Huginn-0125 (`model_type` "huginn_raven"), sandwich blocks, interleaved RoPE, ln_f twice;
- raven_llama / raven_olmo: the retrofitted-recurrence Llama / TinyLlama / OLMo-2 checkpoints, also
  "huginn_raven" but with Llama RoPE (`rope_theta`, `rope_scaling`), GQA, pre-norm (Llama) or
  post-norm with q/k norms (OLMo-2) blocks and ln_f once. A `rope_theta` key marks them (Huginn-0125's
  config has only `rope_base`); the OLMo-2 blocks are told apart by their q/k-norm tensors (io.py).
Our own checkpoints are written in the real formats plus a few extra keys (`exit_criterion`,
`exit_threshold`, `exit_gate`, `r_min`, ...), so a real folder and ours go through the same reader.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ParamError

ARCHS = ("ouro", "huginn")
FAMILIES = {"ouro": "ouro", "nanbeige": "ouro", "huginn": "huginn", "raven_llama": "huginn", "raven_olmo": "huginn"}
MODEL_TYPES = {"ouro": "ouro", "nanbeige": "ouro", "huginn_raven": "huginn"}
CRITERIA = ("ouro_gate", "learned", "lookahead_gate", "preloop", "kl", "latent_diff", "entropy_diff", "none")
GATE_CRITERIA = ("ouro_gate", "learned")  # read the stock gate head: what train/distill_gate.py distils from


@dataclass
class LoopConfig:
    arch: str  # "ouro" (sandwich-norm layers, no injection) | "huginn" (post-norm blocks, adapter injection)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    n_prelude: int  # transformer layers before the loop (Ouro: 0, the embedding only)
    n_core: int  # layers of the shared block, applied r times per token
    n_coda: int  # layers after the loop (Ouro: 0, lm_head only)
    r_max: int  # loop steps at full depth
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position: int = 2048  # context limit (Ouro max_position_embeddings, Huginn block_size)
    qk_bias: bool = False  # Huginn: learned bias added to q and k before RoPE
    tie_embeddings: bool = False
    embed_scale: float = 1.0  # Huginn multiplies the token embedding by this
    init_std: float = 0.02  # Huginn: std of the random initial state (times embed_scale)
    exit_gate: bool = False  # a linear gate head on the loop state (Ouro always has one)
    exit_criterion: str = "none"
    exit_threshold: float | None = None
    r_min: int = 1
    kv_layout: str | None = None  # the KV layout the checkpoint was adapted to (train/shared_kv.py)
    exit_lookahead: bool | None = None  # its exit gate was trained for lookahead
    # heads distilled from the stock gate (train/distill_gate.py; weights in exit_gates.safetensors):
    # a lookahead head (Linear(d -> 1) on the gate's input, its score after step s decides "exit after
    # s+1") and a preloop gate (Linear(d -> r_max) on the prelude output: an exit-depth distribution
    # known before the loop). `gate_teacher` is the stock criterion they were distilled from: the
    # lookahead head's score follows its rule (ouro_gate: the exit CDF of its hazards; learned: the
    # per-step probability)
    lookahead_gate: bool = False
    preloop_gate: bool = False
    # the depths 1..preloop_depths the preloop gate's distribution covers (its rows): the r_max it was
    # distilled at, kept when r_max is overridden (a sweep to a lower r_max reads the same head and
    # clamps its depth there, as a request's lower r_max does); None without a preloop gate
    preloop_depths: int | None = None
    gate_teacher: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    family: str | None = None  # FAMILIES (module docstring); None: the arch's original family
    rope_scaling: dict[str, Any] | None = None  # Llama-3 RoPE scaling (the retrofitted Llama-3.2 models)
    extra: dict[str, Any] = field(default_factory=dict)  # unread keys, written back unchanged

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; supported: {ARCHS}")
        if self.family is None:
            self.family = self.arch
        if FAMILIES.get(self.family) != self.arch:
            raise ValueError(f"family {self.family!r} is not of arch {self.arch!r}; families: {FAMILIES}")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                     "head_dim", "n_core", "r_max", "max_position"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"config field {name} must be > 0, got {getattr(self, name)!r}")
        if self.n_prelude < 0 or self.n_coda < 0:
            raise ValueError("n_prelude and n_coda must be >= 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.qk_bias and self.num_kv_heads != self.num_heads:
            # the reference adds a [heads, head_dim] bias to k, which is undefined for GQA
            raise ValueError("qk_bias needs num_kv_heads == num_heads (the Huginn reference defines no GQA bias)")
        if self.family == "ouro":
            self.exit_gate = True  # Ouro's early_exit_gate is part of the architecture
        if self.arch == "ouro" and (self.n_prelude or self.n_coda):
            raise ValueError(f"the {self.family} architecture is 0-L-0 (n_prelude = n_coda = 0)")
        if self.exit_criterion not in CRITERIA:
            raise ValueError(f"unknown exit_criterion {self.exit_criterion!r}; supported: {CRITERIA}")
        if self.exit_criterion in GATE_CRITERIA and not self.exit_gate:
            raise ValueError(f"exit_criterion {self.exit_criterion!r} needs a gate head (exit_gate=true)")
        if self.gate_teacher is not None and self.gate_teacher not in GATE_CRITERIA:
            raise ValueError(f"gate_teacher must be one of {GATE_CRITERIA}, got {self.gate_teacher!r}")
        if self.lookahead_gate and self.gate_teacher is None:
            raise ValueError("lookahead_gate=true needs gate_teacher (the stock criterion it was distilled from)")
        for crit, key in (("lookahead_gate", "lookahead_gate"), ("preloop", "preloop_gate")):
            if self.exit_criterion == crit and not getattr(self, key):
                raise ValueError(f"exit_criterion {crit!r} needs a distilled {key} head ({key}=true; "
                                 f"train/distill_gate.py writes one)")
        check_depths(self.r_min, self.r_max)
        if not self.preloop_gate:
            self.preloop_depths = None
        elif self.preloop_depths is None:
            self.preloop_depths = self.r_max  # a head made for this config (train/distill_gate.py)
        elif not isinstance(self.preloop_depths, int) or self.preloop_depths < 1:
            raise ValueError(f"preloop_depths must be an integer >= 1, got {self.preloop_depths!r}")

    @property
    def num_loop_layers(self) -> int:
        return self.n_prelude + self.n_core + self.n_coda

    @property
    def name(self) -> str:
        return f"{self.family} {self.n_prelude}-{self.n_core}-{self.n_coda} r_max={self.r_max}"

    # ---------------------------------------------------------------- reading
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoopConfig:
        mt = d.get("model_type")
        if mt not in MODEL_TYPES:
            raise ValueError(f"unsupported model_type {mt!r}; supported model types: {sorted(MODEL_TYPES)}")
        reader = {"ouro": _from_ouro, "nanbeige": _from_nanbeige, "huginn_raven": _from_huginn}[mt]
        try:
            return reader(d)
        except KeyError as e:
            raise ValueError(f"config.json ({mt}) is missing required key {e.args[0]!r}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> LoopConfig:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: malformed JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path}: expected a JSON object")
        return cls.from_dict(d)

    # ---------------------------------------------------------------- writing
    def to_dict(self) -> dict[str, Any]:
        ours = {"exit_criterion": self.exit_criterion, "exit_threshold": self.exit_threshold,
                "r_min": self.r_min, "exit_gate": self.exit_gate}
        ours.update({k: getattr(self, k) for k in ("kv_layout", "exit_lookahead", "gate_teacher")
                     if getattr(self, k) is not None})
        ours.update({k: True for k in ("lookahead_gate", "preloop_gate") if getattr(self, k)})
        if self.preloop_depths not in (None, self.r_max):  # written only where it differs (r_max overridden)
            ours["preloop_depths"] = self.preloop_depths
        if self.family == "raven_olmo":  # the only family its config.json cannot name (io.py reads the tensors)
            ours["loop_family"] = self.family
        if self.family == "nanbeige" or self.arch == "ouro":  # Llama-style keys, then each one's loop count
            nanbeige = self.family == "nanbeige"
            d = {
                "model_type": "nanbeige" if nanbeige else "ouro",
                "architectures": ["NanbeigeForCausalLM" if nanbeige else "OuroForCausalLM"],
                "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": self.n_core,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.norm_eps,
                "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position,
                "tie_word_embeddings": self.tie_embeddings,
            }
            d.update({"num_loops": self.r_max} if nanbeige else {
                "total_ut_steps": self.r_max,
                "early_exit_threshold": 1.0 if self.exit_threshold is None else self.exit_threshold})
        else:
            d = {
                "model_type": "huginn_raven", "architectures": ["RavenForCausalLM"],
                "vocab_size": self.vocab_size, "padded_vocab_size": self.vocab_size,
                "n_embd": self.hidden_size, "n_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size, "n_layers_in_prelude": self.n_prelude,
                "n_layers_in_recurrent_block": self.n_core, "n_layers_in_coda": self.n_coda,
                "n_layers": self.num_loop_layers, "mean_recurrence": self.r_max, "norm_eps": self.norm_eps,
                "rope_base": self.rope_theta, "block_size": self.max_position, "qk_bias": self.qk_bias,
                "bias": False, "tie_embeddings": self.tie_embeddings, "injection_type": "linear",
                "state_init": "like-init",
                "init_values": {"embed_scale": self.embed_scale, "std": self.init_std},
            }
            if self.family != "huginn":  # the retrofitted models' Llama RoPE (rope_base is not read)
                d.update(rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                         max_position_embeddings=self.max_position)
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        return {**self.extra, **d, **ours}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _ours(d: dict[str, Any]) -> dict[str, Any]:
    out = {k: d[k] for k in ("exit_criterion", "exit_threshold", "r_min", "exit_gate", "kv_layout", "exit_lookahead",
                             "lookahead_gate", "preloop_gate", "preloop_depths", "gate_teacher", "loop_family") if k in d}
    if "loop_family" in out:
        out["family"] = out.pop("loop_family")
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = d.get(k)
        if isinstance(v, list):  # HF allows a list of eos ids; the first is the canonical one
            out.setdefault("stop_token_ids", list(v))
            v = v[0] if v else None
        if v is not None:
            out[k] = int(v)
    if "stop_token_ids" in d:
        out["stop_token_ids"] = [int(t) for t in d["stop_token_ids"]]
    return out


_OURO_KEYS = {"model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "hidden_act", "rms_norm_eps", "rope_theta", "max_position_embeddings",
              "tie_word_embeddings", "total_ut_steps", "early_exit_threshold"}
_HUGINN_KEYS = {"model_type", "architectures", "vocab_size", "padded_vocab_size", "n_embd", "n_heads",
                "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda", "n_layers",
                "mean_recurrence", "norm_eps", "rope_base", "block_size", "qk_bias", "bias",
                "tie_embeddings", "injection_type", "state_init", "init_values"}
_NANBEIGE_KEYS = {"model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                  "rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings", "num_loops",
                  "loop_loss_weights"}
_RAVEN_LLAMA_KEYS = {"rope_theta", "rope_scaling", "max_position_embeddings"}
_OUR_KEYS = {"exit_criterion", "exit_threshold", "r_min", "exit_gate", "kv_layout", "exit_lookahead",
             "lookahead_gate", "preloop_gate", "preloop_depths", "gate_teacher", "loop_family",
             "bos_token_id", "eos_token_id", "pad_token_id", "stop_token_ids"}


# Settings of the real configs that we do not implement: (key, the value we support). A key that is
# absent or holds a false-y value for "off" features is fine.
_SUPPORTED_ONLY = {"ouro": (("hidden_act", "silu"), ("rope_scaling", None)),
                   "huginn": (("injection_type", "linear"), ("bias", False)),
                   # Nanbeige4.2's code has features its release leaves off; a checkpoint that turns one on
                   # computes something else, so it is refused by name
                   "nanbeige": (("hidden_act", "silu"), ("rope_scaling", None), ("attention_bias", False),
                                ("mlp_bias", False), ("qk_layernorm", False), ("emb_neighbor_num", None),
                                ("insert_ngram_layer_idx", None), ("ngram_insert_all_layers", False),
                                ("skip_loop_final_norm", False), ("enable_double_loop_split", False),
                                ("loop_share_kv", False), ("mhc_diff_for_loop", False),
                                ("mhc_double_stream_position_for_loop", None), ("enable_hyper_connection", False),
                                ("enable_mhc", False), ("enable_depth_attention", False))}


def _check_supported(arch: str, d: dict[str, Any]) -> None:
    for key, ok in _SUPPORTED_ONLY[arch]:
        v = d.get(key, ok)
        if v != ok and (ok not in (None, False) or v):
            raise ValueError(f"{arch}: only {key}={ok!r} is supported (the released model's), got {v!r}")


def _from_ouro(d: dict[str, Any]) -> LoopConfig:
    _check_supported("ouro", d)
    heads = int(d["num_attention_heads"])
    ours = _ours(d)
    thr = ours.pop("exit_threshold", d.get("early_exit_threshold"))
    return LoopConfig(
        arch="ouro", vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]), num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
        n_prelude=0, n_core=int(d["num_hidden_layers"]), n_coda=0,
        r_max=int(d.get("total_ut_steps", 4)), norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(d.get("rope_theta", 10000.0)),
        max_position=int(d.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        exit_criterion=ours.pop("exit_criterion", "ouro_gate"),
        exit_threshold=None if thr is None else float(thr),
        extra={k: v for k, v in d.items() if k not in _OURO_KEYS | _OUR_KEYS},
        **ours,
    )


def _from_nanbeige(d: dict[str, Any]) -> LoopConfig:
    _check_supported("nanbeige", d)
    heads = int(d["num_attention_heads"])
    ours = _ours(d)
    # the reference runs len(loop_loss_weights) + 1 loops when that list is set, else num_loops
    weights = d.get("loop_loss_weights") or []
    loops = len(weights) + 1 if weights else int(d.get("num_loops", 1))
    return LoopConfig(
        arch="ouro", family="nanbeige", vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]), num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
        n_prelude=0, n_core=int(d["num_hidden_layers"]), n_coda=0, r_max=loops,
        norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(d.get("rope_theta", 10000.0)),
        max_position=int(d.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        exit_criterion=ours.pop("exit_criterion", "none"),
        extra={k: v for k, v in d.items() if k not in _NANBEIGE_KEYS | _OUR_KEYS},
        **ours,
    )


def check_rope_scaling(rs: Any) -> None:
    """Only Llama 3's scaling (the retrofitted Llama-3.2 checkpoints) is implemented."""
    if not isinstance(rs, dict) or rs.get("rope_type", rs.get("type")) != "llama3":
        raise ValueError(f"only rope_scaling with rope_type 'llama3' is supported, got {rs!r}")
    for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if not isinstance(rs.get(k), (int, float)) or isinstance(rs.get(k), bool):
            raise ValueError(f"rope_scaling (llama3) needs a number {k!r}, got {rs.get(k)!r}")
    if rs["high_freq_factor"] == rs["low_freq_factor"]:
        raise ValueError("rope_scaling (llama3): high_freq_factor must differ from low_freq_factor")


def _from_huginn(d: dict[str, Any]) -> LoopConfig:
    _check_supported("huginn", d)
    if "rope_theta" in d or "rope_scaling" in d:
        return _from_raven(d)
    hidden = int(d["n_embd"])
    heads = int(d.get("num_attention_heads") or d["n_heads"])
    init = d.get("init_values") or {}
    ours = _ours(d)
    # Huginn stores the vocabulary padded; the weights are sized by padded_vocab_size.
    return LoopConfig(
        arch="huginn", vocab_size=int(d.get("padded_vocab_size") or d["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]), num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=hidden // heads,  # the reference derives it; a stored head_dim is informational
        n_prelude=int(d["n_layers_in_prelude"]), n_core=int(d["n_layers_in_recurrent_block"]),
        n_coda=int(d["n_layers_in_coda"]), r_max=int(d.get("mean_recurrence", 32)),
        norm_eps=float(d.get("norm_eps", 1e-6)), rope_theta=float(d.get("rope_base", 50000.0)),
        max_position=int(d.get("block_size", 4096)), qk_bias=bool(d.get("qk_bias", False)),
        tie_embeddings=bool(d.get("tie_embeddings", True)),
        embed_scale=float(init.get("embed_scale", math.sqrt(hidden))),
        init_std=float(init.get("std", 0.02)),
        exit_criterion=ours.pop("exit_criterion", "none"),
        extra={k: v for k, v in d.items() if k not in _HUGINN_KEYS | _OUR_KEYS},
        **ours,
    )


def _from_raven(d: dict[str, Any]) -> LoopConfig:
    """The retrofitted-recurrence checkpoints (McLeish et al. 2025): the huginn_raven format with Llama's
    RoPE and head layout. The reference reads `head_dim`, `num_key_value_heads`, `rope_theta`,
    `rope_scaling` and `init_values.embed_scale` (1.0) from the file; `rope_base` is not read."""
    hidden = int(d["n_embd"])
    heads = int(d.get("num_attention_heads") or d["n_heads"])
    init = d.get("init_values") or {}
    ours = _ours(d)
    family = ours.pop("family", "raven_llama")
    if d.get("qk_bias"):
        raise ValueError("huginn_raven with rope_theta (a retrofitted model): qk_bias is not supported "
                         "(its reference defines no GQA bias)")
    head_dim = int(d.get("head_dim") or hidden // heads)
    if family == "raven_llama" and head_dim * heads != hidden:
        # its attention reshapes the heads back to n_embd (raven_modeling_minimal_llama.py)
        raise ValueError(f"huginn_raven (Llama retrofit): head_dim * n_heads must equal n_embd, got "
                         f"{head_dim} * {heads} != {hidden}")
    return LoopConfig(
        arch="huginn", family=family,
        vocab_size=int(d.get("padded_vocab_size") or d["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]), num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads), head_dim=head_dim,
        n_prelude=int(d["n_layers_in_prelude"]), n_core=int(d["n_layers_in_recurrent_block"]),
        n_coda=int(d["n_layers_in_coda"]), r_max=int(d.get("mean_recurrence", 32)),
        norm_eps=float(d.get("norm_eps", 1e-6)), rope_theta=float(d["rope_theta"]),
        rope_scaling=d.get("rope_scaling"),
        max_position=int(d.get("max_position_embeddings") or d.get("block_size", 4096)),
        tie_embeddings=bool(d.get("tie_embeddings", False)),
        embed_scale=float(init.get("embed_scale", 1.0)),
        init_std=float(init.get("std", 0.02)),
        exit_criterion=ours.pop("exit_criterion", "none"),
        extra={k: v for k, v in d.items() if k not in _HUGINN_KEYS | _RAVEN_LLAMA_KEYS | _OUR_KEYS},
        **ours,
    )


def check_depths(r_min: int | None, r_max: int | None) -> None:
    """The one check of a loop-depth pair (config, exit policy, request): integers with
    1 <= r_min <= r_max; None leaves that side unchecked."""
    for name, v in (("r_max", r_max), ("r_min", r_min)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ParamError(name, f"{name} must be an integer >= 1, got {v!r}")
    if r_min is not None and r_max is not None and r_min > r_max:
        raise ParamError("r_min", f"r_min={r_min} must be in [1, r_max={r_max}]")


def replace(cfg: LoopConfig, **kw: Any) -> LoopConfig:
    d = asdict(cfg)
    d.update(kw)
    return LoopConfig(**d)
