"""Do `equal`, `greater_equal`, `select` and `clip` mean on this device what the select mask form
needs, and do they run on the Neural Engine? The answer picks `--mask-form` (issue 28 item 6).

No peer has shown `select`, `equal` or `greater_equal` on the ANE (Anemll, ml-ane-transformers
and ane-book use clip and additive masks only). The select form (shards/layer_graph.py) runs
clip -> equal -> select twice and a select mask per layer: exact whatever an overflowing row
holds, but three round trips a layer if those ops fall to the CPU. The additive form uses
clip and add only, and gives up that exactness (layer_graph's docstring says what it keeps).

One small program, built from the layer graph's own functions (`finite_rows`, `hide_slots`) on
layer-like shapes, runs on the device with K-row-like values holding NaN and +-inf and with
the host's mask rows, and each output is compared bit for bit with what the op must give:

- `equal(x, x)` is false exactly at NaN (and true at +-inf);
- `greater_equal(mask, 0)` marks the visible slots;
- `select(visible, x, HIDDEN_SCORE)` picks x where visible, HIDDEN_SCORE where hidden, whatever
  x holds (inf or NaN included);
- `clip(x, -65504, 65504)` saturates +-inf and changes no finite value (what it makes of NaN is
  recorded: IEEE leaves it to the implementation, and a clip that drops NaN would clean rows);
- `finite_rows(x)`: the select form's whole K/V clean-up, NaN -> 0 and inf -> +-65504.

Placement comes only from the compute plan of the build's first layer shard, for the ops it
holds (`--manifest`): a small standalone program is placed on the CPU whatever its ops (issue
35), so the probe program's own plan would advise against ops that run on the ANE inside a
layer. Without a build the check reports the op results and says that placement needs
`--manifest`. The probe runs through the backend (the Core ML worker, with the bridge's input-
lifetime rule), as the pipeline's programs do.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ane_spec.runtime.host_inputs import MASK_VALUE

# The select form's ops whose placement and meaning decide the mask form; clip both forms use.
SELECT_OPS = ("equal", "greater_equal", "select")
CHECKED_OPS = (*SELECT_OPS, "clip", "finite_rows")
CHANNELS, T, S = 32, 4, 64
FP16_MAX = float(np.finfo(np.float16).max)


@dataclass
class OpResult:
    right: bool
    wrong: int          # elements that differ from what the op must give
    example: str        # the first wrong element, or ""


def probe_inputs(seed: int = 0) -> dict[str, np.ndarray]:
    """K-row-like values with NaN, +inf and -inf spread through them, and the host's mask rows
    (row t sees slots 0..40+t, hides the rest with MASK_VALUE)."""
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((1, CHANNELS, T, S)) * 1000).astype(np.float16)
    flat = rows.reshape(-1)
    flat[0::7], flat[1::7], flat[2::7] = np.nan, np.inf, -np.inf
    flat[3::11], flat[4::11] = FP16_MAX, -FP16_MAX  # the largest finite: clip keeps them
    mask = np.zeros((1, 1, T, S), np.float16)
    for t in range(T):
        mask[0, 0, t, 41 + t:] = MASK_VALUE
    return {"rows": rows, "mask": mask}


def build_probe(path: Path) -> Path:
    """The probe program, saved as an ML program package at `path`."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    from ane_spec.shards.layer_graph import finite_rows, hide_slots
    from ane_spec.shards.programs import OPSET, save_package

    @mb.program(input_specs=[mb.TensorSpec((1, CHANNELS, T, S), dtype=types.fp16),
                             mb.TensorSpec((1, 1, T, S), dtype=types.fp16)],
                opset_version=OPSET)
    def prog(rows, mask):
        # bool results leave the program as fp16 0/1 (a cast): Core ML outputs are arrays.
        same = mb.equal(x=rows, y=rows)
        visible = mb.greater_equal(x=mask, y=np.float16(0.0))
        return (mb.cast(x=same, dtype="fp16", name="equal"),
                mb.cast(x=visible, dtype="fp16", name="greater_equal"),
                mb.identity(x=hide_slots(rows, visible), name="select"),
                mb.clip(x=rows, alpha=np.float16(-FP16_MAX), beta=np.float16(FP16_MAX),
                        name="clip"),
                finite_rows(rows, "finite_rows"))

    save_package(prog, path)  # every input shape is fixed: no RangeDim
    return path


def expected_outputs(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from ane_spec.shards.layer_graph import HIDDEN_SCORE

    rows = inputs["rows"].astype(np.float32)
    visible = inputs["mask"].astype(np.float32) >= 0
    return {
        "equal": (~np.isnan(rows)).astype(np.float32),
        "greater_equal": visible.astype(np.float32),
        "select": np.where(visible, rows, np.float32(HIDDEN_SCORE)),
        "clip": np.clip(rows, -FP16_MAX, FP16_MAX),  # NaN stays NaN: judged apart
        "finite_rows": np.nan_to_num(rows, nan=0.0, posinf=FP16_MAX, neginf=-FP16_MAX),
    }


def judge(outputs: dict[str, np.ndarray], inputs: dict[str, np.ndarray]
          ) -> tuple[dict[str, OpResult], str]:
    """Each op's output against what it must give, bit for bit (NaN where NaN is due); and what
    clip made of NaN (informational)."""
    want = expected_outputs(inputs)
    nan_in = np.isnan(inputs["rows"])
    results = {}
    for name in CHECKED_OPS:
        got = np.asarray(outputs[name], np.float32).reshape(want[name].shape)
        due = want[name]
        care = ~nan_in if name == "clip" else np.ones(due.shape, bool)
        same = (got == due) | (np.isnan(got) & np.isnan(due))
        bad = np.flatnonzero(~same & care)
        example = ""
        if bad.size:
            i = int(bad[0])
            x = float(inputs["rows"].reshape(-1)[i]) if got.size == nan_in.size else None
            example = f"element {i}: got {got.reshape(-1)[i]!r}, want {due.reshape(-1)[i]!r}" + (
                f" (input {x!r})" if x is not None else "")
        results[name] = OpResult(bad.size == 0, int(bad.size), example)
    clipped_nan = np.asarray(outputs["clip"], np.float32).reshape(nan_in.shape)[nan_in]
    kinds = sorted({"NaN" if np.isnan(v) else repr(float(v)) for v in clipped_nan})
    return results, f"clip(NaN) -> {', '.join(kinds)}"


def placements(report: Any, present: set[str] | None = None) -> dict[str, str]:
    """Where each op kind of a package is planned, from its `ResidencyReport`: the device class
    name(s) off the Neural Engine, "NeuralEngine", or "unplanned" (the plan gave no device).
    `present`: the op kinds the package holds (None: all four, as the probe program does)."""
    from ane_spec.probes.residency import op_kind

    found: dict[str, str] = {}
    for kind in ("equal", "greater_equal", "select", "clip"):
        if present is not None and kind not in present:
            continue
        off = sorted({o["device"] for o in report.non_ane_ops if op_kind(o["op"]) == kind})
        if off:
            found[kind] = "/".join(d.removeprefix("ML").removesuffix("ComputeDevice")
                                   for d in off)
        elif report.unplanned.get(kind):
            found[kind] = "unplanned"
        else:
            found[kind] = "NeuralEngine"
    return found


def recommend(results: dict[str, OpResult], where: dict[str, str], built: bool = True
              ) -> tuple[str | None, str]:
    """`select` when its ops are right and planned on the Neural Engine; `additive` when one is
    wrong or planned elsewhere (with the reason); None when placement is not known here: no
    build (`built` False: a standalone probe's placement says nothing, small programs go to
    the CPU whatever their ops), or a build whose shard does not hold the select form's ops."""
    wrong = [op for op in (*SELECT_OPS, "finite_rows") if not results[op].right]
    if wrong:
        return "additive", (f"{', '.join(wrong)} wrong on this device: the select form's "
                            "exactness rests on them")
    if not built:
        return None, ("placement needs --manifest: only a build shard's compute plan says where "
                      "these ops run (a small standalone program is placed on the CPU whatever "
                      "its ops); select, the exact default, until then")
    off = [f"{op} on {where[op]}" for op in SELECT_OPS
           if where.get(op) not in (None, "NeuralEngine", "unplanned")]
    if off:
        return "additive", (f"{', '.join(off)}: the select form would leave the Neural Engine "
                            "three times a layer")
    absent = [op for op in SELECT_OPS if op not in where]
    if absent:
        return None, (f"the build's shard holds no {', '.join(absent)} (an additive-form "
                      "build?): build with --mask-form select to place them")
    unknown = [op for op in SELECT_OPS if where[op] == "unplanned"]
    if unknown:
        return None, (f"placement of {', '.join(unknown)} not planned here: no recommendation "
                      "(select, the exact default, until a Mac's compute plan says)")
    return "select", ("equal, greater_equal and select are right and planned on the Neural "
                      "Engine: the exact form costs nothing here")


def to_details(results: dict[str, OpResult], clip_nan: str, where: dict[str, str],
               source: dict[str, str], form: str | None, reason: str) -> dict[str, Any]:
    return {"semantics": {k: asdict(v) for k, v in results.items()}, "clip_nan": clip_nan,
            "placement": where, "placement_source": source, "recommended_mask_form": form,
            "reason": reason}
