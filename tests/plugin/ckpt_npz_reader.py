"""A third-party reader, as a plugin package would ship it: `.npz` archives of tensors.

Registered through the `ckptforensics.formats` entry point (see
`ckpt_npz_reader-0.1.dist-info/entry_points.txt`); it uses only the public reader API.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptforensics.formats import Checkpoint, TensorMeta


def open_npz(path: Path) -> Checkpoint:
    arrays = np.load(path, allow_pickle=False)  # data, never code
    ck = Checkpoint(path=path, format="npz")
    for name in arrays.files:
        a = arrays[name]
        ck.add_tensor(
            name,
            TensorMeta(tuple(a.shape), torch.from_numpy(a[:0].copy()).dtype),
            lambda n=name: torch.from_numpy(arrays[n]),
        )
    return ck


def is_npz(path: Path) -> bool:
    return path.is_file() and path.suffix == ".npz"


def register(reg: Any) -> None:
    reg("npz", open_npz, is_npz)
