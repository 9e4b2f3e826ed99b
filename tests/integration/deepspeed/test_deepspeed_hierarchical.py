"""Hierarchical CP through DeepSpeed (``"context_parallel": {"ulysses_size": 2}``) on 4 gloo ranks:
SP=4 as 2 x 2 (Ulysses pairs, the ring across) equals SP=1, for the Hugging Face path and for a
DeepSpeed engine step (loss, every gradient, the parameters after the step)."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
import torch.distributed as dist

import striped_sp
from dist_helper import run_cases, check_case
from reference import rel_err
from test_deepspeed_dist import _STATE, _batch, _ds_config, _grads, _setup, _tiny_llama

SP, U = 4, 2


def _case_hf(layout):
    from striped_sp.deepspeed import enable_hf_attention, shard_batch

    rank = dist.get_rank()
    full = _batch()
    ref = _tiny_llama()
    ref_loss = ref(**full).loss
    ref_loss.backward()
    groups = striped_sp.ulysses_ring_groups([list(range(SP))], U)
    model = enable_hf_attention(_tiny_llama(), _STATE["group"], layout, ulysses_groups=groups)
    out = model(**shard_batch(full, SP, rank, layout))
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    assert rel_err(loss, ref_loss.detach()) < 1e-5, (loss.item(), ref_loss.item())
    for name, g in _grads(model).items():
        dist.all_reduce(g)
        assert rel_err(g, _grads(ref)[name]) < 1e-5, name


def _case_engine(algo):
    from striped_sp.deepspeed import initialize, shard_batch

    full = _batch()
    ref = _tiny_llama(seed=1)
    ref_loss = ref(**full).loss
    ref_loss.backward()
    ref_grads = _grads(ref)
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
    model = _tiny_llama(seed=1)
    cfg = _ds_config(SP, algo)
    cfg["context_parallel"]["ulysses_size"] = U
    cfg["gradient_clipping"] = 0.0  # DeepSpeed clips at 1.0 by default; the reference does not
    engine, _, _, _ = initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), config=cfg)
    assert engine.context_parallel.ulysses_size == U
    from striped_sp.deepspeed import hf

    assert hf._ACTIVE.ulysses_groups[0].size() == U  # the hierarchical path really runs
    rank = dist.get_rank(engine.context_parallel_group)
    loss = engine(**shard_batch(full, SP, rank, engine.context_parallel.layout)).loss
    engine.backward(loss)
    grads = _grads(engine.module)
    engine.step()
    assert rel_err(loss.detach(), ref_loss.detach()) < 1e-5, (loss.item(), ref_loss.item())
    for name, p in engine.module.named_parameters():
        assert rel_err(grads[name], ref_grads[name]) < 1e-5, (name, "grad", rel_err(grads[name], ref_grads[name]))
        assert rel_err(p.detach(), dict(ref.named_parameters())[name].detach()) < 1e-5, (name, "param")


def _case_distributed_attention():
    """The DistributedAttention drop-in configured with Ulysses groups (as initialize does) against
    a float64 reference, forward and gradients; configure(ulysses_groups=None) goes back to the ring."""
    from reference import reference_attention, sharded_errors
    from striped_sp.deepspeed import DistributedAttention

    rank, seq = dist.get_rank(), 32
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(seq, 1, 4, 16, generator=gen)  # [s, b, h, d]: batch_dim_idx=1
    k, v = (torch.randn(seq, 1, 2, 16, generator=gen) for _ in range(2))
    dout = torch.randn(seq, 1, 4, 16, generator=gen)
    qr, kr, vr = (t.double().transpose(0, 1).requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, True, 0.3)  # not the default 16 ** -0.5
    (ref * dout.double().transpose(0, 1)).sum().backward()
    module = DistributedAttention(None, _STATE["group"], 2, 0, softmax_scale=0.3)
    module.configure(ulysses_groups=striped_sp.ulysses_ring_groups([list(range(SP))], U))
    assert module.ulysses_groups[0].size() == U
    local = [striped_sp.shard(t, SP, rank, dim=0).requires_grad_() for t in (q, k, v)]
    out = module(*local, 1)
    out.backward(striped_sp.shard(dout, SP, rank, dim=0))
    sh = lambda t: striped_sp.shard(t, SP, rank, dim=1).transpose(0, 1)  # noqa: E731
    errs = sharded_errors(out, local, ref, (qr, kr, vr), sh)
    assert all(e < 1e-5 for e in errs.values()), errs
    module.configure(ulysses_groups=None)
    assert module.ulysses_groups is None


CASES = [("setup", _setup, ()), ("distributed_attention_2x2", _case_distributed_attention, ()), ("hf_2x2_striped", _case_hf, ("striped",)), ("hf_2x2_zigzag", _case_hf, ("zigzag",)),
         ("engine_2x2_striped", _case_engine, ("striped",))]


@pytest.fixture(scope="module")
def results():
    return run_cases(SP, CASES, timeout_s=400)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_hierarchical_deepspeed_case(results, name):
    check_case(results, name)
