"""The reference forward pass: llama.cpp's phi3 / llama / qwen2 / qwen3 / gemma3 graphs in torch.

This is the oracle every shard is checked against, so it shares nothing with the compiler except
the model contract (config, architecture description, tensors, RoPE tables). It is written for
clarity, not speed.

    h = token_embd[tokens]           (gemma3: * sqrtf(hidden), in fp32)
    for each layer:
        a = rmsnorm(h, attn_norm)
        q, k, v = a @ attn_qkv.T split, or a @ attn_{q,k,v}.T (+ attn_{q,k,v}.bias)   qwen2
        q, k = rmsnorm_per_head(q, attn_q_norm), rmsnorm_per_head(k, attn_k_norm)      qwen3, gemma3
        q, k = rope(q), rope(k)         # NEOX halves (phi3: first rope_dims only) or NORM pairs;
                                        # local layers: the sliding-window RoPE tables     gemma3
        o = attn(q * scale, k, v) @ attn_output.T    # scale 1/sqrt(head_dim); local layers see
                                                     # only the last `sliding_window` positions
        h = h + o  (gemma3: h + rmsnorm(o, post_attention_norm))
        g, u = split(n @ ffn_up.T) or n @ ffn_gate.T, n @ ffn_up.T;  n = rmsnorm(h, ffn_norm)
        h = h + (act(g) * u) @ ffn_down.T   (act: silu, gemma3 tanh-GELU; gemma3: post_ffw_norm)
    logits = rmsnorm(h, output_norm) @ (output or token_embd).T
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ane_spec.errors import AneSpecError
from ane_spec.model.gguf_file import GGUFModel, Tensor
from ane_spec.model.quant import times_block_scales
from ane_spec.model.rope import RopeSpec


def _one_thread_in_a_forked_child() -> None:
    """torch's CPU ops run on libgomp's OpenMP team, which is not fork-safe: a child forked after
    its parent ran a parallel op waits forever at its own first one (gomp_team_barrier_wait_end).
    Builds calibrate activations with this reference, and the build-kill tests (like any caller
    that forks a build) hung there. One thread never enters an OpenMP region."""
    torch.set_num_threads(1)


os.register_at_fork(after_in_child=_one_thread_in_a_forked_child)

# Above this many bytes of dequantized weights the reference re-dequantizes each matrix from the
# memmap on every use instead of caching it: the real 3.8B model would need 15 GB in fp32.
MATERIALIZE_LIMIT_BYTES = 3 << 30
# Values per row block of a streamed projection (Weights.project): 2 MB of float32, which the
# matmul reads back from the core's caches instead of from memory, in a whole number of
# STREAM_ROW_MULTIPLE rows: MKL's sgemm gives an output column the same bits whether its block
# starts on a multiple of 16 rows of the whole matrix or the matrix is whole (blocks of 7 rows
# change some, measured here at 5, 40 and 224 token rows on one thread and two).
STREAM_BLOCK_ELEMENTS = 1 << 19
STREAM_ROW_MULTIPLE = 64


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NEOX rotate-half over the first 2*cos.shape[-1] dims of `x` `[T, heads, head_dim]`.

    cos/sin are `[T, rot/2]` and already carry the attention factor; the tail dims pass through.
    """
    half = cos.shape[-1]
    x1, x2, tail = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, tail], dim=-1)


def apply_rope_norm(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NORM RoPE (llama.cpp's LLAMA_ROPE_TYPE_NORM): pair j is dims (2j, 2j+1), rotated by
    theta_j; dims past 2*cos.shape[-1] pass through."""
    rot = 2 * cos.shape[-1]
    pairs = x[..., :rot].unflatten(-1, (-1, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    return torch.cat([rotated, x[..., rot:]], dim=-1)


WeightTransform = Callable[[str, np.ndarray], np.ndarray]
# Sees intermediate activations: (what, layer, tensor). `what` is "embedding" (layer -1),
# "residual" (the stream after each add into it), "ffn_up" (gate and up outputs) or
# "ffn_down_in" (act(gate) * up). Activation calibration (activation_range.py) uses it.
Observer = Callable[[str, int, torch.Tensor], None]


class Weights:
    """Float views of the GGUF matrices, cached or re-dequantized per use (see the limit above).

    `transform(name, values)` may replace a tensor's values, e.g. with the values a build stores
    after requantization; embedding lookups (`rows`) always read the file's own values.

    `stream`: `project` dequantizes a matrix a row block at a time into one small buffer and
    multiplies each block as it comes, instead of dequantizing the whole matrix into memory
    first (see `project`).
    """

    def __init__(self, gguf: GGUFModel, dtype: torch.dtype, materialize: bool,
                 transform: WeightTransform | None = None,
                 empty: Callable[..., np.ndarray] = np.empty, stream: bool = False):
        self.gguf, self.dtype, self.materialize = gguf, dtype, materialize
        self.transform = transform
        self.empty = empty   # where dequantized matrices go (a MemoryPool's, to reuse pages)
        self.stream = stream and transform is None and dtype == torch.float32
        self._cache: dict[str, torch.Tensor] = {}

    def __call__(self, name: str) -> torch.Tensor:
        if name in self._cache:
            return self._cache[name]
        w = self._load(self.gguf.tensor(name))
        if self.materialize:
            self._cache[name] = w
        return w

    def project(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """`x @ W.T` for the matrix `name`.

        Streamed (`stream`, nothing cached), each block of rows is dequantized into a ~2 MB
        buffer and multiplied while it is still in cache, into its columns of the output. The
        whole-matrix way writes every fp32 weight to memory and reads it back: a real-size
        synthetic Phi-4-mini's calibration took 8.9 CPU s that way and 5.9 streamed, with the
        same peaks bit for bit. Each output column is the same dot product either way, and with
        blocks of STREAM_ROW_MULTIPLE rows MKL gives it the same bits (tests/test_reference.py);
        a BLAS that did not could move a calibrated peak by an ulp. A matrix read this way is
        given back to the page cache."""
        if not self.stream or name in self._cache:
            return x @ self(name).T
        t = self.gguf.tensor(name)
        out_rows, width = t.shape
        out = torch.empty((x.shape[0], out_rows), dtype=x.dtype)
        step = max(1, STREAM_BLOCK_ELEMENTS // width // STREAM_ROW_MULTIPLE) * STREAM_ROW_MULTIPLE
        if t.is_q8_0:
            qs, d = t.q8_0()
            block = self.empty((min(step, out_rows) * width,), np.float32)
        for r0 in range(0, out_rows, step):
            r1 = min(out_rows, r0 + step)
            values = (_q8_0_rows_into(block, qs[r0:r1], d[r0:r1]) if t.is_q8_0
                      else t.rows(np.arange(r0, r1), np.float32))
            torch.mm(x, torch.from_numpy(values).T, out=out[:, r0:r1])
        t.release()
        return out

    def drop_cached(self) -> None:
        """Forget the cached values and give back the file pages they were read from: mapped
        pages count in this process's RSS, and a layer-major sweep reads every one of them
        (a 4 GB file otherwise peaks at 4.4 GB of RSS for 0.4 GB of layer weights)."""
        for name in self._cache:
            self.gguf.tensor(name).release()
        self._cache.clear()

    def rows(self, name: str, ids: Sequence[int]) -> torch.Tensor:
        return torch.from_numpy(self.gguf.tensor(name).rows(np.asarray(ids))).to(self.dtype)

    def _load(self, t: Tensor) -> torch.Tensor:
        values = t.dequantize(np.float32, self.empty)
        if self.transform is not None:
            values = self.transform(t.name, values)
        if not values.flags.writeable:  # F32 tensors: read-only views of the memmap
            values = values.copy()
        # Shared, not copied: a dequantized matrix is a fresh array nothing else holds, and a
        # copy doubled the largest one's memory for a moment (201 MB more on Phi-4-mini's
        # ffn_up, while a build holds a whole shard of converted weights beside it).
        return torch.from_numpy(values).to(self.dtype)


@dataclass
class KVCache:
    """Per-layer K and V `[n_kv, window, head_dim]`; `length` tokens are committed."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int = 0
    tokens: list[int] = field(default_factory=list)


@dataclass
class _Rows:
    """One sequence's rows [start, stop) in a stack of several, with its mask and cache."""

    start: int
    stop: int
    mask: torch.Tensor
    cache: KVCache


class ReferenceModel:
    """Runs token lists to logits with llama.cpp's semantics, in float32 or float64."""

    def __init__(self, gguf: GGUFModel, *, context_window: int = 4096,
                 dtype: torch.dtype = torch.float32, materialize: bool | None = None,
                 weight_transform: WeightTransform | None = None,
                 observer: Observer | None = None,
                 allocate: Callable[..., np.ndarray] = np.empty, stream_weights: bool = False):
        self.gguf = gguf
        self.observe: Observer = observer or (lambda _what, _layer, _x: None)
        self.config = c = gguf.config
        self.context_window = context_window
        self.rope = gguf.rope_spec(context_window)
        # Sliding-window layers' own tables (another base, no linear scaling), where there are any.
        self.rope_local = gguf.rope_spec(context_window, local=True) if c.has_local_layers else None
        self.dtype = dtype
        if materialize is None:
            materialize = c.num_parameters() * torch.finfo(dtype).bits // 8 <= MATERIALIZE_LIMIT_BYTES
        self.w = Weights(gguf, dtype, materialize, weight_transform, allocate, stream_weights)
        self.head_name = "output.weight" if not c.tied_embeddings else "token_embd.weight"
        self.arch = c.architecture
        self.rope_fn = apply_rope if self.arch.rope_type == "neox" else apply_rope_norm

    def new_cache(self) -> KVCache:
        c = self.config
        shape = (c.num_kv_heads, self.context_window, c.head_dim)
        return KVCache(k=[torch.zeros(shape, dtype=self.dtype) for _ in range(c.num_layers)],
                       v=[torch.zeros(shape, dtype=self.dtype) for _ in range(c.num_layers)])

    @torch.no_grad()
    def forward(self, tokens: Sequence[int], cache: KVCache) -> torch.Tensor:
        """Append `tokens` after the cache's committed ones; returns logits `[T, vocab]`."""
        c = self.config
        start, n = cache.length, len(tokens)
        if n == 0:
            raise AneSpecError("forward needs at least one token")
        if start + n > self.context_window:
            raise AneSpecError(f"{start + n} tokens do not fit the context window of "
                               f"{self.context_window}")
        bad = [t for t in tokens if not 0 <= t < c.vocab_size]
        if bad:
            raise AneSpecError(f"token ids {bad[:5]} are outside the vocabulary 0..{c.vocab_size - 1}")

        tables, masks = self._position_inputs(start, n)
        h = self._embed(tokens)
        for i in range(c.num_layers):
            local = c.is_local(i)
            cos, sin = tables[local]
            h = self._layer(i, h, cos, sin, masks[local], cache)
        cache.length += n
        cache.tokens.extend(int(t) for t in tokens)
        h = rms_norm(h, self.w("output_norm.weight"), c.rms_eps)
        return h @ self.w(self.head_name).T

    def _tables(self, rope: RopeSpec, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope.tables(positions, np.float64)
        return torch.from_numpy(cos).to(self.dtype), torch.from_numpy(sin).to(self.dtype)

    def _position_inputs(self, start: int, n: int
                         ) -> tuple[dict[bool, tuple[torch.Tensor, torch.Tensor]],
                                    dict[bool, torch.Tensor]]:
        """RoPE tables and masks for rows start..start+n-1, keyed by "is a local layer"."""
        c = self.config
        positions = np.arange(start, start + n)
        tables = {False: self._tables(self.rope, positions)}
        # Row i may see key slots 0 .. start+i: the causal mask over the committed prefix.
        keys = torch.arange(start + n)
        rows = start + torch.arange(n)
        masks = {False: keys[None, :] <= rows[:, None]}
        if self.rope_local is not None:
            tables[True] = self._tables(self.rope_local, positions)
            # llama_hparams::is_masked_swa (STANDARD) hides key p0 from row p1 when
            # p1 - p0 >= n_swa: a local row sees the last `sliding_window` positions, itself
            # included.
            masks[True] = masks[False] & (keys[None, :] > rows[:, None] - c.sliding_window)
        return tables, masks

    def _embed(self, tokens: Sequence[int]) -> torch.Tensor:
        h = self.w.rows("token_embd.weight", tokens)
        if self.arch.embed_scale:
            # gemma3.cpp: ggml_scale(inp, sqrtf(n_embd)), the fp32-rounded root.
            h = h * float(np.float32(math.sqrt(self.config.hidden_size)))
        self.observe("embedding", -1, h)
        return h

    @torch.no_grad()
    def run_layer_major(self, sequences: Sequence[Sequence[int]],
                        caches: Sequence[KVCache] | None = None) -> list[KVCache]:
        """Run each sequence through every layer, for the observer only (no logits), one layer
        at a time for all of them: each weight is dequantized once and only one layer's weights
        are held, however large the model (activation calibration). The sequences' rows are
        stacked, so each weight is one matmul over all of them (a few hundred rows: ~1.7x the
        throughput of one matmul per sequence of ~48 on MKL, which gives each row the same bits
        either way; attention runs per sequence).

        Each sequence starts at position 0, or, given `caches` (one per sequence, as an earlier
        call returned them), after what its cache holds: it continues that sequence. Returns
        the caches, each holding its sequence's K/V so far."""
        c = self.config
        if caches is not None and len(caches) != len(sequences):
            raise ValueError(f"{len(caches)} caches for {len(sequences)} sequences")
        caches = list(caches) if caches is not None else [self.new_cache() for _ in sequences]
        embedded, parts, tables = [], {False: [], True: []}, {False: [], True: []}
        row = 0
        for tokens, cache in zip(sequences, caches):
            if not 0 < len(tokens) <= self.context_window - cache.length:
                raise AneSpecError(f"a sequence of {len(tokens)} tokens after {cache.length} "
                                   f"does not fit the context window of {self.context_window}")
            embedded.append(self._embed(tokens))
            seq_tables, masks = self._position_inputs(cache.length, len(tokens))
            for local in masks:
                parts[local].append(_Rows(row, row + len(tokens), masks[local], cache))
                tables[local].append(seq_tables[local])
            row += len(tokens)
        cos_sin = {local: (torch.cat([t[0] for t in ts]), torch.cat([t[1] for t in ts]))
                   for local, ts in tables.items() if ts}
        h = torch.cat(embedded)
        kept = self.w.materialize
        self.w.materialize = True
        try:
            for i in range(c.num_layers):
                local = c.is_local(i)
                h = self._layer_rows(i, h, *cos_sin[local], parts[local])
                self.w.drop_cached()  # layer i's weights are not read again
        finally:
            self.w.materialize = kept
        for tokens, cache in zip(sequences, caches):
            cache.length += len(tokens)
            cache.tokens.extend(tokens)
        return caches

    def _layer(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Layer i over the rows of one sequence, after the cache's committed ones."""
        return self._layer_rows(i, h, cos, sin, [_Rows(0, h.shape[0], mask, cache)])

    def _layer_rows(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    parts: Sequence[_Rows]) -> torch.Tensor:
        """Layer i over the rows of one or more sequences stacked in `h` (`parts` says whose
        rows are where, with their masks and caches; `cos`/`sin` are per row). Everything but
        attention works row by row."""
        c, w, n = self.config, self.w, h.shape[0]
        a = rms_norm(h, w(f"blk.{i}.attn_norm.weight"), c.rms_eps)
        q, k, v = self._qkv(i, a)
        q = q.reshape(n, c.num_heads, c.head_dim)
        k = k.reshape(n, c.num_kv_heads, c.head_dim)
        v = v.reshape(n, c.num_kv_heads, c.head_dim)
        if self.arch.qk_norm:
            q = rms_norm(q, w(f"blk.{i}.attn_q_norm.weight"), c.rms_eps)
            k = rms_norm(k, w(f"blk.{i}.attn_k_norm.weight"), c.rms_eps)
        q, k = self.rope_fn(q, cos, sin), self.rope_fn(k, cos, sin)
        if len(parts) == 1:
            o = self._attend(i, q, k, v, parts[0])
        else:
            o = torch.cat([self._attend(i, q[p.start:p.stop], k[p.start:p.stop],
                                        v[p.start:p.stop], p) for p in parts])
        o = w.project(o, f"blk.{i}.attn_output.weight")
        if self.arch.post_norms:
            o = rms_norm(o, w(f"blk.{i}.post_attention_norm.weight"), c.rms_eps)
        h = h + o
        self.observe("residual", i, h)

        f = rms_norm(h, w(f"blk.{i}.ffn_norm.weight"), c.rms_eps)
        if self.arch.fused_gate_up:
            g, u = w.project(f, f"blk.{i}.ffn_up.weight").split(c.ffn_size, dim=-1)
        else:
            g = w.project(f, f"blk.{i}.ffn_gate.weight")
            u = w.project(f, f"blk.{i}.ffn_up.weight")
        self.observe("ffn_up", i, g)
        self.observe("ffn_up", i, u)
        act = F.silu(g) if self.arch.ffn_activation == "silu" else F.gelu(g, approximate="tanh")
        act = act * u
        self.observe("ffn_down_in", i, act)
        down = w.project(act, f"blk.{i}.ffn_down.weight")
        if self.arch.post_norms:
            down = rms_norm(down, w(f"blk.{i}.post_ffw_norm.weight"), c.rms_eps)
        h = h + down
        self.observe("residual", i, h)
        return h

    def _attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rows: _Rows) -> torch.Tensor:
        """One sequence's attention output `[T, q_dim]`: its new K/V written to its cache
        after the committed ones, its rows attending over them under its mask."""
        c, n, cache = self.config, q.shape[0], rows.cache
        start = cache.length
        cache.k[i][:, start:start + n] = k.transpose(0, 1)
        cache.v[i][:, start:start + n] = v.transpose(0, 1)
        keys = cache.k[i][:, :start + n].repeat_interleave(c.gqa_group, dim=0)
        values = cache.v[i][:, :start + n].repeat_interleave(c.gqa_group, dim=0)

        scores = (q.transpose(0, 1) * c.attention_scale) @ keys.transpose(1, 2)
        scores = scores.masked_fill(~rows.mask, float("-inf"))
        o = torch.softmax(scores, dim=-1) @ values          # [heads, T, head_dim]
        return o.transpose(0, 1).reshape(n, c.q_dim)        # channel = head * head_dim + d

    def _qkv(self, i: int, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c, w = self.config, self.w
        if self.arch.fused_qkv:
            qkv = w.project(a, f"blk.{i}.attn_qkv.weight")
            return qkv.split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
        out = []
        for part in ("q", "k", "v"):
            x = w.project(a, f"blk.{i}.attn_{part}.weight")
            out.append(x + w(f"blk.{i}.attn_{part}.bias") if self.arch.qkv_bias else x)
        return out[0], out[1], out[2]

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits `[T, vocab]` for `tokens` processed from position 0, as float32."""
        return self.forward(tokens, self.new_cache()).float().numpy()

    def generate(self, prompt: Sequence[int], max_new_tokens: int,
                 stop_ids: frozenset[int] = frozenset()) -> list[int]:
        """Plain greedy decoding with a KV cache: the exactness target for speculation."""
        cache = self.new_cache()
        room = self.context_window - len(prompt)
        logits = self.forward(prompt, cache)[-1]
        out: list[int] = []
        for _ in range(min(max_new_tokens, room + 1)):
            tok = int(torch.argmax(logits))
            out.append(tok)
            if tok in stop_ids or cache.length >= self.context_window:
                break
            logits = self.forward([tok], cache)[-1]
        return out


def _q8_0_rows_into(block: np.ndarray, qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q8_0 rows (blocked int8 `[rows, nb, 32]`, fp16 scales `[rows, nb]`) dequantized into the
    front of `block`, as `[rows, nb * 32]` float32: the int8 cast by numpy, then scaled in
    place by `quant.times_block_scales` (torch's broadcast multiply, faster than numpy's). The
    same values as quant.q8_0_dequantize, bit for bit: an exact cast, then one
    float32 product each."""
    values = block[:qs.size].reshape(qs.shape)
    np.copyto(values, qs, casting="unsafe")
    times_block_scales(values, d.astype(np.float32), values)
    return values.reshape(qs.shape[0], -1)
