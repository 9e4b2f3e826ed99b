"""Megatron-core's attention sinks (``--softmax-type learnable`` / ``off-by-one``) where the heads
are split: tensor parallelism (``softmax_offset`` holds this TP partition's heads) and Ulysses
through Megatron (``--cp-comm-type a2a`` / ``a2a+p2p --hierarchical-context-parallel-sizes 2 2``:
each member of a Ulysses group attends with its slice of those heads, and takes that slice of the
sinks).

One spawn of 4 gloo ranks, the cases of ``test_megatron_sinks.py`` (a megatron-core GPT with RoPE
and GQA against CP=1 with a float64 core attention that appends the sink logit as one more softmax
column; loss and every gradient, ``softmax_offset``'s included):

* Ulysses, parallel_state with CP=4 and hierarchical groups 2 x 2: ``a2a+p2p`` at CP=4 (striped,
  zigzag), ``a2a`` at CP=4 (MHA: one head per rank);
* then parallel_state again with TP=2 x CP=2: the ring at CP=2 (striped learnable, zigzag
  off-by-one, a window), TP and Ulysses together (``a2a`` at CP=2: TP slice, then Ulysses
  slice), each TP rank's sinks its own slice of one 4-head tensor; and the core attention's sharded
  state dict at TP=2 (key, global shape, fragmentation, offset) equal to megatron-core's own
  ``DotProductAttention``'s.

Seen failing with the TP split of the sinks dropped (``softmax_offset`` made with every head in
``attention.py``: the TP cases, a shape refusal) and with the Ulysses split of the sinks wrong
(every member taking slice 0 in ``engine/request.py``: the a2a and a2a+p2p cases, on loss and
gradients).
"""

import pytest
import torch
import torch.distributed as dist

from case_tests import cases_test
from megatron_reference import compare, setup_groups
from seeds import seed_for

pytest.importorskip("megatron.core")
pytest.importorskip("einops")  # Megatron builds its hierarchical CP groups with it

SEED = seed_for(__name__)
VOCAB = 48
SEQ = 40
HEADS = 4
#: the CP-size-1 group and the 2-rank CP group of the TP=2 x CP=2 world (made once)
_TP_GROUPS: dict = {}


def _set_sinks(ref, model, seed):
    """The same learnable sinks in both models: one 4-head tensor, this TP rank's slice of it."""
    from megatron.core import parallel_state

    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    per = HEADS // tp
    gen = torch.Generator().manual_seed(seed + 5)
    for a, b in zip(ref.decoder.layers, model.decoder.layers):
        value = (torch.randn(HEADS, generator=gen) * 2)[tp_rank * per:(tp_rank + 1) * per]
        with torch.no_grad():
            for layer in (a, b):
                layer.self_attention.core_attention.softmax_offset.copy_(value)


def _check(groups, cp, algo, softmax_type, seed, kv_heads=2, cp_comm_type=None, window=None, inner=None):
    """CP=``cp`` (``groups[cp]``) against CP=1 (``groups[1]``) with the float64 sink reference."""
    import striped_sp.megatron as sm
    from striped_sp.megatron.toy import tiny_gpt
    from test_megatron_sinks import _check_sink_grads, _use_sink_reference

    sm.install(algo)
    common = dict(vocab_size=VOCAB, max_seq_len=SEQ, hidden=32, heads=HEADS, kv_heads=kv_heads, layers=2, seed=seed,
                  softmax_type=softmax_type, init_std=0.3)
    if window is not None:
        common.update(window_size=window, window_attn_skip_freq=2)
    if cp_comm_type is not None:
        common["cp_comm_type"] = cp_comm_type
    ref = tiny_gpt(groups[1], algo, **common)
    _use_sink_reference(ref, ref.config)
    model = tiny_gpt(groups[cp], algo, **common)
    if softmax_type == "learnable":
        _set_sinks(ref, model, seed)
    attentions = [m for m in model.modules() if isinstance(m, sm.ContextParallelAttention)]
    tp = attentions[0].tp_group.size()
    assert all(m.softmax_offset.shape == (HEADS // tp,) for m in attentions)
    if inner is not None:  # the Ulysses path really runs (the plain ring would pass too)
        assert all(m.ulysses_groups[0].size() == inner for m in attentions), [m.ulysses_groups for m in attentions]
    gen = torch.Generator().manual_seed(seed + 1)
    tokens, labels = (torch.randint(0, VOCAB, (1, SEQ), generator=gen) for _ in range(2))
    pos = torch.arange(SEQ)[None]
    ref_loss = ref(tokens, pos, None, labels=labels).sum()
    ref_loss.backward()
    local = sm.get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels, "position_ids": pos}, algo,
                                         cp_group=groups[cp])
    loss = model(local["tokens"], local["position_ids"], None, labels=local["labels"]).sum()
    loss.backward()
    if tp == 1:
        _check_sink_grads(model, softmax_type)
    compare(model, ref, loss, ref_loss, groups[cp], seed)


def check_ulysses(cp, algo, softmax_type, cp_comm_type, seed, kv_heads=2):
    groups = setup_groups()  # CP=4 with hierarchical groups [2, 2]
    inner = 2 if cp_comm_type == "a2a+p2p" else cp
    _check(groups, cp, algo, softmax_type, seed, kv_heads=kv_heads, cp_comm_type=cp_comm_type, inner=inner)


def _tp_world():
    """parallel_state again, as TP=2 x CP=2 (TP groups [0, 1], [2, 3]; CP groups [0, 2], [1, 3])."""
    if _TP_GROUPS:
        return _TP_GROUPS
    from megatron.core import parallel_state

    from striped_sp.megatron.toy import single_rank_group

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    _TP_GROUPS[1] = single_rank_group()
    _TP_GROUPS[2] = parallel_state.get_context_parallel_group()
    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    assert dist.get_process_group_ranks(_TP_GROUPS[2]) == [dist.get_rank() % 2, dist.get_rank() % 2 + 2]
    return _TP_GROUPS


def check_tp(algo, softmax_type, seed, cp_comm_type=None, window=None, kv_heads=2):
    _check(_tp_world(), 2, algo, softmax_type, seed, kv_heads=kv_heads, cp_comm_type=cp_comm_type, window=window,
           inner=2 if cp_comm_type == "a2a" else None)


def check_tp_sharded_state_dict():
    """At TP=2 the core attention's sharded ``softmax_offset`` is megatron-core's own: same key,
    global shape (every head), fragmentation over TP and this rank's offset."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from striped_sp.megatron.attention import ContextParallelAttention
    from striped_sp.megatron.toy import pg_collection

    groups = _tp_world()
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=HEADS, num_query_groups=2,
                               context_parallel_size=1, attention_dropout=0.0, use_cpu_initialization=True,
                               params_dtype=torch.float32, softmax_type="learnable")
    pgc = pg_collection(groups[2])
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # megatron-core's DotProductAttention puts the sinks there
    try:
        native = DotProductAttention(config, 1, AttnMaskType.causal, "self", pg_collection=pgc)
    finally:
        torch.cuda.current_device = current
    ours = ContextParallelAttention(config, 1, AttnMaskType.causal, "self", pg_collection=pgc)
    assert ours.softmax_offset.shape == native.softmax_offset.shape == (HEADS // 2,)
    meta = {"dp_cp_group": groups[2]}
    a, b = native.sharded_state_dict("p.", (), meta), ours.sharded_state_dict("p.", (), meta)
    assert a.keys() == b.keys() == {"p.softmax_offset"}
    fields = ("key", "global_shape", "global_offset", "axis_fragmentations", "replica_id")
    assert ({f: getattr(a["p.softmax_offset"], f) for f in fields}
            == {f: getattr(b["p.softmax_offset"], f) for f in fields})
    assert b["p.softmax_offset"].global_shape == (HEADS,) and b["p.softmax_offset"].axis_fragmentations == (2,)


def _cases():
    return [  # the Ulysses cases first: the TP cases rebuild parallel_state
        ("ulysses-a2a+p2p-cp4-striped-learnable", check_ulysses, (4, "striped", "learnable", "a2a+p2p", SEED)),
        ("ulysses-a2a+p2p-cp4-zigzag-off-by-one", check_ulysses, (4, "zigzag", "off-by-one", "a2a+p2p", SEED + 1)),
        ("ulysses-a2a-cp4-ring-learnable-mha", check_ulysses, (4, "ring", "learnable", "a2a", SEED + 2, 4)),
        ("tp2-cp2-striped-learnable", check_tp, ("striped", "learnable", SEED + 4)),
        ("tp2-cp2-zigzag-off-by-one-window", check_tp, ("zigzag", "off-by-one", SEED + 5, None, (5, 0))),
        ("tp2-cp2-a2a-striped-learnable-mha", check_tp, ("striped", "learnable", SEED + 6, "a2a", None, 4)),
        ("tp2-sharded-state-dict", check_tp_sharded_state_dict, ()),
    ]


CASES = _cases()
test_megatron_sinks_split_heads_on_4_ranks = cases_test(4, CASES)
