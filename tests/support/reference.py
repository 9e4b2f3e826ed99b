"""Float64 single-process reference attention over the full sequence."""

import torch


def reference_mask(seq_len: int, causal: bool, cu_seqlens=None, window_size=None) -> torch.Tensor:
    """Boolean ``[S, S]``: query ``p`` sees key ``k`` (same document, inside the window, causal)."""
    pos = torch.arange(seq_len)
    rel = pos.unsqueeze(0) - pos.unsqueeze(1)  # key - query
    visible = torch.ones(seq_len, seq_len, dtype=torch.bool)
    if causal:
        visible &= rel <= 0
    if cu_seqlens is not None:
        ends = torch.as_tensor(list(cu_seqlens)[1:])
        doc = torch.searchsorted(ends, pos, right=True)
        visible &= doc.unsqueeze(0) == doc.unsqueeze(1)
    if window_size is not None:
        left, right = window_size
        if left >= 0:
            visible &= rel >= -left
        if right >= 0:
            visible &= rel <= right
    return visible


def reference_attention(q, k, v, causal: bool, scale: float, cu_seqlens=None, window_size=None) -> torch.Tensor:
    """``q`` ``[b, S, h, d]``, ``k``/``v`` ``[b, S, kv_h, d]`` -> ``[b, S, h, d]``, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.size(2) // k.size(2)
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = s.masked_fill(~reference_mask(q.size(1), causal, cu_seqlens, window_size), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def sharded_errors(out, local_inputs, ref, ref_inputs, shard) -> dict:
    """Errors of a sharded forward (``out``) and of its inputs' gradients (``local_inputs``: q, k,
    v with ``.grad``) against the float64 reference (``ref``, ``ref_inputs`` with ``.grad``),
    each relative to ``max(1, |reference|)`` (a window of 0 makes some reference gradients 0)."""
    def err(x, want):
        return ((x.double() - want.double()).abs().max() / max(1.0, want.double().abs().max().item())).item()

    errs = {"out": err(out, shard(ref))}
    for name, mine, theirs in zip(("dq", "dk", "dv"), local_inputs, ref_inputs):
        errs[name] = err(mine.grad, shard(theirs.grad))
    return errs
