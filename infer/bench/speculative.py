"""Self-speculative decoding on real checkpoints (issue 27, deliverable 5): how often a shallow
draft is accepted, how many tokens a verification gives, whether that pays at batch 1 on this CPU,
and that speculation changes nothing (the exactness law, checked end to end).

    python -m infer.bench.speculative --models checkpoints/ouro-demo checkpoints/huginn-demo \
        checkpoints/lab-hops --num-prompts 32 --max-tokens 32 --ks 2 4 8 --draft-depths 1 2 \
        --latency-settings 2:1 4:1 2:2 8:2 --repeats 12 --out outputs/speculative     # 4 min, 2 cores

Per checkpoint:
1. acceptance: greedy decoding of `--num-prompts` realistic prompts (held-out corpus text through
   the checkpoint's tokenizer; the lab task's held-out records for a lab checkpoint) once without
   speculation (the reference) and once per (k, draft_depth); each run's tokens and exit depths must
   equal the reference's (asserted after the JSON is written), and its engine
   `speculative_metrics()` is kept. Prompts run in waves of `speculative_max_batch` (and as many
   slots): speculation only runs while at most that many sequences decode, so one wave of all
   prompts would mostly decode without it.
2. latency: `--latency-prompts` prompts decoded one at a time (batch 1) without speculation and with
   each `--latency-settings` pair (default: per draft depth, the k with the most emitted tokens per
   estimated batch-1 launch), interleaved over `--repeats` rounds (alternating order); the
   per-token latency ratio off / on as the median of the per-round ratios with a 95% bootstrap
   interval (offline.ratio_interval), beside the exact work counts of each run (work.py: launches,
   weight bytes; they do not depend on the machine).
The checkpoint's own KV layout and exit criterion are used, except where speculation refuses them
(a shared-slot layout: last_exited instead; an output criterion, kl / entropy_diff: the learned
gate at 0.9, what scripts/demo.py serves huginn-demo with); the JSON says so (`overrides`).

JSON (one file per checkpoint, `--out`/speculative_<name>.json): `acceptance` blocks and `latency`
blocks, each with the engine's speculative_metrics dict (`speculative`): `python -m infer.sim
--acceptance FILE` pools every such dict in the file (all settings); pass one setting's
`draft_accept_prob` as a number to project that setting.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from statistics import median

import torch

from infer.engine.config import add_engine_args, engine_kwargs_from_args
from infer.engine.llm import load_model
from infer.sim.report import model_meta
from infer.sim.stats import ratio_interval
from infer.sim.work import work_counts
from infer.sim.workloads import FIRST_ID, Request
from kv_layouts import DEFAULT_LAYOUT, layout_class
from looplm.policy import OUTPUT_CRITERIA

from .offline import make_engine, run_engine

CHECKPOINTS = ("checkpoints/ouro-demo", "checkpoints/huginn-demo", "checkpoints/lab-hops")
HELDOUT_TEXT = Path(__file__).resolve().parents[2] / ".cache" / "corpus" / "heldout.txt"
# the lab's held-out split: python -m train.tasks.hops --seed 7 --n 400 (docs/results/lab-and-gates.md "The lab";
# training never draws seed 7); read as a file, since infer.bench does not import train
LAB_HELDOUT = Path(__file__).resolve().parents[2] / "eval" / "tasks" / "data" / "lab_hops.jsonl"
SPEC_LAYOUT = "last_exited"  # where the checkpoint's layout shares depth slots (speculation refuses it)
SPEC_CRITERION = {"exit_criterion": "learned", "exit_threshold": 0.9}  # for an output criterion (scripts/demo.py)


# ---------------------------------------------------------------------------------- prompts
def text_requests(tokenizer, n: int, prompt_len: int, max_tokens: int, text: Path = HELDOUT_TEXT) -> list[Request]:
    """`n` windows of `prompt_len` tokens spread evenly over the held-out corpus text (tokenized as
    eval.gates does), each continued for `max_tokens` tokens: real text the model was not trained on."""
    ids = tokenizer(text.read_text())["input_ids"]
    stride = (len(ids) - prompt_len) // n
    if stride < 1:
        raise ValueError(f"{text} has {len(ids)} tokens: too few for {n} windows of {prompt_len}")
    return [Request(ids[i * stride:i * stride + prompt_len], max_tokens, prompt_len, max_tokens) for i in range(n)]


def hops_requests(tokenizer, n: int, path: Path = LAB_HELDOUT) -> list[Request]:
    """The first `n` of the lab task's held-out records (the file eval.lab's and lm-eval's lab_hops
    read), each asked for its answer's tokens plus one (the end of text): the decode eval.lab scores."""
    out = []
    for line in path.read_text().splitlines()[:n]:
        r = json.loads(line)
        n_out = len(tokenizer.encode(r["answer"])) + 1
        p = tokenizer.encode(r["prompt"])
        out.append(Request(p, n_out, len(p), n_out))
    return out


def random_requests(vocab_size: int, n: int, prompt_len: int, max_tokens: int, seed: int = 0) -> list[Request]:
    """Random token ids (a model without a tokenizer: the tiny presets of the tests)."""
    rng = random.Random(seed)
    return [Request([rng.randrange(FIRST_ID, vocab_size) for _ in range(prompt_len)], max_tokens, prompt_len, max_tokens)
            for _ in range(n)]


def prompts_for(source: str, model, tokenizer, a) -> tuple[list[Request], str]:
    """The requests of a checkpoint and what they are: lab records for a lab folder, corpus text
    where there is a tokenizer, random ids otherwise."""
    if tokenizer is None:
        return random_requests(model.cfg.vocab_size, a.num_prompts, a.prompt_len, a.max_tokens), "random token ids"
    if Path(source).name.startswith("lab"):
        return hops_requests(tokenizer, a.num_prompts), f"lab held-out records ({LAB_HELDOUT.relative_to(LAB_HELDOUT.parents[3])}, seed 7)"
    return (text_requests(tokenizer, a.num_prompts, a.prompt_len, a.max_tokens),
            f"{a.prompt_len}-token windows of {HELDOUT_TEXT.relative_to(HELDOUT_TEXT.parents[2])}")


def speculation_settings(cfg, base: dict) -> tuple[dict, dict]:
    """The engine settings with the checkpoint's layout and criterion kept where speculation is exact
    under them, and the overrides made (recorded in the JSON)."""
    over = {}
    layout = base.get("kv_layout") or cfg.kv_layout or DEFAULT_LAYOUT
    if not layout_class(layout).depth_slots_exact:
        over["kv_layout"] = SPEC_LAYOUT
    if (base.get("exit_criterion") or cfg.exit_criterion) in OUTPUT_CRITERIA:
        over.update(SPEC_CRITERION)
    return {**base, **over}, over


# ---------------------------------------------------------------------------------- runs
def decode(eng, mode: dict, requests: list[Request], wave: int) -> tuple[list[tuple[list[int], list[int]]], list[dict]]:
    """Greedy decode of `requests` on `eng` in waves of `wave` (offline.run_engine per wave): each
    request's (tokens, exit depths) and the raw record of every wave."""
    outs, raws = [], []
    for i in range(0, len(requests), wave):
        seqs: list = []
        raws.append(run_engine(eng, mode, requests[i:i + wave], seqs=seqs))
        outs += [(list(s.output_ids), list(s.exit_depths)) for s in seqs]
    return outs, raws


def mismatches(want: list, got: list) -> list[dict]:
    """Requests whose tokens or exit depths differ from the reference's (the first position where)."""
    bad = []
    for i, ((wt, wd), (gt, gd)) in enumerate(zip(want, got)):
        if wt != gt or wd != gd:
            at = next((j for j, x in enumerate(zip(wt, gt, wd, gd)) if x[0] != x[1] or x[2] != x[3]), min(len(wt), len(gt)))
            bad.append({"request": i, "position": at, "tokens": [wt[at:at + 4], gt[at:at + 4]],
                        "depths": [wd[at:at + 4], gd[at:at + 4]]})
    if len(want) != len(got):
        bad.append({"request": None, "count": [len(want), len(got)]})
    return bad


def repeated_share(requests: list[Request], outs: list, n: int = 4) -> float:
    """The share of output tokens that complete an n-gram already seen earlier in the same prompt +
    output: greedy decoding of a small model loops, and a loop is easy to draft."""
    hit = tot = 0
    for r, (toks, _) in zip(requests, outs):
        seq, seen = list(r.prompt_ids) + toks, set()
        for j in range(n, len(seq) + 1):
            g = tuple(seq[j - n:j])
            if j > len(r.prompt_ids):
                hit, tot = hit + (g in seen), tot + 1
            seen.add(g)
    return hit / max(1, tot)


def spec_mode(k: int, draft: int) -> dict:
    return {"name": f"k{k}_d{draft}", "speculative_tokens": k, "draft_depth": draft}


OFF = {"name": "off", "speculative_tokens": 0}


def acceptance(model, tokenizer, requests: list[Request], base: dict, ks, drafts, wave: int,
               name: str = "") -> tuple[dict, list[dict]]:
    """The reference run and one block per (k, draft_depth): the engine's speculative_metrics over
    all waves, and the exactness check against the reference."""
    eng = make_engine(model, tokenizer, OFF, base)
    t0 = time.perf_counter()
    want, raws = decode(eng, OFF, requests, wave)
    depths = [d for _, ds in want for d in ds[1:]]  # [0]: the prefill's token, full depth
    hist = {d: depths.count(d) for d in sorted(set(depths))}
    ref = {"seconds": time.perf_counter() - t0, "output_tokens": sum(len(t) for t, _ in want),
           "mean_exit_depth": sum(depths) / max(1, len(depths)), "exit_depth_hist": hist,
           # a draft at depth d is already final for a token whose policy exits at <= d
           "final_at_draft_depth": {d: sum(c for x, c in hist.items() if x <= d) / max(1, len(depths)) for d in drafts},
           "repeated_4gram_share": repeated_share(requests, want), "engine_config": raws[0]["engine_config"]}
    blocks = []
    for d in drafts:
        for k in ks:
            mode = spec_mode(k, d)
            eng = make_engine(model, tokenizer, mode, base)
            t0 = time.perf_counter()
            got, raws = decode(eng, mode, requests, wave)
            bad = mismatches(want, got)
            blocks.append({"k": k, "draft_depth": d, "exact": not bad, "mismatches": bad[:5],
                           "seconds": time.perf_counter() - t0, "speculative": eng.speculative_metrics()})
            print(row(name, blocks[-1]), flush=True)
    return ref, blocks


def latency(model, tokenizer, requests: list[Request], base: dict, settings: list[tuple[int, int]],
            repeats: int) -> list[dict]:
    """Batch-1 decoding of `requests` (one at a time) without speculation and with each (k, draft)
    setting, interleaved for `repeats` rounds after one warm-up pass each; per setting the
    per-token latency ratio off / on with its interval (and the median ms per token), and both
    runs' work counts."""
    modes = [OFF] + [spec_mode(k, d) for k, d in settings]
    engines = {m["name"]: make_engine(model, tokenizer, m, {**base, "max_batch_size": 1}) for m in modes}
    secs: dict[str, list[float]] = {m["name"]: [] for m in modes}
    work, spec, tokens = {}, {}, {}

    def one_pass(m: dict) -> float:
        eng, rows, n = engines[m["name"]], [], 0
        sp0 = eng.speculative_metrics()
        s = 0.0
        for r in requests:
            raw = run_engine(eng, m, [r])
            s, rows, n = s + raw["seconds"], rows + raw["trace"], n + raw["output_tokens"]
        work[m["name"]] = {**work_counts(rows, model.cfg, model.dtype.itemsize), "complete": traced_core(rows)}
        spec[m["name"]], tokens[m["name"]] = eng.speculative_metrics(sp0), n
        return s

    for m in modes:  # warm-up: first-call costs stay out of the timed rounds
        one_pass(m)
    for rep in range(repeats):
        for m in (modes if rep % 2 == 0 else modes[::-1]):
            secs[m["name"]].append(one_pass(m))
    off = secs["off"]
    out = []
    for m in modes[1:]:
        name, w0, w1 = m["name"], work["off"], work[m["name"]]
        out.append({"k": m["speculative_tokens"], "draft_depth": m["draft_depth"], "prompts": len(requests),
                    "output_tokens": tokens[name], "repeats": repeats,
                    "ms_per_token_off": 1e3 * median(off) / tokens["off"],
                    "ms_per_token_on": 1e3 * median(secs[name]) / tokens[name],
                    "seconds_off": off, "seconds_on": secs[name],
                    "ratio_off_over_on": ratio_interval(off, secs[name]),
                    "work_off": w0, "work_on": w1,
                    "launches_off": sum(w0["launches"].values()), "launches_on": sum(w1["launches"].values()),
                    "weight_bytes_ratio": w1["weight_bytes"] / w0["weight_bytes"],
                    "flops_ratio": w1["flops"] / w0["flops"], "speculative": spec[name]})
    return out


def traced_core(rows: list[dict]) -> bool:
    """Whether the trace holds the core launches of its speculative stages: every draft runs core
    step 1 (no exit comes before it), so a trace with draft rows and no draft core row undercounts
    launches and weight bytes (work.py reads only what the trace holds)."""
    phases = {(r.get("phase"), r["stage"]) for r in rows}
    return not any(ph == "draft" for ph, _ in phases) or ("draft", "core") in phases


# ---------------------------------------------------------------------------------- report
def row(name: str, b: dict) -> str:
    sp = b["speculative"]
    return (f"{name:12s} k={b['k']} d={b['draft_depth']}  accept {sp['acceptance_rate']:.3f}  "
            f"p(draft) {sp['draft_accept_prob']:.3f}  tok/verif {sp['tokens_per_verification']:.2f}  "
            f"verifs {sp['verifications']}  exact {b['exact']}")


def latency_row(name: str, b: dict) -> str:
    r = b["ratio_off_over_on"]
    return (f"{name:12s} k={b['k']} d={b['draft_depth']}  ms/token off {b['ms_per_token_off']:.2f} on "
            f"{b['ms_per_token_on']:.2f}  off/on {r['median']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] ({r['verdict']})  "
            f"launches {b['launches_off']} -> {b['launches_on']}  weight bytes x{b['weight_bytes_ratio']:.3f}" +
            ("" if b["work_on"]["complete"] else "  (trace lacks the speculative core launches: work undercounted)"))


def each(results: dict[str, dict], part: str):
    """(checkpoint, block) for every block of `part` ("acceptance" or "latency") of every checkpoint."""
    return ((name, b) for name, res in results.items() for b in res[part])


def _table(head: list[str], rows) -> list[str]:
    """A markdown table: the header `head`, its rule, one line per row of cells."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def tables(results: dict[str, dict]) -> list[str]:
    """The markdown tables of docs/results/speculation.md: acceptance per checkpoint x setting, the
    reference's depths per checkpoint, then batch-1 latency."""
    def acceptance(name, b):
        sp = b["speculative"]
        return [name, str(b["draft_depth"]), str(b["k"]), f"{sp['acceptance_rate']:.3f}",
                f"{sp['draft_accept_prob']:.3f}", f"{sp['tokens_per_verification']:.2f}", str(sp["verifications"]),
                "yes" if b["exact"] else "NO"]

    def reference(name, res):
        ref = res["reference"]
        return [name, f"{res['num_prompts']} x {res['prompts']}", str(res["overrides"] or "none"),
                f"{ref['mean_exit_depth']:.2f}", " / ".join(f"{v:.2f}" for v in ref["final_at_draft_depth"].values()),
                f"{ref['repeated_4gram_share']:.2f}"]

    def latency(name, b):
        r = b["ratio_off_over_on"]
        return [name, str(b["k"]), str(b["draft_depth"]), f"{b['ms_per_token_off']:.2f}", f"{b['ms_per_token_on']:.2f}",
                f"{r['median']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]", f"{b['launches_off']} -> {b['launches_on']}",
                f"{b['weight_bytes_ratio']:.3f}", f"{b['flops_ratio']:.3f}"]

    return [*_table(["checkpoint", "draft depth", "k", "acceptance rate", "P(draft accepted)", "tokens / verification",
                     "verifications", "exact"], (acceptance(*x) for x in each(results, "acceptance"))), "",
            *_table(["checkpoint", "prompts", "settings changed", "mean exit depth",
                     "tokens final at draft depth 1 / 2", "output 4-grams seen before"],
                    (reference(*x) for x in results.items())), "",
            *_table(["checkpoint", "k", "draft depth", "ms/token off", "ms/token on", "off / on (95% CI)",
                     "launches off -> on", "weight bytes on / off", "FLOPs on / off"],
                    (latency(*x) for x in each(results, "latency")))]


def pick_latency_settings(blocks: list[dict], depth: float, arg: list[str] | None) -> list[tuple[int, int]]:
    """`K:D` pairs as given, else per draft depth the k with the most tokens per launch at batch 1,
    where a launch costs about the same whatever it carries: a window's emitted tokens over its
    launches, estimated as k draft rounds of (prelude + d core steps + coda), the verifier's core
    steps from d to the mean exit depth `depth` of the reference, and its coda."""
    if arg:
        return [tuple(int(x) for x in s.split(":")) for s in arg]
    best: dict[int, tuple[float, int]] = {}
    for b in blocks:
        sp, k, d = b["speculative"], b["k"], b["draft_depth"]
        score = sp["emitted"] / max(1, sp["stages"]) / (k * (d + 2) + max(0.0, depth - d) + 1)
        if score > best.get(d, (-1.0, 0))[0]:
            best[d] = (score, k)
    return [(k, d) for d, (_, k) in sorted(best.items())]


def bench_checkpoint(source: str, model, tokenizer, requests: list[Request], prompts: str, base: dict,
                     ks=(2, 4, 8), drafts=(1, 2), latency_prompts: int = 4, latency_settings=None,
                     repeats: int = 5) -> dict:
    """Everything measured on one checkpoint (the JSON's content)."""
    base, over = speculation_settings(model.cfg, base)
    wave = base.setdefault("max_batch_size", base.get("speculative_max_batch", 8))
    # a pool for one wave at full context (the CPU default, 512 MiB per engine, costs more to fill
    # than these runs take)
    base.setdefault("kv_cache_tokens", wave * model.cfg.max_position)
    ref, blocks = acceptance(model, tokenizer, requests, base, ks, drafts, wave, Path(source).name)
    settings = pick_latency_settings(blocks, ref["mean_exit_depth"], latency_settings)
    lat = latency(model, tokenizer, requests[:latency_prompts], base, settings, repeats) if repeats > 0 else []
    return {**model_meta(model, source, tokenizer), "prompts": prompts, "num_prompts": len(requests),
            "prompt_tokens": sum(r.prompt_len for r in requests), "max_tokens": max(r.output_len for r in requests),
            "engine_settings": base, "overrides": over, "wave": wave, "reference": ref,
            "exact": all(b["exact"] for b in blocks), "acceptance": blocks, "latency": lat,
            "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(CHECKPOINTS))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64, help="corpus-text prompts: tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="corpus-text prompts: tokens decoded (EOS ignored)")
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8], help="speculative_tokens values")
    p.add_argument("--draft-depths", type=int, nargs="+", default=[1, 2])
    p.add_argument("--latency-prompts", type=int, default=4, help="prompts decoded one at a time per latency pass")
    p.add_argument("--latency-settings", nargs="*", metavar="K:D",
                   help="(k, draft_depth) pairs timed at batch 1 (default: per draft depth, the k with the most "
                        "tokens per verification per launch)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved latency rounds (0: no latency)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", type=Path, default=Path("outputs/speculative"))
    add_engine_args(p, skip=("trace", "speculative_tokens", "draft_depth"))
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    base = engine_kwargs_from_args(a)
    a.out.mkdir(parents=True, exist_ok=True)
    command = "python -m infer.bench.speculative " + " ".join(argv if argv is not None else sys.argv[1:])
    inexact, results = [], {}
    for src in a.models:
        model, tok = load_model(src, a.dtype)
        reqs, prompts = prompts_for(src, model, tok, a)
        res = bench_checkpoint(src, model, tok, reqs, prompts, dict(base), a.ks, a.draft_depths, a.latency_prompts,
                               a.latency_settings, a.repeats)
        name = Path(src).name
        path = a.out / f"speculative_{name}.json"
        path.write_text(json.dumps({"command": command, **res}, indent=1))
        for b in res["latency"]:
            print(latency_row(name, b), flush=True)
        print(f"wrote {path}", flush=True)
        results[name] = res
        inexact += [(name, b["k"], b["draft_depth"], b["mismatches"]) for b in res["acceptance"] if not b["exact"]]
    print("\n".join(tables(results)), flush=True)
    # the exactness law: speculation must not change a token or an exit depth
    assert not inexact, f"speculation changed outputs: {inexact}"


if __name__ == "__main__":
    main()
