"""Offline corpus builder: real English text + a small synthetic reasoning component.

    python -m train.data --out .cache/corpus

Writes train.txt, heldout.txt (natural text only), heldout_synthetic.txt (+ .jsonl with
prompt/answer pairs for exact-match evaluation) and stats.json. In the .txt files one document
is a run of non-empty lines (one paragraph per line) and documents are separated by one blank
line; `read_documents` reads them back.
"""
from __future__ import annotations

import argparse
import bz2
import html
import io
import json
import logging
import os
import random
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger("train.data")

DOC_SEP = "\n\n"
DEFAULT_CACHE = Path(__file__).resolve().parent.parent / ".cache" / "corpus"
GENSIM_PIN = "gensim==4.4.0"
_TEST_DATA = "gensim/test/test_data/"
# English Wikipedia excerpts shipped in gensim's test data (the bgwiki file is Bulgarian).
_WIKI_FILES = {
    "wiki": "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
    "wiki-tables": "enwiki-table-markup.xml.bz2",
}
_LEE_FILES = {"lee-background": "lee_background.cor", "lee": "lee.cor"}


@dataclass(frozen=True, slots=True)
class Doc:
    source: str
    text: str


# ---------------------------------------------------------------- MediaWiki markup stripping

# Everything after these headings is lists of links and citations, not prose.
_TRAILING_SECTIONS = re.compile(
    r"^==+\s*(References|Notes|Footnotes|Citations|Sources|Bibliography|Further reading|"
    r"External links|See also)\s*==+\s*$", re.M | re.I)
# Non-prose link namespaces; interlanguage links like [[de:Foo]] are handled by _link_text.
_DROP_LINK = re.compile(r"^\s*:?\s*(file|image|media|category)\s*:", re.I)
_INTERLANG = re.compile(r"^[a-z]{2,3}(-[a-z]+)*:[^|]*$")
_DROP_TAGS = "ref|gallery|math|timeline|imagemap|score|syntaxhighlight|source|chem|hiero"


def _strip_nested(text: str, open_: str, close: str,
                  keep: Callable[[str], str] | None = None) -> str:
    """Remove balanced open_..close spans (nesting aware, one regex scan).

    `keep(inner)` may return replacement text for a span. An unmatched opener is dropped on its
    own, so a stray '{{' never swallows the rest of an article.
    """
    token = re.compile(f"{re.escape(open_)}|{re.escape(close)}")
    out: list[str] = []
    i = 0
    while (start := text.find(open_, i)) >= 0:
        out.append(text[i:start])
        depth, j = 1, start + len(open_)
        while depth and (m := token.search(text, j)):
            depth += 1 if m.group() == open_ else -1
            j = m.end()
        if depth:  # unmatched: drop just the opener
            i = start + len(open_)
            continue
        if keep is not None:
            out.append(keep(text[start + len(open_): j - len(close)]))
        i = j
    out.append(text[i:])
    return "".join(out)


_RANGE_WORDS = {"to", "-", "\u2013", "and", "or", "by", "x"}


def _template_text(inner: str) -> str:
    """The few inline templates that carry prose (numbers, names); every other one is dropped."""
    # nested templates and links first: their '|' are not this template's separators
    inner = _strip_nested(inner, "{{", "}}", _template_text)
    inner = _strip_nested(inner, "[[", "]]", _link_text)
    name, *args = [a.strip() for a in inner.split("|")]
    name, pos = name.lower(), [a for a in args if "=" not in a]
    if name == "convert" and len(pos) >= 2:  # {{convert|5|to|10|km|mi}} -> "5 to 10 km"
        return " ".join(pos[:4] if len(pos) >= 4 and pos[1] in _RANGE_WORDS else pos[:2])
    if (name in ("lang", "transl") or name.startswith("lang-")) and pos:
        return pos[-1]  # {{lang|fr|texte}} -> texte
    if name in ("small", "smaller", "nowrap", "nobr", "nihongo", "flag") and pos:
        return pos[0]
    if name == "linktext":
        return "".join(pos)
    if name == "as of" and pos:
        return f"As of {pos[0]}"
    return ""


def _link_text(inner: str) -> str:
    if _DROP_LINK.match(inner) or _INTERLANG.match(inner):
        return ""
    inner = _strip_nested(inner, "[[", "]]", _link_text)  # rare nested links in labels
    return inner.rsplit("|", 1)[-1].lstrip(":")


def strip_wikitext(text: str) -> str:
    """MediaWiki source -> plain prose: one paragraph per line, no blank lines."""
    text = _TRAILING_SECTIONS.split(text, maxsplit=1)[0]
    text = re.sub(r"<!--.*?(-->|$)", "", text, flags=re.S)
    text = re.sub(rf"<({_DROP_TAGS})\b[^>]*/>", "", text, flags=re.I)
    text = re.sub(rf"<({_DROP_TAGS})\b[^>]*>.*?</\1\s*>", "", text, flags=re.I | re.S)
    text = _strip_nested(text, "{{", "}}", _template_text)  # infoboxes, citations, ...
    text = _strip_nested(text, "{|", "|}")  # tables
    text = _strip_nested(text, "[[", "]]", _link_text)
    text = re.sub(r"\[(?:https?:)?//[^\s\]]+\s*([^\]]*)\]", r"\1", text)  # [url label] -> label
    text = re.sub(r"<[^>]*>", "", text)  # remaining html tags, keep their content
    text = re.sub(r"'{2,}", "", text)  # ''italic'', '''bold'''
    text = re.sub(r"__[A-Z]+__", "", text)  # __NOTOC__ and friends
    text = html.unescape(text).replace("\xa0", " ")
    lines = []
    for line in text.splitlines():
        line = re.sub(r"^=+\s*(.*?)\s*=+$", r"\1", line.strip())  # heading -> its title
        line = re.sub(r"^[*#:;]+\s*", "", line)  # list / indent markers
        # "(; , Akhilleus, )" left by dropped templates -> "(Akhilleus)"; "( )" -> ""
        line = re.sub(r"\(\s*(?:[,;]\s*)*", "(", line)
        line = re.sub(r"(?:\s*[,;])*\s*\)", ")", line)
        line = re.sub(r"\s*\(\s*\)", "", line)
        line = re.sub(r"[ \t]{2,}", " ", line).strip()
        if re.search(r"\w", line):
            lines.append(line)
    return "\n".join(lines)


def wiki_documents(xml_bytes: bytes, source: str) -> list[Doc]:
    """Articles (namespace 0, no redirects) of a MediaWiki XML export, markup stripped."""
    docs = []
    for _, elem in ET.iterparse(io.BytesIO(xml_bytes)):
        if elem.tag.rsplit("}", 1)[-1] != "page":
            continue
        fields = {child.tag.rsplit("}", 1)[-1]: child for child in elem}
        rev = fields.get("revision")
        raw = rev.findtext("{*}text") if rev is not None else None
        if fields.get("ns") is not None and fields["ns"].text == "0" and "redirect" not in fields \
                and raw and not raw.lstrip().upper().startswith("#REDIRECT"):
            clean = strip_wikitext(raw)
            if len(clean) >= 200:  # stubs that were all templates carry no prose
                docs.append(Doc(source, clean))
        elem.clear()
    return docs


# ---------------------------------------------------------------- sources

def _paragraphs(text: str) -> str:
    """One paragraph per line and no blank lines: a blank line separates documents on disk."""
    return "\n".join(ln.strip() for ln in text.splitlines() if ln.strip())


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:  # lee.cor holds a few Latin-1 bytes (e.g. the pound sign)
        return data.decode("latin-1")


def fetch_gensim_wheel(cache: Path, timeout_s: int = 600) -> Path | None:
    """The gensim wheel in `cache`, downloaded with pip if absent; None if pip cannot get it."""
    version = GENSIM_PIN.split("==")[1]
    found = sorted(cache.glob(f"gensim-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", GENSIM_PIN, "-d", str(cache)]
    log.info("downloading %s: %s", GENSIM_PIN, " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("pip download timed out after %d s", timeout_s)
        return None
    if proc.returncode != 0:
        log.warning("pip download failed (rc=%d): %s", proc.returncode, proc.stderr.strip()[-500:])
        return None
    found = sorted(cache.glob(f"gensim-{version}-*.whl"))
    return found[0] if found else None


def gensim_documents(wheel: Path) -> list[Doc]:
    """Wikipedia articles and Lee news documents from gensim's test data (no gensim import)."""
    docs: list[Doc] = []
    with zipfile.ZipFile(wheel) as zf:
        for source, name in _WIKI_FILES.items():
            docs += wiki_documents(bz2.decompress(zf.read(_TEST_DATA + name)), source)
        for source, name in _LEE_FILES.items():  # one news story per line
            for line in _decode(zf.read(_TEST_DATA + name)).splitlines():
                if line.strip():
                    docs.append(Doc(source, re.sub(r"\s+", " ", line).strip()))
    return docs


def pydoc_documents() -> list[Doc]:
    """Zero-install fallback: the help topics bundled with Python (~65k words)."""
    from pydoc_data.topics import topics

    docs = []
    for key in sorted(topics):
        paras = [re.sub(r"\s+", " ", p).strip() for p in topics[key].split("\n\n")]
        text = "\n".join(p for p in paras if p)
        if text:
            docs.append(Doc("pydoc-topics", text))
    return docs


def text_file_documents(paths: list[Path]) -> list[Doc]:
    """Local .txt files; blank lines separate documents, as in the files this module writes."""
    docs = []
    for path in paths:
        for block in re.split(r"\n\s*\n", _decode(path.read_bytes())):
            if block.strip():
                docs.append(Doc(f"file:{path.name}", _paragraphs(block)))
    return docs


def hf_documents(name: str, split: str = "train", field: str = "text") -> list[Doc]:
    """A Hugging Face dataset with a text column; needs network access to the hub."""
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise RuntimeError(f"--hf-dataset {name} needs the hub, but offline mode is set")
    import datasets

    ds = datasets.load_dataset(name, split=split)
    return [Doc(f"hf:{name}", _paragraphs(t)) for t in ds[field] if t and t.strip()]


# ---------------------------------------------------------------- synthetic reasoning

@dataclass(frozen=True, slots=True)
class Problem:
    kind: str
    prompt: str
    answer: int

    @property
    def line(self) -> str:
        return f"{self.prompt}{self.answer}" if self.prompt.endswith("=") else \
            f"{self.prompt} {self.answer}"


def chain_problem(rng: random.Random, hops: int) -> Problem:
    """'a=3; b=a+4; c=b-2; c?' -- each hop needs the previous one, so depth should help."""
    names = rng.sample("abcdefghijkmnpqrstuvwxyz", hops + 1)
    value = rng.randint(0, 9)
    stmts = [f"{names[0]}={value}"]
    for prev, name in zip(names, names[1:]):
        k = rng.randint(1, 9)
        op = "-" if rng.random() < 0.5 and value >= k else "+"  # keep values non-negative
        value = value + k if op == "+" else value - k
        stmts.append(f"{name}={prev}{op}{k}")
    return Problem("chain", "; ".join(stmts) + f"; {names[-1]}?", value)


def addition_problem(rng: random.Random) -> Problem:
    """2-3 digit additions; carries chain across digits."""
    a, b = (rng.randint(10, 99) if rng.random() < 0.5 else rng.randint(100, 999) for _ in range(2))
    return Problem("add", f"{a}+{b}=", a + b)


_NAMES = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo"]
_ITEMS = ["apples", "books", "coins", "shells", "stamps", "marbles"]


def word_problem(rng: random.Random, steps: int) -> Problem:
    """'Ann has 5 coins. Then Ann gets 3 more. Then Ann gives away 2. How many coins does Ann
    have? 6' -- the same chain as chain_problem, in words."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    value = rng.randint(2, 20)
    parts = [f"{name} has {value} {item}."]
    for _ in range(steps):
        k = rng.randint(1, 9)
        if rng.random() < 0.5 and value >= k:
            value -= k
            parts.append(f"Then {name} gives away {k}.")
        else:
            value += k
            parts.append(f"Then {name} gets {k} more.")
    parts.append(f"How many {item} does {name} have?")
    return Problem("word", " ".join(parts), value)


def synthetic_problems(rng: random.Random, count: int) -> list[Problem]:
    out = []
    for _ in range(count):
        r = rng.random()
        if r < 0.5:
            out.append(chain_problem(rng, hops=rng.randint(1, 5)))
        elif r < 0.75:
            out.append(addition_problem(rng))
        else:
            out.append(word_problem(rng, steps=rng.randint(1, 4)))
    return out


def synthetic_documents(n_chars: int, seed: int) -> list[list[Problem]]:
    """Documents of 8-16 problems each, about n_chars characters in all, deterministic by seed."""
    rng = random.Random(f"synthetic:{seed}")
    docs: list[list[Problem]] = []
    total = 0
    while total < n_chars:
        doc = synthetic_problems(rng, rng.randint(8, 16))
        docs.append(doc)
        total += sum(len(p.line) + 1 for p in doc)
    return docs


# ---------------------------------------------------------------- split and write

def _synthetic_doc(problems: list[Problem]) -> Doc:
    return Doc("synthetic", "\n".join(p.line for p in problems))


def split_documents(docs: list[T], heldout_frac: float, seed: int,
                    key: Callable[[T], str] = lambda d: d.source) -> tuple[list[T], list[T]]:
    """Deterministic document-level split, stratified by `key` so every source is held out.

    Returns (train, heldout) preserving the input order within each part.
    """
    groups: dict[str, list[int]] = {}
    for i, d in enumerate(docs):
        groups.setdefault(key(d), []).append(i)
    held: set[int] = set()
    for name, idx in sorted(groups.items()):
        n_held = round(len(idx) * heldout_frac)
        if heldout_frac > 0 and len(idx) >= 2:
            n_held = max(1, n_held)
        held.update(random.Random(f"{seed}:{name}").sample(idx, n_held))
    train = [d for i, d in enumerate(docs) if i not in held]
    heldout = [d for i, d in enumerate(docs) if i in held]
    return train, heldout


def write_documents(path: Path, texts: list[str]) -> None:
    path.write_text(DOC_SEP.join(texts) + "\n", encoding="utf-8")


def read_documents(path: Path) -> list[str]:
    return [d for d in path.read_text(encoding="utf-8").strip("\n").split(DOC_SEP) if d]


def _stats(docs: list[Doc]) -> dict:
    by_source: dict[str, int] = {}
    for d in docs:
        by_source[d.source] = by_source.get(d.source, 0) + 1
    return {"documents": len(docs), "characters": sum(len(d.text) for d in docs),
            "words": sum(len(d.text.split()) for d in docs), "documents_by_source": by_source}


def build_corpus(out: Path, cache: Path = DEFAULT_CACHE, text_files: list[Path] | None = None,
                 hf_dataset: str | None = None, use_gensim: bool = True,
                 synthetic_frac: float = 0.1, heldout_frac: float = 0.05, seed: int = 0) -> dict:
    """Collect sources, add synthetic problems, split, write the files; returns the stats."""
    if not 0 <= synthetic_frac < 1 or not 0 <= heldout_frac < 1:
        raise ValueError("synthetic_frac and heldout_frac must be in [0, 1)")
    docs: list[Doc] = []
    if use_gensim:
        wheel = fetch_gensim_wheel(cache)
        if wheel is not None:
            docs += gensim_documents(wheel)
        else:
            log.warning("gensim wheel unavailable: falling back to pydoc_data.topics (~65k words)")
            docs += pydoc_documents()
    docs += text_file_documents(text_files or [])
    if hf_dataset:
        docs += hf_documents(hf_dataset)
    unique: dict[str, Doc] = {}
    for d in docs:  # an exact duplicate on both sides of the split would leak held-out text
        unique.setdefault(d.text, d)
    docs = list(unique.values())
    if not docs:
        raise RuntimeError("no source documents")

    natural_chars = sum(len(d.text) for d in docs)
    # synthetic share of *all* characters: s / (n + s) = frac
    syn = synthetic_documents(int(natural_chars * synthetic_frac / (1 - synthetic_frac)), seed) \
        if synthetic_frac > 0 else []
    nat_train, nat_held = split_documents(docs, heldout_frac, seed)
    syn_train, syn_held = split_documents(syn, heldout_frac, seed, key=lambda _: "synthetic")
    # Short problems repeat by chance; a held-out one seen in training would measure recall.
    seen = {p.prompt for ps in syn_train for p in ps}
    syn_held = [kept for ps in syn_held if (kept := [p for p in ps if p.prompt not in seen])]
    train = nat_train + [_synthetic_doc(ps) for ps in syn_train]
    random.Random(f"order:{seed}").shuffle(train)  # interleave synthetic with prose

    out.mkdir(parents=True, exist_ok=True)
    write_documents(out / "train.txt", [d.text for d in train])
    write_documents(out / "heldout.txt", [d.text for d in nat_held])
    write_documents(out / "heldout_synthetic.txt", [_synthetic_doc(ps).text for ps in syn_held])
    with open(out / "heldout_synthetic.jsonl", "w", encoding="utf-8") as f:
        for p in (p for ps in syn_held for p in ps):
            row = {"kind": p.kind, "prompt": p.prompt, "answer": str(p.answer)}
            f.write(json.dumps(row) + "\n")
    stats = {
        "seed": seed, "heldout_frac": heldout_frac, "synthetic_frac": synthetic_frac,
        "sources": sorted({d.source for d in docs} | ({"synthetic"} if syn else set())),
        "train": _stats(train), "heldout": _stats(nat_held),
        "heldout_synthetic": _stats([_synthetic_doc(ps) for ps in syn_held]),
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the gensim wheel lives")
    p.add_argument("--text-files", type=Path, nargs="*", default=[], help="extra local .txt files")
    p.add_argument("--hf-dataset", default=None, help="datasets name with a 'text' column (online)")
    p.add_argument("--no-gensim", action="store_true", help="skip the gensim Wikipedia/Lee text")
    p.add_argument("--synthetic-frac", type=float, default=0.1, help="0 turns synthetic off")
    p.add_argument("--heldout-frac", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    stats = build_corpus(a.out, a.cache, a.text_files, a.hf_dataset, not a.no_gensim,
                         a.synthetic_frac, a.heldout_frac, a.seed)
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    from train.cli import run
    run(main)
