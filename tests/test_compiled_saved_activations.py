"""What a compiled block keeps for backward, against the cost model's per-layer activation bytes.

One llama3-debug block (fp32, CPU), eager and under ``torch.compile`` as titan-run compiles it (per block),
run forward under ``torch.autograd.graph.saved_tensors_hooks``: the bytes of the distinct storages saved for
backward, parameters left out, per token.  The model (`cost_models.activations.layer_activation_terms`, no
recompute) must give the same within 1%: eager, titan-run's SwiGLU Function keeps gate and up and the down
projection's input is rebuilt from them (``rebuilt_input``, on as titan-run's parallelize turns it on); the
compiled block gate, up and the product too -- AOTAutograd's min-cut partitioner
does not recompute the product, which fc2's weight gradient must materialize in backward.
"""
from __future__ import annotations

import pytest
import torch

from cost_models.activations import layer_activation_terms
from cost_models.specs import load_model
from cost_models.workload import Workload
from executor.models.llama import Transformer, rope_cos_sin
from executor.parallel.parallelize import set_rebuild_product

MICROBATCH, SEQ = 4, 128


def _saved_bytes_per_token(block, x, cos, sin) -> float:
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in seen and ptr not in params:
            seen.add(ptr)
            total += st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cos, sin)
    return total / x.shape[0] / x.shape[1]


@pytest.mark.parametrize("compiled", [False, True])
def test_saved_activations_match_the_model(compiled):
    torch.manual_seed(0)
    spec = load_model("llama3-debug")
    model = Transformer(spec)
    block = model.layers["0"]
    set_rebuild_product(block, not compiled)   # as titan-run's parallelize: eager blocks without recompute
    cos, sin = rope_cos_sin(torch.arange(SEQ), model.rope_dim, spec.rope_theta, torch.float32, spec)
    x = torch.randn(MICROBATCH, SEQ, spec.dim, requires_grad=True)
    run = torch.compile(block) if compiled else block
    run(x, cos, sin).sum().backward()          # compile (and warm up) outside the measurement
    measured = _saved_bytes_per_token(run, x, cos, sin)
    model_bytes = float(layer_activation_terms(spec, Workload(seq_len=SEQ, global_batch=MICROBATCH, dtype="fp32"),
                                               False, "none", compiled).sum())
    assert measured == pytest.approx(model_bytes, rel=0.01), (measured, model_bytes)
