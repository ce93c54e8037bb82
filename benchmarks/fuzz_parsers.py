"""The long fuzz run: the targets of tests/test_fuzz.py with many more inputs, fresh
randomness, and a memory bound (a parse may allocate at most MEM x the file's size +
16 MiB through Python's allocators, traced with tracemalloc).

    nice python benchmarks/fuzz_parsers.py --examples 2000           # per target
    nice python benchmarks/fuzz_parsers.py --examples 500 --only gguf

Prints, per target, how many inputs ran, how many parsed and how many were refused with
MlxrunError; a failing input (another exception, a hang, too much memory) is shrunk by
hypothesis and printed, and the script exits 1.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests import test_fuzz as F  # noqa: E402

TARGETS = {
    "safetensors-mutated": (F.mutated("safetensors"), F.parse_safetensors),
    "safetensors-header": (
        st.dictionaries(st.text(max_size=6), F.tensor_entries, max_size=3) | F.json_values,
        lambda h: F.parse_safetensors(F.safetensors_header(h)),
    ),
    "safetensors-bytes": (st.binary(max_size=64), F.parse_safetensors),
    "gguf-mutated": (F.mutated("gguf"), F.parse_gguf),
    "gguf-bytes": (st.binary(max_size=256).map(lambda b: b"GGUF" + b), F.parse_gguf),
    "config-fields": (F.configs, F.parse_config),
    "config-json": (F.json_values, F.parse_config),
    "prompts": (
        st.tuples(st.binary(max_size=400), st.sampled_from([".txt", ".jsonl"])),
        lambda a: F.parse_prompts(*a),
    ),
}


def _counting(parse, counts):
    def run(x):
        counts["parsed" if parse(x) else "refused"] += 1

    return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=2000, help="inputs per target")
    ap.add_argument("--only", default="", help="comma list of target name prefixes")
    ap.add_argument("--mem", type=float, default=16.0, help="bytes allocated per file byte")
    args = ap.parse_args()
    F.MEMORY["limit"] = args.mem
    failed = 0
    total = 0
    for name, (strategy, parse) in TARGETS.items():
        if args.only and not any(name.startswith(p) for p in args.only.split(",")):
            continue
        counts = {"parsed": 0, "refused": 0}
        run = _counting(parse, counts)
        test = settings(
            max_examples=args.examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )(given(strategy)(run))
        t0 = time.perf_counter()
        status = "ok"
        try:
            test()
        except Exception:  # the shrunk failing input and its exception
            status = "FAILED"
            failed += 1
            traceback.print_exc()
        n = counts["parsed"] + counts["refused"]
        total += n
        print(
            f"{name:20s} {n:6d} inputs ({counts['parsed']} parsed, {counts['refused']} refused "
            f"with MlxrunError) in {time.perf_counter() - t0:7.1f} s: {status}",
            flush=True,
        )
    print(f"total {total} inputs, {failed} target(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
