"""Contracts of the private PyTorch attention ops the CUDA branch of ``TorchKernel`` calls.

:class:`AtenShim` stands in for ``torch.ops.aten`` inside :mod:`striped_sp.kernels`.  Each call
of a CUDA attention op is checked in levels (each includes the ones before):

``meta``      the real op on ``meta`` copies of the arguments: torch's own argument parser
              (arity, types) and its meta kernel (output shapes).  This is all a plain meta run
              checks; it does not see two same-typed tensors passed in the wrong order.
``schema``    the call bound by hand to ``torch.ops.aten.<op>.default._schema``: every
              positional argument lands on a named parameter, keyword arguments exist and are
              keyword-capable, no parameter twice, missing ones have defaults, each value has
              the parameter's type (undefined tensors only where torch itself passes them).
``contract``  every bound argument against what that parameter means: ``out`` / ``logsumexp``
              have exactly the shape and dtype the matching *forward* op returns for these
              ``query``/``key``/``value`` (asked of torch's meta kernel, so the lse padding of
              the memory-efficient op and cuDNN's trailing 1 come from torch, not from us),
              ``grad_out`` is like ``out``, scale / causal / dropout / masks are the kernel's.
``values``    (CPU tensors) the op's documented semantics computed in float64 *by parameter
              name*, returned with the op's own output conventions (lse padding rows are NaN, so
              a consumer that reads them is caught), for end-to-end comparisons.
"""

from __future__ import annotations

import math

import torch

REAL = torch.ops.aten
LEVELS = ("meta", "schema", "contract", "values")

# Parameters declared ``Tensor`` (not ``Tensor?``) that torch itself passes undefined (None from
# Python): the forward returns them undefined for dense inputs, autograd hands them back.
UNDEFINED_OK = {
    "_scaled_dot_product_flash_attention_backward": {"cum_seq_q", "cum_seq_k"},
    "_scaled_dot_product_efficient_attention_backward": {"attn_bias"},
    "_scaled_dot_product_cudnn_attention_backward": {"attn_bias", "cum_seq_q", "cum_seq_k"},
}

FORWARD_OF = {
    "_scaled_dot_product_flash_attention_backward": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention_backward": "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention_backward": "_scaled_dot_product_cudnn_attention",
    "_flash_attention_backward": "_flash_attention_forward",
}
OPS = set(FORWARD_OF) | set(FORWARD_OF.values())


class ContractError(AssertionError):
    pass


def _fail(op, msg):
    raise ContractError(f"{op}: {msg}")


# -- schema level ----------------------------------------------------------------------------

def _type_ok(arg, value, undefined_ok: bool) -> bool:
    t = str(arg.type)
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if t == "Tensor":
        return isinstance(value, torch.Tensor) or (value is None and undefined_ok)
    if t == "Optional[Tensor]":
        return value is None or isinstance(value, torch.Tensor)
    if t == "float":
        return isinstance(value, float)
    if t == "Optional[float]":
        return value is None or isinstance(value, float)
    if t == "bool":
        return isinstance(value, bool)
    if t == "int":
        return is_int
    if t == "Optional[int]":
        return value is None or is_int
    if t == "List[bool]":
        return isinstance(value, (list, tuple)) and all(isinstance(x, bool) for x in value) and (
            arg.N is None or len(value) == arg.N)
    raise ContractError(f"no rule for schema type {t} of {arg.name}")


def bind(op: str, args: tuple, kwargs: dict) -> dict:
    """The call ``op(*args, **kwargs)`` bound to the op's schema: ``{parameter name: value}``."""
    schema = getattr(REAL, op).default._schema
    params = list(schema.arguments)
    positional = [a for a in params if not a.kwarg_only]
    if len(args) > len(positional):
        _fail(op, f"{len(args)} positional arguments, the schema takes {len(positional)}: {schema}")
    bound = {a.name: v for a, v in zip(positional, args)}
    by_name = {a.name: a for a in params}
    for name, v in kwargs.items():
        if name not in by_name:
            _fail(op, f"no parameter named {name!r}: {schema}")
        if name in bound:
            _fail(op, f"{name!r} given twice")
        bound[name] = v
    for a in params:
        if a.name not in bound:
            if not a.has_default_value():
                _fail(op, f"parameter {a.name!r} (no default) missing: {schema}")
            bound[a.name] = a.default_value
        elif not _type_ok(a, bound[a.name], a.name in UNDEFINED_OK.get(op, ())):
            _fail(op, f"parameter {a.name!r} is {a.type}, got {type(bound[a.name]).__name__} {bound[a.name]!r:.80}")
    return bound


# -- contract level --------------------------------------------------------------------------

def _meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def _expect(op, name, t, shape, dtype=None):
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a tensor, got {t!r:.60}")
    if tuple(t.shape) != tuple(shape):
        _fail(op, f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if dtype is not None and t.dtype != dtype:
        _fail(op, f"{name} has dtype {t.dtype}, expected {dtype}")


class Expect:
    """What the kernel promises each call (``scale``), and how the stand-in ops treat fewer kv
    heads than query heads (``gqa``): ``None`` refuses them (a contract error, as the releases
    whose ops require equal heads); ``"native"`` takes them (query head ``i`` uses kv head
    ``i // (h / kv_h)``, gradients summed over each group); ``"wrong"`` takes them but maps query
    head ``i`` to kv head ``i % kv_h`` (an op that silently misreads them); ``"wrong_if_<case>"``
    misreads them only in one kind of call (:data:`GQA_WRONG_IF`) and reads them right otherwise."""

    def __init__(self, scale: float, gqa: str | None = None):
        self.scale, self.gqa = scale, gqa


def _forward_meta(fwd: str, b: dict):
    """The forward op's outputs (meta) for the bound ``query``/``key``/``value``."""
    q, k, v = (_meta(b[n]) for n in ("query", "key", "value"))
    if fwd == "_scaled_dot_product_flash_attention":
        return REAL._scaled_dot_product_flash_attention(q, k, v, 0.0, b["is_causal"], False, scale=b["scale"])
    if fwd == "_scaled_dot_product_efficient_attention":
        return REAL._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, b["is_causal"], scale=b["scale"])
    if fwd == "_scaled_dot_product_cudnn_attention":
        return REAL._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, b["is_causal"], False,
                                                       scale=b["scale"])
    return REAL._flash_attention_forward(q, k, v, _meta(b["cum_seq_q"]), _meta(b["cum_seq_k"]), b["max_q"],
                                         b["max_k"], 0.0, b["is_causal"], False, scale=b["scale"],
                                         window_size_left=b["window_size_left"],
                                         window_size_right=b["window_size_right"])


def check_contract(op: str, b: dict, expect: Expect) -> None:
    varlen = op.startswith("_flash_attention")
    q, k, v = b["query"], b["key"], b["value"]
    if b["dropout_p"] != 0.0:
        _fail(op, f"dropout_p={b['dropout_p']}, the ring never drops out")
    if b["scale"] != expect.scale:
        _fail(op, f"scale={b['scale']}, the kernel was asked for {expect.scale}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        _fail(op, f"dtypes query {q.dtype}, key {k.dtype}, value {v.dtype}")
    if "flash" in op or "cudnn" in op:
        if q.dtype == torch.float32:
            _fail(op, "flash and cuDNN ops take float16/bfloat16 only")
    for name in ("query", "key", "value", "out", "grad_out", "grad_out_"):
        if name in b and isinstance(b[name], torch.Tensor) and b[name].stride(-1) != 1:
            _fail(op, f"{name} needs a contiguous last dimension, strides {b[name].stride()}")
    seq, heads_dim = 2, 1  # [b, h, s, d]; varlen [T, h, d]
    if q.dim() != (3 if varlen else 4) or k.dim() != q.dim() or v.dim() != q.dim():
        _fail(op, f"query/key/value dims {q.dim()}/{k.dim()}/{v.dim()}")
    if k.shape != v.shape or k.size(-1) != q.size(-1):
        _fail(op, f"key {tuple(k.shape)} / value {tuple(v.shape)} do not fit query {tuple(q.shape)}")
    if k.size(heads_dim) != q.size(heads_dim) and (expect.gqa is None or varlen):
        _fail(op, f"key has {k.size(heads_dim)} heads, query {q.size(heads_dim)}: these ops are called with "
                  "expanded kv heads (see TorchKernel's docstring)")
    if not varlen:
        if q.size(0) != k.size(0):
            _fail(op, "batch sizes differ")
        if b["is_causal"] and q.size(seq) != k.size(seq):
            # only the flash op's mask is bottom-right aligned (vendored flash-attn 2): the aligned
            # strict block, n queries against n - 1 keys; the others keep causal calls square
            if "_scaled_dot_product_flash_attention" not in op or q.size(seq) != k.size(seq) + 1:
                _fail(op, f"causal call on {q.size(seq)} x {k.size(seq)}: the ring keeps causal calls square "
                          "(n x n-1 on the flash op only: the aligned strict block)")
    else:
        cq, ck = b["cum_seq_q"], b["cum_seq_k"]
        for name, cu, total in (("cum_seq_q", cq, q.size(0)), ("cum_seq_k", ck, k.size(0))):
            if cu is None or cu.dtype != torch.int32 or cu.dim() != 1 or not cu.is_contiguous():
                _fail(op, f"{name} must be a contiguous int32 vector")
            if cu.device.type != "meta" and (int(cu[0]) != 0 or int(cu[-1]) != total):
                _fail(op, f"{name} must run from 0 to {total}")
        if cq.numel() != ck.numel():
            _fail(op, "cum_seq_q and cum_seq_k count different segments")
        if cq.device.type != "meta":
            if int(torch.diff(cq).max()) > b["max_q"] or int(torch.diff(ck).max()) > b["max_k"]:
                _fail(op, "max_q / max_k below a segment's length")
        wl, wr = b["window_size_left"], b["window_size_right"]
        if wl is None or wr is None:
            _fail(op, "window sizes must be given (None means the op's default)")
        if b["is_causal"] != (wl < 0 and wr == 0):
            _fail(op, f"is_causal={b['is_causal']} with window ({wl}, {wr})")
    if op in FORWARD_OF.values():
        if "compute_log_sumexp" in b and not b["compute_log_sumexp"]:
            _fail(op, "compute_log_sumexp=False: the ring needs the lse")
        if b.get("return_debug_mask"):
            _fail(op, "return_debug_mask=True")
        return
    # backward: out / lse / grad_out exactly as the forward op returns them for these inputs
    fwd = _forward_meta(FORWARD_OF[op], b)
    out, lse = fwd[0], fwd[1]
    grad = b.get("grad_out", b.get("grad_out_"))
    _expect(op, "out", b["out"], out.shape, out.dtype)
    _expect(op, "grad_out", grad, out.shape, out.dtype)
    _expect(op, "logsumexp", b["logsumexp"], lse.shape, lse.dtype)
    if b["logsumexp"].stride() != torch.empty(lse.shape).stride():
        _fail(op, f"logsumexp must be contiguous, strides {b['logsumexp'].stride()}")
    if op == "_scaled_dot_product_flash_attention_backward":
        if b["cum_seq_q"] is not None or b["cum_seq_k"] is not None:
            _fail(op, "dense calls pass cum_seq_q/k undefined, as the forward returns them")
        if (b["max_q"], b["max_k"]) != (q.size(2), k.size(2)):
            _fail(op, f"max_q/max_k {b['max_q']}/{b['max_k']} for blocks {q.size(2)} x {k.size(2)}")
    if op == "_scaled_dot_product_cudnn_attention_backward":
        if (b["max_q"], b["max_k"]) != (q.size(2), k.size(2)):
            _fail(op, f"max_q/max_k {b['max_q']}/{b['max_k']} for blocks {q.size(2)} x {k.size(2)}")
    if op == "_scaled_dot_product_efficient_attention_backward":
        if list(b["grad_input_mask"]) != [True, True, True, False]:
            _fail(op, f"grad_input_mask={b['grad_input_mask']}")
    for name in ("philox_seed", "philox_offset", "rng_state", "unused"):
        if name in b and not isinstance(b[name], torch.Tensor):
            _fail(op, f"{name} must be a tensor")


def check_bias(op: str, b: dict) -> None:
    """The memory-efficient op's additive mask: query dtype, [b, h, sq, sk], aligned rows."""
    bias = b.get("attn_bias")
    if bias is None:
        return
    q, k = b["query"], b["key"]
    _expect(op, "attn_bias", bias, (q.size(0), q.size(1), q.size(2), k.size(2)), q.dtype)
    if bias.stride(-1) != 1 or bias.stride(-2) % 16 != 0:
        _fail(op, f"attn_bias rows must be contiguous and 16-element aligned, strides {bias.stride()}")


# -- values level (float64 reference by parameter name) --------------------------------------

def _attend64(q, k, v, scale, visible):
    """q [.., sq, d], k/v [.., sk, d], visible bool [.., sq, sk] -> out, lse (float64)."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return p @ v.double(), lse


def _grads64(do, q, k, v, out, lse, scale, visible):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    p = torch.exp(s.masked_fill(~visible, float("-inf")) - lse.double().unsqueeze(-1)).nan_to_num(0.0)
    do = do.double()
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.double().transpose(-1, -2)
    delta = (do * out.double()).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    return (ds @ k.double()) * scale, (ds.transpose(-1, -2) @ q.double()) * scale, dv


def _dense_visible(b):
    sq, sk = b["query"].size(2), b["key"].size(2)
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if b["is_causal"]:
        vis = vis.tril(sk - sq)  # bottom-right (non-square on the flash op only, checked above)
    bias = b.get("attn_bias")
    if bias is not None:
        vis = vis & (bias != float("-inf"))
    return vis


def _varlen_segments(b):
    cq, ck = b["cum_seq_q"].tolist(), b["cum_seq_k"].tolist()
    wl, wr = b["window_size_left"], b["window_size_right"]
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        qi = torch.arange(lq).unsqueeze(1) + (lk - lq)  # bottom-right aligned, as flash-attn
        kj = torch.arange(lk).unsqueeze(0)
        vis = torch.ones(lq, lk, dtype=torch.bool)
        if wl >= 0:
            vis &= kj >= qi - wl
        if wr >= 0:
            vis &= kj <= qi + wr
        yield slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1]), vis


GQA_WRONG_IF = {  # the kinds of call in which a "wrong_if_<case>" stand-in misreads kv heads
    "backward": lambda op, b: op.endswith("_backward"),
    "batched": lambda op, b: b["query"].size(0) > 1,
    "noncausal": lambda op, b: not b["is_causal"],
    "rectangular": lambda op, b: b["query"].size(2) != b["key"].size(2),
    "strided": lambda op, b: not b["query"].is_contiguous(),
}


def _kv_heads_of(h: int, kvh: int, gqa: str | None, op: str = "", b: dict | None = None) -> torch.Tensor:
    """For each of ``h`` query heads, the kv head a stand-in op reads (see :class:`Expect`)."""
    i = torch.arange(h)
    if gqa and gqa.startswith("wrong_if_"):
        gqa = "wrong" if GQA_WRONG_IF[gqa[len("wrong_if_"):]](op, b) else "native"
    return i % kvh if gqa == "wrong" else i // (h // kvh)


def reference(op: str, b: dict, meta_out, gqa: str | None = None):
    """The op's result from its documented semantics, in float64, cast to the meta outputs'
    dtypes and shapes; lse padding (rows the op pads) is NaN.  Dense ops with fewer kv heads
    read them as ``gqa`` says (:class:`Expect`)."""
    scale = b["scale"]
    h, kvh = b["query"].size(1), b["key"].size(1)
    if not op.startswith("_flash_attention") and kvh != h:
        heads = _kv_heads_of(h, kvh, gqa, op, b)
        b = {**b, "key": b["key"][:, heads], "value": b["value"][:, heads]}
        res = reference(op, b, meta_out if op in FORWARD_OF.values() else
                        [m.new_empty(b["key"].shape) if i in (1, 2) else m for i, m in enumerate(meta_out)])
        if op in FORWARD_OF.values():
            return res
        res = list(res)
        for i in (1, 2):  # dK / dV in the shape torch's meta kernel gives them
            if meta_out[i].size(1) == kvh:  # flash, cuDNN: summed over the query heads that read each
                summed = torch.zeros(meta_out[i].shape, dtype=torch.float64).index_add_(1, heads, res[i].double())
                res[i] = summed.to(meta_out[i].dtype)
            # efficient: one per query head (the meta kernel says so), the kernel sums the groups
        return tuple(res)

    def like(i, value=None):
        m = meta_out[i]
        if not isinstance(m, torch.Tensor):
            return m
        t = torch.full(m.shape, float("nan"), dtype=m.dtype) if m.is_floating_point() else torch.zeros(m.shape, dtype=m.dtype)
        if value is not None:
            t[tuple(slice(0, n) for n in value.shape)] = value.to(m.dtype).reshape(
                *value.shape, *([1] * (t.dim() - value.dim())))
        return t

    res = list(meta_out)
    if op in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention"):
        out, lse = _attend64(b["query"], b["key"], b["value"], scale, _dense_visible(b))
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # a row with no key: flash-attn's +inf
        res[0], res[1] = like(0, out), like(1, lse)
        return tuple(like(i) if i > 1 else r for i, r in enumerate(res))
    if op == "_flash_attention_forward":
        q, k, v = b["query"], b["key"], b["value"]
        out = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.full((q.size(1), q.size(0)), float("inf"), dtype=torch.float64)
        for sq, sk, vis in _varlen_segments(b):
            o, l = _attend64(q[sq].transpose(0, 1), k[sk].transpose(0, 1), v[sk].transpose(0, 1), scale, vis)
            out[sq], lse[:, sq] = o.transpose(0, 1), l
        res[0], res[1] = like(0, out), like(1, lse)
        return tuple(like(i) if i > 1 else r for i, r in enumerate(res))
    grad = b.get("grad_out", b.get("grad_out_"))
    if op == "_flash_attention_backward":
        q, k, v = b["query"], b["key"], b["value"]
        g = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
        for sq, sk, vis in _varlen_segments(b):
            t = lambda x, s: x[s].transpose(0, 1)  # noqa: E731
            dq, dk, dv = _grads64(t(grad, sq), t(q, sq), t(k, sk), t(v, sk), t(b["out"], sq),
                                  b["logsumexp"][:, sq], scale, vis)
            g[0][sq] += dq.transpose(0, 1)
            g[1][sk] += dk.transpose(0, 1)
            g[2][sk] += dv.transpose(0, 1)
        return tuple(like(i, g[i]) for i in range(3))
    sq = b["query"].size(2)
    lse = b["logsumexp"].reshape(*b["logsumexp"].shape[:2], -1)[:, :, :sq]  # padded / trailing 1
    g = _grads64(grad, b["query"], b["key"], b["value"], b["out"], lse, scale, _dense_visible(b))
    return tuple(like(i, g[i]) if i < 3 else like(i) for i in range(len(meta_out)))


# -- the shim --------------------------------------------------------------------------------

class AtenShim:
    """``torch.ops.aten`` for :mod:`striped_sp.kernels`: checks the attention ops' calls up to
    ``level`` and records them; every other op is the real one."""

    def __init__(self, level: str, scale: float, gqa: str | None = None):
        assert level in LEVELS
        self.level, self.expect, self.calls = level, Expect(scale, gqa), []
        self.kv_heads: list[int] = []  # the key's head count in each dense call (level schema and up)

    def __getattr__(self, name):
        real = getattr(REAL, name)
        if name not in OPS:
            return real

        def call(*args, **kwargs):
            meta_out = real(*(_meta(a) for a in args), **{k: _meta(v) for k, v in kwargs.items()})
            self.calls.append(name)
            at = LEVELS.index(self.level)
            if at >= 1:
                bound = bind(name, args, kwargs)
                if not name.startswith("_flash_attention"):
                    self.kv_heads.append(bound["key"].size(1))
            if at >= 2:
                check_contract(name, bound, self.expect)
                check_bias(name, bound)
            if at >= 3 and args[0].device.type != "meta":
                return reference(name, bound, meta_out, self.expect.gqa)
            return meta_out

        return call


class TorchProxy:
    """The ``torch`` module with ``torch.ops.aten`` replaced by a shim."""

    def __init__(self, shim):
        self._ops = type("Ops", (), {"aten": shim, "__getattr__": lambda s, n: getattr(torch.ops, n)})()

    @property
    def ops(self):
        return self._ops

    def __getattr__(self, name):
        return getattr(torch, name)


def isclose_rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if b.numel() else 0.0


__all__ = ["AtenShim", "TorchProxy", "ContractError", "LEVELS", "bind", "check_contract", "reference", "math"]
