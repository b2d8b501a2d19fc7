"""Equivalence: the replay reports of this checkout and of another (the code before a change
to the replay's step) agree, on every run directory given that logged its batches (a zoo
incident's `truth.json` names the replay's `--model` and `--batch`).

Each report is `ckptforensics replay` in a child process per checkout (its PYTHONPATH);
report.json documents are compared field by field with `diff_equivalence.compare`:
integers, booleans and list lengths exactly, floats within --rel. Strings are compared
exactly as well (a message quoting a figure that moved in its last printed digit is
listed, with both texts). Prints the largest relative float difference, per field and
overall, and every difference; exits 1 when one is past --rel or a string differs.

    python bench/replay_equivalence.py --reference ../main build/zoo/*
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diff_equivalence import VOLATILE, Delta, compare  # noqa: E402

HERE = Path(__file__).resolve().parent.parent


def replay_report(checkout: Path, run: Path, out: Path) -> dict | str:
    """report.json of the replay a user would type for `run` (its truth.json hint), made by
    `checkout`'s code; the child's last error line where it failed."""
    truth = json.loads((run / "truth.json").read_text())
    hint = truth["replay"]
    cmd = [sys.executable, "-m", "ckptforensics.cli", "-q", "replay"]
    if hint.get("model"):
        spec = hint["model"]
        local = run / spec.split(":")[0]
        cmd += ["--model", str(run / spec) if local.is_file() else spec]
    cmd += ["--batch", str(run / hint["batch"])]
    cmd += ["--precision", hint["precision"]] if hint.get("precision") else []
    before, after = str(truth.get("before", 30)), str(truth.get("after", 40))
    cmd += ["--run-dir", str(run), "--before", before, "--after", after, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=checkout, env=env)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return json.loads((out / "report.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--reference", type=Path, required=True, help="the other checkout's root")
    ap.add_argument("--rel", type=float, default=1e-5)
    args = ap.parse_args()
    runs = [
        r
        for r in args.runs
        if (r / "truth.json").is_file() and json.loads((r / "truth.json").read_text()).get("replay")
    ]
    worst: dict[str, float] = {}
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            docs = [
                replay_report(c.resolve(), run.resolve(), Path(tmp) / f"{run.name}-{k}")
                for k, c in enumerate((args.reference, HERE))
            ]
            if isinstance(docs[0], str) or isinstance(docs[1], str):
                print(f"{run.name}: a replay failed: {docs[0]!r} / {docs[1]!r}")
                failed |= docs[0] != docs[1]
                continue
            d = Delta()
            compare(docs[0], docs[1], "", args.rel, d)
            strings: list[str] = []
            _strings(docs[0], docs[1], "", strings)
            top = max(d.worst.values(), default=0.0)
            field = max(d.worst, key=d.worst.get) if d.worst else "-"
            print(
                f"{run.name}: largest relative difference {top:.2e} ({field}); "
                f"{len(d.hard)} past {args.rel:g}; {len(strings)} string(s) differ"
            )
            for line in d.hard + strings:
                print(f"    {line}")
            for k, v in d.worst.items():
                worst[k] = max(worst.get(k, 0.0), v)
            failed |= bool(d.hard or strings)
    top = max(worst.values(), default=0.0)
    print(f"{len(runs)} runs; largest relative float difference overall {top:.2e}")
    for k, v in sorted(worst.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {k}: {v:.2e}")
    sys.exit(1 if failed or not math.isfinite(top) else 0)


def _strings(x: object, y: object, where: str, out: list[str]) -> None:
    """Every string that differs between the two documents (`compare` lets a message's
    quoted figures differ in their last printed digit; this does not)."""
    if isinstance(x, dict) and isinstance(y, dict):
        for k in x.keys() & y.keys():
            if k not in VOLATILE:
                _strings(x[k], y[k], f"{where}.{k}", out)
    elif isinstance(x, list) and isinstance(y, list):
        for i, (u, v) in enumerate(zip(x, y, strict=False)):
            _strings(u, v, f"{where}[{i}]", out)
    elif isinstance(x, str) and isinstance(y, str) and x != y:
        out.append(f"string {where}: {x!r} against {y!r}")


if __name__ == "__main__":
    main()
