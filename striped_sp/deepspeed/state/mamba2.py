"""Mamba2 mixers on contiguous chunks (the forms :class:`~striped_sp.deepspeed.split.mamba2.Mamba2Split`
recognises: Bamba, GraniteMoeHybrid, NemotronH, Zamba2, Falcon-H1).

On this rank's chunk: ``in_proj``; the convolution with the previous chunk's last ``k - 1`` inputs
(:func:`.common.conv_with_halo`); the model's ``mamba2_chunk_scan`` from a zero state with its final
state; the entry state folded from the other chunks' summaries (one fp32 decay and ``[head_dim,
d_state]`` state per head) and added to the outputs
(:func:`~striped_sp.engine.state_fold.scalar_decay_pass`); the gated norm and ``out_proj``.  The
hidden states cross the network (one all-to-all each way), not the ``d_inner`` channels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...engine.state_fold import scalar_decay_pass
from ...engine.state_passing import ContiguousChunks, from_chunks, to_chunks
from ..split.mamba2 import Mamba2Split
from .common import StateForm, conv_with_halo, documents_of

__all__ = ["Mamba2State"]


class Mamba2State(StateForm):
    """The state-passing form of one Mamba2 mixer."""

    kind = "Mamba2"
    split_form = Mamba2Split

    def run(self, x: torch.Tensor, group, plan: ContiguousChunks, kwargs: dict) -> torch.Tensor:
        m, split = self.module, self.split
        self.check(plan, m.conv1d)
        plan, kwargs, resets = documents_of(plan, kwargs, "seq_idx")
        if resets:  # before the re-layout
            self.check_packed(plan, seq_idx=split.conv)
            self.check_packed(plan, seq_idx=split.scan)
        dtype = x.dtype
        x = to_chunks(x, group, plan)
        b, t, _ = x.shape
        if split.falcon:
            x = x * m.ssm_in_multiplier
        projected = m.in_proj(x)
        if split.falcon:
            projected = projected * m.mup_vector
        gate, xbc, dt = projected.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        xbc = conv_with_halo(split.conv, xbc, m.conv1d.weight.squeeze(1), m.conv1d.bias, group, plan, resets,
                             activation=m.activation, **kwargs)
        width = m.n_groups * m.ssm_state_size
        h, B, C = torch.split(xbc, [m.intermediate_size, width, width], dim=-1)
        B, C = (u.reshape(b, t, m.n_groups, m.ssm_state_size) for u in (B, C))
        A = -torch.exp(m.A_log.float())
        scan_kw = dict(kwargs)
        if resets:
            scan_kw["seq_idx"] = plan.on(x.device).seq_idx.expand(b, -1).contiguous()
        y, final = split.scan(h.reshape(b, t, m.num_heads, m.head_dim), dt, A, B, C, chunk_size=m.chunk_size,
                              D=m.D, z=None, return_final_states=True, dt_bias=m.dt_bias, dt_softplus=True,
                              initial_states=None, dt_limit=m.time_step_limit, **scan_kw)
        lo, hi = m.time_step_limit
        step = torch.clamp(F.softplus(dt.float() + m.dt_bias.float()), min=lo, max=hi)
        heads_c = C.repeat_interleave(m.num_heads // m.n_groups, dim=2)
        y = scalar_decay_pass(y, final, step * A, heads_c, group, plan)
        y = y.reshape(b, t, m.intermediate_size)
        return from_chunks(m.out_proj(split._gate(y, gate).to(dtype)), group, plan)
