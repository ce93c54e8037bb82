"""Launch choices of the CUDA decode attention (cuda_attention.decode_attention), which
re-exports AttnLaunch: kept apart from the kernels, plain Python."""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class AttnLaunch:
    """Launch choices of decode_attention (benchmarks/kv_attention.py times others)."""

    # (H100, one layer of Llama-3.1-8B's attention at 4k and 32k, batch 1 and 8; the numbers
    # in docs/long-context.md): 128-key blocks and more programs suit the one-byte caches,
    # whose blocks take twice bf16's instructions per value read
    block: int = 64  # keys a block of a bf16 / float16 / float32 cache (a power of 2, >= 16)
    block_quant: int = 128  # of an int8 / fp8 cache
    per_sm: int = 2  # splits over the keys: about this many programs per SM (bf16)
    per_sm_quant: int = 4  # (int8, fp8)
    stages: int = 3  # blocks whose loads are in flight (Triton's pipeliner)
    # the combine's program (b, head) reads the splits' partials this many at a time: all
    # 128 at once spilled (32k, batch 1, 4 programs per SM); 4 warps over chunks of 16 were
    # slower at 4k (int8 15.6 against 10.9 us)
    combine_warps: int = 1
    combine_chunk: int = 64
    fp8_f16: bool | None = None  # fp8 dots in float16; None: where q is bf16 / float16
    # at least this many splits for a bf16 / float16 / float32 cache: at batch 64 (8 kv heads,
    # 512 programs) per_sm alone gives one split; two were 5.2% faster in the 8B int4 decode
    # step (H200, context 1024, benchmarks/attn_loop_ab.py: 7.016 against 7.401 ms, 5
    # rounds each). Batch 32 already takes two (one, per_sm=1, lost: +4.7%). min_splits=1
    # gives the previous launch (for A/B timing)
    min_splits: int = 2
    # one split and no sinks: the attention kernel writes the output, no combine launch
    # (which at batch 64, context 1024, 8B shape, took 0.73 ms a step: one split already);
    # MLXRUN_ATTN_DIRECT=0 keeps the combine (for A/B timing)
    direct: bool = os.environ.get("MLXRUN_ATTN_DIRECT", "1") == "1"
    # with the rope folded in (RopeStep): its cos/sin before the PDL wait, not after;
    # MLXRUN_ROPE_EARLY=0 after it (for A/B timing)
    rope_early: bool = os.environ.get("MLXRUN_ROPE_EARLY", "1") == "1"
    # with the rope folded in and a plain cache: the first block's keys and values loaded
    # before the PDL wait, the new key patched in after it; 0: after it (for A/B timing).
    # With combine_once, 8B int4 decode step at context 512, batch 1, medians of 10 rounds
    # (attn_loop_ab): H100 2.1903 -> 2.1616 ms; H200 1.8643 -> 1.8575 with the key loop one
    # stage deep, 1.8731 with 3 stages behind it. The keys alone early: H100 2.1888
    early_kv: bool = True
    # ... where the grid has at most this many programs a SM (8B int4 step, batch 1, H100:
    # two, against one, -0.7% at context 1024 and -0.9% at 4096, whose 8 kv heads take 18
    # and 33 splits)
    early_waves: int = 2
    # the combine loads the stats and partials of its splits together where they fit one
    # chunk (one round trip to L2, not two): same step 1.9073 -> 1.8643 ms (-2.3%); 0: the
    # stats first (for A/B timing)
    combine_once: bool = True

    @classmethod
    def from_spec(cls, spec: str) -> AttnLaunch:
        """'per_sm=8,fp8_f16=0' -> AttnLaunch(per_sm=8, fp8_f16=False); '' -> the default."""
        kw = {}
        for item in filter(None, spec.split(",")):
            key, val = item.split("=")
            flags = ("fp8_f16", "direct", "rope_early", "early_kv", "combine_once")
            kw[key] = bool(int(val)) if key in flags else int(val)
        return cls(**kw)
