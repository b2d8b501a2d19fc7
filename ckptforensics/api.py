"""The library API: what every command does, callable from a notebook.

The CLI is these functions plus argument parsing and printing. Each returns a `Report`
(the report document, its findings, and renderings); checkpoints it opens are closed
before it returns.

    import ckptforensics as cf   # the commands are the package's functions too
    rep = cf.replay("runs/x/step_30.pt", "runs/x/batches.h5", after="runs/x/step_40.pt")
    rep.cause, rep.verdict["first_bad_step"]
    print(rep.to_markdown())
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Report", "diff", "replay", "bisect", "whatif", "plan", "plan_from", "recovery", "triage", "audit", "resolve", "NotRankZero"]

Progress = Callable[[str], None]


class NotRankZero(Exception):
    """Raised on torchrun ranks other than 0, where a distributed diff, replay, bisect or
    whatif leaves no report (rank 0 returns it)."""


@dataclass
class Report:
    """One command's result: the report document (schema `ckptforensics.report/1`) and the
    findings behind it. `extra` holds what a command adds beside the report (bisect's
    skip list)."""

    doc: dict[str, Any]
    findings: list[Any]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def verdict(self) -> dict[str, Any]:
        return self.doc["verdict"]

    @property
    def cause(self) -> str:
        """The verdict's first cause ('none' for a healthy pair)."""
        return str(self.verdict["causes"][0]["cause"])

    def to_json(self) -> str:
        from .report import to_json

        return to_json(self.doc)

    def to_markdown(self) -> str:
        from .report.markdown import render_markdown

        return render_markdown(self.doc)

    def to_html(self) -> str:
        from .report.html import render_html

        return render_html(self.doc)

    @classmethod
    def load(cls, path: str | Path) -> Report:
        """A report written earlier: its `report.json`, or the `evidence.h5` beside it (what
        `ckptforensics report` re-renders). Findings come back as the document's records."""
        from .report.evidence import load_report

        doc = load_report(Path(path))
        return cls(doc, list(doc.get("findings", [])), {"skip": doc["bisect"]["skip"]} if (doc.get("bisect") or {}).get("skip") else {})

    def save(self, out: str | Path) -> list[Path]:
        """report.json, report.md, report.html and evidence.h5 under `out` (plus skip.json
        for a bisect), written together: a failure leaves the previous report as it was.
        Returns the paths written."""
        from .report import to_json, write_report

        extra = {"skip.json": to_json(self.extra["skip"])} if "skip" in self.extra else None
        return write_report(Path(out), self.doc, extra)

    @property
    def plan(self) -> dict[str, Any]:
        """The resume plan (`plan` section; empty for a recovery report)."""
        return dict(self.doc.get("plan") or {})


def resolve(step_or_path: str | int | Path, run_dir: str | Path | None = None) -> Path:
    """A checkpoint path from a step number (resolved in `run_dir`) or a path."""
    from .locate import resolve_checkpoint

    return resolve_checkpoint(str(step_or_path), Path(run_dir) if run_dir is not None else Path("."))


def diff(
    before: str | int | Path,
    after: str | int | Path,
    *,
    run_dir: str | Path | None = None,
    format: str | None = None,
    chunk: int = 1 << 19,
    workers: int = 1,
    progress: Progress | None = None,
    command: str = "ckptforensics.diff",
) -> Report:
    """Diff weights and Adam moments of two checkpoints and score every tensor."""
    from .analysis import run_diff

    got = run_diff(resolve(before, run_dir), resolve(after, run_dir), command=command, fmt=format, chunk=chunk, progress=progress, workers=workers)
    if got is None:
        raise NotRankZero("diff under torchrun: rank 0 returns the report")
    return Report(*got)


def _config(before: Any, after: Any, batch: str | Path | None, run_dir: Any, **opts: Any) -> Any:
    from .replay import ReplayConfig

    metrics = opts.pop("metrics", None)
    data = opts.pop("data", None)
    return ReplayConfig(
        before=resolve(before, run_dir),
        after=resolve(after, run_dir) if after is not None else None,
        batch=str(batch) if batch is not None else None,
        data=str(data) if data is not None else None,
        metrics=Path(metrics) if metrics is not None else None,
        **opts,
    )


def replay(
    before: str | int | Path,
    batch: str | Path | None = None,
    *,
    data: str | Path | None = None,
    collator: str | None = None,
    after: str | int | Path | None = None,
    run_dir: str | Path | None = None,
    model: str | None = None,
    step: int | None = None,
    precision: str = "auto",
    device: str = "cpu",
    clip: float | None = None,
    loss: str | None = None,
    metrics: str | Path | None = None,
    checkpoint_activations: bool = False,
    labels: str | None = None,
    allow_mismatch: bool = False,
    progress: Progress | None = None,
    command: str = "ckptforensics.replay",
) -> Report:
    """Replay the window (before, after] from *before* with probes on every module, merged
    with the pair's diff into one verdict. `batch`: a batch log (.h5), batch file or
    `module:function`, or None with `data` (an HF Trainer run's training data: the batches
    are rebuilt with the Trainer's sampler and `collator`, `module:obj`, or the standard
    collator whose first step lands on the log); `model`: `module:factory` or None (built
    from what the run recorded)."""
    from .analysis import run_replay

    cfg = _config(
        before, after, batch, run_dir, data=data, collator=collator, model=model, step=step, precision=precision, device=device, clip=clip, loss=loss, metrics=metrics,
        checkpoint_activations=checkpoint_activations, labels=labels, allow_mismatch=allow_mismatch,
    )  # fmt: skip
    return Report(*_rank_zero(run_replay(cfg, command=command, progress=progress), "replay"))


def bisect(
    before: str | int | Path,
    after: str | int | Path,
    batch: str | Path | None = None,
    *,
    data: str | Path | None = None,
    collator: str | None = None,
    run_dir: str | Path | None = None,
    model: str | None = None,
    precision: str = "auto",
    device: str = "cpu",
    clip: float | None = None,
    loss: str | None = None,
    metrics: str | Path | None = None,
    checkpoint_activations: bool = False,
    labels: str | None = None,
    allow_mismatch: bool = False,
    tokenizer: str | Path | None = None,
    progress: Progress | None = None,
    command: str = "ckptforensics.bisect",
) -> Report:
    """The first bad step of the window and the rows of its batch that cause it; the
    skip list for the trainer is `report.extra["skip"]`."""
    from .analysis import run_bisect

    cfg = _config(
        before, after, batch, run_dir, data=data, collator=collator, model=model, precision=precision, device=device, clip=clip, loss=loss, metrics=metrics,
        checkpoint_activations=checkpoint_activations, labels=labels, allow_mismatch=allow_mismatch,
    )  # fmt: skip
    doc, findings, skip = _rank_zero(run_bisect(cfg, command=command, progress=progress, tokenizer=Path(tokenizer) if tokenizer else None), "bisect")
    return Report(doc, findings, {"skip": skip})


def whatif(
    before: str | int | Path,
    batch: str | Path | None,
    steps: int,
    tries: Sequence[str],
    *,
    data: str | Path | None = None,
    collator: str | None = None,
    run_dir: str | Path | None = None,
    model: str | None = None,
    precision: str = "auto",
    device: str = "cpu",
    clip: float | None = None,
    loss: str | None = None,
    metrics: str | Path | None = None,
    checkpoint_activations: bool = False,
    labels: str | None = None,
    allow_mismatch: bool = False,
    progress: Progress | None = None,
    command: str = "ckptforensics.whatif",
) -> Report:
    """Replay `steps` steps from *before* under each mitigation (`clip=1.0`,
    `precision=bf16`, `lr_scale=0.5`, `skip_samples=auto`, ...) and recommend the least
    invasive one that keeps the run on track."""
    from .analysis import run_whatif

    cfg = _config(
        before, None, batch, run_dir, data=data, collator=collator, model=model, precision=precision, device=device, clip=clip, loss=loss, metrics=metrics,
        checkpoint_activations=checkpoint_activations, labels=labels, allow_mismatch=allow_mismatch,
    )  # fmt: skip
    return Report(*_rank_zero(run_whatif(cfg, steps, list(tries), None, command=command, progress=progress), "whatif"))


def plan(
    before: str | int | Path,
    after: str | int | Path,
    batch: str | Path | None = None,
    *,
    data: str | Path | None = None,
    collator: str | None = None,
    run_dir: str | Path | None = None,
    model: str | None = None,
    precision: str = "auto",
    device: str = "cpu",
    clip: float | None = None,
    loss: str | None = None,
    metrics: str | Path | None = None,
    checkpoint_activations: bool = False,
    labels: str | None = None,
    allow_mismatch: bool = False,
    tries: Sequence[str] | None = None,
    progress: Progress | None = None,
    command: str = "ckptforensics.plan",
) -> Report:
    """The resume plan for the incident between `before` and `after`: the window is replayed
    (the verdict), then the mitigations its cause calls for (`plan.mitigations`, or `tries`)
    are replayed from the rollback checkpoint (the what-if), and the plan is written in the
    trainer's own terms, each change marked verified by the what-if or not replayed. The
    report holds the replay's verdict, the `whatif` section and the `plan` section; the skip
    list, where there is one, is `report.extra["skip"]` (saved as skip.json)."""
    from .errors import ForensicsError
    from .formats import open_checkpoint
    from .plan import mitigations, plan_section
    from .shard import dist_world

    if dist_world()[1] > 1:
        raise ForensicsError(
            "plan runs in one process (its what-if follows from the replay's verdict); under torchrun run `replay` and "
            "`whatif`, then `ckptforensics plan incident/ whatif/`"
        )
    opts = dict(data=data, collator=collator, run_dir=run_dir, model=model, precision=precision, device=device, clip=clip, loss=loss, metrics=metrics,
                checkpoint_activations=checkpoint_activations, labels=labels, allow_mismatch=allow_mismatch, progress=progress)  # fmt: skip
    rep = replay(before, batch, after=after, command=command, **opts)
    p = rep.plan
    tried = list(tries) if tries else mitigations(rep.doc, ((rep.doc.get("replay") or {}).get("config") or {}).get("clip", {}).get("value"))
    doc, findings = rep.doc, list(rep.findings)
    if p.get("status") == "ready" and tried:
        r = p["rollback"]
        n = int(rep.doc["incident"]["after"]["step"]) - int(r["step"])
        wi = whatif(r["path"], batch, max(n, 1), tried, command=command, **opts)
        from .detectors import Finding

        f = wi.findings[0]
        extra = Finding(f"F{len(findings) + 1}", *[getattr(f, k) for k in Finding.__slots__[1:]])  # type: ignore[attr-defined]
        findings.append(extra)
        doc = {**doc, "whatif": wi.doc["whatif"], "findings": [*doc["findings"], {**wi.doc["findings"][0], "id": extra.id}]}
        with open_checkpoint(doc["incident"]["before"]["path"]) as ck:
            doc["plan"] = _clean_doc(plan_section(doc, ck))
    return Report(doc, findings, _skip_extra(doc))


def _clean_doc(x: Any) -> Any:
    from .report import clean

    return clean(x)


def _skip_extra(doc: dict[str, Any]) -> dict[str, Any]:
    """skip.json for a plan that skips data: steps, sample ids and rows per step."""
    sk = (doc.get("plan") or {}).get("skip")
    return {"skip": {"steps": sk["steps"], "sample_ids": sk["sample_ids"], "rows": sk["rows"]}} if sk else {}


def plan_from(reports: Sequence[str | Path]) -> Report:
    """The resume plan from reports already written (a replay or bisect report, a what-if
    report of the same incident: their `report.json`, `evidence.h5` or directories). The
    *before* checkpoint they name must still be where they say: the run's own settings are
    read from it."""
    from .errors import ForensicsError
    from .formats import open_checkpoint
    from .plan import merge_reports, plan_section
    from .report.evidence import load_report

    docs = []
    for r in reports:
        p = Path(r)
        docs.append(load_report(p / "report.json" if p.is_dir() else p))
    if any(d.get("recovery") for d in docs):
        raise ForensicsError("a recovery report has no incident to plan for: pass the replay, bisect or what-if report")
    doc = merge_reports(docs)
    before = Path(doc["incident"]["before"]["path"])
    if not before.exists():
        raise ForensicsError(f"{before}: the report's before checkpoint is not here; the plan reads the run's settings from it (run `ckptforensics plan --run-dir ...` where the run is)")
    with open_checkpoint(before) as ck:
        doc = {**doc, "plan": _clean_doc(plan_section(doc, ck))}
    return Report(doc, list(doc.get("findings", [])), _skip_extra(doc))


def recovery(
    run_dir: str | Path,
    resumed_from: int,
    *,
    metrics: str | Path | None = None,
    plan: str | Path | dict[str, Any] | None = None,
    flight: str | Path | None = None,
    checkpoint: str | int | Path | None = None,
    window: int | None = None,
    command: str = "ckptforensics.recovery",
) -> Report:
    """Whether the run resumed at step `resumed_from` recovered: its log against the
    pre-incident trajectory (`recovered` at step S, `recovering`, `not recovered`, `relapsed`
    at step S) and the checks that the resume was the plan (`plan`: a plan report, its
    directory, or its `plan` section), in the `recovery` section."""
    from .recovery import recovery as _recovery
    from .recovery import recovery_report
    from .report.evidence import load_report
    from .tensors import CURVE_SHORT

    rd = Path(run_dir)
    section, source = None, None
    if isinstance(plan, dict):
        section = plan.get("plan", plan)
    elif plan is not None:
        pp = Path(plan)
        pp = pp / "report.json" if pp.is_dir() else pp
        section, source = load_report(pp).get("plan") or {}, str(pp)
    ck = resolve(checkpoint, rd) if checkpoint is not None else None
    res = _recovery(rd, int(resumed_from), metrics=Path(metrics) if metrics else None, plan=section, plan_source=source,
                    flight=Path(flight) if flight else None, checkpoint=ck, width=window or CURVE_SHORT)  # fmt: skip
    doc, findings = recovery_report(res, command)
    return Report(doc, findings)


def _rank_zero(got: Any, what: str) -> Any:
    if got is None:
        raise NotRankZero(f"{what} under torchrun: rank 0 returns the report")
    return got


def triage(metrics: str | Path | None = None, run_dir: str | Path | None = None, config: Any = None, keys: dict[str, str] | None = None) -> Any:
    """The first bad step in a training log and the checkpoint to roll back to
    (`triage.TriageResult`); the log is discovered in `run_dir` when not given. `config`:
    a `triage.TriageConfig`; `keys`: the log's column names for loss / grad_norm / lr."""
    from .logs import discover_metrics
    from .triage import triage as _triage

    rd = Path(run_dir) if run_dir is not None else None
    log = Path(metrics) if metrics is not None else discover_metrics(rd or Path("."))
    return _triage(log, rd, config, keys)


def audit(
    step: str | int | Path | None = None,
    *,
    run_dir: str | Path | None = None,
    compare: str | int | Path | None = None,
    model: str | None = None,
    batch: str | Path | None = None,
    metrics: str | Path | None = None,
    device: str = "cpu",
    progress: Progress | None = None,
    command: str = "ckptforensics.audit",
) -> Report:
    """Audit a checkpoint (a step resolved in `run_dir`, a path, or None: the run's latest)
    for known instability risks: `report.doc["architecture"]` (norm placement, QK-norm, ...)
    and `report.doc["audit"]["rows"]` (each check's figure, threshold and source). `compare`:
    an earlier checkpoint for the rows that compare two (default: the one before; "none": skip).

        rep = cf.api.audit(run_dir="runs/x")
        rep.doc["architecture"]["norm_placement"], [r["id"] for r in rep.doc["audit"]["rows"] if r["status"] == "risk"]
    """
    from .audit import AuditConfig, default_checkpoint, run_audit

    rd = Path(run_dir) if run_dir is not None else Path(".")
    path = resolve(step, rd) if step is not None else default_checkpoint(rd)
    cmp: Path | bool | None = None
    if compare is not None:
        cmp = False if str(compare).lower() == "none" else resolve(compare, rd)
    cfg = AuditConfig(
        checkpoint=path,
        compare=cmp,
        run_dir=rd if run_dir is not None else path.parent,
        model=model,
        batch=str(batch) if batch is not None else None,
        metrics=Path(metrics) if metrics is not None else None,
        device=device,
    )
    return Report(*run_audit(cfg, command=command, progress=progress))
