"""Mamba (1) split by channels (Jamba's ``JambaMambaMixer``; transformers 5.24).

The forward (``../shared/mixers-transformers-5.24.md`` section 3) is per channel except ``x_proj``,
which contracts all ``d_inner`` channels of a token into ``dt_rank + 2 d_state`` numbers (the step
input and the one B / C group every channel shares).  So:

1. on this rank's tokens: ``in_proj`` -> ``x, z`` ``[b, s, d_inner]``; one all-to-all gives rank ``j``
   its channels of both for every token in natural order;
2. there: ``causal_conv1d_fn`` on its rows of ``conv1d``; its share of ``x_proj`` (its columns), summed
   over the group by an all-reduce (whose gradient is an all-reduce too: every rank's channels use
   the sum); the small RMSNorms of ``dt``, ``B``, ``C`` (on every rank, their gradients partial per
   rank and summed with the rest); ``dt_proj``'s rows of its channels; the model's
   ``mamba_selective_scan`` with its channels' ``A_log``, ``D`` and the gate ``z``;
3. one all-to-all back, ``out_proj`` on this rank's tokens.

Bytes per layer: the two all-to-alls of ``S/N x 2 d_inner`` and ``S/N x d_inner`` per rank, plus an
all-reduce of ``S x (dt_rank + 2 d_state)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...engine.head_split import heads_to_tokens, tokens_to_heads
from .heads import kernels_of, pack, per_rank, source_has, unpack

__all__ = ["MambaSplit"]

_KERNELS = ("causal_conv1d_fn", "mamba_selective_scan")
_ATTRS = ("in_proj", "x_proj", "dt_proj", "conv1d", "A_log", "D", "out_proj", "dt_layernorm", "b_layernorm",
          "c_layernorm", "intermediate_size", "time_step_rank", "ssm_state_size", "activation")


class _SumOverGroup(torch.autograd.Function):
    """Every rank's partial sum -> the total on every rank; backward the same (each rank's channels
    use the total, so the gradient of each part is the sum of every rank's gradient of it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class MambaSplit:
    """The split form of one Mamba (1) mixer (see the module notes)."""

    kind = "Mamba"

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.conv, self.scan = kernels_of(module, *_KERNELS)

    @classmethod
    def recognise(cls, module: torch.nn.Module) -> "MambaSplit | None":
        if not all(hasattr(module, a) for a in _ATTRS) or kernels_of(module, *_KERNELS) is None:
            return None
        if not source_has(module, "hidden_states_B_C, gate = projected_states.chunk(2, dim=1)", "self.x_proj(",
                          "self.dt_proj.weight @ time_step.transpose(1, 2)", "mamba_selective_scan("):
            return None
        return cls(module)

    def cannot_split(self, n: int) -> str | None:
        channels = self.module.intermediate_size
        if channels % n:
            return f"{channels} channels are not divisible by {n} ranks"
        if self.module.x_proj.bias is not None:
            return "x_proj has a bias (its per-rank partial sums would add it N times)"
        if hasattr(getattr(self.module, "config", None), "_is_quantized"):
            return "a quantized dt_proj"
        return None

    def run(self, x: torch.Tensor, group, order, kwargs: dict) -> torch.Tensor:
        """``x`` ``[b, S/N, hidden]`` -> the mixer's output for this rank's tokens (``kwargs`` as in
        :meth:`~.gdn.GatedDeltaNetSplit.run`)."""
        m, n, rank = self.module, order.world_size, order.rank
        b, s, _ = x.shape
        dtype = x.dtype
        h, gate = m.in_proj(x).chunk(2, dim=-1)
        send, sizes = pack([per_rank(h.unsqueeze(-1), n), per_rank(gate.unsqueeze(-1), n)], n)
        h, gate = unpack(tokens_to_heads(send, group, order), sizes)
        width = h.size(-1)
        mine = slice(rank * width, (rank + 1) * width)
        bias = None if m.conv1d.bias is None else m.conv1d.bias[mine]
        h = self.conv(h.transpose(1, 2), m.conv1d.weight.squeeze(1)[mine], bias, activation=m.activation, **kwargs)
        h = h.transpose(1, 2)                                                   # [b, S, d_inner / N]
        ssm = _SumOverGroup.apply(h @ m.x_proj.weight[:, mine].t(), group)     # [b, S, dt_rank + 2 d_state]
        step, B, C = torch.split(ssm, [m.time_step_rank, m.ssm_state_size, m.ssm_state_size], dim=-1)
        step, B, C = m.dt_layernorm(step), m.b_layernorm(B), m.c_layernorm(C)
        dt = m.dt_proj.weight[mine] @ step.transpose(1, 2)
        dt_bias = None if m.dt_proj.bias is None else m.dt_proj.bias[mine].float()
        y = self.scan(h.transpose(1, 2), dt, -torch.exp(m.A_log[mine].float()), B.transpose(1, 2),
                      C.transpose(1, 2), D=m.D[mine].float(), z=gate.transpose(1, 2), delta_bias=dt_bias,
                      delta_softplus=True, return_last_state=False, use_mambapy=m.use_mambapy,
                      use_associative_scan=m.use_associative_scan)
        y = heads_to_tokens(y.transpose(1, 2), group, order).reshape(b, s, -1)
        return m.out_proj(y.to(dtype))
