"""The package's architecture, checked from the source: which folder may import which, no import circles (lazy imports
inside functions count too), and no test that edits sys.path. docs/DESIGN.md draws the same graph."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "jetflow_sglang"

# layer -> the layers it may import (besides itself). Top-level modules are their own layers.
ALLOWED = {
    "paths": set(),
    "machine": {"core", "paths"},
    "core": set(),
    "kernels": {"core"},
    "head": {"core", "paths"},
    "draft": {"head", "kernels", "core", "paths"},  # kernels: the paged head context (draft/paged.py)
    "engine": {"draft", "head", "kernels", "core", "paths", "machine"},
    "sglang": {"draft", "head", "kernels", "core", "paths", "machine"},  # the server never imports the HF engine
    "train": {"head", "core", "paths"},
    "cli": {"engine", "draft", "head", "core", "paths"},
    "__init__": {"paths"},
}
ALLOWED["viz"] = set(ALLOWED)  # the explorer sits on top: it may import any layer, and no layer imports it


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every jetflow_sglang module this file imports, at module level or inside a function."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("jetflow_sglang")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("jetflow_sglang"):
                continue
            for a in node.names:  # `from pkg import module` names a module; `from module import name` does not
                sub = f"{base}.{a.name}"
                out.add(sub if (PKG.parent / (sub.replace(".", "/") + ".py")).is_file()
                        or (PKG.parent / sub.replace(".", "/")).is_dir() else base)
    return out - {mod}


def _graph() -> dict[str, set[str]]:
    return {_module(p): _imports(p) for p in PKG.rglob("*.py")}


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_every_module_sits_in_a_known_layer():
    assert {_layer(m) for m in _graph()} <= set(ALLOWED), {_layer(m) for m in _graph()} - set(ALLOWED)


def _violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if _layer(d) != _layer(m) and _layer(d) not in ALLOWED[_layer(m)])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles among explicit imports (a package's __init__ importing its own modules is not one)."""
    edges = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    state: dict[str, int] = {}
    found = []

    def visit(m, stack):
        state[m] = 1
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                found.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return found


def test_imports_point_one_way():
    bad = _violations(_graph())
    assert not bad, "imports against the layering (see docs/DESIGN.md):\n" + "\n".join(bad)


def test_no_import_circles():
    cycles = _cycles(_graph())
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_can_fail(tmp_path):
    """A server module importing the engine, and a lazy import that closes a circle, are both caught."""
    lazy = tmp_path / "jetflow_sglang" / "sglang" / "x.py"
    lazy.parent.mkdir(parents=True)
    lazy.write_text("def f():\n    from jetflow_sglang.engine.loop import generate\n")
    tree = ast.parse(lazy.read_text())
    assert {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} == {"jetflow_sglang.engine.loop"}
    assert _violations({"jetflow_sglang.sglang.x": {"jetflow_sglang.engine.loop"}}) == \
        ["jetflow_sglang.sglang.x -> jetflow_sglang.engine.loop"]
    graph = {"jetflow_sglang.train.data": {"jetflow_sglang.train.engines"},
             "jetflow_sglang.train.engines": {"jetflow_sglang.train.data"}, "jetflow_sglang.train": set()}
    assert _cycles(graph)
    assert _violations({"jetflow_sglang.core.tree": {"jetflow_sglang.viz.figures"},
                        "jetflow_sglang.viz.models": {"jetflow_sglang.engine.stack"}}) == \
        ["jetflow_sglang.core.tree -> jetflow_sglang.viz.figures"]
    assert "jetflow_sglang.engine.stack" in _imports(PKG / "viz" / "models.py")
    assert "jetflow_sglang.core.tree_batch" in _imports(PKG / "sglang" / "worker.py")


def test_tests_do_not_edit_sys_path():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
                 if p.name != Path(__file__).name and "sys.path.insert" in p.read_text()]
    assert not offenders, offenders
