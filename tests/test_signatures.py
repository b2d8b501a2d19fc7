"""Every signature a detector cites is a row of docs/signatures.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_cited_signature_has_its_row() -> None:
    doc = (ROOT / "docs" / "signatures.md").read_text()
    anchors = set(re.findall(r'<a id="([a-z0-9-]+)"></a>', doc))
    cited: set[str] = set()
    for f in (ROOT / "ckptforensics").rglob("*.py"):
        for m in re.finditer(r"docs/signatures\.md((?:#[a-z0-9-]+(?:, )?)+)", f.read_text()):
            cited |= set(re.findall(r"#([a-z0-9-]+)", m.group(1)))
    assert len(cited) >= 12
    assert cited <= anchors, f"cited but not in docs/signatures.md: {sorted(cited - anchors)}"
