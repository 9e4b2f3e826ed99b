"""Float64 single-process reference attention over the full sequence."""

import torch


def reference_attention(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """``q`` ``[b, S, h, d]``, ``k``/``v`` ``[b, S, kv_h, d]`` -> ``[b, S, h, d]``, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.size(2) // k.size(2)
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        n = q.size(1)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
