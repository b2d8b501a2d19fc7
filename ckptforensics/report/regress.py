"""The `regress` block as report sections (what report.md and report.html render) and as
evidence.h5's `regress` group."""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np

from ckptforensics.report.blocks import Block, Bullets, Code, Para, Section, Table
from ckptforensics.report.text import fmt

__all__ = ["regress_headline", "regress_sections", "write_regress_h5"]

_MODULE_HEAD = ["tensor", "dtype", "max abs", "relative", "ulps", "differing", "A's noise", "parts"]
_STEP_HEAD = ["step", "loss A", "loss B", "grad norm A", "grad norm B", "parts"]
# rows of the per-tensor table shown (all of them are in report.json and evidence.h5)
_SHOWN = 40


def regress_headline(reg: dict[str, Any], before: str) -> list[Any]:
    """The verdict box of a regression: identical, equivalent, or where it parts."""
    p = reg.get("parting")
    head: list[Any] = ["Regress from ", Code(before), ": "]
    if reg["status"] == "identical":
        return [*head, "B is bitwise identical to A."]
    if reg["status"] == "equivalent":
        return [*head, "B is equivalent to A, within A's own run-to-run noise."]
    if p is None:
        return [*head, "B parts from A on the loss or grad norm."]
    return [
        *head,
        f"B parts from A in the {p['direction']} at ",
        Code(p["module"] or "the model"),
        ".",
    ]


def _side(name: str, s: dict[str, Any]) -> list[Any]:
    env = s.get("environment") or {}
    knobs = ", ".join(f"{k}={v}" for k, v in (s.get("env") or {}).items())
    return [
        f"{name}: ",
        Code(s.get("model") or "the run's model"),
        f" in {s.get('python')}" + (f" with {knobs}" if knobs else "")
        + f" (torch {env.get('torch', '?')}, CPU kernels {env.get('cpu_capability', '?')}, "
        f"{env.get('threads', '?')} threads)",
    ]  # fmt: skip


def _rows(reg: dict[str, Any]) -> list[dict[str, Any]]:
    """The tensors worth reading: those that part, then the others that differ, in order."""
    mods = reg["modules"]
    parted = [m for m in mods if m["exceeds"]]
    differ = [m for m in mods if not m["exceeds"] and not m["bitwise_equal"]]
    return (parted + differ)[:_SHOWN]


def regress_sections(reg: dict[str, Any]) -> list[Section]:
    """The regression: where it parts and each side; the tensors that differ; the steps."""
    p = reg.get("parting")
    facts: list[Block] = [
        Bullets(
            [
                [f"status: {reg['status']}"],
                _side("A", reg["sides"]["a"]),
                _side("B", reg["sides"]["b"]),
                [f"A's own run-to-run noise: {fmt(reg['noise']['floor'])} relative (B parts past {fmt(reg['noise']['factor'])}x it)"],
            ],
            tight=True,
        )
    ]  # fmt: skip
    if p:
        facts.append(
            Para([f"Parts in the {p['direction']} at ", Code(p["module"] or "the model"),
                  f" ({p['where']}), first at ", Code(p["tensor"]),
                  f": {fmt(p['max_abs'])} max abs, {fmt(p['max_rel'])} relative, {fmt(p['max_ulps'])} ulps."])
        )  # fmt: skip
    if reg.get("unmatched"):
        facts.append(Para([f"Tensors on one side only: {len(reg['unmatched'])} (not compared)."]))
    rows = [
        [Code(m["tensor"]), m["dtype"], fmt(m["max_abs"]), fmt(m["max_rel"]), fmt(m["max_ulps"]),
         f"{m['differing']:,} of {m['numel']:,}", fmt(m["noise_max_abs"]), fmt(m["exceeds"])]
        for m in _rows(reg)
    ]  # fmt: skip
    steps = [
        [s["step"], fmt(s["loss_a"]), fmt(s["loss_b"]), fmt(s["grad_norm_a"]), fmt(s["grad_norm_b"]), fmt(s["exceeds"])]
        for s in reg["steps"]
    ]  # fmt: skip
    params = [x for x in reg["params"] if not x["bitwise_equal"]]
    shown = f" (first {_SHOWN})" if len(rows) == _SHOWN else ""
    return [
        Section("Regression", facts),
        Section(
            f"Tensors of the first step that differ{shown}",
            [Table(_MODULE_HEAD, rows)] if rows else [Para(["Every tensor is bitwise equal."])],
            collapsed=True,
        ),
        Section(
            "After the steps",
            [
                Table(_STEP_HEAD, steps),
                Para(
                    [
                        f"Parameters that differ: {len(params)} of {len(reg['params'])}; past A's noise: "
                        f"{sum(x['exceeds'] for x in reg['params'])}."
                    ]
                ),
            ],
            collapsed=True,
        ),  # fmt: skip
    ]


def _floats(xs: list[Any]) -> np.ndarray:
    return np.array([np.nan if x is None else float(x) for x in xs], dtype=np.float64)


def write_regress_h5(h: h5py.File, reg: dict[str, Any]) -> None:
    """evidence.h5's `regress` group: one row per tensor of the first step (A's order), one
    per parameter, one per step."""
    g = h.create_group("regress")
    g.attrs["status"] = reg["status"]
    mods = reg["modules"]
    g.create_dataset(
        "tensor", data=np.array([m["tensor"] for m in mods], dtype=h5py.string_dtype())
    )
    for col in ("max_abs", "max_rel", "max_ulps", "differing", "numel", "noise_max_abs"):
        g.create_dataset(col, data=_floats([m[col] for m in mods]))
    g.create_dataset("exceeds", data=np.array([bool(m["exceeds"]) for m in mods]))
    ps = reg["params"]
    g.create_dataset("param", data=np.array([x["name"] for x in ps], dtype=h5py.string_dtype()))
    g.create_dataset("param_max_abs", data=_floats([x["max_abs"] for x in ps]))
    g.create_dataset("step", data=np.array([s["step"] for s in reg["steps"]], dtype=np.int64))
    for col in ("loss_a", "loss_b", "grad_norm_a", "grad_norm_b"):
        g.create_dataset(col, data=_floats([s[col] for s in reg["steps"]]))
