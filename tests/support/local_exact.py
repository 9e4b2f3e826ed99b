"""One check for the in-process executor (:func:`striped_sp.engine.local.simulate`) against a float64
reference on the full row: output and gradients, with random documents on request."""

from __future__ import annotations

import torch

from reference import reference_attention
from seeds import seed_for
from striped_sp.engine import local


def random_docs(seq_len: int, gen: torch.Generator) -> list[int]:
    """Random document bounds: some shorter than the ring, one long."""
    cuts = sorted(set(torch.randint(1, seq_len, (7,), generator=gen).tolist()) | {3, 4})
    return [0, *cuts, seq_len]


def check_simulation_exact(n: int, per_rank: int, args: dict, name: str, heads: int = 8, kv_heads: int = 2,
                           head_dim: int = 8) -> None:
    """``simulate`` on ``n`` ranks of ``per_rank`` tokens with ``args`` (``docs=True``: random documents,
    ``docs="padded"``: every document a multiple of ``2n``) against float64, to 1e-10 relative;
    the inputs seeded by ``name``."""
    gen = torch.Generator().manual_seed(seed_for(name))
    seq = n * per_rank
    args = dict(args)
    docs = args.pop("docs", False)
    if docs == "padded":  # zigzag: every document a multiple of 2N (as pad_documents leaves them)
        unit = 2 * n
        args["cu_seqlens"] = [0, *sorted(set((torch.randint(1, seq // unit, (3,), generator=gen) * unit).tolist())), seq]
    elif docs:
        args["cu_seqlens"] = random_docs(seq, gen)
    q, do = (torch.randn(1, seq, heads, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, seq, kv_heads, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    causal = args.get("causal", True)
    ref = reference_attention(qr, kr, vr, causal, head_dim ** -0.5, args.get("cu_seqlens"), args.get("window_size"))
    (ref * do).sum().backward()
    sim = local.simulate(q, k, v, n, do, backend="torch", **args)
    for what, got, want in (("out", sim.out, ref), ("dq", sim.dq, qr.grad), ("dk", sim.dk, kr.grad),
                            ("dv", sim.dv, vr.grad)):
        err = (got - want.detach()).abs().max().item() / max(1.0, want.abs().max().item())
        assert err < 1e-10, (what, err)
