"""`plan`: the resume, in the trainer's own terms, each change verified by a what-if replay or
marked not replayed; `plan_from` builds it from reports already written."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.commands.common import (
    Progress,
    Report,
)
from ckptforensics.commands.replay import replay
from ckptforensics.commands.whatif import whatif
from ckptforensics.core.errors import ForensicsError
from ckptforensics.core.options import ReplayOptions, replay_options
from ckptforensics.detectors import Finding
from ckptforensics.engine.diff.shard import (
    dist_world,
)
from ckptforensics.engine.whatif import parse_mitigation
from ckptforensics.formats.batches import BatchError
from ckptforensics.planner import merge_reports, mitigations, plan_section
from ckptforensics.report import (
    clean,
)
from ckptforensics.report.evidence import load_report

log = logging.getLogger(__name__)


def plan(
    before: str | int | Path,
    after: str | int | Path,
    *,
    batch: str | Path | None = None,
    tries: Sequence[str] | None = None,
    run_dir: str | Path | None = None,
    options: ReplayOptions | None = None,
    progress: Progress | None = None,
    command: str = "ckptforensics.plan",
    **option: Any,
) -> Report:
    """The resume plan for the incident between `before` and `after`: the window is replayed
    (the verdict), then the mitigations its cause calls for (`plan.mitigations`, or `tries`)
    are replayed from the rollback checkpoint (the what-if), and the plan is written in the
    trainer's own terms, each change marked verified by the what-if or not replayed. The
    report holds the replay's verdict, the `whatif` section and the `plan` section; the skip
    list, where there is one, is `report.extra["skip"]` (saved as skip.json). Options as
    for `replay`."""

    if dist_world()[1] > 1:
        raise ForensicsError(
            "plan runs in one process (its what-if follows from the replay's verdict); under torchrun run `replay` and "
            "`whatif`, then `ckptforensics plan incident/ whatif/`"
        )
    opts = replay_options(options, **option)
    rep = replay(
        before,
        after,
        batch=batch,
        run_dir=run_dir,
        options=opts,
        progress=progress,
        command=command,
    )
    p = rep.plan
    tried = (
        list(tries)
        if tries
        else mitigations(
            rep.doc,
            ((rep.doc.get("replay") or {}).get("config") or {}).get("clip", {}).get("value"),
        )
    )
    doc, findings = rep.doc, list(rep.findings)
    if p.get("status") == "ready" and tried:
        r = p["rollback"]
        n = int(rep.doc["incident"]["after"]["step"]) - int(r["step"])
        wi = _whatif_past_skips(
            int(r["step"]),
            max(n, 1),
            lambda steps: whatif(
                r["path"],
                steps=steps,
                tries=tried,
                batch=batch,
                run_dir=run_dir,
                options=opts,
                progress=progress,
                command=command,
            ),
            tried,
        )

        f = wi.findings[0]
        extra = Finding(f"F{len(findings) + 1}", *[getattr(f, k) for k in Finding.__slots__[1:]])  # type: ignore[attr-defined]
        findings.append(extra)
        doc = {
            **doc,
            "whatif": wi.doc["whatif"],
            "findings": [*doc["findings"], {**wi.doc["findings"][0], "id": extra.id}],
        }
        with open_checkpoint(doc["incident"]["before"]["path"]) as ck:
            doc["plan"] = _clean_doc(plan_section(doc, ck))
    return Report(doc, findings, _skip_extra(doc))


# Steps replayed past the last step a `skip_step` try skips: the what-if judges a skip on the
# steps after it (the skipped batch is not on its record), not only on the healthy ones before.
AFTER_SKIP = 2


def _whatif_past_skips(
    rollback: int, n: int, run: Callable[[int], Report], tried: Sequence[str]
) -> Report:
    """The plan's what-if over the window (`n` steps from the rollback), or past it where a
    `skip_step` try skips its last step (the onset, as the cause's tries name it): judged on
    the window's steps alone, a skip would pass on the healthy steps before it. Past the
    window only where the batches are there (a batch log that stops at *after* keeps the
    window)."""
    skips = [int(float(v)) for t in tried for k, v in parse_mitigation(t).knobs if k == "skip_step"]
    if not skips or max(skips) < rollback + n:
        return run(n)
    try:
        return run(max(skips) - rollback + AFTER_SKIP)
    except BatchError as e:
        log.info("what-if over the window only (%s)", e)
        return run(n)


def _clean_doc(x: Any) -> Any:

    return clean(x)


def _skip_extra(doc: dict[str, Any]) -> dict[str, Any]:
    """skip.json for a plan that skips data: steps, sample ids and rows per step."""
    sk = (doc.get("plan") or {}).get("skip")
    return (
        {"skip": {"steps": sk["steps"], "sample_ids": sk["sample_ids"], "rows": sk["rows"]}}
        if sk
        else {}
    )


def plan_from(reports: Sequence[str | Path]) -> Report:
    """The resume plan from reports already written (a replay or bisect report, a what-if
    report of the same incident: their `report.json`, `evidence.h5` or directories). The
    *before* checkpoint they name must still be where they say: the run's own settings are
    read from it."""

    docs = []
    for r in reports:
        p = Path(r)
        docs.append(load_report(p / "report.json" if p.is_dir() else p))
    if any(d.get("recovery") for d in docs):
        raise ForensicsError(
            "a recovery report has no incident to plan for: pass the replay, bisect or what-if report"
        )
    doc = merge_reports(docs)
    before = Path(doc["incident"]["before"]["path"])
    if not before.exists():
        raise ForensicsError(
            f"{before}: the report's before checkpoint is not here; the plan reads the run's settings from it (run `ckptforensics plan --run-dir ...` where the run is)"
        )
    with open_checkpoint(before) as ck:
        doc = {**doc, "plan": _clean_doc(plan_section(doc, ck))}
    return Report(doc, list(doc.get("findings", [])), _skip_extra(doc))
