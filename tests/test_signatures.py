"""Every signature a detector cites is a row of docs/signatures.md."""

from __future__ import annotations

import re
from pathlib import Path

from ckptforensics.detectors.causes import CAUSES

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


def test_every_cause_has_its_row() -> None:
    """docs/signatures.md#causes: one row per registered cause, in the registry's order, its
    meaning word for word the record's (detectors/causes.py)."""
    doc = (ROOT / "docs" / "signatures.md").read_text()
    section = doc.split("\n## Causes", 1)
    assert len(section) == 2, "docs/signatures.md has no '## Causes' section"
    rows = re.findall(
        r'^\| <a id="cause-([a-z0-9-]+)"></a>`([a-z0-9_]+)` \| ([^|]+) \|',
        section[1],
        re.MULTILINE,
    )
    assert [name for _, name, _ in rows] == list(CAUSES), "the causes table is not the registry"
    for anchor, name, meaning in rows:
        assert anchor == name.replace("_", "-"), name
        assert meaning.strip() == CAUSES[name].meaning, (
            f"{name}: the row's meaning is not the record's"
        )
