"""`regress`: one state and one batch under two versions of the code, compared module by
module (`run`), from passes captured whole (`capture`), element by element (`compare`); a
side in another interpreter runs as a worker process (`worker`, `side`)."""

from ckptforensics.engine.regress.run import (
    NOISE_FACTOR,
    ModuleDiff,
    ParamDiff,
    Parting,
    RegressOptions,
    RegressResult,
    StepDiff,
    regress,
)

__all__ = [
    "NOISE_FACTOR",
    "ModuleDiff",
    "ParamDiff",
    "Parting",
    "RegressOptions",
    "RegressResult",
    "StepDiff",
    "regress",
]
