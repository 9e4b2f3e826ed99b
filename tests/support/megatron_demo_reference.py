"""The CP=1 side of examples/megatron/train_tiny_gpt.py against an independent reference.

The demo test checks that the demo's CP=N run tracks its CP=1 run, which is striped_sp's own
code at CP=1.  This script closes that loop on one gloo rank: the demo's own training steps
(``train_step``, ``packed_train_step``) on its own batches, with the CP=1 model the demo builds,
give the loss and gradients of the same model whose core attention is the float64
``ReferenceCoreAttention`` (nothing from striped_sp) on the plain sequences, packed rows as
dense rows with Megatron's document mask.  Run as a script (Megatron's parallel_state is global):
``python tests/support/megatron_demo_reference.py``; prints one ``ok`` line per case, raises otherwise.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "megatron", "train_tiny_gpt.py")
CASES = (("striped", False), ("striped", True), ("zigzag", True))


class _NoStep:
    """An optimizer that keeps the gradients: the demo's step functions call these two."""

    def zero_grad(self, set_to_none=True):
        pass

    def step(self):
        pass


def _demo():
    spec = importlib.util.spec_from_file_location("train_tiny_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check(demo, algo: str, packed: bool) -> None:
    import striped_sp.megatron as sm
    from megatron_reference import document_mask, use_reference_attention
    from reference import rel_err
    from striped_sp.megatron.toy import single_rank_group, tiny_gpt

    args = demo.parse_args(["--world-size", "1", "--cp", "1", "--batch", "2", "--algo", algo]
                           + (["--packed"] if packed else []))
    sm.install(algo)
    try:
        group = single_rank_group()
        common = dict(vocab_size=args.vocab, max_seq_len=args.seq_length, hidden=64, heads=4, kv_heads=2,
                      layers=2, position_embedding_type="rope", seed=args.seed, init_std=args.init_std)
        model, ref = tiny_gpt(group, algo, **common), tiny_gpt(group, algo, **common)
        use_reference_attention(ref, ref.config)
        ref_loss = torch.zeros((), dtype=torch.float64)
        if packed:
            rows = demo.make_packed_rows(args, 0)
            loss = demo.packed_train_step(model, _NoStep(), rows, 1.0, algo, group)
            for row in rows:
                seq = row["tokens"].size(1)
                out = ref(row["tokens"], row["position_ids"], document_mask(row["cu_seqlens"].tolist(), seq),
                          labels=row["labels"])
                ref_loss = ref_loss + (out.double() * row["loss_mask"]).sum()
        else:
            batch = demo.make_batch(args, 0)
            loss = demo.train_step(model, _NoStep(), batch, 1.0)
            out = ref(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            ref_loss = (out.double() * batch["loss_mask"]).sum()
        ref_loss.backward()
        assert rel_err(torch.tensor(loss), ref_loss.detach()) < 1e-5, (algo, packed, loss, ref_loss.item())
        bad = {name: rel_err(p.grad, q.grad) for (name, p), q in zip(model.named_parameters(), ref.parameters())}
        bad = {name: e for name, e in bad.items() if not e < 1e-4}
        assert not bad, f"{algo} packed={packed}: gradient errors above 1e-4: {bad}"
        print(f"ok {algo} packed={packed}: loss {loss:.6f} vs reference {ref_loss.item():.6f}", flush=True)
    finally:
        sm.uninstall()


def main() -> None:
    warnings.filterwarnings("ignore")
    sys.path.insert(0, HERE)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=300))
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(context_parallel_size=1)
        demo = _demo()
        for algo, packed in CASES:
            check(demo, algo, packed)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
