"""Tied embeddings over pipeline stages: the first stage holds the embedding, the last a copy of it as the LM head
(initialized alike), and after each step's backward the two gradients are summed into both
(``executor/parallel/pipeline.py: TiedEmbedding``), over the pair of each pipeline's first and last ranks, or on
one rank under the V schedules, which put both ends there.  The gradient norm counts the tied weight once.  Each
layout matches the single-process run of the tied model (loss and grad norm per step within 1e-4 relative).
Checkpoints across pipeline splits: tests/distributed/test_checkpoint.py."""
from __future__ import annotations

import dataclasses

import pytest

from cost_models.specs import load_model
from search_spaces.plan import Plan
from tests.distributed.harness import assert_matches_single_process, write_tied_model

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "dp2xpp2": Plan(dp_shard=2, pp=2, microbatch=1, n_microbatches=2),                 # spmd_types typed stages
    "pp2_zbv": Plan(pp=2, microbatch=1, n_microbatches=4, schedule="ZBVZeroBubble", stages_per_rank=2),  # ends on rank 0
    "pp2_interleaved": Plan(pp=2, microbatch=1, n_microbatches=4, schedule="Interleaved1F1B", stages_per_rank=2),
    "dp2xpp2_dtensor": Plan(dp_shard=2, pp=2, microbatch=1, n_microbatches=2, backend="dtensor"),
}


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> str:
    return write_tied_model(tmp_path_factory.mktemp("tied"))


@pytest.mark.parametrize("layout", [
    "dp2xpp2", "pp2_zbv",
    pytest.param("pp2_interleaved", marks=pytest.mark.slow), pytest.param("dp2xpp2_dtensor", marks=pytest.mark.slow)])
def test_tied_embedding_over_stages_matches_single_process(tied_model, layout):
    run, _ = assert_matches_single_process(LAYOUTS[layout], model=tied_model)
    want = "spmd_types" if layout == "dp2xpp2" else "dtensor"    # a pipeline alone distributes no typed axis
    assert f"backend {want}" in run.proc.stdout


def test_the_head_copy_starts_as_the_embedding():
    """The last stage's head copy takes the embedding's initial values (``Transformer.init_fqn``): one stage of a
    2-stage split, built and initialized in one process, holds exactly what the whole model's tied weight holds."""
    import torch
    from executor.init import init_weights
    from executor.models.llama import Transformer
    from executor.parallel.pipeline import split_for_rank
    spec = dataclasses.replace(load_model("llama3-debug"), tie_embeddings=True)
    whole = Transformer(spec)
    init_weights(whole, whole.init_rule, seed=3, device=torch.device("cpu"))
    (_, last), = split_for_rank(whole, Plan(pp=2, microbatch=1, n_microbatches=2), 1)
    init_weights(last, whole.init_rule, seed=3, device=torch.device("cpu"))
    assert last.tok_embeddings is None and torch.equal(last.output.weight, whole.tok_embeddings.weight)
