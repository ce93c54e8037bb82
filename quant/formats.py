"""Quantization formats: what a quantized linear stores, and the names users pick them by.

The on-disk format is MLX's (mlx-lm's): a quantized linear `p` stores `p.weight` (uint32,
`[out, in*bits/32]`, value i of a row at bit offset i*bits, least significant first),
`p.scales` (`[out, in/G]`) and, in affine mode only, `p.biases` (`[out, in/G]`).

| mode   | values        | bits        | group G     | scales                     | biases |
|--------|---------------|-------------|-------------|----------------------------|--------|
| affine | unsigned ints | 2,3,4,5,6,8 | 32, 64, 128 | input dtype (f32/f16/bf16) | yes    |
| mxfp4  | E2M1          | 4           | 32          | uint8 E8M0 (power of two)  | no     |
| nvfp4  | E2M1          | 4           | 16          | uint8 E4M3                 | no     |
| mxfp8  | E4M3          | 8           | 32          | uint8 E8M0                 | no     |

User-facing names (`--quant NAME`) map onto these: `int4`, `int8`, `fp8`, `fp4`, `nvfp4`.
The two other values a user may type, `none` (keep the checkpoint's dtype) and `auto` (let
the device profile choose), are decided by the caller before a format is resolved; they are
not formats and `resolve` refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxrun.errors import MlxrunError

# mode -> (allowed bits, allowed group sizes); the first entry is MLX's default
ALLOWED: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "affine": ((4, 2, 3, 5, 6, 8), (64, 32, 128)),
    "mxfp4": ((4,), (32,)),
    "nvfp4": ((4,), (16,)),
    "mxfp8": ((8,), (32,)),
}
MODES = tuple(ALLOWED)


def _or_list(xs: list) -> str:
    """'32', '32 or 64', '32, 64 or 128'."""
    xs = [str(x) for x in xs]
    return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " or " + xs[-1]


@dataclass(frozen=True)
class QuantSpec:
    """One quantized format: mode ('affine', 'mxfp4', 'nvfp4', 'mxfp8'), bits, group size."""

    mode: str
    bits: int
    group_size: int

    @property
    def label(self) -> str:
        """Name for messages: 'int4 (affine)', 'fp4 (mxfp4)', 'nvfp4', 'fp8 (mxfp8)'."""
        if self.mode == "affine":
            return f"int{self.bits} (affine)"
        return {"mxfp4": "fp4 (mxfp4)", "nvfp4": "nvfp4", "mxfp8": "fp8 (mxfp8)"}.get(
            self.mode, self.mode
        )

    @property
    def has_biases(self) -> bool:
        """Affine groups store a bias next to the scale; the float modes do not."""
        return self.mode == "affine"

    def validate(self) -> QuantSpec:
        """Raise MlxrunError unless mode, bits and group size are a combination MLX supports.

        Returns self, so `QuantSpec(...).validate()` chains.
        """
        if self.mode not in ALLOWED:
            raise MlxrunError(
                f"unknown quantization mode {self.mode!r}: supported modes are "
                f"{_or_list(list(MODES))}"
            )
        bits_ok, groups_ok = ALLOWED[self.mode]
        if self.bits not in bits_ok:
            raise MlxrunError(
                f"{self.bits}-bit values are not allowed for {self.mode}: use "
                f"{_or_list(sorted(bits_ok))} bits"
            )
        if self.group_size not in groups_ok:
            raise MlxrunError(
                f"group size {self.group_size} is not allowed for {self.label}: use "
                f"{_or_list(sorted(groups_ok))}"
            )
        return self


# user name -> default spec. `none` and `auto` are handled by callers (see module docstring).
USER_FORMATS: dict[str, QuantSpec] = {
    "int4": QuantSpec("affine", 4, 64),
    "int8": QuantSpec("affine", 8, 64),
    "fp8": QuantSpec("mxfp8", 8, 32),
    "fp4": QuantSpec("mxfp4", 4, 32),
    "nvfp4": QuantSpec("nvfp4", 4, 16),
}


def resolve(name: str, group_size: int | None = None, bits: int | None = None) -> QuantSpec:
    """The spec for a user format name, with an optional group size (`--group-size`).

    `bits` (`--bits`) is only a consistency check: each name fixes its width (int4 is 4-bit,
    int8 8-bit, ...), so a different value is an error rather than a silent change of
    format. Other affine widths (2, 3, 5, 6 bits) load from MLX checkpoints through
    `from_config` but are not offered as quantization targets.
    """
    key = name.strip().lower()
    if key in ("none", "auto"):
        raise ValueError(f"resolve() needs a concrete format; decide {key!r} before calling it")
    if key not in USER_FORMATS:
        raise MlxrunError(
            f"unknown quantization format {name!r}: use {_or_list(list(USER_FORMATS))} "
            "(or none / auto)"
        )
    spec = USER_FORMATS[key]
    if bits is not None and bits != spec.bits:
        others = [n for n, s in USER_FORMATS.items() if s.bits == bits and n != key]
        hint = f"; use {_or_list(others)} for {bits}-bit weights" if others else ""
        raise MlxrunError(f"{key} stores {spec.bits}-bit values, not {bits}-bit{hint}")
    if group_size is not None:
        spec = QuantSpec(spec.mode, spec.bits, int(group_size))
    return spec.validate()


def from_config(q: dict) -> QuantSpec:
    """The global spec of a config.json "quantization" block.

    `{"group_size": 64, "bits": 4, "mode": "affine"}`; a missing mode means affine (older
    mlx-lm files), a missing or null group size or bits takes MLX's default for the mode
    (mlx-lm's mixed recipes write `"group_size": null` per layer, and `nn.quantize` passes
    it on to MLX, which reads None as the default). Other keys (per-layer overrides, see
    `layer_spec`) are ignored here.
    """
    if not isinstance(q, dict):
        raise MlxrunError(
            f"config.json 'quantization' must be an object like "
            f'{{"group_size": 64, "bits": 4}}, not {type(q).__name__}; fix the config'
        )
    mode = q.get("mode") or "affine"
    if mode not in ALLOWED:
        raise MlxrunError(
            f"config.json quantization mode {mode!r} is not supported: supported modes are "
            f"{_or_list(list(MODES))}"
        )
    default_bits, default_group = ALLOWED[mode][0][0], ALLOWED[mode][1][0]
    vals = {}
    for key, default in (("bits", default_bits), ("group_size", default_group)):
        v = q.get(key)
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, int):
            raise MlxrunError(
                f"config.json quantization {key} must be an integer, not {v!r}; fix the config"
            )
        vals[key] = v
    return QuantSpec(mode, vals["bits"], vals["group_size"]).validate()


def to_config(spec: QuantSpec) -> dict:
    """The config.json "quantization" block for a spec (mode always written)."""
    return {"group_size": spec.group_size, "bits": spec.bits, "mode": spec.mode}


def layer_spec(qconfig: dict, path: str) -> QuantSpec | None:
    """The spec of module `path` ("model.layers.0.mlp.down_proj") under mlx-lm's rules.

    `qconfig[path]` is False: the module is not quantized (None). A dict: the module's own
    spec, read like the global block; as in `mlx.nn.quantize`, which passes the dict
    straight to `to_quantized`, missing keys take MLX's defaults for the dict's mode
    (affine unless given), not the global values. True or absent: the global spec.
    Whether an absent module is quantized at all is decided by the weights (a
    `<path>.scales` tensor), not here.
    """
    entry = qconfig.get(path, True)
    if entry is False:
        return None
    if entry is True:
        return from_config(qconfig)
    if isinstance(entry, dict):
        return from_config(entry)
    raise MlxrunError(
        f"config.json quantization entry for {path!r} must be false or an object, "
        f"not {entry!r}; fix the config"
    )


def infer_spec(path: str, in_features: int, packed: int, groups: int, byte_scales: bool):
    """The spec a stored layer was packed with, from its shapes, as mlx-lm 0.32's
    `infer_quant_config` recovers it for a module the per-layer map does not name.

    packed: columns of `p.weight` (uint32); groups: columns of `p.scales`; byte_scales:
    the scales are uint8 codes (the float modes) rather than floats (affine).
    """
    if not groups or in_features % groups or (packed * 32) % in_features:
        raise MlxrunError(f"{path}: stored shapes fit no quantized format; re-download it")
    g, bits = in_features // groups, packed * 32 // in_features
    if not byte_scales:
        return QuantSpec("affine", bits, g).validate()
    mode = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}.get((bits, g))
    if mode is None:
        raise MlxrunError(
            f"{path}: {bits}-bit values in groups of {g} with byte scales are no MLX mode"
        )
    return QuantSpec(mode, bits, g)


def packed_shape(out_features: int, in_features: int, spec: QuantSpec) -> dict[str, tuple]:
    """Shapes of the stored tensors of a `[out, in]` linear: weight, scales (, biases)."""
    if in_features % spec.group_size:
        raise MlxrunError(
            f"input dimension {in_features} is not a multiple of the group size "
            f"{spec.group_size} of {spec.label}; pick another group size or keep this layer "
            "unquantized"
        )
    groups = (out_features, in_features // spec.group_size)
    shapes = {"weight": (out_features, in_features * spec.bits // 32), "scales": groups}
    if spec.has_biases:
        shapes["biases"] = groups
    return shapes


def bytes_per_weight(spec: QuantSpec, scale_dtype_bytes: int = 2) -> float:
    """Stored bytes per weight element, scales and biases included.

    `scale_dtype_bytes` is the size of an affine scale/bias (2 for f16/bf16, 4 for f32); the
    float modes always store 1-byte scales. int4 g64 with bf16 scales: 0.5 + 4/64 = 0.5625.
    """
    per_group = 2 * scale_dtype_bytes if spec.has_biases else 1
    return spec.bits / 8 + per_group / spec.group_size
