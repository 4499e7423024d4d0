"""Chat and prompt/completion data through `accelerate launch` on 2 CPU ranks (issue 59): the
trainers' --dataset formats, packed documents, assistant-only / completion-only loss. (Its own file:
pytest-xdist's loadfile runs a file on one worker, and test_train_clients.py is the longest.)"""
import json
import random
import sys

import numpy as np
import pytest

from tests.test_train_clients import _env, _launch, _run, _skv, tiny  # noqa: F401 (tiny: the fixture)

pytestmark = pytest.mark.slow  # accelerate launch


@pytest.mark.parametrize("fmt", ["messages", "prompt_completion"])
def test_chat_and_prompt_completion_finetunes_on_2_cpu_ranks(tiny, tmp_path, fmt):
    """A chat JSONL (assistant-only loss) and a prompt/completion JSONL (completion-only loss)
    fine-tune through `accelerate launch` on 2 CPU ranks: packed documents, counted targets only."""
    rng = random.Random(1)
    words = ["zebra", "quantum", "lattice", "orchid", "meridian", "cobalt", "falcon", "tundra"]
    say = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    if fmt == "messages":
        rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": say(8)},
                              {"role": "assistant", "content": say(5)}]} for _ in range(60)]
    else:
        rows = [{"prompt": say(8), "completion": say(5)} for _ in range(60)]
    src = tmp_path / f"{fmt}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    args = _skv(tiny, out, steps=2, extra=["--no-wandb"])
    i = args.index("--tokens")
    args[i:i + 2] = ["--dataset", str(src)]
    r = _run(_launch("cpu_2ranks.yaml", args), _env(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    data = s["data"]
    assert data["format"] == fmt
    assert s["world_size"] == 2 and data["documents"] + data["heldout_documents"] == 60
    assert 0 < data["train_target_tokens"] < data["train_tokens"] - data["train_padding_tokens"]
    hist = json.loads((out / "history.json").read_text())
    assert [h["step"] for h in hist if "loss" in h] == [1, 2] and all(np.isfinite(h["loss"]) for h in hist if "loss" in h)
