"""Request preparation: a /v1 chat or completion request checked and turned into the engine's
work item (prompt tokens, sampling, grammar, speculation options); every refusal is a
`BadRequest`.

`prepare_request` runs it off the event loop: `prepare` on a worker thread, at most
PREPARE_THREADS at once (tokenizing a megabyte holds the GIL; more threads would only slow the
event loop's turn at it), with at most PREPARE_WAITING requests waiting for one (more: 429). A
grammar that is not compiled yet is not compiled on that thread: the thread returns
(`NeedsCompile`), the request waits for the grammar compile queue without holding any thread
(`CompileQueue`: bounded, with a deadline, a 429 or 503 with Retry-After past them), and
`prepare` runs again with the grammar in hand. So a plain request never waits behind grammar
compiles, and a request whose client leaves while it waits is dropped, its grammar with it
when nobody else waits for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request

from ane_spec.daemon.engine import Engine, WorkItem
from ane_spec.daemon.fim import fim_prompt, fim_tokens
from ane_spec.daemon.http_errors import BadRequest
from ane_spec.daemon.protocol import (
    RANDOM_SEED, SEED_MAX, ChatCompletionRequest, CompletionRequest, NamedToolChoice,
    SpeculationOptions, Tool,
)
from ane_spec.daemon.tool_formats import (
    PHI4, TemplateInput, ToolFormat, tool_format_of, tool_tag_ids,
)
from ane_spec.decode.grammar import Grammar, GrammarError
from ane_spec.decode.grammar_compiler import CompileBusy, NeedsCompile
from ane_spec.decode.grammar_limits import check_schema
from ane_spec.decode.sampling import SamplingParams
from ane_spec.decode.session import GenerateOptions, NeedsLogits, needs_logits
from ane_spec.errors import AneSpecError


@dataclass(frozen=True)
class Plan:
    """A validated request: the engine's work item and what the response does with its text."""

    item: WorkItem
    tools: list[Tool] | None = None  # parse output into calls to these, in this format:
    tool_format: ToolFormat = PHI4
    schema: dict[str, Any] | None = None  # the output must be JSON valid against it


@dataclass(frozen=True)
class Constraint:
    """A request's grammar, the parameter that asked for it (named in errors), and the schema
    its JSON output is validated against."""

    grammar: Grammar
    param: str
    schema: dict[str, Any] | None = None


PREPARE_THREADS = 4     # requests prepared at once (tokenizing, templates, grammar lookups)
PREPARE_WAITING = 64    # requests waiting for one of those threads before the next gets a 429


class Unavailable(Exception):
    """Not now: a 429 or 503 with Retry-After (the prepare or compile queue is full or too
    slow), or 499 (the client left while its request was prepared)."""

    def __init__(self, status: int, message: str, code: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after = status, message, code, retry_after


def prepare_limiter(request: Request) -> anyio.CapacityLimiter | None:
    """The app's limiter for request preparation (made at startup; None outside an app)."""
    return getattr(request.app.state, "prepare_limiter", None)


async def off_loop(request: Request, fn: Any, *args: Any) -> Any:
    """`fn(*args)` on a request-preparation thread (see the module docstring); Unavailable(429)
    when PREPARE_WAITING requests wait for one already."""
    limiter = prepare_limiter(request)
    if limiter is not None and limiter.statistics().tasks_waiting >= PREPARE_WAITING:
        raise Unavailable(429, f"{PREPARE_WAITING} requests are waiting to be prepared; retry "
                               "later", "queue_full", 1)
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)


async def prepare_request(request: Request, engine: Engine,
                          body: ChatCompletionRequest | CompletionRequest, kind: str,
                          scope: str | None = None) -> Plan:
    """`prepare`, off the event loop, with new grammars compiled through the compile queue
    (see the module docstring). Raises BadRequest or Unavailable."""
    ready: dict[str, Grammar | GrammarError] = {}
    while True:
        try:
            return await off_loop(request, prepare, engine, body, kind, scope, ready)
        except NeedsCompile as need:
            ready[need.key] = await _compiled(request, engine, need)


async def _compiled(request: Request, engine: Engine, need: NeedsCompile) -> Grammar | GrammarError:
    queue = engine.grammars.queue
    try:
        entry = queue.submit(need)
    except CompileBusy as exc:
        raise Unavailable(exc.status, exc.message, "grammar_queue_full", exc.retry_after) from None
    result = asyncio.wrap_future(entry.future)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        try:
            done, _ = await asyncio.wait({result, gone}, timeout=queue.wait_seconds,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server stops, or the task is torn down
            queue.give_up(entry, timed_out=False)
            raise
        if result not in done:
            left = gone in done
            if queue.give_up(entry, timed_out=not left):
                if left:
                    raise Unavailable(499, "the client closed the request", "cancelled")
                exc = queue.busy_error(entry)
                raise Unavailable(exc.status, exc.message, "grammar_queue_timeout",
                                  exc.retry_after)
            # It runs already: its own deadline (compile_seconds) bounds the rest.
            await asyncio.wait({result})
        return result.result()
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def prepare(engine: Engine, body: ChatCompletionRequest | CompletionRequest, kind: str,
            scope: str | None = None,
            ready: MutableMapping[str, Grammar | GrammarError] | None = None) -> Plan:
    """The request's plan. With `ready`, grammars not compiled yet raise NeedsCompile instead
    of being compiled here (`ready` then holds what the queue compiled for this request)."""
    tok, config, ctx = engine.tokenizer, engine.config, engine.context
    vocab = engine.pipeline.config.vocab_size
    uses_tools = kind == "chat" and body.uses_tools
    fmt = tool_format_of(tok.data.chat_template, tok.markup_ids, tok.id_of)
    if uses_tools and fmt is None:
        raise BadRequest(f"tools: this model's chat template ({engine.pipeline.config.arch}) "
                         "has no tool-call format this server knows (Phi-4-mini's "
                         "<|tool_call|>, Llama 3's JSON calls, Qwen's <tool_call> tags)", "tools")
    # A template without a known format still renders earlier calls somehow: as Phi-4-mini's.
    fmt = fmt or PHI4
    # The tools the template is given. A template with no call format (Gemma 3) gets them as
    # llama.cpp gives them, and the output is plain content: no grammar, no call parsing.
    template_tools = body.tools if uses_tools else None
    if uses_tools and not fmt.calls:
        if body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice):
            raise BadRequest(f"tool_choice: this model's chat template "
                             f"({engine.pipeline.config.arch}) has no tool-call format, so its "
                             "output is read as text and a call cannot be required; use "
                             "tool_choice \"auto\" or \"none\"", "tool_choice")
        uses_tools = False
    # The grammar first: one not compiled yet sends the request to the compile queue before
    # any tokenizing, which would otherwise be done twice.
    constraint = _constraint(engine, body, kind, fmt if uses_tools else None, ready)
    if kind == "chat":
        where = "messages"
        try:
            given = fmt.template_input(body.messages, template_tools, engine.grammars.limits)
        except (ValueError, GrammarError) as exc:
            raise BadRequest(str(exc), "messages") from None
        prompt = _chat_prompt(tok, given, config.special_in_content, tool_tag_ids(fmt, tok.id_of))
    else:
        where = "prompt"
        source = body.single_prompt()
        fim = fim_tokens(tok) if body.suffix else None
        if body.suffix and fim is None:
            raise BadRequest("suffix: this model's vocabulary has no fill-in-the-middle tokens",
                             "suffix")
        if isinstance(source, str):
            prompt = (tok.encode(source) if fim else
                      tok.encode(source, special=True, add_special=True))
        else:
            prompt = list(source)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise BadRequest(f"token ids {bad[:5]} are outside the vocabulary "
                                 f"0..{vocab - 1}", "prompt")
        if fim:  # the prompt is the prefix: the model writes what goes before the suffix
            prompt = fim_prompt(tok, fim, prompt, tok.encode(body.suffix))
    n = len(prompt)
    if n == 0:
        raise BadRequest("the prompt is empty", where)
    room = ctx - n
    if room < 1:
        raise BadRequest(f"this model's context window is {ctx} tokens and the prompt has {n}, "
                         "which leaves no room to generate", where, "context_length_exceeded")
    # Like llama-server, a cap beyond the room left is lowered to it: generation then ends with
    # finish_reason "length" when the context fills.
    max_tokens = min(body.requested_max_tokens() or ctx, room)

    sampling = _sampling(engine, body)
    if constraint is not None and sampling.ignore_eos:
        raise BadRequest("ignore_eos: cannot be combined with a grammar, a response_format or "
                         "tools (the grammar decides where the output ends)", "ignore_eos")

    ext = body.ane_spec or SpeculationOptions()
    lo = config.ngram_min if ext.ngram_min is None else ext.ngram_min
    hi = config.ngram_max if ext.ngram_max is None else ext.ngram_max
    if ext.ngram_max is None:
        hi = max(hi, lo)
    if ext.ngram_min is None:
        lo = min(lo, hi)
    if hi < lo:
        raise BadRequest(f"ane_spec.ngram_max ({hi}) must be >= ane_spec.ngram_min ({lo})",
                         "ane_spec.ngram_max")
    options = GenerateOptions(
        max_tokens=max_tokens, stop=body.stops, sampling=sampling,
        speculative=config.speculative if ext.speculative is None else ext.speculative,
        guard=config.guard if ext.guard is None else ext.guard,
        grammar=None if constraint is None else constraint.grammar,
        logprobs=body.top_n, special_text=uses_tools, time_limit=config.request_timeout,
        grammar_token_seconds=config.grammar_token_ms / 1000, n_indent=body.n_indent or 0)
    refusal = needs_logits(options) if engine.pipeline.head_argmax else None
    if refusal is not None:
        if refusal.param == "grammar":  # the parameter that asked for it
            refusal = NeedsLogits(constraint.param)
        raise BadRequest(str(refusal), refusal.param)
    return Plan(WorkItem(prompt, options, lo, hi, kind, scope),
                tools=body.tools if uses_tools else None, tool_format=fmt,
                schema=None if constraint is None else constraint.schema)


def _chat_prompt(tok, given: TemplateInput, special_in_content: bool,  # noqa: ANN001
                 not_in_text: Iterable[int] = ()) -> list[int]:
    """The chat's prompt tokens. Only the template's markup may produce special tokens; with
    --special-in-content the whole prompt is parsed for them, as llama-server does."""
    from ane_spec.model.chat import render_chat, render_chat_pieces

    messages = given.messages
    kw = dict(template=tok.data.chat_template, tools=given.tools, extra=given.extra,
              eos_token=token_text(tok, tok.eos_token_id, "<|endoftext|>"),
              bos_token=token_text(tok, tok.bos_token_id, "<|endoftext|>"),
              add_bos=tok.data.add_bos_token)
    try:
        if special_in_content:
            return tok.encode(render_chat(messages, **kw), special=True, add_special=True)
        return tok.encode_pieces(render_chat_pieces(messages, **kw), add_special=True,
                                 not_in_text=not_in_text)
    except AneSpecError as exc:
        raise BadRequest(str(exc), "messages") from None


def _sampling(engine: Engine, body: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
    try:
        bias = body.logit_bias_pairs(engine.pipeline.config.vocab_size)
    except ValueError as exc:
        raise BadRequest(str(exc).removeprefix("logit_bias: "), "logit_bias") from None
    last_n = 64 if body.repeat_last_n is None else body.repeat_last_n
    # llama.cpp: seed -1 draws a random seed, as no seed does.
    seed = None if body.seed in (None, RANDOM_SEED) else body.seed & SEED_MAX
    # top_p 0: llama.cpp's top-p keeps min_keep = 1 token, the most likely after the
    # processors, which is what greedy decoding picks; decoding it greedily keeps it exact.
    greedy = body.top_p == 0
    return SamplingParams(
        temperature=0.0 if greedy else body.temperature or 0.0,
        top_p=1.0 if body.top_p is None or greedy else body.top_p,
        top_k=max(body.top_k or 0, 0), min_p=body.min_p or 0.0,
        repeat_penalty=1.0 if body.repeat_penalty is None else body.repeat_penalty,
        repeat_last_n=engine.context if last_n == -1 else last_n,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0, logit_bias=bias,
        ignore_eos=bool(body.ignore_eos), seed=seed)


def _constraint(engine: Engine, body: ChatCompletionRequest | CompletionRequest, kind: str,
                tool_format: ToolFormat | None,
                ready: MutableMapping[str, Grammar | GrammarError] | None = None
                ) -> Constraint | None:
    uses_tools = tool_format is not None
    fmt = body.response_format if kind == "chat" else None
    schema: dict[str, Any] | None = None
    if uses_tools:
        param, what = "tools", "the tools' parameters"
    elif fmt is not None and fmt.type != "text":
        param = what = "response_format"
        schema = fmt.enforced_schema
        schema = {"type": "object"} if schema is None else schema  # json_object: any object
    elif body.json_schema is not None:
        param = what = "json_schema"
        schema = body.json_schema
    elif body.grammar is not None:
        param = what = "grammar"
    else:
        return None
    compiler = engine.grammars

    def compile(kind: Any, source: Any, what: str) -> Grammar:  # noqa: A001
        if ready is None:
            return compiler.compile(kind, source, what)
        return compiler.lookup(kind, source, what, ready)

    try:
        if uses_tools:
            for i, t in enumerate(body.tools):
                if t.function.parameters is not None:
                    check_schema(t.function.parameters,
                                 f"tools[{i}].function.parameters", compiler.limits)
            grammar = compile("lark", tool_format.grammar(
                body.tools, body.tool_choice, body.parallel_tool_calls), what)
        elif schema is not None:
            grammar = compile("json_schema", schema, what)
        else:
            grammar = compile("gbnf", body.grammar, what)
        return Constraint(grammar, param, schema)
    except GrammarError as exc:
        raise BadRequest(str(exc), param) from None


def token_text(tok, token_id: int | None, fallback: str) -> str:  # noqa: ANN001
    return fallback if token_id is None else tok.token_text(token_id)
