"""The fast greedy choice under processors and a grammar (integer keys of the head's own rows, the
edited ids compared by value) is the argmax of the processed float32 row, first index on ties,
with NoTokenLeft exactly when that row is all -inf: checked on rows built to tie, in both head
dtypes, with every processor and real llguidance masks."""

from __future__ import annotations

import numpy as np
import pytest

from ane_spec.decode import grammar as grammar_module
from ane_spec.decode.grammar import Grammar, GrammarState, json_schema_grammar
from ane_spec.decode.sampling import LogitProcessor, NoTokenLeft, SamplingParams
from ane_spec.decode.verify import RowChooser
from ane_spec.model.tokenizer import Tokenizer
from ane_spec.model.vocab import build_synthetic_vocab
from ane_spec.runtime.fp16_argmax import NonFiniteLogits
from ane_spec.runtime.pipeline import BlockOutput
from ane_spec.runtime.row_keys import EXCLUDED, excluded_argmax, unsigned_keys

VOCAB = 1024
ROW = VOCAB + 8  # the model's rows may be longer than the tokenizer's vocabulary
# The lowest finite half, not -inf: a head row holding inf or NaN is refused (fp16_argmax's rule).
LEVELS = np.array([-65504.0, -2.0, -0.0, 0.0, 1.5, 3.0, 7.0, 7.0], dtype=np.float32)
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(build_synthetic_vocab(VOCAB))


def native_and_float(rows: np.ndarray) -> tuple[BlockOutput, BlockOutput]:
    """The same rows as the head gives them (its dtype, read by keys and by ids) and as float32
    logits only (the reference path)."""
    return BlockOutput(len(rows), lambda i: rows[i]), BlockOutput.of_logits(rows.astype(np.float32))


def reference(chooser: RowChooser, out: BlockOutput) -> int | None:
    z = chooser.logits(out, 0)
    best = int(z.argmax())
    return None if z[best] == -np.inf else best


def fast(chooser: RowChooser, out: BlockOutput) -> int | None:
    try:
        return chooser.argmax(out, 0)
    except NoTokenLeft:
        return None


def test_keys_order_as_the_floats() -> None:
    for dtype in (np.float16, np.float32):
        x = np.array([-np.inf, -5, -0.0, 0.0, 2, 2, np.inf], dtype=dtype)
        keys = unsigned_keys(x)
        assert keys[2] == keys[3] and keys[4] == keys[5] and EXCLUDED not in keys
        assert (np.diff(keys[[0, 1, 2, 4, 6]].astype(np.int64)) > 0).all()


@pytest.mark.parametrize("mask_words", [0, 512], ids=["dense-mask", "sparse-mask"])
def test_processed_argmax_is_the_float_rows_argmax(tok: Tokenizer, monkeypatch,
                                                   mask_words: int) -> None:
    """Both ways: the raw winner untouched (compared with the edited ids only), and the raw
    winner edited or forbidden (the key row with those excluded, or under a grammar that
    allows few tokens, their logits gathered: `mask_words` sets which)."""
    monkeypatch.setattr(grammar_module, "SPARSE_MASK_WORDS", mask_words)
    sparse = []
    allowed_ids = GrammarState.allowed_ids

    def counted_allowed_ids(self, *args):  # noqa: ANN001, ANN202
        ids = allowed_ids(self, *args)
        sparse.append(ids is not None)
        return ids

    monkeypatch.setattr(GrammarState, "allowed_ids", counted_allowed_ids)
    keyed, edited = [], []
    original = RowChooser._processed_argmax
    monkeypatch.setattr(RowChooser, "_processed_argmax",
                        lambda self, *a: keyed.append(1) or original(self, *a))
    edits = LogitProcessor.edits
    monkeypatch.setattr(LogitProcessor, "edits",
                        lambda self, *a: edited.append(1) or edits(self, *a))
    rng = np.random.default_rng(0)
    grammar = Grammar(tok, json_schema_grammar(SCHEMA))
    text = tok.encode('{"a": "xy z", "b": 12}')
    kinds = {"fast": 0, "banned": 0, "skipped_edits": 0, "computed_edits": 0}
    for trial in range(600):
        dtype = (np.float16, np.float32)[trial % 2]
        rows = rng.choice(LEVELS, size=(1, ROW)).astype(dtype)
        if trial % 50 == 0:
            rows[:] = -65504.0
        raw_best = int(rows[0].astype(np.float32).argmax())
        targets = set(rng.choice(ROW - 8, rng.integers(0, 4), replace=False).tolist())
        if trial % 4 == 0 and raw_best < ROW - 8:
            targets.add(raw_best)  # the raw winner itself edited
        bias = tuple((t, float(rng.choice([-np.inf, -1.0, 0.5, 4.0, 5.5]))) for t in targets)
        params = SamplingParams(
            logit_bias=bias, ignore_eos=bool(rng.integers(2)),
            repeat_penalty=float(rng.choice([1.0, 1.3, 1.3, 0.8])),
            frequency_penalty=float(rng.choice([0.0, 0.5, 0.5, -0.5])),
            presence_penalty=float(rng.choice([0.0, 0.25, 0.25, -0.25])), repeat_last_n=16)
        state = None
        if trial % 3:
            state = grammar.start()
            for t in text[:rng.integers(0, len(text))]:
                state.advance(t)
        history = rng.integers(0, VOCAB, rng.integers(0, 24)).tolist()
        if trial % 4 == 1:
            history.append(raw_best)  # the raw winner penalised
        chooser = RowChooser(params, eog_ids=tok.eog_ids, history=history, grammar=state)
        if chooser.plain:
            continue
        native, floats = native_and_float(rows)
        expected = reference(chooser, floats)
        before = len(edited)
        assert fast(chooser, native) == expected, trial
        kinds["banned" if expected is None else "fast"] += 1
        if chooser.processor is not None:
            kinds["computed_edits" if len(edited) > before else "skipped_edits"] += 1
    chosen = kinds["fast"] + kinds["banned"]
    assert kinds["fast"] > 300
    assert 100 < len(keyed) < chosen - 100
    assert (sum(sparse) > 100) if mask_words else (len(sparse) > 100 and not any(sparse))
    # Rows whose raw winner no processor touches, where every edit lowers, skip the edits.
    assert kinds["skipped_edits"] > 20 and kinds["computed_edits"] > 300, kinds


def test_excluded_argmax_is_the_masked_float_argmax() -> None:
    """Every finite half, in rows where a random part is excluded: the first maximum of what is
    left, by the raw bits when it is positive and by order keys otherwise; None when nothing is
    left."""
    halves = np.arange(65536, dtype=np.uint16).view(np.float16)
    halves = halves[np.isfinite(halves)]
    rng = np.random.default_rng(6)
    paths = {"bits": 0, "keys": 0, "none": 0}
    for dtype in (np.float16, np.float32):
        for pool in (halves, halves[halves <= 0], np.array([0.0, -0.0, -1.0, 1.0, 1.0])):
            for _ in range(300):
                row = rng.choice(pool, 40).astype(dtype)
                drop = rng.random(40) < rng.choice([0.0, 0.5, 0.9, 1.0])

                def exclude(keys: np.ndarray) -> None:
                    keys[drop] = EXCLUDED

                left = np.where(drop, -np.inf, row.astype(np.float64))
                want = None if drop.all() else int(left.argmax())
                assert excluded_argmax(row, exclude) == want, (row, drop)
                paths["none" if want is None else "bits" if left.max() > 0 else "keys"] += 1
    assert min(paths.values()) > 50


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("poison", [np.nan, -np.nan, np.inf, -np.inf])
def test_the_key_paths_refuse_non_finite_rows(tok: Tokenizer, dtype, poison: float) -> None:
    """The NaN rule holds on the fast paths too: a grammar-only choice (key row straight from
    the head's dtype) and a penalised one refuse a row holding NaN or inf wherever it sits, as
    the float path does; a NaN key would otherwise sort above every finite logit."""
    grammar = Grammar(tok, json_schema_grammar(SCHEMA))
    for where in (0, 7, ROW - 1):
        rows = np.zeros((1, ROW), dtype=dtype)
        rows[0, 3] = 1.0
        rows[0, where] = poison
        for params in (SamplingParams(), SamplingParams(repeat_penalty=1.3, repeat_last_n=16)):
            chooser = RowChooser(params, eog_ids=tok.eog_ids, history=[3, 5],
                                 grammar=grammar.start())
            for out in native_and_float(rows):
                with pytest.raises(NonFiniteLogits):
                    chooser.argmax(out, 0)
