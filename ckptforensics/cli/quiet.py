"""Libraries' warnings kept in the log: a failure is one line on stderr, not a library's
warnings and then the line.

Python's `warnings` (torch's, numpy's) are captured into the log, and transformers' logging,
which writes to stderr through a handler of its own (its config checks warn before a
refusal's one line), is sent to the log too. There they are DEBUG records: shown with -vv.
With --debug nothing is rerouted, and every library speaks as it would.
"""

from __future__ import annotations

import importlib.machinery
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

__all__ = ["libraries", "LIBRARY_LOGGERS"]

# The loggers of libraries whose warnings are theirs to fix, not the user's: `warnings`
# (captured as `py.warnings`) and transformers' (config validation, deprecations).
LIBRARY_LOGGERS = ("py.warnings", "transformers")
_TF_LOGGING = "transformers.utils.logging"


@contextmanager
def libraries(*, debug: bool = False) -> Iterator[None]:
    """Libraries' warnings into the log as DEBUG records for as long as it runs (shown with
    -vv); with `debug`, left as the libraries print them. Restored on the way out."""
    if debug:
        yield
        return
    root = logging.getLogger()
    demote = _AsDebug()
    handlers = list(root.handlers)
    for h in handlers:
        h.addFilter(demote)
    captured = logging.captureWarnings
    captured(True)
    hook = _AfterImport(_TF_LOGGING, _into_the_log)
    undo: list[Callable[[], None]] = []
    if _TF_LOGGING in sys.modules:
        undo.append(_into_the_log(sys.modules[_TF_LOGGING]))
    else:
        sys.meta_path.insert(0, hook)
    try:
        yield
    finally:
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)
        for fn in undo + hook.undo:
            fn()
        captured(False)
        for h in handlers:
            h.removeFilter(demote)


class _AsDebug(logging.Filter):
    """On the log's handlers: a library's record is demoted to DEBUG and passes only when
    the log shows DEBUG (-vv); the tool's own records pass as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(LIBRARY_LOGGERS):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().getEffectiveLevel() <= logging.DEBUG


def _into_the_log(tf_logging: ModuleType) -> Callable[[], None]:
    """transformers' records to the root logger's handlers instead of its own stderr
    handler; returns what puts its handler back."""
    tf_logging.disable_default_handler()
    tf_logging.enable_propagation()

    def undo() -> None:
        tf_logging.disable_propagation()
        tf_logging.enable_default_handler()

    return undo


class _AfterImport:
    """A meta-path finder that runs `then(module)` once module `name` is imported
    (transformers is imported lazily, by whichever command builds a model); `then`
    returns its undo, kept in `undo`."""

    def __init__(self, name: str, then: Callable[[ModuleType], Callable[[], None]]) -> None:
        self.name, self.then = name, then
        self.undo: list[Callable[[], None]] = []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            self.undo.append(self.then(module))

        loader.exec_module = exec_module  # this module's own loader instance, not the class
        return spec
