"""What a call's tensors become on the way into the ring and out of it: q, k, v brought to one head
dim for a kernel that needs one (multi-latent attention's v zero-padded, or q and k), the output's
padded value columns dropped, and a Ulysses member's slice of a per-head ``[heads]`` tensor (sinks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import Kernel

__all__ = ["equal_head_dims", "value_columns", "ulysses_heads"]


def equal_head_dims(q, k, v, kernel: Kernel):
    """q, k, v with one head dim for a kernel without :attr:`~striped_sp.kernels.Kernel.native_value_head_dim`
    (multi-latent attention): v zero-padded to q/k's head dim, or q and k to v's.  Exact: zero
    columns of q and k add nothing to a score (the scale was fixed before), and zero columns of v
    give zero output columns, which :func:`value_columns` drops (autograd drops their gradient)."""
    d, dv = q.size(-1), v.size(-1)
    if d == dv or kernel.native_value_head_dim:
        return q, k, v
    if dv < d:
        return q, k, F.pad(v, (0, d - dv))
    return F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d)), v


def value_columns(out: torch.Tensor, value_dim: int) -> torch.Tensor:
    """``out`` without the columns of a padded v (contiguous, as the ring returns it)."""
    return out if out.size(-1) == value_dim else out[..., :value_dim].contiguous()


def ulysses_heads(x: torch.Tensor, member: int, u: int) -> torch.Tensor:
    """The part of a per-head ``[heads]`` tensor that Ulysses member ``member`` of ``u`` holds after
    :func:`~striped_sp.engine.ulysses.seq_to_heads` (slice ``member`` of ``u`` equal slices)."""
    w = x.size(0) // u
    return x[member * w:(member + 1) * w]
