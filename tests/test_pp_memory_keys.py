"""The pipeline memory facts as workload keys: what the runtime does with the tensors a stage has sent
(``pp_sent_tensors``: kept by torch.distributed.pipelining, freed by Megatron's deallocate_pipeline_outputs
and the Llama 3 runtime) and when FSDP reduce-scatters the gradients under a pipeline (``pp_grad_sync``:
at the last micro-batch, torch's pipelining, or every micro-batch, the Llama 3 paper's FSDP).  Each key's
memory effect against a hand computation (exact bytes), its step-time effect, the auto resolution, the
one-line errors, titan-run's refusal, the uncovered regime and the validator's llama3-meta rule.  The
flag / plan-file / --json test is the parametrized one in tests/test_moe_dispatch.py."""
from __future__ import annotations

import dataclasses

import pytest
import yaml

from cost_models.coefficients import Coefficients
from cost_models.comm import axis_links, ring_gather_time
from cost_models.compute import Rates
from cost_models.data_parallel import data_parallel
from cost_models.flops import param_counts
from cost_models.frameworks import get_framework
from cost_models.layout import layers_per_rank, rank_params
from cost_models.memory import memory_by_rank
from cost_models.specs import SpecError, load_hardware, load_model
from cost_models.uncertainty import regimes
from cost_models.step_time import stage_times, step_time_breakdown
from cost_models.workload import Workload
from search_spaces.plan import Plan
from search_spaces.table import CandidateTable
from tests.cost_model_helpers import assert_titan_run_refuses, load_bench

DEBUG = load_model("llama3-debug")          # dim 256, 4 layers, dense
LLAMA70 = load_model("llama3-70b")
H100 = load_hardware("h100-sxm")
SEQ = 128


def _wl(layout="fsdp2", **kw) -> Workload:
    zero = {"zero": 1} if layout == "megatron" else {}
    return Workload(seq_len=SEQ, global_batch=16, state_layout=layout, **zero, **kw)


def _table(**kw) -> CandidateTable:
    base = dict(dp_shard=2, pp=2, microbatch=1, n_microbatches=8, ac="none", runnable=False)
    return CandidateTable.from_plans([Plan(**{**base, **kw})])


def _mem(table, wl, model=DEBUG):
    # no caching allocator: no fragmentation on top, so each term is the tensors' bytes alone
    return memory_by_rank(table, model, wl, Coefficients(), caching_allocator=False)


def test_freed_sends_drop_the_interleaved_send_buffers_exactly():
    """Interleaved1F1B, pp 2, v 2, 8 micro-batches: torch's runtime keeps (2v - 1) x n_microbatches sent
    residual-width tensors ([microbatch x seq, dim] bf16) to the end of the step on every rank, and its
    PipelineStage as TorchTitan runs it (``pp_recv_buffers: persistent``) one receive buffer per
    micro-batch and direction (2 per stage held, less the first stage's input and the last stage's output
    gradient: 3 per rank here; titan-run receives per micro-batch).  ``freed`` (the Llama 3 paper's "we
    proactively deallocate ... the input and output tensors of each pipeline stage") drops both."""
    t = _table(schedule="Interleaved1F1B", stages_per_rank=2)
    kept, freed = _mem(t, _wl(pp_sent_tensors="kept")), _mem(t, _wl(pp_sent_tensors="freed"))
    persistent = _mem(t, _wl(pp_sent_tensors="kept", pp_recv_buffers="persistent"))
    freed_p = _mem(t, _wl(pp_sent_tensors="freed", pp_recv_buffers="persistent"))
    sends = (2 * 2 - 1) * 8 * (2.0 * DEBUG.dim * 1 * SEQ)         # 3 x 8 x 64 KiB = 1.5 MiB
    recv = 3 * 8 * (2.0 * DEBUG.dim * 1 * SEQ)
    for rank in kept:
        assert kept[rank]["activations"][0] - freed[rank]["activations"][0] == sends, rank
        assert persistent[rank]["activations"][0] - freed_p[rank]["activations"][0] == sends + recv, rank
        for k in ("params", "grads", "optimizer", "fsdp_buffers", "logits", "overhead"):
            assert kept[rank][k][0] == freed[rank][k][0], (rank, k)
    released = _mem(t, _wl(pp_sent_tensors="released"))
    assert _mem(t, _wl())["first"]["activations"][0] == released["first"]["activations"][0]   # auto, fsdp2
    for rank in kept:
        assert freed[rank]["activations"][0] < released[rank]["activations"][0] < kept[rank]["activations"][0]


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble", "DualPipeV", "1F1B"])
def test_released_sends_do_not_grow_with_the_microbatch_count(schedule):
    """titan-run (``pp_sent_tensors: released``, executor/parallel/pipeline.py): a sent stage output is let go
    once its gradient is back, a sent input gradient once the schedule's program shows the peer has used it,
    so a rank's peak no longer grows with the micro-batch count (titan-run's profiled peak at 8 and 16
    micro-batches: 0 / 0 on every schedule, bench/bench_pp_recv_memory.py); a bounded set of input gradients
    stays (`HELD_GRAD_SENDS`); torch's runtime as it is (``kept``) grows 3 / 3 and 2 / 2 a micro-batch."""
    from cost_models.activations import HELD_GRAD_SENDS, HELD_GRAD_SENDS_ZBV
    v = 1 if schedule == "1F1B" else 2
    resid = 2.0 * DEBUG.dim * SEQ
    grow, at16 = {}, {}
    for mode in ("released", "kept", "freed"):
        lo, hi = (_mem(_table(schedule=schedule, stages_per_rank=v, n_microbatches=n), _wl(pp_sent_tensors=mode))
                  for n in (8, 16))
        grow[mode] = [(hi[r]["activations"][0] - lo[r]["activations"][0]) / 8 / resid for r in ("first", "last")]
        at16[mode] = [hi[r]["activations"][0] for r in ("first", "last")]
    assert grow["released"] == [0, 0]
    assert grow["kept"] == {"Interleaved1F1B": [3, 3], "1F1B": [0, 0]}.get(schedule, [2, 2])
    if schedule == "1F1B":
        return
    held = HELD_GRAD_SENDS_ZBV if schedule == "ZBVZeroBubble" else HELD_GRAD_SENDS
    # on top of Megatron's freed sends: the in-flight stage outputs (`boundary`) and the held input gradients
    for r in range(2):
        extra = (at16["released"][r] - at16["freed"][r]) / resid
        assert extra >= held and extra < held + 2 * v * 8, (r, extra)


def test_freed_sends_drop_the_1f1b_stage_outputs_exactly():
    """1F1B, pp 2, 8 micro-batches: each in-flight micro-batch's stage output stays in the forward cache of the
    first stage (2 in flight on rank 0 of 2); the loss stage sends none (its output is the logits).  With
    torch's persistent receive buffers each stage also keeps one per micro-batch (the first stage its output
    gradient's, the last its input's); ``freed`` drops them too."""
    t = _table(schedule="1F1B")
    kept, freed = _mem(t, _wl()), _mem(t, _wl(pp_sent_tensors="freed"))
    resid = 2.0 * DEBUG.dim * SEQ
    assert kept["first"]["activations"][0] - freed["first"]["activations"][0] == 2 * resid
    assert kept["last"]["activations"][0] == freed["last"]["activations"][0]
    kept_p = _mem(t, _wl(pp_recv_buffers="persistent"))
    freed_p = _mem(t, _wl(pp_sent_tensors="freed", pp_recv_buffers="persistent"))
    assert kept_p["first"]["activations"][0] - freed_p["first"]["activations"][0] == 2 * resid + 8 * resid
    assert kept_p["last"]["activations"][0] - freed_p["last"]["activations"][0] == 8 * resid


def test_megatron_kept_sends_cost_what_torch_keeps():
    t = _table(schedule="Interleaved1F1B", stages_per_rank=2)
    m_auto, m_kept = _mem(t, _wl("megatron")), _mem(t, _wl("megatron", pp_sent_tensors="kept"))
    f_kept, f_freed = _mem(t, _wl(pp_sent_tensors="kept")), _mem(t, _wl(pp_sent_tensors="freed"))
    assert m_auto["first"]["activations"][0] == _mem(t, _wl("megatron", pp_sent_tensors="freed"))["first"][
        "activations"][0]
    assert (m_kept["first"]["activations"][0] - m_auto["first"]["activations"][0]
            == f_kept["first"]["activations"][0] - f_freed["first"]["activations"][0] > 0)


@pytest.mark.parametrize("reshard", [True, False])
def test_every_microbatch_grad_sync_shards_the_gradients_exactly(reshard):
    """fsdp2, pp 2, FSDP 2, 8 micro-batches: deferred, each rank accumulates its stage's fp32 gradients
    unsharded (4 B x local parameters); reduce-scattered every micro-batch, it holds its shard (/ 2)."""
    t = _table(schedule="1F1B", reshard_after_forward=reshard)
    rp = rank_params(t, DEBUG)
    last, every = _mem(t, _wl()), _mem(t, _wl(pp_grad_sync="every_microbatch"))
    for rank in ("first", "last"):
        local = float(rp[f"{rank}_dense"][0])
        assert last[rank]["grads"][0] == 4.0 * local
        assert every[rank]["grads"][0] == 4.0 * local / 2
        assert every[rank]["params"][0] == last[rank]["params"][0] == 4.0 * local / 2
        assert every[rank]["optimizer"][0] == last[rank]["optimizer"][0]
    # no pipeline: the gradients are reduce-scattered every micro-batch either way
    t1 = _table(pp=1, dp_shard=4)
    a, b = _mem(t1, _wl()), _mem(t1, _wl(pp_grad_sync="every_microbatch"))
    assert a["first"]["grads"][0] == b["first"]["grads"][0] == 4.0 * float(rank_params(t1, DEBUG)["first_dense"][0]) / 4


def test_every_microbatch_grad_sync_pays_a_gradient_pass_per_microbatch():
    """llama3-70b on 64 H100 nodes (TP 8, PP 4, FSDP 16 across nodes, 64 micro-batches of 2,048 tokens): the
    data-parallel time grows with the reduce-scatters of every micro-batch (more than the block's compute can
    hide), the unsharded accumulation pass shrinks to the shard's, and without a pipeline nothing changes."""
    wl = Workload(seq_len=2048, global_batch=1024)
    every = dataclasses.replace(wl, pp_grad_sync="every_microbatch")
    for reshard in (True, False):
        t = CandidateTable.from_plans([Plan(dp_shard=16, tp=8, pp=4, microbatch=1, n_microbatches=64,
                                            schedule="Interleaved1F1B", stages_per_rank=2, ac="none",
                                            reshard_after_forward=reshard, runnable=False)])
        a = step_time_breakdown(t, LLAMA70, H100, wl, Coefficients())
        b = step_time_breakdown(t, LLAMA70, H100, every, Coefficients())
        assert b["dp_comm"][0] > a["dp_comm"][0] > 0, reshard
        assert b["other"][0] < a["other"][0]
        assert b["compute"][0] == a["compute"][0]
    t1 = CandidateTable.from_plans([Plan(dp_shard=64, tp=8, microbatch=1, n_microbatches=16, ac="full",
                                         runnable=False)])
    a1 = step_time_breakdown(t1, LLAMA70, H100, wl, Coefficients())
    b1 = step_time_breakdown(t1, LLAMA70, H100, every, Coefficients())
    assert all(a1[k][0] == b1[k][0] for k in a1)


def test_auto_resolution_and_one_line_errors():
    assert _wl().pp_sent_tensors == "auto" and _wl().pp_keeps_sent
    assert not _wl("megatron").pp_keeps_sent
    assert _wl("megatron", pp_sent_tensors="kept").pp_keeps_sent and not _wl(pp_sent_tensors="freed").pp_keeps_sent
    assert _wl().pp_recv_buffers == "auto" and not _wl().pp_recv_persistent and not _wl("megatron").pp_recv_persistent
    assert _wl(pp_recv_buffers="persistent").pp_recv_persistent
    assert get_framework("torchtitan").workload["pp_recv_buffers"] == "persistent"
    assert _wl().pp_grad_sync == "auto" and _wl().pp_defers_grad_sync and _wl().pp_grad_sync_mode == "last_microbatch"
    assert _wl(pp_grad_sync="last_microbatch").pp_defers_grad_sync and _wl("megatron").pp_defers_grad_sync
    assert _wl(pp_grad_sync="every_microbatch").pp_grad_sync_mode == "every_microbatch"
    assert not _wl(pp_grad_sync="every_microbatch").pp_defers_grad_sync
    assert _wl().pp_sent_mode == "released" and _wl("megatron").pp_sent_mode == "freed"
    assert not _wl().pp_keeps_sent_outputs and _wl(pp_sent_tensors="kept").pp_keeps_sent_outputs
    assert get_framework("torchtitan").workload["pp_sent_tensors"] == "kept"
    with pytest.raises(SpecError, match="pp_sent_tensors.*auto, kept, released, freed; got 'dropped'"):
        _wl(pp_sent_tensors="dropped")
    with pytest.raises(SpecError) as ei:
        _wl("megatron", pp_grad_sync="every_microbatch")
    msg = str(ei.value)
    assert "\n" not in msg and "'pp_grad_sync' is 'every_microbatch'" in msg and "allowed: auto, last_microbatch" in msg


def test_titan_run_refuses_what_it_does_not_run(tmp_path):
    assert_titan_run_refuses(tmp_path, "pp_sent_tensors", "freed", ["auto", "released"])
    assert_titan_run_refuses(tmp_path, "pp_sent_tensors", "kept", ["auto"])
    assert_titan_run_refuses(tmp_path, "pp_recv_buffers", "persistent", ["auto", "per_microbatch"])
    # titan-run runs every_microbatch on GPipe / 1F1B / Interleaved1F1B (tests/distributed/test_pp_grad_sync.py);
    # the V schedules compute weight gradients after the micro-batch's reduce-scatter would run
    v_plan = {"pp": 2, "schedule": "ZBVZeroBubble", "stages_per_rank": 2, "n_microbatches": 2, "microbatch": 2}
    assert_titan_run_refuses(tmp_path, "pp_grad_sync", "every_microbatch", ["last_microbatch"], plan=v_plan)
    from executor.config import load_run_config   # lazy: the cost-model tests stay torch-free
    f = tmp_path / "plain.yaml"
    f.write_text(yaml.safe_dump({"model": "llama3-debug", "plan": {**v_plan, "schedule": "1F1B", "stages_per_rank": 1},
                                 "workload": {"seq_len": 64, "global_batch": 4, "pp_grad_sync": "every_microbatch"}}))
    assert load_run_config(str(f), [], world_size=2).workload.pp_grad_sync == "every_microbatch"


def test_a_departure_from_the_layouts_runtime_is_a_regime_of_its_own():
    """Each key that departs from the layout's own runtime is a regime the uncertainty bands track (whether a
    published run covers it is the derived file's business: the llama3-meta rows now cover the grad sync)."""
    t = _table(schedule="Interleaved1F1B", stages_per_rank=2)
    on = lambda wl: {name for name, mask in regimes(t, DEBUG, H100, wl).items() if bool(mask[0])}
    new = on(_wl(pp_sent_tensors="freed", pp_grad_sync="every_microbatch")) - on(_wl())
    assert new == {"pipeline freeing the tensors it has sent, fsdp2 state layout",
                   "FSDP gradients reduce-scattered every pipeline micro-batch"}, new


def test_validator_applies_the_llama3_papers_stated_deallocations():
    V = load_bench("validate_reference")
    rows = {r["id"]: r for r in V.load_extra_rows()}
    rid = "llama3paper_t4_405B_8192gpu_seq8k"
    if rid not in rows:
        pytest.skip("llama3 paper rows not in bench/reference_extra.yaml")
    wl = V.build_case(rows[rid]).workload
    assert (wl.pp_sent_tensors, wl.pp_grad_sync) == ("freed", "every_microbatch")


def test_every_microbatch_reduce_scatters_against_a_hand_computation():
    """llama3-8b, FSDP 8 x PP 3 (1F1B, 8 micro-batches, no reshard after forward), overlap off: each of the 7
    micro-batches before the last adds one reduce-scatter of the busiest rank's 11 blocks (the last rank holds
    10) and of the last rank's root (LM head and final norm), each a ring over the 8 FSDP ranks in fp32."""
    model = load_model("llama3-8b")
    wl = Workload(seq_len=4096, global_batch=64)
    coeffs = Coefficients(dp_overlap=0.0)
    t = CandidateTable.from_plans([Plan(dp_shard=8, pp=3, microbatch=1, n_microbatches=8, schedule="1F1B",
                                        ac="full", reshard_after_forward=False, runnable=False)])
    rp = rank_params(t, model)
    assert rp["last_layers"][0][0] == 10 and layers_per_rank(t, model)[0] == 11
    r = Rates(H100, wl, coeffs)
    links = axis_links(t, H100, coeffs)
    st = stage_times(t, model, H100, wl, coeffs, links, r)
    last, _ = data_parallel(t, model, H100, wl, coeffs, links, r, st)
    every, _ = data_parallel(t, model, H100, dataclasses.replace(wl, pp_grad_sync="every_microbatch"), coeffs,
                             links, r, st)
    pc = param_counts(model)
    block, root = pc["dense_layer"], pc["lm_head"] + pc["final_norm"]
    fs = links["fsdp"]
    rs = float(ring_gather_time(8, 4.0 * block, fs.bw, fs.alpha)[0])
    rs_root = float(ring_gather_time(8, 4.0 * root, fs.bw, fs.alpha)[0])
    assert float(every[0] - last[0]) == pytest.approx(7 * (11 * rs + rs_root), rel=1e-9)
