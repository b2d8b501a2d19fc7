"""A corpus of damaged checkpoints, made from real runs: what a crash leaves on disk.

Each source is a run the frameworks' own code wrote (the zoo's and the formats' fixtures,
the committed megatron-core / OLMo-core / LitGPT runs, a DeepSpeed run), and a pair of its
checkpoints (*before*, *after*). Each case is a copy of the pair with *after* damaged one way:

- truncated at every boundary of its format: a torch.save zip in its first header, its pickle
  (the index of its storages), its first and its last tensor, its directory and its end
  record; a safetensors file in its header length, its header, its first and last tensor; a
  DCP shard in its first and its last chunk; DCP `.metadata`, JSON files; and at one more
  offset drawn by a seeded generator (`random.Random(f"corpus-{source}-{file}")`);
- every required file empty, and missing;
- a required file, and the checkpoint itself, replaced by a symlink loop;
- the checkpoint directory a file (a single-file checkpoint a directory);
- DeepSpeed's `latest` and Megatron's tracker naming a step that is not there, or lagging
  behind the newest save; ranks of another world size; a DCP shard missing;
- a required file, and the checkpoint directory, without read permission.

Every case must exit 2 with one line, write nothing into its input, and leave nothing in --out.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Source", "Case", "sources", "build_cases", "snapshot", "unprivileged"]


@dataclass(frozen=True)
class Source:
    """A real run's pair of checkpoints.

    Attributes:
        name: the format and framework ('hf-trainer', 'megatron-legacy', ...).
        run: its run directory.
        before, after: the pair's names in `run` (checkpoint dirs or files).
        steps: the pair's steps, as `--before/--after` take them with `--run-dir`.
        required: files of *after* (relative to it; "" for *after* itself) that its format's
            rule requires: damaging or removing any of them must be refused.
        optional: files its reader reads when they are there: damaging them must be
            refused, their absence not (HF's config.json, scheduler.pt, training_args.bin).
        save_files: files of the save dir that come along (DeepSpeed's `latest`, Megatron's tracker).
    """

    name: str
    run: Path
    before: str
    after: str
    steps: tuple[int, int]
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    save_files: tuple[str, ...] = ()


@dataclass(frozen=True)
class Case:
    """One damaged copy: `run` holds *before* and the damaged *after*; `after` is what the
    commands are given for it (a step, or a path such as the save dir)."""

    name: str
    run: Path
    before: str
    after: str
    unprivileged: bool = False
    args: tuple[str, ...] = field(default=())


def sources(
    zoo: dict[str, Path], data: Path, deepspeed: Path | None, hf_sharded: Path
) -> list[Source]:
    """The runs the corpus damages."""
    mcore, olmo, litgpt = (
        data / "megatron-core-0.19",
        data / "olmo-core-3.0" / "run",
        data / "litgpt-0.5",
    )
    hf = ("optimizer.pt", "trainer_state.json")
    hf_optional = ("config.json", "scheduler.pt", "training_args.bin")
    shards = tuple(
        sorted(p.name for p in (hf_sharded / "checkpoint-40").glob("model-*.safetensors"))
    )
    tracker = ("latest_checkpointed_iteration.txt",)
    out = [
        Source("nanogpt", zoo["healthy"], "step_30.pt", "step_40.pt", (30, 40), ("",)),
        Source(
            "safetensors",
            zoo["healthy-safetensors"],
            "step_30.safetensors",
            "step_40.safetensors",
            (30, 40),
            ("",),
        ),
        Source(
            "lightning",
            zoo["lightning"],
            "epoch=0-step=30.ckpt",
            "epoch=0-step=40.ckpt",
            (30, 40),
            ("",),
        ),
        Source(
            "hf-trainer",
            zoo["hf-trainer"],
            "checkpoint-30",
            "checkpoint-40",
            (30, 40),
            ("model.safetensors", *hf),
            hf_optional,
        ),
        Source(
            "hf-sharded",
            hf_sharded,
            "checkpoint-30",
            "checkpoint-40",
            (30, 40),
            ("model.safetensors.index.json", *shards, *hf),
            hf_optional,
        ),
        Source("litgpt", litgpt, "step-00000020", "step-00000030", (20, 30), ("lit_model.pth",)),
        Source(
            "megatron-legacy",
            mcore / "legacy",
            "iter_0000010",
            "iter_0000020",
            (10, 20),
            ("mp_rank_00/model_optim_rng.pt",),
            save_files=tracker,
        ),
        Source(
            "megatron-dist",
            mcore / "plain",
            "iter_0000010",
            "iter_0000020",
            (10, 20),
            (".metadata", "__0_0.distcp", "metadata.json"),
            save_files=tracker,
        ),
        Source(
            "olmo-core",
            olmo,
            "step20",
            "step30",
            (20, 30),
            (
                ".metadata.json",
                "train/rank0.pt",
                "model_and_optim/.metadata",
                *(f"model_and_optim/__0_{i}.distcp" for i in range(4)),
            ),
        ),
    ]
    if deepspeed is not None:
        ds = tuple(sorted(p.name for p in (deepspeed / "global_step3").iterdir()))
        out.append(
            Source(
                "deepspeed",
                deepspeed,
                "global_step2",
                "global_step3",
                (2, 3),
                ds,
                save_files=("latest",),
            )
        )
    return out


# ---------------------------------------------------------------- boundaries
def _zip_cuts(f: Path) -> dict[str, int]:
    """Offsets inside each part of a torch.save zip: its first local header, its pickle,
    its first and last tensor record, its central directory, its end record."""
    with zipfile.ZipFile(f) as z:
        infos, start_dir = z.infolist(), int(z.start_dir)
    with f.open("rb") as fh:

        def data_at(i: zipfile.ZipInfo) -> int:
            fh.seek(i.header_offset)
            head = fh.read(30)
            n, m = struct.unpack("<HH", head[26:30])
            return i.header_offset + 30 + n + m

        pkl = next(i for i in infos if i.filename.endswith("data.pkl"))
        tensors = [i for i in infos if "/data/" in i.filename and i.compress_size > 0]
        cuts = {"zip header": 10, "pickle (index)": data_at(pkl) + pkl.compress_size // 2}
        if tensors:
            first, last = tensors[0], tensors[-1]
            cuts["first tensor"] = data_at(first) + first.compress_size // 2
            cuts["last tensor"] = data_at(last) + last.compress_size - 1
    cuts["directory"] = start_dir + 10
    cuts["end record"] = f.stat().st_size - 5
    return cuts


def _safetensors_cuts(f: Path) -> dict[str, int]:
    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    start = 8 + n
    return {
        "header length": 4,
        "header": 8 + n // 2,
        "first tensor": start + (spans[0][0] + spans[0][1]) // 2,
        "last tensor": start + spans[-1][1] - 1,
    }


def _distcp_cuts(f: Path) -> dict[str, int]:
    from ckptforensics.formats.dcp import read_metadata

    md = read_metadata(f.parent)
    spans = sorted(
        (int(i.offset), int(i.offset) + int(i.length))
        for i in md.storage_data.values()
        if Path(str(i.relative_path)).name == f.name
    )
    return {
        "first chunk header": spans[0][0] + 10,
        "first chunk": (spans[0][0] + spans[0][1]) // 2,
        "last chunk": spans[-1][1] - 1,
    }


def boundaries(f: Path, seed: str) -> dict[str, int]:
    """Where to cut `f`: every boundary its format has, plus one seeded offset."""
    size = f.stat().st_size
    if (
        f.suffix == ".distcp"
    ):  # chunks one after another (each a small zip): cut by .metadata's offsets
        cuts = _distcp_cuts(f)
    elif f.suffix == ".safetensors":
        cuts = _safetensors_cuts(f)
    elif zipfile.is_zipfile(f):
        cuts = _zip_cuts(f)
    else:  # DCP .metadata, JSON: their head and their middle
        cuts = {"head": min(16, size - 1), "middle": size // 2}
    cuts["seeded"] = random.Random(seed).randrange(1, size)
    return {k: v for k, v in cuts.items() if 0 < v < size}


# ---------------------------------------------------------------- cases
def _fresh(src: Source, root: Path, name: str) -> Path:
    """A copy of the source's pair (and its save-dir files) under root/name."""
    run = root / name
    run.mkdir(parents=True)
    for part in (src.before, src.after, *src.save_files):
        p = src.run / part
        (shutil.copytree if p.is_dir() else shutil.copy2)(p, run / part)
    for d, dirs, files in os.walk(
        run
    ):  # readable by all (atomic writers leave 0600): only a case's damage is not
        for n in dirs:
            (Path(d) / n).chmod(0o755)
        for n in files:
            (Path(d) / n).chmod(0o644)
    return run


def build_cases(srcs: list[Source], root: Path) -> list[Case]:
    """Every damaged copy, under root (one run dir each)."""
    cases: list[Case] = []

    def add(
        src: Source, what: str, damage: Callable[[Path], str | None], unprivileged: bool = False
    ) -> None:
        name = f"{src.name}/{what}"
        run = _fresh(src, root, name.replace("/", "__").replace(" ", "_"))
        after = damage(run / src.after)
        cases.append(
            Case(
                name,
                run,
                str(src.steps[0]),
                after if after is not None else str(src.steps[1]),
                unprivileged,
            )
        )

    for src in srcs:
        for rel in (*src.required, *src.optional):
            f = src.run / src.after / rel if rel else src.run / src.after
            label = rel or f.name
            for where, cut in boundaries(f, f"corpus-{src.name}-{label}").items():
                at = "at a seeded offset" if where == "seeded" else f"in its {where}"
                add(
                    src,
                    f"{label} cut {at} (byte {cut})",
                    lambda a, r=rel, c=cut: _truncate(a / r if r else a, c),
                )
            add(src, f"{label} empty", lambda a, r=rel: _truncate(a / r if r else a, 0))
            if rel and rel in src.required:
                add(src, f"{label} missing", lambda a, r=rel: _remove(a / r))
        first = src.required[0]
        for rel in sorted({first, *src.optional[:1]} - {""}):
            add(src, f"{rel} a symlink loop", lambda a, r=rel: _loop(a / r))
        if first:
            add(src, f"{first} unreadable", lambda a, r=first: _chmod(a / r, 0), unprivileged=True)
            add(src, "checkpoint dir unreadable", lambda a: _chmod(a, 0), unprivileged=True)
            add(src, "checkpoint dir is a file", _dir_to_file)
        else:
            add(src, "checkpoint file unreadable", lambda a: _chmod(a, 0), unprivileged=True)
            add(src, "checkpoint file is a directory", _file_to_dir)
        add(src, "checkpoint is a symlink loop", _loop)
    for src in srcs:
        _pointer_cases(src, add)
    return cases


def _pointer_cases(src: Source, add: Callable[..., None]) -> None:
    """Save-dir pointers (DeepSpeed's `latest`, Megatron's tracker) and world sizes."""
    if src.name == "deepspeed":
        add(
            src,
            "latest names a step that is not there",
            lambda a: _write(a.parent / "latest", "global_step99", a.parent),
        )
        add(
            src,
            "latest lags behind this tag",
            lambda a: _write(a.parent / "latest", "global_step2", None),
        )
        add(src, "an extra rank (another world size)", lambda a: _extra_rank(a))
        add(src, "latest empty", lambda a: _write(a.parent / "latest", "", a.parent))
    if src.name.startswith("megatron"):
        tracker = "latest_checkpointed_iteration.txt"
        add(
            src,
            "tracker names an iteration that is not there",
            lambda a: _write(a.parent / tracker, "99", a.parent),
        )
        add(
            src,
            "tracker lags behind this iteration",
            lambda a: _write(a.parent / tracker, "10", None),
        )
        add(src, "tracker empty", lambda a: _write(a.parent / tracker, "", a.parent))
    if src.name == "megatron-legacy":
        add(
            src,
            "an extra model-parallel rank (another world size)",
            lambda a: shutil.copytree(a / "mp_rank_00", a / "mp_rank_01") and None,
        )
    if src.name == "hf-sharded":
        add(src, "index names a shard that is not there", lambda a: _rename_shard(a))


def _truncate(f: Path, size: int) -> None:
    with f.open("r+b") as fh:
        fh.truncate(size)


def _remove(f: Path) -> None:
    shutil.rmtree(f) if f.is_dir() else f.unlink()


def _loop(f: Path) -> None:
    _remove(f)
    f.symlink_to(f.name)  # relative: a loop wherever the case is


def _chmod(f: Path, mode: int) -> None:
    f.chmod(mode)


def _dir_to_file(a: Path) -> None:
    shutil.rmtree(a)
    a.write_text("not a checkpoint directory\n")


def _file_to_dir(a: Path) -> None:
    a.unlink()
    a.mkdir()


def _write(f: Path, text: str, given: Path | None) -> str | None:
    """Rewrite a save-dir pointer; the case gives the commands `given` (the save dir) instead
    of the step when the pointer is what resolves the checkpoint."""
    f.write_text(text)
    return str(given) if given is not None else None


def _extra_rank(a: Path) -> None:
    src = a / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy2(src, a / "zero_pp_rank_2_mp_rank_00_optim_states.pt")


def _rename_shard(a: Path) -> None:
    index = json.loads((a / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (a / shard).rename(a / f"{shard}.partial")


# ---------------------------------------------------------------- checks
def snapshot(path: Path) -> dict[str, object]:
    """Every name under `path` with its kind, mode and content (symlinks: their target)."""
    out: dict[str, object] = {}
    top = path.parent
    for d, dirs, files in os.walk(path, followlinks=False):
        for n in dirs + files:
            p = Path(d) / n
            st = p.lstat()
            if p.is_symlink():
                out[str(p.relative_to(top))] = ("link", os.readlink(p))
            elif p.is_dir():
                out[str(p.relative_to(top))] = ("dir", st.st_mode)
            else:
                out[str(p.relative_to(top))] = ("file", st.st_mode, p.read_bytes())
    return out


@contextmanager
def unprivileged() -> Iterator[None]:
    """Run as nobody (uid 65534) while the block runs, when the tests run as root: root reads
    files whatever their mode, so permission cases would test nothing."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
