"""The other protocols clients speak, on one real uvicorn server on loopback: llama-server's
native API (replays of Continue's llama.cpp provider and llama.vscode), the OpenAI routes under
the paths clients use, llama-server's leniency, Ollama's API (the `ollama` client) and OpenAI's
Responses API (the `openai` client).

Each adapter turns its request into one /v1 request, so its output is checked against the same
request on /v1 with speculation off: token-identical text.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from ane_spec.daemon.config import ServeConfig
from ane_spec.daemon.relay import Failure
from tests.live_server import started

PROMPT = "Once upon a time"
ASK = [{"role": "user", "content": "weather in Paris?"}]
PLAIN = {"ane_spec": {"speculative": False}}


@pytest.fixture(scope="module")
def server(tiny_build_512: Path):
    srv = started(ServeConfig(manifest=tiny_build_512, port=0, backend="mil", precision="fp32",
                              log_level="warning", access_log=False))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.url


def v1_text(url: str, prompt: str | list[int], n: int, **kw) -> str:
    """The reference: /v1/completions, speculation off."""
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": n, **PLAIN,
                                                   **kw}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def sse_data(response: httpx.Response) -> list[dict]:
    """What Continue's streamSse does: every `data:` line, parsed."""
    return [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]


def tokenize(url: str, text: str, add_special: bool = False) -> list[int]:
    return httpx.post(f"{url}/tokenize", json={"content": text,
                                               "add_special": add_special}).json()["tokens"]


# --- llama-server's native API ----------------------------------------------------------------

def test_continue_llama_cpp_provider_replay(url) -> None:
    """core/llm/llms/LlamaCpp.ts: POST new URL("completion", apiBase) with `prompt`,
    `stream: true` and _convertArgs' fields (undefined ones dropped by JSON.stringify), then
    yields `content` of every SSE chunk that has one."""
    body = {"prompt": PROMPT, "stream": True, "n_predict": 20, "frequency_penalty": 0,
            "presence_penalty": 0, "min_p": 0, "mirostat": 0, "stop": ["<|end|>", "\n\n\n"],
            "top_k": 40, "top_p": 0.95, "temperature": 0}
    with httpx.stream("POST", f"{url}/completion", json=body, headers={
            "Authorization": "Bearer undefined"}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_data(r)
    text = "".join(c["content"] for c in chunks if c.get("content"))
    *partials, last = chunks
    assert all(c["stop"] is False for c in partials) and last["stop"] is True
    assert last["content"] == "" and last["tokens_predicted"] <= 20
    assert last["stop_type"] in ("limit", "eos", "word")
    assert last["timings"]["predicted_n"] == last["tokens_predicted"]
    assert last["tokens_evaluated"] == len(tokenize(url, PROMPT, add_special=True))
    ref = v1_text(url, PROMPT, 20, stop=body["stop"], top_k=40, top_p=0.95)
    assert text == ref and text
    # a base URL set to the OpenAI one: new URL("completion", "http://host/v1/")
    with httpx.stream("POST", f"{url}/v1/completion", json=body, timeout=120) as r:
        assert "".join(c["content"] for c in sse_data(r) if c.get("content")) == text
    # the same request unstreamed: one JSON answer with the same content
    r = httpx.post(f"{url}/completion", json=body | {"stream": False}, timeout=120).json()
    assert r["content"] == text and r["stop"] is True and r["model"]


def test_completion_prompts_limits_and_stop_words(url) -> None:
    ids = tokenize(url, PROMPT, add_special=True)
    by_ids = httpx.post(f"{url}/completion", json={"prompt": ids, "n_predict": 8},
                        timeout=120).json()
    assert by_ids["content"] == v1_text(url, PROMPT, 8) and by_ids["tokens_evaluated"] == len(ids)
    # a mix of ids and text: the text is tokenized in place (no BOS: it does not come first)
    mixed = ids + [" there"]
    r = httpx.post(f"{url}/completion", json={"prompt": mixed, "n_predict": 8},
                   timeout=120).json()
    whole = ids + tokenize(url, " there")
    assert r["tokens_evaluated"] == len(whole) and r["content"] == v1_text(url, whole, 8)
    # a stop string the output reaches: cut before it, stop_type "word"
    free = v1_text(url, PROMPT, 16)
    word = free[6:9]
    assert word and word not in free[:6]
    r = httpx.post(f"{url}/completion", json={"prompt": PROMPT, "n_predict": 16,
                                              "stop": [word]}, timeout=120).json()
    assert r["content"] == free[:free.index(word)]
    assert (r["stop_type"], r["stopping_word"]) == ("word", word)
    # n_predict -1 (the default): the rest of the context; EOS banned so it fills it
    eog = httpx.get(f"{url}/props").json()["eos_token"]
    eos = tokenize(url, eog)
    long_prompt = ids * (490 // len(ids))
    r = httpx.post(f"{url}/completion", json={
        "prompt": long_prompt, "logit_bias": [[eos[0], False]]}, timeout=120).json()
    assert r["tokens_predicted"] == 512 - len(long_prompt) and r["stop_type"] == "limit"


def test_completion_grammar_and_json_schema(url) -> None:
    r = httpx.post(f"{url}/completion", json={
        "prompt": PROMPT, "grammar": 'root ::= "yes" | "no"', "n_predict": 8},
        timeout=120).json()
    assert r["content"] in ("yes", "no") and r["stop_type"] == "eos"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = httpx.post(f"{url}/completion", json={
        "prompt": PROMPT, "json_schema": schema, "n_predict": 60}, timeout=120).json()
    # no extra keys, at most 16 digits: the JSON always ends within 60 tokens
    assert r["stop_type"] == "eos" and list(json.loads(r["content"])) == ["n"]
    # the runaway: {"x": 1, "y": 1111111515151515181818...} for 140 digits; now the
    # same schema (no additionalProperties) always ends, greedy or sampled
    xy = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
          "required": ["x", "y"]}
    for seed in range(3):
        r = httpx.post(f"{url}/v1/chat/completions", json={
            "messages": ASK, "max_tokens": 60, "temperature": 1.0, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "xy",
                                                                       "schema": xy}}},
            timeout=120).json()
        assert r["choices"][0]["finish_reason"] == "stop", r
        value = json.loads(r["choices"][0]["message"]["content"])
        assert list(value) == ["x", "y"] and max(map(abs, value.values())) < 10**16


def test_completion_errors_in_llama_servers_shape(url) -> None:
    for body, words in [({"prompt": []}, "prompt"), ({"prompt": ["a", "b"]}, "one prompt"),
                        ({"prompt": "x", "n_predict": -5}, "n_predict"),
                        ({"prompt": "x", "mirostat": 2}, "mirostat"),
                        ({"prompt": [10**9]}, "outside the vocabulary"),
                        ({"prompt": "x", "grammar": "root ::= [", "n_predict": 2}, "grammar"),
                        ({"prompt": "x", "json_schema": {"type": "array", "uniqueItems": True}},
                         "uniqueItems")]:
        r = httpx.post(f"{url}/completion", json=body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["code"] == 400 and error["type"] == "invalid_request_error"
        assert words in error["message"], (body, error)


def test_llama_vscode_replay(url) -> None:
    """src/llama-server.ts: FIM goes to /infill (createRequestPayload), which a model without
    FIM tokens answers with llama-server's own 501; chat edits go to /v1/chat/completions
    (createChatEditRequestPayload) with llama.cpp's neutral sampler fields and max_tokens -1."""
    fim = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "input_extra": [
        {"text": "import os\n", "filename": "util.py"}], "prompt": "", "n_predict": 128,
        "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000}
    r = httpx.post(f"{url}/infill", json=fim)
    assert r.status_code == 501
    assert r.json() == {"error": {"code": 501, "type": "not_supported_error", "message": (
        "Infill is not supported by this model: prefix token is missing. suffix token is "
        "missing. middle token is missing. ")}}
    edit = {"messages": [{"role": "system", "content": "You are an expert coder."},
                         {"role": "user", "content": "rename x to y: x = 1"}],
            "stream": False, "cache_prompt": True, "samplers": "edkypmxt", "temperature": 0.8,
            "dynatemp_range": 0, "dynatemp_exponent": 1, "top_k": 40, "top_p": 0.95,
            "min_p": 0.05, "typical_p": 1, "xtc_probability": 0, "xtc_threshold": 0.1,
            "repeat_last_n": 64, "repeat_penalty": 1, "presence_penalty": 0,
            "frequency_penalty": 0, "dry_multiplier": 0, "dry_base": 1.75,
            "dry_allowed_length": 2, "dry_penalty_last_n": -1, "max_tokens": -1,
            "timings_per_token": False, "seed": 3, "logit_bias": [[0, False]]}
    r = httpx.post(f"{url}/v1/chat/completions", json=edit, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and choice["message"]["content"]


def test_infill_prompt_for_a_vocabulary_with_fim_tokens() -> None:
    """What /infill sends to the model when the vocabulary has FIM tokens, as llama-server's
    format_prompt_infill builds it (Phi-4-mini has none: the server test above gets the 501)."""
    from ane_spec.daemon.llama_server_api import SNIPPET, fim_tokens, infill_prompt
    from ane_spec.daemon.relay import Failure
    from ane_spec.model.tokenizer import TOKEN_CONTROL, Tokenizer
    from ane_spec.model.vocab import build_synthetic_vocab

    data = build_synthetic_vocab(1024)
    assert fim_tokens(Tokenizer(data)) is None
    tokens, types = list(data.tokens), list(data.token_types)
    for i, name in zip((960, 961, 962), ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")):
        tokens[i], types[i] = name, TOKEN_CONTROL
    tok = Tokenizer(data.model_copy(update={"tokens": tokens, "token_types": types}))
    assert fim_tokens(tok) == (960, 961, 962)
    ids = infill_prompt(tok, (960, 961, 962), {
        "input_prefix": "def f(", "input_suffix": "\n", "prompt": "a",
        "input_extra": [{"filename": "x.py", "text": "import os"}]})
    assert ids == (tok.encode(SNIPPET) + tok.encode("import os") + [960] + tok.encode("def f(")
                   + tok.encode("a") + [961] + tok.encode("\n") + [962])
    with pytest.raises(Failure):
        infill_prompt(tok, (960, 961, 962), {"input_prefix": 5})


def fim_vocab(*extra: str):  # noqa: ANN201 - a Tokenizer
    """The synthetic vocabulary with Qwen's FIM tokens (and `extra` ones) at 960..."""
    from ane_spec.model.tokenizer import TOKEN_CONTROL, Tokenizer
    from ane_spec.model.vocab import build_synthetic_vocab

    data = build_synthetic_vocab(1024)
    tokens, types = list(data.tokens), list(data.token_types)
    names = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", *extra)
    for i, name in enumerate(names, 960):
        tokens[i], types[i] = name, TOKEN_CONTROL
    return Tokenizer(data.model_copy(update={"tokens": tokens, "token_types": types}))


def test_infill_is_repo_level_where_the_vocabulary_can_say_so() -> None:
    """llama-server's format_prompt_infill with `<|repo_name|>` and `<|file_sep|>` (Qwen2.5-
    Coder's): the chunks become files of a repository, not `--- snippet ---` text."""
    from ane_spec.daemon.llama_server_api import infill_prompt

    tok = fim_vocab("<|repo_name|>", "<|file_sep|>")
    rep, sep = 963, 964
    ids = infill_prompt(tok, (960, 961, 962), {
        "input_prefix": "def f(", "input_suffix": "\n", "prompt": "a",
        "input_extra": [{"filename": "x.py", "text": "import os"}, {"text": "y = 1"}]})
    assert ids == ([rep] + tok.encode("myproject\n") + [sep] + tok.encode("x.py\n")
                   + tok.encode("import os") + [sep] + tok.encode("tmp\n") + tok.encode("y = 1")
                   + [sep] + tok.encode("filename\n") + [960] + tok.encode("def f(")
                   + tok.encode("a") + [961] + tok.encode("\n") + [962])


def test_infill_parts_are_cut_to_their_budgets_before_expansion() -> None:
    """340,000 empty input_extra items in a 1 MiB body became a 3.7M-token prompt (+1 GB, 7.8 s
    of CPU before the 400). The chunks are read from the last back only as far as their token
    budget reaches (llama-server's: the last context - n_batch - 2 n_predict tokens), the
    prefix keeps its last 3/4 n_batch tokens and the suffix its first n_batch/4 - 2 - prompt."""
    from ane_spec.daemon.llama_server_api import SNIPPET, infill_prompt

    for tok in (fim_vocab(), fim_vocab("<|repo_name|>", "<|file_sep|>")):
        raw = {"input_prefix": "p " * 2000, "input_suffix": "s " * 2000, "prompt": "",
               "input_extra": [{}] * 340_000}
        t0 = time.perf_counter()
        ids = infill_prompt(tok, (960, 961, 962), raw, context=512, n_predict=16)
        assert time.perf_counter() - t0 < 2
        # n_batch 256: extras 512 - 256 - 32 = 224, prefix 192, suffix 64 - 2.
        assert len(ids) == 224 + 1 + 192 + 1 + 62 + 1
        assert ids[224] == 960 and ids[-64] == 961 and ids[-1] == 962
        assert ids[225:417] == tok.encode("p " * 2000)[-192:]
        if tok.id_of("<|file_sep|>") is None:
            snippet = tok.encode(SNIPPET)
            assert ids[:224] == (snippet * 224)[-224:]
        else:
            assert ids[224 - len(tok.encode("filename\n")) - 1] == tok.id_of("<|file_sep|>")
    # Bad chunks are refused before any of them is tokenized.
    with pytest.raises(Failure, match="input_extra"):
        infill_prompt(tok, (960, 961, 962), {"input_extra": [{}] * 1000 + [{"text": 5}]})
    with pytest.raises(Failure, match="input_extra"):
        infill_prompt(tok, (960, 961, 962), {"input_extra": [{"filename": ["x"]}]})


def test_apply_template(url) -> None:
    r = httpx.post(f"{url}/apply-template", json={"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]})
    assert r.json() == {"prompt": "<|system|>Be brief.<|end|><|user|>hi<|end|><|assistant|>"}
    assert httpx.post(f"{url}/apply-template", json={"messages": []}).status_code == 400


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("path, body", [
    ("/completion", {"prompt": PROMPT, "stream": True}),
    ("/api/chat", {"messages": ASK, "options": {}}),
    ("/api/generate", {"prompt": PROMPT, "raw": True}),
    ("/v1/responses", {"input": "weather in Paris?", "stream": True}),
])
def test_a_dropped_stream_cancels_its_generation(url, path, body) -> None:
    """Every adapter's stream, dropped after its first line, cancels the generation (which would
    otherwise run to the end of the context: EOS is banned)."""
    import time

    eos = tokenize(url, httpx.get(f"{url}/props").json()["eos_token"])[0]
    bias = {"logit_bias": {str(eos): -100}}
    body = body | ({"options": {"logit_bias": {str(eos): -100}}} if path.startswith("/api")
                   else bias)
    cancelled = 'ane_spec_generations_total{finish_reason="cancelled"}'
    before = metric(url, cancelled)
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if "content" in line or "delta" in line
             or "response" in line)
    deadline = time.monotonic() + 30
    while metric(url, cancelled) != before + 1 or httpx.get(f"{url}/health").json()["busy"]:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.02)


# Every refusal here is the client's fault, and every route answers it with 400 (llama-server,
# OpenAI and Ollama alike): exact, so a removed route (404) or method (405) fails.
@pytest.mark.parametrize("path, body, status", [
    ("/completion", b"{", 400), ("/completion", [1], 400),
    ("/completion", {"prompt": {"a": 1}}, 400), ("/completion", {"prompt": [1.5]}, 400),
    ("/completion", {"prompt": "x", "stream": "yes"}, 400),
    ("/apply-template", {"messages": "x"}, 400), ("/apply-template", b"\xff", 400),
    ("/api/chat", b"[1", 400),
    ("/api/chat", {"messages": [{"role": "critic", "content": "x"}]}, 400),
    ("/api/chat", {"messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]}]}, 400),
    ("/api/chat", {"messages": ASK, "format": 5}, 400),
    ("/api/chat", {"messages": ASK, "options": 3}, 400),
    ("/api/chat", {"messages": ASK, "think": True}, 400), ("/api/show", b"}", 400),
    ("/api/generate", {"prompt": 5}, 400), ("/api/generate", {"prompt": "x", "context": [1]}, 400),
    ("/v1/responses", b"nul", 400), ("/v1/responses", {"input": 5}, 400),
    ("/v1/responses", {"input": [{"type": "function_call", "arguments": 5}]}, 400),
    ("/v1/responses", {"input": [{"role": "user", "content": [7]}]}, 400),
    ("/v1/responses", {"input": "x", "text": {"format": "json"}}, 400),
    ("/v1/responses", {"input": "x", "tool_choice": {"type": "web_search"}}, 400),
    ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400),
    ("/chat/completions", {"messages": "x"}, 400),
])
def test_adapters_refuse_bad_bodies_with_a_4xx(url, path, body, status) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, (path, body, r.status_code, r.text)
    error = r.json()["error"]
    assert error if isinstance(error, str) else error["message"]


# --- paths and leniency -----------------------------------------------------------------------

def test_paths_without_v1_and_with_a_trailing_slash(url) -> None:
    chat = {"messages": ASK, "max_tokens": 4, **PLAIN}
    ref = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json()
    for path in ("/chat/completions", "/chat/completions/", "/v1/chat/completions/"):
        r = httpx.post(f"{url}{path}", json=chat, timeout=60)
        assert r.status_code == 200, (path, r.status_code)
        assert r.json()["choices"] == ref["choices"]
    for path in ("/completions", "/completions/", "/v1/completions/", "/completion/"):
        r = httpx.post(f"{url}{path}", json={"prompt": PROMPT, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, path
    for path in ("/models", "/models/", "/v1/models/", "/v1/health", "/v1/health/",
                 "/health/"):
        assert httpx.get(f"{url}{path}").status_code == 200, path
    model = httpx.get(f"{url}/models").json()["data"][0]["id"]
    assert httpx.get(f"{url}/models/{model}").json()["id"] == model


def test_llama_server_leniency(url) -> None:
    chat = f"{url}/v1/chat/completions"
    greedy = httpx.post(chat, json={"messages": ASK, "max_tokens": 12, **PLAIN},
                        timeout=60).json()["choices"][0]["message"]["content"]
    # top_p 0: llama.cpp keeps one token, the most likely: greedy, whatever the temperature
    r = httpx.post(chat, json={"messages": ASK, "max_tokens": 12, "top_p": 0,
                               "temperature": 1.5, "seed": 9}, timeout=60).json()
    assert r["choices"][0]["message"]["content"] == greedy
    # any number of stop strings: one of 3000 is the text's first word
    word = greedy[2:5]
    stops = [f"never{i}" for i in range(3000)] + [word]
    r = httpx.post(chat, json={"messages": ASK, "max_tokens": 12, "stop": stops}, timeout=60)
    assert r.json()["choices"][0]["message"]["content"] == greedy[:greedy.index(word)]
    assert r.json()["ane_spec"]["stop_word"] == word
    # max_tokens -1 / max_completion_tokens -1: the rest of the context
    n = httpx.post(chat, json={"messages": ASK, "max_tokens": -1, "top_p": 0, "stop": [
        greedy[-3:]]}, timeout=120).json()["usage"]["completion_tokens"]
    assert n >= 1
    r = httpx.post(chat, json={"messages": ASK, "max_tokens": 0})
    assert r.status_code == 400 and "-1 for the rest of the context" in r.text
    # mirostat 0 is accepted; 1 and 2 are refused by name
    for off in (0, None):
        assert httpx.post(chat, json={"messages": ASK, "max_tokens": 1, "mirostat": off,
                                      "mirostat_tau": 5, "mirostat_eta": 0.1}).status_code == 200
    for mode in (1, 2):
        r = httpx.post(chat, json={"messages": ASK, "max_tokens": 1, "mirostat": mode})
        assert r.status_code == 400 and r.json()["error"]["param"] == "mirostat"
        assert "mirostat 1 and 2 are not implemented" in r.json()["error"]["message"]


# --- Ollama ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ollama_client(url):
    ollama = pytest.importorskip("ollama", reason="the ollama client is not installed")
    return ollama.Client(host=url)


def v1_chat(url: str, **kw) -> dict:
    """The reference: /v1/chat/completions, speculation off."""
    r = httpx.post(f"{url}/v1/chat/completions", json={**kw, **PLAIN}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_ollama_models_and_version(ollama_client, url) -> None:
    (model,) = ollama_client.list().models
    assert model.model.endswith(":latest") and model.details.family == "phi3"
    shown = ollama_client.show(model.model)
    assert "tools" in shown.capabilities and shown.template
    assert httpx.get(f"{url}/api/version").json()["version"]
    (loaded,) = ollama_client.ps().models
    assert loaded.model == model.model and loaded.context_length == 512
    import ollama

    with pytest.raises(ollama.ResponseError) as info:
        ollama_client.show("llama3:8b")
    assert info.value.status_code == 404 and "not found" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        ollama_client.embed(model=model.model, input="x")
    assert info.value.status_code == 501 and "embeddings are not supported" in info.value.error


def test_ollama_chat_streamed_and_not(ollama_client, url) -> None:
    options = {"num_predict": 16, "temperature": 0, "top_k": 40, "repeat_penalty": 1.1,
               "num_ctx": 4096, "mirostat": 0}
    r = ollama_client.chat(model="phi4-mini", messages=ASK, options=options, keep_alive="5m")
    ref = v1_chat(url, messages=ASK, max_tokens=16, top_k=40, repeat_penalty=1.1)
    assert r.message.content == ref["choices"][0]["message"]["content"] and r.done
    assert r.done_reason == ("length" if ref["choices"][0]["finish_reason"] == "length"
                             else "stop")
    assert r.eval_count == ref["usage"]["completion_tokens"]
    assert r.prompt_eval_count == ref["usage"]["prompt_tokens"] and r.total_duration > 0
    parts = list(ollama_client.chat(model="phi4-mini", messages=ASK, options=options,
                                    stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == r.eval_count
    import ollama

    with pytest.raises(ollama.ResponseError) as info:
        ollama_client.chat(model="m", messages=ASK, options={"mirostat": 2})
    assert info.value.status_code == 400 and "mirostat" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        ollama_client.chat(model="m", messages=[{"role": "user", "content": "x",
                                                 "images": ["aGVsbG8="]}])
    assert "image inputs are not supported" in info.value.error


def test_ollama_format_and_tools(ollama_client, url) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "days": {"type": "integer"}},
              "required": ["city", "days"]}
    r = ollama_client.chat(model="m", messages=ASK, format=schema,
                           options={"num_predict": 80})  # bounded: always ends in time
    value = json.loads(r.message.content)
    assert r.done_reason == "stop" and set(value) == {"city", "days"}
    assert abs(value["days"]) < 10**16
    r = ollama_client.chat(model="m", messages=ASK, format="json", options={"num_predict": 40})
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.message.content), dict)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "weather",
            "parameters": {"type": "object", "properties": {"city": {
                "type": "string", "enum": ["paris", "rome"]}}, "required": ["city"]}}}
    # (the ollama client keeps only type, description, enum and items of a property)
    # the tiny model never starts a call by itself: a bias on <|tool_call|> makes it
    call_tag = tokenize(url, "<|tool_call|>")
    assert len(call_tag) == 1
    bias = {str(call_tag[0]): 100}
    ref = v1_chat(url, messages=ASK, tools=[tool], tool_choice="auto", max_tokens=60,
                  logit_bias=bias)
    options = {"num_predict": 60, "logit_bias": bias}
    r = ollama_client.chat(model="m", messages=ASK, tools=[tool], options=options)
    calls = ref["choices"][0]["message"].get("tool_calls") or []
    assert calls and r.message.tool_calls
    assert [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls or []] \
        == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    streamed = list(ollama_client.chat(model="m", messages=ASK, tools=[tool], stream=True,
                                       options=options))
    streamed_calls = [c for p in streamed for c in p.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed_calls] == \
        [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls or []]
    # the call's result goes back as a tool message
    history = ASK + [r.message, {"role": "tool", "content": '{"temp_c": 21}',
                                 "tool_name": "get_weather"}]
    final = ollama_client.chat(model="m", messages=history, tools=[tool],
                               options={"num_predict": 8})
    assert final.done and final.prompt_eval_count > r.prompt_eval_count


def test_ollama_generate(ollama_client, url) -> None:
    r = ollama_client.generate(model="m", prompt="hi", system="Be brief.",
                               options={"num_predict": 10})
    ref = v1_chat(url, messages=[{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "hi"}], max_tokens=10)
    assert r.response == ref["choices"][0]["message"]["content"] and r.done
    raw = ollama_client.generate(model="m", prompt=PROMPT, raw=True, options={"num_predict": 8})
    assert raw.response == v1_text(url, PROMPT, 8)
    parts = list(ollama_client.generate(model="m", prompt=PROMPT, raw=True, stream=True,
                                        options={"num_predict": 8}))
    assert "".join(p.response for p in parts) == raw.response and parts[-1].done
    assert ollama_client.generate(model="m", prompt="").done_reason == "load"
    import ollama

    with pytest.raises(ollama.ResponseError) as info:  # no FIM tokens (test_fim_* has them)
        ollama_client.generate(model="m", prompt="x", suffix="y")
    assert info.value.status_code == 400 and "does not support insert" in info.value.error


def test_ollama_is_running_and_its_metadata_comes_from_the_manifest(ollama_client, url,
                                                                    tiny_gguf) -> None:
    """`GET /` and `HEAD /` answer as Ollama does (its Go client probes them); /api/tags,
    /api/show and /api/ps give the GGUF's family, parameter count and file type, and the
    build's context window; /api/show without a model is Ollama's 400."""
    from ane_spec.model.gguf_file import open_gguf

    r = httpx.get(f"{url}/")
    assert (r.status_code, r.text) == (200, "Ollama is running")
    assert r.headers["content-type"].startswith("text/plain")
    r = httpx.head(f"{url}/")
    assert r.status_code == 200 and r.content == b""
    with open_gguf(tiny_gguf) as m:
        want = {"family": m.config.arch, "families": [m.config.arch],
                "quantization_level": m.file_type_name}
        count = m.parameter_count
    assert want["quantization_level"] == "Q8_0"
    (model,) = ollama_client.list().models
    details = model.details.model_dump()
    assert {k: details[k] for k in want} == want
    assert details["parameter_size"] == f"{count / 1e6:.2f}M" and details["parameter_size"]
    shown = httpx.post(f"{url}/api/show", json={"model": model.model}).json()
    assert shown["details"] == httpx.get(f"{url}/api/tags").json()["models"][0]["details"]
    info = shown["model_info"]
    assert info["general.architecture"] == "phi3" and info["phi3.context_length"] == 512
    assert info["general.parameter_count"] == count
    assert shown["capabilities"] == ["completion", "tools"]  # no FIM tokens: no "insert"
    (loaded,) = ollama_client.ps().models
    assert loaded.details.parameter_size == details["parameter_size"]
    for body in ({}, {"model": ""}, {"name": None}):
        r = httpx.post(f"{url}/api/show", json=body)
        assert (r.status_code, r.json()) == (400, {"error": "model is required"}), body
    r = httpx.post(f"{url}/api/embed", json={"model": "m", "input": "x"})
    assert r.status_code == 501 and "Phi-4-mini" not in r.json()["error"]


def test_ollama_errors_are_in_ollamas_shape(url) -> None:
    """Every refusal under /api/, the middlewares' and the router's included, is Ollama's
    `{"error": "message"}` (what the ollama client, litellm and LangChain read); /v1 keeps
    OpenAI's."""
    def ollama_error(r: httpx.Response, status: int) -> str:
        assert r.status_code == status, (r.status_code, r.text)
        body = r.json()
        assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
        return body["error"]

    ollama_error(httpx.post(f"{url}/api/nowhere", json={}), 404)
    ollama_error(httpx.get(f"{url}/api/chat"), 405)
    ollama_error(httpx.post(f"{url}/api/chat", content=b"{}", headers={
        "content-type": "text/plain"}), 415)
    ollama_error(httpx.post(f"{url}/api/chat", content=b"x" * (2 << 20), headers={
        "content-type": "application/json"}), 413)
    ollama_error(httpx.post(f"{url}/api/chat", json={"messages": ASK}, headers={
        "Host": "evil.example"}), 403)
    ollama_error(httpx.post(f"{url}/api/generate", json={"prompt": "x"}, headers={
        "Origin": "http://evil.example"}), 403)
    ollama_error(httpx.post(f"{url}/api/chat", json={"messages": ASK, "options": 3}), 400)
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{}", headers={
        "content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["message"]


def test_ollama_options_are_typed_as_ollamas_go_struct(url) -> None:
    """api/types.go, Options.FromMap: JSON numbers are float64 in Go, so an integer option
    takes any number and truncates it, a float option any number; a string or a bool where a
    number belongs, or a stop list of anything but strings, is refused, naming the option.
    An option Ollama does not know is ignored, as Ollama ignores it."""
    def generate(options: dict) -> httpx.Response:
        return httpx.post(f"{url}/api/generate", json={
            "model": "m", "prompt": PROMPT, "raw": True, "stream": False, "options": options},
            timeout=120)

    ref = v1_text(url, PROMPT, 5)
    for options in ({"num_predict": 5}, {"num_predict": 5.0}, {"num_predict": 5.9},
                    {"num_predict": 5, "top_k": 40.7, "temperature": 0, "seed": 3.0},
                    {"num_predict": 5, "numa": "yes", "use_mmap": True, "stop": None}):
        r = generate(options)
        assert r.status_code == 200 and r.json()["response"] == ref, (options, r.text)
        assert r.json()["eval_count"] <= 5
    for options, name, kind in (({"num_predict": "5"}, "num_predict", "integer"),
                                ({"num_predict": True}, "num_predict", "integer"),
                                ({"top_k": "40"}, "top_k", "integer"),
                                ({"seed": [1]}, "seed", "integer"),
                                ({"temperature": "0.5"}, "temperature", "float32"),
                                ({"temperature": True}, "temperature", "float32"),
                                ({"use_mmap": 1}, "use_mmap", "boolean"),
                                ({"stop": "x"}, "stop", "array"),
                                ({"stop": ["x", 1]}, "stop", "an array of strings")):
        r = generate({"num_predict": 2} | options)
        assert r.status_code == 400, (options, r.text)
        of = kind if kind.startswith("an ") else f"type {kind}"
        assert r.json() == {"error": f'option "{name}" must be of {of}'}


def test_ollama_format_errors_name_format(url) -> None:
    """A schema /v1 refuses is refused under Ollama's name for it, `format`."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "not": {}}
    for path, body in (("/api/chat", {"messages": ASK}), ("/api/generate", {"prompt": "x"}),
                       ("/api/generate", {"prompt": "x", "raw": True})):
        r = httpx.post(f"{url}{path}", json=body | {"model": "m", "format": schema,
                                                    "stream": False})
        assert r.status_code == 400, (path, body, r.text)
        message = r.json()["error"]
        assert message.startswith("format cannot be compiled") and "not" in message, message
    r = httpx.post(f"{url}/api/chat", json={"model": "m", "messages": ASK, "stream": False,
                                            "options": {"temperature": 3}})
    assert r.status_code == 400 and r.json()["error"].startswith("options.temperature: ")


# --- fill-in-the-middle: a vocabulary with FIM tokens ------------------------------------------

@pytest.fixture(scope="module")
def fim_server(tmp_path_factory: pytest.TempPathFactory):
    """A 2-layer synthetic Qwen 2.5 build: its vocabulary has Qwen's <|fim_prefix|>,
    <|fim_suffix|> and <|fim_middle|> (as Qwen2.5-Coder's does). Yields (server, GGUF path)."""
    from ane_spec.model.synthetic import write_synthetic_gguf
    from ane_spec.shards.build import BuildRequest, build
    from tests.test_architectures import spec

    root = tmp_path_factory.mktemp("fim")
    gguf = write_synthetic_gguf(root / "qwen2.gguf", spec("qwen2", seed=11, num_layers=2))
    build(gguf, root / "art", BuildRequest(topology="2", max_seq=256))
    srv = started(ServeConfig(manifest=root / "art", port=0, backend="mil", precision="fp32",
                              log_level="warning", access_log=False))
    yield srv, gguf
    srv.stop()


def test_fim_suffix_on_ollama_generate_v1_completions_and_infill(fim_server) -> None:
    """`suffix` on Ollama's /api/generate (Continue's Ollama autocomplete) and OpenAI's
    /v1/completions makes the prefix-suffix-middle prompt /infill makes (one builder,
    daemon/fim.py): <|fim_prefix|> prefix <|fim_suffix|> suffix <|fim_middle|>, as Ollama's
    Qwen 2.5 Coder template renders it. Token-identical output on all three."""
    from ane_spec.model.gguf_file import open_gguf
    from ane_spec.model.tokenizer import Tokenizer

    srv, gguf = fim_server
    url = srv.url
    with open_gguf(gguf) as m:
        tok = Tokenizer(m.tokenizer_data)
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    ids = ([tok.id_of("<|fim_prefix|>")] + tok.encode(prefix) + [tok.id_of("<|fim_suffix|>")]
           + tok.encode(suffix) + [tok.id_of("<|fim_middle|>")])
    ref = v1_text(url, ids, 8)
    assert ref
    r = httpx.post(f"{url}/api/generate", json={"model": "m", "prompt": prefix,
                                                "suffix": suffix, "stream": False,
                                                "options": {"num_predict": 8}}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["response"] == ref and r.json()["prompt_eval_count"] == len(ids)
    with httpx.stream("POST", f"{url}/api/generate", json={
            "model": "m", "prompt": prefix, "suffix": suffix, "raw": True,
            "options": {"num_predict": 8}}, timeout=120) as s:
        lines = [json.loads(line) for line in s.iter_lines() if line]
    assert "".join(x["response"] for x in lines) == ref and lines[-1]["done"]
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prefix, "suffix": suffix,
                                                  "max_tokens": 8, **PLAIN}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    # /infill is llama-server's repo-level prompt: with the vocabulary's repo and file-separator
    # tokens it opens with `<|repo_name|>myproject\n<|file_sep|>filename\n` (format_prompt_infill).
    repo = ([tok.id_of("<|repo_name|>")] + tok.encode("myproject\n")
            + [tok.id_of("<|file_sep|>")] + tok.encode("filename\n"))
    r = httpx.post(f"{url}/infill", json={"input_prefix": prefix, "input_suffix": suffix,
                                          "n_predict": 8}, timeout=120)
    assert r.json()["content"] == v1_text(url, repo + ids, 8)
    # the model's listings say what it is, and that it can insert
    with open_gguf(gguf) as m:
        count, file_type = m.parameter_count, m.file_type_name
    name = httpx.get(f"{url}/api/tags").json()["models"][0]["name"]
    shown = httpx.post(f"{url}/api/show", json={"model": name}).json()
    assert shown["details"]["family"] == "qwen2" and shown["details"]["families"] == ["qwen2"]
    assert shown["details"]["quantization_level"] == file_type == "Q8_0"
    assert shown["details"]["parameter_size"] == f"{count / 1e3:.0f}K"  # HumanNumber
    assert shown["model_info"]["qwen2.context_length"] == 256
    assert "insert" in shown["capabilities"] and "tools" in shown["capabilities"]
    r = httpx.post(f"{url}/api/embed", json={"model": "m", "input": "x"})
    assert r.status_code == 501 and "qwen2" in r.json()["error"]


# --- Ollama client libraries -------------------------------------------------------------------

def test_litellm_ollama_chat_provider_replay(url) -> None:
    """litellm's `ollama_chat/` provider (litellm 1.110, llms/ollama/chat/transformation.py and
    llms/custom_httpx/llm_http_handler.py): it POSTs `{"model", "messages", "options",
    "stream"}` to api/chat as `content=json.dumps(data)`, with no Content-Type header (its
    headers are `User-Agent: litellm/<version>`, plus `Authorization` only with an api key),
    and reads `message.content`, `prompt_eval_count`, `eval_count` (NDJSON lines when
    streaming). litellm itself is not installed here (44 MB, and it pulls boto3)."""
    headers = {"User-Agent": "litellm/1.110.2"}
    data = {"model": "qwen2.5-coder", "messages": ASK, "options": {"num_predict": 12,
            "temperature": 0}, "stream": False}
    r = httpx.post(f"{url}/api/chat", content=json.dumps(data), headers=headers, timeout=120)
    assert "content-type" not in r.request.headers
    assert r.status_code == 200, r.text
    ref = v1_chat(url, messages=ASK, max_tokens=12)
    assert r.json()["message"]["content"] == ref["choices"][0]["message"]["content"]
    assert r.json()["eval_count"] == ref["usage"]["completion_tokens"]
    with httpx.stream("POST", f"{url}/api/chat", content=json.dumps(data | {"stream": True}),
                      headers=headers, timeout=120) as s:
        assert s.status_code == 200
        lines = [json.loads(line) for line in s.iter_lines() if line]
    assert "".join(x["message"]["content"] for x in lines) == r.json()["message"]["content"]
    assert lines[-1]["done"] and lines[-1]["eval_count"] == r.json()["eval_count"]


def test_litellm_ollama_generate_provider_replay(url) -> None:
    """litellm's `ollama/` provider (llms/ollama/completion/transformation.py): the messages
    rendered by its ollama_pt ("### User:\n...\n\n"), POSTed to api/generate as `{"model",
    "prompt", "options", "stream", "images": []}` the same way, with no Content-Type."""
    data = {"model": "qwen2.5-coder", "prompt": "### User:\nweather in Paris?\n\n",
            "options": {"num_predict": 12, "temperature": 0}, "stream": False, "images": []}
    r = httpx.post(f"{url}/api/generate", content=json.dumps(data),
                   headers={"User-Agent": "litellm/1.110.2"}, timeout=120)
    assert r.status_code == 200, r.text
    ref = v1_chat(url, messages=[{"role": "user", "content": data["prompt"]}], max_tokens=12)
    assert r.json()["response"] == ref["choices"][0]["message"]["content"]


def test_langchain_ollama_chat(url) -> None:
    """langchain-ollama's ChatOllama (through the ollama client): invoke, stream, and
    with_structured_output by JSON schema (Ollama's `format`)."""
    chat_ollama = pytest.importorskip("langchain_ollama", reason="langchain-ollama missing")
    llm = chat_ollama.ChatOllama(model="m", base_url=url, num_predict=12, temperature=0)
    reply = llm.invoke("weather in Paris?")
    ref = v1_chat(url, messages=ASK, max_tokens=12)
    assert reply.content == ref["choices"][0]["message"]["content"]
    assert reply.usage_metadata["output_tokens"] == ref["usage"]["completion_tokens"]
    assert "".join(c.content for c in llm.stream("weather in Paris?")) == reply.content
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=8)
        days: int = Field(ge=0, le=9)

    structured = chat_ollama.ChatOllama(model="m", base_url=url, num_predict=60,
                                        temperature=0).with_structured_output(
        City, method="json_schema")
    assert isinstance(structured.invoke("a city"), City)


def test_llama_index_ollama_llm(url) -> None:
    """llama-index's Ollama LLM (llama-index-llms-ollama, through the ollama client): chat,
    complete and stream_complete, with its options in additional_kwargs."""
    llms = pytest.importorskip("llama_index.llms.ollama", reason="llama-index-llms-ollama missing")
    from llama_index.core.llms import ChatMessage

    llm = llms.Ollama(model="m", base_url=url, request_timeout=120, temperature=0,
                      context_window=512, additional_kwargs={"num_predict": 12})
    reply = llm.chat([ChatMessage(role="user", content="weather in Paris?")])
    ref = v1_chat(url, messages=ASK, max_tokens=12)
    assert reply.message.content == ref["choices"][0]["message"]["content"]
    done = llm.complete("weather in Paris?")
    assert done.text == reply.message.content
    assert "".join(c.delta for c in llm.stream_complete("weather in Paris?")) == done.text


# --- OpenAI's Responses API --------------------------------------------------------------------

@pytest.fixture(scope="module")
def openai_client(url):
    openai = pytest.importorskip("openai", reason="the openai client is not installed")
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_responses_text_and_stream(openai_client, url) -> None:
    kw = dict(model="m", instructions="Be brief.", input="weather in Paris?",
              max_output_tokens=12)
    r = openai_client.responses.create(**kw)
    ref = v1_chat(url, messages=[{"role": "system", "content": "Be brief."}, *ASK],
                  max_tokens=12)
    assert r.output_text == ref["choices"][0]["message"]["content"]
    assert r.usage.output_tokens == ref["usage"]["completion_tokens"]
    finished = ref["choices"][0]["finish_reason"] != "length"
    assert r.status == ("completed" if finished else "incomplete")
    if not finished:
        assert r.incomplete_details.reason == "max_output_tokens"
    # streamed: typed events whose deltas add up to the same text
    events = list(openai_client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{r.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        == r.output_text
    # the SDK's stream helper (it needs response.completed: ask for a short answer that ends)
    with openai_client.responses.stream(model="m", input=[
            {"role": "user", "content": [{"type": "input_text", "text": "weather in Paris?"}]}],
            max_output_tokens=400) as s:
        texts = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert final.output_text == "".join(texts) and final.status == "completed"


def test_responses_function_tools(openai_client, url) -> None:
    tool = {"type": "function", "name": "get_weather", "description": "weather",
            "parameters": {"type": "object", "properties": {"city": {
                "type": "string", "pattern": "^[a-z]{1,8}$"}}, "required": ["city"],
                "additionalProperties": False}, "strict": True}
    r = openai_client.responses.create(model="m", input="weather in Paris?", tools=[tool],
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       max_output_tokens=60)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    args = json.loads(call.arguments)
    assert set(args) == {"city"} and args["city"].isalpha()
    ref = v1_chat(url, messages=ASK, tools=[{"type": "function", "function": {
        k: tool[k] for k in ("name", "description", "parameters", "strict")}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60)
    assert ref["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == \
        call.arguments
    with openai_client.responses.stream(model="m", input="weather in Paris?", tools=[tool],
                                        tool_choice="required", parallel_tool_calls=False,
                                        max_output_tokens=60) as s:
        deltas = [e.delta for e in s if e.type == "response.function_call_arguments.delta"]
        final = s.get_final_response()
    (streamed,) = [o for o in final.output if o.type == "function_call"]
    assert "".join(deltas) == streamed.arguments and json.loads(streamed.arguments)
    # the result goes back as a function_call_output item; the model answers in text
    answer = openai_client.responses.create(model="m", tools=[tool], tool_choice="none",
                                            max_output_tokens=8, input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}])
    assert not [o for o in answer.output if o.type == "function_call"]
    ref = v1_chat(url, tools=[{"type": "function", "function": {
        k: tool[k] for k in ("name", "description", "parameters")}}], tool_choice="none",
        max_tokens=8, messages=ASK + [
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call.call_id, "type": "function", "function": {
                    "name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp_c": 21}'}])
    assert answer.usage.input_tokens == ref["usage"]["prompt_tokens"]
    assert answer.output_text == (ref["choices"][0]["message"]["content"] or "")


def test_responses_json_schema_and_refusals(openai_client) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    # bounded strings and integers: the JSON always ends within 80 tokens
    r = openai_client.responses.create(model="m", input="a person", max_output_tokens=80,
                                       text={"format": {"type": "json_schema",
                                                        "name": "person", "schema": schema,
                                                        "strict": True}})
    assert r.status == "completed"
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"} and abs(person["age"]) < 10**16
    # the SDK's parse() with a pydantic model: the same request, parsed
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=8)
        age: int

    parsed = openai_client.responses.parse(model="m", input="a person", text_format=Person,
                                           max_output_tokens=80)
    assert isinstance(parsed.output_parsed, Person)
    assert parsed.output_parsed == Person.model_validate_json(parsed.output_text)
    import openai

    for kw, param in [({"previous_response_id": "resp_1"}, "previous_response_id"),
                      ({"tools": [{"type": "web_search"}]}, "tools"),
                      ({"input": [{"role": "user", "content": [
                          {"type": "input_image", "image_url": "http://x/y.png"}]}]},
                       "input[0]")]:
        with pytest.raises(openai.BadRequestError) as info:
            openai_client.responses.create(**{"model": "m", "input": "x", **kw})
        assert info.value.body["param"] == param, info.value.body


def test_responses_cut_calls_cached_tokens_extension_and_unknown_call_ids(url) -> None:
    """A function call cut by max_output_tokens is `incomplete` inside the incomplete response
    (streamed and not); `cached_tokens` counts the prompt tokens whose KV cache was reused; the
    response carries `ane_spec` with its stats; an output for a call the input does not hold is
    OpenAI's 400."""
    tool = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    # (the tiny vocabulary spells the call's name in ~20 tokens: 30 cut it in its arguments)
    body = {"model": "m", "input": "weather in Paris?", "tools": [tool], "max_output_tokens": 30,
            "tool_choice": {"type": "function", "name": "get_weather"}}
    first = httpx.post(f"{url}/v1/responses", json=body, timeout=120).json()
    assert first["status"] == "incomplete", first
    (call,) = first["output"]
    assert call["type"] == "function_call" and call["status"] == "incomplete", call
    with pytest.raises(ValueError):
        json.loads(call["arguments"])
    # the same request again: its whole prompt is a cached prefix but the last token
    again = httpx.post(f"{url}/v1/responses", json=body, timeout=120).json()
    stats = again["ane_spec"]["stats"]
    assert again["usage"]["input_tokens_details"]["cached_tokens"] == \
        stats["reused_prefix_tokens"] > 0
    assert again["usage"]["input_tokens"] == stats["prompt_tokens"]
    assert again["output"][0]["arguments"] == call["arguments"]
    with httpx.stream("POST", f"{url}/v1/responses", json=body | {"stream": True},
                      timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert [o["status"] for o in last["response"]["output"]] == ["incomplete"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["status"] for i in done] == ["incomplete"]
    assert last["response"]["ane_spec"]["stats"]["reused_prefix_tokens"] == \
        last["response"]["usage"]["input_tokens_details"]["cached_tokens"] > 0
    # a whole call (room to finish) stays completed
    short = {"type": "string", "pattern": "^[a-z]{1,8}$"}
    whole = httpx.post(f"{url}/v1/responses", json=body | {"max_output_tokens": 200, "tools": [
        tool | {"parameters": tool["parameters"] | {"properties": {"city": short},
                                                    "additionalProperties": False}}]},
        timeout=120).json()
    assert whole["status"] == "completed" and whole["output"][-1]["status"] == "completed"
    # a text answer cut short: its message is the incomplete item
    text = httpx.post(f"{url}/v1/responses", json={"model": "m", "input": "hi",
                                                   "max_output_tokens": 2}, timeout=120).json()
    if text["status"] == "incomplete":
        assert text["output"][-1]["status"] == "incomplete" and text["output"][-1]["content"]
    # an output for a call id the input does not hold
    r = httpx.post(f"{url}/v1/responses", json={"model": "m", "input": [
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_2", "output": "21 C"}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == \
        "No tool call found for function call output with call_id call_2."
    assert r.json()["error"]["param"] == "input"
