"""One typed reader for every YAML / wire format: `from_mapping(cls, data, where=...)`.

Every config, spec and plan type of the project is a frozen, keyword-only
dataclass.  `from_mapping` builds one from a mapping read from YAML (or JSON, or
``--set`` overrides), reading what is allowed from the class itself:

* the keys are the fields; an unknown key is refused with a "did you mean";
* the field annotations say the type: ``int``, ``float``, ``bool``, ``str``,
  ``X | None``, ``Literal["a", "b"]`` (the choices), ``tuple[X, ...]``,
  ``list[X]`` and ``Mapping[str, X]`` of those;
* field metadata states ranges: ``field(default=1, metadata={"min": 1})``,
  ``{"min": 0, "max": 1, "open": "left"}`` (``open``: ``left``, ``right`` or
  ``both`` makes that end exclusive), ``{"allow_inf": True}`` (a float may be
  infinite), ``{"nonempty": True}`` (a string may not be empty).

Refused everywhere: a bool where a number is expected, non-finite floats (NaN
always, infinity unless the field allows it), integers beyond `INT_LIMIT`.
Every refusal is one line, ``<where>: key 'x' must be ..., got ...``, raised as
the caller's error class, a subclass of `InputError`: the one base class of
the user-input errors, which the command-line tools turn into exit code 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Mapping as AbcMapping, Sequence as AbcSequence
from typing import Any, Literal, Mapping, TypeVar, Union

INT_LIMIT = 2 ** 53          # larger integers are refused: the cost models compute in float64 (exact up to 2**53)
MAX_WORLD_SIZE = 2 ** 20     # 1,048,576 devices: the most a plan, --gpus or --world may ask for
MAX_SHOWN = 60               # characters of a value quoted in an error message

T = TypeVar("T")


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, as every other refusal: ``PROG: error: MESSAGE (see 'PROG
    --help')`` on stderr, exit 2, instead of the whole usage block before the message."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class InputError(ValueError):
    """Base class of every error caused by user input (a file, a flag, a key): one line, exit code 2."""


def show(v: Any) -> str:
    """`repr(v)` cut to `MAX_SHOWN` characters, so that an error message stays one short line."""
    try:
        r = repr(v)
    except Exception:  # noqa: BLE001 - a value whose repr fails is still named by its type
        r = f"<{type(v).__name__}>"
    r = r.replace("\n", " ")
    return r if len(r) <= MAX_SHOWN else r[: MAX_SHOWN - 3] + "..."


def did_you_mean(word: Any, allowed: typing.Iterable[str], *, prefixes: bool = False) -> str:
    """The hint of a one-line error: the closest spelling in `allowed`, or nothing.  With `prefixes`, the
    names `word` begins come first (`h100` -> the H100 presets), up to three, closest first."""
    allowed, low = [str(a) for a in allowed], str(word).lower()
    starts = [a for a in allowed if a.lower().startswith(low) and a.lower() != low] if prefixes else []
    if starts:
        starts.sort(key=lambda a: -difflib.SequenceMatcher(None, low, a.lower()).ratio())
        return " (did you mean " + " or ".join(f"'{a}'" for a in starts[:3]) + "?)"
    close = difflib.get_close_matches(str(word), allowed, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def check_keys(data: Any, allowed: typing.Sequence[str], *, where: str,
               error: type[InputError] = InputError) -> None:
    """`data` is a mapping whose keys are all in `allowed` (one line naming the first unknown key)."""
    if not isinstance(data, AbcMapping):
        raise error(f"{where}: expected a mapping of keys ({', '.join(allowed)}), got {type(data).__name__}")
    unknown = sorted((k for k in data if k not in allowed), key=str)
    if unknown:
        k = unknown[0]
        raise error(f"{where}: unknown key {show(str(k))}{did_you_mean(k, allowed)} "
                    f"(allowed: {', '.join(allowed)})")


def from_mapping(cls: type[T], data: Any, *, where: str, error: type[InputError] = InputError) -> T:
    """Build the dataclass `cls` from `data`, checking keys, types and ranges (see the module docstring).

    Errors raised by `cls.__post_init__` of the class `error` are re-raised with `where` in front.
    """
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    check_keys(data, sorted(fields), where=where, error=error)
    hints = _hints(cls)
    for name, f in fields.items():
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and name not in data:
            raise error(f"{where}: missing key '{name}'")
    kwargs = {name: coerce(v, hints.get(name, Any), key=name, where=where, error=error,
                           meta=fields[name].metadata)
              for name, v in data.items()}
    try:
        return cls(**kwargs)
    except error as e:
        msg = str(e)
        raise error(msg if msg.startswith(where) else f"{where}: {msg}") from None


def check_fields(obj: Any, *, where: str, error: type[InputError] = InputError) -> None:
    """The rules of `from_mapping` for a frozen dataclass built in code (call from ``__post_init__``).

    Each field is checked against its annotation and metadata and stored coerced (an int
    given for a float field becomes a float, a list for a tuple field a tuple).
    """
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        v = coerce(getattr(obj, f.name), hints.get(f.name, Any), key=f.name, where=where, error=error,
                   meta=f.metadata)
        object.__setattr__(obj, f.name, v)


def coerce(v: Any, typ: Any, *, key: str, where: str, error: type[InputError] = InputError,
           meta: Mapping[str, Any] | None = None) -> Any:
    """`v` read as the annotation `typ` (see the module docstring); `meta` holds the range rules."""
    meta = meta or {}
    origin, args = typing.get_origin(typ), typing.get_args(typ)

    def bad(what: str) -> InputError:
        return error(f"{where}: key '{key}' must be {what}, got {show(v)}")

    if typ is Any or typ is object:
        return v
    ctx = dict(key=key, where=where, error=error, meta=meta)
    if origin in (Union, types.UnionType):
        return _coerce_union(v, args, bad, **ctx)
    if origin is Literal:
        if isinstance(v, bool) or v not in args or not any(type(v) is type(a) for a in args if a == v):
            allowed = ", ".join(str(a) for a in args)
            raise error(f"{where}: key '{key}' must be one of {allowed}; got {show(v)}"
                        f"{did_you_mean(v, [str(a) for a in args]) if isinstance(v, str) else ''}")
        return v
    for scalar, read in _SCALARS:
        if typ is scalar:
            return read(v, meta, bad)
    if origin in (tuple, list, AbcSequence):
        if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
            raise bad(f"a list of {_type_words(args[0]) if args else 'values'}")
        item = args[0] if args else Any
        out = [coerce(x, item, key=f"{key}[{i}]", where=where, error=error, meta=meta) for i, x in enumerate(v)]
        return tuple(out) if origin is tuple else out
    if origin in (dict, AbcMapping, typing.Mapping):
        return _coerce_mapping(v, args, bad, **ctx)
    if dataclasses.is_dataclass(typ) and isinstance(typ, type):
        if isinstance(v, typ):
            return v
        return from_mapping(typ, v, where=f"{where}: {key}", error=error)
    return v


def _coerce_union(v: Any, args: tuple, bad, **ctx: Any) -> Any:
    """`v` read as ``X | Y | ...``: null when allowed, else the first member type that reads it."""
    if v is None and type(None) in args:
        return None
    rest = [a for a in args if a is not type(None)]
    if len(rest) == 1 and rest[0] in (int, float, str, bool):
        try:
            return coerce(v, rest[0], **ctx)
        except InputError:
            word = "a number" if rest[0] is float else _type_words(rest[0])
            raise bad(f"{_range_words(word, ctx['meta'])} or null") from None
    if len(rest) == 1:
        return coerce(v, rest[0], **ctx)
    for a in rest:
        try:
            return coerce(v, a, **ctx)
        except InputError:
            pass
    raise bad(" or ".join(_type_words(a) for a in args))


def _coerce_mapping(v: Any, args: tuple, bad, *, key: str, where: str, error: type[InputError],
                    meta: Mapping[str, Any]) -> dict:
    """`v` read as ``Mapping[K, V]``: a string key type refuses other keys, each value read as V."""
    if not isinstance(v, AbcMapping):
        raise bad("a mapping")
    kt, vt = args if len(args) == 2 else (Any, Any)
    out = {}
    for k2, v2 in v.items():
        if kt is str and not isinstance(k2, str):
            raise error(f"{where}: key '{key}' has a key {show(k2)} that is not a string")
        out[k2] = coerce(v2, vt, key=f"{key}.{k2}", where=where, error=error, meta=meta)
    return out


def _read_bool(v: Any, meta: Mapping[str, Any], bad) -> bool:
    if not isinstance(v, bool):
        raise bad("true or false")
    return v


def _read_int(v: Any, meta: Mapping[str, Any], bad) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(_range_words("an integer", meta))
    if abs(v) > INT_LIMIT:
        raise bad(f"an integer of at most {INT_LIMIT:,} (2**53) in size")
    _check_range(v, meta, bad, "an integer")
    return v


def _read_float(v: Any, meta: Mapping[str, Any], bad) -> float:
    x = v
    if isinstance(x, str):                  # YAML 1.1 reads 1e-3 (no dot) as a string
        try:
            x = float(x)
        except ValueError:
            raise bad(_range_words("a number", meta)) from None
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise bad(_range_words("a number", meta))
    if isinstance(x, int) and abs(x) > INT_LIMIT:
        raise bad(f"a number of at most {INT_LIMIT:,} (2**53) in size")
    x = float(x)
    if math.isnan(x) or (math.isinf(x) and not meta.get("allow_inf")):
        raise bad(_range_words("a finite number", meta))
    _check_range(x, meta, bad, "a number")
    return x


def _read_str(v: Any, meta: Mapping[str, Any], bad) -> str:
    if not isinstance(v, str):
        raise bad("a string")
    if meta.get("nonempty") and not v.strip():
        raise bad("a non-empty string")
    return v


_SCALARS = ((bool, _read_bool), (int, _read_int), (float, _read_float), (str, _read_str))


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception as e:  # noqa: BLE001 - a programming error in the class, not user input
        raise TypeError(f"{cls.__name__}: cannot resolve field annotations: {e}") from e


def _type_words(t: Any) -> str:
    if t is type(None):
        return "null"
    if typing.get_origin(t) is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(t))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        t, getattr(t, "__name__", str(t)))


def _range_words(noun: str, meta: Mapping[str, Any]) -> str:
    lo, hi, open_ = meta.get("min"), meta.get("max"), meta.get("open", "")
    lo_open, hi_open = open_ in ("left", "both"), open_ in ("right", "both")
    if lo is not None and hi is not None:
        return f"{noun} in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{noun} {'>' if lo_open else '>='} {_num(lo)}"
    if hi is not None:
        return f"{noun} {'<' if hi_open else '<='} {_num(hi)}"
    return noun


def _num(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) and abs(x) >= 10_000 else f"{x:g}"


def _check_range(x: float, meta: Mapping[str, Any], bad, noun: str) -> None:
    lo, hi, open_ = meta.get("min"), meta.get("max"), meta.get("open", "")
    if lo is not None and (x < lo or (x == lo and open_ in ("left", "both"))):
        raise bad(_range_words(noun, meta))
    if hi is not None and (x > hi or (x == hi and open_ in ("right", "both"))):
        raise bad(_range_words(noun, meta))
