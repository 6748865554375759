"""Decoding the real catalog models (tests/real_models.py's shared builds) on the fp16
interpreter, the ANE's arithmetic: speculative decoding against plain greedy, and the prefill
function against T=4 passes (issue 33). Split from test_real_models.py so that the two files,
each several minutes, run on both xdist workers.

- fp16 speculative decoding equals plain greedy decoding token for token on real chat prompts;
- the build's prefill function (64-row prompt chunks, the default build's): every prompt row's
  logits against T=4 passes, and speculative == greedy after it, over chat and code prompts of
  several chunks, and a second turn continued on the first turn's cache == a fresh prefill.
"""

from __future__ import annotations

import numpy as np
import pytest

from ane_spec.decode.generate import prompt_tokens
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.probes.parity import cosine_rows
from ane_spec.runtime.pipeline import prefill_logits

NAMES = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")


SPEC_CHATS = {
    "smollm2-135m-instruct": [
        [{"role": "user", "content": "List the planets of the solar system in order."}],
        [{"role": "user", "content": "Write a short poem about the sea."}],
    ],
    "qwen2.5-coder-0.5b-instruct": [
        [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci "
                                     "number, with a docstring."}],
        [{"role": "user", "content": "Rewrite this loop as a list comprehension:\n"
                                     "out = []\nfor x in xs:\n    if x % 2:\n"
                                     "        out.append(x * x)\n"}],
    ],
}


@pytest.mark.parametrize("name", NAMES)
def test_fp16_speculative_equals_greedy_on_real_chat_prompts(name: str,
                                                             fp16_pipelines: dict) -> None:
    pipeline = fp16_pipelines[name]
    passes = tokens = 0
    for chat in SPEC_CHATS[name]:
        prompt = prompt_tokens(pipeline, messages=chat)
        plain = DecodeSession(pipeline).generate(
            prompt, GenerateOptions(max_tokens=32, speculative=False))
        spec = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=32))
        assert spec.tokens == plain.tokens, chat
        assert len(plain.tokens) >= 8 and plain.text.strip()
        passes += spec.stats.passes
        tokens += len(spec.tokens)
    print(f"\n{name}: fp16 speculative == greedy, {tokens} tokens in {passes} passes")


# Prompts of several prefill chunks (64 rows each in the default build): a chat question over a
# paragraph, and code to rework; the second text is the next turn's question.
LONG_CHATS = {
    "chat": ("Read this paragraph and answer in two sentences: why did the city build the "
             "canal, and what did it change?\n\nIn the early nineteenth century the city sat on "
             "a river too shallow for the barges that carried grain and coal from the plains. "
             "Merchants paid carters to haul every load around the rapids, and the cost of bread "
             "rose each winter when the roads froze. In 1824 the council borrowed against the "
             "harbour dues and hired engineers to cut a canal past the rapids, with six locks "
             "and a basin near the old market. It took nine years. When it opened, barges "
             "reached the market directly, the price of coal fell by a third, and new mills "
             "grew along the basin, drawing workers from the countryside.",
             "Now say the same in one sentence for a child."),
    "code": ("Add type hints and a docstring to this function, and make it handle an empty "
             "list:\n\n```python\ndef summarize(records, key, threshold):\n    totals = {}\n"
             "    counts = {}\n    for record in records:\n        name = record[key]\n"
             "        value = record['value']\n        if value < threshold:\n"
             "            continue\n        totals[name] = totals.get(name, 0) + value\n"
             "        counts[name] = counts.get(name, 0) + 1\n    result = []\n"
             "    for name in sorted(totals):\n        mean = totals[name] / counts[name]\n"
             "        result.append((name, totals[name], round(mean, 2)))\n"
             "    best = max(result, key=lambda row: row[1])\n    return result, best\n```",
             "Also write one pytest test for it."),
}


# Which prompt each model's two prefill tests take: each model runs both kinds, one per test,
# as a real model's 64-row interpreter passes are costly (pytest --durations shows each test).
PREFILL_KINDS = {"smollm2-135m-instruct": ("chat", "code"),
                 "qwen2.5-coder-0.5b-instruct": ("code", "chat")}


@pytest.mark.parametrize("name", NAMES)
def test_prefill_function_logits_agree_with_t4_passes(name: str, fp16_pipelines: dict) -> None:
    """Every row of a prompt of 3+ chunks of 64: the prefill function's logits (the head run on
    each row, as on the last one) against the same prompt in T=4 passes of the same build, whose
    decode program is what a build without a prefill function runs. The issue's bar is cosine
    >= 0.9999 on every row; the interpreter, row-invariant across shapes, gives the same bits."""
    pipeline = fp16_pipelines[name]
    first, _ = LONG_CHATS[PREFILL_KINDS[name][0]]
    prompt = prompt_tokens(pipeline, messages=[{"role": "user", "content": first}])
    assert len(prompt) > 2 * pipeline.prefill_t == 128
    chunked = prefill_logits(pipeline, prompt, prefill=True)
    blocked = prefill_logits(pipeline, prompt)
    cos = cosine_rows(chunked, blocked)
    identical = sum(np.array_equal(a, b) for a, b in zip(chunked, blocked))
    print(f"\n{name}: prefill function vs T=4 passes over {len(prompt)} prompt rows: min "
          f"cosine {cos.min():.7f}, {identical}/{len(prompt)} rows bitwise equal")
    assert cos.min() >= 0.9999 and (chunked.argmax(1) == blocked.argmax(1)).all()
    assert identical == len(prompt)


@pytest.mark.parametrize("name", NAMES)
def test_fp16_speculative_equals_greedy_after_prefill_chunks(name: str,
                                                            fp16_pipelines: dict) -> None:
    """A prompt of 3+ chunks through the prefill function (--prefill on): speculative ==
    greedy; then a second turn continued on the first turn's cache (the reply's K/V written by
    T=4 decode passes, the new chunk starting where the turn ended) == a fresh session
    prefilling the whole conversation in chunks of 64."""
    pipeline = fp16_pipelines[name]
    first, second = LONG_CHATS[PREFILL_KINDS[name][1]]
    chat = [{"role": "user", "content": first}]
    prompt = prompt_tokens(pipeline, messages=chat)
    assert len(prompt) > 2 * pipeline.prefill_t
    options = GenerateOptions(max_tokens=16)
    session = DecodeSession(pipeline, prefill="on")
    spec = session.generate(prompt, options)
    greedy = DecodeSession(pipeline, prefill="on").generate(
        prompt, GenerateOptions(max_tokens=16, speculative=False))
    assert spec.tokens == greedy.tokens
    assert spec.stats.prefill_function_passes == -(-len(prompt) // pipeline.prefill_t)
    chat += [{"role": "assistant", "content": pipeline.tokenizer.decode(spec.tokens)},
             {"role": "user", "content": second}]
    follow = prompt_tokens(pipeline, messages=chat)
    turn = session.generate(follow, options)
    fresh = DecodeSession(pipeline, prefill="on").generate(follow, options)
    assert turn.stats.reused_prefix_tokens > len(prompt)
    assert turn.tokens == fresh.tokens
    print(f"\n{name}: {len(prompt)}-token prompt, {len(spec.tokens)} tokens "
          f"({spec.stats.accepted} drafts accepted); turn 2 reused "
          f"{turn.stats.reused_prefix_tokens} of {len(follow)} tokens, == a fresh prefill")
