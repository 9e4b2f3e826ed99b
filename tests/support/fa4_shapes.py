"""A shape-only stand-in of FlashAttention-4's ``flash_attn.cute.interface`` for dry runs on meta
tensors: nothing is computed and no device value is read (so a dry run counts the ring's own host
work), every call recorded with its architecture's rules checked on shapes and arguments.

The signatures and the return counts are :class:`fa4_double.FA4Double`'s (installed the same way).
The rules checked, read in the upstream source (Dao-AILab/flash-attention
``flash_attn/cute/interface.py`` and ``flash_bwd_sm90.py``, releases 4.0.0b5 to 4.0.0b27):

* inputs fp16/bf16 of one dtype, ``[b, s, h, d]`` dense or ``[T, h, d]`` varlen with int32
  ``cu_seqlens_q`` / ``cu_seqlens_k`` of one length, kv heads dividing query heads;
* head dims per architecture: SM90 both multiples of 8 in 8-256; SM100 both multiples of 8 up to
  128, or ``(192, 128)``, or ``(256, 256)``;
* SM90's backward of a GQA call (fewer kv heads than query heads) with ``head_dim != head_dim_v``
  (``flash_bwd_sm90``: "GQA backward requires head_dim == head_dim_v");
* the backward's ``out`` / ``dout`` ``[.., h, dv]`` and its float32 lse ``[b, h, s]`` (varlen
  ``[h, T]``); an explicit ``max_seqlen_*`` on varlen calls (what the ring always passes).

Varlen, windows and ``deterministic`` run in both passes on both architectures (SM90's varlen,
windowed and deterministic backward landed before 4.0.0b5, the first release supported).
"""

from __future__ import annotations

import collections

import torch

from fa4_double import RETURNS, FA4Double


class FA4Shapes(FA4Double):
    """FA4 on a device of ``arch`` (90 or 100) answering with empty tensors of the right shapes on the
    inputs' device; ``count[(pass, kind)]``: calls per pass (``"forward"``/``"backward"``) and kind
    (``"dense"``/``"varlen"``)."""

    def __init__(self, version: str = "4.0.0b36", arch: int = 100):
        super().__init__(version=version, arch=arch)
        self.count = collections.Counter()

    def _check(self, a: dict, varlen: bool, backward: bool) -> None:
        q, k, v = a["q"], a["k"], a["v"]
        assert q.dtype in (torch.float16, torch.bfloat16), "inputs must be float16 or bfloat16"
        assert q.dtype == k.dtype == v.dtype, "inputs must have the same dtype"
        h, d = q.shape[-2:]
        kvh, dv = k.shape[-2], v.shape[-1]
        assert h % kvh == 0, "num_head must be divisible by num_head_kv"
        if self.arch == 90:
            assert 8 <= d <= 256 and 8 <= dv <= 256 and d % 8 == 0 and dv % 8 == 0, f"SM90 head dims ({d}, {dv})"
            if backward and h != kvh:
                assert d == dv, "GQA backward requires head_dim == head_dim_v"
        else:
            assert (d, dv) in ((192, 128), (256, 256)) or (8 <= d <= 128 and 8 <= dv <= 128 and d % 8 == 0
                                                           and dv % 8 == 0), f"SM100 head dims ({d}, {dv})"
        if varlen:
            cq, ck = a["cu_seqlens_q"], a["cu_seqlens_k"]
            assert q.dim() == k.dim() == v.dim() == 3, "varlen tensors are [total, heads, dim]"
            assert cq.dtype == ck.dtype == torch.int32 and cq.shape == ck.shape and cq.dim() == 1, "cu_seqlens"
            assert a["max_seqlen_q"] is not None and a["max_seqlen_k"] is not None, "the ring passes max_seqlen"
        else:
            assert a["cu_seqlens_q"] is None and a["cu_seqlens_k"] is None
            assert q.dim() == 4 and k.shape[:1] == q.shape[:1] and k.shape[:3] == v.shape[:3], "dense shapes"

    def _forward(self, a):
        varlen = a["cu_seqlens_q"] is not None
        self._check(a, varlen, backward=False)
        self.count[("forward", "varlen" if varlen else "dense")] += 1
        q, v = a["q"], a["v"]
        out = q.new_empty(*q.shape[:-1], v.size(-1))
        lse = q.new_empty((q.size(1), q.size(0)) if varlen else (q.size(0), q.size(2), q.size(1)), dtype=torch.float32)
        return (out, lse if a["return_lse"] else None) + (None,) * (RETURNS[self.version] - 2)

    def _backward(self, a):
        varlen = a["cu_seqlens_q"] is not None
        self._check(a, varlen, backward=True)
        self.count[("backward", "varlen" if varlen else "dense")] += 1
        q, k, v = a["q"], a["k"], a["v"]
        h, dv = q.size(-2), v.size(-1)
        assert a["out"].shape == a["dout"].shape == (*q.shape[:-2], h, dv), "out / dout [.., h, dv]"
        lse_shape = (h, q.size(0)) if varlen else (q.size(0), h, q.size(1))
        assert tuple(a["lse"].shape) == lse_shape and a["lse"].dtype == torch.float32, f"lse {lse_shape} float32"
        assert isinstance(a["deterministic"], bool)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def install_fa4_shapes(monkeypatch, **kwargs) -> FA4Shapes:
    """Install a :class:`FA4Shapes` as ``flash_attn.cute.interface`` for one test."""
    return FA4Shapes(**kwargs).install(monkeypatch)
