"""Scoreboard of `recovery` on resumed runs drawn at random: right on every resumed draw?

    python bench/recovery_draws.py [--split tuning] [--out build/recovery-draws] [--rebuild] [--record]

Each draw of `fixtures/recovery_draws.py` is built (trained: the incident, the run that never
had it where the truth is read against it, the resume) unless its resume.json is there, then
the real CLI runs on the resumed run as a user would type it
(`ckptforensics recovery --run-dir RUN --resumed-from R --json`) and its JSON is held to the
truth in resume.json:

- verdict: recovered or not (`recovered` against `not recovered`, `recovering`, `relapsed`);
- status: the exact status (a stalled resume is `not recovered`, a relapse `relapsed`);
- step: the step recovery names (the resume's first step, the relapse's onset; none else);
- optimizer: the `optimizer_state` check failed at the rollback exactly where the resume lost
  the optimizer's state (`lost`: its truth plants no status, fixtures/resume_runs.py's format).

A draw is right when every field its truth plants is. A draw whose run did not do what its
truth says (`DrawError`) is reported as a build failure, never scored. The held-out split is
scored once, by whoever holds it out; `--record` keeps the figures in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench._results import publish  # noqa: E402
from fixtures.recovery_draws import (  # noqa: E402
    NOISES,
    SPLITS,
    VARIANTS,
    DrawError,
    build_recovery,
    draw_recovery,
)

# The console script beside this interpreter: what a user of the venv types.
CLI = Path(sys.executable).with_name("ckptforensics")


@dataclass(frozen=True, slots=True)
class Score:
    """One resumed draw held to its truth; None where its truth plants nothing."""

    seed: int
    noise: str
    schedule: str
    incident: str
    variant: str
    truth: str  # the truth's status and step, "-" where it plants none
    got: str  # recovery's status and step
    verdict_ok: bool | None  # recovered or not
    status_ok: bool | None
    step_ok: bool | None
    optimizer_ok: bool | None
    error: str | None = None  # the build failure, where the draw could not be scored
    seconds: float = 0.0  # the recovery command's wall time

    @property
    def right(self) -> bool:
        flags = (self.verdict_ok, self.status_ok, self.step_ok, self.optimizer_ok)
        return self.error is None and all(f is not False for f in flags)


def run_recovery(run: Path, resumed_from: int) -> tuple[dict[str, Any], float]:
    """The CLI's JSON on `run`, and its wall time (seconds)."""
    cmd = [str(CLI), "recovery", "--run-dir", str(run), "--resumed-from", str(resumed_from)]
    t = time.perf_counter()
    res = subprocess.run([*cmd, "--json"], capture_output=True, text=True, cwd=ROOT, check=False)
    took = time.perf_counter() - t
    if res.returncode not in (0, 1):
        raise RuntimeError(
            f"recovery on {run} exited {res.returncode}: {res.stderr.strip()[-400:]}"
        )
    try:
        return json.loads(res.stdout), took
    except json.JSONDecodeError as e:
        raise RuntimeError(f"recovery on {run} wrote no JSON: {e}") from e


def _label(status: str | None, step: int | None) -> str:
    return "-" if status is None else status + (f" at {step}" if step is not None else "")


def score(seed: int, run: Path) -> Score:
    """Hold recovery on the resumed draw at `run` to its resume.json."""
    t = json.loads((run / "resume.json").read_text())
    d = draw_recovery(seed)
    try:
        doc, took = run_recovery(run, t["resumed_from"])
    except RuntimeError as e:  # the command failed on a run it should judge: wrong, not skipped
        got = f"error: {str(e)[-120:]}".replace("|", "/").replace("\n", " ")
        truth = _label(t["status"], t["step"])
        return Score(seed, d.noise, d.schedule, d.incident, d.variant, truth, got, *[False] * 4)
    r = doc["recovery"]
    opt = next(c for c in r["checks"] if c["name"] == "optimizer_state")
    if t["optimizer_restarted_at"] is not None:
        opt_ok = opt["status"] == "failed" and opt["step"] == t["optimizer_restarted_at"]
    else:
        opt_ok = opt["status"] == "ok"
    planted = t["status"] is not None
    return Score(
        seed,
        d.noise,
        d.schedule,
        d.incident,
        d.variant,
        _label(t["status"], t["step"]),
        _label(r["status"], r["step"]),
        (r["status"] == "recovered") == (t["status"] == "recovered") if planted else None,
        r["status"] == t["status"] if planted else None,
        r["step"] == t["step"] if planted else None,
        opt_ok,
        None,
        took,
    )


def _failed(seed: int, err: Exception) -> Score:
    d = draw_recovery(seed)
    return Score(
        seed, d.noise, d.schedule, d.incident, d.variant, "-", "-", None, None, None, None, str(err)
    )


def _frac(scores: list[Score], field: str) -> str:
    got = [getattr(s, field) for s in scores if getattr(s, field) is not None]
    return f"{sum(got)}/{len(got)}" if got else "-"


def table(scores: list[Score], split: str) -> str:
    """The figures as Markdown: totals, per noise and per variant, then one line per draw."""
    built = [s for s in scores if s.error is None]
    right = sum(s.right for s in built)
    lines = [
        f"## Recovery on resumed draws (`bench/recovery_draws.py`, split `{split}`)",
        "",
        f"{dt.date.today()} · {platform.machine()} · {platform.python_version()} · "
        f"{len(scores)} draws, {len(scores) - len(built)} build failures · "
        f"**right on {right}/{len(built)}** ({right / max(len(built), 1):.0%})",
        "",
        "| | right | verdict | status | step | optimizer check |",
        "|---|---|---|---|---|---|",
    ]
    groups = [("all", built)]
    groups += [(n, [s for s in built if s.noise == n]) for n in NOISES]
    groups += [(v, [s for s in built if s.variant == v]) for v in VARIANTS]
    for name, g in groups:
        lines.append(
            f"| {name} | {sum(s.right for s in g)}/{len(g)} | {_frac(g, 'verdict_ok')} | "
            f"{_frac(g, 'status_ok')} | {_frac(g, 'step_ok')} | {_frac(g, 'optimizer_ok')} |"
        )
    lines += [
        "",
        "| seed | noise | schedule | incident | resume | truth | recovery | optimizer | s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in scores:
        if s.error is not None:
            got = f"build failed: {s.error}"
        elif s.status_ok is False or s.step_ok is False or s.optimizer_ok is False:
            got = s.got + " ✗"
        else:
            got = s.got
        opt = "-" if s.optimizer_ok is None else ("ok" if s.optimizer_ok else "✗")
        lines.append(
            f"| {s.seed} | {s.noise} | {s.schedule} | {s.incident} | {s.variant} | {s.truth} | "
            f"{got} | {opt} | {s.seconds:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=sorted(SPLITS), default="tuning")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "recovery-draws")
    ap.add_argument("--rebuild", action="store_true", help="retrain draws already built")
    ap.add_argument("--record", action="store_true", help="keep the figures in bench/RESULTS.md")
    args = ap.parse_args()
    out = args.out / args.split
    scores = []
    for seed in SPLITS[args.split]:
        d = draw_recovery(seed)
        run = out / d.name / d.variant
        try:
            if args.rebuild or not (run / "resume.json").is_file():
                run = build_recovery(seed, out)
            scores.append(score(seed, run))
        except DrawError as e:
            scores.append(_failed(seed, e))
        print(f"{seed}: {scores[-1]}", file=sys.stderr, flush=True)
    publish(f"recovery-draws-{args.split}", table(scores, args.split), args.record)


if __name__ == "__main__":
    main()
