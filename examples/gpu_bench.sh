#!/usr/bin/env bash
# The benchmark at the paper's shapes (Striped Attention, arXiv 2311.09431: 32 heads x 128
# head_dim, bf16, 8 ranks), sized to finish within about five minutes on one GPU.
#
#   bash examples/gpu_bench.sh [OUT_DIR]
#
# 1. sim: 8 ranks simulated on the one GPU with the real kernels, 32k .. 256k tokens in all
#    (4k .. 32k per rank); prints critical path, speedup over contiguous and efficiency per layout,
#    and writes sim_gpu.json / sim_gpu.png.  Add --link-gbps 25 (say) to model the ring link.
# 2. run: a real NCCL run, one rank per GPU, with the peers (PyTorch ring CP, DeepSpeed-Ulysses)
#    -- only when the machine has 2 or more GPUs (NCCL cannot put two ranks on one device).
# 3. sim with packed documents and a sliding window (below).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench_out}
PY=${PY:-python}
mkdir -p "$OUT"

SHAPE=(--batch 1 --heads 32 --head-dim 128 --dtype bfloat16)

# ~1-2 min on an H100/H200: 4 lengths, ~6 distinct block plans each, 3 timed rounds, plus the
# single-device full causal reference (the longest: 256k tokens, ~6 s fwd+bwd per round).
$PY -m striped_sp bench sim "${SHAPE[@]}" --device cuda --world-sizes 8 \
    --seq-lens 32768,65536,131072,262144 --reps 3 \
    --json "$OUT/sim_gpu.json" --plot "$OUT/sim_gpu.png"

# 3. packed documents and a sliding window (varlen kernels: flash-attn when installed, else
#    PyTorch's CUDA flash op): every (rank, step) timed, N = 8, 8192 tokens per rank.
for MASK in "--docs lognormal:median=1024,sigma=1.2" "--window 4096" "--docs fixed:32"; do
    TAG=$(echo "$MASK" | tr -c 'a-z0-9' '_')
    $PY -m striped_sp bench sim "${SHAPE[@]}" --device cuda --world-sizes 8 --tokens-per-rank 8192 \
        --reps 3 $MASK --json "$OUT/sim_gpu_$TAG.json"
done

NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())')
if [ "$NGPU" -ge 2 ]; then
    N=$(( NGPU >= 8 ? 8 : NGPU ))
    # ~1-2 min: 5 implementations x (2 warm-up + 7 timed) fwd+bwd iterations per length.
    $PY -m striped_sp bench run "${SHAPE[@]}" --device cuda --world-size "$N" \
        --tokens-per-rank 4096,16384 --peers torch_ring,ulysses \
        --json "$OUT/run_gpu.json" --plot "$OUT/run_gpu.png"
else
    echo "run: skipped, it needs 2 or more GPUs (found $NGPU); sim above covers one GPU"
fi
