"""The precision a replay runs in, read from the run, and the fp16 loss scale it follows.

Modes (`Session.precision`):

- ``fp32``: no autocast.
- ``fp16`` / ``bf16``: `torch.autocast` over fp32 weights (HF Trainer, Lightning, nanoGPT);
  fp16 with a GradScaler whose scale the replay takes from the run (below).
- ``bf16-params``: bf16 parameters computed on, fp32 master weights updated (FSDP2's
  `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`, torchtitan's default;
  Megatron `--bf16`; DeepSpeed `bf16`): forward and backward see each weight rounded to bf16,
  its gradient is produced in bf16 and reduced / accumulated in fp32, and the optimizer
  steps the fp32 weights. Megatron `--bf16` backpropagates each micro-batch on its own and
  sums their bf16 gradients in fp32 (`fp32_micro_batches`); so does its replay.

The loss scale (fp16). A GradScaler's state changes every step (halved on an overflow, the
step skipped; doubled after `growth_interval` clean steps), and a replay that starts from
another scale skips other steps: every element then misses *after* (a skip shifts Adam's
bias correction and drops a whole update). Where the scale comes from, in order:

1. the checkpoint's scaler state (HF `scaler.pt`, Lightning, plain `{"scaler": ...}` saves);
2. the run's logged scale per step (the batch log's `/loss_scale`, the training log's
   `loss_scale`); whether a logger writes the scale a step used or the one `update()` left
   after it is read from the data: the first logged drop follows the step that overflowed;
3. calibration (karpathy/nanoGPT saves no scaler and logs no scale): the pair's Adam step
   counters say how many window steps the run skipped; starting scales 2^k around the prior
   (GradScaler's default 65536 halved once per skip before the window: nanoGPT's `iter_num`
   counts skipped iterations, Adam's `step` does not) are replayed, with a replayed overflow
   beyond the run's skips backed off and the step redone, and the first that skips as many
   steps as the run and lands on *after* is kept.

Where the run logs which steps it skipped (the flight recorder's `skipped`), an overflow on a
step the run applied backs the scale off and redoes the step; no overflow on a step the run
skipped doubles it and redoes the step.

Over 400 lines: the modes and the loss scale are one policy (an fp16 run's scale is chosen by
replaying under the mode), kept together so the search and what it assumes read as one. What
a trainer's config says of its precision is its framework's `precision` hook (trainers/).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptforensics.formats.base import Checkpoint
from ckptforensics.trainers import hook

__all__ = [
    "PRECISIONS",
    "ScalePlan",
    "LossScaler",
    "autocast",
    "candidates",
    "fp32_micro_batches",
    "resolve",
    "scale_plan",
]

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "bf16", "bf16-params")

# torch.amp.GradScaler's defaults (torch/amp/grad_scaler.py), which karpathy/nanoGPT and
# most loops keep: init_scale 2**16, growth_factor 2, backoff_factor 0.5, growth_interval 2000.
DEFAULT_INIT_SCALE = 65536.0
DEFAULT_GROWTH_INTERVAL = 2000
# A scale the replay never goes past when it searches (fp16's largest finite value is
# 65504: a larger scale overflows any non-zero gradient of order one).
MAX_SCALE = 2.0**24
# Calibration tries at most this many starting scales, then at most this many placements
# of the run's skipped steps (each a replay of the window).
MAX_SCALE_TRIALS = 6
MAX_PLACEMENT_TRIALS = 24


# ----------------------------------------------------------------------------- modes
def resolve(requested: str, ckpt: Checkpoint) -> tuple[str, str]:
    """The run's precision and what says so: the first of `candidates`."""
    return candidates(ckpt, requested)[0]


def candidates(ckpt: Checkpoint, requested: str = "auto") -> list[tuple[str, str]]:
    """Every precision the run could have trained in, likeliest first, each with its
    evidence. One entry when the run states it (or `--precision` does); several when it
    does not, for a check against the log (the first replayed step's loss) to pick from.

    `--precision` wins; then a loss scaler's state (fp16); then what the run's own config
    records: a recorded FSDP2 policy (a torchtitan job config's
    `training.mixed_precision_param`), else its framework's `precision` hook (HF
    `TrainingArguments` `fp16`/`bf16` (autocast), nanoGPT's `dtype`, DeepSpeed's `ds_config`
    `bf16.enabled` / `fp16.enabled`, Megatron's `bf16` / `fp16` args); then the weights' dtypes (bf16 weights with fp32 copies in the optimizer are bf16
    parameters on fp32 masters; bf16 weights alone, bf16 compute).
    """
    if requested != "auto":
        return [(requested, "--precision")]
    if ckpt.scalars.get("loss_scale") is not None and not _static_scale(ckpt):
        return [("fp16", "loss scaler state in the checkpoint")]
    stated = _stated(ckpt)
    if stated is not None:
        return [stated]
    dtypes = {ckpt.meta(n).dtype for n in ckpt.names()}
    if torch.bfloat16 in dtypes:
        if ckpt.scalars.get("fp32_masters"):
            return [("bf16-params", "bf16 weights with fp32 master weights in the optimizer state")]
        return [
            ("bf16", "bf16 weights in the checkpoint"),
            ("bf16-params", "bf16 weights in the checkpoint (bf16 compute on fp32 masters)"),
        ]
    # fp32 weights say nothing of the compute: an FSDP2 run with a bf16 policy and an
    # autocast run both keep fp32 weights. fp32 first (no evidence of anything else).
    return [
        ("fp32", "fp32 weights, no loss scaler"),
        ("bf16-params", "fp32 weights: FSDP2's bf16 MixedPrecisionPolicy keeps fp32 weights too"),
        ("bf16", "fp32 weights: bf16 autocast keeps fp32 weights too"),
    ]


def _static_scale(ckpt: Checkpoint) -> bool:
    """DeepSpeed pickles a static scaler of 1.0 into runs without fp16 (formats/deepspeed)."""
    tc = ckpt.scalars.get("train_config") or {}
    return bool(tc.get("bf16")) and not tc.get("fp16")


def _stated(ckpt: Checkpoint) -> tuple[str, str] | None:
    """The precision the run's own config states, with the key it is read from: a recorded
    FSDP2 policy (any run's), else the `precision` hook of the framework that wrote it
    (trainers/: DeepSpeed's ds_config, Megatron's args, HF TrainingArguments, nanoGPT's dtype)."""
    tc = ckpt.scalars.get("train_config") or {}
    mp = ckpt.scalars.get("mixed_precision") or {}
    param = str(mp.get("param_dtype") or tc.get("mixed_precision_param") or "")
    if param in ("bfloat16", "torch.bfloat16", "bf16"):
        return "bf16-params", str(
            mp.get("source") or "job config training.mixed_precision_param=bfloat16"
        )
    if param in ("float32", "torch.float32", "fp32") and mp:
        return "fp32", str(mp.get("source"))
    fn = hook(ckpt, "precision")
    return fn(ckpt) if fn is not None else None


def autocast(precision: str, device: str) -> contextlib.AbstractContextManager[Any]:
    """The forward's autocast: fp16/bf16 autocast; none for fp32 and bf16 parameters (the
    weights themselves are bf16 there: `BF16Params`)."""
    if precision in ("fp32", "bf16-params"):
        return contextlib.nullcontext()
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device_type=device, dtype=dtype)


class BF16Params:
    """bf16 parameters on fp32 master weights, in one process, as FSDP2's
    `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)` computes: before the
    forward each parameter's data becomes its bf16 rounding (FSDP2 casts the all-gathered
    fp32 shard), the backward produces bf16 gradients, and `restore` puts the fp32 master
    back with its gradient cast to fp32 (FSDP2's reduce-scatter in `reduce_dtype`; a world of
    one reduces nothing). The optimizer only ever sees the fp32 masters.

    Under torchrun, FSDP2's own `fully_shard(mp_policy=...)` does this (replay/distributed)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.masters: list[torch.Tensor] | None = None

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        if self.masters is None:
            self.masters = [p.data for p in self.params]
            for p in self.params:
                p.data = p.data.to(torch.bfloat16)
        yield

    def restore(self) -> None:
        """fp32 masters back in place, each gradient (bf16) cast to fp32."""
        if self.masters is None:
            return
        for p, m in zip(self.params, self.masters, strict=True):
            g = p.grad
            p.grad = None
            p.data = m
            if g is not None:
                p.grad = g.float()
        self.masters = None

    def accumulate(self, into: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """`restore`, then this pass's fp32-cast gradients added to `into` (Megatron's main_grad
        buffer: each micro-batch's bf16 gradient summed in fp32); the params keep no grad."""
        self.restore()
        out = []
        for p, acc in zip(self.params, into, strict=True):
            g, p.grad = p.grad, None
            out.append(g if acc is None else (acc if g is None else acc.add_(g)))
        return out


def fp32_micro_batches(ckpt: Checkpoint) -> int | None:
    """Rows per micro-batch whose low-precision gradients the run summed in fp32, each
    micro-batch backpropagated on its own (a step's gradient is then a sum of roundings, not
    the rounding of one backward over the global batch): the `fp32_micro_batches` hook of the
    framework that wrote `ckpt` (trainers/megatron: `--bf16` with
    `accumulate_allreduce_grads_in_fp32`); None for any other run."""
    fn = hook(ckpt, "fp32_micro_batches")
    return fn(ckpt) if fn is not None else None


# A replayed moment's rounding per step, relative (compare.compare_after; docs/signatures.md#replay-precision): fp32 compute and fp16
# autocast (fp16 gradients round at 2^-11) sit under 1e-3; a bf16 gradient rounds at 2^-8
# (bf16's unit roundoff, 8 significand bits), and a bf16 weight a last-bit different master
# weight rounds to (a replay's sums in another order) moves every gradient it touches by as
# much: the run and its replay differ by that much per step wherever the compute is bf16.
BF16_ROUNDING = 2.0**-8


def moment_rounding(precision: str) -> float:
    """The relative rounding per step a replayed moment may differ by (module note above)."""
    return BF16_ROUNDING if precision in ("bf16", "bf16-params") else 1e-3


def reach(precision: str) -> float:
    """How many Adam bounds apart a replayed weight and *after*'s may be before no replay
    of the window could explain it (compare.weight_match's `impossible`). One where the
    replay follows the run's arithmetic; two where the compute is bf16: an element whose
    true gradient is zero (an attention key's bias) moves on rounding noise alone, up to the
    bound each step, and the run's noise and the replay's can push it opposite ways."""
    return 2.0 if precision in ("bf16", "bf16-params") else 1.0


def tolerance(precision: str) -> dict[str, str]:
    """The tolerance a replay in `precision` is held to against *after*, as the report states it
    (compare.weight_match, compare.moment_tol)."""
    first = (
        "; the first moment's relative to the gradient's size (sqrt of the second)"
        if precision in ("bf16", "bf16-params")
        else ""
    )
    return {
        "weights": f"1% of the window's Adam steps (k x lr) plus 4 ulp of after's dtype; impossible past {reach(precision):g} x the Adam bound",
        "moments": f"{moment_rounding(precision):.3g} relative per replayed step ({precision}){first}",
        "source": "docs/signatures.md#replay-precision",
    }


def moment_scale(
    precision: str, where: str, x: torch.Tensor, y: torch.Tensor, vx: torch.Tensor, vy: torch.Tensor
) -> torch.Tensor:
    """What a moment's rounding is relative to, per element: the moment itself; for the
    first moment under bf16 compute, the gradient's size (sqrt of the second moment), since
    a bf16 gradient's rounding is relative to the gradient, not to an average of gradients
    that cancel."""
    scale = torch.maximum(x.abs(), y.abs())
    if where == "exp_avg" and precision in ("bf16", "bf16-params"):
        scale = torch.maximum(scale, torch.maximum(vx, vy).clamp_min(0).sqrt())
    return scale


# ----------------------------------------------------------------------------- loss scale
@dataclass(slots=True)
class ScalePlan:
    """Where the replay's loss scale comes from (fp16).

    Attributes:
        start: the scale at the window's first step (None: `calibrate`).
        growth_tracker: clean steps since the last change, at the start.
        growth_interval: steps between growths (GradScaler's default unless recorded).
        logged: step -> the loss scale the run's log holds for it.
        flags: step -> the run skipped that step (its log says so).
        applied: optimizer updates the run applied inside the window (Adam's counter,
            *after* minus *before*); None without *after*.
        window: the window's steps.
        source: what the scale was read from (stated in `replay.config.loss_scale`).
        align: how the log's scale lines up with the steps: "used" (the scale the step
            used) or "after" (the scale `update()` left after it); None until the data says.
    """

    start: float | None
    growth_tracker: int = 0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = DEFAULT_GROWTH_INTERVAL
    logged: dict[int, float] = field(default_factory=dict)
    flags: dict[int, bool] = field(default_factory=dict)
    applied: int | None = None
    window: list[int] = field(default_factory=list)
    source: str = ""
    prior: float = DEFAULT_INIT_SCALE
    align: str | None = None
    fixed: bool = False  # the scale is the run's record (state or log), not a calibration
    force: frozenset[int] | None = None  # calibration: the window steps the run skipped

    @property
    def skips(self) -> int | None:
        """How many window steps the run skipped (None: unknown)."""
        return None if self.applied is None else len(self.window) - self.applied

    def describe(self) -> dict[str, Any]:
        return {"value": self.start, "source": self.source}


def _adam_step(ckpt: Checkpoint | None) -> int | None:
    if ckpt is None or ckpt.optimizer is None or not ckpt.optimizer.state:
        return None
    st = next(iter(ckpt.optimizer.state.values())).get("step")
    try:
        return int(float(st)) if st is not None else None
    except (TypeError, ValueError):
        return None


def _log_flags(logged: dict[int, dict[str, float]]) -> dict[int, bool]:
    """step -> skipped, where the log says: the flight recorder's `skipped` (written only on
    skipped steps, so a row without it was applied once any row has it); else the logged
    pre-clip grad norm, since a GradScaler skips a step exactly when an unscaled gradient
    is not finite (torch/amp/grad_scaler.py: `found_inf`), which makes the total norm
    infinite or NaN."""
    flags = {s: bool(r["skipped"] > 0.5) for s, r in logged.items() if "skipped" in r}
    if flags:
        return {s: flags.get(s, False) for s in logged}
    return {s: not math.isfinite(r["grad_norm"]) for s, r in logged.items() if "grad_norm" in r}


def _alignment(scales: dict[int, float], flags: dict[int, bool]) -> str | None:
    """Whether a log's loss scale is the one each step used ("used") or the one `update()`
    left after it ("after"), from the data: at a step the run skipped, the scale drops at
    that step's row ("after": the flight recorder, Megatron, DeepSpeed) or at the next row
    ("used")."""
    for s in sorted(k for k, v in flags.items() if v):
        prev, cur, nxt = scales.get(s - 1), scales.get(s), scales.get(s + 1)
        if prev is not None and cur is not None and cur < prev:
            return "after"
        if cur is not None and nxt is not None and nxt < cur:
            return "used"
    return None


def scale_plan(
    a: Checkpoint,
    b: Checkpoint | None,
    steps: list[int],
    batch_scales: dict[int, float],
    logged: dict[int, dict[str, float]],
) -> ScalePlan:
    """The window's loss-scale plan, from the best record the run left (module docstring)."""
    adam_a, adam_b = _adam_step(a), _adam_step(b)
    applied = (
        adam_b - adam_a
        if adam_a is not None and adam_b is not None and 0 <= adam_b - adam_a <= len(steps)
        else None
    )
    plan = ScalePlan(start=None, applied=applied, window=list(steps), flags=_log_flags(logged))
    state = a.scalars.get("scaler")
    if isinstance(state, dict) and isinstance(state.get("scale"), (int, float)):
        plan.start = float(state["scale"])
        plan.growth_tracker = int(state.get("_growth_tracker", 0) or 0)
        plan.growth_factor = float(state.get("growth_factor", 2.0) or 2.0)
        plan.backoff_factor = float(state.get("backoff_factor", 0.5) or 0.5)
        plan.growth_interval = int(
            state.get("growth_interval", DEFAULT_GROWTH_INTERVAL) or DEFAULT_GROWTH_INTERVAL
        )
        plan.source, plan.fixed = "the checkpoint's GradScaler state", True
        return plan
    if isinstance(a.scalars.get("loss_scale"), (int, float)):
        plan.start = float(a.scalars["loss_scale"])
        plan.source, plan.fixed = "the checkpoint's loss scale", True
        return plan
    first = steps[0]
    for series, what in (
        (batch_scales, "batch log /loss_scale"),
        (
            {s: r["loss_scale"] for s, r in logged.items() if "loss_scale" in r},
            "training log loss_scale",
        ),
    ):
        if all(s in series for s in steps):
            plan.align = _alignment(series, plan.flags)
            plan.logged = {
                s: float(v) for s, v in series.items() if first - 1 <= s <= steps[-1] + 1
            }
            prev = plan.logged.get(first - 1)
            plan.start = plan.logged[first] if plan.align == "used" or prev is None else prev
            plan.source, plan.fixed = f"{what} per step", True
            if plan.align is not None:
                plan.source += f" (the scale {'each step used' if plan.align == 'used' else 'update() left after each step'}: where the log's skipped steps fall)"
            return plan
    # Nothing recorded: GradScaler's default start, halved once per step skipped before the
    # window (the trainer's step counts every iteration, Adam's only applied updates).
    skipped_before = (a.step - adam_a) if a.step is not None and adam_a is not None else 0
    plan.prior = DEFAULT_INIT_SCALE * 0.5 ** max(0, min(skipped_before, 40))
    plan.source = "calibrated"
    return plan


class LossScaler:
    """The replay's GradScaler, following a `ScalePlan`.

    torch's GradScaler scales the loss and unscales the gradients (its own kernels); the
    skip decision and the scale's dynamics are this class's, so that a scale the run's
    record contradicts can be corrected and the step redone (`settle`)."""

    def __init__(self, device: torch.device, plan: ScalePlan) -> None:
        self.plan = plan
        self.scale_now = float(plan.start if plan.start is not None else plan.prior)
        self.tracker = plan.growth_tracker
        self.scaler = torch.amp.GradScaler(device.type, init_scale=self.scale_now)
        self.skipped: list[int] = []
        self.used: dict[int, float] = {}  # step -> the scale it finally ran at
        self.redone: dict[int, list[float]] = {}  # step -> scales tried before the one kept
        self.forced: list[int] = []  # steps skipped as the run did, without an overflow
        self._retries = 0
        self._last_overflow: bool | None = None

    # -- per step ---------------------------------------------------------------------
    def begin(self, step: int) -> float:
        """The scale step `step` runs at (from the log when it has one)."""
        used = self._logged_scale(step)
        if used is not None and self._retries == 0:
            self.scale_now = used
        self._set(self.scale_now)
        return self.scale_now

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
        """Unscale the gradients (torch's kernel); True when any is not finite."""
        self.scaler.unscale_(opt)
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return False
        return not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

    def settle(self, step: int, overflow: bool) -> str:
        """'redo' (the scale moved: run the step again), 'skip' or 'apply'."""
        want = self._expected(step)
        if want is False and overflow and self.scale_now > 1.0:
            return self._redo(step, self.scale_now * self.plan.backoff_factor)
        if (
            want is True
            and not overflow
            and self.scale_now * 2 <= MAX_SCALE
            and not self.plan.fixed
        ):
            return self._redo(step, self.scale_now * self.plan.growth_factor)
        self._retries = 0
        self._last_overflow = overflow
        self.used[step] = self.scale_now
        if want is True and not overflow:
            self.forced.append(step)
            return "skip"
        return "skip" if overflow else "apply"

    def hold(self) -> None:
        """No update this step (a mitigation skips it): the scale stays as it was."""
        self._retries = 0
        self._set(self.scale_now)

    def finish(self, step: int, opt: torch.optim.Optimizer, skip: bool) -> None:
        """The step's update (unless skipped) and GradScaler's scale dynamics after it."""
        if skip:
            self.skipped.append(step)
            self.scale_now *= self.plan.backoff_factor
            self.tracker = 0
        else:
            opt.step()
            self.tracker += 1
            if self.tracker >= self.plan.growth_interval:
                self.scale_now *= self.plan.growth_factor
                self.tracker = 0
        self._set(self.scale_now)

    # -- internals --------------------------------------------------------------------
    def _set(self, value: float) -> None:
        if self.scaler._scale is None:  # lazily made by the first scale()
            self.scaler._init_scale = value
        else:
            self.scaler.update(new_scale=float(value))  # also clears the per-step unscale record

    def _redo(self, step: int, value: float) -> str:
        self.redone.setdefault(step, []).append(self.scale_now)
        self._retries += 1
        self.scale_now = value
        self._set(value)
        return "redo"

    def _expected(self, step: int) -> bool | None:
        """Whether the run skipped `step`: its log's flag; else a drop in its logged scale;
        else, with a skip count from Adam's counters, no more skips than the run made."""
        if self.plan.force is not None:
            return step in self.plan.force
        if step in self.plan.flags:
            return self.plan.flags[step]
        if self.plan.logged:
            return self._logged_skip(step)
        k = self.plan.skips
        if k is not None and len(self.skipped) >= k:
            return False
        return None

    def _logged_scale(self, step: int) -> float | None:
        lg = self.plan.logged
        if not lg:
            return None
        prev, cur = lg.get(step - 1), lg.get(step)
        if prev is None or cur is None or prev == cur:
            return cur if cur is not None else prev
        # A change point: the two readings of the log differ here. The data decides at the
        # first drop: if the step before overflowed at the common scale, the log holds the
        # scale each step used (the drop follows the skip); else the scale left after it.
        if self.plan.align is None and cur < prev and self._last_overflow is not None:
            self.plan.align = "used" if self._last_overflow else "after"
            self.plan.source += f" (the scale {'each step used' if self.plan.align == 'used' else 'update() left after each step'}, read from its first drop)"
        return cur if self.plan.align == "used" else prev

    def _logged_skip(self, step: int) -> bool | None:
        lg = self.plan.logged
        if self.plan.align == "used":
            nxt, cur = lg.get(step + 1), lg.get(step)
            return None if nxt is None or cur is None else nxt < cur
        if self.plan.align == "after":
            cur, prev = lg.get(step), lg.get(step - 1)
            return None if cur is None or prev is None else cur < prev
        return None

    def describe(self) -> str:
        parts = [f"start {self.plan.start if self.plan.start is not None else self.plan.prior:g}"]
        if self.skipped:
            parts.append(f"skipped steps {self.skipped}")
        if self.redone:
            parts.append(
                "redone at another scale: "
                + ", ".join(
                    f"step {s} (tried {', '.join(f'{v:g}' for v in vs)})"
                    for s, vs in self.redone.items()
                )
            )
        if self.forced:
            parts.append(
                f"skipped as the run's log says without an overflow in the replay: {self.forced}"
            )
        return "; ".join(parts)
