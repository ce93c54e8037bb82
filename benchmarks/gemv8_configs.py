"""Which kernel and launch config each linear of a batch-1 decode step gets, per format, as
the model runs them (joint q/k/v, joint gate/up with the SiLU epilogue, o, down, the head),
without a GPU: choose_config called with a given SM count, then qmatmul's own fallback
(a stream config whose tiles or k-steps are not whole runs the one-shot GEMV, 1 split).

    python3 benchmarks/gemv8_configs.py [--model llama3-8b] [--quant int8,fp8] [--sms 132]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--quant", default="int8,fp8")
    ap.add_argument("--sms", type=int, default=132, help="132: H100 SXM; H200 too")
    a = ap.parse_args()
    from mlxrun.bench_models import SHAPES
    from mlxrun.quant import triton_launch as tl
    from mlxrun.quant.formats import resolve

    tl._num_sms = lambda device: a.sms  # the chooser's only device query
    c = SHAPES[a.model]
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = c.get("head_dim", h // c["num_attention_heads"])
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd
    linears = [("q/k/v", qkv, h, False), ("o", h, c["num_attention_heads"] * hd, False),
               ("gate/up", 2 * i, h, True), ("down", h, i, False), ("head", v, h, False)]  # fmt: skip
    dev = torch.device("cuda")
    for name in a.quant.split(","):
        spec = resolve(name)
        print(f"--quant {name}: {spec.mode} {spec.bits}-bit g{spec.group_size}")
        for role, n, k, silu in linears:
            w = types.SimpleNamespace(n=n, k=k, bits=spec.bits, mode=spec.mode,
                                      group_size=spec.group_size)  # fmt: skip
            picks = []
            for gemv8 in ("old", "stream"):
                tl.GEMV8 = gemv8
                cfg = tl.choose_config(1, w, dev, torch.bfloat16)
                # qmatmul: the model's weights are dense (prepare, concat: contiguous)
                if cfg.kernel == "stream" and not tl.stream_even(
                    w, cfg.block_n, cfg.num_warps, silu
                ):
                    cfg = dataclasses.replace(cfg, kernel="gemv", split_k=1)
                desc = f"{cfg.kernel} bn{cfg.block_n} w{cfg.num_warps}"
                if cfg.kernel == "stream":
                    tiles = (n // 2 if silu else n) // (cfg.block_n // 2 if silu else cfg.block_n)
                    progs = min(tiles, cfg.per_sm * a.sms)
                    desc += f" {progs} progs ({tiles / progs:.1f} tiles each) cvt={cfg.cvt}"
                else:
                    kw = k * spec.bits // 32
                    ksteps = math.ceil(kw / (128 * cfg.num_warps))
                    desc += f" split {cfg.split_k}/{ksteps} k-steps prefetch={cfg.prefetch}"
                    desc += f" {math.ceil(n / cfg.block_n) * cfg.split_k} progs"
                picks.append(f"{gemv8}: {desc}")
            print(f"  {role:8s} {n}x{k}{' silu' if silu else ''}:  " + "  |  ".join(picks))


if __name__ == "__main__":
    main()
