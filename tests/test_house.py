"""House rules of the product code (planner, executor, cost_models, search_spaces), read with `ast`.

* No function over `MAX_FUNCTION_LINES` lines (its ``def`` line to its last line, docstring and
  comments included) unless `LONG_FUNCTIONS` names it with the reason it stays long.
* In-project imports sit at the top of a file; a function-level one (lazy: torch on the
  launcher path, an optional package) carries its reason as a comment on its line or the line above.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from executor.elastic import replan
from search_spaces.constraints import EP_MESH
from search_spaces.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("planner", "executor", "cost_models", "search_spaces")
MAX_FUNCTION_LINES = 80

# "path::qualified name" -> why it stays longer than MAX_FUNCTION_LINES (an argparse table may be a reason)
LONG_FUNCTIONS: dict[str, str] = {}


def product_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for pkg in PRODUCT for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def functions(path: Path, root: Path = ROOT) -> list[tuple[str, int, ast.AST]]:
    """("path::Class.name", lines, node) of every function and method of `path`, nested ones too."""
    rel = path.relative_to(root).as_posix()
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((f"{rel}::{name}", child.end_lineno - child.lineno + 1, child))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), "")
    return out


def long_functions(root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    return {name: n for p in product_files(root) for name, n, _ in functions(p, root) if n > limit}


def _in_project(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] in PRODUCT
    return any(a.name.split(".")[0] in PRODUCT for a in node.names)


def unexplained_lazy_imports(root: Path = ROOT) -> list[str]:
    """"path:line: source" of every function-level in-project import without a comment on its line
    or a comment line right above it."""
    out = set()
    for path in product_files(root):
        lines = path.read_text(encoding="utf-8").splitlines()
        for _, _, fn in functions(path, root):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and _in_project(node):
                    here = lines[node.lineno - 1]
                    above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                    if "#" not in here and not above.startswith("#"):
                        out.add(f"{path.relative_to(root).as_posix()}:{node.lineno}: {here.strip()}")
    return sorted(out)


# --------------------------------------------------------------------------- the checkers fail when they should
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return tmp_path


def test_long_function_finder_counts_methods_and_nested_functions(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    root = _tree(tmp_path, {
        "planner/a.py": f"def long():\n{body}\n\ndef short():\n    return 1\n",
        "executor/b.py": f"class K:\n    def method(self):\n        def inner():\n{body.replace('    ', '            ')}"
                         "        return inner\n",
        "tests/c.py": f"def not_product():\n{body}",
    })
    assert long_functions(root) == {"planner/a.py::long": 81, "executor/b.py::K.method": 83,
                                    "executor/b.py::K.method.inner": 81}


def test_lazy_import_finder_wants_a_reason(tmp_path):
    root = _tree(tmp_path, {"executor/a.py": (
        "import os\n\n\n"
        "def f():\n"
        "    from .b import x\n"
        "    import cost_models.flops\n"
        "    from .c import y  # torch: launcher path\n"
        "    # optional: only with the 'plot' extra\n"
        "    from planner import plot\n"
        "    import json\n"
        "    return x, y, plot, json, cost_models\n")})
    assert unexplained_lazy_imports(root) == ["executor/a.py:5: from .b import x",
                                              "executor/a.py:6: import cost_models.flops"]


# --------------------------------------------------------------------------- the rules hold in the tree
def test_no_product_function_over_80_lines_without_a_reason():
    found = long_functions()
    assert not (set(found) - set(LONG_FUNCTIONS)), (
        f"functions over {MAX_FUNCTION_LINES} lines (split them along their seams, or name the reason in "
        f"LONG_FUNCTIONS): " + ", ".join(f"{k} ({v})" for k, v in sorted(found.items()) if k not in LONG_FUNCTIONS))
    stale = set(LONG_FUNCTIONS) - set(found)
    assert not stale, f"LONG_FUNCTIONS names functions that are no longer long (or gone): {sorted(stale)}"
    assert all(reason.strip() for reason in LONG_FUNCTIONS.values())


def test_function_level_in_project_imports_carry_a_reason():
    bad = unexplained_lazy_imports()
    assert bad == [], ("in-project imports belong at the top of the file; a lazy one needs its reason "
                       "as a comment: " + "; ".join(bad))


# --------------------------------------------------------------------------- one home for each rule
@pytest.mark.parametrize("ep,cp,world,expected", [(4, 1, 8, 4), (4, 1, 6, 2), (4, 1, 3, 1), (8, 2, 12, 4),
                                                  (2, 2, 2, 2), (8, 1, 2, 2)])
def test_elastic_replan_keeps_the_largest_halved_ep_the_mesh_rule_accepts(ep, cp, world, expected):
    plan = Plan(dp_shard=8 // cp, cp=cp, ep=ep, microbatch=1, n_microbatches=3)
    new = replan(plan, world)
    assert new.ep == expected and EP_MESH.ok(new, None)
    assert new.ep == ep or new.fsdp_size % (2 * new.ep), "a larger halving of ep would have fit"
    assert (new.cp, new.dp_shard, new.global_batch()) == (cp, world // cp, plan.global_batch())


def test_elastic_replan_picks_a_micro_batch_the_pipeline_rules_accept():
    """Interleaved1F1B at pp 2 runs micro-batches in rounds (constraints.MICRO_ROUNDS): 10 sequences per
    dp rank at micro-batch 2 would be 5 micro-batches, which the rule refuses, so the re-plan takes 1."""
    plan = Plan(pp=2, schedule="Interleaved1F1B", stages_per_rank=2, microbatch=2, n_microbatches=10)
    new = replan(plan, 4)
    assert (new.dp_shard, new.microbatch, new.n_microbatches) == (2, 1, 10)
    assert replan(Plan(pp=2, microbatch=2, n_microbatches=10), 4).microbatch == 2    # 1F1B: 5 >= pp is enough
