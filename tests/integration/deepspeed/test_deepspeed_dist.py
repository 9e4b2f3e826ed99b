"""DeepSpeed adapter on 2 gloo ranks (one spawn for the whole module, many cases in it).

* the DistributedAttention drop-in against DeepSpeed's own (Ulysses) on the same inputs;
* a tiny Llama-style transformers model under SP=2 against the unsharded model;
* DeepSpeed engines with sequence_parallel_size=2 (striped, zigzag, ring) against 1;
* errors raise ValueError on every rank without a hang.

DeepSpeed's CPU shared-memory op is never compiled: the setup case calls
``skip_cpu_shm_comm_build()`` before ``deepspeed.init_distributed`` (initialize does it itself).
"""

import os
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_helper import run_cases, check_case
from reference import rel_err

WORLD = 2
SEQ = 24  # tokens of the full sequence: not a power of two, a multiple of 2 * WORLD
_STATE = {}  # per-rank results shared between cases


# ------------------------------------------------------------------------------- helpers


def _setup():
    rank = dist.get_rank()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(dist.get_world_size()),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    import deepspeed
    from striped_sp.deepspeed import skip_cpu_shm_comm_build

    assert skip_cpu_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.utils import logger

    logger.setLevel("WARNING")
    _STATE["group"] = dist.new_group(ranks=list(range(dist.get_world_size())))


def _gather(t):
    parts = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(parts, t.contiguous())
    return parts


def _full(shards, dim, layout):
    from striped_sp import unshard

    return unshard(shards, dim=dim, layout=layout)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class _CausalSDPA(torch.nn.Module):
    """DeepSpeed's local attention: full sequence, local heads, in the given layout."""

    def __init__(self, batch_dim_idx):
        super().__init__()
        self.batch_dim_idx = batch_dim_idx

    def forward(self, q, k, v, *args, **kwargs):
        perm = (1, 2, 0, 3) if self.batch_dim_idx == 1 else (0, 2, 1, 3)  # -> [b, h, s, d]
        back = (2, 0, 1, 3) if self.batch_dim_idx == 1 else (0, 2, 1, 3)
        out = F.scaled_dot_product_attention(*(t.permute(perm) for t in (q, k, v)), is_causal=True, enable_gqa=True)
        return out.permute(back)


def _rotary(seq, dim, batch_dim_idx=1):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(seq).float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    # DeepSpeed permutes (1, 0, 2, 3) and broadcasts against q: [1, S, 1, d] for [s, b, h, d]
    # inputs, [S, 1, 1, d] for [b, s, h, d] inputs (Megatron-DeepSpeed's flash path)
    emb = emb[None, :, None, :] if batch_dim_idx == 1 else emb[:, None, None, :]
    return emb.cos(), emb.sin()


# ------------------------------------------------------- DistributedAttention vs DeepSpeed


def _case_distributed_attention(batch_dim_idx, heads, kv_heads, rotary):
    from deepspeed.sequence.layer import DistributedAttention as DSAttention
    from striped_sp import shard
    from striped_sp.deepspeed import DistributedAttention

    group, rank = _STATE["group"], dist.get_rank()
    b, d = 2, 16
    seq_dim = 1 - batch_dim_idx
    shape = (SEQ, b) if batch_dim_idx == 1 else (b, SEQ)
    q = _randn(*shape, heads, d, seed=1)
    k, v = _randn(*shape, kv_heads, d, seed=2), _randn(*shape, kv_heads, d, seed=3)
    dout = _randn(*shape, heads, d, seed=4)
    emb = _rotary(SEQ, d, batch_dim_idx) if rotary else None

    def run(module, layout, rotary=emb):
        xs = [shard(t, WORLD, rank, dim=seq_dim, layout=layout).requires_grad_() for t in (q, k, v)]
        out = module(*xs, batch_dim_idx, rotary)
        out.backward(shard(dout, WORLD, rank, dim=seq_dim, layout=layout))
        return [out.detach()] + [x.grad for x in xs]

    local = _CausalSDPA(batch_dim_idx)
    theirs = run(DSAttention(local, group, scatter_idx=2, gather_idx=seq_dim), "contiguous")
    ours_striped = run(DistributedAttention(local, group, 2, seq_dim), "striped")
    ours_ring = run(DistributedAttention(local, group, 2, seq_dim, layout="ring"), "contiguous")
    if rotary:  # rotary tables of the local tokens only give the same
        local_emb = tuple(shard(t, WORLD, rank, dim=batch_dim_idx, layout="striped") for t in emb)
        again = run(DistributedAttention(local, group, 2, seq_dim), "striped", local_emb)
        assert all(torch.equal(a, b) for a, b in zip(again, ours_striped))
    for name, t_ds, t_s, t_r in zip(("out", "dq", "dk", "dv"), theirs, ours_striped, ours_ring):
        assert t_ds.shape == t_s.shape == t_r.shape, (name, t_ds.shape, t_s.shape, t_r.shape)
        full_ds = _full(_gather(t_ds), seq_dim, "contiguous")
        err_s = rel_err(_full(_gather(t_s), seq_dim, "striped"), full_ds)
        err_r = rel_err(t_r, t_ds)  # same local inputs: same local rows
        assert err_s < 1e-5 and err_r < 1e-5, f"{name}: striped {err_s:.2e}, ring {err_r:.2e}"


def _case_distributed_attention_uneven_heads():
    """3 query heads, 1 kv head (MQA) on 2 ranks: Ulysses cannot split them; the ring need not."""
    from striped_sp import shard
    from striped_sp.deepspeed import DistributedAttention
    from reference import reference_attention

    rank = dist.get_rank()
    q, k, v = _randn(SEQ, 2, 3, 8, seed=11), _randn(SEQ, 2, 1, 8, seed=12), _randn(SEQ, 2, 1, 8, seed=13)
    xs = [shard(t, WORLD, rank, dim=0).requires_grad_() for t in (q, k, v)]
    out = DistributedAttention(None, _STATE["group"])(*xs, 1)
    full = _full(_gather(out.detach()), 0, "striped")
    ref = reference_attention(*(t.transpose(0, 1) for t in (q, k, v)), causal=True, scale=8**-0.5).transpose(0, 1)
    assert rel_err(full, ref) < 1e-5
    dout = _randn(SEQ, 2, 3, 8, seed=14)
    out.backward(shard(dout, WORLD, rank, dim=0))
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*(t.transpose(0, 1) for t in refs), causal=True, scale=8**-0.5).transpose(0, 1)
    ref.backward(dout.double())
    for name, x, r in zip(("dq", "dk", "dv"), xs, refs):
        err = rel_err(_full(_gather(x.grad), 0, "striped"), r.grad)
        assert err < 1e-5, f"{name}: {err:.2e}"


# ------------------------------------------------------------------- transformers model


def _tiny_llama(seed=0, heads=4, kv_heads=2, kind="llama"):
    """A tiny Llama; ``kind="granite"``: Granite, whose attention scale (``attention_multiplier``)
    is not ``head_dim ** -0.5``."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(
        vocab_size=61, hidden_size=8 * heads, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4 * SEQ,
        attention_dropout=0.0, tie_word_embeddings=False,
    )
    if kind == "granite":
        model = tf.GraniteForCausalLM(tf.GraniteConfig(**common, attention_multiplier=0.9))
        assert model.model.layers[0].self_attn.scaling == 0.9
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    model.set_attn_implementation("sdpa")
    return model


def _batch(b=2, seed=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 61, (b, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100  # row 1 counts from its first token: a wrap-around shift would show
    labels[1, SEQ // 2] = -100  # an ignored target at the shard edge of contiguous / zigzag
    return {"input_ids": ids, "labels": labels}


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _case_hf_model(layout, heads=4, kv_heads=2, kind="llama"):
    from striped_sp.deepspeed import enable_hf_attention, shard_batch

    group, rank = _STATE["group"], dist.get_rank()
    full = _batch()
    ref = _tiny_llama(heads=heads, kv_heads=kv_heads, kind=kind)
    ref_loss = ref(**full).loss
    ref_loss.backward()
    model = enable_hf_attention(_tiny_llama(heads=heads, kv_heads=kv_heads, kind=kind), group, layout)
    out = model(**shard_batch(full, WORLD, rank, layout))
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)  # each rank's loss is its share of the global mean
    assert rel_err(loss, ref_loss.detach()) < 1e-5, (loss.item(), ref_loss.item())
    ref_grads, grads = _grads(ref), _grads(model)
    assert ref_grads.keys() == grads.keys()
    for name, g in grads.items():
        dist.all_reduce(g)  # DeepSpeed sums gradients over the SP group
        err = rel_err(g, ref_grads[name])
        assert err < 1e-5, f"{name}: {err:.2e}"


def _case_hf_unsharded_positions_rejected():
    from striped_sp.deepspeed import enable_hf_attention

    model = enable_hf_attention(_tiny_llama(), _STATE["group"], "striped")
    ids = _batch()["input_ids"][:, : SEQ // WORLD]  # local tokens, but HF's own 0..n-1 positions
    with pytest.raises(ValueError, match="position_ids are not the 'striped' positions"):
        model(input_ids=ids)


def _case_hf_softcap_kernel_refused():
    """Gemma 2's soft-capping on a backend that cannot soft-cap (PyTorch's SDPA ops) is refused naming the
    kernel and those that can (on the kernels that can: tests/integration/deepspeed/test_hf_softcap.py)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from striped_sp import positions
    from striped_sp.deepspeed import enable_hf_attention

    cfg = Gemma2Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1, head_dim=8,
                       num_attention_heads=4, num_key_value_heads=2, sliding_window=4, attn_logit_softcapping=50.0)
    model = enable_hf_attention(Gemma2ForCausalLM(cfg), _STATE["group"], "striped", backend="torch")
    n = SEQ // WORLD
    ids = _batch()["input_ids"][:, :n]
    pos = positions(SEQ, WORLD, dist.get_rank(_STATE["group"])).expand(ids.size(0), -1)
    with pytest.raises(ValueError, match=r"softcap=50.0: backend 'torch' cannot soft-cap logits .*kernels that can: "
                                         r"\['flash_attn', 'fa4', 'math'\]"):
        model(input_ids=ids, position_ids=pos)


def _case_hf_padding_mask_rejected():
    from striped_sp import positions
    from striped_sp.deepspeed import enable_hf_attention

    model = enable_hf_attention(_tiny_llama(), _STATE["group"], "striped")
    n = SEQ // WORLD
    ids = _batch()["input_ids"][:, :n]
    pos = positions(SEQ, WORLD, dist.get_rank(_STATE["group"])).expand(ids.size(0), -1)
    mask = torch.ones_like(ids)
    model(input_ids=ids, position_ids=pos, attention_mask=mask)  # all valid: accepted
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="padding.*shard_batch"):  # the sharded batch carries no mask
        model(input_ids=ids, position_ids=pos, attention_mask=mask)


def _case_engine_refuses_unshifted_labels():
    from striped_sp import positions, shard
    from striped_sp.deepspeed import initialize

    model = _tiny_llama()
    engine, _, _, _ = initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 config=_ds_config(2))
    rank = dist.get_rank(engine.context_parallel_group)
    full = _batch()
    local = {k: shard(v, WORLD, rank) for k, v in full.items()}
    local["position_ids"] = positions(SEQ, WORLD, rank).expand(2, -1)
    with pytest.raises(ValueError, match="labels without shift_labels"):
        engine(**local)


# ------------------------------------------------------------------------ DeepSpeed engine


def _ds_config(sp, algo="striped"):
    return {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6, "zero_optimization": {"stage": 0},
        "sequence_parallel_size": sp, "context_parallel": {"algo": algo},
    }


def _engine_step(sp, algo, drop_count=False):
    from striped_sp.deepspeed import initialize, shard_batch

    model = _tiny_llama(seed=1)
    engine, opt, _, _ = initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                   config=_ds_config(sp, algo))
    layout = engine.context_parallel.layout
    n = sp
    rank = dist.get_rank(engine.context_parallel_group) if sp > 1 else 0
    batch = shard_batch(_batch(), n, rank, layout)
    if drop_count:  # a data path of the user's own: the pre-hook counts the targets itself
        del batch["num_items_in_batch"]
    loss = engine(**batch).loss
    engine.backward(loss)
    grads = _grads(engine.module)
    engine.step()
    params = {n_: p.detach().clone() for n_, p in engine.module.named_parameters()}
    return loss.detach(), grads, params


def _case_engine_sp1():
    # world 2, SP 1: two data-parallel replicas on the same batch = one process on it
    _STATE["engine_ref"] = _engine_step(1, "striped")


def _case_engine_sp2(algo, drop_count=False):
    ref_loss, ref_grads, ref_params = _STATE["engine_ref"]
    loss, grads, params = _engine_step(2, algo, drop_count)
    assert rel_err(loss, ref_loss) < 1e-5, (loss.item(), ref_loss.item())
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) < 1e-5, name
        assert rel_err(params[name], ref_params[name]) < 1e-5, name


def _case_engine_loader_and_swap():
    from deepspeed.sequence.layer import DistributedAttention as DSAttention
    from striped_sp import positions
    from striped_sp.deepspeed import DistributedAttention, initialize

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            ids = torch.arange(SEQ) + i
            return {"input_ids": ids, "labels": ids.clone()}

    class Block(torch.nn.Module):  # Megatron-DeepSpeed style: a Ulysses attention inside
        def __init__(self, group):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)
            self.attn = DSAttention(_CausalSDPA(0), group, 2, 1)

    model = Block(_STATE["group"])
    engine, _, loader, _ = initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=_ds_config(2, "zigzag"), training_data=Data())
    assert isinstance(engine.module.attn, DistributedAttention) and engine.module.attn.layout == "zigzag"
    rank = dist.get_rank(engine.context_parallel_group)
    # without training_data, the user's own data path must shard in the layout: say so
    other = Block(_STATE["group"])
    with pytest.warns(UserWarning, match="shard_batch"):
        initialize(model=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
                   config=_ds_config(2, "zigzag"))
    # a layout whose ranks hold contiguous slices (Layout.contiguous_slices: ring) needs no warning
    ring = Block(_STATE["group"])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*shard_batch")
        initialize(model=ring, optimizer=torch.optim.SGD(ring.parameters(), lr=0.1), config=_ds_config(2, "ring"))
    batches = list(loader)
    assert len(batches) == 3  # one data-parallel replica: every sample, micro-batch 2
    for batch in batches:
        pos = positions(SEQ, WORLD, rank, "zigzag")
        assert torch.equal(batch["position_ids"][0], pos)
        first = batch["input_ids"][:, 0] - pos[0]  # sample offsets
        assert torch.equal(batch["shift_labels"][0], torch.where(pos + 1 < SEQ, pos + 1 + first[0], -100))


def _case_engine_dp2_sp2(algo):
    """4 ranks: 2 data-parallel replicas x SP 2, through initialize's loader, against one process."""
    from striped_sp.deepspeed import initialize

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            row = _batch(b=2, seed=7)
            return {"input_ids": row["input_ids"][i], "labels": row["labels"][i], "idx": torch.tensor(i)}

    data = Data()
    ref_losses, ref_grads = [], {}
    for i in range(2):  # the reference: each sample alone, unsharded, gradients averaged
        ref = _tiny_llama(seed=2)
        sample = {k: v[None] for k, v in data[i].items() if k != "idx"}
        loss = ref(**sample).loss
        loss.backward()
        ref_losses.append(loss.detach())
        for name, g in _grads(ref).items():
            ref_grads[name] = ref_grads.get(name, 0) + g / 2
    model = _tiny_llama(seed=2)
    cfg = dict(_ds_config(2, algo), train_micro_batch_size_per_gpu=1)
    engine, _, loader, _ = initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                      config=cfg, training_data=data)
    (batch,) = list(loader)
    idx = int(batch.pop("idx"))
    seen = [torch.empty(1, dtype=torch.int64) for _ in range(4)]
    dist.all_gather(seen, torch.tensor([idx]))
    rank = dist.get_rank()
    assert seen[rank ^ 1].item() == idx and seen[rank ^ 2].item() != idx, seen  # SP pairs share a sample
    loss = engine(**batch).loss
    engine.backward(loss)
    assert rel_err(loss.detach(), ref_losses[idx]) < 1e-5
    for name, g in _grads(engine.module).items():
        assert rel_err(g, ref_grads[name]) < 1e-5, name


def _case_engine_calibrate_dp2_sp2():
    """context_parallel.calibrate on 2 data-parallel replicas x SP 2: one model, timed on rank 0 and
    adopted by all four ranks (not one per SP group), measured for the kernel that runs."""
    from striped_sp.deepspeed import initialize
    from striped_sp.plan import cost

    model = _tiny_llama(seed=3)
    cfg = _ds_config(2, "striped")
    cfg["context_parallel"]["calibrate"] = True
    try:
        initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
        adopted = cost.default_model()
        assert adopted.measured and adopted.label == "torch@cpu", adopted
        assert adopted.ns_per_entry > 0, adopted  # a timing, not an untimed all-zero model every rank agrees on
        mine = torch.tensor([adopted.ns_per_entry, adopted.causal_waste, adopted.call_ns], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(4)]
        dist.all_gather(every, mine)
        assert all(torch.equal(e, every[0]) for e in every), every
    finally:
        cost.use_model(None)


# -------------------------------------------------------------------------------- errors


def _case_errors():
    from striped_sp.deepspeed import DistributedAttention, initialize

    model = _tiny_llama()
    with pytest.raises(ValueError, match=r"sequence_parallel_size=3 must divide the world size \(2\)"):
        initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=_ds_config(3))
    with pytest.raises(ValueError, match="context_parallel.algo"):
        initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                   config=_ds_config(2, "ulysses"))
    da = DistributedAttention(None, _STATE["group"], layout="zigzag")
    q = torch.randn(3, 2, 4, 8)  # 3 local tokens: zigzag needs an even count
    with pytest.raises(ValueError, match="local sequence length 3"):
        da(q, q, q, 1)
    dist.barrier()  # nobody hangs


CASES = [("setup", _setup, ())]
for _bdi, _h, _kv, _rot in [(1, 4, 4, False), (1, 4, 2, True), (0, 4, 2, False), (0, 4, 4, True)]:
    CASES.append((f"attention_bdi{_bdi}_h{_h}_kv{_kv}_rot{int(_rot)}", _case_distributed_attention, (_bdi, _h, _kv, _rot)))
CASES += [("attention_uneven_heads", _case_distributed_attention_uneven_heads, ())]
CASES += [(f"hf_{lay}", _case_hf_model, (lay,)) for lay in ("striped", "zigzag", "contiguous")]
CASES += [("hf_striped_mqa_3_heads", _case_hf_model, ("striped", 3, 1))]
CASES += [("hf_granite_scale", _case_hf_model, ("zigzag", 4, 2, "granite"))]
CASES += [("hf_positions", _case_hf_unsharded_positions_rejected, ())]
CASES += [("hf_softcap_kernel", _case_hf_softcap_kernel_refused, ())]
CASES += [("hf_padding_mask", _case_hf_padding_mask_rejected, ())]
CASES += [("engine_sp1", _case_engine_sp1, ())]  # before any SP=2 engine (DeepSpeed keeps groups.mpu)
CASES += [(f"engine_sp2_{algo}", _case_engine_sp2, (algo,)) for algo in ("striped", "zigzag", "ring")]
CASES += [("engine_sp2_striped_no_count", _case_engine_sp2, ("striped", True))]
CASES += [("engine_loader_swap", _case_engine_loader_and_swap, ()), ("errors", _case_errors, ())]
CASES += [("engine_unshifted_labels", _case_engine_refuses_unshifted_labels, ())]


CASES4 = [("setup", _setup, ()), ("engine_calibrate_dp2_sp2", _case_engine_calibrate_dp2_sp2, ()),
          ("engine_dp2_sp2_striped", _case_engine_dp2_sp2, ("striped",))]


@pytest.fixture(scope="module")
def results():
    return run_cases(WORLD, CASES, timeout_s=400)


@pytest.fixture(scope="module")
def results4():
    return run_cases(4, CASES4, timeout_s=400)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_deepspeed_case(results, name):
    check_case(results, name)


@pytest.mark.parametrize("name", [c[0] for c in CASES4])
def test_deepspeed_case_4_ranks(results4, name):
    check_case(results4, name)
