"""Gated delta net split by value heads (Qwen3-Next's ``Qwen3NextGatedDeltaNet``, Qwen3.5's
``Qwen3_5GatedDeltaNet``, OLMo hybrid's ``OlmoHybridGatedDeltaNet``; transformers 5.24).

The model's forward (``../shared/mixers-transformers-5.24.md`` section 1), cut where no head mixes:

1. on this rank's tokens: the input projections -> ``q, k`` ``[b, s, nk, dk]``, ``v, z`` ``[b, s, nv, dv]``,
   ``b, a`` ``[b, s, nv]`` (Qwen3-Next: ``in_proj_qkvz`` / ``in_proj_ba`` and its per-key-head ordering;
   Qwen3.5: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; OLMo hybrid: ``q/k/v/g/b/a_proj``,
   ``z`` its ``g_proj`` gate, ``beta`` doubled with ``linear_allow_neg_eigval``, ``o_norm`` / ``o_proj``);
2. one all-to-all: rank ``j`` gets, for every token in natural order, its value heads' ``v, b, a``
   and the key heads they read (``q, k``; a key head shared by two ranks goes to both);
3. there: the depthwise convolution on its ``q | k | v`` rows of ``conv1d`` (``causal_conv1d_fn``),
   ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` with its heads' ``A_log`` and
   ``dt_bias``, and the model's ``chunk_gated_delta_rule`` (fla where installed, transformers' torch
   fallback elsewhere; ``cu_seq_lens_q`` as at SP=1);
4. one all-to-all back, then on this rank's tokens the gated RMSNorm (per head, with the local ``z``)
   and ``out_proj``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...engine.head_split import heads_to_tokens, tokens_to_heads
from .heads import conv_rows, head_groups, kernels_of, pack, per_rank, source_has, unpack

__all__ = ["GatedDeltaNetSplit"]

_KERNELS = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")
_ATTRS = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "conv1d",
          "A_log", "dt_bias", "activation")
#: form -> (its input projections, the marker lines of its forward, its gated norm, its output projection)
_FORMS = {
    "qkvz": (("in_proj_qkvz", "in_proj_ba"), ("fix_query_key_value_ordering(", "self.norm(core_attn_out, z)"),
             "norm", "out_proj"),
    "qkv": (("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), ("self.in_proj_qkv(", "self.norm(core_attn_out, z)"),
            "norm", "out_proj"),
    "separate": (("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj"),
                 ("self.q_proj(hidden_states)", "beta = beta * 2.0", "gate = self.g_proj(hidden_states)",
                  "self.o_norm(output, gate)"), "o_norm", "o_proj"),
}


class GatedDeltaNetSplit:
    """The split form of one gated delta net module (see the module notes)."""

    kind = "gated delta net"

    def __init__(self, module: torch.nn.Module, form: str):
        self.module, self.form = module, form
        self.conv, self.scan = kernels_of(module, *_KERNELS)
        _, _, norm, out = _FORMS[form]
        self.norm, self.out = getattr(module, norm), getattr(module, out)

    @classmethod
    def recognise(cls, module: torch.nn.Module) -> "GatedDeltaNetSplit | None":
        if not all(hasattr(module, a) for a in _ATTRS) or kernels_of(module, *_KERNELS) is None:
            return None
        for form, (projections, markers, norm, out) in _FORMS.items():
            if all(hasattr(module, a) for a in (*projections, norm, out)) and \
                    source_has(module, "torch_chunk_gated_delta_rule(", *markers):
                return cls(module, form)
        return None

    def cannot_split(self, n: int) -> str | None:
        deal = head_groups(n, self.module.num_v_heads, self.module.num_k_heads, "value heads")
        return deal if isinstance(deal, str) else None

    def _project(self, x: torch.Tensor):
        """``q, k`` ``[b, s, nk, dk]``, ``v, z`` ``[b, s, nv, dv]``, ``b, a`` ``[b, s, nv]`` of this rank's tokens."""
        m = self.module
        b, s, _ = x.shape
        if self.form == "qkvz":
            q, k, v, z, beta_in, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x), m.in_proj_ba(x))
            return q, k, v.reshape(b, s, m.num_v_heads, m.head_v_dim), z, beta_in, a
        if self.form == "qkv":
            q, k, v = torch.split(m.in_proj_qkv(x), [m.key_dim, m.key_dim, m.value_dim], dim=-1)
            z, beta_in, a = m.in_proj_z(x), m.in_proj_b(x), m.in_proj_a(x)
        else:
            q, k, v, z, beta_in, a = m.q_proj(x), m.k_proj(x), m.v_proj(x), m.g_proj(x), m.b_proj(x), m.a_proj(x)
        return (q.reshape(b, s, m.num_k_heads, m.head_k_dim), k.reshape(b, s, m.num_k_heads, m.head_k_dim),
                v.reshape(b, s, m.num_v_heads, m.head_v_dim), z.reshape(b, s, -1, m.head_v_dim), beta_in, a)

    def run(self, x: torch.Tensor, group, order, kwargs: dict) -> torch.Tensor:
        """``x`` ``[b, S/N, hidden]`` (this rank's tokens) -> the mixer's output for them; ``kwargs``:
        the module's other keyword arguments, per-token ones already in natural order."""
        m, n, rank = self.module, order.world_size, order.rank
        deal = head_groups(n, m.num_v_heads, m.num_k_heads, "value heads")
        b, s, _ = x.shape
        q, k, v, z, beta_in, a = self._project(x)
        keys = deal.group_index(x.device)
        send, sizes = pack([per_rank(q, n, keys), per_rank(k, n, keys), per_rank(v, n),
                            per_rank(beta_in.unsqueeze(-1), n), per_rank(a.unsqueeze(-1), n)], n)
        q, k, v, beta_in, a = unpack(tokens_to_heads(send, group, order), sizes)
        total = q.size(1)
        heads, kv = deal.heads_of[rank], deal.groups_of[rank]
        rows = conv_rows([(0, m.head_k_dim, kv), (m.key_dim, m.head_k_dim, kv),
                          (2 * m.key_dim, m.head_v_dim, heads)], x.device)
        weight = m.conv1d.weight.squeeze(1).index_select(0, rows)
        bias = None if m.conv1d.bias is None else m.conv1d.bias.index_select(0, rows)
        mixed = self.conv(torch.cat((q, k, v), dim=-1).transpose(1, 2), weight, bias, activation=m.activation,
                          **kwargs).transpose(1, 2)
        q, k, v = torch.split(mixed, [q.size(-1), k.size(-1), v.size(-1)], dim=-1)
        q = q.reshape(b, total, -1, m.head_k_dim)
        k = k.reshape(b, total, -1, m.head_k_dim)
        v = v.reshape(b, total, -1, m.head_v_dim)
        mine = slice(heads[0], heads[-1] + 1)
        beta = beta_in.sigmoid()
        if self.form == "separate" and m.allow_neg_eigval:
            beta = beta * 2.0
        g = -m.A_log[mine].float().exp() * F.softplus(a.float() + m.dt_bias[mine])
        kw = dict(kwargs)
        out, _ = self.scan(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=True, cu_seqlens=kw.pop("cu_seq_lens_q", None), **kw)
        out = heads_to_tokens(out.reshape(b, total, -1), group, order).reshape(b, s, m.num_v_heads, m.head_v_dim)
        out = self.norm(out.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
        return self.out(out.reshape(b, s, -1))
