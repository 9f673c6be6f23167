"""The one typed reader (search_spaces/typed.py) and the one YAML reader/writer (search_spaces/yaml_file.py)."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
import time
from dataclasses import dataclass, field
from typing import Literal, Mapping

import pytest

from cost_models.coefficients import CoefficientsError
from cost_models.specs import SpecError, hardware_from_dict, load_hardware, load_model, model_from_dict
from executor.checkpoint_files import CheckpointError
from executor.config import ConfigError, TrainConfig
from executor.safe_pickle import UnsafePickleError
from planner.cli import UsageError
from planner.rank import PlanningError
from planner.trials import TrialsError
from search_spaces.plan import PlanError
from search_spaces.space import SpaceError
from search_spaces.typed import INT_LIMIT, InputError, check_fields, from_mapping
from search_spaces.yaml_file import MAX_FILE_BYTES, parse_yaml, read_yaml, write_text


class E(InputError):
    pass


@dataclass(frozen=True, kw_only=True)
class Thing:
    name: str = field(metadata={"nonempty": True})
    count: int = field(default=1, metadata={"min": 1})
    share: float = field(default=0.5, metadata={"min": 0, "max": 1, "open": "left"})
    sharp: float = field(default=4.0, metadata={"allow_inf": True})
    mode: Literal["fast", "slow"] = "fast"
    flag: bool = False
    limit: int | None = None
    sizes: tuple[int, ...] = ()
    weights: Mapping[str, float] = field(default_factory=dict)


def read(**kw):
    return from_mapping(Thing, {"name": "t", **kw}, where="thing.yaml", error=E)


def refused(match: str, **kw) -> str:
    with pytest.raises(E) as ei:
        read(**kw)
    msg = str(ei.value)
    assert match in msg, msg
    assert "\n" not in msg and msg.startswith("thing.yaml: ")
    return msg


def test_values_are_coerced_from_the_annotations():
    t = read(count=3, share=1, sharp=float("inf"), mode="slow", flag=True, limit=None, sizes=[1, 2],
             weights={"a": 1})
    assert (t.count, t.share, t.mode, t.flag, t.limit, t.sizes, t.weights) == (3, 1.0, "slow", True, None, (1, 2),
                                                                                 {"a": 1.0})
    assert isinstance(t.share, float) and math.isinf(t.sharp)
    assert read(share="1e-3").share == 1e-3          # YAML 1.1 reads 1e-3 as a string
    assert read(limit=7).limit == 7


def test_unknown_and_missing_keys():
    msg = refused("unknown key 'cuont' (did you mean 'count'?)", cuont=2)
    assert "allowed: count, flag, limit, mode, name, share, sharp, sizes, weights" in msg
    with pytest.raises(E, match="thing.yaml: missing key 'name'"):
        from_mapping(Thing, {}, where="thing.yaml", error=E)
    with pytest.raises(E, match="expected a mapping of keys"):
        from_mapping(Thing, [1, 2], where="thing.yaml", error=E)
    with pytest.raises(E, match="unknown key '1'"):            # non-string keys do not break sorting
        from_mapping(Thing, {"name": "t", 1: 2, "b": 3}, where="thing.yaml", error=E)


def test_types_ranges_and_finiteness():
    refused("key 'count' must be an integer >= 1, got True", count=True)
    refused("key 'count' must be an integer >= 1, got 0", count=0)
    refused("key 'count' must be an integer >= 1, got 1.5", count=1.5)
    refused(f"at most {INT_LIMIT:,}", count=10 ** 30)
    refused("key 'share' must be a number in (0, 1], got 0", share=0)
    refused("key 'share' must be a number in (0, 1], got 1.5", share=1.5)
    refused("must be a finite number in (0, 1], got nan", share=float("nan"))
    refused("must be a finite number in (0, 1], got inf", share=float("inf"))
    refused("key 'sharp' must be a finite number, got nan", sharp=float("nan"))    # inf allowed, NaN never
    refused("key 'sharp'", sharp=10 ** 400)
    refused("key 'mode' must be one of fast, slow; got 'fats' (did you mean 'fast'?)", mode="fats")
    refused("key 'mode' must be one of fast, slow", mode=1)
    refused("key 'flag' must be true or false, got 'yes'", flag="yes")
    refused("key 'flag' must be true or false, got 1", flag=1)
    refused("key 'name' must be a non-empty string, got ''", name="")
    refused("key 'name' must be a string, got 5", name=5)
    refused("key 'limit' must be an integer or null", limit="x")
    refused("key 'sizes[1]' must be an integer", sizes=[1, "2"])
    refused("key 'sizes' must be a list", sizes="12")
    refused("key 'weights.a' must be a finite number", weights={"a": float("nan")})
    msg = refused("got 'xxxx", mode="x" * 10_000)
    assert len(msg) < 300                                         # values are cut in messages


def test_check_fields_applies_the_same_rules_to_code():
    @dataclass(frozen=True, kw_only=True)
    class Checked:
        n: int = field(default=1, metadata={"min": 1})
        x: float = 1

        def __post_init__(self):
            check_fields(self, where="checked", error=E)

    assert isinstance(Checked(x=2).x, float)
    with pytest.raises(E, match="checked: key 'n' must be an integer >= 1, got 0"):
        Checked(n=0)


def test_every_user_error_class_is_an_input_error():
    for cls in (SpecError, ConfigError, CheckpointError, PlanError, SpaceError, CoefficientsError, UsageError,
                PlanningError, TrialsError, UnsafePickleError):
        assert issubclass(cls, InputError) and issubclass(cls, ValueError), cls


def test_specs_read_through_the_typed_reader():
    base = {"name": "m", "dim": 256, "n_layers": 2, "n_heads": 8, "vocab_size": 512, "ffn_hidden": 512}
    for bad, match in (({"n_kv_heads": 0}, "key 'n_kv_heads' must be an integer in [1, 16,777,216], got 0"),
                       ({"n_layers": 2 ** 40}, "key 'n_layers' must be an integer in [1, 4096]"),
                       ({"rope_theta": float("nan")}, "key 'rope_theta' must be a finite number > 0, got nan"),
                       ({"max_seq_len": -1}, "key 'max_seq_len' must be an integer >= 1, got -1"),
                       ({"vocab_size": 10 ** 30}, "key 'vocab_size' must be an integer of at most"),
                       ({"mlp": "gleu"}, "key 'mlp' must be one of swiglu, gelu; got 'gleu' (did you mean 'gelu'?)"),
                       ({"dim": 250, "n_heads": 16}, "dim (250) must be divisible by n_heads (16)"),
                       ({"head_dim": 15}, "key 'head_dim' must be even")):
        with pytest.raises(SpecError, match=re.escape(match)):
            model_from_dict({**base, **bad})
    hw = load_hardware("h100-sxm").to_dict()
    assert hardware_from_dict(hw) == load_hardware("h100-sxm")          # the wire format round-trips
    for bad, match in (({"sm_count": 0}, "key 'sm_count' must be an integer >= 1 or null, got 0"),
                       ({"host_cores": 0}, "key 'host_cores' must be an integer >= 1 or null, got 0"),
                       ({"device": "tpu"}, "key 'device' must be one of cuda, cpu, rocm"),
                       ({"memory_gib": float("inf")}, "key 'memory_gib' must be a finite number")):
        with pytest.raises(SpecError, match=match):
            hardware_from_dict({**hw, **bad})
    assert load_hardware("cpu").sm_count is None          # not given: no tile/wave quantization
    with pytest.raises(SpecError, match="an empty name"):
        load_model("")
    with pytest.raises(SpecError, match="unknown model"):
        load_model("x" * 5000)                            # a name too long is not an OSError


def test_train_config_ranges():
    for key, v, match in (("lr", float("inf"), "finite number >= 0"), ("grad_clip", float("nan"), "finite"),
                          ("steps", 0, "integer >= 1"), ("min_lr_ratio", 5, r"in \[0, 1\]"),
                          ("beta2", 2.0, r"in \[0, 1\)"), ("beta1", 1.0, r"in \[0, 1\)"), ("eps", 0, "> 0"),
                          ("dtype", "fp16", "one of auto, bf16, fp32"), ("data", "", "non-empty")):
        with pytest.raises(ConfigError, match=f"train: key '{key}' must be .*{match}"):
            TrainConfig.from_dict({key: v})
        with pytest.raises(ConfigError, match=key):
            TrainConfig(**{key: v})
    assert TrainConfig.from_dict({"lr": "1e-3"}).lr == 1e-3
    assert dataclasses.asdict(TrainConfig.from_dict({})) == dataclasses.asdict(TrainConfig())


# --------------------------------------------------------------------------- the YAML reader
def _bomb(levels: int = 9) -> str:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    prev = "a"
    for n in "bcdefghijk"[: levels - 1]:
        lines.append(f"{n}: &{n} [" + ",".join(["*" + prev] * 9) + "]")
        prev = n
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_fast(tmp_path):
    f = tmp_path / "bomb.yaml"
    f.write_text(_bomb())
    t0 = time.perf_counter()
    with pytest.raises(SpecError, match="expands to more than 1,000,000 nodes"):
        load_model(str(f))
    assert time.perf_counter() - t0 < 1.0
    assert parse_yaml("x: &a [1, 2]\ny: *a\n", error=E, where="w") == {"x": [1, 2], "y": [1, 2]}  # small reuse
    with pytest.raises(E, match="more than 100 YAML aliases"):
        parse_yaml("a: &a 1\nb: [" + ", ".join(["*a"] * 101) + "]\n", error=E, where="w")
    with pytest.raises(E, match="refers to a node that contains it"):
        parse_yaml("a: &a [*a]\n", error=E, where="w")
    with pytest.raises(E, match="nested too deeply"):
        parse_yaml("[" * 100_000, error=E, where="w")


def test_files_that_are_not_yaml(tmp_path):
    cases = {"missing": (tmp_path / "nope.yaml", "does not exist"), "folder": (tmp_path, "is a folder"),
             "long": (tmp_path / ("n" * 4000 + ".yaml"), "cannot be read: File name too long")}
    (tmp_path / "bin.yaml").write_bytes(b"\x7fELF\xff\xfe")
    cases["binary"] = (tmp_path / "bin.yaml", "is not a UTF-8 text file")
    (tmp_path / "nul.yaml").write_bytes(b"a: 1\x00")
    cases["nul"] = (tmp_path / "nul.yaml", "binary file")
    os.mkfifo(tmp_path / "fifo.yaml")
    cases["fifo"] = (tmp_path / "fifo.yaml", "is not a regular file")
    with open(tmp_path / "big.yaml", "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)
    cases["big"] = (tmp_path / "big.yaml", "larger than 16 MiB")
    (tmp_path / "bad.yaml").write_text("a: [1, 2\nb: " + "x" * 5000 + "\n")
    cases["malformed"] = (tmp_path / "bad.yaml", "malformed YAML at line")
    for name, (p, match) in cases.items():
        with pytest.raises(E, match=match) as ei:
            read_yaml(p, error=E, what="spec")
        assert "\n" not in str(ei.value) and len(str(ei.value)) < 500, name


# --------------------------------------------------------------------------- the writer
def test_write_text_follows_links_and_never_replaces_devices(tmp_path):
    real = tmp_path / "real.yaml"
    real.write_text("old\n")
    real.chmod(0o640)
    link = tmp_path / "link.yaml"
    link.symlink_to(real)
    assert write_text(link, "new\n", error=E, what="plan file") == real
    assert link.is_symlink() and real.read_text() == "new\n"
    assert stat.S_IMODE(real.stat().st_mode) == 0o640                 # the target keeps its mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.yaml", "real.yaml"]   # no temp file left
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    dev = tmp_path / "dev"
    try:
        os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))       # a /dev/null of our own (root only)
    except PermissionError:
        dev = fifo
    for target, match in ((fifo, "not a regular file"), (dev, "not a regular file"), (tmp_path, "is a folder")):
        with pytest.raises(E, match=f"{match}.*; refusing to replace it"):
            write_text(target, "x", error=E, what="plan file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and not dev.is_file()
    dev_link = tmp_path / "dev-link"
    dev_link.symlink_to(dev)
    with pytest.raises(E, match="refusing to replace it"):
        write_text(dev_link, "x", error=E, what="plan file")
    with pytest.raises(E, match="cannot write plan file"):
        write_text(tmp_path / "fifo" / "x.yaml", "x", error=E, what="plan file")


def test_calibration_file_refuses_non_finite(tmp_path):
    from cost_models.coefficients import Coefficients
    f = tmp_path / "cal.yaml"
    for text, match in (("coefficients: {gemm_efficiency_scale: .nan}", "must be a finite number, got nan"),
                        ("coefficients: {dp_overlap: .inf}", "must be a finite number, got inf"),
                        ("", "an empty calibration file"),
                        ("coefficients: {gemm_eficiency_scale: 1}", "did you mean 'gemm_efficiency_scale'")):
        f.write_text(text)
        with pytest.raises(CoefficientsError, match=match):
            Coefficients.load(f)
    f.write_text("coefficients: {launch_overlap_sharpness: .inf}")
    assert math.isinf(Coefficients.load(f).launch_overlap_sharpness)        # inf = plain maximum: allowed
