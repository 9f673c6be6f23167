"""Reading a YAML file with errors a user can act on: one line naming the file (and the line)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml


def read_yaml(path: str | os.PathLike, *, error: type[Exception], what: str) -> Any:
    """Parse `path`; a missing file or malformed YAML raises `error` with a one-line message."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} '{p}' does not exist")
    try:
        return yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise error(f"{p}: malformed YAML{at}: {getattr(e, 'problem', e)}") from None
