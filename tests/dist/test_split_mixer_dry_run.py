"""A split mixer layer on the CUDA dry run (issue 54): after the batch's first layer, a layer does no
host-to-device copy, no synchronisation and reads no device value on the host; its only collectives
are the all-to-alls (two forward, two backward).

The dry run: rank 0 of PyTorch's fake process group of 2 (collectives return at once), the mixer's
weights and inputs on the meta device (a device that is not the host's: :class:`HostWork` counts a
copy from host memory to it, and any op that would read it on the host, as on a GPU), transformers'
own module through the plugin's wrapped forward (:mod:`striped_sp.deepspeed.hybrid`: the row's
natural order, the split form's lookup, the split run).  The model's kernels are transformers' PyTorch
paths (fla / mamba_ssm / causal-conv1d where installed on a GPU): on meta tensors any of them that
read a device value would raise.  Seen failing with an index tensor built per layer on the device
(``torch.tensor(list, device=...)`` in place of ``heads._index_on``'s cached one): 1 copy per layer."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from striped_sp.bench.host_work import HostWork  # noqa: E402

N, SEQ, HIDDEN = 2, 64, 128
KINDS = ("gated_delta", "mamba2", "mamba", "short_conv")


@pytest.fixture
def fake_group():
    """Rank 0 of a fake group of N (CPU and meta tensors), the default group, destroyed after the test."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.fail("a process group is already initialized in the test process")
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=0, world_size=N)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _wrapped(kind: str, group):
    """transformers' mixer of ``kind`` on the meta device behind the plugin's wrapped forward."""
    from striped_sp.bench.hybrid_split import mixer_of
    from striped_sp.deepspeed.hybrid import _wrapped_forward

    torch.manual_seed(0)
    module = mixer_of(kind, HIDDEN).train().to("meta")
    settings = types.SimpleNamespace(group=group, layout="striped", cu_seqlens=None)
    return module, _wrapped_forward(module.forward, kind, HIDDEN, lambda: settings, module)


def _layer(forward):
    x = torch.empty(1, SEQ // N, HIDDEN, device="meta", requires_grad=True)
    forward(x).backward(torch.empty(1, SEQ // N, HIDDEN, device="meta"))
    return x.grad


def layer_counts(kind: str, group) -> dict:
    """The first layer's and a later layer's (the same batch) counts on the dry run."""
    from striped_sp.engine import head_split

    _, forward = _wrapped(kind, group)
    exchanges = []
    real = head_split._exchange

    def counted(chunks, grp):
        exchanges.append(chunks.device.type)
        return real(chunks, grp)

    head_split._exchange = counted
    try:
        with HostWork() as first:
            _layer(forward)
        exchanges.clear()
        with HostWork() as later:
            grad = _layer(forward)
    finally:
        head_split._exchange = real
    assert grad is not None and grad.shape == (1, SEQ // N, HIDDEN)
    return {"copies": later.copies, "syncs": dict(later.syncs), "data_dependent": later.data_dependent,
            "exchanges": exchanges, "comm": later.comm, "first_copies": first.copies,
            "first_syncs": dict(first.syncs)}


@pytest.mark.parametrize("kind", KINDS)
def test_a_later_split_layer_copies_and_syncs_nothing(fake_group, kind):
    got = layer_counts(kind, fake_group)
    assert got["exchanges"] == ["meta"] * 4, got  # one all-to-all each way, forward and backward
    assert got["copies"] == 0, got
    assert got["syncs"] == {}, got
    assert got["data_dependent"] == 0, got
    # the collectives: the all-to-alls (Mamba: and the all-reduce of x_proj's partial sums, each pass)
    assert got["comm"] == 4 + (2 if kind == "mamba" else 0), got
