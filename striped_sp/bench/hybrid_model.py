"""``striped-sp bench hybrid-split --model``: a whole tiny mixer-heavy hybrid, SP=1 against SP=N.

Per mixer kind, transformers' own causal LM at width ``C`` with four decoder layers, three of the
kind's mixer and then one attention layer (4 query / 2 kv heads x ``C / 4``, MLP ``4 C``, dense;
vocab 2048; weights moved off their initialisation by ``0.02 x N(0, 1)``, seeded):

* ``gated_delta``: Qwen3-Next (4 value / 2 key heads x ``C / 4``);
* ``mamba2``: Bamba (``2 C / 64`` heads x 64, one B / C group, state 64, chunks of 256);
* ``mamba``: Jamba (``d_inner = 2 C``, state 16; one expert: dense MLPs);
* ``short_conv``: LFM2.

One row of ``S`` tokens (random ids, labels the ids), forward + backward of the loss (no optimizer),
three ways on ``N`` spawned gloo ranks, one compute thread each:

* ``sp1``: the plain model (a copy taken before the plugin touches it, transformers' SDPA) on the
  whole row in one process (rank 0; the others wait at a barrier);
* ``split``: the model enabled (:func:`striped_sp.deepspeed.enable_hf_attention`, layout striped) on
  this rank's shard (:func:`striped_sp.deepspeed.shard_batch`): its mixers split over the group;
* ``gathered``: the same with ``$STRIPED_SP_SPLIT_MIXERS=0`` (every mixer on the gathered row).

Figures (:func:`~striped_sp.bench.split_runs.timed_steps`): the busiest rank's process CPU time
(median over ``--reps`` after a warm-up), the slowest rank's wall time and the largest rank's peak
of tensor memory above the step's start (one more step; parameter gradients are allocated inside
it, as in the first step of training). Exactness: the loss summed over the group against SP=1's,
and every parameter's gradient summed over the group (as DeepSpeed reduces it) against SP=1's.
"""

from __future__ import annotations

import copy
import os

import torch

from .common import init_rank

__all__ = ["MODEL_KINDS", "model_of", "measure_models"]

MODEL_KINDS = ("gated_delta", "mamba2", "mamba", "short_conv")
MODEL_MODES = ("sp1", "split", "gathered")
VOCAB = 2048


def model_of(kind: str, hidden: int, seq_len: int) -> torch.nn.Module:
    """The tiny hybrid causal LM of ``kind`` (module notes), float32, train mode, seeded by the caller."""
    heads, kv_heads = 4, 2
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=4,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
                  tie_word_embeddings=False, use_cache=False)
    if kind == "gated_delta":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        model = Qwen3NextForCausalLM(Qwen3NextConfig(
            **common, head_dim=hidden // heads, layer_types=["linear_attention"] * 3 + ["full_attention"],
            mlp_only_layers=[0, 1, 2, 3], linear_num_value_heads=heads, linear_num_key_heads=kv_heads,
            linear_key_head_dim=hidden // heads, linear_value_head_dim=hidden // heads))
    elif kind == "mamba2":
        from transformers import BambaConfig, BambaForCausalLM

        model = BambaForCausalLM(BambaConfig(
            **common, attn_layer_indices=[3], mamba_n_heads=hidden * 2 // 64, mamba_d_head=64, mamba_d_state=64,
            mamba_n_groups=1, mamba_chunk_size=256, mamba_expand=2))
    elif kind == "mamba":
        from transformers import JambaConfig, JambaForCausalLM

        model = JambaForCausalLM(JambaConfig(
            **common, attn_layer_period=4, attn_layer_offset=3, num_experts=1, expert_layer_period=4,
            expert_layer_offset=3, mamba_d_state=16, mamba_expand=2))
    elif kind == "short_conv":
        from transformers import Lfm2Config, Lfm2ForCausalLM

        model = Lfm2ForCausalLM(Lfm2Config(**common, block_auto_adjust_ff_dim=False,
                                           layer_types=["conv"] * 3 + ["full_attention"]))
    else:
        raise ValueError(f"model kind {kind!r}: expected one of {', '.join(MODEL_KINDS)}")
    with torch.no_grad():  # off the initialisation (a decay at its init has ~1e-7 gradients)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.config.use_cache = False
    model.set_attn_implementation("sdpa")
    return model.float().train()


def _grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank, cfg, n: int, device_type: str, init_file, results):
    results.put(("ok", rank, _worker_body(rank, cfg, n, init_file)))


def _worker_body(rank, cfg, n: int, init_file) -> list[dict]:
    import torch.distributed as dist

    from ..deepspeed import enable_hf_attention, shard_batch
    from ..deepspeed.hybrid import SPLIT_ENV, mixer_summary
    from .split_runs import timed_steps

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    init_rank(rank, n, "cpu", init_file, cfg.timeout_s, threads=1)
    group = dist.group.WORLD
    records = []
    for kind in cfg.kinds:
        for seq in cfg.seq_lens:
            torch.manual_seed(cfg.seed)
            model = model_of(kind, cfg.hidden, seq)
            plain = copy.deepcopy(model)  # SP=1: before anything of ours touches the model
            enable_hf_attention(model, group, "striped")
            ids = torch.randint(3, VOCAB, (1, seq), generator=torch.Generator().manual_seed(cfg.seed))
            full = {"input_ids": ids, "labels": ids.clone()}
            mine = shard_batch(full, n, rank, "striped")
            rec = {"kind": kind, "world_size": n, "seq_len": seq, "hidden": cfg.hidden, "reps": cfg.reps,
                   "mixers": mixer_summary(model, n, seq)}
            losses = {}
            for mode in cfg.model_modes:
                net, batch = (plain, full) if mode == "sp1" else (model, mine)
                box = {}

                def step(net=net, batch=batch, box=box):
                    net.zero_grad(set_to_none=True)
                    loss = net(**batch, use_cache=False).loss
                    loss.backward()
                    box["loss"] = loss.detach()

                os.environ[SPLIT_ENV] = "0" if mode == "gathered" else "1"
                try:
                    stats, _ = timed_steps(step, cfg.reps, mode != "sp1" or rank == 0, True)
                finally:
                    os.environ.pop(SPLIT_ENV, None)
                rec.update({f"{mode}_{k}": v for k, v in stats.items()})
                loss = box.get("loss", torch.zeros(()))
                if mode == "sp1":
                    dist.broadcast(loss, 0)  # rank 0 ran it
                else:
                    dist.all_reduce(loss)  # each rank's loss is its share of the row's mean
                losses[mode] = loss.item()
                if mode == "split":  # its gradients (the last step's) against SP=1's, summed as DeepSpeed does
                    worst, which = 0.0, None
                    ref = _grads(plain)
                    for name, g in _grads(model).items():
                        g = g.clone()
                        dist.all_reduce(g)
                        if rank == 0:
                            err = ((g - ref[name]).norm() / ref[name].norm().clamp_min(1e-30)).item()
                            if which is None or err > worst:
                                worst, which = err, name
                    rec["split_grad_rel_diff"], rec["split_grad_worst"] = worst, which
            for mode in [m for m in cfg.model_modes if m != "sp1"]:
                rec[f"{mode}_loss_rel_diff"] = abs(losses[mode] - losses["sp1"]) / abs(losses["sp1"])
                rec[f"{mode}_cpu_over_sp1"] = rec[f"{mode}_cpu_ms"] / rec["sp1_cpu_ms"]
                rec[f"{mode}_peak_over_sp1"] = rec[f"{mode}_peak_mib"] / rec["sp1_peak_mib"]
            rec["sp1_loss"] = losses["sp1"]
            records.append(rec)
            del model, plain
    dist.barrier()
    dist.destroy_process_group()
    return records


def measure_models(cfg) -> list[dict]:
    """One record per (kind, N, S) (module notes); ``cfg``: a
    :class:`~striped_sp.bench.hybrid_split.HybridSplitConfig`."""
    from .split_runs import spawn_all

    if cfg.model_modes[0] != "sp1" or not set(cfg.model_modes) <= set(MODEL_MODES):
        raise ValueError(f"--model-modes {','.join(cfg.model_modes)}: sp1 and any of split, gathered")
    return spawn_all(cfg, MODEL_KINDS, _worker, "bench hybrid-split --model")


COLUMNS = [("kind", "model"), ("world_size", "N"), ("seq_len", "S"), ("sp1_cpu_ms", "SP=1 cpu ms"),
           ("split_cpu_ms", "split cpu ms"), ("gathered_cpu_ms", "gathered cpu ms"),
           ("split_cpu_over_sp1", "split / SP=1 cpu"), ("gathered_cpu_over_sp1", "gathered / SP=1 cpu"),
           ("sp1_peak_mib", "SP=1 peak MiB"), ("split_peak_mib", "split peak MiB"),
           ("gathered_peak_mib", "gathered peak MiB"), ("split_peak_over_sp1", "split / SP=1 peak"),
           ("split_loss_rel_diff", "split loss rel"), ("split_grad_rel_diff", "split grad rel")]
