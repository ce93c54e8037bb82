"""How the quantized-linear kernels (triton_gemv.py, triton_gemm.py) are launched: Triton
itself (or why it could not load), the device's properties, the launch parameters chosen per
shape and format (`choose_config`, from the H100 sweeps in benchmarks/KERNEL_NOTES.md),
programmatic dependent launch, and the split-K tickets. The constexprs a choice implies are
made where the kernels are launched (triton_kernels.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

from .triton_layout import QLinear

try:
    import torch
except ImportError:  # an MLX-only install: the module still imports, use raises
    torch = None

try:
    import triton
    import triton.language as tl

    try:
        from triton.language.extra import cuda as tlc
    except ImportError:  # no grid dependency control: pdl() is then False
        tlc = None
    _TRITON_ERROR = None
except Exception as e:  # ImportError, or a triton that cannot load its libraries
    triton = None
    tl = None
    tlc = None
    _TRITON_ERROR = e

GEMV_MAX_M = 4  # above this many rows the tensor-core kernel wins (per-row FMA cost grows)
# The most warps a GEMV program splits K across; MLXRUN_GEMV_WARPS=1 gives the one-warp
# configs (for A/B timing)
GEMV_WARPS = int(os.environ.get("MLXRUN_GEMV_WARPS", "4"))


def _small_m_gemm(spec: str) -> tuple:
    """Parse "BLOCK_N,warps,stages,groups,waves[,l2[,tma]]" (SMALL_M_GEMM's numbers; tma:
    1 the weight words and x loaded by TMA, 0 by cp.async) into numbers."""
    v = spec.split(",")
    bn, warps, stages, ng, waves = v[:5]
    l2 = int(v[5]) if len(v) > 5 else 0
    tma = int(v[6]) if len(v) > 6 else 0
    return int(bn), int(warps), int(stages), int(ng), float(waves), l2, tma


# The batched-decode GEMM (4 < M <= 32, and 32 < M <= 64): W rows a tile, warps, stages,
# groups a k-step (128 to 256 inputs), split-K to this many waves of programs, k-steps of
# weights brought into L2 before the PDL wait (KernelConfig.l2_prefetch), and 1 where the
# words and x come in by TMA (triton_gemm_tma.py; 0: cp.async, triton_gemm._gemm_kernel).
# The TMA kernel won in the 8B int4 decode step (attn_loop_ab.py, context 1024, one call,
# against the cp.async launch 128,4,4,2,1,0): H100 batch 8 / 16 / 24 / 32 / 48 / 64 -11.3 /
# -9.0 / -11.7 / -10.1 / -10.1 / -10.3%, and 2 k-steps into L2 another -1.7% at batch 32;
# H200 256-input steps at batch 64 -10.1% against -6.3% with 128 (at 48 on the H100 they
# lost 2.1% to 128). H100 `bench --prompt-tokens 1024`: batch 32 5,726 -> 6,515 tok/s,
# batch 64 8,104 -> 9,082 (KERNEL_NOTES.md, 2026-11-27). MLXRUN_SMALL_M_GEMM (the numbers,
# comma-separated; "128,4,4,2,1,0" the previous cp.async launch) overrides both.
_SMALL_M_ENV = os.environ.get("MLXRUN_SMALL_M_GEMM")
SMALL_M_GEMM = _small_m_gemm(_SMALL_M_ENV or "128,4,4,2,1,2,1")
SMALL_M_GEMM_64 = _small_m_gemm(_SMALL_M_ENV or "128,4,3,4,1,0,1")
# Load a k-step's scales with its words (KernelConfig.early) where choose_config says;
# MLXRUN_GEMV_EARLY=0 loads them after the FMAs, as before (for A/B timing)
GEMV_EARLY = os.environ.get("MLXRUN_GEMV_EARLY", "1") != "0"
_COUNTERS: dict = {}  # device -> zeroed int32 tickets, reset by the kernels themselves
_OUTGROWN: list = []  # replaced ticket buffers: a captured CUDA graph may still use one


def _counters(device, n: int) -> torch.Tensor:
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


_PROPS: dict = {}  # device index -> its properties (the query costs host time per call)


def _props(device):
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _PROPS:
        _PROPS[key] = torch.cuda.get_device_properties(key)
    return _PROPS[key]


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a small grid keeps the CPU tests fast
    return _props(device).multi_processor_count


def _l2_bytes(device) -> int:
    return _props(device).L2_cache_size


@functools.cache
def _pdl_api() -> bool:
    """Whether this Triton has grid dependency control and the launch option (3.3/3.4+)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions  # noqa: PLC0415
    except Exception:
        return False
    fields = {f.name for f in dataclasses.fields(CUDAOptions)}
    return tlc is not None and hasattr(tlc, "gdc_wait") and "launch_pdl" in fields


def pdl(device) -> bool:
    """Launch the decode kernels with programmatic dependent launch (Hopper and later).

    Each kernel then lets the next one start while it runs: the next one's programs are
    placed on the SMs, issue their first weight loads (which depend on no earlier kernel) and
    wait in `gdc_wait` until this one's results are visible. Every kernel triggers the next
    (gdc_launch_dependents) only once its own wait is over, so at most one kernel waits
    ahead. Without it every kernel of a decode step pays its launch and its first DRAM round
    trip after the previous one ends: a few us each, ~300 times a token. MLXRUN_PDL=0 turns
    it off (for A/B timing)."""
    if device.type != "cuda" or os.environ.get("MLXRUN_PDL", "1") == "0":
        return False
    return _pdl_api() and _props(device).major >= 9


def pdl_args(device) -> dict:
    """The PDL constexpr and launch option of a kernel launched on `device` (see pdl)."""
    return {"PDL": True, "launch_pdl": True} if pdl(device) else {"PDL": False}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters.

    kernel: "gemv" (num_warps warps per program, splitting each k-step of 128*num_warps
    words per row), "stream" (the same k-steps, per_sm programs a SM each streaming row
    tiles: triton_gemv_stream.py; cvt: E4M3 decoded a word at a time; balance: fewer
    programs where that gives each the same number of tiles) or "gemm" (tl.dot, k-steps of
    ng groups). split_k: programs along K whose partials the last one sums. l2_prefetch
    (gemm, with PDL): k-steps of each program's weight rows, scales and biases brought into
    L2 before it waits for the previous kernel.
    """

    kernel: str
    block_m: int
    block_n: int
    split_k: int
    ng: int = 1
    num_warps: int = 1
    num_stages: int = 1
    group_m: int = 8
    prefetch: bool = True
    swap: bool = False
    l2_prefetch: int = 0
    per_sm: int = 0
    cvt: bool = False
    balance: bool = False
    seq: bool = False  # GEMV, 16 rows: each k-step's two 8-row halves one after the other
    early: bool = False  # GEMV: each k-step's scales loaded with its words
    ahead: bool = False  # stream: the next tile's words issued before the last k-step's FMAs
    tma: int = 0  # gemm, M <= block_m: 1 the words and x by TMA (triton_gemm_tma.py)
    xvec: bool = False  # GEMV, fp4 with bf16 x: a k-step's x as 16-byte loads, not per position
    quads: bool = False  # GEMV, fp4 SiLU 8-row tiles: the scales as two 4-row runs a lane


def _split(n_tiles: int, ksteps: int, sms: int, waves: float) -> int:
    """Split K so that about waves*SMs programs run; each split gets whole k-steps."""
    want = max(1, min(ksteps, math.ceil(waves * sms / max(n_tiles, 1))))
    per = math.ceil(ksteps / want)
    return math.ceil(ksteps / per)


def _split_even(n_tiles: int, ksteps: int, sms: int, waves: float) -> int:
    """Like _split, but a divisor of ksteps (every split gets the same whole k-steps, so the
    GEMM runs without k masks): the smallest one reaching 0.9 of the wanted programs, or
    _split's count where that divisor would be more than twice too many."""
    want = waves * sms / max(n_tiles, 1)
    for d in range(1, ksteps + 1):
        if ksteps % d == 0 and d >= 0.9 * want:
            return d if d <= 2 * want + 1 else _split(n_tiles, ksteps, sms, waves)
    return ksteps


# The 8-bit GEMV: "old" (one-shot programs) or "stream" (persistent programs that stream
# row tiles, triton_gemv_stream.py), and the stream's programs a SM
GEMV8 = os.environ.get("MLXRUN_GEMV8", "stream")
# 4 at 4 warps and 16 rows: 128 registers a thread (E4M3 a word at a time, int8), so all 4
# are resident (H200, mxfp8 28672x4096: 2, 3, 4 a SM 34.2, 36.2, 30.8 us)
STREAM_PER_SM = int(os.environ.get("MLXRUN_STREAM_PER_SM", "4"))
# MLXRUN_STREAM_AHEAD=1: the stream in 8-row tiles with the next tile's words issued before
# the last k-step's FMAs (KernelConfig.ahead; at 16 rows that takes ~250 registers). Off: in
# the H100 decode step it lost 10% (int8 3.301 -> 3.635 ms, fp8 3.165 -> 3.486; 8-row tiles
# alone cost 0.1-0.2%): benchmarks/KERNEL_NOTES.md (2026-11-27)
STREAM_AHEAD = os.environ.get("MLXRUN_STREAM_AHEAD", "0") == "1"


# The fp4 GEMVs' (mxfp4, nvfp4) batch-1 launches and decode: "old" (the default) or "new" (the
# down projection streamed, nvfp4's E4M3 scales by cvt: now GEMV4_LOADS's too). "new" won alone
# (down 14.8 -> 14.4 us) and lost in the model on an H100: fp4 449.3 -> 373.0, nvfp4 385.3 ->
# 339.0 tok/s, same call (KERNEL_NOTES.md, 2026-11-27); MLXRUN_GEMV4=new for the A/B
GEMV4 = os.environ.get("MLXRUN_GEMV4", "old")
# The fp4 GEMVs' loads (KernelConfig.xvec, early where a split has one k-step, nvfp4's quads)
# and nvfp4's decodes (triton_decode: E4M3 scales by cvt, E2M1 positions 3, 7 from one mask):
# MLXRUN_GEMV4_LOADS=0 gives them as before 2026-11-27 (for the A/B; KERNEL_NOTES.md)
GEMV4_LOADS = os.environ.get("MLXRUN_GEMV4_LOADS", "1") != "0"
# mxfp4's E2M1 positions 3 and 7 of a word from one shared mask (triton_decode._decode_pos,
# with MLXRUN_GEMV4=new): fewer instructions, more registers (122 -> 158, sm_90); in the H100
# decode step +3.3%, so off unless MLXRUN_E2M1_PAIR=1 (nvfp4 has it with GEMV4_LOADS)
E2M1_PAIR_ON = os.environ.get("MLXRUN_E2M1_PAIR", "0") == "1"


def launch_from_name(name: str) -> KernelConfig:
    """A batch-1 GEMV launch by its sweep name (benchmarks/gemv8_sweep.py): "gBNwWsS" (the
    one-shot GEMV: BN rows a program, W warps, S splits of K; "nopf": the next k-step's words
    not prefetched) or "sBNwWpP" / "cBNwWpP" / "aBNwWpP" (the streaming GEMV, P programs a
    SM; c: E4M3 a word at a time, a: c with the next tile's words ahead; a trailing "b":
    fewer programs where that gives each the same number of tiles)."""
    import re

    mt = re.fullmatch(r"([sca])(8|16)w([1248])p([1-9])(b?)", name)
    if mt:
        bn, nw, ps = (int(v) for v in mt.groups()[1:4])
        return KernelConfig("stream", 1, bn, 1, num_warps=nw, per_sm=ps, cvt=mt[1] != "s",
                            balance=mt[5] == "b", ahead=mt[1] == "a")  # fmt: skip
    mt = re.fullmatch(r"g(8|16)w([1248])s([1-9])(nopf)?", name)
    if mt:
        bn, nw, sk = (int(v) for v in mt.groups()[:3])
        return KernelConfig("gemv", 1, bn, sk, num_warps=nw, prefetch=not mt[4])
    raise ValueError(name)


def role8(w) -> str:
    """Which Llama linear a weight's shape is (8B: q/k/v 6144x4096, o 4096x4096, the joint
    gate/up 28672x4096, down 4096x14336, the head 128256x4096)."""
    if w.n >= 16 * w.k:
        return "head"
    if w.k > w.n:
        return "down"
    if 2 * w.k < w.n:
        return "gu"
    return "o" if w.n == w.k else "qkv"


def _gemv8_launches(spec: str) -> dict:
    """MLXRUN_GEMV8_LAUNCH: "ROLE[:FORMAT]=LAUNCH" entries joined by "," (FORMAT: int8 or
    fp8, else both); "none" (or empty) for no overrides."""
    from mlxrun.errors import MlxrunError

    out = {}
    for part in [] if spec in ("", "none") else spec.split(","):
        key, _, name = part.partition("=")
        role, _, fmt = key.partition(":")
        try:
            if role not in ("qkv", "o", "gu", "down", "head") or fmt not in ("", "int8", "fp8"):
                raise ValueError(key)
            out[key] = launch_from_name(name)
        except ValueError:
            raise MlxrunError(
                f"MLXRUN_GEMV8_LAUNCH: {part!r} is not ROLE[:FORMAT]=LAUNCH (ROLE: qkv, o, gu, "
                "down, head; FORMAT: int8, fp8; LAUNCH like g16w4s1 or c16w4p4, see "
                "benchmarks/gemv8_sweep.py), or set it to none"
            ) from None
    return out


def gemv8_launch(w):
    """The fixed batch-1 launch of an 8-bit weight (int8 = affine, fp8 = mxfp8), or None."""
    global GEMV8_LAUNCH
    if GEMV8_LAUNCH is None:  # read here, not at import: a bad value is a run's error
        GEMV8_LAUNCH = _gemv8_launches(
            os.environ.get("MLXRUN_GEMV8_LAUNCH") or GEMV8_LAUNCH_DEFAULT
        )
    table = GEMV8_LAUNCH
    role = role8(w)
    fmt = {"affine": "int8", "mxfp8": "fp8"}.get(w.mode)
    return table.get(f"{role}:{fmt}", table.get(role)) if fmt else None


# The 8-bit batch-1 launches that replace choose_config's rules per linear (role8), where
# the shape takes them; MLXRUN_GEMV8_LAUNCH=none gives the rules alone (for the A/B). Empty:
# the H100 sweep of 2026-11-27 (KERNEL_NOTES.md) found no launch that beats the rules' in
# the decode step (q/k/v and o 8 warps +0.5%, split in 2 +2.9%, streamed +2.4%; gate/up on 3
# programs a SM +0.0%, 8 warps +9.3%). It stays for such A/Bs: MLXRUN_GEMV8_LAUNCH="o=..."
GEMV8_LAUNCH_DEFAULT = ""
GEMV8_LAUNCH: dict | None = None  # parsed from MLXRUN_GEMV8_LAUNCH at first use


def stream_even(w, block_n: int, warps: int, silu: bool = False) -> bool:
    """Whether the streaming GEMV takes w (a QLinear, or anything with its n, k, bits):
    whole row tiles (gate/up halves with silu) and whole k-steps of 128*warps words."""
    kw = w.k * w.bits // 32
    rows = w.n // 2 if silu else w.n
    tile = block_n // 2 if silu else block_n
    return kw % (128 * warps) == 0 and rows % tile == 0 and (not silu or w.n % 2 == 0)


def choose_config(m: int, w: QLinear, device, x_dtype=None) -> KernelConfig:
    """Heuristic launch parameters for x [m, K] @ W^T (bench/tuning may override).

    Chosen from the H100 sweep in benchmarks/KERNEL_NOTES.md (run 3).
    """
    sms = _num_sms(device)
    if m <= GEMV_MAX_M:
        # Up to 4 warps a program, each taking its own part of every k-step (lanes along K,
        # summed through shared memory once at the end): a split of K inside the program,
        # with no partials and no ticket round trip. H100 sweep (profile_decode.py --linears
        # --all --warps 1,2,4: cycled weights, PDL on), int4 us, best with 1 warp -> 4 warps:
        # 6144x4096 8.3 -> 6.6, 4096x4096 6.8 -> 5.6, 28672x4096 25.9 -> 24.9, 4096x14336
        # 14.6 -> 14.2, 128256x4096 101.6 -> 96.4; with 4 warps more splits only lost.
        kw = w.k * w.bits // 32
        fp4 = w.mode in ("mxfp4", "nvfp4")
        warps = 1
        while warps < GEMV_WARPS and 256 * warps <= kw:
            warps *= 2
        if fp4 and w.n >= 64 * sms:
            # fp4 with many row blocks (8 or more a SM): 2 warps, twice the k-steps a warp
            # (mxfp4 28672x4096 26.2 -> 24.1 us, 128256x4096 97.4 -> 95.1; 4 warps still
            # win at 6144x4096, 7.5 against 7.7, and 4096x14336, 14.8 against 16.1). In the
            # decode loop (bench, fp4, same call): 438.4, 434.8 -> 440.3, 440.5 tok/s
            warps = min(warps, 2)
        ksteps = math.ceil(kw / (128 * warps))
        if warps > 1:
            # 16 rows (two halves sharing each x input) where a warp has at most 2 k-steps:
            # mxfp8 4096x4096 8.0 -> 7.4 us, but 4096x14336 (7 k-steps) 23.5 -> 84.2;
            # fp4 is slower at 16 rows everywhere (6144x4096 7.5 -> 8.6 us)
            bn = 16 if not fp4 and ksteps <= 2 else 8
        else:
            # 8 or 16 rows (affine with >= 2 row blocks per SM: 8% fewer instructions,
            # twice the work per warp; the fp formats spill at 16)
            bn = 16 if w.mode == "affine" and math.ceil(w.n / 16) >= 4 * sms else 8
        # split K until ~6 warps per SM are in flight (more splits cost their partials and
        # the ticket round trip), into a divisor of the k-steps where one is near (no masks)
        tiles = m * math.ceil(w.n / bn)
        sk = _split(tiles * warps, ksteps, sms, 6.0)
        divs = [d for d in range(1, ksteps + 1) if ksteps % d == 0]
        near = min(divs, key=lambda d: (abs(math.log(d / sk)), -d))
        if kw % (128 * warps) == 0 and abs(math.log(near / sk)) <= math.log(2):
            sk = near
        # One warp a program (rows of fewer than 256 words): from the sweep with PDL on,
        # int4 6144x4096 10.8 us in 1 split, 8.3 in 2; 4096x4096 6.8 in 2; 16 rows lost at
        # N = 6144, 10.1 against 9.1 us, and won at N >= 28672.
        few = warps == 1 and tiles < 8 * sms  # the small shapes (q/k/v, o, down at batch 1)
        if few and fp4:
            # fp4 decodes with ~2x the instructions of int4 and wants every warp it can get:
            # one k-step each (6144x4096 11.0 -> 9.6 us, 4096x4096 9.3 -> 7.9, 4096x14336
            # 22.2 -> 19.5)
            sk = ksteps
        elif few and ksteps / sk > 4:  # long serial chains lose where the rows are few:
            sk = math.ceil(ksteps / 4)  # 4096x14336 int4 17.8 us in 2 splits, 14.6 in 4
        # (with many rows one split wins: mxfp8 28672x4096 45.5 us against 48.6 in 2)
        # E4M3 holds ~155 registers a lane with the next step's words in flight: where a
        # warp has many k-steps, more resident warps beat the prefetch (mxfp8 4096x14336,
        # 7 four-warp steps: 23.5 -> 22.6 us without it; 4096x4096, 2 steps: 7.4 -> 9.5)
        prefetch = not (w.mode == "mxfp8" and warps > 1 and ksteps > 2)
        if fp4 and GEMV4 != "old" and m == 1 and w.k > w.n and stream_even(w, 8, 2):
            # fp4's long rows (the down projection): the streaming GEMV, 8 rows on 2 warps,
            # its k-steps unrolled with the next one's words in flight (4096x14336 on 528
            # programs: about one tile each). H100 sweep (gemv8_sweep.py --formats mxfp4, cycled
            # weights): mxfp4 14.9 -> 14.3 us (4 warps one-shot -> this); the one-shot GEMV
            # on 2 warps 16.1; the stream lost on the K = 4096 shapes (gate/up 24.2 -> 25.4
            # at best, head 95.4 -> 97.6). Batch 1 only: 2-4 rows of x are not measured
            return KernelConfig("stream", 1, 8, 1, num_warps=2, per_sm=4)
        fixed = gemv8_launch(w) if w.bits == 8 and m == 1 else None
        if fixed and GEMV8 == "stream":  # one launch per linear, from the sweeps
            if fixed.kernel != "stream" or stream_even(w, fixed.block_n, fixed.num_warps):
                return fixed
        if w.bits == 8 and GEMV8 == "stream":
            # The streaming GEMV where its programs take several tiles or a tile has long
            # rows; the one-shot GEMV on the small K=4096 shapes. H200 (gemv8_sweep.py,
            # cycled weights, us, one-shot -> stream): mxfp8 28672x4096 with SiLU 36.0 ->
            # 30.8, 4096x14336 16.9 -> 15.1 (8 rows), head 126.5 -> 122.5; int8 34.5 ->
            # 31.4, 21.2 -> 17.0, 137.6 -> 125.8; but 6144x4096 (one tile a program) mxfp8
            # 7.6 -> 8.0, int8 8.1 -> 7.9, 4096x4096 6.0 -> 6.5, 6.4 -> 6.6. E4M3 is decoded
            # a word at a time (the tile-wide conversion spills at 16 rows: Triton 3.6, 255
            # registers + 272 B; a word at a time 128, none); 16 rows, but 8 for long rows
            # (K=14336, 7 k-steps unrolled: int8 at 16 rows holds 249 registers, 2 programs
            # a SM; at 8, 114 and 4). In the H100 decode step (gemv_loop_ab.py, int8): 16 ->
            # 8 rows on the down projection 3.410 -> 3.298 ms, where its one-shot GEMV was
            # 3.357 (mxfp8 4096x14336 alone on the H200: 15.1 us against 17.2)
            sbn = 8 if ksteps > 2 else 16
            many = math.ceil(w.n / 16) * m > STREAM_PER_SM * sms
            sbn = 8 if STREAM_AHEAD else sbn
            if (many or ksteps > 2) and stream_even(w, sbn, warps):
                return KernelConfig("stream", 1, sbn, 1, num_warps=warps,
                                    per_sm=STREAM_PER_SM, cvt=True, ahead=STREAM_AHEAD)  # fmt: skip
        # int4, one k-step a split (q/k/v, o, gate/up, head): the scales loaded with the
        # words, before the PDL wait; otherwise the program ends on a DRAM round trip for
        # them after its FMAs. 8B decode step (gemv_loop_ab.py, H200): 1.929 -> 1.868 ms.
        # Not where a split loops (down: 128 -> 140 registers, the step +2.7%). fp4 with
        # GEMV4_LOADS: there too (q/k/v and o), with x a k-step at a time (xvec); H200
        # decode step, same process: nvfp4 2.4077 -> 2.2375 ms, mxfp4 1.9911 -> 1.9617
        # (xvec alone 2.2493, 1.9745; early alone 2.3972, 1.9727; early everywhere +2.3%)
        # nvfp4's gate/up (SiLU, 8-row tiles) also loads its scales as two 4-row runs a lane
        # (quads: H100 step 2.3748 -> 2.3226 ms with the cvt scales; mxfp4 +1.5%, not there)
        one = math.ceil(ksteps / sk) == 1
        int4 = w.mode == "affine" and w.bits == 4
        loads = fp4 and GEMV4_LOADS
        early = GEMV_EARLY and (int4 or loads) and one
        quads = loads and w.mode == "nvfp4"
        return KernelConfig("gemv", 1, bn, sk, num_warps=warps, prefetch=prefetch, early=early,
                            xvec=loads, quads=quads)  # fmt: skip
    g = w.group_size
    swap = False
    if device.type == "cpu":  # interpreter: small tiles keep the CPU tests fast
        bm, bn, ng, warps = 32, 64, max(1, 256 // g), 4
    elif x_dtype == torch.float32:  # tf32x3 needs 3 MMAs and hi/lo operands: small tiles
        bm, bn, ng, warps = 16, 64, max(1, 64 // g), 4
    elif m <= 64:
        # A few sequences (batched decode): the weight tile is the wgmma's 128-row operand
        # and x's rows its narrow side, split K to about one wave. Measured at M = 32 on the
        # 8B shapes (profile_decode.py --linears): 0.6x the time of the 128x128 tiles.
        # The split divides the k-steps where it can (no k masks in the loop: EVEN_K).
        bn, warps, stages, ng, waves, l2, tma = SMALL_M_GEMM if m <= 32 else SMALL_M_GEMM_64
        bm = 32 if m <= 32 else 64
        # at least 128 inputs a step, at most 256 where that takes more than 2 groups (g128
        # keeps 2 groups, so the scale loads are 4 bytes, async; sm_90 registers, no spills)
        ng = max(2, 128 // g, min(ng, 256 // g))
        ksteps = math.ceil(w.k / (ng * g))
        tiles = math.ceil(m / bm) * math.ceil(w.n / bn)
        sk = _split_even(tiles, ksteps, sms, waves)
        return KernelConfig("gemm", bm, bn, sk, ng, warps, stages, swap=True, l2_prefetch=l2,
                            tma=tma)  # fmt: skip
    elif w.mode == "affine" and w.bits == 4:
        # measured best for g64 (0.81x the time); with bf16 x the swap puts the packed decode
        # straight into wgmma's register operand (no shared-memory round trip), any g
        bm, bn, ng, warps, swap = 128, 128, max(2, 128 // g), 8, True
    elif w.mode != "affine" and x_dtype == torch.bfloat16:
        # packed decode (as affine 4-bit): 6.2-6.3 SASS instructions per weight element
        # against 7.8-8.5 with the 128x256 k64 tiles (sass_gemm.py); not measured on a GPU
        bm, bn, ng, warps, swap = 128, 128, max(1, 128 // g), 8, True
    elif w.mode in ("mxfp4", "mxfp8"):  # measured best: 128x256 tiles, k-step 64
        bm, bn, ng, warps = 128, 256, 2, 8
    else:
        bm, bn, ng, warps = 128, 128, max(1, 128 // g), 8
    ksteps = math.ceil(w.k / (ng * g))
    tiles = math.ceil(m / bm) * math.ceil(w.n / bn)
    sk = _split(tiles, ksteps, sms, 2.0) if tiles < sms else 1
    return KernelConfig("gemm", bm, bn, sk, ng, warps, 3, swap=swap)
