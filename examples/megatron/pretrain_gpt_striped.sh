#!/bin/bash
# GPT pretraining with striped context parallelism: Megatron-LM (tag core_v0.16.1) pretrain_gpt.py
# on one node, mock data, --context-parallel-size $CP --context-parallel-algo $ALGO.
#
#   MEGATRON_LM_DIR=/path/to/Megatron-LM bash examples/megatron/pretrain_gpt_striped.sh
#
# PATCHED=1 runs $MEGATRON_LM_DIR/pretrain_gpt.py of a checkout with
#   patches/megatron_lm_core_v0.16.1_context_parallel_algo.patch applied;
# PATCHED=0 (default) runs the unmodified checkout through `-m striped_sp.megatron.pretrain_gpt`.
# Either way `pip install striped_sp` (this repository) must be importable.
# What changes against a usual launch script: the two CP flags below, --attention-dropout 0.0,
# and --seq-length a multiple of CP (2*CP for zigzag, and on the no-patch route).
set -euo pipefail

: "${MEGATRON_LM_DIR:?set MEGATRON_LM_DIR to a Megatron-LM checkout at tag core_v0.16.1}"
NPROC=${NPROC:-8}          # GPUs on this node
CP=${CP:-8}                # context-parallel size (divides NPROC)
ALGO=${ALGO:-striped}      # native | striped | zigzag | ring
SEQ=${SEQ:-32768}          # sequence length
ITERS=${ITERS:-50}
PATCHED=${PATCHED:-0}

export CUDA_DEVICE_MAX_CONNECTIONS=1
export MEGATRON_LM_DIR

MODEL_ARGS=(
    --num-layers 8 --hidden-size 2048 --ffn-hidden-size 5632
    --num-attention-heads 16 --group-query-attention --num-query-groups 4
    --seq-length "$SEQ" --max-position-embeddings "$SEQ"
    --position-embedding-type rope --normalization RMSNorm --swiglu
    --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0.0 --hidden-dropout 0.0
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --context-parallel-size "$CP" --cp-comm-type p2p
    --context-parallel-algo "$ALGO"
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 8 --train-iters "$ITERS"
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5
    --weight-decay 0.1 --clip-grad 1.0 --bf16
)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000)
LOG_ARGS=(--log-interval 1 --eval-interval 1000 --eval-iters 0)

if [ "$PATCHED" = 1 ]; then
    ENTRY=("$MEGATRON_LM_DIR/pretrain_gpt.py")
else
    ENTRY=(-m striped_sp.megatron.pretrain_gpt)
fi

cd "$MEGATRON_LM_DIR"
torchrun --nproc-per-node "$NPROC" "${ENTRY[@]}" \
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${LOG_ARGS[@]}"
