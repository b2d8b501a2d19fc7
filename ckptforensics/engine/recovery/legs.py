"""The legs of a run's log, read and split around the resume: the pre-incident steps, the
incident leg's and the resumed leg's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptforensics.core.errors import ForensicsError
from ckptforensics.logs import discover_metrics, find_logs
from ckptforensics.logs.columns import canonical
from ckptforensics.logs.readers import read_file

__all__ = ["Rows", "Leg", "read_legs", "Split", "split_legs"]


Rows = dict[int, dict[str, float]]


@dataclass(frozen=True, slots=True)
class Leg:
    """What one launch of the trainer logged: step -> metrics, and where it came from."""

    source: str
    rows: Rows

    @property
    def first(self) -> int:
        return min(self.rows)

    @property
    def last(self) -> int:
        return max(self.rows)


# ---------------------------------------------------------------- reading the legs
def read_legs(run_dir: Path, metrics: Path | None = None) -> list[Leg]:
    """The legs of a run's log, in the order they started (the logs package's readers: a file
    a restart appends to splits where its steps go back; Lightning's CSVLogger writes a
    version folder per launch, TensorBoard an events file; an HF Trainer's
    `trainer_state.json` carries the rows it resumed with, so its newest holds the
    pre-incident and the resumed steps as one leg, the incident leg's rows gone with the
    checkpoints the resumed run overwrote). Our column names (`loss`, `grad_norm`, `lr`,
    `loss_scale`) are added as `logs.read_metrics` adds them.

    Raises:
        ForensicsError: no log found, or one no reader reads.
    """

    if metrics is not None and not metrics.is_dir():
        files = [metrics]
    else:
        files = find_logs(metrics or run_dir)
        if not files:
            discover_metrics(metrics or run_dir)  # the one-line error naming what was looked for
    read = [leg for f in files for leg in read_file(f)]
    out = []
    for leg in sorted(read, key=lambda x: (x.started, x.source, x.order)):
        if leg.rows:
            canonical(leg.rows)
            out.append(Leg(leg.source, dict(sorted(leg.rows.items()))))
    if not out:
        raise ForensicsError(f"{', '.join(map(str, files))}: no rows with a step")
    return out


@dataclass(frozen=True, slots=True)
class Split:
    """The legs around a resume at step R: the pre-incident rows (steps <= R, as first
    logged), the incident leg's rows after R (empty where the log lost them), the resumed
    leg's rows after R."""

    pre: Rows
    incident: Rows
    resumed: Rows
    resumed_source: str
    incident_source: str | None


def split_legs(legs: Sequence[Leg], resumed_from: int) -> Split:
    """Which rows are which, around the resume at `resumed_from`.

    Raises:
        ForensicsError: no leg logged a step after `resumed_from`.
    """
    after = [leg for leg in legs if leg.last > resumed_from]
    if not after:
        raise ForensicsError(
            f"no step after {resumed_from} in the log ({', '.join(sorted({leg.source for leg in legs}))}): has the resumed run logged yet?"
        )
    resumed = after[-1]
    pre: Rows = {}
    for leg in legs:
        for s, r in leg.rows.items():
            if s <= resumed_from and s not in pre:
                pre[s] = r
    earlier = [leg for leg in after[:-1] if any(s > resumed_from for s in leg.rows)]
    inc = earlier[0] if earlier else None
    return Split(
        dict(sorted(pre.items())),
        {s: r for s, r in sorted(inc.rows.items()) if s > resumed_from} if inc is not None else {},
        {s: r for s, r in sorted(resumed.rows.items()) if s > resumed_from},
        resumed.source,
        inc.source if inc is not None else None,
    )
