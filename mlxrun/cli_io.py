"""What the CLI reads and writes besides the model: prompts from files or stdin, JSONL
results, JSON reports, the summary of a converted checkpoint. Files are written to a
temporary name, then renamed."""

from __future__ import annotations

import dataclasses
import sys

import click

from .errors import MlxrunError


def emit_json(obj, path: str | None) -> None:
    """JSON on stdout for '-', else to `path` (written to a temporary name, then renamed)."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415

    def plain(o):
        if dataclasses.is_dataclass(o):
            return dataclasses.asdict(o)
        return str(o)

    text = json.dumps(obj, indent=2, default=plain, ensure_ascii=False) + "\n"
    if path == "-":
        click.echo(text, nl=False)
        return
    check_writable(path)
    try:
        with open(f"{path}.partial", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(f"{path}.partial", path)
    except OSError as e:
        raise MlxrunError(f"cannot write {path}: {e.strerror}") from None
    click.echo(f"wrote {path}", err=True)


def stdin_text() -> str | None:
    """What a pipe or a redirected file on stdin holds; None on a terminal (or when stdin is
    no file at all), so `mlxrun generate` alone never waits for input."""
    import os  # noqa: PLC0415
    import stat  # noqa: PLC0415

    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is an OSError
        return None
    if not (stat.S_ISFIFO(mode) or stat.S_ISREG(mode)):
        return None
    return sys.stdin.read()


def read_prompts(path: str) -> list[dict]:
    """One prompt per line, or JSONL objects with a "prompt" field (by extension or when the
    first non-blank line starts with '{'); '-' reads stdin. Returns one dict per prompt: a
    JSONL line's own fields (an "id", say) with "prompt"."""
    if path == "-":
        text = sys.stdin.read()
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or str(e)
            raise MlxrunError(f"cannot read prompts file {path}: {why}") from None
    return parse_prompts(text, "stdin" if path == "-" else path)


def parse_prompts(text: str, name: str) -> list[dict]:
    """read_prompts on text already read; `name` is what errors call it."""
    import json  # noqa: PLC0415

    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip()), "")
    rows = []
    if name.endswith(".jsonl") or first.lstrip().startswith("{"):
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"]
            except (json.JSONDecodeError, TypeError, KeyError):
                raise MlxrunError(f'{name}:{n}: not a JSON object with a "prompt" field') from None
            if not isinstance(prompt, str) or not prompt.strip():
                raise MlxrunError(f'{name}:{n}: "prompt" must be a non-empty string')
            rows.append(row)
    else:
        rows = [{"prompt": ln} for ln in lines if ln.strip()]
    if not rows:
        raise MlxrunError(f"prompts file {name} holds no prompts")
    return rows


def check_writable(path: str) -> None:
    """Refuse an output path that cannot be written before any model loads."""
    import os  # noqa: PLC0415

    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise MlxrunError(
            f"cannot write {path}: directory {parent} does not exist; create it first"
        )
    if os.path.isdir(path):
        raise MlxrunError(f"cannot write {path}: it is a directory; give a file name")
    if not os.access(parent, os.W_OK):
        raise MlxrunError(f"cannot write {path}: directory {parent} is not writable")


def write_jsonl(path, rows, results) -> None:
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415

    tmp = f"{path}.partial"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for row, r in zip(rows, results):
                out = {
                    **row,
                    "text": r.text,
                    "tokens": r.generated,
                    "finish_reason": r.finish_reason,
                }
                f.write(json.dumps(out, ensure_ascii=False))
                f.write("\n")
        os.replace(tmp, path)
    except OSError as e:
        raise MlxrunError(f"cannot write {path}: {e.strerror}") from None


def convert_summary(out_dir: str) -> str:
    """One line on what `convert` wrote: the weight files, their size, the formats."""
    import json  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    d = Path(out_dir)
    shards = sorted(d.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in shards)
    cfg = json.loads((d / "config.json").read_text())
    q = cfg.get("quantization")
    if q:
        fmt = f"{q.get('mode', 'affine')} {q['bits']}-bit g{q['group_size']}"
        other = sorted(
            {f"{v.get('mode', 'affine')} {v['bits']}-bit g{v['group_size']}"
             for v in q.values() if isinstance(v, dict)} - {fmt}
        )  # fmt: skip
        n_other = sum(isinstance(v, dict) for v in q.values())
        if other:
            fmt += f"; {n_other} layer(s) {', '.join(other)}"
    else:
        fmt = f"dense {cfg.get('torch_dtype', 'as stored')}"
    files = f"{len(shards)} safetensors file{'s' if len(shards) != 1 else ''}"
    return f"wrote {out_dir}: {files}, {size / 1e9:.3f} GB ({size} bytes), {fmt}"
