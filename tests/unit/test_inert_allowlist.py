"""The inert unpickler's allowlist once every trainer has registered its classes
(`formats.inert.register_safe_globals`, from each trainer's `checkpoint.py`): exactly the set
the allowlist held when it was one table in formats/inert.py. A class admitted is one more
thing a checkpoint may build: a change here is a decision, never a side effect of a move."""

from __future__ import annotations

import pytest

import ckptforensics.checkpoints  # noqa: F401  (registers every trainer's classes)
from ckptforensics.formats import inert

# (qualified name, stand-in base) of torch.load's allowlist beyond torch's own and numpy's.
TORCH_LOAD = {
    ("accelerate.state.PartialState", "InertRecord"),
    ("accelerate.utils.dataclasses.DistributedType", "InertRecord"),
    ("argparse.Namespace", "InertRecord"),
    ("deepspeed.checkpoint.utils.fragment_address", "InertRecord"),
    ("deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler", "InertRecord"),
    ("deepspeed.runtime.fp16.loss_scaler.LossScaler", "InertRecord"),
    ("deepspeed.runtime.zero.config.ZeroStageEnum", "InertRecord"),
    ("deepspeed.utils.tensor_fragment.fragment_address", "InertRecord"),
    ("lightning.fabric.utilities.data.AttributeDict", "InertDict"),
    ("lightning_fabric.utilities.data.AttributeDict", "InertDict"),
    ("megatron.core.enums.ModelType", "InertRecord"),
    ("megatron.core.rerun_state_machine.RerunMode", "InertRecord"),
    ("megatron.core.rerun_state_machine.RerunState", "InertRecord"),
    ("megatron.core.transformer.enums.AttnBackend", "InertRecord"),
    ("megatron.core.transformer.enums.AttnMaskType", "InertRecord"),
    ("megatron.core.transformer.enums.CudaGraphScope", "InertRecord"),
    ("megatron.core.transformer.enums.InferenceCudaGraphScope", "InertRecord"),
    ("pytorch_lightning.utilities.parsing.AttributeDict", "InertDict"),
    ("signal.Signals", "InertRecord"),
    ("transformers.debug_utils.DebugOption", "InertRecord"),
    ("transformers.trainer_pt_utils.AcceleratorConfig", "InertRecord"),
    ("transformers.trainer_utils.FSDPOption", "InertRecord"),
    ("transformers.trainer_utils.HubStrategy", "InertRecord"),
    ("transformers.trainer_utils.IntervalStrategy", "InertRecord"),
    ("transformers.trainer_utils.SaveStrategy", "InertRecord"),
    ("transformers.trainer_utils.SchedulerType", "InertRecord"),
    ("transformers.training_args.OptimizerNames", "InertRecord"),
    ("transformers.training_args.ParallelMode", "InertRecord"),
    ("transformers.training_args.TrainingArguments", "InertRecord"),
}

# The same for the DCP `.metadata` unpickler.
DCP = {
    ("olmo_core.distributed.checkpoint.filesystem._StorageInfo", "InertRecord"),
    ("torch.distributed.checkpoint.planner.BytesIOWriteData", "InertRecord"),
    ("torch.distributed.checkpoint.planner.LoadItemType", "InertRecord"),
    ("torch.distributed.checkpoint.planner.LoadPlan", "InertRecord"),
    ("torch.distributed.checkpoint.planner.ReadItem", "InertRecord"),
    ("torch.distributed.checkpoint.planner.SavePlan", "InertRecord"),
    ("torch.distributed.checkpoint.planner.TensorWriteData", "InertRecord"),
    ("torch.distributed.checkpoint.planner.WriteItem", "InertRecord"),
    ("torch.distributed.checkpoint.planner.WriteItemType", "InertRecord"),
}


def _named(classes: object) -> set[tuple[str, str]]:
    return {(f"{c.__module__}.{c.__qualname__}", c.__mro__[1].__name__) for c in classes}  # type: ignore[attr-defined]


def test_torch_load_allowlist_is_the_snapshot() -> None:
    assert _named(inert.inert_globals()) == TORCH_LOAD


def test_dcp_allowlist_is_the_snapshot() -> None:
    assert _named(inert.dcp_inert_classes().values()) == DCP
    assert all(k == (c.__module__, c.__qualname__) for k, c in inert.dcp_inert_classes().items())


def test_allowed_names_are_the_stand_ins_and_numpy() -> None:
    numpy = {n for _, n in inert.numpy_globals()}
    assert inert.allowed_names() == {n for n, _ in TORCH_LOAD} | numpy


def test_stand_ins_have_no_behaviour() -> None:
    """Every stand-in is an InertRecord or InertDict: nothing pickled is ever called."""
    for c in [*inert.inert_globals(), *inert.dcp_inert_classes().values()]:
        assert c.__mro__[1] in (inert.InertRecord, inert.InertDict)
        assert set(vars(c)) <= {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__"}


def test_a_second_registration_is_idempotent_and_a_clash_refused() -> None:
    entry = ("argparse", "Namespace", inert.InertRecord)
    before = inert.inert_globals()
    inert.register_safe_globals([entry])
    assert inert.inert_globals() == before
    with pytest.raises(ValueError):
        inert.register_safe_globals([("argparse", "Namespace", inert.InertDict)])
    with pytest.raises(ValueError):
        inert.register_safe_globals([("x.y", "Z", object)])
    assert inert.inert_globals() == before
