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
    """Stored bytes of one layer: four matrices plus two fp16 norm vectors."""
    d, f = c.hidden_size, c.ffn_size
    mats = [(c.qkv_rows, d), (d, d), (2 * f, d), (d, f)]
    return sum(estimate_bytes(o, i, fmt) for o, i in mats) + 2 * 2 * d


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
