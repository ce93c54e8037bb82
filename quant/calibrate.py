"""Calibrated quantization: activation-aware scaling (AWQ), clipping and error feedback
(GPTQ), written into the canonical (mlx-lm) packed format, so no new kernel is needed.

The model runs one decoder layer at a time on any backend (`Transformer.block`, through
quant/calib_layers.py), from the quantized previous layers' output, so memory holds one
layer's weights and one layer's activations. For each linear, the inputs it sees on the
calibration text give H = X^T X (in x in); every search below scores a candidate by the
output error it causes, tr(E H E^T) for a weight error E, computed from H rather than from
the activations:

- awq: per input channel scales s = mean|x|^a (a searched on a grid), applied as W*s with
  1/s folded into the op before (the RMSNorm weight, or the rows of up_proj for
  down_proj), as mlx-lm's AWQ does; then per group a clip of the range (both ends shrunk by
  a searched factor) against the group's block of H; codes by rounding to nearest.
- gptq: the same scales and group parameters, then the codes chosen column by column with
  the rounding error fed forward to the columns not yet quantized (GPTQ, static groups).

A layer of experts (mixture-of-experts models): attention as above, each expert on the
tokens the router sends to it (quant/calibrate_moe.py); the router stays as stored.

The numerical work runs in numpy float32/float64 on the host (quant/calib_search.py: the
group grids, the searches, GPTQ); the backend only runs the layer forward passes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from mlxrun.errors import MlxrunError, read_user_text
from mlxrun.quant.calib_layers import LINEARS, _layer, _names, _Recorder, _run, _Stats
from mlxrun.quant.calib_search import (
    Grid,
    fake_quant,
    gptq_codes,
    make_grid,
    search_clip,
    search_scales,
)
from mlxrun.quant.formats import QuantSpec

METHODS = ("awq", "gptq")
# Output errors of q and k go through a softmax, where a clipped outlier matters more than
# the squared error says; mlx-lm's AWQ leaves them unclipped too.
NO_CLIP = ("q_proj", "k_proj")


@dataclass(frozen=True)
class CalibOptions:
    """How to calibrate: `method` (awq | gptq), `samples` windows of `seq_len` tokens of
    `data` (a file, or None for the bundled text), chosen by `seed`; `grid` points for the
    scale search; the embedding (and a tied head) at `embed_group_size` (None: the spec's);
    `target_bpw`: per-linear widths chosen from measured sensitivity to meet that many bits
    per weight in the file (None: every linear at the spec's width)."""

    method: str = "awq"
    data: str | None = None
    samples: int = 16
    seq_len: int = 320
    seed: int = 0
    grid: int = 20
    embed_group_size: int | None = 32
    target_bpw: float | None = None

    def check(self) -> CalibOptions:
        if self.method not in METHODS:
            raise MlxrunError(
                f"--calibrate {self.method!r} is not a method: use {' or '.join(METHODS)}"
            )
        if self.samples < 1 or self.seq_len < 2:
            raise MlxrunError(
                f"--calib-samples ({self.samples}) must be at least 1 and --calib-seq-len "
                f"({self.seq_len}) at least 2"
            )
        if self.target_bpw is not None and not 0 < self.target_bpw <= 16:
            raise MlxrunError(
                f"--target-bpw {self.target_bpw} is not a size: give bits per weight such as 4.5"
            )
        return self


# ---------------------------------------------------------------- calibration text


def calib_text(path: str | None) -> str:
    """The calibration text: plain UTF-8 text, or JSONL with a "text" field per line (the
    fields joined by blank lines); None: the bundled mlxrun/data/calib.txt (original
    English prose written for mlxrun, distinct from the evaluation text eval.txt)."""
    if path is None:
        return resources.files("mlxrun").joinpath("data/calib.txt").read_text(encoding="utf-8")
    body = read_user_text(path, "--calib-data", "a text or JSONL file")
    if Path(path).suffix.lower() in (".jsonl", ".ndjson"):
        texts = []
        for n, line in enumerate(body.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise MlxrunError(
                    f"--calib-data {path}: line {n} is not JSON; give one object per line "
                    'with a "text" field'
                ) from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise MlxrunError(
                    f'--calib-data {path}: line {n} has no string "text" field; give one '
                    'object per line such as {"text": "..."}'
                )
            texts.append(row["text"])
        body = "\n\n".join(texts)
    return body


def calib_windows(ids: list[int], opts: CalibOptions) -> np.ndarray:
    """Token ids -> `samples` non-overlapping windows [samples, seq_len] (int64), picked
    from all the text's windows by a permutation seeded with `seed`."""
    n = len(ids) // opts.seq_len
    if n < opts.samples:
        raise MlxrunError(
            f"the calibration text gives {len(ids)} tokens, {n} windows of "
            f"{opts.seq_len}, but --calib-samples asks for {opts.samples}: give a longer "
            "--calib-data, or fewer --calib-samples or a shorter --calib-seq-len"
        )
    w = np.asarray(ids[: n * opts.seq_len], np.int64).reshape(n, opts.seq_len)
    pick = np.random.default_rng(opts.seed).permutation(n)[: opts.samples]
    return w[np.sort(pick)]


def calibrate(ckpt, spec: QuantSpec, opts: CalibOptions, backend: str = "cpu", progress=True):
    """Quantize the dense checkpoint `ckpt` (its matrices float32-able) to `spec` with
    calibration `opts`, running the layers on `backend`. Returns (tensors, block, notes):
    every tensor to write (packed matrices, folded norms, the rest unchanged), the
    config.json quantization block, and notes for the user."""
    from tqdm.auto import tqdm  # noqa: PLC0415

    from mlxrun.backends import get_backend  # noqa: PLC0415
    from mlxrun.model import Transformer  # noqa: PLC0415
    from mlxrun.quant.formats import resolve, to_config  # noqa: PLC0415
    from mlxrun.weights import Tensor, bf16_bits  # noqa: PLC0415

    opts.check()
    cfg = ckpt.config
    if cfg.local_rope_theta is not None or cfg.sandwich_norms:
        raise MlxrunError(
            f"--calibrate does not run {cfg.model_type} models yet (sliding layers with a "
            "rope base of their own, sandwich norms); convert without it (round to nearest)"
        )
    if cfg.moe is not None and cfg.moe.shared_intermediate_size:
        raise MlxrunError(
            f"--calibrate does not run a shared expert ({cfg.model_type}) yet; convert this "
            "model without it (round to nearest)"
        )
    inter = cfg.intermediate_size if cfg.moe is None else cfg.moe.intermediate_size
    if cfg.hidden_size % spec.group_size or inter % spec.group_size:
        raise MlxrunError(
            f"calibration needs the hidden size {cfg.hidden_size} and intermediate size "
            f"{inter} to be multiples of the group size {spec.group_size}; "
            "choose a smaller --group-size"
        )
    ids = ckpt.tokenizer.encode(calib_text(opts.data), add_special_tokens=False)
    wins = calib_windows(ids, opts)
    t = dict(ckpt.tensors)
    dtype = {"BF16": "bfloat16", "F16": "float16"}.get(t["model.embed_tokens.weight"].dtype)
    dtype = dtype or "float32"
    be = get_backend(backend, "float32")
    eps = cfg.rms_norm_eps

    def f32(name):
        return t[name].float32()

    def stored(name: str, v: np.ndarray) -> Tensor:
        """A float32 array as a tensor of the checkpoint's float dtype."""
        if dtype == "bfloat16":
            return Tensor("BF16", bf16_bits(v))
        return Tensor.from_numpy(v.astype(np.float16 if dtype == "float16" else np.float32))

    out: dict[str, Tensor] = {}
    block = to_config(spec)

    def put(path: str, grid: Grid, q: np.ndarray) -> np.ndarray:
        """Store codes q on `grid` as `path`'s packed tensors; their float32 values back."""
        for k, v in grid.tensors(q).items():
            out[f"{path}.{k}"] = stored(path, v) if v.dtype == np.float32 else Tensor.from_numpy(v)
        return grid.values(q)

    def codes(w, h, sp, clip=True) -> tuple[Grid, np.ndarray]:
        """w's grid and codes, calibrated against h (None: rounded to nearest)."""
        if h is None:
            grid = make_grid(w, sp, dtype)
            return grid, grid.codes(w)
        grid = make_grid(w, sp, dtype, search_clip(w, h, sp, dtype) if clip else None)
        return grid, gptq_codes(w, h, grid) if opts.method == "gptq" else grid.codes(w)

    def quantize(path, w, h, sp, clip=True) -> np.ndarray:
        return put(path, *codes(w, h, sp, clip))

    def experts(i: int, x: np.ndarray, logits: np.ndarray, ew: dict, dense):
        """Layer i's experts calibrated and stored (stacked, mlx-lm's layout); returns them
        packed on the backend, as the loader will run them (`dense`'s router and biases)."""
        from mlxrun.moe import expert_names  # noqa: PLC0415
        from mlxrun.quant.calibrate_moe import experts as calibrated  # noqa: PLC0415

        nonlocal few
        o, n = cfg.moe, expert_names(cfg.model_type, f"model.layers.{i}")
        # each stacked projection at its own width (--target-bpw), else the spec's
        esp = {proj: specs.get(f"{n.stacked}.{proj}", spec) for proj in LINEARS[4:]}
        parts, k = calibrated(
            ew, x, logits, o,
            lambda w, h, proj: codes(w, h, esp[proj]),
            lambda w, rows, m: search_scales([w], rows, m, esp["down_proj"], dtype, opts.grid),
            2 * spec.group_size,
        )  # fmt: skip
        few += k
        packed = []
        for proj, arrays in parts.items():
            for leaf, v in arrays.items():
                key = f"{n.stacked}.{proj}.{leaf}"
                out[key] = stored("", v) if v.dtype == np.float32 else Tensor.from_numpy(v)
            sp = esp[proj]
            packed.append(be.quantized(
                *(out.get(f"{n.stacked}.{proj}.{leaf}") for leaf in ("weight", "scales", "biases")),
                sp.mode, sp.bits, sp.group_size, embedding=True,
            ))  # fmt: skip
        for proj in LINEARS[4:]:  # biases (gpt-oss) as stacked tensors, whatever the layout
            if f"{proj[:-5]}_bias" in ew:
                out[f"{n.stacked}.{proj}.bias"] = stored("", ew[f"{proj[:-5]}_bias"])
        return dataclasses.replace(dense, gate=packed[0], up=packed[1], down=packed[2])

    # The embedding is quantized at its own group size (mlx-lm's AWQ uses g32) by rounding
    # first, for the layers' inputs; with a tied head it is re-done at the end against
    # the head's inputs.
    espec = spec
    if opts.embed_group_size and spec.mode == "affine":
        espec = resolve("int" + str(spec.bits), group_size=opts.embed_group_size, bits=spec.bits)
    if espec != spec:
        block["model.embed_tokens"] = to_config(espec)
        if not cfg.tie_word_embeddings:
            block["lm_head"] = to_config(espec)
    emb = fake_quant(f32("model.embed_tokens.weight"), espec, dtype)
    shell = Transformer(cfg, be, None, [], None, None)
    rec = _Recorder(be)
    shell_rec = Transformer(cfg, rec, None, [], None, None)
    chunk = max(1, 4096 // opts.seq_len)  # windows per forward: ~4096 tokens of activations
    hs = emb[wins]  # residual stream [samples, T, hidden], float32 on the host
    notes = []

    few = 0  # experts rounded to nearest for want of calibration tokens
    consumed: set[str] = set()  # transformers' per-expert tensors, stored stacked instead

    def expert_stacks(i: int) -> dict[str, np.ndarray]:
        """Layer i's router and stacked experts as float32: {"router": (E, H), "gate_proj":
        (E, I, H), "up_proj": (E, I, H), "down_proj": (E, H, I)}, and where the
        architecture has them (gpt-oss) "router_bias" (E,) and "gate_bias"/"up_bias" (E, I),
        "down_bias" (E, H); from any stored layout (per expert, stacked, gpt-oss's fused)."""
        from mlxrun.moe import expert_names, fused_experts, stack_per_expert  # noqa: PLC0415

        n, tmp = expert_names(cfg.model_type, f"model.layers.{i}"), dict(t)
        consumed.update(stack_per_expert(tmp, n, cfg.moe.num_experts))
        consumed.update(fused_experts(tmp, n))
        out = {}
        for k in LINEARS[4:]:
            w, sc = tmp[f"{n.stacked}.{k}.weight"], tmp.get(f"{n.stacked}.{k}.scales")
            if sc is None:
                out[k] = w.float32()
            else:  # OpenAI's MXFP4 blocks, viewed as mxfp4 by fused_experts: expanded here
                from mlxrun.quant.reference import dequantize  # noqa: PLC0415

                mx4 = QuantSpec("mxfp4", 4, 32)
                out[k] = dequantize(
                    np.asarray(w.data), np.asarray(sc.data), None, mx4, dtype="float32"
                )
        out["router"] = tmp[f"{n.router}.weight"].float32()
        if cfg.moe.bias:
            out["router_bias"] = tmp[f"{n.router}.bias"].float32()
            for k in LINEARS[4:]:
                out[f"{k[:-5]}_bias"] = tmp[f"{n.stacked}.{k}.bias"].float32()
        return out

    def load(i: int):
        """Layer i's names, float32 matrices, norms and the Layer's extra arguments."""
        moe = cfg.moe is not None and cfg.moe.is_moe(i)
        names = _names(i, moe)
        p = f"model.layers.{i}"
        w = {k: f32(f"{n}.weight") for k, n in names.items()}
        ln_in, ln_post = (
            f32(f"{p}.input_layernorm.weight"),
            f32(f"{p}.post_attention_layernorm.weight"),
        )
        extra = {}
        for k in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if f"{names[k]}.bias" in t:
                extra[k[0] + "_bias"] = be.array(f32(f"{names[k]}.bias"))
        for k in ("q_norm", "k_norm"):
            if f"{p}.self_attn.{k}.weight" in t:
                extra[k] = be.array(f32(f"{p}.self_attn.{k}.weight"))
        if f"{p}.self_attn.sinks" in t:  # gpt-oss: a logit per head joining the softmax
            extra["sinks"] = be.array(f32(f"{p}.self_attn.sinks"))
        if moe:
            from mlxrun.moe import Experts  # noqa: PLC0415

            ew = expert_stacks(i)
            biases = ("router_bias", "gate_bias", "up_bias", "down_bias")
            extra["moe"] = Experts(
                *(be.array(ew[k]) for k in ("router", *LINEARS[4:])),
                **{k: be.array(ew[k]) for k in biases if k in ew},
            )
            w["experts"] = ew  # not a linear: _layer takes the experts from `extra`
        return names, p, w, ln_in, ln_post, extra

    specs: dict[str, QuantSpec] = {}  # per-linear widths other than the spec's
    if opts.target_bpw is not None:
        from mlxrun.quant.mixed_bits import mixed_specs  # noqa: PLC0415

        specs = mixed_specs(load, shell, hs, chunk, cfg, spec, espec, dtype, opts, progress)
        for name, sp in specs.items():
            block[name] = to_config(sp)
        notes.append(
            f"--target-bpw {opts.target_bpw}: "
            + ", ".join(
                f"{sum(sp.bits == b for sp in specs.values())} linears at {b} bits"
                for b in sorted({sp.bits for sp in specs.values()})
            )
            + f" (the rest at {spec.bits})"
        )
    bar = tqdm(
        range(cfg.num_hidden_layers),
        desc=f"calibrating ({opts.method})",
        unit="layer",
        disable=not progress,
    )
    for i in bar:
        names, p, w, ln_in, ln_post, extra = load(i)
        sp = {k: specs.get(n, spec) for k, n in names.items()}
        L = _layer(be, w, ln_in, ln_post, extra)
        _, stats = _run(shell_rec, L, hs, chunk, rec, i)
        h_qkv, m_qkv, x_qkv = stats[id(L.q_proj)].result()
        h_o, _, _ = stats[id(L.o_proj)].result()
        # scales: q/k/v (folded into the input norm), down (into up's rows), gate/up
        qkv = [w["q_proj"], w["k_proj"], w["v_proj"]]
        s1 = search_scales(qkv, x_qkv, m_qkv, [sp[k] for k in LINEARS[:3]], dtype, opts.grid)
        ln_in = ln_in / s1
        if L.moe is not None:  # experts: attention as below, then calibrate_moe
            ew = w.pop("experts")
            xs = (np.concatenate(stats.pop(k)) for k in ("moe_x", "moe_logits"))
            extra["moe"] = experts(i, *xs, ew, extra["moe"])
            del stats
            wq = {}
            for k in LINEARS[:4]:
                ws, hk = (w[k], h_o) if k == "o_proj" else (w[k] * s1, h_qkv / np.outer(s1, s1))
                wq[k] = quantize(names[k], ws, hk, sp[k], clip=k not in NO_CLIP)
            out[f"{p}.input_layernorm.weight"] = stored("", ln_in)
            hs, _ = _run(shell, _layer(be, wq, ln_in, ln_post, extra), hs, chunk, None, i)
            continue
        h_gu, m_gu, x_gu = stats[id(L.gate_proj)].result()
        h_d, m_d, x_d = stats[id(L.down_proj)].result()
        del stats
        s2 = search_scales([w["down_proj"]], x_d, m_d, sp["down_proj"], dtype, opts.grid)
        w["up_proj"] = w["up_proj"] / s2[:, None]
        gu = [w["gate_proj"], w["up_proj"]]
        s3 = search_scales(gu, x_gu, m_gu, [sp["gate_proj"], sp["up_proj"]], dtype, opts.grid)
        ln_post = ln_post / s3
        scaled = {
            "q_proj": s1,
            "k_proj": s1,
            "v_proj": s1,
            "o_proj": None,
            "gate_proj": s3,
            "up_proj": s3,
            "down_proj": s2,
        }
        hh = {
            "q_proj": h_qkv,
            "k_proj": h_qkv,
            "v_proj": h_qkv,
            "o_proj": h_o,
            "gate_proj": h_gu,
            "up_proj": h_gu,
            "down_proj": h_d,
        }
        wq = {}
        for k in LINEARS:
            s = scaled[k]
            ws = w[k] if s is None else w[k] * s
            hk = hh[k] if s is None else hh[k] / np.outer(s, s)
            wq[k] = quantize(names[k], ws, hk, sp[k], clip=k not in NO_CLIP)
        out[f"{p}.input_layernorm.weight"] = stored("", ln_in)
        out[f"{p}.post_attention_layernorm.weight"] = stored("", ln_post)
        hs, _ = _run(shell, _layer(be, wq, ln_in, ln_post, extra), hs, chunk, None, i)
    bar.close()
    # the head (or the tied embedding) against the final norm's outputs
    norm = f32("model.norm.weight")
    st = _Stats()
    for s in range(0, len(hs), chunk):
        x = be.rms_norm(be.array(hs[s : s + chunk]), be.array(norm), eps)
        st.add(be.to_numpy(x).reshape(-1, cfg.hidden_size), len(hs) * opts.seq_len)
    h_head = st.result()[0]
    head = "model.embed_tokens" if cfg.tie_word_embeddings else "lm_head"
    quantize(head, f32(f"{head}.weight"), h_head, espec)
    if not cfg.tie_word_embeddings:
        emb_grid = make_grid(f32("model.embed_tokens.weight"), espec, dtype)
        put("model.embed_tokens", emb_grid, emb_grid.codes(f32("model.embed_tokens.weight")))
    for name, x in t.items():  # the rest (other norms, q/k/v biases, routers) as stored
        path, _, leaf = name.rpartition(".")
        if name in consumed:
            continue
        if name not in out and not (leaf == "weight" and f"{path}.scales" in out):
            out[name] = x
    if cfg.moe is not None:
        total = cfg.moe.num_experts * sum(map(cfg.moe.is_moe, range(cfg.num_hidden_layers)))
        notes.append(
            f"experts calibrated on the tokens routed to them; {few} of {total} saw fewer "
            f"than {2 * spec.group_size} calibration tokens and were rounded to nearest"
        )
    return out, block, notes
