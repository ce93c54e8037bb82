"""TorchBackend's tensor-parallel methods, a mixin as TorchWeights is: the sums over the
ranks (backends/torch_tp.py says which all-reduce runs), the logits' all-gather, the
vocabulary-split embedding. Where the Triton kernels run with symmetric memory, a decode
step's sums are left to the kernels that follow them (torch_tp.Partial: add_rms_norm sums
it) and its logits are gathered through the same lamport slots (cuda_allreduce). Uses the
backend's `group`, `_all_sum`, `_zero_rows`, `triton_kernels`, `_dt`, `_dev`, `embedding`,
`linear` and `moe`."""

from __future__ import annotations

try:
    import torch
except ImportError:  # reported by get_backend with the extra to install
    torch = None
if torch is not None:
    from mlxrun.backends.torch_tp import FUSED_ROWS, Partial


class TorchParallel:
    def all_sum(self, x):
        """x summed over the group's ranks (x is a fresh product: it may be summed in
        place). Captured into the decode graph with the rest of the step (backends/torch_tp.py
        says which all-reduce runs)."""
        if self.group is None or self.group.size == 1:
            return x
        if self._all_sum is None:
            from .torch_tp import AllSum  # noqa: PLC0415

            self._all_sum = AllSum(self._dev)
        return self._all_sum(x)

    def all_gather(self, x, width):
        """(..., k) from each rank -> (..., width): rank r's x at [r*k, (r+1)*k), the
        padding past `width` cut. all_gather_into_tensor (NCCL, gloo) is captured into the
        decode graph like the sums."""
        from .torch_tp import all_gather  # noqa: PLC0415

        n = x.shape[-1]
        # the layers' sums made _all_sum; a decode step's logits go through lamport slots
        if self.triton_kernels and self._all_sum is not None and n % 4 == 0:
            peers = self._all_sum.gather_peers(n, x.numel() // n)
            if peers is not None:
                from .cuda_allreduce import lamport_gather  # noqa: PLC0415

                y = lamport_gather(x, peers)
                return y if width == y.shape[-1] else y[..., :width].contiguous()
        return all_gather(x, self.group.size, width)

    def embedding_sum(self, ids, w, start, rows, partial=False):
        """The rows of `ids` from a table split by vocabulary: this rank's rows [start,
        start+rows), zeros for the others' ids, summed over the ranks (one nonzero term a
        token: the sum is exact in any dtype). partial: a decode step's rows may come back
        as a Partial, for the first add_rms_norm to sum."""
        shape = (*ids.shape, w.shape[-1]) if isinstance(w, torch.Tensor) else None
        if partial and shape and self._fused_sum(ids[..., None].expand(shape)):
            from .cuda_ops import embed_shard  # noqa: PLC0415

            return Partial(embed_shard(ids, w, start, rows), self._all_sum)
        local = ids - start
        inside = (local >= 0) & (local < rows)
        e = self.embedding(torch.where(inside, local, 0), w)
        return self.all_sum(e * inside.unsqueeze(-1).to(e.dtype))

    def linear_sum(self, x, w, bias=None):
        if self.group is None or self.group.size == 1:
            return self.linear(x, w, bias)
        y = self.linear(x, w, out_dtype=torch.float32)
        if bias is None and self._fused_sum(y):
            return Partial(y, self._all_sum)  # summed by add_rms_norm's kernel
        y = self.all_sum(y)
        return y if bias is None else y.to(self._dt) + bias

    def _zeros(self, shape):
        """A zero residual of `shape` in the model's dtype, kept (it is only read)."""
        z = self._zero_rows.get(tuple(shape))
        if z is None:
            z = torch.zeros(shape, dtype=self._dt, device=self._dev)
            self._zero_rows[tuple(shape)] = z
        return z

    def _fused_sum(self, y) -> bool:
        """Whether add_rms_norm may sum this product (a torch_tp.Partial): the Triton
        kernels on CUDA with symmetric memory, a decode-sized batch (every rank decides
        alike: the same shapes)."""
        n = y.shape[-1]
        if not self.triton_kernels or y.numel() // n > FUSED_ROWS or n % 4:
            return False
        if self._all_sum is None:
            from .torch_tp import AllSum  # noqa: PLC0415

            self._all_sum = AllSum(self._dev)
        return self._all_sum.peers(n) is not None

    def moe_sum(self, x, logits, experts, opts, shared=None):
        """moe over experts split by their intermediate rows (mlxrun/shard.py), plus the
        scaled shared expert's down product when given, summed over the ranks: each rank's
        outputs are fp32 partial sums, as linear_sum's (one all-reduce for both)."""
        if self.group is None or self.group.size == 1:
            y = self.moe(x, logits, experts, opts)
            if shared is not None:
                a, down, scale = shared
                y = y + scale * self.linear(a, down)
            return y
        from .torch_moe import moe  # noqa: PLC0415

        f32 = torch.float32
        y = moe(x, logits, experts, opts, self.triton_kernels, f32, self.linear)
        if shared is not None:
            a, down, scale = shared
            y = y + scale.to(f32) * self.linear(a, down, out_dtype=f32)
        return self.all_sum(y)
