"""The probes a Mac user runs first on new hardware or a new macOS (seeds/003's gates).

- `synthetic-t4`: one stateful T=4-capable layer at chosen dims with random int8 weights:
  does the op pattern (multi-row KV scatter, block attention, RangeDim) stay on the ANE, and do
  a T=4 call and four T=1 calls agree?
- `layer`: the same question for one real layer taken from a GGUF file.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np

from ane_spec.model.config import ModelConfig
from ane_spec.peak_memory import peak_rss_bytes
from ane_spec.model.rope import make_rope_spec
from ane_spec.probes.block import block_thresholds, block_vs_sequential
from ane_spec.probes.report import GateReport
from ane_spec.runtime.backend import Backend
from ane_spec.runtime.host_inputs import HostInputs
from ane_spec.shards.layer_graph import LayerWeights
from ane_spec.shards.programs import layer_program, save_package
from ane_spec.shards.weights import ConvWeight

# (hidden, heads, kv heads, head_dim, rope dims, ffn, S): seeds/003's three probe shapes.
PROBE_DIMS = {
    "tiny": (64, 4, 2, 16, 12, 128, 64),
    "d1024": (1024, 16, 4, 64, 48, 2048, 256),
    "phi": (3072, 24, 8, 128, 96, 8192, 512),
}


def synthetic_config(dims: str) -> tuple[ModelConfig, int]:
    d, h, kv, hd, rot, ffn, s = PROBE_DIMS[dims]
    return ModelConfig(hidden_size=d, num_layers=1, num_heads=h, num_kv_heads=kv, head_dim=hd,
                       rope_dims=rot, ffn_size=ffn, vocab_size=1024, context_length=131072,
                       original_context_length=4096), s


def random_layer(c: ModelConfig, seed: int = 0) -> LayerWeights:
    rng = np.random.default_rng(seed)

    def mat(out: int, inp: int) -> ConvWeight:
        q = rng.integers(-127, 128, (out, inp, 1, 1), dtype=np.int8)
        # scale so y = W x keeps unit variance: std(q) ~ 73, so scale ~ 1/(73 sqrt(in))
        scale = np.full((out, 1, 1, 1), 1.0 / (73.0 * np.sqrt(inp)), np.float16)
        return ConvWeight("int8-channel", (out, inp), q, scale, 1.0)

    d, f = c.hidden_size, c.ffn_size
    return LayerWeights(rng.uniform(0.8, 1.2, d).astype(np.float32), mat(c.qkv_rows, d),
                        mat(d, d), rng.uniform(0.8, 1.2, d).astype(np.float32), mat(2 * f, d),
                        mat(d, f))


def probe_block(package: Path, c: ModelConfig, max_seq: int, layout: str, backend: Backend,
                name: str, prefix: int = 8, seed: int = 0) -> GateReport:
    """Load one layer package, fill two states with the same prefix, compare T=4 with 4 x T=1.

    Passes are grouped by width (every T=4 call, then every T=1 call) and the prefix is a
    multiple of 4: under reshapeFrequency Infrequent, Core ML re-optimises for each new input
    shape (minutes at Phi size), so the probe switches shape once, not six times."""
    t0 = time.perf_counter()
    program = backend.load(package)
    load_s = time.perf_counter() - t0
    rope = make_rope_spec(rope_dims=c.rope_dims, freq_base=c.rope_freq_base,
                          attn_factor=c.rope_attn_factor,
                          original_context_length=c.original_context_length,
                          context_window=max_seq,
                          short_factors=np.ones(c.rope_dims // 2),
                          long_factors=np.ones(c.rope_dims // 2))
    dtype = np.float32 if backend.precision == "fp32" else np.float16
    host = HostInputs(rope, max_seq, dtype=dtype)
    rng = np.random.default_rng(seed)

    def rows(t: int) -> np.ndarray:
        """t random hidden rows in the package's layout."""
        x = rng.standard_normal((c.hidden_size, t)).astype(dtype)
        return x[None, :, :, None] if layout == "BCT1" else x[None, :, None, :]

    def timed_call(t: int) -> float:
        x, scratch = rows(t), program.make_state()
        t1 = time.perf_counter()
        program.predict({"x": x, **host.block(prefix, t)}, scratch)
        return 1000 * (time.perf_counter() - t1)

    if prefix % 4:
        raise ValueError(f"prefix {prefix} must be a multiple of 4 (one pass width)")
    states = [program.make_state(), program.make_state()]
    for st in states:  # the same prefix in both: reseeding makes the rows identical
        rng = np.random.default_rng(seed)
        for start in range(0, prefix, 4):
            program.predict({"x": rows(4), **host.block(start, 4)}, st)
    timings = {"load_s": load_s, "t4_call_ms": timed_call(4)}
    # block_vs_sequential: one T=4 call, then the T=1 calls; the T=1 timing follows them.
    cos, state_diff, _ = block_vs_sequential(program, host, layout, rows(4), prefix, *states)
    timings["t1_call_ms"] = timed_call(1)
    thresholds = block_thresholds(backend.precision)
    passed = float(cos.min()) >= thresholds["min_cosine"] and state_diff <= thresholds["state_rel_diff"]
    figures = {"min_cosine": float(cos.min()), "state_rel_diff": state_diff,
               "package_mb": _size_mb(package), **{k: round(v, 3) for k, v in timings.items()},
               "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1)}
    return GateReport(name, passed, backend.name, backend.precision, figures, thresholds,
                      {"token_cosine": [float(v) for v in cos], "package": str(package)})


def build_synthetic_t4(dims: str, out: Path, layout: str = "BCT1") -> tuple[Path, ModelConfig, int]:
    c, max_seq = synthetic_config(dims)
    prog = layer_program(0, [random_layer(c)], c, max_seq, layout)
    path = out / f"synthetic-t4-{dims}-{layout}.mlpackage"
    _save_fresh(prog, path)
    return path, c, max_seq


def build_gguf_layer(gguf: str | os.PathLike[str], layer: int, out: Path, max_seq: int,
                     layout: str = "BCT1", weights: str = "int8-channel"
                     ) -> tuple[Path, ModelConfig]:
    from ane_spec.model.gguf_file import open_gguf
    from ane_spec.shards.build import layer_weights

    model = open_gguf(gguf)
    c = model.config
    if not 0 <= layer < c.num_layers:
        from ane_spec.errors import AneSpecError

        raise AneSpecError(f"--layer {layer} is outside 0..{c.num_layers - 1}")
    prog = layer_program(layer, [layer_weights(model, layer, weights, {})], c, max_seq, layout)
    path = out / f"layer-{layer}-{layout}-{weights}.mlpackage"
    _save_fresh(prog, path)
    return path, c


def _save_fresh(prog, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".partial-" + path.name)  # coremltools insists on .mlpackage
    shutil.rmtree(tmp, ignore_errors=True)
    save_package(prog, tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def _size_mb(path: Path) -> float:
    return round(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20, 1)
