"""How noisy a log is (`log_noise`, docs/signatures.md#log-noise), and which rules read
that noise (`NOISE_RULES`): an excerpt whose only evidence is its last line rising by one of
them is undecidable (`undecidable_last_line`, docs/signatures.md#log-undecided)."""

from __future__ import annotations

import math

import numpy as np

from ckptforensics.core.stats import expected_exceedances, family_z, robust_sigma, tail_df
from ckptforensics.detectors.log.blips import blips
from ckptforensics.detectors.log.evidence import LogEvidence, Onset, TriageConfig, printed_lines


def log_noise(ev: LogEvidence, cfg: TriageConfig) -> dict[str, float | int | str]:
    """How noisy the log is: the loss's robust spread per step, its blips, and how heavy its
    tail is against a normal noise of that spread (stats.tail_df, stats.expected_exceedances;
    docs/signatures.md#log-noise)."""

    z = ev.loss.z[np.isfinite(ev.loss.z) & (ev.loss.z != 0)]
    lv = np.log10(np.maximum(np.asarray(ev.loss.values, dtype=np.float64), 1e-12))
    steps_judged = int(z.size)
    tail = blips(ev, cfg)
    over = int(np.sum(z > cfg.z))
    df = tail_df(z)
    sigma = robust_sigma(np.diff(lv)) / math.sqrt(2) if lv.size > 3 else math.nan
    kind = (
        "quiet" if over <= 1 else ("heavy-tailed" if (math.isfinite(df) and df < 10) else "noisy")
    )
    return {
        "loss_noise_pct_per_step": round(100 * (10**sigma - 1), 2)
        if math.isfinite(sigma)
        else math.nan,
        "steps_judged": steps_judged,
        "steps_over_z": over,
        "expected_over_z_if_normal": expected_exceedances(steps_judged, cfg.z),
        "recovering_blips": len(tail),
        "largest_blip_z": max((zb for zb, _ in tail.values()), default=0.0),
        "tail_df": df,
        "family_z": family_z(max(steps_judged, 1)),
        "kind": kind,
        "ignored_columns": ", ".join(ev.ignored_columns),
    }


# Rules that read the noise (a z against a spread, measured or floored); on an excerpt's last
# line alone they cannot tell a hard batch from an onset. The ratio rules, a non-finite loss,
# an LR jump, a NaN count and a collapsing loss scale need no line after.
NOISE_RULES = (
    "trend",
    "persisting-run",
    "short-z",
    "short-joint",
    "held",
    "held-shift",
    "one-reference-line",
    "tail",
)
UNDECIDABLE = "the last line rises; one line cannot tell a hard batch from an onset"


def undecidable_last_line(onsets: list[Onset], ev: LogEvidence, cfg: TriageConfig) -> bool:
    """Whether an excerpt's only evidence is its last line rising by a noise rule: nothing
    after it is logged, so it may be a hard batch as well as an onset (said, not called)."""
    lines = printed_lines(ev)
    if not onsets or not ev.excerpt or not lines or len(lines) >= cfg.judge_after:
        return False
    last = lines[-1]
    return all(o.step == last and o.rule in NOISE_RULES for o in onsets)
