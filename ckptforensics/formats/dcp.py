"""torch.distributed.checkpoint directories (FSDP2, torchtitan, OLMo-core), read in one
process without a process group, one tensor at a time, never the whole checkpoint.

Over 400 lines: one format's reader (metadata, lazy tensor reads, the optimizer's state);
formats/ keeps one module per format.
"""

from __future__ import annotations

import functools
import io
import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckptforensics.core.errors import CorruptCheckpoint, UnsafeCheckpoint
from ckptforensics.formats.base import (
    Checkpoint,
    Completeness,
    GroupHyper,
    LazyState,
    OptimizerView,
    TensorMeta,
    file_problem,
    rel_name,
)
from ckptforensics.formats.inert import allowed_names, dcp_inert_classes, safe_load_globals
from ckptforensics.formats.locate import step_of_name
from ckptforensics.formats.optstate import group_hyper, optimizer_kind

__all__ = ["is_dcp_dir", "open_dcp", "read_metadata", "dcp_completeness", "dcp_files_problems"]

_MODEL_PREFIXES = ("model.", "")
_OPTIM_PREFIXES = ("optim.", "optimizer.")


def _dcp_roots(path: Path) -> list[Path]:
    """The directories holding `.metadata`: the path itself, OLMo-core's
    `model_and_optim/`, or accelerate's FSDP pair `pytorch_model_fsdp_0/` + `optimizer_0/`."""
    for d in (path, path / "model_and_optim"):
        if (d / ".metadata").is_file():
            return [d]
    if (path / "pytorch_model_fsdp_0" / ".metadata").is_file():
        return [path / "pytorch_model_fsdp_0"] + (
            [path / "optimizer_0"] if (path / "optimizer_0" / ".metadata").is_file() else []
        )
    return []


def is_dcp_dir(path: Path) -> bool:
    """A DCP directory, or one a DCP save died in: shard files (`__R_I.distcp`) but no
    `.metadata` yet (the coordinator writes it after every rank's files)."""
    if not path.is_dir():
        return False
    if _dcp_roots(path):
        return True
    return any(
        any(d.glob("*.distcp"))
        for d in (path, path / "model_and_optim", path / "pytorch_model_fsdp_0")
        if d.is_dir()
    )


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a plain pickle: admit only DCP's own metadata records,
    torch.Size / dtypes / layouts and paths; refuse every other global."""

    _ALLOWED = {
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    } | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        inert = dcp_inert_classes().get((module, name))
        if inert is not None:
            return inert
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(
            f"refused to unpickle {module}.{name} from DCP metadata (code execution risk); nothing was run"
        )


def read_metadata(root: Path) -> Any:
    """The DCP Metadata record, through the restricted unpickler. Read once per file state
    (its size and mtime): the completeness check and the reader both need it, and a large
    model's `.metadata` runs to tens of MB."""
    f = root / ".metadata"
    try:
        st = f.stat()
    except OSError as e:
        raise CorruptCheckpoint(f"{f}: {e.strerror}") from None
    return _read_metadata(str(f), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_metadata(path: str, size: int, mtime_ns: int) -> Any:
    f = Path(path)
    try:
        with f.open("rb") as fh:
            md = _MetadataUnpickler(fh).load()
    except UnsafeCheckpoint as e:
        raise UnsafeCheckpoint(f"{f}: {e}") from None
    except Exception as e:  # any decoding failure of untrusted metadata is corruption
        raise CorruptCheckpoint(
            f"{f}: unreadable DCP metadata ({type(e).__name__}: {str(e)[:120]})"
        ) from None
    if not hasattr(md, "state_dict_metadata") or not hasattr(md, "storage_data"):
        raise CorruptCheckpoint(f"{f}: not DCP metadata")
    return md


class DcpStore:
    """Reads chunks and byte items of one DCP directory on demand."""

    def __init__(self, root: Path, md: Any) -> None:
        self.root, self.md = root, md
        self.by_fqn: dict[str, list[tuple[Any, Any]]] = {}
        for idx, info in md.storage_data.items():
            self.by_fqn.setdefault(idx.fqn, []).append((idx, info))

    def _blob(self, info: Any) -> Any:
        path = self.root / Path(str(info.relative_path)).name  # never leave the checkpoint dir
        try:
            with path.open("rb") as fh:
                fh.seek(int(info.offset))
                data = fh.read(int(info.length))
        except OSError as e:
            raise CorruptCheckpoint(f"{path}: {e}") from None
        if len(data) != int(info.length):
            raise CorruptCheckpoint(
                f"{path}: truncated (wanted {info.length} bytes at {info.offset})"
            )
        try:
            with torch.serialization.safe_globals(safe_load_globals()):
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise UnsafeCheckpoint(
                f"{path}: refused to unpickle {_unsafe_name(data) or 'an item'} (code execution risk); nothing was run"
            ) from None
        except Exception as e:  # a mangled chunk
            raise CorruptCheckpoint(
                f"{path}: unreadable chunk at {info.offset} ({type(e).__name__})"
            ) from None

    def tensor(self, fqn: str) -> torch.Tensor:
        meta = self.md.state_dict_metadata[fqn]
        out = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for idx, info in self.by_fqn.get(fqn, []):
            chunk = self._blob(info)
            if not isinstance(chunk, torch.Tensor):
                raise CorruptCheckpoint(f"{self.root}: chunk of {fqn} is not a tensor")
            sl = tuple(slice(o, o + s) for o, s in zip(idx.offset, chunk.shape, strict=False))
            try:
                out[sl] = chunk
            except RuntimeError:
                raise CorruptCheckpoint(
                    f"{self.root}: chunk of {fqn} at {list(idx.offset)} does not fit {list(meta.size)}"
                ) from None
        return out

    def rows(self, fqn: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0: only the chunks that overlap them are read."""
        meta = self.md.state_dict_metadata[fqn]
        size = tuple(meta.size)
        out = torch.empty((stop - start, *size[1:]), dtype=meta.properties.dtype)
        for idx, info in self.by_fqn.get(fqn, []):
            lo = int(idx.offset[0]) if size else 0
            meta_chunk = next(
                (c for c in meta.chunks if tuple(c.offsets) == tuple(idx.offset)), None
            )
            hi = lo + (int(meta_chunk.sizes[0]) if meta_chunk is not None else size[0] - lo)
            if hi <= start or lo >= stop:
                continue
            chunk = self._blob(info)
            if not isinstance(chunk, torch.Tensor):
                raise CorruptCheckpoint(f"{self.root}: chunk of {fqn} is not a tensor")
            a, b = max(lo, start), min(lo + chunk.shape[0], stop)
            rest = tuple(
                slice(o, o + s) for o, s in zip(idx.offset[1:], chunk.shape[1:], strict=False)
            )
            try:
                out[(slice(a - start, b - start), *rest)] = chunk[a - lo : b - lo]
            except RuntimeError:
                raise CorruptCheckpoint(
                    f"{self.root}: chunk of {fqn} at {list(idx.offset)} does not fit {list(size)}"
                ) from None
        return out

    def value(self, fqn: str) -> Any:
        items = self.by_fqn.get(fqn)
        return self._blob(items[0][1]) if items else None


def _unsafe_name(data: bytes) -> str | None:
    """The first global outside the allowlist in a torch.save blob (for the refusal message)."""

    try:
        bad = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:  # too mangled to scan: the refusal stands anyway
        return None
    rest = [g for g in bad if g not in allowed_names()]
    return rest[0] if rest else None


def open_dcp(path: Path) -> Checkpoint:
    """Open a DCP checkpoint: model tensors by FQN, optimizer state keyed by FQN (no id mapping)."""
    roots = _dcp_roots(path)
    if not roots:
        raise CorruptCheckpoint(f"{path}: no .metadata")
    ckpt = Checkpoint(path=path, format="dcp")
    state: dict[str, dict[str, Any]] = {}
    groups: dict[int, dict[str, Any]] = {}
    opt_store = None
    for root in roots:
        md = read_metadata(root)
        store = DcpStore(root, md)
        planner = md.planner_data if isinstance(getattr(md, "planner_data", None), dict) else {}
        for key, meta in md.state_dict_metadata.items():
            parts = planner.get(key) or _split(key)
            if parts and parts[0] in ("optim", "optimizer") and len(parts) < 4:
                parts = _split(key)  # OLMo-core's planner data keeps 'state.<fqn>.<field>' whole
            if parts and parts[0] in ("optim", "optimizer"):
                opt_store = store
                if len(parts) >= 4 and parts[1] == "state":
                    fqn, field = ".".join(map(str, parts[2:-1])), str(parts[-1])
                    state.setdefault(fqn, {})[field] = getter(store, key)
                elif len(parts) >= 4 and parts[1] == "param_groups":
                    # torch's get_state_dict keys groups by index; OLMo-core flattens them per
                    # parameter (`optim.param_groups.<fqn>.lr`), without a group index.
                    gid = ".".join(map(str, parts[2:-1]))
                    groups.setdefault(int(gid) if gid.isdigit() else gid, {})[str(parts[-1])] = key
                continue
            if not hasattr(meta, "size"):
                ckpt.scalars.setdefault("extra", []).append(key)  # bytes items (train state ...)
                continue
            name = (
                ".".join(map(str, parts[1:]))
                if parts and parts[0] == "model" and len(parts) > 1
                else key
            )
            ckpt.add_tensor(
                name, TensorMeta(tuple(meta.size), meta.properties.dtype), getter(store, key)
            )
    # The trainers' records beside the DCP files (`register_dcp_records`: their config, and
    # the step their own train state states), then the directory name, then the
    # trainer_state.json beside accelerate's folders.
    own = [records(ckpt, path) for records in DCP_RECORDS]
    step = next(
        (
            s
            for s in (*own, step_of_name(path), step_of_name(path.parent), _trainer_step(path))
            if s is not None
        ),
        None,
    )
    if step is not None:
        ckpt.scalars["global_step"] = step
    if state and opt_store is not None:
        _untie(ckpt, state)
        ckpt.optimizer = _optimizer(opt_store, state, groups)
        _note_adam_step(ckpt)
    else:
        ckpt.notes.append("no optimizer state in this DCP checkpoint: weights only")
    return ckpt


def _note_adam_step(ckpt: Checkpoint) -> None:
    """OLMo-core's step-0 save initialises Adam with one zero-LR step, so Adam's counter
    runs one ahead of the trainer's: say so, since per-step figures use the trainer's."""
    if ckpt.step is None or ckpt.optimizer is None or not ckpt.optimizer.state:
        return
    first = next(iter(ckpt.optimizer.state.values()))
    st = first.get("step")
    adam = int(float(st)) if st is not None else None
    if adam is not None and adam == ckpt.step + 1:
        ckpt.notes.append(
            f"Adam's step counter is {adam}, one ahead of the trainer's {ckpt.step} (a step-0 save initialises Adam with one zero-LR step)"
        )


_HEAD = re.compile(r"(^|\.)(lm_head|output|output_layer)\.weight$")
_EMBED = re.compile(r"embed|wte|tok_emb|word_emb")


def _untie(ckpt: Checkpoint, state: dict[str, dict[str, Any]]) -> None:
    """get_state_dict saves a tied output head under its own name too, while the
    optimizer holds one state for the shared parameter: an output head without state,
    shaped like an embedding with state, is that embedding (recorded as an alias)."""
    for name in [n for n in ckpt.names() if n not in state and _HEAD.search(n)]:
        meta = ckpt.meta(name)
        twins = [e for e in state if _EMBED.search(e) and ckpt.has(e) and ckpt.meta(e) == meta]
        if len(twins) == 1:
            ckpt.aliases[name] = twins[0]
            ckpt.remove_tensor(name)
            ckpt.notes.append(
                f"{name} has no optimizer state and is shaped like {twins[0]}: read as tied to it"
            )


def _trainer_step(path: Path) -> int | None:
    """HF Trainer's `trainer_state.json` beside accelerate's FSDP folders."""
    try:
        step = json.loads((path / "trainer_state.json").read_text()).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return int(step) if isinstance(step, int) else None


def _split(key: str) -> tuple[str, ...]:
    """Without (or with partial) planner data: 'optim.state.<fqn>.<field>',
    'optim.param_groups.<index or fqn>.<field>' / 'model.<fqn>'. Field names hold no dots."""
    for p in _OPTIM_PREFIXES:
        for part in ("state", "param_groups"):
            if key.startswith(f"{p}{part}."):
                rest = key[len(p) + len(part) + 1 :]
                fqn, _, field = rest.rpartition(".")
                return (p[:-1], part, fqn, field)
    return ("model", key[len("model.") :]) if key.startswith("model.") else (key,)


class _Getter:
    """Loader of one stored tensor: whole (`()`), or by rows (`rows`, a rank's shard)."""

    __slots__ = ("store", "key")

    def __init__(self, store: DcpStore, key: str) -> None:
        self.store, self.key = store, key

    def __call__(self) -> torch.Tensor:
        return self.store.tensor(self.key)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.store.rows(self.key, start, stop)


def getter(store: DcpStore, key: str) -> Callable[[], torch.Tensor]:
    return _Getter(store, key)


def _optimizer(
    store: DcpStore, state: dict[str, dict[str, Any]], groups: dict[Any, dict[str, str]]
) -> OptimizerView:
    by_name = {fqn: LazyState(fields) for fqn, fields in state.items()}
    hypers, hyper_of = [], {}
    per_param = {k: v for k, v in groups.items() if isinstance(k, str)}
    for gi in sorted(k for k in groups if isinstance(k, int)):
        g = {field: store.value(key) for field, key in groups[gi].items()}
        h = group_hyper({k: v for k, v in g.items() if k != "params"}, gi)
        hypers.append(h)
        for fqn in g.get("params") or []:
            hyper_of[str(fqn)] = h
    if per_param:
        # One record per parameter: parameters with equal hyper-parameters form a group,
        # numbered in the order the optimizer lists them.
        seen: dict[tuple, GroupHyper] = {}
        for fqn, fields in per_param.items():
            g = {field: store.value(key) for field, key in fields.items()}
            h = group_hyper(g, len(hypers))
            key = (h.lr, h.betas, h.eps, h.weight_decay, h.initial_lr, h.max_lr)
            if key not in seen:
                seen[key] = h
                hypers.append(h)
            hyper_of[fqn] = seen[key]
    if not hypers:
        hypers = [group_hyper({"lr": 0.0}, 0)]
    for fqn in by_name:
        hyper_of.setdefault(fqn, hypers[0])
    kind = optimizer_kind({k: dict.fromkeys(v) for k, v in state.items()})
    label = (
        "FQN (DCP); param groups stored per parameter, grouped by equal values"
        if per_param
        else "FQN (DCP)"
    )
    return OptimizerView(kind=kind, state=by_name, hyper=hyper_of, groups=hypers, mapping=label)


DCP_RULE = ".metadata (torch.distributed.checkpoint writes it after every rank's files) and every file it names, as long as the chunks it places there"


def dcp_files_problems(root: Path, top: Path) -> list[str]:
    """A DCP directory's `.metadata` and the files it names, checked against the byte
    ranges it places in each (sizes only: no chunk is read). Named relative to `top`."""
    meta = root / ".metadata"
    bad = file_problem(meta, top)
    if bad is not None:
        return [
            f"{bad} (written after every rank's files: the save did not finish)"
            if bad.endswith("missing")
            else bad
        ]
    try:
        md = read_metadata(root)
    except (CorruptCheckpoint, UnsafeCheckpoint) as e:
        return [f"{rel_name(meta, top)}: {str(e).removeprefix(f'{meta}: ')}"]
    ends: dict[str, int] = {}
    for info in md.storage_data.values():
        name = Path(str(getattr(info, "relative_path", ""))).name
        try:
            end = int(info.offset) + int(info.length)
        except (AttributeError, TypeError, ValueError):
            return [f"{rel_name(meta, top)}: a storage record without offset and length"]
        ends[name] = max(ends.get(name, 0), end)
    out = []
    for name in sorted(ends):
        f = root / name
        bad = file_problem(f, top)
        if bad is not None:
            out.append(f"{bad} (named in .metadata)" if bad.endswith("missing") else bad)
        elif f.stat().st_size < ends[name]:
            out.append(
                f"{rel_name(f, top)}: truncated ({f.stat().st_size} bytes; .metadata places chunks up to byte {ends[name]})"
            )
    return out


# A trainer's layout around its DCP files: (path, the DCP roots found) -> (its rule, the
# problems beyond the DCP files'), or None where the layout is not that trainer's.
DcpLayout = Callable[[Path, list[Path]], "tuple[str, list[str]] | None"]
DCP_LAYOUTS: list[DcpLayout] = []


# A trainer's records beside its DCP files: `fn(ckpt, path)` reads what they say into `ckpt`
# (the model config, the run's settings, notes) and returns the step its own train state
# records (None: none); every one registered is asked, in order.
DcpRecords = Callable[[Checkpoint, Path], "int | None"]
DCP_RECORDS: list[DcpRecords] = []


def register_dcp_records(fn: DcpRecords) -> None:
    """Add a trainer's reader of its records around the DCP files (OLMo-core's config.json and
    train state, torchtitan's job config)."""
    DCP_RECORDS.append(fn)


def register_dcp_layout(fn: DcpLayout) -> None:
    """Add a trainer's rule for its checkpoint directory around the DCP files (OLMo-core's
    `stepN/`, accelerate's FSDP folders): asked in order, the first that applies wins."""
    DCP_LAYOUTS.append(fn)


def dcp_completeness(path: Path) -> Completeness:
    """torchtitan / FSDP2 DCP directories, and the trainers' layouts around them
    (`register_dcp_layout`: OLMo-core's `stepN/`, accelerate's FSDP folders)."""
    roots = _dcp_roots(path)
    if not roots:  # shards without .metadata: find where it should be
        roots = [
            d
            for d in (path / "model_and_optim", path / "pytorch_model_fsdp_0", path)
            if d.is_dir() and any(d.glob("*.distcp"))
        ][:1]
    problems = [p for root in roots for p in dcp_files_problems(root, path)]
    rule = DCP_RULE
    for layout in DCP_LAYOUTS:  # a trainer's own layout around its DCP files
        got = layout(path, roots)
        if got is not None:
            rule, more = got
            problems += more
            break
    else:
        if not roots:
            problems.append("no .metadata and no shard files")
    return Completeness("dcp", rule, tuple(problems))
