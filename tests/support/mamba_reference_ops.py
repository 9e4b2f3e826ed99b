"""Pure-torch stand-ins for the mamba_ssm / causal_conv1d ops that megatron-core's ``MambaMixer``
calls in training (tests only: mamba_ssm's Triton kernels and causal_conv1d need CUDA).

Written from the ops' documented semantics, not copied; each computes in float64 and returns the
input's dtype, so a CP=N run and its CP=1 reference (which use the same ops) differ only by what
the context parallelism does around them.

* :func:`mamba_split_conv1d_scan_combined`: ``zxbcdt`` ``[b, l, 2*d + 2*g*n + h]`` (``d = h*p``)
  split into ``z``, ``xBC``, ``dt``; a depthwise causal convolution of ``xBC`` (width ``w``, bias,
  SiLU), then the selective state-space scan (SSD) per head::

      dt_t = softplus(dt_t + dt_bias)          state_t = exp(dt_t * A) * state_{t-1} + dt_t * x_t B_t^T
      y_t  = state_t C_t + D * x_t             out_t   = y_t * silu(z_t)

  With ``seq_idx`` (int ``[b, l]``, a document index per token) neither the convolution nor the
  scan crosses a change of index: a token sees only earlier tokens of its own document.  Returns
  ``[b, l, d]``.  The scan is evaluated in its quadratic (attention-like) form.
* :class:`GatedRMSNorm`: ``mamba_ssm.ops.triton.layernorm_gated.RMSNorm`` (``group_size``,
  ``norm_before_gate``, an optional gate ``z``).
* :func:`use_reference_ops`: puts both into megatron-core's ``mamba_mixer`` module (and says the
  packing support is there); returns a function that restores what it replaced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "ssd_scan", "mamba_split_conv1d_scan_combined", "GatedRMSNorm", "use_reference_ops"]


def _same_doc(seq_idx: torch.Tensor | None, shift: int, shape) -> torch.Tensor | None:
    """bool ``[b, l]``: token ``t`` and token ``t - shift`` exist and share a document."""
    b, l = shape
    valid = torch.arange(l) >= shift
    if seq_idx is None:
        return valid.expand(b, l)
    prev = torch.roll(seq_idx, shift, dims=1)
    return valid & (prev == seq_idx)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  seq_idx: torch.Tensor | None = None, activation: str | None = "silu") -> torch.Tensor:
    """Depthwise causal convolution: ``x`` ``[b, l, c]``, ``weight`` ``[c, w]`` (tap ``w - 1`` on
    the token itself), ``bias`` ``[c]``; float64 ``[b, l, c]``."""
    b, l, _ = x.shape
    w = weight.size(1)
    x, weight = x.double(), weight.double()
    out = torch.zeros_like(x) if bias is None else bias.double().expand_as(x).clone()
    for k in range(w):
        shift = w - 1 - k
        keep = _same_doc(seq_idx, shift, (b, l)).to(x.device)
        out = out + torch.roll(x, shift, dims=1) * keep[..., None] * weight[:, k]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"activation={activation!r}: the reference knows silu only")
    return out


def ssd_scan(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True, seq_idx=None,
             dt_limit=(0.0, float("inf"))) -> torch.Tensor:
    """The SSD scan: ``x`` ``[b, l, h, p]``, ``dt`` ``[b, l, h]``, ``A`` ``[h]``, ``B`` / ``C``
    ``[b, l, g, n]``, ``D`` ``[h]`` or ``[h, p]``, ``z`` ``[b, l, h, p]``; float64 ``[b, l, h, p]``."""
    b, l, h, _ = x.shape
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(*dt_limit)
    rep = h // B.size(2)
    B, C = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)  # [b, l, h, n]
    cs = torch.cumsum(dt * A, dim=1)  # [b, l, h]
    decay = cs.transpose(1, 2)[..., :, None] - cs.transpose(1, 2)[..., None, :]  # [b, h, t, s]
    t = torch.arange(l, device=x.device)
    visible = (t[None, :] <= t[:, None]).expand(b, l, l)
    if seq_idx is not None:
        visible = visible & (seq_idx[:, :, None] == seq_idx[:, None, :]).to(x.device)
    weights = decay.masked_fill(~visible[:, None], float("-inf")).exp()
    weights = weights * torch.einsum("bthn,bshn->bhts", C, B)
    y = torch.einsum("bhts,bsh,bshp->bthp", weights, dt, x)
    if D is not None:
        D = D.double()
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * F.silu(z.double())
    return y


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size=None,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True, **unused):
    """mamba_ssm's fused training op (see the module docstring); ``chunk_size`` only tiles the
    real kernel.  Initial / final states are not supported (training never passes them)."""
    if initial_states is not None or return_final_states:
        raise NotImplementedError("the reference scan has no initial or final states")
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("a per-head D needs headdim")
        nheads = D.size(0)
    else:
        nheads, headdim = D.shape
    batch, seqlen, width = zxbcdt.shape
    dim = nheads * headdim
    dstate = (width - 2 * dim - nheads) // ngroups // 2
    if width != 2 * dim + 2 * ngroups * dstate + nheads:
        raise ValueError(f"zxbcdt has {width} features: expected 2*{dim} + 2*{ngroups}*d_state + {nheads}")
    z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xbc = causal_conv1d(xbc, conv1d_weight, conv1d_bias, seq_idx, activation)
    x, B, C = torch.split(xbc, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    y = ssd_scan(x.view(batch, seqlen, nheads, headdim), dt, A, B.view(batch, seqlen, ngroups, dstate),
                 C.view(batch, seqlen, ngroups, dstate), D=D,
                 z=None if rmsnorm_weight is not None else z.view(batch, seqlen, nheads, headdim),
                 dt_bias=dt_bias, seq_idx=seq_idx, dt_limit=dt_limit).reshape(batch, seqlen, dim)
    if rmsnorm_weight is not None:
        y = _rms_norm(y, rmsnorm_weight, z, rmsnorm_eps, None, norm_before_gate)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight.double(), None if outproj_bias is None else outproj_bias.double())
    return y.to(zxbcdt.dtype)


def _rms_norm(x, weight, z, eps, group_size, norm_before_gate):
    x = x.double()
    if z is not None and not norm_before_gate:
        x = x * F.silu(z.double())
    shape = x.shape
    if group_size is not None:
        x = x.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    out = (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)).reshape(shape) * weight.double()
    if z is not None and norm_before_gate:
        out = out * F.silu(z.double())
    return out


class GatedRMSNorm(torch.nn.Module):
    """``mamba_ssm``'s gated RMSNorm: ``forward(x, z=None)`` normalizes ``x`` ``[..., hidden]`` per
    group of ``group_size`` features (all of them when ``None``), scales by ``weight`` and gates by
    ``silu(z)`` after the norm (``norm_before_gate``) or before it."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x, z=None):
        return _rms_norm(x, self.weight, z, self.eps, self.group_size, self.norm_before_gate).to(x.dtype)


_TRITON_TENSOR_OPS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"


def _stub_inference_triton_ops() -> None:
    """Without triton (the CPU torch build), megatron-core 0.16's ``mamba_mixer`` cannot import its
    inference-only triton tensor ops: a stub module whose functions refuse stands in."""
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("triton") is not None or _TRITON_TENSOR_OPS in sys.modules:
        return
    stub = types.ModuleType(_TRITON_TENSOR_OPS)

    def refuse(*args, **kwargs):
        raise RuntimeError("Mamba inference needs triton (CUDA): not available in the CPU test stand-ins")

    for name in ("tensor_get_slice_after", "tensor_masked_update", "tensor_merge"):
        setattr(stub, name, refuse)
    sys.modules[_TRITON_TENSOR_OPS] = stub


def use_reference_ops(mixer_module=None):
    """Put the reference ops into megatron-core's ``mamba_mixer`` (or ``mixer_module``); returns a
    function that restores the module's attributes."""
    if mixer_module is None:
        _stub_inference_triton_ops()
        from megatron.core.ssm import mamba_mixer as mixer_module

    class ExtendedRMSNorm(GatedRMSNorm):
        pass

    new = {
        "HAVE_MAMBA_SSM": True,
        "mamba_split_conv1d_scan_combined": mamba_split_conv1d_scan_combined,
        "ExtendedRMSNorm": ExtendedRMSNorm,
        "RMSNormGated": GatedRMSNorm,
        "_check_mamba_sequence_packing_support": lambda *a, **k: (True, None),
    }
    old = {name: getattr(mixer_module, name) for name in new if hasattr(mixer_module, name)}
    for name, value in new.items():
        setattr(mixer_module, name, value)

    def restore():
        for name in new:
            if name in old:
                setattr(mixer_module, name, old[name])
            else:
                delattr(mixer_module, name)

    return restore
