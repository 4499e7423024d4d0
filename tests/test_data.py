"""Corpus builder and tokenizer: tiny inline inputs, no network, seconds."""
import os

# Set before transformers / huggingface_hub are imported: they read it once at import time.
os.environ["HF_HUB_OFFLINE"] = "1"

import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from train import data  # noqa: E402
from train.tokenizer import EOS, encode_corpus, save_tokenizer, train_bpe  # noqa: E402

WIKI = """{{Infobox person
| name = Ada {{nowrap|Lovelace}}
| image = Ada.jpg
}}
'''Augusta Ada King''' ({{IPAc-en|ˈ|eɪ|d|ə}}; 10 December 1815 &ndash; 1852) was an [[England|English]] \
[[mathematician]].<ref name="a">{{cite book|title=X}}</ref> She wrote ''notes''.<ref>Y</ref>
[[File:Ada.jpg|thumb|A [[portrait]] of Ada]]
== Early life ==
{| class="wikitable"
|-
| cell {{flag|UK}} || more
|}
* She met [[Charles Babbage]] in 1833.<!-- hidden -->
She lived {{convert|5|km|mi|abbr=on}} from {{lang|fr|Paris}}.
See [http://example.org the site] and <span style="x">this</span>.

== References ==
{{reflist}}
[[Category:1815 births]]
[[fr:Ada Lovelace]]
"""


def test_strip_wikitext() -> None:
    text = data.strip_wikitext(WIKI)
    assert text.split("\n") == [
        "Augusta Ada King (10 December 1815 \u2013 1852) was an English mathematician. "
        "She wrote notes.",
        "Early life",
        "She met Charles Babbage in 1833.",
        "She lived 5 km from Paris.",
        "See the site and this.",
    ]


def test_wiki_documents_skip_redirects_and_other_namespaces() -> None:
    def page(title: str, ns: int, body: str, redirect: bool = False) -> str:
        red = f'<redirect title="{title}x" />' if redirect else ""
        return (f"<page><title>{title}</title><ns>{ns}</ns>{red}<revision>"
                f'<text xml:space="preserve">{body}</text></revision></page>')
    prose = "Some [[real]] prose about a topic. " * 10
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">'
           + page("A", 0, prose) + page("B", 0, "#REDIRECT [[A]]", redirect=True)
           + page("Talk:A", 1, prose) + "</mediawiki>").encode()
    docs = data.wiki_documents(xml, "wiki")
    assert [d.text for d in docs] == [prose.replace("[[real]]", "real").strip()]


def test_split_is_deterministic_disjoint_and_stratified() -> None:
    docs = [data.Doc("a" if i % 3 else "b", f"doc {i}") for i in range(200)]
    train, held = data.split_documents(docs, 0.05, seed=1)
    again = data.split_documents(docs, 0.05, seed=1)
    assert (train, held) == again
    assert {d.text for d in train}.isdisjoint(d.text for d in held)
    assert len(train) + len(held) == len(docs)
    assert {d.source for d in held} == {"a", "b"}
    assert 7 <= len(held) <= 13
    assert data.split_documents(docs, 0.05, seed=2)[1] != held


def _evaluate(problem: data.Problem) -> int:
    """Independent check: re-derive the answer from the problem's text alone."""
    if problem.kind == "add":
        a, b = re.fullmatch(r"(\d+)\+(\d+)=", problem.prompt).groups()
        return int(a) + int(b)
    if problem.kind == "chain":
        *stmts, query = problem.prompt.split("; ")
        env: dict[str, int] = {}
        for stmt in stmts:
            name, expr = stmt.split("=")
            m = re.fullmatch(r"(\w)([+-])(\d)", expr)
            env[name] = int(expr) if m is None else \
                env[m[1]] + (int(m[3]) if m[2] == "+" else -int(m[3]))
        return env[query.rstrip("?")]
    value = int(re.search(r"has (\d+)", problem.prompt)[1])
    for verb, k in re.findall(r"(gets|gives away) (\d+)", problem.prompt):
        value += int(k) if verb == "gets" else -int(k)
    return value


def test_synthetic_answers_are_correct_and_deterministic() -> None:
    problems = data.synthetic_problems(random.Random(0), 500)
    assert {p.kind for p in problems} == {"chain", "add", "word"}
    for p in problems:
        assert p.answer == _evaluate(p) >= 0, p
        assert p.line.startswith(p.prompt) and p.line.endswith(str(p.answer))
    assert data.synthetic_documents(5000, seed=3) == data.synthetic_documents(5000, seed=3)
    assert data.synthetic_documents(5000, seed=3) != data.synthetic_documents(5000, seed=4)


def test_build_corpus_from_text_files(tmp_path: Path) -> None:
    src = tmp_path / "src.txt"
    src.write_text("\n\n".join(f"Paragraph {i} of plain text, long enough to matter.\n"
                               f"Second line {i} of the same document." for i in range(200)))
    out = tmp_path / "out"
    stats = data.build_corpus(out, text_files=[src], use_gensim=False, seed=0)
    train, held = data.read_documents(out / "train.txt"), data.read_documents(out / "heldout.txt")
    assert stats["heldout"]["documents"] == len(held) == 10
    assert all(d.startswith("Paragraph") for d in held) and set(held).isdisjoint(train)
    # synthetic problems are a minority of train, and their held-out part has its own file
    syn_chars = sum(len(d) for d in train if not d.startswith("Paragraph"))
    assert 0.05 < syn_chars / stats["train"]["characters"] < 0.2
    held_syn = [json.loads(ln) for ln in (out / "heldout_synthetic.jsonl").read_text().splitlines()]
    train_lines = {ln for d in train for ln in d.split("\n")}
    assert held_syn and not any(ln.startswith(h["prompt"]) for h in held_syn for ln in train_lines)
    assert stats == data.build_corpus(out, text_files=[src], use_gensim=False, seed=0)


TEXT = ("The quick brown fox jumps over the lazy dog. It's 47+38=85, isn't it?\n"
        "Caf\u00e9 na\u00efve \u2013 \u201cquotes\u201d \u00a3 3.50 \U0001d11e"
        "  tabs\tand  spaces .\n")


def test_tokenizer_round_trip_and_autotokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = train_bpe([TEXT] * 20, vocab_size=300)
    save_tokenizer(tok, tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert hf.eos_token == hf.bos_token == hf.pad_token == EOS and hf.eos_token_id == 0
    assert hf.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    for x in [TEXT, "unseen \u4e2d\u6587 \U0001f600 text", " leading space", ""]:
        assert hf.decode(hf.encode(x)) == x
        assert tok.decode(tok.encode(x).ids) == x
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                  add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError):
        train_bpe([TEXT], vocab_size=8192)


def test_encode_corpus_separates_documents_and_caches(tmp_path: Path) -> None:
    save_tokenizer(train_bpe([TEXT] * 20, vocab_size=300), tmp_path / "tok")
    text_file = tmp_path / "c.txt"
    data.write_documents(text_file, ["first doc\nline two", "second doc"])
    ids = encode_corpus(tmp_path / "tok", text_file)
    assert ids.ndim == 1 and ids.dtype == np.int64
    assert (ids == 0).sum() == 2 and ids[-1] == 0
    assert len(list(tmp_path.glob("c.tok-*.npy"))) == 1
    assert np.array_equal(encode_corpus(tmp_path / "tok", text_file), ids)
