"""Training tokens from a `datasets` source, the built corpus, or .npy ids.

`--dataset SRC`: SRC is a local .jsonl/.json/.parquet/.csv/.txt/.arrow file, a folder of such files,
a `save_to_disk` folder, or (online) a hub dataset name. Formats (TRL's SFTTrainer conventions),
detected from the columns unless `fmt` names one:
  messages           a `messages` column of [{role, content}, ...] lists, rendered with the
                     tokenizer's chat template; with assistant_only_loss only the assistant turns
                     count (each turn's content + end-of-turn marker; not the role header, which
                     the model is given at inference, i.e. what add_generation_prompt adds)
  prompt_completion  `prompt` + `completion` columns, both strings (tokenised separately and
                     concatenated, so the boundary is exact) or both message lists (the prompt
                     rendered with the generation prompt, the completion is what the full
                     conversation adds); with completion_only_loss only the completion + EOS count
  text               the `column` (--text-column) strings; every token counts
Every document ends with EOS (a chat document: the template's rendering, then EOS unless it already
ends with it; that EOS counts iff the last message counts). A document longer than a window (ctx+1
tokens) is split into window-sized pieces, each packed as a document of its own (no token is lost,
as under TRL's "bfd_split"; a plain-text corpus of long documents stays whole; counted in meta
`split_documents`; pieces without a counted target are left out and counted in `empty_pieces`). A bad row (missing / wrong type /
unknown role / no assistant turn under assistant_only_loss / ...) is a UserError naming the
source, split and row, unless skip_bad_rows: then it is skipped and counted in meta `skipped_rows`
(reason -> count), like empty text rows (always skipped, never silently).

Packing (`packing=True`): documents are placed whole into windows of ctx+1 tokens by best-fit
decreasing (TRL's packing_strategy="bfd"; deterministic: longest first, ties in source order, each
into the fullest window it fits, within a window in source order), the rest padded with the pad id;
`packing=False`: one document per window. Alongside the windows [N, ctx+1]:
  mask  bool: token i is a target that counts (predicted from token i-1); False at every
        document's first token (nothing of its own document precedes it), at padding and on the
        tokens the format does not count
  doc   int32: the document's number within its window (0, 1, 2, ...); padding gets the number
        after the last document. Trainers restart positions and attention per document from it.
Held-out: the source's `validation` / `test` split when it has one, else the last documents (in
source order) holding `heldout_frac` of the tokens (not the last windows: under bfd those would be
the shortest documents), packed separately and never trained on. The arrays are cached under
`.cache/datasets/<key>/`, key = sha256 of (version; source and, for local files, their names / sizes
/ mtimes; column; format and loss flags; packing; tokenizer files; ctx; heldout_frac); env
LOOPLM_DATASETS_CACHE moves that cache.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
from bisect import bisect_left, insort
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
FORMATS = ("auto", "text", "messages", "prompt_completion")
ROLES = ("system", "developer", "user", "assistant", "tool")
# bump when the arrays built for the same inputs change, so older caches are not reused
CACHE_VERSION = 2


@dataclass
class Tokens:
    """Training / held-out tokens: a stream (random windows) or packed windows (random rows)."""
    train: np.ndarray
    heldout: np.ndarray
    packed: bool = False
    meta: dict = field(default_factory=dict)
    # loss masks aligned with the tokens (1: the token is a target that counts), or None
    train_mask: np.ndarray | None = None
    heldout_mask: np.ndarray | None = None
    # packed windows: each token's document number within its window (see the module docstring);
    # None: a token stream, one document
    train_doc: np.ndarray | None = None
    heldout_doc: np.ndarray | None = None

    def _rows(self, batch: int, seed: list[int]) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, len(self.train), size=batch)

    def batch(self, batch: int, ctx: int, seed: list[int]) -> torch.Tensor:
        if not self.packed:
            return random_windows(self.train, batch, ctx, seed)
        return torch.from_numpy(self.train[self._rows(batch, seed)]).long()

    def _train_like(self, arr: np.ndarray, batch: int, ctx: int, seed: list[int]) -> torch.Tensor:
        """`arr` (aligned with the training tokens) at the rows / windows `batch(batch, ctx, seed)` draws."""
        if self.packed:
            return torch.from_numpy(arr[self._rows(batch, seed)])
        return random_windows(arr, batch, ctx, seed)

    def _held_like(self, arr: np.ndarray, ctx: int, max_windows: int | None) -> torch.Tensor:
        """`arr` (aligned with the held-out tokens) at the windows `eval(ctx, max_windows)` returns."""
        if self.packed:
            return torch.from_numpy(arr[:max_windows])
        return eval_windows(arr, ctx, max_windows)

    def batch_mask(self, batch: int, ctx: int, seed: list[int]) -> torch.Tensor | None:
        """The loss mask of `batch(batch, ctx, seed)`'s windows (the same seed draws the same starts / rows)."""
        return None if self.train_mask is None else self._train_like(self.train_mask, batch, ctx, seed).bool()

    def batch_doc(self, batch: int, ctx: int, seed: list[int]) -> torch.Tensor | None:
        """The document numbers of `batch(batch, ctx, seed)`'s windows; None for a stream."""
        return None if self.train_doc is None else self._train_like(self.train_doc, batch, ctx, seed).long()

    def eval(self, ctx: int, max_windows: int | None) -> torch.Tensor:
        if not self.packed:
            return eval_windows(self.heldout, ctx, max_windows)
        return torch.from_numpy(self.heldout[:max_windows]).long()

    def eval_mask(self, ctx: int, max_windows: int | None) -> torch.Tensor | None:
        return None if self.heldout_mask is None else self._held_like(self.heldout_mask, ctx, max_windows).bool()

    def eval_doc(self, ctx: int, max_windows: int | None) -> torch.Tensor | None:
        return None if self.heldout_doc is None else self._held_like(self.heldout_doc, ctx, max_windows).long()


def sha(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr.astype(np.int64)).tobytes()).hexdigest()


def _local_stamp(p: Path) -> list:
    files = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
    return [[str(f.relative_to(p) if p.is_dir() else f.name), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


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
        raise UserError(f"--dataset {source}: cannot load it{hint}: {_first_line(e)}")


def _split(ds):
    """(train split, its name, held-out split or None, its name)."""
    import datasets
    if isinstance(ds, datasets.Dataset):
        return ds, "train", None, None
    names = list(ds.keys())
    train = "train" if "train" in ds else names[0]
    held = next((n for n in ("validation", "valid", "test") if n in ds and n != train), None)
    return ds[train], train, (None if held is None else ds[held]), held


def _resolve_format(fmt: str, columns: list[str], column: str, source: str) -> str:
    if fmt not in FORMATS:
        raise UserError(f"--dataset-format {fmt!r}: use one of {', '.join(FORMATS)}")
    if fmt == "auto":  # TRL's convention: messages > prompt + completion > the text column
        fmt = ("messages" if "messages" in columns else
               "prompt_completion" if "prompt" in columns and "completion" in columns else "text")
    need = {"text": [column], "messages": ["messages"], "prompt_completion": ["prompt", "completion"]}[fmt]
    missing = [c for c in need if c not in columns]
    if missing:
        raise UserError(f"--dataset {source} has no column {missing[0]!r} (format {fmt}); its columns: {columns} "
                        f"(formats: a 'messages' column, 'prompt' + 'completion' columns, or a text column "
                        f"named by --text-column)")
    return fmt


class _BadRow(Exception):
    """A row the format cannot use: `reason` keys meta skipped_rows, `detail` goes in the error line."""

    def __init__(self, reason: str, detail: str | None = None):
        super().__init__(reason)
        self.reason, self.detail = reason, detail or reason


class _NotPrefixStable(Exception):
    """The chat template renders a conversation's prefix as something other than a prefix of it."""


def _show(x) -> str:
    r = repr(x)  # repr keeps it on one line
    return f"{type(x).__name__} {r[:60]}{'...' if len(r) > 60 else ''}"


def _check_messages(msgs, what: str) -> list[dict]:
    if msgs is None:
        raise _BadRow(f"missing {what}", f"{what} is missing")
    if not isinstance(msgs, list) or not msgs:
        raise _BadRow(f"{what} not a list of messages", f"{what} is {_show(msgs)}, not a non-empty list of "
                                                         f"{{role, content}} messages")
    out = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise _BadRow("message not a {role, content} dict",
                          f"{what}[{j}] is {_show(m)}, not a {{role, content}} dict")
        if m["role"] not in ROLES:
            raise _BadRow("unknown role", f"{what}[{j}] has the unknown role {m['role']!r} (known: {', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise _BadRow("content not a string", f"{what}[{j}] content is {_show(m['content'])}, not a string")
        if not m["content"] and m["role"] in ("user", "assistant") and not m.get("tool_calls"):
            raise _BadRow("empty content", f"{what}[{j}] ({m['role']}) has empty content")
        # arrow gives every message all the keys any message has (None where absent): drop those
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _render(tok, convs: list[list[dict]], gen: bool = False) -> list[list[int]]:
    try:
        out = tok.apply_chat_template(convs, tokenize=True, add_generation_prompt=gen)
    except Exception as e:  # noqa: BLE001 - a template may raise on a row (e.g. roles that must alternate)
        raise _BadRow("the chat template failed", f"the chat template failed on it: {_first_line(e)}")
    # transformers 5 returns a BatchEncoding, 4.x the bare ids
    return [list(x) for x in (out["input_ids"] if hasattr(out, "keys") else out)]


def _is_prefix(a: list[int], b: list[int]) -> bool:
    return len(a) <= len(b) and b[:len(a)] == a


def _with_eos(ids: list[int], counted: list[bool], eos: int) -> tuple[list[int], list[bool]]:
    # the EOS belongs to the last token's span (counts iff it does)
    if not ids or ids[-1] != eos:
        ids, counted = ids + [eos], counted + [counted[-1] if counted else True]
    return ids, counted


def _encode_messages(tok, msgs, assistant_only: bool, eos: int):
    msgs = _check_messages(msgs, "messages")
    if not assistant_only:
        ids = _render(tok, [msgs])[0]
        return _with_eos(ids, [True] * len(ids), eos)
    if not any(m["role"] == "assistant" for m in msgs):
        raise _BadRow("no assistant turn", "has no assistant message (assistant-only loss needs one; "
                                           "or pass --no-assistant-only-loss)")
    # each message's span: what its rendering adds to the previous prefix's rendering
    prefixes = _render(tok, [msgs[:i + 1] for i in range(len(msgs))])
    heads = iter(_render(tok, [msgs[:i] for i, m in enumerate(msgs) if m["role"] == "assistant"], gen=True))
    ids, prev = prefixes[-1], []
    counted = [False] * len(ids)
    for m, cur in zip(msgs, prefixes):
        if not _is_prefix(prev, cur):
            raise _NotPrefixStable
        if m["role"] == "assistant":
            head = next(heads)
            # the role header (what add_generation_prompt adds) is given at inference: it does not
            # count; a template whose generation prompt is not a prefix counts the whole span
            start = len(head) if _is_prefix(prev, head) and _is_prefix(head, cur) else len(prev)
            counted[start:len(cur)] = [True] * (len(cur) - start)
        prev = cur
    return _with_eos(ids, counted, eos)


def _encode_prompt_completion(tok, prompt, completion, completion_only: bool, eos: int):
    for name, x in (("prompt", prompt), ("completion", completion)):
        if x is None:
            raise _BadRow(f"missing {name}", f"{name} is missing")
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            raise _BadRow("empty completion", "completion is empty")
        # tokenised apart so the prompt/completion boundary is exact
        p = tok(prompt, add_special_tokens=False)["input_ids"] if prompt else []
        full = list(p) + list(tok(completion, add_special_tokens=False)["input_ids"])
    elif isinstance(prompt, list) and isinstance(completion, list):
        prompt, completion = _check_messages(prompt, "prompt"), _check_messages(completion, "completion")
        p = _render(tok, [prompt], gen=completion[0]["role"] == "assistant")[0]
        full = _render(tok, [prompt + completion])[0]
        if not _is_prefix(p, full):
            raise _NotPrefixStable
    else:
        raise _BadRow("prompt/completion types", f"prompt is {_show(prompt)} and completion is {_show(completion)}: "
                                                 f"want two strings or two message lists")
    counted = [not completion_only] * len(p) + [True] * (len(full) - len(p))
    return _with_eos(full, counted, eos)


def _documents(ds, fmt: str, column: str, tok, eos: int, where: str, tok_dir, assistant_only: bool,
               completion_only: bool, skip_bad_rows: bool, skipped: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """One split's rows -> [(ids int32, counted bool)] documents (EOS-ended, not truncated yet)."""
    def bad(i: int, e: _BadRow) -> None:
        if not skip_bad_rows:
            raise UserError(f"{where} row {i}: {e.detail} (fix the row, or pass --skip-bad-rows to skip such rows)")
        skipped[e.reason] = skipped.get(e.reason, 0) + 1

    if fmt == "messages" and not getattr(tok, "chat_template", None):
        raise UserError(f"{where}: the 'messages' format needs a chat template and the tokenizer in {tok_dir} has none")
    cols = {"text": [column], "messages": ["messages"], "prompt_completion": ["prompt", "completion"]}[fmt]
    docs = []
    for start in range(0, len(ds), 1000):
        chunk = ds[start:start + 1000]
        rows = list(zip(*(chunk[c] for c in cols)))
        if fmt == "text":
            keep = []
            for j, (t,) in enumerate(rows):
                if t == "":
                    skipped["empty text"] = skipped.get("empty text", 0) + 1
                elif not isinstance(t, str):
                    bad(start + j, _BadRow("missing text" if t is None else "text not a string",
                                           f"{column} is {'missing' if t is None else _show(t)}, not a string"))
                else:
                    keep.append(t)
            for seq in (tok(keep, add_special_tokens=False)["input_ids"] if keep else []):
                docs.append((np.asarray(list(seq) + [eos], np.int32), np.ones(len(seq) + 1, bool)))
            continue
        for j, row in enumerate(rows):
            try:
                if fmt == "messages":
                    ids, counted = _encode_messages(tok, row[0], assistant_only, eos)
                else:
                    if isinstance(row[0], list) and not getattr(tok, "chat_template", None):
                        raise UserError(f"{where} row {start + j}: conversational prompt/completion needs a chat "
                                        f"template and the tokenizer in {tok_dir} has none")
                    ids, counted = _encode_prompt_completion(tok, row[0], row[1], completion_only, eos)
            except _BadRow as e:
                bad(start + j, e)
                continue
            except _NotPrefixStable:
                raise UserError(f"{where} row {start + j}: the chat template of {tok_dir} is not prefix-stable (a "
                                f"conversation's first turns render differently inside the whole one), so the "
                                f"turns' tokens cannot be found; pass --no-assistant-only-loss / "
                                f"--no-completion-only-loss or fix the template") from None
            docs.append((np.asarray(ids, np.int32), np.asarray(counted, bool)))
    return docs


def _fit(docs, window: int, stats: dict, skipped: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split documents longer than a window into window-sized pieces (each then a document of its own);
    leave out pieces with no counted target (a document's first token never counts), and documents
    with none at all as skipped rows."""
    out = []
    for ids, counted in docs:
        if len(ids) > window:
            stats["split_documents"] += 1
        pieces = [(ids[a:a + window], counted[a:a + window]) for a in range(0, len(ids), window)]
        kept = [p for p in pieces if p[1][1:].any()]
        if not kept:
            skipped["no counted token"] = skipped.get("no counted token", 0) + 1
            continue
        stats["empty_pieces"] += len(pieces) - len(kept)
        out.extend(kept)
    return out


def _pack(docs, window: int, pad: int, packing: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Documents (each <= window tokens) -> windows [N, window] int32, mask bool, doc int32."""
    if packing:
        # best-fit decreasing: longest first (ties in source order), into the window with the
        # least room that holds it; `free` holds (room, window) sorted, for the bisect
        bins: list[list[int]] = []
        free: list[tuple[int, int]] = []
        for i in sorted(range(len(docs)), key=lambda i: -len(docs[i][0])):
            n = len(docs[i][0])
            k = bisect_left(free, (n, -1))
            if k < len(free):
                room, b = free.pop(k)
            else:
                room, b = window, len(bins)
                bins.append([])
            bins[b].append(i)
            if room > n:
                insort(free, (room - n, b))
    else:
        bins = [[i] for i in range(len(docs))]
    ids = np.full((len(bins), window), pad, np.int32)
    mask = np.zeros((len(bins), window), bool)
    doc = np.zeros((len(bins), window), np.int32)
    for r, b in enumerate(bins):
        pos = 0
        for k, i in enumerate(sorted(b)):  # source order within a window
            t, c = docs[i]
            ids[r, pos:pos + len(t)] = t
            mask[r, pos + 1:pos + len(t)] = c[1:]  # a document's first token is predicted from nothing of its own
            doc[r, pos:pos + len(t)] = k
            pos += len(t)
        doc[r, pos:] = len(b)
    return ids, mask, doc


def _tok_key(tokenizer_dir) -> str:
    # the tokenizer and its chat template (in tokenizer_config.json or chat_template.jinja)
    files = [Path(tokenizer_dir) / f for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")]
    files = [f for f in files if f.exists()]
    if not files:
        return str(Path(tokenizer_dir).resolve())
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def from_dataset(source: str, column: str, tokenizer_dir: Path, ctx: int, heldout_frac: float = 0.1,
                 cache_root: Path | None = None, is_main: bool = True, wait=None, *, fmt: str = "auto",
                 assistant_only_loss: bool = True, completion_only_loss: bool = True, packing: bool = True,
                 skip_bad_rows: bool = False) -> Tokens:
    """Tokenise + pack `source` (see the module docstring), cached. `wait()` (e.g.
    accelerator.wait_for_everyone) lets rank 0 build the cache while the others wait."""
    from looplm.io import load_tokenizer
    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    if tokenizer is None:
        raise UserError(f"--dataset needs a tokenizer: {tokenizer_dir} has no tokenizer.json (pass --tokenizer DIR)")
    if fmt not in FORMATS:
        raise UserError(f"--dataset-format {fmt!r}: use one of {', '.join(FORMATS)}")
    tok_key = _tok_key(tokenizer_dir)
    p = Path(source)
    src = {"source": str(p.resolve()) if p.exists() else source, "stamp": _local_stamp(p) if p.exists() else None}
    key_dict = {**src, "version": CACHE_VERSION, "column": column, "format": fmt,
                "assistant_only_loss": assistant_only_loss, "completion_only_loss": completion_only_loss,
                "packing": packing, "skip_bad_rows": skip_bad_rows, "tokenizer": tok_key, "ctx": ctx,
                "heldout_frac": heldout_frac}
    key = hashlib.sha256(json.dumps(key_dict, sort_keys=True).encode()).hexdigest()[:16]
    cache_root = Path(cache_root or os.environ.get("LOOPLM_DATASETS_CACHE") or DATASETS_CACHE)
    d = cache_root / key
    names = [f"{s}_{k}" for s in ("train", "heldout") for k in ("ids", "mask", "doc")]
    if is_main and not (d / "meta.json").exists():
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        window = ctx + 1
        train_ds, train_name, held_ds, held_name = _split(_load(source))
        resolved = _resolve_format(fmt, train_ds.column_names, column, source)
        skipped: dict[str, int] = {}
        stats = {"split_documents": 0, "empty_pieces": 0}
        enc = dict(fmt=resolved, column=column, tok=tokenizer, eos=eos, tok_dir=tokenizer_dir,
                   assistant_only=assistant_only_loss, completion_only=completion_only_loss,
                   skip_bad_rows=skip_bad_rows, skipped=skipped)
        train_docs = _documents(train_ds, where=f"--dataset {source} split {train_name!r}", **enc)
        if held_ds is not None:
            _resolve_format(resolved, held_ds.column_names, column, f"{source} split {held_name!r}")
            held_docs = _documents(held_ds, where=f"--dataset {source} split {held_name!r}", **enc)
        else:
            # the last documents holding heldout_frac of the tokens (at least one when there are two)
            need, got, k = heldout_frac * sum(len(t) for t, _ in train_docs), 0, len(train_docs)
            while k > 1 and heldout_frac > 0 and (got < need or k == len(train_docs)):
                k -= 1
                got += len(train_docs[k][0])
            train_docs, held_docs = train_docs[:k], train_docs[k:]
        n_docs, n_held = len(train_docs), len(held_docs)
        train_docs, held_docs = _fit(train_docs, window, stats, skipped), _fit(held_docs, window, stats, skipped)
        if not train_docs:
            raise UserError(f"--dataset {source}: no training document left (skipped rows: {skipped or 'none'})")
        arrays = {**dict(zip(names[:3], _pack(train_docs, window, pad, packing))),
                  **dict(zip(names[3:], _pack(held_docs, window, pad, packing)))}
        d.mkdir(parents=True, exist_ok=True)
        for n, arr in arrays.items():
            np.save(d / f"{n}.npy", arr)
        train, held = arrays["train_ids"], arrays["heldout_ids"]
        meta = {"source": source, "text_column": column, "format": resolved, "ctx": ctx,
                "assistant_only_loss": assistant_only_loss, "completion_only_loss": completion_only_loss,
                "packing": packing, "documents": n_docs, "heldout_documents": n_held,
                "packed_documents": len(train_docs), "skipped_rows": skipped, **stats,
                "train_windows": int(len(train)), "heldout_windows": int(len(held)),
                "train_tokens": int(train.size), "train_target_tokens": int(arrays["train_mask"].sum()),
                "train_padding_tokens": int(train.size - sum(len(t) for t, _ in train_docs)),
                "train_sha256": sha(train), "heldout_sha256": sha(held),
                "tokenizer_sha256": tok_key, "cache": str(d), "key": key_dict}
        (d / "meta.tmp").write_text(json.dumps(meta, indent=2) + "\n")
        (d / "meta.tmp").replace(d / "meta.json")
    if wait is not None:
        wait()
    if not (d / "meta.json").exists():
        raise UserError(f"--dataset {source}: the cache {d} was not built (rank 0 failed?)")
    meta = json.loads((d / "meta.json").read_text())
    a = {n: np.load(d / f"{n}.npy") for n in names}
    if len(a["heldout_ids"]) == 0:
        for k in ("ids", "mask", "doc"):
            a[f"heldout_{k}"] = a[f"train_{k}"][-1:]
    return Tokens(a["train_ids"].astype(np.int64), a["heldout_ids"].astype(np.int64), packed=True, meta=meta,
                  train_mask=a["train_mask"], heldout_mask=a["heldout_mask"],
                  train_doc=a["train_doc"], heldout_doc=a["heldout_doc"])


def summary(meta: dict) -> str:
    """One line for the log: documents, windows, split documents and skipped rows."""
    skipped = ", ".join(f"{r}: {n}" for r, n in sorted(meta.get("skipped_rows", {}).items())) or "none"
    return (f"dataset {meta.get('source')} ({meta.get('format', 'text')}): {meta.get('documents')} documents in "
            f"{meta.get('train_windows')} windows, {meta.get('heldout_documents', '?')} held out in "
            f"{meta.get('heldout_windows')}; {meta.get('split_documents', 0)} longer than a window, split; "
            f"skipped rows: {skipped}")


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    """The --dataset options of the trainers (see the module docstring); dataset_kwargs(a) maps them."""
    p.add_argument("--dataset", default=None,
                   help="a datasets source: a .jsonl/.json/.parquet/.csv/.txt/.arrow file, a folder of them, a "
                        "save_to_disk folder or a hub name (see train/datasource.py)")
    p.add_argument("--text-column", default="text", help="the text column of the 'text' format (default: text)")
    p.add_argument("--heldout-frac", type=float, default=0.1,
                   help="without a validation/test split: the share of the tokens (last documents) held out "
                        "(default: 0.1)")
    p.add_argument("--dataset-format", default="auto", choices=FORMATS,
                   help="auto (default): a 'messages' column = conversational, 'prompt' + 'completion' columns = "
                        "prompt/completion, else the --text-column text")
    p.add_argument("--assistant-only-loss", action=argparse.BooleanOptionalAction, default=True,
                   help="messages: only the assistant turns' tokens count in the loss (default: on)")
    p.add_argument("--completion-only-loss", action=argparse.BooleanOptionalAction, default=True,
                   help="prompt/completion: only the completion's tokens (and EOS) count in the loss (default: on)")
    p.add_argument("--packing", action=argparse.BooleanOptionalAction, default=True,
                   help="pack whole documents into the ctx+1 windows, best-fit decreasing (default: on); "
                        "--no-packing: one document per window, padded")
    p.add_argument("--skip-bad-rows", action="store_true",
                   help="skip (and count) malformed rows instead of stopping at the first one")


def dataset_kwargs(a: argparse.Namespace) -> dict:
    """add_dataset_args's options as from_dataset's keyword-only arguments (source, column and
    heldout_frac stay positional: a.dataset, a.text_column, a.heldout_frac)."""
    return {"fmt": a.dataset_format, "assistant_only_loss": a.assistant_only_loss,
            "completion_only_loss": a.completion_only_loss, "packing": a.packing, "skip_bad_rows": a.skip_bad_rows}


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
