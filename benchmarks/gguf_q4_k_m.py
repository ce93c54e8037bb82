"""Write a GGUF laid out as llama.cpp's Q4_K_M lays one out, from any GGUF (default: the
bundled SmolLM2 Q4_1), for runs on files shaped like what people download.

    python benchmarks/gguf_q4_k_m.py OUT.gguf [--source FILE.gguf]

llama.cpp's Q4_K_M rules (src/llama-quant.cpp): Q4_K for matrices; Q6_K for `output` (or the
token embedding when the head is tied) and for attn_v / ffn_down of the layers where
use_more_bits(i, n) holds; a K-quant whose rows are not a multiple of 256 falls back (Q4_K ->
Q5_0, Q6_K -> Q8_0); norms stay F32. The K-quant blocks come from the min-max encoders of
`mlxrun.quant.gguf_encode`, not llama.cpp's search, so the file has Q4_K_M's layout and bytes
but not its quality. Q5_0 / Q8_0 use gguf's own quantize. Tensors are re-quantized from the
source's dequantized values, in the source's row order (so llama q/k stay permuted).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import gguf
import numpy as np

from mlxrun.loader import bundled_model_path
from mlxrun.quant import gguf_blocks as gb
from mlxrun.quant.gguf_encode import ENCODERS, kquant_type

Q = gguf.GGMLQuantizationType
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}


def target_type(name: str, n_layers: int, tied: bool, cols: int) -> str | None:
    """The Q4_K_M type of tensor `name` with `cols` inputs, or None to keep it as stored."""
    kind = kquant_type("q4_k_m", name, n_layers, tied)
    if kind is None:
        return None
    return kind if cols % gb.QK == 0 else FALLBACK[kind]


def encode(w: np.ndarray, kind: str) -> np.ndarray:
    if kind in ENCODERS:
        return ENCODERS[kind](w)
    return gguf.quants.quantize(w, Q[kind])


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--source", default=None, help="GGUF to re-quantize [bundled SmolLM2]")
    a = ap.parse_args()
    src = Path(a.source) if a.source else bundled_model_path()
    reader = gguf.GGUFReader(src, "r")
    arch = reader.fields["general.architecture"].contents()
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    out = Path(a.out)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    copy_metadata(reader, writer)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        cols = int(t.shape[0])
        kind = target_type(t.name, n_layers, tied, cols) if len(t.shape) == 2 else None
        if kind is None:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            kind = t.tensor_type.name
        else:
            w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(-1, cols)
            writer.add_tensor(t.name, encode(w.astype(np.float32), kind), raw_dtype=Q[kind])
        counts[kind] = counts.get(kind, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): {counts}")


if __name__ == "__main__":
    main()
