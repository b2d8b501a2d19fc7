"""What a replay is asked to do and what it measured: the window's configuration, each
replayed step's record, each tensor's match against *after*, the whole result."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptforensics.core.options import ReplayOptions
from ckptforensics.engine.replay.logcheck import LogCheck
from ckptforensics.engine.replay.probes import PassStats
from ckptforensics.engine.replay.routers import RouterFigures
from ckptforensics.engine.replay.rowstats import RowStats

__all__ = [
    "AFTER_SHARE",
    "after_share",
    "ReplayConfig",
    "StepRecord",
    "GradEvidence",
    "TensorMatch",
    "ReplayResult",
    "local_tensor",
    "local_state",
]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class ReplayConfig(ReplayOptions):
    """What to replay (the window) and how (`options.ReplayOptions`, every field of which
    is a keyword here too).

    Attributes:
        before, after: checkpoint paths (after optional: then one step is replayed).
        batch: batch file, batch log (.h5) or `module:function`; None with `data`.
        step: the step to replay when there is no *after*.
    """

    before: Path
    after: Path | None = None
    batch: str | None = None
    step: int | None = None


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One replayed step: loss, pre-clip grad norm, whether the optimizer skipped it."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool
    lr: tuple[float, ...]
    loss_scale: float | None
    sample_loss: tuple[float, ...]
    sample_grad_sq: tuple[float, ...] | None
    sample_ids: tuple[int, ...] | None
    param_grad_nonfinite: tuple[str, ...]
    param_grad_rms: dict[str, float] = field(
        default_factory=dict
    )  # checkpoint name -> RMS of its gradient
    # RMS_t = sqrt(mean(g^2 / v_hat)) against the second moment before this step
    # (StableAdamW, Wortsman 2304.13013), and elements with g^2 > 5000 v (SPAM 2501.06842).
    param_rms_t: dict[str, float] = field(default_factory=dict)
    param_spikes: dict[str, int] = field(default_factory=dict)
    logit_absmax: float = math.nan  # max |logit| of the step's batch
    skipped_by: str = (
        ""  # who skipped the update: "loss scaler", "optimizer rule" (SkipStepAdamW), "mitigation"
    )
    log_z: float = math.nan  # mean logsumexp of the logits (softmax normaliser, nats)
    sample_tokens: tuple[int, ...] = ()  # target tokens of each row (weights of its mean loss)
    router: RouterFigures | None = None  # a Mixture-of-Experts model's routing (`routers`)


@dataclass(frozen=True, slots=True)
class GradEvidence:
    """One step's gradient evidence, merged over the ranks: the step's loss, the pre-clip
    total norm, parameters (model names) with non-finite gradients, per parameter RMS /
    RMS_t / spikes (checkpoint names), per row loss and gradient norm^2, logit stats."""

    loss: float
    total: float
    nonfinite: tuple[str, ...]
    rms: dict[str, float]
    rms_t: dict[str, float]
    spikes: dict[str, int]
    sample_loss: tuple[float, ...]
    sample_grad_sq: tuple[float, ...] | None
    logit_absmax: float
    log_z: float
    sample_tokens: tuple[int, ...] = ()


def local_tensor(t: Any) -> Any:
    """A rank's shard of a DTensor (FSDP2 parameter, gradient or moment); others as is."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_state(state: dict | None) -> dict:
    return {k: local_tensor(v) for k, v in (state or {}).items()}


@dataclass(frozen=True, slots=True)
class TensorMatch:
    """Replayed vs *after* for one tensor: max |difference|, elements past tolerance and past the bound."""

    name: str
    where: str
    max_abs_diff: float
    mismatched: int
    numel: int
    tolerance: float
    impossible: int = 0  # elements further from *after* than any Adam step allows
    worst: float = (
        0.0  # the largest |difference| / tolerance of an element (< 1: every element within)
    )


@dataclass(slots=True)
class ReplayResult:
    """Everything the replay measured; detectors turn it into findings."""

    config: dict[str, dict[str, Any]]
    precision: str
    records: list[StepRecord] = field(default_factory=list)
    passes: dict[int, PassStats] = field(default_factory=dict)
    fp32_passes: dict[int, PassStats] = field(default_factory=dict)
    row_stats: dict[int, list[RowStats]] = field(default_factory=dict)
    matches: list[TensorMatch] | None = None
    logged: dict[int, dict[str, float]] = field(default_factory=dict)
    baseline: dict[int, dict[str, float]] = field(
        default_factory=dict
    )  # logged steps before the window
    # the run's logged steps right after the window, up to `core.stats.LOSS_FOLLOW` of them:
    # whether the loss followed a signal on the window's last steps (`detectors.replay.onset`)
    following: dict[int, dict[str, float]] = field(default_factory=dict)
    check: LogCheck = field(default_factory=LogCheck)  # every replayed step against the run's log
    plan: Any = None  # the settled Plan the replay ran (bisect continues from it)
    diagnosis: str = ""  # the likeliest reason the first checked step misses the log, where it does
    # a replay that missed the log: the explanations replayed (`variants.Variant`), the
    # plan as planned first; the one that landed, whose result this is, where one did
    variants: list[Any] = field(default_factory=list)
    explained_by: Any = None


# The share of *after*'s elements a replay may miss and still reproduce it
# (`detectors.replay.state.reproduction`, `engine.replay.variants`).
AFTER_SHARE = 0.01


def after_share(result: ReplayResult) -> float | None:
    """The share of *after*'s elements the replay missed (None without *after*)."""
    if not result.matches:
        return None
    total = sum(m.numel for m in result.matches) or 1
    return sum(m.mismatched for m in result.matches) / total
