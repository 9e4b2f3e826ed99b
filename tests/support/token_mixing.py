"""A probe that tells whether a transformers causal LM mixes tokens outside its attention layers,
without any rule about module kinds (the rule under test is :mod:`striped_sp.deepspeed.mixers`).

The model's attention is swapped for a per-token function (each query row gets its own value row),
so nothing the attention does can carry one token's input to another token's output.  Then the
input embedding of token 0 is moved: if any later token's logits move, something else in the model
mixes tokens (a scan, a convolution, a linear attention).
"""

from __future__ import annotations

import torch

PER_TOKEN = "striped_sp_probe_per_token"
#: the tiny shape every config is built with (keys a config does not know are kept as attributes)
#: (the layer count stays the config's own: hybrids place their mixers by layer index)
TINY = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
            head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32)
#: tiny configs of the hybrid families with both attention and the family's mixer (the configs'
#: defaults are large, and LFM2's puts attention in every layer)
HYBRID_SHAPES = {
    "qwen3_next": dict(num_hidden_layers=4, full_attention_interval=2, mlp_only_layers=[0, 1, 2, 3], linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
    "qwen3_5_text": dict(num_hidden_layers=4, full_attention_interval=2, linear_num_value_heads=4,
                         linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, mamba_d_state=8, mamba_expand=2),
    "falcon_h1": dict(num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                      mamba_n_groups=1, mamba_chunk_size=8),
    "granitemoehybrid": dict(num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"],
                             mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1,
                             mamba_chunk_size=8),
    "lfm2": dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"]),
}

#: models that stay larger than this at the tiny shape (composite configs with default vision
#: towers) are skipped: their text parts are causal LM entries of their own
MAX_PARAMETERS = 150_000_000


def _per_token_attention(module, query, key, value, attention_mask=None, *args, **kwargs):
    heads, kv_heads = query.shape[1], value.shape[1]
    out = value.repeat_interleave(heads // kv_heads, dim=1) if kv_heads != heads else value
    return out.transpose(1, 2).contiguous(), None


def tiny_causal_lm(model_type: str, **overrides):
    """``(model, None)`` for transformers' causal LM of ``model_type`` at the tiny shape (and
    ``overrides`` of its config), in eval mode, with trained-looking weights, or ``(None, why)``
    when it does not build or is not tiny."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        size = sum(p.numel() for p in meta.parameters())
        if size > MAX_PARAMETERS:
            return None, f"{size / 1e6:.0f}M parameters at the tiny shape"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    except Exception as err:  # noqa: BLE001 - any model that does not build is reported, not judged
        return None, f"does not build: {type(err).__name__}: {str(err)[:120]}"
    with torch.no_grad():  # trained-looking: a mixer initialised to a no-op (zero conv) must show
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model, None


def mixes_tokens_outside_attention(model, seq_len: int = 8) -> bool | None:
    """True when token 0's input moves a later token's logits with per-token attention; ``None``
    when the model does not run (or does not take a per-token attention function)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PER_TOKEN, _per_token_attention)
    try:
        model.set_attn_implementation(PER_TOKEN)
    except Exception:  # noqa: BLE001
        return None
    if getattr(model.config, "_attn_implementation", None) != PER_TOKEN:
        return None
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (1, seq_len), generator=generator)
    with torch.no_grad():
        try:
            embeds = model.get_input_embeddings()(ids)
            moved = embeds.clone()
            moved[:, 0] += 1.0
            base = model(inputs_embeds=embeds, use_cache=False).logits
            other = model(inputs_embeds=moved, use_cache=False).logits
        except Exception:  # noqa: BLE001
            return None
    scale = base.abs().max().clamp_min(1e-12)
    return bool(((other[:, 1:] - base[:, 1:]).abs().max() / scale) > 1e-5)
