"""Trials: hard timeouts leave no process behind; the study resumes; bad storage is a clear error.

The study machinery is exercised with a launcher template (the same hook an
`srun` line uses) that runs a small script writing the files titan-run
writes; the real titan-run trials are in test_trials_real.py.
"""
from __future__ import annotations

import io
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from planner.cli import main
from planner.progress import Progress, duration
from planner.trials import run_one

FAKE = textwrap.dedent("""\
    import json, sys, time, yaml
    plan_file, run_dir = sys.argv[1], sys.argv[2]
    d = yaml.safe_load(open(plan_file))
    p = d["plan"]
    if p["ac"] == "full" and p["microbatch"] == 8:
        sys.exit(3)                                   # a crash, with no summary
    # a deterministic 'measurement': the analytic prediction bent by the knobs
    tps = d["predicted"]["tokens_per_s"] * (1.3 if p["compile"] else 1.0) * (0.8 if p["ac"] == "full" else 1.0)
    with open(run_dir + "/metrics.jsonl", "w") as f:
        for s in range(4):
            f.write(json.dumps({"step": s + 1, "step_time_s": 1.0 / tps}) + "\\n")
    json.dump({"status": "ok", "step_time_s": 1.0 / tps, "tokens_per_s": tps,
               "peak_memory_bytes": 1e8}, open(run_dir + "/summary.json", "w"))
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_hanging_trial_is_killed_with_all_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    code = (f"import subprocess, time; c = subprocess.Popen(['sleep', '1000']); "
            f"open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(1000)")
    t0 = time.monotonic()
    s = run_one([sys.executable, "-c", code], tmp_path / "run", timeout_s=3)
    assert s["status"] == "timeout"
    assert time.monotonic() - t0 < 20
    child = int(pidfile.read_text())
    time.sleep(0.5)
    assert not _alive(child), "the hung trial's child survived"
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert f"{child} sleep 1000" not in ps


def test_crashing_trial_is_recorded_with_reason(tmp_path):
    s = run_one([sys.executable, "-c", "import sys; print('boom: bad layout'); sys.exit(7)"], tmp_path / "r", 30)
    assert s["status"] == "error" and "exit 7" in s["reason"] and "boom" in s["reason"]


def _plan_args(tmp_path, n, storage, extra=()):
    fake = tmp_path / "fake_trial.py"
    fake.write_text(FAKE)
    return ["--gpus", "2", "--hardware", "cpu", "--trials", str(n), "--storage", storage,
            "--launcher", f"{sys.executable} {fake} {{plan}} {{run_dir}}", "--run-root", str(tmp_path / "runs"),
            "--out", str(tmp_path / "plan.yaml"), *extra]


def _n_trials(db: Path) -> int:
    with sqlite3.connect(db) as c:
        return c.execute("select count(*) from trials").fetchone()[0]


def test_study_runs_resumes_and_picks_on_measurement(tmp_path, capsys):
    db = tmp_path / "t.db"
    storage = f"sqlite:///{db}"
    assert main(_plan_args(tmp_path, 4, storage)) == 0
    out = capsys.readouterr().out
    assert "measured trials" in out and "chosen on measured throughput" in out
    n1 = _n_trials(db)
    assert n1 >= 4
    import yaml
    doc = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    assert doc["measured"]["tokens_per_s"] > 0 and doc["predicted"]["tokens_per_s"] > 0
    # asking again for the same number of trials runs nothing new
    assert main(_plan_args(tmp_path, 4, storage)) == 0
    assert _n_trials(db) == n1
    # asking for more continues the same study
    assert main(_plan_args(tmp_path, 6, storage)) == 0
    assert _n_trials(db) > n1


def test_killed_planner_resumes_without_repeating(tmp_path):
    db = tmp_path / "k.db"
    storage = f"sqlite:///{db}"
    slow = tmp_path / "slow.py"
    slow.write_text("import sys, time, runpy\ntime.sleep(1.5)\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    fake = tmp_path / "fake_trial.py"
    fake.write_text(FAKE)
    args = ["--gpus", "2", "--hardware", "cpu", "--trials", "5", "--storage", storage, "--launcher",
            f"{sys.executable} {slow} {fake} {{plan}} {{run_dir}}", "--run-root", str(tmp_path / "runs"),
            "--no-write"]
    p = subprocess.Popen([sys.executable, "-m", "planner.cli", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:   # wait until two trials have finished, then kill mid-study
        if db.exists():
            with sqlite3.connect(db) as c:
                try:
                    done = c.execute("select count(*) from trials where state='COMPLETE'").fetchone()[0]
                except sqlite3.OperationalError:
                    done = 0
            if done >= 2:
                break
        time.sleep(0.3)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    with sqlite3.connect(db) as c:
        before = c.execute("select number from trials where state='COMPLETE'").fetchall()
    r = subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    with sqlite3.connect(db) as c:
        after = c.execute("select number, state from trials").fetchall()
    done_after = [n for n, s in after if s == "COMPLETE"]
    finished = [n for n, s in after if s in ("COMPLETE", "PRUNED")]   # a pruned trial is finished too
    assert set(n for (n,) in before) <= set(done_after)
    assert len(finished) >= 5
    # trials finished before the kill were not run again: their run folders were written once
    logs = list((tmp_path / "runs").rglob("summary.json"))
    assert len(logs) == len({x.parent for x in logs})


def test_bad_storage_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "planner.cli", "--gpus", "2", "--hardware", "cpu", "--trials", "2",
                        "--storage", f"sqlite:///{tmp_path}/missing/dir/t.db", "--no-write"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "does not exist" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_storage_from_another_model_is_refused(tmp_path, capsys):
    storage = f"sqlite:///{tmp_path}/s.db"
    assert main(_plan_args(tmp_path, 2, storage, ["--study-name", "mine"])) == 0
    r = subprocess.run([sys.executable, "-m", "planner.cli", *_plan_args(tmp_path, 2, storage,
                        ["--study-name", "mine", "--model", "moe-debug"])], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "was made for model='llama3-debug'" in r.stderr


def test_locked_storage_is_a_clear_error(tmp_path):
    db = tmp_path / "l.db"
    storage = f"sqlite:///{db}"
    assert main(_plan_args(tmp_path, 2, storage)) == 0
    con = sqlite3.connect(db, timeout=0)
    con.execute("begin exclusive")          # another writer holds the database
    try:
        r = subprocess.run([sys.executable, "-m", "planner.cli", *_plan_args(tmp_path, 3, storage)],
                           capture_output=True, text=True, timeout=120)
    finally:
        con.rollback()
        con.close()
    assert r.returncode == 2 and "locked" in r.stderr, r.stderr


# --------------------------------------------------------------------------- the study's processes and budget
HANG = textwrap.dedent("""\
    import os, subprocess, sys, time
    run_dir = sys.argv[2]
    c = subprocess.Popen(["sleep", "1000"])            # what titan-run starts (torchrun): same process group
    open(run_dir + "/pids", "w").write(f"{os.getpid()} {c.pid}")
    time.sleep(1000)
""")


def _hanging_args(tmp_path, storage, n=2):
    hang = tmp_path / "hang.py"
    hang.write_text(HANG)
    return ["--gpus", "2", "--hardware", "cpu", "--trials", str(n), "--storage", storage, "--launcher",
            f"{sys.executable} {hang} {{plan}} {{run_dir}}", "--run-root", str(tmp_path / "runs"), "--no-write"]


def _wait_for(path_glob, root: Path, timeout=120.0) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hits = list(root.rglob(path_glob)) if root.exists() else []
        if hits and hits[0].read_text().strip():
            return hits[0]
        time.sleep(0.2)
    raise AssertionError(f"no {path_glob} under {root} after {timeout} s")


def test_kill_9_of_the_planner_takes_the_running_trial_with_it(tmp_path):
    """kill -9 of titan-plan (only its pid, not its group): the trial and what it started die within seconds."""
    p = subprocess.Popen([sys.executable, "-m", "planner.cli", *_hanging_args(tmp_path, f"sqlite:///{tmp_path}/k.db")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        pids = [int(x) for x in _wait_for("pids", tmp_path / "runs").read_text().split()]
        assert all(_alive(x) for x in pids)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        deadline = time.monotonic() + 5
        while any(_alive(x) for x in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(x) for x in pids), f"trial processes outlived titan-plan: {pids}"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def test_a_second_planner_on_the_same_study_is_refused_and_a_dead_ones_lock_taken_over(tmp_path):
    storage = f"sqlite:///{tmp_path}/two.db"
    a = subprocess.Popen([sys.executable, "-m", "planner.cli", *_hanging_args(tmp_path, storage)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for("pids", tmp_path / "runs")            # a's first trial is running
        r = subprocess.run([sys.executable, "-m", "planner.cli", *_plan_args(tmp_path, 2, storage)],
                           capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert f"is in use by pid {a.pid}" in lines[0] and "study 'titan-llama3-debug-cpu-2'" in lines[0]
    finally:
        os.killpg(a.pid, signal.SIGKILL)
        a.wait()
    # a is dead (its lock with it): the study is taken over; its RUNNING trial is run again, to completion
    assert main(_plan_args(tmp_path, 2, storage)) == 0


def test_trials_budget_counts_real_measurements_and_the_printed_name_is_stored(tmp_path, capsys):
    import optuna
    from optuna.trial import TrialState

    storage = f"sqlite:///{tmp_path}/b.db"
    assert main(_plan_args(tmp_path, 6, storage)) == 0
    out, err = capsys.readouterr()
    # progress without a terminal: one plain line per measurement, i/N with the time left (no bar)
    progress = [ln for ln in err.splitlines() if ln.startswith("[trials] ") and "elapsed" in ln]
    assert [ln.split()[1] for ln in progress] == [f"{i}/6" for i in range(1, 7)], err
    assert all("ETA" in ln for ln in progress[:-1]) and "ETA" not in progress[-1] and "\r" not in err
    names = [s.study_name for s in optuna.study.get_all_study_summaries(storage)]
    assert names == ["titan-llama3-debug-cpu-2"] and f"study '{names[0]}' in {storage}" in out
    trials = optuna.load_study(study_name=names[0], storage=storage).get_trials()
    measured = [t for t in trials if "plan" in t.user_attrs and "duplicate_of" not in t.user_attrs]
    assert len(measured) == 6                                          # --trials 6 = 6 runs of titan-run
    assert len({tuple(sorted(t.params.items())) for t in measured}) == 6       # all distinct points
    runs = list((tmp_path / "runs").rglob("plan.yaml"))
    assert len(runs) == 6                                              # a duplicate never launched a run
    for t in trials:     # an illegal point or a duplicate of one is never a measured 0.0
        if t.user_attrs.get("status") == "illegal":
            assert t.state == TrialState.PRUNED and "plan" not in t.user_attrs


def test_calibrate_on_a_missing_database_is_one_line_and_creates_nothing(tmp_path):
    db = tmp_path / "typo.db"
    r = subprocess.run([sys.executable, "-m", "planner.cli", "calibrate", "--storage", f"sqlite:///{db}",
                        "--out", str(tmp_path / "c.yaml")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and str(db) in r.stderr, r.stderr
    assert not db.exists() and not (tmp_path / "c.yaml").exists()


SPACE3 = textwrap.dedent("""\
    name: three-microbatches
    degrees: {dp_replicate: [1], pp: [1], tp: [1], cp: [1], ep: [1]}
    tp_within_node: true
    knobs:
      microbatch: [1, 2, 4]
      schedule: [GPipe]
      stages_per_rank: [2]
      ac: [none]
      reshard_after_forward: [true]
      compile: [false]
      float8: [false]
      backend: [spmd_types]
""")


@pytest.mark.slow
def test_three_real_trials_then_calibrate(tmp_path):
    """`--trials 3` runs titan-run 3 times (3 distinct plans), and `calibrate` fits them (a pruned trial
    counts with the step times it ran)."""
    space = tmp_path / "space.yaml"
    space.write_text(SPACE3)
    storage = f"sqlite:///{tmp_path}/real.db"
    r = subprocess.run([sys.executable, "-m", "planner.cli", "--model", "llama3-debug", "--gpus", "1",
                        "--hardware", "cpu", "--seq-len", "64", "--global-batch", "4", "--space", str(space),
                        "--trials", "3", "--trial-steps", "4", "--storage", storage, "--run-root",
                        str(tmp_path / "runs"), "--no-write"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("[trials]   ok:") + r.stderr.count("[trials]   pruned") == 3, r.stderr[-3000:]
    assert r.stderr.count("[trials] trial ") == 3              # duplicates proposed by TPE ran nothing
    c = subprocess.run([sys.executable, "-m", "planner.cli", "calibrate", "--storage", storage, "--no-loo",
                        "--out", str(tmp_path / "cal.yaml")], capture_output=True, text=True, timeout=600)
    assert c.returncode == 0, c.stderr
    assert "3 successful trials" in c.stdout and (tmp_path / "cal.yaml").is_file()


# --------------------------------------------------------------------------- progress (planner/progress.py)
class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_plain_lines_without_a_terminal_and_a_bar_on_one():
    plain = io.StringIO()
    with Progress(3, "trials", unit="trial", initial=1, stream=plain) as bar:
        bar.write("[trials] a log line")
        bar.step("#1 ok")
        bar.step("#2 oom")
    lines = plain.getvalue().splitlines()
    assert lines[0] == "[trials] a log line"
    assert lines[1].startswith("[trials] 2/3 #1 ok (") and "ETA" in lines[1]
    assert lines[2].startswith("[trials] 3/3 #2 oom (") and "ETA" not in lines[2] and len(lines) == 3
    tty = _Terminal()
    with Progress(2, "dry run", unit="candidate", stream=tty) as bar:
        bar.write("a log line")
        bar.step("fsdp4: ok")
    text = tty.getvalue()
    assert "\r" in text and "1/2" in text and "a log line\n" in text and "[dry run]" not in text
    assert duration(5) == "5 s" and duration(185) == "3m05s" and duration(3720) == "1h02m"
