"""`ane-spec generate`: one prompt or chat through a built model, streamed, with stats."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ane_spec.decode.drafter import NgramDrafter
from ane_spec.decode.metrics import Trace
from ane_spec.decode.session import DecodeSession, GenerateOptions, GenerationResult
from ane_spec.errors import AneSpecError
from ane_spec.model.chat import render_chat
from ane_spec.runtime.pipeline import ShardPipeline


def prompt_tokens(pipeline: ShardPipeline, *, prompt: str | None = None,
                  messages: list[dict[str, Any]] | None = None) -> list[int]:
    """Raw text (special tokens written in it are parsed) or chat messages rendered with the
    model's own template, as llama.cpp and HF do. BOS is added where the vocabulary asks for it
    (Llama 3; not Phi-4-mini or Qwen), as llama.cpp's completion does."""
    tok = pipeline.tokenizer
    if messages is not None:
        bos, eos = (tok.token_text(i) if i is not None else ""
                    for i in (tok.bos_token_id, tok.eos_token_id))
        text = render_chat(messages, template=pipeline.tokenizer_data.chat_template,
                           bos_token=bos, eos_token=eos, add_bos=tok.data.add_bos_token)
        return tok.encode(text, special=True, add_special=True)
    if prompt is None:
        raise AneSpecError("give a prompt or chat messages")
    return tok.encode(prompt, special=True, add_special=True)


def load_chat_file(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AneSpecError(f"{path}: cannot read chat messages: {exc}") from None
    messages = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise AneSpecError(f"{path}: expected a JSON list of {{\"role\", \"content\"}} messages "
                           "(or an object with a \"messages\" list)")
    return messages


def generate(pipeline: ShardPipeline, tokens: list[int], options: GenerateOptions, *,
             ngram_min: int = 1, ngram_max: int = 4, trace_path: str | None = None,
             on_text: Callable[[str], Any] | None = None,
             drafter: Any = None) -> GenerationResult:
    """`drafter`: e.g. a draft model beside the n-gram drafter (decode/draft_setup.py);
    default: the n-gram drafter alone."""
    drafter = drafter or NgramDrafter(ngram_min=ngram_min, ngram_max=ngram_max)
    if trace_path is None:
        return DecodeSession(pipeline, drafter=drafter).generate(tokens, options, on_text)
    with open(trace_path, "w") as fh:
        session = DecodeSession(pipeline, drafter=drafter, trace=Trace(fh))
        return session.generate(tokens, options, on_text)
