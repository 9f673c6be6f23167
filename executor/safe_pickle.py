"""A pickle reader that cannot call anything: for DCP's ``.metadata`` file.

DCP writes its checkpoint index (``.metadata``) with ``pickle``.  A checkpoint
is often someone else's file, and ``pickle.load`` -- even through an
``Unpickler.find_class`` allow-list -- runs whatever callables the stream
reaches (``getattr`` on an allowed module, methods of allowed classes, a
``__setstate__``, ``__reduce__`` chains).  This module never hands the stream
to ``pickle``.  It walks the opcodes with :func:`pickletools.genops` (a
parser only) on a small stack machine of its own where:

* plain data opcodes build plain data (None, bool, int, float, str, bytes,
  tuple, list, dict, set, frozenset);
* ``GLOBAL``/``STACK_GLOBAL`` resolve only the exact ``(module, qualname)``
  pairs in :data:`ALLOWED` -- DCP's metadata dataclasses, ``torch.Size``, the
  torch dtypes and layouts, DCP's memory-format enum, ``pathlib`` paths and
  ``collections.OrderedDict`` -- to a token; nothing is imported, no
  attribute is looked up by a name taken from the stream;
* ``REDUCE`` and ``NEWOBJ`` on a token run the constructor *this module*
  writes for it (``torch.Size`` of ints, a layout by its name, an enum member
  by value, a path of strings, an empty dataclass instance made by
  ``object.__new__``), after checking the argument types;
* ``BUILD`` sets only the declared dataclass fields, with plain values, by
  ``object.__setattr__`` (no ``__setstate__`` of the stream's choosing:
  ``TensorProperties``' tuple state is decoded here);
* every other opcode (``INST``, ``OBJ``, ``NEWOBJ_EX``, ``EXT*``,
  persistent ids, out-of-band buffers, ...) is refused, as is any global not
  on the list, a ``REDUCE`` of anything but a token, and a file or structure
  beyond the size limits.

Refusals raise :class:`UnsafePickleError` (a ``ValueError``) naming the
opcode or global and its byte offset.
"""
from __future__ import annotations

import collections
import dataclasses
import pathlib
import pickletools

import torch
import torch.distributed.checkpoint.filesystem as fs
import torch.distributed.checkpoint.metadata as md

from search_spaces.typed import InputError

MAX_BYTES = 512 * 2**20          # a .metadata of a 100k-tensor model is a few MB
MAX_ITEMS = 20_000_000           # containers items in total (a cap on work, not a format limit)
MAX_INT_DIGITS = 4300            # Python's own str->int limit


class UnsafePickleError(InputError):
    """A pickle stream that uses something this reader does not allow."""


@dataclasses.dataclass(frozen=True)
class _Global:
    module: str
    name: str


_DCP_META = "torch.distributed.checkpoint.metadata"
_DCP_FS = "torch.distributed.checkpoint.filesystem"
_DATACLASSES = {(_DCP_META, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                         "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                         "StorageMeta")} | {(_DCP_FS, "_StorageInfo")}
_DTYPES = {name: getattr(torch, name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}
_LAYOUTS = {f"torch.{name}": getattr(torch, name) for name in dir(torch)
            if isinstance(getattr(torch, name, None), torch.layout)}
_PATHS = {("pathlib", n): getattr(pathlib, n) for n in ("PosixPath", "PurePosixPath", "WindowsPath",
                                                         "PureWindowsPath", "Path")}

#: every global a DCP ``.metadata`` may name; nothing else resolves
ALLOWED = (_DATACLASSES | {("torch", n) for n in _DTYPES} | set(_PATHS)
           | {("torch", "Size"), ("torch.serialization", "_get_layout"), (_DCP_META, "_MEM_FORMAT_ENCODING"),
              ("collections", "OrderedDict")})


def _dataclass(g: _Global):
    """The real class for an allowed dataclass token (looked up in modules torch itself imported)."""
    cls = getattr({_DCP_META: md, _DCP_FS: fs}[g.module], g.name, None)
    if cls is None or not dataclasses.is_dataclass(cls):
        raise UnsafePickleError(f"{g.module}.{g.name} is not a dataclass in this torch")
    return cls


def _plain(value, what: str):
    """Check that `value` is plain data or an object this reader built (never a token)."""
    if isinstance(value, _Global):
        raise UnsafePickleError(f"{what}: a bare global {value.module}.{value.name} is not a value")
    return value


def _ints(value, what: str) -> tuple:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int for v in value):
        raise UnsafePickleError(f"{what} takes a sequence of ints")
    return tuple(value)


def _call(g: _Global, args: tuple, pos: int):
    """REDUCE of an allowed global: the constructors this reader writes itself."""
    key = (g.module, g.name)
    if key == ("torch", "Size"):
        if len(args) > 1:
            raise UnsafePickleError(f"torch.Size takes one argument (at byte {pos})")
        return torch.Size(_ints(args[0] if args else (), "torch.Size"))
    if key == ("torch.serialization", "_get_layout"):
        if len(args) != 1 or args[0] not in _LAYOUTS:
            raise UnsafePickleError(f"unknown tensor layout {args!r:.80} (at byte {pos})")
        return _LAYOUTS[args[0]]
    if key == (_DCP_META, "_MEM_FORMAT_ENCODING"):
        enc = md._MEM_FORMAT_ENCODING
        members = {m.value: m for m in enc}
        if len(args) != 1 or type(args[0]) is not int or args[0] not in members:
            raise UnsafePickleError(f"unknown memory-format encoding {args!r:.80} (at byte {pos})")
        return members[args[0]]
    if key in _PATHS:
        if not all(type(a) is str for a in args):
            raise UnsafePickleError(f"{g.module}.{g.name} takes strings (at byte {pos})")
        return pathlib.PurePosixPath(*args) if "Windows" not in g.name else pathlib.PureWindowsPath(*args)
    if key == ("collections", "OrderedDict"):
        out = collections.OrderedDict()
        if args:
            if len(args) != 1 or not isinstance(args[0], (list, tuple)):
                raise UnsafePickleError(f"OrderedDict takes one sequence of pairs (at byte {pos})")
            for pair in args[0]:
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    raise UnsafePickleError(f"OrderedDict takes (key, value) pairs (at byte {pos})")
                out[_plain(pair[0], "a dict key")] = _plain(pair[1], "a dict value")
        return out
    raise UnsafePickleError(f"{g.module}.{g.name} cannot be called (at byte {pos})")


_MEMORY_FORMATS = None


def _build(obj, state, pos: int) -> None:
    """BUILD on an instance this reader made: declared fields only, plain values only."""
    cls = type(obj)
    if not dataclasses.is_dataclass(cls) or (cls.__module__, cls.__qualname__) not in _DATACLASSES:
        raise UnsafePickleError(f"BUILD on a {cls.__name__} is not allowed (at byte {pos})")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if cls.__name__ == "TensorProperties" and isinstance(state, tuple):
        global _MEMORY_FORMATS
        if _MEMORY_FORMATS is None:
            enc = md._MEM_FORMAT_ENCODING
            _MEMORY_FORMATS = {enc.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
                               enc.TORCH_CHANNELS_LAST: torch.channels_last,
                               enc.TORCH_PRESERVE_FORMAT: torch.preserve_format}
        if len(state) != 5 or not isinstance(state[0], torch.dtype) or not isinstance(state[1], torch.layout) \
                or type(state[2]) is not bool or state[3] not in _MEMORY_FORMATS or type(state[4]) is not bool:
            raise UnsafePickleError(f"malformed TensorProperties state (at byte {pos})")
        state = {"dtype": state[0], "layout": state[1], "requires_grad": state[2],
                 "memory_format": _MEMORY_FORMATS[state[3]], "pin_memory": state[4]}
    if isinstance(state, tuple) and len(state) == 2 and state[0] is None and isinstance(state[1], dict):
        state = state[1]                     # (None, slotstate) form
    if not isinstance(state, dict):
        raise UnsafePickleError(f"BUILD state of {cls.__name__} must be a dict (at byte {pos})")
    for name, value in state.items():
        if name not in fields:
            raise UnsafePickleError(f"{cls.__name__} has no field {name!r:.60} (at byte {pos})")
        object.__setattr__(obj, name, _plain(value, f"{cls.__name__}.{name}"))
    for name, f in fields.items():          # fields a different torch version did not write: their defaults
        if name not in state:
            if f.default is not dataclasses.MISSING:
                object.__setattr__(obj, name, f.default)
            elif f.default_factory is not dataclasses.MISSING and f.default_factory in (list, dict):
                object.__setattr__(obj, name, f.default_factory())


_DATA_OPS = {"NONE": lambda a: None, "NEWTRUE": lambda a: True, "NEWFALSE": lambda a: False}
_ARG_OPS = {"BININT", "BININT1", "BININT2", "LONG1", "LONG4", "BINFLOAT", "FLOAT", "UNICODE", "BINUNICODE",
            "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BINSTRING",
            "SHORT_BINSTRING", "STRING"}
_FRAMING = {"PROTO", "FRAME", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"}


def loads(data: bytes):
    """Decode a DCP metadata pickle without calling anything the stream names."""
    if len(data) > MAX_BYTES:
        raise UnsafePickleError(f"metadata of {len(data)} bytes exceeds the {MAX_BYTES} byte limit")
    stack: list = []
    marks: list[int] = []
    memo: dict = {}
    items = 0

    def pop_mark() -> list:
        if not marks:
            raise UnsafePickleError("MARK expected")
        start = marks.pop()
        out = stack[start:]
        del stack[start:]
        return out

    def top(n: int = 1):
        if len(stack) - (marks[-1] if marks else 0) < n:
            raise UnsafePickleError("stack underflow")

    try:
        ops = pickletools.genops(data)
        for op, arg, pos in ops:
            name = op.name
            if name in _FRAMING:
                if name == "PROTO" and arg > 5:
                    raise UnsafePickleError(f"pickle protocol {arg} is not supported")
                if name == "MEMOIZE":
                    top()
                    memo[len(memo)] = stack[-1]
                elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                    top()
                    memo[int(arg)] = stack[-1]
                continue
            if name in ("GET", "BINGET", "LONG_BINGET"):
                if int(arg) not in memo:
                    raise UnsafePickleError(f"memo key {arg} not defined (at byte {pos})")
                stack.append(memo[int(arg)])
            elif name in _DATA_OPS:
                stack.append(_DATA_OPS[name](arg))
            elif name == "INT":           # protocol 0: also True/False as "01"/"00"
                if isinstance(arg, int) and len(str(abs(arg))) > MAX_INT_DIGITS:
                    raise UnsafePickleError("integer too long")
                stack.append(arg)
            elif name == "LONG":
                stack.append(arg)
            elif name in _ARG_OPS:
                if name in ("LONG1", "LONG4") and arg.bit_length() > 4 * MAX_INT_DIGITS:
                    raise UnsafePickleError("integer too long")
                stack.append(arg)
            elif name == "MARK":
                marks.append(len(stack))
            elif name == "POP":
                top()
                stack.pop()
            elif name == "POP_MARK":
                pop_mark()
            elif name == "DUP":
                top()
                stack.append(stack[-1])
            elif name == "EMPTY_TUPLE":
                stack.append(())
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                top(n)
                vals = tuple(_plain(v, "a tuple item") for v in stack[-n:])
                del stack[-n:]
                stack.append(vals)
            elif name == "TUPLE":
                stack.append(tuple(_plain(v, "a tuple item") for v in pop_mark()))
            elif name == "EMPTY_LIST":
                stack.append([])
            elif name == "LIST":
                stack.append(pop_mark())
            elif name in ("APPEND", "APPENDS"):
                if name == "APPENDS":
                    vals = pop_mark()
                else:
                    top(2)
                    vals = [stack.pop()]
                top()
                if type(stack[-1]) is not list:
                    raise UnsafePickleError(f"{name} to a {type(stack[-1]).__name__} (at byte {pos})")
                stack[-1].extend(_plain(v, "a list item") for v in vals)
                items += len(vals)
            elif name == "EMPTY_DICT":
                stack.append({})
            elif name == "DICT":
                vals = pop_mark()
                stack.append(_pairs({}, vals, pos))
                items += len(vals)
            elif name in ("SETITEM", "SETITEMS"):
                if name == "SETITEMS":
                    vals = pop_mark()
                else:
                    top(3)
                    vals = stack[-2:]
                    del stack[-2:]
                top()
                if not isinstance(stack[-1], dict):
                    raise UnsafePickleError(f"{name} on a {type(stack[-1]).__name__} (at byte {pos})")
                _pairs(stack[-1], vals, pos)
                items += len(vals)
            elif name == "EMPTY_SET":
                stack.append(set())
            elif name == "ADDITEMS":
                vals = pop_mark()
                top()
                if type(stack[-1]) is not set:
                    raise UnsafePickleError(f"ADDITEMS to a {type(stack[-1]).__name__} (at byte {pos})")
                stack[-1].update(_plain(v, "a set item") for v in vals)
                items += len(vals)
            elif name == "FROZENSET":
                stack.append(frozenset(_plain(v, "a set item") for v in pop_mark()))
            elif name in ("GLOBAL", "STACK_GLOBAL"):
                if name == "GLOBAL":
                    module, _, qual = arg.partition(" ")
                else:
                    top(2)
                    module, qual = stack[-2], stack[-1]
                    del stack[-2:]
                    if type(module) is not str or type(qual) is not str:
                        raise UnsafePickleError(f"STACK_GLOBAL needs two strings (at byte {pos})")
                if (module, qual) not in ALLOWED:
                    raise UnsafePickleError(f"global {module}.{qual} is not allowed (at byte {pos})"[:300])
                # a dtype is pickled as the global itself: it is a value, never something to call
                stack.append(_DTYPES[qual] if module == "torch" and qual in _DTYPES else _Global(module, qual))
            elif name == "REDUCE":
                top(2)
                fn, args = stack[-2], stack[-1]
                del stack[-2:]
                if not isinstance(fn, _Global) or type(args) is not tuple:
                    raise UnsafePickleError(f"REDUCE of a {type(fn).__name__} is not allowed (at byte {pos})")
                stack.append(_call(fn, tuple(_plain(a, "an argument") for a in args), pos))
            elif name == "NEWOBJ":
                top(2)
                cls, args = stack[-2], stack[-1]
                del stack[-2:]
                if not isinstance(cls, _Global) or (cls.module, cls.name) not in _DATACLASSES or args != ():
                    raise UnsafePickleError(f"NEWOBJ of {cls!r:.80} is not allowed (at byte {pos})")
                stack.append(object.__new__(_dataclass(cls)))
            elif name == "BUILD":
                top(2)
                state = stack.pop()
                _build(stack[-1], state, pos)
            elif name == "STOP":
                if len(stack) != 1 or marks:
                    raise UnsafePickleError("malformed pickle: STOP with a stack of "
                                            f"{len(stack)} items")
                result = stack[0]
                if isinstance(result, _Global):
                    raise UnsafePickleError("the pickle's value is a bare global")
                return result
            else:
                raise UnsafePickleError(f"pickle opcode {name} is not allowed (at byte {pos})")
            if items > MAX_ITEMS:
                raise UnsafePickleError(f"more than {MAX_ITEMS} container items")
    except UnsafePickleError:
        raise
    except (ValueError, TypeError, IndexError, KeyError, OverflowError, UnicodeDecodeError, EOFError,
            MemoryError, RecursionError) as e:     # pickletools' own parse errors, unhashable keys
        raise UnsafePickleError(f"malformed pickle: {type(e).__name__}: {str(e)[:200]}") from None
    raise UnsafePickleError("malformed pickle: no STOP opcode")


def _pairs(d: dict, vals: list, pos: int) -> dict:
    if len(vals) % 2:
        raise UnsafePickleError(f"odd number of dict items (at byte {pos})")
    for k, v in zip(vals[::2], vals[1::2]):
        d[_plain(k, "a dict key")] = _plain(v, "a dict value")
    return d
