"""A Sequence's three parts each have one owner (infer/engine/sequence.py: OWNERS): every assignment
or list mutation of a Sequence field in infer/ is made by the modules that own the field's part, and
the request's part is written by no one after creation. Sequences are named `s` or `seq` throughout
infer/ (the receivers this reads as Sequences); writes through an alias (`ids = s.output_ids;
ids.append(t)`) are not seen."""
import ast
import dataclasses
from pathlib import Path

from infer.engine.sampling_params import SamplingParams
from infer.engine.sequence import OWNERS, Sequence
from looplm.policy import ExitPolicy

ROOT = Path(__file__).resolve().parents[1]
MUTATORS = {"append", "extend", "clear", "pop", "insert", "remove", "sort", "update"}
RECEIVERS = {"s", "seq"}


def written(tree: ast.AST):
    """(line, receiver, field) of every write to an attribute of a Name in `tree`."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign):
            ts = n.targets
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
            ts = [n.target]
        elif isinstance(n, ast.Delete):
            ts = n.targets
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MUTATORS:
            ts = [n.func.value]
        else:
            continue
        for t in ts:
            for x in t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]:
                x = x.value if isinstance(x, (ast.Starred, ast.Subscript)) else x
                if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name):
                    yield n.lineno, x.value.id, x.attr


def test_owners_cover_every_field_once():
    parts = [f for _, fields in OWNERS.values() for f in fields]
    assert sorted(parts) == sorted(f.name for f in dataclasses.fields(Sequence)), "a field in no part or in two"


def stray(rel: str, source: str) -> list[str]:
    """The writes in `source` (the text of infer/ file `rel`) to fields whose part `rel` does not own."""
    owner = {f: (part, mods) for part, (mods, fields) in OWNERS.items() for f in fields}
    return [f"{rel}:{line} writes {who}.{field} ({owner[field][0]} part, owned by "
            f"{sorted(owner[field][1]) or 'no one after creation'})"
            for line, who, field in written(ast.parse(source))
            if who in RECEIVERS and field in owner and rel not in owner[field][1]]


def test_each_part_is_written_by_its_owner_only():
    bad = []
    for p in sorted((ROOT / "infer").rglob("*.py")):
        bad += stray(p.relative_to(ROOT).as_posix(), p.read_text())
    assert not bad, "\n".join(bad)


def test_kv_memory_is_written_by_the_block_manager_only():
    # the block table, slot and room changed by hand in the scheduler (as before the BlockManager
    # owned them) is reported; the same lines in block_manager.py are not
    src = "def f(s, seq):\n    s.blocks, s.slot = [], -1\n    seq.blocks.append(3)\n    seq.room = 0\n"
    assert len(stray("infer/engine/scheduler.py", src)) == 4
    assert len(stray("infer/engine/preemption.py", src)) == 4
    assert stray("infer/engine/block_manager.py", src) == []


def test_the_checker_sees_a_stray_write():
    # the scan itself: a write from a module that does not own the field is reported
    tree = ast.parse("def f(s, seq):\n    s.stage = None\n    seq.output_ids.append(3)\n    s.blocks[0] = 1\n"
                     "    seq.room += 1\n    s.slot, s.step = 0, 1\n")
    assert sorted(f for _, _, f in written(tree)) == ["blocks", "output_ids", "room", "slot", "stage", "step"]


def test_request_part_is_derived_at_creation():
    """What the per-token loops and the scheduler read (stop ids, the length limit, sampling,
    extras) exists as soon as the sequence does, not after the output processor saw it."""
    pol = ExitPolicy(criterion="kl", threshold=None, r_min=1, r_max=4)
    s = Sequence(0, "a", [1] * 10, SamplingParams(max_tokens=100, temperature=0.7, stop_token_ids=[5]), pol,
                 eos_ids=frozenset({2}), max_model_len=64)
    assert (s.stop_ids, s.max_out, s.sampled, s.extras) == (frozenset({2, 5}), 54, True, False)
    forced = Sequence(1, "b", [1], SamplingParams(max_tokens=3, temperature=0.7, ignore_eos=True), pol,
                      forced=[4, 4, 4], eos_ids=frozenset({2}))
    assert (forced.stop_ids, forced.max_out, forced.sampled, forced.extras) == (frozenset(), 3, False, True)
