"""`--help` of every titan-plan and titan-run (sub)command is complete: each flag and positional says what
it is for, and `titan-run --help` names its subcommands (export, import) and the dry run."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from executor import cli as run_cli
from planner import cli as plan_cli
from tests.distributed.harness import ROOT, env


def _walk(parser: argparse.ArgumentParser, name: str):
    """(command name, parser) for `parser` and every subparser under it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _walk(p, f"{name} {sub}")


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    out = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        if not (action.help or "").strip():
            out.append("/".join(action.option_strings) or action.dest)
    return out


class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def _parser_of(main, argv, monkeypatch) -> argparse.ArgumentParser:
    """The parser a `main(argv)` builds (for the parsers built inside a main): caught at parse_args."""
    def capture(self, args=None, namespace=None):
        raise _Captured(self)
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(_Captured) as ei:
            main(argv)
    return ei.value.parser


def _titan_run_parsers(monkeypatch):
    from executor import dry_run, export          # torch: these modules are the executor's
    yield "titan-run", run_cli.build_parser()
    yield "titan-run --dry-run", _parser_of(dry_run.main, [], monkeypatch)
    for cmd in ("export", "import"):
        yield f"titan-run {cmd}", _parser_of(export.main, [cmd], monkeypatch)


def test_every_flag_of_every_command_has_help(monkeypatch):
    parsers = list(_walk(plan_cli.build_parser(), "titan-plan")) + list(_titan_run_parsers(monkeypatch))
    names = [n for n, _ in parsers]
    for sub in plan_cli.SUBCOMMANDS:
        assert f"titan-plan {sub}" in names and sub in plan_cli.build_parser().epilog, sub
    missing = {n: _undocumented(p) for n, p in parsers}
    missing = {n: m for n, m in missing.items() if m}
    assert not missing, f"flags without a help string: {missing}"
    for name, p in parsers:
        assert (p.description or "").strip(), f"{name} has no description"


def test_titan_run_help_names_its_subcommands():
    p = subprocess.run([sys.executable, "-m", "executor.cli", "--help"], cwd=ROOT, env=env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and not p.stderr
    for text in ("titan-run export", "titan-run import", "--hf-dir", "--dry-run", "torchrun"):
        assert text in p.stdout, text
    for cmd in ("export", "import"):
        q = subprocess.run([sys.executable, "-m", "executor.cli", cmd, "--help"], cwd=ROOT, env=env(),
                           capture_output=True, text=True, timeout=120)
        assert q.returncode == 0 and f"usage: titan-run {cmd}" in q.stdout and "--out" in q.stdout
