"""What a command shows on stderr while it works: a live line on a terminal, a plain line every
few seconds in a log file, nothing under --quiet.

The library calls a callback with what it is doing (`progress(str)`) and never prints: a
tensor's name for inspect and diff (counted here against the checkpoint's tensor count), or
a replay's own words for the replay commands ("pass 2, clip 1.0: step 33 (3 of 5)", "what-if
2 of 4: clip=1.0, 5 steps"), which carry their own position. Batch jobs send stderr to a file: there
a line is written at most every `EVERY_S` seconds (CKPTFORENSICS_PROGRESS_EVERY sets
another), with no carriage returns, so the log shows the job moving without filling up.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

__all__ = ["EVERY_S", "Progress", "mode_of", "progress"]

EVERY_S = 10.0  # seconds between plain lines in a log file


def mode_of(stream: IO[str]) -> str:
    """'live' on a terminal, 'lines' on a file or pipe, 'off' on a stream with no file
    descriptor (an in-process capture such as click's CliRunner: nothing to show it to)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return "off"
    return "live" if os.isatty(fd) else "lines"


def _elapsed(s: float) -> str:
    m, s = divmod(int(s), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


class Progress:
    """A command's progress: call it with what the library is doing.

    Args:
        label: the command ("diff").
        total: the calls to expect when each call is one unit (tensors), else 0: each call
            is then a message that says where it is.
        unit: what one call counts ("tensors").
        stream: where to write (stderr).
        mode: 'live' (one line rewritten), 'lines' (a plain line every `every` seconds) or 'off'.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(
        self,
        label: str,
        total: int = 0,
        unit: str = "tensors",
        *,
        stream: IO[str],
        mode: str,
        every: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.stream, self.mode, self.every, self.clock = stream, mode, every, clock
        self.done = 0
        self.start = clock()
        self.last_shown: float | None = None
        self.width = 0

    def line(self, what: str) -> str:
        """The progress line after the call with `what`."""
        if self.total:
            pct = f" ({100 * self.done // self.total}%)" if self.done <= self.total else ""
            where = f"{self.done} of {self.total} {self.unit}{pct}: {what[-60:]}"
        else:
            where = what
        return f"{self.label}: {where} [{_elapsed(self.clock() - self.start)}]"

    def __call__(self, what: str) -> None:
        self.done += 1
        now = self.clock()
        if self.mode == "lines":
            if now - self.start < self.every or (
                self.last_shown is not None and now - self.last_shown < self.every
            ):
                return
            self.stream.write(self.line(what) + "\n")
        elif self.mode == "live":
            if self.last_shown is not None and now - self.last_shown < 0.1:
                return
            text = self.line(what)
            self.stream.write("\r" + text.ljust(self.width))
            self.width = len(text)
        else:
            return
        self.last_shown = now
        self.stream.flush()

    def close(self) -> None:
        """A live line is cleared, so what the command prints next starts on a clean line."""
        if self.mode == "live" and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


@contextmanager
def progress(
    total: int, label: str, quiet: bool, unit: str = "tensors"
) -> Iterator[Callable[[str], None]]:
    """The callback a command passes to the library (`Progress` on stderr; nothing when
    `quiet`)."""
    every = float(os.environ.get("CKPTFORENSICS_PROGRESS_EVERY", EVERY_S))
    mode = "off" if quiet else mode_of(sys.stderr)
    p = Progress(label, total, unit, stream=sys.stderr, mode=mode, every=every)
    try:
        yield p
    finally:
        p.close()
