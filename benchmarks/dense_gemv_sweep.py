"""The bf16 batch-1 GEMV (cuda_ops.dense_gemv) swept over its launch settings on the 8B
shapes whole and split over 2 and 4 ranks (tensor parallelism: q/k/v, gate/up and the
head by rows, o and down by inputs): cycled weights in a CUDA graph, us and GB/s.
    python3 benchmarks/dense_gemv_sweep.py [RANKS] [small]
RANKS: comma-separated (default 1,2,4); small: 18 settings (rows 2/4/8, warps 2/4/8, 8 or
16 inputs a thread) instead of 48."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from profile_decode import _events_ms, _graphed  # noqa: E402


def shapes(ranks):
    H, I, V, q, kv = 4096, 14336, 128256, 4096, 1024
    return [((q + 2 * kv) // ranks, H), (H, q // ranks), (2 * I // ranks, H), (H, I // ranks),
            (V // ranks, H)]  # fmt: skip


def main():
    from mlxrun.backends.cuda_ops import dense_gemv

    ws_ = (2, 4, 8) if "small" in sys.argv[2:] else (1, 2, 4, 8)
    cfgs = [(bn, w, v) for bn in (2, 4, 8) for w in ws_ for v in (8, 16)]
    rank_list = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 2, 4]
    for ranks in rank_list:
        print(f"ranks {ranks}", flush=True)
        for n, k in shapes(ranks):
            nbytes = n * k * 2
            copies = max(2, (400 << 20) // nbytes + 1)
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            ref = (x.float() @ ws[0].float().T).flatten()
            res = []
            for bn, w, v in cfgs:
                try:
                    y = dense_gemv(x, ws[0], block_n=bn, warps=w, vec=v).float().flatten()
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    rep = _graphed(lambda i, bn=bn, w=w, v=v, x=x, ws=ws: dense_gemv(
                        x, ws[i % len(ws)], block_n=bn, warps=w, vec=v), 24)  # fmt: skip
                    us = _events_ms(rep) * 1e3 / 24
                except Exception as e:
                    print(f"  {n}x{k} {bn},{w},{v}: {type(e).__name__}", flush=True)
                    continue
                res.append((us, bn, w, v, err))
            res.sort()
            dflt = next((r for r in res if r[1:4] == (4, 4, 16)), None)
            line = f"  {n}x{k}: default {dflt[0]:.1f} us" if dflt else f"  {n}x{k}:"
            best = " | ".join(f"{u:.1f} us {nbytes / u / 1e3:.0f} GB/s rows{bn} w{w} v{v}"
                              for u, bn, w, v, _ in res[:4])  # fmt: skip
            print(f"{line} | best {best} | max rel err {max(r[4] for r in res):.1e}", flush=True)
            del ws
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
