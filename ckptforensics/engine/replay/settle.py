"""What the plan cannot read from the run's files, calibrated against its log and *after*:
the precision, a per-group LR change inside the window, the clip norm; and the likeliest
reason a replay misses the log."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ckptforensics.core.errors import ForensicsError
from ckptforensics.core.tensors import LR_GROWTH_MARGIN
from ckptforensics.engine.replay import distributed
from ckptforensics.engine.replay import precision as mp
from ckptforensics.engine.replay.compare import MATCH_SHARE, compare_after
from ckptforensics.engine.replay.logcheck import (
    GRAD_RTOL,
    LOSS_RTOL,
    LogCheck,
    StepCheck,
    check_against_log,
    log_rounding,
)
from ckptforensics.engine.replay.model import (
    LossNorm,
    build_model,
    set_padding_rows,
    tied_padding_rows,
)
from ckptforensics.engine.replay.scalecal import settle_loss_scale
from ckptforensics.engine.replay.window import Plan, run_window
from ckptforensics.formats.base import Checkpoint

__all__ = [
    "settle",
    "settle_precision",
    "settle_clip",
    "diagnose_miss",
    "ratio_change",
    "log_score",
]

log = logging.getLogger(__name__)


def settle(p: Plan, progress: Callable[[str], None] | None = None) -> None:
    """What the plan cannot read from the run's files, calibrated: a per-group LR change the
    log does not show, the precision where the run states none (the first step against the
    log), the fp16 loss scale where the run recorded none."""
    settle_padding(p)
    _settle_ratio_change(p, progress)
    settle_precision(p)
    settle_loss_scale(p, progress)


def settle_padding(p: Plan) -> None:
    """Whether the run zeroed the padding row of a tied embedding's lookup, from its log: the
    head's gradient trains that row either way, so the moments cannot tell (held-out draw
    9545: a tied Llama built with pad id 0, whose Trainer config names 0 too), and a config
    the Trainer rewrote may name another row than the one the model was built with. Matters
    only where the first batch feeds that token id; the first step's logged grad norm
    decides (the loss is the same either way). Without one, the row config.json names stays,
    said so."""
    if distributed.current() is not None:
        return  # the replay of a sharded embedding keeps config.json's row
    first = p.steps[0]
    batch = p.batches.batch(first)
    try:  # the model's ties and padding rows: no weights read, no memory for them
        with distributed.params_on_meta():
            rows = tied_padding_rows(build_model(p.cfg.model, p.a)[0])
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        rows = tied_padding_rows(build_model(p.cfg.model, p.a)[0])  # a model meta cannot build
    ids = batch["input_ids"]
    fed = {n: r for n, r in rows.items() if bool((ids == r).any())}
    if not fed:
        return
    logged = (p.logged.get(first) or {}).get("grad_norm")
    shown = ", ".join(f"{n} {r}" for n, r in fed.items())
    if logged is None or not math.isfinite(logged) or logged <= 0:
        p.padding_source = f"; padding row of the tied {shown} as config.json names it (the log has no grad norm at step {first} to tell whether the run zeroed it)"
        return
    session = p.session()
    try:
        kept = session.evaluate(batch)[1]
        set_padding_rows(session.model, {n: None for n in fed})
        dropped = session.evaluate(batch)[1]
    finally:
        session.close()
    off = {"zeroed": abs(kept - logged) / logged, "trained": abs(dropped - logged) / logged}
    choice = min(off, key=lambda k: off[k])
    if choice == "trained":
        p.padding = {n: None for n in fed}
    p.padding_source = (
        f"; padding row of the tied {shown}: {choice} by the run (calibrated on step {first}'s "
        f"grad norm: {kept:.6g} zeroed, {dropped:.6g} trained, logged {logged:.6g})"
    )


def settle_precision(p: Plan) -> None:
    """Where the run states no precision (fp32 weights: fp32, bf16 parameters on fp32 masters
    and bf16 autocast all keep them), the candidate whose first replayed step lands on the
    logged loss and grad norm (`precision.candidates`, likeliest first). Without a logged
    first step the likeliest stands, said so."""
    cands = [c for c in mp.candidates(p.a, p.cfg.precision) if c[0] != "fp16"]
    if len(cands) < 2:
        return
    first = p.steps[0]
    row = p.logged.get(first) or {}
    if "loss" not in row:
        p.precision_source += (
            "; other precisions possible, the log cannot tell (no logged loss at the first step)"
        )
        return
    others = []
    if (
        distributed.current() is not None
    ):  # FSDP2 shards in one precision: only the plan's is tried here
        others = [c for c, _ in cands if c != p.precision]
        cands = [c for c in cands if c[0] == p.precision]
    miss = StepCheck(
        step=first,
        logged_loss=row["loss"],
        logged_grad_norm=row.get("grad_norm"),
        loss_ok=False,
        grad_ok=False if "grad_norm" in row else None,
    )
    atol = log_rounding([r["loss"] for r in p.logged.values() if "loss" in r])
    batch = p.batches.batch(first)
    session = p.session()
    tried = []
    try:
        for prec, why in cands:
            got = session.evaluate(batch, prec)
            tried.append(f"{prec} {got[0]:.5g}")
            if _lands(got, miss, atol, prec):
                p.precision = prec
                p.precision_source = f"{why}; calibrated: its first step gives loss {got[0]:.6g}, the log {row['loss']:.6g} ({', '.join(tried)})"
                return
    finally:
        session.close()
    p.precision_source += f"; no candidate lands on the log's first step ({', '.join(tried)}; logged {row['loss']:.5g})"
    if others:
        p.precision_source += (
            f"; {', '.join(others)} are tried in one process only (run without torchrun)"
        )


def settle_clip(
    p: Plan, progress: Callable[[str], None] | None = None, probe_steps: int = 4
) -> tuple[float | None, str]:
    """The plan's clip norm: the stated one, else the candidate whose replay of the window's
    first `probe_steps` steps lands on the run's log best (the mitigation comparisons of
    `whatif` replay from it). Without a log to tell, the first candidate, said so."""
    if len(p.clips) == 1:
        return p.clips[0]
    head = p.steps[:probe_steps]
    if sum(s in p.logged for s in head) < 2:
        return p.clips[0][0], f"{p.clips[0][1]} (the log cannot tell within {len(head)} steps)"
    short = dataclasses.replace(p, steps=head, b=None)
    scored = []
    for i, (clip, src) in enumerate(p.clips, 1):
        if progress is not None:
            progress(f"which clip the run used: clip {clip or 'none'} ({i} of {len(p.clips)})")
        recs = run_window(short, clip, None).records
        scored.append(
            (
                log_score(
                    check_against_log(recs, p.logged, p.precision, p.batches.micro_batch_size, clip)
                ),
                clip,
                src,
            )
        )
    _, clip, src = min(scored, key=lambda x: x[0])
    return clip, src


def log_score(check: LogCheck) -> float:
    """How far a replay is from the run's log: the share of its checked steps that miss, plus
    their mean relative loss error (a tie-break below one step's share)."""
    done = [c for c in check.checks if c.checked]
    if not done:
        return 0.0
    errs = [
        abs(c.loss - c.logged_loss) / max(abs(c.logged_loss), 1e-12)
        for c in done
        if c.loss is not None and c.logged_loss is not None
    ]
    finite = [e for e in errs if math.isfinite(e)]
    return sum(not c.ok for c in done) / len(done) + min(sum(finite) / max(len(finite), 1), 1.0) / (
        len(done) + 1
    )


def _lands(got: tuple[float, float], miss: Any, atol: float, precision: str) -> bool:
    """Whether (loss, grad norm) lands on the log's figures of the missed step."""
    loss, grad = got
    ok = (
        miss.logged_loss is None
        or abs(loss - miss.logged_loss)
        <= LOSS_RTOL.get(precision, 5e-3) * abs(miss.logged_loss) + atol
    )
    if miss.logged_grad_norm is not None and miss.grad_ok is not None:
        ok = ok and abs(grad - miss.logged_grad_norm) <= GRAD_RTOL.get(precision, 3e-2) * abs(
            miss.logged_grad_norm
        )
    return bool(ok and math.isfinite(loss))


def diagnose_miss(p: Plan, miss: Any, atol: float = 0.0) -> str:
    """The likeliest reason a replay misses the log on its first checked step, from the
    figures: the same batch re-evaluated from *before* with each convention the replay may
    have got wrong (labels, loss normalisation, precision); the first that lands on the log
    is named with its figure. On a later first checked step the window's updates (LR,
    clipping, optimizer state) before it are suspects too."""
    if miss.step != p.steps[0]:
        return (
            f"the log has no figure before step {miss.step} to check the earlier steps against: the batches, model, labels or "
            "precision, or the updates before it (LR, clipping, optimizer state), differ from the run's"
        )
    batch = p.batches.batch(miss.step)
    session = p.session()
    tried: list[str] = []
    try:
        labels, norm = session.labels, session.loss_norm
        variants: list[tuple[str, Callable[[], None], str]] = []
        if "labels" in batch and labels.same is not None:
            flipped = dataclasses.replace(labels, shifted=not labels.shifted)

            def use_flipped() -> None:
                session.labels = flipped

            variants.append((f"labels: read as {flipped.name}", use_flipped, session.precision))
        for kind in ("targets", "labels", "micro"):
            if kind != norm.kind:

                def use_norm(kind: str = kind) -> None:
                    session.labels, session.loss_norm = labels, LossNorm(kind, kind)

                variants.append((f"loss normalisation: {kind}", use_norm, session.precision))
        for prec in ("fp32", "bf16-params", "bf16", "fp16"):
            if prec != session.precision:

                def use_default() -> None:
                    session.labels, session.loss_norm = labels, norm

                variants.append((f"precision: {prec}", use_default, prec))
        for what, apply, prec in variants:
            apply()
            try:
                got = session.evaluate(batch, prec)
            except (
                RuntimeError,
                ValueError,
            ) as e:  # a variant the model cannot run (fp16 on CPU kernels, say)
                tried.append(f"{what} fails ({type(e).__name__})")
                continue
            if _lands(got, miss, atol, prec):
                return f"{what} (it gives loss {got[0]:.5g}, grad norm {got[1]:.4g})"
            tried.append(f"{what} gives loss {got[0]:.4g}")
    finally:
        session.close()
    dropout = [n for n, m in session.model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if dropout:
        return f"dropout is on ({dropout[0]} p={session.model.get_submodule(dropout[0]).p:g}...): a replay cannot draw the run's masks; none of {', '.join(tried)}"
    if miss.loss_ok is not False:
        return "the loss matches but the gradient does not: the loss scaling, frozen parameters or what the log calls its grad norm differ"
    off = abs(miss.loss - miss.logged_loss) / max(abs(miss.logged_loss), 1e-12)
    if off <= 3 * LOSS_RTOL.get(p.precision, 5e-3):
        return f"a numerical difference just past float noise (kernels, TF32, fused ops) ({off:.2%} off); none of: {'; '.join(tried)}"
    # Another batch of the same data lands ~1% away; a different task or model far further.
    return f"the batches (data, order, collator) or the model (architecture, activation, norm) differ from the run's ({off:.1%} off); none of: {'; '.join(tried)}"


def ratio_change(
    a: Checkpoint, b: Checkpoint | None
) -> tuple[list[int], list[float], list[float]] | None:
    """Param groups whose LR relative to group 0 differs between *before* and *after* by
    more than `LR_GROWTH_MARGIN`: (those groups, every group's ratio at a, at b). A schedule
    the groups share scales them all alike, so their ratios hold; a ratio that moves is a
    per-group LR change inside the window (a per-module LR bug, a group unfrozen)."""
    if b is None or a.optimizer is None or b.optimizer is None:
        return None
    la, lb = [g.lr for g in a.optimizer.groups], [g.lr for g in b.optimizer.groups]
    if len(la) != len(lb) or len(la) < 2 or la[0] <= 0 or lb[0] <= 0:
        return None
    ra, rb = [x / la[0] for x in la], [x / lb[0] for x in lb]
    changed = [
        g
        for g in range(len(la))
        if ra[g] > 0 and rb[g] > 0 and max(rb[g] / ra[g], ra[g] / rb[g]) > LR_GROWTH_MARGIN
    ]
    return (changed, ra, rb) if changed else None


def _switched(p: Plan, ra: list[float], rb: list[float], k: int) -> dict[int, list[float]]:
    """The plan's LRs with the group ratios of *before* up to step k - 1 and *after*'s from k."""
    return {
        s: [v[0] * (ra[g] if s < k else rb[g]) for g in range(len(v))] for s, v in p.lrs.items()
    }


def _settle_ratio_change(p: Plan, progress: Callable[[str], None] | None) -> None:
    """Where the log gives one LR for all groups (HF Trainer logs group 0's) and the pair
    shows a group's ratio changed, find the step it changed at: the one whose replay moves
    the changed groups' weights as far as they moved from *before* to *after* (movement
    falls monotonically as the change comes later, so bisection: ~log2(window) replays)."""
    change = ratio_change(p.a, p.b)
    if change is None or p.b is None or not p.lr_source.startswith(("training log lr", "constant")):
        return
    groups, ra, rb = change
    if distributed.current() is not None:
        raise ForensicsError(
            f"param group {', '.join(map(str, groups))}'s LR ratio changes inside the window and the log gives one LR: "
            "finding the step it changed at runs in one process; run without torchrun, or pass a batch log with /lr per group (the flight recorder's)"
        )
    assert p.a.optimizer is not None
    names = [n for n, h in p.a.optimizer.hyper.items() if h.index in groups and p.b.has(n)]
    if not names:
        return
    start = {n: p.a.tensor(n).double() for n in names}  # read once for every trial
    target = sum(float((p.b.tensor(n).double() - start[n]).norm()) for n in names)
    clip = p.clips[0][0]
    grows = any(rb[g] > ra[g] for g in groups)  # later change -> less movement when the ratio grew
    seen: dict[int, tuple[float, float, int]] = {}

    def trial(k: int) -> tuple[float, float, int]:
        if k not in seen:
            if progress is not None:
                progress(f"LR change at step {k}?")
            seen[k] = _movement(p, _switched(p, ra, rb, k), clip, start)
        return seen[k]

    lo, hi = p.steps[0], p.steps[-1] + 1  # hi: no change inside the window
    while lo < hi:
        mid = (lo + hi) // 2
        if (trial(mid)[0] > target) == grows:
            lo = mid + 1
        else:
            hi = mid
    cands = [k for k in (lo - 1, lo) if p.steps[0] <= k <= p.steps[-1]]
    k = min(cands, key=lambda c: abs(trial(c)[0] - target))
    how = "the step whose replay moves its weights as far as before -> after did"
    if trial(k)[1] > MATCH_SHARE:
        # A wrecked module's movement is chaotic, not monotone: every step of the window is
        # tried. The run's log decides first: the change step's replay matches it longest
        # (the steps before the change cannot tell the candidates apart; the step after it
        # shows the jump). Then the replay closest to after's weights of those groups (held-out
        # draw 9525: an Adafactor group whose LR rose 2159x at 383; no candidate lands on after,
        # and the closest, 386, missed the log's spike at 384).
        k = min(p.steps, key=lambda c: (-trial(c)[2], trial(c)[1]))
        how = (
            "the step whose replay matches the run's log longest, then reproduces after's "
            "weights of those groups best"
            if p.logged
            else "the step whose replay reproduces after's weights of those groups"
        )
    p.lrs = _switched(p, ra, rb, k)
    shown = ", ".join(str(g) for g in groups)
    p.lr_source += (
        f"; group {shown}'s LR ratio changes at step {k} (calibrated: {how}; {len(seen)} replays)"
    )


def _movement(
    p: Plan, lrs: dict[int, list[float]], clip: float | None, start: dict[str, torch.Tensor]
) -> tuple[float, float, int]:
    """How far a replay of the window moves the named weights from where they started
    (`start`, *before*'s), the share of their elements that miss *after*'s (`compare_after`'s
    tolerance), and how many of its first steps match the run's log (0 without a log)."""
    assert p.b is not None
    session = p.session()
    try:
        recs = [session.step(s, p.batches.batch(s), lrs[s], clip)[0] for s in p.steps]
        check = check_against_log(recs, p.logged, p.precision, p.batches.micro_batch_size, clip)
        miss = check.first_miss
        agree = sum(1 for s in p.steps if miss is None or s < miss.step)
        params = {session.to_ckpt(k): q for k, q in session.model.named_parameters()}
        moved = sum(
            float((params[n].detach().cpu().double() - w).norm())
            for n, w in start.items()
            if n in params
        )
        matches = [
            m for m in compare_after(session, p.b, lrs, only=set(start)) if m.where == "weight"
        ]
        share = sum(m.mismatched for m in matches) / max(1, sum(m.numel for m in matches))
        return moved, share, agree if p.logged else 0
    finally:
        session.close()
