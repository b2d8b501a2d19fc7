"""Data statistics of each row of a replayed window (OLMo-core's instance filter and
friends): longest repeated run, longest periodic repeat, distinct-token ratio, tokens no
other row of the window holds. Whole-window numpy ops, not a pass per row."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["RowStats", "row_data_stats", "window_row_stats"]


@dataclass(frozen=True, slots=True)
class RowStats:
    """Data statistics of one row (OLMo-core's instance filter and friends).

    Attributes:
        longest_run: longest stretch of one repeated token.
        periodic_repeat: longest stretch repeating with a period of 2..13 tokens.
        unique_ratio: distinct tokens / tokens.
        unseen: tokens of the row that no other row of the window contains.
        length: tokens in the row.
    """

    longest_run: int
    periodic_repeat: int
    unique_ratio: float
    unseen: int
    length: int


def _longest_runs(eq: np.ndarray) -> np.ndarray:
    """Longest stretch of True in each row of a boolean [N, L] array (0 where none)."""
    n, L = eq.shape
    if L == 0:
        return np.zeros(n, dtype=np.int64)
    pos = np.arange(1, L + 1)
    # the position of the last False at or before each position: a run ends there
    last_false = np.maximum.accumulate(np.where(eq, 0, pos), axis=1)
    return (pos - last_false).max(1)


def _longest_matches(ids: np.ndarray, periods: range) -> np.ndarray:
    """[B, len(periods)]: for each row and period p, the longest stretch where
    x[t] == x[t - p], plus p itself (0 where there is none, or the row is too short)."""
    b, t = ids.shape
    out = np.zeros((b, len(periods)), dtype=np.int64)
    for k, p in enumerate(periods):
        if t > p:
            runs = _longest_runs(ids[:, p:] == ids[:, :-p])
            out[:, k] = np.where(runs > 0, runs + p, 0)
    return out


def row_data_stats(ids: np.ndarray, others: np.ndarray) -> list[RowStats]:
    """Stats for every row of `ids` [B, T]; `others` = all other tokens of the window.

    Whole-batch numpy ops (a handful per period), not a pass per row: a token is unseen
    when no other row of the batch holds it and `others` does not either."""
    ids = np.asarray(ids)
    if ids.shape[0] == 0:
        return []
    rows_with = _rows_holding([ids])
    alone = rows_with[0][(rows_with[1] == 1) & ~np.isin(rows_with[0], others)]
    return _stats(ids, alone)


def window_row_stats(window: list[np.ndarray]) -> list[list[RowStats]]:
    """`row_data_stats` of each batch [B, T] of a window against the window's other
    batches, in one call: a token is unseen exactly when one row of the whole window holds
    it, and batches of one row length are measured stacked (the same figures as a call per
    batch, with a fixed ~0.2 ms of numpy calls a step saved)."""
    window = [np.asarray(x) for x in window]
    rows_with = _rows_holding([x for x in window if x.shape[0]])
    alone = rows_with[0][rows_with[1] == 1]
    out: list[list[RowStats]] = [[] for _ in window]
    by_len: dict[int, list[int]] = {}
    for k, x in enumerate(window):
        if x.shape[0]:
            by_len.setdefault(x.shape[1], []).append(k)
    for ks in by_len.values():
        every = _stats(np.concatenate([window[k] for k in ks]), alone)
        at = 0
        for k in ks:
            out[k] = every[at : at + window[k].shape[0]]
            at += window[k].shape[0]
    return out


def _rows_holding(batches: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct tokens of these batches, how many of their rows hold each), a row's
    repeats of a token counted once."""
    held = []
    for ids in batches:
        srt = np.sort(ids, axis=1)
        first = np.ones_like(srt, dtype=bool)
        first[:, 1:] = srt[:, 1:] != srt[:, :-1]
        held.append(srt[first])
    if not held:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.unique(np.concatenate(held), return_counts=True)


def _stats(ids: np.ndarray, alone: np.ndarray) -> list[RowStats]:
    """Each row's stats of `ids` [N, T] (N > 0), `alone`: the sorted tokens it alone holds."""
    b, t = ids.shape
    runs = _longest_matches(ids, range(1, 14))
    srt = np.sort(ids, axis=1)
    distinct = (np.diff(srt, axis=1) != 0).sum(1) + (1 if t else 0)
    unseen = np.isin(ids, alone).sum(1)
    return [
        RowStats(
            longest_run=max(int(runs[r, 0]), 1 if t else 0),
            periodic_repeat=int(runs[r, 1:].max()) if t else 0,
            unique_ratio=int(distinct[r]) / max(t, 1),
            unseen=int(unseen[r]),
            length=int(t),
        )
        for r in range(b)
    ]
