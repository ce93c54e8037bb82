"""The mixture-of-experts primitive in plain PyTorch (cpu, mps, cuda): routing, then the
selected experts' gated MLPs, weighted and summed.

Two ways to run the experts, the same arithmetic:
- gather (a few tokens, e.g. decode): the k experts of each token are gathered by index,
  (N*k, out, in), and applied with a batched product. No host sync; only the selected
  experts' bytes are read (packed ones expanded after the gather).
- grouped (prefill, large batches): token slots sorted by expert, then one matmul per
  expert that was hit over its tokens (one host sync for the counts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlxrun.backends.base import QuantizedWeight
from mlxrun.moe import Experts, MoEOptions

# Token slots (tokens x k) up to which the gathered path runs: each gathered expert is a
# full (out, in) matrix, so past this the grouped path reads less.
GATHER_MAX_SLOTS = 16
# With the Triton kernels (CUDA): slots up to which they run (decode batches, capturable);
# past it (prefill) a grouped path reads each expert's weights once for all its tokens
# (cuda_moe.moe_grouped for packed experts, else _grouped).
KERNEL_MAX_SLOTS = 1024


def route(logits: torch.Tensor, o: MoEOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (N, E) -> (weights (N, k) float32, expert ids (N, k) int64), as
    transformers' routers compute them (softmax in float32)."""
    if o.routing == "softmax_topk":
        w, ids = torch.topk(torch.softmax(logits.float(), dim=-1), o.top_k, dim=-1)
        if o.norm_topk:
            w = w / w.sum(dim=-1, keepdim=True)
        return w, ids
    top, ids = torch.topk(logits, o.top_k, dim=-1)
    return torch.softmax(top.float(), dim=-1), ids


def expert_act(g: torch.Tensor, u: torch.Tensor, o: MoEOptions) -> torch.Tensor:
    if o.act == "silu":
        return F.silu(g) * u
    # gpt-oss: gate clamped from above, up on both sides, and up shifted by one
    g = g.clamp(max=o.swiglu_limit)
    u = u.clamp(min=-o.swiglu_limit, max=o.swiglu_limit)
    return (u + 1) * (g * torch.sigmoid(g * o.swiglu_alpha))


def _take(w, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Experts `ids` (n,) of a stacked weight -> dense (n, out, in) in `dtype`."""
    if not isinstance(w, QuantizedWeight):
        return w[ids]
    if w.weight is None:  # only the CUDA kernels' repack is held (cuda_moe_pack.ExpertPart)
        return w.kernel.dense(ids, dtype)
    from mlxrun.quant.torch_dequant import dequantize  # noqa: PLC0415

    def rows(t):  # CUDA has no indexing kernel for uint32: gather the same bits as int32
        return t.view(torch.int32)[ids].view(torch.uint32) if t.dtype == torch.uint32 else t[ids]

    b = None if w.biases is None else rows(w.biases)
    return dequantize(rows(w.weight), rows(w.scales), b, w.mode, w.bits, w.group_size, dtype)


def _gathered(x, ids, e: Experts, o: MoEOptions, dt=None):
    """x (N, H), ids (N, k) -> expert outputs (N, k, H) in dtype `dt` (x's when None)."""
    dt = dt or x.dtype
    N, k = ids.shape
    flat = ids.reshape(-1)
    xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # (N*k, H, 1)

    def apply(w, b, inp):
        y = torch.bmm(_take(w, flat, inp.dtype), inp).squeeze(-1)
        return y if b is None else y + b[flat]

    h = expert_act(apply(e.gate, e.gate_bias, xs), apply(e.up, e.up_bias, xs), o)
    return apply(e.down, e.down_bias, h.to(dt).unsqueeze(-1)).view(N, k, -1)


def _one(w, b, sel, inp):
    """inp (n, in) @ expert sel's (1,) weight^T (+ its bias) -> (n, out)."""
    y = inp @ _take(w, sel, inp.dtype)[0].T
    return y if b is None else y + b[sel]


def _grouped(x, ids, e: Experts, o: MoEOptions, dt=None):
    dt = dt or x.dtype
    N, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=o.num_experts).tolist()  # the one host sync
    xs = x[order // k]  # (N*k, H), grouped by expert
    out = torch.empty(xs.shape, dtype=dt, device=xs.device)
    start = 0
    for j, c in enumerate(counts):
        if not c:
            continue
        sl, sel = slice(start, start + c), torch.tensor([j], device=x.device)
        start += c
        g, u = (_one(w, b, sel, xs[sl]) for w, b in ((e.gate, e.gate_bias), (e.up, e.up_bias)))
        out[sl] = _one(e.down, e.down_bias, sel, expert_act(g, u, o).to(dt))
    y = torch.empty_like(out)
    y[order] = out
    return y.view(N, k, -1)


def moe(
    x: torch.Tensor,
    logits: torch.Tensor,
    e: Experts,
    o: MoEOptions,
    kernel: bool = False,
    out_dtype: torch.dtype | None = None,
    linear=None,
) -> torch.Tensor:
    """x (B, T, H), router logits (B, T, E) -> the weighted sum of the top-k experts'
    outputs (B, T, H), in `out_dtype` (x's when None; float32 for a tensor-parallel rank:
    its down products and their sum stay unrounded partial sums, as torch_tp.py explains).
    kernel: run the Triton kernels (backends/cuda_moe.py) for up to KERNEL_MAX_SLOTS token
    slots. logits None: linear(x, e.router, e.router_bias) (the backend's), or with the
    kernels the router's linear and the routing in one launch (cuda_moe.route_linear)."""
    dt = out_dtype or x.dtype
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if kernel:
        from . import cuda_moe  # noqa: PLC0415

        if logits is None and cuda_moe.routes_linear(x2, e, o):
            w, ids = cuda_moe.route_linear(x2, e.router, e.router_bias, o)
            return cuda_moe.moe_experts(x2, ids, w, e, o, out_dtype=out_dtype).view(shape)
    if logits is None:
        logits = linear(x, e.router, e.router_bias)
    logits = logits.reshape(-1, logits.shape[-1])
    if kernel:
        if x2.shape[0] * o.top_k <= KERNEL_MAX_SLOTS:
            w, ids = cuda_moe.route(logits, o)
            return cuda_moe.moe_experts(x2, ids, w, e, o, out_dtype=out_dtype).view(shape)
        if cuda_moe.prepared(e) is not None:  # packed experts: grouped quantized matmuls
            w, ids = route(logits, o)
            return cuda_moe.moe_grouped(x2, ids, w, e, o, out_dtype).view(shape)
    w, ids = route(logits, o)
    run = _gathered if ids.numel() <= GATHER_MAX_SLOTS else _grouped
    y = run(x2, ids, e, o, dt)  # (N, k, H)
    return (y * w.to(y.dtype).unsqueeze(-1)).sum(dim=1).view(shape)
