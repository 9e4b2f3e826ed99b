"""``--context-parallel-algo``: the command-line flag and the checks of the settings around it.

No Megatron import here: the parser works with any ``argparse.ArgumentParser`` and the checks
read plain attributes, so a launch script can validate its arguments before starting ranks.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from ..plan.layouts import ALGOS as LAYOUT_ALGOS, get_layout
from .layout_flags import doc_placement_of, order_of, stripe_arg, stripe_size_of
from ..engine.transport import set_ring_timeout
from ..engine.ulysses import check_ulysses
from ..plan.masks import check_window


#: algo name -> this project's layout (``None``: Megatron/Transformer Engine's own path).
ALGOS: dict[str, Optional[str]] = {"native": None, **LAYOUT_ALGOS}
DEFAULT_ALGO = "native"
#: the token layout of Megatron's own context parallelism (``--context-parallel-algo native``):
#: Transformer Engine's zigzag chunks (a flag value's translation, as :data:`ALGOS`)
NATIVE_LAYOUT = "zigzag"


def check_algo(algo: str) -> str:
    """``algo`` itself if it names an algorithm; ``ValueError`` naming the flag otherwise.

    Besides the names of :data:`ALGOS`, a striped layout key with parameters
    (``"striped:stripe=4,place=auto"``, what :func:`algo_of` gives for ``--striped-stripe-size`` /
    ``--striped-doc-placement``) is an algo: every adapter function takes it where it takes
    ``"striped"``."""
    base, sep, params = str(algo).partition(":")
    if base not in ALGOS or (sep and ALGOS[base] is None):
        raise ValueError(
            f"--context-parallel-algo {algo!r} is unknown: choose one of {sorted(ALGOS)} "
            "(or a striped layout key 'striped:stripe=S,place=P')"
        )
    if sep:
        try:  # the plan's rule: which layouts take parameters, and their values
            get_layout(f"{ALGOS[base]}:{params}")
        except ValueError as err:
            raise ValueError(f"--context-parallel-algo {algo!r} is unknown: {err}") from None
    return algo


def algo_name(algo: str) -> str:
    """The algorithm of ``algo`` without layout parameters (``"striped:stripe=4"`` -> ``"striped"``)."""
    return check_algo(algo).partition(":")[0]


def layout_of(algo: str) -> str:
    """The striped_sp layout key that a non-native ``algo`` runs (``ring`` -> ``contiguous``;
    ``striped:stripe=4`` -> itself)."""
    layout = ALGOS[algo_name(algo)]
    if layout is None:
        raise ValueError(
            "--context-parallel-algo native runs Megatron's own context parallelism and has no "
            f"striped_sp layout: choose one of {sorted(a for a in ALGOS if ALGOS[a])}"
        )
    return get_layout(algo if ":" in algo else layout).key


def rows_layout(layout: str, seq_len: int | None = None, size: int | None = None) -> str:
    """The layout a ``[b, s]`` batch runs (``--reset-attention-mask`` documents inside whole rows):
    the rows share one RoPE table, so their documents are never placed, and the bare default (the
    per-batch search, which places the documents of packed THD rows) runs there what it runs on a
    row of one document of ``seq_len`` tokens on ``size`` ranks
    (:func:`~striped_sp.plan.dense_choice.dense_choice`), pinned so that documents move no token:
    zigzag's order (``striped:stripe=S/2N,order=mirror``, zigzag's dense plans) or stripes of 1 (also
    without ``seq_len``), in the batch slicing, RoPE and the attention alike; any other layout as it is."""
    if layout != get_layout("striped").key or not get_layout(layout).auto:
        return layout
    if seq_len is not None and size is not None and size > 1:
        from ..plan.dense_choice import dense_choice

        if dense_choice(int(seq_len), int(size))[0] == "doc":
            return f"striped:stripe={int(seq_len) // (2 * int(size))},order=mirror"
    return "striped:stripe=1"


def algo_of(args) -> str:
    """The one algo string of ``--context-parallel-algo``, ``--striped-stripe-size``,
    ``--striped-doc-placement`` and ``--striped-order``: the algo name, or for striped with parameters
    its layout key (``"striped:stripe=4,place=auto"``, ``"striped:stripe=2048,order=mirror"``).  Pass it
    wherever an ``algo`` goes (:func:`install`, the batch slicing, the spec).  ``ValueError`` names the
    flag: the striped flags with another algo, a stripe size below 1, a placement other than split /
    auto / a positive integer, an order other than round / mirror, mirror without an integer stripe
    size.  Under a window (``--window-size``) the default's stripes come from the cost model
    (:func:`~striped_sp.megatron.layout_flags.order_of`, zigzag's order included), pinned."""
    algo = check_algo(getattr(args, "context_parallel_algo", DEFAULT_ALGO))
    layout = ALGOS[algo_name(algo)]
    given_order = getattr(args, "striped_order", None)
    if given_order is not None and layout != "striped":
        raise ValueError(f"--striped-order {given_order} applies to --context-parallel-algo striped only, not "
                         f"{algo}: drop it or use --context-parallel-algo striped")
    stripe, place, order = stripe_size_of(args), doc_placement_of(args), order_of(args)
    for flag, value, default, param in (("--striped-stripe-size", stripe, 1, "stripe_size"),
                                        ("--striped-doc-placement", place, "split", "doc_placement")):
        if value == default:
            continue
        try:  # the plan's rule: which layouts take a stripe size / placement
            if layout is None:
                raise ValueError("native runs Megatron's own layout, which takes no parameters")
            get_layout(layout, **{param: value})
        except ValueError as err:
            raise ValueError(f"{flag} {value} applies to --context-parallel-algo striped only, not {algo} "
                             f"({err}): drop it or use --context-parallel-algo striped") from None
    if order == "mirror":  # an int stripe size (order_of); the layout's own rule for the rest
        from ..plan.striped_layout import Striped

        try:
            return Striped(stripe, None if place == "split" else place, order="mirror").key
        except ValueError as err:
            raise ValueError(f"--striped-order mirror with --striped-stripe-size {stripe}: {err}") from None
    documents = bool(getattr(args, "sft", False) or getattr(args, "reset_attention_mask", False))
    if (":" not in algo and stripe == 1 and place == "split" and order is None
            and not (layout == "striped" and documents)):
        return algo  # "striped" without documents: the core default, stripes of 1 on such rows
    if layout == "striped" and stripe == 1 and place == "split":
        # pinned: "striped" alone would search packed rows (issue 36), or take zigzag's order where the
        # window's cost model chose stripes of 1 (order "round")
        return get_layout(layout, 1).key
    return get_layout(algo, stripe if stripe != 1 else None, place if place != "split" else None).key


#: the flags :func:`add_arguments` adds (each one the parser lacks)
_FLAGS = ("--context-parallel-algo", "--striped-stripe-size", "--striped-doc-placement", "--striped-order",
          "--context-parallel-timeout-s", "--striped-calibrate")
#: ``--striped-calibrate`` asked for and not yet done in this process: module-level because
#: validate_args (which reads the flag, before any process group exists) and the first core
#: attention built (which has the CP group, before any batch is placed) are apart
_CALIBRATION = {"pending": False}


def add_arguments(parser):
    """Add ``--context-parallel-algo``, ``--striped-stripe-size``, ``--striped-doc-placement`` and
    ``--context-parallel-timeout-s`` to ``parser`` (those it lacks) and return it.

    ``parser`` is an ``argparse.ArgumentParser`` (the flags go into a group of their own) or an
    argument group, into which they go directly: the Megatron-LM patches call it with the group of
    Megatron's distributed arguments, so a patched checkout knows every flag of this route too.
    Usable as Megatron's ``extra_args_provider``; see :func:`chain_providers` to combine it
    with another provider.  Adding it twice is a no-op.
    """
    known = {o for a in parser._actions for o in a.option_strings}  # a group shares its parser's
    if set(_FLAGS) <= known:
        return parser
    group = parser
    if isinstance(parser, argparse.ArgumentParser):
        group = parser.add_argument_group(title="striped_sp context parallelism")
    add = lambda flag, **kw: None if flag in known else group.add_argument(flag, **kw)  # noqa: E731
    add(
        "--context-parallel-algo",
        type=str,
        default=DEFAULT_ALGO,
        choices=list(ALGOS),
        help="How context parallelism splits each sequence and runs attention. "
        "'native': Megatron/Transformer Engine's own path (unchanged). "
        "'striped': striped ring attention (rank r holds tokens r, r+CP, r+2CP, ...). "
        "'zigzag': the same engine with Megatron's zigzag layout. "
        "'ring': the same engine with contiguous chunks (original Ring Attention). "
        "The last three need --context-parallel-size > 1.",
    )
    add(
        "--striped-stripe-size",
        type=stripe_arg,
        default=None,
        help="--context-parallel-algo striped: deal tokens to the CP ranks in stripes of this many "
        "(1: token by token, the paper's layout; larger stripes mean fewer, larger kernel calls on "
        "packed rows and windows), 'doc': per document 2*CP stripes, dealt to ranks 0..CP-1 then "
        "back (large dense blocks, no padding), or 'auto' (the default): chosen from --sft, --window-size and "
        "--window-attn-skip-freq (docs/tuning.md). With an integer and no document placement "
        "--seq-length must be a multiple of CP * stripe size.",
    )
    add(
        "--striped-doc-placement",
        type=str,
        default="split",
        help="--context-parallel-algo striped on packed THD rows (--sft): 'split' stripes every "
        "document over all CP ranks; an integer L keeps documents of at most L tokens whole on one "
        "rank (dealt by a balancing solver) and stripes the rest; 'auto' lets the cost model pick L.",
    )
    add(
        "--striped-order",
        type=str,
        default=None,
        choices=["round", "mirror"],
        help="--context-parallel-algo striped with an integer --striped-stripe-size: how its stripes are "
        "dealt to the CP ranks: 'round' (stripe g to rank g mod CP, the paper's) or 'mirror' (ranks "
        "0..CP-1, then CP-1..0: zigzag's order; stripes of seq-length / (2*CP) are zigzag's own placement). "
        "Not given: round, except where the default's cost model picks zigzag's order under --window-size.",
    )
    add(
        "--striped-calibrate",
        action="store_true",
        help="Time the attention kernel on global rank 0 when the model is built and give "
        "every rank that cost model (instead of the table's; on GPUs a prediction) for the 'auto' "
        "choices (--striped-stripe-size auto with --sft, --striped-doc-placement auto) and the "
        "packed plans' schedules. A few seconds, once.",
    )
    add(
        "--context-parallel-timeout-s",
        type=float,
        default=None,
        help="Seconds a rank of the striped/zigzag/ring engine waits for a ring transfer before it "
        "raises an error naming itself, the stuck peer and the ring step (gloo/CPU; on NCCL the "
        "process group's timeout applies). Default: $STRIPED_SP_RING_TIMEOUT_S, else 600.",
    )
    return parser


def chain_providers(*providers: Optional[Callable]) -> Callable:
    """One ``extra_args_provider`` that applies each non-None provider in order."""
    chain = [p for p in providers if p is not None]

    def provider(parser):
        for p in chain:
            parser = p(parser)
        return parser

    return provider


#: Megatron's ``--attention-backend`` -> the striped_sp kernel backend that runs each block
ATTENTION_BACKENDS = {
    "auto": "auto",            # flash-attn on CUDA when installed, else PyTorch's fused ops
    "flash": "flash_attn",     # flash-attn 2 (as Transformer Engine's flash backend)
    "fused": "torch",          # PyTorch's fused SDPA ops (flash / memory-efficient)
    "unfused": "math",         # plain softmax(QK^T)V
    "local": "math",
}


def kernel_backend_of(attention_backend=None, use_flash_attn: bool = False) -> str:
    """The kernel backend for Megatron's ``--attention-backend`` (an ``AttnBackend`` or its name;
    ``None``: auto) and the older ``--use-flash-attn``."""
    name = getattr(attention_backend, "name", attention_backend) or "auto"
    if use_flash_attn and name == "auto":
        name = "flash"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {name} is unknown: choose one of {sorted(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]


def _check_kernel_flags(args, flag: str) -> None:
    backend = kernel_backend_of(getattr(args, "attention_backend", None), getattr(args, "use_flash_attn", False))
    if backend == "flash_attn":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            raise ValueError(
                f"{flag} with --attention-backend flash (or --use-flash-attn) runs flash-attn, which is not "
                "installed: pip install flash-attn, or use --attention-backend fused / auto"
            )
    for name in ("fp8_dot_product_attention", "fp8_multi_head_attention"):
        if getattr(args, name, False):
            raise ValueError(
                f"{flag} does not run FP8 attention: set {name}=False in the TransformerConfig (FP8 GEMMs elsewhere "
                "are fine) or use --context-parallel-algo native"
            )


def _cp_comm_types(value) -> list[str]:
    if value is None:
        return ["p2p"]
    if isinstance(value, str):
        return [value]
    return list(value)


def note_layout(args) -> None:
    """Set ``args.striped_layout`` and ``args.striped_stripe_policy`` for a non-native algo, so that
    Megatron's argument dump shows what ``auto`` stands for (the layout key with
    ``--striped-stripe-size auto`` resolved for this model, and the stripe policy in words).  Bad
    flags are left to :func:`validate_args`, which names them."""
    from ..setup_report import stripe_policy

    try:
        key = algo_of(args)
        if ALGOS[algo_name(key)] is None:
            return
        args.striped_layout = layout_of(key)
        args.striped_stripe_policy = stripe_policy(args.striped_layout)
    except (ValueError, KeyError):
        return


def validate_args(args) -> None:
    """Check the settings that ``--context-parallel-algo`` needs; ``ValueError`` names the fix.

    Reads Megatron's argument names (missing ones take Megatron's defaults), so it works on
    the parsed ``args`` of pretrain_gpt.py.  A native algo is never checked.  Also makes
    ``--context-parallel-timeout-s`` this process's ring timeout (validate_args runs on every rank).
    """
    algo = check_algo(getattr(args, "context_parallel_algo", DEFAULT_ALGO))
    key = algo_of(args)  # the striped flags: valid, and with striped only
    if ALGOS[algo_name(algo)] is None:
        if getattr(args, "striped_calibrate", False):
            raise ValueError(f"--striped-calibrate calibrates the cost model of the striped_sp engine, which "
                             f"--context-parallel-algo {algo} does not run: drop it or choose striped, zigzag or ring")
        return
    flag = f"--context-parallel-algo {algo}"
    _check_striped_flags(args, key)
    note_layout(args)  # the patched validate_args calls this before Megatron's argument dump
    _apply_timeout(args)
    _CALIBRATION["pending"] = bool(getattr(args, "striped_calibrate", False))
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if _CALIBRATION["pending"] and pp > 1:
        _CALIBRATION["pending"] = False
        raise ValueError(f"--striped-calibrate with --pipeline-model-parallel-size {pp}: the calibration is one "
                         "exchange over every rank when the model is built, which a pipeline stage without attention "
                         "layers would never join: drop --striped-calibrate (the table's model decides) or use "
                         "--pipeline-model-parallel-size 1")
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    if cp < 2:
        raise ValueError(
            f"{flag} needs --context-parallel-size > 1 (got {cp}): raise "
            "--context-parallel-size or use --context-parallel-algo native"
        )
    lay = get_layout(layout_of(key))
    seq_length = getattr(args, "seq_length", None)
    if seq_length is not None:
        try:
            lay.check_seq_len(seq_length, cp)  # the layout's rule (world_size: the CP size)
        except ValueError as err:
            stripe = stripe_size_of(args)
            given = f"--seq-length {seq_length} over --context-parallel-size {cp}" + (
                f" with --striped-stripe-size {stripe}" if stripe != 1 else "")
            raise ValueError(f"{flag}: {given}: {err}: change --seq-length or --context-parallel-size") from None
    comm = _cp_comm_types(getattr(args, "cp_comm_type", None))
    if any(c not in ("p2p", "a2a", "a2a+p2p") for c in comm):
        raise ValueError(
            f"{flag} supports --cp-comm-type p2p, a2a and a2a+p2p (got {' '.join(comm)}): "
            "choose among those or use --context-parallel-algo native"
        )
    hier = getattr(args, "hierarchical_context_parallel_sizes", None)
    if "a2a+p2p" in comm and (not hier or len(hier) != 2):
        raise ValueError(
            f"{flag} with --cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes U R "
            f"(a Ulysses group of U ranks, a ring of R; U x R = --context-parallel-size), got {hier}"
        )
    heads = getattr(args, "num_attention_heads", None)
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else heads
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    for comm_type in sorted(set(comm) - {"p2p"}):
        u = cp if comm_type == "a2a" else int(hier[0])
        h = u if heads is None else heads // tp  # unknown heads: the split of the CP ranks only
        kv = h if groups is None else max(1, groups // tp)
        try:
            check_ulysses(u, cp, h, kv)  # the engine's rule, on the heads of one tensor-parallel rank
        except ValueError as err:
            given = [f"ulysses_size = --context-parallel-size {cp}" if comm_type == "a2a" else
                     f"ulysses_size = U of --hierarchical-context-parallel-sizes {' '.join(map(str, hier))} "
                     f"with --context-parallel-size {cp}"]
            if heads is not None:
                given.append(f"heads = --num-attention-heads {heads} / --tensor-model-parallel-size {tp}")
            if heads is not None and getattr(args, "group_query_attention", False):
                given.append(f"kv heads = --num-query-groups {groups} / --tensor-model-parallel-size {tp}")
            raise ValueError(
                f"{flag} with --cp-comm-type {comm_type}: {err} ({'; '.join(given)}): change "
                "--hierarchical-context-parallel-sizes, --num-attention-heads or --num-query-groups") from None
    if getattr(args, "hybrid_context_parallel", False):
        raise ValueError(
            f"{flag} does not support hybrid context parallelism yet: drop "
            "--hybrid-context-parallel or use --context-parallel-algo native"
        )
    dropout = float(getattr(args, "attention_dropout", 0.0) or 0.0)
    if dropout > 0:
        raise ValueError(
            f"{flag} does not support attention dropout yet (got {dropout}): "
            "set --attention-dropout 0"
        )
    if getattr(args, "reset_attention_mask", False) and not getattr(
            args, "create_attention_mask_in_dataloader", True):
        raise ValueError(
            f"{flag} reads the documents of --reset-attention-mask from the attention mask: drop "
            "--no-create-attention-mask-in-dataloader"
        )
    if lay.places_documents and getattr(args, "reset_attention_mask", False):
        m = lay.document_multiple(cp)
        multiple = f" (every document a multiple of {m} tokens)" if m > 1 else ""
        raise ValueError(
            f"{flag} places tokens by each packed document's own bounds{multiple} and cannot run the "
            "documents of --reset-attention-mask "
            "inside whole rows: use --context-parallel-algo ring, or striped with an integer "
            "--striped-stripe-size and --striped-doc-placement split"
        )
    window = getattr(args, "window_size", None)
    if window is not None:
        try:
            check_window(window, causal=True)  # the plan's rule; GPT attention is causal
        except ValueError as err:
            shown = ",".join(map(str, window)) if isinstance(window, (tuple, list)) else repr(window)
            raise ValueError(
                f"{flag}: --window-size {shown}: {err}; pass L,0 with L >= 0 (or -1 for no limit): "
                "GPT attention is causal, so a query sees the L tokens before it and itself"
            ) from None
    _check_kernel_flags(args, flag)
    _check_pipeline_documents(args, flag)
    _check_loss_weighting(args, flag)
    if getattr(args, "use_legacy_models", False):
        raise ValueError(f"{flag} needs megatron-core models: drop --use-legacy-models")
    if getattr(args, "multi_latent_attention", False) and getattr(args, "apply_rope_fusion", False):
        raise ValueError(
            f"{flag}: the fused multi-latent attention RoPE places its rotary rows by Megatron's zigzag "
            "chunks, not by the layout's positions: pass --no-rope-fusion with --multi-latent-attention"
        )
    for name in ("qk_clip", "log_max_attention_logit"):
        if getattr(args, name, False):
            raise ValueError(
                f"{flag} does not report attention logits yet: drop --{name.replace('_', '-')}"
            )
    graphs = getattr(args, "cuda_graph_impl", "none") or "none"
    if graphs != "none" or getattr(args, "external_cuda_graph", False) or getattr(args, "enable_cuda_graph", False):
        raise ValueError(
            f"{flag} sends and receives inside attention and cannot be captured in CUDA graphs yet: "
            "set --cuda-graph-impl none (and drop --external-cuda-graph / --enable-cuda-graph)"
        )


def _check_striped_flags(args, key: str) -> None:
    """``--striped-doc-placement`` places the documents of packed THD rows (``--sft``).  On ``[b, s]``
    batches (``--reset-attention-mask``) Megatron's RoPE slices one table for every row, which
    cannot follow a per-row placement, and MTP's roll there knows no documents: refused.  Without
    documents a placement would do nothing: refused too, so that a flag never silently does nothing."""
    lay = get_layout(layout_of(key))
    if getattr(lay, "per_document", False) and getattr(args, "reset_attention_mask", False):
        raise ValueError("--striped-stripe-size doc follows the documents of packed THD rows (--sft) or "
                         "whole rows: with --reset-attention-mask Megatron's RoPE takes one table for every "
                         "row of a [b, s] batch; use --sft packed rows or an integer stripe size")
    if not getattr(lay, "placed", False) or getattr(lay, "default", False):
        return  # the default "striped": only where rows hold no documents (algo_of)
    place = f"--striped-doc-placement {lay.doc_placement}"
    if getattr(args, "reset_attention_mask", False):
        raise ValueError(
            f"{place} places the documents of packed THD rows (--sft) only: with --reset-attention-mask "
            "Megatron's RoPE takes one table for every row of a [b, s] batch, which cannot follow a "
            "per-row placement; use --sft packed rows or --striped-doc-placement split")
    if not getattr(args, "sft", False):
        raise ValueError(
            f"{place} needs packed THD rows (--sft) to place documents; without them it would do "
            "nothing: add --sft or drop the flag (--striped-doc-placement split)")


def take_calibration() -> bool:
    """Whether ``--striped-calibrate`` is pending in this process (then no longer): the first core
    attention built calibrates, on its CP group, before any batch is placed."""
    pending, _CALIBRATION["pending"] = _CALIBRATION["pending"], False
    return pending


def _apply_timeout(args) -> None:
    """``--context-parallel-timeout-s``: checked, then made the ring timeout of this process
    (:func:`striped_sp.engine.transport.set_ring_timeout`; validate_args runs on every rank)."""
    seconds = getattr(args, "context_parallel_timeout_s", None)
    if seconds is None:
        return
    try:
        set_ring_timeout(seconds)
    except ValueError:
        raise ValueError(f"--context-parallel-timeout-s {seconds!r} must be a positive, finite number of seconds") \
            from None


def _check_loss_weighting(args, flag: str) -> None:
    """With masked loss tokens (``--eod-mask-loss``, the padding and prompts that ``--sft``
    masks, MTP's rolled-out last tokens) each CP rank holds a different number of counted tokens.  Megatron then divides every
    rank's loss by its own count, which weights ranks unequally: only the per-token loss (summed
    over DP x CP, divided by the global count) gives the gradient of the loss without CP."""
    if getattr(args, "calculate_per_token_loss", False):
        return
    masked = [name for name, on in (("--eod-mask-loss", getattr(args, "eod_mask_loss", False)),
                                    ("--sft", getattr(args, "sft", False)),
                                    # MTP's rolled loss mask drops the row's (and each document's)
                                    # last token, which only one rank holds
                                    ("--mtp-num-layers", getattr(args, "mtp_num_layers", None)))
              if on]
    if masked:
        raise ValueError(
            f"{flag} with {' and '.join(masked)} gives each CP rank a different number of loss tokens, "
            "and Megatron would weight the ranks unequally: add --calculate-per-token-loss (the exact "
            "per-token loss over the whole CP group)"
        )


def _check_pipeline_documents(args, flag: str) -> None:
    """pretrain_gpt.py gives a batch (and so the documents: ``packed_seq_params`` or the
    attention mask) only to the first and last pipeline stage; a middle stage would run its
    layers without them, as one causal row."""
    docs = [name for name, on in (("--sft", getattr(args, "sft", False)),
                                  ("--reset-attention-mask", getattr(args, "reset_attention_mask", False)))
            if on]
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    virtual = getattr(args, "virtual_pipeline_model_parallel_size", None) or getattr(
        args, "num_layers_per_virtual_pipeline_stage", None)
    if docs and (pp > 2 or (pp > 1 and virtual)):
        raise ValueError(
            f"{flag} with {' and '.join(docs)} needs every pipeline stage to see the documents, but "
            "pretrain_gpt.py gives a batch only to the first and last stage: use "
            "--pipeline-model-parallel-size 1 or 2 without a virtual pipeline"
        )
