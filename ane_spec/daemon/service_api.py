"""The server's own routes, beside the protocols: /health, /metrics, llama-server's /props,
/tokenize, /detokenize and /slots, and the refused /embeddings. Tokenizing runs on threads (see
`HEAVY_THREADS`), so the event loop always answers /health and /metrics.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anyio
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ane_spec import __version__
from ane_spec.daemon.config import ServeConfig
from ane_spec.daemon.engine import Engine, NotReady, QueueFull, SlotAction
from ane_spec.daemon.http_errors import error_response
from ane_spec.daemon.metrics import CONTENT_TYPE, grammar_queue_metrics
from ane_spec.daemon.prepare import token_text
from ane_spec.daemon.protocol import RANDOM_SEED, DetokenizeRequest, TokenizeRequest
from ane_spec.model.chat import PHI4_MINI_CHAT_TEMPLATE

SLOT_ACTIONS = ("save", "restore", "erase")
HEAVY_THREADS = 2


class SlotActionBody(BaseModel):
    """POST /slots/{id}?action=save|restore|erase (llama-server's shape)."""

    model_config = ConfigDict(extra="forbid")
    filename: str | None = None


def router(config: ServeConfig, engine: Engine,
           heavy: dict[str, anyio.CapacityLimiter]) -> APIRouter:
    """`heavy["limiter"]`: the app's limiter for tokenizing threads (made at startup)."""
    api = APIRouter()
    metrics = engine.metrics

    async def off_loop(fn, *args):  # noqa: ANN001, ANN202
        return await anyio.to_thread.run_sync(fn, *args, limiter=heavy["limiter"])

    @api.get("/health")
    async def health() -> JSONResponse:
        """llama-server's convention: 503 {"status": "loading"} until the model can answer
        (probes that only check the code must not see it ready early), 200 {"status": "ok"}."""
        body = engine.health()
        if body["status"] == "ready":
            body["grammar_queue"] = engine.grammars.queue.snapshot()
        status = {"ready": "ok", "warming": "loading"}.get(body["status"], body["status"])
        return JSONResponse(body | {"status": status},
                            status_code=200 if status == "ok" else 503)

    @api.get("/metrics")
    async def prometheus() -> Response:
        text = metrics.render(engine.gauges) + grammar_queue_metrics(
            engine.grammars.queue.snapshot())
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    @api.get("/props")
    async def props() -> dict[str, Any]:
        tok = engine.tokenizer
        return {
            "default_generation_settings": {
                "n_ctx": engine.context, "speculative": config.speculative,
                "params": {"n_predict": -1, "seed": RANDOM_SEED, "temperature": 0.0,
                           "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_last_n": 64,
                           "repeat_penalty": 1.0, "presence_penalty": 0.0,
                           "frequency_penalty": 0.0, "ignore_eos": False, "stop": [],
                           "samplers": ["penalties", "temperature", "top_k", "top_p",
                                        "min_p"]}},
            "total_slots": engine.kv_slots, "model_path": engine.model_id,
            "model_alias": engine.model_id,
            "chat_template": tok.data.chat_template or PHI4_MINI_CHAT_TEMPLATE,
            "bos_token": token_text(tok, tok.bos_token_id, ""),
            "eos_token": token_text(tok, tok.eos_token_id, ""),
            "modalities": {"vision": False, "audio": False},
            "build_info": f"ane-spec {__version__}", "status": engine.status}

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        tok = engine.tokenizer

        def run() -> bytes:
            ids = tok.encode(body.content, special=True, add_special=body.add_special)
            if not body.with_pieces:
                return _json_list("tokens", ids)
            return _json_list("tokens", [{"id": t, "piece": _piece(tok.token_bytes(t))}
                                         for t in ids])

        return Response(await off_loop(run), media_type="application/json")

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        tok = engine.tokenizer
        vocab = tok.vocab_size

        def run() -> Response:
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            if bad:
                return error_response(400, f"tokens: ids {bad[:5]} are outside the vocabulary "
                                           f"0..{vocab - 1}", param="tokens",
                                      code="invalid_value")
            # llama-server's tokens_to_str: every piece as is. (decode() drops a SentencePiece
            # text's first leading space, which /detokenize keeps.)
            text = tok.decode_bytes(body.tokens).decode("utf-8", errors="replace")
            return Response(_json_bytes({"content": text}),
                            media_type="application/json")

        return await off_loop(run)

    @api.post("/v1/embeddings")
    @api.post("/embeddings")
    async def embeddings() -> Response:
        return error_response(
            501, "embeddings are not supported: this server runs a generative Phi-4-mini "
                 "build whose shards return next-token logits, not pooled embeddings",
            "not_implemented_error", code="not_implemented")

    @api.get("/slots")
    async def slots() -> Response:
        if engine.status != "ready" or engine.slots is None:
            return error_response(503, str(engine.not_ready()), "server_error",
                                  code="unavailable")
        return JSONResponse(engine.slots_snapshot())

    @api.post("/slots/{slot_id}")
    async def slot_action(slot_id: int, action: str,
                          body: SlotActionBody | None = None) -> Response:
        if action not in SLOT_ACTIONS:
            return error_response(400, f"action must be one of {', '.join(SLOT_ACTIONS)}, got "
                                       f"{action!r}", param="action")
        if body is not None and body.filename == "":  # llama-server: "Invalid filename"
            return error_response(400, "filename: must not be empty (leave it out to save as "
                                       "slot-ID)", param="filename")
        if action == "restore" and not (body and body.filename):
            return error_response(400, "restore needs a filename: {\"filename\": \"NAME\"}",
                                  param="filename")
        try:
            job = engine.submit(SlotAction(action, slot_id, body.filename if body else None),
                                asyncio.get_running_loop())
        except NotReady as exc:
            return error_response(503, str(exc), "server_error", code="unavailable")
        except QueueFull as exc:
            return error_response(429, str(exc), "rate_limit_error", code="queue_full",
                                  headers={"Retry-After": "1"})
        event, payload = await job.events.get()
        if event == "error":
            status, message = payload
            return error_response(status, message, "server_error" if status >= 500
                                  else "invalid_request_error")
        if payload is None:
            return error_response(503, "the server is shutting down", "server_error")
        return JSONResponse(payload)

    return api


def _json_bytes(obj: Any) -> bytes:
    """What JSONResponse would send, rendered wherever the caller runs (a worker thread)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _json_list(key: str, items: list[Any], chunk: int = 4096) -> bytes:
    """`_json_bytes({key: items})`, encoded a slice at a time: json.dumps holds the GIL for
    the whole call, and one call over a million items would stall the event loop for it."""
    parts = [_json_bytes(items[i:i + chunk])[1:-1] for i in range(0, len(items), chunk)]
    return b'{"%s":[%s]}' % (key.encode(), b",".join(parts))


def _piece(data: bytes) -> str | list[int]:
    """llama-server's token piece: text when it is valid UTF-8, else its bytes."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)

