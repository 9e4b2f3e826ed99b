"""The engine's executor on the in-process transport (LocalRing): exact at N = 16, 32, 64 for every
layout and parameter against float64, and, on meta tensors, the dry run of the CUDA path that
counts host<->device copies, synchronisations and kernel launches per layer."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from local_exact import check_simulation_exact
from reference import reference_attention
from seeds import seed_for
from striped_sp.engine import local
from striped_sp.engine.plans import PLANS, plan_for
from striped_sp.engine.request import RingRequest
from striped_sp.engine.step import head_splits
from striped_sp.engine.transport import LocalRing, run_local
from striped_sp.kernels import KERNELS, TorchKernel
from striped_sp.plan.cost import model_for

pytestmark = pytest.mark.dist


CASES = [  # (N, tokens per rank, request arguments; "docs" = random documents)
    (16, 6, dict(layout="striped")),
    (16, 6, dict(layout="zigzag")),
    (32, 4, dict(layout="contiguous")),
    (64, 2, dict(layout="striped")),
    (64, 2, dict(layout="zigzag")),
    (16, 8, dict(layout="striped", docs=True)),
    (32, 4, dict(layout="contiguous", docs=True)),
    (16, 6, dict(layout="striped", window_size=(13, 0))),
    (32, 4, dict(layout="striped", docs=True, window_size=(9, 0))),
    (16, 8, dict(layout="striped:stripe=doc", docs=True)),
    (16, 8, dict(layout="striped:stripe=2", window_size=(11, 0))),
    (32, 4, dict(layout="striped:place=auto", docs=True)),
    (16, 8, dict(layout="striped:stripe=doc,place=7", docs=True)),
    (16, 6, dict(layout="striped", causal=False)),
    (16, 8, dict(layout="striped", docs=True, ulysses_size=4)),
    (32, 4, dict(layout="zigzag", ulysses_size=2)),
    (64, 2, dict(layout="striped", docs=True, ulysses_size=8)),
    (16, 8, dict(layout="striped:stripe=auto", docs=True)),
    (32, 4, dict(layout="striped:stripe=auto", docs=True, window_size=(9, 0))),
    (16, 6, dict(layout="striped:stripe=auto")),
    (16, 8, dict(layout="striped:stripe=auto,place=split", docs=True, ulysses_size=4)),
    (16, 8, dict(layout="zigzag", docs="padded")),
    (16, 8, dict(layout="zigzag", docs="padded", window_size=(40, 0))),
    (32, 4, dict(layout="zigzag", docs="padded", ulysses_size=2)),
    (16, 6, dict(layout="zigzag", window_size=(13, 0))),
    (32, 4, dict(layout="contiguous", window_size=(9, 0))),
    (16, 6, dict(layout="zigzag", causal=False)),
    (16, 6, dict(layout="contiguous", causal=False)),
    # mirrored stripes (zigzag's order at any stripe size) and zigzag's placement in the striped family
    (2, 12, dict(layout="striped:stripe=3,order=mirror")),
    (4, 8, dict(layout="striped:stripe=1,order=mirror")),
    (4, 8, dict(layout="striped:stripe=2,order=mirror", docs=True)),
    (4, 8, dict(layout="striped:stripe=1,order=mirror", docs=True)),
    (2, 12, dict(layout="striped:stripe=2,order=mirror", window_size=(5, 0))),
    (4, 8, dict(layout="striped:stripe=2,order=mirror,place=auto", docs=True, window_size=(6, 0))),
    (4, 8, dict(layout="striped:stripe=2,order=mirror", docs=True, ulysses_size=2)),
    (2, 12, dict(layout="striped:stripe=doc")),
    (4, 6, dict(layout="striped")),
    (4, 6, dict(layout="striped", ulysses_size=2)),
    (2, 12, dict(layout="striped", window_size=(5, 0))),
]


@pytest.mark.parametrize("n,per_rank,args", CASES, ids=lambda c: str(c) if not isinstance(c, dict) else
                         ",".join(f"{k}={v}" for k, v in c.items()))
def test_local_ring_is_exact_at_large_n(n, per_rank, args):
    check_simulation_exact(n, per_rank, args, f"local-{n}-{args}")


def test_local_ring_names_a_missing_message():
    ring = LocalRing(2)

    def sends_and_waits():
        transfer = ring.transports[0].shift([torch.zeros(1, 1)], "step 1")
        yield transfer
        transfer.wait()

    def silent():
        return None
        yield

    with pytest.raises(RuntimeError, match="rank 0 waits in step 1 for rank 1, which sent nothing"):
        run_local([sends_and_waits(), silent()])


# -- the CUDA path, dry-run on meta tensors ----------------------------------------------------

class HostWork(TorchDispatchMode):
    """Counts, per op, what would cost the host on a GPU: copies from host memory to the device,
    synchronisations (a device value read on the host, data-dependent shapes), kernel launches."""

    SYNCING = ("aten._local_scalar_dense", "aten.nonzero", "aten.unique", "aten.masked_select",
               "aten.repeat_interleave.Tensor", "aten._unique2")
    KERNELS = ("_flash_attention_forward", "_flash_attention_backward", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_efficient_attention")

    def __init__(self):
        super().__init__()
        self.copies = 0
        self.syncs = collections.Counter()
        self.launches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        on_device = [t for t in tensors if t.device.type != "cpu"]
        if name.startswith(("aten._to_copy", "aten.copy_")):
            target = kwargs.get("device")
            src_host = any(t.device.type == "cpu" for t in tensors)
            if (target is not None and torch.device(target).type != "cpu" and src_host) or \
                    (name.startswith("aten.copy_") and args[0].device.type != "cpu" and args[1].device.type == "cpu"):
                self.copies += 1
        if on_device and name.startswith(self.SYNCING):
            self.syncs[name] += 1
        if any(k in name for k in self.KERNELS):
            self.launches += 1
        return func(*args, **kwargs)


@pytest.fixture
def cuda_branch_on_meta(monkeypatch):
    """TorchKernel's CUDA branch for meta tensors: the flash op (bf16 on an sm80+ GPU)."""
    monkeypatch.setattr(TorchKernel, "_cuda_op_for", lambda self, device, dtype, head_dim=None: "flash")
    return KERNELS["torch"]


@pytest.mark.parametrize("args", [
    dict(layout="striped", cu_seqlens="web"),
    dict(layout="striped:stripe=doc", cu_seqlens="web"),
    dict(layout="striped", cu_seqlens="web", window_size=(255, 0)),
    dict(layout="zigzag"),
    dict(layout="striped"),
], ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()))
def test_dry_run_of_the_cuda_path_has_no_host_work_after_the_first_layer(cuda_branch_on_meta, args):
    n, seq, h, d = 8, 8 * 512, 4, 64
    args = dict(args)
    if args.get("cu_seqlens") == "web":
        gen = torch.Generator().manual_seed(seed_for("dry-run"))
        lengths = torch.exp(torch.randn(64, generator=gen) * 1.2 + 5.5).long().clamp(min=1).tolist()
        bounds = [0]
        for length in lengths:
            if bounds[-1] + length >= seq:
                break
            bounds.append(bounds[-1] + length)
        args["cu_seqlens"] = bounds + [seq]
    q, do = (torch.empty(1, seq, h, d, dtype=torch.bfloat16, device="meta") for _ in range(2))
    k, v = (torch.empty(1, seq, 2, d, dtype=torch.bfloat16, device="meta") for _ in range(2))
    with HostWork() as first:
        sim = local.simulate(q, k, v, n, do, kernel=cuda_branch_on_meta, **args)
    assert sim.out.device.type == "meta" and sim.dq.shape == q.shape
    masked = sim.plans[0][0].masked
    # the first layer places each rank's plan on the device with one copy, and synchronises nowhere
    assert first.copies == (n if masked else 0), first.copies
    assert not first.syncs, first.syncs
    with HostWork() as later:  # the batch's next layer: its plans as built
        local.simulate(q, k, v, n, do, kernel=cuda_branch_on_meta, plans=sim.plans, **args)
    assert later.copies == 0 and not later.syncs, (later.copies, later.syncs)
    # kernel launches: what the plans say, forward and backward, on every rank
    forward = sum(p.launches(t) for p in sim.plans[0] for t in range(p.steps))
    halves = 1 if masked else len(head_splits(h, 2))  # dense backward calls run in head halves
    assert later.launches == forward * (1 + halves), (later.launches, forward)


def test_layers_of_a_batch_share_one_plan():
    PLANS.clear()
    request = RingRequest(None, layout="striped", cu_seqlens=[0, 100, 256])
    mask = request._mask(32, 8)
    kernel = KERNELS["torch"]
    plans = {id(plan_for(request.layout, mask, True, 8, 3, 32, kernel=kernel, scale=0.125)) for _ in range(5)}
    assert len(plans) == 1 and PLANS.builds == 2  # the host plan and its compilation, once
    plan = plan_for(request.layout, mask, True, 8, 3, 32, kernel=kernel, scale=0.125)
    assert plan.cost_model == "cpu"  # PyTorch's CPU op: the measured model
    # every step's prediction, by hand: rank 3 of 8 holds 13 tokens of document [0, 100) (100 = 8 x 12
    # + 4: ranks 0-3 hold 13) and 19 of [100, 256) (it is that document's 8th rank: 156 = 8 x 19 + 4,
    # its first 4 ranks hold 20).  Steps 0-3 bring ranks 3, 2, 1, 0: a 13 x 13 causal square of the
    # first document; steps 4-7 ranks 7-4, later ranks: its strict block, 12 x 12.  The second
    # document is a 19 x 19 causal square every step (no rank is later than rank 3 in it).
    model = model_for("torch", "cpu")
    want = [(model.call(13 if t < 4 else 12, 13 if t < 4 else 12, True) + model.call(19, 19, True)) / 1e6
            for t in range(8)]
    assert plan.steps == 8 and plan.predicted_ms == pytest.approx(want, rel=1e-9), (plan.predicted_ms, want)


def test_plans_prepared_ahead_are_the_layers_plans():
    import striped_sp

    PLANS.clear()
    cu = [0, 100, 101, 256]
    host = striped_sp.prepare_plans(256, world_size=8, rank=3, layout="striped", cu_seqlens=cu)
    assert PLANS.builds == 1
    request = RingRequest(None, layout="striped", cu_seqlens=cu)
    plan = plan_for(request.layout, request._mask(32, 8), True, 8, 3, 32, kernel=KERNELS["torch"], scale=0.125)
    assert plan.calls is host.calls and PLANS.builds == 2  # the layer only compiles the prepared plan
    with pytest.raises(ValueError, match="cu_seqlens ends at 256"):
        striped_sp.prepare_plans(512, world_size=8, rank=3, cu_seqlens=cu)


@pytest.mark.parametrize("layout", ["striped:place=64", "striped:stripe=doc,place=64", "striped:stripe=auto"])
def test_a_row_of_whole_documents_runs_one_step_and_sends_nothing(layout):
    """Documents that all stay whole on their ranks: one ring step, no transfer at all, exact."""
    n, per_rank = 8, 64
    gen = torch.Generator().manual_seed(seed_for(f"whole-{layout}"))
    bounds = list(range(0, n * per_rank + 1, 16))  # 32 documents of 16 tokens: 4 per rank, whole
    h, d = 2, 8
    q, k, v, do = (torch.randn(1, n * per_rank, h, d, generator=gen, dtype=torch.float64) for _ in range(4))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, True, d ** -0.5, bounds, None)
    (ref * do).sum().backward()
    sim = local.simulate(q, k, v, n, do, backend="torch", layout=layout, cu_seqlens=bounds)
    assert [p.steps for p in sim.plans[0]] == [1] * n
    assert sim.rings[0].sent_bytes == 0
    for got, want in ((sim.out, ref), (sim.dq, qr.grad), (sim.dk, kr.grad), (sim.dv, vr.grad)):
        assert (got - want.detach()).abs().max().item() < 1e-10
