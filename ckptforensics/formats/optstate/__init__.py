"""Map a torch optimizer state_dict (integer ids) onto parameter names, verified by shape.

One module a part: `families` (the optimizer families told apart by their state keys and
group options, each group's options as a `GroupHyper`, several optimizers merged into one
state_dict), `order` (the order-preserving assignment of parameters to groups by shape),
`mapping` (the rules trainers group by, verified by shape: `map_optimizer`, the view it
builds), `settle` (an ambiguous mapping settled by a pair's own updates).
"""

from __future__ import annotations

from ckptforensics.formats.optstate.mapping import (
    AmbiguousMapping,
    PendingMapping,
    map_optimizer,
    param_shape_of,
    register_group_rule,
    view_from_ids,
)
from ckptforensics.formats.optstate.mapping import trainable_order as trainable_order
from ckptforensics.formats.optstate.order import Assignment as Assignment
from ckptforensics.formats.optstate.order import Param as Param
from ckptforensics.formats.optstate.order import order_preserving
from ckptforensics.formats.optstate.settle import settle_by_evidence
from ckptforensics.optim.families import (
    FAMILIES,
    group_hyper,
    merge_optimizers,
    optimizer_family,
    optimizer_kind,
)

__all__ = [
    "FAMILIES",
    "map_optimizer",
    "merge_optimizers",
    "optimizer_family",
    "param_shape_of",
    "register_group_rule",
    "group_hyper",
    "optimizer_kind",
    "order_preserving",
    "AmbiguousMapping",
    "PendingMapping",
    "settle_by_evidence",
    "view_from_ids",
]
