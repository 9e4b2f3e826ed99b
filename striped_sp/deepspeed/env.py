"""DeepSpeed start-up on CPU: skip the JIT build of the shared-memory all-reduce op.

On the CPU accelerator (``DS_ACCELERATOR=cpu``) the first ``deepspeed.init_distributed`` (which
``deepspeed.initialize`` calls) JIT-compiles ``deepspeed_shm_comm`` (~30 s, cached afterwards under
``TORCH_EXTENSIONS_DIR``).  That op only serves DeepSpeed's inference all-reduce; training
collectives go through ``torch.distributed`` (gloo).  DeepSpeed builds it only when its probe table
``deepspeed.ops.__compatible_ops__`` says the op is compatible, so marking it incompatible before
the communication backend starts makes DeepSpeed fall back to gloo at once.

On a GPU accelerator DeepSpeed never builds this op, so nothing here changes anything there.
Set ``STRIPED_SP_DS_SHM_COMM=1`` to keep DeepSpeed's default (build and use the op).
"""

from __future__ import annotations

import os

__all__ = ["skip_cpu_shm_comm_build", "SHM_ENV"]

SHM_ENV = "STRIPED_SP_DS_SHM_COMM"
_SHM_OP = "deepspeed_shm_comm"


def skip_cpu_shm_comm_build() -> bool:
    """Stop DeepSpeed from JIT-compiling its CPU shared-memory comm op; returns True if it did.

    Does nothing (returns False) on a non-CPU accelerator, when ``STRIPED_SP_DS_SHM_COMM=1``, or
    when DeepSpeed's communication backend already started (the op was built or loaded then).
    Call it before ``deepspeed.init_distributed`` / ``deepspeed.initialize``;
    :func:`striped_sp.deepspeed.initialize` calls it itself.
    """
    if os.environ.get(SHM_ENV, "0") == "1":
        return False
    from deepspeed import comm as ds_comm
    from deepspeed.accelerator import get_accelerator

    if get_accelerator()._name != "cpu":  # noqa: SLF001 - the accelerator's public-by-use name
        return False
    if ds_comm.is_initialized():
        return False
    import deepspeed.ops

    ops = deepspeed.ops.__compatible_ops__  # the probe table DeepSpeed consults (cheap)
    ops[_SHM_OP] = False
    return True
