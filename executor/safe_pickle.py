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


_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": ()}
_VALUE_OPS = {"INT", "LONG", "BININT", "BININT1", "BININT2", "LONG1", "LONG4", "BINFLOAT", "FLOAT", "UNICODE",
              "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
              "BINSTRING", "SHORT_BINSTRING", "STRING"}
_PARSE_ERRORS = (ValueError, TypeError, IndexError, KeyError, OverflowError, UnicodeDecodeError, EOFError,
                 MemoryError, RecursionError)     # pickletools' own parse errors, unhashable keys


class _Machine:
    """The stack machine: one method per family of allowed opcodes (:data:`_HANDLERS`)."""

    def __init__(self) -> None:
        self.stack: list = []
        self.marks: list[int] = []
        self.memo: dict = {}
        self.items = 0

    # -- stack helpers
    def need(self, n: int = 1) -> None:
        if len(self.stack) - (self.marks[-1] if self.marks else 0) < n:
            raise UnsafePickleError("stack underflow")

    def take(self, n: int, below: int = 0) -> list:
        """Pop the top `n` items, checking that `below` more (the container they go into) exist."""
        self.need(n + below)
        out = self.stack[-n:]
        del self.stack[-n:]
        return out

    def pop_mark(self) -> list:
        if not self.marks:
            raise UnsafePickleError("MARK expected")
        start = self.marks.pop()
        out = self.stack[start:]
        del self.stack[start:]
        return out

    def count(self, n: int) -> None:
        self.items += n
        if self.items > MAX_ITEMS:
            raise UnsafePickleError(f"more than {MAX_ITEMS} container items")

    def target(self, kind, op: str, pos: int):
        self.need()
        if type(self.stack[-1]) is not kind and not (kind is dict and isinstance(self.stack[-1], dict)):
            raise UnsafePickleError(f"{op} on a {type(self.stack[-1]).__name__} (at byte {pos})")
        return self.stack[-1]

    # -- opcode families
    def framing(self, op: str, arg, pos: int) -> None:
        if op == "PROTO" and arg > 5:
            raise UnsafePickleError(f"pickle protocol {arg} is not supported")
        if op in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
            self.need()
            self.memo[len(self.memo) if op == "MEMOIZE" else int(arg)] = self.stack[-1]

    def get(self, op: str, arg, pos: int) -> None:
        if int(arg) not in self.memo:
            raise UnsafePickleError(f"memo key {arg} not defined (at byte {pos})")
        self.stack.append(self.memo[int(arg)])

    def value(self, op: str, arg, pos: int) -> None:
        if isinstance(arg, int) and arg.bit_length() > 4 * MAX_INT_DIGITS:
            raise UnsafePickleError("integer too long")
        self.stack.append(_CONSTANTS[op] if op in _CONSTANTS else arg)

    def marker(self, op: str, arg, pos: int) -> None:
        if op == "MARK":
            self.marks.append(len(self.stack))
        elif op == "POP":
            self.take(1)
        elif op == "POP_MARK":
            self.pop_mark()
        else:                                           # DUP
            self.need()
            self.stack.append(self.stack[-1])

    def container(self, op: str, arg, pos: int) -> None:
        st = self.stack
        if op in ("TUPLE1", "TUPLE2", "TUPLE3"):
            st.append(tuple(_plain(v, "a tuple item") for v in self.take(int(op[-1]))))
        elif op == "TUPLE":
            st.append(tuple(_plain(v, "a tuple item") for v in self.pop_mark()))
        elif op in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"):
            st.append({"EMPTY_LIST": list, "EMPTY_DICT": dict, "EMPTY_SET": set}[op]())
        elif op == "LIST":
            st.append([_plain(v, "a list item") for v in self.pop_mark()])
        elif op == "DICT":
            vals = self.pop_mark()
            st.append(_pairs({}, vals, pos))
            self.count(len(vals))
        elif op == "FROZENSET":
            st.append(frozenset(_plain(v, "a set item") for v in self.pop_mark()))
        elif op in ("APPEND", "APPENDS"):
            vals = self.pop_mark() if op == "APPENDS" else self.take(1, below=1)
            self.target(list, op, pos).extend(_plain(v, "a list item") for v in vals)
            self.count(len(vals))
        elif op in ("SETITEM", "SETITEMS"):
            vals = self.pop_mark() if op == "SETITEMS" else self.take(2, below=1)
            _pairs(self.target(dict, op, pos), vals, pos)
            self.count(len(vals))
        else:                                           # ADDITEMS
            vals = self.pop_mark()
            self.target(set, op, pos).update(_plain(v, "a set item") for v in vals)
            self.count(len(vals))

    def global_(self, op: str, arg, pos: int) -> None:
        if op == "GLOBAL":
            module, _, qual = arg.partition(" ")
        else:
            module, qual = self.take(2)
            if type(module) is not str or type(qual) is not str:
                raise UnsafePickleError(f"STACK_GLOBAL needs two strings (at byte {pos})")
        if (module, qual) not in ALLOWED:
            raise UnsafePickleError(f"global {module}.{qual} is not allowed (at byte {pos})"[:300])
        # a dtype is pickled as the global itself: it is a value, never something to call
        self.stack.append(_DTYPES[qual] if module == "torch" and qual in _DTYPES else _Global(module, qual))

    def construct(self, op: str, arg, pos: int) -> None:
        if op == "REDUCE":
            fn, args = self.take(2)
            if not isinstance(fn, _Global) or type(args) is not tuple:
                raise UnsafePickleError(f"REDUCE of a {type(fn).__name__} is not allowed (at byte {pos})")
            self.stack.append(_call(fn, tuple(_plain(a, "an argument") for a in args), pos))
        elif op == "NEWOBJ":
            cls, args = self.take(2)
            if not isinstance(cls, _Global) or (cls.module, cls.name) not in _DATACLASSES or args != ():
                raise UnsafePickleError(f"NEWOBJ of {cls!r:.80} is not allowed (at byte {pos})")
            self.stack.append(object.__new__(_dataclass(cls)))
        else:                                           # BUILD
            self.need(2)
            state = self.stack.pop()
            _build(self.stack[-1], state, pos)

    def result(self):
        if len(self.stack) != 1 or self.marks:
            raise UnsafePickleError(f"malformed pickle: STOP with a stack of {len(self.stack)} items")
        if isinstance(self.stack[0], _Global):
            raise UnsafePickleError("the pickle's value is a bare global")
        return self.stack[0]


_HANDLERS = {
    **{op: _Machine.framing for op in ("PROTO", "FRAME", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT")},
    **{op: _Machine.get for op in ("GET", "BINGET", "LONG_BINGET")},
    **{op: _Machine.value for op in _VALUE_OPS | set(_CONSTANTS)},
    **{op: _Machine.marker for op in ("MARK", "POP", "POP_MARK", "DUP")},
    **{op: _Machine.container for op in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "LIST", "APPEND",
                                          "APPENDS", "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_SET",
                                          "ADDITEMS", "FROZENSET")},
    **{op: _Machine.global_ for op in ("GLOBAL", "STACK_GLOBAL")},
    **{op: _Machine.construct for op in ("REDUCE", "NEWOBJ", "BUILD")},
}


def loads(data: bytes):
    """Decode a DCP metadata pickle without calling anything the stream names."""
    if len(data) > MAX_BYTES:
        raise UnsafePickleError(f"metadata of {len(data)} bytes exceeds the {MAX_BYTES} byte limit")
    machine = _Machine()
    try:
        for op, arg, pos in pickletools.genops(data):
            if op.name == "STOP":
                return machine.result()
            handler = _HANDLERS.get(op.name)
            if handler is None:
                raise UnsafePickleError(f"pickle opcode {op.name} is not allowed (at byte {pos})")
            handler(machine, op.name, arg, pos)
    except UnsafePickleError:
        raise
    except _PARSE_ERRORS as e:
        raise UnsafePickleError(f"malformed pickle: {type(e).__name__}: {str(e)[:200]}") from None
    raise UnsafePickleError("malformed pickle: no STOP opcode")


def _pairs(d: dict, vals: list, pos: int) -> dict:
    if len(vals) % 2:
        raise UnsafePickleError(f"odd number of dict items (at byte {pos})")
    for k, v in zip(vals[::2], vals[1::2]):
        d[_plain(k, "a dict key")] = _plain(v, "a dict value")
    return d
