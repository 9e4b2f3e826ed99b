"""Pure-torch float64 stand-ins for the fla ops megatron-core's ``GatedDeltaNet`` calls (tests
only: fla's Triton kernels need CUDA and are not installed on CPU).

Written from the ops' definitions, not copied; each computes in float64 and returns the input's
dtype, so a CP=N run and its CP=1 reference (which call the same ops) differ only by what the
context parallelism does around them.  ``cu_seqlens`` (int ``[n + 1]``, batch 1) are document
bounds: nothing crosses a bound, the state starts from zero at each document.

* :func:`l2norm`: ``x / sqrt(sum(x^2, -1) + eps)`` (``eps = 1e-6``);
* :func:`causal_conv1d`: depthwise causal convolution of ``x`` ``[b, s, d]`` with ``weight``
  ``[d, w]`` (tap ``w - 1`` on the token itself), bias, SiLU; returns ``(out, None)``;
* :func:`chunk_gated_delta_rule`: the gated delta rule, token by token: per head, with the state
  ``S`` ``[d_k, d_v]``, ``a_t = exp(g_t)``::

      S' = a_t S_{t-1}            u_t = v_t - S'^T k_t
      S_t = S' + beta_t k_t u_t^T  o_t = scale * S_t^T q_t     (scale = d_k ** -0.5)

  ``q``, ``k`` ``[b, s, h, d_k]``, ``v`` ``[b, s, h, d_v]``, ``g`` (log decay), ``beta``
  ``[b, s, h]``; returns ``(o, None)``;
* :func:`use_reference_ops`: puts the three into megatron-core's GDN modules (and says fla is
  there); returns a function that restores what it replaced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["l2norm", "causal_conv1d", "chunk_gated_delta_rule", "use_reference_ops"]


def _document_starts(cu_seqlens, length: int) -> torch.Tensor:
    """bool ``[length]``: token ``t`` opens a document (token 0 always)."""
    starts = torch.zeros(length, dtype=torch.bool)
    starts[0] = True
    if cu_seqlens is not None:
        bounds = [int(b) for b in cu_seqlens.reshape(-1).tolist()]
        for b in bounds[:-1]:
            if b < length:
                starts[b] = True
    return starts


def _document_index(cu_seqlens, length: int) -> torch.Tensor:
    return torch.cumsum(_document_starts(cu_seqlens, length).long(), 0)


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    y = x.double()
    return (y / torch.sqrt((y * y).sum(dim, keepdim=True) + eps)).to(x.dtype)


def causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, **kwargs):
    assert initial_state is None and not output_final_state, "the stand-in runs training only"
    b, s, d = x.shape
    w = weight.size(-1)
    xd, wd = x.double(), weight.reshape(d, w).double()
    doc = _document_index(cu_seqlens, s)
    out = torch.zeros_like(xd) if bias is None else bias.double().expand(b, s, d).clone()
    for k in range(w):
        back = w - 1 - k  # tap k sees token t - back
        if back >= s:
            continue
        src = torch.zeros_like(xd)
        src[:, back:] = xd[:, : s - back]
        same = torch.zeros(s, dtype=torch.bool)
        same[back:] = doc[back:] == doc[: s - back]
        out = out + src * same[None, :, None] * wd[:, k]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"activation={activation!r}: the stand-in knows silu only")
    return out.to(x.dtype), None


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    assert initial_state is None and not output_final_state, "the stand-in runs training only"
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    b, s, h, dk = k.shape
    dv = v.size(-1)
    scale = dk ** -0.5 if scale is None else scale
    qd, kd, vd, gd, bd = (t.double() for t in (q, k, v, g, beta))
    starts = _document_starts(cu_seqlens, s)
    state = qd.new_zeros(b, h, dk, dv)
    outs = []
    for t in range(s):
        if starts[t]:
            state = qd.new_zeros(b, h, dk, dv)
        decayed = state * torch.exp(gd[:, t])[..., None, None]
        kt, vt = kd[:, t], vd[:, t]                                      # [b, h, dk], [b, h, dv]
        u = vt - torch.einsum("bhkv,bhk->bhv", decayed, kt)
        state = decayed + bd[:, t][..., None, None] * kt[..., :, None] * u[..., None, :]
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", state, qd[:, t]))
    return torch.stack(outs, 1).to(v.dtype), None


def use_reference_ops():
    """Put the stand-ins where megatron-core's GDN looks them up; returns the restore function."""
    from megatron.core.ssm.gated_delta_net import common, gdn

    saved = [(common, "HAVE_FLA", common.HAVE_FLA), (common, "l2norm", common.l2norm),
             (gdn, "causal_conv1d", gdn.causal_conv1d), (gdn, "chunk_gated_delta_rule", gdn.chunk_gated_delta_rule)]
    common.HAVE_FLA = True
    common.l2norm = l2norm
    gdn.causal_conv1d = causal_conv1d
    gdn.chunk_gated_delta_rule = chunk_gated_delta_rule

    def restore():
        for owner, name, value in saved:
            setattr(owner, name, value)

    return restore
