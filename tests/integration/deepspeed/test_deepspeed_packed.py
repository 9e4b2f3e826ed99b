"""DeepSpeed / Hugging Face adapter on 2 gloo ranks: packed rows, padded rows, sliding windows.

One spawn for the module, many cases.  Every reference is a *plain* transformers model (eager
attention, no plugin) on one process over the full batch, in float64 (the DeepSpeed engine case in
float32); SP=2 must equal it on the loss and every gradient:

* packed rows as ``DataCollatorWithFlattening`` makes them (7 documents of uneven lengths, two
  shorter than the SP size), every layout;
* right-padded rows of an ordinary padded batch (3 rows; the row length fits no layout);
* sliding-window models: Mistral (every layer) and Qwen2 with alternating sliding / full layers
  (``config.layer_types``), plain, packed and padded;
* a DeepSpeed engine step through ``initialize``'s loader with the flattening collator;
* the ``DistributedAttention`` drop-in with documents and a window against a float64 reference;
* bad input raising ``ValueError`` on every rank, no hang.
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
import torch.distributed as dist

from dist_helper import run_cases, check_case
from reference import rel_err

WORLD = 2
DOCS = [7, 1, 12, 3, 9, 1, 6]  # 39 tokens: odd, and two documents shorter than WORLD
VOCAB = 61
_STATE = {}


def _setup():
    rank = dist.get_rank()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(dist.get_world_size()),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    import deepspeed
    from striped_sp.deepspeed import skip_cpu_shm_comm_build

    skip_cpu_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.utils import logger

    logger.setLevel("WARNING")
    _STATE["group"] = dist.new_group(ranks=list(range(dist.get_world_size())))


# --------------------------------------------------------------------------------- models


def _model(kind, seed=0, dtype=torch.float64):
    """A tiny transformers model with eager attention (the plain reference), GQA, 2 layers."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  attention_dropout=0.0, tie_word_embeddings=False)
    if kind == "llama":
        cfg = tf.LlamaConfig(**common)
        cls = tf.LlamaForCausalLM
    elif kind == "mistral":  # a window of 5 in every layer
        cfg = tf.MistralConfig(**common, sliding_window=5)
        cls = tf.MistralForCausalLM
    elif kind == "qwen2":  # layer 0 slides with a window of 4, layer 1 attends to everything
        cfg = tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=4,
                             layer_types=["sliding_attention", "full_attention"])
        cls = tf.Qwen2ForCausalLM
    else:
        raise AssertionError(kind)
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    model.set_attn_implementation("eager")
    return model


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_against(ref, ref_loss, model, loss, tol=1e-6):
    # transformers' eager attention takes its softmax in float32 even for float64 models: the
    # reference is good to ~1e-7 (a wrong mask or target is off by 1e-3 or more)
    """SP loss (each rank its share) and gradients (summed over the group) equal the reference."""
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    assert rel_err(loss, ref_loss.detach()) < tol, (loss.item(), ref_loss.item())
    ref_grads, grads = _grads(ref), _grads(model)
    assert ref_grads.keys() == grads.keys() and len(grads) > 0
    for name, g in grads.items():
        dist.all_reduce(g)
        err = rel_err(g, ref_grads[name])
        assert err < tol, f"{name}: {err:.2e}"


# ---------------------------------------------------------------------------------- batches


def _features(lengths=DOCS, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()} for n in lengths]


def _flattened(flash_kwargs=True, lengths=DOCS):
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(_features(lengths))


def _padded(b=3, seq=13, seed=9, pad_from=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    mask[2, pad_from:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _plain(b=2, seq=24, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, seq), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100
    return {"input_ids": ids, "labels": labels}


def _reference(kind, batch, dtype=torch.float64):
    ref = _model(kind, dtype=dtype)
    # use_cache=False: with a cache transformers does not split a packed row into its documents
    loss = ref(**{k: v for k, v in batch.items() if not k.startswith(("cu_", "max_"))}, use_cache=False).loss
    loss.backward()
    return ref, loss


# ------------------------------------------------------------------------- HF model cases


def _case_reference_is_per_document():
    """The packed eager reference equals each document run on its own (the reference is sound)."""
    full = _flattened()
    _, loss = _reference("mistral", full)
    total, count = 0.0, 0
    ref = _model("mistral")
    for f in _features():
        ids = torch.tensor([f["input_ids"]])
        if ids.size(1) > 1:
            total = total + ref(input_ids=ids, labels=ids).loss * (ids.size(1) - 1)
            count += ids.size(1) - 1
    assert rel_err(loss.detach(), total.detach() / count) < 1e-6


def _case_hf(kind, data, layout, sp_labels="same"):
    """SP=2 with the ring engine against the plain eager model on the full batch."""
    from striped_sp.deepspeed import enable_hf_attention, shard_batch

    group, rank = _STATE["group"], dist.get_rank()
    full = {"packed": _flattened, "packed_positions": lambda: _flattened(False),
            "padded": _padded, "plain": _plain,
            # transformers' eager attention gives NaN for a padding query with no real key in its
            # window: the windowed reference keeps the padding shorter than the window
            "padded_short": lambda: _padded(pad_from=10)}[data]()
    ref, ref_loss = _reference(kind, full)
    mine = dict(full)
    if sp_labels == "raw":  # labels = input_ids (no separator / no -100 on padding): still exact
        mine["labels"] = full["input_ids"].clone()
    model = enable_hf_attention(_model(kind), group, layout)
    batch = shard_batch(mine, WORLD, rank, layout)
    out = model(**batch)
    out.loss.backward()
    _check_against(ref, ref_loss, model, out.loss)


def _case_engine_packed(algo):
    """A DeepSpeed engine step (SGD) through initialize's loader with DataCollatorWithFlattening.
    ``algo``: the config's algo, or a whole ``context_parallel`` section (a dict)."""
    from transformers import DataCollatorWithFlattening

    from striped_sp.deepspeed import initialize

    lr = 0.5
    data = _features()
    model = _model("mistral", seed=1, dtype=torch.float32)
    cfg = {"train_micro_batch_size_per_gpu": len(data), "gradient_accumulation_steps": 1,
           "steps_per_print": 10**6, "zero_optimization": {"stage": 0},
           "gradient_clipping": 0.0, "sequence_parallel_size": WORLD,
           "context_parallel": dict(algo) if isinstance(algo, dict) else {"algo": algo}}
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    engine, _, loader, _ = initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                                      config=cfg, training_data=data, collate_fn=collator)
    order = list(loader.sampler)
    (batch,) = list(loader)
    loss = engine(**batch).loss
    engine.backward(loss)
    grads = _grads(engine.module)
    engine.step()
    ref = _model("mistral", seed=1, dtype=torch.float32)
    full = collator([data[i] for i in order])
    ref_loss = ref(**{k: v for k, v in full.items() if not k.startswith(("cu_", "max_"))}, use_cache=False).loss
    ref_loss.backward()
    assert rel_err(loss.detach(), ref_loss.detach()) < 1e-5, (loss.item(), ref_loss.item())
    ref_params = dict(ref.named_parameters())
    for name, g in grads.items():
        assert rel_err(g, ref_params[name].grad) < 1e-5, (name, rel_err(g, ref_params[name].grad))
    for name, p in engine.module.named_parameters():
        expected = ref_params[name].detach() - lr * ref_params[name].grad
        assert rel_err(p.detach(), expected) < 1e-5, (name, rel_err(p.detach(), expected), rel_err(p.detach(), ref_params[name].detach()))


# ------------------------------------------------------------------ DistributedAttention drop-in


def _case_distributed_attention(layout, batch_dim_idx):
    from reference import reference_attention

    from striped_sp import pad_documents, shard, unshard
    from striped_sp.deepspeed import DistributedAttention

    rank = dist.get_rank()
    pad = pad_documents([0, *torch.tensor(DOCS).cumsum(0).tolist()], WORLD, layout)
    cu = pad.cu_seqlens
    g = torch.Generator().manual_seed(21)
    q, k, v, dout = (torch.randn(1, pad.seq_len, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    seq_dim = 1 - batch_dim_idx

    def local(t):
        t = shard(t, WORLD, rank, dim=1, layout=layout, cu_seqlens=cu)
        return (t.transpose(0, 1) if batch_dim_idx == 1 else t).contiguous().requires_grad_()

    xs = [local(t) for t in (q, k, v)]
    da = DistributedAttention(None, _STATE["group"], layout=layout, sliding_window=4)
    out = da(*xs, batch_dim_idx, cu_seqlens=cu)
    out.backward(local(dout).detach())
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_in, causal=True, scale=8**-0.5, cu_seqlens=cu.tolist(), window_size=(3, 0))
    ref.backward(dout)
    for got, want in zip([out, *(x.grad for x in xs)], [ref, *(t.grad for t in ref_in)]):
        got = got.detach()
        got = got.transpose(0, 1) if batch_dim_idx == 1 else got
        parts = [torch.empty_like(got) for _ in range(WORLD)]
        dist.all_gather(parts, got.contiguous())
        full = unshard(parts, dim=1, layout=layout, cu_seqlens=cu)
        real = pad.unpad(full), pad.unpad(want.detach())
        assert rel_err(*real) < 1e-6, (layout, batch_dim_idx, rel_err(*real))  # the CPU op's lse is float32
    assert seq_dim in (0, 1)


# ---------------------------------------------------------------------------------- errors


def _case_errors():
    from striped_sp.deepspeed import DistributedAttention, enable_hf_attention, hf_attention_forward, shard_batch

    group, rank = _STATE["group"], dist.get_rank()
    model = enable_hf_attention(_model("mistral"), group, "striped")
    batch = shard_batch(_flattened(), WORLD, rank, "striped")
    # packed positions without the boundaries: the model would attend across documents
    without_cu = {k: v for k, v in batch.items() if not k.startswith(("cu_", "max_"))}
    with pytest.raises(ValueError, match="position_ids are not the 'striped' positions"):
        model(**without_cu)
    # the local slice of an unsharded packed batch: per-document positions, but not this rank's
    full = _flattened()
    n = full["input_ids"].size(1) // WORLD * WORLD
    sliced = {"input_ids": full["input_ids"][:, :n // WORLD], "position_ids": full["position_ids"][:, :n // WORLD],
              "cu_seq_lens_q": torch.tensor([0, 7, 8, 20, 23, 32, 33, n], dtype=torch.int32)}
    sliced["cu_seq_lens_k"] = sliced["cu_seq_lens_q"]
    with pytest.raises(ValueError, match="position_ids are not the 'striped' positions inside the documents"):
        model(**sliced)
    # boundaries that differ across the ranks: every rank raises (opt-in cross-rank check)
    other = dict(batch)
    if rank == 1:
        other["cu_seq_lens_q"] = other["cu_seq_lens_k"] = batch["cu_seq_lens_q"].clone().index_fill(0, torch.tensor([1]), 6)
    os.environ["STRIPED_SP_CHECK_RANKS"] = "1"
    try:
        with pytest.raises(ValueError, match="another rank|different arguments|position_ids"):
            model(**other)
    finally:
        del os.environ["STRIPED_SP_CHECK_RANKS"]
    # ranks that load different micro-batches: the loader's opt-in check raises on every rank
    from striped_sp.deepspeed import ShardedDataLoader

    batches = [_flattened(), _flattened(lengths=DOCS[::-1] if rank == 1 else DOCS)]
    loader = ShardedDataLoader(batches, group, "striped", check_ranks=True)
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError, match=r"different micro-batches \(ranks \[1\]"):
        next(it)
    q = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    kv = torch.randn(1, 2, 8, 8, dtype=torch.float64)

    class Layer(torch.nn.Module):
        layer_idx, is_causal = 1, True

    with pytest.raises(ValueError, match=r"softcap=-30.0 must be None, 0 \(off\) or a positive finite float"):
        hf_attention_forward(Layer(), q, kv, kv, None, softcap=-30.0)
    with pytest.raises(ValueError, match=r"sinks has shape \(3,\): expected \[4\]"):  # s_aux: one per query head
        hf_attention_forward(Layer(), q, kv, kv, None, s_aux=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="sliding_window=4 on a non-causal"):
        hf_attention_forward(Layer(), q, kv, kv, None, is_causal=False, sliding_window=4)
    with pytest.raises(ValueError, match="sliding_window=0"):
        hf_attention_forward(Layer(), q, kv, kv, None, sliding_window=0)
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k differ"):
        hf_attention_forward(Layer(), q, kv, kv, None, cu_seq_lens_q=torch.tensor([0, 4, 16]),
                             cu_seq_lens_k=torch.tensor([0, 6, 16]))
    with pytest.raises(ValueError, match="window_size=.* or sliding_window=.*not both"):
        DistributedAttention(None, group, window_size=(3, 0), sliding_window=4)
    with pytest.raises(ValueError, match="right must be 0"):
        DistributedAttention(None, group, window_size=(3, 2))
    da = DistributedAttention(None, group, layout="zigzag")
    x = torch.randn(1, 8, 2, 8)
    with pytest.raises(ValueError, match="multiple of 2 \\* world_size"):
        da(x, x, x, 0, cu_seqlens=[0, 6, 16])  # zigzag documents must be padded (shard_batch does)
    dist.barrier()  # nobody hangs


CASES = [("setup", _setup, ()), ("reference_is_per_document", _case_reference_is_per_document, ())]
for _lay in ("striped", "zigzag", "contiguous"):
    CASES.append((f"llama_packed_{_lay}", _case_hf, ("llama", "packed", _lay, "raw")))
    CASES.append((f"llama_padded_{_lay}", _case_hf, ("llama", "padded", _lay, "raw")))
    CASES.append((f"mistral_window_{_lay}", _case_hf, ("mistral", "plain", _lay)))
CASES += [
    ("llama_packed_positions_only", _case_hf, ("llama", "packed_positions", "striped")),
    ("mistral_window_packed_striped", _case_hf, ("mistral", "packed", "striped")),
    ("mistral_window_padded_zigzag", _case_hf, ("mistral", "padded_short", "zigzag", "raw")),
    ("qwen2_layer_types_packed_striped", _case_hf, ("qwen2", "packed", "striped", "raw")),
    ("qwen2_layer_types_packed_zigzag", _case_hf, ("qwen2", "packed_positions", "zigzag")),
    ("qwen2_layer_types_plain_contiguous", _case_hf, ("qwen2", "plain", "contiguous")),
]
CASES += [(f"drop_in_{lay}_bdi{bdi}", _case_distributed_attention, (lay, bdi))
          for lay, bdi in (("striped", 1), ("zigzag", 0), ("contiguous", 0))]
CASES += [("errors", _case_errors, ())]
CASES += [(f"engine_packed_{algo}", _case_engine_packed, (algo,)) for algo in ("striped", "zigzag")]


@pytest.fixture(scope="module")
def results():
    return run_cases(WORLD, CASES, timeout_s=400)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_deepspeed_packed_case(results, name):
    check_case(results, name)
