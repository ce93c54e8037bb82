"""Triton kernels of the CUDA device sampler (`torch_sampling.TorchSampler` on CUDA).

The same algorithm as the torch ops in torch_sampling (see mlxrun.sampling) in three
launches instead of about fifty: each stock op over a 128k-token row was a launch of its own
(~2-3 us even in a CUDA graph), and torch's scans of long rows were slow at batch 32.

- `row_stats`: per row the maximum logit, its first index (the greedy token) and the sum
  of exp((x - max) / T), split over blocks of the row with an atomic ticket (the last block
  of a row reduces the blocks' partials).
- `cut`: for rows whose kept set depends on the order (top-k, top-p), one program per row
  walks the row sorted in descending order (stable, so equal logits stay in id order) until
  the first token the reference would drop: the threshold logit and the id of the last kept
  token (kept tokens tied at the threshold are those with ids up to it). It stops early:
  a peaked row reads only its head.
- `draw`: each block sums the kept weights exp((x - max) / T) of its part of the row; the
  last block takes the row's uniform (the counter-based hash of sampling.uniform_np),
  finds the block holding the target of the inverse CDF, and scans that block for the token.

Logits are compared in their own dtype's values (bf16 logits sort on 16-bit keys); the
temperature only scales the weights, which keeps the order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlxrun.quant.triton_kernels import _counters

BLOCK = 4096


@triton.jit
def _hash32(x):
    # x int64 in [0, 2^32); Wellons' lowbias32, products split so int64 never overflows
    x = x ^ (x >> 16)
    x = (x * 0x352D + (((x * 0x7FEB) & 0xFFFF) << 16)) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0xA68B + (((x * 0x846C) & 0xFFFF) << 16)) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _stats_kernel(x_ptr, temp_ptr, pmax_ptr, psum_ptr, parg_ptr, cnt_ptr, max_ptr, sum_ptr,
                  arg_ptr, V, stride, BLOCK: tl.constexpr, NB: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    nblk = tl.num_programs(1)
    t = tl.load(temp_ptr + row)
    t = tl.where(t > 0, t, 1.0)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    tl.store(pmax_ptr + row * nblk + blk, m)
    tl.store(psum_ptr + row * nblk + blk, tl.sum(tl.exp((x - m) / t), axis=0))
    tl.store(parg_ptr + row * nblk + blk, tl.min(tl.where(x == m, offs, V), axis=0))
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
    if ticket == nblk - 1:
        r = tl.arange(0, NB)
        ok = r < nblk
        ms = tl.load(pmax_ptr + row * nblk + r, mask=ok, other=float("-inf"), cache_modifier=".cg")
        ss = tl.load(psum_ptr + row * nblk + r, mask=ok, other=0.0, cache_modifier=".cg")
        ags = tl.load(parg_ptr + row * nblk + r, mask=ok, other=V, cache_modifier=".cg")
        big = tl.max(ms, axis=0)
        tl.store(max_ptr + row, big)
        tl.store(sum_ptr + row, tl.sum(ss * tl.exp((ms - big) / t), axis=0))
        tl.store(arg_ptr + row, tl.min(tl.where(ms == big, ags, V), axis=0).to(tl.int64))
        tl.atomic_xchg(cnt_ptr + row, 0, sem="relaxed", scope="gpu")


@triton.jit
def _cut_kernel(vals_ptr, ids_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, ranked_ptr, max_ptr,
                sum_ptr, thr_ptr, bound_ptr, V, stride, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    if tl.load(ranked_ptr + row) != 0:
        t = tl.load(temp_ptr + row)
        t = tl.where(t > 0, t, 1.0)
        k = tl.load(topk_ptr + row)
        top_p = tl.load(topp_ptr + row)
        log_min_p = tl.log(tl.load(minp_ptr + row))
        big = tl.load(max_ptr + row)
        lane = tl.arange(0, BLOCK)
        base = vals_ptr + row * stride
        norm = tl.load(sum_ptr + row)
        if k > 0:  # top-p sees the probabilities renormalised over the top-k set
            norm = 0.0
            for s in range(0, tl.minimum(k, V), BLOCK):
                r = s + lane
                v = tl.load(base + r, mask=(r < k) & (r < V), other=float("-inf")).to(tl.float32)
                norm += tl.sum(tl.exp((v - big) / t), axis=0)
        kk = tl.where(k > 0, k, V)
        n = V  # the first rank the reference drops (V: none)
        before = 0.0  # probability mass of the ranks already walked
        s = 0
        while s < V:
            r = s + lane
            inside = r < V
            v = tl.load(base + r, mask=inside, other=float("-inf")).to(tl.float32)
            p = tl.where(inside, tl.exp((v - big) / t) / norm, 0.0)
            cum_before = before + tl.cumsum(p, axis=0) - p
            keep = (r < kk) & (cum_before < top_p) & ((v - big) / t >= log_min_p)
            keep = keep | (r == 0)
            drop = tl.min(tl.where(inside & ~keep, r, V), axis=0)
            before += tl.sum(p, axis=0)
            if drop < V:
                n = drop
                s = V
            else:
                s += BLOCK
        last = n - 1
        tl.store(thr_ptr + row, tl.load(base + last).to(tl.float32))
        tl.store(bound_ptr + row, tl.load(ids_ptr + row * stride + last))


@triton.jit
def _draw_kernel(x_ptr, temp_ptr, minp_ptr, ranked_ptr, thr_ptr, bound_ptr, max_ptr, arg_ptr,
                 seed_ptr, ctr_ptr, part_ptr, cnt_ptr, out_ptr, V, stride,
                 BLOCK: tl.constexpr, NB: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    nblk = tl.num_programs(1)
    t = tl.load(temp_ptr + row)
    greedy = t <= 0
    t = tl.where(greedy, 1.0, t)
    big = tl.load(max_ptr + row)
    ranked = tl.load(ranked_ptr + row) != 0
    # unranked rows keep min-p's set: (x - max) / T >= log(min_p), every tie included
    thr = tl.where(ranked, tl.load(thr_ptr + row), big + t * tl.log(tl.load(minp_ptr + row)))
    bound = tl.where(ranked, tl.load(bound_ptr + row), V)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    kept = (offs < V) & ((x > thr) | ((x == thr) & (offs <= bound)))
    w = tl.where(kept, tl.exp((x - big) / t), 0.0)
    tl.store(part_ptr + row * nblk + blk, tl.sum(w, axis=0))
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
    if ticket == nblk - 1:
        ctr = tl.load(ctr_ptr + row)
        tl.store(ctr_ptr + row, ctr + 1)
        if greedy:
            tl.store(out_ptr + row, tl.load(arg_ptr + row))
        else:
            r = tl.arange(0, NB)
            sums = tl.load(
                part_ptr + row * nblk + r, mask=r < nblk, other=0.0, cache_modifier=".cg"
            )
            cum = tl.cumsum(sums, axis=0)
            total = tl.sum(sums, axis=0)
            seed = tl.load(seed_ptr + row)
            h = seed ^ (
                (ctr & 0xFFFFFFFF) * 0x79B9 + ((((ctr & 0xFFFFFFFF) * 0x9E37) & 0xFFFF) << 16)
            )
            h = _hash32(h & 0xFFFFFFFF)
            target = (h >> 8).to(tl.float32) / 16777216.0 * total
            target = tl.minimum(target, total * (1.0 - 1.0 / 8388608.0))
            j = tl.minimum(tl.sum(((cum <= target) & (r < nblk)).to(tl.int32), axis=0), nblk - 1)
            rem = target - tl.sum(tl.where(r < j, sums, 0.0), axis=0)
            offs = j * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride + offs, mask=offs < V, other=float("-inf"))
            x = x.to(tl.float32)
            kept = (offs < V) & ((x > thr) | ((x == thr) & (offs <= bound)))
            w = tl.where(kept, tl.exp((x - big) / t), 0.0)
            i = tl.sum((tl.cumsum(w, axis=0) <= rem).to(tl.int32), axis=0)
            # rounding past the block's last kept weight: take that token
            i = tl.minimum(i, tl.max(tl.where(w > 0, tl.arange(0, BLOCK), 0), axis=0))
            tl.store(out_ptr + row, (j * BLOCK + i).to(tl.int64))
        tl.atomic_xchg(cnt_ptr + row, 0, sem="relaxed", scope="gpu")


class CudaDraw:
    """The three kernels over one plan's (B, V) logits, with their scratch preallocated (a
    captured graph keeps their addresses)."""

    def __init__(self, batch: int, vocab: int, device):
        self.nb = triton.cdiv(vocab, BLOCK)
        f32 = dict(dtype=torch.float32, device=device)
        self.pmax = torch.empty((batch, self.nb), **f32)
        self.psum = torch.empty((batch, self.nb), **f32)
        self.parg = torch.empty((batch, self.nb), dtype=torch.int32, device=device)
        self.max = torch.empty(batch, **f32)
        self.sum = torch.empty(batch, **f32)
        self.arg = torch.empty(batch, dtype=torch.int64, device=device)
        self.thr = torch.zeros(batch, **f32)
        self.bound = torch.zeros(batch, dtype=torch.int64, device=device)

    def __call__(self, x, t: dict, ranked: bool):
        """x (B, V) logits (penalised where asked); t: the sampler's state tensors. Returns
        the tokens (B,) int64 and moves the row counters on."""
        B, V = x.shape
        x = x if x.stride(-1) == 1 else x.contiguous()
        NB = triton.next_power_of_2(self.nb)
        cnt = _counters(x.device, B)
        _stats_kernel[(B, self.nb)](
            x, t["temperature"], self.pmax, self.psum, self.parg, cnt, self.max, self.sum,
            self.arg, V, x.stride(0), BLOCK=BLOCK, NB=NB, num_warps=4,
        )  # fmt: skip
        if ranked:
            vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
            _cut_kernel[(B,)](
                vals, ids, t["temperature"], t["top_k"], t["top_p"], t["min_p"], t["ranked"],
                self.max, self.sum, self.thr, self.bound, V, vals.stride(0), BLOCK=1024,
                num_warps=4,
            )  # fmt: skip
        out = torch.empty(B, dtype=torch.int64, device=x.device)
        _draw_kernel[(B, self.nb)](
            x, t["temperature"], t["min_p"], t["ranked"], self.thr, self.bound, self.max,
            self.arg, t["seed"], t["counter"], self.psum, cnt, out, V, x.stride(0),
            BLOCK=BLOCK, NB=NB, num_warps=4,
        )  # fmt: skip
        return out
