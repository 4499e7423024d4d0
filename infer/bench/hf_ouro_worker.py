"""One timed run of Ouro's public HF reference code (not ours): static batches, greedy, at full depth.

A plain script, run by infer/bench/reference.py under the Python of a scratch venv that has the
reference's pins (transformers 4.57.6), with the folder holding the reference modules as the package
`ouro_ref` on PYTHONPATH (LoopedLMs/ouro_rl `ouro_rl/modeling/{modeling,configuration}_ouro.py`;
tests/fixtures/parity/README.md says how to make that venv and folder). It imports nothing of this
repository, so the reference runs as its users run it: `OuroForCausalLM.from_pretrained` and
`generate` on left-padded batches.

    PYTHONPATH=$REF $REF_PY infer/bench/hf_ouro_worker.py --model DIR --job job.json --out out.json

job.json: {"prompts": [[ids], ...], "batch": B, "new_tokens": N, "threads": 1}. Writes the new
token ids per prompt (input order) and the seconds of the timed pass (every batch, after one
warm-up generate that is not timed).
"""
from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch
    import transformers
    from ouro_ref.modeling_ouro import OuroForCausalLM

    job = json.loads(open(a.job).read())
    torch.set_num_threads(job["threads"])
    model = OuroForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    T = model.config.total_ut_steps
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    prompts, B, N = job["prompts"], job["batch"], job["new_tokens"]

    def run(batch: list[list[int]], new: int) -> list[list[int]]:
        L = max(len(p) for p in batch)  # left padding, masked (generate derives the positions from the mask)
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             exit_at_step=T - 1, eos_token_id=None, pad_token_id=pad)
        return out[:, L:].tolist()

    with torch.inference_mode():
        run(prompts[:B], 2)  # warm-up: allocator, first-call paths
        t0 = time.perf_counter()
        outs = []
        for i in range(0, len(prompts), B):
            outs += run(prompts[i:i + B], N)
        seconds = time.perf_counter() - t0
    json.dump({"seconds": seconds, "outputs": outs, "torch": torch.__version__,
               "transformers": transformers.__version__, "threads": torch.get_num_threads()}, open(a.out, "w"))


if __name__ == "__main__":
    main()
