"""The peers measured beside our layouts in ``bench run``.

Each peer is a factory ``make(group, cfg, q, k, v) -> (fn, layout)`` where ``fn(q, k, v)`` is a
differentiable causal attention over the CP group on core-format local tensors
``[batch, s_local, heads, head_dim]`` sharded in ``layout`` (one of ours, so the bench can check the
peer's output against ``ring_attention`` on the same inputs).  A factory raises :class:`PeerSkip`
with the reason when the peer cannot run here; the bench prints the reason in its table.

* ``torch_ring``: PyTorch's own ring context parallelism, its private
  ``_templated_ring_attention`` (+ ``_backward``) from
  ``torch.distributed.tensor.experimental._context_parallel._attention``, with its head-tail load
  balancing (our ``zigzag`` layout) and its default KV rotation (all-gather).  Private API: pinned to
  the torch versions in :data:`TORCH_RING_TESTED`.
* ``ulysses``: DeepSpeed-Ulysses ``deepspeed.sequence.layer.DistributedAttention``: all-to-all from
  sequence shards to head shards, local causal attention over the whole sequence, all-to-all back.
  DeepSpeed gathers shards in rank order, so its layout is ``contiguous``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["PEERS", "PeerSkip", "TORCH_RING_TESTED"]

#: torch versions whose private ring attention signatures this module was written against
TORCH_RING_TESTED = ("2.13",)


class PeerSkip(Exception):
    """The peer cannot run here; the message says why."""


# --------------------------------------------------------------------------------------------
# PyTorch ring context parallel
# --------------------------------------------------------------------------------------------

def _torch_ring_ops(device: torch.device, dtype: torch.dtype):
    aten = torch.ops.aten
    if device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu, \
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default, False
    if dtype in (torch.float16, torch.bfloat16):
        return aten._scaled_dot_product_flash_attention, \
            aten._scaled_dot_product_flash_attention_backward.default, True
    raise PeerSkip(f"torch_ring: no fused op wired here for {device.type} {dtype}")


class _TorchRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, mod, fwd_op, bwd_op, cuda_flash):
        # torch's ops take [b, h, s, d]; seq_dim = 2
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        res = mod._templated_ring_attention(
            group, 2, fwd_op, qt, kt, vt, is_causal=True, dropout_p=0.0, scale=scale,
            **({"return_debug_mask": False} if cuda_flash else {}),
        )
        out, lse, rest = res[0], res[1], res[2:]
        ctx.save_for_backward(qt, kt, vt, out, lse)
        ctx.rest, ctx.group, ctx.scale, ctx.mod, ctx.bwd_op, ctx.cuda_flash = rest, group, scale, mod, bwd_op, cuda_flash
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, dout):
        qt, kt, vt, out, lse = ctx.saved_tensors
        extra = {}
        if ctx.cuda_flash:
            cq, ck, mq, mk, seed, off = ctx.rest[:6]
            extra = dict(cum_seq_q=cq, cum_seq_k=ck, max_q=mq, max_k=mk, philox_seed=seed, philox_offset=off)
        dq, dk, dv, *_ = ctx.mod._templated_ring_attention_backward(
            ctx.group, 2, ctx.bwd_op, dout.transpose(1, 2), "grad_out", qt, kt, vt, out, lse,
            is_causal=True, dropout_p=0.0, scale=ctx.scale, **extra,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None, None, None, None, None


def make_torch_ring(group, cfg, q, k, v):
    ver = torch.__version__.split("+")[0]
    if not any(ver.startswith(t) for t in TORCH_RING_TESTED) and not cfg.get("force_peers"):
        raise PeerSkip(f"torch_ring: private API pinned to torch {TORCH_RING_TESTED}, found {ver}")
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as mod
        mod._templated_ring_attention, mod._templated_ring_attention_backward, mod._cp_options  # noqa: B018
    except (ImportError, AttributeError) as e:
        raise PeerSkip(f"torch_ring: private ring attention not found in torch {ver}: {e}") from None
    if not mod._cp_options.enable_load_balance:
        raise PeerSkip("torch_ring: _cp_options.enable_load_balance is off (head-tail layout expected)")
    fwd_op, bwd_op, cuda_flash = _torch_ring_ops(q.device, q.dtype)
    heads = q.size(2)
    scale = q.size(-1) ** -0.5

    def fn(q, k, v):
        if k.size(2) != heads:  # the CUDA flash op needs equal head counts
            k, v = (t.repeat_interleave(heads // t.size(2), dim=2) for t in (k, v))
        return _TorchRing.apply(q, k, v, group, scale, mod, fwd_op, bwd_op, cuda_flash)

    return fn, "zigzag"


# --------------------------------------------------------------------------------------------
# DeepSpeed-Ulysses
# --------------------------------------------------------------------------------------------

def _local_causal(q, k, v, *args, **kwargs):
    """[b, S, h/N, d] -> the same: causal SDPA over the whole sequence (fused kernel)."""
    gqa = k.size(2) != q.size(2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=gqa
    )
    return out.transpose(1, 2)


def make_ulysses(group, cfg, q, k, v):
    n = dist.get_world_size(group)
    kvh = k.size(2)
    if q.size(2) % n or kvh % n:
        raise PeerSkip(f"ulysses: heads {q.size(2)} and kv heads {kvh} must both divide by N={n}")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if q.device.type == "cuda" else "cpu")
    try:
        import deepspeed.comm as ds_comm
        from deepspeed.sequence.layer import DistributedAttention
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        raise PeerSkip(f"ulysses: deepspeed not importable ({type(e).__name__}: {e})") from None
    try:
        if not ds_comm.is_initialized():
            from ..deepspeed.env import skip_cpu_shm_comm_build

            skip_cpu_shm_comm_build()  # its CPU shm op serves inference all-reduce, not all-to-all
            # torch.distributed is already up: DeepSpeed wraps the existing default group
            ds_comm.init_distributed(dist_backend=dist.get_backend(group), auto_mpi_discovery=False,
                                     verbose=False)
    except Exception as e:  # noqa: BLE001
        raise PeerSkip(f"ulysses: deepspeed.comm init failed ({type(e).__name__}: {e})") from None
    attn = DistributedAttention(_local_causal, group, scatter_idx=2, gather_idx=1)

    def fn(q, k, v):
        return attn(q, k, v, 0)

    return fn, "contiguous"


PEERS = {"torch_ring": make_torch_ring, "ulysses": make_ulysses}
