"""Session fixtures: the zoo is trained once per test session (seconds on CPU)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fixtures.zoo import build  # noqa: E402

__all__ = ["ROOT", "build", "free_port", "torchrun"]


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> run dir for every incident and every library-written format."""
    return build(tmp_path_factory.mktemp("zoo"))


def free_port() -> int:
    """A TCP port nobody listens on now (torchrun's rendezvous; fixed ports collide)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(args: list[str], env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 ARGS` on a free port. A launch that fails is tried once
    more on a new port: the port found free can be taken before torchrun binds it, and a
    rendezvous lost that way says nothing about the code under test (a real failure
    fails twice)."""
    exe = Path(sys.executable).with_name("torchrun")
    for attempt in (1, 2):
        cmd = [str(exe), "--nproc_per_node", "2", "--master_port", str(free_port()), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
        if proc.returncode == 0 or attempt == 2 or "error: " in proc.stderr:
            return proc
    return proc


def truth(run: Path) -> dict:
    return json.loads((run / "truth.json").read_text())


def tree_hash(path: Path) -> str:
    """Hash of every file under `path` (names and bytes): inputs must stay byte-identical."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(path.parent)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()
