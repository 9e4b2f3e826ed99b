"""Gated delta net on contiguous chunks (the forms :class:`~striped_sp.deepspeed.split.gdn.GatedDeltaNetSplit`
recognises: Qwen3-Next, Qwen3.5, OLMo hybrid).

On this rank's chunk: the input projections; the convolution over ``q | k | v`` with the previous
chunk's last ``k - 1`` inputs; the model's ``chunk_gated_delta_rule`` from a zero state with its final
state; the entry state folded from the other chunks' summaries (per value head the ``dk x dk``
transition and the ``dk x dv`` final state, fp32) and added to the outputs in the chunked form
(:func:`~striped_sp.engine.state_fold.delta_rule_pass`); the gated norm and the output projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...engine.state_fold import delta_rule_pass
from ...engine.state_passing import ContiguousChunks, from_chunks, to_chunks
from ..split.gdn import GatedDeltaNetSplit
from .common import StateForm, conv_with_halo, documents_of

__all__ = ["GatedDeltaNetState"]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """As the kernels normalise q and k (fla's, transformers' ``l2norm``), in float32 or wider."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


class GatedDeltaNetState(StateForm):
    """The state-passing form of one gated delta net."""

    kind = "gated delta net"
    split_form = GatedDeltaNetSplit

    def run(self, x: torch.Tensor, group, plan: ContiguousChunks, kwargs: dict) -> torch.Tensor:
        m, split = self.module, self.split
        self.check(plan, m.conv1d)
        conv_resets = kwargs.get("seq_idx") is not None  # its conv resets with seq_idx only, its scan with cu_seqlens
        plan, kwargs, resets = documents_of(plan, kwargs, "cu_seq_lens_q")
        if resets:  # before the re-layout: a kernel that cannot keep documents apart refuses on every rank
            self.check_packed(plan, cu_seqlens=split.scan, **({"seq_idx": split.conv} if conv_resets else {}))
        x = to_chunks(x, group, plan)
        b, t, _ = x.shape
        q, k, v, z, beta_in, a = split._project(x)
        mixed = torch.cat((q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)), dim=-1)
        mixed = conv_with_halo(split.conv, mixed, m.conv1d.weight.squeeze(1), m.conv1d.bias, group, plan,
                               conv_resets and resets, activation=m.activation, **kwargs)
        q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        q, k = (u.reshape(b, t, m.num_k_heads, m.head_k_dim) for u in (q, k))
        v = v.reshape(b, t, m.num_v_heads, m.head_v_dim)
        beta = beta_in.sigmoid()
        if split.form == "separate" and m.allow_neg_eigval:
            beta = beta * 2.0
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        cu = plan.on(x.device).cu_seqlens if resets else None
        out, final = split.scan(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True,
                                use_qk_l2norm_in_kernel=True, cu_seqlens=cu, **kwargs)
        if resets:  # fla's varlen form (one row) returns every document's final state: the chunk's last one
            final = final[-1:]
        ratio = m.num_v_heads // m.num_k_heads
        qn, kn = (_l2norm(u).repeat_interleave(ratio, dim=2) for u in (q, k))
        out = delta_rule_pass(out, final, qn * m.head_k_dim ** -0.5, kn, g, beta, group, plan)
        out = split.norm(out.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
        return from_chunks(split.out(out.reshape(b, t, -1)), group, plan)
