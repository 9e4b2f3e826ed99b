"""Masked plans on the caller's strided tensors (Megatron's ``[s, b, h, d]`` seen as ``[b, s, h, d]``
with ``b > 1``): exact, and no row gather or gradient add reads or writes a strided view (on the
CPU, ``index_select`` from one copies the whole tensor first: 22 ms instead of 27 us for 100 rows
of 8 x 64 at 8k tokens)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from reference import reference_attention
from seeds import seed_for
from striped_sp.engine.autograd import backward_steps, forward_steps
from striped_sp.engine.local import local_plans
from striped_sp.engine.request import RingRequest
from striped_sp.engine.transport import LocalRing, run_local
from striped_sp.kernels import KERNELS
from striped_sp.plan.layouts import shard, unshard

ROW_OPS = ("aten.index_select", "aten.index_add", "aten.index_fill", "aten.index_copy")


class StridedRowOps(TorchDispatchMode):
    """The row gathers and adds whose tensor (the first argument) is not contiguous."""

    def __init__(self):
        super().__init__()
        self.strided, self.row_ops = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(ROW_OPS):
            self.row_ops += 1
            if not args[0].is_contiguous():
                self.strided.append(name)
        return func(*args, **(kwargs or {}))


def _sbhd(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[b, s, h, d]`` with ``[s, b, h, d]`` storage, as Megatron's adapter hands it on."""
    return x.transpose(0, 1).contiguous().transpose(0, 1)


@pytest.mark.parametrize("args", [dict(layout="striped", window_size=(13, 0)),
                                  dict(layout="zigzag", window_size=(9, 0))],
                         ids=lambda a: a["layout"])
def test_masked_backward_on_strided_inputs_is_exact_and_gathers_from_contiguous_rows(args):
    n, b, seq, h, kvh, d = 2, 2, 2 * 96, 4, 2, 8
    gen = torch.Generator().manual_seed(seed_for(f"strided-{args}"))
    q, do = (torch.randn(b, seq, h, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, seq, kvh, d, generator=gen, dtype=torch.float64) for _ in range(2))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, True, d ** -0.5, None, args["window_size"])
    (ref * do).sum().backward()

    request = RingRequest(None, backend="torch", **args)
    plans = local_plans(request, n, seq // n, device="cpu", dtype=torch.float64, head_dim=d, scale=d ** -0.5,
                        batch=b, kernel=KERNELS["torch"], heads=h)
    assert plans[0].masked
    parts = [[_sbhd(shard(t, n, r, layout=args["layout"])) for r in range(n)] for t in (q, k, v, do)]
    assert not parts[0][0].is_contiguous()
    ring = LocalRing(n)
    fwd = run_local([forward_steps(parts[0][r], parts[1][r], parts[2][r], plans[r], ring.transports[r])
                     for r in range(n)])
    with StridedRowOps() as seen:
        grads = run_local([backward_steps(parts[3][r], parts[0][r], parts[1][r], parts[2][r], *fwd[r], plans[r],
                                          ring.transports[r]) for r in range(n)])
    assert seen.row_ops > 0 and not seen.strided, (seen.row_ops, seen.strided)
    got = [unshard([o for o, _ in fwd], layout=args["layout"])] + [
        unshard([g[i] for g in grads], layout=args["layout"]) for i in range(3)]
    for name, x, want in zip(("out", "dq", "dk", "dv"), got, (ref, qr.grad, kr.grad, vr.grad)):
        err = (x - want.detach()).abs().max().item() / max(1.0, want.abs().max().item())
        assert err < 1e-10, (name, err)


class Clones(TorchDispatchMode):
    """The whole-tensor copies (``.contiguous()`` dispatches to ``aten.clone``) of a tensor without a
    unit stride along its last dim."""

    def __init__(self):
        super().__init__()
        self.clones = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("aten.clone") and args[0].stride(-1) != 1:
            self.clones += 1
        return func(*args, **(kwargs or {}))


def _strided_d(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every other element of a twice-as-wide head dim: ``stride(-1) == 2``."""
    y = x.new_zeros(*x.shape[:-1], 2 * x.size(-1))[..., ::2]
    return y.copy_(x)


@pytest.mark.parametrize("view, extra", [(lambda x: x, 0), (_sbhd, 0), (_strided_d, 4)],
                         ids=["bshd", "sbhd", "strided-head-dim"])
def test_dense_backward_copies_only_inputs_without_a_unit_head_dim_stride(view, extra):
    """The dense ring's backward hands the caller's tensors to the kernel, which needs a unit stride
    along the head dim (a strided one gave wrong gradients silently): it copies exactly the tensors
    that lack it (q, k, v and dout here: 4), none of a ``[b, s, h, d]`` or ``[s, b, h, d]`` view, and
    the gradients are exact."""
    n, b, seq, h, d = 2, 2, 2 * 24, 2, 8
    gen = torch.Generator().manual_seed(seed_for("dense-strided"))
    q, k, v, do = (torch.randn(b, seq, h, d, generator=gen, dtype=torch.float64) for _ in range(4))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, True, d ** -0.5)
    (ref * do).sum().backward()
    plans = local_plans(RingRequest(None, backend="torch"), n, seq // n, device="cpu", dtype=torch.float64,
                        head_dim=d, scale=d ** -0.5, batch=b, kernel=KERNELS["torch"], heads=h)
    assert not plans[0].masked
    parts = [[view(shard(t, n, r)) for r in range(n)] for t in (q, k, v, do)]
    ring = LocalRing(n)
    fwd = run_local([forward_steps(parts[0][r], parts[1][r], parts[2][r], plans[r], ring.transports[r])
                     for r in range(n)])

    def backward(parts):
        return run_local([backward_steps(parts[3][r], parts[0][r], parts[1][r], parts[2][r], *fwd[r], plans[r],
                                         ring.transports[r]) for r in range(n)])

    with Clones() as seen:
        grads = backward(parts)
    assert seen.clones == extra * n, seen.clones
    for i, want in enumerate((qr.grad, kr.grad, vr.grad)):
        got = unshard([g[i] for g in grads])
        assert (got - want).abs().max().item() < 1e-10
