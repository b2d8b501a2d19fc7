"""`inspect`: one checkpoint at a glance, complete or not."""

from __future__ import annotations

from pathlib import Path

from ckptforensics.checkpoints import open_checkpoint, require_complete
from ckptforensics.commands.common import (
    Progress,
    Report,
    resolve,
)
from ckptforensics.engine.summary import summarize
from ckptforensics.formats import verify as verify_files
from ckptforensics.report.inspect import inspect_doc


def inspect(
    checkpoint: str | int | Path,
    *,
    run_dir: str | Path | None = None,
    format: str | None = None,
    progress: Progress | None = None,
    verify: bool = False,
) -> Report:
    """One checkpoint summarised: complete or not (its format's rule for a whole save;
    an incomplete one raises, naming what is missing), format, step, sizes, optimizer,
    loss scale, and each tensor's non-finite count and dtype headroom. The report's
    `result` is the `summary.CheckpointSummary`.

    With `verify`, every file is first read whole and each zip member (torch.save files)
    checked against its CRC-32 (`formats.verify`): a damaged file raises
    DamagedCheckpoint naming the file, the member and the tensor; files whose format has
    no checksum (safetensors, DCP) are named as such."""

    path = resolve(checkpoint, run_dir)
    whole = require_complete(path, format)
    checked = verify_files(path, format) if verify else None
    with open_checkpoint(path, format, check=False) as ck:
        s = summarize(ck, progress=progress)
    return Report(inspect_doc(s, whole, checked), result=s)
