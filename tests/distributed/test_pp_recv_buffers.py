"""titan-run's pipeline stages receive into a fresh buffer per micro-batch (executor/parallel/pipeline.py):
torch's PipelineStage keeps one per micro-batch and direction for the stage's life.  Real 2-process gloo
runs at two micro-batch counts (bench/bench_pp_recv_memory.py's runs): each rank's measured peak grows per
micro-batch by exactly what the cost model says titan-run keeps (the runtime's retained sends, no receive
buffers), and the torchtitan regime's persistent buffers are what the model adds on top."""
from __future__ import annotations

import pytest

from tests.cost_model_helpers import load_bench

bench = load_bench("bench_pp_recv_memory")
SCHEDULE, V = "Interleaved1F1B", 2


def _growth(lo: list[float], hi: list[float], n: int) -> list[float]:
    return [(b - a) / n / bench.RESID for a, b in zip(lo, hi)]


@pytest.mark.slow          # two titan-run launches (~1 min); the suite is at its 30-minute budget
def test_peak_growth_per_microbatch_is_the_modelled_sends_only():
    measured = _growth(bench.measured(SCHEDULE, V, 4, 1), bench.measured(SCHEDULE, V, 8, 1), 4)
    model = _growth(bench.modelled(SCHEDULE, V, 4), bench.modelled(SCHEDULE, V, 8), 4)
    # Interleaved1F1B, pp 2, v 2: each rank sends 3 tensors a micro-batch, held to the step's end
    assert model == pytest.approx([3.0, 3.0])
    assert measured == pytest.approx(model, abs=0.05), (measured, model)
    # torch's persistent buffers (the torchtitan regime) would add 3 directions a micro-batch on each rank
    persistent = _growth(bench.modelled(SCHEDULE, V, 4, pp_recv_buffers="persistent"),
                         bench.modelled(SCHEDULE, V, 8, pp_recv_buffers="persistent"), 4)
    assert persistent == pytest.approx([6.0, 6.0])
