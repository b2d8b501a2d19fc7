"""`import ckptforensics as cf`: the commands are the package's functions, pinned."""

from __future__ import annotations

import subprocess
import sys

import ckptforensics as cf


def test_the_package_surface_is_pinned() -> None:
    assert cf.__all__ == [
        "__version__", "inspect", "diff", "replay", "bisect", "whatif", "triage", "plan", "recovery", "audit",
        "api", "Report", "ReplayOptions", "resolve", "open_checkpoint", "open_pair", "completeness", "record", "Recorder",
    ]  # fmt: skip
    for name in cf.__all__:
        assert getattr(cf, name) is not None, name


def test_a_command_stays_the_command_after_its_submodule_is_imported() -> None:
    """The submodules of the same names (ckptforensics.engine.replay, .diff, ...) are imported by
    the commands themselves: cf.replay is the function before and after."""
    code = (
        "import ckptforensics as cf; f = cf.replay; "
        "import ckptforensics.engine.replay.run, ckptforensics.engine.diff.pair, ckptforensics.commands.triage, ckptforensics.engine.bisect; "
        "from ckptforensics.engine.replay.run import ReplayConfig; from ckptforensics import api; "
        "assert cf.replay is f is api.replay and cf.diff is api.diff and cf.triage is api.triage and cf.bisect is api.bisect; "
        "assert callable(cf.whatif) and callable(cf.plan) and callable(cf.recovery) and callable(cf.audit)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
