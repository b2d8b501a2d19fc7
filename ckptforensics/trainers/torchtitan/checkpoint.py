"""torchtitan's job config (TOML) around its DCP files: its FSDP2 mixed-precision policy,
registered with the DCP reader (`formats.dcp.register_dcp_records`)."""

from __future__ import annotations

from pathlib import Path

from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.dcp import register_dcp_records


def job_config(ckpt: Checkpoint, path: Path) -> None:
    """A torchtitan job config (TOML) in the run dir or above it: its FSDP2 mixed-precision
    policy (`[training] mixed_precision_param`, `mixed_precision_reduce`; torchtitan's
    defaults bfloat16 / float32), which the replay computes in (engine/replay/precision.py)."""
    import tomllib  # Python 3.11 on (the package supports 3.10)

    for d in (path.parent, path.parent.parent):
        for f in sorted(d.glob("*.toml")) if d.is_dir() else []:
            try:
                doc = tomllib.loads(f.read_text())
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
                continue
            training = doc.get("training") if isinstance(doc, dict) else None
            if isinstance(training, dict) and isinstance(
                training.get("mixed_precision_param"), str
            ):
                ckpt.scalars["mixed_precision"] = {
                    "param_dtype": training["mixed_precision_param"],
                    "reduce_dtype": str(training.get("mixed_precision_reduce", "float32")),
                    "source": f"{f.name} training.mixed_precision_param={training['mixed_precision_param']!r} (torchtitan's FSDP2 policy)",
                }
                return


def titan_records(ckpt: Checkpoint, path: Path) -> int | None:
    """The job config's precision policy into `ckpt`; no step (the directory name says it)."""
    job_config(ckpt, path)
    return None


register_dcp_records(titan_records)
