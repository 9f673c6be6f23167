"""The one YAML reader (and writer) of the project: errors a user can act on, in one line.

Every YAML input (model and hardware specs, search spaces, plan files, calibration
files, ``--set`` values) is parsed here, with limits that keep a hostile or broken
file from costing more than a moment: at most `MAX_FILE_BYTES` of UTF-8 text, at
most `MAX_ALIASES` aliases and `MAX_NODES` nodes once the aliases are expanded (a
"billion laughs" bomb of 919 bytes is refused before anything walks it), and
messages cut to `MAX_MESSAGE` characters.  A missing, unreadable or binary file,
a folder, a device or a name too long is one line too.

`write_text` writes a file the same careful way: atomically (temporary file, then
rename) through a symbolic link to its target, and never over something that is
not a regular file (a device node, a pipe, a folder).
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import yaml

MAX_FILE_BYTES = 16 * 2 ** 20    # the largest YAML input (a plan file is a few KiB)
MAX_ALIASES = 100                # aliases (*name) in one document
MAX_NODES = 1_000_000            # nodes of the document with every alias expanded
MAX_MESSAGE = 300                # characters of a parser message quoted in an error


class _LimitedLoader(yaml.SafeLoader):
    """SafeLoader that counts aliases while composing (construction only ever sees a checked tree)."""

    def __init__(self, stream, *, error: type[Exception], where: str):
        super().__init__(stream)
        self._aliases = 0
        self._error, self._where = error, where

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise self._error(f"{self._where}: more than {MAX_ALIASES} YAML aliases (*name); refused "
                                  "(anchors and aliases are for small reuse, not expansion)")
        return super().compose_node(parent, index)


def _expanded_size(root: yaml.Node, *, error: type[Exception], where: str) -> int:
    """Nodes of the tree with every alias expanded, computed once per distinct node (memoized)."""
    sizes: dict[int, int] = {}
    # iterative post-order walk: a deep document must not hit Python's recursion limit
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    on_path: set[int] = set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        children = _children(node)
        if not done:
            if key in on_path:
                raise error(f"{where}: a YAML alias refers to a node that contains it (recursive document)")
            on_path.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            continue
        on_path.discard(key)
        total = 1 + sum(sizes.get(id(c), 1) for c in children)
        if total > MAX_NODES:
            raise error(f"{where}: the YAML document expands to more than {MAX_NODES:,} nodes "
                        f"(aliases of aliases); refused")
        sizes[key] = total
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [x for kv in node.value for x in kv]
    return []


def parse_yaml(text: str, *, error: type[Exception], where: str) -> Any:
    """Parse one YAML document from `text` with the limits above; errors are one line of class `error`."""
    if len(text) > MAX_FILE_BYTES:
        raise error(f"{where}: larger than {MAX_FILE_BYTES // 2 ** 20} MiB; refused")
    loader = _LimitedLoader(text, error=error, where=where)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, error=error, where=where)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        if len(problem) > MAX_MESSAGE:
            problem = problem[: MAX_MESSAGE - 3] + "..."
        raise error(f"{where}: malformed YAML{at}: {problem}") from None
    except RecursionError:
        raise error(f"{where}: the YAML document is nested too deeply") from None
    finally:
        loader.dispose()


def read_yaml(path: str | os.PathLike, *, error: type[Exception], what: str) -> Any:
    """Parse the YAML file `path`; any problem with the file or its text raises `error` in one line."""
    p = Path(path)
    name = _shown_path(p)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise error(f"{what} '{name}' does not exist") from None
    except OSError as e:
        raise error(f"{what} '{name}' cannot be read: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{what} '{name}' is a folder, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} '{name}' is not a regular file (a device, a pipe or a socket)")
    if st.st_size > MAX_FILE_BYTES:
        raise error(f"{what} '{name}' is larger than {MAX_FILE_BYTES // 2 ** 20} MiB; refused")
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise error(f"{what} '{name}' cannot be read: {e.strerror or e}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise error(f"{what} '{name}' is larger than {MAX_FILE_BYTES // 2 ** 20} MiB; refused")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} '{name}' is not a UTF-8 text file (byte {e.start} cannot be decoded)") from None
    if "\x00" in text:
        raise error(f"{what} '{name}' is a binary file (it holds NUL bytes), not YAML")
    return parse_yaml(text, error=error, where=name)


def write_text(path: str | os.PathLike, text: str, *, error: type[Exception], what: str) -> Path:
    """Write `text` to `path` atomically; returns the file written (a symlink's target).

    A symbolic link is followed (the link stays, its target gets the new text); anything that
    exists and is not a regular file (a device node such as /dev/full, a pipe, a folder) is
    refused rather than replaced.  Errors (permissions, full disk, ...) are one line of `error`.
    """
    p = Path(path)
    name = _shown_path(p)
    try:
        target = Path(os.path.realpath(p)) if p.is_symlink() else p
        try:
            st = target.stat()
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file (a device, a pipe or a socket)"
            raise error(f"{what} '{name}' is {kind}; refusing to replace it")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~_umask())
            os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except OSError as e:
        raise error(f"cannot write {what} '{name}': {e.strerror or e}") from None
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _shown_path(p: Path) -> str:
    s = str(p)
    return s if len(s) <= 120 else s[:60] + "..." + s[-57:]
