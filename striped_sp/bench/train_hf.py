"""``bench train``, the Hugging Face side: a Llama (a Mistral for the window row) through DeepSpeed.

``--hf-model lfm2`` trains a hybrid instead: transformers' LFM2 of the same width, its layers
alternating a short convolution (``conv``, first) and attention (``full_attention``), the same MLP
width (SwiGLU, no automatic adjustment); its convolutions run on the whole sequence gathered into
natural order (:mod:`striped_sp.deepspeed.hybrid`).  Dense rows only (packed rows with a hybrid are
refused, LFM2 has no sliding window), and no ``ulysses`` peer (refused by name, see
:func:`build_runner`).

The model is built from a config (random init from the run's seed, nothing downloaded:
``HF_HUB_OFFLINE=1``), the engine by :func:`striped_sp.deepspeed.initialize` with the layout in the
``context_parallel`` section, the batches sharded by :func:`striped_sp.deepspeed.shard_batch` (labels
shifted on the full row, packed rows' documents found from their ``position_ids``).  The HF attention's
layout is process-wide (:func:`striped_sp.deepspeed.enable_hf_attention`), so each runner switches it
to its own before its steps.

The peer ``ulysses`` is DeepSpeed's own ALST/Ulysses for Hugging Face models
(``UlyssesSPAttentionHF.register_with_transformers``, which takes over the ``"sdpa"`` attention
entry process-wide: registered once per process) on contiguous shards of the same rows, plain
``deepspeed.initialize`` with its ``mpu``.  It attends causally over the whole gathered row, so it
runs on dense rows only (it knows no packed documents and no sliding window).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..plan.layouts import ALGOS
from .train_data import Runner, RunnerSkip, TrainRow

__all__ = ["setup", "build_runner", "HF_MODELS", "hf_model_check"]

#: ``--hf-model`` choices: the plain model (Llama; Mistral for the window row) and one hybrid
HF_MODELS = ("llama", "lfm2", "qwen3_next")

_ALST: dict = {}  # the ALST mpu of this process (DeepSpeed allows one registration)


def setup(cfg, device) -> None:
    """Once per process, before any engine: DeepSpeed's logging, and the ALST registration when the
    ``ulysses`` peer will run (it builds DeepSpeed's sequence-parallel groups itself, which the
    engines of our layouts then reuse)."""
    import types

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils import logger

    logger.setLevel("WARNING")
    import deepspeed
    import torch.distributed as tdist

    import striped_sp.deepspeed as ssd

    ssd.skip_cpu_shm_comm_build()  # its CPU op serves inference all-reduce only
    deepspeed.init_distributed(dist_backend=tdist.get_backend(), auto_mpi_discovery=False, verbose=False)
    if "ulysses" in cfg.peers and "dense" in cfg.kinds and _alst_skip(cfg) is None and _hybrid(cfg) is None:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers import LlamaConfig

        shape = LlamaConfig(**_arch(cfg, max(cfg.seq_lens)))  # the registration reads the config only
        _ALST["mpu"] = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=types.SimpleNamespace(config=shape), core_attn_implementation="sdpa",
            sequence_parallel_size=cfg.world_size, micro_batch_size=1, seq_length_is_variable=True)


def _hybrid(cfg) -> str | None:
    """The hybrid ``--hf-model`` (``None``: the plain model)."""
    name = getattr(cfg, "hf_model", "llama")
    return None if name == "llama" else name


def hf_model_check(cfg) -> None:
    """Refuse, by name, what ``--hf-model`` cannot run."""
    name = getattr(cfg, "hf_model", "llama")
    if name not in HF_MODELS:
        raise ValueError(f"--hf-model {name!r}: expected one of {', '.join(HF_MODELS)}")
    if name != "llama" and "hf" in cfg.models:
        other = [k for k in cfg.kinds if k != "dense"]
        if other:
            raise ValueError(f"--hf-model {name} runs dense rows only (got --rows {','.join(cfg.kinds)}): packed rows "
                             "with a hybrid are refused (a mixer would scan across documents) and the hybrid has no "
                             "sliding window; pass --rows dense")


def _alst_skip(cfg) -> str | None:
    """Why the ``ulysses`` peer cannot run with this model, or ``None``."""
    if cfg.world_size < 2:
        return "needs N >= 2 (DeepSpeed registers no sequence parallelism for one rank)"
    if cfg.heads % cfg.world_size or cfg.kv_heads % cfg.world_size:
        return f"heads {cfg.heads} / kv heads {cfg.kv_heads} must divide by N={cfg.world_size}"
    try:
        import deepspeed.runtime.sequence_parallel.ulysses_sp  # noqa: F401
    except ImportError as e:
        return f"DeepSpeed's ALST is not importable ({e})"
    return None


def _arch(cfg, seq_len: int) -> dict:
    return dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn_hidden,
                num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                head_dim=cfg.head_dim, max_position_embeddings=seq_len, attention_dropout=0.0,
                tie_word_embeddings=False, use_cache=False, initializer_range=cfg.init_std)


def _hf_model(cfg, row: TrainRow, dtype, attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    common = _arch(cfg, row.seq_len)
    torch.manual_seed(cfg.seed)
    if _hybrid(cfg) == "lfm2":
        from transformers import Lfm2Config, Lfm2ForCausalLM

        if cfg.hidden != cfg.heads * cfg.head_dim:
            raise ValueError(f"--hf-model lfm2: head_dim is hidden / heads ({cfg.hidden} / {cfg.heads}), "
                             f"not {cfg.head_dim}")
        kinds = ["conv" if i % 2 == 0 else "full_attention" for i in range(cfg.layers)]
        model = Lfm2ForCausalLM(Lfm2Config(
            vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn_hidden,
            block_auto_adjust_ff_dim=False, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.kv_heads, max_position_embeddings=row.seq_len, layer_types=kinds,
            tie_word_embeddings=False, use_cache=False, initializer_range=cfg.init_std))
    elif _hybrid(cfg) == "qwen3_next":  # 3 gated delta net layers per attention layer, dense MLPs
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(cfg.layers)]
        model = Qwen3NextForCausalLM(Qwen3NextConfig(
            **common, layer_types=kinds, mlp_only_layers=list(range(cfg.layers)), linear_num_value_heads=cfg.heads,
            linear_num_key_heads=cfg.kv_heads, linear_key_head_dim=cfg.head_dim, linear_value_head_dim=cfg.head_dim))
    elif row.window:  # Mistral: a query sees itself and sliding_window - 1 keys before it
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=row.window + 1))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.config.use_cache = False
    model.set_attn_implementation(attn)
    return model.to(dtype)


def _ds_config(cfg, dtype, extra: dict) -> dict:
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**9, "wall_clock_breakdown": False,
              "sequence_parallel_size": cfg.world_size, **extra}
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    return config


def _full_batch(tokens: torch.Tensor, bounds) -> dict:
    batch = {"input_ids": tokens, "labels": tokens.clone()}
    if bounds is None:
        batch["position_ids"] = torch.arange(tokens.size(1)).expand_as(tokens).contiguous()
    else:  # position_ids restart at 0 per document: shard_batch reads the documents from them
        batch["position_ids"] = torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])])[None]
    return batch


def _on(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class HFRunner(Runner):
    """One layout: a DeepSpeed engine of the model, ``context_parallel`` set to the layout."""

    loss_is_global = True  # striped_sp's loss hook makes the loss the group-wide value

    def __init__(self, cfg, row: TrainRow, name: str, layout: str, group, device, dtype):
        import striped_sp
        import striped_sp.deepspeed as ssd

        super().__init__(name, layout)
        lay = striped_sp.get_layout(layout)
        section = {"algo": {name: algo for algo, name in ALGOS.items()}[lay.name]}  # the section's algo name
        if lay.key != lay.name:  # a layout's parameters (stripe size, placement) are keys of the section
            section.update(stripe_size=lay.stripe_size, doc_placement=lay.doc_placement)
            if getattr(lay, "order", "round") == "mirror":  # zigzag's order as stripes (issue 57)
                section["order"] = "mirror"
        model = _hf_model(cfg, row, dtype, "sdpa")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        self.engine, _, _, _ = ssd.initialize(model=model, optimizer=opt,
                                              config=_ds_config(cfg, dtype, {"context_parallel": section}))
        self.group = self.engine.context_parallel_group
        self.settings = self.engine.context_parallel
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        n, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.batches = [_on(ssd.shard_batch(_full_batch(t, b), n, r, self.settings.layout), device)
                        for t, b in row.rounds]

    def activate(self) -> None:
        import striped_sp.deepspeed as ssd

        ssd.enable_hf_attention(self.engine.module, self.group, self.settings.layout, self.settings.backend)

    def step(self, i: int) -> torch.Tensor:
        loss = self.engine(**self.batches[i]).loss
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()


class ALSTRunner(Runner):
    """DeepSpeed's ALST/Ulysses (module docstring)."""

    loss_is_global = False

    def __init__(self, cfg, row: TrainRow, name: str, device, dtype):
        import deepspeed

        import striped_sp.deepspeed as ssd

        super().__init__(name, "contiguous")
        model = _hf_model(cfg, row, dtype, "sdpa")
        mpu = _ALST["mpu"]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=_ds_config(cfg, dtype, {}),
                                                    mpu=mpu)
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        group = mpu.get_sequence_parallel_group()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.batches = []
        for t, b in row.rounds:
            local = ssd.shard_batch(_full_batch(t, b), n, r, "contiguous")
            self.batches.append(_on({"input_ids": local["input_ids"], "position_ids": local["position_ids"],
                                     "labels": local["shift_labels"], "shift_labels": local["shift_labels"],
                                     "num_items_in_batch": local["num_items_in_batch"]}, device))

    def step(self, i: int) -> torch.Tensor:
        loss = self.engine(**self.batches[i]).loss  # this rank's share: its summed loss / the global count
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()


def build_runner(cfg, row: TrainRow, name: str, layout: str | None, group, device, dtype) -> Runner:
    """The runner of ``name`` (a layout column or the peer ``ulysses``) for ``row``."""
    if layout is not None:
        return HFRunner(cfg, row, name, layout, group, device, dtype)
    if name != "ulysses":
        raise RunnerSkip(f"no peer {name!r} on the Hugging Face path (ulysses only)")
    if _hybrid(cfg) is not None:
        raise RunnerSkip(f"no Ulysses peer for the hybrid {_hybrid(cfg)}: DeepSpeed's Ulysses would run its "
                         "non-attention mixers (short convolutions) on each rank's local tokens (wrong gradients)")
    if row.kind != "dense":
        raise RunnerSkip("DeepSpeed's ALST attends causally over the whole row: no packed documents, no window")
    why = _alst_skip(cfg)
    if why is not None:
        raise RunnerSkip(why)
    return ALSTRunner(cfg, row, name, device, dtype)
