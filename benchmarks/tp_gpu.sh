#!/bin/sh
# Tensor-parallel measurements on one multi-GPU host: greedy equality against one process,
# and decode speed at TP 1/2/4 with NCCL's all-reduce or the one-shot one.
#   sh benchmarks/tp_gpu.sh OUTDIR STEP...
# STEP: greedy (TP 1; 2, 2 without the fused sum, 2 with NCCL only; 4 if there are 4 GPUs),
# real (a trained model, MODEL, at TP 1 and RANKS) or decode-N / decode-N-unfused /
# decode-N-nccl (benchmarks/tp_decode.py on N ranks; SHAPE and QUANT pick the model). One JSON line per
# run into OUTDIR/tp-greedy.jsonl and OUTDIR/tp-decode.jsonl.
OUT=${1:?outdir}; shift
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(nvidia-smi -L | wc -l)
tag() { sed "s/^{/{\"run\": \"$1\", /"; }
CK=/tmp/tp-greedy-ck
D="benchmarks/tp_decode.py --shape ${SHAPE:-llama3-8b} --quant ${QUANT:-none,int4} --prompt-tokens 512 --reps 3"
for step in "$@"; do
  echo "== $step" >&2
  case $step in
    greedy)
      [ -d $CK ] || python3 benchmarks/tp_greedy_equal.py --make $CK >&2
      timeout 120 python3 benchmarks/tp_greedy_equal.py $CK | tag tp1 >> $OUT/tp-greedy.jsonl
      for n in 2 4; do
        [ "$GPUS" -ge $n ] || continue
        timeout 120 torchrun --nproc-per-node $n benchmarks/tp_greedy_equal.py $CK | tag tp$n
        MLXRUN_FUSED_SUM=0 timeout 120 torchrun --nproc-per-node $n benchmarks/tp_greedy_equal.py $CK | tag tp$n-unfused
        MLXRUN_ONE_SHOT=0 timeout 120 torchrun --nproc-per-node $n benchmarks/tp_greedy_equal.py $CK | tag tp$n-nccl
      done >> $OUT/tp-greedy.jsonl ;;
    real)  # a trained model: $MODEL (SmolLM2's GGUF splits over 3 ranks)
      Q="What is the capital of France? Answer in one sentence, then name three rivers."
      timeout 120 python3 benchmarks/tp_greedy_equal.py "$MODEL" --prompt "$Q" | tag real-tp1 >> $OUT/tp-greedy.jsonl
      for n in ${RANKS:-3}; do
        [ "$GPUS" -ge $n ] || continue
        timeout 120 torchrun --nproc-per-node $n benchmarks/tp_greedy_equal.py "$MODEL" --prompt "$Q" | tag real-tp$n
      done >> $OUT/tp-greedy.jsonl ;;
    profile-*)  # rank 0's kernels over 16 tokens, per format
      n=${step#profile-}
      timeout 280 torchrun --nproc-per-node $n $D --profile $OUT/prof-tp$n > /dev/null ;;
    decode-*-unfused)  # the one-shot sum + add_rms_norm, not the fused kernel
      n=${step#decode-}; n=${n%-unfused}
      MLXRUN_FUSED_SUM=0 timeout 280 torchrun --nproc-per-node $n $D | tag tp$n-unfused >> $OUT/tp-decode.jsonl ;;
    decode-*-nccl)
      n=${step#decode-}; n=${n%-nccl}
      MLXRUN_ONE_SHOT=0 timeout 280 torchrun --nproc-per-node $n $D | tag tp$n-nccl >> $OUT/tp-decode.jsonl ;;
    decode-*)
      n=${step#decode-}
      timeout 280 torchrun --nproc-per-node $n $D | tag tp$n >> $OUT/tp-decode.jsonl ;;
  esac
done
cat $OUT/tp-*.jsonl
