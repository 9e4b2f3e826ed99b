"""striped_sp.megatron's arguments without megatron-core: the flag, chaining, each validation error."""

import argparse
import re
import types

import pytest

import striped_sp.megatron as sm


# ---------------------------------------------------------------- arguments

def _args(**kw):
    base = dict(context_parallel_algo="striped", context_parallel_size=4, seq_length=4096,
                cp_comm_type=["p2p"], hybrid_context_parallel=False, attention_dropout=0.0)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_flag_default_and_choices():
    parser = sm.add_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).context_parallel_algo == "native"
    for algo in ("native", "striped", "zigzag", "ring"):
        assert parser.parse_args(["--context-parallel-algo", algo]).context_parallel_algo == algo
    with pytest.raises(SystemExit):
        parser.parse_args(["--context-parallel-algo", "bogus"])
    assert sm.add_arguments(parser) is parser  # adding twice is a no-op


STRIPED_FLAGS = ["--context-parallel-algo", "--striped-stripe-size", "--striped-doc-placement",
                 "--context-parallel-timeout-s", "--striped-calibrate"]


@pytest.mark.parametrize("present", [1, 2, 3])
@pytest.mark.parametrize("into_group", [False, True])
def test_flags_added_to_a_parser_that_has_some_of_them(present, into_group):
    """A parser that already has ``--context-parallel-algo`` (the Megatron patch's own when
    striped_sp was missing at that point, an older patch, a launch script's) still gets every flag
    it lacks: its own definitions stay, ours are added, nothing conflicts, adding again is a no-op."""
    parser = argparse.ArgumentParser()
    target = parser.add_argument_group("distributed") if into_group else parser
    own = STRIPED_FLAGS[:present]
    for flag in own:
        target.add_argument(flag, type=str, default="theirs")
    assert sm.add_arguments(target) is target
    assert sm.add_arguments(target) is target
    argv = ["--context-parallel-algo", "striped", "--striped-stripe-size", "4", "--striped-doc-placement", "auto",
            "--context-parallel-timeout-s", "9", "--striped-calibrate"]
    ns = parser.parse_args(argv)
    got = [ns.context_parallel_algo, ns.striped_stripe_size, ns.striped_doc_placement, ns.context_parallel_timeout_s,
           ns.striped_calibrate]
    ours = ["striped", 4, "auto", 9.0, True]  # parsed by our types
    assert got == [str(x) if flag in own else x for flag, x in zip(STRIPED_FLAGS, ours)]
    defaults = vars(parser.parse_args([]))
    for flag in own:
        assert defaults[flag[2:].replace("-", "_")] == "theirs", flag
    ours_default = {"--striped-doc-placement": "split", "--context-parallel-timeout-s": None,
                    "--striped-calibrate": False}
    for flag, value in ours_default.items():
        if flag not in own:
            assert defaults[flag[2:].replace("-", "_")] == value, flag


def test_chain_providers():
    def other(parser):
        parser.add_argument("--other", type=int, default=3)
        return parser

    provider = sm.chain_providers(other, None, sm.add_arguments)
    ns = provider(argparse.ArgumentParser()).parse_args(["--other", "5", "--context-parallel-algo", "ring"])
    assert (ns.other, ns.context_parallel_algo) == (5, "ring")


def test_layout_of():
    assert [sm.layout_of(a) for a in ("striped", "zigzag", "ring")] == ["striped", "zigzag", "contiguous"]
    with pytest.raises(ValueError, match="native"):
        sm.layout_of("native")


def test_valid_settings_pass():
    sm.validate_args(_args())
    sm.validate_args(_args(context_parallel_size=1, context_parallel_algo="native", attention_dropout=0.1))
    sm.validate_args(_args(seq_length=4 * 3 * 5))  # striped needs only a multiple of CP
    sm.validate_args(_args(cp_comm_type="p2p"))
    # packed rows, EOD-reset documents and windows, with the per-token loss where ranks differ
    sm.validate_args(_args(sft=True, eod_mask_loss=True, calculate_per_token_loss=True))
    sm.validate_args(_args(reset_attention_mask=True, reset_position_ids=True, window_size=(64, 0)))
    sm.validate_args(_args(reset_attention_mask=True, pipeline_model_parallel_size=2))
    sm.validate_args(_args(mtp_num_layers=1, calculate_per_token_loss=True, window_size=(-1, 0)))
    # hierarchical CP: Ulysses inside, the ring across (or pure Ulysses)
    sm.validate_args(_args(cp_comm_type=["a2a+p2p"], hierarchical_context_parallel_sizes=[2, 2], num_attention_heads=8))
    sm.validate_args(_args(cp_comm_type=["a2a"], num_attention_heads=8))
    sm.validate_args(_args(multi_latent_attention=True, apply_rope_fusion=False))  # MLA, unfused RoPE


@pytest.mark.parametrize("kw, words", [
    (dict(context_parallel_size=1), "--context-parallel-size"),
    (dict(seq_length=4098), "--seq-length"),
    (dict(context_parallel_algo="zigzag", seq_length=4 * 3), "--seq-length 12 over --context-parallel-size 4"),
    (dict(cp_comm_type=["allgather"]), "--cp-comm-type p2p, a2a and a2a+p2p (got allgather)"),
    (dict(cp_comm_type=["p2p", "a2a+p2p"]), "needs --hierarchical-context-parallel-sizes U R"),
    (dict(cp_comm_type=["a2a"], num_attention_heads=6), "--num-attention-heads 6"),
    (dict(cp_comm_type=["a2a"], num_attention_heads=8, group_query_attention=True, num_query_groups=3),
     "--num-query-groups 3"),
    (dict(cp_comm_type=["a2a+p2p"], hierarchical_context_parallel_sizes=[4, 1], num_attention_heads=8,
          tensor_model_parallel_size=4), "--num-attention-heads 8 / --tensor-model-parallel-size 4"),
    (dict(hybrid_context_parallel=True), "--hybrid-context-parallel"),
    (dict(attention_dropout=0.1), "--attention-dropout 0"),
    (dict(sft=True), "--calculate-per-token-loss"),
    (dict(eod_mask_loss=True), "--calculate-per-token-loss"),
    (dict(mtp_num_layers=1), "--calculate-per-token-loss"),
    (dict(window_size=(64, -1)), "--window-size 64,-1"),
    (dict(fp8_dot_product_attention=True), "fp8_dot_product_attention=False"),
    (dict(fp8_multi_head_attention=True), "fp8_multi_head_attention=False"),
    (dict(attention_backend="flash"), "flash-attn, which is not installed"),
    (dict(use_flash_attn=True), "flash-attn, which is not installed"),
    (dict(window_size=(64, 2)), "--window-size 64,2"),
    (dict(context_parallel_algo="zigzag", reset_attention_mask=True), "--context-parallel-algo ring"),
    (dict(sft=True, calculate_per_token_loss=True, pipeline_model_parallel_size=4), "--pipeline-model-parallel-size"),
    (dict(reset_attention_mask=True, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
     "without a virtual pipeline"),
    (dict(reset_attention_mask=True, create_attention_mask_in_dataloader=False),
     "--no-create-attention-mask-in-dataloader"),
    (dict(multi_latent_attention=True, apply_rope_fusion=True), "--no-rope-fusion"),
    (dict(qk_clip=True), "--qk-clip"),
    (dict(log_max_attention_logit=True), "--log-max-attention-logit"),
    (dict(cuda_graph_impl="local"), "--cuda-graph-impl none"),
    (dict(external_cuda_graph=True), "--cuda-graph-impl none"),
])
def test_each_validation_error_names_the_setting(kw, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        sm.validate_args(_args(**kw))


@pytest.mark.parametrize("kw, words", [
    # the layout's sequence rule (Layout.check_seq_len): the flags, their values, the rule
    (dict(seq_length=4098), ["--seq-length 4098", "--context-parallel-size 4",
                             "must be a positive multiple of world_size = 4"]),
    (dict(context_parallel_algo="zigzag", seq_length=4 * 3),
     ["--seq-length 12", "--context-parallel-size 4", "multiple of 2 * world_size = 8", "layout 'zigzag'"]),
    (dict(striped_stripe_size=3, seq_length=4096),
     ["--seq-length 4096", "--striped-stripe-size 3", "multiple of 3 * world_size = 12"]),
    # the Ulysses rule (engine.ulysses.check_ulysses) on the heads of one tensor-parallel rank
    (dict(cp_comm_type=["a2a"], num_attention_heads=6),
     ["--cp-comm-type a2a", "--context-parallel-size 4", "--num-attention-heads 6",
      "ulysses_size=4 must divide the query heads (6)"]),
    (dict(cp_comm_type=["a2a"], num_attention_heads=8, group_query_attention=True, num_query_groups=3),
     ["--num-query-groups 3", "kv heads (3) must divide by ulysses_size=4 or divide it"]),
    (dict(cp_comm_type=["a2a+p2p"], hierarchical_context_parallel_sizes=[4, 1], num_attention_heads=8,
          tensor_model_parallel_size=4),
     ["--hierarchical-context-parallel-sizes 4 1", "--num-attention-heads 8 / --tensor-model-parallel-size 4",
      "ulysses_size=4 must divide the query heads (2)"]),
    (dict(cp_comm_type=["a2a+p2p"], hierarchical_context_parallel_sizes=[3, 1], num_attention_heads=12),
     ["--hierarchical-context-parallel-sizes 3 1", "--context-parallel-size 4",
      "ulysses_size=3 must divide the context-parallel size 4"]),
    # the window rule (plan.masks.check_window), causal
    (dict(window_size=(64, 2)), ["--window-size 64,2", "right must be 0 when causal=True"]),
    (dict(window_size=(64, -1)), ["--window-size 64,-1", "right must be 0 when causal=True"]),
    (dict(window_size=(-3, 0)), ["--window-size -3,0", "left=-3 must be an int >= -1"]),
    (dict(window_size=(64,)), ["--window-size 64", "must be a pair (left, right)"]),
    # the layout's document fact (places_documents, document_multiple): zigzag cannot run EOD documents
    (dict(context_parallel_algo="zigzag", reset_attention_mask=True),
     ["--context-parallel-algo zigzag", "--reset-attention-mask", "a multiple of 8 tokens"]),
    # which layouts take stripe / place parameters (plan.layouts.get_layout)
    (dict(context_parallel_algo="zigzag", striped_stripe_size=2),
     ["--striped-stripe-size 2", "not zigzag", "apply to layout 'striped' only"]),
])
def test_plan_rules_through_the_flags_name_flag_value_and_rule(kw, words):
    """Each rule is the plan's (or the engine's) own, re-raised with Megatron's flags and values."""
    with pytest.raises(ValueError) as err:
        sm.validate_args(_args(**kw))
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_supported_megatron_versions(monkeypatch):
    from striped_sp.megatron import version

    for ok in ("0.16.1", "0.17.1", "0.18.2", "0.19.2", "0.19.0rc1"):
        assert version.check_supported(ok) == ok
    monkeypatch.delenv(version.ALLOW_ENV, raising=False)
    with pytest.raises(ValueError, match=r"megatron-core 0\.15\.3 .*STRIPED_SP_ALLOW_UNTESTED_MEGATRON=1"):
        version.check_supported("0.15.3")
    with pytest.raises(ValueError, match="0.20.0"):
        version.check_supported("0.20.0")
    monkeypatch.setenv(version.ALLOW_ENV, "1")
    with pytest.warns(UserWarning, match="outside the range"):
        assert version.check_supported("0.20.0") == "0.20.0"


def test_attention_backend_flags_choose_the_kernel():
    import types as _types

    assert sm.arguments.kernel_backend_of(None) == "auto"
    assert sm.arguments.kernel_backend_of(_types.SimpleNamespace(name="fused")) == "torch"
    assert sm.arguments.kernel_backend_of("unfused") == "math"
    assert sm.arguments.kernel_backend_of("local") == "math"
    assert sm.arguments.kernel_backend_of("auto", use_flash_attn=True) == "flash_attn"
    with pytest.raises(ValueError, match="--attention-backend cudnn is unknown"):
        sm.arguments.kernel_backend_of("cudnn")
    sm.validate_args(_args(attention_backend="fused", deterministic_mode=True))


def test_striped_flags_make_one_layout_key():
    parser = sm.add_arguments(argparse.ArgumentParser())
    ns = parser.parse_args(["--context-parallel-algo", "striped", "--striped-stripe-size", "4",
                            "--striped-doc-placement", "auto"])
    assert sm.algo_of(ns) == "striped:stripe=4,place=auto"
    assert sm.algo_of(parser.parse_args(["--context-parallel-algo", "striped"])) == "striped"
    assert sm.algo_of(parser.parse_args(["--context-parallel-algo", "ring"])) == "ring"
    assert sm.algo_of(_args(striped_doc_placement="64")) == "striped:place=64"
    assert sm.algo_of(parser.parse_args(["--context-parallel-algo", "striped", "--striped-stripe-size", "doc"])) \
        == "striped:stripe=doc"
    with pytest.raises(SystemExit):  # argparse: neither an integer nor 'doc'
        parser.parse_args(["--striped-stripe-size", "docs"])
    sm.validate_args(_args(striped_stripe_size="doc", seq_length=4 * 5))  # per-document stripes: any multiple of CP
    assert sm.layout_of("striped:place=64,stripe=2") == "striped:stripe=2,place=64"
    assert sm.add_arguments(parser) is parser
    sm.validate_args(_args(striped_stripe_size=4, seq_length=4 * 4 * 3))
    sm.validate_args(_args(striped_doc_placement="auto", sft=True, calculate_per_token_loss=True,
                           seq_length=4 * 5))  # whole documents: any multiple of CP
    with pytest.raises(ValueError, match="unknown"):
        sm.arguments.check_algo("zigzag:stripe=2")


@pytest.mark.parametrize("kw, words", [
    (dict(striped_stripe_size=0), "--striped-stripe-size 0 must be a positive integer"),
    (dict(striped_doc_placement="whole"), "--striped-doc-placement 'whole' must be split, auto or a positive"),
    (dict(striped_doc_placement="0"), "--striped-doc-placement 0 must be split"),
    (dict(context_parallel_algo="zigzag", striped_stripe_size=2), "--striped-stripe-size 2 applies to "
     "--context-parallel-algo striped only"),
    (dict(context_parallel_algo="ring", striped_doc_placement="auto"), "--striped-doc-placement auto applies to"),
    (dict(context_parallel_algo="native", striped_stripe_size=8), "--striped-stripe-size 8 applies to"),
    (dict(striped_stripe_size=3, seq_length=4096), "with --striped-stripe-size 3"),
    (dict(striped_doc_placement="auto"), "--striped-doc-placement auto needs packed THD rows (--sft)"),
    (dict(striped_stripe_size="doc", reset_attention_mask=True), "--striped-stripe-size doc follows the documents"),
    (dict(striped_stripe_size="tiles"), "--striped-stripe-size 'tiles' must be a positive integer"),
    (dict(striped_doc_placement="32", sft=True, calculate_per_token_loss=True, reset_attention_mask=True),
     "--striped-doc-placement 32 places the documents of packed THD rows (--sft) only"),
])
def test_striped_flag_errors_name_the_flag(kw, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        sm.validate_args(_args(**kw))


def _mask_with_documents(bounds, seq_len):
    """Megatron's ``--reset-attention-mask`` mask of one row: ``True`` where a query may not see a key."""
    import torch

    visible = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for a, b in zip(bounds[:-1], bounds[1:]):
        visible[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    return (~visible).view(1, 1, seq_len, seq_len)


@pytest.mark.parametrize("algo, words", [
    ("zigzag", ["--context-parallel-algo zigzag", "a multiple of 8 tokens", "--reset-attention-mask"]),
    ("striped:place=auto", ["--context-parallel-algo striped:place=auto", "--striped-doc-placement"]),
])
def test_batch_slicing_refuses_documents_a_layout_places(monkeypatch, algo, words):
    """get_batch_on_this_cp_rank asks the layout (places_documents, document_multiple), not its name."""
    import torch

    monkeypatch.setattr(sm.data, "cp_size_and_rank", lambda group=None: (4, 0))
    batch = {"tokens": torch.zeros(1, 16, dtype=torch.long), "attention_mask": _mask_with_documents((0, 5, 16), 16)}
    with pytest.raises(ValueError) as err:
        sm.get_batch_on_this_cp_rank(batch, algo, cp_group=None)
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    # striped with stripes of 1 keeps positions: fine (what algo_of gives under --reset-attention-mask; the
    # default "striped" searches placements, which only packed THD rows allow)
    out = sm.get_batch_on_this_cp_rank(batch, "striped:stripe=1", cp_group=None)
    assert out["tokens"].shape == (1, 4)


@pytest.mark.parametrize("algo", ["striped", "ring", "striped:stripe=4", "zigzag"])
def test_hybrid_layers_with_megatrons_cp_run_under_every_algo(monkeypatch, algo):
    """Mamba layers and, where megatron-core gives it context parallelism (0.18+), gated delta net
    follow every layout (megatron/mamba.py, megatron/gdn.py): neither is refused when built."""
    import torch
    from striped_sp.megatron import hooks, refusals

    class MambaLayer(torch.nn.Module):
        pass

    class GatedDeltaNet(torch.nn.Module):
        pass

    monkeypatch.setitem(hooks._STATE, "algo", algo)
    hooks._check_model(torch.nn.Sequential(MambaLayer()))
    monkeypatch.setattr(refusals, "megatron_core_line", lambda: (0, 19))  # megatron-core's GDN has CP
    hooks._check_model(torch.nn.Sequential(GatedDeltaNet()))
