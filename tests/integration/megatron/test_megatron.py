"""megatron-core GPT with ContextParallelAttention on 4 gloo ranks, against CP=1.

One spawn of 4 ranks runs every case: Megatron's parallel_state has CP=4; CP=2 uses the
sub-groups [0, 2] and [1, 3] (non-adjacent ranks), CP=1 a group per rank.  The CP=1
reference model runs an independent float64 core attention on the whole sequence
(``megatron_reference``), put into the built model, so an adapter bug cannot cancel out: the
``adapter-bug-is-caught`` case checks that a 1% error in our softmax scale fails the comparison.
"""

import itertools
import random

import pytest
import torch
import torch.distributed as dist

import striped_sp
from dist_helper import run_cases
from megatron_reference import compare, document_mask, setup_groups, use_reference_attention

pytest.importorskip("megatron.core")

SEED = random.randrange(2**31)  # differs in each spawned rank: cases get their seed as an argument
ALGOS = {"striped": "striped", "zigzag": "zigzag", "ring": "contiguous"}
HEADS = {"mha": (4, 4), "gqa": (4, 2)}
POS = ["rope", "learned_absolute"]
SEQ = 40  # a multiple of 2 * 4, not a power of two
VOCAB = 48

_setup = setup_groups


def _batch(seed, batch=2, seq=SEQ):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    loss_mask = (torch.rand(batch, seq, generator=gen) > 0.2).float()
    position_ids = torch.arange(seq).expand(batch, seq).contiguous()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


def _loss(model, b, mtp=None):
    extra = {"loss_mask": b["loss_mask"]} if mtp else {}  # MTP masks its loss with it
    out = model(b["tokens"], b["position_ids"], None, labels=b["labels"], **extra)
    return (out * b["loss_mask"]).sum()


def _mtp_even_mask(cp, layout, seq=SEQ):
    """A ``[seq]`` loss mask of ones but for a few zeros, placed so that on every rank of ``layout``
    the counted tokens before MTP's roll by -1 equal those after it.  Zeroing position ``q`` moves one
    counted token from the rank holding ``q - 1`` to the rank holding ``q``; the roll itself takes one
    from the rank holding the last position.  So: zero position 0, then the ``q`` along a shortest
    chain of ranks from the holder of position 0 to the holder of the last one (one zero per rank
    under stripes of 1 or contiguous chunks, position 0 alone where one rank holds both ends, as in
    zigzag's order)."""
    owner = torch.empty(seq, dtype=torch.int64)
    for r in range(cp):
        owner[striped_sp.positions(seq, cp, r, layout)] = r
    steps = {}  # (from rank, to rank) -> the first position q with owner[q - 1], owner[q] that pair
    for q in range(1, seq):
        steps.setdefault((int(owner[q - 1]), int(owner[q])), q)
    start, goal = int(owner[0]), int(owner[-1])
    came, frontier = {start: None}, [start]
    while goal not in came:  # breadth first over the ranks
        nxt = [b for a in frontier for (x, b) in steps if x == a and b not in came]
        assert nxt, f"no chain of ranks from {start} to {goal} in {layout}"
        for (x, b) in steps:
            if x in frontier and b not in came:
                came[b] = x
        frontier = nxt
    mask = torch.ones(seq)
    mask[0] = 0
    rank = goal
    while came[rank] is not None:
        mask[steps[(came[rank], rank)]] = 0
        rank = came[rank]
    return mask


def check_gpt(cp, algo, pos, heads, seed, mtp=None, scale_error=None, cp_comm_type=None):
    env = _setup()
    import striped_sp.megatron as sm
    from striped_sp.megatron.toy import tiny_gpt

    sm.install(algo)  # RoPE slicing and MTP roll follow the algo under test
    h, kvh = HEADS[heads]
    common = dict(vocab_size=VOCAB, max_seq_len=SEQ, hidden=32, heads=h, kv_heads=kvh, layers=2,
                  position_embedding_type=pos, seed=seed, mtp_layers=mtp)
    if cp_comm_type is not None:  # Ulysses inside (Megatron's hierarchical CP groups), ring across
        from megatron.core import parallel_state

        if cp_comm_type == "a2a+p2p" and parallel_state.get_hierarchical_context_parallel_groups(False) is None:
            raise AssertionError("Megatron built no hierarchical CP groups (einops missing?)")
        common["cp_comm_type"] = cp_comm_type
    if mtp:  # Megatron divides the MTP loss by each CP rank's own token count unless per-token
        common["calculate_per_token_loss"] = True
    ref = tiny_gpt(env[1], algo, **common)
    use_reference_attention(ref, ref.config)
    model = tiny_gpt(env[cp], algo, **common)
    if cp_comm_type is not None:  # the hierarchical path really runs (the plain ring would pass too)
        inner = [m.ulysses_groups[0].size() for m in model.modules() if isinstance(m, sm.ContextParallelAttention)]
        assert inner and all(u == (2 if cp_comm_type == "a2a+p2p" else cp) for u in inner), inner
    if scale_error is not None:  # a deliberate adapter bug: the comparison must catch it
        for module in model.modules():
            if isinstance(module, sm.ContextParallelAttention):
                module.softmax_scale *= 1 + scale_error
    if mtp:  # MTP's training-mode loss logging is CUDA-only; its loss still reaches the grads
        ref.eval()
        model.eval()
    b = _batch(seed + 1)
    if mtp:
        # megatron-core 0.17+ rescales each rank's MTP loss by that rank's own (loss tokens / tokens
        # left after the roll), with native CP as well; a loss mask of ones but for every rank's
        # first position makes that ratio 1 on every rank and at CP=1, so the comparison stays
        # exact on every release.
        b["loss_mask"].copy_(_mtp_even_mask(cp, ALGOS[algo]).expand_as(b["loss_mask"]))

    ref_loss = _loss(ref, b, mtp)
    ref_loss.backward()
    local = sm.get_batch_on_this_cp_rank(b, algo, cp_group=env[cp])
    loss = _loss(model, local, mtp)
    loss.backward()
    compare(model, ref, loss, ref_loss, env[cp], seed)


def check_adapter_bug_is_caught(seed):
    with pytest.raises(AssertionError):
        check_gpt(2, "striped", "rope", "gqa", seed, scale_error=0.01)


def check_batch_slicing(cp, algo, seed):
    env = _setup()
    import striped_sp.megatron as sm

    group = env[cp]
    rank = dist.get_rank(group)
    b = _batch(seed)
    rows = [(0, SEQ), (0, SEQ)] if algo == "zigzag" else [(0, 7, 8, 30, SEQ), (0, SEQ)]  # zigzag: no documents
    b["attention_mask"] = torch.cat([document_mask(r, SEQ) for r in rows])
    b["cu_seqlens"] = None
    got = sm.get_batch_on_this_cp_rank(b, algo, cp_group=group)
    from striped_sp.megatron import packed

    assert packed.attached(got["attention_mask"]) == tuple(rows)
    assert list(got) == list(b)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(got[key], striped_sp.shard(b[key], cp, rank, dim=1, layout=ALGOS[algo])), key
    assert torch.equal(got["attention_mask"], striped_sp.shard(b["attention_mask"], cp, rank, dim=2,
                                                               layout=ALGOS[algo]))
    assert got["cu_seqlens"] is None


def check_native_slicing_is_zigzag(seed):
    """Megatron's own slicing (cp_group=None: parallel_state, CP=4) is our zigzag layout."""
    _setup()
    import striped_sp.megatron as sm

    b = _batch(seed)
    native = sm.get_batch_on_this_cp_rank(dict(b), "native")
    zigzag = sm.get_batch_on_this_cp_rank(dict(b), "zigzag")
    for key in b:
        assert torch.equal(native[key], zigzag[key]), key


def check_installed_slicing(algo, seed):
    """Under install, Megatron's own get_batch_on_this_cp_rank follows the algo."""
    _setup()
    import megatron.core.utils as mcu

    import striped_sp.megatron as sm

    sm.install(algo)
    b = _batch(seed)
    import inspect

    original = mcu.get_batch_on_this_cp_rank.__striped_sp_original__
    hybrid = {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(original).parameters else {}
    got = mcu.get_batch_on_this_cp_rank(dict(b), **hybrid)  # as pretrain_gpt.py of that release calls it
    want = sm.get_batch_on_this_cp_rank(dict(b), algo)
    assert all(torch.equal(got[k], want[k]) for k in b)


def check_mtp_roll(cp, algo, shifts, seed):
    env = _setup()
    import striped_sp.megatron as sm
    from megatron.core.transformer import multi_token_prediction as mtp

    group = env[cp]
    rank = dist.get_rank(group)
    layout = ALGOS[algo]
    full = torch.randint(1, 100, (3, SEQ), generator=torch.Generator().manual_seed(seed))
    want = torch.roll(full, shifts, dims=-1)
    if shifts < 0:
        want[:, shifts:] = 0
    want = striped_sp.shard(want, cp, rank, layout=layout)
    got, total = sm.roll_tensor(striped_sp.shard(full, cp, rank, layout=layout), shifts, -1, group, algo=algo)
    assert torch.equal(got, want)
    assert total.item() == want.sum().item()
    if shifts == -1:  # the installed roll, as MTP calls it
        sm.install(algo)
        got2, _ = mtp.roll_tensor(striped_sp.shard(full, cp, rank, layout=layout), shifts=-1, dims=-1,
                                  cp_group=group, packed_seq_params=None)
        assert torch.equal(got2, want)


def check_bad_length_raises_everywhere(cp, seed):
    """A sequence the layout cannot split raises ValueError on every rank, before any message."""
    env = _setup()
    import striped_sp.megatron as sm

    b = _batch(seed, seq=SEQ + 1)
    with pytest.raises(ValueError, match="multiple"):
        sm.get_batch_on_this_cp_rank(b, "striped", cp_group=env[cp])
    dist.barrier()


def _cases():
    cases = []
    for cp, algo, pos, heads in itertools.product([2, 4], ALGOS, POS, HEADS):
        cases.append((f"gpt-cp{cp}-{algo}-{pos}-{heads}", check_gpt, (cp, algo, pos, heads, SEED)))
    cases.append(("gpt-cp2-striped-mtp", check_gpt, (2, "striped", "rope", "gqa", SEED + 7, 1)))
    cases.append(("gpt-cp4-ring-mtp", check_gpt, (4, "ring", "learned_absolute", "mha", SEED + 8, 1)))
    cases.append(("adapter-bug-is-caught", check_adapter_bug_is_caught, (SEED + 9,)))
    for algo, comm in (("striped", "a2a+p2p"), ("zigzag", "a2a+p2p"), ("ring", "a2a"), ("striped", "a2a")):
        cases.append((f"gpt-cp4-{algo}-{comm}", check_gpt, (4, algo, "rope", "mha", SEED + 10, None, None, comm)))
    for cp, algo in itertools.product([2, 4], ALGOS):
        cases.append((f"slice-cp{cp}-{algo}", check_batch_slicing, (cp, algo, SEED + 1)))
        cases.append((f"roll-cp{cp}-{algo}", check_mtp_roll, (cp, algo, -1, SEED + 2)))
    cases.append(("roll-cp4-striped-shift-3", check_mtp_roll, (4, "striped", -3, SEED + 3)))
    cases.append(("native-slicing-is-zigzag", check_native_slicing_is_zigzag, (SEED + 4,)))
    for algo in ALGOS:
        cases.append((f"installed-slicing-{algo}", check_installed_slicing, (algo, SEED + 5)))
    cases.append(("bad-length-cp4", check_bad_length_raises_everywhere, (4, SEED + 6)))
    return cases


CASES = _cases()
_results = {}


def _result(name):
    if not _results:
        _results.update(run_cases(4, CASES))
    return _results[name]


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_megatron_on_4_ranks(name):
    err = _result(name)
    assert err is None, err
