#!/usr/bin/env bash
# The speed issue's device check, one script for a 15-minute GPU lease (about 5-8 minutes on one
# H100/H200), run from a source checkout with the machine's own CUDA torch (nothing installed):
#
#   bash examples/gpu_check.sh [OUT_DIR]        # OUT_DIR defaults to $OUT, else ./gpu_out
#
# 1. correctness: tests/gpu/test_cuda.py (every CUDA kernel against float64 on the ring's block shapes,
#    the striped ring emulated through the ring's own step functions with the sliced and the
#    aligned strict block) and the GQA probe of tests/unit/test_cuda_contracts.py (do PyTorch's fused
#    CUDA ops take fewer kv heads?);
#    The GQA probe's verdict per PyTorch op (gqa_probe.txt).
# 2. sim at N = 8, 32k tokens per rank, Llama-3-8B heads (32 q / 8 kv, head_dim 128), bf16:
#    striped, zigzag, contiguous, speedup over contiguous and efficiency (% of ideal), once with the
#    sliced strict block, once with the aligned one, and once with PyTorch's ops fed strided
#    [b, s, h, d] views instead of contiguous [b, h, s, d] (--tensor-format bshd).
# 3. bench train at N = 1 (NCCL, bf16, the paper preset's width, 4 layers, at most 10 minutes): the
#    Megatron GPTModel and the HF Llama / Mistral training steps (forward, backward, optimizer) run on
#    CUDA end to end for every layout, losses compared; a CP group of one attends locally, so the
#    layouts do the same work here (their speedups need N GPUs: the sims above stand in for N > 1).
# Record the figures in docs/results.md with the GPU model from gpu.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu_out}}
PY=${PY:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
  $PY -c 'import flash_attn; print("flash-attn", flash_attn.__version__)' 2>/dev/null || echo "flash-attn: not installed"
} 2>&1 | tee "$OUT/gpu.txt"

$PY -m pytest -q -p no:cacheprovider tests/gpu/test_cuda.py "tests/unit/test_cuda_contracts.py::test_gqa_native_probe_on_gpu" \
    -rs 2>&1 | tee "$OUT/pytest.log"

# which of PyTorch's CUDA ops take GQA kv heads unexpanded (TorchKernel's one-time probe)
$PY - <<'PYEOF' 2>&1 | tee "$OUT/gqa_probe.txt"
import torch
from striped_sp.kernels_torch import TorchKernel
q = torch.empty(1, 32, 8, 128, device="cuda", dtype=torch.bfloat16)
k = torch.empty(1, 8, 8, 128, device="cuda", dtype=torch.bfloat16)
for op in ("flash", "efficient", "cudnn"):
    print(f"GQA probe, torch {torch.__version__}, {op} op, bf16, head_dim 128: native={TorchKernel(op)._gqa_native(op, q, k)}")
PYEOF

SHAPE=(--device cuda --dtype bfloat16 --batch 1 --heads 32 --kv-heads 8 --head-dim 128 --world-sizes 8
       --tokens-per-rank 32768 --reps 5 --no-progress)
# the sliced run also times the one-device reference (efficiency = % of ideal), the others reuse it
$PY -m striped_sp bench sim "${SHAPE[@]}" --strict-block sliced \
    --json "$OUT/sim_llama8b_sliced.json" 2>&1 | tee "$OUT/sim_llama8b_sliced.log"
$PY -m striped_sp bench sim "${SHAPE[@]}" --strict-block aligned --no-reference \
    --json "$OUT/sim_llama8b_aligned.json" 2>&1 | tee "$OUT/sim_llama8b_aligned.log"
# PyTorch's ops in [b, h, s, d] (the ring's choice) against strided [b, s, h, d] views
$PY -m striped_sp bench sim "${SHAPE[@]}" --strict-block sliced --tensor-format bshd --no-reference \
    --json "$OUT/sim_llama8b_bshd.json" 2>&1 | tee "$OUT/sim_llama8b_bshd.log"

# end-to-end training steps on one GPU (the training loops' CUDA path; speedups need N GPUs)
timeout 600 $PY -m striped_sp bench train --world-size 1 --preset paper --layers 4 --seq-lens 16384,32768 \
    --packed-lens 32768 --window-lens 32768 --rounds 3 --no-progress \
    --json "$OUT/train_1gpu.json" 2>&1 | tee "$OUT/train_1gpu.log"
