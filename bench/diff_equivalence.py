"""Equivalence: the diff's reports from the fused kernel, from its torch fallback and from
another checkout (the code before the kernel) agree, on every adjacent checkpoint pair
of the run directories given (the zoo, drawn runs).

Each report is made in a child process (a checkout is a PYTHONPATH; the fallback is
CKPTFORENSICS_FUSED=0); report.json documents are compared field by field: strings,
integers, booleans and list lengths exactly, floats within --rel (the fused kernel sums
in fp64 where torch's chunk dots round in fp32). Prints every difference and the largest
relative difference per field; exits 1 when a difference is past --rel.

    python bench/diff_equivalence.py --reference ../main runs/lr_jump runs/hf-trainer ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Fields that name where or when a report was made, not what it found.
VOLATILE = {
    "command",
    "report_dir",
    "created",
    "generated_at",
    "tool_version",
    "version",
    "path",
    "paths",
    "wall_s",
    "elapsed_s",
    "host",
}


@dataclass
class Delta:
    """Differences between two report documents."""

    hard: list[str] = field(default_factory=list)  # past tolerance, or not a float
    worst: dict[str, float] = field(
        default_factory=dict
    )  # field -> largest relative float difference


def steps_of(run: Path) -> list[str]:
    """The checkpoint steps of a run directory (step_N.pt, checkpoint-N, epoch=..-step=N.ckpt, ...), sorted."""
    found = {
        int(m.group(1))
        for p in run.iterdir()
        if (m := re.search(r"(?:step[_=-]?|checkpoint-|global_step)(\d+)", p.name))
    }
    return [str(s) for s in sorted(found)]


def reports(run: Path, pairs: list[tuple[str, str]], env: dict[str, str]) -> list[dict] | str:
    """report.json of `diff --before a --after b` for each pair, in one child process under
    `env` (torch imported once); the child's error text where it failed."""
    code = (
        "import json, sys; import ckptforensics; "
        "assert ckptforensics.__file__.startswith(sys.argv[2]), ckptforensics.__file__; "
        "pairs = json.loads(sys.argv[3]); "
        "print(json.dumps([ckptforensics.diff(a, b, run_dir=sys.argv[1], workers=1).doc for a, b in pairs]))"
    )
    # cwd: not a checkout (`python -c` puts the working directory first on sys.path).
    out = subprocess.run(
        [sys.executable, "-c", code, str(run), env["PYTHONPATH"], json.dumps(pairs)], env=env, capture_output=True, text=True, cwd=run,
    )  # fmt: skip
    if out.returncode != 0:
        return (
            out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(x: object, y: object, where: str, rel: float, d: Delta) -> None:
    key = re.sub(r"\[\d+\]", "[]", where)
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(x.keys() | y.keys()):
            if k in VOLATILE:
                continue
            if k not in x or k not in y:
                d.hard.append(f"{where}.{k}: only in {'reference' if k in x else 'new'}")
                continue
            compare(x[k], y[k], f"{where}.{k}", rel, d)
    elif isinstance(x, list) and isinstance(y, list):
        if len(x) != len(y):
            d.hard.append(f"{where}: {len(x)} items against {len(y)}")
        for i, (u, v) in enumerate(zip(x, y, strict=False)):
            compare(u, v, f"{where}[{i}]", rel, d)
    elif isinstance(x, float) and isinstance(y, float | int) and not isinstance(y, bool):
        if x == y or (math.isnan(x) and math.isnan(float(y))):
            return
        r = abs(x - y) / max(abs(x), abs(y)) if math.isfinite(x) and math.isfinite(y) else math.inf
        d.worst[key] = max(d.worst.get(key, 0.0), r)
        if r > rel:
            d.hard.append(f"{where}: {x!r} against {y!r}")
    elif isinstance(x, str) and isinstance(y, str) and x != y:
        # Messages quote figures: equal once their numbers agree to --rel.
        nx, ny = _numbers(x), _numbers(y)
        if (
            _words(x) != _words(y)
            or len(nx) != len(ny)
            or any(_far(u, v, rel) for u, v in zip(nx, ny, strict=True))
        ):
            d.hard.append(f"{where}: {x!r} against {y!r}")
    elif not isinstance(x, float | str | dict | list) and x != y:
        d.hard.append(f"{where}: {x!r} against {y!r}")


def _within(line: str, loose: dict[str, float], d: Delta) -> bool:
    """A float difference on a field given its own tolerance, and within it."""
    m = re.match(r"(\S+): (\S+) against (\S+)$", line)
    if m is None or m.group(1).rsplit(".", 1)[-1] not in loose:
        return False
    try:
        x, y = float(m.group(2)), float(m.group(3))
    except ValueError:
        return False
    return abs(x - y) <= loose[m.group(1).rsplit(".", 1)[-1]] * max(abs(x), abs(y))


_NUM = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _numbers(s: str) -> list[float]:
    return [float(m) for m in _NUM.findall(s)]


def _words(s: str) -> str:
    return _NUM.sub("#", s)


def _far(u: float, v: float, rel: float) -> bool:
    # A message prints 3-4 significant digits: a last-digit change is rounding, not a finding.
    return u != v and abs(u - v) > max(rel, 1e-2) * max(abs(u), abs(v))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument(
        "--reference",
        type=Path,
        help="a checkout of the code to compare with (its repository root)",
    )
    ap.add_argument("--rel", type=float, default=1e-5)
    ap.add_argument(
        "--field-rel",
        action="append",
        default=[],
        metavar="FIELD=REL",
        help="a looser tolerance for one field against --reference (e.g. r_v=1e-3)",
    )
    args = ap.parse_args()
    here = str(HERE.parent)
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    envs = {
        "fused": {**base, "PYTHONPATH": here},
        "torch": {**base, "PYTHONPATH": here, "CKPTFORENSICS_FUSED": "0"},
    }
    if args.reference:
        envs["reference"] = {
            **base,
            "PYTHONPATH": str(args.reference.resolve()),
            "CKPTFORENSICS_FUSED": "0",
        }
    loose = {k: float(v) for k, v in (f.split("=", 1) for f in args.field_rel)}
    worst: dict[str, dict[str, float]] = {}
    failed = 0
    pairs = 0
    for run in args.runs:
        steps = steps_of(run)
        run_pairs = list(zip(steps, steps[1:], strict=False))
        docs = {k: reports(run, run_pairs, env) for k, env in envs.items()}
        pairs += len(run_pairs)
        for other in (k for k in docs if k != "fused"):
            for k in ("fused", other):
                if isinstance(docs[k], str):
                    failed += 1
                    print(f"{run.name}: {k} failed: {docs[k]}")
            if isinstance(docs["fused"], str) or isinstance(docs[other], str):
                continue
            for (a, b), x, y in zip(run_pairs, docs[other], docs["fused"], strict=True):
                d = Delta()
                compare(x, y, "", args.rel, d)
                if other == "reference":
                    d.hard = [h for h in d.hard if not _within(h, loose, d)]
                for k, v in d.worst.items():
                    w = worst.setdefault(other, {})
                    w[k] = max(w.get(k, 0.0), v)
                for line in d.hard:
                    failed += 1
                    print(f"{run.name} {a}->{b} fused vs {other}: {line}")
    print(
        f"{pairs} pairs of {len(args.runs)} runs compared; {failed} differences past rel {args.rel:g}"
    )
    for other, w in worst.items():
        top = sorted(w.items(), key=lambda kv: -kv[1])[:8]
        print(
            f"largest relative float differences, fused vs {other}: "
            + ", ".join(f"{k} {v:.1e}" for k, v in top)
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
