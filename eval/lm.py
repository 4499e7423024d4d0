"""The lm-eval model `looped`: every request runs through the CDB engine, so the accuracy measured
is the accuracy served at the chosen exit threshold, r_min, r_max, lookahead and KV layout.

- `generate_until`: `LLM.generate` with the request's `until` stop strings and `max_gen_toks`.
- `loglikelihood` / `loglikelihood_rolling`: teacher forcing in the engine (`forced_output`): the
  context is prefilled at full depth, so the first continuation token's log-prob comes from full
  depth (as the first generated token does when serving); every later continuation token is
  decoded with the adaptive exit policy.
- Per task, the mean exit depth of the adaptively decoded tokens and the share of scored tokens
  that were adaptive are reported beside the task's metrics (`exit_depth`, `adaptive_frac`).

    lm_eval.simple_evaluate(model="looped", model_args="pretrained=checkpoints/ouro-demo,exit_threshold=0.7",
                            tasks=["looped_suite"], task_manager=eval.lm.task_manager())
"""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.evaluator import simple_evaluate as _lm_eval_simple_evaluate
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from infer.engine.config import EngineConfig
from infer.engine.llm import LLM
from infer.engine.progress import progress
from infer.engine.sampling_params import SamplingParams, check_priority
from infer.sim import replay as RP
from looplm.errors import ParamError
from looplm.io import load_tokenizer
from looplm.model import LoopedLM

log = logging.getLogger(__name__)
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
DEPTH_METRICS = ("exit_depth", "adaptive_frac")


def _opt(cast, v):
    """lm-eval parses model_args values itself ("0.7" -> 0.7, "none" -> None); accept both forms."""
    return None if v is None or (isinstance(v, str) and v.lower() in ("", "none", "null")) else cast(v)


def _bool(v) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).lower()
    if s not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError(f"not a boolean: {v!r}")
    return s in ("1", "true", "yes", "on")


def task_manager(include_defaults: bool = False, extra_paths: list[str | Path] | None = None):
    """A TaskManager that knows the local tasks (eval/tasks). Without the lm-eval defaults it
    indexes in ~0.1 s instead of ~16 s; pass include_defaults=True for arc_easy, hellaswag, ..."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(TASKS_DIR), *map(str, extra_paths or [])], include_defaults=include_defaults)


def engine_settings(args: dict[str, Any]) -> dict[str, Any]:
    """The EngineConfig fields among lm-eval model_args, cast to their field types (lm-eval passes
    strings or its own parse of them); settings left out stay None (the checkpoint decides)."""
    cast = {"bool": _bool, "int": int, "float": float, "str": str}
    out = {}
    for f in fields(EngineConfig):
        if f.name in args:
            v, kind = args[f.name], f.type.split(" | ")
            # ("auto" where a setting takes it: refill, min_coda_batch; EngineConfig refuses it elsewhere)
            try:
                out[f.name] = v if v == "auto" and "str" in kind else _opt(cast[kind[0]], v)
            except ValueError:
                raise ParamError(f.name, f"model_args {f.name}={v!r}: expected {kind[0]}"
                                         f"{' or auto' if 'str' in kind[1:] else ''}") from None
    return {k: v for k, v in out.items() if v is not None}


@register_model("looped")
class LoopedEvalLM(TemplateLM):
    """model_args: `pretrained` (folder or LoopedLM), `dtype`, `device`, `r_max`, `load_format`
    ("dummy": random weights of the folder's shape, as vLLM's), `tokenizer`,
    `batch_size` (the engine's max_batch_size), `max_gen_toks`, `add_bos_token`, `priority` (every
    request's, under scheduling_policy=priority), `record_exits` (a file: the exits of this
    evaluation, each task a workload, for `python -m infer.sim --replay-exits FILE`), and any
    EngineConfig field (policy, kv_layout, exit_threshold, r_min, lookahead, scheduling_policy, ...;
    unset: the checkpoint's)."""

    def __init__(self, pretrained: str | LoopedLM, r_max: int | None = None, dtype: str = "float32",
                 device: str = "cpu", batch_size: int | str = 32, max_batch_size: int | None = None,
                 tokenizer=None, max_gen_toks: int = 256, add_bos_token: bool = False, load_format: str = "auto",
                 priority: int | str = 0, record_exits: str | Path | None = None, **model_args):
        super().__init__()
        bs = 32 if str(batch_size).startswith("auto") else int(batch_size)
        if str(batch_size).startswith("auto") and max_batch_size:
            bs = int(max_batch_size)
        settings = engine_settings(model_args)
        unknown = sorted(set(model_args) - set(EngineConfig.field_names()))
        if unknown:
            raise ParamError(unknown[0], f"unknown model_args {unknown}; known: pretrained, r_max, dtype, device, "
                                         f"load_format, batch_size, tokenizer, max_gen_toks, add_bos_token, priority, "
                                         f"record_exits, "
                                         f"{', '.join(EngineConfig.field_names())}")
        r_max = _opt(int, r_max)
        try:
            self.priority = int(priority)
        except ValueError:
            raise ParamError("priority", f"model_args priority must be an integer, got {priority!r}") from None
        check_priority(self.priority, settings.get("scheduling_policy", "fcfs"))  # before loading the model
        device = str(device)
        if device.startswith("cuda") and not torch.cuda.is_available():  # lm-eval's CLI default is cuda:0
            log.warning("device %s requested but CUDA is unavailable: using cpu", device)
            device = "cpu"
        instance = isinstance(pretrained, LoopedLM)
        # r_max: a folder is loaded with the config override (it may exceed the trained depth, as
        # Huginn's does); a model instance keeps its config and caps each request instead.
        self.llm = LLM(pretrained, dtype=str(dtype), device=device, r_max=None if instance else r_max,
                       load_format=str(load_format), tokenizer=self._tokenizer(tokenizer), **{"max_batch_size": bs, **settings})
        c = self.llm.config
        self.settings = dict(exit_threshold=c.exit_threshold, r_min=c.r_min, r_max=r_max, lookahead=c.lookahead,
                             kv_layout=c.kv_layout, policy=c.policy, full_depth=c.full_depth,
                             exit_criterion=c.exit_criterion)
        self.tokenizer = self.llm.tokenizer
        if self.tokenizer is None:
            raise ValueError(f"{pretrained!r} has no tokenizer: pass model_args tokenizer=<folder>")
        self.model = self.llm.model
        self._r_max_req = r_max if instance else None
        # the engine's one context length (the checkpoint's, capped by what the KV pool holds): every
        # loglikelihood window and generation prompt is cut to fit it, so each one can run
        self.max_length = self.llm.engine.max_model_len
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = _bool(add_bos_token)
        self.batch_size = bs
        self._device = torch.device(device)
        self.pretrained = pretrained if isinstance(pretrained, str) else type(pretrained).__name__
        self.reset_depth_stats()
        # record_exits: task -> recorded requests (replay.record_block's rows), written after each call
        self.record_path = Path(record_exits) if record_exits else None
        self.recorded: dict[str, list[dict]] = defaultdict(list)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> LoopedEvalLM:
        """model_args win over lm-eval's own flags (--device, --batch_size) instead of lm-eval's
        duplicate-keyword TypeError when both name one (e.g. model_args device=cpu and --device)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **arg_dict})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> LoopedEvalLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @staticmethod
    def _tokenizer(tok):
        if tok is None or not isinstance(tok, (str, Path)):
            return tok
        t = load_tokenizer(Path(tok))
        if t is None:
            raise ValueError(f"no tokenizer files in {tok}")
        return t

    # ------------------------------------------------------------------ tokenizer surface
    @property
    def eot_token_id(self) -> int:
        t = self.tokenizer.eos_token_id
        return t if t is not None else self.model.cfg.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        t = self.tokenizer.bos_token_id
        return t if t is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        ids = self.tokenizer.encode(string, add_special_tokens=False)
        if add_special_tokens if add_special_tokens is not None else self.add_bos_token:
            ids = [self.prefix_token_id] + ids
        return ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "looped").replace("/", "__")

    # ------------------------------------------------------------------ exit-depth bookkeeping
    def reset_depth_stats(self) -> None:
        self._depth = defaultdict(lambda: [0, 0, 0])  # task -> [sum of depths, adaptive tokens, scored tokens]

    def _count(self, task: str | None, depths: list[int], scored: int) -> None:
        d = self._depth[task or "unknown"]
        d[0] += sum(depths)
        d[1] += len(depths)
        d[2] += scored

    def depth_stats(self) -> dict[str, dict[str, float]]:
        return {t: {"exit_depth": s / n if n else float("nan"), "adaptive_frac": n / max(1, m)}
                for t, (s, n, m) in self._depth.items()}

    def mean_exit_depth(self) -> float:
        """Over every adaptively decoded token of every task."""
        s, n = (sum(v[i] for v in self._depth.values()) for i in (0, 1))
        return s / n if n else float("nan")

    def get_model_info(self) -> dict[str, Any]:
        """lm-eval adds this to results["config"] after evaluating (see with_exit_depths)."""
        return {"model_kind": "looped", "pretrained": str(self.pretrained), "exit_settings": dict(self.settings),
                "r_max_model": self.model.cfg.r_max, "exit_depths": self.depth_stats()}

    # ------------------------------------------------------------------ requests
    def _run(self, seqs, disable_tqdm: bool, desc: str) -> None:
        eng = self.llm.engine
        bar = progress(len(seqs), desc, disable=disable_tqdm)
        done = 0
        with torch.inference_mode():
            while eng.has_unfinished():
                eng.step()
                n = sum(s.finished for s in seqs)
                bar.update(n - done)
                done = n
        bar.close()

    def _tracker(self, sp: SamplingParams) -> RP.RecordingTracker | None:
        """record_exits: a tracker that keeps every exit score it reads, for the request's policy."""
        if self.record_path is None:
            return None
        eng = self.llm.engine
        return RP.RecordingTracker(eng.policy.override(threshold=sp.exit_threshold, r_min=sp.r_min, r_max=sp.r_max))

    def _record(self, done: list) -> None:
        """record_exits: add finished requests [(task, Sequence)] and rewrite the file (replay.write:
        each task is a workload of the recorded lengths and scores)."""
        if self.record_path is None:
            return
        for task, s in done:
            self.recorded[task or "unknown"].append({"prompt_len": len(s.prompt_ids), "output_len": len(s.output_ids),
                                                     "scores": s.tracker.rows})
        eng = self.llm.engine
        RP.write(self.record_path, model=str(self.pretrained), policy=eng.policy, model_r_min=self.model.cfg.r_min,
                 kv_layout=eng.config.kv_layout,
                 workloads={t: {"scale": None, "seed": None, "requests": rs} for t, rs in self.recorded.items()})

    def _fit(self, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
        """Left-truncate so that context + continuation fit the context window (the engine stops a
        sequence at max_model_len tokens)."""
        n = self.max_length
        if len(cont) >= n:
            log.warning("continuation of %d tokens truncated to the last %d", len(cont), n - 1)
            cont = cont[-(n - 1):]
        return ctx[-(n - len(cont)):], cont

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, tasks: list[str | None] | None = None
                              ) -> list[tuple[float, bool]]:
        eng = self.llm.engine
        tasks = tasks or [None] * len(requests)
        sp = SamplingParams(r_max=self._r_max_req)
        seqs = {}
        for i, (_, ctx, cont) in enumerate(requests):
            if cont:
                ctx, cont = self._fit(list(ctx) or [self.prefix_token_id], list(cont))
                seqs[i] = eng.add_request(ctx, sp, forced_output=cont, priority=self.priority,
                                          tracker=self._tracker(sp))
        self._run(list(seqs.values()), disable_tqdm, "loglikelihood")
        self._record([(tasks[i], s) for i, s in seqs.items()])
        out = []
        for i in range(len(requests)):
            s = seqs.get(i)
            if s is None:  # an empty continuation has probability 1
                out.append((0.0, True))
                continue
            self._count(tasks[i], s.exit_depths[1:], len(s.exit_depths))
            out.append((float(sum(s.logprobs)), bool(s.forced_greedy)))
            eng.release(s.request_id)
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        new = []
        for req in requests:
            context, continuation = req.args
            if context == "":
                cont = self.tok_encode(continuation, add_special_tokens=False)
                ctx, cont = ([self.prefix_token_id], cont) if not cont or cont[0] != self.prefix_token_id \
                    else (cont[:1], cont[1:])
            else:
                ctx, cont = self._encode_pair(context, continuation)
            new.append(((context, continuation), ctx, cont))
        return self._loglikelihood_tokens(new, disable_tqdm, [r.task_name for r in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, req in enumerate(requests):
            toks = self.tok_encode(req.args[0], add_special_tokens=False)
            # max_seq_len = max_length - 1: each window's context + continuation is then at most
            # max_length tokens, which the engine holds without truncation
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    toks, self.prefix_token_id, self.max_length - 1, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm, [requests[i].task_name for i in owner])
        total = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, scores):
            total[i] += lp
        return total

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        for req in requests:
            context, gen_kwargs = req.args
            kw = dict(gen_kwargs or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = int(kw.pop("max_gen_toks", self.max_gen_toks))
            do_sample = bool(kw.pop("do_sample", False))
            temperature = float(kw.pop("temperature", 0.0)) if do_sample else 0.0
            sp = SamplingParams(max_tokens=max_gen, temperature=temperature, top_p=float(kw.pop("top_p", 1.0)),
                                top_k=int(kw.pop("top_k", 0) or 0), stop=[u for u in until if u],
                                seed=kw.pop("seed", None), r_max=self._r_max_req)
            ids = self.tok_encode(context) or [self.prefix_token_id]
            prompts.append(ids[-max(1, self.max_length - max_gen):])
            params.append(sp)
        if self.record_path is None:
            outs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm, priority=self.priority)
        else:  # (the engine directly: LLM.generate, as vLLM's, takes no exit trackers)
            eng = self.llm.engine
            seqs = [eng.add_request(p, sp, priority=self.priority, tracker=self._tracker(sp))
                    for p, sp in zip(prompts, params)]
            self._run(seqs, disable_tqdm, "generate_until")
            self._record([(req.task_name, s) for req, s in zip(requests, seqs)])
            outs = [eng.output(s) for s in seqs]
            for s in seqs:
                eng.release(s.request_id)
        for req, o in zip(requests, outs):
            self._count(req.task_name, o.exit_depths[1:], len(o.exit_depths))
        return [o.text for o in outs]


def with_exit_depths(results: dict | None) -> dict | None:
    """Copy the per-task exit depths (results["config"]["exit_depths"]) beside each task's metrics,
    as `exit_depth,none` and `adaptive_frac,none`, so tables, JSON files and loggers show them."""
    if not results:
        return results
    stats = results.get("config", {}).get("exit_depths") or {}
    for task, metrics in results.get("results", {}).items():
        for k, v in stats.get(task, {}).items():
            metrics[f"{k},none"] = v
    return results


def simple_evaluate(model, *args, **kwargs) -> dict | None:
    """`lm_eval.simple_evaluate` plus the per-task exit depths (counted afresh for every call).
    The CLI (eval/__main__.py) installs this in place of lm_eval.simple_evaluate."""
    if isinstance(model, LoopedEvalLM):
        model.reset_depth_stats()
    return with_exit_depths(_lm_eval_simple_evaluate(model, *args, **kwargs))
