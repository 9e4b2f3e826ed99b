"""An independent CP=1 core attention for megatron-core models, and the CP=N vs CP=1 comparison.

``ReferenceCoreAttention`` follows Megatron's core-attention contract on one rank, in float64,
with nothing from striped_sp: the scale is ``1/sqrt(head_dim)`` from the query's own shape, the
mask is the given boolean ``attention_mask`` (``True`` = masked) or plain causal, and a layer's
window is ``TransformerConfig.window_size`` unless ``layer_number % window_attn_skip_freq == 0``.
:func:`use_reference_attention` puts it into a built model (the plugin's ``install()`` swaps the
core attention of every spec a ``GPTModel`` is built with, so a spec-level swap would not stick).
"""

import math
import warnings

import torch
import torch.distributed as dist

from reference import rel_err


class ReferenceCoreAttention(torch.nn.Module):
    def __init__(self, window=None):
        super().__init__()
        self.window = window

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:  # one THD row: [t, h, d]; padding belongs to its document
            bounds = packed_seq_params.cu_seqlens_q_padded
            bounds = (packed_seq_params.cu_seqlens_q if bounds is None else bounds).tolist()
            attention_mask = document_mask(bounds, query.size(0))
            out = self.forward(*(t.unsqueeze(1) for t in (query, key, value)), attention_mask)
            return out[:, 0]
        s = query.size(0)
        q, k, v = (t.double().permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        group = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        i = torch.arange(s)
        hidden = (i[None, :] > i[:, None]).expand(q.size(0), 1, s, s)
        if attention_mask is not None:
            hidden = hidden | attention_mask
        if self.window is not None:
            left, right = self.window
            hidden = hidden | (i[None, :] < i[:, None] - left)
        out = (scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v).to(query.dtype)
        out = out.permute(2, 0, 1, 3)  # [s, b, h, d]
        return out.reshape(s, out.size(1), -1)


def use_reference_attention(model, config) -> int:
    """Replace every ``core_attention`` module of ``model`` by a reference; returns the count."""
    count = 0
    for name, module in list(model.named_modules()):
        if hasattr(module, "core_attention"):
            layer = getattr(module.core_attention, "layer_number", None) or getattr(module, "layer_number", 1)
            window = config.window_size
            skip = config.window_attn_skip_freq
            if window is not None and skip is not None and layer % skip == 0:
                window = None
            module.core_attention = ReferenceCoreAttention(window)
            count += 1
    assert count > 0
    return count


def document_mask(bounds, seq_len, batch=1):
    """Megatron's ``--reset-attention-mask`` mask of a row with documents ``bounds``:
    bool ``[batch, 1, s, s]``, ``True`` where a query may not see a key."""
    visible = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for a, b in zip(bounds[:-1], bounds[1:]):
        visible[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    return (~visible).expand(batch, 1, seq_len, seq_len).contiguous()


def compare(model, ref, loss, ref_loss, group, seed, grad_tol=1e-4):
    """``loss`` summed over ``group`` equals ``ref_loss``; every gradient summed over ``group``
    equals the reference's (as Megatron's DDP sums them over DP x CP)."""
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    assert rel_err(total, ref_loss.detach()) < 1e-5, (seed, total.item(), ref_loss.item())
    bad = {}
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        err = rel_err(g, p_ref.grad)
        if not err < grad_tol:
            bad[name] = err
    assert not bad, f"seed={seed}: gradient errors above {grad_tol}: {bad}"


_GROUPS = {}


def setup_groups():
    """Megatron's parallel_state with CP = world size (4), ``install('striped')``, and this rank's
    CP groups by size: 1 (a group per rank), 2 (non-adjacent pairs [0, 2], [1, 3]) and 4."""
    if _GROUPS:
        return _GROUPS
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    import striped_sp.megatron as sm
    from striped_sp.megatron.toy import single_rank_group

    try:  # Megatron's hierarchical CP groups (Ulysses 2 x ring 2) as well, for --cp-comm-type a2a+p2p
        import einops  # noqa: F401  (Megatron builds them with it)
        hierarchical = [2, dist.get_world_size() // 2] if dist.get_world_size() == 4 else None
    except ImportError:
        hierarchical = None
    parallel_state.initialize_model_parallel(context_parallel_size=dist.get_world_size(),
                                             hierarchical_context_parallel_sizes=hierarchical)
    sm.install("striped")
    _GROUPS[1] = single_rank_group()
    _GROUPS[2] = [dist.new_group([0, 2]), dist.new_group([1, 3])][dist.get_rank() % 2]
    _GROUPS[4] = parallel_state.get_context_parallel_group()
    return _GROUPS
