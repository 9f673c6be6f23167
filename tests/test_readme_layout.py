"""The README's repository table names every product module, and every module it names exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("search_spaces", "cost_models", "planner", "executor")


def _table() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout of the repository"):]
    nxt = section.find("\n## ", 5)
    section = section[:nxt] if nxt > 0 else section
    out, package = set(), None
    for line in section.splitlines():
        m = re.match(r"\*\*(\w+)/:", line)
        if m:
            package = m.group(1)
        m = re.match(r"\| `([\w/]+\.py)` \|", line)
        if m and package:
            out.add(f"{package}/{m.group(1)}")
    return out


def test_readme_layout_table_matches_the_tree():
    listed = _table()
    tree = {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
            if p.name != "__init__.py" and "__pycache__" not in p.parts}
    assert sorted(tree - listed) == [], "modules missing from README's 'Layout of the repository'"
    assert sorted(listed - tree) == [], "README names modules that do not exist"
