"""bench/RESULTS.md: each benchmark owns one section between its markers, replaced on --record."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
HEAD = "# Benchmark results\n\nFigures from `bench/` scripts; each names its date and machine.\n"


def record_section(key: str, text: str) -> None:
    """Replace (or append) the `<!-- key:start -->` ... `<!-- key:end -->` section."""
    body = RESULTS.read_text() if RESULTS.exists() else HEAD
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    block = f"{start}\n{text}\n{end}"
    if start in body and end in body:
        body = body[: body.index(start)] + block + body[body.index(end) + len(end) :]
    else:
        body = body.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(body)


def publish(key: str, text: str, record: bool) -> None:
    """Print a benchmark's figures and, with --record, keep them in RESULTS.md."""
    print(text)
    if record:
        record_section(key, text)
