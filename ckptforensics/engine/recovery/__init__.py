"""Did the resumed run recover? Its log against the pre-incident trajectory, and the plan's checks.

A run rolled back to step R and resumed leaves legs in its log: the pre-incident steps (up
to R), the incident leg's steps after R (where the log still has them) and the resumed
leg's. The pre-incident trajectory is fitted on the steps before the onset; each window of
the resumed leg is judged against it (loss and grad norm), the resumed leg is searched for
new onsets with `triage`'s own detectors, and the verdict is `recovered` at step S,
`recovering` (the gap to the trajectory closing), `not recovered`, or `relapsed` at step S.
Beside it, the checks that the resume was the plan: the LR, clip, precision and loss scale
the new leg runs with, the optimizer state it resumed (Adam's step counter against the
trainer's), and the skipped samples not seen again (docs/signatures.md#recovery).

One module a part: `legs` (the log's legs, split around the resume), `trajectory` (the fit,
the windows, the verdict), `checks` (the resume against the plan, pure), `gather` (what
those checks read from disk), `assess` (the whole, `recovery`); its report is the command's
(`commands.recovery`).
"""

from __future__ import annotations

from ckptforensics.engine.recovery.assess import RecoveryResult, recovery, relapse_steps, summarize
from ckptforensics.engine.recovery.checks import Check, optimizer_resumed
from ckptforensics.engine.recovery.legs import Leg, Split, read_legs, split_legs
from ckptforensics.engine.recovery.trajectory import (
    STATUSES,
    Z_BAND,
    Trajectory,
    Window,
    fit_trajectory,
    judge,
    verdict_of,
)

__all__ = [
    "Leg",
    "Trajectory",
    "Window",
    "Check",
    "RecoveryResult",
    "STATUSES",
    "read_legs",
    "fit_trajectory",
    "judge",
    "optimizer_resumed",
    "recovery",
    "Z_BAND",
    "Split",
    "split_legs",
    "verdict_of",
    "relapse_steps",
    "summarize",
]
