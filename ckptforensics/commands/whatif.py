"""`whatif`: the window replayed from *before* under each mitigation; the least invasive one
that keeps the run on track."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.commands.common import (
    Progress,
    Report,
    rank_zero,
    replay_config,
)
from ckptforensics.core.errors import ForensicsError, doing
from ckptforensics.core.options import ReplayOptions, replay_options
from ckptforensics.detectors import Finding
from ckptforensics.engine.bisect import bisect as bisect_window
from ckptforensics.engine.replay import distributed
from ckptforensics.engine.whatif import parse_mitigation
from ckptforensics.engine.whatif import whatif as whatif_window
from ckptforensics.report import (
    build_report,
)
from ckptforensics.verdict import decide_whatif


def whatif(
    before: str | int | Path,
    *,
    steps: int,
    tries: Sequence[str],
    batch: str | Path | None = None,
    run_dir: str | Path | None = None,
    options: ReplayOptions | None = None,
    progress: Progress | None = None,
    command: str = "ckptforensics.whatif",
    **option: Any,
) -> Report:
    """Replay `steps` steps from *before* under each mitigation (`clip=1.0`,
    `precision=bf16`, `lr_scale=0.5`, `skip_samples=auto`, ...) and recommend the least
    invasive one that keeps the run on track. Options as for `replay`."""

    if steps < 1:  # the window (before, before + steps] holds no step
        raise ForensicsError(f"--steps {steps}: the window is empty; pass --steps 1 or more")
    cfg = replay_config(before, None, batch, run_dir, replay_options(options, **option))
    return Report(
        *rank_zero(
            run_whatif(cfg, steps, list(tries), None, command=command, progress=progress), "whatif"
        )
    )


def run_whatif(
    cfg: Any,
    n_steps: int,
    tries: list[str],
    skip_rows: dict[int, list[int]] | None,
    *,
    command: str,
    progress: Progress | None = None,
) -> tuple[dict[str, Any], list[Finding]] | None:
    """`ckptforensics whatif`: the baseline and each mitigation replayed from *before*
    (under torchrun: by every rank together; ranks other than 0 return None)."""

    with (
        distributed.joined(cfg.device) as ranks,
        doing(f"replaying {n_steps} steps from {cfg.before} under each mitigation"),
    ):
        got = _whatif(cfg, n_steps, tries, skip_rows, command, progress)
        return got if ranks is None or ranks.rank == 0 else None


def _whatif(
    cfg: Any,
    n_steps: int,
    tries: list[str],
    skip_rows: dict[int, list[int]] | None,
    command: str,
    progress: Progress | None,
) -> tuple[dict[str, Any], list[Finding]]:

    mitigations = [parse_mitigation(t) for t in tries]
    auto = skip_rows
    auto_ids: dict[int, list[int]] = {}
    if (
        any(k == "skip_samples" and v == "auto" for m in mitigations for k, v in m.knobs)
        and not auto
    ):
        first = _step_of(cfg.before) + 1
        res, _ = bisect_window(cfg, progress, steps=list(range(first, first + n_steps)))
        auto = {res.first_bad_step: res.rows} if res.rows else {}
        auto_ids = {res.first_bad_step: res.sample_ids} if res.rows and res.sample_ids else {}
    outcomes, best, info = whatif_window(cfg, n_steps, mitigations, auto, progress)
    msg = (
        f"{best} keeps the run on track over {n_steps} steps (least invasive that does)"
        if best
        else (
            "the baseline stays on track: no mitigation needed"
            if info["baseline_on_track"]
            else "no mitigation tried keeps the run on track"
        )
    )
    finding = Finding(
        "F1",
        "whatif",
        best or "run",
        1.0,
        "info",
        {"recommended": best, **info},
        msg,
        "docs/signatures.md#what-if",
        (),
    )
    verdict = decide_whatif(
        before=str(cfg.before),
        n_steps=n_steps,
        outcome=msg,
        recommended=_named(best, auto_ids),
        baseline_on_track=bool(info["baseline_on_track"]),
    )
    section = {
        "outcomes": [asdict(o) for o in outcomes],
        "recommended": best,
        **info,
        "auto_rows": {str(k): v for k, v in (auto or {}).items()},
        "auto_sample_ids": {str(k): v for k, v in auto_ids.items()},
    }
    with open_checkpoint(cfg.before) as a:
        doc = build_report(
            command=command,
            before=a,
            after=a,
            verdict=verdict,
            findings=[finding],
            sections={"whatif": section},
        )
    return doc, [finding]


def _step_of(path: Path) -> int:
    with open_checkpoint(path) as c:
        if c.step is None:
            raise ForensicsError(f"{path}: the checkpoint does not record its step")
        return c.step


def _named(best: str | None, auto_ids: dict[int, list[Any]]) -> str | None:
    """The recommended mitigation as a user applies it: `skip_samples=auto` names the samples
    bisect found ("skip_samples=auto (samples 273, 276, 278 of step 35)")."""
    if best is None or "skip_samples=auto" not in best or not auto_ids:
        return best
    named = "; ".join(
        f"samples {', '.join(str(i) for i in ids)} of step {s}"
        for s, ids in sorted(auto_ids.items())
    )
    return f"{best} ({named})"
