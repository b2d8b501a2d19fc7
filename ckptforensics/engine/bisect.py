"""Bisection: which step of the window goes bad, and which rows of its batch make it so."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptforensics.core.errors import ForensicsError
from ckptforensics.detectors import (
    Finding,
    first_steps_from_state,
    replay_findings,
    step_z,
    trusted,
)
from ckptforensics.engine.replay.records import ReplayResult
from ckptforensics.engine.replay.run import ReplayConfig, replay
from ckptforensics.formats.segments import pad_rows
from ckptforensics.verdict import replay_fields

__all__ = ["BisectResult", "RowCheck", "bisect", "confirm_rows"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BisectResult:
    """What bisection found.

    Attributes:
        first_bad_step: first robust outlier of the replayed window (None: no spike).
        rows: culprit rows of that batch: the minimal set whose removal removes the
            spike, with every row the per-sample evidence flags that carries a share of it.
        minimal_rows: the minimal removal set alone.
        unusual: rows flagged or taken in that carry no share of the spike when removed one
            at a time (`confirm_rows`): unusual, not culprits.
        presence_spikes: the minimal set alone, with healthy filler rows, still spikes.
        sample_ids: dataset ids of `rows` (batch log `/sample_id`), when recorded.
        unusual_ids: dataset ids of `unusual`, likewise.
        replays: forward+backward evaluations spent on sample bisection; budget: 2 k log2(B) + 4.
        disagreements: steps where the replayed loss differs from the training log.
        trials: (rows kept or removed, loss, grad norm, spiked) per evaluation.
    """

    first_bad_step: int | None
    rows: list[int] = field(default_factory=list)
    minimal_rows: list[int] = field(default_factory=list)
    unusual: list[int] = field(default_factory=list)
    unusual_ids: list[int] = field(default_factory=list)
    presence_spikes: bool | None = None
    sample_ids: list[int] = field(default_factory=list)
    replays: int = 0
    budget: int = 0
    disagreements: list[dict[str, float]] = field(default_factory=list)
    trials: list[dict[str, Any]] = field(default_factory=list)
    evidence: dict[int, str] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)  # row -> decoded text (--tokenizer)
    note: str = ""


def _disagreements(rep: ReplayResult) -> list[dict[str, float]]:
    out = []
    for r in rep.records:
        logged = rep.logged.get(r.step, {}).get("loss")
        if (
            logged is not None
            and math.isfinite(r.loss)
            and abs(r.loss - logged) > 1e-3 * max(1.0, abs(logged))
        ):
            out.append({"step": r.step, "replayed_loss": r.loss, "logged_loss": logged})
    return out


def bisect(
    cfg: ReplayConfig,
    progress: Callable[[str], None] | None = None,
    steps: list[int] | None = None,
    tokenizer: Path | None = None,
    state_findings: list[Finding] | None = None,
) -> tuple[BisectResult, ReplayResult]:
    """Replay the window, find its first bad step, then the rows that make it bad.

    Sample bisection runs on the state just before the bad step: a candidate batch keeps
    some rows and replaces the others by rows of the last healthy step (same batch size,
    so the loss averaging is the trainer's). The per-sample gradient shares seed the
    search, so the common case costs a handful of evaluations.
    """
    rep = replay(cfg, progress, steps)
    rfind = replay_findings(rep)
    why = trusted(cfg, rfind)  # a replay that is not the run bisects nothing
    if why is not None:
        return BisectResult(
            first_bad_step=None,
            disagreements=_disagreements(rep),
            note=f"not bisected: {why.message}",
        ), rep
    fields = replay_fields(rfind, first_steps_from_state(state_findings or [], rep))
    res = BisectResult(
        first_bad_step=fields.get("first_bad_step"), disagreements=_disagreements(rep)
    )
    s = res.first_bad_step
    if s is None or s == rep.records[0].step and len(rep.records) == 1 and not rep.baseline:
        return res, rep
    p = rep.plan  # the replay's settled plan: its precision, loss scale and LRs
    clip = rep.config["clip"]["value"]
    sess = p.session()
    try:
        _replay_to(p, sess, s, clip)
        batch = p.batches.batch(s)
        filler_step = max((t for t in p.steps if t < s), default=None)
        if filler_step is None:
            filler_step = next((t for t in (p.batches.steps or []) if t < s), None)
        if filler_step is None:
            res.note = (
                f"no healthy batch before step {s} to fill rows with; sample bisection skipped"
            )
            return res, rep
        filler = p.batches.batch(filler_step)
        if batch["input_ids"].shape[1] != filler["input_ids"].shape[1]:
            if "attention_mask" not in batch or "attention_mask" not in filler:
                res.note = f"the batches of steps {filler_step} and {s} differ in width and carry no attention mask to pad them with; sample bisection skipped"
                return res, rep
            # Dynamic padding (a collator pads each batch to its longest row): the narrower
            # one is padded out (mask 0, label -100), which no loss or attention reads.
            width = max(batch["input_ids"].shape[1], filler["input_ids"].shape[1])
            batch, filler = (
                {k: pad_rows(v, width, k) for k, v in b.items()} for b in (batch, filler)
            )
        base_loss = [v["loss"] for v in rep.baseline.values() if "loss" in v] or [
            r.loss for r in rep.records if r.step < s
        ]
        base_grad = [v["grad_norm"] for v in rep.baseline.values() if "grad_norm" in v] or [
            r.grad_norm for r in rep.records if r.step < s
        ]
        n = batch["input_ids"].shape[0]
        res.budget = int(2 * math.ceil(math.log2(max(n, 2))) + 4)  # k = 1 until culprits are known

        def spikes(keep: set[int], label: str, need: float = 3.0) -> bool:
            """Whether these rows (healthy filler elsewhere) still make an excursion. The
            whole batch must spike (z > 6, the onset rule); a subset carries the spike where
            it stands at half that, the level at which the onset rule counts the loss's
            answer to a grad spike (`tensors.loss_follows`): a part of the spike is still
            the spike, and at 6 a row whose share is a third of it reads as innocent."""
            if progress is not None:
                progress(f"bisecting step {s}: trial {res.replays + 1} of ~{res.budget}, {label}")
            loss, grad = sess.evaluate(_mixed(batch, filler, keep))
            res.replays += 1
            z = max(float(step_z([loss], base_loss)[0]), float(step_z([grad], base_grad)[0]))
            hit = not math.isfinite(z) or z > need
            res.trials.append(
                {
                    "rows": sorted(keep),
                    "label": label,
                    "loss": loss,
                    "grad_norm": grad,
                    "robust_z": z,
                    "spiked": hit,
                }
            )
            return hit

        everything = set(range(n))
        if not spikes(everything, "whole batch", need=6.0):
            res.note = (
                f"the batch of step {s} does not spike on its own from the replayed state: "
                "the step went bad through the update (LR, optimizer state), not through its data"
            )
            log.info(res.note)
            return res, rep
        if spikes(set(), f"only rows of step {filler_step}"):
            res.note = (
                f"rows of the healthy step {filler_step} spike too from the state before step {s}: "
                "the update went bad (LR, optimizer state), not the data; no row is to blame"
            )
            log.info(res.note)
            return res, rep
        rec = next(r for r in rep.records if r.step == s)
        order = _by_share(rec)
        flagged = {x["index"] for x in fields.get("anomalous_samples", [])}
        res.evidence = {x["index"]: x["why"] for x in fields.get("anomalous_samples", [])}
        culprits = set(flagged) or {order[0]}
        # 1) grow until removing the culprits removes the spike (largest shares first)
        for r in order:
            if not spikes(everything - culprits, f"without {sorted(culprits)}"):
                break
            culprits.add(r)
        # 2) shrink: a row whose removal is not needed goes back (smallest share first)
        for r in sorted(culprits, key=order.index, reverse=True):
            trial = culprits - {r}
            if trial and not spikes(everything - trial, f"without {sorted(trial)}"):
                culprits = trial
        if culprits >= everything:
            res.note = f"no subset of the rows of step {s} carries its spike: every row spikes, so the state did, not the data"
            log.info(res.note)
            return res, rep
        res.minimal_rows = sorted(culprits)
        res.presence_spikes = spikes(culprits, f"only {sorted(culprits)}")
        res.rows = sorted(culprits | flagged)
        res.unusual = []
        k = max(1, len(res.rows))
        res.budget = int(2 * k * math.ceil(math.log2(max(n, 2))) + 4)
        ids = p.batches.sample_ids.get(s)
        res.sample_ids = [ids[i] for i in res.rows] if ids else []
        if tokenizer is not None:
            res.texts = decode_rows(tokenizer, batch["input_ids"], res.rows)
    finally:
        sess.close()
    if len(res.rows) > 1:
        # A row is a culprit only where removing it changes the spike (`confirm_rows`): the
        # flagged rows the minimal set did not need, and any the search took in on its way,
        # are listed apart as unusual when they carry no share of it (issue #42).
        check = confirm_rows(rep, s, res.rows, progress)
        if check is not None and check.removes_spike and check.culprits:
            res.unusual = check.unusual
            res.rows = check.culprits
            ids = p.batches.sample_ids.get(s)
            res.sample_ids = [ids[i] for i in res.rows] if ids else []
            res.unusual_ids = [ids[i] for i in res.unusual] if ids else []
            res.texts = {i: t for i, t in res.texts.items() if i in res.rows}
    return res, rep


def _replay_to(p: Any, sess: Any, step: int, clip: float | None) -> None:
    """The plan's steps before `step`, replayed in `sess` as the replay ran them (a variant's
    fresh optimizer included)."""
    for t in p.steps:
        if t >= step:
            break
        if t == p.fresh_from:
            sess.reset_optimizer()
        sess.step(t, p.batches.batch(t), p.lrs[t], clip)


def _mixed(
    batch: dict[str, torch.Tensor], filler: dict[str, torch.Tensor], keep: set[int]
) -> dict[str, torch.Tensor]:
    """The batch with the rows not in `keep` replaced by the filler batch's (its size kept)."""
    n = batch["input_ids"].shape[0]
    return {
        k: torch.where(_rows_mask(n, keep, v), v, filler[k][:n])
        for k, v in batch.items()
        if k in filler
    }


def _rows_mask(n: int, keep: set[int], v: torch.Tensor) -> torch.Tensor:
    m = torch.zeros(n, dtype=torch.bool)
    m[sorted(keep)] = True
    return m.view(n, *([1] * (v.dim() - 1)))


def _by_share(rec: Any) -> list[int]:
    """Rows by their share of the gradient norm^2 (then loss), largest first."""
    n = len(rec.sample_loss)
    sq = rec.sample_grad_sq if rec.sample_grad_sq is not None else [0.0] * n
    return sorted(
        range(n),
        key=lambda i: (-(sq[i] if math.isfinite(sq[i]) else math.inf), -rec.sample_loss[i]),
    )


def decode_rows(
    tokenizer: Path, input_ids: torch.Tensor, rows: list[int], max_tokens: int = 256
) -> dict[int, str]:
    """The culprit rows as text, with an HF tokenizer directory (the `hf` extra).

    Loaded with `local_files_only` and without remote code: a tokenizer directory is
    data (tokenizer.json, vocab files), never code to run.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ForensicsError("--tokenizer needs the hf extra (transformers)") from None
    try:
        tok = AutoTokenizer.from_pretrained(
            str(tokenizer), local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # noqa: BLE001 - any failure to load is bad input, said in one line
        raise ForensicsError(
            f"{tokenizer}: not a loadable tokenizer directory ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        ) from None
    return {r: tok.decode(input_ids[r][:max_tokens].tolist()) for r in rows}


@dataclass(frozen=True, slots=True)
class RowCheck:
    """Rows flagged in a spiking batch, put to the test: the minimal subset whose removal
    removes the spike (`culprits`, empty where removing every flagged row leaves it), the
    others (`unusual`), and each trial (rows removed, loss, grad norm, robust z, spiked)."""

    step: int
    culprits: list[int]
    unusual: list[int]
    removes_spike: bool
    trials: list[dict[str, Any]]


def confirm_rows(
    rep: ReplayResult, step: int, rows: list[int], progress: Callable[[str], None] | None = None
) -> RowCheck | None:
    """Whether the flagged `rows` of step `step` carry its spike: from the replay's state just
    before it (its settled plan replayed up to there), the batch with the rows replaced by
    rows of the last step before it (same batch size: the trainer's averaging) is evaluated;
    where that removes the spike, each row is removed alone: a culprit takes at least half
    its equal share of what removing them all takes off the step (a row is a culprit only
    when removing it changes the spike, issue #42); the others are unusual. None where there
    is no filler step or the batches' widths differ."""
    p = rep.plan
    if p is None or step not in p.steps or not rows:
        return None
    filler_step = max((t for t in p.steps if t < step), default=None)
    if filler_step is None:
        return None
    batch, filler = p.batches.batch(step), p.batches.batch(filler_step)
    if batch["input_ids"].shape != filler["input_ids"].shape:
        return None
    base_loss = [v["loss"] for v in rep.baseline.values() if "loss" in v]
    base_grad = [v["grad_norm"] for v in rep.baseline.values() if "grad_norm" in v]
    if len(base_loss) < 5:
        return None
    n = batch["input_ids"].shape[0]
    clip = rep.config["clip"]["value"]
    trials: list[dict[str, Any]] = []
    sess = p.session()
    try:
        _replay_to(p, sess, step, clip)

        def without(out: set[int]) -> tuple[float, float, bool]:
            keep = set(range(n)) - out
            if progress is not None:
                progress(f"rows of step {step}: trial {len(trials) + 1}, without {sorted(out)}")
            loss, grad = sess.evaluate(_mixed(batch, filler, keep))
            zs = [float(step_z([loss], base_loss)[0])]
            if base_grad:
                zs.append(float(step_z([grad], base_grad)[0]))
            z = max(zs)
            hit = not math.isfinite(z) or z > 3.0  # bisect's: half the onset rule's 6
            trials.append(
                {
                    "without": sorted(out),
                    "loss": loss,
                    "grad_norm": grad,
                    "robust_z": z,
                    "spiked": hit,
                }
            )
            return loss, grad, hit

        full = without(set())
        none = without(set(rows))
        if none[2]:
            return RowCheck(step, [], sorted(rows), False, trials)
        # What removing every flagged row takes off the step's loss and grad norm, and each
        # row's part of it in either: a culprit carries at least half of an equal share (a
        # poisoned row of k carries about 1/k of the loss's or of the gradient's excess; a
        # clean row the evidence flagged for its loss alone, a few percent of both).
        totals = [full[i] - none[i] for i in (0, 1)]
        if not any(math.isfinite(x) and x > 0 for x in totals):
            return RowCheck(step, sorted(rows), [], True, trials)
        out = set()
        for r in rows:
            alone = without({r}) if len(rows) > 1 else none
            parts = [
                (full[i] - alone[i]) / totals[i]
                for i in (0, 1)
                if math.isfinite(totals[i]) and totals[i] > 0
            ]
            if any(not math.isfinite(x) or x >= 0.5 / len(rows) for x in parts):
                out.add(r)
    finally:
        sess.close()
    return RowCheck(step, sorted(out), sorted(set(rows) - out), True, trials)
