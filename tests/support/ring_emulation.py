"""An N-rank ring emulated on one process with the ring's own step functions (striped_sp.engine.step):
every (rank, source) block in the kernel's tensor format, forward then backward, against a
float64 reference.  Used by tests/unit/test_step.py (CPU) and tests/gpu/test_cuda.py (GPU)."""

import torch

import striped_sp
from reference import reference_attention, rel_err
from striped_sp.plan.layouts import get_layout
from striped_sp.engine.step import Accumulator, backward_step, forward_step, from_format, seq_slice, to_format


def emulate_ring(kernel, layout, n, q, k, v, dout, aligned, scale):
    """Full ``[b, S, h, d]`` tensors -> (out, dq, dk, dv) of an ``n``-rank ring, unsharded."""
    fmt = kernel.tensor_format
    lay = get_layout(layout)
    sh = [[to_format(striped_sp.shard(t, n, r, layout=layout), fmt) for r in range(n)] for t in (q, k, v, dout)]
    qs, ks, vs, dos = sh
    local = q.size(1) // n
    outs, lses = [], []
    for r in range(n):
        acc = Accumulator(qs[r], fmt=fmt)
        for t in range(n):
            src = (r - t) % n
            forward_step(kernel, qs[r], ks[src], vs[src], lay.plan(r, src, n, local, True), scale, acc, aligned)
        outs.append(acc.out.to(q.dtype))
        lses.append(acc.lse)
    dq = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in qs]
    dk = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in ks]
    dv = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in vs]
    for r in range(n):
        for t in range(n):
            src = (r - t) % n
            grads = backward_step(kernel, dos[r], qs[r], ks[src], vs[src], outs[r], lses[r],
                                  lay.plan(r, src, n, local, True), scale, dq[r], fmt, aligned)
            for rows, dk_b, dv_b in grads:
                seq_slice(dk[src], rows, fmt).add_(dk_b)
                seq_slice(dv[src], rows, fmt).add_(dv_b)

    def full(parts):
        return striped_sp.unshard([from_format(p, fmt) for p in parts], layout=layout)

    return full(outs), full(dq), full(dk), full(dv)


def check_emulated(kernel, layout, n, heads, aligned, seed, local=7, dtype=torch.float32, tol=1e-5,
                   head_dim=16, device="cpu"):
    """``emulate_ring`` against float64 attention: every relative error of out, dq, dk, dv < ``tol``."""
    h, kvh = heads
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(2, n * local, h, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(2, n * local, kvh, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    scale = head_dim ** -0.5
    qr, kr, vr = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, True, scale)
    (ref * dout.cpu().double()).sum().backward()
    got = [g.cpu() for g in emulate_ring(kernel, layout, n, q, k, v, dout, aligned, scale)]
    errs = {name: rel_err(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got,
                                                        (ref, qr.grad, kr.grad, vr.grad))}
    assert all(e < tol for e in errs.values()), f"seed={seed}: {errs}"
