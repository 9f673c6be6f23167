"""`titan-run`: train with a plan file (or the default small model) on this node.

    titan-run                                   # llama3-debug, seq 256, on the local devices
    titan-run --plan plan.yaml --nproc-per-node 8 --steps 100 --set train.lr=1e-3
    titan-run --self-test --nproc-per-node 8    # one collective per mesh axis, shard shapes
    titan-run --plan plan.yaml --run-dir runs/a --resume latest --max-restarts 3   # checkpoints, elastic
    titan-run export --checkpoint runs/a/checkpoints/step-000100 --out model.safetensors
    titan-run import --hf my-llama --out init/step-000000   # a Hugging Face folder; --set model=hf:my-llama
    titan-run export --checkpoint runs/a/checkpoints/step-000100 --hf-dir my-llama-tuned   # from_pretrained
    torchrun --nproc-per-node 8 -m executor.cli --plan plan.yaml   # started by a launcher

Exit codes: 0 success, 2 bad input (one line on stderr, before any process
group starts), 1 a failure during the run (the failing rank's traceback is
shown; the other ranks are stopped).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from search_spaces.plan import Plan
from search_spaces.typed import InputError, OneLineArgumentParser

from .config import ConfigError, apply_overrides, load_run_config, parse_overrides, read_plan_file
from .dry_run_args import prepare as prepare_dry_run
from .elastic import launcher_world, load_elastic_config
from .faults import EXIT_PEER_FAILED, expected_failure, peer_failure, print_once
from .launch import die_with_parent, is_worker, launch_workers, local_gpu_count, single_process_env

# This module is the launcher: `titan-run --help` and bad-input errors must not pay for importing
# torch (seconds).  So the modules that import torch (self_test, checkpoint_files, mesh, train,
# dry_run, export, torch itself) are imported where they are used, each marked "torch: launcher path".

EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    """titan-run's training flags (export / import and --dry-run have their own parsers, see main)."""
    p = OneLineArgumentParser(prog="titan-run", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="Plan file keys: model, hardware, workload {seq_len, global_batch}, plan {...}, "
                                     "train {steps, lr, warmup, seed, data, tokenizer, dtype, ...}. "
                                     "Subcommands: 'titan-run import --hf DIR --out CKPT' (a Hugging Face "
                                     "folder; model=hf:DIR), 'titan-run export --checkpoint CKPT --hf-dir DIR' "
                                     "(for from_pretrained) or --out FILE.safetensors; see their --help.")
    p.add_argument("--plan", help="plan YAML (as written by titan-plan); default: llama3-debug on the local devices")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, dest="nproc",
                   help="worker processes (default: the GPUs; without a GPU, the plan's world size, or 2)")
    p.add_argument("--steps", type=int, help="training steps (overrides train.steps)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key: plan.tp=2, train.lr=1e-3, workload.seq_len=128, model=..., or a bare key")
    p.add_argument("--run-dir", help="where metrics.jsonl, plan.yaml and summary.json go (default runs/<timestamp>)")
    p.add_argument("--self-test", action="store_true", help="check every mesh axis and the shard shapes, then exit")
    p.add_argument("--dry-run", action="store_true",
                   help="apply the plan for --world N ranks in one process on the meta device (fake process "
                        "group) and report each rank's exact state bytes; see 'titan-run --dry-run --help'")
    g = p.add_argument_group("checkpoints and elastic restarts (executor/checkpoint.py, executor/elastic.py)")
    g.add_argument("--resume", nargs="?", const="latest", metavar="PATH|latest",
                   help="resume from a checkpoint folder, a folder of them (newest complete one), or 'latest' "
                        "(newest complete one under the run dir's checkpoints; the default value)")
    g.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun restarts after a failure; restarted workers resume from the latest checkpoint")
    g.add_argument("--nnodes", help="torchrun --nnodes N or MIN:MAX (elastic); with MIN:MAX a smaller world "
                                    "re-plans (see --fallback-plan)")
    g.add_argument("--rdzv-backend", help="torchrun --rdzv-backend (default c10d when --rdzv-endpoint is given)")
    g.add_argument("--rdzv-endpoint", help="torchrun --rdzv-endpoint host:port (multi-node)")
    g.add_argument("--rdzv-id", help="torchrun --rdzv-id (a job id shared by the nodes)")
    g.add_argument("--fallback-plan", help="plan YAML to use when an elastic restart leaves a world the plan "
                                           "does not fit (default: keep tp/pp/cp/ep, the rest in dp_shard)")
    return p


def parse_args(argv):
    p = build_parser()
    args = p.parse_args(argv)
    if args.resume:
        args.set = list(args.set) + [f"train.resume={args.resume}"]
    if args.max_restarts < 0:
        p.error("--max-restarts must be >= 0")
    if args.nproc is not None and args.nproc < 1:
        p.error("--nproc-per-node must be >= 1")
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def cpu_default_nproc(args) -> int:
    """Without a GPU: the plan file's world size, or 2 processes for the default layout."""
    if args.plan and not args.self_test:
        try:
            raw = apply_overrides(read_plan_file(args.plan), parse_overrides(args.set))
            return Plan.from_dict(raw.get("plan") or {}).world_size
        except (ValueError, TypeError):
            pass          # reported properly by load_config
    return 2


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def fail(msg: str) -> int:
    print(f"titan-run: error: {msg}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def load_config(args, world_size: int):
    if args.self_test:
        from .self_test import self_test_config  # torch: launcher path
        return self_test_config(args.plan, args.set, world_size)
    if args.nnodes or args.fallback_plan:      # elastic: the world may not be the plan's (executor/elastic.py)
        return load_elastic_config(args, world_size)
    return load_run_config(args.plan, args.set, world_size=world_size, steps=args.steps)


# --------------------------------------------------------------------------- launcher side
def launcher_main(args, argv: list[str]) -> int:
    n_gpu = local_gpu_count()   # imports torch on a GPU host only (launch.py)
    nproc = args.nproc or (n_gpu if n_gpu else cpu_default_nproc(args))
    if n_gpu and nproc > n_gpu:
        return fail(f"--nproc-per-node {nproc} is more than the {n_gpu} GPUs of this node")
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    try:
        cfg = load_config(args, launcher_world(args, nproc))
        if not args.self_test and cfg.train.resume:   # a missing / foreign checkpoint is bad input (exit 2)
            from .checkpoint_files import check_resume  # torch: launcher path
            check_resume(cfg, run_dir)
    except (ConfigError, ValueError) as e:
        return fail(str(e))
    run_dir = run_dir.resolve()
    child_args = strip_option(argv, "--run-dir") + ["--run-dir", str(run_dir)]
    child_args = strip_option(child_args, "--nproc-per-node", "--nproc_per_node")
    if nproc == 1 and not (args.max_restarts or args.nnodes or args.rdzv_endpoint):
        single_process_env()
        return worker_main(parse_args(child_args))
    rc = launch_workers(nproc, child_args, max_restarts=args.max_restarts, nnodes=args.nnodes,
                        rdzv_backend=args.rdzv_backend, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id)
    if rc != 0 and not args.self_test:
        write_failure_summary(run_dir, rc)
    return rc


def strip_option(argv: list[str], *names: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if any(a.startswith(n + "=") for n in names):
            continue
        out.append(a)
    return out


def write_failure_summary(run_dir: Path, rc: int) -> None:
    """summary.json with status error/oom when the workers failed (for trials)."""
    errors = []
    for f in sorted((run_dir / "ranks").glob("rank*.error.json")) if (run_dir / "ranks").is_dir() else []:
        try:
            errors.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            pass
    status = "oom" if any("OutOfMemory" in e.get("type", "") for e in errors) else "error"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").write_text(json.dumps({"status": status, "exit_code": rc, "errors": errors},
                                                         indent=1))
    except OSError as e:          # a read-only or full run dir: the workers said so in one line already
        if rc != EXIT_BAD_INPUT:
            fail(f"cannot write the failure summary: {expected_failure(e, run_dir) or e}")


# --------------------------------------------------------------------------- worker side
def worker_main(args) -> int:
    """Runs in every rank; ends the process with os._exit (see the gloo teardown caveat)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        cfg = load_config(args, world)
    except (ConfigError, ValueError) as e:
        print_once(str(e))     # the first rank of the node to fail says it (the launcher stops the others)
        os._exit(EXIT_BAD_INPUT)

    from .mesh import init_distributed  # torch: launcher path (this module is also the launcher)
    from .train import print_error, train  # torch: launcher path
    run_dir = None
    try:
        init_distributed(cfg.train.pg_timeout_s)
        run_dir = shared_run_dir(args.run_dir)
        if args.self_test:
            from .self_test import run_self_test  # torch: launcher path
            code = 0 if run_self_test(cfg) else 1
        else:
            train(cfg, run_dir)
            code = 0
    except BaseException as e:     # noqa: BLE001 - report, then leave without waiting for peers
        line = str(e) if isinstance(e, InputError) else expected_failure(e, run_dir or args.run_dir)
        if line is not None:       # bad input found late, or the environment refused (a path, permissions, a
            # full disk): one line, exit 2
            print_once(line)
            os._exit(EXIT_BAD_INPUT)
        if peer_failure(e) and int(os.environ.get("WORLD_SIZE", "1")) > 1:   # another rank failed: it is blamed
            os._exit(EXIT_PEER_FAILED)     # (no rank error file: a trial's reason is the failed rank's)
        print_error(rank, e)
        if run_dir is not None:
            write_rank_error(run_dir, rank, e)
        sys.stdout.flush()
        os._exit(1)
    finish(code)


def shared_run_dir(given: str | None) -> Path:
    import torch.distributed as dist  # torch: launcher path
    if given:
        return Path(given)
    box = [str(default_run_dir().resolve())]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def write_rank_error(run_dir: Path, rank: int, e: BaseException) -> None:
    try:
        d = run_dir / "ranks"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"rank{rank}.error.json").write_text(json.dumps({"rank": rank, "type": type(e).__name__,
                                                              "message": str(e)[:2000]}))
    except OSError:
        pass


def finish(code: int):
    """barrier -> destroy the process group -> flush -> os._exit (avoids the gloo teardown abort)."""
    import torch.distributed as dist  # torch: launcher path
    try:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--dry-run" in argv:   # one process, fake process group of the target world: see executor/dry_run.py
        prepared = prepare_dry_run([a for a in argv if a != "--dry-run"])    # torch-free: bad input answered here
        if isinstance(prepared, int):
            return prepared
        from .dry_run import execute  # torch: launcher path
        return execute(prepared)
    if argv and argv[0] in ("export", "import"):   # safetensors export/import: see executor/export.py
        from .export import main as export_main  # torch: launcher path
        return export_main(argv)
    args = parse_args(argv)
    if is_worker():
        die_with_parent()   # a worker dies with its torchrun agent / launcher (executor/launch.py)
        return worker_main(args)
    return launcher_main(args, argv)


if __name__ == "__main__":
    sys.exit(main())
