"""Lightning `.ckpt` files: the classes Lightning pickles into them, admitted by the restricted
unpickler as inert stand-ins."""

from __future__ import annotations

from ckptforensics.formats.inert import InertDict, register_safe_globals

# Lightning's AttributeDict (its `hyper_parameters`), under each package name it has had.
register_safe_globals(
    [
        ("lightning.fabric.utilities.data", "AttributeDict", InertDict),
        ("lightning_fabric.utilities.data", "AttributeDict", InertDict),
        ("pytorch_lightning.utilities.parsing", "AttributeDict", InertDict),
    ]
)
