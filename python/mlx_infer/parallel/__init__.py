"""Tensor-parallel runs over MLX's distributed layer (``mlx.launch``); see :mod:`.group` and :mod:`.shard`."""

from .group import DistributedError, ParallelGroup, current_group

__all__ = ["DistributedError", "ParallelGroup", "current_group"]
