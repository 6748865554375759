"""Constrained decoding: llguidance masks over this project's tokenizer, applied per verified row.

The central property: a grammar is a function of the committed tokens, so greedy decoding under
a grammar gives the same tokens with speculation on and off, whatever the drafter guesses
(right, wrong, or forbidden by the grammar), and every output completes the grammar.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from ane_spec.decode.grammar import Grammar, GrammarError, json_schema_grammar, lark_grammar
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.decode.verify import RowChooser, verify_greedy
from ane_spec.model.tokenizer import TOKEN_CONTROL, TOKEN_UNUSED, Tokenizer
from ane_spec.model.vocab import build_synthetic_vocab
from ane_spec.probes.gates import open_pipeline
from ane_spec.runtime.pipeline import BlockOutput
from ane_spec.shards.build import BuildRequest, build
from ane_spec.bench.scripted_drafter import ScriptedDrafter

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(build_synthetic_vocab(1024))


@pytest.fixture(scope="module")
def pipeline(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("constrained") / "art"
    build(tiny_gguf, out, BuildRequest(topology="3", max_seq=96))
    return open_pipeline(out, "mil", "fp32")[1]


def allowed(state) -> set[int]:
    return set(np.flatnonzero(state.mask()).tolist())


def test_the_mask_follows_this_tokenizer(tok: Tokenizer) -> None:
    """Valid JSON tokenized by this tokenizer is accepted token by token; fillers and special
    tokens are never offered to JSON; a grammar names a special token and gets exactly it."""
    grammar = Grammar(tok, json_schema_grammar(SCHEMA))
    for text in ['{"name": "ab", "n": 7, "tags": ["a", "ccc"]}',
                 '{"name":"","n":0,"tags":[]}', '{"name": "x y", "n": 999, "tags": ["bb"]}']:
        state = grammar.start()
        for t in tok.encode(text):
            assert t in allowed(state), (text, tok.decode([t]))
            state.advance(t)
        assert state.accepting and tok.eos_token_id in allowed(state)
    state = grammar.start()
    first = allowed(state)
    assert first == {tok.encode("{")[0]}  # the grammar forces '{"name":'; '{' begins it
    assert all(tok.token_type(t) not in (TOKEN_UNUSED, TOKEN_CONTROL) for t in first)
    # Forced text comes out as this tokenizer's own tokenization of it.
    assert tok.decode(state.forced_tokens()) == '{"name":'
    assert state.forced_tokens() == tok.encode('{"name":')
    for bad in ['{"name": "toolong!"', '{ "name"', '{"name":  "', '{"n":']:
        state = grammar.start()
        ids = tok.encode(bad)
        ok = True
        for t in ids:
            if t not in allowed(state):
                ok = False
                break
            state.advance(t)
        assert not ok, bad
    call = tok.id_of("<|tool_call|>")
    state = Grammar(tok, lark_grammar('start: <|tool_call|> "x"')).start()
    assert allowed(state) == {call}
    with pytest.raises(GrammarError, match="cannot be compiled"):
        Grammar(tok, json_schema_grammar({"type": "object", "properties": {"a": {
            "type": "string", "format": "no-such-format"}}}))


def test_verification_rejects_a_draft_the_grammar_forbids(tok: Tokenizer) -> None:
    """The raw argmax of row 0 is a draft the grammar forbids: it is rejected, and the masked
    argmax (what plain decoding picks) comes next."""
    grammar = Grammar(tok, json_schema_grammar(SCHEMA))
    brace = tok.encode("{")[0]
    forbidden = tok.encode("x")[0]
    logits = np.zeros((4, tok.vocab_size), np.float32)
    logits[0, forbidden] = 10.0
    logits[0, brace] = 1.0
    out = BlockOutput.of_logits(logits)
    chooser = RowChooser(grammar=grammar.start(), eog_ids=tok.eog_ids)
    assert out.row_argmax(0) == forbidden
    v = verify_greedy([forbidden, brace, brace], out, None, chooser)
    assert (v.accepted, v.next_token) == (0, brace)
    assert chooser.grammar.forced_tokens() == tok.encode('"name":')


def generate(pipeline, prompt, drafter=None, **options):
    session = DecodeSession(pipeline) if drafter is None else DecodeSession(pipeline,
                                                                           drafter=drafter)
    return session.generate(prompt, GenerateOptions(**options))


@pytest.mark.parametrize("schema", [SCHEMA, None])
def test_constrained_greedy_is_identical_with_and_without_speculation(pipeline, schema) -> None:
    tok = pipeline.tokenizer
    grammar = Grammar(tok, json_schema_grammar(schema if schema else {
        "type": "object", "properties": {"k": {"type": "string", "maxLength": 10}},
        "required": ["k"], "additionalProperties": False}))
    for prompt_text in ["Give me JSON:", "data"]:
        prompt = tok.encode(prompt_text)
        plain = generate(pipeline, prompt, max_tokens=48, speculative=False, grammar=grammar)
        assert plain.finish_reason == "stop" and plain.grammar_complete, plain.text
        value = json.loads(plain.text)
        jsonschema.validate(value, schema or {"type": "object"})
        # the n-gram drafter, and scripted drafts that are right, wrong (often forbidden by
        # the grammar) or right then wrong
        spec = generate(pipeline, prompt, max_tokens=48, grammar=grammar)
        assert spec.tokens == plain.tokens
        assert spec.stats.passes < len(plain.tokens)  # forced tokens were drafted and accepted
        for correct in (3, 0, 1):
            drafter = ScriptedDrafter(plain.tokens, correct, tok.vocab_size)
            out = generate(pipeline, prompt, drafter, max_tokens=48, grammar=grammar)
            assert out.tokens == plain.tokens, correct


def test_grammar_and_penalties_together_stay_exact(pipeline) -> None:
    from ane_spec.decode.sampling import SamplingParams

    tok = pipeline.tokenizer
    grammar = Grammar(tok, json_schema_grammar(SCHEMA))
    params = SamplingParams(repeat_penalty=1.8, repeat_last_n=16, frequency_penalty=0.5,
                            logit_bias=((tok.encode("a")[0], 3.0),))
    prompt = tok.encode("record:")
    plain = generate(pipeline, prompt, max_tokens=48, speculative=False, grammar=grammar,
                     sampling=params)
    jsonschema.validate(json.loads(plain.text), SCHEMA)
    unpenalized = generate(pipeline, prompt, max_tokens=48, speculative=False, grammar=grammar)
    assert plain.tokens != unpenalized.tokens
    for correct in (3, 1):
        out = generate(pipeline, prompt, ScriptedDrafter(plain.tokens, correct, tok.vocab_size),
                       max_tokens=48, grammar=grammar, sampling=params)
        assert out.tokens == plain.tokens


def test_a_garbage_collection_inside_a_matcher_call_is_not_the_grammars_cost(
        tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grammar cost guard reads the matcher's thread CPU time. A full collection that an
    allocation inside a matcher call triggers runs in that thread too (tenths of a second in a
    process with a large heap: a valid request was refused at 57 ms a token for a grammar that
    costs 0.25); it is left out of the grammar's seconds, and the matcher's own time is not."""
    import gc

    from ane_spec.decode import work_clock

    state = Grammar(tok, json_schema_grammar(SCHEMA)).start()
    heap = [[i] for i in range(300_000)]   # makes a full collection cost something
    matcher = state._matcher

    class CollectingMatcher:
        def __getattr__(self, name):
            return getattr(matcher, name)

        def compute_ff_tokens(self):
            gc.collect()
            return matcher.compute_ff_tokens()

    _, alone = work_clock.timed(gc.collect)
    before = time.thread_time()
    gc.collect()
    collect = time.thread_time() - before
    assert collect > 0.005 and alone < collect / 5, (collect, alone)
    monkeypatch.setattr(state, "_matcher", CollectingMatcher())
    spent = state.cpu_seconds
    state.forced_tokens()
    assert state.cpu_seconds - spent < collect / 5, (state.cpu_seconds - spent, collect)
    _, busy = work_clock.timed(sum, range(3_000_000))   # plain work counts in full
    assert busy > 0.005
    del heap
