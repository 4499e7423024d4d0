"""The project's import graph (read with `ast`, every import statement, function-local ones included):
no cycle between modules, and the layers point one way:

    looplm (model math, config)  <  kv_layouts  <  infer.engine, train  <  infer.sim (the virtual device)
    <  infer.serving, infer.bench  <  eval, the `python -m infer.serve` entry module  <  scripts

Serving and bench are one level: neither imports the other.

`train/` never imports `infer/` (BLUEPRINT section 1)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("looplm", "kv_layouts", "infer", "eval", "train", "scripts")
LAYERS = {"looplm": 0, "kv_layouts": 1, "infer.engine": 2, "train": 2, "infer.sim": 3, "infer.serving": 4,
          "infer.bench": 4, "eval": 5, "infer": 5, "scripts": 6}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Project modules that `name` imports (the deepest existing module of each dotted name)."""
    is_pkg = path.name == "__init__.py"
    found = set()

    def add(dotted: str) -> None:
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in known:
                found.add(".".join(parts[:i]))
                return

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:
                sub = f"{mod}.{a.name}"
                add(sub if sub in known else mod)
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {n: imports(n, p, known) for n, p in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str) -> str:
    parts = module.split(".")
    two = ".".join(parts[:2])
    return two if two in LAYERS else parts[0]


def test_graph_is_read():
    g = graph()
    assert "infer.engine.llm_engine" in g and "infer.engine.scheduler" in g["infer.engine.llm_engine"]
    assert "looplm.config" in g["kv_layouts.base"]  # relative and absolute imports both resolve
    assert "infer.engine.stages" in g["infer.engine.reference"]


def test_no_import_cycle_between_modules():
    assert cycles(graph()) == []


def test_cycle_detector_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_point_one_way():
    bad = []
    for src, dsts in graph().items():
        for dst in dsts:
            ls, ld = layer_of(src), layer_of(dst)
            if ls != ld and not LAYERS[ld] < LAYERS[ls]:
                bad.append(f"{src} ({ls}) -> {dst} ({ld})")
    assert bad == []


def test_train_never_imports_infer():
    assert [(s, d) for s, ds in graph().items() for d in ds if s.startswith("train") and d.startswith("infer")] == []


def test_scheduler_side_is_pure_python():
    """The bookkeeping the simulator replays imports no torch (STYLE: tensors only where compute happens)."""
    for name in ("infer/engine/scheduler.py", "infer/engine/sequence.py", "infer/engine/block_manager.py",
                 "looplm/policy.py", "looplm/config.py"):
        tree = ast.parse((ROOT / name).read_text())
        mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(m == "torch" or m.startswith("torch.") for m in mods), name
