"""The fused tensor-parallel sum + residual add + RMSNorm kernel (backends/cuda_allreduce.py).

On the CPU it runs under TRITON_INTERPRET=1 as one rank with its peers simulated: plain
tensors stand for the other ranks' symmetric buffers (their partials already written) and
the flags they would have set are preset on this rank's signal pad. The oracle is the
one-shot all-reduce's order (the partials summed in rank order, fp32) followed by
cuda_ops.add_rms_norm, bit for bit. The peers over NVLink (the signal protocol, graph
replays) are checked by benchmarks/tp_allreduce_gpu.py on two GPUs.
"""

import importlib
import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
pytest.importorskip("triton", reason="triton is not installed")

from mlxrun.backends import cuda_allreduce, cuda_ops  # noqa: E402

if not torch.cuda.is_available() and type(cuda_ops._add_rms_norm_kernel).__name__ != (
    "InterpretedFunction"
):  # imported earlier without the interpreter
    cuda_ops = importlib.reload(cuda_ops)
    cuda_allreduce = importlib.reload(cuda_allreduce)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="GPU: tp_allreduce_gpu.py")

MR, SIG = cuda_allreduce.MAX_ROWS, 384  # the pads' slots from SIG on


@pytest.mark.parametrize(
    ("world", "rank", "rows", "n", "dtype", "push"),
    [
        (2, 0, 1, 96, torch.bfloat16, False),
        (2, 1, 3, 64, torch.float16, True),
        (3, 1, 2, 48, torch.bfloat16, False),
        (3, 2, 2, 48, torch.bfloat16, True),
    ],
)
def test_fused_sum_matches_one_shot_then_add_rms_norm(world, rank, rows, n, dtype, push):
    g = torch.Generator().manual_seed(rows * n + rank)
    parts = [torch.randn(rows, n, generator=g) * 3 for _ in range(world)]
    h = torch.randn(rows, n, generator=g).to(dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    # buffer [slot][source rank][row]: pull reads the source's own, push writes the reader's
    bufs = [torch.full((2, world, MR, n), float("nan")) for _ in range(world)]
    pads = [torch.zeros(SIG + MR * world, dtype=torch.int32) for _ in range(world)]
    epoch = torch.zeros(MR, dtype=torch.int32)
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    sigs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
    peers = cuda_allreduce.Peers(rank, ptrs, sigs, epoch, n, SIG, push=push)
    for use in range(3):  # epochs 0, 1, 2: slots 0, 1, 0
        parts = [p + use for p in parts]
        for p in range(world):
            if p != rank:  # the peers' partials and their "use written" flags
                bufs[rank if push else p][use % 2, p, :rows] = parts[p]
                pads[rank][SIG + torch.arange(rows) * world + p] = use + 1
        total = parts[0].clone()
        for p in parts[1:]:
            total += p  # rank order, as one_shot_all_reduce sums
        want_h, want_x = cuda_ops.add_rms_norm(h, total, w, 1e-5)
        got_h, got_x = cuda_allreduce.sum_add_rms_norm(parts[rank], h, w, 1e-5, peers)
        assert torch.equal(got_h.view(torch.int16), want_h.view(torch.int16))
        assert torch.equal(got_x.view(torch.int16), want_x.view(torch.int16))
        # this rank's partial in its slot (its own buffer or, push, every peer's), its flag
        # on every peer's pad, epochs moved on
        for p in [q for q in range(world) if q != rank] if push else [rank]:
            assert torch.equal(bufs[p][use % 2, rank, :rows], parts[rank])
        for p in range(world):
            if p != rank:
                flags = pads[p][SIG + torch.arange(rows) * world + rank]
                assert flags.tolist() == [use + 1] * rows
        assert epoch[:rows].tolist() == [use + 1] * rows and not epoch[rows:].any()
        h = got_h


EMPTY = -(2**31)  # an empty lamport slot: -0.0's bits


@pytest.mark.parametrize(("world", "rank", "rows", "n"), [(2, 1, 1, 96), (3, 0, 3, 48)])
def test_lamport_sum_matches_and_empties_its_slots(world, rank, rows, n):
    """The data is the signal: the peers' rows preset in this rank's slot, this rank's row
    found in every peer's (a -0.0 sent as +0.0), the slot read put back to empty."""
    g = torch.Generator().manual_seed(rows * n + rank + 7)
    parts = [torch.randn(rows, n, generator=g) * 3 for _ in range(world)]
    parts[rank][0, :3] = torch.tensor([-0.0, 0.0, -0.0])
    h = torch.randn(rows, n, generator=g).bfloat16()
    w = (torch.rand(n, generator=g) + 0.5).bfloat16()
    bufs = [torch.full((3, world, MR, n), EMPTY, dtype=torch.int32) for _ in range(world)]
    pads = [torch.zeros(SIG + MR * world, dtype=torch.int32) for _ in range(world)]
    epoch = torch.zeros(MR, dtype=torch.int32)
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    sigs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
    peers = cuda_allreduce.Peers(rank, ptrs, sigs, epoch, n, SIG, push=True, lamport=True)
    for use in range(4):  # slots 0, 1, 2, 0
        parts = [p + use for p in parts]
        for p in range(world):
            if p != rank:
                bufs[rank][use % 3, p, :rows] = parts[p].view(torch.int32)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        want_h, want_x = cuda_ops.add_rms_norm(h, total, w, 1e-5)
        got_h, got_x = cuda_allreduce.sum_add_rms_norm(parts[rank], h, w, 1e-5, peers)
        assert torch.equal(got_h.view(torch.int16), want_h.view(torch.int16))
        assert torch.equal(got_x.view(torch.int16), want_x.view(torch.int16))
        sent = torch.where(parts[rank] == 0, 0.0, parts[rank])  # +0.0 for either zero
        for p in range(world):
            if p != rank:
                assert torch.equal(bufs[p][use % 3, rank, :rows], sent.view(torch.int32))
                bufs[p][use % 3, rank] = EMPTY  # read by that peer
        assert (bufs[rank] == EMPTY).all()  # every slot read is empty again
        assert not any(p.any() for p in pads)  # no flags
        assert epoch[:rows].tolist() == [use + 1] * rows
        h = got_h


@pytest.mark.parametrize(("world", "rank", "rows", "n"), [(2, 1, 2, 48), (3, 0, 1, 40)])
def test_lamport_gather_matches_and_empties_its_slots(world, rank, rows, n, monkeypatch):
    """The logits' gather through the lamport slots: every rank's row side by side in rank
    order (a -0.0 as +0.0), this rank's row found in every peer's slot, the slots read put
    back to empty, a use count a (row, block of columns) program."""
    monkeypatch.setattr(cuda_allreduce, "GATHER_BLOCK", 16)  # several blocks a row
    nblk, R = -(-n // 16), 8
    g = torch.Generator().manual_seed(rows * n + rank)
    xs = [torch.randn(rows, n, generator=g).bfloat16() for _ in range(world)]
    xs[rank][0, :3] = torch.tensor([-0.0, 0.0, -0.0])
    bufs = [torch.full((3, world, R, n), EMPTY, dtype=torch.int32) for _ in range(world)]
    pads = [torch.zeros(SIG + MR * world, dtype=torch.int32) for _ in range(world)]
    epoch = torch.zeros(R * nblk, dtype=torch.int32)
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    sigs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
    peers = cuda_allreduce.Peers(rank, ptrs, sigs, epoch, n, SIG, push=True, lamport=True, rows=R)
    for use in range(4):  # slots 0, 1, 2, 0
        if use:
            xs = [x + use for x in xs]
        for p in range(world):
            if p != rank:
                bufs[rank][use % 3, p, :rows] = xs[p].float().view(torch.int32)
        got = cuda_allreduce.lamport_gather(xs[rank], peers)
        want = torch.cat([torch.where(x == 0, 0.0, x) for x in xs], -1)
        assert got.shape == (rows, world * n)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        sent = torch.where(xs[rank] == 0, 0.0, xs[rank]).float()
        for p in range(world):
            if p != rank:
                assert torch.equal(bufs[p][use % 3, rank, :rows], sent.view(torch.int32))
                bufs[p][use % 3, rank] = EMPTY  # read by that peer
        assert (bufs[rank] == EMPTY).all()
        assert epoch[: rows * nblk].tolist() == [use + 1] * (rows * nblk)
        assert not epoch[rows * nblk :].any()
