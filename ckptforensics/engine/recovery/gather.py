"""What the plan's checks read, from disk: the first checkpoint after the resume (its Adam
step counters, its training config) and the sample ids the resumed run's batch log saw."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ckptforensics.checkpoints import first_complete, list_checkpoints, open_checkpoint
from ckptforensics.core.errors import ForensicsError
from ckptforensics.engine.recovery.checks import (
    Check,
    clip_check,
    lr_check,
    optimizer_resumed,
    precision_check,
    scale_check,
    skip_check,
)
from ckptforensics.engine.recovery.legs import Split
from ckptforensics.formats.batches import BatchError, open_batches

__all__ = ["plan_checks"]


def plan_checks(
    run_dir: Path,
    resumed_from: int,
    sp: Split,
    expect: dict[str, Any],
    flight: Path | None,
    checkpoint: Path | None,
    lr_jumps: Sequence[Any] = (),
) -> tuple[list[Check], str | None]:
    """The plan's checks, and the checkpoint after the resume they read."""

    ckpts = list_checkpoints(run_dir) if run_dir.is_dir() else []
    rollback = next((p for s, p in ckpts if s == resumed_from), None)
    after_path = checkpoint
    if after_path is None:
        # Two checkpoints of one step (Lightning's `-v1` beside the incident leg's): the newer
        # is the resumed leg's.
        later = sorted(
            ((s, p) for s, p in ckpts if s > resumed_from),
            key=lambda sp_: (sp_[0], -sp_[1].stat().st_mtime),
        )
        got, _ = first_complete(later)
        after_path = got[1] if got else None
    r_scale = offset = None
    if rollback is not None:
        # The rollback checkpoint may be incomplete by its format's rule (a weights-only copy
        # resumed from, say): what it holds is read all the same, or nothing where it is unreadable.
        try:
            with open_checkpoint(rollback, check=False) as ck:
                r_scale = ck.scalars.get("loss_scale")
                st = _adam_steps(ck)
                if st and ck.step is not None:
                    offset = float(np.median(st)) - ck.step
        except ForensicsError:
            pass
    after_cfg = None
    checks: list[Check] = []
    if after_path is not None:
        with open_checkpoint(after_path) as ck:
            after_cfg = _train_config(ck)
            skipped = sum(
                1
                for a, b in zip(
                    list(sp.resumed.values()), list(sp.resumed.values())[1:], strict=False
                )
                if "loss_scale" in a and "loss_scale" in b and b["loss_scale"] < a["loss_scale"]
            )
            if ck.step is None:
                checks.append(
                    Check(
                        "optimizer_state",
                        "unknown",
                        None,
                        None,
                        f"{after_path} does not record its step",
                    )
                )
            else:
                checks.append(
                    optimizer_resumed(
                        _adam_steps(ck), ck.step, resumed_from, offset or 0.0, skipped
                    )
                )
    else:
        checks.append(
            Check(
                "optimizer_state",
                "unknown",
                None,
                None,
                f"no checkpoint after step {resumed_from} yet: the optimizer state is checked on the first one the resumed run writes",
            )
        )
    seen, src, recorded_clip = _recorded(run_dir, flight, resumed_from)
    checks += [
        lr_check(expect, sp.resumed, lr_jumps),
        clip_check(expect, after_cfg, recorded_clip),
        precision_check(expect, after_cfg, sp.resumed),
        scale_check(r_scale, sp.resumed, expect),
        skip_check(expect, seen, src),
    ]
    return checks, str(after_path) if after_path is not None else None


def _train_config(ck: Any) -> dict[str, Any]:
    tc = dict(ck.scalars.get("train_config") or {})
    ta = ck.scalars.get("training_args") or {}
    if isinstance(ta, dict):
        tc.setdefault("bf16", ta.get("bf16"))
        tc.setdefault("fp16", ta.get("fp16"))
    return tc


def _adam_steps(ck: Any) -> list[float]:
    """Adam's `step` of every parameter with optimizer state (weights only: none)."""
    if ck.optimizer is None:
        return []
    out = []
    for st in ck.optimizer.state.values():
        v = st.get("step")
        if v is None:
            continue
        try:
            out.append(float(v.item() if hasattr(v, "item") else v))
        except (TypeError, ValueError):
            continue
    return out


def _recorded(
    run_dir: Path, flight: Path | None, resumed_from: int
) -> tuple[dict[int, list[int]] | None, str | None, float | None]:
    """The sample ids the flight recorder kept for each step after the resume, its source,
    and the clip it recorded (None where no recorder ran, or it kept no sample ids)."""
    root = (
        flight
        if flight is not None
        else (run_dir / "flight" if (run_dir / "flight").is_dir() else None)
    )
    if root is None:
        return None, None, None

    try:
        src = open_batches(str(root))
    except (BatchError, ForensicsError, OSError):
        return None, None, None
    seen = {
        int(s): [int(x) for x in ids]
        for s, ids in (src.sample_ids or {}).items()
        if int(s) > resumed_from
    }
    return (seen or None), str(root), src.grad_clip
