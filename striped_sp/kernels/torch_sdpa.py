"""PyTorch's fused SDPA ops as a block kernel (``backend="torch"`` / ``"torch_cudnn"``).

The ops take ``[batch, heads, seq, head_dim]``: that is this kernel's
:attr:`~striped_sp.kernels.Kernel.tensor_format`, which the ring hands it contiguous; the
``[batch, seq, heads, head_dim]`` entry points :meth:`TorchKernel.forward` / ``backward`` are views
over the same calls.  Packed documents and windows (``forward_varlen`` ...) stay in
``[batch, seq, heads, head_dim]``.
"""

from __future__ import annotations

import logging
import os

import torch

from .base import _FLOAT_DTYPES, _HALF_DTYPES, Kernel, _expand_kv, _group_sum, accumulator_dtype, flash2_window, head_dims

__all__ = ["TorchKernel", "GQA_NATIVE_ENV", "gqa_probe_enabled", "cudnn_reason", "cudnn_preferred"]

_LOG = logging.getLogger(__name__)
GQA_NATIVE_ENV = "STRIPED_SP_GQA_NATIVE"
#: the compute capability majors each flash implementation of torch's registry runs on
#: (``torch.nn.attention.current_flash_attention_impl()``; ``None``: the built-in flash-attn 2, sm80+)
_FLASH_IMPL_MAJORS = {"FA3": (9,), "FA4": (9, 10)}
_SAID: set = set()  # the reasons already logged (one line per reason and process, not per call)
_GQA_NATIVE: dict = {}  # (op, device, dtype, head_dim) -> the op takes fewer kv heads as they are


#: the running torch's version (a module constant: tests set it to check another release's contract)
_TORCH_VERSION = torch.__version__


def cudnn_lse_trailing_dim() -> bool:
    """Whether the cuDNN attention op's lse carries a trailing 1: torch >= 2.9 returns it
    ``[B, H, S, 1]`` and its backward takes it so; torch 2.6-2.8 return ``[B, H, S]`` and the
    backward's C++ unsqueezes it itself (a 4-D lse there became 5-D)."""
    major, minor = (int(x) for x in _TORCH_VERSION.split(".")[:2])
    return (major, minor) >= (2, 9)


def cudnn_reason(cap: tuple[int, int], cudnn: int | None, d: int | None, dv: int | None = None,
                 frontend_d256: bool = False, backward: bool = True) -> str | None:
    """Why PyTorch itself would not run its cuDNN attention op on a device of compute capability
    ``cap`` with cuDNN ``cudnn`` (``torch.backends.cudnn.version()``, e.g. 91100) for head dims
    ``(d, dv)`` (``None``: it would).  The rules of ``can_use_cudnn_attention`` in PyTorch's
    ``sdp_utils.cpp`` (checked 2026-12 on its main branch), which a direct call of the op skips:

    * compute capability 8.0 to 12.1, cuDNN 9 (the op needs ``CUDNN_VERSION >= 90000``);
    * head dims multiples of 8, at most 128; up to 256 only on SM 9.0 / 10.x with cuDNN > 9.22 and a
      cuDNN frontend >= 1.24 (``frontend_d256``; SM 10.7 from cuDNN 9.26); ``(192, 128)`` on SM 9.0 /
      10.x from cuDNN 9.11;
    * the backward (``backward``), where 256 is allowed: only ``<= 128``, ``(192, 128)`` or ``(256, 256)``.

    A key length of 1 is refused as well (:meth:`TorchKernel._cuda_op` runs those calls on the
    memory-efficient op)."""
    major, minor = cap
    if not ((8, 0) <= (major, minor) <= (12, 1)):
        return f"PyTorch runs its cuDNN attention on compute capability 8.0-12.1 only, got {major}.{minor}"
    if cudnn is None or cudnn < 90000:
        return f"PyTorch's cuDNN attention needs cuDNN 9 or newer, got {cudnn or 'none'}"
    if d is None:  # head dims unknown: the device and cuDNN only
        return None
    dv = d if dv is None else dv
    sm90_or_10x = (major == 9 and minor == 0) or major == 10
    d256 = sm90_or_10x and not (major == 10 and minor == 7 and cudnn <= 92500) and cudnn > 92200 and frontend_d256
    if d256:
        limit = 256
    elif sm90_or_10x and cudnn >= 91100 and (d, dv) == (192, 128):
        limit = 192
    else:
        limit = 128
    if d > limit or dv > limit:
        return (f"PyTorch's cuDNN attention takes head dims up to {limit} on compute capability {major}.{minor} "
                f"with cuDNN {cudnn} (256 on SM 9.0 / 10.x from cuDNN 9.23 with frontend 1.24; (192, 128) from "
                f"9.11), got ({d}, {dv})")
    if d % 8 or dv % 8:
        return f"PyTorch's cuDNN attention needs head dims multiples of 8, got ({d}, {dv})"
    if backward and d256 and not ((d <= 128 and dv <= 128) or (d, dv) in ((192, 128), (256, 256))):
        return (f"PyTorch's cuDNN attention has no backward for head dims ({d}, {dv}) on compute capability "
                f"{major}.{minor}: <= 128, (192, 128) or (256, 256)")
    return None


def cudnn_preferred(cap: tuple[int, int], cudnn: int | None, cuda: str | None) -> bool:
    """Whether PyTorch ranks its cuDNN attention first (``check_prefer_cudnn_attention`` in
    ``sdp_utils.cpp``): compute capability 9.x / 10.x with cuDNN > 9.15 (9.15.1 fixed sequence
    lengths not divisible by 128); built for CUDA < 13, only minor 0 or 3.  Elsewhere ``auto``
    never picks it."""
    major, minor = cap
    if cudnn is None or cudnn <= 91500 or major not in (9, 10):
        return False
    cuda_major = int(str(cuda).split(".")[0]) if cuda and str(cuda).split(".")[0].isdigit() else 0
    return cuda_major >= 13 or minor in (0, 3)


_D256: dict = {}  # (device, cuDNN version) -> PyTorch takes head dim 256 on the cuDNN op there


def _cudnn_facts(device: torch.device) -> tuple[tuple[int, int], int | None, bool, str | None] | None:
    """``(capability, cuDNN version, frontend takes head dim 256, CUDA version)`` of a CUDA device,
    what :func:`cudnn_reason` / :func:`cudnn_preferred` need; ``None`` without a device to ask (a
    CPU-only build predicting for CUDA: the rules are not applied).  The frontend's version is
    compiled into torch, so PyTorch itself is asked once whether head dim 256 passes its checks.
    One seam: tests patch it to run these rules without a GPU."""
    if not torch.cuda.is_available():
        return None
    cap = tuple(torch.cuda.get_device_capability(device))
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:  # noqa: BLE001 - no usable cuDNN
        cudnn = None
    key = (str(device), cudnn)
    if key not in _D256:
        d256 = False
        if cudnn is not None:
            try:
                q = torch.empty(1, 1, 2, 256, device=device, dtype=torch.bfloat16)
                params = torch.backends.cuda.SDPAParams(q, q, q, None, 0.0, False, False)
                d256 = bool(torch.backends.cuda.can_use_cudnn_attention(params, False))
            except Exception:  # noqa: BLE001 - an older torch without these: no 256
                d256 = False
        _D256[key] = d256
    return cap, cudnn, _D256[key], torch.version.cuda


def _uses_cpu_op(t: torch.Tensor) -> bool:
    """Whether :class:`TorchKernel` takes its CPU op for ``t`` (else the CUDA ops).  One seam, so
    that tests without a GPU can run the CUDA branch on CPU tensors (tests/unit/test_cuda_contracts.py)."""
    return t.device.type == "cpu"


def _cpu_lse(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The CPU op's backward wants lse in float64 for float64 inputs (float32 otherwise)."""
    return lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32).contiguous()


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype, align: int = 1) -> torch.Tensor:
    """0 where ``mask`` is True, -inf elsewhere, in ``dtype``; the last dim's storage padded to a
    multiple of ``align`` (the CUDA memory-efficient op needs aligned bias rows).  A mask that is
    additive already (:meth:`TorchKernel.compile_mask`) is returned as it is."""
    if mask.dtype == dtype:
        return mask
    lk = mask.size(-1)
    if align == 1:  # one pass
        return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device),
                           torch.full((), float("-inf"), dtype=dtype, device=mask.device))
    padded = -(-lk // align) * align
    bias = torch.zeros(*mask.shape[:-1], padded, dtype=dtype, device=mask.device)
    bias[..., :lk].masked_fill_(~mask, float("-inf"))
    return bias[..., :lk]


def gqa_probe_enabled() -> bool:
    """``$STRIPED_SP_GQA_NATIVE``: unset or ``1`` probes (the default), ``0`` always expands;
    anything else is a ``ValueError`` (``ring_attention`` checks it before any message)."""
    value = os.environ.get(GQA_NATIVE_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"${GQA_NATIVE_ENV}={value!r} must be '1' (probe the ops) or '0' (always expand kv heads)")
    return value == "1"


def flash_impl() -> str | None:
    """The flash attention implementation torch's registry has made active
    (``torch.nn.attention.current_flash_attention_impl()`` on the releases that have it; ``None``:
    the built-in one, PyTorch's vendored flash-attn 2)."""
    current = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    return current() if current is not None else None


def flash_impl_reason(impl: str | None, major: int) -> str | None:
    """Why PyTorch's flash op, routed to implementation ``impl``, cannot run on a device of compute
    capability major ``major`` (``None``: it can).  ``FA3`` (the Hopper build's
    ``torch.ops.flash_attn_3``) refuses every device but 9.x; ``FA4`` through torch 2.13's route
    (``torch/nn/attention/_fa4.py``) unpacks two of FA4's results, while flash-attn-4 returns four
    from 4.0.0b19 and five in 4.0.0b36, so every call fails: ``backend="fa4"`` calls FA4 itself."""
    if impl is None:
        return None if major >= 8 else f"PyTorch's flash op needs compute capability 8.0 or newer, got {major}.x"
    if impl == "FA4":
        return ("torch's registry routes the flash op to FA4 (activate_flash_attention_impl('FA4')), whose "
                "torch-side wrapper unpacks 2 of the 4-5 results flash-attn-4 >= 4.0.0b19 returns: use backend='fa4'")
    majors = _FLASH_IMPL_MAJORS.get(impl)
    if majors is not None and major not in majors:
        return (f"torch's registry routes the flash op to {impl}, which runs on compute capability "
                f"{' / '.join(f'{m}.x' for m in majors)} only, not {major}.x")
    return None


def _say_once(reason: str) -> None:
    if reason not in _SAID:
        _SAID.add(reason)
        _LOG.warning("striped_sp backend 'torch': %s; using the memory-efficient op", reason)


def _tracing(t: torch.Tensor) -> bool:
    """Inside ``torch.compile`` tracing, or ``t`` a fake tensor: no probe can run."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and getattr(compiler, "is_compiling", lambda: False)():
        return True
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:
        return False
    return isinstance(t, FakeTensor)


def _is_device_error(e: BaseException) -> bool:
    """A CUDA fault (not an op's argument check): it must not be swallowed."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return (accelerator_error is not None and isinstance(e, accelerator_error)) or "CUDA error" in str(e)


class TorchKernel(Kernel):
    """PyTorch's fused SDPA ops, called directly so that the log-sum-exp is returned.

    CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (GQA native).  CUDA: the flash op for
    fp16/bf16 on sm80+, else the memory-efficient op; the cuDNN op with ``backend="torch_cudnn"``.
    On CUDA, GQA/MQA kv heads go to an op unexpanded only where a one-time probe on the device
    shows that the op takes them (:meth:`_gqa_native`); elsewhere they are expanded *inside* the
    kernel (never on the ring).  What the sources say, which is why it is probed rather than assumed:

    * flash: PyTorch's vendored flash-attn ``mha_fwd``/``mha_bwd`` accept ``num_heads_k`` dividing
      ``num_heads`` (and sum dK/dV over the group), and the newest ``sdp_utils.cpp`` admits GQA for
      the flash backend; but older ``_scaled_dot_product_flash_attention_cuda`` (torch 2.2 era)
      reshaped ``key`` with the *query* head count, so it depends on the release;
    * efficient: ``_efficient_attention_forward`` has ``TORCH_CHECK(query.size(2) == key.size(2))``
      in the releases read; only the newest ``sdp_utils.cpp`` lists GQA for it (non-ROCm);
    * cuDNN: ``sdp_utils.cpp`` admits GQA (``requires_same_num_heads=false``) in recent releases;
    * the meta kernels accept fewer kv heads for all three but check nothing, so they are no
      evidence.  ``enable_gqa`` exists only on ``F.scaled_dot_product_attention``, which returns
      no lse.

    ``tests/unit/test_cuda_contracts.py::test_gqa_native_probe_on_gpu`` reports what each op does on a
    GPU.  The masked and varlen calls keep expanding.  flash-attn (``backend="flash_attn"``) is
    GQA native already.
    """

    name = "torch"
    #: the CPU flash op refuses a v head dim other than q/k's ("Q/K/V should have the same head
    #: size"), and so does the CUDA flash op; the efficient and cuDNN ops may take it, unchecked
    #: on a GPU here: the ring pads v
    native_value_head_dim = False
    tensor_format = "bhsd"  # the ops take [b, h, s, d]: the ring hands them contiguous tensors so

    def __init__(self, cuda_variant: str | None = None):
        self.cuda_variant = cuda_variant
        if cuda_variant == "cudnn":
            self.name = "torch_cudnn"

    def unavailable_reason(self, device, dtype, head_dim=None):
        if device.type == "cpu":
            if self.cuda_variant == "cudnn":
                return "the cuDNN attention op needs a CUDA device"
            if dtype not in _FLOAT_DTYPES:
                return f"dtype {dtype} is not one of {_FLOAT_DTYPES}"
            return None
        if device.type == "cuda":
            if dtype not in (torch.float16, torch.bfloat16, torch.float32):
                return f"dtype {dtype} is not float16, bfloat16 or float32 on CUDA"
            if self.cuda_variant == "cudnn" and dtype not in _HALF_DTYPES:
                return f"the cuDNN attention op needs float16 or bfloat16, got {dtype}"
            # The fused CUDA ops, called directly, do not pad head_dim as F.scaled_dot_product_attention does.
            align = 8 if dtype in _HALF_DTYPES or self.cuda_variant == "cudnn" else 4
            for dim in sorted(set(head_dims(head_dim)) - {None}):
                if dim % align != 0:
                    return f"head_dim={dim} must be a multiple of {align} for the fused CUDA ops with {dtype}"
            facts = _cudnn_facts(device) if self.cuda_variant == "cudnn" else None
            if facts is not None:
                cap, cudnn, d256, _ = facts
                return cudnn_reason(cap, cudnn, *head_dims(head_dim), frontend_d256=d256)
            return None
        return f"no fused PyTorch attention op for device type '{device.type}'"

    # -- CUDA op choice ------------------------------------------------------------------
    def _cuda_op(self, q, k=None) -> str:
        op = self._cuda_op_for(q.device, q.dtype, q.size(-1))
        if op == "cudnn" and k is not None and k.size(-2) == 1:
            return "efficient"  # PyTorch refuses cuDNN for a key length of 1 (sdp_utils.cpp)
        return op

    def _cuda_op_for(self, device, dtype, head_dim: int | None) -> str:
        """``"flash"``, ``"efficient"`` or ``"cudnn"``: the op of a call.  The flash op only where
        the flash implementation torch's registry has active runs (:func:`flash_impl_reason`; the
        reason is logged once), else the memory-efficient op."""
        if self.cuda_variant is not None:
            return self.cuda_variant
        d_ok = all(d is None or (d <= 256 and d % 8 == 0) for d in head_dims(head_dim))
        if dtype not in _HALF_DTYPES or not d_ok:
            return "efficient"
        major, _ = torch.cuda.get_device_capability(device)
        reason = flash_impl_reason(flash_impl(), major)
        if reason is None:
            return "flash"
        if major >= 8:  # a pre-Ampere device never had the flash op: nothing to say
            _say_once(reason)
        return "efficient"

    def kernel_class(self, device, dtype, head_dim=None, varlen=False):
        device = torch.device(device)
        if device.type != "cuda":
            return "cpu_flash" if device.type == "cpu" else "efficient"
        if varlen and self.cuda_variant == "cudnn":
            return "efficient"  # its masked calls run on the memory-efficient op
        if self.cuda_variant is None and not torch.cuda.is_available():  # no device to ask (a CPU-only build)
            return "torch_flash" if dtype in _HALF_DTYPES else "efficient"
        op = self._cuda_op_for(device, dtype, head_dim)
        if op == "flash":
            return "fa3" if flash_impl() == "FA3" else "torch_flash"
        return op

    def auto_reason(self, device, dtype, head_dim=None):
        device = torch.device(device)
        if self.cuda_variant != "cudnn" or device.type != "cuda":
            return None
        facts = _cudnn_facts(device)
        if facts is None:  # no device to ask: ranked by its class, as predictions do
            return None
        cap, cudnn, _, cuda = facts
        if not cudnn_preferred(cap, cudnn, cuda):
            return (f"PyTorch prefers its cuDNN attention only on compute capability 9.x / 10.x with cuDNN > 9.15, "
                    f"got {cap[0]}.{cap[1]} with cuDNN {cudnn or 'none'} (CUDA {cuda}): auto does not pick it")
        return None

    def deterministic_reason(self, device):
        if torch.device(device).type == "cuda":
            return (f"backend {self.name!r} (PyTorch's fused CUDA attention ops) has no deterministic backward: "
                    "use backend 'fa4' (on SM100), 'flash_attn' (flash-attn's deterministic mode) or 'math'")
        return None

    def causal_alignment(self, device, dtype, head_dim=None):
        if device.type != "cuda":
            return "top_left"
        if getattr(torch.version, "hip", None):
            return "unknown"  # ROCm's flash op is another implementation (not read)
        # flash: PyTorch's vendored flash-attn 2 (mha_fwd); efficient: CausalFromTopLeft; cuDNN: not read
        return {"flash": "bottom_right", "efficient": "top_left"}.get(self._cuda_op_for(device, dtype, head_dim),
                                                                      "unknown")

    def forward(self, q, k, v, causal, scale):
        out, lse = self.forward_native(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, scale)
        return out.transpose(1, 2), lse.contiguous()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        grads = self.backward_native(*(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse, causal, scale)
        return tuple(g.transpose(1, 2) for g in grads)

    def forward_native(self, q, k, v, causal, scale):
        """``q`` ``[b, h, s, d]``, ``k``/``v`` ``[b, kv_heads, s_k, d]`` (any strides)."""
        if _uses_cpu_op(q):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
            return out, lse.to(accumulator_dtype(q.dtype))  # [b, s, h] in memory: a copy only where needed
        op = self._cuda_op(q, k)
        return self._cuda_forward(op, q, k, v, causal, scale, expand=not self._gqa_native(op, q, k))

    def backward_native(self, dout, q, k, v, out, lse, causal, scale):
        if _uses_cpu_op(q):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, _cpu_lse(lse, q), 0.0, causal, scale=scale)
        op = self._cuda_op(q, k)
        return self._cuda_backward(op, dout, q, k, v, out, lse, causal, scale, expand=not self._gqa_native(op, q, k))

    def _cuda_forward(self, op, q, k, v, causal, scale, expand: bool):
        h = q.size(1)
        kt, vt = (_expand_kv(k, h, dim=1), _expand_kv(v, h, dim=1)) if expand else (k, v)
        if op == "flash":
            res = torch.ops.aten._scaled_dot_product_flash_attention(q, kt, vt, 0.0, causal, False, scale=scale)
        elif op == "efficient":
            res = torch.ops.aten._scaled_dot_product_efficient_attention(q, kt, vt, None, True, 0.0, causal, scale=scale)
        else:
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kt, vt, None, True, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
        # The efficient op pads lse to a multiple of 32 rows; cuDNN may add a trailing 1.
        lse = lse.reshape(lse.shape[0], lse.shape[1], -1)[:, :, : q.size(2)]
        return out, lse.float().contiguous()

    def _cuda_backward(self, op, dout, q, k, v, out, lse, causal, scale, expand: bool):
        h, kvh = q.size(1), k.size(1)
        sq, sk = q.size(2), k.size(2)
        kt, vt = (_expand_kv(k, h, dim=1), _expand_kv(v, h, dim=1)) if expand else (k, v)
        # Without dropout the RNG state is never read; cum_seq_q/k are undefined (None) for
        # dense, non-nested inputs, exactly as the forward op returns them.
        rng = q.new_empty(0, dtype=torch.int64)
        lse = lse.contiguous()
        if op == "flash":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, kt, vt, out, lse, None, None, sq, sk, 0.0, causal, rng, rng, scale=scale
            )
        elif op == "efficient":
            padded = -(-sq // 32) * 32
            lse_p = lse.new_zeros(lse.shape[0], lse.shape[1], padded)
            lse_p[:, :, :sq] = lse
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dout, q, kt, vt, None, out, lse_p, rng, rng, 0.0, [True, True, True, False], causal, scale=scale
            )
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, kt, vt, out, lse.unsqueeze(-1) if cudnn_lse_trailing_dim() else lse, rng, rng, None, None,
                None, sq, sk, 0.0, causal, scale=scale)
        return dq, _group_sum(dk, kvh, dim=1), _group_sum(dv, kvh, dim=1)

    # -- GQA without expanding kv heads, where the op takes it -------------------------------
    def _gqa_native(self, op: str, q, k) -> bool:
        """Whether CUDA op ``op`` gets ``k``/``v`` with fewer heads than ``q`` as they are.

        Decided once per (op, device, dtype, head_dim, heads, kv_heads) and cached, by
        :meth:`_probe_gqa`: a refusal or any difference from the expanded call means expand, as
        before.  Not probed (expand, nothing cached) on meta or fake tensors, while tracing for
        ``torch.compile`` or inside a CUDA graph capture.  ``STRIPED_SP_GQA_NATIVE=0`` expands
        always."""
        if q.size(1) == k.size(1) or q.device.type == "meta" or not gqa_probe_enabled():
            return False
        key = (op, str(q.device), q.dtype, q.size(-1), q.size(1), k.size(1))
        if key in _GQA_NATIVE:
            return _GQA_NATIVE[key]
        if _tracing(q) or (q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return False
        _GQA_NATIVE[key] = self._probe_gqa(op, q.device, q.dtype, q.size(-1), q.size(1), k.size(1))
        return _GQA_NATIVE[key]

    def _probe_gqa(self, op, device, dtype, head_dim, heads, kv_heads) -> bool:
        """Run ``op`` forward and backward with the kv heads expanded and as they are, on every
        kind of call the ring makes (batch 2, several tiles): a causal square, a dense rectangle
        (zigzag's halves), the aligned strict block (flash, whose causal mask is bottom-right), and
        strided ``[b, s, h, d]`` views; GQA-native only if every result agrees.  The unexpanded
        K/V are head slices of buffers as large as the expanded ones, so an op that ignored their
        head count reads valid memory and shows a wrong result rather than faulting.  An op that
        raises counts as refusing; a CUDA error (from the synchronisation after the calls) is
        raised, not hidden."""
        scale, tol = 0.125, (1e-4 if dtype == torch.float32 else 2e-2)  # any scale does
        shapes = [(160, 160, True), (160, 80, False)] + ([(160, 159, True)] if op == "flash" else [])
        results = []
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            with torch.no_grad():
                for (sq, sk, causal), fmt in [(c, "bhsd") for c in shapes] + [(shapes[0], "bshd")]:
                    def rnd(n, h):  # [2, h, n, d]: heads of a buffer holding all `heads`
                        full = torch.randn(2, n, heads, head_dim, generator=gen, device=device).to(dtype)
                        return full[:, :, :h].transpose(1, 2) if fmt == "bshd" else full.transpose(1, 2).contiguous()[:, :h]

                    q, dout, k, v = rnd(sq, heads), rnd(sq, heads), rnd(sk, kv_heads), rnd(sk, kv_heads)
                    want = self._cuda_forward(op, q, k, v, causal, scale, expand=True)
                    got = self._cuda_forward(op, q, k, v, causal, scale, expand=False)
                    want += self._cuda_backward(op, dout, q, k, v, *want[:2], causal, scale, expand=True)
                    got += self._cuda_backward(op, dout, q, k, v, *want[:2], causal, scale, expand=False)
                    results.append((got, want))
        except Exception as e:  # noqa: BLE001 - an op that refuses fewer kv heads: expand
            if _is_device_error(e):
                raise
            return False
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # outside the try: a fault must surface
        return all(g.shape == w.shape and bool(torch.allclose(g.float(), w.float(), rtol=tol, atol=tol))
                   for got, want in results for g, w in zip(got, want))

    # -- masks and varlen (packed documents, sliding windows) ------------------------------
    def compile_mask(self, mask, device, dtype):
        """On the CPU the op's additive mask in ``dtype``, built once per batch instead of per call
        (4 or 2 bytes per entry instead of 1).  On CUDA the bool mask: the efficient op wants its
        bias rows at aligned strides, which a packed plan buffer does not keep."""
        if torch.device(device).type != "cpu" or mask.dtype != torch.bool:
            return mask
        return _additive_mask(mask, dtype).contiguous()

    def forward_masked(self, q, k, v, mask, scale):
        if _uses_cpu_op(q):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, False,
                attn_mask=_additive_mask(mask, q.dtype), scale=scale,
            )
            return out.transpose(1, 2), lse.to(accumulator_dtype(q.dtype)).contiguous()
        h = q.size(2)
        bias = _additive_mask(mask, q.dtype, align=16).expand(q.size(0), h, q.size(1), k.size(1))
        res = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.transpose(1, 2), _expand_kv(k, h).transpose(1, 2), _expand_kv(v, h).transpose(1, 2),
            bias, True, 0.0, False, scale=scale)
        return res[0].transpose(1, 2), res[1][:, :, : q.size(1)].float().contiguous()

    def backward_masked(self, dout, q, k, v, out, lse, mask, scale):
        if _uses_cpu_op(q):
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                out.transpose(1, 2), _cpu_lse(lse, q), 0.0, False,
                attn_mask=_additive_mask(mask, q.dtype), scale=scale,
            )
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        h, kvh, sq = q.size(2), k.size(2), q.size(1)
        bias = _additive_mask(mask, q.dtype, align=16).expand(q.size(0), h, sq, k.size(1))
        lse_p = lse.new_zeros(lse.shape[0], lse.shape[1], -(-sq // 32) * 32)
        lse_p[:, :, :sq] = lse
        rng = q.new_empty(0, dtype=torch.int64)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout.transpose(1, 2), q.transpose(1, 2), _expand_kv(k, h).transpose(1, 2),
            _expand_kv(v, h).transpose(1, 2), bias, out.transpose(1, 2), lse_p, rng, rng, 0.0,
            [True, True, True, False], False, scale=scale)
        return dq.transpose(1, 2), _group_sum(dk.transpose(1, 2), kvh), _group_sum(dv.transpose(1, 2), kvh)

    def native_varlen(self, device, dtype, head_dim=None) -> bool:
        device = torch.device(device)  # not the CPU: CUDA (or meta tensors dry-running the CUDA branch)
        return device.type != "cpu" and self.cuda_variant is None and self._cuda_op_for(device, dtype, head_dim) == "flash"

    def varlen_forward_op(self, q, k, v, cu_q, cu_k, max_q, max_k, wl, wr, scale):
        wl, wr = flash2_window(wl, wr)
        h = q.size(1)
        res = torch.ops.aten._flash_attention_forward(
            q, _expand_kv(k.unsqueeze(0), h)[0], _expand_kv(v.unsqueeze(0), h)[0], cu_q, cu_k, max_q, max_k,
            0.0, wl < 0 and wr == 0, False, scale=scale, window_size_left=wl, window_size_right=wr)
        return res[0], res[1]

    def varlen_backward_op(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, wl, wr, scale):
        wl, wr = flash2_window(wl, wr)
        h, kvh = q.size(1), k.size(1)
        rng = q.new_empty(0, dtype=torch.int64)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, _expand_kv(k.unsqueeze(0), h)[0], _expand_kv(v.unsqueeze(0), h)[0], out, lse,
            cu_q, cu_k, max_q, max_k, 0.0, wl < 0 and wr == 0, rng, rng, scale=scale,
            window_size_left=wl, window_size_right=wr)
        return dq, _group_sum(dk.unsqueeze(0), kvh)[0], _group_sum(dv.unsqueeze(0), kvh)[0]
