"""One Triton kernel for a tensor-parallel layer's sum and what follows it: the all-reduce of
the ranks' fp32 partial products (o_proj, down_proj), the residual add and the RMSNorm.

At batch-1 decode on two H100s the one-shot all-reduce (9.3 us) and the add+RMSNorm after
it (3.4 us) are two launches of a few KB each, 64 pairs a token of an 8B model. Here one
program a row exchanges the partials with its peers through symmetric memory over NVLink and
sums them in rank order (as torch.ops.symm_mem.one_shot_all_reduce does, so every rank gets
the same bits), then rounds,
adds and normalises as cuda_ops.add_rms_norm does: bit for bit today's two launches.

The default protocol (lamport, as TensorRT-LLM's one-shot all-reduce does it): a rank
stores its row straight into each peer's slot, and the data is the signal. An empty slot
holds -0.0 everywhere; a -0.0 of a partial is sent as +0.0 (the sum starts at +0.0, so no bit
of it changes); the reader polls its slot until no element is -0.0, sums, and empties it
again. No release fence and no flag: on two H100s 3.8 us a call against 5.3 with the flags.
Three slots, used in turn: a peer writes slot s again at use e + 3, which needs this rank's
data of use e + 2, sent after the kernel that emptied slot s at use e had finished.

The flag protocol (MLXRUN_FUSED_SUM=push or pull), per row and per use:
- each row keeps an epoch e in a device counter (incremented by the kernel itself, so CUDA
  graph replays go on counting), and two buffer slots used alternately (e % 2);
- a rank writes its slot, then stores e + 1 into its flag on each peer's signal pad (release,
  system scope), then waits until its peers' flags on its own pad read e + 1 (acquire);
- no closing barrier: the slot written at use e + 2 was read by the peer before the peer
  signalled e + 1, and a peer can't signal e + 2 before this rank signalled e + 1, so a flag
  never runs ahead of the use that waits on it (and equality is safe when e wraps).
The peers' buffer and signal-pad addresses are the symmetric-memory handle's, as int64.

Without a GPU it runs under TRITON_INTERPRET=1 with the peers simulated (plain tensors as
their buffers, their rows or flags preset), which is how the tests check its arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mlxrun.backends.torch_tp import FUSED_ROWS as MAX_ROWS
from mlxrun.backends.torch_tp import GATHER_BLOCK
from mlxrun.quant.triton_kernels import pdl_args, tlc


@dataclass
class Peers:
    """What the kernel needs of the ranks' symmetric memory (torch_tp.AllSum builds it)."""

    rank: int
    buf_ptrs: torch.Tensor  # int64 (W,) on the device: each rank's 2 (3) x W x MAX_ROWS x n fp32
    sig_ptrs: torch.Tensor  # int64 (W,): each rank's signal pad
    epoch: torch.Tensor  # int32, zeros at first: this rank's use count a row (the gather's:
    # a row's block of columns)
    n: int  # the row width the buffers were made for
    sig0: int  # first int32 slot of the pads used (MAX_ROWS x W from there)
    rows: int = MAX_ROWS  # rows a slot holds (the sums' MAX_ROWS; fewer for the gather)
    push: bool = False  # write into the peers' buffers (else each reads the others')
    lamport: bool = False  # push, and no flags: the reader polls the data (3 slots)
    keep: object = None  # the symmetric buffer and its handle, alive as long as this


@triton.jit
def _flagged_sum(y, mine, buf_ptrs, sig_ptrs, e, row, n, rank, slot_stride, src_stride, cols,
                 mask, W: tl.constexpr, SIG: tl.constexpr, PUSH: tl.constexpr):  # fmt: skip
    """The ranks' rows summed in rank order, the data's arrival told by a flag a peer."""
    # rank q's row lands at [e % 2][q][row] of the buffer it is read from; the buffers are
    # 16-byte aligned and n a multiple of 4 (linear_sum's condition): said so, the rows move in
    # 16-byte accesses, not one float at a time
    base = tl.multiple_of((e % 2).to(tl.int64) * slot_stride + row.to(tl.int64) * n, 4)
    if PUSH:  # into every peer's buffer: remote stores don't wait for a reply as loads do
        for p in tl.static_range(W):
            if p != rank:
                peer = tl.multiple_of(tl.load(buf_ptrs + p).to(tl.pointer_type(tl.float32)), 16)
                tl.store(peer + base + rank * src_stride + cols, y, mask=mask)
    else:  # into this rank's own, the peers read it
        tl.store(mine + base + rank * src_stride + cols, y, mask=mask)
    # every thread's store before the (one-thread) release below
    tl.debug_barrier()
    flag = SIG + row * W
    for p in tl.static_range(W):
        if p != rank:
            pad = tl.load(sig_ptrs + p).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(pad + flag + rank, e + 1, sem="release", scope="sys")
    own = tl.load(sig_ptrs + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(W):
        if p != rank:
            while tl.atomic_add(own + flag + p, 0, sem="acquire", scope="sys") != e + 1:
                pass
    tl.debug_barrier()
    # the sum in rank order, this rank's term from registers
    acc = tl.zeros(y.shape, dtype=tl.float32)
    for p in tl.static_range(W):
        if p == rank:
            acc += y
        else:
            src = mine
            if not PUSH:
                src = tl.multiple_of(tl.load(buf_ptrs + p).to(tl.pointer_type(tl.float32)), 16)
            acc += tl.load(src + base + p * src_stride + cols, mask=mask, other=0.0,
                           cache_modifier=".cg")  # fmt: skip
    return acc


@triton.jit
def _lamport_send(y, buf_ptrs, base, rank, src_stride, cols, mask, W: tl.constexpr):
    """This rank's fp32 y into every peer's slot (at base), a -0.0 as +0.0 (the sentinel)."""
    sent = tl.where(y == 0.0, 0.0, y)
    for p in tl.static_range(W):
        if p != rank:
            peer = tl.multiple_of(tl.load(buf_ptrs + p).to(tl.pointer_type(tl.float32)), 16)
            tl.store(peer + base + rank * src_stride + cols, sent, mask=mask)
    return sent


@triton.jit
def _lamport_take(mine, base, p, src_stride, cols, mask):
    """Peer p's row from this rank's slot, once no element of it is the sentinel."""
    src = (mine + base + p * src_stride + cols).to(tl.pointer_type(tl.int32), bitcast=True)
    v = tl.load(src, mask=mask, other=0, volatile=True)
    while tl.max(((v == -2147483648) & mask).to(tl.int32), axis=0) > 0:
        v = tl.load(src, mask=mask, other=0, volatile=True)
    return v.to(tl.float32, bitcast=True)


@triton.jit
def _lamport_empty(mine, base, rank, src_stride, cols, mask, W: tl.constexpr):
    """The peers' rows of this rank's slot back to the sentinel, after every thread read."""
    tl.debug_barrier()
    for p in tl.static_range(W):
        if p != rank:
            src = (mine + base + p * src_stride + cols).to(tl.pointer_type(tl.int32), bitcast=True)
            tl.store(src, tl.full(cols.shape, -2147483648, tl.int32), mask=mask)


@triton.jit
def _lamport_sum(y, mine, buf_ptrs, e, row, n, rank, slot_stride, src_stride, cols, mask,
                 W: tl.constexpr):  # fmt: skip
    """The ranks' rows summed in rank order, the data itself the signal: a slot holds -0.0
    (bits 0x80000000) until a peer's row lands in it, and a peer's -0.0 is sent as +0.0
    (the sum starts at +0.0, so that changes no bit of it). No fence, no flag: one NVLink
    write a sum on the critical path. The reader puts the sentinel back after reading; the
    slot is written again three uses later, after this kernel has finished (stream order:
    the peer's use e + 3 needs this rank's data of use e + 2)."""
    base = tl.multiple_of((e % 3).to(tl.int64) * slot_stride + row.to(tl.int64) * n, 4)
    _lamport_send(y, buf_ptrs, base, rank, src_stride, cols, mask, W)
    acc = tl.zeros(y.shape, dtype=tl.float32)
    for p in tl.static_range(W):
        if p == rank:
            acc += y
        else:
            acc += _lamport_take(mine, base, p, src_stride, cols, mask)
    _lamport_empty(mine, base, rank, src_stride, cols, mask, W)
    return acc


@triton.jit
def _sum_add_rms_norm_kernel(
    y_ptr,  # this rank's fp32 partial, (rows, n)
    buf_ptrs,  # int64 (W,): every rank's symmetric buffer, 2 (3) slots x W x MAX_ROWS x n fp32
    sig_ptrs,  # int64 (W,): every rank's signal pad (int32 flags)
    epoch_ptr,  # int32 (MAX_ROWS,): this rank's per-row use count
    h_ptr,
    w_ptr,
    h_out_ptr,
    x_out_ptr,
    n,
    eps,
    rank,
    slot_stride,
    src_stride,
    W: tl.constexpr,
    SIG: tl.constexpr,
    PUSH: tl.constexpr,
    LAMPORT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: no wait
    if PDL:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    e = tl.load(epoch_ptr + row)
    y = tl.load(y_ptr + row.to(tl.int64) * n + cols, mask=mask, other=0.0)
    mine = tl.multiple_of(tl.load(buf_ptrs + rank).to(tl.pointer_type(tl.float32)), 16)
    if LAMPORT:
        acc = _lamport_sum(y, mine, buf_ptrs, e, row, n, rank, slot_stride, src_stride, cols,
                           mask, W)  # fmt: skip
        h = tl.load(h_ptr + row.to(tl.int64) * n + cols, mask=mask, other=0.0)
    else:
        h = tl.load(h_ptr + row.to(tl.int64) * n + cols, mask=mask, other=0.0)
        acc = _flagged_sum(y, mine, buf_ptrs, sig_ptrs, e, row, n, rank, slot_stride,
                           src_stride, cols, mask, W, SIG, PUSH)  # fmt: skip
    tl.store(epoch_ptr + row, e + 1)
    # from here as cuda_ops._add_rms_norm_kernel: y rounded to the model dtype, h + y rounded
    hrow = row.to(tl.int64) * n
    yd = acc.to(h_ptr.dtype.element_ty)
    h = (h.to(tl.float32) + yd.to(tl.float32)).to(h_ptr.dtype.element_ty)
    tl.store(h_out_ptr + hrow + cols, h, mask=mask)
    h32 = h.to(tl.float32)
    r = tl.rsqrt(tl.sum(h32 * h32, axis=0) / n + eps)
    xn = (h32 * r).to(x_out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(x_out_ptr + hrow + cols, (xn * w).to(x_out_ptr.dtype.element_ty), mask=mask)


def sum_add_rms_norm(y, h, w, eps, peers: Peers):
    """(h + sum_r y_r, rms_norm(h + sum_r y_r) * w) with y this rank's fp32 partial (rows of
    the last dim, at most MAX_ROWS of them), every rank calling it in the same order."""
    n = h.shape[-1]
    rows = h.numel() // n
    ok = rows <= MAX_ROWS and n == peers.n and n % 4 == 0 and y.dtype == torch.float32
    assert ok, (rows, n, y.dtype)
    h = h.contiguous()
    h_new, x = torch.empty_like(h), torch.empty_like(h)
    _sum_add_rms_norm_kernel[(rows,)](
        y.contiguous(),
        peers.buf_ptrs,
        peers.sig_ptrs,
        peers.epoch,
        h,
        w,
        h_new,
        x,
        n,
        eps,
        peers.rank,
        peers.buf_ptrs.numel() * MAX_ROWS * n,  # a slot
        MAX_ROWS * n,
        W=peers.buf_ptrs.numel(),
        SIG=peers.sig0,
        PUSH=peers.push,
        LAMPORT=peers.lamport,
        BLOCK=triton.next_power_of_2(n),
        num_warps=4 if n <= 4096 else 8,
        **pdl_args(h.device),
    )
    return h_new, x


@triton.jit
def _lamport_gather_kernel(x_ptr, buf_ptrs, epoch_ptr, out_ptr, n, rank, slot_stride,
                           src_stride, W: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr = False):  # fmt: skip
    # program (row, block of BLOCK columns): its columns of every rank's row, through the
    # lamport slots as the sums take them; each program keeps its own use count (epoch)
    row = tl.program_id(0)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    if PDL:
        tlc.gdc_wait()
        tlc.gdc_launch_dependents()
    ep = epoch_ptr + row * tl.num_programs(1) + blk
    e = tl.load(ep)
    x = tl.load(x_ptr + row.to(tl.int64) * n + cols, mask=mask, other=0.0).to(tl.float32)
    base = tl.multiple_of((e % 3).to(tl.int64) * slot_stride + row.to(tl.int64) * n, 4)
    sent = _lamport_send(x, buf_ptrs, base, rank, src_stride, cols, mask, W)
    out = out_ptr + row.to(tl.int64) * W * n + cols
    dt = out_ptr.dtype.element_ty
    tl.store(out + rank * n, sent.to(dt), mask=mask)  # a -0.0 as +0.0, as the peers get it
    mine = tl.multiple_of(tl.load(buf_ptrs + rank).to(tl.pointer_type(tl.float32)), 16)
    for p in tl.static_range(W):
        if p != rank:
            tl.store(out + p * n, _lamport_take(mine, base, p, src_stride, cols, mask).to(dt),
                     mask=mask)  # fmt: skip
    _lamport_empty(mine, base, rank, src_stride, cols, mask, W)
    tl.store(ep, e + 1)


def lamport_gather(x: torch.Tensor, peers: Peers) -> torch.Tensor:
    """x (..., n) from every rank -> (..., W * n), rank r's at [r*n, (r+1)*n): the logits'
    all-gather of a decode step through the lamport slots (two H200s: NCCL's all-gather
    took 6.9 us and a copy). A -0.0 arrives as +0.0 (on every rank alike). peers.epoch
    holds a count a (row, block) program."""
    n = x.shape[-1]
    rows = x.numel() // n
    assert rows <= peers.rows and n == peers.n and n % 4 == 0, (rows, n)
    W = peers.buf_ptrs.numel()
    out = torch.empty((*x.shape[:-1], W * n), dtype=x.dtype, device=x.device)
    _lamport_gather_kernel[(rows, triton.cdiv(n, GATHER_BLOCK))](
        x.contiguous(), peers.buf_ptrs, peers.epoch, out, n, peers.rank,
        W * peers.rows * n, peers.rows * n, W=W, BLOCK=GATHER_BLOCK, num_warps=4,
        **pdl_args(x.device),
    )  # fmt: skip
    return out
