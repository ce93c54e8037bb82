"""From checkpoint tensors to a Transformer on a backend: name and shape checks, the
quantized-or-dense decision per layer (by whether `<path>.scales` exists), and optional
quantization on load, one tensor at a time."""

from __future__ import annotations

from .config import ModelConfig
from .errors import MlxrunError
from .model import Layer, Transformer
from .weights import Tensor


def _progress(total: int, show: bool):
    from tqdm.auto import tqdm  # noqa: PLC0415 (notebook-aware bar)

    return tqdm(total=total, desc="loading", unit="tensor", disable=not show, leave=False)


class _Builder:
    def __init__(self, cfg: ModelConfig, tensors: dict[str, Tensor], be, quant, bar):
        self.cfg, self.t, self.be, self.quant, self.bar = cfg, tensors, be, quant, bar
        self.qconfig = cfg.quantization
        if self.qconfig is not None:
            from mlxrun.quant.formats import from_config  # noqa: PLC0415

            from_config(self.qconfig)  # validates the mode before anything is loaded
        self.notes: list[str] = []
        self.used: set[str] = set()

    def _get(self, name: str, shape: tuple[int, ...]) -> Tensor:
        t = self.t.get(name)
        if t is None:
            raise MlxrunError(
                f"the checkpoint has no tensor {name!r} (config.json says "
                f"{self.cfg.model_type} with {self.cfg.num_hidden_layers} "
                "layers); is the download complete?"
            )
        if t.shape != shape:
            raise MlxrunError(
                f"tensor {name!r} has shape {list(t.shape)} but config.json implies {list(shape)}"
            )
        self.used.add(name)
        self.bar.update(1)
        return t

    def dense(self, name: str, shape: tuple[int, ...]):
        return self.be.array(self._get(name, shape))

    def matrix(self, path: str, out: int, inp: int):
        """A linear/embedding weight (out, in): packed when the checkpoint is quantized,
        quantized here when asked, else dense."""
        if f"{path}.scales" in self.t:
            from mlxrun.quant.formats import layer_spec  # noqa: PLC0415

            spec = layer_spec(self.qconfig or {}, path)
            if spec is None:
                raise MlxrunError(
                    f"{path} is stored quantized but config.json has no quantization block for it"
                )
            per = 32 // spec.bits if 32 % spec.bits == 0 else None
            wcols = inp * spec.bits // 32 if per is None else inp // per
            w = self._get(f"{path}.weight", (out, wcols))
            s = self._get(f"{path}.scales", (out, inp // spec.group_size))
            b = None
            if spec.mode == "affine":
                b = self._get(f"{path}.biases", (out, inp // spec.group_size))
            return self.be.quantized(w, s, b, spec.mode, spec.bits, spec.group_size)
        w = self.dense(f"{path}.weight", (out, inp))
        q = self.quant
        if q is None:
            return w
        if inp % q.group_size:
            self.notes.append(
                f"{path} stays unquantized: its input size {inp} is not a "
                f"multiple of the group size {q.group_size}"
            )
            return w
        return self.be.quantize(w, q.mode, q.bits, q.group_size)


def build_model(
    cfg: ModelConfig, tensors: dict[str, Tensor], be, quant=None, progress: bool = True
) -> tuple[Transformer, list[str]]:
    """Check names and shapes, move weights to `be` (quantizing with `quant`, a QuantSpec,
    if given); returns the model and notes for the user (layers left unquantized)."""
    if quant is not None and cfg.quantization is not None:
        raise MlxrunError(
            "this checkpoint is already quantized "
            f"({cfg.quantization.get('mode', 'affine')}); drop --quant"
        )
    c = cfg
    H, I, V = c.hidden_size, c.intermediate_size, c.vocab_size
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    tied = c.tie_word_embeddings
    per_layer = 9 + (3 if c.attention_bias else 0) + (2 if c.qk_norm else 0)
    bar = _progress(2 + c.num_hidden_layers * per_layer + (0 if tied else 1), progress)
    b = _Builder(cfg, tensors, be, quant, bar)
    try:
        embed = b.matrix("model.embed_tokens", V, H)
        layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}"
            L = Layer(
                input_layernorm=b.dense(f"{p}.input_layernorm.weight", (H,)),
                post_attention_layernorm=b.dense(f"{p}.post_attention_layernorm.weight", (H,)),
                q_proj=b.matrix(f"{p}.self_attn.q_proj", q_out, H),
                k_proj=b.matrix(f"{p}.self_attn.k_proj", kv_out, H),
                v_proj=b.matrix(f"{p}.self_attn.v_proj", kv_out, H),
                o_proj=b.matrix(f"{p}.self_attn.o_proj", H, q_out),
                gate_proj=b.matrix(f"{p}.mlp.gate_proj", I, H),
                up_proj=b.matrix(f"{p}.mlp.up_proj", I, H),
                down_proj=b.matrix(f"{p}.mlp.down_proj", H, I),
            )
            if c.attention_bias:
                L.q_bias = b.dense(f"{p}.self_attn.q_proj.bias", (q_out,))
                L.k_bias = b.dense(f"{p}.self_attn.k_proj.bias", (kv_out,))
                L.v_bias = b.dense(f"{p}.self_attn.v_proj.bias", (kv_out,))
            if c.qk_norm:
                L.q_norm = b.dense(f"{p}.self_attn.q_norm.weight", (c.head_dim,))
                L.k_norm = b.dense(f"{p}.self_attn.k_norm.weight", (c.head_dim,))
            layers.append(L)
        norm = b.dense("model.norm.weight", (H,))
        head = embed if tied else b.matrix("lm_head", V, H)
    finally:
        bar.close()
    return Transformer(cfg, be, embed, layers, norm, head), b.notes
