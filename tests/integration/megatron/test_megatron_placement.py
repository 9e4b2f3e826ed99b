"""``--striped-stripe-size`` and ``--striped-doc-placement`` through megatron-core, on 2 gloo ranks.

A megatron-core GPT (RoPE, GQA) at CP=2 against CP=1 with an independent float64 core attention
(``megatron_reference``), on loss and every gradient, with the algo string that
:func:`striped_sp.megatron.algo_of` makes of the flags (``"striped:stripe=4"``,
``"striped:place=16"``, ...): packed THD rows (with and without Megatron's padding, windows, MTP)
and ``--reset-attention-mask`` batches.  The cases and the reference are those of
``test_megatron_packed`` (its document rows: 6 documents of uneven lengths), run here in one
process group of 2 ranks.
"""

import types

import pytest
import torch
import torch.distributed as dist

import striped_sp
from dist_helper import run_cases
from seeds import seed_for

pytest.importorskip("megatron.core")

import test_megatron_packed as packed_cases  # noqa: E402
from megatron_reference import document_mask  # noqa: E402
from test_megatron_packed import WINDOW, check_reset_mask, check_thd, thd_row  # noqa: E402

SEED = seed_for(__name__)
_GROUPS = {}


def _setup():
    """Megatron's parallel_state with CP = 2 (the world), and this rank's CP groups of 1 and 2."""
    if _GROUPS:
        return _GROUPS
    from megatron.core import parallel_state

    from striped_sp.megatron.toy import single_rank_group

    parallel_state.initialize_model_parallel(context_parallel_size=dist.get_world_size())
    _GROUPS[1] = single_rank_group()
    _GROUPS[2] = parallel_state.get_context_parallel_group()
    return _GROUPS


packed_cases._setup = _setup  # the shared cases build their models on these groups


def _algo(**flags):
    import striped_sp.megatron as sm

    return sm.algo_of(types.SimpleNamespace(context_parallel_algo="striped", **flags))


def check_placement_reorders(seed):
    """The placed layouts of these cases really keep documents whole (positions out of order)."""
    _, cu, cu_padded, _, bounds = thd_row(2, True, seed)
    for key in (_algo(striped_doc_placement="16"), _algo(striped_doc_placement="8", striped_stripe_size=2)):
        pos = [striped_sp.positions(bounds[-1], 2, r, key, bounds) for r in range(2)]
        assert any(not bool((p[1:] > p[:-1]).all()) for p in pos), (key, [p.tolist() for p in pos])


def check_placed_reset_mask_refused(seed):
    import striped_sp.megatron as sm

    group = _setup()[2]
    batch = {"tokens": torch.zeros(1, 40, dtype=torch.int64), "attention_mask": document_mask((0, 13, 40), 40)}
    with pytest.raises(ValueError, match="THD rows"):
        sm.get_batch_on_this_cp_rank(batch, _algo(striped_doc_placement="auto"), cp_group=group)
    with pytest.raises(ValueError, match="THD rows"):
        sm.get_batch_on_this_cp_rank(batch, _algo(striped_stripe_size="doc"), cp_group=group)
    dist.barrier()


def _cases():
    s2, s4 = _algo(striped_stripe_size=2), _algo(striped_stripe_size=4)
    p16, auto = _algo(striped_doc_placement="16"), _algo(striped_doc_placement="auto")
    p8s2 = _algo(striped_doc_placement="8", striped_stripe_size=2)
    doc, doc8 = _algo(striped_stripe_size="doc"), _algo(striped_stripe_size="doc", striped_doc_placement="8")
    assert (s4, p8s2, doc8) == ("striped:stripe=4", "striped:stripe=2,place=8", "striped:stripe=doc,place=8")
    stripe_auto = _algo(striped_stripe_size="auto", sft=True)  # --sft packed rows: the per-batch search
    assert stripe_auto == "striped:stripe=auto"
    return [
        ("thd-stripe2", check_thd, (2, s2, False, None, SEED)),
        ("thd-padded-stripe2-window", check_thd, (2, s2, True, WINDOW, SEED + 1)),
        ("thd-stripe4-window", check_thd, (2, s4, False, WINDOW, SEED + 2)),
        ("reset-mask-stripe4", check_reset_mask, (2, s4, None, SEED + 3)),
        ("reset-mask-stripe2-window", check_reset_mask, (2, s2, WINDOW, SEED + 4)),
        ("thd-place16", check_thd, (2, p16, False, None, SEED + 5)),
        ("thd-padded-place16-window", check_thd, (2, p16, True, WINDOW, SEED + 6)),
        ("thd-padded-place8-stripe2", check_thd, (2, p8s2, True, None, SEED + 7)),
        ("thd-padded-auto", check_thd, (2, auto, True, None, SEED + 8)),
        ("thd-padded-place16-mtp", check_thd, (2, p16, True, None, SEED + 9, False, 1)),
        ("thd-padded-doc", check_thd, (2, doc, True, None, SEED + 12)),
        ("thd-doc8-window", check_thd, (2, doc8, False, WINDOW, SEED + 13)),
        ("thd-padded-stripe-auto", check_thd, (2, stripe_auto, True, None, SEED + 14)),
        ("thd-stripe-auto-window", check_thd, (2, stripe_auto, False, WINDOW, SEED + 15)),
        ("placement-reorders", check_placement_reorders, (SEED + 10,)),
        ("placed-reset-mask-refused", check_placed_reset_mask_refused, (SEED + 11,)),
    ]


CASES = _cases()
_results = {}
_SKIP = ({"thd-padded-place16-mtp": "megatron-core >= 0.17 weights MTP per CP rank"}
         if packed_cases._mcore_line() >= (0, 17) else {})
CASES = [case for case in CASES if case[0] not in _SKIP]


@pytest.mark.parametrize("name", [name for name, _, _ in CASES] + list(_SKIP))
def test_megatron_placement_on_2_ranks(name):
    if name in _SKIP:
        pytest.skip(_SKIP[name])
    if not _results:
        _results.update(run_cases(2, CASES))
    err = _results[name]
    assert err is None, err
