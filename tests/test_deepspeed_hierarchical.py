"""Hierarchical CP through DeepSpeed (``"context_parallel": {"ulysses_size": 2}``) on 4 gloo ranks:
SP=4 as 2 x 2 (Ulysses pairs, the ring across) equals SP=1, for the Hugging Face path and for a
DeepSpeed engine step (loss, every gradient, the parameters after the step)."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
import torch.distributed as dist

import striped_sp
from dist_helper import run_cases
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


CASES = [("setup", _setup, ()), ("hf_2x2_striped", _case_hf, ("striped",)), ("hf_2x2_zigzag", _case_hf, ("zigzag",)),
         ("engine_2x2_striped", _case_engine, ("striped",))]


@pytest.fixture(scope="module")
def results():
    return run_cases(SP, CASES, timeout_s=400)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_hierarchical_deepspeed_case(results, name):
    if name != "setup" and results["setup"] is not None:
        pytest.fail(f"setup failed:\n{results['setup']}")
    assert results[name] is None, results[name]
