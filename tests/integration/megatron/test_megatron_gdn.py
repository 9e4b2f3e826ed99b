"""Gated delta net layers (``G``, megatron-core 0.18+) at CP=2 and CP=4 under every layout
(striped_sp/megatron/gdn.py), on gloo ranks.

A HybridModel of megatron-core's own layers ('G' gated delta net, '*' attention, '-' MLP) at
CP=N, its batch sliced by the plugin, equals the same model at CP=1 on the same weights and tokens:
the loss within 1e-6 relative and every gradient within 1e-5 (largest error over the largest
entry).  megatron-core's own GDN context parallelism runs (its all-to-alls, head split and, for
packed rows, its single sequence permutation), with the plugin's order in place of zigzag's.  The
CP=1 reference runs megatron-core's code with the plugin uninstalled (its RoPE, its THD params)
and an independent float64 core attention.  fla's kernels need CUDA: both runs use the same float64
stand-ins written from the ops' definitions (tests/support/megatron_gdn_ops.py), which respect
``cu_seqlens`` (a packed row's documents never see each other in the convolution or the rule).
The decay parameters are redrawn so the state remembers many tokens (megatron-core's default
``A_log`` forgets within a few), and a wrong order cannot hide behind a short memory.

Covered: striped (stripe 1 and 2, per-document stripes, whole-document placement), zigzag and
ring, dense and packed rows (with per-document padding too, masked out of the loss).  Planted
bugs: Megatron's zigzag permutation, no permutation, and the layout's permutation without the
packed row's documents, each in place of the right one, must fail the comparison.
"""

import random

import pytest
import torch

from dist_helper import run_cases
from reference import rel_err

pytest.importorskip("megatron.core")
pytest.importorskip("einops")
gdn_module = pytest.importorskip("megatron.core.ssm.gated_delta_net.gdn",
                                 reason="megatron-core < 0.19: no packaged GDN module to run here")

SEED = random.randrange(2**31)
VOCAB, SEQ = 48, 24
DOCS = [9, 1, 6, 8]           # 24 tokens, one document shorter than CP, lengths not multiples of CP
PADDED = ([7, 3, 10], [8, 4, 12])  # real lengths, padded to multiples of 2 * CP (zigzag's rule)
LOSS_TOL, GRAD_TOL = 1e-6, 1e-5


# ---------------------------------------------------------------- in this process


def test_stand_in_rule_equals_megatrons_torch_rule():
    """The float64 stand-in (the recurrence token by token) equals megatron-core's own torch
    implementation of the chunked gated delta rule (its deterministic mode, float32)."""
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule
    from megatron_gdn_ops import chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(SEED)
    b, s, h, dk, dv = 1, 70, 2, 8, 4  # more than one 64-token chunk
    q, k = (torch.nn.functional.normalize(torch.randn(b, s, h, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(b, s, h, dv, generator=gen)
    g = -torch.rand(b, s, h, generator=gen) * 0.3
    beta = torch.rand(b, s, h, generator=gen)
    ours, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    theirs, _ = torch_chunk_gated_delta_rule(q, k, v, g, beta)
    assert rel_err(ours, theirs) < 1e-5
    # documents: the second starts from a zero state, as if run alone
    cu = torch.tensor([0, 30, 70])
    split, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    alone, _ = chunk_gated_delta_rule(q[:, 30:], k[:, 30:], v[:, 30:], g[:, 30:], beta[:, 30:])
    assert torch.allclose(split[:, 30:], alone) and torch.allclose(split[:, :30], ours[:, :30])


def test_thd_permutation_is_megatrons_own_under_zigzag_and_inverse_pairs():
    """Under zigzag the packed-row permutation equals megatron-core's ``_build_thd_cp_a2a_perm``;
    under every layout ``idx`` and ``inv`` are inverse permutations."""
    from striped_sp.megatron import gdn

    build = getattr(gdn_module._build_thd_cp_a2a_perm, "__striped_sp_original__", gdn_module._build_thd_cp_a2a_perm)
    for cp, lengths in ((2, [8, 4, 12]), (4, [16, 8, 24])):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        t = int(cu[-1])
        idx, inv = gdn.thd_permutation(cu, cp, t, algo="zigzag")
        ref_idx, ref_inv = build(cu, cp, t)
        assert torch.equal(idx, ref_idx) and torch.equal(inv, ref_inv), cp
        for algo in ("striped", "striped:stripe=doc", "ring"):
            idx, inv = gdn.thd_permutation(cu, cp, t, algo=algo)
            assert torch.equal(idx[inv], torch.arange(t)), (algo, cp)


def test_install_replaces_gdns_steps_and_uninstall_restores():
    import striped_sp.megatron as sm
    from megatron.core.ssm.gated_delta_net import common

    owners = {common: ("_undo_attention_load_balancing", "_redo_attention_load_balancing"),
              gdn_module: ("_build_thd_cp_a2a_perm",), common._GDNBase: ("_resolve_cu_seqlens",)}
    before = {(o, n): o.__dict__[n] for o, names in owners.items() for n in names}
    sm.install("striped")
    try:
        for (o, n), f in before.items():
            assert o.__dict__[n].__striped_sp_original__ is f, n
    finally:
        sm.uninstall()
    assert all(o.__dict__[n] is f for (o, n), f in before.items())


# ---------------------------------------------------------------- 4 gloo ranks (CP groups of 2 and 4)


def _long_memory(ref, seed):
    """Decays near 1 (``A`` in [0.02, 0.2], ``dt_bias`` around 0): the state spans the row."""
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for m in ref.modules():
            if type(m).__name__ == "GatedDeltaNet":
                m.A_log.copy_(torch.empty(m.A_log.shape).uniform_(0.02, 0.2, generator=gen).log())
                m.dt_bias.copy_(torch.randn(m.dt_bias.shape, generator=gen) * 0.5 - 1.0)


def check_gdn(algo, pattern, docs, seed, cp=2):
    """``pattern`` at CP=``cp`` under ``algo`` equals CP=1 (``docs``: None dense, a list of lengths
    packed, or (real, padded) lengths)."""
    import torch._dynamo

    import striped_sp.megatron as sm
    from mamba_reference_ops import use_reference_ops as use_mamba_ops
    from megatron_gdn_ops import use_reference_ops
    from megatron_mamba import compare_exact, cp_groups, hybrid_model, reference_model, run_row

    torch._dynamo.config.disable = True  # megatron-core's jit_fuser (torch.compile) runs eagerly on CPU
    use_reference_ops()
    if "M" in pattern:
        use_mamba_ops()
    alone, group = cp_groups(cp)
    sm.install(algo)
    try:
        ref = reference_model(alone, pattern, VOCAB, seed=seed)
        _long_memory(ref, seed)
        model = hybrid_model(group, pattern, VOCAB, like=ref)
        assert any(isinstance(m, sm.ContextParallelAttention) for m in model.modules())
        assert sum(type(m).__name__ == "GatedDeltaNet" for m in model.modules()) == pattern.count("G")
        loss, ref_loss = run_row(model, ref, algo, group, seed, VOCAB, SEQ, docs)
        errors = compare_exact(model, ref, loss, ref_loss, group, seed, LOSS_TOL, GRAD_TOL)
        print(f"[gdn] {algo} {pattern} docs={docs} CP={cp}: loss rel {errors[0]:.1e}, "
              f"worst gradient rel {errors[1]:.1e}", flush=True)
    finally:
        sm.uninstall()


def check_wrong_permutation_fails(planted, algo, docs, seed):
    """A wrong permutation in place of the layout's must fail the comparison: Megatron's own zigzag
    one (``planted="zigzag"``), none at all (``"none"``), or the layout's without the documents
    the packed batch was sliced by (``"no-documents"``)."""
    from megatron_mamba import planted_order

    with planted_order(planted), pytest.raises(AssertionError, match="errors above") as failed:
        check_gdn(algo, "G*G-", docs, seed)
    print(f"[gdn] planted {planted} ({algo}, docs={docs}): {str(failed.value).splitlines()[0][:300]}", flush=True)


CASES = [
    ("striped-dense-G*G-", check_gdn, ("striped", "G*G-", None, SEED)),
    ("striped-packed-G*G-", check_gdn, ("striped", "G*G-", DOCS, SEED + 1)),
    ("striped-stripe2-dense-G-*-", check_gdn, ("striped:stripe=2", "G-*-", None, SEED + 2)),
    ("striped-doc-stripes-packed-G*G-", check_gdn, ("striped:stripe=doc", "G*G-", DOCS, SEED + 3)),
    ("striped-placed-packed-G*G-", check_gdn, ("striped:place=auto", "G*G-", DOCS, SEED + 4)),
    ("striped-packed-padded-G*G-", check_gdn, ("striped", "G*G-", PADDED, SEED + 5)),
    ("zigzag-dense-G*G-", check_gdn, ("zigzag", "G*G-", None, SEED + 6)),
    ("zigzag-packed-padded-G*G-", check_gdn, ("zigzag", "G*G-", PADDED, SEED + 7)),
    ("ring-dense-G*G-", check_gdn, ("ring", "G*G-", None, SEED + 8)),
    ("mamba-and-gdn-striped-packed-MG*-", check_gdn, ("striped", "MG*-", DOCS, SEED + 9)),
    ("planted-zigzag-order-fails", check_wrong_permutation_fails, ("zigzag", "striped:stripe=1", None, SEED + 10)),
    ("planted-no-order-fails", check_wrong_permutation_fails, ("none", "striped", None, SEED + 11)),
    ("planted-packed-order-fails", check_wrong_permutation_fails, ("none", "striped", DOCS, SEED + 12)),
    ("planted-no-documents-fails", check_wrong_permutation_fails,
     ("no-documents", "striped:stripe=doc", DOCS, SEED + 13)),
    # CP=4: 4 key heads, 8 value heads: one key head and two value heads per rank
    ("cp4-striped-dense-G*G-", check_gdn, ("striped", "G*G-", None, SEED + 20, 4)),
    ("cp4-striped-packed-G*G-", check_gdn, ("striped", "G*G-", DOCS, SEED + 21, 4)),
    ("cp4-zigzag-dense-G*G-", check_gdn, ("zigzag", "G*G-", None, SEED + 22, 4)),
]
_results = {}


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_gdn_layers_on_4_ranks(name):
    if not _results:
        _results.update(run_cases(4, CASES))
    assert _results[name] is None, _results[name]
