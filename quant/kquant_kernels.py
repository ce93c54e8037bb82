"""The Triton kernels of the GGUF K-quant weights (Q4_K, Q5_K, Q6_K) in
quant/kquant_layout.py's layout (read its docstring); launched by triton_kquant.kqmatmul.

- _kq_lane_gemv_kernel (defined in quant/kquant_lane.py, named here too): the GEMV (up to
  GEMV_MAX_M rows of x), the affine int4 GEMV's loop reading the K-quant planes, with
  split-K, PDL and a SiLU epilogue for the joint gate/up;
- _kq_tile_gemm_kernel: the tensor-core GEMM, the affine GEMM's structure, each tile
  decoded in registers;
- _kq_gemv_kernel, _kq_gemm_kernel: the tile GEMV and per-super-block GEMM they replaced,
  kept for A/B timing (a KQConfig asks for them).
"""

from __future__ import annotations

from mlxrun.quant import triton_gemm as tgm
from mlxrun.quant import triton_kernels as tk

triton = tk.triton
tl = tk.tl
tlc = tk.tlc

if triton is not None:
    from mlxrun.quant.kquant_lane import _kq_lane_gemv_kernel  # noqa: F401 (launches name it here)

    @triton.jit
    def _kq_load(w_ptr, rn, n_mask, kb, stride_w, KW, KB, KIND: tl.constexpr, NS: tl.constexpr):
        """Words of k-step kb (NS sub-blocks) of rows rn: low nibbles [BN, NS, WPS] (WPS words
        a sub-block) and high bits [BN, NS] (one word a sub-block; lo again for Q4_K, unused).
        KW: low-nibble words a row; KB: super-blocks a row."""
        S: tl.constexpr = 16 if KIND == 2 else 32
        WPS: tl.constexpr = S // 8
        rs = kb * NS + tl.arange(0, NS)  # sub-blocks of the row
        smask = n_mask[:, None] & (rs < KB * (256 // S))[None, :]
        base = w_ptr + rn[:, None] * stride_w + rs[None, :] * WPS
        rw = tl.arange(0, WPS)[None, None, :]
        lo = tl.load(base[:, :, None] + rw, mask=smask[:, :, None], other=0)
        if KIND == 0:
            hi = lo
        else:
            hi = tl.load(w_ptr + rn[:, None] * stride_w + KW + rs[None, :], mask=smask, other=0)
        return lo, hi

    @triton.jit
    def _hi_shift(pos, KIND: tl.constexpr, HS: tl.constexpr):
        """Bit offset in a sub-block's high word of its field pos = 8w + i (weight i*WPS + w):
        KIND (its high bits a weight) * pos, or with HS (Q6_K's spread order,
        kquant_layout.hi_shifts) 8*(i//2) + 4*(1-w) + 2*(i % 2 == 0)."""
        if HS:
            i = pos % 8
            return 8 * (i // 2) + 4 * (1 - pos // 8) + 2 * (1 - i % 2)
        return pos * KIND

    @triton.jit
    def _kq_codes(lo, hi, KIND: tl.constexpr, HS: tl.constexpr = False):
        """Words from _kq_load -> codes as fp32 [BN, NS, WPS, 8] (Q6_K: q - 32), weight
        8w + i of each sub-block at [.., w, i]. The integer code goes into the mantissa of
        2^23 (an OR and a subtract, no int->float conversion, a quarter-rate instruction).
        Every index past the row block stays in one thread's registers: the sums over a
        sub-block need no shuffles."""
        S: tl.constexpr = 16 if KIND == 2 else 32
        WPS: tl.constexpr = S // 8
        lo = lo.to(tl.uint32, bitcast=True)
        c = (lo[:, :, :, None] >> (tl.arange(0, 8) * 4)[None, None, None, :]) & 15
        if KIND != 0:
            hi = hi.to(tl.uint32, bitcast=True)
            pos = tl.arange(0, WPS)[:, None] * 8 + tl.arange(0, 8)[None, :]  # [WPS, 8]
            sh = _hi_shift(pos, KIND, HS)
            h = (hi[:, :, None, None] >> sh[None, None, :, :]) & ((1 << KIND) - 1)
            c = c | (h << 4)
        OFF: tl.constexpr = 8388640.0 if KIND == 2 else 8388608.0  # 2^23 (+ 32 for Q6_K)
        return (c | 0x4B000000).to(tl.float32, bitcast=True) - OFF

    @triton.jit
    def _kq_pos(lo, hi, I: tl.constexpr, KIND: tl.constexpr, HS: tl.constexpr = False):
        """Code q of nibble position I of the words lo [BN, NS, WPS] (hi [BN, NS, 1]: the
        high words) as the fp32 q * 2^-149: an integer below 2^23 read as a float is that
        denormal, so the code needs no conversion (no int->float, a quarter-rate
        instruction, and no subtract); x comes pre-multiplied by 2^100. Weight I*WPS + w of
        each sub-block. A static position keeps every word's codes in its thread."""
        WPS: tl.constexpr = 2 if KIND == 2 else 4
        c = (lo.to(tl.uint32, bitcast=True) >> (4 * I)) & 15
        if KIND != 0:
            sh = _hi_shift(tl.arange(0, WPS) * 8 + I, KIND, HS)  # field 8w + I of the high word
            h = (hi.to(tl.uint32, bitcast=True) >> sh[None, None, :]) & ((1 << KIND) - 1)
            c = c | (h << 4)
        return c.to(tl.float32, bitcast=True)

    @triton.jit
    def _kq_x(x_ptr, kb, KB, KIND: tl.constexpr, NS: tl.constexpr):
        """x of k-step kb as fp32 [NS, WPS, 8], the codes' order."""
        S: tl.constexpr = 16 if KIND == 2 else 32
        WPS: tl.constexpr = S // 8
        rs = kb * NS + tl.arange(0, NS)
        off = (rs[:, None] * S + tl.arange(0, WPS)[None, :] * 8)[:, :, None] + tl.arange(0, 8)
        mask = (rs < KB * (256 // S))[:, None, None]
        return tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _kq_scales(s_ptr, b_ptr, rn, n_mask, kb, KB, KIND: tl.constexpr, NS: tl.constexpr):
        """Per sub-block fp32 scale d*sc and bias -dmin*m [BN, NS] of k-step kb (bias 0 for
        Q6_K); KB: super-blocks a row. Both products are exact in fp32."""
        SPB: tl.constexpr = 16 if KIND == 2 else 8  # sub-blocks per super-block
        rs = kb * NS + tl.arange(0, NS)
        smask = n_mask[:, None] & (rs < KB * SPB)[None, :]
        sb = rs // SPB  # each sub-block loads its super-block's d (a cached line)
        if KIND == 2:
            sc = tl.load(s_ptr + rn[:, None] * (KB * 16) + rs[None, :], mask=smask, other=0)
            d = tl.load(b_ptr + rn[:, None] * KB + sb[None, :], mask=smask, other=0.0)
            scale = d.to(tl.float32) * sc.to(tl.float32)
            bias = scale  # unused
        else:
            sp = s_ptr + rn[:, None] * (KB * 16) + rs[None, :] * 2
            sc = tl.load(sp, mask=smask, other=0).to(tl.float32)
            mn = tl.load(sp + 1, mask=smask, other=0).to(tl.float32)
            bp = b_ptr + rn[:, None] * (KB * 2) + sb[None, :] * 2
            d = tl.load(bp, mask=smask, other=0.0).to(tl.float32)
            dmin = tl.load(bp + 1, mask=smask, other=0.0).to(tl.float32)
            scale = d * sc
            bias = -(dmin * mn)
        return scale, bias

    @triton.jit
    def _kq_gemv_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, N, KW, KB, stride_xm, stride_ym,
        stride_w, KIND: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr,
        SPLIT_K: tl.constexpr, KB_PER_SPLIT: tl.constexpr, PDL: tl.constexpr = False,
        HS: tl.constexpr = False,
    ):  # fmt: skip
        """y[m, rows] = x[m] @ W[rows]^T for one row m of x (program axis 0), BLOCK_N rows
        (axis 1) and one split of K (axis 2), SB super-blocks a k-step. Each k-step's words
        are loaded one step ahead (their loads overlap the previous step's arithmetic); per
        sub-block: scale * dot(codes, x) + bias * sum(x), summed over K at the end."""
        NS: tl.constexpr = SB * (16 if KIND == 2 else 8)
        m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        kb0 = pid_k * KB_PER_SPLIT
        lo, hi = _kq_load(w_ptr, rn, n_mask, kb0, stride_w, KW, KB, KIND, NS)
        if PDL:  # the weights do not depend on the previous kernel; x does
            tlc.gdc_wait()
            tlc.gdc_launch_dependents()
        acc = tl.zeros([BLOCK_N, NS], dtype=tl.float32)
        xm = x_ptr + m * stride_xm
        for j in range(0, KB_PER_SPLIT):
            kb = kb0 + j
            # the last step reloads itself (a cache hit), not the next split's first step
            nxt = tl.minimum(kb + 1, kb0 + KB_PER_SPLIT - 1)
            lo_n, hi_n = _kq_load(w_ptr, rn, n_mask, nxt, stride_w, KW, KB, KIND, NS)
            S: tl.constexpr = 16 if KIND == 2 else 32
            WPS: tl.constexpr = S // 8
            rs = kb * NS + tl.arange(0, NS)
            xo = (rs[:, None] * S + tl.arange(0, WPS)[None, :])[None, :, :]  # [1, NS, WPS]
            xmask = (rs < KB * (256 // S))[None, :, None]
            hi3 = hi[:, :, None]
            p = tl.zeros([BLOCK_N, NS, WPS], dtype=tl.float32)
            xsum = tl.zeros([1, NS, WPS], dtype=tl.float32)
            for i in tl.static_range(8):  # weights i*WPS + w: WPS consecutive inputs
                xr = tl.load(xm + xo + i * WPS, mask=xmask, other=0.0).to(tl.float32)
                if KIND == 0 and i < 6:
                    # Q4_K: the nibble masked in place (bits 4i..4i+3 < 24) is the float
                    # q * 2^(4i-149): one LOP3 a weight, no shift; x carries 2^(100-4i)
                    x = xr * (1.2676506002282294e30 / (1 << (4 * i)))
                    f = (lo.to(tl.uint32, bitcast=True) & (15 << (4 * i))).to(
                        tl.float32, bitcast=True
                    )
                else:  # 2^100: products q * x * 2^-49 stay normal
                    x = xr * 1.2676506002282294e30
                    f = _kq_pos(lo, hi3, i, KIND, HS)
                p += f * x
                xsum += xr
            dot = tl.sum(p, axis=2) * 562949953421312.0  # [BN, NS] * 2^49: sum of q * x
            xs = tl.sum(xsum, axis=2)  # [1, NS]: sum of x
            scale, bias = _kq_scales(s_ptr, b_ptr, rn, n_mask, kb, KB, KIND, NS)
            if KIND == 2:  # codes q - 32
                acc += scale * (dot - 32.0 * xs)
            else:
                acc += dot * scale + bias * xs
            lo, hi = lo_n, hi_n
        out = tl.sum(acc, axis=1)
        y_ptrs = y_ptr + m * stride_ym + rn
        if SPLIT_K == 1:
            tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=n_mask)
        else:
            p_ptrs = part_ptr + m * N + rn
            tile = m * tl.num_programs(1) + pid_n
            last, total = tk._split_sum(out, p_ptrs, n_mask, cnt_ptr, tile, pid_k,
                                        tl.num_programs(0) * N, SPLIT_K)  # fmt: skip
            if last:
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _kq_gemm_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, KW, KB, stride_xm,
        stride_ym, stride_w, KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT_K: tl.constexpr, KB_PER_SPLIT: tl.constexpr, UPCAST: tl.constexpr,
        HS: tl.constexpr = False,
    ):  # fmt: skip
        """y[M, N] = x @ W^T on tensor cores, one super-block a k-step: each W tile is
        decoded in registers (q * scale + bias in fp32, then x's dtype)."""
        NS: tl.constexpr = 16 if KIND == 2 else 8  # sub-blocks of one super-block
        S: tl.constexpr = 256 // NS
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // num_n
        pid_n = pid % num_n
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = rm < M
        n_mask = rn < N
        K = KB * 256
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for j in range(0, KB_PER_SPLIT):
            kb = pid_k * KB_PER_SPLIT + j
            lo, hi = _kq_load(w_ptr, rn, n_mask, kb, stride_w, KW, KB, KIND, NS)
            q = _kq_codes(lo, hi, KIND, HS)  # [BN, NS, WPS, 8]
            scale, bias = _kq_scales(s_ptr, b_ptr, rn, n_mask, kb, KB, KIND, NS)
            if KIND == 2:
                w = q * scale[:, :, None, None]
            else:
                w = q * scale[:, :, None, None] + bias[:, :, None, None]
            # column t of the W tile (sub-block s, word w, nibble i) is weight s*S + i*WPS + w
            t = tl.arange(0, 256)
            rk = kb * 256 + (t // S) * S + (t % 8) * (S // 8) + (t % S) // 8
            xt = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                         mask=m_mask[:, None] & (rk < K)[None, :], other=0.0)  # fmt: skip
            wt = tl.reshape(w, [BLOCK_N, 256])
            if UPCAST:  # the interpreter multiplies bf16 tiles as raw uint16: go through fp32
                acc = tl.dot(xt.to(tl.float32), tl.trans(wt), acc)
            elif xt.dtype == tl.float32:
                acc = tl.dot(xt, tl.trans(wt), acc, input_precision="tf32x3")
            else:
                acc = tl.dot(xt, tl.trans(wt.to(xt.dtype)), acc)
        tk._splitk_epilogue(acc, y_ptr, part_ptr, cnt_ptr, rm, rn, M, N, stride_ym, M * N, pid,
                            pid_k, SPLIT_K)  # fmt: skip


if triton is not None:

    @triton.jit
    def _tile_scales(s_ptr, b_ptr, rn, g_idx, smask, KS, KIND: tl.constexpr):
        """fp32 scale d*sc and bias -dmin*m [BN, NG] of rows rn and sub-blocks g_idx (Q6_K:
        d*sc only). Exact in fp32."""
        if KIND == 2:
            sc = tl.load(s_ptr + rn[:, None] * KS + g_idx[None, :], mask=smask, other=0)
            d = tl.load(b_ptr + rn[:, None] * (KS // 16) + (g_idx // 16)[None, :], mask=smask,
                        other=0.0)  # fmt: skip
            scale = d.to(tl.float32) * sc.to(tl.float32)
            bias = scale  # unused: the codes carry their - 32
        else:
            s16 = s_ptr.to(tl.pointer_type(tl.uint16), bitcast=True)
            scm = tl.load(s16 + rn[:, None] * KS + g_idx[None, :], mask=smask, other=0)
            scm = scm.to(tl.uint32)
            b32 = b_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
            dd = tl.load(b32 + rn[:, None] * (KS // 8) + (g_idx // 8)[None, :], mask=smask,
                         other=0)  # fmt: skip
            d = (dd & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            dmin = (dd >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            sc = ((scm & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            mn = ((scm >> 8) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            scale = d * sc
            bias = -(dmin * mn)
        return scale, bias

    @triton.jit
    def _kq_tile_gemm_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, KS, stride_xm,
        stride_ym, stride_wn, KIND: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, NG: tl.constexpr, SPLIT_K: tl.constexpr,
        KB_PER_SPLIT: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr,
        SWAP: tl.constexpr, EVEN_N: tl.constexpr = False, EVEN_K: tl.constexpr = False,
        PDL: tl.constexpr = False, HS: tl.constexpr = False,
    ):  # fmt: skip
        """y[M, N] = x[M, K] @ W^T on tensor cores: triton_kernels._gemm_kernel (its
        grouped tile order, split-K, SWAP: the W tile as the register operand) with each
        W tile of NG sub-blocks decoded in registers from the K-quant planes: the low
        nibbles in the int4 group-transposed order (_decode_tile's), Q5_K/Q6_K's high bits
        from their word per sub-block, then q * d*sc - dmin*m (Q6_K: (q - 32) * d*sc) in
        fp32, rounded to x's dtype. KS: sub-blocks a row; HS: Q6_K's high words spread
        (_hi_shift)."""
        G: tl.constexpr = 16 if KIND == 2 else 32  # a sub-block
        WPG: tl.constexpr = G // 8
        BK: tl.constexpr = NG * G
        KW = K // 8
        if PDL:
            tlc.gdc_wait()
            tlc.gdc_launch_dependents()
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m, pid_n = tgm._grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = rm < M
        n_mask = (rn < N) | EVEN_N
        rg = tl.arange(0, NG)
        rw = tl.arange(0, WPG)
        rk = tl.arange(0, BK)
        # field 8w + i of a high word: weight i*WPG + w of the sub-block ([8, WPG] order)
        hsh = _hi_shift(tl.arange(0, 8)[:, None] + 8 * rw[None, :], KIND, HS)
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        kb0 = pid_k * KB_PER_SPLIT
        for j in range(0, KB_PER_SPLIT):
            kb = kb0 + j
            g_idx = kb * NG + rg
            g_mask = (g_idx < KS) | EVEN_K
            row = w_ptr + rn[:, None, None] * stride_wn
            wmask = n_mask[:, None, None] & g_mask[None, :, None]
            words = tl.load(row + g_idx[None, :, None] * WPG + rw[None, None, :], mask=wmask,
                            other=0).to(tl.uint32, bitcast=True)  # fmt: skip
            smask = n_mask[:, None] & g_mask[None, :]
            k_idx = kb * BK + rk
            x_tile = tl.load(
                x_ptr + rm[:, None] * stride_xm + k_idx[None, :],
                mask=m_mask[:, None] & ((k_idx[None, :] < K) | EVEN_K),
                other=0.0,
            )
            t = words[:, :, None, :] >> (tl.arange(0, 8) * 4)[None, None, :, None]
            c = t & 15  # [BN, NG, 8, WPG]: weight i*WPG + w at [.., i, w]
            if KIND != 0:
                hw = tl.load(w_ptr + rn[:, None] * stride_wn + KW + g_idx[None, :], mask=smask,
                             other=0).to(tl.uint32, bitcast=True)  # fmt: skip
                h = (hw[:, :, None, None] >> hsh[None, None, :, :]) & ((1 << KIND) - 1)
                c = c | (h << 4)
            OFF: tl.constexpr = 8388640.0 if KIND == 2 else 8388608.0  # 2^23 (+ 32: Q6_K)
            q = (c | 0x4B000000).to(tl.float32, bitcast=True) - OFF
            scale, bias = _tile_scales(s_ptr, b_ptr, rn, g_idx, smask, KS, KIND)
            if not UPCAST:  # an opaque move: else Triton redoes the scale products per weight
                # in the dot operand's layout (sm_90 SASS, Q4_K at M=32: 18.6 -> 9.9 a weight)
                scale = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [scale],
                                                  dtype=tl.float32, is_pure=False, pack=1)  # fmt: skip
                bias = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [bias],
                                                 dtype=tl.float32, is_pure=False, pack=1)  # fmt: skip
            if KIND == 2:
                wv = q * scale[:, :, None, None]
            else:
                wv = q * scale[:, :, None, None] + bias[:, :, None, None]
            w_tile = tl.reshape(wv, [BLOCK_N, BK]).to(x_tile.dtype)
            acc = tgm._tile_dot(acc, x_tile, w_tile, UPCAST, SWAP)
        if SWAP:
            acc = tl.trans(acc)
        tk._splitk_epilogue(
            acc, y_ptr, part_ptr, cnt_ptr, rm, rn, M, N, stride_ym, M * N, pid, pid_k, SPLIT_K
        )
