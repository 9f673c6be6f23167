"""The executor's data pipeline and small helpers (in-process, no process group)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from executor.data import PackedBatches, load_token_stream, stdlib_files
from executor.init import clean_fqn, full_value, param_seed
from executor.tokenizer import ByteTokenizer, load_tokenizer


def test_stdlib_corpus_is_deterministic_and_excludes_site_packages():
    files = stdlib_files()
    assert files and all("site-packages" not in f.parts for f in files)
    a = load_token_stream("stdlib", ByteTokenizer(), 200_000)
    b = load_token_stream("stdlib", ByteTokenizer(), 200_000)
    assert np.array_equal(a, b) and a.max() < 259 and a[0] == ByteTokenizer.bos_id


def test_txt_and_jsonl_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "xy"}) + "\n\n" + json.dumps({"text": "z"}) + "\n")
    tok = ByteTokenizer()
    s = load_token_stream(str(tmp_path), tok, 10_000)
    assert tok.decode(s) == "hello worldxyz"
    assert list(s[:1]) == [tok.bos_id] and (s == tok.eos_id).sum() == 3
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(ValueError, match="'text' field"):
        load_token_stream(str(tmp_path / "bad.jsonl"), tok, 10_000)


def test_hf_tokenizer_needs_the_package_or_works(tmp_path):
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="pip install tokenizers"):
            load_tokenizer(str(tmp_path / "tokenizer.json"))


def test_batches_shard_the_global_batch_by_dp_rank_and_resume():
    stream = load_token_stream("stdlib", ByteTokenizer(), 300_000)
    full = PackedBatches(stream, seq_len=32, global_batch=8, dp_rank=0, dp_size=1, seed=3)
    parts = [PackedBatches(stream, seq_len=32, global_batch=8, dp_rank=r, dp_size=4, seed=3) for r in range(4)]
    for _ in range(3):
        x, y = full.next_batch()
        xs = [p.next_batch() for p in parts]
        assert torch.equal(torch.cat([a for a, _ in xs]), x) and torch.equal(torch.cat([b for _, b in xs]), y)
        assert torch.equal(x[:, 1:], y[:, :-1])              # labels are the next tokens
    sd = full.state_dict()
    nxt = full.next_batch()
    again = PackedBatches(stream, seq_len=32, global_batch=8, dp_rank=0, dp_size=1, seed=3)
    again.load_state_dict(sd)
    assert torch.equal(again.next_batch()[0], nxt[0])


def test_init_values_depend_on_seed_and_name_only():
    cpu = torch.device("cpu")
    a = full_value(("trunc_normal", 0.02), torch.Size([64, 32]), seed=0, fqn="layers.0.attention.wq.weight", device=cpu)
    b = full_value(("trunc_normal", 0.02), torch.Size([64, 32]), seed=0, fqn="layers.0.attention.wq.weight", device=cpu)
    c = full_value(("trunc_normal", 0.02), torch.Size([64, 32]), seed=0, fqn="layers.1.attention.wq.weight", device=cpu)
    assert torch.equal(a, b) and not torch.equal(a, c) and a.abs().max() <= 0.04
    assert clean_fqn("layers.0._checkpoint_wrapped_module._orig_mod.attention.wq.weight") == \
        "layers.0.attention.wq.weight"
    assert param_seed(0, "x") != param_seed(1, "x")
