#!/usr/bin/env bash
# The GPU lease check, ONE command within 8 minutes on one H100/H200, from a source checkout with the
# machine's own CUDA torch (nothing installed by this script; flash-attn / flash-attn-4 are used where
# present):
#
#   bash examples/gpu_check.sh [OUT_DIR]        # OUT_DIR defaults to $OUT, else ./gpu_out
#
# It runs `python -m striped_sp.bench.gpu_check all` (striped_sp/bench/gpu_check.py), which
# tests/unit/test_gpu_check.py runs on the CPU at a tiny size with a backend that fails and one that
# hangs, so this script cannot rot:
# 1. env:      the GPU, torch, flash-attn 2 and flash-attn-4 versions (env.json);
# 2. backends: ONE worker process runs, backend by backend (PyTorch's flash op, cuDNN, flash-attn,
#              FA4), the engine in bf16 on dense / packed / windowed rows with GQA against float64,
#              then bench sim with N = 8 ranks on the one GPU at ring-flash-attn's shape (8192 tokens
#              per rank, 32 q / 8 kv heads x 128): striped, zigzag, contiguous as % of ideal, the
#              packed web mix, a window of 4096 (sim_<backend>_<case>.json).  FA4 compiles each flag
#              set once and keeps it on disk (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1);
# 3. the CUDA tests (tests/gpu/test_cuda.py, the GQA probe of PyTorch's ops).
# Every record goes to OUT/records.jsonl the moment it exists; a backend past its limit
# (gpu_check.TIMEOUTS, with the tests' limit at most 480 s in all) loses only the case it was running,
# and the next backend runs in a fresh worker; the summary is printed last.
# Record the figures in docs/results.md with the GPU model from env.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu_out}}
PY=${PY:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
STEP="$PY -m striped_sp.bench.gpu_check"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
$STEP all --out "$OUT" 2>&1 | tee "$OUT/all.log"
