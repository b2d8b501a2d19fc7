"""Rebuild the model and its optimizer from a checkpoint, exactly as the trainer left them.

The model a run's recorded config describes is its framework's (`model` hook, frameworks/);
transformers from a `config.json` and a `--model` factory are built here for every run.
Over 400 lines: the weights and the optimizer state are read into one model with one name
map (`load_weights`, then `build_optimizer` by the same names and shards); replay/session.py
takes both from here."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptforensics.core.errors import ForensicsError, IncompatibleCheckpoints
from ckptforensics.formats.base import Checkpoint
from ckptforensics.trainers import hook

__all__ = [
    "load_callable",
    "build_model",
    "call_factory",
    "load_weights",
    "build_optimizer",
    "OptimizerChain",
    "ModelSpecError",
    "LossNorm",
    "trainer_loss_norm",
    "padding_rows_trained",
    "tied_padding_rows",
    "set_padding_rows",
]

log = logging.getLogger(__name__)


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


_UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")


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


def build_model(spec: str | None, ckpt: Checkpoint) -> tuple[nn.Module, str]:
    """The model named by `spec`, or, when spec is None, by the config the run recorded:
    HF config.json (transformers), Megatron `args` or OLMo-core config.json (reference
    models, `replay.reference`), LitGPT model_config.yaml (litgpt), the LightningModule
    class path LightningCLI records in `hyper_parameters` (frameworks/lightning).

    A factory receives the checkpoint's model config (nanoGPT `model_args`, Lightning
    hyper-parameters) as the keyword arguments its signature accepts.

    Returns:
        (model, how it was built: the call with its arguments, for `replay.config`).
    """
    if spec is None:
        built = _from_recorded_config(ckpt)
        if built is not None:
            return built
    if (
        spec is None
        or spec.endswith("config.json")
        or (Path(spec).is_dir() and (Path(spec) / "config.json").is_file())
    ):
        return _hf_model(spec, ckpt), f"transformers from {'config.json' if spec is None else spec}"
    fn = load_callable(spec, "--model")
    model, desc = call_factory(fn, spec, ckpt.config)
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"--model {spec!r}: returned {type(model).__name__}, not an nn.Module")
    return model, desc


def _from_recorded_config(ckpt: Checkpoint) -> tuple[nn.Module, str] | None:
    """A model from what the run recorded, by the `model` hook of the framework that wrote
    it (frameworks/: Megatron `args`, OLMo-core's config.json, LitGPT's model_config.yaml, a
    LightningCLI class path). None when it has none or it does not apply."""
    fn = hook(ckpt, "model")
    return fn(ckpt) if fn is not None else None


@dataclass(frozen=True, slots=True)
class LossNorm:
    """What the trainer divides the summed token losses of a step by.

    kind: 'targets' (the step's next-token targets: the mean every framework's own loop
    takes), 'labels' (every label != -100 before the causal shift: HF Trainer's
    num_items_in_batch for a model whose loss_type it does not know to shift, GPT-2),
    'micro' (each micro-batch's mean, averaged: Trainer without loss kwargs).
    """

    kind: str
    source: str


def trainer_loss_norm(model: nn.Module, ckpt: Checkpoint) -> LossNorm:
    """The loss normalisation the run's trainer used: the `loss_norm` hook of the framework
    that wrote `ckpt` (frameworks/hf: the HF Trainer's), else the mean over target tokens."""
    fn = hook(ckpt, "loss_norm")
    found = fn(model, ckpt) if fn is not None else None
    return found or LossNorm("targets", "mean over the step's target tokens")


def _hf_model(spec: str | None, ckpt: Checkpoint) -> nn.Module:
    import json

    if spec is not None:
        path = Path(spec)
        cfg = json.loads((path if path.is_file() else path / "config.json").read_text())
    elif ckpt.config and "model_type" in ckpt.config:
        cfg = ckpt.config
    else:
        raise ModelSpecError(
            f"{ckpt.path}: no config.json to build the model from; pass --model module:factory"
        )
    try:
        import transformers
    except ImportError:
        raise ModelSpecError(
            "building the model from config.json needs transformers: pip install 'ckptforensics[hf]'"
        ) from None
    try:
        config = transformers.AutoConfig.for_model(**cfg)
        archs = cfg.get("architectures") or []
        cls = getattr(transformers, archs[0], None) if archs else None
        return (
            cls(config)
            if cls is not None
            else transformers.AutoModelForCausalLM.from_config(config)
        )
    except Exception as e:  # a config transformers cannot build
        raise ModelSpecError(
            f"cannot build the model from config.json ({type(e).__name__}: {e})"
        ) from None


def _prefix_map(model_keys: list[str], ckpt_names: set[str]) -> Callable[[str], str]:
    """Model key -> checkpoint name, allowing one wrapper prefix ('model.', '_orig_mod.').

    A prefix is taken only when it maps every parameter of the model onto the checkpoint.
    """
    if not model_keys or all(k in ckpt_names for k in model_keys):
        return lambda k: k
    first = model_keys[0]
    for n in sorted(ckpt_names):
        if n.endswith("." + first):
            pre = n[: -len(first)]
            if sum(pre + k in ckpt_names for k in model_keys) > sum(
                k in ckpt_names for k in model_keys
            ):
                return lambda key, pre=pre: pre + key
    return lambda k: k


def load_weights(model: nn.Module, ckpt: Checkpoint, ranks: Any = None) -> Callable[[str], str]:
    """Load the checkpoint's weights strictly (tied weights filled from their owner).

    With `ranks` (a torchrun replay, `replay.distributed`), the model's parameters are
    FSDP2 shards: each is filled with only its rows of the stored tensor.

    Returns:
        The model-key -> checkpoint-name mapping used (for optimizer state).

    Raises:
        IncompatibleCheckpoints: missing, unexpected or mis-shaped tensors, listing the first.
    """
    sd = model.state_dict()
    names = set(ckpt.names()) | set(ckpt.aliases)
    to_ckpt = _prefix_map([k for k, _ in model.named_parameters()], names)
    ties = _model_ties(model)
    missing, shapes, new = [], [], {}
    for key, ref in sd.items():
        name = to_ckpt(key)
        src = ckpt.aliases.get(name, name)
        if src not in ckpt.names():
            if _is_derived_buffer(model, key):
                new[key] = ref
                continue
            # A weight the model ties to another (GPT-2's lm_head to wte): HF stores it once.
            twin = next(
                (
                    t
                    for t in ties.get(key, ())
                    if ckpt.aliases.get(to_ckpt(t), to_ckpt(t)) in ckpt.names()
                ),
                None,
            )
            if twin is not None:
                ckpt.aliases.setdefault(name, ckpt.aliases.get(to_ckpt(twin), to_ckpt(twin)))
                src = ckpt.aliases[name]
            else:
                missing.append(key)
                continue
        if tuple(ckpt.meta(src).shape) != tuple(ref.shape):
            shapes.append(f"{key} {list(ckpt.meta(src).shape)} vs model {list(ref.shape)}")
            continue
        if ranks is not None and hasattr(ref, "to_local"):
            _fill_shard(ref, ckpt, src, ranks)
            continue
        new[key] = ckpt.tensor(src).to(ref.dtype).clone()
    used = {ckpt.aliases.get(to_ckpt(k), to_ckpt(k)) for k in sd}
    unexpected = sorted(n for n in ckpt.names() if n not in used)
    if missing or shapes or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing in the checkpoint (first: {sorted(missing)[:3]})")
        if unexpected:
            parts.append(f"{len(unexpected)} not in the model (first: {unexpected[:3]})")
        if shapes:
            parts.append(f"shape mismatch: {shapes[0]}")
        raise IncompatibleCheckpoints(f"--model does not match {ckpt.path}: " + "; ".join(parts))
    if ranks is None:
        model.load_state_dict(new, strict=True)
    else:
        with torch.no_grad():  # buffers (not sharded) and anything else read whole
            for key, t in new.items():
                sd[key].copy_(t)
    return to_ckpt


def _fill_shard(param: Any, ckpt: Checkpoint, name: str, ranks: Any) -> None:
    """Copy this rank's rows of checkpoint tensor `name` into the DTensor `param`."""
    from ckptforensics.engine.replay.distributed import local_rows

    local = local_rows(
        ranks,
        param,
        ckpt.meta(name).shape,
        lambda lo, hi: ckpt.rows(name, lo, hi),
        lambda: ckpt.tensor(name),
    )
    with torch.no_grad():
        param.to_local().copy_(local)


def _model_ties(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Parameter name -> the other names of the same Parameter (tied weights)."""
    by_param: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(n)
    return {
        n: tuple(o for o in group if o != n)
        for group in by_param.values()
        if len(group) > 1
        for n in group
    }


def _is_derived_buffer(model: nn.Module, key: str) -> bool:
    """Non-persistent-like buffers (rotary inv_freq, causal masks) rebuilt by the model itself."""
    return key not in dict(model.named_parameters()) and key.endswith(
        ("inv_freq", "attn.bias", "masked_bias", "position_ids")
    )


class OptimizerChain(torch.optim.Optimizer):
    """Several optimizers stepped as one (a Muon run's Muon for the hidden matrices and AdamW
    for the rest): their param groups in order, their states as one mapping. Everything the
    replay does to an optimizer (set each group's LR, zero, step, unscale under a
    GradScaler) goes through here to each of them."""

    def __init__(self, opts: list[torch.optim.Optimizer]) -> None:
        # No Optimizer.__init__: the parts own the groups and the state.
        self.opts = opts
        self.defaults = {}
        self._optimizer_step_pre_hooks = {}  # type: ignore[assignment]
        self._optimizer_step_post_hooks = {}  # type: ignore[assignment]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for o in self.opts for g in o.param_groups]

    @property
    def state(self) -> Any:  # type: ignore[override]
        from collections import ChainMap

        return ChainMap(*[o.state for o in self.opts])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for o in self.opts:
            o.step()
        return None


def _family_class(family: str, impl: str) -> Any:
    """The framework's own optimizer class for a family (never a re-implementation)."""
    if family == "adam":
        return torch.optim.AdamW
    if family == "adafactor" and impl.startswith("transformers"):
        try:
            from transformers.optimization import Adafactor
        except ImportError:
            raise ForensicsError(
                "replaying transformers' Adafactor needs transformers (pip install 'ckptforensics[hf]')"
            ) from None
        return Adafactor
    if family == "adafactor":
        return torch.optim.Adafactor
    if family == "lion":
        try:
            from lion_pytorch import Lion
        except ImportError:
            raise ForensicsError(
                "replaying Lion needs its package: pip install lion-pytorch"
            ) from None
        return Lion
    if family == "muon":
        return torch.optim.Muon
    if family == "sgd":
        return torch.optim.SGD
    if family == "adam8bit":
        try:
            # Its import warns about an optional 4-bit GEMM kernel on CPUs with AVX512-BF16
            # (nothing the 8-bit optimizer uses): kept out of the user's terminal.
            quiet = logging.getLogger("bitsandbytes")
            level = quiet.level
            quiet.setLevel(logging.ERROR)
            try:
                import bitsandbytes as bnb
            finally:
                quiet.setLevel(level)
        except ImportError:
            raise ForensicsError(
                "replaying 8-bit Adam needs its package: pip install bitsandbytes"
            ) from None
        # Adam8bit and AdamW8bit are one Optimizer2State("adam"): decay applied as w (1 - lr wd).
        return bnb.optim.AdamW8bit
    if family == "lamb" and impl.startswith("pytorch_optimizer"):
        try:
            from pytorch_optimizer import Lamb
        except ImportError:
            raise ForensicsError(
                "replaying pytorch_optimizer's Lamb needs its package: pip install pytorch_optimizer"
            ) from None
        return Lamb
    if family == "lamb" and impl:
        raise ForensicsError(
            f"replaying {impl} needs its CUDA op (a fused kernel; no CPU build): the replay rebuilds pytorch_optimizer's Lamb "
            "only; `ckptforensics diff` still checks its LAMB bounds"
        )
    return None


# The constructor arguments each class takes from a saved group (its own names).
_CLASS_KEYS = {
    "adam": ("lr", "betas", "eps", "weight_decay"),
    "adafactor-torch": ("lr", "beta2_decay", "eps", "d", "weight_decay", "maximize"),
    "adafactor-transformers": (
        "lr",
        "eps",
        "clip_threshold",
        "decay_rate",
        "beta1",
        "weight_decay",
        "scale_parameter",
        "relative_step",
        "warmup_init",
    ),
    "lion": ("lr", "betas", "weight_decay"),
    "muon": (
        "lr",
        "weight_decay",
        "momentum",
        "nesterov",
        "ns_coefficients",
        "eps",
        "ns_steps",
        "adjust_lr_fn",
    ),
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    "adam8bit": ("lr", "betas", "eps", "weight_decay"),
    # pytorch_optimizer's Lamb; `pre_norm` is an attribute, not saved: its default (False).
    "lamb": (
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "weight_decouple",
        "fixed_decay",
        "rectify",
        "grad_averaging",
        "max_grad_norm",
        "adam",
    ),
}


def _group_args(h: Any, key: str) -> dict[str, Any]:
    """A saved group's hyper-parameters as its class's constructor takes them."""
    o = h.options
    vals: dict[str, Any] = {
        "lr": h.lr,
        "betas": h.betas,
        "weight_decay": h.weight_decay,
        **{k: v for k, v in o.items() if k != "implementation"},
    }
    if key.startswith("adafactor"):
        eps1 = None if not math.isfinite(h.eps) else h.eps
        vals["eps"] = (eps1, o.get("eps2", 1e-3))
        if o.get("relative_step"):
            vals["lr"] = None  # transformers' relative step: its own schedule
    elif key == "muon":
        vals["eps"] = h.eps if math.isfinite(h.eps) else 1e-7
        if isinstance(vals.get("ns_coefficients"), list):
            vals["ns_coefficients"] = tuple(vals["ns_coefficients"])
    else:
        vals["eps"] = h.eps
    # transformers' Adafactor takes lr=None (relative step); every other None means "the
    # class's default".
    keep_none = ("lr",) if key == "adafactor-transformers" else ()
    return {
        k: vals[k]
        for k in _CLASS_KEYS[key]
        if k in vals and (vals[k] is not None or k in keep_none)
    }


def build_optimizer(
    model: nn.Module, ckpt: Checkpoint, to_ckpt: Callable[[str], str], ranks: Any = None
) -> torch.optim.Optimizer:
    """The run's optimizer rebuilt with its framework's own class, its param groups,
    hyper-parameters and state (with `ranks`, Adam's moments as the DTensor shard of their
    parameter: only those rows read).

    Families: Adam/AdamW (torch's; fused where the run's was), torch's and transformers'
    Adafactor, lion-pytorch's Lion, torch's Muon (with the AdamW of the same run: an
    `OptimizerChain`), torch's SGD. Every group is tagged with its `family`, which the
    replay's comparison reads for the family's update bound (`updates.replay_bound`).

    Raises:
        ForensicsError: no optimizer state, or one whose family the replay cannot rebuild.
    """
    opt = ckpt.optimizer
    if opt is None:
        raise ForensicsError(
            f"{ckpt.path}: no optimizer state; replay needs the moments to reproduce the update"
        )
    fams = {h.family for h in opt.groups}
    unknown = sorted(
        {
            h.family
            for h in opt.groups
            if h.family != "none"
            and _family_class(h.family, str(h.options.get("implementation", ""))) is None
        }
    )
    if unknown:
        what = unknown[0].removeprefix("unknown:")
        raise ForensicsError(
            f"{ckpt.path}: optimizer {what!r} cannot be rebuilt for a replay (replay rebuilds Adam/AdamW, Adafactor, Lion, "
            "Muon, SGD, bitsandbytes' 8-bit Adam and pytorch_optimizer's LAMB with their own classes); "
            "`ckptforensics diff` still compares the weights"
        )
    if ranks is not None and fams - {"adam", "none"}:
        raise ForensicsError(
            f"{ckpt.path}: a torchrun replay rebuilds Adam(W) only; run this {'+'.join(sorted(fams))} replay in one process"
        )
    groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in opt.groups]
    for key, p in model.named_parameters():
        if not p.requires_grad:
            continue
        name = ckpt.aliases.get(to_ckpt(key), to_ckpt(key))
        h = opt.hyper.get(name)
        if h is None:
            raise IncompatibleCheckpoints(
                f"{ckpt.path}: parameter {name} is in no optimizer param group"
            )
        groups[h.index].append((name, p))
    # One optimizer per saved optimizer (groups keep their order within it).
    built: list[torch.optim.Optimizer] = []
    for oi in sorted({h.optimizer for h in opt.groups}):
        mine = [gi for gi, h in enumerate(opt.groups) if h.optimizer == oi and groups[gi]]
        if not mine:
            continue
        h0 = opt.groups[mine[0]]
        fam = h0.family if h0.family != "none" else "adam"
        impl = str(h0.options.get("implementation", ""))
        key = (
            "adafactor-transformers"
            if fam == "adafactor" and impl.startswith("transformers")
            else "adafactor-torch"
            if fam == "adafactor"
            else fam
        )
        cls = _family_class(fam, impl)
        param_groups = [
            {
                "params": [p for _, p in groups[gi]],
                **_group_args(opt.groups[gi], key),
                "family": fam,
                "implementation": impl,
            }
            for gi in mine
        ]
        if fam == "adam":
            # The saved implementation: HF Trainer's default is fused AdamW, whose rounding differs.
            fused = all(opt.groups[gi].fused for gi in mine)
            o = (
                torch.optim.AdamW(param_groups, fused=True)
                if fused
                else torch.optim.AdamW(param_groups)
            )
        else:
            try:
                o = cls(param_groups)
            except (TypeError, ValueError) as e:
                raise ForensicsError(
                    f"{ckpt.path}: cannot rebuild {cls.__name__} from the saved param groups ({e})"
                ) from None
            for g, gi in zip(o.param_groups, mine, strict=True):
                step = opt.groups[gi].options.get("step")
                if fam == "lamb" and isinstance(step, (int, float)):
                    g["step"] = int(
                        step
                    )  # pytorch_optimizer counts steps in the group (its bias correction)
        for gi in mine:
            for name, p in groups[gi]:
                st = opt.state.get(name)
                if not st:
                    continue
                if ranks is not None and hasattr(p, "to_local"):
                    o.state[p] = {
                        "step": torch.tensor(float(st["step"])),
                        **{
                            k: _shard_moment(p, ckpt, name, k, ranks)
                            for k in ("exp_avg", "exp_avg_sq")
                        },
                    }
                    ckpt.forget(name)
                    continue
                o.state[p] = _state_for(fam, key, st, p)
        built.append(o)
    return built[0] if len(built) == 1 else OptimizerChain(built)


def _state_for(fam: str, key: str, st: dict[str, Any], p: nn.Parameter) -> dict[str, Any]:
    """One parameter's saved state as its class keeps it: tensors in fp32 on the parameter's
    device (moments saved in bf16 widened), Adam's and torch Adafactor's `step` a float
    tensor, transformers' Adafactor's `step` a Python int."""
    out: dict[str, Any] = {}
    if fam == "adam8bit":
        # bitsandbytes' own layout: uint8 codes, maps and scales as saved, an int step.
        from ckptforensics.optim import bnb

        return {
            k: int(float(v))
            if k == "step"
            else v.to(p.device).clone()
            if isinstance(v, torch.Tensor)
            else v
            for k, v in bnb.raw_state(st).items()
        }
    for k, v in st.items():
        if k == "step":
            out[k] = int(float(v)) if key == "adafactor-transformers" else torch.tensor(float(v))
        elif isinstance(v, torch.Tensor):
            t = v.to(p.device, torch.float32).clone()
            out[k] = (
                t.view_as(p)
                if t.numel() == p.numel()
                and k in ("exp_avg", "exp_avg_sq", "momentum_buffer", "variance")
                else t
            )
        else:
            out[k] = v
    return out


def _shard_moment(p: Any, ckpt: Checkpoint, name: str, field: str, ranks: Any) -> Any:
    """A moment of `name` as a DTensor sharded like its parameter `p`."""
    from torch.distributed.tensor import DTensor

    from ckptforensics.engine.replay.distributed import local_rows

    st = ckpt.optim_state(name)
    stored = tuple(ckpt.meta(name).shape) if ckpt.has(name) else ()
    local = local_rows(
        ranks, p, stored, lambda lo, hi: ckpt.state_rows(name, field, lo, hi), lambda: st[field]
    )
    local = local.to(p.device, torch.float32).reshape(p.to_local().shape)
    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


def padding_rows_trained(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """Embeddings whose padding row (`padding_idx`, a row whose gradient is always zeroed)
    is not the one config.json names, read from the data. transformers' Trainer aligns
    `config.pad_token_id` with the tokenizer's pad id after the model's embedding was built
    (`align_special_tokens`), so a saved config can name a row the run never froze and miss
    the one it did. The run's padding row is the one whose weights are still the zeros
    `nn.Embedding` starts it with and whose second moment never saw a gradient; where exactly
    one row is, it is the padding row; where none is and the named row trained, there is
    none. An embedding tied to the output head is left as built: the head's gradient reaches
    every row, the padding row included, so a trained second moment there says nothing about
    the lookup (held-out draw 9545: a tied Llama built with pad id 0, replayed unpadded, missed
    *after* on 24% of elements). The changes are returned for `replay.config`. One process
    only (a sharded row lives on one rank)."""
    fixed = []
    ties = _model_ties(model)
    for name, m in model.named_modules():
        if not isinstance(m, nn.Embedding) or _tied_embedding(ties, name):
            continue
        v = (opt.state.get(m.weight) or {}).get("exp_avg_sq")
        if (
            not isinstance(v, torch.Tensor)
            or hasattr(v, "to_local")
            or v.dim() != 2
            or v.shape != m.weight.shape
        ):
            continue
        frozen = (
            torch.nonzero((v.abs().sum(1) == 0) & (m.weight.detach().abs().sum(1) == 0))
            .flatten()
            .tolist()
        )
        was = m.padding_idx
        if len(frozen) == 1:
            m.padding_idx = frozen[0]
        elif was is not None and bool(v[was].abs().sum() > 0):
            m.padding_idx = None
        if m.padding_idx != was:
            fixed.append(f"{name} {was} -> {m.padding_idx}")
    return fixed


def _tied_embedding(ties: dict[str, tuple[str, ...]], name: str) -> bool:
    """Whether the embedding module `name` shares its weight (`_model_ties`) with another."""
    return (f"{name}.weight" if name else "weight") in ties


def tied_padding_rows(model: nn.Module) -> dict[str, int]:
    """Embeddings tied to an output head that zero a padding row, by module name: whether the
    run zeroed that row's lookup gradient is not in its moments (the head trains the row
    anyway), so the replay asks the log (`settle.settle_padding`)."""
    ties = _model_ties(model)
    return {
        name: m.padding_idx
        for name, m in model.named_modules()
        if isinstance(m, nn.Embedding) and _tied_embedding(ties, name) and m.padding_idx is not None
    }


def set_padding_rows(model: nn.Module, rows: dict[str, int | None]) -> None:
    """Give the named embeddings these padding rows (None: no padding row)."""
    for name, m in model.named_modules():
        if name in rows and isinstance(m, nn.Embedding):
            m.padding_idx = rows[name]
