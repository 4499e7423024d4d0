"""Checkpoint IO: HF-format folders (config.json + safetensors [+ tokenizer]), sharded or not.

`load_pretrained` reads the real Ouro and Huginn folders unchanged (and ours, which use the same
formats). Every expected tensor must be present with the right shape; errors name the key.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import LoopConfig, replace
from .huginn import HuginnLM
from .model import LoopedLM
from .ouro import OuroLM

GATES_FILE = "exit_gates.safetensors"  # heads distilled by train/distill_gate.py, beside the model's own tensors
DISTILLED_PREFIXES = ("lookahead_exit_gate.", "preloop_exit_gate.")
IGNORED_KEYS = ("freqs_cis",)  # Huginn's persistent RoPE buffer: we compute RoPE on the fly
# a RoPE buffer some checkpoints store per layer (Nanbeige's Hub copy patched for MPS); also recomputed
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; supported: {sorted(DTYPES)}")
    return DTYPES[dtype]


def build_model(cfg: LoopConfig) -> LoopedLM:
    return (OuroLM if cfg.arch == "ouro" else HuginnLM)(cfg)


def resolve_path(path_or_hub_id: str | os.PathLike) -> Path:
    p = Path(path_or_hub_id)
    if p.is_dir():
        return p
    s = str(path_or_hub_id)
    if p.exists() or s.startswith((".", "/")) or s.count("/") != 1:
        raise FileNotFoundError(f"checkpoint folder not found: {s}")
    from huggingface_hub import snapshot_download  # only for hub ids; honours HF_HUB_OFFLINE
    return Path(snapshot_download(s, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))


def _tensor_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    files = [single] if single.exists() else sorted(folder.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model*.safetensors in {folder}")
    return files


def tensor_names(folder: Path) -> set[str]:
    """The tensor names a folder holds, read from the index or the files' headers (no tensor is
    loaded); empty for a folder without weights (a dummy load's config-only folder)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    try:
        files = _tensor_files(folder)
    except FileNotFoundError:
        return set()
    names: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                names.update(fh.keys())
        except Exception:  # noqa: BLE001 - load_state names an unreadable file when it loads it
            pass
    return names


def read_config(folder: Path) -> LoopConfig:
    """A folder's config.json as a LoopConfig, the file named in any error. The retrofitted OLMo-2
    checkpoints share the Llama retrofits' config keys; their q/k-norm tensors tell them apart."""
    try:
        cfg = LoopConfig.from_json(folder / "config.json")
    except ValueError as e:  # name the file unless the message already does
        raise ValueError(str(e) if str(folder) in str(e) else f"{folder / 'config.json'}: {e}") from None
    if cfg.family == "raven_llama" and any(".attn.q_norm." in k for k in tensor_names(folder)):
        cfg = replace(cfg, family="raven_olmo")
    return cfg


def load_state(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in _tensor_files(folder):
        if not f.exists():
            raise FileNotFoundError(f"{f}: listed in model.safetensors.index.json but missing")
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    state[k] = fh.get_tensor(k)
        except Exception as e:  # noqa: BLE001 - safetensors' own errors do not name the file
            raise ValueError(f"{f}: not a readable safetensors file (truncated or corrupt?): "
                             f"{type(e).__name__}: {e}") from e
    return state


def load_pretrained(path_or_hub_id: str | os.PathLike, dtype: str | torch.dtype = "float32",
                    device: str | torch.device = "cpu", layer_split: str | None = None, **overrides) -> LoopedLM:
    """Load a looped LM from an HF-format folder (or a hub id when online).
    `overrides` replace config fields (e.g. r_max=16 for Huginn). `layer_split` "P-C-Q" (Huginn
    only) keeps the first P prelude, C core and Q coda layers and drops the rest
    (looplm/layer_split.py)."""
    folder = resolve_path(path_or_hub_id)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder}: no config.json (not a checkpoint folder)")
    cfg = read_config(folder)
    if overrides:
        cfg = replace(cfg, **overrides)
    state = load_state(folder)
    if layer_split is not None:
        from .layer_split import apply_layer_split
        cfg, state = apply_layer_split(cfg, state, layer_split)
    if cfg.lookahead_gate or cfg.preloop_gate:
        state.update(load_gates(folder))
    return model_from_state(cfg, state, dtype, device)


def load_gates(folder: Path) -> dict[str, torch.Tensor]:
    """The distilled heads of a checkpoint whose config.json names them (lookahead_gate / preloop_gate)."""
    f = folder / GATES_FILE
    if not f.exists():
        raise FileNotFoundError(f"{folder}: config.json names distilled exit gates but {GATES_FILE} is missing "
                                f"(train/distill_gate.py writes it)")
    with safe_open(str(f), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


def save_gates(model: LoopedLM, folder: str | os.PathLike) -> Path:
    """Write the model's distilled heads to GATES_FILE and their keys into config.json, leaving the
    model's own tensors untouched (a real checkpoint's shards are not rewritten)."""
    out = Path(folder)
    state = {k: v.detach().float().cpu().contiguous().clone() for k, v in model.state_dict().items()
             if k.startswith(DISTILLED_PREFIXES)}
    save_file(state, str(out / GATES_FILE), metadata={"format": "pt"})
    model.cfg.save(out / "config.json")
    return out / GATES_FILE


def model_from_state(cfg: LoopConfig, state: dict[str, torch.Tensor], dtype: str | torch.dtype = "float32",
                     device: str | torch.device = "cpu") -> LoopedLM:
    dtype = resolve_dtype(dtype)
    with torch.device("meta"):
        model = build_model(cfg)
    expected = model.state_dict()
    tied = cfg.tie_embeddings
    head_key = "lm_head.weight"
    for k in [k for k in state if k in IGNORED_KEYS or k.endswith(IGNORED_SUFFIXES)]:
        state.pop(k)
    if tied:
        state.pop(head_key, None)  # a tied copy (Huginn stores one) is the embedding again
        expected = {k: v for k, v in expected.items() if k != head_key}
    missing = [k for k in expected if k not in state]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) for {cfg.name}: {missing[:8]}")
    unexpected = [k for k in state if k not in expected]
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensor(s) for {cfg.name}: {unexpected[:8]}")
    for k, t in expected.items():
        if tuple(state[k].shape) != tuple(t.shape):
            raise ValueError(f"tensor {k!r} has shape {tuple(state[k].shape)}, expected {tuple(t.shape)}")
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.input_embedding().weight
    return model.eval()


def save_pretrained(model: LoopedLM, out_dir: str | os.PathLike, dtype: str | torch.dtype | None = None,
                    max_shard_bytes: int | None = None, tokenizer=None) -> Path:
    """Write config.json + model.safetensors (or shards with an index) [+ tokenizer files]."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    dt = resolve_dtype(dtype) if dtype is not None else None
    state = {k: (v.to(dt) if dt is not None else v).detach().cpu().contiguous().clone()
             for k, v in model.state_dict().items() if not k.startswith(DISTILLED_PREFIXES)}
    if cfg.family == "huginn":
        # Huginn-0125's reference registers RoPE as a persistent buffer; keep it so the folder loads there
        # too (the retrofits' reference computes RoPE on the fly and stores none)
        half = cfg.head_dim // 2
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        ang = torch.outer(torch.arange(cfg.max_position, dtype=torch.float32), inv)
        state["freqs_cis"] = torch.stack([ang.cos(), ang.sin()], -1).view(1, cfg.max_position, 1, half, 2)
    cfg.save(out / "config.json")
    for old in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        old.unlink()
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(state, str(out / "model.safetensors"), metadata=meta)
    else:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for k, v in state.items():
            nb = v.numel() * v.element_size()
            if shards[-1] and size + nb > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][k] = v
            size += nb
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata=meta)
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in state.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
        portable_tokenizer_config(out)
    if cfg.lookahead_gate or cfg.preloop_gate:
        save_gates(model, out)
    return out


def portable_tokenizer_config(folder: str | os.PathLike) -> bool:
    """Rewrite `folder`'s tokenizer_config.json in the spelling transformers 4.4x-4.5x and 5.x both
    load; True if it changed. transformers 5 writes its own class name ("TokenizersBackend") and a
    list under "extra_special_tokens"; 4.x (4.51 is what vLLM 0.8.5 pins) fails on the first ("does
    not exist") and then on the second ('list' object has no attribute 'keys'). The same tokenizer
    named PreTrainedTokenizerFast, with the list as additional_special_tokens and the chat template
    inline, loads in both and gives identical ids (docs/results/serving.md, tests/test_tokenizer_compat.py)."""
    path = Path(folder) / "tokenizer_config.json"
    if not path.exists():
        return False
    cfg = json.loads(path.read_text())
    new = dict(cfg)
    extra = new.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        new["additional_special_tokens"] = list(dict.fromkeys([*(new.get("additional_special_tokens") or []), *extra]))
    elif extra:  # a {name: token} map: both versions read it
        new["extra_special_tokens"] = extra
    if new.get("tokenizer_class") == "TokenizersBackend":
        new["tokenizer_class"] = "PreTrainedTokenizerFast"
    template = Path(folder) / "chat_template.jinja"
    if "chat_template" not in new and template.exists():
        new["chat_template"] = template.read_text()
    if new == cfg:
        return False
    path.write_text(json.dumps(new, indent=2, ensure_ascii=False) + "\n")
    return True


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer stored in a checkpoint folder (transformers AutoTokenizer), or None."""
    folder = Path(path)
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        logging.getLogger("looplm").warning(
            "%s has no tokenizer (tokenizer.json / tokenizer_config.json): text prompts, stop strings "
            "and chat are unavailable; send token ids", folder)
        return None
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    # AutoTokenizer reads config.json to find the tokenizer class; transformers knows neither "ouro" nor
    # "huginn_raven" and warns that the (absent) model class may not fit, which is noise here
    log = hf_logging.get_logger("transformers.configuration_utils")
    level = log.level
    log.setLevel(hf_logging.ERROR)
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    finally:
        log.setLevel(level)
