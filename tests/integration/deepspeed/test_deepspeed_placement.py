"""``context_parallel.stripe_size`` / ``doc_placement`` through the DeepSpeed / Hugging Face adapter.

SP=2 on 2 gloo ranks against a plain transformers model (eager attention, float64, one process,
full batch) on the loss and every gradient, with striped layout keys (``"striped:stripe=2"``,
``"striped:place=8"``, ...) as ``parse_config`` makes them: ``DataCollatorWithFlattening`` rows
(documents whole on one rank, stripes, windows, alternating sliding / full layers), padded and plain
rows, the ``DistributedAttention`` drop-in, and a DeepSpeed engine step whose JSON section carries
the two keys.  The cases are those of ``test_deepspeed_packed``, run in one process group here.
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

import test_deepspeed_packed as ds_cases  # noqa: E402
from dist_helper import check_case, run_cases  # noqa: E402

WORLD = ds_cases.WORLD


def _case_placement_reorders(key):
    """The placed layout of these cases really keeps documents whole: some rank's positions go back."""
    import striped_sp
    from striped_sp.deepspeed import shard_batch

    full = ds_cases._flattened()
    pos = [shard_batch(full, WORLD, r, key)["input_ids"] for r in range(WORLD)]
    bounds = shard_batch(full, WORLD, 0, key)["cu_seq_lens_q"].tolist()
    order = [striped_sp.positions(bounds[-1], WORLD, r, key, bounds) for r in range(WORLD)]
    assert any(not bool((o[1:] > o[:-1]).all()) for o in order), order
    assert all(p.size(1) == order[0].numel() for p in pos)


CASES = [
    ("setup", ds_cases._setup, ()),
    ("llama_packed_stripe2", ds_cases._case_hf, ("llama", "packed", "striped:stripe=2", "raw")),
    ("llama_packed_place8", ds_cases._case_hf, ("llama", "packed", "striped:place=8", "raw")),
    ("llama_packed_stripe4_auto", ds_cases._case_hf, ("llama", "packed", "striped:stripe=4,place=auto")),
    ("llama_padded_stripe4", ds_cases._case_hf, ("llama", "padded", "striped:stripe=4", "raw")),
    ("mistral_window_plain_stripe4", ds_cases._case_hf, ("mistral", "plain", "striped:stripe=4")),
    ("mistral_window_packed_stripe2_place4", ds_cases._case_hf, ("mistral", "packed", "striped:stripe=2,place=4")),
    ("qwen2_layer_types_packed_place16", ds_cases._case_hf, ("qwen2", "packed_positions", "striped:place=16")),
    ("drop_in_stripe2_place8", ds_cases._case_distributed_attention, ("striped:stripe=2,place=8", 1)),
    ("llama_packed_doc_place8", ds_cases._case_hf, ("llama", "packed", "striped:stripe=doc,place=8", "raw")),
    ("mistral_window_plain_doc", ds_cases._case_hf, ("mistral", "plain", "striped:stripe=doc")),
    ("placement_reorders", _case_placement_reorders, ("striped:place=8",)),
    ("engine_packed_stripe2_place8", ds_cases._case_engine_packed,
     ({"algo": "striped", "stripe_size": 2, "doc_placement": 8},)),
    ("engine_packed_doc", ds_cases._case_engine_packed, ({"algo": "striped", "stripe_size": "doc"},)),
]


@pytest.fixture(scope="module")
def results():
    return run_cases(WORLD, CASES, timeout_s=400)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_deepspeed_placement_case(results, name):
    check_case(results, name)
