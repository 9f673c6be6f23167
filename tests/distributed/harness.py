"""The multi-process test harness: real `titan-run` runs (torchrun, gloo) and the one parity check.

    from tests.distributed.harness import assert_matches_single_process
    assert_matches_single_process(Plan(dp_shard=2, microbatch=2))     # 5 steps, llama3-debug, seq 64

`assert_matches_single_process` runs the real executor for the plan, runs the
single-process reference of the same model, data and seed (cached per
configuration for the session), reads the losses and global gradient norms of
every step from each run's ``metrics.jsonl`` and asserts them within ``rtol``
(relative, 1e-4 by default).  It also checks that every rank reports the same
losses (``ranks/rank<r>.json``) and that the reference learns.

`run_titan` is the one way the tests start `titan-run`; `launch_worker` starts a
standalone torchrun worker script of this folder (``_pp_cp_worker.py``,
``_spmd_worker.py``) and returns rank 0's JSON report.  Runs with more than 4
processes take ``/tmp/titan_heavy.lock`` so two heavy runs never overlap on a
small machine.
"""
from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

from search_spaces.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
HEAVY_LOCK = "/tmp/titan_heavy.lock"
DEFAULT_MODEL = "llama3-debug"
DEFAULT_SEQ_LEN = 64
DEFAULT_STEPS = 5
# small, deterministic, fast: enough learning rate that 5 steps move the loss
DEFAULT_TRAIN = {"lr": 3e-3, "warmup": 2, "seed": 0, "profile_step": 0, "tensorboard": False,
                 "max_corpus_bytes": 1_000_000, "grad_clip": 1.0}


_SPEC_DIR: list[Path] = []


def model_spec_file(spec: dict, stem: str) -> str:
    """`spec` (a model dict) as a YAML file titan-run can load, in one folder for this test process that goes
    when it exits."""
    if not _SPEC_DIR:
        folder = Path(tempfile.mkdtemp(prefix="titan-test-specs-"))
        atexit.register(shutil.rmtree, folder, True)
        _SPEC_DIR.append(folder)
    path = _SPEC_DIR[0] / f"{stem}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def titan_run_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "executor.cli", *args]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
    e.setdefault("OMP_NUM_THREADS", "1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


class _heavy_lock:
    def __init__(self, take: bool):
        self.take, self.f = take, None

    def __enter__(self):
        if self.take:
            self.f = open(HEAVY_LOCK, "w")
            fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.f is not None:
            fcntl.flock(self.f, fcntl.LOCK_UN)
            self.f.close()
        return False


# --------------------------------------------------------------------------- running titan-run
@dataclass(frozen=True)
class TitanRun:
    """What one `titan-run` left behind: the process, its run dir (gone for a temporary run), every
    rank's ``ranks/rank<r>.json`` record that exists, and rank 0's ``metrics.jsonl`` records."""
    proc: subprocess.CompletedProcess
    run_dir: Path
    ranks: dict
    metrics: tuple

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.metrics]

    @property
    def grad_norms(self) -> list[float]:
        return [r["grad_norm"] for r in self.metrics]


def write_tied_model(folder: Path) -> str:
    """llama3-debug with its LM head tied to its embedding (as BLOOM, GPT-3 and small Llamas are), as a model YAML
    file in `folder`; returns its path."""
    from cost_models.specs import load_model
    path = Path(folder) / "tied-debug.yaml"
    path.write_text(yaml.safe_dump({**load_model("llama3-debug").to_dict(), "name": "tied-debug",
                                    "tie_embeddings": True}))
    return str(path)


def run_titan(plan: Plan, *, nproc: int | None = None, model: str = DEFAULT_MODEL, seq_len: int = DEFAULT_SEQ_LEN,
              global_batch: int | None = None, steps: int = DEFAULT_STEPS, train: dict | None = None,
              extra: dict | None = None, args: tuple = (), extra_env: dict | None = None,
              run_dir: Path | None = None, expect_ok: bool = True, timeout: float = 900) -> TitanRun:
    """Run the real `titan-run` for `plan` (train = DEFAULT_TRAIN + steps + `train`; `extra` are ``--set``
    overrides such as ``{"train.lr": 1e-3}``; `args` further CLI arguments).  Without `run_dir` the run
    goes to a temporary directory that is removed once its records are read.  ``nproc`` None lets
    titan-run choose (the plan's world size).  With `expect_ok`, a non-zero exit raises."""
    global_batch = plan.global_batch() if global_batch is None else global_batch
    if run_dir is None:
        with tempfile.TemporaryDirectory(prefix="titan-harness-") as tmp:
            return run_titan(plan, nproc=nproc, model=model, seq_len=seq_len, global_batch=global_batch,
                             steps=steps, train=train, extra=extra, args=args, extra_env=extra_env,
                             run_dir=Path(tmp) / "run", expect_ok=expect_ok, timeout=timeout)
    run_dir = Path(run_dir)
    plan_file = run_dir.parent / f"{run_dir.name}.yaml"
    plan_file.write_text(yaml.safe_dump({
        "model": model, "workload": {"seq_len": seq_len, "global_batch": global_batch},
        "plan": plan.to_dict(), "train": {**DEFAULT_TRAIN, "steps": steps, **(train or {})}}))
    cmd = titan_run_cmd("--plan", str(plan_file), "--run-dir", str(run_dir), *args)
    if nproc is not None:
        cmd += ["--nproc-per-node", str(nproc)]
    for k, v in (extra or {}).items():
        cmd += ["--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    e = env()
    e.update(extra_env or {})
    world = nproc or plan.world_size
    with _heavy_lock(world > 4):
        proc = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    if expect_ok and proc.returncode != 0:
        raise RuntimeError(f"titan-run failed (exit {proc.returncode}) for {plan.describe()} on {world} procs:\n"
                           f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    ranks = {r: json.loads(f.read_text()) for r in range(world)
             if (f := run_dir / "ranks" / f"rank{r}.json").exists()}
    mf = run_dir / "metrics.jsonl"
    metrics = tuple(json.loads(x) for x in mf.read_text().splitlines()) if mf.exists() else ()
    return TitanRun(proc, run_dir, ranks, metrics)


def parity_run(plan: Plan, *, nproc: int | None = None, steps: int = DEFAULT_STEPS, **kw) -> TitanRun:
    """A complete run from step 1: `steps` metrics records, and every rank reports rank 0's losses."""
    nproc = nproc or plan.world_size
    run = run_titan(plan, nproc=nproc, steps=steps, **kw)
    assert [r["step"] for r in run.metrics] == list(range(1, steps + 1)), \
        f"metrics.jsonl steps {[r['step'] for r in run.metrics]}, expected 1..{steps}"
    assert sorted(run.ranks) == list(range(nproc)), f"rank records {sorted(run.ranks)} of {nproc} ranks"
    first = run.ranks[0]["losses"]
    for r, rec in run.ranks.items():
        assert rec["losses"] == first, f"rank {r} reports losses {rec['losses']}, rank 0 {first}"
    assert run.losses == first, f"metrics.jsonl losses {run.losses}, rank 0 {first}"
    return run


# --------------------------------------------------------------------------- the single-process reference
_REFERENCES: dict[tuple, TitanRun] = {}


def _model_key(model: str) -> tuple:
    """A preset name, or a spec file by its path and content (a rewritten file is another model)."""
    p = Path(model)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return str(p.resolve()), hashlib.sha256(p.read_bytes()).hexdigest()
    return (model,)


def reference_run(*, model: str = DEFAULT_MODEL, seq_len: int = DEFAULT_SEQ_LEN, global_batch: int = 4,
                  steps: int = DEFAULT_STEPS, plan: Plan | None = None, extra: dict | None = None) -> TitanRun:
    """The single-process run of the same model, data and seed (by default one micro-batch of the whole
    global batch), cached per (model, seq_len, global batch, steps, plan, overrides) for the session."""
    plan = Plan(microbatch=global_batch) if plan is None else plan
    assert plan.world_size == 1, f"a reference runs in one process, not {plan.describe()}"
    key = (_model_key(model), seq_len, global_batch, steps, tuple(sorted(plan.to_dict().items())),
           tuple(sorted((extra or {}).items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = parity_run(plan, nproc=1, steps=steps, model=model, seq_len=seq_len,
                                      global_batch=global_batch, extra=extra)
    return _REFERENCES[key]


def reference_losses(steps: int = DEFAULT_STEPS, model: str = DEFAULT_MODEL, seq_len: int = DEFAULT_SEQ_LEN,
                     global_batch: int = 4, extra: dict | None = None) -> list[float]:
    return reference_run(model=model, seq_len=seq_len, global_batch=global_batch, steps=steps, extra=extra).losses


# --------------------------------------------------------------------------- the checks
def assert_close_per_step(got: list[float], want: list[float], rtol: float = 1e-4, what: str = "loss") -> None:
    """Every step's value within `rtol` of the reference's (relative)."""
    assert len(got) == len(want), f"{len(got)} {what} values vs {len(want)} in the reference"
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rtol * abs(w), \
            f"step {i + 1}: {what} {g!r} vs reference {w!r} (rel {abs(g - w) / abs(w):.2e})"


def free_port() -> int:
    """A TCP port free on this host now (for a process group's MASTER_PORT)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gloo_workers(worker, world: int, *args, timeout: float = 300) -> None:
    """Run ``worker(rank, port, *args, queue)`` in `world` spawned processes (they start a gloo group on
    127.0.0.1:port); each puts ``(rank, None)`` when it passed or ``(rank, traceback text)``; fails with the
    tracebacks of the ranks that did not pass."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = [q.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    failed = [f"rank {rank}:\n{err}" for rank, err in sorted(results) if err is not None]
    assert not failed, "\n".join(failed)


def in_fresh_process(fn, *args, timeout: float = 600):
    """`fn(*args)` in a new spawned interpreter (for cases that start a process group or alter module
    tables), its result returned."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result(timeout=timeout)


def assert_backends_agree(a: TitanRun, b: TitanRun, rtol: float = 1e-5) -> None:
    """The spmd_types run `a` and the dtensor run `b` of one plan: loss and grad norm per step within `rtol`."""
    assert_close_per_step(a.losses, b.losses, rtol, "loss (spmd_types vs dtensor)")
    assert_close_per_step(a.grad_norms, b.grad_norms, rtol, "grad norm (spmd_types vs dtensor)")


def backend_params(layouts, *, slow=(), dtensor_slow=()) -> tuple[list, list]:
    """pytest parameters of a parity matrix on both backends: ([(layout, backend)] for the single-process
    parity test, [layout] for the backend-agreement test).  Layouts in `slow` are marked slow everywhere;
    those in `dtensor_slow` only on the dtensor fallback and in the agreement test, so the default backend
    keeps them in the CI run (`python -m pytest -m "not slow"`, 30 minutes on 2 cores) and `-m slow` runs
    the rest."""
    import pytest     # here, not at the top: bench/ scripts import this module without the dev extra

    def marks(is_slow: bool) -> list:
        return [pytest.mark.slow] if is_slow else []
    pairs = [pytest.param(name, backend, id=f"{backend}-{name}",
                          marks=marks(name in slow or (backend == "dtensor" and name in dtensor_slow)))
             for backend in ("spmd_types", "dtensor") for name in layouts]
    agree = [pytest.param(name, marks=marks(name in slow or name in dtensor_slow)) for name in layouts]
    return pairs, agree


_BACKEND_RUNS: dict = {}


def run_on_its_backend(plan: Plan, **kwargs) -> TitanRun:
    """`assert_matches_single_process(plan, **kwargs)`, also asserting the run used ``plan.backend`` with no
    fallback note; cached for the session per (plan, kwargs), so a comparison of two backends reuses the runs."""
    key = (plan, tuple(sorted(kwargs.items())))
    if key not in _BACKEND_RUNS:
        run, _ = assert_matches_single_process(plan, **kwargs)
        assert f"backend {plan.backend}" in run.proc.stdout, run.proc.stdout[-2000:]
        assert "note: backend" not in run.proc.stderr, run.proc.stderr[-2000:]
        _BACKEND_RUNS[key] = run
    return _BACKEND_RUNS[key]


def assert_matches_single_process(plan: Plan, *, model: str | None = None, grad_norms: bool = True,
                                  steps: int = DEFAULT_STEPS, rtol: float = 1e-4, nproc: int | None = None,
                                  seq_len: int = DEFAULT_SEQ_LEN, global_batch: int | None = None,
                                  reference_plan: Plan | None = None, reference_learns_by: float | None = 0.0,
                                  extra: dict | None = None, timeout: float = 900) -> tuple[TitanRun, TitanRun]:
    """`titan-run` with `plan` matches the single-process run: per-step loss (and global gradient norm
    before clipping, with `grad_norms`) within `rtol`.  The reference must learn: its last loss below
    its first by more than `reference_learns_by` (None: not checked).  Returns (run, reference) for
    further checks."""
    model = model or DEFAULT_MODEL
    global_batch = plan.global_batch() if global_batch is None else global_batch
    assert plan.global_batch() == global_batch, \
        f"{plan.describe()} trains a global batch of {plan.global_batch()}, not {global_batch}"
    want = reference_run(model=model, seq_len=seq_len, global_batch=global_batch, steps=steps,
                         plan=reference_plan, extra=extra)
    got = parity_run(plan, nproc=nproc, steps=steps, model=model, seq_len=seq_len, global_batch=global_batch,
                     extra=extra, timeout=timeout)
    if reference_learns_by is not None:
        assert want.losses[-1] < want.losses[0] - reference_learns_by, f"the reference does not learn: {want.losses}"
    assert_close_per_step(got.losses, want.losses, rtol, "loss")
    if grad_norms:
        assert_close_per_step(got.grad_norms, want.grad_norms, rtol, "grad norm")
    return got, want


# --------------------------------------------------------------------------- standalone workers
def launch_worker(script: str, nproc: int, *worker_args: str, timeout: float = 900) -> dict:
    """Run a worker script of this folder under torchrun with `nproc` gloo processes (it writes rank 0's
    JSON report to ``--out``; a failing rank may write ``<out>.rank<r>.err``); return the report."""
    with tempfile.TemporaryDirectory(prefix="titan-worker-") as tmp:
        out = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "--log-dir", os.path.join(tmp, "elastic"), str(HERE / script), *worker_args, "--out", out]
        with _heavy_lock(nproc > 4):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(), cwd=ROOT)
        errs = sorted(f for f in os.listdir(tmp) if ".err" in f)
        if errs:
            with open(os.path.join(tmp, errs[0])) as f:
                raise AssertionError(f"{script} {' '.join(worker_args)}: {errs[0]}:\n{f.read()}")
        if proc.returncode != 0 or not os.path.exists(out):
            raise AssertionError(f"{script} {' '.join(worker_args)} failed (rc {proc.returncode}):\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        with open(out) as f:
            report = json.load(f)
    if "error" in report:
        raise AssertionError(f"{script} {' '.join(worker_args)} raised:\n{report['error']}")
    return report


def check_worker_run(run: dict, ref_losses: list[float]) -> None:
    """A `_pp_cp_worker.py` run equals its in-worker single-process run: per-step losses within 1e-4
    (the same check as assert_matches_single_process), step-0 gradients and final parameters by FQN."""
    assert "error" not in run, run.get("error")
    assert_close_per_step(run["losses"], ref_losses, 1e-4, "loss")
    assert run["grad_diff"] < 1e-5, f"step-0 gradient differs by {run['grad_diff']:.3g}"
    assert run["param_diff"] < 5e-4, f"parameters after 5 AdamW steps differ by {run['param_diff']:.3g}"
