"""The causes a verdict can name: one `Cause` record each, in one registry (`CAUSES`).

A cause is the report's word for what went wrong (`verdict.causes[].cause`). Everything the
tool knows about one lives in its record: what it means, what the verdict recommends, the
what-ifs `plan` replays for it and the change the plan proposes, whether its finding names
the layer to fix, whether it is a resume that lost state. The verdict (`verdict.py`) and the
plan (`planner.py`) read the records; `report/schema.json`'s enum, `docs/signatures.md#causes`
and the README's table are tested against them (tests/test_causes.py). A new cause is one
entry here and the detector that supports it.

Detectors name causes in a finding's `supports` (strongest first); a name there that is not
registered here is a bug the tests catch.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["Cause", "CAUSES", "RESUME_CAUSES", "lookup", "figures", "registry"]

# The figures a cause's texts may name, and who fills them in.
ACTION_FIGURES = frozenset({"rollback", "after", "layer"})  # the verdict
TRY_FIGURES = frozenset({"half_clip", "onset", "jump_scale"})  # the planner
CHANGE_FIGURES = frozenset(
    {"{half_clip}", "{onset}", "{culprits}", "{safe_beta2}", "{raised_eps}"}
)  # the planner
NOTE_FIGURES = frozenset({"what", "layer"})  # the planner


def figures(text: str) -> set[str]:
    """The figures (`{name}` fields) a cause's text names."""
    return {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}


@dataclass(frozen=True, slots=True, kw_only=True)
class Cause:
    """One cause: its name in the report and what the tool does about it.

    Attributes:
        name: the report's key (`verdict.causes[].cause`; report/schema.json's enum).
        meaning: what the evidence says, one plain line (docs/signatures.md#causes).
        actions: the verdict's recommended actions, in order, when this cause leads;
            `{rollback}` (the last safe checkpoint), `{after}` and `{layer}` (the layer
            `layer_finding` names, else "the affected layers") are filled in by the verdict.
        layer_finding: the finding kind whose subject is the layer to fix (it then leads the
            verdict's first anomalous module and exploding layers); None: no such finding.
        resume: a resume that lost this state: the finding of this kind (its kind is the
            cause's name) carries `resume_step`, and the update after it is the first bad step.
        tries: the what-ifs `plan` replays for it (`--try` strings), least invasive first;
            `{half_clip}` (half the run's clip, 1.0 where it clipped at nothing) and
            `{onset}` (the first bad step; the try is left out without one) are filled in
            by the planner.
        jump_tries: the what-ifs instead, where the replay dates an LR jump
            (`lr_step_jump`): `{jump_scale}` is 1 / the jump. Non-empty means the jump is
            this cause's fault: the plan fixes that LR first (`lr_fix`) whatever else helps.
        changes: the plan's change where no what-if replayed one on track: the first of
            these `(knob, value)` the report has the figures for. A value `"{half_clip}"`
            or `"{onset}"` as in `tries`; `"{culprits}"`: the rows the replay or the
            bisection names; `"{safe_beta2}"`: a beta2 of at least beta1^2 where the run's
            optimizer groups hold one below it; `"{raised_eps}"`: the run's Adam epsilon
            raised (none: the entry is passed over).
        plan_note: the plan's note for this cause (a hardware fault, a resume to redo, a fix
            no config key writes), with `{what}` the cause in words and `{layer}` the
            verdict's first anomalous module ("the affected layers" without one); None: where
            the plan has no change, its note says no change is known to help.
    """

    name: str
    meaning: str
    actions: tuple[str, ...] = ()
    layer_finding: str | None = None
    resume: bool = False
    tries: tuple[str, ...] = ()
    jump_tries: tuple[str, ...] = ()
    changes: tuple[tuple[str, object], ...] = ()
    plan_note: str | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name != self.name.lower():
            raise ValueError(f"cause {self.name!r}: a name is one lower-case identifier")
        if not self.meaning or "\n" in self.meaning or "|" in self.meaning:
            raise ValueError(f"cause {self.name!r}: its meaning is one line (no '|': a table cell)")
        for texts, known, what in (
            (self.actions, ACTION_FIGURES, "action"),
            (self.tries + self.jump_tries, TRY_FIGURES, "try"),
            ((self.plan_note,) if self.plan_note else (), NOTE_FIGURES, "plan note"),
        ):
            for text in texts:
                if not figures(text) <= known:
                    raise ValueError(
                        f"cause {self.name!r}: {what} {text!r} names {sorted(figures(text) - known)}; "
                        f"known: {sorted(known)}"
                    )
        for knob, value in self.changes:
            if isinstance(value, str) and value.startswith("{") and value not in CHANGE_FIGURES:
                raise ValueError(
                    f"cause {self.name!r}: change {knob}={value}; known figures: {sorted(CHANGE_FIGURES)}"
                )


def registry(*causes: Cause) -> Mapping[str, Cause]:
    """The causes by name, in the given order; a name given twice is refused."""
    out: dict[str, Cause] = {}
    for c in causes:
        if c.name in out:
            raise ValueError(f"cause {c.name!r} registered twice")
        out[c.name] = c
    return MappingProxyType(out)


# An LR the replay sees jump at one step is the fault: the LR from before the jump, then half
# of it, then half the clip.
_LR_JUMP_TRIES = ("lr_scale={jump_scale:.4g}", "lr_scale=0.5", "clip={half_clip:g}")
_RESUME_NOTE = (
    "the resume itself lost state ({what}): resume again from the rollback checkpoint the "
    "trainer's own way (the resume keys below), nothing else to change"
)

CAUSES: Mapping[str, Cause] = registry(
    Cause(
        name="gradient_explosion",
        meaning="one layer's gradient leaves its range first, the LR is right",
        actions=(
            "Resume from {rollback} with a tighter gradient clip (the plan tries half the run's own, 1.0 where it clipped at nothing) and inspect the exploding layer's inputs with `ckptforensics replay`.",
        ),
        tries=("clip={half_clip:g}", "lr_scale=0.5"),
        jump_tries=_LR_JUMP_TRIES,
        changes=(("clip", "{half_clip}"),),
    ),
    Cause(
        name="lr_too_high",
        meaning="the LR (a step, a group) is above what the schedule allows",
        actions=(
            "Check the LR schedule and per-group LR multipliers; the recorded LR is above what the schedule allows.",
            "Resume from {rollback} with the intended LR (or a lower one) and confirm with `ckptforensics whatif --try lr_scale=0.5`.",
        ),
        tries=("lr_scale=0.5", "lr_scale=0.1"),
        jump_tries=_LR_JUMP_TRIES,
        changes=(("lr_scale", 0.5),),
    ),
    Cause(
        name="fp16_overflow",
        meaning="an fp16 tensor past its range (65504), or the loss scaler skipping steps on overflows",
        actions=(
            "Resume from {rollback} in bf16, or lower the initial loss scale; find the overflowing module with `ckptforensics replay`.",
        ),
        tries=("precision=bf16", "precision=fp32"),
        changes=(("precision", "bf16"),),
    ),
    Cause(
        name="bf16_overflow",
        meaning="a bf16 tensor past its range (3.39e38)",
        actions=(
            "Resume from {rollback}; add QK-norm / z-loss or clip activations of the overflowing module.",
        ),
        tries=("precision=fp32", "clip={half_clip:g}"),
        changes=(("precision", "fp32"),),
    ),
    Cause(
        name="loss_scale_collapse",
        meaning="the fp16 loss scale backed off to nothing under repeated overflows",
        actions=(
            "Resume from {rollback} in bf16; the fp16 loss scale collapsed under repeated overflows.",
        ),
        tries=("precision=bf16", "precision=fp32"),
        changes=(("precision", "bf16"),),
    ),
    Cause(
        name="poison_batch",
        meaning="the replayed step spikes with the batch, and only a few rows carry it (bisect names them)",
        actions=(
            "Find the rows that carry the spike with `ckptforensics bisect`, then resume from {rollback} without them (or without the whole batch).",
        ),
        tries=("skip_samples=auto", "skip_step={onset}"),
        changes=(("skip_samples", "{culprits}"), ("skip_step", "{onset}")),
    ),
    Cause(
        name="adam_instability",
        meaning="a second moment far smaller than its gradient (Adam's epsilon and beta2 regime): updates go sign-like",
        actions=(
            "Resume from {rollback} with Adam's second moment kept in step with its gradient in {layer}: beta2 >= beta1^2 "
            "(0.95 at beta1 0.9) where it decays faster than the first moment (steps that grow where the gradient stops), "
            "a lower beta2 (0.95) where it lags a growing gradient (beta2 0.999), and an epsilon of 1e-8 or more "
            "(1e-6 damps a stale second moment, Molybog 2304.09871).",
        ),
        layer_finding="adam_step_growth",
        # Molybog et al. 2023 (2304.09871): eps 1e-8 -> 1e-6 damps the sign-like updates of a
        # stale second moment.
        tries=("eps=1e-6", "clip={half_clip:g}"),
        # The run's own beta2 raised where it is below beta1^2 (the planner reads the run's
        # optimizer groups), else its eps raised.
        changes=(("beta2", "{safe_beta2}"), ("eps", "{raised_eps}")),
    ),
    Cause(
        name="attention_logit_growth",
        meaning="a layer's attention logits grew past the cap before the spike",
        actions=(
            "Resume from {rollback} with QK-norm (LayerNorm on each head's queries and keys, Dehghani et al. 2023) or "
            "attention-logit soft-capping (Gemma 2: 50 tanh(x/50)) in {layer}, or a lower LR; `ckptforensics audit` checks the fix.",
        ),
        layer_finding="attention_logit_growth",
        tries=("lr_scale=0.5", "clip={half_clip:g}"),
        changes=(("lr_scale", 0.5),),
        plan_note=(
            "{what} in {layer}: the fix is the model's, which no config key writes: QK-norm on its queries and keys "
            "(Dehghani et al. 2023) or attention-logit soft-capping (Gemma 2: 50 tanh(x/50)); short of it, a lower LR "
            "for {layer}'s query and key projections (a per-module LR multiplier), or the whole LR as below"
        ),
    ),
    Cause(
        name="output_logit_divergence",
        meaning="the head's log Z drifted away from 0 before the spike (no z-loss holds it)",
        actions=(
            "Resume from {rollback} with z-loss (1e-4 log^2 Z, PaLM) or final-logit soft-capping (Gemma 2: 30 tanh(x/30)) on "
            "{layer}, or weight decay on the head; `ckptforensics audit` checks log Z.",
        ),
        layer_finding="output_logit_drift",
        tries=("lr_scale=0.5", "clip={half_clip:g}"),
        changes=(("lr_scale", 0.5),),
        plan_note=(
            "{what} at {layer}: the fix is the loss's or the model's, which no config key writes: z-loss "
            "(1e-4 log^2 Z, PaLM) or final-logit soft-capping (Gemma 2: 30 tanh(x/30)); short of it, a lower LR or "
            "weight decay for {layer}, or the whole LR as below"
        ),
    ),
    Cause(
        name="expert_collapse",
        meaning="a Mixture-of-Experts router sends most tokens to few experts (its logits grown into a hard pick), the others idle",
        actions=(
            "Resume from {rollback} with a router z-loss (ST-MoE: 1e-3 log^2 Z of the router logits) and the "
            "load-balancing loss on (transformers: `output_router_logits=True`, `router_aux_loss_coef` 1e-3..1e-2), "
            "the router in fp32, or a lower LR for {layer}; `ckptforensics audit` checks these settings.",
        ),
        layer_finding="expert_collapse",
        tries=("lr_scale=0.5", "clip={half_clip:g}"),
        changes=(("lr_scale", 0.5),),
    ),
    Cause(
        name="silent_corruption",
        meaning="a hardware fault: the replay from the same state and batch does not reproduce the spike, with nothing else the run's files name left open, or an element moved beyond any update the optimizer can make",
        actions=(
            "Roll back to {rollback} and resume on different hardware; quarantine the node that wrote {after}.",
            "Run `ckptforensics replay` from {rollback}: a clean replay that misses {after} confirms a hardware fault.",
        ),
        plan_note=(
            "a hardware fault: resume from the rollback checkpoint on other hardware and "
            "quarantine the node that wrote the bad state"
        ),
    ),
    # A resume that restored the weights but not the rest of the training state.
    Cause(
        name="optimizer_state_lost",
        meaning="the resume restored the weights without the optimizer's state: a fresh optimizer restarted its moments and step counter",
        actions=(
            "Resume from {rollback} with its optimizer state loaded, the trainer's own way: HF Trainer "
            "`trainer.train(resume_from_checkpoint=...)`; Lightning `trainer.fit(model, ckpt_path=...)`; DeepSpeed "
            "`engine.load_checkpoint(dir, load_optimizer_states=True)`; Megatron without `--no-load-optim` (and "
            "without `--finetune`); DCP: load the `optim` (torchtitan `optimizer`) key with `set_optimizer_state_dict`; "
            "a hand-written loop: `optimizer.load_state_dict(ckpt['optimizer'])` after building the optimizer.",
            "Check the resume log: a fresh optimizer counts its steps from the resume, so its step counter "
            "(`state[...]['step']`) trails the trainer's global step from there on.",
        ),
        resume=True,
        plan_note=_RESUME_NOTE,
    ),
    Cause(
        name="lr_scheduler_restarted",
        meaning="the resume rebuilt the LR scheduler without its state: it re-runs its warm-up",
        actions=(
            "Resume from {rollback} with the LR scheduler's state: HF Trainer `resume_from_checkpoint` restores "
            "`scheduler.pt`; Lightning `ckpt_path=` restores `lr_schedulers`; DeepSpeed `load_lr_scheduler_states=True`; "
            "Megatron restores `opt_param_scheduler` unless `--override-opt_param-scheduler`; a hand-written loop: "
            "`scheduler.load_state_dict(ckpt['scheduler'])`.",
        ),
        resume=True,
        plan_note=_RESUME_NOTE,
    ),
    Cause(
        name="loss_scaler_reset",
        meaning="the resume rebuilt the loss scaler without its state: its scale and growth count started over",
        actions=(
            "Resume from {rollback} with the loss scaler's state: HF Trainer `resume_from_checkpoint` restores "
            "`scaler.pt`; Lightning `ckpt_path=` restores the precision plugin's scaler; DeepSpeed restores it with the "
            "optimizer states; a hand-written loop: `scaler.load_state_dict(ckpt['scaler'])`.",
        ),
        resume=True,
        plan_note=_RESUME_NOTE,
    ),
    Cause(
        name="data_loader_restarted",
        meaning="the resume restarted the data loader without its position: the run re-reads samples it has already seen",
        actions=(
            "Resume from {rollback} with the data loader's position (a stateful sampler / dataloader state; HF Trainer "
            "skips the consumed batches unless `ignore_data_skip`): the run is re-reading samples it has already seen.",
        ),
        resume=True,
        plan_note=_RESUME_NOTE,
    ),
    Cause(
        name="code_change",
        meaning="two versions of the code part on the same state and batch, past the reference's own run-to-run noise (regress names the module)",
        actions=(
            "Read the code of the first anomalous module in both versions (forward or backward, as the regression says); train on the reference version until the difference is explained.",
        ),
    ),
    Cause(
        name="none",
        meaning="nothing in the pair or the replay stands out",
    ),
    Cause(
        name="undiagnosed",
        meaning="something stands out with no signature to name it (a what-if's baseline off its track, a recovery that did not recover): replay or bisect name the cause",
    ),
)

# Causes of a resume that lost state: their finding's `resume_step` sets the first bad step.
RESUME_CAUSES: tuple[str, ...] = tuple(c.name for c in CAUSES.values() if c.resume)


# What the tool knows of a name it does not register (a report another version wrote): nothing.
_UNREGISTERED = Cause(name="unregistered", meaning="a cause this version does not know")


def lookup(name: str) -> Cause:
    """The record of `name`; a name the registry lacks gets a bare record (no actions, no
    what-ifs, no change, no note)."""
    return CAUSES.get(name, _UNREGISTERED)
