"""A settled level shift (docs/signatures.md#log-settled): a healthy run whose data mixture
switches steps its loss up ~1.2x and keeps it there, the first batch heavy with the new source's
rows a departure the trend rule reads as a spike. Neither triage nor the replay's onset names
it; a poisoned batch (its loss falls back) and an LR fault (its excursion grows, its grad norm
spikes after it) at the same step of the same log stay onsets.

The log is tuning draw 1546's (fixtures/draws.py, trap mixture_switch: an HF Trainer Llama,
the second source ramped in from step 211, all 290 logged steps' loss and grad norm to four
digits): at step 220 its grad norm 1.4x and its loss 1.32x, the loss level 1.22x from there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import ckptforensics.detectors.log.onsets as onsets
from ckptforensics.detectors.base import Thresholds
from ckptforensics.detectors.log.settled import SETTLE_AFTER, settled_level
from ckptforensics.detectors.replay.onset import _LoggedStep, _onset
from ckptforensics.engine.triage import triage

SWITCH = 220
RAMP = 211  # the second source's first step
PEAK_LR, WARMUP = 6.25e-4, 30

# fmt: off
LOSS = (
    4.1578, 4.1551, 4.1518, 4.1501, 4.1504, 4.1463, 4.1423, 4.1357, 4.1307, 4.1242, 4.1219,
    4.1122, 4.1066, 4.0976, 4.0894, 4.0776, 4.0630, 4.0542, 4.0467, 4.0377, 4.0244, 4.0097,
    4.0013, 3.9846, 3.9686, 3.9536, 3.9390, 3.9169, 3.9092, 3.8908, 3.8760, 3.8551, 3.8311,
    3.8187, 3.8083, 3.7812, 3.7648, 3.7553, 3.7340, 3.7140, 3.7162, 3.6969, 3.6723, 3.6584,
    3.6467, 3.6325, 3.6171, 3.6004, 3.5893, 3.5699, 3.5459, 3.5414, 3.5373, 3.5148, 3.4927,
    3.4776, 3.4838, 3.4459, 3.4382, 3.4306, 3.4095, 3.3900, 3.3928, 3.3840, 3.3663, 3.3528,
    3.3302, 3.3196, 3.3164, 3.2836, 3.2881, 3.2749, 3.2634, 3.2507, 3.2233, 3.2196, 3.2099,
    3.1783, 3.1973, 3.1528, 3.1479, 3.1549, 3.1330, 3.1166, 3.1053, 3.0961, 3.0905, 3.0770,
    3.0594, 3.0311, 3.0401, 3.0414, 3.0067, 3.0128, 2.9737, 2.9795, 2.9603, 2.9512, 2.9510,
    2.9203, 2.9140, 2.8974, 2.8800, 2.8640, 2.8879, 2.8536, 2.8230, 2.8314, 2.8375, 2.8164,
    2.8011, 2.7834, 2.7691, 2.7484, 2.7406, 2.7312, 2.6831, 2.7167, 2.7116, 2.7014, 2.6692,
    2.6313, 2.6740, 2.6469, 2.6658, 2.6157, 2.6491, 2.5916, 2.6077, 2.5998, 2.5664, 2.5684,
    2.5343, 2.4957, 2.5330, 2.4691, 2.4969, 2.4906, 2.4841, 2.4859, 2.4962, 2.4375, 2.4820,
    2.4608, 2.4241, 2.3993, 2.4096, 2.4368, 2.4042, 2.3846, 2.3915, 2.3840, 2.3715, 2.3434,
    2.3648, 2.3081, 2.3221, 2.2976, 2.3169, 2.2804, 2.2931, 2.2708, 2.2284, 2.2536, 2.2524,
    2.2290, 2.1978, 2.2435, 2.2099, 2.2176, 2.1959, 2.1922, 2.1706, 2.2086, 2.1638, 2.1554,
    2.1567, 2.1517, 2.1457, 2.1244, 2.1292, 2.0980, 2.0639, 2.0798, 2.0928, 2.0814, 2.0524,
    2.0628, 2.0518, 2.0626, 2.0644, 2.0661, 2.0066, 2.0262, 2.0004, 2.0500, 1.9743, 1.9605,
    1.9411, 2.0038, 1.9845, 1.9643, 1.9629, 1.9617, 1.9770, 1.9940, 1.9704, 1.9498, 1.9700,
    1.9024, 1.9117, 1.8717, 1.9454, 1.8587, 2.0672, 2.0866, 2.2781, 1.8723, 2.2600, 2.5857,
    2.0154, 1.8226, 1.8573, 2.0558, 2.3666, 2.3795, 1.8828, 2.0323, 2.0202, 2.3072, 2.3195,
    2.6343, 2.0490, 2.1017, 2.4405, 2.4119, 2.4419, 2.3097, 2.2458, 2.6701, 2.1068, 2.6659,
    2.2494, 2.6094, 2.2695, 2.6193, 1.9653, 2.4506, 2.8152, 2.7865, 2.5632, 2.3356, 2.3847,
    2.1955, 2.4141, 2.6909, 2.5922, 2.3633, 2.7187, 2.3950, 2.5821, 2.6794, 2.7388, 2.4924,
    2.3479, 2.7690, 2.5030, 2.8345, 2.5498, 2.3525, 2.4477, 2.6447, 2.3973, 2.2519, 2.4507,
    2.4309, 2.5465, 2.3632, 2.4532, 2.2709, 2.4581, 2.3939, 2.3160, 2.4414, 2.2263, 2.2881,
    2.3231, 2.3088, 2.3064, 2.2348,
)
GRAD = (
    0.6831, 0.7003, 0.7003, 0.7086, 0.6799, 0.7094, 0.6817, 0.6607, 0.6888, 0.6881, 0.6737,
    0.6779, 0.6701, 0.6370, 0.6508, 0.6437, 0.6747, 0.6667, 0.6570, 0.6322, 0.6343, 0.6511,
    0.6422, 0.6639, 0.6431, 0.6441, 0.6499, 0.6475, 0.6347, 0.6243, 0.6380, 0.6348, 0.6444,
    0.6237, 0.6312, 0.6291, 0.6242, 0.6160, 0.6138, 0.6292, 0.5962, 0.5988, 0.6064, 0.6175,
    0.6058, 0.6183, 0.6057, 0.6138, 0.6075, 0.6271, 0.6244, 0.6413, 0.6011, 0.6233, 0.6385,
    0.6416, 0.6078, 0.6361, 0.6423, 0.6346, 0.6481, 0.6464, 0.6299, 0.6272, 0.6296, 0.6375,
    0.6392, 0.6402, 0.6267, 0.6463, 0.6341, 0.6227, 0.6371, 0.6306, 0.6391, 0.6328, 0.6291,
    0.6562, 0.6262, 0.6634, 0.6565, 0.6298, 0.6368, 0.6404, 0.6377, 0.6362, 0.6389, 0.6308,
    0.6383, 0.6555, 0.6237, 0.6240, 0.6589, 0.6313, 0.6360, 0.6261, 0.6341, 0.6386, 0.6129,
    0.6257, 0.6467, 0.6409, 0.6281, 0.6262, 0.6199, 0.6217, 0.6367, 0.6267, 0.6257, 0.6054,
    0.6200, 0.6462, 0.6425, 0.6357, 0.6423, 0.6094, 0.6501, 0.6348, 0.6358, 0.6223, 0.6054,
    0.6515, 0.6011, 0.6067, 0.6015, 0.6270, 0.6022, 0.6237, 0.6407, 0.6121, 0.6099, 0.5985,
    0.6316, 0.6330, 0.6002, 0.6298, 0.6095, 0.6109, 0.6215, 0.6041, 0.6247, 0.6325, 0.6239,
    0.5913, 0.6177, 0.6228, 0.6111, 0.6106, 0.5880, 0.6021, 0.5883, 0.6042, 0.5860, 0.6058,
    0.5896, 0.5951, 0.6104, 0.5956, 0.5780, 0.6138, 0.5975, 0.5941, 0.6096, 0.5759, 0.5704,
    0.5875, 0.5978, 0.6017, 0.5925, 0.5706, 0.5667, 0.5710, 0.5847, 0.5899, 0.5959, 0.5584,
    0.5932, 0.5895, 0.5743, 0.5475, 0.5799, 0.5595, 0.5886, 0.5570, 0.5746, 0.5774, 0.5809,
    0.5689, 0.5616, 0.5572, 0.5531, 0.5851, 0.5635, 0.5442, 0.5755, 0.5762, 0.5704, 0.5264,
    0.5502, 0.5928, 0.5660, 0.5512, 0.5413, 0.5606, 0.5427, 0.5988, 0.5351, 0.5528, 0.5285,
    0.5489, 0.5698, 0.5589, 0.5550, 0.5574, 0.5632, 0.5797, 0.5765, 0.5682, 0.5664, 0.8070,
    0.5351, 0.5709, 0.5910, 0.5513, 0.6845, 0.6256, 0.5758, 0.5200, 0.5879, 0.6936, 0.6467,
    0.9230, 0.5705, 0.5582, 0.7789, 0.7185, 0.6872, 0.5753, 0.6382, 0.8722, 0.5721, 0.8851,
    0.6262, 0.9143, 0.6200, 0.8097, 0.8168, 0.6674, 1.1442, 1.0790, 0.7631, 0.6561, 0.6997,
    0.8686, 0.7765, 0.9726, 0.8687, 0.7733, 0.9881, 0.8646, 0.9539, 1.0837, 1.1578, 0.8710,
    1.0316, 1.3290, 0.8873, 1.4573, 0.9854, 1.1092, 0.8715, 1.1080, 0.9139, 1.4891, 0.9804,
    1.0767, 0.9533, 0.8793, 0.8981, 1.0012, 1.1098, 1.0181, 0.9161, 0.9909, 0.8636, 0.9985,
    0.9339, 1.4394, 0.8812, 1.0664,
)
# fmt: on


def _log(kind: str, seed: int = 0) -> list[dict[str, float]]:
    """Draw 1546's log ("mixture"), or its twins, whose steps from RAMP on but SWITCH are
    the plateau before RAMP (its last 20 steps over and over): "poison" as they are (the loss
    falls back after the switch's step), "lr" rising 1% a step from the switch on, with a grad
    norm 5x and noisy (seeded)."""
    r = np.random.default_rng(seed)
    loss, grad = list(LOSS), list(GRAD)
    if kind == "mixture":
        return _rows(loss, grad)
    for k, s in enumerate(s for s in range(RAMP, len(LOSS) + 1) if s != SWITCH):
        j = RAMP - 21 + k % 20  # an index into the 20 steps before the ramp
        loss[s - 1], grad[s - 1] = LOSS[j], GRAD[j]
        if kind == "lr" and s > SWITCH:
            loss[s - 1] *= 1.0 + 0.01 * (s - SWITCH)
            grad[s - 1] *= 5 * math.exp(r.normal(0, 0.3))
    return _rows(loss, grad)


def _rows(loss: list[float], grad: list[float]) -> list[dict[str, float]]:
    return [
        {
            "step": s,
            "loss": a,
            "grad_norm": g,
            "learning_rate": PEAK_LR * min(1.0, (s - 1) / WARMUP),
        }
        for s, (a, g) in enumerate(zip(loss, grad, strict=True), start=1)
    ]


def _triage(tmp_path: Path, rows: list[dict[str, float]]) -> int | None:
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return triage(log, tmp_path).first_bad_step


def test_triage_names_no_onset_at_a_mixture_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = _log("mixture")
    assert _triage(tmp_path, rows) is None
    # the rule is what spares it: without it the switch is an onset (a grad-norm spike the
    # loss followed)
    monkeypatch.setattr(onsets, "settled_shift", lambda o, ev, cfg: None)
    assert _triage(tmp_path, rows) == SWITCH


@pytest.mark.parametrize("kind", ["poison", "lr"])
@pytest.mark.parametrize("seed", range(2))
def test_triage_keeps_a_poisoned_batch_and_an_lr_fault(
    tmp_path: Path, kind: str, seed: int
) -> None:
    assert _triage(tmp_path, _log(kind, seed)) == SWITCH


def test_settled_level_needs_the_steps_after_it() -> None:
    i = SWITCH - 1
    before, own = LOSS[i - 16 : i], LOSS[i : i + 2]
    assert settled_level(before, own, LOSS[i + 1 :], 6.0) is not None
    assert settled_level(before, own, LOSS[i + 1 : i + SETTLE_AFTER], 6.0) is None  # too few


def _replay(rows: list[dict[str, float]], lo: int, hi: int) -> int | None:
    """The replay's onset over the window lo..hi (its steps replayed as logged), the log
    before it its history and the 16 logged steps after it its `following` rows (as
    `ReplayResult` holds them)."""
    by = {x["step"]: x for x in rows}
    recs = [_LoggedStep(s, by[s]["loss"], by[s]["grad_norm"]) for s in range(lo, hi + 1)]
    base = [by[s] for s in range(lo - 128, lo) if s in by]
    following = [by[s] for s in range(hi + 1, hi + 17) if s in by]
    i, _, _ = _onset(recs, base, Thresholds(), following=following)
    return recs[i].step if i is not None else None


def test_replay_names_no_spike_at_a_mixture_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptforensics.detectors.replay.onset as onset

    rows = _log("mixture")
    assert _replay(rows, 211, 230) is None
    monkeypatch.setattr(onset, "_settled", lambda *a: None)
    assert _replay(rows, 211, 230) == SWITCH


@pytest.mark.parametrize("kind", ["poison", "lr"])
@pytest.mark.parametrize("seed", range(2))
def test_replay_keeps_a_poisoned_batch_and_an_lr_fault(kind: str, seed: int) -> None:
    assert _replay(_log(kind, seed), 211, 230) == SWITCH
