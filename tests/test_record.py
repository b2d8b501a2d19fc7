"""The flight recorder (ckptforensics.record): a recorded incident replays as the run's own
log does, a killed run's log replays, the ring drops the oldest interval, one host read a step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch
from click.testing import CliRunner

from ckptforensics.cli import cli
from ckptforensics.engine.triage import triage
from ckptforensics.formats.batches import open_batches
from ckptforensics.record import Recorder, SpikeMonitor
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT))
from fixtures.tinygpt import GPT, GPTConfig  # noqa: E402
from fixtures.zoo import batch_for_step, markov_table, poison_batch  # noqa: E402

MODEL = "fixtures/tinygpt.py:factory"


@pytest.fixture(scope="session")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The zoo's poison incident, trained again with the recorder attached."""
    return poison_batch(tmp_path_factory.mktemp("recorded"), record=True)


def _replay(run: Path, before: str, after: str, batch: Path, out: Path) -> dict:
    args = [
        "replay",
        "--before",
        str(run / before),
        "--after",
        str(after),
        "--model",
        MODEL,
        "--batch",
        str(batch),
        "--out",
        str(out),
    ]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads((out / "report.json").read_text())


def test_a_recorded_incident_replays_as_the_zoo_log_does(recorded: Path, tmp_path: Path) -> None:
    t = json.loads((recorded / "truth.json").read_text())
    at = t["first_bad_step"]
    flight = recorded / "flight"
    box = flight / f"blackbox-step{at}"
    assert box.is_dir(), sorted(
        p.name for p in flight.iterdir()
    )  # the monitor alarmed on the planted step
    incident = json.loads((box / "incident.json").read_text())
    assert incident["spike"]["step"] == at and f"step_{t['before']}.pt" in incident["command"]
    ref = _replay(
        recorded,
        f"step_{t['before']}.pt",
        str(recorded / f"step_{t['after']}.pt"),
        recorded / "batches.h5",
        tmp_path / "ref",
    )
    got = _replay(
        recorded,
        f"step_{t['before']}.pt",
        str(recorded / f"step_{t['after']}.pt"),
        box,
        tmp_path / "got",
    )
    for k in ("first_bad_step", "reproducible"):
        assert got["verdict"][k] == ref["verdict"][k]
    assert [c["cause"] for c in got["verdict"]["causes"]] == [
        c["cause"] for c in ref["verdict"]["causes"]
    ]
    assert got["verdict"]["causes"][0]["cause"] == t["cause"]
    rows = [(s["index"], s["sample_id"]) for s in got["verdict"]["anomalous_samples"]]
    assert rows == [(s["index"], s["sample_id"]) for s in ref["verdict"]["anomalous_samples"]]
    assert [i for i, _ in rows] == t["samples"]
    # The black box's own state is an *after* the replay reads.
    state = _replay(
        recorded, f"step_{t['before']}.pt", str(box / f"state_step{at}.pt"), box, tmp_path / "box"
    )
    assert (
        state["verdict"]["causes"][0]["cause"] == t["cause"]
        and state["verdict"]["reproducible"] is True
    )
    # triage reads the recorder's log, per-parameter columns included, as it reads the run's.
    res = triage(flight / "metrics.jsonl", recorded)
    assert res.first_bad_step == at
    row = json.loads((flight / "metrics.jsonl").read_text().splitlines()[9])
    assert row["step"] == 10 and any(
        k.startswith("optim/grad/") and k.endswith(".norm") for k in row
    )


def test_bisect_on_a_black_box_writes_the_skip_list_the_batch_log_gives(
    recorded: Path, tmp_path: Path
) -> None:
    t = json.loads((recorded / "truth.json").read_text())
    box = recorded / "flight" / f"blackbox-step{t['first_bad_step']}"
    docs = {}
    for name, batch in (("ref", recorded / "batches.h5"), ("rec", box)):
        out = tmp_path / name
        args = [
            "bisect",
            "--run-dir",
            str(recorded),
            "--before",
            str(t["before"]),
            "--after",
            str(t["after"]),
            "--model",
            MODEL,
            "--batch",
            str(batch),
            "--out",
            str(out),
        ]
        r = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert r.exit_code == 0, r.output
        docs[name] = (
            json.loads((out / "report.json").read_text())["bisect"],
            json.loads((out / "skip.json").read_text()),
        )
    (b_ref, skip_ref), (b_rec, skip_rec) = docs["ref"], docs["rec"]
    assert b_rec["first_bad_step"] == b_ref["first_bad_step"] == t["first_bad_step"]
    assert sorted(b_rec["rows"]) == sorted(b_ref["rows"]) == t["samples"]
    assert (
        skip_rec["sample_ids"] == skip_ref["sample_ids"]
    )  # the recorder's sample ids, as the zoo's log numbers rows


def test_a_killed_run_leaves_a_log_that_replays(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "fixtures" / "record_run.py"),
            str(tmp_path),
            "30",
            "--kill-at",
            "9",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]  # SIGKILL: the segment was never closed
    seg = next((tmp_path / "flight").glob("segment-*.h5"))
    with pytest.raises(OSError):
        h5py.File(seg, "r")  # a plain open refuses it; the reader falls back to SWMR
    src = open_batches(str(tmp_path / "flight"))
    assert src.steps == list(range(1, 10)) and src.grad_clip == 1.0
    table = markov_table(0)
    assert torch.equal(src.batch(7)["input_ids"], batch_for_step(7, table))
    doc = _replay(
        tmp_path, "ckpt_5.pt", str(tmp_path / "ckpt_8.pt"), tmp_path / "flight", tmp_path / "rep"
    )
    assert doc["verdict"]["reproducible"] is True and doc["verdict"]["causes"][0]["cause"] == "none"
    assert doc["replay"]["config"]["lr"]["source"] == "batch log /lr"


def test_a_log_of_sample_ids_replays_with_the_dataset_they_index(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    from tests.test_cli import assert_bad_input

    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "fixtures" / "record_run.py"),
            str(tmp_path),
            "9",
            "--ids-only",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    seg = next((tmp_path / "flight").glob("segment-*.h5"))
    with h5py.File(seg, "r") as h:
        assert "input_ids" not in h and h["sample_id"].shape == (9, 8)
    args = [
        "replay",
        "--before",
        str(tmp_path / "ckpt_5.pt"),
        "--after",
        str(tmp_path / "ckpt_8.pt"),
        "--model",
        MODEL,
        "--batch",
        str(tmp_path / "flight"),
    ]
    assert_bad_input(CliRunner().invoke(cli, args), "pass --data")
    r = CliRunner().invoke(
        cli,
        [*args, "--data", str(tmp_path / "data"), "--out", str(tmp_path / "rep")],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert doc["verdict"]["reproducible"] is True and doc["verdict"]["causes"][0]["cause"] == "none"


def _loop(
    rec: Recorder, model: torch.nn.Module, steps: range, every_ckpt: int | None = None
) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    table = markov_table(0)
    for step in steps:
        ids = batch_for_step(step, table)
        for half in (ids[:4], ids[4:]):  # two micro-batches: gradient accumulation
            rec.on_batch(step, {"input_ids": half, "labels": half})
            (model(half, labels=half) / 2).backward()
        rec.after_backward(model)
        opt.step()
        rec.after_step(step, opt, loss=torch.tensor(1.0), model=model)
        opt.zero_grad(set_to_none=True)
        if every_ckpt and step % every_ckpt == 0:
            rec.on_checkpoint(step)


def test_the_ring_drops_the_oldest_interval_never_the_newest(tmp_path: Path) -> None:
    torch.manual_seed(0)
    rec = Recorder(tmp_path / "flight", keep=2)
    _loop(rec, GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2)), range(1, 24), every_ckpt=5)
    rec.close()
    segs = sorted(p.name for p in (tmp_path / "flight").glob("segment-*.h5"))
    assert segs == ["segment-000000016-rank0.h5", "segment-000000021-rank0.h5"]
    src = open_batches(str(tmp_path / "flight"))
    assert src.steps == list(range(16, 24))
    assert src.micro_batch_size == 4  # two micro-batches a step: the loss is averaged per 4 rows
    assert src.batch(23)["input_ids"].shape == (8, 32)
    assert rec.spikes == []  # a healthy run: no alarm


def test_one_host_read_per_step_whatever_the_depth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Statistics stay on the device; each step is read back once (stats steps included).
    Counted: what reads a device value on the host (`.cpu()`, `.item()`, `float()`); the
    batch's rows are host copies started in `on_batch`, turned into arrays without a read."""
    reads = []
    for name in ("cpu", "item", "__float__"):
        orig = getattr(torch.Tensor, name)

        def counted(
            self: torch.Tensor, *a: object, _orig: object = orig, _n: str = name, **k: object
        ) -> object:
            reads.append(_n)
            return _orig(self, *a, **k)  # type: ignore[operator]

        monkeypatch.setattr(torch.Tensor, name, counted)
    per_step = {}
    for depth in (1, 4):
        torch.manual_seed(0)
        rec = Recorder(tmp_path / f"d{depth}", stats_every=2, monitor=False)
        model = GPT(GPTConfig(n_layer=depth, n_embd=16, n_head=2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = batch_for_step(1, markov_table(0))
        counts = []
        for step in (1, 2):
            rec.on_batch(step, {"input_ids": ids})
            model(ids, labels=ids).backward()
            opt.step()
            reads.clear()
            rec.after_backward(model)
            spike = rec.after_step(step, opt, model=model)
            counts.append(len(reads))
            assert spike is None
        per_step[depth] = counts
        rec.close()
    assert per_step == {1: [1, 1], 4: [1, 1]}, per_step


def test_the_monitor_alarms_on_a_spike_not_on_a_blip() -> None:
    import math

    m = SpikeMonitor()
    loss = [3.0 * math.exp(-s / 200) * (1 + 0.01 * math.sin(s * 1.7)) for s in range(1, 200)]
    grad = [1.0 + 0.05 * math.sin(s * 2.3) for s in range(1, 200)]
    grad[80] = 4.0  # a blip the loss ignores
    loss[150] *= 3.0  # a spike
    alarms = [
        sp.step
        for s, (lo, g) in enumerate(zip(loss, grad, strict=True), 1)
        if (sp := m.update(s, lo, g))
    ]
    assert alarms == [151]


def test_the_trainer_callback_stops_training_at_an_alarm_when_asked(tmp_path: Path) -> None:
    """record.hf's callback, driven through the Trainer's callback events by hand: a loss
    that leaves its trend stops training (control.should_training_stop) with stop_on_spike."""
    pytest.importorskip("transformers")
    import math
    from types import SimpleNamespace

    from ckptforensics.record.hf import hf_callback

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(16, 4)

        def forward(
            self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
        ) -> SimpleNamespace:
            loss = self.emb(input_ids).pow(2).mean() * self.scale
            return SimpleNamespace(loss=loss)

        scale = 1.0

    model = LM().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cb = hf_callback(tmp_path / "flight", stop_on_spike=True)
    args = SimpleNamespace(
        gradient_accumulation_steps=1,
        max_grad_norm=1.0,
        per_device_train_batch_size=2,
        output_dir=str(tmp_path),
    )
    state, control = SimpleNamespace(global_step=0), SimpleNamespace(should_training_stop=False)
    cb.on_train_begin(args, state, control, model=model)
    stopped_at = None
    for step in range(1, 41):
        model.scale = (1 + 0.02 * math.sin(step)) * (5.0 if step == 30 else 1.0)
        cb.on_step_begin(args, state, control)
        ids = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        cb.on_pre_optimizer_step(args, state, control, model=model)
        opt.step()
        cb.on_optimizer_step(args, state, control, optimizer=opt, model=model)
        opt.zero_grad()
        state.global_step = step
        if control.should_training_stop:
            stopped_at = step
            break
    cb.on_train_end(args, state, control)
    assert (
        stopped_at == 30 and (tmp_path / "flight" / "blackbox-step30" / "incident.json").is_file()
    )
    assert open_batches(str(tmp_path / "flight")).steps == list(range(1, 31))
