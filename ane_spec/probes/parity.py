"""Parity gate: the whole built pipeline against the reference forward pass.

Each prompt is prefilled in T=4 blocks and then continued at T=1 with the reference's own greedy
tokens, so every logit row of both paths is compared at the same positions and context.

Two references, two questions:
- *graph*: the reference run with the weights the build stores (requantized per row for
  int8-channel, rounded for fp16, identical for q8-block; norms as the fp16 constants the
  program holds), re-derived here from the format's definition, not with the compiler's code.
  This is what the gate decides on: min cosine >= 0.9999 with the fp32 backend (only float
  reordering separates them, measured >= 0.99999 on tiny builds; the known graph bugs land far
  below), >= 0.999 in fp16 emulation, whose rounding of every op is the ANE's arithmetic.
- *model*: the reference with the GGUF's own values. Reported, not gated here: requantizing to
  one scale per row is a deliberate model change, gated per tensor at build time, and how far it
  moves the logits depends on how chaotic the model is (0.9988 on the random "varied" fixture,
  0.99984 on the well-conditioned one, for int8-channel).

A build with a prefill function (`build --prefill-t P`) prefills prompts in P-row passes, layers
only, with the head on the last row. The gate runs every prompt that way too (`prefill_logits(...,
prefill=True)`: the head then runs on every row, 4 at a time, as on the last one), continues it
at T=1 from the cache those passes wrote, and holds the result to the same thresholds
(`prefill_*` figures); one more prompt, of P + P/2 tokens where the context allows, spans two
chunks. It also reports how the two ways compare with each other (`prefill_vs_decode_*`: where the
backend is row-invariant across shapes, `probe row-invariance`, every row is bitwise equal).

Argmax must agree at every *decisive* position: where the reference's top-1/top-2 margin exceeds
twice the largest logit error seen at that position. Closer calls are genuine near-ties that any
rounding may flip (one was seen at margin 0.0007 on a random model); they are counted and
reported, not failed. This is the same rule the decode engine's exactness guard applies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ane_spec.manifests.store import LoadedManifest
from ane_spec.probes.report import GateReport
from ane_spec.runtime.pipeline import ShardPipeline, prefill_logits

DEFAULT_PROMPT_LENGTHS = (1, 6, 17, 40)
DEFAULT_DECODE_STEPS = 6


def parity_thresholds(precision: str | None) -> dict[str, float]:
    return {"min_cosine": 0.9999 if precision == "fp32" else 0.999,
            "decisive_argmax_agreement": 1.0}


def stored_weights(weights: str, per_tensor: dict[str, str] | None = None):
    """The values a build of format `weights` holds for each GGUF tensor (see module docstring).

    `per_tensor` (the manifest's tensor -> format, from an `auto` build) overrides `weights`
    per tensor. A lut8 tensor is taken at the file's own values: its table is a fit, not a
    definition this gate could re-derive independently, so its small error (cos >= the build's
    floor, ~0.99998 typically) stays inside what the gate measures."""
    per_tensor = per_tensor or {}

    def transform(name: str, values: np.ndarray) -> np.ndarray:
        if values.ndim == 1:
            return values.astype(np.float16).astype(np.float32)
        fmt = per_tensor.get(name, weights)
        if fmt == "fp16":
            return values.astype(np.float16).astype(np.float32)
        if fmt in ("int8-channel", "auto"):
            amax = np.abs(values).max(axis=1, keepdims=True)
            scale = np.where(amax == 0, 1.0, amax / 127.0).astype(np.float16).astype(np.float32)
            return np.clip(np.rint(values / scale), -127, 127) * scale
        return values
    return transform


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64 * b64).sum(-1) / (np.linalg.norm(a64, axis=-1) * np.linalg.norm(b64, axis=-1))


def gate_prompts(vocab_size: int, max_seq: int, lengths: Sequence[int],
                 special_ids: Sequence[int] = (), seed: int = 0,
                 reserve: int = DEFAULT_DECODE_STEPS) -> list[list[int]]:
    """Seeded random prompts of ordinary (non-special) tokens, clipped to leave `reserve` slots
    of the context for decoding."""
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(special_ids, dtype=np.int64))
    return [rng.choice(allowed, size=min(n, max_seq - reserve)).tolist() for n in lengths]


def special_token_ids(pipeline: ShardPipeline) -> list[int]:
    """CONTROL and USER_DEFINED tokens: gate prompts leave them out."""
    return [i for i, t in enumerate(pipeline.tokenizer_data.token_types) if t in (3, 4)]


def run_parity(loaded: LoadedManifest, pipeline: ShardPipeline, gguf,
               lengths: Sequence[int] = DEFAULT_PROMPT_LENGTHS,
               decode_steps: int = DEFAULT_DECODE_STEPS) -> GateReport:
    """`gguf` is the opened source model (`GGUFModel`); the references are built from it."""
    from ane_spec.model.reference import ReferenceModel

    m = loaded.manifest
    backend, precision = pipeline.backend.name, pipeline.backend.precision
    thresholds = parity_thresholds(precision)
    window = m.build.max_seq
    graph_ref = ReferenceModel(gguf, context_window=window,
                               weight_transform=stored_weights(m.build.weights, {
                                   n: t.format for p in [*m.shards, *m.heads]
                                   for n, t in p.quant.tensors.items()}))
    model_ref = ReferenceModel(gguf, context_window=window)
    specials = special_token_ids(pipeline)
    prefill_t = pipeline.prefill_t
    if prefill_t:
        lengths = (*lengths, prefill_t + prefill_t // 2)
    graph, model, prefill, per_prompt = _Tally(), _Tally(), _Tally(), []
    between: list[float] = []  # cosine of each row, prefill function against T=4 passes
    identical = 0              # rows bitwise equal both ways
    for prompt in gate_prompts(m.model.vocab_size, window, lengths, specials):
        continuation = graph_ref.generate(prompt, decode_steps)[:decode_steps]
        sequence = prompt + continuation
        expected = graph_ref.logits(sequence)
        got = _prefill_then_decode(pipeline, prompt, continuation)
        cos = graph.add(got, expected)
        model.add(got, model_ref.logits(sequence))
        row = {"prompt_tokens": len(prompt), "positions": len(sequence),
               "cosine": [round(float(c), 7) for c in cos]}
        if prefill_t:
            got_p = _prefill_then_decode(pipeline, prompt, continuation, prefill=True)
            row["prefill_cosine"] = [round(float(c), 7) for c in prefill.add(got_p, expected)]
            between.extend(cosine_rows(got_p, got).tolist())
            identical += sum(np.array_equal(a, b) for a, b in zip(got_p, got))
        per_prompt.append(row)
    figures = graph.figures() | {f"gguf_{k}": v for k, v in model.figures().items()
                                 if k in ("min_cosine", "argmax_agreement")}
    passed = _meets(figures, thresholds)
    if prefill_t:
        figures |= {f"prefill_{k}": v for k, v in prefill.figures().items()}
        figures |= {"prefill_vs_decode_min_cosine": float(min(between)),
                    "prefill_vs_decode_identical_rows": int(identical)}
        passed = passed and _meets(prefill.figures(), thresholds)
    return GateReport("parity", passed, backend, precision, figures, thresholds,
                      {"weights": m.build.weights, "prompts": per_prompt},
                      decode_shape=pipeline.decode_shape)


def _meets(figures: dict, thresholds: dict[str, float]) -> bool:
    return (figures["min_cosine"] >= thresholds["min_cosine"]
            and figures["decisive_argmax_agreement"] >= thresholds["decisive_argmax_agreement"])


class _Tally:
    def __init__(self) -> None:
        self.cos: list[float] = []
        self.agree: list[bool] = []
        self.decisive: list[bool] = []
        self.max_abs = 0.0

    def add(self, got: np.ndarray, expected: np.ndarray) -> np.ndarray:
        cos = cosine_rows(got, expected)
        agree = got.argmax(-1) == expected.argmax(-1)
        top2 = np.sort(expected, axis=-1)[:, -2:]
        decisive = (top2[:, 1] - top2[:, 0]) > 2 * np.abs(got - expected).max(axis=-1)
        self.cos.extend(cos.tolist())
        self.agree.extend(agree.tolist())
        self.decisive.extend(agree[decisive].tolist())
        self.max_abs = max(self.max_abs, float(np.abs(got - expected).max()))
        return cos

    def figures(self) -> dict[str, float | int]:
        return {"min_cosine": float(min(self.cos)),
                "argmax_agreement": float(np.mean(self.agree)),
                "decisive_argmax_agreement": float(np.mean(self.decisive)) if self.decisive else 1.0,
                "near_ties": len(self.cos) - len(self.decisive),
                "max_abs_error": self.max_abs, "positions": len(self.cos)}


def _prefill_then_decode(pipeline: ShardPipeline, prompt: list[int],
                         continuation: list[int], *, prefill: bool = False) -> np.ndarray:
    """Every row's logits: the prompt prefilled (T=4 passes, or with `prefill` the prefill
    function's), then the continuation one token per pass on the cache that left."""
    state = pipeline.new_state()
    rows = [prefill_logits(pipeline, prompt, state, prefill=prefill)]
    position = len(prompt)
    for token in continuation:
        rows.append(pipeline.run([token], position, state).logits)
        position += 1
    return np.concatenate(rows, axis=0)
