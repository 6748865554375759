"""Which layers go in which shard, and whether each shard fits the ANE's size budget.

Measured on Phi-4-mini (ane-book): a [0,20) int8 shard (~1.9 GiB, 1,921 MiB) stayed fully
ANE-resident, a [0,24) one (~2.3 GiB) compiled but ran 0/96 convs on the ANE. The edge lies
somewhere between, measured once, on one chip. The default budget of 1,750 MiB keeps the auto
topology about 10% under the largest shard seen resident, rather than at it: the 2,000 MiB it
replaced let the auto topology pick exactly that 1,921 MiB shard, with no margin for another
chip, another macOS, or the compiled model's own overhead.
"""

from __future__ import annotations

from ane_spec.errors import BuildError
from ane_spec.model.config import ModelConfig
from ane_spec.shards.weights import WeightFormat, estimate_bytes

DEFAULT_MAX_SHARD_MB = 1750
MIB = 1 << 20


def parse_topology(text: str | None, num_layers: int) -> list[tuple[int, int]] | None:
    """Parse `20,4,6,2` (layers per shard) or `0:20,20:24,...` (explicit ranges).

    Returns [first, last) ranges, or None for `auto`/None (plan by budget). Refuses any plan
    that skips or repeats a layer or runs past the model.
    """
    if text is None or text.strip().lower() == "auto":
        return None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise BuildError("empty --topology")
    try:
        if all(":" in p for p in parts):
            ranges = []
            for p in parts:
                a, b = (int(x) for x in p.split(":"))
                ranges.append((a, b))
        elif any(":" in p for p in parts):
            raise ValueError("mix of sizes and ranges")
        else:
            sizes = [int(p) for p in parts]
            if any(s <= 0 for s in sizes):
                raise BuildError(f"--topology {text}: every shard needs at least one layer")
            if sum(sizes) != num_layers:
                raise BuildError(f"--topology {text} covers {sum(sizes)} layers; the model has "
                                 f"{num_layers}, and every layer must be in exactly one shard")
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            ranges = [(a, a + s) for a, s in zip(starts, sizes)]
    except ValueError as exc:
        raise BuildError(f"--topology {text!r}: expected layer counts like 20,4,6,2 or ranges "
                         f"like 0:20,20:32 ({exc})") from None
    _check_cover(ranges, num_layers, text)
    return ranges


def _check_cover(ranges: list[tuple[int, int]], num_layers: int, text: str) -> None:
    owner: dict[int, int] = {}
    for n, (a, b) in enumerate(ranges):
        if not 0 <= a < b <= num_layers:
            raise BuildError(f"--topology {text}: range {a}:{b} is empty or outside the "
                             f"model's layers 0..{num_layers - 1}")
        for layer in range(a, b):
            if layer in owner:
                raise BuildError(f"--topology {text}: layer {layer} is in shard {owner[layer]} "
                                 f"and shard {n}; every layer must be in exactly one shard")
            owner[layer] = n
    missing = [layer for layer in range(num_layers) if layer not in owner]
    if missing:
        raise BuildError(f"--topology {text}: layers {_spans(missing)} are in no shard")
    if [a for a, _ in ranges] != sorted(a for a, _ in ranges):
        raise BuildError(f"--topology {text}: shards must be listed in layer order")


def _spans(layers: list[int]) -> str:
    spans, start = [], layers[0]
    for prev, cur in zip(layers, layers[1:] + [None]):
        if cur != prev + 1:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(spans)


def layer_bytes(c: ModelConfig, fmt: WeightFormat) -> int:
    """Stored bytes of one layer: four matrices (q|k|v and gate|up fused), fp16 norm vectors,
    and the architecture's fp16 q|k|v bias and per-head q/k norms."""
    d, f, a = c.hidden_size, c.ffn_size, c.architecture
    mats = [(c.qkv_rows, d), (d, c.q_dim), (2 * f, d), (d, f)]
    vectors = 2 * d + (c.qkv_rows if a.qkv_bias else 0) + (2 * c.head_dim if a.qk_norm else 0)
    return sum(estimate_bytes(o, i, fmt) for o, i in mats) + 2 * vectors


def plan_topology(c: ModelConfig, fmt: WeightFormat, max_shard_mb: int) -> list[tuple[int, int]]:
    """Fewest shards under the budget, filled greedily from the first layer."""
    per_layer = layer_bytes(c, fmt)
    per_shard = max_shard_mb * MIB // per_layer
    if per_shard < 1:
        raise BuildError(f"one layer needs {per_layer / MIB:,.2f} MiB, more than --max-shard-mb "
                         f"{max_shard_mb}")
    return [(a, min(a + per_shard, c.num_layers)) for a in range(0, c.num_layers, per_shard)]


def check_budget(ranges: list[tuple[int, int]], c: ModelConfig, fmt: WeightFormat,
                 max_shard_mb: int) -> None:
    per_layer = layer_bytes(c, fmt)
    for a, b in ranges:
        size = (b - a) * per_layer
        if size > max_shard_mb * MIB:
            fit = max_shard_mb * MIB // per_layer
            if fit < 1:
                raise BuildError(f"shard [{a},{b}) is over --max-shard-mb {max_shard_mb}: even "
                                 f"one layer needs {per_layer / MIB:,.2f} MiB of {fmt} weights")
            raise BuildError(
                f"shard [{a},{b}) would hold {size / MIB:,.0f} MiB of {fmt} weights, over "
                f"--max-shard-mb {max_shard_mb} (the measured ANE residency cliff is between "
                f"~1.9 and ~2.3 GiB; the default keeps a margin under it). Split it: at most {fit} "
                "layers per shard, e.g. --topology "
                + ",".join(str(b - a) for a, b in plan_topology(c, fmt, max_shard_mb))
                + ", or raise --max-shard-mb")


# The widest LM-head chunk known to stay resident: ane-book's Phi-4-mini head ran as 4 chunks of
# 50,016 output channels, fully on the ANE (ane-platform-notes.md; the "16384 per dimension" rule
# quoted elsewhere is contradicted by that measurement and not applied here).
MAX_HEAD_CHANNELS = 50_016


def min_head_chunks(vocab_size: int) -> int:
    """Fewest LM-head chunks that keep every chunk within MAX_HEAD_CHANNELS (chunks are split as
    evenly as np.linspace makes them, so the widest is ceil(vocab / chunks))."""
    return -(-vocab_size // MAX_HEAD_CHANNELS)


# The LM head's budget per package. ane-book ran Phi-4-mini's head as four separate packages of
# 50,016 x 3,072 int8 rows (146.6 MiB each with their per-channel scales), all fully
# ANE-resident (ane-platform-notes.md: "LM head shards with 50,016 output channels were fully
# resident"; seeds/003: "the existing batch-4 LM-head shards"). No bigger head program was
# measured, so this is the size known to work, not a measured edge: 160 MiB holds one such
# chunk, in int8 per channel or in the 8-bit LUT form auto falls back to (152.6 MiB: the same
# conv, 4% more bytes, not measured), and never two; the whole 586 MiB head in one program is
# what nobody has seen resident.
DEFAULT_MAX_HEAD_MB = 160.0
HEAD_PACKAGE_SOURCE = ("ane-book's Phi-4-mini head ran fully ANE-resident as separate packages "
                       "of 50,016 x 3,072 int8 rows, 146.6 MiB each; no larger head program "
                       "was measured")


def mib(size: int) -> str:
    """MiB to one decimal, or to three below 1 MiB (small test builds), never a bare 0.0."""
    return f"{size / MIB:,.1f}" if size >= MIB else f"{size / MIB:.3f}"


def head_chunk_bytes(chunks: list[tuple[int, int]], hidden_size: int,
                     fmt: WeightFormat) -> list[int]:
    """Estimated stored bytes of each LM-head chunk (auto costed as int8 per channel, as for
    shards; the build checks each package's real size after conversion)."""
    return [estimate_bytes(e - s, hidden_size, fmt) for s, e in chunks]


def plan_head_packages(sizes: list[int], max_head_mb: float) -> list[tuple[int, int]]:
    """Contiguous runs [first, last) of LM-head chunks, one per package, each within
    `max_head_mb`, filled greedily from the first chunk (the fewest packages: each package is
    one more prediction per pass). A chunk that alone is over the budget still gets a package of
    its own: `head_budget_problems` says so, and the build refuses it unless forced."""
    budget = max_head_mb * MIB
    groups: list[tuple[int, int]] = []
    first, total = 0, 0
    for i, size in enumerate(sizes):
        if i > first and total + size > budget:
            groups.append((first, i))
            first, total = i, 0
        total += size
    groups.append((first, len(sizes)))
    return groups


def head_budget_problems(chunks: list[tuple[int, int]], sizes: list[int], max_head_mb: float,
                         fmt: WeightFormat, hidden_size: int) -> list[str]:
    """Chunks too big for a head package of their own, with the --head-chunks that would fit."""
    budget = max_head_mb * MIB
    row = estimate_bytes(1, hidden_size, fmt)
    over = [(c, s) for c, s in zip(chunks, sizes) if s > budget]
    if not over:
        return []
    vocab = chunks[-1][1]
    rows_fit = int(budget // row)
    (s, e), size = over[0]
    if rows_fit < 1:
        advice = (f"even one vocabulary row needs {row / MIB:,.3f} MiB of {fmt} weights; raise "
                  "--max-head-mb")
    else:
        need = -(-vocab // rows_fit)
        advice = (f"use --head-chunks {need} or more (chunks of at most {rows_fit:,} rows), or "
                  "raise --max-head-mb")
    return [f"LM-head chunk [{s},{e}) holds {mib(size)} MiB of {fmt} weights, over "
            f"--max-head-mb {max_head_mb:g} ({HEAD_PACKAGE_SOURCE})"
            + (f", and so do {len(over) - 1} more chunk(s)" if len(over) > 1 else "")
            + f"; a package holds whole chunks, so {advice}"]
