"""Sequence-parallel process groups for DeepSpeed: build them, or reuse the ones that exist.

DeepSpeed's own groups live in ``deepspeed.runtime.sequence_parallel.parallel_state_sp`` (its ALST
path): sequence-parallel groups of ``sp`` consecutive ranks, and one sequence-data-parallel group
over all of them, over which the engine reduces gradients (summing over SP, averaging over DP).
That module is itself the ``mpu`` DeepSpeed expects, so we pass it to ``deepspeed.initialize``.
A user ``mpu`` (Megatron-DeepSpeed style) that already has ``get_sequence_parallel_group`` is
reused as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

__all__ = ["SequenceParallelGroups", "sequence_parallel_groups"]


@dataclasses.dataclass(frozen=True)
class SequenceParallelGroups:
    """The groups one rank belongs to.  ``group`` is the SP (context-parallel) group, ``None`` when
    ``size == 1``; ``mpu`` is what to pass to ``deepspeed.initialize`` (``None`` when none needed).
    ``dp_rank``/``dp_size``: this rank's data-parallel replica and the number of replicas."""

    size: int
    rank: int
    group: Any
    mpu: Any
    dp_rank: int
    dp_size: int


def _ds_parallel_state():
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as ps

    return ps


def _existing_group(ps):
    try:
        return ps.get_sequence_parallel_group()
    except AssertionError:  # "sequence parallel group is not initialized"
        return None


def _data_parallel_coords(mpu, group, sp: int) -> tuple[int, int]:
    world, rank = dist.get_world_size(), dist.get_rank()
    if mpu is not None and hasattr(mpu, "get_data_parallel_rank") and hasattr(mpu, "get_data_parallel_world_size"):
        return int(mpu.get_data_parallel_rank()), int(mpu.get_data_parallel_world_size())
    ranks = list(dist.get_process_group_ranks(group)) if group is not None else [rank]
    first = ranks[0]
    if ranks != list(range(first, first + sp)) or first % sp != 0:
        raise ValueError(
            f"sequence-parallel group ranks {ranks} are not {sp} consecutive ranks starting at a "
            f"multiple of {sp}: pass an mpu with get_data_parallel_rank()/get_data_parallel_world_size()"
        )
    return first // sp, world // sp


def sequence_parallel_groups(sp_size: int, mpu: Any = None) -> SequenceParallelGroups:
    """The SP groups for ``sequence_parallel_size=sp_size``; ``torch.distributed`` must be up.

    * ``sp_size == 1``: no SP group; ``mpu`` passes through unchanged.
    * a given ``mpu`` with ``get_sequence_parallel_group()``: reused; its size must be ``sp_size``.
    * otherwise DeepSpeed's ``parallel_state_sp`` groups: reused if already built (e.g. by
      ``UlyssesSPAttentionHF.register_with_transformers``), else built here (a collective call:
      every rank must reach it).

    Raises ``ValueError`` if an existing group has another size.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized: call deepspeed.init_distributed() first")
    world = dist.get_world_size()
    if sp_size == 1:
        dp_rank, dp_size = (
            (int(mpu.get_data_parallel_rank()), int(mpu.get_data_parallel_world_size()))
            if mpu is not None and hasattr(mpu, "get_data_parallel_rank")
            else (dist.get_rank(), world)
        )
        return SequenceParallelGroups(1, 0, None, mpu, dp_rank, dp_size)
    if mpu is not None:
        if not hasattr(mpu, "get_sequence_parallel_group"):
            raise ValueError(
                f"sequence_parallel_size={sp_size} needs an mpu with get_sequence_parallel_group(); "
                f"the given mpu ({type(mpu).__name__}) has none: pass mpu=None to let DeepSpeed's "
                "parallel_state_sp build the groups"
            )
        group = mpu.get_sequence_parallel_group()
        source = "the given mpu"
    else:
        mpu = _ds_parallel_state()
        group = _existing_group(mpu)
        source = "deepspeed parallel_state_sp"
        if group is None:
            mpu.initialize_sequence_parallel(sequence_parallel_size=sp_size)
            group = mpu.get_sequence_parallel_group()
    size = dist.get_world_size(group)
    if size != sp_size:
        raise ValueError(
            f"sequence_parallel_size={sp_size} but the existing sequence-parallel group of {source} "
            f"has {size} ranks: they must match"
        )
    dp_rank, dp_size = _data_parallel_coords(mpu, group, sp_size)
    return SequenceParallelGroups(sp_size, dist.get_rank(group), group, mpu, dp_rank, dp_size)


def ulysses_groups(groups: SequenceParallelGroups, ulysses_size: int):
    """``(inner, outer)`` groups for hierarchical CP over the SP groups, or ``None`` when
    ``ulysses_size == 1``.  Collective over the whole world (every rank learns every SP group's
    ranks with one all-gather, then builds all inner and outer groups in the same order)."""
    if ulysses_size == 1 or groups.group is None:
        return None
    from ..engine.ulysses import ulysses_ring_groups

    mine = dist.get_process_group_ranks(groups.group)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    unique = sorted({tuple(r) for r in every})
    return ulysses_ring_groups([list(r) for r in unique], ulysses_size)
