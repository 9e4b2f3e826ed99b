"""Mamba layers at CP=2 and CP=4 under every layout (striped_sp/megatron/mamba.py), on gloo ranks.

A hybrid stack of megatron-core's own layers (MambaModel on 0.16 / 0.17, HybridModel from 0.18;
'M' Mamba, '*' attention, '-' MLP) at CP=2, its batch sliced by the plugin, equals the same
model at CP=1 on the same weights and tokens (a few cases at CP=4 too): the loss within 1e-6 relative and every gradient
within 1e-5 (largest error over the largest entry).  The CP=1 reference runs megatron-core's own
code with the plugin uninstalled (its RoPE, its THD params with ``seq_idx``) and an independent
float64 core attention; both runs use the same pure-torch stand-ins for mamba_ssm's kernels
(tests/support/mamba_reference_ops.py), which respect ``seq_idx``: a packed row's documents never
see each other in the convolution or the scan.

Covered: striped (stripe 1 and 2, per-document stripes, whole-document placement), zigzag and
ring, dense and packed rows (with per-document padding too, masked out of the loss).  The
planted-bug cases put Megatron's own zigzag permutation, no permutation, and the layout's
permutation without the packed row's documents in place of the right one: each must fail the
comparison.
"""

import random

import pytest
import torch

from dist_helper import run_cases

pytest.importorskip("megatron.core")
pytest.importorskip("einops")

SEED = random.randrange(2**31)
VOCAB, SEQ = 48, 24
DOCS = [9, 1, 6, 8]           # 24 tokens, one document shorter than CP
PADDED = ([7, 3, 10], [8, 4, 12])  # real lengths, padded to multiples of 2 * CP (zigzag's rule)
LOSS_TOL, GRAD_TOL = 1e-6, 1e-5


# ---------------------------------------------------------------- in this process


def test_zigzag_order_is_megatrons_own_and_undo_redo_are_inverse():
    from megatron.core.ssm import mamba_context_parallel as mcp

    from striped_sp.megatron import mamba

    undo = getattr(mcp._undo_attention_load_balancing, "__striped_sp_original__", mcp._undo_attention_load_balancing)
    for cp in (2, 3, 4):
        x = torch.randn(4 * cp * 3, 2, 5, dtype=torch.float64, requires_grad=True)
        ours = mamba.undo_load_balancing(x, cp, algo="zigzag")
        assert torch.equal(ours, undo(x, cp)), cp
        for algo in ("striped", "striped:stripe=3", "ring"):
            back = mamba.redo_load_balancing(mamba.undo_load_balancing(x, cp, algo=algo), cp, algo=algo)
            assert torch.equal(back, x), (algo, cp)
        grad = torch.randn_like(x)
        (mamba.undo_load_balancing(x, cp, algo="striped") * grad).sum().backward()
        order = mamba.gathered_order(x.size(0), cp, "striped")
        assert torch.equal(x.grad, grad[order]), cp  # gathered row p is global position order[p]
        x.grad = None


def test_install_replaces_the_undo_and_redo_steps_and_uninstall_restores():
    import sys

    import striped_sp.megatron as sm
    from megatron.core.ssm import mamba_context_parallel as mcp

    names = ("_undo_attention_load_balancing", "_redo_attention_load_balancing")
    before = {n: getattr(mcp, n) for n in names}
    gdn = sys.modules.get("megatron.core.ssm.gated_delta_net.common")
    gdn_before = {n: getattr(gdn, n) for n in names} if gdn is not None else None
    sm.install("striped")
    try:
        for n in names:
            assert getattr(mcp, n) is not before[n] and getattr(mcp, n).__striped_sp_original__ is before[n]
        if gdn is not None:  # gated delta net's copies of the names too (megatron/gdn.py)
            for n in names:
                assert getattr(gdn, n).__striped_sp_original__ is gdn_before[n]
    finally:
        sm.uninstall()
    assert {n: getattr(mcp, n) for n in names} == before
    if gdn is not None:
        assert {n: getattr(gdn, n) for n in names} == gdn_before


# ---------------------------------------------------------------- 4 gloo ranks (CP groups of 2 and 4)


def check_mamba(algo, pattern, docs, seed, cp=2):
    """``pattern`` at CP=``cp`` under ``algo`` equals CP=1 (``docs``: None dense, a list of lengths
    packed, or (real, padded) lengths)."""
    import striped_sp.megatron as sm
    from mamba_reference_ops import use_reference_ops
    from megatron_mamba import compare_exact, cp_groups, hybrid_model, reference_model, run_row

    use_reference_ops()
    alone, group = cp_groups(cp)
    sm.install(algo)
    try:
        ref = reference_model(alone, pattern, VOCAB, seed=seed)
        model = hybrid_model(group, pattern, VOCAB, like=ref)
        assert any(isinstance(m, sm.ContextParallelAttention) for m in model.modules())
        assert sum(type(m).__name__ == "MambaMixer" for m in model.modules()) == pattern.count("M")
        loss, ref_loss = run_row(model, ref, algo, group, seed, VOCAB, SEQ, docs)
        compare_exact(model, ref, loss, ref_loss, group, seed, LOSS_TOL, GRAD_TOL)
    finally:
        sm.uninstall()


def check_wrong_permutation_fails(planted, algo, docs, seed):
    """A wrong permutation in place of the layout's must fail the comparison: Megatron's own zigzag
    one (``planted="zigzag"``), none at all (``"none"``), or the layout's without the documents
    the packed batch was sliced by (``"no-documents"``)."""
    from megatron_mamba import planted_order

    with planted_order(planted), pytest.raises(AssertionError, match="errors above"):
        check_mamba(algo, "M*M*", docs, seed)


CASES = [
    ("striped-dense-M*M*", check_mamba, ("striped", "M*M*", None, SEED)),
    ("striped-packed-M-*-", check_mamba, ("striped", "M-*-", DOCS, SEED + 1)),
    ("striped-stripe2-dense-M-*-", check_mamba, ("striped:stripe=2", "M-*-", None, SEED + 2)),
    ("striped-doc-stripes-packed-M*M*", check_mamba, ("striped:stripe=doc", "M*M*", DOCS, SEED + 3)),
    ("striped-placed-packed-M*M*", check_mamba, ("striped:place=auto", "M*M*", DOCS, SEED + 4)),
    ("zigzag-dense-M*M*", check_mamba, ("zigzag", "M*M*", None, SEED + 5)),
    ("zigzag-packed-padded-M*M*", check_mamba, ("zigzag", "M*M*", PADDED, SEED + 6)),
    ("striped-packed-padded-M*M*", check_mamba, ("striped", "M*M*", PADDED, SEED + 7)),
    ("ring-dense-M-*-", check_mamba, ("ring", "M-*-", None, SEED + 8)),
    # stripes of 1 pinned: the bare default may run zigzag's order on a dense row (issue 57)
    ("planted-zigzag-order-fails", check_wrong_permutation_fails, ("zigzag", "striped:stripe=1", None, SEED + 9)),
    ("planted-no-order-fails", check_wrong_permutation_fails, ("none", "striped", None, SEED + 10)),
    ("planted-packed-order-fails", check_wrong_permutation_fails, ("none", "striped", DOCS, SEED + 11)),
    ("planted-no-documents-fails", check_wrong_permutation_fails,
     ("no-documents", "striped:stripe=doc", DOCS, SEED + 12)),
    # CP=4: 8 Mamba heads in 2 groups, so each group's B / C state is repeated on 2 ranks
    ("cp4-striped-dense-M*M*", check_mamba, ("striped", "M*M*", None, SEED + 20, 4)),
    ("cp4-striped-packed-M-*-", check_mamba, ("striped", "M-*-", DOCS, SEED + 21, 4)),
    ("cp4-zigzag-dense-M*M*", check_mamba, ("zigzag", "M*M*", None, SEED + 22, 4)),
]
_results = {}


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_mamba_layers_on_4_ranks(name):
    if not _results:
        _results.update(run_cases(4, CASES))
    assert _results[name] is None, _results[name]
