"""The library API: what every command does, callable from a notebook.

The CLI is these functions plus argument parsing and printing. Each returns a `Report`
(the report document, its findings, and renderings); checkpoints it opens are closed
before it returns.

    import ckptforensics as cf   # the commands are the package's functions too
    rep = cf.replay("runs/x/step_30.pt", "runs/x/step_40.pt", batch="runs/x/batches.h5")
    rep.cause, rep.verdict["first_bad_step"]
    print(rep.to_markdown())

Over 400 lines: one function per command, the surface `import ckptforensics` exposes, kept
in one file so it reads as the table of contents; the work is in `analysis`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptforensics.core.options import ReplayOptions, replay_options

__all__ = [
    "ReplayOptions",
    "Report",
    "inspect",
    "diff",
    "replay",
    "bisect",
    "whatif",
    "plan",
    "plan_from",
    "recovery",
    "triage",
    "audit",
    "resolve",
    "NotRankZero",
]

Progress = Callable[[str], None]


class NotRankZero(Exception):
    """Raised on torchrun ranks other than 0, where a distributed diff, replay, bisect or
    whatif leaves no report (rank 0 returns it)."""


TRIAGE_SCHEMA = "ckptforensics.commands.triage/1"


@dataclass
class Report:
    """One command's result: its document and the findings behind it.

    Three kinds of document, told apart by `doc["schema"]`: an incident report
    (`ckptforensics.report/1`: diff, replay, bisect, whatif, plan, recovery, audit), a
    triage of a training log (`ckptforensics.commands.triage/1`) and one checkpoint's summary
    (`ckptforensics.inspect/1`). Each renders to Markdown, HTML and JSON and saves the same
    way. `extra` holds what a command adds beside the document (bisect's skip list);
    `result` the command's own record where it has one (triage's `TriageResult`, inspect's
    `CheckpointSummary`)."""

    doc: dict[str, Any]
    findings: list[Any] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    result: Any = None

    @property
    def kind(self) -> str:
        """'incident', 'triage' or 'inspect'."""
        schema = str(self.doc.get("schema", ""))
        return {TRIAGE_SCHEMA: "triage", "ckptforensics.inspect/1": "inspect"}.get(
            schema, "incident"
        )

    @property
    def verdict(self) -> dict[str, Any]:
        if self.kind != "incident":
            raise AttributeError(
                f"a {self.kind} report has no verdict (its document is {self.doc.get('schema')})"
            )
        return self.doc["verdict"]

    @property
    def cause(self) -> str:
        """The verdict's first cause ('none' for a healthy pair)."""
        return str(self.verdict["causes"][0]["cause"])

    @property
    def first_bad_step(self) -> int | None:
        """The first bad step: the verdict's, or the log's onset for a triage."""
        if self.kind == "triage":
            return self.doc.get("first_bad_step")
        return self.verdict.get("first_bad_step")

    @property
    def rollback(self) -> str | None:
        """The checkpoint to roll back to: the verdict's last safe one, or triage's."""
        if self.kind == "triage":
            return self.doc.get("rollback")
        return self.verdict.get("rollback_checkpoint")

    def to_json(self) -> str:
        from ckptforensics.report import to_json

        return to_json(self.doc)

    def to_markdown(self) -> str:
        if self.kind == "triage":
            from ckptforensics.report.timeline import render_triage_markdown

            return render_triage_markdown(self.doc)
        if self.kind == "inspect":
            from ckptforensics.report.inspect import render_inspect_text

            return render_inspect_text(self.doc, show_all=True)
        from ckptforensics.report.markdown import render_markdown

        return render_markdown(self.doc)

    def to_html(self) -> str:
        if self.kind == "triage":
            from ckptforensics.report.timeline import render_triage_html

            return render_triage_html(self.doc)
        if self.kind == "inspect":
            from ckptforensics.report.inspect import render_inspect_html

            return render_inspect_html(self.doc)
        from ckptforensics.report.html import render_html

        return render_html(self.doc)

    @classmethod
    def load(cls, path: str | Path) -> Report:
        """A report written earlier: its `report.json`, or the `evidence.h5` beside it (what
        `ckptforensics report` re-renders). Findings come back as the document's records."""
        from ckptforensics.report.evidence import load_report

        doc = load_report(Path(path))
        return cls(
            doc,
            list(doc.get("findings", [])),
            {"skip": doc["bisect"]["skip"]} if (doc.get("bisect") or {}).get("skip") else {},
        )

    def save(self, out: str | Path) -> list[Path]:
        """The report's files under `out`, written together (a failure leaves the previous
        report as it was), never inside a checkpoint the report read: report.json, .md,
        .html and evidence.h5 (plus skip.json for a bisect); triage.json, .md, .html for a
        triage; inspect.json and .md for an inspect. Returns the paths written."""
        from ckptforensics.report import (
            check_outside,
            report_inputs,
            to_json,
            write_files,
            write_report,
        )

        o = Path(out)
        check_outside(o, report_inputs(self.doc))
        if self.kind == "triage":
            return write_files(
                {
                    o / "triage.json": to_json(self.doc),
                    o / "triage.md": self.to_markdown(),
                    o / "triage.html": self.to_html(),
                }
            )
        if self.kind == "inspect":
            return write_files(
                {o / "inspect.json": to_json(self.doc), o / "inspect.md": self.to_markdown()}
            )
        extra = {"skip.json": to_json(self.extra["skip"])} if "skip" in self.extra else None
        return write_report(o, self.doc, extra)

    @property
    def plan(self) -> dict[str, Any]:
        """The resume plan (`plan` section; empty for a recovery report)."""
        return dict(self.doc.get("plan") or {})


def resolve(step_or_path: str | int | Path, run_dir: str | Path | None = None) -> Path:
    """A checkpoint path from a step number (resolved in `run_dir`) or a path."""
    from ckptforensics.formats.locate import resolve_checkpoint

    return resolve_checkpoint(
        str(step_or_path), Path(run_dir) if run_dir is not None else Path(".")
    )


def diff(
    before: str | int | Path,
    after: str | int | Path,
    *,
    run_dir: str | Path | None = None,
    format: str | None = None,
    chunk: int = 1 << 19,
    workers: int | None = None,
    progress: Progress | None = None,
    command: str = "ckptforensics.engine.diff.pair",
    device: str = "cpu",
) -> Report:
    """Diff weights and Adam moments of two checkpoints and score every tensor (`workers`
    processes; None: one per core, at most 8, for pairs of 512 MiB and more, else one: the
    report does not depend on it). `device` 'cuda': the statistics on this process's GPU,
    each chunk read on the host and staged through a pinned buffer (one process feeds it;
    under torchrun, each rank its LOCAL_RANK's GPU)."""
    from ckptforensics.commands.analysis import run_diff
    from ckptforensics.engine.diff.shard import checkpoint_bytes, compute_device, default_workers

    dev = compute_device(device)
    pa, pb = resolve(before, run_dir), resolve(after, run_dir)
    n = (
        1
        if dev != "cpu"
        else workers or default_workers(checkpoint_bytes(pa) + checkpoint_bytes(pb))
    )
    got = run_diff(
        pa, pb, command=command, fmt=format, chunk=chunk, progress=progress, workers=n, device=dev
    )
    if got is None:
        raise NotRankZero("diff under torchrun: rank 0 returns the report")
    return Report(*got)


def _config(
    before: Any,
    after: Any,
    batch: str | Path | None,
    run_dir: Any,
    options: ReplayOptions,
    step: int | None = None,
) -> Any:
    from ckptforensics.engine.diff.shard import compute_device
    from ckptforensics.engine.replay import ReplayConfig

    compute_device(options.device)  # a GPU torch cannot see: bad input, before any reading
    return ReplayConfig(
        before=resolve(before, run_dir),
        after=resolve(after, run_dir) if after is not None else None,
        batch=str(batch) if batch is not None else None,
        step=step,
        **options.as_kwargs(),
    )


def replay(
    before: str | int | Path,
    after: str | int | Path | None = None,
    *,
    batch: str | Path | None = None,
    step: int | None = None,
    run_dir: str | Path | None = None,
    options: ReplayOptions | None = None,
    progress: Progress | None = None,
    command: str = "ckptforensics.engine.replay",
    **option: Any,
) -> Report:
    """Replay the window (before, after] from *before* with probes on every module, merged
    with the pair's diff into one verdict (`after` None: the one step `step`, default
    before + 1). `batch`: a batch log (.h5), batch file or `module:function`, or None with
    the option `data` (the run's training data, its batches rebuilt). The options are an
    `options.ReplayOptions` or its fields by name (`model=`, `precision=`, `clip=`, ...)."""
    from ckptforensics.commands.analysis import run_replay

    cfg = _config(before, after, batch, run_dir, replay_options(options, **option), step)
    return Report(*_rank_zero(run_replay(cfg, command=command, progress=progress), "replay"))


def bisect(
    before: str | int | Path,
    after: str | int | Path,
    *,
    batch: str | Path | None = None,
    tokenizer: str | Path | None = None,
    run_dir: str | Path | None = None,
    options: ReplayOptions | None = None,
    progress: Progress | None = None,
    command: str = "ckptforensics.engine.bisect",
    **option: Any,
) -> Report:
    """The first bad step of the window and the rows of its batch that cause it; the
    skip list for the trainer is `report.extra["skip"]`. Options as for `replay`."""
    from ckptforensics.commands.analysis import run_bisect

    cfg = _config(before, after, batch, run_dir, replay_options(options, **option))
    doc, findings, skip = _rank_zero(
        run_bisect(
            cfg,
            command=command,
            progress=progress,
            tokenizer=Path(tokenizer) if tokenizer else None,
        ),
        "bisect",
    )
    return Report(doc, findings, {"skip": skip})


def whatif(
    before: str | int | Path,
    *,
    steps: int,
    tries: Sequence[str],
    batch: str | Path | None = None,
    run_dir: str | Path | None = None,
    options: ReplayOptions | None = None,
    progress: Progress | None = None,
    command: str = "ckptforensics.engine.whatif",
    **option: Any,
) -> Report:
    """Replay `steps` steps from *before* under each mitigation (`clip=1.0`,
    `precision=bf16`, `lr_scale=0.5`, `skip_samples=auto`, ...) and recommend the least
    invasive one that keeps the run on track. Options as for `replay`."""
    from ckptforensics.commands.analysis import run_whatif

    cfg = _config(before, None, batch, run_dir, replay_options(options, **option))
    return Report(
        *_rank_zero(
            run_whatif(cfg, steps, list(tries), None, command=command, progress=progress), "whatif"
        )
    )


def plan(
    before: str | int | Path,
    after: str | int | Path,
    *,
    batch: str | Path | None = None,
    tries: Sequence[str] | None = None,
    run_dir: str | Path | None = None,
    options: ReplayOptions | None = None,
    progress: Progress | None = None,
    command: str = "ckptforensics.commands.plan",
    **option: Any,
) -> Report:
    """The resume plan for the incident between `before` and `after`: the window is replayed
    (the verdict), then the mitigations its cause calls for (`plan.mitigations`, or `tries`)
    are replayed from the rollback checkpoint (the what-if), and the plan is written in the
    trainer's own terms, each change marked verified by the what-if or not replayed. The
    report holds the replay's verdict, the `whatif` section and the `plan` section; the skip
    list, where there is one, is `report.extra["skip"]` (saved as skip.json). Options as
    for `replay`."""
    from ckptforensics.commands.plan import mitigations, plan_section
    from ckptforensics.core.errors import ForensicsError
    from ckptforensics.engine.diff.shard import dist_world
    from ckptforensics.formats import open_checkpoint

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
        wi = whatif(
            r["path"],
            steps=max(n, 1),
            tries=tried,
            batch=batch,
            run_dir=run_dir,
            options=opts,
            progress=progress,
            command=command,
        )
        from ckptforensics.detectors import Finding

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


def _clean_doc(x: Any) -> Any:
    from ckptforensics.report import clean

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
    from ckptforensics.commands.plan import merge_reports, plan_section
    from ckptforensics.core.errors import ForensicsError
    from ckptforensics.formats import open_checkpoint
    from ckptforensics.report.evidence import load_report

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


def recovery(
    run_dir: str | Path,
    resumed_from: int,
    *,
    metrics: str | Path | None = None,
    plan: str | Path | dict[str, Any] | None = None,
    flight: str | Path | None = None,
    checkpoint: str | int | Path | None = None,
    window: int | None = None,
    command: str = "ckptforensics.engine.recovery",
) -> Report:
    """Whether the run resumed at step `resumed_from` recovered: its log against the
    pre-incident trajectory (`recovered` at step S, `recovering`, `not recovered`, `relapsed`
    at step S) and the checks that the resume was the plan (`plan`: a plan report, its
    directory, or its `plan` section), in the `recovery` section."""
    from ckptforensics.core.tensors import CURVE_SHORT
    from ckptforensics.engine.recovery import recovery as _recovery
    from ckptforensics.engine.recovery import recovery_report
    from ckptforensics.report.evidence import load_report

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


def triage(
    metrics: str | Path | None = None,
    *,
    run_dir: str | Path | None = None,
    config: Any = None,
    keys: dict[str, str] | None = None,
) -> Report:
    """The first bad step in a training log and the checkpoint to roll back to; the log is
    discovered in `run_dir` when not given. `config`: a `triage.TriageConfig`; `keys`: the
    log's column names for loss / grad_norm / lr. The report's `result` is the
    `triage.TriageResult`; `first_bad_step` and `rollback` read it."""
    from ckptforensics.commands.triage import as_dict
    from ckptforensics.commands.triage import triage as _triage
    from ckptforensics.logs import discover_metrics
    from ckptforensics.report import clean

    rd = Path(run_dir) if run_dir is not None else None
    log = Path(metrics) if metrics is not None else discover_metrics(rd or Path("."))
    res = _triage(log, rd, config, keys)
    return Report({"schema": TRIAGE_SCHEMA, **clean(as_dict(res))}, result=res)


def inspect(
    checkpoint: str | int | Path,
    *,
    run_dir: str | Path | None = None,
    format: str | None = None,
    progress: Progress | None = None,
) -> Report:
    """One checkpoint summarised: complete or not (its format's rule for a whole save;
    an incomplete one raises, naming what is missing), format, step, sizes, optimizer,
    loss scale, and each tensor's non-finite count and dtype headroom. The report's
    `result` is the `summary.CheckpointSummary`."""
    from ckptforensics.engine.summary import summarize
    from ckptforensics.formats import open_checkpoint, require_complete
    from ckptforensics.report.inspect import inspect_doc

    path = resolve(checkpoint, run_dir)
    whole = require_complete(path, format)
    with open_checkpoint(path, format, check=False) as ck:
        s = summarize(ck, progress=progress)
    return Report(inspect_doc(s, whole), result=s)


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
    command: str = "ckptforensics.commands.audit",
) -> Report:
    """Audit a checkpoint (a step resolved in `run_dir`, a path, or None: the run's latest)
    for known instability risks: `report.doc["architecture"]` (norm placement, QK-norm, ...)
    and `report.doc["audit"]["rows"]` (each check's figure, threshold and source). `compare`:
    an earlier checkpoint for the rows that compare two (default: the one before; "none": skip).

        rep = cf.api.audit(run_dir="runs/x")
        rep.doc["architecture"]["norm_placement"], [r["id"] for r in rep.doc["audit"]["rows"] if r["status"] == "risk"]
    """
    from ckptforensics.commands.audit import AuditConfig, default_checkpoint, run_audit
    from ckptforensics.engine.diff.shard import compute_device

    compute_device(device)  # a GPU torch cannot see: bad input, before any reading
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
