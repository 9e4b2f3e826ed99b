"""The matmul reference kernel (``backend="math"``): float32 (float64 for float64 inputs), any device."""

from __future__ import annotations

import torch

from .base import _FLOAT_DTYPES, Kernel, _expand_kv, _group_sum, accumulator_dtype

__all__ = ["MathKernel"]


class MathKernel(Kernel):
    """Matmul reference, computed in float32 (float64 for float64 inputs).  Runs anywhere."""

    name = "math"
    native_value_head_dim = True  # einsums: v's head dim is free

    def softcap_unavailable_reason(self):
        return None  # the scores are explicit: capped in _scores, the chain rule in backward

    def unavailable_reason(self, device, dtype, head_dim=None):
        if dtype not in _FLOAT_DTYPES:
            return f"dtype {dtype} is not one of {_FLOAT_DTYPES}"
        return None

    def _scores(self, q, k, causal, scale, mask=None):
        """``(s, acc)``: the scores ``[b, h, sq, sk]`` in the accumulator dtype ``acc``, soft-capped
        (``c * tanh(s / c)``) when :attr:`softcap` is on, -inf outside ``mask`` / the causal triangle."""
        acc = accumulator_dtype(q.dtype)
        kx = _expand_kv(k, q.size(2)).to(acc)
        s = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), kx) * scale
        if self.softcap:
            s = torch.tanh(s / self.softcap) * self.softcap
        if causal:
            mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril_()
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return s, acc

    def forward_masked(self, q, k, v, mask, scale):
        return self.forward(q, k, v, False, scale, mask)

    def backward_masked(self, dout, q, k, v, out, lse, mask, scale):
        return self.backward(dout, q, k, v, out, lse, False, scale, mask)

    def forward(self, q, k, v, causal, scale, mask=None):
        s, acc = self._scores(q, k, causal, scale, mask)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.einsum("bhqk,bkhd->bqhd", p, _expand_kv(v, q.size(2)).to(acc))
        return out.to(q.dtype), lse.contiguous()  # lse in accumulator_dtype

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None):
        s, acc = self._scores(q, k, causal, scale, mask)
        p = torch.exp(s - lse.to(acc).unsqueeze(-1))
        do = dout.to(acc)
        vx = _expand_kv(v, q.size(2)).to(acc)
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, vx)
        delta = (do * out.to(acc)).sum(-1).transpose(1, 2)  # [b, h, q]
        ds = p * (dp - delta.unsqueeze(-1))
        if self.softcap:  # d/dx of c * tanh(x / c) = 1 - tanh(x / c)^2, with s = c * tanh(x / c)
            t = s / self.softcap
            ds = ds * (1 - t * t).nan_to_num_(0.0)  # masked entries: p = 0 there already
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, _expand_kv(k, q.size(2)).to(acc)) * scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(acc)) * scale
        kvh = k.size(2)
        return dq.to(q.dtype), _group_sum(dk, kvh).to(k.dtype), _group_sum(dv, kvh).to(v.dtype)
