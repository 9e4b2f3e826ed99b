"""Launch Megatron-LM's pretrain_gpt.py on a CPU gloo rank, with the test-only CPU shims.

    torchrun ... tests/support/megatron_lm_launch.py --script DIR <pretrain_gpt.py arguments>
    torchrun ... tests/support/megatron_lm_launch.py --no-patch DIR <pretrain_gpt.py arguments>

``--script DIR`` runs DIR/pretrain_gpt.py as it is (a patched checkout, or any checkout at
CP=1); ``--no-patch DIR``
runs the unmodified DIR through ``striped_sp.megatron.pretrain_gpt`` (the no-patch entry).

``STRIPED_SP_TEST_SCALE_FACTOR=F`` multiplies the softmax scale of striped_sp's core attention by F
(a planted bug: the loss comparison must notice it).  ``STRIPED_SP_TEST_PLANT=NAME`` plants one of
:data:`PLANTS` (the MoE comparisons must notice each).
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import megatron_cpu_shims  # noqa: E402


def _plant_wrong_softmax_scale(factor: float) -> None:
    from striped_sp.megatron import attention

    original = attention.ContextParallelAttention.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.softmax_scale *= factor

    attention.ContextParallelAttention.__init__ = __init__


def _plant_contiguous_batch() -> None:
    """The ``[b, s]`` batch cut into contiguous chunks, not striped: RoPE and the attention still
    take the striped positions."""
    from striped_sp.megatron import data

    data.rows_layout = lambda layout, *row: "contiguous"


def _plant_router_without_cp() -> None:
    """MoE routers that reduce their token counts over the tensor-parallel group only, not over
    TP x CP: each CP rank's aux losses see its own tokens."""
    from megatron.core.transformer.moe import router

    original = router.Router.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.tp_cp_group = self.tp_group

    router.Router.__init__ = __init__


def _plant_sink_grad_dropped() -> None:
    """The attention sinks' gradient dropped (zeros) in the ring's backward."""
    import torch

    from striped_sp.engine import autograd

    autograd.sink_grad = lambda dout, out, lse, sinks: torch.zeros(sinks.shape, dtype=lse.dtype, device=lse.device)


PLANTS = {"contiguous-batch": _plant_contiguous_batch, "router-without-cp": _plant_router_without_cp,
          "sink-grad-dropped": _plant_sink_grad_dropped}


def main() -> None:
    route, root, argv = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3:]
    if root not in sys.path:
        sys.path.insert(0, root)  # megatron.training of this checkout, next to the megatron-core wheel
    megatron_cpu_shims.apply()
    factor = os.environ.get("STRIPED_SP_TEST_SCALE_FACTOR")
    if factor:
        _plant_wrong_softmax_scale(float(factor))
    plant = os.environ.get("STRIPED_SP_TEST_PLANT")
    if plant:
        PLANTS[plant]()
    if route == "--script":
        script = os.path.join(root, "pretrain_gpt.py")
        sys.argv = [script] + argv
        runpy.run_path(script, run_name="__main__")
    elif route == "--no-patch":
        from striped_sp.megatron.pretrain_gpt import main as entry

        entry(["--megatron-lm-dir", root] + argv)
    else:
        raise SystemExit(f"unknown route {route!r}: use --script DIR or --no-patch DIR")


if __name__ == "__main__":
    main()
