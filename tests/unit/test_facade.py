"""`import ckptforensics as cf`: the commands are the package's functions, pinned."""

from __future__ import annotations

import subprocess
import sys

import ckptforensics as cf


def test_the_package_surface_is_pinned() -> None:
    assert cf.__all__ == [
        "__version__", "inspect", "diff", "replay", "bisect", "whatif", "triage", "plan", "recovery", "audit",
        "regress", "history", "plan_from", "Report", "NotRankZero", "ReplayOptions", "resolve", "open_checkpoint", "open_pair",
        "completeness", "record", "Recorder",
    ]  # fmt: skip
    for name in cf.__all__:
        assert getattr(cf, name) is not None, name


def test_each_command_is_its_module_function_and_every_module_imports_plainly() -> None:
    """cf.replay is `commands/replay.py`'s function, and no submodule shadows it: the engines
    live under `engine/`, so `import ckptforensics.engine.replay.run as run` works as written."""
    code = (
        "import ckptforensics as cf; f = cf.replay; "
        "import ckptforensics.engine.replay.run as run, ckptforensics.engine.diff.pair as pair; "
        "import ckptforensics.commands.replay as r, ckptforensics.commands.diff as d; "
        "assert cf.replay is f is r.replay and cf.diff is d.diff and callable(run.replay); "
        "assert all(callable(getattr(cf, c)) for c in cf.COMMANDS)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_help_and_the_package_load_no_torch() -> None:
    """`ckptforensics --help` and `import ckptforensics` stay fast: neither loads torch (the
    startup bench's `--help` <= 0.5 s; torch alone takes ~2 s)."""
    code = (
        "import sys; import ckptforensics; from ckptforensics.cli import main; "
        "sys.argv = ['ckptforensics', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch loaded'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
