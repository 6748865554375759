"""Run a built model one block at a time: embed on the host, every shard in order, then the head.

The manifest is the only thing read: which packages, in which layout, with which RoPE spec and
context window. A `PipelineState` holds one backend state per shard, i.e. one conversation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from ane_spec.errors import AneSpecError
from ane_spec.manifests.store import LoadedManifest
from ane_spec.runtime.backend import Backend, LoadedProgram
from ane_spec.runtime.host_inputs import HostInputs


@dataclass
class PipelineState:
    shard_states: list[Any]


@dataclass
class BlockOutput:
    """One pass over T rows. `logits` [T, V] unless the head was built with --head-argmax, in
    which case only `argmax` [T] (and the winning values `max_logit`) are available."""

    logits: np.ndarray | None
    argmax: np.ndarray
    max_logit: np.ndarray
    backend_seconds: float
    host_seconds: float


@dataclass
class Embeddings:
    """token_embd rows from the build's .npy files, dequantized only for the rows looked up."""

    qs: np.ndarray | None = None
    scales: np.ndarray | None = None
    table: np.ndarray | None = None

    @classmethod
    def load(cls, loaded: LoadedManifest) -> "Embeddings":
        e = loaded.manifest.embeddings
        files = {k: np.load(loaded.path(ref), mmap_mode="r") for k, ref in e.files.items()}
        if e.format == "q8_0":
            return cls(qs=files["qs"], scales=files["scales"])
        return cls(table=files["table"])

    def lookup(self, tokens: Sequence[int]) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64)
        if self.table is not None:
            return self.table[ids].astype(np.float32)
        qs = self.qs[ids].reshape(len(ids), -1, 32).astype(np.float32)
        return (qs * self.scales[ids].astype(np.float32)[..., None]).reshape(len(ids), -1)


@dataclass
class ShardPipeline:
    loaded: LoadedManifest
    backend: Backend
    shards: list[LoadedProgram] = field(init=False)
    head: LoadedProgram = field(init=False)
    # Per-process measurements that layers above make once per loaded model (the decode
    # engine's pass-cost policy), kept with the model they describe.
    measurements: dict[str, Any] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        m = self.loaded.manifest
        self.manifest = m
        self.config = m.model
        self.max_seq = m.build.max_seq
        self.max_t = m.build.t_range[1]
        self.layout = m.build.layout
        self.head_argmax = m.head.argmax
        self.input_dtype = np.float32 if self.backend.precision == "fp32" else np.float16
        self.host = HostInputs(m.rope, self.max_seq, self.max_t, self.input_dtype)
        self.embeddings = Embeddings.load(self.loaded)
        self.shards = [self.backend.load(self.loaded.path(s.file)) for s in m.shards]
        self.head = self.backend.load(self.loaded.path(m.head.file))

    @property
    def drift_key(self) -> str:
        """The manifest's `drift` entry for this backend and precision (`mil-fp16`, `coreml`)."""
        return "-".join(x for x in (self.backend.name, self.backend.precision) if x)

    @cached_property
    def tokenizer_data(self):
        """The build's copy of the GGUF vocabulary and chat template (tokenizer.json)."""
        return self.loaded.tokenizer_data()

    @cached_property
    def tokenizer(self):
        from ane_spec.model.tokenizer import Tokenizer

        return Tokenizer.from_data(self.tokenizer_data)

    def new_state(self) -> PipelineState:
        return PipelineState([shard.make_state() for shard in self.shards])

    # --- layout ---------------------------------------------------------------------------

    def to_hidden(self, rows: np.ndarray) -> np.ndarray:
        """[T, d] float rows -> the packages' hidden layout."""
        x = rows.astype(self.input_dtype).T  # [d, T]
        return (x[None, :, :, None] if self.layout == "BCT1" else x[None, :, None, :]).copy()

    def token_major(self, x: np.ndarray) -> np.ndarray:
        """A [T, channels] view of a hidden-layout array or head output (no copy)."""
        return (x[0, :, :, 0] if self.layout == "BCT1" else x[0, :, 0, :]).T

    def from_hidden(self, x: np.ndarray) -> np.ndarray:
        """Hidden layout (or a head output) -> [T, channels] float32."""
        return np.ascontiguousarray(self.token_major(x), dtype=np.float32)

    # --- running -------------------------------------------------------------------------

    def run_shards(self, hidden: np.ndarray, inputs: dict[str, np.ndarray], state: PipelineState,
                   shard_range: range | None = None) -> np.ndarray:
        """Hidden states through the shards (all, or a range of them, for per-shard gates)."""
        for n in shard_range or range(len(self.shards)):
            hidden = self.shards[n].predict({"x": hidden, **inputs}, state.shard_states[n])["hidden"]
        return hidden

    def run(self, tokens: Sequence[int], position: int, state: PipelineState) -> BlockOutput:
        """One pass over `tokens` (1..T_max) written at slots position.. position+T-1."""
        t0 = time.perf_counter()
        if not 1 <= len(tokens) <= self.max_t:
            raise AneSpecError(f"a pass takes 1..{self.max_t} tokens, got {len(tokens)}")
        bad = [t for t in tokens if not 0 <= t < self.config.vocab_size]
        if bad:
            raise AneSpecError(f"token ids {bad[:5]} are outside the vocabulary "
                               f"0..{self.config.vocab_size - 1}")
        hidden = self.to_hidden(self.embeddings.lookup(tokens))
        inputs = self.host.block(position, len(tokens))
        host = time.perf_counter() - t0

        t1 = time.perf_counter()
        outputs = self.head.predict({"x": self.run_shards(hidden, inputs, state)})
        backend = time.perf_counter() - t1

        t2 = time.perf_counter()
        result = self._read_head(outputs)
        host += time.perf_counter() - t2
        return BlockOutput(*result, backend_seconds=backend, host_seconds=host)

    def _read_head(self, outputs: dict[str, np.ndarray]
                   ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        chunks = self.manifest.head.chunks
        if not self.head_argmax:
            # One copy per pass: each chunk's [V_i, T] view is written straight into [T, V].
            t = self.token_major(outputs["logits_0"]).shape[0]
            logits = np.empty((t, chunks[-1][1]), dtype=np.float32)
            for i, (start, end) in enumerate(chunks):
                logits[:, start:end] = self.token_major(outputs[f"logits_{i}"])
            best = logits.argmax(axis=1)
            return logits, best, logits[np.arange(len(best)), best]
        maxima = np.stack([self.from_hidden(outputs[f"max_{i}"])[:, 0]
                           for i in range(len(chunks))], axis=1)           # [T, chunks]
        index = np.stack([self.from_hidden(outputs[f"argmax_{i}"])[:, 0]
                          for i in range(len(chunks))], axis=1).astype(np.int64)
        winner = maxima.argmax(axis=1)  # first chunk on ties, like a global argmax
        starts = np.array([s for s, _ in chunks])
        rows = np.arange(len(winner))
        return None, starts[winner] + index[rows, winner], maxima[rows, winner]


def prefill_logits(pipeline: ShardPipeline, tokens: Sequence[int],
                   state: PipelineState | None = None) -> np.ndarray:
    """Logits [T, V] for `tokens` from position 0, run in blocks of T_max (the last shorter).
    Pass `state` to keep the filled KV slots for decoding after it."""
    if pipeline.head_argmax:
        raise AneSpecError("this build's head emits only argmax (--head-argmax); rebuild "
                           "without it to dump logits")
    if len(tokens) > pipeline.max_seq:
        raise AneSpecError(f"{len(tokens)} tokens do not fit the build's context window of "
                           f"{pipeline.max_seq}")
    state = state or pipeline.new_state()
    rows = []
    for start in range(0, len(tokens), pipeline.max_t):
        rows.append(pipeline.run(tokens[start:start + pipeline.max_t], start, state).logits)
    return np.concatenate(rows, axis=0)
