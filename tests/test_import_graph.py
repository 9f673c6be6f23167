"""The in-project import graph of the whole repository has no cycle.

Every ``import`` / ``from ... import`` of every Python file in the tree is read with ``ast``
(function-level imports too: a cycle hidden in a function body is still a cycle), relative
imports are resolved, and an edge is kept when the target is a file of this repository.
``from package import name`` points at ``package/name.py`` when that is a module, else at the
package.  Imports under ``if TYPE_CHECKING:`` are skipped (they never run).  A package's
``__init__`` importing its own submodules is not a cycle: importing ``a.b`` runs ``a/__init__``
first, which may import ``a.b`` -- Python handles that order, so no implicit parent edge is added.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", "build", "dist", "runs", "node_modules", "__pycache__", ".venv", "venv"}


def module_map(root: Path) -> dict[str, Path]:
    """dotted module name (from the repository root) -> file, for every .py file of the tree."""
    out = {}
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or any(p.endswith(".egg-info") for p in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            out[".".join(parts)] = f
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    return skip


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The in-project modules that file `path` (module `name`) imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skip = _type_checking_nodes(tree)
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    # script-style imports (``import harness`` from a file run with its folder on sys.path)
    folder = ".".join(path.relative_to(ROOT).parts[:-1])

    def resolve(mod: str) -> str | None:
        for cand in (mod, f"{folder}.{mod}" if folder else mod):
            if cand in modules:
                return cand
        return None

    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                # `import a.b.c` imports a, a.b and a.b.c; the deepest in-project one is the dependency
                parts = a.name.split(".")
                for k in range(len(parts), 0, -1):
                    hit = resolve(".".join(parts[:k]))
                    if hit:
                        out.add(hit)
                        break
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join(base + ([node.module] if node.module else []))
                hit = mod if mod in modules else None
            else:
                mod = node.module or ""
                hit = resolve(mod)
                mod = hit or mod
            for a in node.names:
                sub = f"{mod}.{a.name}" if mod else a.name
                if sub in modules:
                    out.add(sub)
                elif hit:
                    out.add(hit)
    out.discard(name)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_map(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle [a, b, ..., a] of the directed graph, or None (iterative depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    for start in sorted(graph):
        if color[start] != WHITE:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        color[start] = GREY
        while stack:
            node, children = stack[-1]
            nxt = next(children, None)
            if nxt is None:
                stack.pop()
                path.pop()
                color[node] = BLACK
            elif color.get(nxt, BLACK) == GREY:
                return path[path.index(nxt):] + [nxt]
            elif color.get(nxt) == WHITE:
                color[nxt] = GREY
                path.append(nxt)
                stack.append((nxt, iter(sorted(graph[nxt]))))
    return None


def test_cycle_finder_finds_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_resolution_of_relative_and_function_level_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import x\n")
    (pkg / "a.py").write_text("from . import b\nx = 1\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("import pkg.a\nfrom typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from pkg import b\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        g = import_graph(tmp_path)
    finally:
        ROOT = saved
    assert g["pkg"] == {"pkg.a"} and g["pkg.a"] == {"pkg.b"} and g["pkg.b"] == {"pkg.sub.c"}
    assert g["pkg.sub.c"] == {"pkg.a"}           # the TYPE_CHECKING import is not an edge
    assert find_cycle(g) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]


def test_the_repository_import_graph_is_acyclic():
    g = import_graph()
    # the graph is the real one: the executor's build path is in it
    assert "executor.parallel.parallelize" in g["executor.train"] | g["executor.parallel"]
    assert {"executor.models.layers", "executor.models.mla", "executor.models.moe"} <= g["executor.models.llama"]
    cycle = find_cycle(g)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_arrows_point_one_way():
    """search_spaces <- cost_models <- planner; the executor reads search_spaces and cost_models (DESIGN)."""
    allowed = {"search_spaces": {"search_spaces"},
               "cost_models": {"search_spaces", "cost_models"},
               "planner": {"search_spaces", "cost_models", "planner"},
               "executor": {"search_spaces", "cost_models", "executor"}}
    bad = [(m, d) for m, deps in import_graph().items() for d in deps
           if m.split(".")[0] in allowed and d.split(".")[0] not in allowed[m.split(".")[0]]]
    assert bad == []
