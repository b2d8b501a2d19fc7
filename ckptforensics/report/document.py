"""The report document's plain-data rules: its schema name, JSON-safe values, its JSON text.

Every module that builds or reads a document (the package's `build_report`, `inspect_doc`,
evidence.h5) takes these from here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

__all__ = ["SCHEMA", "clean", "to_json", "schema"]

SCHEMA = "ckptforensics.report/1"


def clean(x: Any) -> Any:
    """JSON-safe: non-finite floats -> None (strict JSON has no NaN), tuples -> lists,
    dataclasses -> dicts. A section built outside `build_report` (the plan's, triage's) is
    made JSON-safe the same way."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return clean({f.name: getattr(x, f.name) for f in dataclasses.fields(x)})
    return x


def to_json(doc: dict[str, Any]) -> str:
    """report.json's text: indented, strict JSON (no NaN), one trailing newline."""
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"


def schema() -> dict[str, Any]:
    """The JSON Schema of report.json (shipped in the package)."""
    return json.loads((Path(__file__).with_name("schema.json")).read_text())
