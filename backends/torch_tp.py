"""The torch backend's tensor-parallel collectives: the all-reduce (linear_sum gives it fp32
partial products) and the all-gather of the logits (the head split by vocabulary).

Each rank's o_proj and down_proj product is a partial sum of the whole product. Rounding
each partial to bf16 before the sum (as a plain `all_reduce(linear(x, w))` does) rounds
every output element twice where one device rounds it once, and greedy decoding drifts
from the one-device tokens within a few dozen steps. The partials here stay fp32 through
the sum (`TorchBackend.linear(..., out_dtype=float32)`); the residual add rounds the sum once (add_rms_norm rounds y to the residual's
dtype), so the split model differs from one device only in the order of fp32 additions.

The all-reduce of a decode step is a few KB, where NCCL's latency (about 19 us on two
H200s, inside a CUDA graph) is most of its cost: 64 of them a token for an 8B model. Such
small sums go through PyTorch's symmetric-memory one-shot all-reduce (each rank reads the
others' buffers over NVLink and adds them in rank order, so every rank gets the same bits);
larger ones (prefill) and other devices use the process group's all_reduce.

With the Triton kernels on CUDA, a sum the residual add and RMSNorm follow (linear_sum
without a bias, at most FUSED_ROWS rows) is not summed here: linear_sum hands
add_rms_norm a Partial, and one kernel (backends/cuda_allreduce.py) sums, adds and
normalises, bit for bit as the one-shot sum and add_rms_norm do (3.8 us a call against 12.1
for the two launches on two H100s); MLXRUN_FUSED_SUM=0 turns it off (for A/B timing).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# one-shot all-reduce up to this many bytes (a batch-32 decode step of a 4096-wide model
# in fp32 is 512 KiB); MLXRUN_ONE_SHOT=0 turns it off (for A/B timing)
ONE_SHOT_BYTES = 1 << 20
_ONE_SHOT = os.environ.get("MLXRUN_ONE_SHOT", "1") != "0"
# MLXRUN_FUSED_SUM: lamport (the default: each rank writes its partial into the others'
# buffers and the data is the signal), push (writes it, then a flag), pull or 1 (each reads
# the others'); 0: the one-shot sum + add_rms_norm (A/B)
_FUSED = os.environ.get("MLXRUN_FUSED_SUM", "lamport")
FUSED_ROWS = 64  # rows a fused sum takes (a batch-64 decode step): one program a row
GATHER_ROWS = 8  # rows the logits' lamport gather takes (3 x ranks x 8 x vocab/ranks fp32)
GATHER_BLOCK = 2048  # columns a program of it (cuda_allreduce.lamport_gather)


class Partial:
    """This rank's fp32 partial product, not yet summed: add_rms_norm sums it in its kernel;
    anything else takes `total()` (the one-shot sum)."""

    def __init__(self, y, all_sum):
        self.y, self._all_sum = y, all_sum

    def total(self):
        return self._all_sum(self.y)


class AllSum:
    """Sum over the process group, in place where it can be (x is a fresh product)."""

    def __init__(self, device):
        self.device = device
        self._buf = None  # the symmetric-memory buffer, on first use
        self._name = None
        self.one_shot = _ONE_SHOT and str(device).startswith("cuda") and self._available()
        self.fused = _FUSED in ("1", "pull", "push", "lamport") and self.one_shot
        self.push = _FUSED in ("push", "lamport")
        self.lamport = _FUSED == "lamport"
        self._peers = {}  # row width -> cuda_allreduce.Peers

    @staticmethod
    def _available() -> bool:
        try:
            import torch.distributed._symmetric_memory  # noqa: F401, PLC0415

            return hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy")
        except Exception:
            return False

    def _buffer(self):
        if self._buf is None:
            import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415

            self._name = dist.group.WORLD.group_name
            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before 2.8
                symm_mem.enable_symm_mem_for_group(self._name)
            self._buf = symm_mem.empty(ONE_SHOT_BYTES // 4, dtype=torch.float32, device=self.device)
            symm_mem.rendezvous(self._buf, self._name)
        return self._buf

    def peers(self, n: int, rows: int = FUSED_ROWS):
        """The fused kernel's symmetric buffers for up to `rows` rows of n (made on first
        use, which is eager: the graph's warm-up runs before its capture), or None where it
        can't run."""
        if (n, rows) not in self._peers:
            self._peers[n, rows] = self._make_peers(n, rows) if self.fused else None
        return self._peers[n, rows]

    def gather_peers(self, n: int, rows: int):
        """The lamport gather's buffers for rows of n (a decode step's logits), or None:
        up to GATHER_ROWS rows, with the lamport sums only."""
        return self.peers(n, GATHER_ROWS) if self.lamport and rows <= GATHER_ROWS else None

    def _make_peers(self, n: int, rows: int):
        import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415

        from .cuda_allreduce import Peers  # noqa: PLC0415

        self._buffer()  # the group enabled, as the one-shot path does it
        world = dist.get_world_size()
        slots = 3 if self.lamport else 2
        buf = symm_mem.empty(slots * world * rows * n, dtype=torch.float32, device=self.device)
        h = symm_mem.rendezvous(buf, self._name)
        if self.lamport:  # every slot empty (-0.0) on every rank before any rank writes one
            buf.view(torch.int32).fill_(-(2**31))
            torch.cuda.synchronize(self.device)
            dist.barrier()
        if not all(hasattr(h, a) for a in ("buffer_ptrs", "signal_pad_ptrs")):
            return None
        # the pads' last FUSED_ROWS x world int32 slots (torch's own ops use the first ones)
        words = getattr(h, "signal_pad_size", 2048) // 4
        if words < FUSED_ROWS * world:
            return None
        dev = buf.device
        return Peers(
            rank=getattr(h, "rank", dist.get_rank()),
            buf_ptrs=torch.tensor(h.buffer_ptrs, dtype=torch.int64, device=dev),
            sig_ptrs=torch.tensor(h.signal_pad_ptrs, dtype=torch.int64, device=dev),
            # a count a row (the sums), a row's block of columns (the gather)
            epoch=torch.zeros(rows * -(-n // GATHER_BLOCK), dtype=torch.int32, device=dev),
            n=n,
            sig0=words - FUSED_ROWS * world,
            push=self.push,
            lamport=self.lamport,
            rows=rows,
            keep=(buf, h),
        )

    def __call__(self, x):
        n = x.numel()
        # Every rank sees the same shapes, so every rank takes the same branch.
        if self.one_shot and x.dtype == torch.float32 and n * 4 <= ONE_SHOT_BYTES and n % 4 == 0:
            buf = self._buffer()[:n].view(x.shape)
            return torch.ops.symm_mem.one_shot_all_reduce_copy(
                buf, x.contiguous(), "sum", self._name
            )
        dist.all_reduce(x)
        return x


def all_gather(x, ranks: int, width: int):
    """x (..., k) from every rank -> (..., width): the ranks' x side by side in rank order,
    columns past `width` (padding) cut. One all_gather_into_tensor (captured by a CUDA
    graph with NCCL), then one copy to put the rank axis next to k."""
    # stacked on the first axis (gloo checks that shape; NCCL only the size)
    out = torch.empty((ranks * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous())
    out = out.view(ranks, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], ranks * x.shape[-1])
    return out if width == out.shape[-1] else out[..., :width].contiguous()
