"""llama-server's native routes, as its README (ggml-org/llama.cpp, tools/server) documents them:
`POST /completion`, `/apply-template` and `/infill`. A thin adapter: each request becomes one
/v1/completions request (see relay.py), and its answer goes back in llama-server's shapes.

/completion:
- `prompt`: a string, token ids, or a mix of both (`[12, 34, "text", 56]`): strings are
  tokenized with special tokens parsed, the first one (when the prompt starts with one) with
  BOS, as llama-server's `tokenize_mixed` does. A list of several prompts is refused (one
  result per request).
- `n_predict` (default -1, the rest of the context), `stop`, `stream`, the sampling fields the
  /v1 routes take, `json_schema`, `grammar`; `cache_prompt` and `id_slot` are accepted: the
  server always reuses the longest cached prefix, exactly, and picks the slot holding it.
- The answer: `content`, `stop`, `tokens_predicted`, `tokens_evaluated`, `stop_type` ("eos",
  "word", "limit"), `stopping_word`, `timings`. Streamed as SSE `data:` chunks carrying
  `content` and `stop: false`, then a final chunk with `stop: true` and the totals.

/infill: a vocabulary without FIM tokens (Phi-4-mini's) gets llama-server's 501, word for
word; one with them gets llama-server's prompt (format_prompt_infill, see `infill_prompt`),
repo-level (`<|repo_name|>`, `<|file_sep|>`) where the vocabulary has those tokens, completed
like /completion. `n_indent` (here and on /completion): after the first line, a line indented
by fewer spaces or tabs ends the output there, with stop_type "limit", as llama-server does.

Departures: `n_predict: 0` still generates one token (llama-server only evaluates the prompt);
`n_probs` is refused (ask /v1/completions for `logprobs`); `id_slot` in the answer is -1 unless
the client named one; `tokens` is always empty; `return_tokens`, `timings_per_token`,
`samplers`, `t_max_predict_ms` and `t_max_prompt_ms` are ignored.
"""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, Response, StreamingResponse

from ane_spec.daemon.engine import Engine
from ane_spec.daemon.prepare import Unavailable, off_loop
from ane_spec.daemon.fim import fim_prompt, fim_token, fim_tokens
from ane_spec.daemon.protocol import ChatCompletionRequest, CompletionRequest, dumps
from ane_spec.daemon.relay import Failure, Generate, answer, chunks, json_body, validated
from ane_spec.model.tokenizer import Tokenizer

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# llama-server's error types by status (utils.hpp, format_error_response).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error"}


class NativeCompletion(BaseModel):
    """The fields /completion reads itself; the rest go to the /v1 request as they are."""

    model_config = ConfigDict(extra="allow", strict=True)

    prompt: str | list[int | str] = Field(min_length=1)
    n_predict: int | None = Field(-1, ge=-1)
    stream: bool = False
    cache_prompt: bool = True
    id_slot: int = Field(-1, ge=-1)


def error(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    """llama-server's error shape: {"error": {"code", "message", "type"}}."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"error": {"code": status, "message": message, "type": kind}},
                        status_code=status,
                        headers={"Retry-After": str(retry_after)} if retry_after else None)


def timings(stats: dict[str, Any], n_ctx: int) -> dict[str, Any]:
    """llama-server's `timings` object from the request's stats."""
    def per(n: int, seconds: float) -> tuple[float, float]:
        ms = seconds * 1000
        return (ms / n if n else 0.0), (n / seconds if seconds else 0.0)

    prompt_n, predicted_n = stats["prefill_tokens"], stats["generated_tokens"]
    prompt_tok_ms, prompt_per_s = per(prompt_n, stats["prefill_seconds"])
    predicted_tok_ms, predicted_per_s = per(predicted_n, stats["decode_seconds"])
    return {"prompt_n": prompt_n, "prompt_ms": stats["prefill_seconds"] * 1000,
            "prompt_per_token_ms": prompt_tok_ms, "prompt_per_second": prompt_per_s,
            "predicted_n": predicted_n, "predicted_ms": stats["decode_seconds"] * 1000,
            "predicted_per_token_ms": predicted_tok_ms, "predicted_per_second": predicted_per_s,
            "n_ctx": n_ctx, "n_past": stats["prompt_tokens"] + predicted_n}


def stop_type(finish_reason: str | None, stop_word: str | None) -> str:
    if finish_reason == "length":
        return "limit"
    return "word" if stop_word is not None else "eos"


# "\n\n--- snippet ---\n\n": llama-server's separator before each input_extra chunk when the
# vocabulary has no FIM file-separator token.
SNIPPET = "\n\n--- snippet ---\n\n"
N_BATCH = 2048  # llama-server's default --batch-size, which sizes its FIM prompt parts


def infill_prompt(tok: Tokenizer, fim: tuple[int, int, int], raw: Any,
                  context: int | None = None, n_predict: int = -1) -> list[int]:
    """llama-server's infill prompt (format_prompt_infill, server-common.cpp): [the input_extra
    chunks] [BOS] <PRE> prefix prompt <SUF> suffix <MID>. With the vocabulary's repo and file
    separator tokens the chunks are repo-level: `<|repo_name|>myproject\n`, then
    `<|file_sep|>{filename}\n{text}` per chunk and `<|file_sep|>filename\n`; without them each
    chunk follows SNIPPET. Prefix, suffix and chunks are cut to llama-server's budgets: the
    prefix's last 3/4 n_batch tokens, the suffix's first n_batch/4 - 2 - prompt, and the last
    context - n_batch - 2 n_predict tokens of the chunks, with n_batch = min(2048, context / 2)
    and n_predict the request's (or an eighth of the context). The chunks are read from the
    last one back only until that budget is full, so their number costs nothing past it (340,000
    empty ones made a 3.7M-token prompt)."""
    if not isinstance(raw, dict):
        raise Failure(400, "the request body must be a JSON object")
    parts = {k: raw.get(k, "") for k in ("input_prefix", "input_suffix", "prompt")}
    extra = raw.get("input_extra") or []
    if not all(isinstance(v, str) for v in parts.values()):
        raise Failure(400, "input_prefix, input_suffix and prompt must be strings")
    if not isinstance(extra, list) or not all(
            isinstance(c, dict) and isinstance(c.get("text", ""), str)
            and isinstance(c.get("filename", ""), str) for c in extra):
        raise Failure(400, "input_extra must be a list of {\"text\", \"filename\"} objects "
                           "with string values")
    context = context or 2 * N_BATCH + 1
    n_batch = min(N_BATCH, context // 2)
    reserve = n_predict if n_predict > 0 else context // 8
    extra_budget = max(0, context - n_batch - 2 * reserve)
    rep, sep = fim_token(tok, "rep"), fim_token(tok, "sep")
    # llama-server's extra tokens are [repo header] chunks... [file trailer]; it keeps their
    # last extra_budget. Built from the end, only as far back as that budget reaches.
    pieces: list[list[int]] = []
    if sep is not None:
        pieces.append([sep] + tok.encode("filename\n"))
    have = sum(map(len, pieces))
    snippet = tok.encode(SNIPPET)
    for chunk in reversed(extra):
        if have >= extra_budget:
            break
        head = ([sep] + tok.encode(chunk.get("filename", "tmp") + "\n") if sep is not None
                else snippet)
        pieces.append(head + tok.encode(chunk.get("text", "")))
        have += len(pieces[-1])
    else:
        if rep is not None:
            pieces.append([rep] + tok.encode("myproject\n"))
    ids = [t for piece in reversed(pieces) for t in piece]
    ids = ids[len(ids) - min(extra_budget, len(ids)):]
    prompt = tok.encode(parts["prompt"], special=True)  # llama-server parses specials here
    prefix = tok.encode(parts["input_prefix"])
    prefix = prefix[len(prefix) - min(len(prefix), 3 * (n_batch // 4)):]
    suffix = tok.encode(parts["input_suffix"])[:max(0, n_batch // 4 - (2 + len(prompt)))]
    return fim_prompt(tok, fim, prefix + prompt, suffix, before=ids)


def router(engine: Engine, generate: Generate) -> APIRouter:
    api = APIRouter()

    def tokenize_mixed(prompt: list[int | str]) -> list[int]:
        tok, ids = engine.tokenizer, []
        for i, part in enumerate(prompt):
            if isinstance(part, str):
                ids += tok.encode(part, special=True, add_special=i == 0)
            else:
                ids.append(part)
        return ids

    def final(native: NativeCompletion, text: str, reason: str | None, ext: dict[str, Any],
              use: dict[str, int], prompt: str) -> dict[str, Any]:
        stats, word = ext["stats"], ext.get("stop_word")
        return {"index": 0, "content": text, "tokens": [], "id_slot": native.id_slot,
                "stop": True, "model": engine.model_id,
                "tokens_predicted": use["completion_tokens"],
                "tokens_evaluated": use["prompt_tokens"],
                "generation_settings": {"n_predict": native.n_predict,
                                        "stream": native.stream},
                "prompt": prompt, "has_new_line": "\n" in text, "truncated": False,
                "stop_type": stop_type(reason, word), "stopping_word": word or "",
                "tokens_cached": use["total_tokens"], "timings": timings(stats, engine.context)}

    async def shown_prompt(prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return await anyio.to_thread.run_sync(engine.tokenizer.decode, prompt)

    @api.post("/completion")
    async def completion(request: Request) -> Response:
        try:
            raw = await json_body(request)
        except Failure as exc:
            return error(exc.status, exc.message)
        return await complete(request, raw)

    def build(raw: Any) -> tuple[NativeCompletion, CompletionRequest, str | list[int]]:
        """The request, checked and its prompt tokenized: on a preparation thread, since a
        megabyte of token ids or text takes a while to validate."""
        native = validated(NativeCompletion, raw)
        if isinstance(native.prompt, list) and all(isinstance(p, str) for p in native.prompt):
            if len(native.prompt) != 1:
                raise Failure(400, "prompt: one prompt per request (a list of strings is a "
                                   "batch of prompts)")
            native.prompt = native.prompt[0]
        prompt: str | list[int] = native.prompt  # type: ignore[assignment]
        if isinstance(prompt, list):
            prompt = tokenize_mixed(prompt)
        fields = {k: v for k, v in raw.items() if k not in ("id_slot", "cache_prompt")}
        body = validated(CompletionRequest, fields | {
            "prompt": prompt, "n_predict": native.n_predict, "stream": native.stream,
            "stream_options": {"include_usage": True} if native.stream else None})
        return native, body, prompt

    async def complete(request: Request, raw: Any) -> Response:
        try:
            native, body, prompt = await off_loop(request, build, raw)
            if not native.stream:
                data = await answer(generate, request, body, "completions")
                shown = await shown_prompt(prompt)
                choice = data["choices"][0]
                return JSONResponse(final(native, choice["text"], choice["finish_reason"],
                                          data["ane_spec"], data["usage"], shown))
            events = await chunks(generate, request, body, "completions")
            shown = await shown_prompt(prompt)  # the ids are valid: the handler took them
        except Failure as exc:
            return error(exc.status, exc.message, exc.retry_after)
        except Unavailable as exc:
            return error(exc.status, exc.message, exc.retry_after)

        async def sse() -> Any:
            reason, ext = None, None
            async for chunk in events:
                if "error" in chunk:
                    yield f"data: {dumps(chunk)}\n\n"
                    continue
                if chunk.get("usage"):
                    last = final(native, "", reason, ext, chunk["usage"], shown)
                    yield f"data: {dumps(last)}\n\n"
                    continue
                choice = chunk["choices"][0]
                reason, ext = choice.get("finish_reason") or reason, chunk.get("ane_spec") or ext
                if choice["text"]:
                    partial = {"index": 0, "content": choice["text"], "tokens": [],
                               "stop": False, "id_slot": native.id_slot}
                    yield f"data: {dumps(partial)}\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers=SSE_HEADERS)

    @api.post("/apply-template")
    async def apply_template(request: Request) -> Response:
        """The chat's prompt text, as /v1/chat/completions renders it (same template, same
        BOS/EOS texts)."""
        from ane_spec.daemon.tool_formats import PHI4, tool_format_of
        from ane_spec.decode.grammar import GrammarError
        from ane_spec.errors import AneSpecError
        from ane_spec.model.chat import render_chat

        def render(body: ChatCompletionRequest) -> str:
            tok = engine.tokenizer
            fmt = tool_format_of(tok.data.chat_template, tok.markup_ids, tok.id_of) or PHI4
            given = fmt.template_input(body.messages, body.tools if body.uses_tools else None,
                                       engine.grammars.limits)

            def text(token: int | None) -> str:
                return "<|endoftext|>" if token is None else tok.token_text(token)

            return render_chat(given.messages, template=tok.data.chat_template,
                               tools=given.tools, extra=given.extra,
                               eos_token=text(tok.eos_token_id), bos_token=text(tok.bos_token_id))

        try:
            body = validated(ChatCompletionRequest, await json_body(request))
            prompt = await off_loop(request, render, body)
        except (Failure, Unavailable) as exc:
            return error(exc.status, exc.message, exc.retry_after)
        except (AneSpecError, GrammarError, ValueError) as exc:  # what the renderer refuses
            return error(400, str(exc))
        return JSONResponse({"prompt": prompt})

    @api.post("/infill")
    async def infill(request: Request) -> Response:
        fim = fim_tokens(engine.tokenizer)
        if fim is None:  # llama-server's answer for a vocabulary without FIM tokens, verbatim
            return error(501, "Infill is not supported by this model: prefix token is missing. "
                              "suffix token is missing. middle token is missing. ")
        try:
            raw = await json_body(request)
            n_predict = raw.get("n_predict", -1) if isinstance(raw, dict) else -1
            ids = await off_loop(request, infill_prompt, engine.tokenizer, fim, raw,
                                 engine.context, n_predict if type(n_predict) is int else -1)
        except Failure as exc:
            return error(exc.status, exc.message)
        except Unavailable as exc:
            return error(exc.status, exc.message, exc.retry_after)
        return await complete(request, {k: v for k, v in raw.items() if k not in (
            "input_prefix", "input_suffix", "input_extra")} | {"prompt": ids})

    return api
