"""evidence.h5: the raw per-layer evidence behind a report, and the report itself (docs/evidence.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ckptforensics.core.errors import ForensicsError
from ckptforensics.report.document import SCHEMA
from ckptforensics.report.files import write_files
from ckptforensics.report.history import write_history_h5
from ckptforensics.report.regress import write_regress_h5

__all__ = ["write_evidence", "write_h5", "load_report"]

_DIFF_COLUMNS = (
    "update_ratio",
    "dw_max_abs",
    "r_v",
    "rho_share_a",
    "rho_share_b",
    "headroom_b",
    "max_abs_b",
    "bound_violations",
    "nonfinite_b",
)


def _floats(xs: list[Any]) -> np.ndarray:
    return np.array([np.nan if x is None else float(x) for x in xs], dtype=np.float64)


def write_evidence(path: Path, doc: dict[str, Any]) -> None:
    """Write evidence.h5 atomically (temp file + rename)."""
    write_files({path: lambda tmp: write_h5(tmp, doc)})


def write_h5(path: Path, doc: dict[str, Any]) -> None:
    """evidence.h5's content, written to `path` as it is (`write_files` makes it atomic)."""
    with h5py.File(path, "w") as h:
        h.attrs["schema"] = doc["schema"]
        h.attrs["tool_version"] = doc["incident"]["tool_version"]
        h.create_dataset("report_json", data=json.dumps(doc))
        diff = doc.get("diff") or {}
        if diff.get("tensors"):
            g = h.create_group("diff")
            g.create_dataset(
                "name",
                data=np.array([t["name"] for t in diff["tensors"]], dtype=h5py.string_dtype()),
            )
            for col in _DIFF_COLUMNS:
                g.create_dataset(col, data=_floats([t.get(col) for t in diff["tensors"]]))
        if doc.get("regress"):
            write_regress_h5(h, doc["regress"])
        if doc.get("history"):
            write_history_h5(h, doc["history"])
        rep = doc.get("replay") or {}
        if rep.get("steps"):
            g = h.create_group("replay")
            steps = rep["steps"]
            g.create_dataset("step", data=np.array([s["step"] for s in steps], dtype=np.int64))
            for col in ("loss", "grad_norm", "logit_absmax", "log_z"):
                g.create_dataset(col, data=_floats([s.get(col) for s in steps]))
            g.create_dataset("skipped", data=np.array([bool(s["skipped"]) for s in steps]))
            mods = rep.get("modules") or []
            per = rep.get("per_module_steps") or {}
            if mods and per:
                g.create_dataset("modules", data=np.array(mods, dtype=h5py.string_dtype()))
                order = [str(s["step"]) for s in steps if str(s["step"]) in per]
                for stat in ("absmax", "rms", "grad_norm"):
                    # [steps, modules], rows in step order
                    g.create_dataset(
                        f"module_{stat}", data=np.array([_floats(per[s][stat]) for s in order])
                    )
            sl = [s["sample_loss"] for s in steps]
            if sl and all(len(x) == len(sl[0]) for x in sl):
                g.create_dataset("sample_loss", data=np.array(sl, dtype=np.float64))
            sq = [s["sample_grad_sq"] for s in steps]
            if sq and all(x is not None and len(x) == len(sq[0]) for x in sq):
                g.create_dataset(
                    "sample_grad_sq", data=_floats([v for x in sq for v in x]).reshape(len(sq), -1)
                )


def load_report(path: Path) -> dict[str, Any]:
    """The report document from evidence.h5 or report.json."""
    if not path.is_file():
        raise ForensicsError(f"{path}: no such file")
    try:
        if path.suffix in (".h5", ".hdf5"):
            with h5py.File(path, "r") as h:
                raw = h["report_json"][()]
            doc = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        else:
            doc = json.loads(path.read_text())
    except (OSError, KeyError, ValueError, UnicodeDecodeError) as e:
        raise ForensicsError(f"{path}: not a ckptforensics report or evidence file ({e})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ForensicsError(f"{path}: not a {SCHEMA} document")
    return doc
