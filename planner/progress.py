"""Progress on long work (dry-run candidates, profile stages, trials): a tqdm bar on stderr when stderr is
a terminal; otherwise (a pipe, a CI log, a test) no bar, one plain line per finished item instead.

    with Progress(total=3, desc="dry run", unit="candidate") as bar:
        for c in candidates:
            ...
            bar.step(f"{c}: ok")          # "[dry run] 1/3 rep2·fsdp2: ok (12 s elapsed, ETA 24 s)"
            bar.write("a log line")       # printed above the bar (tqdm.write), or plainly
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable, TextIO


def duration(s: float) -> str:
    """12 s, 3m05s, 1h02m."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f} s"
    m, sec = divmod(int(round(s)), 60)
    return f"{m}m{sec:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


class Progress:
    """`total` items, of which `initial` are already done (a resumed study)."""

    def __init__(self, total: int, desc: str, *, unit: str = "item", initial: int = 0, eta: bool = True,
                 stream: TextIO | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.desc, self.n = int(total), desc, int(initial)
        self._initial, self._t0, self._eta = int(initial), time.monotonic(), eta   # eta: items of like length
        self.bar = None
        if _is_tty(self.stream):
            from tqdm import tqdm     # tqdm: imported when a bar is drawn (titan-plan's cold start)
            width = {"dynamic_ncols": True} if _sized(self.stream) else {"ncols": 100, "nrows": 20}
            self.bar = tqdm(total=self.total, initial=self.n, desc=desc, unit=unit, file=self.stream, leave=True,
                            **width)

    def eta_s(self) -> float | None:
        """Seconds left at the mean time per item finished in this run (None before the first)."""
        done = self.n - self._initial
        if done <= 0:
            return None
        return (time.monotonic() - self._t0) / done * max(0, self.total - self.n)

    def step(self, what: str = "") -> None:
        """One item finished: advance the bar, or print `[desc] i/N what (elapsed, ETA)`."""
        self.n += 1
        if self.bar is not None:
            if what:
                self.bar.set_postfix_str(what[:60], refresh=False)
            self.bar.update(1)
            return
        eta = self.eta_s()
        clock = f"{duration(time.monotonic() - self._t0)} elapsed"
        if self._eta and eta is not None and self.n < self.total:
            clock += f", ETA {duration(eta)}"
        head = f"[{self.desc}] {self.n}/{self.total}" + (f" {what}" if what else "")
        print(f"{head} ({clock})", file=self.stream, flush=True)

    def write(self, line: str) -> None:
        """A log line that keeps the bar intact (printed above it)."""
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def wrap(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """`log` (a caller's printer) made bar-safe: the bar is cleared while it writes, then redrawn."""
        if self.bar is None:
            return log

        def bar_safe(line: str) -> None:
            with type(self.bar).external_write_mode(file=self.stream):
                log(line)
        return bar_safe

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _sized(stream) -> bool:
    """The terminal reports its size (a bare pty says 0 x 0, and tqdm then draws nothing)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):
        return False
    return size.columns > 0 and size.lines > 0


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):     # no isatty, or a closed stream
        return False
