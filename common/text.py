"""Text around the engine: tokenizers, chat templates, JSONL prompt files, stop tokens.

The engine sees token ids only; everything that turns text into ids and back, for every caller
(the RL loop, `launch.generate`, drafter warm-start, benchmarks), is here, written once.
"""

from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    """The tokenizer saved with a Hugging Face model folder (never downloaded)."""
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"model folder {path} has no usable tokenizer ({type(e).__name__}: {e})") from None


def read_prompts(path: str | Path) -> list[dict]:
    """`{"id": ..., "prompt": "..."}` lines (other fields are kept); ids must be unique."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} not found")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); expected {{\"id\": ..., \"prompt\": \"...\"}}") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "id" not in row:
            raise ValueError(f"{path}:{lineno}: expected an object with \"id\" and a string \"prompt\", got {line[:80]!r}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    ids = [str(r["id"]) for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: prompt ids must be unique (they key the sampling noise)")
    return rows


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of a prompt; `chat`: as the user turn of the tokenizer's chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("a chat prompt was asked for but the tokenizer has no chat template")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if not isinstance(ids, list) else ids)
    return list(tokenizer(text)["input_ids"])


def stop_tokens(model_config, tokenizer) -> tuple[int, ...]:
    """The model's end-of-sequence ids (config.json), else the tokenizer's, else none."""
    ids = tuple(model_config.eos_ids)
    if ids:
        return ids
    return (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()


def pad_token(tokenizer) -> int:
    """The id a batch's padding is written with: the tokenizer's pad token, else 0 (masked out either way)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
