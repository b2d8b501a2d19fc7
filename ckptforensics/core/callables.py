"""A user's `module:function` or `path/file.py:function` spec -> the function, and a factory
called with the keyword arguments a recorded config gives it (--model, --loss, --batch, a
LightningCLI class path)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptforensics.core.errors import ForensicsError

__all__ = ["ModelSpecError", "load_callable", "call_factory"]

_UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")


class ModelSpecError(ForensicsError):
    """A --model / --loss / --batch spec that cannot be imported or called."""


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """`module:function` or `path/file.py:function` -> the function.

    Raises:
        ModelSpecError: the module or attribute is missing, or importing it failed.
    """
    if ":" not in spec:
        raise ModelSpecError(f"{what} {spec!r}: expected module:function or path/file.py:function")
    mod_name, _, attr = spec.rpartition(":")
    try:
        if mod_name.endswith(".py") or "/" in mod_name:
            path = Path(mod_name)
            if not path.is_file():
                raise ModelSpecError(f"{what} {spec!r}: {path} does not exist")
            name = f"_ckptforensics_user_{path.stem}"
            spec_obj = importlib.util.spec_from_file_location(name, path)
            assert spec_obj is not None and spec_obj.loader is not None
            module = importlib.util.module_from_spec(spec_obj)
            sys.modules[name] = module
            # The user's own code, named on the command line: importing it is the point.
            sys.path.insert(0, str(path.resolve().parent.parent))
            try:
                spec_obj.loader.exec_module(module)
            finally:
                sys.path.pop(0)
        else:
            module = importlib.import_module(mod_name)
    except ModelSpecError:
        raise
    except Exception as e:  # any import failure of user code is bad input
        raise ModelSpecError(f"{what} {spec!r}: import failed ({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ModelSpecError(f"{what} {spec!r}: {mod_name} has no callable {attr!r}")
    return fn


def _factory_kwargs(
    fn: Callable[..., Any], config: dict[str, Any] | None
) -> tuple[dict[str, Any], bool]:
    """The checkpoint's model config restricted to what the factory's signature accepts.

    Returns:
        (kwargs, open): `open` is True when the factory takes **kwargs, so whatever it
        passes on may still refuse a key (then dropped and said; see `call_factory`).
    """
    if not config:
        return {}, False
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: nothing to match against
        return {}, False
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    # A nested `{"class_path": ...}` is an object the trainer's CLI built (an optimizer, a
    # sub-module): never built from a checkpoint, so never passed; the default stands.
    config = {k: v for k, v in config.items() if not _class_spec(v)}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return {
            k: v
            for k, v in config.items()
            if _plain_value(v) or (k in params and params[k].kind in named)
        }, True
    return {k: v for k, v in config.items() if k in params and params[k].kind in named}, False


def _plain_value(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool)) or v is None


def _class_spec(v: Any) -> bool:
    return isinstance(v, dict) and "class_path" in v


def call_factory(
    fn: Callable[..., Any],
    spec: str,
    config: dict[str, Any] | None,
    what: str | None = None,
    source: str = "from the checkpoint's model config",
) -> tuple[Any, str]:
    """Call a `--model` factory (or a class the checkpoint names) with the checkpoint
    config's keys that it accepts.

    Lightning's `hyper_parameters` mix model settings with training ones (`lr`, `betas`);
    a factory that forwards **kwargs to a config class refuses those: each refused key is
    dropped and the call retried, and the description says what was passed and what not.

    Args:
        what: how errors name the callable (default `--model 'spec'`).
        source: where the arguments came from, for the description.
    """
    what = what or f"--model {spec!r}"
    kwargs, open_kw = _factory_kwargs(fn, config)
    refused: list[str] = []
    while True:
        try:
            model = fn(**kwargs)
            break
        except TypeError as e:
            m = _UNEXPECTED.search(str(e))
            if open_kw and m and m.group(1) in kwargs:
                refused.append(m.group(1))
                del kwargs[m.group(1)]
                continue
            raise ModelSpecError(f"{what}: the factory raised TypeError: {e}") from None
        except Exception as e:  # the user's factory failed: say where
            raise ModelSpecError(f"{what}: the factory raised {type(e).__name__}: {e}") from None
    passed = ", ".join(f"{k}={kwargs[k]!r}" for k in kwargs) if kwargs else "no arguments"
    ignored = sorted(set(config or {}) - set(kwargs))
    desc = f"{spec}({passed})"
    if config:
        desc += f" {source}"
    if refused:
        desc += f"; refused by the factory: {', '.join(refused)}"
    if ignored and not refused:
        desc += f"; not passed: {', '.join(ignored[:12])}{' ...' if len(ignored) > 12 else ''}"
    return model, desc
