"""``bench train``, the Megatron side: a megatron-core ``GPTModel`` built by the plugin's own route.

Every layout gets its own model, built from the same seed (``use_cpu_initialization``: the same
weights whatever the layout and the device), with :func:`striped_sp.megatron.patch_layer_spec` on
megatron-core's local layer spec (GQA, RoPE) and :func:`striped_sp.megatron.install` switched to the
layout before each of its steps (Megatron's RoPE follows the installed algo).  Batches are sliced
with :func:`striped_sp.megatron.get_batch_on_this_cp_rank` (dense rows) or
:func:`~striped_sp.megatron.get_thd_batch_on_this_cp_rank` (packed THD rows, zigzag padded per
document as Transformer Engine needs), the optimizer is torch AdamW (Megatron's is CUDA-only) over
one flat gradient buffer all-reduced over the CP group once per step (what Megatron's DDP does with
a single bucket).  ``native`` (Megatron's own CP through Transformer Engine) runs only where
Transformer Engine imports, on dense rows.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist

from .train_data import Runner, RunnerSkip, TrainRow

__all__ = ["setup", "build_runner", "resolve_auto"]


def setup(cfg, device: torch.device) -> None:
    """Megatron's parallel state: CP over the whole world (once per process)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(context_parallel_size=cfg.world_size)
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)


def resolve_auto(cfg, row: TrainRow) -> str:
    """The layout key of ``--striped-stripe-size auto`` for this row and model
    (:func:`striped_sp.megatron.algo_of`: the per-batch search on packed rows, stripes of W/8 (packed)
    or W/4 (one document) for a window model, else token by token)."""
    import argparse

    import striped_sp.megatron as sm

    args = argparse.Namespace(
        context_parallel_algo="striped", striped_stripe_size="auto", striped_doc_placement="split",
        sft=row.kind == "packed", window_size=(row.window, 0) if row.window else None,
        window_attn_skip_freq=None, num_layers=cfg.layers, context_parallel_size=cfg.world_size,
        seq_length=row.seq_len)
    return sm.layout_of(sm.algo_of(args))


def _algo(layout: str) -> str:
    """The ``--context-parallel-algo`` value of a layout key (contiguous is Megatron's ``ring``)."""
    return "ring" if layout == "contiguous" else layout


def _model(cfg, row: TrainRow, algo: str, device, dtype):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    import striped_sp.megatron as sm

    config = TransformerConfig(
        num_layers=cfg.layers, hidden_size=cfg.hidden, ffn_hidden_size=cfg.ffn_hidden,
        num_attention_heads=cfg.heads, num_query_groups=cfg.kv_heads, kv_channels=cfg.head_dim,
        context_parallel_size=cfg.world_size, attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, window_size=(row.window, 0) if row.window else None,
        init_method_std=cfg.init_std)
    if algo == "native":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        sm.uninstall()  # Megatron's own RoPE, slicing and spec
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        sm.install(algo)
        spec = sm.patch_layer_spec(get_gpt_layer_local_spec(), algo)
    torch.manual_seed(cfg.seed)
    model = GPTModel(config, spec, vocab_size=cfg.vocab, max_sequence_length=row.seq_len,
                     position_embedding_type="rope")
    return model.to(device)


def _dense_batch(tokens: torch.Tensor) -> dict:
    """Megatron's batch of dense rows: labels shifted on the full sequence, the last token masked."""
    labels = torch.zeros_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    loss_mask[:, -1] = 0.0
    pos = torch.arange(tokens.size(1)).expand_as(tokens).contiguous()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": pos}


def _packed_batch(tokens: torch.Tensor, bounds: list[int]) -> dict:
    """One packed row: labels shifted inside each document, its last token masked, positions
    restarting per document."""
    b = _dense_batch(tokens)
    for end in bounds[1:]:
        b["loss_mask"][0, end - 1] = 0.0
    b["position_ids"] = torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])])[None]
    return b


def _local_batch(batch: dict, bounds, algo: str, layout: str, group, device):
    """This rank's part of the round's batch and its ``packed_seq_params`` (``None`` for dense rows)."""
    import striped_sp
    import striped_sp.megatron as sm

    if bounds is None:
        local = sm.get_batch_on_this_cp_rank(batch, algo, cp_group=group)
        return {k: v.to(device) for k, v in local.items()}, None
    pad = striped_sp.pad_documents(torch.tensor(bounds), group.size(), layout)
    padded = {k: pad.pad(v, dim=1) for k, v in batch.items()}
    real = torch.tensor(bounds, dtype=torch.int32)
    cu_pad = pad.cu_seqlens[:len(bounds)].to(torch.int32)
    max_len = torch.tensor([int((pad.cu_seqlens[1:] - pad.cu_seqlens[:-1]).max())])
    local, params = sm.get_thd_batch_on_this_cp_rank(padded, real, cu_pad, max_len, algo=algo, cp_group=group)
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        val = getattr(params, name, None)
        if isinstance(val, torch.Tensor):
            setattr(params, name, val.to(device))
    return {k: v.to(device) for k, v in local.items()}, params


class MegatronRunner(Runner):
    """One layout's GPTModel, AdamW and prepared batches."""

    def __init__(self, cfg, row: TrainRow, name: str, layout: str | None, group, device, dtype):
        import striped_sp.megatron as sm

        super().__init__(name, layout)
        self.algo = "native" if layout is None else _algo(layout)
        self.group, self.device = group, device
        self.model = _model(cfg, row, self.algo, device, dtype)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        offset = 0
        for p in params:  # every gradient a view of one buffer: one all-reduce per step
            p.grad = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
        self.param_bytes = sum(p.numel() * p.element_size() for p in params)
        self.batches = []
        for tokens, bounds in row.rounds:
            full = _dense_batch(tokens) if bounds is None else _packed_batch(tokens, bounds)
            total = float(full["loss_mask"].sum())
            local, params = _local_batch(full, bounds, self.algo, layout or "zigzag", group, device)
            self.batches.append((local, params, total))
        if self.algo != "native":
            sm.install(self.algo)

    def activate(self) -> None:
        import striped_sp.megatron as sm

        sm.install(self.algo)  # "native" uninstalls

    def step(self, i: int) -> torch.Tensor:
        local, params, total = self.batches[i]
        self.opt.zero_grad(set_to_none=False)
        losses = self.model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                            packed_seq_params=params)
        loss = (losses.float() * local["loss_mask"]).sum() / total
        loss.backward()
        dist.all_reduce(self.flat, group=self.group)  # DP x CP (here CP): the summed gradient
        self.opt.step()
        return loss.detach()


def build_runner(cfg, row: TrainRow, name: str, layout: str | None, group, device, dtype) -> Runner:
    """The runner of ``name`` (a layout column, or the peer ``native``) for ``row``;
    :class:`RunnerSkip` says why one cannot run here."""
    if layout is None:  # Megatron's native CP
        if name != "native":
            raise RunnerSkip(f"no peer {name!r} on the Megatron path (native only)")
        if importlib.util.find_spec("transformer_engine") is None:
            raise RunnerSkip("needs Transformer Engine (Megatron's native CP runs through it): not installed")
        if device.type != "cuda":
            raise RunnerSkip("Transformer Engine runs on CUDA only")
        if row.kind != "dense":
            raise RunnerSkip("run on dense rows only here")
    return MegatronRunner(cfg, row, name, layout, group, device, dtype)
