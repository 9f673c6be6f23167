"""titan-run's pipeline stages receive into a fresh buffer per micro-batch (executor/parallel/pipeline.py):
torch's PipelineStage keeps one per micro-batch and direction for the stage's life.  Real 2-process gloo
runs at two micro-batch counts (bench/bench_pp_recv_memory.py's runs): each rank's measured peak grows per
micro-batch by exactly what the cost model says titan-run keeps (nothing: no receive buffers, no sent output
past its backward, no sent input gradient past the peer's use of it), and the torchtitan regime's retained outputs and
persistent buffers are what the model adds on top."""
from __future__ import annotations

import pytest

from tests.cost_model_helpers import load_bench

bench = load_bench("bench_pp_recv_memory")
SCHEDULE, V = "Interleaved1F1B", 2


def _growth(lo: list[float], hi: list[float], n: int) -> list[float]:
    return [(b - a) / n / bench.RESID for a, b in zip(lo, hi)]


@pytest.mark.slow          # two titan-run launches (~1 min); the suite is at its 30-minute budget
def test_peak_growth_per_microbatch_is_the_modelled_sends_only():
    # 8 and 16 micro-batches: past the in-flight cap on both (at 4 rank 0 still holds one stage output fewer)
    measured = _growth(bench.measured(SCHEDULE, V, 8, 1), bench.measured(SCHEDULE, V, 16, 1), 8)
    model = _growth(bench.modelled(SCHEDULE, V, 8), bench.modelled(SCHEDULE, V, 16), 8)
    # Interleaved1F1B, pp 2, v 2: each rank sends 3 tensors a micro-batch; titan-run lets a sent stage output go
    # once its gradient is back and a sent input gradient once the peer's next message shows it used it
    # (pp_sent_tensors: released): nothing grows (torch's runtime holds them all to the step's end)
    assert model == pytest.approx([0.0, 0.0])
    assert measured == pytest.approx(model, abs=0.05), (measured, model)
    # torch's runtime as TorchTitan runs it holds the sent outputs too (3 a micro-batch on each rank), and its
    # persistent receive buffers add 3 directions a micro-batch on each rank
    torchtitan = _growth(bench.modelled(SCHEDULE, V, 8, pp_recv_buffers="persistent", pp_sent_tensors="kept"),
                         bench.modelled(SCHEDULE, V, 16, pp_recv_buffers="persistent", pp_sent_tensors="kept"), 8)
    assert torchtitan == pytest.approx([6.0, 6.0])
