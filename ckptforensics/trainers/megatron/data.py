"""Megatron's training data, read without megatron-core: the batch of an iteration rebuilt.

Two parts, both documented file formats that megatron-core writes:

- the **indexed dataset** (`PREFIX.idx` + `PREFIX.bin`; megatron/core/datasets/
  indexed_dataset.py): the index is the header `MMIDIDX\\0\\0`, version (<Q> = 1), the
  token dtype's code (<B>: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
  7 float32, 8 uint16), the sequence count and the document count (<Q> each), then the
  sequence lengths (int32), the sequences' byte offsets into the .bin (int64) and the
  document boundaries (int64). The .bin is the tokens back to back.
- the **GPTDataset index caches** (`<hash>-GPTDataset-train-{document,sample,shuffle}_index.npy`,
  with `description.txt` naming the sequence length and seed): sample i is
  `shuffle_index[i]`'s span of `sample_index` (document position and offset at each end)
  over the documents in `document_index` order, `sequence_length + 1` tokens (the extra
  token is the last label); `tokens = text[:-1]`, `labels = text[1:]`.

Megatron's pretraining sampler hands out global samples in order: iteration `it` (the
update that makes checkpoint `it + 1`) consumes samples `it x global_batch_size` to
`(it + 1) x global_batch_size - 1`. Caches are read with `allow_pickle=False`: they are
plain integer arrays, and an untrusted one that is not is refused.

The run's args record `--data-path` and `--data-cache-path` as the launch script passed
them, mostly relative to the launch directory: they are resolved against the run directory,
its parents and `--data`'s parent (`paths.resolve_recorded`), and the one used is stated.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptforensics.core.paths import resolve_recorded
from ckptforensics.formats.batches import BatchError, BatchSource

__all__ = ["IndexedTokens", "GPTSamples", "megatron_batches", "is_megatron_data"]

_HEADER = b"MMIDIDX\x00\x00"
_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


@dataclass
class IndexedTokens:
    """A Megatron indexed dataset (`.idx` + `.bin`), memory-mapped."""

    prefix: Path
    dtype: Any
    lengths: np.ndarray
    pointers: np.ndarray
    documents: np.ndarray
    bin: np.ndarray

    @classmethod
    def open(cls, prefix: Path) -> IndexedTokens:
        idx, bin_ = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
        try:
            raw = idx.read_bytes()
            if raw[:9] != _HEADER:
                raise BatchError(f"{idx}: not a Megatron index (header {raw[:9]!r})")
            (version,) = struct.unpack_from("<Q", raw, 9)
            (code,) = struct.unpack_from("<B", raw, 17)
            n_seq, n_doc = struct.unpack_from("<QQ", raw, 18)
            if version != 1 or code not in _DTYPES:
                raise BatchError(
                    f"{idx}: Megatron index version {version}, dtype code {code}: not one this reader knows"
                )
            off = 34
            lengths = np.frombuffer(raw, np.int32, n_seq, off)
            pointers = np.frombuffer(raw, np.int64, n_seq, off + lengths.nbytes)
            documents = np.frombuffer(raw, np.int64, n_doc, off + lengths.nbytes + pointers.nbytes)
            data = np.memmap(bin_, dtype=np.uint8, mode="r")
        except (OSError, ValueError, struct.error) as e:
            raise BatchError(
                f"{prefix}: unreadable Megatron indexed dataset ({type(e).__name__}: {e})"
            ) from None
        dtype = _DTYPES[code]
        end = int(pointers[-1]) + int(lengths[-1]) * np.dtype(dtype).itemsize if n_seq else 0
        if end > data.size:
            raise BatchError(f"{bin_}: truncated ({data.size} bytes; the index needs {end})")
        return cls(prefix, dtype, lengths, pointers, documents, data)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence i from `offset`, `length` of them (default: to its end)."""
        n = int(self.lengths[i]) - offset if length is None else int(length)
        start = int(self.pointers[i]) + offset * np.dtype(self.dtype).itemsize
        return np.frombuffer(self.bin, dtype=self.dtype, count=n, offset=start)


@dataclass
class GPTSamples:
    """GPTDataset's samples from its index caches (megatron/core/datasets/gpt_dataset.py)."""

    tokens: IndexedTokens
    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray
    sequence_length: int
    description: dict[str, Any]
    cache_dir: Path | None = None  # where the index caches were read

    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

    def text(self, i: int) -> np.ndarray:
        """The `sequence_length + 1` tokens of sample i (GPTDataset's add_extra_token_to_sequence)."""
        j = int(self.shuffle_index[i])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        if d0 == d1:
            parts = [self.tokens.get(int(self.document_index[d0]), o0, o1 - o0 + 1)]
        else:
            parts = [
                self.tokens.get(
                    int(self.document_index[k]), o0 if k == d0 else 0, None if k < d1 else o1 + 1
                )
                for k in range(d0, d1 + 1)
            ]
        out = np.concatenate(parts).astype(np.int64)
        if (
            out.size < self.sequence_length + 1
        ):  # the dataset's last sample: GPTDataset pads with the tokenizer's pad id
            raise BatchError(
                f"sample {i} is short ({out.size} of {self.sequence_length + 1} tokens): the end of the data"
            )
        return out


def _load_index(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise BatchError(
            f"{path}: not a plain GPTDataset index ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        ) from None


def _find(root: Path, pattern: str) -> list[Path]:
    return sorted(p for p in [*root.glob(pattern), *root.glob(f"*/{pattern}")] if p.is_file())


def is_megatron_data(path: Path) -> bool:
    """A dir (or its subdirs) with an indexed dataset and GPTDataset caches, or a prefix."""
    if path.with_name(path.name + ".idx").is_file():
        return True
    return (
        path.is_dir()
        and bool(_find(path, "*.idx"))
        and bool(_find(path, "*-GPTDataset-train-sample_index.npy"))
    )


def _caches(
    root: Path, seq_length: int | None, seed: int | None
) -> list[tuple[Path, dict[str, Any]]]:
    """GPTDataset train caches under `root` (or one level down) built for this sequence
    length and seed (their description.txt)."""
    out = []
    for desc in _find(root, "*-GPTDataset-train-description.txt"):
        try:
            d = json.loads(desc.read_text())
        except (OSError, ValueError):
            continue
        if (seq_length is None or d.get("sequence_length") == seq_length) and (
            seed is None or d.get("random_seed") == seed
        ):
            out.append((desc, d))
    return out


def open_samples(
    data: Path,
    seq_length: int | None = None,
    seed: int | None = None,
    cache: Path | None = None,
    prefix: Path | None = None,
) -> GPTSamples:
    """The GPTDataset of `data`: a directory holding one indexed dataset and its caches (in
    it or one level down), or a dataset prefix; `prefix` names the dataset when `data` is a
    directory that does not say (the run's `--data-path`). The caches come from `cache`
    (the run's `--data-cache-path`) when it holds them, else from beside the dataset.
    Several caches are told apart by their description's sequence length and seed."""
    if data.with_name(data.name + ".idx").is_file():
        prefix, root = data, data.parent
    elif prefix is None:
        idx = _find(data, "*.idx")
        if len(idx) != 1:
            raise BatchError(
                f"--data {data}: {len(idx)} indexed datasets (*.idx); pass the one the run trained on as a prefix"
            )
        prefix, root = idx[0].with_suffix(""), data
    else:
        root = data if data.is_dir() and data in prefix.parents else prefix.parent
    caches = _caches(cache, seq_length, seed) if cache is not None else []
    caches = caches or _caches(root, seq_length, seed)
    if len(caches) != 1:
        where = f"{cache} (the run's --data-cache-path) nor " if cache is not None else ""
        raise BatchError(
            f"--data {data}: {len(caches)} GPTDataset train caches for sequence length {seq_length}, seed {seed} in {where}{root} "
            "(the run's *-GPTDataset-train-*_index.npy under its --data-cache-path); rebuilding them is megatron-core's job"
        )
    desc, d = caches[0]
    base = desc.name.removesuffix("description.txt")
    get = lambda affix: _load_index(desc.with_name(base + affix))  # noqa: E731
    samples = GPTSamples(
        IndexedTokens.open(prefix),
        get("document_index.npy"),
        get("sample_index.npy"),
        get("shuffle_index.npy"),
        int(d["sequence_length"]),
        d,
    )
    samples.cache_dir = desc.parent
    return samples


def _recorded_prefix(args: dict[str, Any]) -> str | None:
    """The one dataset prefix of the run's `--data-path` (weights dropped); None for a blend."""
    raw = args.get("data_path")
    items = raw.split() if isinstance(raw, str) else raw if isinstance(raw, (list, tuple)) else []
    prefixes = [x for x in items if isinstance(x, str) and not _is_number(x)]
    return prefixes[0] if len(prefixes) == 1 else None


def _is_number(x: str) -> bool:
    try:
        float(x)
    except ValueError:
        return False
    return True


def _locate(
    data: Path, args: dict[str, Any], run_dir: Path | None, seq: int | None
) -> tuple[Path | None, Path | None, list[str]]:
    """(the dataset prefix when `--data` does not name one, the caches' dir, what was used):
    the run's `--data-path` and `--data-cache-path`, resolved (`paths.resolve_recorded`)."""
    said: list[str] = []
    prefix = None
    named = data.with_name(data.name + ".idx").is_file() or (
        data.is_dir() and len(_find(data, "*.idx")) == 1
    )
    recorded = _recorded_prefix(args)
    if not named and recorded is not None:
        is_prefix = lambda p: p.with_name(p.name + ".idx").is_file()  # noqa: E731
        under = (
            [p.with_suffix("") for p in _find(data, Path(recorded).name + ".idx")]
            if data.is_dir()
            else []
        )
        if len(under) == 1:
            prefix = under[0]
            said.append(
                f"dataset {prefix} (the run's --data-path {recorded}, by name under --data)"
            )
        elif (
            found := resolve_recorded(recorded, run_dir or data, data, holds=is_prefix)
        ) is not None:
            prefix = found.path
            said.append(f"dataset: --data-path {found.how}")
    cache = None
    has = lambda p: p.is_dir() and bool(_caches(p, seq, args.get("seed")))  # noqa: E731
    found = resolve_recorded(
        args.get("data_cache_path") if isinstance(args.get("data_cache_path"), str) else None,
        run_dir or data,
        data,
        holds=has,
    )
    if found is not None:
        cache = found.path
        said.append(f"caches: --data-cache-path {found.how}")
    return prefix, cache, said


def megatron_batches(
    data: str, args: dict[str, Any] | None, run_dir: Path | None = None
) -> BatchSource:
    """The global batch of every step from the run's data: step s is iteration s - 1,
    samples (s - 1) x global_batch_size onwards; `labels` are next-token targets.
    `run_dir`: the directory holding the run's checkpoints (`--save`), against which the
    paths the run recorded relative to its launch directory are resolved."""
    if not args:
        raise BatchError(
            "--data needs the run's Megatron args in the checkpoint (global batch size, sequence length, seed)"
        )
    gbs, seq = args.get("global_batch_size"), args.get("seq_length")
    if not isinstance(gbs, int) or gbs < 1:
        raise BatchError("--data: the checkpoint's args give no global_batch_size")
    seq = seq if isinstance(seq, int) else None
    prefix, cache, said = _locate(Path(data), args, run_dir, seq)
    samples = open_samples(Path(data), seq, args.get("seed"), cache, prefix)
    if cache is None or samples.cache_dir != cache:
        said.append(f"caches: {samples.cache_dir} (beside the dataset)")
    n_steps = len(samples) // gbs

    def get(step: int) -> dict[str, torch.Tensor]:
        text = torch.from_numpy(
            np.stack([samples.text(i) for i in range((step - 1) * gbs, step * gbs)])
        )
        return {"input_ids": text[:, :-1].contiguous(), "labels": text[:, 1:].contiguous()}

    mbs = args.get("micro_batch_size")
    src = BatchSource(
        describe=f"{data} (Megatron GPTDataset, {len(samples)} samples, global batch {gbs}; {'; '.join(said)})", get=get, steps=list(range(1, n_steps + 1)),
        labels_shifted=True, micro_batch_size=int(mbs) if isinstance(mbs, int) and mbs < gbs else None, rebuilt=True,
    )  # fmt: skip
    src.sample_ids = {s: list(range((s - 1) * gbs, s * gbs)) for s in src.steps or []}
    return src
