"""The diff's per-element statistics in one fused pass per chunk (CPU), from `fused.c`.

Computed with torch ops, every statistic of a chunk is its own pass over memory (about
thirty for a weight and its two Adam moments: 0.45 GiB/s per core). The C kernels here
load each element once and take every sum, maximum and count from it in registers, at
the speed memory streams (about 10 GiB/s per core): the diff then runs at the speed of
the disk, or of the page cache.

The kernel is compiled on first use with the system's C compiler (the one torch.compile
and triton need too) into a per-user cache, keyed by its source, the compiler and the
CPU; where none is available, or `CKPTFORENSICS_FUSED=0`, `load()` returns None and the
diff computes the same statistics with torch ops (`diffstats`), as it does on a GPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["Kernels", "WeightStats", "MomentStats", "load", "SAMPLE_STRIDES"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("fused.c")
# -ffp-contract=off: no multiply-add is fused behind the source's back (each rounding is
# the one written); -fno-math-errno lets sqrtf vectorise and changes no value;
# -fopenmp-simd honours the `omp simd` reductions without an OpenMP runtime.
_FLAGS = ["-O3", "-fopenmp-simd", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
_NATIVE = ["-march=native"]
# The share sample's strides the kernel takes (a power of two: positions i & (s - 1) == 0).
SAMPLE_STRIDES = (1, 2, 4, 8, 16, 32, 64)
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


@dataclass(frozen=True, slots=True)
class WeightStats:
    """One chunk of a weight pair (d = b - a, in fp32).

    Attributes:
        sum_a2, sum_d2, sum_abs_d, sum_abs_a: fp64 sums over the chunk (non-finite when
            an element of a or d is).
        max_abs_d, max_abs_b: maxima (meaningful when the sums are finite).
    """

    sum_a2: float
    sum_d2: float
    sum_abs_d: float
    sum_abs_a: float
    max_abs_d: float
    max_abs_b: float


@dataclass(frozen=True, slots=True)
class MomentStats:
    """One chunk of Adam's moments m_A, m_B, v_A, v_B.

    Attributes:
        sum_va, sum_vb: fp64 sums.
        max_abs_mb, max_vb: maxima over the finite values.
        nonfinite_mb, nonfinite_va, nonfinite_vb: NaN / inf counts (where any is not 0,
            the caller recomputes sums and maxima with masks).
        rho_a, rho_b, van_a, van_b, sampled: the share counts on the sample.
        v_pos: elements with v_A > 0.
        low, big: elements under the v floor / over the m bound (torch's predicates).
    """

    sum_va: float
    sum_vb: float
    max_abs_mb: float
    max_vb: float
    nonfinite_mb: int
    nonfinite_va: int
    nonfinite_vb: int
    rho_a: int
    rho_b: int
    van_a: int
    van_b: int
    sampled: int
    v_pos: int
    low: int
    big: int


class Kernels:
    """The loaded C kernels (ctypes; each call releases the GIL)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._w: dict[str, Any] = {}
        self._m: dict[str, Any] = {}
        for k in _DTYPES.values():
            if not hasattr(lib, f"cf_weights_{k}"):
                continue  # fp16 where the compiler has no _Float16: torch ops take those
            w = getattr(lib, f"cf_weights_{k}")
            w.argtypes = [_P, _P, _I64, _P, _P]
            w.restype = None
            m = getattr(lib, f"cf_moments_{k}")
            m.argtypes = [_P, _P, _P, _P, _I64, _I64, _P, _P, _P, _P]
            m.restype = None
            self._w[k], self._m[k] = w, m
        # (x, elements, row address) -> the replay probe's table row of width 6 (an
        # output's) or 3 (a gradient's): `probe_row` without its Python frame, for the
        # probe's hooks (`replay.proberows.ProbeRows`); three arguments for ctypes to convert
        self.probe_rows: dict[int, Any] = {}
        for width, name in ((6, "cf_probe_out_f32"), (3, "cf_probe_grad_f32")):
            f = getattr(lib, name, None)
            if f is not None:
                f.argtypes = [_P, _I64, _P]
                f.restype = None
                self.probe_rows[width] = f
        self._persample = getattr(lib, "cf_persample_f32", None)
        if self._persample is not None:
            self._persample.argtypes = [_P, _I64, _I64, _P, _P, _I64]
            self._persample.restype = None
        self._params = getattr(lib, "cf_params_f32", None)
        if self._params is not None:
            self._params.argtypes = [_I64, _P, _P, _P, _P, _P]
            self._params.restype = None
        self._logits = getattr(lib, "cf_logits_f32", None)
        if self._logits is not None:
            self._logits.argtypes = [_P, _I64, _I64, _P]
            self._logits.restype = None
        self._attn = getattr(lib, "cf_attn_causal_f32", None)
        if self._attn is not None:
            self._attn.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _P, ctypes.c_float, _P]
            self._attn.restype = _I64
        self._crc, folds = getattr(lib, "cf_crc32", None), getattr(lib, "cf_crc32_folds", None)
        # 2: AVX-512 VPCLMULQDQ, 1: PCLMULQDQ, 0: none (zlib's crc32 is then the faster)
        self.crc_level = int(folds()) if folds is not None and self._crc is not None else 0
        if self._crc is not None:
            self._crc.argtypes = [_P, _I64, _I64, _I64]
            self._crc.restype = _I64

    def crc32(self, address: int, n: int, crc: int = 0, most: int = 2) -> int | None:
        """The zip format's CRC-32 (zlib's) of the `n` bytes at `address`, continuing `crc`,
        folded with carry-less multiplies (about 20 GB/s with AVX-512, 8 without, where
        zlib's runs at 2); None where the CPU has none (the caller uses zlib). `most` caps
        the path taken (2, 1, 0: a byte at a time), for tests of each."""
        if self._crc is None or (self.crc_level == 0 and most > 0):
            return None
        return int(self._crc(address, n, crc, most))

    def weights(self, a: torch.Tensor, b: torch.Tensor) -> WeightStats | None:
        """Statistics of a chunk pair (flat, contiguous, CPU, fp32 or bf16, same dtype);
        None where the kernel does not take these tensors (the caller uses torch)."""
        k = _kind(a, b)
        if k is None or k not in self._w:
            return None
        d = np.empty(4, np.float64)
        f = np.empty(2, np.float32)
        self._w[k](a.data_ptr(), b.data_ptr(), a.numel(), d.ctypes.data, f.ctypes.data)
        return WeightStats(*d.tolist(), *f.tolist())

    def moments(
        self, ma: torch.Tensor, mb: torch.Tensor, va: torch.Tensor, vb: torch.Tensor, *,
        stride: int, thr: float, eps: float, floor_k: float, c_mb: float,
    ) -> MomentStats | None:  # fmt: skip
        """Statistics of one chunk of Adam's moments, mirroring diffstats' torch code:

        rho: |m| - thr sqrt(v) > thr eps, sampled every `stride`-th element; vanished:
        v < 100 eps^2 on the sample; v_pos: v_A > 0; low: v_B < v_A floor_k; big:
        |m_B| > sqrt(v_B) c_mb. The scalars are rounded to fp32 as torch rounds a Python
        scalar it compares or multiplies an fp32 tensor with.
        """
        k = _kind(ma, mb, va, vb)
        if k is None or k not in self._m or stride not in SAMPLE_STRIDES or ma.numel() >= 1 << 31:
            return None
        with np.errstate(over="ignore"):
            par = np.array([thr, thr * eps, 100 * eps * eps, floor_k, c_mb], dtype=np.float32)
        d = np.empty(2, np.float64)
        f = np.empty(2, np.float32)
        c = np.empty(11, np.int64)
        self._m[k](
            ma.data_ptr(), mb.data_ptr(), va.data_ptr(), vb.data_ptr(), ma.numel(), stride - 1,
            par.ctypes.data, d.ctypes.data, f.ctypes.data, c.ctypes.data,
        )  # fmt: skip
        return MomentStats(*d.tolist(), *f.tolist(), *c.tolist())

    def probe_row(self, x: torch.Tensor, row: int, table: torch.Tensor) -> bool:
        """The replay probe's table row of an fp32 tensor `x` (CPU, contiguous, not empty;
        the caller checks) into row `row` of `table` (fp32, CPU, contiguous: 6 columns,
        an output's [max |x|, RMS, non-finite, over fp16, over bf16, 0]; 3, a gradient's
        [L2 norm, max |x|, non-finite]), in one pass, from the hook while `x` is in cache
        (`replay.proberows.ProbeRows` calls `probe_rows` itself). False where the library has no
        such kernel."""
        width = table.shape[1]
        f = self.probe_rows.get(width)
        if f is None:
            return False
        f(x.data_ptr(), x.numel(), table.data_ptr() + 4 * width * row)
        return True

    def persample(
        self, per: torch.Tensor, norms: int, total: torch.Tensor, accumulate: bool
    ) -> bool:
        """Per-sample L2 norms of the products `per` [B, ...] into the fp32 [B] buffer at
        address `norms` (a row of the replay's buffer, no view made per call) and their sum
        over samples into `total` (added to it with `accumulate`), in one pass; all fp32,
        CPU, contiguous, `per` not empty (the caller checks). False where the library has
        no such kernel."""
        if self._persample is None:
            return False
        b = per.shape[0]
        self._persample(per.data_ptr(), b, per.numel() // b, norms, total.data_ptr(), accumulate)
        return True

    def param_sums(
        self, gp: Sequence[int], vp: Sequence[int], numels: Sequence[int], e: Sequence[float]
    ) -> list[list[float]] | None:
        """[P][4] = [sum g^2, sum g^2 / (v + e), spikes, finite] per gradient (float64 sums,
        as Python numbers), one pass each in one call (the replay's `param_grad_table`), from
        the tensors' addresses (fp32 contiguous CPU gradients `gp`, moments `vp` of the same
        sizes or 0 for none: NaN / 0), their sizes and `e` (rounded to fp32, as torch rounds
        a scalar it adds); None where the library has no such kernel. ctypes arrays in and
        out: a few dozen numbers, for which numpy's conversions cost more than the call."""
        if self._params is None:
            return None
        n = len(gp)
        i64 = ctypes.c_int64 * n
        out = (ctypes.c_double * (4 * n))()
        self._params(n, i64(*gp), i64(*vp), i64(*numels), (ctypes.c_float * n)(*e), out)
        flat = out[:]
        return [flat[4 * k : 4 * k + 4] for k in range(n)]

    def logit_figures(self, x: torch.Tensor) -> tuple[float, float, float] | None:
        """(max |x|, sum over rows of logsumexp, rows) of logits x [..., V] (fp32, CPU,
        contiguous, not empty) in one pass (`cf_logits_f32`); None where the kernel does
        not take them."""
        if (
            self._logits is None
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or x.dim() < 1
            or x.numel() == 0
            or not x.is_contiguous()
        ):
            return None
        v = x.shape[-1]
        out = (ctypes.c_double * 3)()
        self._logits(x.data_ptr(), x.numel() // v, v, out)
        return out[0], out[1], out[2]

    def causal_attention(
        self, s: torch.Tensor, w: torch.Tensor, rows: float, out: torch.Tensor
    ) -> bool | None:
        """The replay's attention statistics of causal logits s [L, b, H, t, S] (SDPA's
        top-left mask added as a 0 / -inf bias) into out [L, H, 3] = [max logit, sum over
        rows of w[row] x entropy, `rows`], as `replay.attnstats._accumulate` takes them,
        in one pass (`cf_attn_causal_f32`); w [t] are the rows' weights. All fp32, CPU,
        contiguous. True when done; False where a logit is NaN (out unspecified: the
        caller's masked_fill path); None where the kernel does not take these tensors,
        the library has no such kernel or its scratch could not be allocated."""
        if (
            self._attn is None
            or s.dim() != 5
            or s.numel() == 0
            or s.dtype != torch.float32
            or s.device.type != "cpu"
            or not s.is_contiguous()
            or not all(x.dtype == torch.float32 and x.device.type == "cpu" for x in (w, out))
            or not (w.is_contiguous() and out.is_contiguous())
            or w.shape != s.shape[3:4]
            or out.shape != (s.shape[0], s.shape[2], 3)
        ):
            return None
        n, b, h, t, sk = s.shape
        rc = self._attn(s.data_ptr(), n, b, h, t, sk, w.data_ptr(), rows, out.data_ptr())
        return None if rc < 0 else rc == 0


def _kind(*ts: torch.Tensor) -> str | None:
    k = _DTYPES.get(ts[0].dtype)
    n = ts[0].numel()
    ok = k is not None and all(
        t.dtype == ts[0].dtype and t.device.type == "cpu" and t.is_contiguous() and t.numel() == n
        for t in ts
    )
    return k if ok and n > 0 else None


_lock = threading.Lock()
_loaded: list[Kernels | None] = []


def load() -> Kernels | None:
    """The kernels, compiled on first use; None where they cannot be had (no compiler,
    an unusable cache directory, or CKPTFORENSICS_FUSED=0): the caller then uses torch."""
    with _lock:
        if not _loaded:
            _loaded.append(_build())
        return _loaded[0]


def _build() -> Kernels | None:
    if os.environ.get("CKPTFORENSICS_FUSED", "1").strip().lower() in ("0", "false", "no", "off"):
        log.info("fused diff kernels disabled (CKPTFORENSICS_FUSED=0): statistics in torch ops")
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        log.info("no C compiler found: the diff computes its statistics with torch ops (slower)")
        return None
    try:
        key = _key(cc)
        cache = _cache_dir()
        so = cache / f"fused-{key}.so" if cache is not None else None
        if so is None or not so.exists():
            so = _compile(cc, key, cache)
        kernels = Kernels(ctypes.CDLL(str(so)))
        if cache is None:  # a private temporary build: the loaded library outlives its file
            shutil.rmtree(so.parent, ignore_errors=True)
        return kernels
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        log.info(
            "fused diff kernels unavailable (%s): the diff computes its statistics with torch ops",
            str(e).splitlines()[0] if str(e) else type(e).__name__,
        )
        return None


def _key(cc: str) -> str:
    """What the library depends on: its source, the compiler, the flags and the CPU."""
    version = subprocess.run(
        [*shlex.split(cc), "--version"], capture_output=True, timeout=30
    ).stdout
    parts = (_SOURCE.read_bytes(), version, _cpu_id().encode(), " ".join(_FLAGS).encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _compile(cc: str, key: str, cache: Path | None) -> Path:
    """Compile fused.c into the cache (atomically: concurrent workers and ranks each
    write their own file, and the last rename wins an identical file)."""
    where = cache if cache is not None else Path(tempfile.mkdtemp(prefix="ckptforensics-fused-"))
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=where)
    os.close(fd)
    err = b""
    for extra in (_NATIVE, []):  # -march=native where the compiler knows it
        r = subprocess.run(
            [*shlex.split(cc), *_FLAGS, *extra, "-o", tmp, str(_SOURCE)],
            capture_output=True,
            timeout=120,
        )
        if r.returncode == 0:
            dest = where / f"fused-{key}.so"
            os.replace(tmp, dest)
            log.debug("compiled the fused diff kernels into %s", dest)
            return dest
        err = r.stderr
    Path(tmp).unlink(missing_ok=True)
    raise OSError(f"{cc} failed: {err.decode(errors='replace').strip()[:200]}")


def _cache_dir() -> Path | None:
    """A directory only this user can write ($CKPTFORENSICS_CACHE, else the XDG cache):
    a library loaded from a directory others can write to would run their code."""
    base = os.environ.get("CKPTFORENSICS_CACHE")
    root = (
        Path(base)
        if base
        else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ckptforensics"
    )
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = root.stat()
    except OSError:
        return None
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.info(
            "cache %s is not private to this user: the fused kernels are compiled per process", root
        )
        return None
    return root


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's feature flags (a cache shared by nodes of
    different CPUs then keeps one library per CPU kind)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"
