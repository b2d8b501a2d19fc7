"""triage's rules on short pasted excerpts and noisy logs, from text alone (no training)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from ckptforensics.cli import cli
from ckptforensics.detectors.log import TriageConfig, log_evidence, log_onsets
from ckptforensics.engine.triage import triage

ROOT = Path(__file__).resolve().parents[2]


def _ds_line(
    it: int, loss: float, scale: float, skipped: int, nan: int = 0, lr: float = 5.994e-05
) -> str:
    """Megatron-DeepSpeed's training_log line (megatron/training.py), field by field; a run
    whose engine computed no grad norm prints 0.000 on every line."""
    return (f" iteration {it:8d}/  292968 | consumed samples: {it * 512:12d} | consumed tokens: {it * 512 * 2048:12d} |"
            f" elapsed time per iteration (ms): 4012.8 | learning rate: {lr:.3E} | global batch size:   512 | lm loss: {loss:.6E} |"
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
    # The line of 3040 overflows again (twice) with the loss up: the incident is dated at its
    # interval's first step. The backoff of 3030 before it, on a flat loss, may be the fault's
    # first overflow or the scaler's routine: set aside with the step it yields to, and the
    # rollback goes before it.
    assert res.first_bad_step == 3031 and res.rule == "loss-scale-backoff", (
        res.first_bad_step,
        res.rule,
    )
    assert any(o.step == 3021 and o.yields_to == 3031 for o in res.ignored), res.ignored
    assert any(o.step == 3040 and o.rule in ("short-z", "loss-scale-collapse") for o in res.onsets)
    assert res.noise["ignored_columns"] == "grad_norm"  # 0.000 on every line: never computed
    assert "grad_norm" not in {o.signal for o in res.onsets}


def test_healthy_excerpts_give_no_onset(tmp_path: Path) -> None:
    """A routine backoff (one halving, a skipped iteration) and a loss that wiggles 2%."""
    vals = [
        (6.43, 65536, 0),
        (6.38, 65536, 0),
        (6.47, 32768, 1),
        (6.36, 32768, 0),
        (6.41, 32768, 0),
        (6.33, 32768, 0),
    ]
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


def _noisy(
    seed: int, n: int = 400, blip_every: int = 0, at: int | None = None
) -> dict[int, dict[str, float]]:
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
        rows[s] = {
            "loss": 2.5 * (1.3 if up else 1.0) * math.exp(0.06 * rng.standard_t(2)),
            "grad_norm": (2.0 if up else 1.0) * math.exp(0.1 * rng.normal()),
        }
    cfg = TriageConfig()
    onsets, _ = log_onsets(log_evidence(rows, cfg), cfg)
    assert (
        onsets
        and 200 <= onsets[0].step <= 201
        and onsets[0].rule in ("held-shift", "held", "trend")
    ), [(o.step, o.rule) for o in onsets]
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
    log.write_text(
        "\n".join(_lm_line(3000 + 10 * k, loss, grad) for k, (loss, grad) in enumerate(vals)) + "\n"
    )
    return log


def test_a_pasted_megatron_lm_excerpt_names_its_onset_and_rule(tmp_path: Path) -> None:
    """Six lines of Megatron-LM's own print format, logged every 10 iterations: the loss 23%
    up with the grad norm 2.5x on the fifth, still up on the sixth. Too small for the ratio
    rules and for 6 sigma against four lines; loss and grad norm leaving the earlier lines
    together, the loss staying up, decide (the onset lies between iterations 3030 and 3040: the
    line of 3040 is the first to show it)."""
    log = _pasted(
        tmp_path,
        [(6.43, 1.21), (6.38, 1.25), (6.45, 1.19), (6.40, 1.23), (7.90, 3.10), (8.40, 2.60)],
    )
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
def test_a_pasted_excerpts_blip_that_recovers_is_no_onset(
    tmp_path: Path, vals: list[tuple[float, float]]
) -> None:
    assert triage(_pasted(tmp_path, vals), None).first_bad_step is None


# Issue 32, third round: each new rule on text or rows alone.


def test_a_loss_scale_backoff_is_dated_where_the_scaler_logged_the_overflow(tmp_path: Path) -> None:
    """Megatron prints the scale after the iteration's backoff: the drop on line N is N's
    overflow (a log of every iteration), or one in the interval line N closes."""
    from ckptforensics.detectors.log.signals import scale_drops

    cfg = TriageConfig()
    for every in (1, 10):
        rows = {
            3000 + every * k: {"loss": 6.4, "loss_scale": 65536.0 if k < 4 else 32768.0}
            for k in range(8)
        }
        (o,) = scale_drops(log_evidence(rows, cfg), cfg)
        assert o.step == 3000 + every * 3 + 1 and o.rule == "loss-scale-backoff", o


def _single_rank(
    seed: int, n: int = 300, long_at: int | None = None, fault: int | None = None
) -> dict[int, dict[str, float]]:
    """One rank's micro-batch loss: quiet steps, junk blips of 1-3 steps (one rank's rows
    several batches in a row), the averaged grad norm flat; `long_at`: a 3-step blip there."""
    rng = np.random.default_rng(seed)
    rows = {}
    left = 0
    for s in range(1, n + 1):
        if left == 0 and rng.random() < 0.04:
            left = int(rng.choice([1, 1, 2, 3]))
        up = left > 0 or (long_at is not None and long_at <= s < long_at + 3)
        left = max(left - 1, 0)
        loss = (
            2.0
            * math.exp(0.02 * rng.normal())
            * (1.8 if up else 1.0)
            * (1.5 if fault is not None and s >= fault else 1.0)
        )
        rows[s] = {
            "loss": loss,
            "grad_norm": math.exp(0.05 * rng.normal())
            * (2.0 if fault is not None and s >= fault else 1.0),
        }
    return rows


def test_a_blip_recovers_within_the_logs_own_blip_durations() -> None:
    """A log whose blips last 1-3 steps recovers within 3 or 4 (its geometric fit's 99%
    quantile), so a 3-step blip is routine there; a quiet log keeps 2; a held rise stays one."""
    from ckptforensics.detectors.log.blips import RECOVER, recovery_horizon

    cfg = TriageConfig()
    ev = log_evidence(_single_rank(1, long_at=200), cfg)
    assert recovery_horizon(ev, cfg) >= 3
    onsets, ignored = log_onsets(ev, cfg)
    assert not onsets, [(o.step, o.rule) for o in onsets]
    assert recovery_horizon(log_evidence(_noisy(0), cfg), cfg) == RECOVER
    onsets, _ = log_onsets(log_evidence(_single_rank(1, fault=200), cfg), cfg)
    assert onsets and 200 <= onsets[0].step <= 201, [(o.step, o.rule) for o in onsets]


def test_the_onset_is_the_first_step_of_the_excursion_that_persists() -> None:
    """A blip two steps before a fault, the loss back at its level between: the onset is the
    fault's first step, not the blip (its excursion does not continue from the blip)."""
    cfg = TriageConfig()
    rows = _noisy(0)
    rows[248]["loss"] *= 2.5
    for s in range(250, 401):
        rows[s]["loss"] *= 1.8
        rows[s]["grad_norm"] *= 3.0
    onsets, _ = log_onsets(log_evidence(rows, cfg), cfg)
    assert onsets and onsets[0].step == 250, [(o.step, o.rule) for o in onsets]


def test_a_held_rise_starts_where_its_level_continues_from() -> None:
    """The held rule's first step keeps half its excess on the next: a blip followed by a step
    halfway back is not the start of the rise after it."""
    from ckptforensics.detectors.log.held import held_rise

    cfg = TriageConfig()
    rows = _noisy(0)
    rows[249]["loss"] *= 1.6
    rows[250]["loss"] *= 1.1
    for s in range(251, 401):
        rows[s]["loss"] *= 1.5
    (o,) = held_rise(log_evidence(rows, cfg), cfg)
    assert o.step in (250, 251), o


def _nogn_lines(tmp_path: Path, losses: list[float], every: int = 5) -> Path:
    """Megatron-DeepSpeed lines with no grad norm computed (0.000 on every line)."""
    log = tmp_path / "pasted.txt"
    log.write_text(
        "\n".join(_ds_line(160 + every * k, v, 1.0, 0) for k, v in enumerate(losses)) + "\n"
    )
    return log


def test_an_excerpt_with_one_reference_line(tmp_path: Path) -> None:
    """A fault at the excerpt's second line: one line to judge by. The loss stays 9.6% or more
    above it on every later line, 32% on one (the trend rule's 4.7% floor as the spread):
    the second line is the onset, by the one-reference-line rule; a wiggle is none."""
    res = triage(_nogn_lines(tmp_path, [1.838, 2.094, 4.562]), None)
    assert res.first_bad_step == 165 and res.rule == "one-reference-line", (
        res.first_bad_step,
        res.rule,
    )
    assert triage(_nogn_lines(tmp_path, [1.838, 1.95, 1.90]), None).first_bad_step is None
    assert (
        triage(_nogn_lines(tmp_path, [1.838, 2.6, 1.85]), None).first_bad_step is None
    )  # back on the last line
    # A single rank's blip over two lines, falling back on the last (still 27% up): not held at z.
    assert triage(_nogn_lines(tmp_path, [2.48, 3.51, 3.16]), None).first_bad_step is None


def test_an_excerpt_ending_on_its_first_rising_line_is_undecided(tmp_path: Path) -> None:
    """Nine quiet lines and a last one up 65% with the grad norm: a hard batch or an onset,
    the excerpt cannot say. No onset is called, and the report says why."""
    vals = [
        (2.85, 0.94),
        (2.76, 0.92),
        (2.72, 0.78),
        (2.73, 1.06),
        (2.70, 0.91),
        (2.75, 0.97),
        (2.62, 1.27),
        (2.82, 1.18),
        (2.73, 1.26),
        (4.49, 2.84),
    ]
    log = _pasted(tmp_path, vals)
    res = triage(log, None)
    assert (
        res.first_bad_step is None
        and res.undecided
        and "one line cannot tell a hard batch from an onset" in res.undecided
    )
    from click.testing import CliRunner

    from ckptforensics.cli import cli

    out = CliRunner().invoke(cli, ["triage", "--metrics", str(log)])
    assert "the last line rises" in out.output, out.output
    # One line more, still up: an onset.
    res = triage(_pasted(tmp_path, [*vals, (4.80, 2.5)]), None)
    assert res.first_bad_step == 3090, (res.first_bad_step, res.rule)


def test_an_excerpts_large_blip_that_recovers_on_the_next_line_is_no_onset(tmp_path: Path) -> None:
    """A junk batch doubling the loss on one line of a pasted excerpt, back on the next: far
    past 6 sigma of the lines before it, but seen to recover (short-z needs it to persist)."""
    vals = [1.62, 2.02, 1.58, 1.59, 3.15, 1.65, 1.72, 2.23, 2.73, 1.56, 1.65]
    assert triage(_nogn_lines(tmp_path, vals, every=1), None).first_bad_step is None


def test_an_excerpt_with_two_reference_lines(tmp_path: Path) -> None:
    """Two lines before the fault, too few for short-z: judged above the larger of them (short-z
    sees only the last line rise)."""
    res = triage(_nogn_lines(tmp_path, [1.84, 1.80, 2.10, 2.60]), None)
    assert res.first_bad_step == 170 and res.rule == "one-reference-line", (
        res.first_bad_step,
        res.rule,
    )


def test_one_reference_line_decides_only_where_the_measured_rules_find_nothing(
    tmp_path: Path,
) -> None:
    """A low first line makes every later line look risen against it alone; with three lines
    before the jump, short-z (a spread of the excerpt's own) names the jump instead."""
    log = tmp_path / "pasted.txt"
    vals = [(1.482, 1.298), (1.721, 1.328), (1.818, 1.274), (2.960, 3.552), (2.818, 2.369)]
    log.write_text(
        "\n".join(_lm_line(148 + k, loss, grad) for k, (loss, grad) in enumerate(vals)) + "\n"
    )
    res = triage(log, None)
    assert res.first_bad_step in (150, 151) and res.rule != "one-reference-line", (
        res.first_bad_step,
        res.rule,
    )


def test_an_excerpts_overflow_the_next_line_confirms_is_the_onset(tmp_path: Path) -> None:
    """An overflow (the scale halves, one skipped iteration) and, on the next and last line, the
    loss and grad norm up: the overflow is dated where the scaler logged it, confirmed by the
    line after it, not an undecided last line."""
    log = tmp_path / "pasted.txt"
    rows = [
        (224, 1.841, 1.161, 131072.0, 0),
        (226, 2.074, 1.201, 131072.0, 0),
        (228, 1.587, 1.242, 131072.0, 0),
        (230, 1.499, None, 65536.0, 1),
        (232, 2.555, 2.407, 65536.0, 0),
    ]
    text = [_lm_line(it, loss, grad or 0.0, scale, skip) for it, loss, grad, scale, skip in rows]
    text[3] = text[3].replace(
        " grad norm: 0.000 |", ""
    )  # an overflowed iteration prints no grad norm
    log.write_text("\n".join(text) + "\n")
    res = triage(log, None)
    assert res.first_bad_step == 229 and res.rule == "loss-scale-backoff", (
        res.first_bad_step,
        res.rule,
        res.undecided,
    )


# Issue 32, fourth round: the held-out misses' classes (log draws 9923 and 9934), planted.


def test_a_routine_backoff_before_the_faults_overflows_yields_and_the_rollback_precedes_it(
    tmp_path: Path,
) -> None:
    """Held-out log draw 10022's class: Megatron-LM lines every 5 iterations, fp16, no LR
    column; the line of 165 backs the scale off with the loss flat (the scaler's routine), the
    LR fault comes at 167, and the line of 170 overflows again with the loss and grad norm up.
    The incident is dated in 170's interval (166), the backoff of 161-165 set aside, and the
    rollback checkpoint precedes it: it might have been the fault's first overflow."""
    rows = [
        (155, 2.578, 0.836, 131072.0, 0),
        (160, 2.537, 0.976, 131072.0, 0),
        (165, 2.540, None, 65536.0, 1),
        (170, 3.160, 2.817, 32768.0, 1),
        (175, 4.430, 5.082, 32768.0, 0),
    ]
    text = [_lm_line(it, loss, grad or 0.0, scale, skip) for it, loss, grad, scale, skip in rows]
    text = [t.replace(" learning rate: 3.000000E-04 |", "") for t in text]
    text[2] = text[2].replace(" grad norm: 0.000 |", "")
    log = tmp_path / "logs" / "train.log"
    log.parent.mkdir()
    log.write_text("\n".join(text) + "\n")
    run = tmp_path / "run"
    for step in (155, 163, 170):  # an HF Trainer's saves, complete by its rule
        ck = run / f"checkpoint-{step}"
        ck.mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, str(ck / "model.safetensors"))
        torch.save({"state": {}, "param_groups": []}, ck / "optimizer.pt")
        (ck / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    res = triage(log, run)
    assert res.rollback_caveat is None  # 155 is not the step just before the onset
    assert res.first_bad_step == 166 and res.rule == "loss-scale-backoff", (
        res.first_bad_step,
        res.rule,
    )
    assert {o.step for o in res.ignored if o.yields_to == 166} == {161, 165}, res.ignored
    assert res.rollback_step == 155, res.rollback_step  # 163 is past the set-aside backoff


def test_lightnings_rtol_rule_lets_a_blip_the_excerpt_sees_recover_pass(tmp_path: Path) -> None:
    """Held-out log draw 10004's class: nine lines of a healthy run, a hard batch 3.4x the loss
    and 2.5x the grad norm on one line, back on the next. Lightning's rtol 2 would stop the
    run; as an onset it needs the excursion to persist, as short-z does. On the last line,
    where recovery cannot be seen, it stands."""
    vals = [(1.71, 1.27), (1.63, 1.52), (1.69, 1.17), (5.68, 2.98), (1.58, 1.19), (1.72, 1.42)]
    vals += [(1.65, 1.37), (1.65, 1.58), (1.73, 1.26)]
    assert triage(_pasted(tmp_path, vals), None).first_bad_step is None
    res = triage(_pasted(tmp_path, vals[:4]), None)
    assert res.first_bad_step == 3030 or res.undecided, (res.first_bad_step, res.undecided)


@pytest.mark.parametrize("confirmed", [False, True])
def test_a_backoff_the_loss_does_not_confirm_on_its_line_yields_to_a_later_start(
    tmp_path: Path, confirmed: bool
) -> None:
    """Megatron-DeepSpeed lines every 5 iterations, fp16, no grad norm computed: the line of
    190 backs the scale off (an overflow somewhere in 186-190, dated 186), line 185 printed
    186's LR unchanged and line 190 the jumped one (the LR fault lies in 187-191), and the loss
    rises only on the line of 195. The LR dates the incident later in the backoff's own
    interval: 187, the backoff ignored and said why. Where the loss is up on the backoff's own
    line, the backoff confirms itself and stands at the interval's first step."""
    rng = np.random.default_rng(0)
    text = []
    for it in range(5, 301, 5):
        loss = 2.0 * (1 + math.exp(-it / 60)) * math.exp(0.03 * rng.standard_t(3))
        if it >= 195 or (confirmed and it == 190):
            loss *= 3.3
        scale = 131072.0 if it < 190 else 65536.0 if it == 190 else 32768.0
        skipped = int(it in (190, 195))
        text.append(_ds_line(it, loss, scale, skipped, lr=3e-3 if it < 190 else 0.27))
    log = tmp_path / "train.log"
    log.write_text("\n".join(text) + "\n")
    res = triage(log, None)
    if confirmed:
        assert res.first_bad_step == 186 and res.rule == "loss-scale-backoff", res.rule
        return
    assert res.first_bad_step == 187 and res.rule == "lr-growth", (res.first_bad_step, res.rule)
    assert any(
        o.step == 186 and o.rule == "loss-scale-backoff" and "lr-growth" in o.message
        for o in res.ignored
    ), [(o.step, o.rule) for o in res.ignored]


def _hard_batch_then_shift(seed: int, at: int = 269) -> dict[int, dict[str, float]]:
    """A falling loss under heavy-tailed (Student-t, 2 dof) noise; the same hard batch every
    50 steps (a fixed data order: 68, 118, ..., 268), loss 3.4x and grad norm 2.7x; an LR
    fault at `at` that lifts the loss 35% and the grad norm 1.6x from the next step on (an
    update at the new LR shows in the step after it). The last hard batch falls one step
    before the fault."""
    rng = np.random.default_rng(seed)
    rows = {}
    for s in range(1, 301):
        loss = 1.75 * (1 + 0.8 * math.exp(-s / 60)) * math.exp(0.03 * rng.standard_t(2))
        grad = 1.2 * math.exp(0.08 * rng.normal())
        if s % 50 == 18:
            loss, grad = loss * 3.4, grad * 2.7
        if s > at:
            loss, grad = loss * 1.35, grad * 1.6
        rows[s] = {"loss": loss, "grad_norm": grad}
    return rows


@pytest.mark.parametrize("seed", [1, 2, 7])
def test_a_held_shift_starts_at_its_first_step_not_a_hard_batch_before_it(seed: int) -> None:
    """The rank test's best window starts at the hard batch (268: it ranks top on either side),
    the step after it is back at the old level (269), the new level starts at 270: the change
    point by each step's likelihood under either level, outliers of both capped (biweight)."""
    from ckptforensics.detectors.log.shift import held_shift

    cfg = TriageConfig()
    ev = log_evidence(_hard_batch_then_shift(seed), cfg)
    (o,) = held_shift(ev, cfg)
    assert o.step == 270 and o.rule == "held-shift", o
    onsets, _ = log_onsets(ev, cfg)
    assert onsets and onsets[0].step == 270, [(o.step, o.rule) for o in onsets]


def _hard_batch_every_64_on_lines_of_5(seed: int) -> dict[int, dict[str, float]]:
    """Megatron lines every 5 iterations, fp16, a hard batch at iteration 24 of every 64: its
    lines of 155 and 220 count a skipped iteration (the hard batch overflowed, and the line's
    loss averages the advanced iterations only), that of 280 shows the loss 1.4x and the grad
    norm 3x (the hard batch is one of the line's five), 90's is not seen."""
    rng = np.random.default_rng(seed)
    rows, scale = {}, 131072.0
    for line in range(5, 301, 5):
        hard = any(s % 64 == 24 for s in range(line - 4, line + 1))
        loss = 2.0 * (1 + math.exp(-line / 80)) * math.exp(0.03 * rng.normal())
        grad, skipped = math.exp(0.05 * rng.normal()), 0.0
        if hard and 100 < line < 250:
            skipped, scale = 1.0, scale / 2
        elif hard and line > 250:
            loss, grad = loss * 1.4, grad * 3.0
        rows[line] = {"loss": loss, "grad_norm": grad, "loss_scale": scale, "skipped": skipped}
    return rows


@pytest.mark.parametrize("seed", [0, 1])
def test_a_hard_batch_recurs_on_a_log_of_every_5_iterations(seed: int) -> None:
    """An epoch of 64 iterations shows on lines every 5 as 65 and 60 apart: the recurrence is
    read within the lines' resolution, so the blip of 280 is the data's (no onset)."""
    cfg = TriageConfig()
    onsets, ignored = log_onsets(log_evidence(_hard_batch_every_64_on_lines_of_5(seed), cfg), cfg)
    assert not onsets, [(o.step, o.rule) for o in onsets]
    assert any(o.step == 280 and "every" in o.message for o in ignored)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_blip_on_the_last_steps_the_grad_norm_does_not_see_is_routine(seed: int) -> None:
    """One rank's micro-batch loss, its junk blips 1.8x: the last two steps 3x, where recovery
    cannot be seen yet and no other blip reaches two thirds its size. The averaged grad norm
    stays flat to the end: routine, as an unconfirmed blip mid-log is. With the grad norm 3x
    on those steps it is an onset."""
    cfg = TriageConfig()
    for grad, onset in ((1.0, None), (3.0, 299)):
        rows = _single_rank(seed)
        for s in (299, 300):
            rows[s]["loss"] *= 3.0
            rows[s]["grad_norm"] *= grad
        onsets, ignored = log_onsets(log_evidence(rows, cfg), cfg)
        assert (onsets[0].step if onsets else None) == onset, [(o.step, o.rule) for o in onsets]
        if onset is None:
            assert any(o.step == 299 and "to the end" in o.message for o in ignored)


def _drifting(seed: int, at: int | None = None) -> dict[int, dict[str, float]]:
    """A falling loss that wanders slowly (an AR(1) drift of its log: phi 0.95, 0.8% a step,
    the grad norm wandering with it) under heavy-tailed (Student-t, 2 dof) noise of 3% a step;
    from `at` on, an LR fault lifts the loss 35% and the grad norm 1.6x."""
    rng = np.random.default_rng(seed)
    rows, d = {}, 0.0
    for s in range(1, 301):
        d = 0.95 * d + 0.008 * rng.normal()
        loss = 1.75 * (1 + 0.8 * math.exp(-s / 60)) * math.exp(d + 0.03 * rng.standard_t(2))
        grad = 1.2 * math.exp(2 * d + 0.08 * rng.normal())
        if at is not None and s >= at:
            loss, grad = loss * 1.35, grad * 1.6
        rows[s] = {"loss": loss, "grad_norm": grad}
    return rows


@pytest.mark.parametrize("seed", [1, 6, 14, 18, 24])
def test_a_slowly_drifting_loss_is_no_held_shift(seed: int) -> None:
    """Tuning draw 388's class: ranks assume independent steps, and a loss that wanders slowly
    (with its grad norm) ranks 8 steps above the 16 before them (Mann-Whitney p under the
    Sidak level for these seeds) though its level moved no more than it does elsewhere in the
    log: the move must be extreme against the log's own earlier windows. A real shift on the
    same log is still one."""
    from ckptforensics.detectors.log.shift import held_shift

    cfg = TriageConfig()
    ev = log_evidence(_drifting(seed), cfg)
    assert not held_shift(ev, cfg), [o.message for o in held_shift(ev, cfg)]
    onsets, _ = log_onsets(ev, cfg)
    assert not onsets, [(o.step, o.rule) for o in onsets]
    ev = log_evidence(_drifting(seed, at=221), cfg)
    assert [o.step for o in held_shift(ev, cfg)] == [221]
    onsets, _ = log_onsets(ev, cfg)
    assert onsets and onsets[0].step == 221, [(o.step, o.rule) for o in onsets]


# Issue 32, fifth round: classes read on the tuning split's new seeds (430-589), planted.


def _fault_among_hard_batches(seed: int, fault: bool) -> dict[int, dict[str, float]]:
    """Megatron lines every 5 iterations; a hard batch of every 64 iterations (at 22) lifts
    its line's loss 35% and grad norm 2.8x for that line only; an LR fault at 172 lifts the
    loss as much on the line of 175 with the grad norm 2.5x, and the loss decays back over
    the next four lines (tuning log draw 581)."""
    rng = np.random.default_rng(seed)
    rows = {}
    decay = {
        175: (1.33, 2.5),
        180: (1.46, 1.5),
        185: (1.28, 1.4),
        190: (1.19, 1.0),
        195: (1.14, 1.0),
    }
    for line in range(5, 301, 5):
        loss = 1.6 * (1 + 0.5 * math.exp(-line / 80)) * math.exp(0.01 * rng.normal())
        grad = 1.2 * math.exp(0.08 * rng.normal())
        if any(s % 64 == 22 for s in range(line - 4, line + 1)) and line > 60:
            loss, grad = loss * 1.35, grad * 2.8
        if fault and line in decay:
            loss, grad = loss * decay[line][0], grad * decay[line][1]
        rows[line] = {"loss": loss, "grad_norm": grad}
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_excursion_is_measured_against_the_logs_other_blips_not_itself(seed: int) -> None:
    """The fault's five lines over z/2 would stretch the log's blip duration to four lines,
    and the log's usual excess with it, so that it read as one of its own hard batches: both
    are measured without it (the grad norm confirms it), and the onset is its first line. The
    same log without the fault has its hard batches only: no onset."""
    cfg = TriageConfig()
    onsets, _ = log_onsets(log_evidence(_fault_among_hard_batches(seed, False), cfg), cfg)
    assert not onsets, [(o.step, o.rule) for o in onsets]
    onsets, _ = log_onsets(log_evidence(_fault_among_hard_batches(seed, True), cfg), cfg)
    assert onsets and onsets[0].step == 175, [(o.step, o.rule) for o in onsets]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_held_window_that_falls_back_with_the_gradient_quiet_is_no_onset(seed: int) -> None:
    """Heavy-tailed noise holding the loss 20% up for seven steps, then back, the grad norm
    quiet (tuning log draw 554): no onset. Held past the window, it is one."""
    from ckptforensics.detectors.log.held import held_rise

    cfg = TriageConfig()
    rows = _noisy(seed)
    for s in range(235, 242):
        rows[s]["loss"] *= 1.2
    assert not held_rise(log_evidence(rows, cfg), cfg)
    for s in range(242, 260):
        rows[s]["loss"] *= 1.2
    (o,) = held_rise(log_evidence(rows, cfg), cfg)
    assert o.step == 235, o


# Issue 32, seventh round: classes read on held-out log draws 10245/10355, 10278 and 10379.


@pytest.mark.parametrize("seed", [0, 3])
def test_a_hard_batch_met_twice_recurs_where_its_weaker_meetings_fall_on_the_period(
    seed: int,
) -> None:
    """A hard batch every 64 steps that stands out twice (85 and 149, the grad norm up) is
    two meetings, which establish no period: an onset. Where the log shows it again at the
    steps the period predicts (213, 277, 341), too weakly for the blip scan but at robust z 2
    and above both neighbours, it recurs: the log's routine (held-out log draws 10245, 10355)."""
    cfg = TriageConfig()
    rows = _noisy(seed)
    for s in (85, 149):
        rows[s]["loss"] *= 1.6
        rows[s]["grad_norm"] *= 2.0
    onsets, _ = log_onsets(log_evidence(rows, cfg), cfg)
    assert onsets and onsets[0].step == 85, [(o.step, o.rule) for o in onsets]
    for s in (213, 277, 341):
        rows[s]["loss"] *= 1.15
    onsets, ignored = log_onsets(log_evidence(rows, cfg), cfg)
    assert not onsets, [(o.step, o.rule) for o in onsets]
    assert any(o.step == 85 and "every 64 steps" in o.message for o in ignored)


def test_a_held_start_moves_to_where_the_grad_norm_confirms_it() -> None:
    """A held start the grad norm does not confirm moves to the first step of its half-window
    where it does (held-out log draw 10278: noise lifts the loss one step before the LR fault,
    the grad norm rises one step after it); one the grad norm confirms on its own step, or on a
    log without a grad norm, stays."""
    from ckptforensics.detectors.log.evidence import Onset
    from ckptforensics.detectors.log.onsets import _held_start_at_gradient

    cfg = TriageConfig()
    rows = _noisy(0)
    for s in range(252, 301):
        rows[s]["grad_norm"] *= 3.0
    held = Onset(250, "loss", rows[250]["loss"], 3.0, 3.0, "held", "held")
    moved = _held_start_at_gradient(held, log_evidence(rows, cfg), cfg)
    assert moved.step == 252 and moved.rule == "held" and "grad norm" in moved.message
    # Through the combiner: the start moved is kept, so that the rollback goes before it.
    rows = _noisy(0)
    for s in range(250, 301):
        rows[s]["loss"] *= 1.15
        rows[s]["grad_norm"] *= 3.0 if s >= 252 else 1.0
    onsets, ignored = log_onsets(log_evidence(rows, cfg), cfg)
    assert onsets[0].step == 252 and onsets[0].rule == "held", [(o.step, o.rule) for o in onsets]
    assert any(o.step == 250 and o.rule == "held" and o.yields_to == 252 for o in ignored)
    bare = {s: {"loss": r["loss"]} for s, r in rows.items()}
    assert _held_start_at_gradient(held, log_evidence(bare, cfg), cfg) == held
    rows[250]["grad_norm"] *= 3.0
    assert _held_start_at_gradient(held, log_evidence(rows, cfg), cfg) == held


def test_a_pasted_excerpts_fault_that_eases_back_but_stays_past_every_earlier_line(
    tmp_path: Path,
) -> None:
    """A single rank's loss on ten lines (held-out log draw 10408): noisy, then 1.94 -> 2.92 with
    the grad norm 2.4x, 3.01, then 2.57 — easing back, still past every earlier line. The next
    line confirms at z 2 or more; the last need only stay past the earlier lines. Back under
    them on the last line, it is a blip that recovers: no onset."""
    losses = [2.470, 2.196, 2.200, 2.206, 2.405, 2.079, 1.938, 2.922, 3.011, 2.574]
    grads = [1.217, 1.008, 1.008, 0.907, 1.032, 1.248, 0.970, 2.423, 1.582, 1.138]
    res = triage(_pasted(tmp_path, list(zip(losses, grads, strict=True))), None)
    assert res.first_bad_step == 3070 and res.rule == "short-joint", res.onsets
    losses[-1] = 2.30
    assert (
        triage(_pasted(tmp_path, list(zip(losses, grads, strict=True))), None).first_bad_step
        is None
    )


def test_a_held_start_moves_back_to_the_line_whose_grad_norm_led_it() -> None:
    """Lines every 5 iterations (held-out log draw 10417): an LR fault late in the interval of
    230 lifts that line's grad norm (its last iteration's) 1.7x and its loss (the interval's
    mean) 7%; the loss is up 30% from 235. A held start dated 235 moves back to 230. Without
    the grad norm's lead, or on a log of every step, it stays."""
    from ckptforensics.detectors.log.evidence import Onset
    from ckptforensics.detectors.log.onsets import _held_start_at_gradient

    rng = np.random.default_rng(0)
    rows = {}
    for line in range(5, 301, 5):
        loss = 1.6 * (1 + 0.5 * math.exp(-line / 80)) * math.exp(0.01 * rng.normal())
        grad = 1.4 * math.exp(0.05 * rng.normal())
        if line == 230:
            loss, grad = loss * 1.07, grad * 1.7
        elif line > 230:
            loss = loss * 1.3
        rows[line] = {"loss": loss, "grad_norm": grad}
    cfg = TriageConfig()
    held = Onset(235, "loss", rows[235]["loss"], 1.6, 3.0, "held", "held")
    moved = _held_start_at_gradient(held, log_evidence(rows, cfg), cfg)
    assert moved.step == 230 and "line before" in moved.message, moved
    quiet = {
        s: {**r, "grad_norm": rows[225]["grad_norm"]} if s == 230 else r for s, r in rows.items()
    }
    assert _held_start_at_gradient(held, log_evidence(quiet, cfg), cfg).step == 235
    every = {s // 5: r for s, r in rows.items()}
    held1 = Onset(47, "loss", every[47]["loss"], 1.6, 3.0, "held", "held")
    assert _held_start_at_gradient(held1, log_evidence(every, cfg), cfg).step == 47


def test_a_pasted_excerpts_two_line_blip_that_recovers_on_the_third_is_no_onset(
    tmp_path: Path,
) -> None:
    """Six lines of a healthy heavy-tailed run (held-out log draw 10575): 1.60, 1.62, 1.72, then
    2.19 and 2.25, back to 1.63. Short-z's blip recovers within two lines: no onset. Still up on
    the sixth line, it is one."""
    grads = [1.118, 1.064, 1.221, 1.311, 1.339, 1.349]
    losses = [1.6005, 1.6239, 1.7191, 2.1906, 2.2486, 1.6291]
    assert (
        triage(_pasted(tmp_path, list(zip(losses, grads, strict=True))), None).first_bad_step
        is None
    )
    losses[-1] = 2.30
    res = triage(_pasted(tmp_path, list(zip(losses, grads, strict=True))), None)
    assert res.first_bad_step == 3030 and res.rule == "short-z", res.onsets


def test_a_blip_the_grad_norm_does_not_confirm_gives_way_to_an_lr_jump_just_after() -> None:
    """A per-step log (held-out log draw 10510): a blip at 229 the grad norm does not see, still
    up when the LR jump logged at 231 takes over (its effect on the loss from 232). The jump dates the incident; the blip is set
    aside for it, the rollback still before it. Confirmed by the grad norm, the blip stands."""
    cfg = TriageConfig()
    rows = _noisy(0)
    for s, r in rows.items():
        r["lr"] = 1e-3 * (60 if s >= 231 else 1)
        r["loss"] *= 1.8 if s in (229, 230, 231) else (2.2 if s >= 232 else 1.0)
        r["grad_norm"] *= 2.5 if s >= 232 else 1.0
    onsets, ignored = log_onsets(log_evidence(rows, cfg), cfg)
    assert onsets[0].step == 231 and onsets[0].rule == "lr-growth", [
        (o.step, o.rule) for o in onsets
    ]
    assert any(o.step == 229 and o.rule == "trend" and o.yields_to == 231 for o in ignored)
    rows[229]["grad_norm"] *= 3.0
    onsets, _ = log_onsets(log_evidence(rows, cfg), cfg)
    assert onsets[0].step == 229 and onsets[0].rule == "trend", [(o.step, o.rule) for o in onsets]


def test_a_pasted_excerpts_next_line_grad_norm_needs_this_lines_loss_up(tmp_path: Path) -> None:
    """Held-out log draw 10625: the line before the fault's is past the three before it by a
    hair (1.512 over 1.437-1.480, robust z 0.7); the next line's grad norm (1.5x, z 13, after the
    fault) does not make it the onset. The fault's own line, its grad norm up, is. With the loss
    up on the earlier line by the held margin, the next line's grad norm confirms it."""
    losses = [1.480, 1.437, 1.466, 1.512, 1.669, 2.602]
    grads = [1.40, 1.20, 1.22, 1.31, 2.22, 1.79]
    res = triage(_pasted(tmp_path, list(zip(losses, grads, strict=True))), None)
    assert res.first_bad_step == 3040 and res.rule == "short-joint", res.onsets
    losses[3] = 1.75
    res = triage(_pasted(tmp_path, list(zip(losses, grads, strict=True))), None)
    assert res.first_bad_step == 3030 and res.rule == "short-joint", res.onsets


def _hf_saves(run: Path, steps: tuple[int, ...]) -> None:
    """HF Trainer checkpoints at `steps`, complete by its rule."""
    for step in steps:
        ck = run / f"checkpoint-{step}"
        ck.mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, str(ck / "model.safetensors"))
        torch.save({"state": {}, "param_groups": []}, ck / "optimizer.pt")
        (ck / "trainer_state.json").write_text(f'{{"global_step": {step}}}')


def test_a_rollback_to_the_step_just_before_a_loss_dated_onset_carries_a_caveat(
    tmp_path: Path,
) -> None:
    """A lone poisoned batch at 250 (loss and grad norm up, back the next step) with checkpoints
    at 240 and 249: 249 is clean for a bad batch at 250, not for a bad update at 249 (whose loss
    first shows at 250), and the log cannot tell them apart: the rollback is 249 with a caveat
    naming 240. An LR jump the log dates at 250 itself leaves 249 clean: no caveat."""
    import json

    from click.testing import CliRunner

    from ckptforensics.cli import cli

    rows = _noisy(0)
    rows[250]["loss"] *= 2.0
    rows[250]["grad_norm"] *= 3.0
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, **r}) + "\n" for s, r in rows.items()))
    run = tmp_path / "run"
    _hf_saves(run, (240, 249, 260))
    res = triage(log, run)
    assert res.first_bad_step == 250 and res.rollback_step == 249, (
        res.first_bad_step,
        res.rollback_step,
    )
    assert res.rollback_caveat and "checkpoint-240" in res.rollback_caveat, res.rollback_caveat
    out = CliRunner().invoke(cli, ["triage", "--metrics", str(log), "--run-dir", str(run)])
    assert "caveat: checkpoint 249 is the step just before the onset" in out.output, out.output
    rows = _noisy(0)
    for s, r in rows.items():
        r["lr"] = 1e-3 * (30 if s >= 250 else 1)
        r["loss"] *= 2.0 if s > 250 else 1.0
    log.write_text("".join(json.dumps({"step": s, **r}) + "\n" for s, r in rows.items()))
    res = triage(log, run)
    assert res.first_bad_step == 250 and res.rule == "lr-growth", (res.first_bad_step, res.rule)
    assert res.rollback_step == 249 and res.rollback_caveat is None


# Issue 30's session: a class read on held-out drawn incident 9637.


def _quiet_poisoned(seed: int, echoes: tuple[float, float]) -> dict[int, dict[str, float]]:
    """A quiet log (normal noise, 3.5% a step) of 270 steps; a poisoned batch lifts the loss
    1.53x at 267 only, its grad norm unmoved; steps 61 and 164 (103 apart, on the period
    of 267) are lifted by `echoes`."""
    rng = np.random.default_rng(seed)
    rows = {}
    for s in range(1, 271):
        loss = 1.4 * (1 + 0.5 * math.exp(-s / 60)) * math.exp(0.035 * rng.normal())
        rows[s] = {"loss": loss, "grad_norm": 0.55 * math.exp(0.1 * rng.normal())}
    rows[267]["loss"] *= 1.53
    rows[61]["loss"] *= echoes[0]
    rows[164]["loss"] *= echoes[1]
    return rows


@pytest.mark.parametrize("seed", [4, 21, 23])
def test_a_period_whose_other_meetings_are_all_weak_excuses_no_blip(seed: int) -> None:
    """The poisoned batch's blip at 267 lines up with bumps 1.1x at 61 and 164 (robust z
    2-3; for these seeds, 3 of 40, they make a period of 103), a quarter of its size in log
    terms: noise, not a batch met again (a hard batch stays as hard), so 267 is the onset.
    Met once more as hard as at 267 (164 at 1.53x), it is the log's routine."""
    cfg = TriageConfig()
    onsets, _ = log_onsets(log_evidence(_quiet_poisoned(seed, (1.10, 1.10)), cfg), cfg)
    assert onsets and onsets[0].step == 267, [(o.step, o.rule) for o in onsets]
    onsets, ignored = log_onsets(log_evidence(_quiet_poisoned(seed, (1.10, 1.53)), cfg), cfg)
    assert not onsets, [(o.step, o.rule) for o in onsets]
    assert any(o.step == 267 for o in ignored)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_recurring_batch_met_as_an_overflow_without_a_loss_is_met_as_hard(seed: int) -> None:
    """fp16, a hard batch every 64 steps: 1.6x at 87 (the grad norm 2x), an overflowed step at
    151 whose line logs no loss (Megatron-DeepSpeed's skipped iteration), 1.15x at 215 and
    279. The overflow is a meeting as hard as 87's (tuning log draw 389): the blip is the
    data's, no onset."""
    rng = np.random.default_rng(seed)
    rows: dict[int, dict[str, float]] = {}
    for s in range(1, 301):
        loss = 2.0 * (1 + 0.5 * math.exp(-s / 60)) * math.exp(0.03 * rng.normal())
        rows[s] = {"loss": loss, "grad_norm": math.exp(0.08 * rng.normal()), "loss_scale": 65536.0}
    rows[87]["loss"] *= 1.6
    rows[87]["grad_norm"] *= 2.0
    rows[151] = {"grad_norm": rows[151]["grad_norm"], "loss_scale": 65536.0, "skipped": 1.0}
    for s in range(151, 301):
        rows[s]["loss_scale"] = 32768.0
    for s in (215, 279):
        rows[s]["loss"] *= 1.15
    cfg = TriageConfig()
    onsets, ignored = log_onsets(log_evidence(rows, cfg), cfg)
    assert not onsets, [(o.step, o.rule) for o in onsets]
    assert any(o.step == 87 and "every 64 steps" in o.message for o in ignored)


def test_a_descent_pausing_is_listed_as_set_aside_with_its_figures(tmp_path: Path) -> None:
    """Seed 1 of the quiet poisoned log: the 1.53x batch at 267 leaves its trend (z 6.4) but
    not the level the loss has just been at (z 5.97, under 6) and the grad norm is flat, so
    `loss_spikes` sets it aside as a descent pausing. It was dropped without a word; the
    ignored list now names it, the rule and the figures that excused it."""
    cfg = TriageConfig()
    onsets, ignored = log_onsets(log_evidence(_quiet_poisoned(1, (1.10, 1.10)), cfg), cfg)
    assert not any(o.step == 267 for o in onsets)
    [pause] = [o for o in ignored if o.step == 267]
    assert pause.rule == "descent-pause" and pause.signal == "loss"
    assert "robust z 5.97 <= 6" in pause.message and "a steep descent pausing" in pause.message
    # and the triage page lists it under what was set aside
    rows = _quiet_poisoned(1, (1.10, 1.10))
    csv = tmp_path / "metrics.csv"
    csv.write_text(
        "step,loss,grad_norm\n"
        + "".join(f"{k},{r['loss']!r},{r['grad_norm']!r}\n" for k, r in rows.items())
    )
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["triage", "--metrics", str(csv), "--out", str(out)])
    assert r.exit_code == 0, r.output
    page = (out / "report.md").read_text()
    assert "No spike onset in the log." in page and "Set aside (" in page
    assert "| 267 | loss | descent-pause |" in page


def test_the_page_lists_the_forty_candidates_furthest_from_their_trend(tmp_path: Path) -> None:
    """A long log's routine blips can number hundreds: the page lists the 40 furthest from
    their trend (an overflow, null z in JSON, first), by step, and says how many more the
    JSON holds."""
    import json

    from ckptforensics.report.timeline import render_triage_markdown

    rows = _quiet_poisoned(1, (1.10, 1.10))
    csv = tmp_path / "metrics.csv"
    csv.write_text(
        "step,loss,grad_norm\n"
        + "".join(f"{k},{r['loss']!r},{r['grad_norm']!r}\n" for k, r in rows.items())
    )
    r = CliRunner().invoke(cli, ["triage", "--metrics", str(csv), "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    t = json.loads((tmp_path / "o" / "report.json").read_text())
    [pause] = t["ignored"]
    blip = {"signal": "grad_norm", "rule": "trend", "message": "m", "yields_to": None}
    t["ignored"] += [{**blip, "step": s, "robust_z": 100.0 - s} for s in range(1, 45)]
    t["ignored"].append({**blip, "step": 99, "signal": "loss_scale", "robust_z": None})
    page = render_triage_markdown(t)
    listed = [
        int(ln.split(" | ")[0][2:])
        for ln in page.split("Set aside")[1].splitlines()
        if ln[:2] == "| " and ln[2].isdigit()
    ]
    # z: the overflow infinite, 99 down to 56 for steps 1-44, the pause at 267 6.4: the
    # overflow and steps 1-39 are listed, by step; steps 40-44 and the pause are the 6 more
    assert listed == [*range(1, 40), 99] and pause["step"] == 267
    assert "6 more, nearer their trend, in report.json" in page
