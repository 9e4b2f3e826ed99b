#!/usr/bin/env bash
# The GPU lease check (<= 8 minutes on one H100/H200), from a source checkout with the machine's own
# CUDA torch (nothing installed by this script; flash-attn / flash-attn-4 are used where present):
#
#   bash examples/gpu_check.sh [OUT_DIR]        # OUT_DIR defaults to $OUT, else ./gpu_out
#
# Its Python steps live in striped_sp/bench/gpu_check.py, which tests/unit/test_gpu_check.py runs on
# the CPU at a tiny size, so this script cannot rot:
# 1. env:   the GPU, torch, flash-attn 2 and flash-attn-4 versions (env.json);
# 2. exact: every available backend (PyTorch's flash op, cuDNN, flash-attn, FA4) runs the engine in bf16
#           on dense / packed (documents shorter than N) / windowed rows with GQA against float64, and
#           the peak memory (exact.json); tests/gpu/test_cuda.py; the GQA probe of PyTorch's ops;
# 3. sims:  bench sim with N = 8 ranks on the one GPU at ring-flash-attn's shape (8192 tokens per rank,
#           32 q / 8 kv heads x 128, bf16): striped, zigzag, contiguous per backend as % of ideal
#           (ring-flash-attn's H800 figures: zigzag 90.2, stripe 82.9, ring 53.9), also on the packed
#           web mix and with a window of 4096 (sim_<backend>_<case>.json).
# Record the figures in docs/results.md with the GPU model from env.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu_out}}
PY=${PY:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
STEP="$PY -m striped_sp.bench.gpu_check"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
$STEP env --out "$OUT" 2>&1 | tee -a "$OUT/gpu.txt"
timeout 120 $STEP exact --out "$OUT" 2>&1 | tee "$OUT/exact.log"
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_cuda.py \
    "tests/unit/test_cuda_contracts.py::test_gqa_native_probe_on_gpu" -rs 2>&1 | tee "$OUT/pytest.log"
$STEP gqa 2>&1 | tee "$OUT/gqa_probe.txt"

# each sim at most 45 s: 3 per backend, up to 4 backends
$STEP sims --out "$OUT" > "$OUT/sims.txt"
while read -r line; do
    name=$(basename "${line##*--json }" .json)
    timeout 45 $PY -m striped_sp $line 2>&1 | tee "$OUT/$name.log"
done < "$OUT/sims.txt"
