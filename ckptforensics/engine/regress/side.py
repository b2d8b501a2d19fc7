"""One side of a regression: the replay session built under one version of the model code,
K steps of the window stepped from *before*, the first step's pass captured whole, the
parameters after the last. A side run in another interpreter comes back through files
(`save`, `load`): safetensors for the tensors, JSON for the rest, nothing unpickled."""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ckptforensics.core.errors import ForensicsError, doing
from ckptforensics.engine.regress.capture import Event, PassCapture
from ckptforensics.engine.replay import distributed
from ckptforensics.engine.replay.records import StepRecord
from ckptforensics.engine.replay.window import Plan

__all__ = ["SideRun", "run_side", "save", "load", "environment"]

log = logging.getLogger(__name__)

TENSORS, RECORD = "side.safetensors", "side.json"


@dataclass(slots=True)
class SideRun:
    """What one side measured.

    Attributes:
        events: the first step's pass, in the order it happened (`capture.Event`).
        tensors: event key -> tensor (on the side's device; on the host when loaded); under
            torchrun this rank's rows of it.
        records: each stepped step's record (loss, pre-clip grad norm, ...).
        params: parameter name (the model's own) -> its value after the last step; under
            torchrun this rank's FSDP2 shard of it.
        model_source: how the model was built (`--model` and what the session added).
        environment: the interpreter's versions and numerics settings (`environment`).
        rows, batch_rows: the first step's rows this process stepped, and the whole batch's
            (equal but under torchrun, where a rank steps its block of the rows): a tensor
            whose leading dimension is `rows` is this rank's rows of the pass's tensor.
    """

    events: list[Event]
    tensors: dict[str, torch.Tensor]
    records: list[StepRecord]
    params: dict[str, torch.Tensor]
    model_source: str = ""
    environment: dict[str, str] = field(default_factory=dict)
    rows: int = 0
    batch_rows: int = 0


def environment() -> dict[str, str]:
    """The versions and settings that change numerics: torch and Python, the CPU kernel set,
    threads, TF32 and the device."""
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "threads": str(torch.get_num_threads()),
        "matmul_precision": torch.get_float32_matmul_precision(),
    }
    if torch.cuda.is_available():
        env["cuda"] = str(torch.version.cuda)
        env["gpu"] = torch.cuda.get_device_name()
        env["tf32"] = str(torch.backends.cuda.matmul.allow_tf32)
    return env


def run_side(p: Plan, model: str | None, clip: float | None) -> SideRun:
    """Step the plan's steps from *before* with the model `model` (a `--model` spec; None:
    what the run recorded), the first step's pass captured. Seeded as a replay is, so that
    code that draws random numbers (dropout) draws the same ones on both sides.

    Raises:
        ForensicsError: the model cannot be built or called, or a batch is bad.
    """
    q = dataclasses.replace(p, cfg=dataclasses.replace(p.cfg, model=model))
    torch.manual_seed(0)
    sess = q.session()
    records: list[StepRecord] = []
    rows = batch_rows = 0
    try:
        cap = PassCapture(sess.model)
        for i, s in enumerate(q.steps):
            batch = q.batches.batch(s)
            with doing(f"stepping step {s} under --model {model or 'the run recorded'}"):
                if i == 0:
                    batch_rows = next(iter(batch.values())).shape[0]
                    rows = next(iter(sess.ranks.my_rows(batch).values())).shape[0]
                    with cap:
                        rec, _ = sess.step(s, batch, q.lrs[s], clip)
                else:
                    rec, _ = sess.step(s, batch, q.lrs[s], clip)
            records.append(rec)
        params = _local_params(sess.model, sess.shards is not None)
    finally:
        sess.close()
    return SideRun(
        cap.events,
        cap.tensors,
        records,
        params,
        sess.model_source,
        environment(),
        rows,
        batch_rows,
    )


def _local_params(model: torch.nn.Module, sharded: bool) -> dict[str, torch.Tensor]:
    """Each parameter's value, by the model's own name. An FSDP2 rank (`sharded`) keeps its
    own dim-0 shard (`to_local`): the ranks compare their shards and merge the figures, so
    no rank gathers the model it could not hold. Its modules are resharded first: a module
    FSDP2 left unsharded would hand back its gathered parameter."""
    if sharded:
        distributed.reshard(model)
    return {
        n: (t.to_local() if hasattr(t, "to_local") else t).detach().clone()
        for n, t in model.named_parameters()
    }


def save(side: SideRun, out: Path) -> None:
    """`side` under `out`: its tensors in one safetensors file (each storage once: an input
    that is the previous output, tied weights), the rest in JSON."""
    out.mkdir(parents=True, exist_ok=True)
    named = {f"t:{k}": v for k, v in side.tensors.items()}
    named.update({f"p:{k}": v for k, v in side.params.items()})
    stored: dict[str, torch.Tensor] = {}
    alias: dict[str, str] = {}
    seen: dict[int, str] = {}
    for k, v in named.items():
        if id(v) in seen:
            alias[k] = seen[id(v)]
            continue
        seen[id(v)] = k
        stored[k] = v.detach().to("cpu").contiguous().clone()
    save_file(stored, str(out / TENSORS))
    record = {
        "events": [dataclasses.asdict(e) for e in side.events],
        "records": [dataclasses.asdict(r) for r in side.records],
        "alias": alias,
        "model_source": side.model_source,
        "environment": side.environment,
        "rows": side.rows,
        "batch_rows": side.batch_rows,
    }
    (out / RECORD).write_text(json.dumps(record))


def _record(d: dict[str, Any]) -> StepRecord:
    fields = {f.name for f in dataclasses.fields(StepRecord)}
    return StepRecord(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in fields}
    )


def load(out: Path) -> SideRun:
    """A side `save` wrote (another interpreter's).

    Raises:
        ForensicsError: the files are missing or not what `save` writes.
    """
    try:
        stored = load_file(str(out / TENSORS))
        record = json.loads((out / RECORD).read_text())
        for k, target in record["alias"].items():
            stored[k] = stored[target]
        events = [Event(**e) for e in record["events"]]
        records = [_record(r) for r in record["records"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ForensicsError(f"{out}: not a regress side's files ({e})") from None
    return SideRun(
        events,
        {k[2:]: v for k, v in stored.items() if k.startswith("t:")},
        records,
        {k[2:]: v for k, v in stored.items() if k.startswith("p:")},
        record.get("model_source", ""),
        record.get("environment", {}),
        int(record.get("rows", 0)),
        int(record.get("batch_rows", 0)),
    )
