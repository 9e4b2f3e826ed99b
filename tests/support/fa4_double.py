"""A float64 test double of FlashAttention-4's ``flash_attn.cute.interface`` (no GPU needed).

Written from the upstream source's semantics (Dao-AILab/flash-attention ``flash_attn/cute/interface.py``),
never from ``striped_sp``'s kernel:

* signatures: ``_flash_attn_fwd(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
  seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, page_table=None, softmax_scale=None,
  causal=False, softcap=None, window_size_left=None, window_size_right=None, ..., return_lse=False, ...)``
  and ``_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
  window_size_left=None, window_size_right=None, ..., cu_seqlens_q=None, cu_seqlens_k=None,
  seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, deterministic=False, ...)``;
* the forward returns ``(out, lse)`` up to 4.0.0b18, four values from b19, five in b36 (the extra
  ones are ``None`` here); the backward ``(dq, dk, dv)``;
* windows: ``causal`` sets the right side to 0; ``wl + wr < 0`` opens both sides; ``(None, 0)`` is
  causal; ``None`` is an open side; masks bottom-right aligned (query ``i`` of a segment of ``lq``
  queries and ``lk`` keys sees key ``j`` when ``i + lk - lq - wl <= j <= i + lk - lq + wr``);
* ``softcap`` (fwd default ``None``, bwd ``0.0``): every scaled score ``x`` becomes ``c * tanh(x / c)``
  before the softmax, and the backward chains ``1 - tanh(x / c)^2``;
* lse float32 ``[b, h, s]`` dense, ``[h, total_q]`` varlen; a row that sees no key gets lse ``-inf``
  and output 0; GQA: query head ``i`` reads kv head ``i // (h / kv_h)``; ``v`` may have its own
  head dim (out ``[.., h, dv]``);
* its asserts: fp16/bf16 inputs of one dtype, the shapes, int32 contiguous ``cu_seqlens`` of
  ``batch + 1``, kv heads dividing heads, head dims multiples of 8 up to 256, per architecture
  SM100's (d, dv) rules, SM100's (256, 256) kernels without local attention (forward and backward)
  nor a deterministic backward (``sm100_hd256_2cta_fmha_*``, 4.0.0b14 on), SM90's GQA backward with one head dim (``flash_bwd_sm90``; windows, varlen
  and ``deterministic`` run on SM90 from 4.0.0b5, the first release supported); lse / out /
  dout of the backward exactly as the forward returns them.  ``max_seqlen_*`` below a segment's
  length is refused too (the kernels size their tiles by it).

Knobs for the tests: ``fp32=True`` also takes float32 inputs (a stand-in with float64-exact
answers, for tight tolerances); ``alignment="top_left"`` answers with a wrongly aligned mask (to
show that the tests would catch a kernel whose alignment differs from what the ring assumes).
"""

from __future__ import annotations

import sys
import types

import torch

RETURNS = {"4.0.0b18": 2, "4.0.0b19": 4, "4.0.0b36": 5}


class FA4Double:
    """One installed FA4 of ``version`` on a device of ``arch`` (90 or 100); ``calls`` records
    ``(function name, its bound arguments)``."""

    def __init__(self, version: str = "4.0.0b36", arch: int = 100, fp32: bool = False,
                 alignment: str = "bottom_right"):
        self.version, self.arch, self.fp32, self.alignment = version, arch, fp32, alignment
        self.calls: list[tuple[str, dict]] = []

    # -- install ------------------------------------------------------------------------
    def install(self, monkeypatch) -> "FA4Double":
        pkg = types.ModuleType("flash_attn")
        cute = types.ModuleType("flash_attn.cute")
        iface = types.ModuleType("flash_attn.cute.interface")
        double = self

        def _flash_attn_fwd(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                            max_seqlen_q=None, max_seqlen_k=None, page_table=None, softmax_scale=None,
                            causal=False, softcap=None, window_size_left=None, window_size_right=None,
                            learnable_sink=None, m_block_size=128, n_block_size=128, num_threads=384, num_splits=1,
                            pack_gqa=None, _arch=None, score_mod=None, mask_mod=None, block_sparse_tensors=None,
                            return_lse=False, out=None, lse=None, aux_tensors=None):
            args = dict(locals())
            double.calls.append(("_flash_attn_fwd", args))
            return double._forward(args)

        def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                            window_size_left=None, window_size_right=None, m_block_size=64, n_block_size=128,
                            num_threads=256, pack_gqa=False, num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False,
                            dKV_swapAB=False, dQ_swapAB=False, AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2,
                            V_in_regs=False, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                            max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None,
                            score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                            block_sparse_tensors=None):
            args = dict(locals())
            double.calls.append(("_flash_attn_bwd", args))
            return double._backward(args)

        iface._flash_attn_fwd, iface._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
        pkg.cute, cute.interface = cute, iface
        monkeypatch.setitem(sys.modules, "flash_attn", pkg)
        monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
        monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", iface)
        return self

    # -- semantics ----------------------------------------------------------------------
    def _check_common(self, a: dict, varlen: bool):
        q, k, v = a["q"], a["k"], a["v"]
        dtypes = (torch.float16, torch.bfloat16) + ((torch.float32,) if self.fp32 else ())
        assert q.dtype in dtypes, "inputs must be float16 or bfloat16"
        assert q.dtype == k.dtype == v.dtype, "inputs must have the same dtype"
        assert a["seqused_q"] is None and a["seqused_k"] is None and a.get("page_table") is None
        h, d = q.shape[-2:]
        kvh, dv = k.shape[-2], v.shape[-1]
        assert h % kvh == 0, "num_head must be divisible by num_head_kv"
        assert d <= 256 and dv <= 256, "head_dim must be less than or equal to 256"
        assert d % 8 == 0 and dv % 8 == 0, "head_dim must be divisible by 8"
        if self.arch == 100:
            assert (d, dv) in ((192, 128), (256, 256)) or (d <= 128 and dv <= 128), f"SM100 head dims ({d}, {dv})"
        assert a["softcap"] is None or (isinstance(a["softcap"], float) and a["softcap"] >= 0), "softcap float"
        if varlen:
            cq, ck = a["cu_seqlens_q"], a["cu_seqlens_k"]
            assert q.dim() == 3 and k.dim() == 3 and v.dim() == 3
            for name, cu, total in (("cu_seqlens_q", cq, q.size(0)), ("cu_seqlens_k", ck, k.size(0))):
                assert cu is not None and cu.dtype == torch.int32 and cu.stride(0) == 1, f"{name} int32, contiguous"
                assert int(cu[0]) == 0 and int(cu[-1]) == total, f"{name} runs from 0 to {total}"
            assert cq.shape == ck.shape, "cu_seqlens_k must have shape (batch_size + 1,)"
            for name, cu in (("max_seqlen_q", cq), ("max_seqlen_k", ck)):
                if a[name] is not None:
                    assert int(torch.diff(cu).max()) <= a[name], f"{name}={a[name]} below a segment's length"
        else:
            assert a["cu_seqlens_q"] is None and a["cu_seqlens_k"] is None
            assert q.dim() == 4 and k.shape[:1] == q.shape[:1] and k.shape[:3] == v.shape[:3], "dense shapes"

    @staticmethod
    def _capped(scores: torch.Tensor, softcap) -> torch.Tensor:
        """Upstream's ``softcap``: every scaled score ``x`` becomes ``c * tanh(x / c)`` (``None`` / 0: off)."""
        return softcap * torch.tanh(scores / softcap) if softcap else scores

    @staticmethod
    def _window(causal, wl, wr):
        """The upstream normalisation: ``(causal, wl, wr)`` as the kernels see them."""
        if causal:
            wr = 0
        if wl is not None and wr is not None and wl + wr < 0:
            wl = wr = None
        if wl is not None or wr is not None:
            if wl is None and wr == 0:
                return True, None, None
            return False, wl, wr
        return causal, None, None

    def _visible(self, a, varlen, causal, wl, wr) -> torch.Tensor:
        """Bool ``[rows, keys]`` over the flattened (``[b * s]``) or packed (``[T]``) rows: query
        ``x`` of a segment sees key ``y`` of the same segment inside the (aligned) band."""
        if varlen:
            cq, ck = a["cu_seqlens_q"].long(), a["cu_seqlens_k"].long()
        else:
            b, sq, sk = a["q"].size(0), a["q"].size(1), a["k"].size(1)
            cq, ck = torch.arange(b + 1) * sq, torch.arange(b + 1) * sk
        lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
        seg_q = torch.repeat_interleave(torch.arange(lq.numel()), lq)
        seg_k = torch.repeat_interleave(torch.arange(lk.numel()), lk)
        off = (lk - lq)[seg_q] if self.alignment == "bottom_right" else torch.zeros_like(seg_q)
        i = (torch.arange(seg_q.numel()) - cq[:-1][seg_q] + off).unsqueeze(1)
        j = (torch.arange(seg_k.numel()) - ck[:-1][seg_k]).unsqueeze(0)
        vis = seg_q.unsqueeze(1) == seg_k.unsqueeze(0)
        if causal:
            vis &= j <= i
        if wl is not None:
            vis &= j >= i - wl
        if wr is not None:
            vis &= j <= i + wr
        return vis

    def _flat(self, a, varlen):
        q, k, v = (a[n].double() for n in ("q", "k", "v"))
        if not varlen:
            q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
        group = q.size(1) // k.size(1)
        return q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), group

    def _forward(self, a):
        varlen = a["cu_seqlens_q"] is not None
        self._check_common(a, varlen)
        assert a["out"] is None and a["lse"] is None and a["score_mod"] is None and a["mask_mod"] is None
        causal, wl, wr = self._window(a["causal"], a["window_size_left"], a["window_size_right"])
        if self.arch == 100 and (a["q"].size(-1), a["v"].size(-1)) == (256, 256):  # sm100_hd256_2cta_fmha_forward
            assert wl is None and wr is None, "SM100 forward with head_dim=256 does not support local attention yet"
        q, k, v, _ = self._flat(a, varlen)
        scale = a["softmax_scale"] if a["softmax_scale"] is not None else q.size(-1) ** -0.5
        vis = self._visible(a, varlen, causal, wl, wr)
        sc = self._capped(torch.einsum("qhd,khd->hqk", q, k) * scale, a["softcap"])
        sc = sc.masked_fill(~vis, float("-inf"))
        lse = torch.logsumexp(sc, -1)  # [h, rows]; -inf for a row that sees no key
        p = torch.exp(sc - lse.unsqueeze(-1)).nan_to_num(0.0)
        out = torch.einsum("hqk,khd->qhd", p, v)  # 0 for a row that sees no key
        dtype = a["q"].dtype
        if varlen:
            out_t, lse_t = out.to(dtype), lse.float()
        else:
            b, s = a["q"].shape[:2]
            out_t = out.reshape(b, s, *out.shape[1:]).to(dtype)
            lse_t = lse.reshape(lse.size(0), b, s).transpose(0, 1).contiguous().float()
        if not a["return_lse"]:
            lse_t = None
        return (out_t, lse_t) + (None,) * (RETURNS[self.version] - 2)

    def _backward(self, a):
        varlen = a["cu_seqlens_q"] is not None
        self._check_common(a, varlen)
        q, k, v = a["q"], a["k"], a["v"]
        if self.arch == 90 and q.size(-2) != k.size(-2):
            assert q.size(-1) == v.size(-1), "GQA backward requires head_dim == head_dim_v"
        assert isinstance(a["deterministic"], bool)
        h, dv = q.size(-2), v.size(-1)
        rows = q.shape[:-2]
        assert a["out"].shape == (*rows, h, dv) and a["dout"].shape == (*rows, h, dv), "out / dout [.., h, dv]"
        assert a["out"].dtype == a["dout"].dtype == q.dtype, "inputs must have the same dtype"
        lse_shape = (h, q.size(0)) if varlen else (q.size(0), h, q.size(1))
        assert tuple(a["lse"].shape) == lse_shape, f"lse must have shape {lse_shape}"
        assert a["lse"].dtype == torch.float32 and a["lse"].is_contiguous(), "lse must be float32"
        for name in ("dq", "dk", "dv", "score_mod", "mask_mod"):
            assert a[name] is None
        causal, wl, wr = self._window(a["causal"], a["window_size_left"], a["window_size_right"])
        if self.arch == 100 and (q.size(-1), v.size(-1)) == (256, 256):  # sm100_hd256_2cta_fmha_backward
            assert wl is None and wr is None, "SM100 backward with head_dim=256 does not support local attention"
            assert not a["deterministic"], "SM100 backward with head_dim=256 does not support deterministic mode"
        qf, kf, vf, group = self._flat(a, varlen)
        flat = (lambda t: t.double()) if varlen else (lambda t: t.double().reshape(-1, *t.shape[2:]))
        o, do = flat(a["out"]), flat(a["dout"])
        lse = a["lse"].double() if varlen else a["lse"].double().transpose(0, 1).reshape(h, -1)
        scale = a["softmax_scale"] if a["softmax_scale"] is not None else qf.size(-1) ** -0.5
        vis = self._visible(a, varlen, causal, wl, wr)
        sc = self._capped(torch.einsum("qhd,khd->hqk", qf, kf) * scale, a["softcap"])
        p = torch.exp(sc.masked_fill(~vis, float("-inf")) - lse.unsqueeze(-1)).nan_to_num(0.0)
        dvx = torch.einsum("hqk,qhd->khd", p, do)
        dp = torch.einsum("qhd,khd->hqk", do, vf)
        delta = (do * o).sum(-1).transpose(0, 1).unsqueeze(-1)  # [h, q, 1]
        ds = p * (dp - delta)
        if a["softcap"]:  # upstream: the scaled score x becomes c * tanh(x / c); dx = ds * (1 - tanh^2)
            ds = ds * (1 - (sc / a["softcap"]) ** 2)
        dq = torch.einsum("hqk,khd->qhd", ds, kf) * scale
        dk = torch.einsum("hqk,qhd->khd", ds, qf) * scale
        kvh = k.size(-2)
        dk = dk.reshape(dk.size(0), kvh, group, -1).sum(2)  # GQA: summed over each kv head's group
        dvx = dvx.reshape(dvx.size(0), kvh, group, -1).sum(2)
        return tuple(g.reshape(t.shape).to(t.dtype) for g, t in ((dq, q), (dk, k), (dvx, v)))


def install_fa4(monkeypatch, **kwargs) -> FA4Double:
    """Install a :class:`FA4Double` as ``flash_attn.cute.interface`` for one test."""
    return FA4Double(**kwargs).install(monkeypatch)
