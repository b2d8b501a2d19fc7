"""Numbers and words for people: how every rendering (Markdown, HTML, text) writes a figure.

The lowest module of the report package: it imports nothing of it, and every renderer
imports it, so a figure reads the same in report.md, report.html and a terminal.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["fmt", "finite", "reproduces"]


def fmt(x: Any) -> str:
    """Numbers for people: 65,504 / 1.2e-03 / 3.4; None -> '—'."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        if x == 0:
            return "0"
        a = abs(x)
        if a >= 1e5 or a < 1e-2:
            return f"{x:.2e}"
        if float(x).is_integer() and a < 1e5:
            return f"{int(x):,}"
        return f"{x:.3g}"
    return str(x)


def finite(x: Any) -> str:
    """A replayed figure; JSON carries inf/NaN as null, which here means 'not finite'."""
    return "not finite" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt(x)


# How the verdict's replay check reads in a ticket.
_CHECK_WORDS = {
    "missed_first": "withheld: the replay does not reproduce the run's own log",
    "missed_later": "withheld: the replay leaves the run's own log before any spike",
    "unexplained": "not reproduced, unexplained: the replay misses the log's spike and the run's files name explanations it could not exclude",
    "unchecked": "inconclusive (no logged figure to check the replay against)",
}


def reproduces(v: dict[str, Any]) -> str:
    """The verdict's 'reproduces' cell: yes / no, or why there is no answer."""
    if v["reproducible"] is not None:
        return fmt(v["reproducible"])
    check = v.get("replay_check")
    if check is None:
        return "not replayed"
    return _CHECK_WORDS.get(
        check["status"], "inconclusive (the replay deviates from after: see replay.config)"
    )
