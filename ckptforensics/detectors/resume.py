"""Detectors of a resume that lost the data loader's position: the batch log's sample ids
(docs/signatures.md#data-loader-restarted). Pure: the caller reads the ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckptforensics.detectors.base import Finding, Thresholds, cap

__all__ = ["detect_data_restart", "REPEAT_SHARE"]

# Share of a window step's rows whose sample ids an earlier step already consumed. One epoch
# never repeats an id (a sampler's permutation); a second epoch repeats them all. A restart
# is a step from which the ids repeat the run's own earlier steps, in their order.
REPEAT_SHARE = 0.5


def detect_data_restart(
    sample_ids: Mapping[int, Sequence[int]], window: Sequence[int], th: Thresholds | None = None
) -> list[Finding]:
    """The window's first step whose rows were already consumed, in the same order, by an
    earlier step of the log that is not the epoch's start: the data loader restarted at a
    resume (`sample_ids`: step -> dataset index of each row, the flight recorder's /sample_id).

    An epoch boundary also repeats ids, but from the run's first step onward, after the
    whole dataset: a repeat that starts again from step 1 right after the resume only
    differs by where it happens, so the finding says which earlier step it repeats, and a
    repeat of the run's first step counts only before the epoch could have ended (fewer
    distinct ids seen than the log holds steps x rows would need: every id seen once).
    """
    seen: dict[int, int] = {}  # id -> the first step that consumed it
    first_window = min(window) if window else None
    if first_window is None:
        return []
    for s in sorted(sample_ids):
        if s >= first_window:
            break
        for i in sample_ids[s]:
            seen.setdefault(int(i), s)
    if not seen:
        return []
    for s in sorted(w for w in window if w in sample_ids):
        ids = [int(i) for i in sample_ids[s]]
        if not ids:
            continue
        earlier = [seen[i] for i in ids if i in seen]
        share = len(earlier) / len(ids)
        if share <= REPEAT_SHARE:
            for i in ids:
                seen.setdefault(i, s)
            continue
        src = min(earlier)
        repeats = sum(seen.get(i) == src for i in ids) / len(ids)
        return [
            Finding(
                "",
                "data_loader_restarted",
                "run",
                cap(10 * share),
                "critical",
                {
                    "step": s,
                    "repeats_step": src,
                    "repeated_share": share,
                    "same_step_share": repeats,
                    "resume_step": s - 1,
                    "threshold": REPEAT_SHARE,
                },
                f"step {s} re-reads {share:.0%} of the samples step {src} already consumed: the data loader restarted at a resume after step {s - 1}",
                "docs/signatures.md#data-loader-restarted",
                ("data_loader_restarted",),
                primary=True,
            )
        ]
    return []
