"""titan-run's pipeline stages receive into a fresh buffer per micro-batch (executor/parallel/pipeline.py):
torch's PipelineStage keeps one per micro-batch and direction for the stage's life.  Real 2-process gloo
runs at two micro-batch counts: each rank's measured peak grows per micro-batch by exactly what the cost
model says titan-run keeps (the runtime's retained sends, no receive buffers), and the torchtitan regime's
persistent buffers are what the model adds on top."""
from __future__ import annotations

import pytest

from cost_models.coefficients import Coefficients
from cost_models.memory import memory_by_rank
from cost_models.specs import load_model
from cost_models.workload import Workload
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable
from tests.distributed.harness import run_titan

SEQ = 256
RESID = 4 * 256 * SEQ          # fp32 [seq, dim] of llama3-debug, micro-batch 1


def _plan(n_mb: int) -> Plan:
    return Plan(pp=2, schedule="Interleaved1F1B", stages_per_rank=2, microbatch=1, n_microbatches=n_mb)


def _model_acts(n_mb: int, **keys) -> list[float]:
    mem = memory_by_rank(CandidateTable.from_plans([_plan(n_mb)]), load_model("llama3-debug"),
                         Workload(seq_len=SEQ, global_batch=n_mb, dtype="fp32", **keys), Coefficients(),
                         caching_allocator=False)
    return [float(mem[w]["activations"][0]) for w in ("first", "last")]


@pytest.mark.slow          # two titan-run launches (~1 min); the suite is at its 30-minute budget
def test_peak_growth_per_microbatch_is_the_modelled_sends_only():
    peaks = {}
    for n_mb in (4, 8):
        run = run_titan(_plan(n_mb), nproc=2, seq_len=SEQ, steps=2, train={"profile_step": 1})
        peaks[n_mb] = run.metrics[0]["peak_memory_bytes"]
    measured = [(peaks[8][r] - peaks[4][r]) / 4 / RESID for r in range(2)]
    model = [(b - a) / 4 / RESID for a, b in zip(_model_acts(4), _model_acts(8))]
    # Interleaved1F1B, pp 2, v 2: each rank sends 3 tensors a micro-batch, held to the step's end
    assert model == pytest.approx([3.0, 3.0])
    assert measured == pytest.approx(model, abs=0.05), (measured, model)
    # torch's persistent buffers (the torchtitan regime) would add 3 directions a micro-batch on each rank
    persistent = [(b - a) / 4 / RESID for a, b in zip(_model_acts(4, pp_recv_buffers="persistent"),
                                                      _model_acts(8, pp_recv_buffers="persistent"))]
    assert persistent == pytest.approx([6.0, 6.0])
