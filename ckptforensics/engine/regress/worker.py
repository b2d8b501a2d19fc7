"""The other side of a regression in another interpreter (`--against-python`): a venv with
another torch or transformers runs this tool's own side there, as a worker process.

    python -m ckptforensics.engine.regress.worker SPEC.json OUT_DIR

SPEC holds the replay's configuration as this process resolved it (the window, the batches,
the LR per step, the clip, the precision, the model under test); the worker plans the same
replay, steps it with `side.run_side` and writes `side.save`'s files under OUT_DIR, or
`error.json` with one line. The parent reads safetensors and JSON only: nothing the worker
writes is unpickled.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ckptforensics.core.errors import ForensicsError, one_line
from ckptforensics.engine.regress.side import SideRun, load, run_side, save
from ckptforensics.engine.replay.records import ReplayConfig
from ckptforensics.engine.replay.window import plan

__all__ = ["WorkerSpec", "run_worker", "main"]

log = logging.getLogger(__name__)

ERROR = "error.json"
# The package's parent directory: the worker imports this same tool, whatever the other
# interpreter has installed.
_ROOT = Path(__file__).resolve().parents[3]


@dataclass(kw_only=True, slots=True)
class WorkerSpec:
    """What the worker replays.

    Attributes:
        config: the replay's configuration (`ReplayConfig`'s fields, paths as strings), its
            `model` the side under test.
        steps: the window's steps, in order.
        lrs: step -> LR per parameter group, as this process settled them.
        clip: the clip norm both sides step with (None: none).
        threads: torch's intra-op threads, as this process has them (a reduction split over
            another count of threads sums in another order); None: the worker's own, where
            the environment sets them (`OMP_NUM_THREADS` in `--against-env`).
    """

    config: dict[str, Any]
    steps: list[int]
    lrs: dict[int, list[float]]
    clip: float | None
    threads: int | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "config": self.config,
                "steps": self.steps,
                "lrs": {str(k): v for k, v in self.lrs.items()},
                "clip": self.clip,
                "threads": self.threads,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        d = json.loads(text)
        return cls(
            config=d["config"],
            steps=[int(s) for s in d["steps"]],
            lrs={int(k): [float(x) for x in v] for k, v in d["lrs"].items()},
            clip=d["clip"],
            threads=d.get("threads"),
        )


def config_dict(cfg: ReplayConfig, model: str | None) -> dict[str, Any]:
    """`cfg` as JSON values, `model` in place of its own."""
    out = {f.name: getattr(cfg, f.name) for f in fields(ReplayConfig)}
    out["model"] = model
    return {k: str(v) if isinstance(v, Path) else v for k, v in out.items()}


def _config(d: dict[str, Any]) -> ReplayConfig:
    paths = {"before", "after", "metrics"}
    return ReplayConfig(**{k: Path(v) if k in paths and v is not None else v for k, v in d.items()})


def run_worker(python: Path, env: dict[str, str], spec: WorkerSpec, work: Path) -> SideRun:
    """Run the side in `python` with `env` added to this process's environment; its files
    under `work`.

    Raises:
        ForensicsError: the interpreter cannot run the worker, or the worker failed (its one
            line, else the end of what it printed).
    """
    work.mkdir(parents=True, exist_ok=True)
    (work / "spec.json").write_text(spec.to_json())
    full = {**os.environ, **env}
    full["PYTHONPATH"] = os.pathsep.join(
        [str(_ROOT), *([full["PYTHONPATH"]] if full.get("PYTHONPATH") else [])]
    )
    cmd = [str(python), "-m", "ckptforensics.engine.regress.worker", str(work / "spec.json")]
    log.info(
        "regress: running the other side in %s (%s)",
        python,
        " ".join(f"{k}={v}" for k, v in env.items()) or "same environment",
    )
    try:
        proc = subprocess.run(
            [*cmd, str(work)], env=full, capture_output=True, text=True, check=False
        )
    except OSError as e:
        raise ForensicsError(f"--against-python {python}: cannot run it ({e.strerror})") from None
    if proc.returncode != 0:
        err = work / ERROR
        said = (
            json.loads(err.read_text())["error"]
            if err.is_file()
            else (proc.stderr.strip().splitlines() or ["no output"])[-1]
        )
        raise ForensicsError(f"--against-python {python}: the worker failed: {said}")
    return load(work)


def main(argv: list[str] | None = None) -> int:
    """The worker's entry point: 0 with the side's files written, 2 with `error.json`."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.stderr.write("usage: python -m ckptforensics.engine.regress.worker SPEC.json OUT_DIR\n")
        return 2
    out = Path(args[1])
    try:
        spec = WorkerSpec.from_json(Path(args[0]).read_text())
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        cfg = _config(spec.config)
        p = plan(cfg, spec.steps)
        p.lrs = {s: spec.lrs[s] for s in spec.steps}
        save(run_side(p, cfg.model, spec.clip), out)
    except Exception as e:  # noqa: BLE001 - the process boundary: every failure is one line
        code, line = one_line(e)
        out.mkdir(parents=True, exist_ok=True)
        (out / ERROR).write_text(json.dumps({"error": line.removeprefix("error: ")}))
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
