"""CPU shims for running Megatron-LM's own ``pretrain_gpt.py`` on CPU gloo ranks (tests only).

Megatron-LM's training loop assumes CUDA: it asserts ``torch.cuda.is_available()``, moves the
batch with ``.cuda()``, makes tensors on ``device="cuda"`` or ``torch.cuda.current_device()``,
synchronizes, times with CUDA events and reads CUDA memory statistics.  :func:`apply` maps all of
that onto the CPU for the launched process:

* a ``TorchFunctionMode`` rewrites every ``device=`` that names CUDA (``"cuda"``, ``"cuda:0"``,
  ``torch.device("cuda")`` or a bare device index) to the CPU, and ``Tensor.cuda()`` /
  ``Tensor.to("cuda")`` to CPU moves; ``pin_memory`` becomes a no-op;
* the ``torch.cuda`` calls Megatron makes (``is_available``, ``set_device``, ``current_device``,
  ``synchronize``, ``Event``, memory statistics, ...) get CPU stand-ins, and the CUDA random
  generator becomes a CPU generator of its own, so that random draws on "cuda" tensors (Megatron's
  RNG tracker, the JIT warm-up) leave the CPU generator that ``--use-cpu-initialization`` draws the
  weights from alone, as on a GPU (else the warm-up, whose shapes depend on the CP size, would
  give CP=1 and CP=2 different weights);
* ``Tensor.type()`` names float tensors ``torch.cuda.*`` (megatron-core's gradient clipping
  asserts it), torch's own code sees no accelerator (the optimizer's graph-capture check), the
  DataLoader does not pin memory;
* start-up builds that need nvcc or a checkout's Makefile are skipped: the legacy fused kernels
  (the runs turn every fusion off) and the dataset helpers (the megatron-core wheel ships them
  built); Megatron's torch.compile'd fusions run eagerly;
* without triton (CPU torch), megatron-core's triton batch-invariant kernels module is replaced by
  a stub whose entry points refuse (``--batch-invariant-mode`` cannot run on CPU);
* MoE without Transformer Engine: megatron-core's router GEMM (0.16.1 to 0.19.2) names
  ``te_general_gemm``, which only its Transformer Engine import defines (a ``NameError`` without
  it): the name is set to ``None``, megatron-core's own fallback (``torch.mm``); and an expert MLP
  with a bias adds it in place to the output of ``_ReduceFromModelParallelRegion``, which returns
  its input as is (a view autograd forbids modifying in place): that function's forward returns a
  copy (the same values; Transformer Engine's linear layers, used on GPUs, do not go through it).

This module is never imported by the product (striped_sp/): it lives in tests/ on purpose.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["apply"]


def _is_cuda_device(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare index means a CUDA device in torch
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


# Random factories that, asked for a CUDA tensor, must draw from the stand-in CUDA generator:
# on a GPU they would not touch the CPU generator that --use-cpu-initialization draws the weights
# from (Megatron's JIT warm-up draws torch.rand(seq_length // CP, ...) on "cuda" before the model
# is built, which would otherwise shift the CPU weights with the CP size).
_RANDOM_FACTORIES = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like"}

_CUDA_GENERATOR = torch.Generator()

# Random ops on existing tensors (all of them would be CUDA tensors in a GPU run, e.g. the 10%
# dropout of Megatron's JIT warm-up) draw from the stand-in CUDA generator too.
_RANDOM_OPS = {
    "dropout", "dropout_", "native_dropout", "bernoulli", "bernoulli_", "feature_dropout", "alpha_dropout",
}


def _on_cuda_generator(func, args, kwargs):
    cpu_state = torch.get_rng_state()
    torch.set_rng_state(_CUDA_GENERATOR.get_state())
    try:
        return func(*args, **kwargs)
    finally:
        _CUDA_GENERATOR.set_state(torch.get_rng_state())
        torch.set_rng_state(cpu_state)


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = torch.device("cpu")
            if getattr(func, "__name__", "") in _RANDOM_FACTORIES and kwargs.get("generator") is None:
                kwargs["generator"] = _CUDA_GENERATOR
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        name = getattr(func, "__name__", "")
        if name in _RANDOM_OPS and kwargs.get("generator") is None:
            return _on_cuda_generator(func, args, kwargs)
        if name == "type" and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            # megatron-core's gradient clipping asserts 'torch.cuda.FloatTensor' grads
            out = func(*args)
            if out.startswith("torch.") and ".cuda." not in out:
                out = out.replace("torch.", "torch.cuda.", 1)
            return out
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "pin_memory" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            args = tuple(
                torch.device("cpu") if (i > 0 and _is_cuda_device(a) and not isinstance(a, int)) else a
                for i, a in enumerate(args)
            )
            if len(args) > 1 and isinstance(args[1], int) and not isinstance(args[1], bool):
                args = (args[0], torch.device("cpu")) + args[2:]
        return func(*args, **kwargs)


class _Event:
    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, *args, **kwargs):
        import time

        self._t = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 1000.0 * ((other._t or 0.0) - (self._t or 0.0))


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Props:
    major, minor, name, total_memory, multi_processor_count = 9, 0, "cpu-shim", 0, 1


_MODE = None


def _stub_batch_invariant_kernels() -> None:
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    if importlib.util.find_spec("triton") is not None or name in sys.modules:
        return
    stub = types.ModuleType(name)

    def _refuse(*args, **kwargs):
        raise RuntimeError("batch-invariant mode needs triton (CUDA): not available in the CPU test shims")

    for fn in ("enable_batch_invariant_mode", "disable_batch_invariant_mode", "set_batch_invariant_mode"):
        setattr(stub, fn, _refuse)
    stub.is_batch_invariant_mode_enabled = lambda: False
    sys.modules[name] = stub


def _use_prebuilt_dataset_helpers() -> None:
    """The megatron-core wheel ships its C++ dataset helpers built, but no Makefile for
    ``compile_helpers`` (a Megatron-LM checkout has one): keep the built ones."""
    from megatron.core.datasets import utils

    original = utils.compile_helpers

    def compile_helpers():
        try:
            importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError:
            original()

    utils.compile_helpers = compile_helpers


def _skip_fused_kernel_build() -> None:
    """Megatron-LM's legacy fused kernels are built with nvcc at start-up: nothing to build on
    CPU (the run uses --no-masked-softmax-fusion and friends)."""
    try:
        fused_kernels = importlib.import_module("megatron.legacy.fused_kernels")
    except ImportError:
        return
    fused_kernels.load = lambda *args, **kwargs: None


def _no_pinned_loader_memory() -> None:
    """Megatron builds its DataLoader with pin_memory=True: nothing to pin for on CPU (and a CUDA
    build of torch without a driver fails there)."""
    import torch.utils.data as data

    original = data.DataLoader.__init__
    if getattr(original, "__cpu_shim__", False):
        return

    def __init__(self, *args, **kwargs):
        kwargs["pin_memory"] = False
        original(self, *args, **kwargs)

    __init__.__cpu_shim__ = True
    data.DataLoader.__init__ = __init__


def _moe_router_without_te() -> None:
    """megatron-core 0.16.1's ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None``,
    a name its ``moe_utils`` binds only when Transformer Engine imports: bind it to ``None`` (the
    branch megatron-core takes for float64 routers, ``torch.mm``)."""
    try:
        moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    except ImportError:
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _reduce_region_returns_a_copy() -> None:
    """megatron-core's ``_ReduceFromModelParallelRegion.forward`` returns its input (all-reduced in
    place, or untouched on one rank), which autograd treats as a view of it; an MoE expert's MLP
    then adds its bias in place (``output += ...``, megatron-core 0.16.1 ``mlp.py``) and autograd
    refuses.  Return a copy of the same values instead."""
    try:
        mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    except ImportError:
        return
    region = mappings._ReduceFromModelParallelRegion
    if getattr(region.forward, "__cpu_shim__", False):
        return

    def forward(ctx, input_, group):
        return mappings._reduce(input_, group).clone()

    forward.__cpu_shim__ = True
    region.forward = staticmethod(forward)


def apply() -> None:
    """Make the current process run Megatron's CUDA-only calls on the CPU (idempotent)."""
    global _MODE
    if _MODE is not None:
        return
    torch.set_num_threads(1)
    # Megatron's jit_fuser is torch.compile: run those functions eagerly (no inductor build on
    # CPU). Importing dynamo here also builds its table of torch functions before we replace some.
    importlib.import_module("torch._dynamo").config.disable = True

    _stub_batch_invariant_kernels()
    cuda = torch.cuda

    def nothing():  # a fresh function per name: dynamo refuses one object under two names
        return lambda *args, **kwargs: None

    def zero():
        return lambda *args, **kwargs: 0

    cuda.is_available = lambda: True  # Megatron asserts it; torch's own code asks torch.accelerator
    if hasattr(torch, "accelerator"):
        torch.accelerator.current_accelerator = lambda check_available=False: None
        torch.accelerator.is_available = lambda: False
    cuda.device_count = lambda: 1  # Megatron skips its model-parallel groups with 0 devices
    cuda.current_device = lambda: 0
    cuda.set_device = nothing()
    cuda.synchronize = nothing()
    cuda.empty_cache = nothing()
    cuda.Event = _Event
    cuda.Stream = _Stream
    cuda.current_stream = lambda *args, **kwargs: _Stream()
    cuda.default_stream = lambda *args, **kwargs: _Stream()
    cuda.stream = lambda *args, **kwargs: _Stream()
    cuda.set_stream = nothing()
    cuda.get_device_properties = lambda *args, **kwargs: _Props()
    cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    cuda.get_device_name = lambda *args, **kwargs: "cpu-shim"
    for stat in (
        "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
        "device_memory_used", "reset_peak_memory_stats", "reset_max_memory_allocated",
    ):
        setattr(cuda, stat, zero())
    # The "CUDA" random generator: a CPU generator of its own (see the module docstring).
    gen = _CUDA_GENERATOR
    gen.manual_seed(0)

    def get_rng_state(device="cuda"):
        return gen.get_state()

    def set_rng_state(new_state, device="cuda"):
        gen.set_state(new_state.clone())

    def manual_seed(seed):
        gen.manual_seed(int(seed))

    def manual_seed_all(seed):
        gen.manual_seed(int(seed))

    def lazy_call(callable, **kwargs):
        callable()

    for module in (cuda, cuda.random):
        module.get_rng_state = get_rng_state
        module.set_rng_state = set_rng_state
        module.manual_seed = manual_seed
        module.manual_seed_all = manual_seed_all
    cuda.default_generators = (gen,)
    cuda._lazy_call = lazy_call
    cuda._lazy_init = nothing()
    cuda.memory_stats = lambda *args, **kwargs: {}
    cuda.mem_get_info = lambda *args, **kwargs: (0, 0)
    _use_prebuilt_dataset_helpers()
    _no_pinned_loader_memory()
    _skip_fused_kernel_build()
    _moe_router_without_te()
    _reduce_region_returns_a_copy()
    _MODE = _CudaToCpu()
    _MODE.__enter__()
