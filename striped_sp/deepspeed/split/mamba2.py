"""Mamba2 mixers split by heads (transformers 5.24: ``BambaMixer``, ``GraniteMoeHybridMambaLayer``,
``NemotronHMamba2Mixer``, ``Zamba2MambaMixer``, whose forwards are the same code, and
``FalconH1Mixer`` with its multipliers).

The forward (``../shared/mixers-transformers-5.24.md`` section 2), cut where no head mixes:

1. on this rank's tokens: ``in_proj`` -> gate ``z`` ``[b, s, d_inner]``, ``x`` ``[b, s, heads, head_dim]``,
   ``B, C`` ``[b, s, groups, d_state]``, ``dt`` ``[b, s, heads]`` (Falcon-H1: the input times
   ``ssm_in_multiplier``, the projection times its ``mup_vector``);
2. one all-to-all: rank ``j`` gets its heads' ``x, dt`` and the groups they read (``B, C``; with one
   group, as in Bamba's default, every rank gets all of it and the gradients sum back);
3. there: ``causal_conv1d_fn`` on its ``x | B | C`` rows of ``conv1d``, and the model's
   ``mamba2_chunk_scan`` with its heads' ``A_log``, ``D`` and ``dt_bias`` (the ``D * x`` skip inside);
4. one all-to-all back, then on this rank's tokens the gated RMSNorm over ``d_inner / groups``
   channels (all heads with one group: it mixes heads, so it waits for the way back; Falcon-H1 without
   ``mamba_rms_norm``: ``y * silu(z)``) and ``out_proj``.

The fused training path of mamba_ssm (``mamba_split_conv1d_scan_combined``: conv, scan, norm and
``out_proj`` in one kernel) cannot run split; the split form calls the conv and the scan separately,
which is what the model does without mamba_ssm.
"""

from __future__ import annotations

import torch

from ...engine.head_split import heads_to_tokens, tokens_to_heads
from .heads import conv_rows, head_groups, kernels_of, pack, per_rank, source_has, unpack

__all__ = ["Mamba2Split"]

_KERNELS = ("causal_conv1d_fn", "mamba2_chunk_scan")
_ATTRS = ("in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj", "num_heads", "head_dim", "n_groups",
          "ssm_state_size", "intermediate_size", "conv_dim", "chunk_size", "time_step_limit", "activation")


class Mamba2Split:
    """The split form of one Mamba2 mixer (see the module notes)."""

    kind = "Mamba2"

    def __init__(self, module: torch.nn.Module, falcon: bool):
        self.module, self.falcon = module, falcon
        self.conv, self.scan = kernels_of(module, *_KERNELS)

    @classmethod
    def recognise(cls, module: torch.nn.Module) -> "Mamba2Split | None":
        if not all(hasattr(module, a) for a in _ATTRS) or kernels_of(module, *_KERNELS) is None:
            return None
        core = ("gate, hidden_states_B_C, dt = projected_states.split(", "mamba2_chunk_scan(", "z=None")
        if source_has(module, *core, "scan_output = self.norm(scan_output, gate)") and \
                not source_has(module, "mup_vector"):
            return cls(module, falcon=False)
        if source_has(module, *core, "self.ssm_in_multiplier", "self.mup_vector", "self.mamba_rms_norm"):
            return cls(module, falcon=True)
        return None

    def cannot_split(self, n: int) -> str | None:
        deal = head_groups(n, self.module.num_heads, self.module.n_groups, "heads")
        return deal if isinstance(deal, str) else None

    def _gate(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        m = self.module
        if self.falcon and not m.mamba_rms_norm:
            return y * torch.nn.functional.silu(z)
        return m.norm(y, z)

    def run(self, x: torch.Tensor, group, order, kwargs: dict) -> torch.Tensor:
        """``x`` ``[b, S/N, hidden]`` -> the mixer's output for this rank's tokens (``kwargs`` as in
        :meth:`~.gdn.GatedDeltaNetSplit.run`)."""
        m, n, rank = self.module, order.world_size, order.rank
        deal = head_groups(n, m.num_heads, m.n_groups, "heads")
        b, s, _ = x.shape
        dtype = x.dtype
        if self.falcon:
            x = x * m.ssm_in_multiplier
        projected = m.in_proj(x)
        if self.falcon:
            projected = projected * m.mup_vector
        gate, xbc, dt = projected.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        width = m.n_groups * m.ssm_state_size
        h, B, C = torch.split(xbc, [m.intermediate_size, width, width], dim=-1)
        groups = deal.group_index(x.device)
        send, sizes = pack([per_rank(h.reshape(b, s, m.num_heads, m.head_dim), n),
                            per_rank(B.reshape(b, s, m.n_groups, m.ssm_state_size), n, groups),
                            per_rank(C.reshape(b, s, m.n_groups, m.ssm_state_size), n, groups),
                            per_rank(dt.unsqueeze(-1), n)], n)
        h, B, C, dt = unpack(tokens_to_heads(send, group, order), sizes)
        total = h.size(1)
        heads, used = deal.heads_of[rank], deal.groups_of[rank]
        rows = conv_rows([(0, m.head_dim, heads), (m.intermediate_size, m.ssm_state_size, used),
                          (m.intermediate_size + width, m.ssm_state_size, used)], x.device)
        weight = m.conv1d.weight.squeeze(1).index_select(0, rows)
        bias = None if m.conv1d.bias is None else m.conv1d.bias.index_select(0, rows)
        xbc = self.conv(torch.cat((h, B, C), dim=-1).transpose(1, 2), weight, bias, activation=m.activation,
                        **kwargs).transpose(1, 2)
        h, B, C = torch.split(xbc, [h.size(-1), B.size(-1), C.size(-1)], dim=-1)
        mine = slice(heads[0], heads[-1] + 1)
        y = self.scan(h.reshape(b, total, -1, m.head_dim), dt, -torch.exp(m.A_log[mine].float()),
                      B.reshape(b, total, -1, m.ssm_state_size), C.reshape(b, total, -1, m.ssm_state_size),
                      chunk_size=m.chunk_size, D=m.D[mine], z=None, return_final_states=False,
                      dt_bias=m.dt_bias[mine], dt_softplus=True, initial_states=None,
                      dt_limit=m.time_step_limit, **kwargs)
        y = heads_to_tokens(y.reshape(b, total, -1), group, order).reshape(b, s, m.intermediate_size)
        return m.out_proj(self._gate(y, gate).to(dtype))
