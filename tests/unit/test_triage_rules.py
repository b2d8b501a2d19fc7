"""triage's rules on short pasted excerpts and noisy logs, from text alone (no training)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from ckptforensics.detectors.log import TriageConfig, log_evidence, log_onsets
from ckptforensics.triage import triage

ROOT = Path(__file__).resolve().parents[2]


def _ds_line(it: int, loss: float, scale: float, skipped: int, nan: int = 0) -> str:
    """Megatron-DeepSpeed's training_log line (megatron/training.py), field by field; a run
    whose engine computed no grad norm prints 0.000 on every line."""
    return (f" iteration {it:8d}/  292968 | consumed samples: {it * 512:12d} | consumed tokens: {it * 512 * 2048:12d} |"
            f" elapsed time per iteration (ms): 4012.8 | learning rate: 5.994E-05 | global batch size:   512 | lm loss: {loss:.6E} |"
            f" loss scale: {scale:.1f} | grad norm: 0.000 | actual seqlen:  2048 | number of skipped iterations: {skipped:3d} |"
            f" number of nan iterations: {nan:3d} | samples per second: 127.591 | tokens per gpu per second (tgs): 2041.4 | TFLOPs: 109.38 |")  # fmt: skip


def test_a_pasted_megatron_deepspeed_excerpt_names_its_onset_and_rule(tmp_path: Path) -> None:
    """Issue 32's excerpt: loss 6.4 -> 14 between two lines, the loss scale collapsing
    65536 -> 4096 with skipped iterations, grad norm 0.000 on every line."""
    lines = [_ds_line(3000 + 10 * k, loss, scale, skip) for k, (loss, scale, skip) in enumerate(
        [(6.43, 65536, 0), (6.41, 65536, 0), (6.44, 65536, 0), (6.40, 32768, 1), (14.12, 8192, 2), (13.9, 4096, 1), (12.7, 4096, 0)])]  # fmt: skip
    log = tmp_path / "pasted.txt"
    log.write_text("\n".join(lines) + "\n")
    res = triage(log, None)
    assert res.first_bad_step == 3040 and res.rule in ("short-z", "loss-scale-collapse")
    assert res.noise["ignored_columns"] == "grad_norm"  # 0.000 on every line: never computed
    assert "grad_norm" not in {o.signal for o in res.onsets}


def test_healthy_excerpts_give_no_onset(tmp_path: Path) -> None:
    """A routine backoff (one halving, a skipped iteration) and a loss that wiggles 2%."""
    vals = [(6.43, 65536, 0), (6.38, 65536, 0), (6.47, 32768, 1), (6.36, 32768, 0), (6.41, 32768, 0), (6.33, 32768, 0)]
    log = tmp_path / "pasted.txt"
    log.write_text("\n".join(_ds_line(3000 + 10 * k, *v) for k, v in enumerate(vals)) + "\n")
    assert triage(log, None).first_bad_step is None


def test_nan_iterations_are_an_onset(tmp_path: Path) -> None:
    vals = [(6.43, 65536, 0, 0), (6.38, 65536, 0, 0), (6.41, 65536, 1, 1), (6.39, 65536, 0, 0)]
    log = tmp_path / "pasted.txt"
    log.write_text("\n".join(_ds_line(3000 + 10 * k, *v) for k, v in enumerate(vals)) + "\n")
    res = triage(log, None)
    assert res.first_bad_step == 3020 and res.rule == "nan-iterations"


def test_an_excerpt_of_megatron_lms_own_log(tmp_path: Path) -> None:
    """Seven lines cut from the log Megatron-LM printed (fixtures/data/megatron-lm-log): the
    LR fault of iteration 30 by its logged LR (Megatron logs N + 1's LR on line N)."""
    text = (ROOT / "fixtures" / "data" / "megatron-lm-log" / "train.log").read_text().splitlines()
    cut = [line for line in text if any(f" iteration {i:8d}/" in line for i in range(25, 32))][:7]
    assert len(cut) == 7
    log = tmp_path / "excerpt.log"
    log.write_text("\n".join(cut) + "\n")
    res = triage(log, None)
    assert res.first_bad_step == 30 and res.rule == "lr-growth"


def _noisy(seed: int, n: int = 400, blip_every: int = 0, at: int | None = None) -> dict[int, dict[str, float]]:
    """A slowly falling loss with heavy-tailed (Student-t, 3 dof) noise, hard-batch blips every
    `blip_every` steps, and (at `at`) a level that rises 40% and stays."""
    rng = np.random.default_rng(seed)
    rows = {}
    for s in range(1, n + 1):
        loss = 3.0 * (1 + 0.5 * math.exp(-s / 100)) * math.exp(0.03 * rng.standard_t(3))
        if blip_every and s % blip_every == 7:
            loss *= 2.2
        if at is not None and s >= at:
            loss *= 1.4
        rows[s] = {"loss": loss, "grad_norm": 1.0 * math.exp(0.05 * rng.normal())}
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_recurring_blips_are_the_logs_own_tail_and_a_held_rise_is_not(seed: int) -> None:
    cfg = TriageConfig()
    onsets, ignored = log_onsets(log_evidence(_noisy(seed, blip_every=37), cfg), cfg)
    assert not onsets, [o.message for o in onsets]
    assert sum(o.rule == "tail" for o in ignored) >= 5
    onsets, _ = log_onsets(log_evidence(_noisy(seed, blip_every=37, at=300), cfg), cfg)
    assert onsets and 300 <= onsets[0].step <= 303, [(o.step, o.rule) for o in onsets]


def test_a_lone_blip_in_a_quiet_log_stays_an_onset() -> None:
    cfg = TriageConfig()
    rows = _noisy(0)
    rows[250]["loss"] *= 2.0  # one poisoned batch: its loss, recovered the next step ...
    rows[250]["grad_norm"] *= 3.0  # ... and its gradient
    onsets, _ = log_onsets(log_evidence(rows, cfg), cfg)
    assert onsets and onsets[0].step == 250 and onsets[0].rule == "trend"


def test_a_loss_blip_the_grad_norm_does_not_see_is_routine() -> None:
    """Issue 32: on a log that blips, a blip that recovers and that the grad norm does not
    confirm is a batch the model found hard (a single rank's micro-batch, junk rows), not an
    onset; the reason says so. Alone on a quiet log, it stays one."""
    cfg = TriageConfig()
    rows = _noisy(0)
    rows[250]["loss"] *= 2.0
    onsets, _ = log_onsets(log_evidence(rows, cfg), cfg)
    assert onsets and onsets[0].step == 250
    rows[150]["loss"] *= 2.0
    onsets, ignored = log_onsets(log_evidence(rows, cfg), cfg)
    assert not onsets, [(o.step, o.rule) for o in onsets]
    assert any(o.step == 250 and o.rule == "tail" and "grad norm" in o.message for o in ignored)


def test_a_held_shift_of_loss_and_grad_norm_under_heavy_tailed_noise() -> None:
    """A fault that lifts the loss 30% and the grad norm 2x under Student-t (2 dof) noise of
    15% a step: no single step stands out, the ranks of the 8 steps after do (Mann-Whitney)."""
    rng = np.random.default_rng(3)
    rows = {}
    for s in range(1, 301):
        up = s >= 200
        rows[s] = {"loss": 2.5 * (1.3 if up else 1.0) * math.exp(0.06 * rng.standard_t(2)), "grad_norm": (2.0 if up else 1.0) * math.exp(0.1 * rng.normal())}
    cfg = TriageConfig()
    onsets, _ = log_onsets(log_evidence(rows, cfg), cfg)
    assert onsets and 200 <= onsets[0].step <= 201 and onsets[0].rule in ("held-shift", "held", "trend"), [(o.step, o.rule) for o in onsets]
    # The same loss without the grad norm moving (a single rank's noise): no onset.
    for r in rows.values():
        r["grad_norm"] = 1.0 * math.exp(0.1 * rng.normal())
    for s in range(200, 301):
        rows[s]["loss"] /= 1.3
    assert not log_onsets(log_evidence(rows, cfg), cfg)[0]


def _lm_line(it: int, loss: float, grad: float, scale: float = 65536.0, skipped: int = 0) -> str:
    """Megatron-LM's training_log line (megatron/training/training.py), as printed."""
    return (f" [2026-12-01 10:00:00] iteration {it:8d}/  500000 | consumed samples: {it * 256:12d} | elapsed time per iteration (ms): 812.4 |"
            f" learning rate: 3.000000E-04 | global batch size:   256 | lm loss: {loss:.6E} | loss scale: {scale:.1f} | grad norm: {grad:.3f} |"
            f" number of skipped iterations: {skipped:3d} | number of nan iterations:   0 |")  # fmt: skip


def _pasted(tmp_path: Path, vals: list[tuple[float, float]]) -> Path:
    log = tmp_path / "pasted.txt"
    log.write_text("\n".join(_lm_line(3000 + 10 * k, loss, grad) for k, (loss, grad) in enumerate(vals)) + "\n")
    return log


def test_a_pasted_megatron_lm_excerpt_names_its_onset_and_rule(tmp_path: Path) -> None:
    """Six lines of Megatron-LM's own print format, logged every 10 iterations: the loss 23%
    up with the grad norm 2.5x on the fifth, still up on the sixth. Too small for the ratio
    rules and for 6 sigma against four lines; loss and grad norm leaving the earlier lines
    together, the loss staying up, decide (the onset lies between iterations 3030 and 3040: the
    line of 3040 is the first to show it)."""
    log = _pasted(tmp_path, [(6.43, 1.21), (6.38, 1.25), (6.45, 1.19), (6.40, 1.23), (7.90, 3.10), (8.40, 2.60)])
    res = triage(log, None)
    assert res.first_bad_step == 3040 and res.rule == "short-joint"
    assert "grad norm" in res.onsets[0].message and "stays above" in res.onsets[0].message
    from click.testing import CliRunner

    from ckptforensics.cli import cli

    out = CliRunner().invoke(cli, ["triage", "--metrics", str(log)])
    assert "first bad step: 3040 (rule: short-joint)" in out.output, out.output
    assert "log noise:" in out.output


@pytest.mark.parametrize(
    "vals",
    [
        # a single rank's blip: the loss alone, back on the next line
        [(6.43, 1.21), (6.38, 1.25), (6.45, 1.19), (7.90, 1.22), (6.41, 1.20), (6.37, 1.24)],
        # a hard batch: loss and grad norm, both back on the next line
        [(6.43, 1.21), (6.38, 1.25), (6.45, 1.19), (7.90, 3.10), (6.41, 1.20), (6.37, 1.24)],
    ],
    ids=["single-rank-blip", "hard-batch"],
)
def test_a_pasted_excerpts_blip_that_recovers_is_no_onset(tmp_path: Path, vals: list[tuple[float, float]]) -> None:
    assert triage(_pasted(tmp_path, vals), None).first_bad_step is None
