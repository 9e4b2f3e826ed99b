"""Megatron-core's attention sinks (``--softmax-type learnable`` / ``off-by-one``) under our layouts.

* On 4 gloo ranks: a megatron-core GPT (RoPE, GQA) at CP=2 (striped, zigzag, ring) against CP=1
  with an independent float64 core attention that appends the sink logit as one more softmax column
  (as megatron-core's ``SoftmaxOne``), on loss and every gradient, ``softmax_offset``'s included;
  dense rows, a window on every other layer (``window_size``, ``window_attn_skip_freq=2``) and
  packed THD rows (``--sft``-style ``cu_seqlens``).
* In one process: the core attention's state dict (keys, shapes), its sharded state dict keys and
  ``softmax_offset``'s attributes equal those of megatron-core's own ``DotProductAttention`` for
  the same config, and checkpoints load strictly both ways; the setup line names the sinks.

Seen failing with the sink gradient dropped (the engine's ``sink_grad`` returning zeros): every
learnable case, on ``core_attention.softmax_offset`` alone.
"""

import itertools
import logging

import pytest
import torch

from dist_helper import run_cases
from megatron_reference import compare, document_mask, setup_groups
from seeds import seed_for

pytest.importorskip("megatron.core")

SEED = seed_for(__name__)
VOCAB = 48
WINDOW = (5, 0)
DOCS = [13, 3, 9, 1, 6, 8]  # 40 tokens


class SinkReferenceCoreAttention(torch.nn.Module):
    """Float64 softmax attention with one extra logit per head (no value), nothing from striped_sp:
    causal, the boolean ``attention_mask`` (``True`` = masked) and a left window."""

    def __init__(self, window, offset):
        super().__init__()
        self.window = window
        if isinstance(offset, torch.nn.Parameter):
            self.softmax_offset = torch.nn.Parameter(offset.detach().clone())
        else:
            self.softmax_offset = offset.clone()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            out = self.forward(*(t.unsqueeze(1) for t in (query, key, value)), document_mask(bounds, query.size(0)))
            return out[:, 0]
        s = query.size(0)
        q, k, v = (t.double().permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        g = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        scores = q @ k.transpose(-1, -2) / q.size(-1) ** 0.5
        i = torch.arange(s)
        hidden = (i[None, :] > i[:, None]).expand(q.size(0), 1, s, s)
        if attention_mask is not None:
            hidden = hidden | attention_mask
        if self.window is not None:
            hidden = hidden | (i[None, :] < i[:, None] - self.window[0])
        scores = scores.masked_fill(hidden, float("-inf"))
        sink = self.softmax_offset.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        out = (probs @ v).to(query.dtype).permute(2, 0, 1, 3)
        return out.reshape(s, out.size(1), -1)


def _use_sink_reference(model, config):
    count = 0
    for _, module in list(model.named_modules()):
        if hasattr(module, "core_attention"):
            layer = module.core_attention.layer_number
            window = config.window_size
            if window is not None and layer % config.window_attn_skip_freq == 0:
                window = None
            module.core_attention = SinkReferenceCoreAttention(window, module.core_attention.softmax_offset)
            count += 1
    assert count


def _models(cp, algo, softmax_type, window, seed):
    env = setup_groups()
    import striped_sp.megatron as sm
    from striped_sp.megatron.toy import tiny_gpt

    sm.install(algo)
    common = dict(vocab_size=VOCAB, max_seq_len=128, hidden=32, heads=4, kv_heads=2, layers=2, seed=seed,
                  softmax_type=softmax_type, init_std=0.3)
    if window is not None:
        common.update(window_size=window, window_attn_skip_freq=2)  # layer 2: full attention
    ref = tiny_gpt(env[1], algo, **common)
    _use_sink_reference(ref, ref.config)
    model = tiny_gpt(env[cp], algo, **common)
    if softmax_type == "learnable":  # sinks large enough to matter (init std 0.3 gives small ones)
        gen = torch.Generator().manual_seed(seed + 5)
        for a, b in zip(ref.decoder.layers, model.decoder.layers):
            value = torch.randn(4, generator=gen) * 2
            with torch.no_grad():
                for layer in (a, b):
                    layer.self_attention.core_attention.softmax_offset.copy_(value)
    return ref, model, env[cp]


def check_dense(cp, algo, softmax_type, window, seed):
    import striped_sp.megatron as sm

    ref, model, group = _models(cp, algo, softmax_type, window, seed)
    seq = 40
    gen = torch.Generator().manual_seed(seed + 1)
    tokens, labels = (torch.randint(0, VOCAB, (1, seq), generator=gen) for _ in range(2))
    pos = torch.arange(seq)[None]
    ref_loss = ref(tokens, pos, None, labels=labels).sum()
    ref_loss.backward()
    local = sm.get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels, "position_ids": pos}, algo,
                                         cp_group=group)
    loss = model(local["tokens"], local["position_ids"], None, labels=local["labels"]).sum()
    loss.backward()
    _check_sink_grads(model, softmax_type)
    compare(model, ref, loss, ref_loss, group, seed)


def check_thd(cp, algo, softmax_type, window, seed):
    import striped_sp.megatron as sm

    ref, model, group = _models(cp, algo, softmax_type, window, seed)
    bounds = list(itertools.accumulate(DOCS, initial=0))
    total = bounds[-1]
    gen = torch.Generator().manual_seed(seed + 1)
    tokens, labels = (torch.randint(0, VOCAB, (1, total), generator=gen) for _ in range(2))
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]
    out = ref(tokens, pos, document_mask(bounds, total), labels=labels)
    ref_loss = out.sum()
    ref_loss.backward()
    cu = torch.tensor(bounds, dtype=torch.int32)
    batch = {"tokens": tokens, "labels": labels, "position_ids": pos, "loss_mask": torch.ones(1, total)}
    local, params = sm.get_thd_batch_on_this_cp_rank(batch, cu, None, torch.tensor([max(DOCS)], dtype=torch.int32),
                                                     algo=algo, cp_group=group)
    loss = model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                 packed_seq_params=params).sum()
    loss.backward()
    _check_sink_grads(model, softmax_type)
    compare(model, ref, loss, ref_loss, group, seed)


def _check_sink_grads(model, softmax_type):
    offsets = [layer.self_attention.core_attention.softmax_offset for layer in model.decoder.layers]
    if softmax_type == "learnable":
        assert all(isinstance(o, torch.nn.Parameter) and o.grad is not None for o in offsets)
    else:
        assert all(not isinstance(o, torch.nn.Parameter) and torch.equal(o, torch.zeros(4)) for o in offsets)


def _cases():
    cases = []
    for algo, softmax_type in itertools.product(["striped", "zigzag", "ring"], ["learnable", "off-by-one"]):
        cases.append((f"dense-cp2-{algo}-{softmax_type}", check_dense, (2, algo, softmax_type, None, SEED)))
    for algo in ("striped", "zigzag"):
        cases.append((f"dense-cp2-{algo}-learnable-window", check_dense, (2, algo, "learnable", WINDOW, SEED + 1)))
    cases.append(("dense-cp4-striped-learnable-window", check_dense, (4, "striped", "learnable", WINDOW, SEED + 2)))
    cases.append(("thd-cp2-striped-learnable", check_thd, (2, "striped", "learnable", None, SEED + 3)))
    cases.append(("thd-cp2-striped-learnable-window", check_thd, (2, "striped", "learnable", WINDOW, SEED + 4)))
    cases.append(("thd-cp4-ring-off-by-one-window", check_thd, (4, "ring", "off-by-one", WINDOW, SEED + 5)))
    return cases


CASES = _cases()
_results = {}


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_megatron_sinks_on_4_ranks(name):
    if not _results:
        _results.update(run_cases(4, CASES))
    err = _results[name]
    assert err is None, err


# ---------------------------------------------------------------- one process: checkpoints, setup line

@pytest.fixture
def megatron_world(world_of_one, monkeypatch):
    from megatron.core import parallel_state

    import striped_sp.megatron as sm

    if not torch.cuda.is_available():  # Megatron's own DotProductAttention puts softmax_offset there
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    parallel_state.initialize_model_parallel()
    try:
        yield world_of_one
    finally:
        sm.uninstall()
        parallel_state.destroy_model_parallel()


def _attrs(p):
    names = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel", "allreduce",
             "shared", "is_embedding_or_output_parameter")
    return {n: getattr(p, n) for n in names if hasattr(p, n)}


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one", "vanilla"])
def test_checkpoints_move_between_native_and_ours(megatron_world, softmax_type):
    """The GPT's state dict under ``install()`` has the keys and shapes of megatron-core's own
    (unpatched) build, ``softmax_offset`` included (learnable) or absent (off-by-one, vanilla); the
    same seed gives the same weights; strict loading works both ways; the core attentions' sharded
    state dicts hold the same keys; the parameter carries Megatron's attributes."""
    import striped_sp.megatron as sm
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from striped_sp.megatron.attention import ContextParallelAttention
    from striped_sp.megatron.toy import tiny_gpt

    kw = dict(vocab_size=VOCAB, heads=4, kv_heads=2, seed=3, softmax_type=softmax_type)
    native = tiny_gpt(megatron_world, spec=get_gpt_layer_local_spec(), **kw)
    assert isinstance(native.decoder.layers[0].self_attention.core_attention, DotProductAttention)
    sm.install("striped")
    ours = tiny_gpt(megatron_world, "striped", **kw)
    assert isinstance(ours.decoder.layers[0].self_attention.core_attention, ContextParallelAttention)
    a, b = native.state_dict(), ours.state_dict()
    assert {k: tuple(v.shape) for k, v in a.items() if torch.is_tensor(v)} == \
        {k: tuple(v.shape) for k, v in b.items() if torch.is_tensor(v)}
    assert a.keys() == b.keys()
    key = "decoder.layers.0.self_attention.core_attention.softmax_offset"
    assert (key in a) == (softmax_type == "learnable")
    for name, value in a.items():
        if torch.is_tensor(value):
            assert torch.equal(value, b[name]), name  # the same draws at the same points
    for layer_a, layer_b in zip(native.decoder.layers, ours.decoder.layers):
        ca, cb = layer_a.self_attention.core_attention, layer_b.self_attention.core_attention
        if softmax_type == "vanilla":
            assert ca.softmax_offset is None and cb.softmax_offset is None
        else:
            assert cb.softmax_offset.shape == ca.softmax_offset.shape == (4,)
            assert cb.softmax_offset.dtype == ca.softmax_offset.dtype
            assert type(cb.softmax_offset) is type(ca.softmax_offset)
            assert _attrs(cb.softmax_offset) == _attrs(ca.softmax_offset)
        meta = {"dp_cp_group": megatron_world}
        sa, sb = ca.sharded_state_dict("p.", (), meta), cb.sharded_state_dict("p.", (), meta)
        assert sa.keys() == sb.keys()
        for name in sa:
            assert (sa[name].key, sa[name].global_shape, sa[name].axis_fragmentations) == \
                (sb[name].key, sb[name].global_shape, sb[name].axis_fragmentations)
    ours.load_state_dict(a, strict=True)
    native.load_state_dict(b, strict=True)
    if softmax_type == "learnable":  # a changed value travels
        with torch.no_grad():
            ours.decoder.layers[1].self_attention.core_attention.softmax_offset.add_(1.5)
        native.load_state_dict(ours.state_dict(), strict=True)
        assert torch.equal(native.state_dict()[key.replace("layers.0", "layers.1")],
                           ours.decoder.layers[1].self_attention.core_attention.softmax_offset.detach())


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one", "vanilla"])
def test_the_setup_line_names_the_sinks(megatron_world, caplog, softmax_type):
    import striped_sp.megatron as sm
    from striped_sp.megatron.toy import tiny_gpt

    caplog.set_level(logging.INFO, logger="striped_sp.megatron")
    sm.install("striped")
    tiny_gpt(megatron_world, "striped", softmax_type=softmax_type)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "striped_sp.megatron"]
    if softmax_type == "vanilla":
        assert "sinks" not in line, line
    else:
        assert line.endswith(f"; sinks {softmax_type}"), line
