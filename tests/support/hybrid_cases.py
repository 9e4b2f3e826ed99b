"""What the hybrid tests on the Hugging Face path share (test_hf_hybrids.py, test_hf_hybrid_families.py):
a batch, the comparison with the plain model at SP=1, and a count of the split mixers' all-to-alls.

:func:`compare`: the loss summed over the group (each rank's loss is its share of the global mean)
to 1e-5 of the plain model's, every gradient summed over the group (as DeepSpeed does) to 1e-4."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from reference import rel_err

__all__ = ["SEQ", "batch", "grads", "compare", "exchanges", "mixer_count"]

SEQ = 32


def batch(b=2, seed=5, seq=SEQ):
    """``input_ids`` and ``labels`` ``[b, seq]`` (int64), the first two labels of row 0 ignored."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (b, seq), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    return {"input_ids": ids, "labels": labels}


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(model, ref, loss, ref_loss) -> None:
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    assert rel_err(loss, ref_loss.detach()) < 1e-5, (loss.item(), ref_loss.item())
    ref_grads, mine = grads(ref), grads(model)
    assert ref_grads.keys() == mine.keys(), set(ref_grads) ^ set(mine)
    worst = []
    for name, g in mine.items():
        dist.all_reduce(g)
        err = rel_err(g, ref_grads[name])
        if err >= 1e-4:
            worst.append(f"{name}: {err:.2e}")
    assert not worst, worst


def mixer_count(model) -> int:
    """The model's non-attention mixers (each splits, gathers or is refused)."""
    from striped_sp.deepspeed.mixers import unhandled_mixers

    return len(unhandled_mixers(model))


@contextlib.contextmanager
def exchanges():
    """Counts the split mixers' all-to-alls (:mod:`striped_sp.engine.head_split`) while it is open:
    a split mixer layer makes 4 per forward and backward (one each way, each way's gradient)."""
    from striped_sp.engine import head_split

    calls, real = [0], head_split._exchange

    def counted(chunks, group):
        calls[0] += 1
        return real(chunks, group)

    head_split._exchange = counted
    try:
        yield calls
    finally:
        head_split._exchange = real
