"""train/datasource.py's dataset formats, loss masks, document arrays and packing: tiny JSONL files,
the demo checkpoint's ChatML tokenizer, CPU, seconds."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from looplm.cli import UserError  # noqa: E402
from train.datasource import add_dataset_args, dataset_kwargs, from_dataset, from_npy, summary  # noqa: E402

TOK = Path(__file__).resolve().parents[1] / "checkpoints" / "ouro-demo"
pytestmark = pytest.mark.skipif(not (TOK / "tokenizer.json").exists(), reason="checkpoints/ouro-demo is missing")


@pytest.fixture(scope="module")
def tok():
    from looplm.io import load_tokenizer
    return load_tokenizer(TOK)


def jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build(tmp_path, src, ctx=64, **kw):
    return from_dataset(str(src), kw.pop("column", "text"), TOK, ctx, kw.pop("heldout_frac", 0.0),
                        cache_root=tmp_path / "cache", **kw)


def conv(i: int) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"question {i}?"},
            {"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": "and then"},
            {"role": "assistant", "content": f"more {i * 7}"}]


def runs(row, mask):
    """The contiguous runs of masked tokens of one window."""
    out, cur = [], []
    for t, m in zip(row.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def check_windows(data, split="train"):
    """Document numbers contiguous from 0, masks False at document starts and on padding."""
    ids, mask, doc = ((data.train, data.train_mask, data.train_doc) if split == "train"
                      else (data.heldout, data.heldout_mask, data.heldout_doc))
    assert ids.shape == mask.shape == doc.shape and mask.dtype == bool and doc.dtype == np.int32
    for r in range(len(ids)):
        d = doc[r]
        assert d[0] == 0 and set(np.diff(d).tolist()) <= {0, 1}
        starts = np.r_[0, np.flatnonzero(np.diff(d)) + 1]
        assert not mask[r][starts].any()


def test_format_detection_and_override(tmp_path):
    msgs = jsonl(tmp_path / "m.jsonl", [{"messages": conv(i), "text": f"plain {i}"} for i in range(3)])
    pc = jsonl(tmp_path / "pc.jsonl", [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(3)])
    txt = jsonl(tmp_path / "t.jsonl", [{"body": f"some text {i}"} for i in range(3)])
    assert build(tmp_path, msgs).meta["format"] == "messages"
    assert build(tmp_path, pc).meta["format"] == "prompt_completion"
    assert build(tmp_path, txt, column="body").meta["format"] == "text"
    forced = build(tmp_path, msgs, fmt="text")
    assert forced.meta["format"] == "text"
    # the cache key holds the format (and the loss flags): no reuse across them
    assert forced.meta["cache"] != build(tmp_path, msgs).meta["cache"]
    assert build(tmp_path, msgs, assistant_only_loss=False).meta["cache"] != build(tmp_path, msgs).meta["cache"]
    with pytest.raises(UserError, match="no column 'text'"):
        build(tmp_path, txt)
    with pytest.raises(UserError, match="no column 'messages'"):
        build(tmp_path, txt, fmt="messages")


def test_assistant_mask_is_exactly_the_assistant_turns(tmp_path, tok):
    rows = [conv(i) for i in range(4)]
    data = build(tmp_path, jsonl(tmp_path / "m.jsonl", [{"messages": m} for m in rows]), ctx=128, packing=False)
    assert len(data.train) == 4 and not data.meta["skipped_rows"]
    for r, m in enumerate(rows):
        ids, mask = data.train[r], data.train_mask[r]
        n = int((data.train_doc[r] == 0).sum())
        # the window is the rendered conversation, EOS, then padding
        assert tok.decode(ids[:n]) == tok.apply_chat_template(m, tokenize=False) + tok.eos_token
        assert [tok.decode(x) for x in runs(ids, mask)] == [
            f"{m[2]['content']}<|im_end|>\n", f"{m[4]['content']}<|im_end|>\n{tok.eos_token}"]
    # the user turns' text changes no masked token
    other = [[{**x, "content": x["content"] * 3} if x["role"] == "user" else x for x in m] for m in rows]
    data2 = build(tmp_path, jsonl(tmp_path / "m2.jsonl", [{"messages": m} for m in other]), ctx=128, packing=False)
    for r in range(4):
        assert runs(data.train[r], data.train_mask[r]) == runs(data2.train[r], data2.train_mask[r])
    # without assistant-only loss every token of the document counts but its first
    full = build(tmp_path, tmp_path / "m.jsonl", ctx=128, packing=False, assistant_only_loss=False)
    n = int((full.train_doc[0] == 0).sum())
    assert not full.train_mask[0][0] and full.train_mask[0][1:n].all() and not full.train_mask[0][n:].any()


def test_completion_only_mask(tmp_path, tok):
    rows = [{"prompt": f"What is {i}+{i}? ", "completion": f"It is {2 * i}."} for i in range(3)]
    data = build(tmp_path, jsonl(tmp_path / "pc.jsonl", rows), packing=False)
    for r, row in enumerate(rows):
        n = int((data.train_doc[r] == 0).sum())
        assert tok.decode(data.train[r][:n]) == row["prompt"] + row["completion"] + tok.eos_token
        assert [tok.decode(x) for x in runs(data.train[r], data.train_mask[r])] == [row["completion"] + tok.eos_token]
    # conversational prompt/completion: the completion after the generation prompt
    chat = [{"prompt": [{"role": "user", "content": f"hi {i}"}],
             "completion": [{"role": "assistant", "content": f"hello {i}"}]} for i in range(3)]
    data = build(tmp_path, jsonl(tmp_path / "cpc.jsonl", chat), packing=False)
    assert [tok.decode(x) for x in runs(data.train[1], data.train_mask[1])] == [f"hello 1<|im_end|>\n{tok.eos_token}"]
    everything = build(tmp_path, tmp_path / "pc.jsonl", packing=False, completion_only_loss=False)
    assert everything.train_mask[0][1:].sum() == (everything.train_doc[0] == 0).sum() - 1


def test_packing_keeps_documents_whole(tmp_path, tok):
    rng = np.random.default_rng(0)
    texts = [" ".join(f"w{int(x)}" for x in rng.integers(0, 50, rng.integers(1, 12))) for _ in range(60)]
    src = jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    data = build(tmp_path, src, ctx=48, heldout_frac=0.2)
    want = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    assert all(len(w) <= 49 for w in want) and data.meta["split_documents"] == 0
    got, per_split = [], {}
    for split in ("train", "heldout"):
        per_split[split] = len(got)
        check_windows(data, split)
        ids, mask, doc = ((data.train, data.train_mask, data.train_doc) if split == "train"
                          else (data.heldout, data.heldout_mask, data.heldout_doc))
        for r in range(len(ids)):
            n_docs = 0
            for k in np.unique(doc[r]):
                seg, m = ids[r][doc[r] == k].tolist(), mask[r][doc[r] == k]
                if seg in want:  # a whole document (not padding): every token but its first counts
                    got.append(seg)
                    assert not m[0] and m[1:].all()
                    n_docs += 1
                else:  # padding: only after the documents, the pad id, never counted
                    assert k == doc[r].max() and set(seg) == {tok.pad_token_id} and not m.any()
            assert n_docs >= 1
    assert sorted(got) == sorted(want)  # every document exactly once, whole
    # held out: the last documents, never trained on; packing is dense and deterministic
    n_held = data.meta["heldout_documents"]
    assert n_held >= 1 and data.meta["documents"] + n_held == 60
    assert sorted(got[per_split["heldout"]:]) == sorted(want[-n_held:])
    assert len(data.train) < data.meta["documents"] / 2
    again = build(tmp_path / "again", src, ctx=48, heldout_frac=0.2)
    assert np.array_equal(again.train, data.train) and np.array_equal(again.train_doc, data.train_doc)
    # batch / batch_mask / batch_doc draw the same rows; eval_* the same windows
    seed = [3, 1, 0]
    b, bm, bd = data.batch(8, 48, seed), data.batch_mask(8, 48, seed), data.batch_doc(8, 48, seed)
    for row, mrow, drow in zip(b.numpy(), bm.numpy(), bd.numpy()):
        hits = [i for i in range(len(data.train)) if np.array_equal(data.train[i], row)]
        assert hits and all(np.array_equal(data.train_mask[i], mrow) and np.array_equal(data.train_doc[i], drow)
                            for i in hits)
    assert data.eval_doc(48, 1).shape == data.eval(48, 1).shape == data.eval_mask(48, 1).shape == (1, 49)


def test_no_packing_is_one_document_per_window(tmp_path):
    src = jsonl(tmp_path / "t.jsonl", [{"text": f"document number {i}"} for i in range(5)])
    data = build(tmp_path, src, packing=False)
    assert len(data.train) == 5
    assert all(set(d.tolist()) == {0, 1} for d in data.train_doc)  # the document, then padding
    check_windows(data)


def test_bad_rows_raise_one_line_or_are_skipped_and_counted(tmp_path):
    rows = [{"messages": conv(0)}, {"messages": conv(1)},
            {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},
            {"messages": [{"role": "user", "content": "no answer"}]},
            {"messages": None},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
            {"messages": conv(2)}]
    src = jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(UserError) as e:
        build(tmp_path, src)
    msg = str(e.value)
    assert "\n" not in msg and "bad.jsonl" in msg and "'train'" in msg and "row 2" in msg and "wizard" in msg
    data = build(tmp_path, src, skip_bad_rows=True)
    assert data.meta["skipped_rows"] == {"unknown role": 1, "no assistant turn": 1, "missing messages": 1,
                                         "empty content": 1}
    assert data.meta["documents"] == 3
    assert "skipped rows:" in summary(data.meta)
    # text: a non-string row is bad, an empty one skipped (and counted) either way
    txt = jsonl(tmp_path / "t.jsonl", [{"text": "one"}, {"text": ""}, {"text": "three"}])
    assert build(tmp_path, txt).meta["skipped_rows"] == {"empty text": 1}
    txt2 = jsonl(tmp_path / "t2.jsonl", [{"text": "one"}, {"text": None}, {"text": "three"}])
    with pytest.raises(UserError, match=r"t2.jsonl split 'train' row 1: text is missing"):
        build(tmp_path, txt2)
    assert build(tmp_path, txt2, skip_bad_rows=True).meta["skipped_rows"] == {"missing text": 1}
    pc = jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": ""}])
    with pytest.raises(UserError, match="row 1: completion is empty"):
        build(tmp_path, pc)


def test_long_documents_are_split_into_window_pieces_and_counted(tmp_path, tok):
    long = " ".join(f"w{i}" for i in range(200))
    src = jsonl(tmp_path / "t.jsonl", [{"text": long}, {"text": "short one"}])
    data = build(tmp_path, src, ctx=32)
    assert data.meta["split_documents"] == 1 and data.meta["documents"] == 2
    full = tok(long, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    pieces = [full[a:a + 33] for a in range(0, len(full), 33)]
    rows = [r[d == k].tolist() for r, d in zip(data.train, data.train_doc) for k in np.unique(d)]
    for p in pieces:  # every token kept: each piece a document of its own somewhere
        assert p in rows
    for r, d, m in zip(data.train, data.train_doc, data.train_mask):
        starts = np.flatnonzero(np.diff(d, prepend=-1) != 0)
        assert not m[starts].any()  # a piece's first token is not a target: its predecessor is elsewhere
    # a prompt longer than the window: the prompt-only piece is left out (counted), the completion kept
    pc = jsonl(tmp_path / "pc.jsonl", [{"prompt": long, "completion": "x"}, {"prompt": "a", "completion": "b"}])
    meta = build(tmp_path, pc, ctx=32).meta
    assert meta["split_documents"] == 1 and meta["empty_pieces"] >= 1 and meta["skipped_rows"] == {}


def test_save_to_disk_and_folder_of_jsonl(tmp_path, tok):
    import datasets
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"messages": conv(i)} for i in range(4)]),
        "validation": datasets.Dataset.from_list([{"messages": conv(10 + i)} for i in range(2)])})
    dd.save_to_disk(str(tmp_path / "disk"))
    data = build(tmp_path, tmp_path / "disk", ctx=128)
    assert data.meta["format"] == "messages" and data.meta["heldout_documents"] == 2
    assert data.meta["documents"] == 4
    check_windows(data, "heldout")
    assert "answer 10<|im_end|>" in tok.decode(data.heldout[0][data.heldout_mask[0]])
    folder = tmp_path / "folder"
    folder.mkdir()
    for j in range(2):
        jsonl(folder / f"part{j}.jsonl", [{"prompt": f"p{j}{i} ", "completion": f"c{j}{i}"} for i in range(3)])
    data = build(tmp_path, folder, heldout_frac=0.2)
    assert data.meta["format"] == "prompt_completion"
    assert data.meta["documents"] + data.meta["heldout_documents"] == 6 and data.meta["heldout_documents"] >= 1


def test_args_and_streams():
    p = argparse.ArgumentParser()
    add_dataset_args(p)
    a = p.parse_args(["--dataset", "x.jsonl", "--dataset-format", "messages", "--no-assistant-only-loss",
                      "--no-packing", "--skip-bad-rows"])
    assert (a.dataset, a.text_column, a.heldout_frac) == ("x.jsonl", "text", 0.1)
    assert dataset_kwargs(a) == {"fmt": "messages", "assistant_only_loss": False, "completion_only_loss": True,
                                 "packing": False, "skip_bad_rows": True}
    assert dataset_kwargs(p.parse_args([]))["packing"] is True


def test_token_streams_have_no_doc_arrays(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(500) % 97)
    data = from_npy(tmp_path / "t.npy")
    assert data.batch_doc(2, 16, [0]) is None and data.eval_doc(16, 2) is None
    assert data.batch(2, 16, [0]).shape == (2, 17)


def test_template_that_is_not_prefix_stable_is_named(tmp_path):
    """A template that renders a conversation's first turns differently inside the whole one (here:
    a message count up front) cannot give assistant spans: one UserError naming it."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_bytes((TOK / "tokenizer.json").read_bytes())
    cfg = json.loads((TOK / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages|length }}" + cfg["chat_template"]
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    src = jsonl(tmp_path / "m.jsonl", [{"messages": conv(0)}])
    with pytest.raises(UserError, match=r"m.jsonl split 'train' row 0: the chat template of .* is not prefix-stable"):
        from_dataset(str(src), "text", tok_dir, 128, 0.0, cache_root=tmp_path / "c")
    # without assistant-only loss the whole rendering counts: no spans needed
    data = from_dataset(str(src), "text", tok_dir, 128, 0.0, cache_root=tmp_path / "c", assistant_only_loss=False)
    assert data.meta["documents"] == 1
