"""Optimizer families: each recognised from the state its own code saves, its
hyper-parameters, its update bound (for the diff) and its torch class (for the replay)."""
