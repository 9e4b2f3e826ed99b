"""The scheduled varlen path's direct calls: their layers (distinct query and key rows, one
merge each, batches merged with them) against a float64 reference, the halving rule that decides how many
pieces a causal square becomes, the host ops per piece, and masks compiled once per batch."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from striped_sp.kernels import KERNELS
from striped_sp.kernels import schedule as schedule_mod
from striped_sp.kernels.schedule import halving_rule, schedule
from striped_sp.kernels.segments import Segments
from striped_sp.kernels.varlen import Arena, compile_call
from striped_sp.plan.cost import COST_MODELS
from striped_sp.plan.ring_plan import _halving

SCALE = 0.25


def _segments(docs, causal=True, gap=0, k_starts=None):
    """One segment per document length, every one causal (or full), ``gap`` rows between them;
    ``k_starts``: the segments' first keys (default: their first rows)."""
    lq = torch.tensor(docs)
    starts = torch.cumsum(lq + gap, 0) - lq - gap
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lq, 0)])
    wr = torch.zeros(len(docs), dtype=torch.int64) if causal else torch.full((len(docs),), -1)
    ks = starts if k_starts is None else torch.tensor(k_starts)
    return Segments(cu, cu, torch.full((len(docs),), -1), wr, starts, ks)


def _reference(q, k, v, segs):
    """float64 per-segment attention (top-left causal squares or full), 0 / -inf elsewhere."""
    g = q.size(2) // k.size(2)
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.size(0), q.size(2), q.size(1)), float("-inf"), dtype=torch.float64)
    for t in range(len(segs)):
        a, c, n = int(segs.q_start[t]), int(segs.k_start[t]), int(segs.lq[t])
        s = torch.einsum("bqhd,bkhd->bhqk", q[:, a:a + n].double(),
                         k[:, c:c + n].double().repeat_interleave(g, 2)) * SCALE
        if int(segs.wr[t]) == 0:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        rows = torch.arange(a, a + n)
        lse = lse.index_copy(2, rows, torch.logsumexp(s, -1))
        out = out.index_copy(1, rows, torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1),
                                                   v[:, c:c + n].double().repeat_interleave(g, 2)))
    return out, lse


def _run_program(kernel, program, q, k, v, dout):
    acc = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full((q.size(0), q.size(2), q.size(1)), float("-inf"))
    kernel.forward_varlen(q, k, v, program, SCALE, acc, lse)
    out = acc.to(q.dtype)
    grads = [torch.zeros(t.shape, dtype=torch.float32) for t in (q, k, v)]
    kernel.backward_varlen(dout, q, k, v, out, lse, program, SCALE, *grads)
    return (out, lse, *grads)


def _check_program(kernel, program, q, k, v, dout, segs):
    """The program's forward and gradients against float64; returns the reference ``(out, lse)``."""
    got = _run_program(kernel, program, q, k, v, dout)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _reference(qr, kr, vr, segs)
    (ref * dout.double()).sum().backward()
    for name, x, want in zip(("out", "lse", "dq", "dk", "dv"), got, (ref, ref_lse, qr.grad, kr.grad, vr.grad)):
        assert _err(x, want) < 1e-5, name
    return ref, ref_lse


def _err(x, ref):
    x, ref = x.detach().double(), ref.detach().double()
    diff = torch.where(torch.isinf(ref) & (x == ref), torch.zeros_like(x), x - ref)
    return float(diff.abs().max()) / max(1.0, float(ref[~torch.isinf(ref)].abs().max()))


def _compiled(kernel, segs, b, n, halve):
    arena = Arena()
    program = compile_call(kernel, segs, b, n, n, "cpu", torch.float32, 16, arena, halve)
    arena.place("cpu")
    return program


NEVER = halving_rule(lambda r, k, c: 1.0, 1e9)  # one more call never pays: squares stay whole


def _disjoint(ranges) -> bool:
    ranges = sorted(ranges)
    return all(r[1] <= nxt[0] for r, nxt in zip(ranges, ranges[1:]))


CASES = {  # docs, gap, halve, batch rows, key starts, layers
    "span": ([130, 140, 129, 150], 0, NEVER, 1, None, 1),
    "gaps": ([130, 140, 129, 150], 3, NEVER, 1, None, 1),
    "halved": ([600, 300], 2, None, 1, None, 3),  # 600 rows: halved twice
    "batch2": ([600, 140], 1, None, 2, None, 3),
    "shared_keys": ([130, 140, 150], 0, NEVER, 1, [0, 0, 300], 1),
    "mixed": ([130, 20, 33, 140, 17, 60], 0, NEVER, 1, None, 1),
    "long": ([1100, 130, 1030], 2, NEVER, 1, None, 1),  # pieces of 1024 rows or more: merged on their slices
}


@pytest.mark.parametrize("backend", ["torch", "math"])
@pytest.mark.parametrize("case", list(CASES))
def test_layered_merge_matches_float64(backend, case, seed):
    """Direct pieces in layers of distinct query and key rows, each layer's results merged at once:
    documents back to back (one slice), with gaps between them (an index), a halved causal square
    (its rectangle shares query rows with a triangle: a second layer), two batch rows, two documents
    that see the same keys (one layer, one of them with key views of its own), short documents between long ones (their batches merged
    with the direct pieces)."""
    kernel = KERNELS[backend]
    docs, gap, halve, b, k_starts, n_layers = CASES[case]
    segs = _segments(docs, gap=gap, k_starts=k_starts)
    n = max(int(segs.q_start[-1] + segs.lq[-1]) + gap, int((segs.k_start + segs.lk).max()))
    program = _compiled(kernel, segs, b, n, halve)
    assert len(program.layers) == n_layers, [x.pieces for x in program.direct_layers]
    for layer in program.direct_layers:  # no query row twice in a layer, nor a key row in its key split
        shared = [p[2:4] for p, j in zip(layer.pieces, layer.k_chunk) if j >= 0]
        assert _disjoint([p[:2] for p in layer.pieces]) and _disjoint(shared) and shared
        assert layer.q_extent == sum(layer.q_sizes) == max(p[1] for p in layer.pieces)
        assert layer.k_extent == sum(layer.k_sizes) == max(b for _, b in shared)
    if case == "shared_keys":  # one layer: the second document's keys are the first's, its own view
        assert program.direct_layers[0].k_chunk[1] == -1
    assert (program.layers[0].span is not None) == (case in ("span", "shared_keys", "long"))
    assert program.layers[0].alone == ((0, 2) if case == "long" else ())
    assert bool(program.batches) == (case == "mixed")
    if case == "mixed":
        assert program.layers[0].direct is not None and program.layers[0].batches
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, n, 4, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, n, 2, 16, generator=gen) for _ in range(2))
    ref, ref_lse = _check_program(kernel, program, q, k, v, dout, segs)
    # merged into accumulators that hold a result already (a ring's later steps): a softmax-weighted
    # mean with it, whichever of the two log-sum-exps is larger
    rows = ~torch.isinf(ref_lse)
    prior = torch.randn(q.shape[:-1] + (16,), generator=gen, dtype=torch.float64)
    prior_lse = torch.where(rows, ref_lse.detach() + torch.randn(ref_lse.shape, generator=gen, dtype=torch.float64),
                            ref_lse.detach())
    acc, lse = prior.float(), prior_lse.float()
    kernel.forward_varlen(q, k, v, program, SCALE, acc, lse)
    both = torch.logaddexp(prior_lse, ref_lse.detach())
    w = torch.where(rows, torch.exp(prior_lse - both), torch.ones_like(both)).transpose(1, 2).unsqueeze(-1)
    want = prior * w + ref.detach() * (1 - w)
    assert _err(acc, want) < 1e-5 and _err(lse, both) < 1e-5


def test_halving_follows_the_price():
    """A causal square is halved where the kernel time saved beats the host time of the extra
    calls: at 32 heads of 128 on the CPU model, not at 1 head of 8; without a rule, always."""
    segs = _segments([1024])
    cpu = COST_MODELS["cpu"]
    pieces = {name: len(schedule(segs, rule).direct) for name, rule in
              (("always", None), ("big", _halving(cpu, 32, 1, 128)), ("tiny", _halving(cpu, 1, 1, 8)))}
    assert pieces["always"] == 15 and pieces["tiny"] == 1 and pieces["big"] > 1, pieces
    # the rule compares like with like: a free extra call halves as far as the model gains
    free = halving_rule(lambda r, k, c: cpu.call(r, k, c), 0.0)
    assert len(schedule(segs, free).direct) > 1


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func).split(".")[1]] += 1
        return func(*args, **(kwargs or {}))


def test_host_ops_per_piece_are_few():
    """Forward + backward of a program of many whole causal documents back to back (one piece
    each, one layer): one kernel call per piece and pass and, beside them, one op per piece (the
    backward op's lse) and a few per layer (the splits, the concatenation and merge, the three
    gradient adds): no op per piece for its views, its merge or its gradient adds."""
    kernel = KERNELS["torch"]
    docs = [130 + 3 * i for i in range(40)]  # each at least the direct size, distinct lengths
    segs = _segments(docs, gap=1)
    n = int(segs.q_start[-1] + segs.lq[-1])
    program = _compiled(kernel, segs, 1, n, NEVER)
    assert len(program.direct) == len(docs) and len(program.layers) == 1
    q, k, v, dout = (torch.randn(1, n, 2, 16) for _ in range(4))
    with _Ops() as ops:
        _run_program(kernel, program, q, k, v, dout)
    kernels = ops.ops["_scaled_dot_product_flash_attention_for_cpu"] + \
        ops.ops["_scaled_dot_product_flash_attention_for_cpu_backward"]
    assert kernels == 2 * len(docs)
    other = sum(ops.ops.values()) - kernels
    assert other <= len(docs) + 50, (other, ops.ops.most_common(8))
    assert ops.ops["split_with_sizes"] == 12 and ops.ops["_foreach_add_"] == 3 and ops.ops["slice"] == 0


def test_masks_are_compiled_once():
    """Batched masked calls on the CPU get their additive mask at compile time: running the
    program builds none (no masked_fill), and the result is exact."""
    kernel = KERNELS["torch"]
    segs = _segments([20, 33, 41, 17, 60, 12], causal=False, gap=1)  # short full documents: packs with a mask
    n = int(segs.q_start[-1] + segs.lq[-1])
    program = _compiled(kernel, segs, 1, n, None)
    assert program.batches and all(p.mask is not None and p.mask.t.dtype == torch.float32 for p in program.batches)
    q, k, v, dout = (torch.randn(1, n, 2, 16) for _ in range(4))
    with _Ops() as ops:
        got = _run_program(kernel, program, q, k, v, dout)
    assert ops.ops["masked_fill_"] == 0 and ops.ops["masked_fill"] == 0
    ref, _ = _reference(q, k, v, segs)
    assert _err(got[0], ref) < 1e-5


@pytest.mark.parametrize("backend", ["torch", "math"])
def test_small_causal_squares_run_unmasked(backend, seed):
    """Short causal documents of every size: one batched causal call per size class, each square
    padded at its end, no mask built (under 16 rows: packs with a mask); exact forward and gradients (padding keys unseen, padding
    rows adding nothing)."""
    kernel = KERNELS[backend]
    gen = torch.Generator().manual_seed(seed)
    docs = torch.randint(1, 128, (30,), generator=gen).tolist() + [16, 127, 1, 5]  # 128 x 128: direct
    segs = _segments(docs, gap=2)
    n = int(segs.q_start[-1] + segs.lq[-1]) + 2
    program = _compiled(kernel, segs, 1, n, NEVER)
    classes = schedule_mod.CAUSAL_CLASSES
    used = {min(c for c in classes if c >= m) for m in docs if m >= classes[0]}
    assert not program.direct and sum(p.causal for p in program.batches) == len(used)
    assert all(p.mask is None for p in program.batches if p.causal)
    assert sum(p.mask is not None for p in program.batches) >= 1  # the documents under 16 rows: packs
    q, dout = (torch.randn(1, n, 4, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, n, 2, 16, generator=gen) for _ in range(2))
    q[:, ::7] *= 30  # large scores on some rows: a padding row that leaked would show
    _check_program(kernel, program, q, k, v, dout, segs)


def _brute_cost(lq, st, chosen, item_ns, batch_ns):
    """Reference price of padding squares ``lq`` (calls ``st``) to the classes ``chosen``."""
    total, batches = 0.0, set()
    for m, t in zip(lq.tolist(), st.tolist()):
        c = min(x for x in chosen if x >= m)
        total += item_ns(c)
        batches.add((t, c))
    return total + batch_ns * len(batches)


def test_size_classes_follow_the_price():
    """The classes chosen cost no more than any other subset of the classes (every subset that
    holds the largest square, priced by brute force); free batches keep every class, dear ones
    leave one."""
    import itertools

    from striped_sp.kernels.schedule import CAUSAL_CLASSES, class_rule

    gen = torch.Generator().manual_seed(12)
    for trial in range(60):
        n = int(torch.randint(1, 60, (1,), generator=gen))
        lq = torch.randint(16, 129, (n,), generator=gen)
        st = torch.randint(0, int(torch.randint(1, 6, (1,), generator=gen)), (n,), generator=gen)
        power = 1.0 + float(torch.rand(1, generator=gen))
        item_ns = lambda c, power=power: c ** (2 * power)  # noqa: E731
        batch_ns = float(torch.rand(1, generator=gen)) * 10 ** int(torch.randint(2, 7, (1,), generator=gen))
        chosen = class_rule(item_ns, batch_ns)(lq, st)
        assert list(chosen) == sorted(chosen) and max(chosen) >= int(lq.max())
        top = min(c for c in CAUSAL_CLASSES if c >= int(lq.max()))
        best = min(_brute_cost(lq, st, sub + (top,), item_ns, batch_ns)
                   for r in range(len(CAUSAL_CLASSES)) for sub in itertools.combinations(
                       [c for c in CAUSAL_CLASSES if c < top], r))
        assert _brute_cost(lq, st, chosen, item_ns, batch_ns) <= best * (1 + 1e-12), trial
    lq, st = torch.tensor([16, 20, 30, 40, 60, 90, 120]), torch.zeros(7, dtype=torch.int64)
    assert class_rule(lambda c: c * c, 0.0)(lq, st) == CAUSAL_CLASSES
    assert class_rule(lambda c: c * c, 1e12)(lq, st) == (128,)


@pytest.mark.parametrize("batch_ns", [3e3, 1e12])
def test_merged_size_classes_are_exact(batch_ns, seed):
    """Squares padded to fewer classes than the table's (the price's choice): one batched call per
    chosen class, exact forward and gradients."""
    from striped_sp.kernels.schedule import class_rule
    from striped_sp.kernels.varlen import ScheduledCall

    kernel = KERNELS["torch"]
    gen = torch.Generator().manual_seed(seed)
    docs = torch.randint(16, 128, (30,), generator=gen).tolist() + [16, 32, 64, 96]  # some of a class's size
    segs = _segments(docs, gap=1)
    n = int(segs.q_start[-1] + segs.lq[-1]) + 1
    rule = class_rule(lambda c: c * c, batch_ns)
    chosen = rule(segs.lq, torch.zeros(len(docs), dtype=torch.int64))
    assert len(chosen) < len({min(c for c in schedule_mod.CAUSAL_CLASSES if c >= m) for m in docs})
    arena = Arena()
    program = ScheduledCall(schedule(segs, NEVER, rule), 1, arena, n, n,
                            lambda m: kernel.compile_mask(m, "cpu", torch.float32))
    used = [min(c for c in chosen if c >= m) for m in docs]  # each square in the smallest chosen class
    assert sorted(p.cq for p in program.batches if p.causal) == sorted(set(used))
    assert sum(p.packs * p.cq for p in program.batches if p.causal) == sum(used)
    q, dout = (torch.randn(1, n, 4, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, n, 2, 16, generator=gen) for _ in range(2))
    q[:, ::5] *= 30
    _check_program(kernel, program, q, k, v, dout, segs)


def test_compiled_plans_price_their_size_classes():
    """``compile_plan`` hands the schedule the class rule of its heads: at 1 head of 8 the small
    squares of a packed row fall into fewer classes than at 32 heads of 128 (where every class
    of the table that holds one is kept)."""
    from striped_sp.engine.request import RingRequest
    from striped_sp.plan.ring_plan import compile_plan

    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(2 * 16, 2 * 128, (60,), generator=gen)  # squares of 16..127 rows per rank at N=2
    bounds = [0] + torch.cumsum(lens, 0).tolist()
    seq = -(-bounds[-1] // 4) * 4
    bounds[-1] = seq
    host = RingRequest(None, layout="striped:stripe=1", cu_seqlens=bounds).prepare(seq, world_size=2, rank=0)

    def classes(heads, d):
        plan = compile_plan(host, kernel=KERNELS["torch"], scale=0.1, heads=heads, head_dim=d)
        return {p.cq for step in plan.programs for prog in step for p in prog.batches if p.causal}

    tiny, big = classes(1, 8), classes(32, 128)
    table = set(schedule_mod.CAUSAL_CLASSES)
    assert big <= table and len(big) >= 5 and len(tiny) < len(big), (tiny, big)
