"""Bad input raises ValueError naming the value and the rule, on every rank, before any message."""

import pytest
import torch
import torch.distributed as dist

import striped_sp
from dist_helper import run_cases


def _qkv(b=1, s=4, h=4, kvh=2, d=8, dtype=torch.float32):
    return (torch.randn(b, s, h, d, dtype=dtype), torch.randn(b, s, kvh, d, dtype=dtype),
            torch.randn(b, s, kvh, d, dtype=dtype))


def _bad(kind):
    q, k, v = _qkv()
    if kind == "zigzag-odd":
        q, k, v = _qkv(s=5)
        return (q, k, v), {"layout": "zigzag"}, "local sequence length 5 must be a positive multiple of 2"
    if kind == "heads":
        q, k, v = _qkv(h=6, kvh=4)
        return (q, k, v), {}, r"q heads \(6\) must be a multiple of k/v heads \(4\)"
    if kind == "dtype":
        return (q, k.double(), v), {}, "dtypes must match"
    if kind == "device":
        return (q, k.to("meta"), v), {}, "must be on one device"
    if kind == "batch":
        q2, _, _ = _qkv(b=2)
        return (q2, k, v), {}, "batch sizes differ: q has 2"
    if kind == "head_dim":
        q2, _, _ = _qkv(d=16)
        return (q2, k, v), {}, "head_dim differs: q has 16"
    if kind == "kv-shapes":
        return (q, k, v[:, :, :1]), {}, "k and v (shapes )?must match"
    if kind == "seq":
        return (q, k[:, :3], v[:, :3]), {}, "local sequence lengths differ: q has 4"
    if kind == "ndim":
        return (q[0], k, v), {}, "expected 4 dims"
    if kind == "layout":
        return (q, k, v), {"layout": "spiral"}, "unknown layout 'spiral'"
    if kind == "backend":
        return (q, k, v), {"backend": "cutlass"}, "unknown backend 'cutlass'"
    if kind == "backend-device":
        return (q, k, v), {"backend": "torch_cudnn"}, "backend 'torch_cudnn' is not available: .*CUDA"
    if kind == "backend-dtype":
        q, k, v = (t.to(torch.int32) for t in (q, k, v))
        return (q, k, v), {"backend": "torch"}, "backend 'torch' is not available: dtype torch.int32"
    if kind == "flash-missing":
        return (q, k, v), {"backend": "flash_attn"}, r"pip install 'striped_sp\[flash\]'|CUDA devices only"
    if kind == "scale":
        return (q, k, v), {"softmax_scale": -1.0}, "softmax_scale=-1.0 must be positive"
    # packed documents and windows (2 ranks x 4 local tokens: a global row of 8)
    if kind == "cu-2d":
        return (q, k, v), {"cu_seqlens": torch.tensor([[0, 8]])}, r"cu_seqlens has shape \(1, 2\): it must be 1-D"
    if kind == "cu-float":
        return (q, k, v), {"cu_seqlens": torch.tensor([0.0, 8.0])}, "cu_seqlens has dtype torch.float32: it must be an integer"
    if kind == "cu-start":
        return (q, k, v), {"cu_seqlens": torch.tensor([1, 8])}, r"cu_seqlens=\[1, 8\] must start at 0"
    if kind == "cu-order":
        return (q, k, v), {"cu_seqlens": torch.tensor([0, 5, 5, 8])}, "strictly increasing: entry 2 is 5, after 5"
    if kind == "cu-end":
        return (q, k, v), {"cu_seqlens": torch.tensor([0, 4, 7])}, "cu_seqlens ends at 7 but the global row holds 8 tokens"
    if kind == "cu-batch":
        q, k, v = _qkv(b=2)
        return (q, k, v), {"cu_seqlens": torch.tensor([0, 8])}, "cu_seqlens needs batch size 1.*got batch 2"
    if kind == "cu-zigzag":
        return (q, k, v), {"cu_seqlens": torch.tensor([0, 3, 8]), "layout": "zigzag"}, (
            "document 0 has 3 tokens: under layout 'zigzag' every document must be a multiple of 2 \\* world_size = 4")
    if kind == "window-left":
        return (q, k, v), {"window_size": (-2, 0)}, "window_size left=-2 must be an int >= -1"
    if kind == "window-right":
        return (q, k, v), {"window_size": (4, 1)}, r"window_size=\(4, 1\): right must be 0 when causal=True"
    if kind == "window-pair":
        return (q, k, v), {"window_size": (4,)}, r"window_size=\(4,\) must be a pair"
    raise AssertionError(kind)


KINDS = ["zigzag-odd", "heads", "dtype", "device", "batch", "head_dim", "kv-shapes", "seq", "ndim",
         "layout", "backend", "backend-device", "backend-dtype", "flash-missing", "scale",
         "cu-2d", "cu-float", "cu-start", "cu-order", "cu-end", "cu-batch", "cu-zigzag",
         "window-left", "window-right", "window-pair"]


def check_raises(kind):
    args, kwargs, match = _bad(kind)
    with pytest.raises(ValueError, match=match):
        striped_sp.ring_attention(*args, **kwargs)


def check_ring_still_works():
    """After every rank raised, no message is left half-sent: a real call completes."""
    n, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    q, k, v = _qkv(s=4 * n)
    out = striped_sp.ring_attention(*(striped_sp.shard(t, n, rank) for t in (q, k, v)))
    assert torch.isfinite(out).all()


def check_mismatch_across_ranks():
    """Ranks that disagree on the local length all raise by default, naming the field and both values."""
    rank = dist.get_rank()
    q, k, v = _qkv(s=4 + 2 * rank)
    with pytest.raises(ValueError, match=r"rank 1 passed q.shape=\(1, 6, 4, 8\), rank 0 passed \(1, 4, 4, 8\)"):
        striped_sp.ring_attention(q, k, v)
    # agreeing ranks pass the check and run
    q, k, v = _qkv(s=4)
    assert torch.isfinite(striped_sp.ring_attention(q, k, v)).all()


def check_mask_mismatch_across_ranks(what):
    """Ranks that disagree on cu_seqlens or window_size all raise, naming the field."""
    rank = dist.get_rank()
    q, k, v = _qkv(s=4)
    bad = ({"cu_seqlens": torch.tensor([0, 3 + rank, 8])} if what == "cu_seqlens"
           else {"window_size": (2 + rank, 0)})
    match = (r"rank 1 passed cu_seqlens=\(0, 4, 8\), rank 0 passed \(0, 3, 8\)" if what == "cu_seqlens"
             else r"rank 1 passed window_size=\(3, 0\), rank 0 passed \(2, 0\)")
    with pytest.raises(ValueError, match=match):
        striped_sp.ring_attention(q, k, v, **bad)
    good = ({"cu_seqlens": torch.tensor([0, 3, 8]), "sharded_by_documents": True}  # random rows: nothing sharded
            if what == "cu_seqlens" else {"window_size": (2, 0)})
    assert torch.isfinite(striped_sp.ring_attention(q, k, v, **good)).all()


def check_one_rank_fails_its_own_checks():
    """A rank whose own checks fail tells the others: every rank raises, nobody waits in the ring
    or in the check's exchange."""
    rank = dist.get_rank()
    q, k, v = _qkv(s=4)
    cu = torch.tensor([0, 5, 5, 8]) if rank == 1 else torch.tensor([0, 5, 8])
    match = "strictly increasing" if rank == 1 else r"rank 1 of the group refused: ValueError: .*strictly increasing"
    with pytest.raises(ValueError, match=match):
        striped_sp.ring_attention(q, k, v, cu_seqlens=cu)
    assert torch.isfinite(striped_sp.ring_attention(q, k, v, cu_seqlens=torch.tensor([0, 5, 8]),
                                                    sharded_by_documents=True)).all()  # random rows


def check_kernel_failure_leaves_ring_clean():
    """A kernel that fails on every rank at step 0 (after the KV transfer was posted) raises there,
    and the next call is still exact: no half-sent message is left to be mis-received."""
    from reference import reference_attention, rel_err
    from striped_sp import kernels

    n, rank = dist.get_world_size(), dist.get_rank()
    math = kernels.KERNELS["math"]

    class FailsOnFirstCall(kernels.MathKernel):
        calls = 0

        def forward(self, *args):
            FailsOnFirstCall.calls += 1
            if FailsOnFirstCall.calls == 1:
                raise RuntimeError("kernel refused this block")
            return super().forward(*args)

    torch.manual_seed(1)
    q, k, v = _qkv(s=3 * n)
    local = [striped_sp.shard(t, n, rank) for t in (q, k, v)]
    kernels.KERNELS["math"] = FailsOnFirstCall()
    try:
        with pytest.raises(RuntimeError, match="kernel refused"):
            striped_sp.ring_attention(*local, backend="math")
    finally:
        kernels.KERNELS["math"] = math
    out = striped_sp.ring_attention(*local, backend="math")
    ref = reference_attention(q, k, v, True, 8 ** -0.5)
    assert rel_err(out, striped_sp.shard(ref, n, rank)) < 1e-5


CASES = [(kind, check_raises, (kind,)) for kind in KINDS] + [
    ("kernel-failure-settles", check_kernel_failure_leaves_ring_clean, ()),
    ("rank-mismatch-checked", check_mismatch_across_ranks, ()),
    ("cu-seqlens-mismatch-checked", check_mask_mismatch_across_ranks, ("cu_seqlens",)),
    ("window-mismatch-checked", check_mask_mismatch_across_ranks, ("window_size",)),
    ("one-rank-fails-checked", check_one_rank_fails_its_own_checks, ()),
    ("ring-still-works", check_ring_still_works, ()),
]
_results = {}


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_bad_input_on_every_rank(name):
    if "all" not in _results:
        _results["all"] = run_cases(2, CASES)
    err = _results["all"][name]
    assert err is None, err


def test_no_process_group_initialized():
    assert not dist.is_initialized()
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="no process group initialized"):
        striped_sp.ring_attention(q, k, v)


def test_striped_attention_rejects_layout():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="fixes layout='striped'"):
        striped_sp.striped_attention(q, k, v, layout="zigzag")
