"""ZeRO-3 under sequence parallelism: make its reduce-scatter *sum* gradients over the SP group.

DeepSpeed reduces gradients over its sequence-data-parallel group (SP x DP ranks) and divides by
``dp_world_size / sequence_parallel_size``: a sum over the SP ranks (each holds the gradient of its
share of the loss) and a mean over data-parallel replicas.  ZeRO stages 1 and 2 do so, and so does
ZeRO-3's contiguous all-reduce path (``__avg_scatter_contiguous_grads``).  ZeRO-3's default path,
``__avg_scatter_grads`` (``reduce_scatter: true``, or buckets larger than ``reduce_bucket_size``),
calls ``reduce_scatter_coalesced``, which divides by the whole group size: the gradients come out
``sequence_parallel_size`` times too small (measured in deepspeed 0.19.8: exactly half at SP=2),
and so do the logged gradient norm, clipping and any optimizer that is not scale-invariant.

:func:`fix_zero3_sequence_parallel_grads` wraps that method on one optimizer instance so its
gradient partitions are multiplied by ``sequence_parallel_size`` (a power of two in practice, so
the product is exact in every dtype).  It does nothing when the engine is not ZeRO-3, SP is 1, or
the installed DeepSpeed already scales that path by the SP size.
"""

from __future__ import annotations

import inspect

__all__ = ["fix_zero3_sequence_parallel_grads", "zero3_scatter_needs_fix"]

_METHOD = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"  # name-mangled ``__avg_scatter_grads``


def zero3_scatter_needs_fix() -> bool:
    """Whether the installed DeepSpeed's ZeRO-3 reduce-scatter path leaves out the SP factor."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    method = getattr(DeepSpeedZeroOptimizer_Stage3, _METHOD, None)
    if method is None:  # renamed upstream: cannot tell, leave DeepSpeed alone
        return False
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):
        return False
    return "sequence_parallel_size" not in source


def fix_zero3_sequence_parallel_grads(engine) -> bool:
    """Patch ``engine``'s ZeRO-3 optimizer (see the module notes); returns True if it did."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    optimizer = getattr(engine, "optimizer", None)
    if not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        return False
    sp = int(getattr(optimizer, "sequence_parallel_size", 1))
    if sp == 1 or getattr(optimizer, "_striped_sp_scatter_fixed", False) or not zero3_scatter_needs_fix():
        return False
    original = getattr(optimizer, _METHOD)  # the bound method

    def avg_scatter_grads(params_to_reduce, communication_data_type):
        """``__avg_scatter_grads`` times ``sequence_parallel_size``: sum over SP, mean over DP."""
        return [g.mul_(sp) for g in original(params_to_reduce, communication_data_type)]

    setattr(optimizer, _METHOD, avg_scatter_grads)
    optimizer._striped_sp_scatter_fixed = True
    return True
