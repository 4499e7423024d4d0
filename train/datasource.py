"""Training tokens from a `datasets` source, the built corpus, or .npy ids.

`--dataset SRC --text-column text`: SRC is a local .jsonl/.json/.parquet/.csv/.txt/.arrow file, a
folder of such files, a `save_to_disk` folder, or (online) a hub dataset name. Each document is
tokenised with the model's tokenizer and followed by EOS; the stream is packed into consecutive
windows of ctx+1 tokens (the last partial window is dropped). Held-out: the source's `validation`
/ `test` split when it has one, else the last `heldout_frac` of the packed windows (never trained
on). The packed arrays are cached under `.cache/datasets/<key>/`, key = sha256 of (source and, for
local files, their names/sizes/mtimes; column; tokenizer.json; ctx; heldout_frac); env
LOOPLM_DATASETS_CACHE moves that cache.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from looplm.cli import UserError
from train.common import CACHE, CORPUS, TOKENIZER, eval_windows, random_windows

DATASETS_CACHE = CACHE / "datasets"
BUILD_CORPUS = "python -m train.corpus"
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text",
             ".arrow": "arrow"}


@dataclass
class Tokens:
    """Training / held-out tokens: a stream (random windows) or packed windows (random rows)."""
    train: np.ndarray
    heldout: np.ndarray
    packed: bool = False
    meta: dict = field(default_factory=dict)
    # loss masks aligned with the token streams (1: the token is a target that counts), or None
    train_mask: np.ndarray | None = None
    heldout_mask: np.ndarray | None = None

    def batch(self, batch: int, ctx: int, seed: list[int]) -> torch.Tensor:
        if not self.packed:
            return random_windows(self.train, batch, ctx, seed)
        rows = np.random.default_rng(seed).integers(0, len(self.train), size=batch)
        return torch.from_numpy(self.train[rows]).long()

    def batch_mask(self, batch: int, ctx: int, seed: list[int]) -> torch.Tensor | None:
        """The loss mask of `batch(batch, ctx, seed)`'s windows (the same seed draws the same starts)."""
        return None if self.train_mask is None else random_windows(self.train_mask, batch, ctx, seed).bool()

    def eval(self, ctx: int, max_windows: int | None) -> torch.Tensor:
        if not self.packed:
            return eval_windows(self.heldout, ctx, max_windows)
        return torch.from_numpy(self.heldout[:max_windows]).long()

    def eval_mask(self, ctx: int, max_windows: int | None) -> torch.Tensor | None:
        return None if self.heldout_mask is None else eval_windows(self.heldout_mask, ctx, max_windows).bool()


def sha(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr.astype(np.int64)).tobytes()).hexdigest()


def _local_stamp(p: Path) -> list:
    files = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
    return [[str(f.relative_to(p) if p.is_dir() else f.name), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _load(source: str):
    import datasets
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    p = Path(source)
    try:
        if p.is_file():
            builder = _BUILDERS.get(p.suffix.lower())
            if builder is None:
                raise UserError(f"--dataset {source}: unknown file type {p.suffix!r}; use one of {sorted(_BUILDERS)}")
            return datasets.load_dataset(builder, data_files=str(p))
        if p.is_dir():
            if any((p / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
                return datasets.load_from_disk(str(p))
            return datasets.load_dataset(str(p))
        if source.startswith((".", "/", "~")) or p.suffix.lower() in _BUILDERS or source.count("/") > 1:
            raise UserError(f"--dataset {source}: no such file or folder")
        return datasets.load_dataset(source)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many types; the message is what matters
        hint = " (offline: HF_HUB_OFFLINE/HF_DATASETS_OFFLINE are set)" if os.environ.get("HF_DATASETS_OFFLINE") else ""
        raise UserError(f"--dataset {source}: cannot load it{hint}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")


def _split(ds):
    import datasets
    if isinstance(ds, datasets.Dataset):
        return ds, None
    names = list(ds.keys())
    train = ds["train"] if "train" in ds else ds[names[0]]
    held = next((ds[n] for n in ("validation", "valid", "test") if n in ds), None)
    return train, held


def _encode(ds, column: str, tokenizer, eos: int, source: str) -> tuple[np.ndarray, int]:
    if column not in ds.column_names:
        raise UserError(f"--dataset {source} has no column {column!r}; its columns: {ds.column_names} "
                        f"(pick one with --text-column)")
    ids: list[int] = []
    n = 0
    for i in range(0, len(ds), 1000):
        texts = [t for t in ds[i:i + 1000][column] if isinstance(t, str) and t]
        for seq in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            ids.extend(seq)
            ids.append(eos)
            n += 1
    return np.asarray(ids, dtype=np.int64), n


def _pack(stream: np.ndarray, ctx: int) -> np.ndarray:
    n = len(stream) // (ctx + 1)
    return stream[: n * (ctx + 1)].reshape(n, ctx + 1)


def from_dataset(source: str, column: str, tokenizer_dir: Path, ctx: int, heldout_frac: float = 0.1,
                 cache_root: Path | None = None, is_main: bool = True, wait=None) -> Tokens:
    """Tokenise + pack `source` (see the module docstring), cached. `wait()` (e.g.
    accelerator.wait_for_everyone) lets rank 0 build the cache while the others wait."""
    from looplm.io import load_tokenizer
    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    if tokenizer is None:
        raise UserError(f"--dataset needs a tokenizer: {tokenizer_dir} has no tokenizer.json (pass --tokenizer DIR)")
    tok_file = Path(tokenizer_dir) / "tokenizer.json"
    tok_key = hashlib.sha256(tok_file.read_bytes()).hexdigest() if tok_file.exists() else str(Path(tokenizer_dir).resolve())
    p = Path(source)
    src = {"source": str(p.resolve()) if p.exists() else source, "stamp": _local_stamp(p) if p.exists() else None}
    key_dict = {**src, "column": column, "tokenizer": tok_key, "ctx": ctx, "heldout_frac": heldout_frac}
    key = hashlib.sha256(json.dumps(key_dict, sort_keys=True).encode()).hexdigest()[:16]
    cache_root = Path(cache_root or os.environ.get("LOOPLM_DATASETS_CACHE") or DATASETS_CACHE)
    d = cache_root / key
    if is_main and not (d / "meta.json").exists():
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        train_ds, held_ds = _split(_load(source))
        stream, n_docs = _encode(train_ds, column, tokenizer, eos, source)
        train = _pack(stream, ctx)
        if held_ds is not None:
            held = _pack(_encode(held_ds, column, tokenizer, eos, source)[0], ctx)
        else:
            n_held = int(round(len(train) * heldout_frac)) if len(train) > 1 else 0
            n_held = max(1, n_held) if len(train) > 1 and heldout_frac > 0 else n_held
            train, held = train[: len(train) - n_held], train[len(train) - n_held:]
        if len(train) == 0:
            raise UserError(f"--dataset {source}: {len(stream)} tokens make no training window of --ctx {ctx} + 1")
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / "train.npy", train.astype(np.int32))
        np.save(d / "heldout.npy", held.astype(np.int32))
        meta = {"source": source, "text_column": column, "ctx": ctx, "documents": n_docs,
                "train_windows": int(len(train)), "heldout_windows": int(len(held)),
                "train_tokens": int(train.size), "train_sha256": sha(train), "heldout_sha256": sha(held),
                "tokenizer_sha256": tok_key, "cache": str(d), "key": key_dict}
        (d / "meta.tmp").write_text(json.dumps(meta, indent=2) + "\n")
        (d / "meta.tmp").replace(d / "meta.json")
    if wait is not None:
        wait()
    if not (d / "meta.json").exists():
        raise UserError(f"--dataset {source}: the cache {d} was not built (rank 0 failed?)")
    meta = json.loads((d / "meta.json").read_text())
    train = np.load(d / "train.npy").astype(np.int64)
    held = np.load(d / "heldout.npy").astype(np.int64)
    if len(held) == 0:
        held = train[-1:]
    return Tokens(train, held, packed=True, meta=meta)


def from_npy(tokens: Path, heldout: Path | None = None, mask: Path | None = None,
             heldout_mask: Path | None = None) -> Tokens:
    """Token ids from .npy files; `mask` / `heldout_mask`: loss masks of the same lengths (.npy,
    nonzero = the token counts as a target), e.g. a task's answer tokens only."""
    for f in (tokens, heldout, mask, heldout_mask):
        if f is not None and not Path(f).exists():
            raise UserError(f"no such token file: {f}")
    ids = np.load(tokens).astype(np.int64)
    m = None if mask is None else np.load(mask).astype(np.int64) != 0
    if m is not None and len(m) != len(ids):
        raise UserError(f"--loss-mask {mask} has {len(m)} entries, the tokens {len(ids)}")
    if heldout is not None:
        held = np.load(heldout).astype(np.int64)
        train, train_m = ids, m
        held_m = None if heldout_mask is None else np.load(heldout_mask).astype(np.int64) != 0
        if held_m is not None and len(held_m) != len(held):
            raise UserError(f"--heldout-loss-mask {heldout_mask} has {len(held_m)} entries, the tokens {len(held)}")
    else:
        cut = len(ids) * 9 // 10
        train, held = ids[:cut], ids[cut:]
        train_m, held_m = (None, None) if m is None else (m[:cut], m[cut:])
    meta = {"source": str(tokens), "train_tokens": int(len(train)), "train_sha256": sha(train)}
    if m is not None:
        meta["loss_mask"] = str(mask)
    return Tokens(train, held, meta=meta, train_mask=train_m, heldout_mask=held_m)


def corpus_missing_message(tokenizer_dir: Path, corpus: Path = CORPUS) -> str | None:
    missing = [p for p in (corpus / "train.txt", corpus / "heldout.txt", Path(tokenizer_dir) / "tokenizer.json")
               if not p.exists()]
    if not missing:
        return None
    return (f"the default corpus is not built ({missing[0]} is missing); build it once (~2 min) with: "
            f"{BUILD_CORPUS}   (or train on your own text with --dataset FILE.jsonl --text-column text)")


def from_corpus(names: tuple[str, ...], tokenizer_dir: Path = TOKENIZER, corpus: Path = CORPUS) -> list[np.ndarray]:
    msg = corpus_missing_message(tokenizer_dir, corpus)
    if msg:
        raise UserError(msg)
    from train.common import load_tokens
    out = []
    for n in names:
        if not (corpus / f"{n}.txt").exists():
            raise UserError(f"{corpus / (n + '.txt')} is missing; rebuild the corpus with: {BUILD_CORPUS}")
        out.append(load_tokens(n, tokenizer_dir, corpus))
    return out
