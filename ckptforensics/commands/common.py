"""What every command shares: its result (`Report`), a step or path resolved to a checkpoint,
the replay's configuration from the façade's arguments, and the few helpers of assembly."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptforensics.checkpoints import open_checkpoint, resolve_checkpoint
from ckptforensics.core.errors import ForensicsError
from ckptforensics.core.options import ReplayOptions
from ckptforensics.detectors import Finding
from ckptforensics.engine.diff.shard import (
    compute_device,
)
from ckptforensics.engine.replay.run import ReplayConfig
from ckptforensics.formats.locate import STEP_PATTERNS
from ckptforensics.logs import skipped_lines, unreadable
from ckptforensics.report import (
    check_outside,
    report_inputs,
    to_json,
    write_files,
    write_report,
)
from ckptforensics.report.evidence import load_report
from ckptforensics.report.html import render_html
from ckptforensics.report.inspect import render_inspect_html, render_inspect_text
from ckptforensics.report.markdown import render_markdown
from ckptforensics.report.timeline import render_triage_html, render_triage_markdown

Progress = Callable[[str], None]


class NotRankZero(Exception):
    """Raised on torchrun ranks other than 0, where a distributed diff, replay, bisect or
    whatif leaves no report (rank 0 returns it)."""


TRIAGE_SCHEMA = "ckptforensics.engine.triage/1"


@dataclass
class Report:
    """One command's result: its document and the findings behind it.

    Three kinds of document, told apart by `doc["schema"]`: an incident report
    (`ckptforensics.report/1`: diff, replay, bisect, whatif, plan, recovery, audit), a
    triage of a training log (`ckptforensics.engine.triage/1`) and one checkpoint's summary
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

        return to_json(self.doc)

    def to_markdown(self) -> str:
        if self.kind == "triage":
            return render_triage_markdown(self.doc)
        if self.kind == "inspect":
            return render_inspect_text(self.doc, show_all=True)

        return render_markdown(self.doc)

    def to_html(self) -> str:
        if self.kind == "triage":
            return render_triage_html(self.doc)
        if self.kind == "inspect":
            return render_inspect_html(self.doc)

        return render_html(self.doc)

    @classmethod
    def load(cls, path: str | Path) -> Report:
        """A report written earlier: its `report.json`, or the `evidence.h5` beside it (what
        `ckptforensics report` re-renders). Findings come back as the document's records."""

        doc = load_report(Path(path))
        return cls(
            doc,
            list(doc.get("findings", [])),
            {"skip": doc["bisect"]["skip"]} if (doc.get("bisect") or {}).get("skip") else {},
        )

    def save(self, out: str | Path) -> list[Path]:
        """The report's files under `out`, written together (a failure leaves the previous
        report as it was), never inside a checkpoint the report read: report.json, .md,
        .html and evidence.h5 (plus skip.json for a bisect; a triage's report.json has its own
        schema and no evidence.h5); inspect.json and .md for an inspect. Returns the paths written."""

        o = Path(out)
        check_outside(o, report_inputs(self.doc))
        if self.kind == "triage":
            return write_files(
                {
                    o / "report.json": to_json(self.doc),
                    o / "report.md": self.to_markdown(),
                    o / "report.html": self.to_html(),
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

    return resolve_checkpoint(
        str(step_or_path), Path(run_dir) if run_dir is not None else Path(".")
    )


def window(
    before: str | int | Path, after: str | int | Path, run_dir: str | Path | None = None
) -> tuple[Path, Path]:
    """The window's two checkpoints (`resolve`), refused when it is reversed or empty
    (`check_window`): every command that takes --before and --after asks here first."""

    pa, pb = resolve(before, run_dir), resolve(after, run_dir)
    check_window(pa, pb)
    return pa, pb


def check_window(before: Path, after: Path) -> None:
    """Refuse a window (before, after] with no step in it: *after* the same checkpoint as
    *before*, or of the same step (empty), or of an earlier one (reversed). Steps as the
    names say (`step_30.pt`, `checkpoint-30`), else as the checkpoints record them; a pair
    whose steps neither says is let through (a diff of two arbitrary files).

    Raises:
        ForensicsError: one line naming both ends, their steps and the fix.
    """
    if os.path.realpath(before) == os.path.realpath(after):
        raise ForensicsError(
            f"--before and --after are the same checkpoint ({before}): the window is empty; "
            "pass an --after later than --before"
        )
    sa, sb = step_of(before), step_of(after)
    if sa is None or sb is None:
        return
    if sb == sa:
        raise ForensicsError(
            f"--before {before} and --after {after} are both step {sa}: the window is empty; "
            "pass an --after later than --before"
        )
    if sb < sa:
        raise ForensicsError(
            f"--after {after} (step {sb}) comes before --before {before} (step {sa}): the window "
            "is reversed; pass the earlier checkpoint as --before"
        )


def step_of(path: Path) -> int | None:
    """A checkpoint's step: from its name where a trainer's pattern gives it, else as the
    checkpoint records it; None when neither says (or it cannot be opened: the command
    that reads it says why)."""
    for _, pattern in STEP_PATTERNS:
        m = pattern.match(path.name)
        if m:
            return int(m.group(1))
    try:
        with open_checkpoint(path) as ck:
            return ck.step
    except ForensicsError:
        return None


def replay_config(
    before: Any,
    after: Any,
    batch: str | Path | None,
    run_dir: Any,
    options: ReplayOptions,
    step: int | None = None,
) -> Any:

    compute_device(options.device)  # a GPU torch cannot see: bad input, before any reading
    pa, pb = (
        window(before, after, run_dir) if after is not None else (resolve(before, run_dir), None)
    )
    return ReplayConfig(
        before=pa,
        after=pb,
        batch=str(batch) if batch is not None else None,
        step=step,
        **options.as_kwargs(),
    )


def note_unread_log(rep: Any) -> None:
    """What a replay made of its training log, in its configuration (`replay.config.metrics`):
    a log that cannot be read, replayed without (`logs.read_metrics`; the log is optional to
    a replay, triage needs it), and why; the lines of a log it read that were skipped."""
    m = rep.config.get("metrics") or {}
    if not m.get("value"):
        return
    if not rep.logged and not rep.baseline and (why := unreadable(m["value"])) is not None:
        m["source"] = f"{m.get('source')}; cannot be read ({why}): replayed without it"
        return
    skipped = skipped_lines(m["value"])
    if skipped:
        m["source"] = f"{m.get('source')}; {'; '.join(skipped)}, the rest read"


def rank_zero(got: Any, what: str) -> Any:
    if got is None:
        raise NotRankZero(f"{what} under torchrun: rank 0 returns the report")
    return got


def number_findings(findings: list[Finding]) -> list[Finding]:
    return [
        Finding(f"F{i}", *[getattr(f, k) for k in Finding.__slots__[1:]])
        for i, f in enumerate(findings, 1)
    ]  # type: ignore[attr-defined]


def close_all(*cks: Any) -> None:
    for i, c in enumerate(cks):
        if all(c is not d for d in cks[:i]):  # a and b are one object without *after*
            c.close()


def window_text(what: str, cfg: Any) -> str:
    """'replaying ckpt-45 to ckpt-50' (what a fault's one line says was being done)."""
    return f"{what} {cfg.before}" + (f" to {cfg.after}" if cfg.after is not None else "")
