"""Several processes, one model: joining the group a platform launcher started.

`torchrun --nproc-per-node N -m mlxrun ...` (torch.distributed: NCCL on CUDA, gloo on the
CPU) and `mlx.launch -n N ... -m mlxrun ...` (mx.distributed: ring over TCP, or whatever
the launcher set up) start N copies of the same command. Each copy finds its rank here,
gives its backend the group (the backend's `all_sum` is the model's only collective), and
loads its shard (mlxrun.shard). Nothing here moves data beyond that one sum.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import MlxrunError

_MESSAGE_BYTES = 1024
_joined: Group | None = None  # a process joins its launcher's group once


def launcher() -> str | None:
    """'torch' under torchrun, 'mlx' under mlx.launch with more than one process, else None.

    torchrun with one process still joins (a one-rank group), whose sums the backend skips:
    it runs as one process does, the baseline the split runs are compared with."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "torch"
    if "MLX_RANK" in os.environ and int(os.environ.get("MLX_WORLD_SIZE", "2")) > 1:
        return "mlx"
    return None


def env_rank() -> int:
    """This process's rank as the launcher set it (0 when not launched), before any init."""
    kind = launcher()
    if kind == "torch":
        return int(os.environ["RANK"])
    if kind == "mlx":
        return int(os.environ["MLX_RANK"])
    return 0


@dataclass
class Group:
    """The processes one model is split over. `handle`: the mx.distributed group (mlx);
    torch uses its default process group."""

    kind: str  # "torch" or "mlx"
    rank: int
    size: int
    handle: Any = None
    device: str = "cpu"  # where torch's host-side sums run (NCCL needs CUDA tensors)
    via: str = ""  # the collective library: nccl, gloo, mx.distributed

    @property
    def label(self) -> str:
        """'tensor parallel rank 0 of 2 (nccl)', for the backend's description."""
        return f"tensor parallel rank {self.rank} of {self.size} ({self.via})"

    def all_sum_np(self, a: np.ndarray) -> np.ndarray:
        """Sum a small host array over every rank (for agreement, not for the model)."""
        if self.kind == "torch":
            import torch  # noqa: PLC0415
            import torch.distributed as dist  # noqa: PLC0415

            t = torch.from_numpy(np.array(a)).to(self.device)
            dist.all_reduce(t)
            return t.cpu().numpy()
        import mlx.core as mx  # noqa: PLC0415

        return np.array(mx.distributed.all_sum(mx.array(a), group=self.handle, stream=mx.cpu))

    def shared_seed(self) -> int:
        """A fresh random seed, the same on every rank (rank 0's draw)."""
        mine = np.random.SeedSequence().entropy % 2**31 if self.rank == 0 else 0
        return int(self.all_sum_np(np.array([mine], dtype=np.int64))[0])

    def agree(self, error: str | None) -> str | None:
        """Every rank calls this with its error (or None); all get the first failing rank's
        message (or None), so one failure ends every rank with the same one line."""
        failed = np.zeros(self.size, dtype=np.int32)
        failed[self.rank] = error is not None
        failed = self.all_sum_np(failed)
        if not failed.any():
            return None
        first = int(np.argmax(failed))
        buf = np.zeros(_MESSAGE_BYTES, dtype=np.int32)
        if self.rank == first:
            raw = error.encode()[:_MESSAGE_BYTES]
            buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        raw = self.all_sum_np(buf).astype(np.uint8).tobytes().rstrip(b"\0")
        msg = raw.decode(errors="replace")
        return msg if first == 0 else f"rank {first}: {msg}"


def join(be) -> Group | None:
    """Join the launcher's group (once a process) and give it to backend `be`; None when
    this process was not started by a launcher."""
    kind = launcher()
    if kind is None:
        return None
    global _joined
    if kind == "torch" and be.name != "torch":
        raise MlxrunError(
            "torchrun starts the PyTorch backends (--backend cuda or cpu); launch "
            "--backend mlx with mlx.launch"
        )
    if kind == "mlx" and be.name != "mlx":
        raise MlxrunError(
            "mlx.launch starts the mlx backend; launch --backend cuda or cpu with torchrun"
        )
    if _joined is None:
        if kind == "torch":
            _joined = _join_torch(be)
        else:
            import mlx.core as mx  # noqa: PLC0415

            h = mx.distributed.init(strict=True)
            _joined = Group("mlx", h.rank(), h.size(), h, via="mx.distributed")
    be.group = _joined
    return _joined


def _join_torch(be) -> Group:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    cuda = str(be.device).startswith("cuda")
    if be.device == "mps":
        raise MlxrunError("--backend mps runs one process; for several Macs use mlx.launch")
    if cuda:
        # one GPU a rank on a host: LOCAL_RANK picks it, before the first tensor lands
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
        # left to interpreter teardown, gloo's threads can be destroyed still joinable, and
        # the process aborts ("terminate called without an active exception") after its work
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    dev = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    return Group("torch", dist.get_rank(), dist.get_world_size(), None, dev, dist.get_backend())
