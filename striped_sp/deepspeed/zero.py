"""ZeRO-3 under sequence parallelism: make its reduce-scatter *sum* gradients over the SP group.

DeepSpeed reduces gradients over its sequence-data-parallel group (SP x DP ranks) and divides by
``dp_world_size / sequence_parallel_size``: a sum over the SP ranks (each holds the gradient of its
share of the loss) and a mean over data-parallel replicas.  ZeRO stages 1 and 2 do so, and so does
ZeRO-3's contiguous all-reduce path (``__avg_scatter_contiguous_grads``).  ZeRO-3's default path,
``__avg_scatter_grads`` (``reduce_scatter: true``, or buckets larger than ``reduce_bucket_size``),
calls ``reduce_scatter_coalesced``, which divides by the whole group size: the gradients come out
``sequence_parallel_size`` times too small (measured in deepspeed 0.19.8: exactly half at SP=2),
and so do the logged gradient norm, clipping and any optimizer that is not scale-invariant
(reported upstream as deepspeedai/DeepSpeed issue 6841: SP gradients g1 + g2 expected, average seen).

:func:`fix_zero3_sequence_parallel_grads` wraps that method on one optimizer instance so its
gradient partitions are multiplied by ``sequence_parallel_size`` (a power of two in practice, so
the product is exact in every dtype).  It does nothing when the engine is not ZeRO-3, SP is 1, or
the installed DeepSpeed already scales that path by the SP size.
"""

from __future__ import annotations

import inspect

__all__ = ["fix_zero3_sequence_parallel_grads", "zero3_scatter_needs_fix", "check_sequence_parallel_settings"]

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


def check_sequence_parallel_settings(config: dict, model=None) -> None:
    """``ValueError`` naming the DeepSpeed setting that conflicts with ``sequence_parallel_size > 1``
    (``config`` is the engine's config dict; checked before any collective):

    * ``gradient_predivide_factor`` other than 1: ZeRO-1/2 skip their SP correction when it equals
      the group size, and ZeRO-3's reduce-scatter refuses it;
    * ``tensor_parallel.autotp_size > 1``: the SP groups assume world = data-parallel x SP ranks;
    * ``zero_optimization.mics_shard_size > 0`` (MiCS): its partition groups are not the SP x DP group;
    * a pipeline model (``deepspeed.pipe.PipelineModule``): its engine reduces over the pipeline's
      data-parallel group, not the sequence-data-parallel one.
    """
    problems = []
    predivide = config.get("gradient_predivide_factor", 1.0)
    if predivide not in (None, 1, 1.0):
        problems.append(f"gradient_predivide_factor={predivide!r}: leave it at 1.0 (ZeRO-1/2 then lose the "
                        "sum over the sequence-parallel group when it equals the group size)")
    tp = (config.get("tensor_parallel") or {}).get("autotp_size", 1) or 1
    if tp > 1:
        problems.append(f"tensor_parallel.autotp_size={tp}: tensor parallelism with the sequence-parallel groups "
                        "is not supported; set it to 1")
    mics = (config.get("zero_optimization") or {}).get("mics_shard_size", -1)
    if mics is not None and mics > 0:
        problems.append(f"zero_optimization.mics_shard_size={mics}: MiCS partition groups are not the "
                        "sequence-data-parallel group; use ZeRO-3 without MiCS")
    if model is not None and type(model).__name__ == "PipelineModule":
        problems.append("a PipelineModule model: pipeline parallelism with sequence_parallel_size > 1 is not supported")
    if problems:
        raise ValueError(f"sequence_parallel_size={config.get('sequence_parallel_size')} conflicts with the "
                         "DeepSpeed config: " + "; ".join(problems))
