"""The DCP metadata reader never runs code: a corpus of known pickle exploits.

Every payload is checked twice: run by the standard ``pickle`` in a child
process it really creates its marker file (so the corpus is live, not a set
of harmless strings), and handed to :func:`executor.safe_pickle.loads` and to
a real ``--resume``-style ``dcp_load`` it is refused with nothing created.
"""
from __future__ import annotations

import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from executor import checkpoint_files as ck
from executor import safe_pickle

PROTO = b"\x80\x04"
MARK, STOP, TUPLE, REDUCE, BUILD, EMPTY_TUPLE, EMPTY_DICT = b"(", b".", b"t", b"R", b"b", b")", b"}"
NEWOBJ, SETITEM, TUPLE1 = b"\x81", b"s", b"\x85"


def s(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw if len(raw) < 256 else b"X" + struct.pack("<I", len(raw)) + raw


def sg(module: str, name: str) -> bytes:
    """STACK_GLOBAL module.name"""
    return s(module) + s(name) + b"\x93"


def g(module: str, name: str) -> bytes:
    """GLOBAL module name (protocol 0-3 form)"""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def call(fn: bytes, *args: bytes) -> bytes:
    return fn + MARK + b"".join(args) + TUPLE + REDUCE


def corpus(marker: Path) -> dict[str, bytes]:
    m = str(marker)
    cmd = f"touch {m}"
    os_mod = call(sg("builtins", "__import__"), s("os"))
    return {
        "REDUCE os.system": PROTO + call(sg("os", "system"), s(cmd)) + STOP,
        "GLOBAL posix.system": g("posix", "system") + MARK + s(cmd) + TUPLE + REDUCE + STOP,
        "STACK_GLOBAL builtins.exec": PROTO + call(sg("builtins", "exec"), s(f"open({m!r}, 'w')")) + STOP,
        "builtins.eval": PROTO + call(sg("builtins", "eval"), s(f"open({m!r}, 'w')")) + STOP,
        "getattr on an imported module": PROTO + call(call(sg("builtins", "getattr"), os_mod, s("system")),
                                                      s(cmd)) + STOP,
        "nested getattr through DCP's module": PROTO + call(
            call(sg("builtins", "getattr"),
                 call(sg("builtins", "getattr"), call(sg("importlib", "import_module"),
                                                      s("torch.distributed.checkpoint.metadata")), s("os")),
                 s("system")), s(cmd)) + STOP,
        "dotted global name": PROTO + call(sg("torch.distributed.checkpoint.metadata", "os.system"), s(cmd)) + STOP,
        "pathlib method": PROTO + call(call(sg("builtins", "getattr"), call(sg("pathlib", "PosixPath"), s(m)),
                                            s("touch"))) + STOP,
        "pathlib write_text by dotted name": PROTO + call(sg("pathlib", "Path.write_text"),
                                                          call(sg("pathlib", "PosixPath"), s(m)), s("x")) + STOP,
        "operator.attrgetter": PROTO + call(call(call(sg("operator", "attrgetter"), s("system")), os_mod),
                                            s(cmd)) + STOP,
        "operator.methodcaller": PROTO + call(call(sg("operator", "methodcaller"), s("system"), s(cmd)),
                                              os_mod) + STOP,
        "functools.partial": PROTO + call(call(sg("functools", "partial"), sg("os", "system"), s(cmd))) + STOP,
        "codecs.open": PROTO + call(sg("codecs", "open"), s(m), s("w")) + STOP,
        "subprocess.Popen": PROTO + call(sg("subprocess", "Popen"), MARK + s("touch") + s(m) + b"l") + STOP,
        "subprocess.check_call": PROTO + call(sg("subprocess", "check_call"), MARK + s("touch") + s(m) + b"l") + STOP,
        "INST opcode": MARK + s(cmd) + b"ios\nsystem\n" + STOP,
        "OBJ opcode": MARK + sg("os", "system") + s(cmd) + b"o" + STOP,
        "NEWOBJ of a callable": PROTO + sg("subprocess", "Popen") + MARK + MARK + s("touch") + s(m) + b"l"
                                + TUPLE + NEWOBJ + STOP,
        "NEWOBJ_EX": PROTO + sg("subprocess", "Popen") + MARK + MARK + s("touch") + s(m) + b"l" + TUPLE
                     + EMPTY_DICT + b"\x92" + STOP,
        "copyreg._reconstructor": PROTO + call(sg("copyreg", "_reconstructor"), sg("subprocess", "Popen"),
                                               sg("subprocess", "Popen"), MARK + s("touch") + s(m) + b"l") + STOP,
        "copyreg.__newobj__": PROTO + call(sg("copyreg", "__newobj__"), sg("subprocess", "Popen"),
                                           MARK + s("touch") + s(m) + b"l") + STOP,
        "torch._utils._rebuild_tensor_v2 with a REDUCE inside": PROTO + call(
            sg("torch._utils", "_rebuild_tensor_v2"), call(sg("os", "system"), s(cmd))) + STOP,
        "BUILD __setstate__ gadget": PROTO + call(sg("collections", "OrderedDict")) + MARK
                                     + s("__setstate__") + sg("os", "system") + b"d" + BUILD + s(cmd) + BUILD + STOP,
        "BUILD slot state on a DCP class": PROTO + sg("torch.distributed.checkpoint.metadata", "StorageMeta")
                                           + EMPTY_TUPLE + NEWOBJ + b"N" + MARK + s("__class__")
                                           + sg("subprocess", "Popen") + b"d" + b"\x86" + BUILD + STOP,
        "REDUCE of an allowed class with a gadget argument": PROTO + call(
            sg("torch", "Size"), call(sg("os", "system"), s(cmd))) + STOP,
        "REDUCE on a dtype": PROTO + call(sg("torch", "float32"), s(cmd)) + STOP,
        "enum call chain": PROTO + call(call(sg("builtins", "getattr"), sg("torch.distributed.checkpoint.metadata",
                                                                           "_MEM_FORMAT_ENCODING"),
                                             s("__class__"))) + STOP,
        "EXT1 registry": PROTO + b"\x82\x01" + STOP,
        "BINPERSID": PROTO + s(cmd) + b"Q" + STOP,
        "torch.load through a global": PROTO + call(sg("torch", "load"), s(m)) + STOP,
        "a legit DCP metadata with one bad value": None,      # filled by the test below
    }


def _legit_metadata(tmp_path: Path) -> bytes:
    import warnings

    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.zeros(4, 3), "b": torch.ones(2, dtype=torch.bfloat16)}},
                 checkpoint_id=str(tmp_path / "legit"), no_dist=True)
    return (tmp_path / "legit" / ".metadata").read_bytes()


def _payloads(legit: bytes, marker: Path) -> dict[str, bytes]:
    out = corpus(marker)
    # replace the saved 'version' value by a call to os.system
    evil = legit.replace(s("1.0.0"), call(sg("os", "system"), s(f"touch {marker}")))
    assert evil != legit
    out["a legit DCP metadata with one bad value"] = evil
    return out


def test_legit_dcp_metadata_decodes_to_what_pickle_gives(tmp_path):
    data = _legit_metadata(tmp_path)
    assert safe_pickle.loads(data) == pickle.loads(data)


@pytest.mark.slow      # ~30 s: runs every exploit under plain pickle (the refusals of each are tested in CI)
def test_the_exploit_corpus_is_live_under_plain_pickle(tmp_path):
    """Most payloads really run code with the standard unpickler (else the corpus proves nothing)."""
    live, legit = 0, _legit_metadata(tmp_path)
    names = list(corpus(tmp_path))
    for i, name in enumerate(names):
        marker = tmp_path / f"live{i}"
        data = _payloads(legit, marker)[name]
        subprocess.run([sys.executable, "-c", "import pickle,sys; pickle.loads(sys.stdin.buffer.read())"],
                       input=data, capture_output=True, timeout=60)
        live += marker.exists()
    assert live >= 20, f"only {live} of {len(names)} payloads ran code under pickle"


@pytest.mark.parametrize("name", list(corpus(Path("/m"))))
def test_no_payload_runs_code(tmp_path, name):
    marker = tmp_path / "pwned"
    data = _payloads(_legit_metadata(tmp_path), marker)[name]
    with pytest.raises(safe_pickle.UnsafePickleError):
        safe_pickle.loads(data)
    assert not marker.exists()
    # the same bytes as a checkpoint's .metadata: refused in one line by the loader
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / ".metadata").write_bytes(data)
    with pytest.raises(ck.CheckpointError, match="DCP metadata refused"):
        ck.dcp_load({"model": {"w": torch.zeros(4, 3)}}, folder, no_dist=True)
    assert not marker.exists()


def test_malformed_and_oversized_streams_are_refused():
    for data in (b"", b"\x80\x04", b"\x80\x04(", b"\x80\x04]\x94" + b"h\x05", b"\x80\x04}a.",
                 b"\x80\x04K\x01K\x02.", b"\x80\x04" + b"(" * 10 + b"t.", b"\x80\x06N.", b"garbage"):
        with pytest.raises(safe_pickle.UnsafePickleError):
            safe_pickle.loads(data)
    big = b"\x80\x04L" + b"9" * 5000 + b"L\n."
    with pytest.raises(safe_pickle.UnsafePickleError):
        safe_pickle.loads(big)


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_plain_data_round_trips_in_every_protocol(protocol):
    """Every data opcode family (text and binary ints, floats, strings, memo, containers) decodes as pickle does."""
    shared = [1, 2]
    value = {"a": [0, -1, 2**40, -(2**70), 1.5, float("-inf"), "ü" * 300, True, False, None],
             "t": (1,), "t2": (1, 2), "t3": (1, 2, 3), "t4": tuple(range(4)), "nested": {"x": {"y": []}},
             "same": shared, "again": shared, 7: "int key"}
    data = pickle.dumps(value, protocol=protocol)
    out = safe_pickle.loads(data)
    assert out == pickle.loads(data)
    assert out["same"] is out["again"]          # memo references stay shared
