"""Fault-injection suite: real faults on real `titan-run` runs on this machine (CPU, gloo, torchrun).

Every fault runs `titan-run` (llama3-debug, seq_len 64, global batch 4, fp32, dp_shard 2, a checkpoint
every 2 steps) with a wall-clock timeout and is judged on four things:

* ended within its timeout (the process, and everything it started);
* one line: a run that fails ends with exactly one error line on stderr (``titan-run: error: ...``;
  no traceback, no torchrun dump); a run that recovers (elastic restart) ends with exit 0;
* processes left: every process started for the fault carries an environment tag
  (``TITAN_FAULT_SUITE_TAG``); after the fault, /proc is scanned for it (workers, torchrun agents,
  async checkpoint writers), 5 s grace;
* resumed matches: where the fault leaves a checkpoint, the run is resumed (``--resume latest``)
  and its per-step losses are compared to an uninterrupted run's (max |dloss|, must be <= 1e-6).

Faults: SIGKILL of a rank mid-run (torchrun restarts it, ``--max-restarts 1``), SIGKILL during a
synchronous and during an asynchronous checkpoint save (TITAN_RUN_KILL, executor/faults.py), a
truncated checkpoint shard (skipped by ``--resume latest``; refused in one line by an explicit
``--resume``), a read-only run dir and a full disk (small tmpfs mounts; needs root and mount, else
the row says why it was skipped), a stopped rank (SIGSTOP; ``train.pg_timeout_s`` 20 s), a killed
"node" (one of two localhost torchrun agents, ``--nnodes 2``: the survivor ends in one line; and
``--nnodes 1:2 --max-restarts 1``: the survivor re-plans onto world 1, finishes, and logs MFU against
the world it runs now), a SIGKILLed `titan-run` launcher.

    python bench/fault_suite.py [--out runs/fault_suite] [--keep]

The results table is printed last, then the figure (faults passing every check / faults run).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.distributed.harness import env as harness_env  # noqa: E402
from tests.distributed.harness import titan_run_cmd  # noqa: E402

STEPS = 6
TOL = 1e-6
TRAIN = {"lr": 3e-3, "warmup": 2, "seed": 0, "profile_step": 0, "tensorboard": False, "max_corpus_bytes": 1_000_000,
         "grad_clip": 1.0, "steps": STEPS, "checkpoint_every": 2, "keep_checkpoints": 0}
PLAN = {"dp_shard": 2, "microbatch": 2}
PG_TIMEOUT_S = 20            # the stopped-rank fault: collectives give up after this
RDZV_TIMEOUT_S = 60          # the killed-node faults: a node waits this long at the rendezvous (covers torchrun's
                             # 30 s last call and its ~15 s detection of a dead node)
INFO_PREFIXES = ("titan-run: warning", "titan-run: elastic", "titan-run: checkpoint", "titan-run: resum")


@dataclass
class Row:
    fault: str
    ended: bool | None = None
    one_line: bool | None = None
    left: int | None = None
    matches: float | None = None         # max |dloss| of the resumed run; None: not applicable
    note: str = ""

    def ok(self) -> bool:
        return (self.ended is not False and self.one_line is not False and not self.left
                and (self.matches is None or self.matches <= TOL) and not self.note.startswith("skipped"))


# --------------------------------------------------------------------------- processes
def tagged_pids(tag: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            environ = (d / "environ").read_bytes()
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"TITAN_FAULT_SUITE_TAG={tag}".encode() in environ.split(b"\0") and state != "Z":
            out.append(int(d.name))
    return out


def left_after(tag: str, grace_s: float = 5.0) -> int:
    deadline = time.monotonic() + grace_s
    while tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = tagged_pids(tag)
    for pid in pids:                      # leave the machine clean for the next fault
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def rank_pid(tag: str, rank: int, timeout_s: float = 120.0) -> int:
    """The worker process of `rank` (RANK=... in its environment) of the run tagged `tag`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in tagged_pids(tag):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ and b"executor.cli" in cmd and b"torch.distributed" not in cmd \
                    and b"executor.launch" not in cmd:
                return pid
        time.sleep(0.2)
    raise RuntimeError(f"no rank {rank} process of run {tag} after {timeout_s} s")


def wait_listening(port: int, timeout_s: float = 120.0) -> None:
    """Until something accepts connections on 127.0.0.1:`port`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as c:
            if c.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


def wait_for_step(run_dir: Path, step: int, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    f = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if f.is_file() and sum(1 for line in f.read_text().splitlines() if line.strip()) >= step:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{run_dir}: step {step} not reached after {timeout_s} s")


# --------------------------------------------------------------------------- runs
class Suite:
    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.base: list[float] = []

    def plan_file(self, name: str, train: dict | None = None) -> Path:
        f = self.out / f"{name}.yaml"
        f.write_text(yaml.safe_dump({"model": "llama3-debug", "workload": {"seq_len": 64, "global_batch": 4},
                                     "plan": PLAN, "train": {**TRAIN, **(train or {})}}))
        return f

    def start(self, name: str, run_dir: Path, *, train=None, args=(), extra_env=None, tag=None):
        tag = tag or uuid.uuid4().hex[:12]
        e = harness_env()
        e.update({"TITAN_FAULT_SUITE_TAG": tag, **(extra_env or {})})
        cmd = titan_run_cmd("--plan", str(self.plan_file(name, train)), "--run-dir", str(run_dir), *args)
        p = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        return p, tag

    def _finish(self, p, tag: str, timeout_s: float):
        t0 = time.monotonic()
        try:
            out, err = p.communicate(timeout=timeout_s)
            ended = True
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            ended = False
        return ended, p.returncode, out, err, left_after(tag), time.monotonic() - t0

    def run(self, name: str, run_dir: Path, timeout_s: float = 300, **kw):
        p, tag = self.start(name, run_dir, **kw)
        return self.finish(p, tag, timeout_s)

    def finish(self, p, tag: str, timeout_s: float):
        res = self._finish(p, tag, timeout_s)
        (self.out / f"stderr-{tag}.txt").write_text(res[3])      # what the user saw, per run
        return res

    def losses(self, run_dir: Path) -> tuple[int, list[float]]:
        rec = json.loads((run_dir / "ranks" / "rank0.json").read_text())
        return rec["first_step"], rec["losses"]

    def dloss(self, run_dir: Path) -> float:
        first, losses = self.losses(run_dir)
        want = self.base[first - 1:]
        if len(want) != len(losses):
            return float("inf")
        return max(abs(a - b) for a, b in zip(losses, want))


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip() and not line.startswith(INFO_PREFIXES)]


def one_line(rc: int, err: str) -> bool:
    lines = error_lines(err)
    if rc == 0:
        return "Traceback" not in err
    return len(lines) == 1 and lines[0].startswith("titan-run: error:")


def mount_tmpfs(path: Path, opts: str) -> str | None:
    """Mount a tmpfs at `path`; the reason when it cannot be done."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "not root: cannot mount a tmpfs"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    return None if r.returncode == 0 else f"mount failed: {r.stderr.strip()}"


def umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


# --------------------------------------------------------------------------- the faults
def fault_kill_rank(s: Suite) -> Row:
    run_dir = s.out / "kill-rank"
    ended, rc, _, err, left, _ = s.run("kill-rank", run_dir, args=("--max-restarts", "1"),
                                       extra_env={"TITAN_RUN_KILL": "1:4"})
    note = "" if rc == 0 else f"exit {rc}: {error_lines(err)[-1:]}"
    return Row("SIGKILL rank 1 at step 4 (--max-restarts 1)", ended, one_line(rc, err), left,
               s.dloss(run_dir) if rc == 0 else float("inf"), note)


def fault_kill_save(s: Suite, use_async: bool) -> Row:
    name = f"kill-save-{'async' if use_async else 'sync'}"
    run_dir = s.out / name
    train = {"async_checkpoint": use_async}
    ended, rc, _, err, left, _ = s.run(name, run_dir, train=train, extra_env={"TITAN_RUN_KILL": "0:4:save"})
    _, rc2, _, err2, left2, _ = s.run(name, run_dir, train=train, args=("--resume", "latest"))
    d = s.dloss(run_dir) if rc2 == 0 else float("inf")
    note = f"killed run exit {rc}; resumed from step {s.losses(run_dir)[0] if rc2 == 0 else '?'}"
    if rc2 != 0:
        note += f"; resume exit {rc2}: {error_lines(err2)[-1:]}"
    return Row(f"SIGKILL during a {'async' if use_async else 'sync'} save (step 4)", ended,
               one_line(rc, err) and rc != 0, left + left2, d, note)


def fault_corrupt(s: Suite) -> Row:
    src = s.out / "base" / "checkpoints"
    run_dir = s.out / "corrupt"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(src, run_dir / "checkpoints")
    shard = sorted((run_dir / "checkpoints" / f"step-{STEPS:06d}").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    # explicit --resume of the truncated checkpoint: refused in one line
    ended1, rc1, _, err1, left1, _ = s.run("corrupt", s.out / "corrupt-explicit",
                                           args=("--resume", str(run_dir / "checkpoints" / f"step-{STEPS:06d}")))
    # --resume latest: skipped, the one before is loaded (steps 5..6 run again)
    ended2, rc2, _, err2, left2, _ = s.run("corrupt", run_dir, args=("--resume", "latest"))
    d = s.dloss(run_dir) if rc2 == 0 else float("inf")
    note = f"explicit --resume: exit {rc1}; latest: exit {rc2}, resumed from step " \
           f"{s.losses(run_dir)[0] if rc2 == 0 else '?'}"
    return Row("truncated checkpoint shard", ended1 and ended2, rc1 == 2 and one_line(rc1, err1) and
               one_line(rc2, err2), left1 + left2, d, note)


def fault_read_only(s: Suite) -> Row:
    mnt = s.out / "ro-mnt"
    why = mount_tmpfs(mnt, "size=1m,ro")
    if why:
        return Row("read-only run dir", note=f"skipped: {why}")
    try:
        ended, rc, _, err, left, _ = s.run("ro", mnt / "run", timeout_s=120)
    finally:
        umount(mnt)
    return Row("read-only run dir", ended, rc == 2 and one_line(rc, err), left, None,
               f"exit {rc}: {error_lines(err)[:1]}")


def fault_full_disk(s: Suite, use_async: bool) -> Row:
    mnt = s.out / f"full-mnt-{'async' if use_async else 'sync'}"
    why = mount_tmpfs(mnt, "size=2m")       # metrics fit, the first checkpoint (about 10 MB) does not
    label = f"full disk at the first {'async' if use_async else 'sync'} save"
    if why:
        return Row(label, note=f"skipped: {why}")
    try:
        ended, rc, _, err, left, _ = s.run("full", mnt / "run", timeout_s=180, train={"async_checkpoint": use_async})
    finally:
        umount(mnt)
    return Row(label, ended, rc == 2 and one_line(rc, err), left, None, f"exit {rc}: {error_lines(err)[:1]}")


def fault_stopped_rank(s: Suite) -> Row:
    run_dir = s.out / "stopped"
    p, tag = s.start("stopped", run_dir, train={"pg_timeout_s": PG_TIMEOUT_S})
    try:
        wait_for_step(run_dir, 2)
        os.kill(rank_pid(tag, 1), signal.SIGSTOP)
    except RuntimeError as e:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        left_after(tag)
        return Row("SIGSTOP rank 1 at step 2", note=f"setup failed: {e}")
    timeout = PG_TIMEOUT_S + 90
    ended, rc, _, err, left, wall = s.finish(p, tag, timeout)
    return Row(f"SIGSTOP rank 1 (pg timeout {PG_TIMEOUT_S} s)", ended, rc != 0 and one_line(rc, err), left, None,
               f"ended {wall:.0f} s after the stop, exit {rc}: {error_lines(err)[-1:]}")


def fault_killed_node(s: Suite) -> Row:
    from executor.launch import free_port
    port = free_port()
    common = ("--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
              uuid.uuid4().hex[:8])
    run_dir = s.out / "node"
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {"TITAN_RUN_RDZV_TIMEOUT_S": str(RDZV_TIMEOUT_S)}
    # b hosts the rendezvous store (started first) and is the node killed: the harder case for the survivor a
    b, tag_b = s.start("node", run_dir, args=common, extra_env=env)
    try:
        wait_listening(port)
    except RuntimeError:
        pass                                 # wait_for_step below reports a start that failed
    tag = uuid.uuid4().hex[:12]
    a, _ = s.start("node", run_dir, args=common, extra_env=env, tag=tag)
    try:
        wait_for_step(run_dir, 2)
    except RuntimeError as e:
        return _setup_failed("killed node (1 of 2 localhost agents)", e, (a, tag), (b, tag_b))
    os.kill(b.pid, signal.SIGKILL)           # the node's titan-run; its torchrun and worker die with it
    b.communicate()
    timeout = RDZV_TIMEOUT_S + 90
    ended, rc, _, err, left, wall = s.finish(a, tag, timeout)
    left += left_after(tag_b)
    return Row("killed node hosting the rendezvous (--nnodes 2)", ended, rc != 0 and one_line(rc, err), left,
               None, f"survivor ended {wall:.0f} s after the kill, exit {rc}: {error_lines(err)[-1:]}")


def _setup_failed(label: str, e: Exception, *nodes) -> Row:
    """Kill both localhost 'nodes' of a two-node fault whose setup failed; the row says why."""
    for q, t in nodes:
        os.killpg(q.pid, signal.SIGKILL)
        q.communicate()
        left_after(t)
    return Row(label, note=f"setup failed: {e}")


def fault_shrunk_world(s: Suite) -> Row:
    """--nnodes 1:2 --max-restarts 1: the node that does not host the rendezvous store is killed, the other
    re-plans onto world 1 and finishes; the MFU it logs after the shrink is against the world it runs now
    (< 100%).  (Killing the store's host ends the survivor in one line: torchrun's c10d rendezvous lives there.)"""
    from executor.launch import free_port
    port = free_port()
    common = ("--nproc-per-node", "1", "--nnodes", "1:2", "--max-restarts", "1", "--rdzv-endpoint",
              f"127.0.0.1:{port}", "--rdzv-id", uuid.uuid4().hex[:8])
    run_dir = s.out / "shrink"
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {"TITAN_RUN_RDZV_TIMEOUT_S": str(RDZV_TIMEOUT_S)}
    a, tag = s.start("shrink", run_dir, args=common, extra_env=env)
    wait_listening(port)          # a hosts the rendezvous store (c10d); b, started after, is the node killed
    b, tag_b = s.start("shrink", run_dir, args=common, extra_env=env)
    label = "killed node, --nnodes 1:2 (survivor re-plans)"
    try:
        wait_for_step(run_dir, 3)
    except RuntimeError as e:
        return _setup_failed(label, e, (a, tag), (b, tag_b))
    os.kill(b.pid, signal.SIGKILL)
    b.communicate()
    ended, rc, _, err, left, wall = s.finish(a, tag, RDZV_TIMEOUT_S + 240)
    left += left_after(tag_b)
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    mfu = [r["mfu"] for r in recs if r.get("mfu") is not None]
    first, losses = s.losses(run_dir) if rc == 0 else (None, [])
    d = max((abs(x - y) for x, y in zip(losses, s.base[first - 1:])), default=float("nan")) if rc == 0 else None
    ok = rc == 0 and bool(mfu) and max(mfu) < 1.0
    return Row(label, ended, one_line(rc, err) and ok, left, None,
               f"exit {rc}, {wall:.0f} s after the kill; max MFU logged {max(mfu, default=float('nan')):.1%}; "
               + (f"world 1 resumed at step {first}, max|dloss| {d:.1e} vs world 2 (fp32 reduction order)" if rc == 0
                  else str(error_lines(err)[-1:])))


def fault_killed_launcher(s: Suite) -> Row:
    run_dir = s.out / "launcher"
    p, tag = s.start("launcher", run_dir)
    try:
        wait_for_step(run_dir, 2)
    except RuntimeError as e:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        left_after(tag)
        return Row("SIGKILL of titan-run", note=f"setup failed: {e}")
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGKILL)           # only titan-run itself, not its process group
    p.communicate()
    left = left_after(tag)
    return Row("SIGKILL of titan-run (the launcher only)", True, None, left, None,
               f"its workers gone {time.monotonic() - t0:.1f} s after the kill")


# --------------------------------------------------------------------------- main
def fmt(v, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "bool":
        return "yes" if v else "NO"
    if kind == "left":
        return str(v)
    return f"{v:.1e}" if v != float("inf") else "FAIL"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="work folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--only", nargs="*", help="run only the faults whose function name contains one of these")
    a = ap.parse_args(argv)
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="titan-faults-"))
    s = Suite(out)
    t0 = time.monotonic()
    ended, rc, _, err, left, _ = s.run("base", out / "base")
    if rc != 0:
        print(f"fault_suite: the uninterrupted run failed (exit {rc}): {err[-2000:]}", file=sys.stderr)
        return 1
    s.base = s.losses(out / "base")[1]
    faults = [("kill_rank", fault_kill_rank), ("kill_save_sync", lambda x: fault_kill_save(x, False)),
              ("kill_save_async", lambda x: fault_kill_save(x, True)), ("corrupt", fault_corrupt),
              ("read_only", fault_read_only), ("full_disk_sync", lambda x: fault_full_disk(x, False)),
              ("full_disk_async", lambda x: fault_full_disk(x, True)), ("stopped_rank", fault_stopped_rank),
              ("killed_node", fault_killed_node), ("shrunk_world", fault_shrunk_world),
              ("killed_launcher", fault_killed_launcher)]
    rows = []
    for name, f in faults:
        if a.only and not any(o in name for o in a.only):
            continue
        t = time.monotonic()
        try:
            row = f(s)
        except Exception as e:  # noqa: BLE001 - a fault that breaks the suite is a failed row, not a crash
            row = Row(name, note=f"suite error: {type(e).__name__}: {e}")
            row.ended = False
        rows.append(row)
        print(f"[{time.monotonic() - t:5.0f} s] {row.fault}: {'ok' if row.ok() else 'FAILED'}  {row.note}",
              flush=True)
    if not a.keep and not a.out:
        shutil.rmtree(out, ignore_errors=True)
    w = max(len(r.fault) for r in rows)
    print()
    print(f"{'fault':<{w}}  ended in time  one line  processes left  resumed max|dloss|  note")
    for r in rows:
        print(f"{r.fault:<{w}}  {fmt(r.ended, 'bool'):>13}  {fmt(r.one_line, 'bool'):>8}  {fmt(r.left, 'left'):>14}  "
              f"{fmt(r.matches, 'f'):>18}  {r.note[:150]}")
    passed = sum(r.ok() for r in rows)
    print(f"\nfault suite: {passed} of {len(rows)} faults end within their timeout, in one line, with no process left "
          f"and (where resumed) the uninterrupted run's losses (|dloss| <= {TOL:g}); "
          f"{time.monotonic() - t0:.0f} s in all")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
