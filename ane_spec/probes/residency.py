"""Where a package's ops run: Core ML's compute plan (macOS), and a static lint (anywhere).

`residency_report` is the measurement: it asks Core ML which device each op of the compiled
program prefers, and applies ane-book's gate: every `conv` and every other op Core ML dispatches
prefers the Neural Engine. Consts and `constexpr_*` weight decompression are weights, not work.
An op for which the plan returns no device usage (None) is not dispatched at all: const-like ops,
state reads, casts, identities. Apple's own tests and executorch's plan tool skip those; they are
reported as "unplanned", by op type, and do not fail the gate, except a `conv`: a conv is the work
the gate is about, so an undetermined one cannot count as on the ANE. `ane_lint` only reads the
package for patterns known to fall off the ANE; a clean lint is never a claim of residency.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ane_spec.ane_limits import ANE_MAX_SPATIAL, ARGMAX_NOTE, MAX_SEQ_SOURCE, Q8_BLOCK_SOURCE
from ane_spec.errors import AneSpecError
from ane_spec.runtime.coreml_backend import (
    check_compute_units,
    compile_package,
    hardware_problem,
    require_macos,
)
from ane_spec.shards.static_checks import read_package_facts
from ane_spec.shards.topology import (
    DEFAULT_MAX_HEAD_MB,
    DEFAULT_MAX_SHARD_MB,
    HEAD_PACKAGE_SOURCE,
    MIB,
)


@dataclass
class ResidencyReport:
    package: str
    compute_units: str
    conv_total: int = 0
    conv_non_ane: int = 0       # convs preferring another device, or with no planned device
    compute_total: int = 0      # ops with a planned device (convs included)
    compute_non_ane: int = 0
    unplanned: dict[str, int] = field(default_factory=dict)  # op type -> ops with usage None
    non_ane_ops: list[dict[str, Any]] = field(default_factory=list)
    # each {"op": type, "output": first output name, "device": preferred device, "cost": weight}
    # Why placement is unknown although the plan loaded (a stand-in for Core ML's native layer
    # reads structure only); None on real Core ML.
    undetermined: str | None = None
    argmax_devices: list[str] = field(default_factory=list)  # where each reduce_argmax goes

    @property
    def passed(self) -> bool:
        """Every planned op and every conv prefers the ANE; a plan with no planned op proves
        nothing, so it never passes."""
        return self.compute_total > 0 and self.conv_non_ane == 0 and self.compute_non_ane == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"passed": self.passed}


def residency_report(package: Path, compute_units: str = "CPU_AND_NE",
                     sha256: str | None = None) -> ResidencyReport:
    check_compute_units(compute_units)
    require_macos("the residency report")
    import coremltools as ct
    from coremltools.models.compute_plan import MLComputePlan

    compiled = compile_package(package, sha256)
    # MLComputePlan.load_from_path(path, compute_units) on the .mlmodelc (models/compute_plan.py)
    plan = MLComputePlan.load_from_path(str(compiled), compute_units=ct.ComputeUnit[compute_units])
    report = plan_residency(plan, str(package), compute_units)
    report.undetermined = hardware_problem()
    return report


def op_kind(operator_name: str) -> str:
    """`ios18.conv` -> `conv`: compiled programs may carry the opset in operator names."""
    return operator_name.rsplit(".", 1)[-1]


def plan_residency(plan: Any, package: str, compute_units: str) -> ResidencyReport:
    """Walk an `MLComputePlan` (coremltools' dataclasses in models/compute_plan.py, walked as
    test_compute_plan_utils.py does) and count where each op goes."""
    from coremltools.models.compute_device import MLNeuralEngineComputeDevice

    program = plan.model_structure.program
    if program is None:
        raise AneSpecError(f"{package} is not an ML program")
    report = ResidencyReport(package, compute_units)
    unplanned: Counter[str] = Counter()
    for op in program.functions["main"].block.operations:
        kind = op_kind(op.operator_name)
        if kind == "const" or kind.startswith("constexpr_"):
            continue  # weights and their decompression
        usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
        if kind == "reduce_argmax":  # --head-argmax: likely the CPU (ane_limits.ARGMAX_NOTE)
            report.argmax_devices.append("unplanned" if usage is None else
                                         type(usage.preferred_compute_device).__name__)
        is_conv = kind == "conv"
        report.conv_total += is_conv
        if usage is None:
            unplanned[kind] += 1
            if not is_conv:
                continue  # not dispatched: nothing runs anywhere
            device_name = "unplanned"
        else:
            report.compute_total += 1
            device = usage.preferred_compute_device
            if isinstance(device, MLNeuralEngineComputeDevice):  # as test_compute_plan_utils.py
                continue
            report.compute_non_ane += 1
            device_name = type(device).__name__
        report.conv_non_ane += is_conv
        cost = plan.get_estimated_cost_for_mlprogram_operation(op)  # MLComputePlanCost | None
        report.non_ane_ops.append({
            "op": op.operator_name, "output": op.outputs[0].name if op.outputs else "",
            "device": device_name, "cost": cost.weight if cost is not None else None})
    report.unplanned = dict(sorted(unplanned.items()))
    return report


# Lint codes that inform without failing the doctor's ane-lint check: a choice the user made
# knowingly whose placement only the compute plan can settle.
INFORMATIONAL_LINT = frozenset({"argmax"})


@dataclass
class LintWarning:
    package: str
    code: str
    message: str


def ane_lint(package: Path, *, max_shard_mb: int = DEFAULT_MAX_SHARD_MB,
             max_head_mb: float = DEFAULT_MAX_HEAD_MB) -> list[LintWarning]:
    """Patterns in the package known to keep ops off the ANE. Reads the spec, not the weights."""
    package = Path(package)
    facts = read_package_facts(package)
    found: list[LintWarning] = []

    def warn(code: str, message: str) -> None:
        found.append(LintWarning(str(package), code, message))

    blocked = [(name, scale) for name, data, scale in facts.blockwise if _per_block(data, scale)]
    if blocked:
        warn("per-block-scales", f"{len(blocked)} weight(s) have per-block scales (e.g. "
             f"'{blocked[0][0]}', scale shape {blocked[0][1]}): {Q8_BLOCK_SOURCE}; use "
             "int8-channel")
    longest = max((max(shape) for shape, _ in facts.states.values()), default=0)
    if longest > ANE_MAX_SPATIAL:
        warn("max-seq", f"a state axis is {longest:,} long, above {ANE_MAX_SPATIAL:,} "
             f"({MAX_SEQ_SOURCE})")
    if facts.ops["reduce_argmax"]:
        warn("argmax", f"{facts.ops['reduce_argmax']} reduce_argmax op(s): {ARGMAX_NOTE}")
    for name, (shape, _) in facts.states.items():
        if any(d != 1 and d % 32 for d in shape[-2:]):
            warn("state-dim-not-32", f"state '{name}' has shape {shape}: a state dimension that "
                 "is not a multiple of 32 fails on the ANE (coremltools #2631)")
    flexible = {n for n, (_, ranges) in facts.inputs.items() if any(a != b for a, b in ranges)}
    fixed = set(facts.inputs) - flexible - set(facts.enumerated_inputs)
    if facts.states and flexible and fixed:
        warn("mixed-fixed-range", f"stateful program mixes fixed-shape inputs {sorted(fixed)} "
             f"with RangeDim inputs {sorted(flexible)}: crashes Core ML (coremltools #2548)")
    if facts.states and facts.enumerated_inputs:
        warn("enumerated-shapes-state", f"inputs {facts.enumerated_inputs} use EnumeratedShapes "
             "in a stateful program: fails with std::bad_cast; use one RangeDim")
    if facts.ops["topk"]:
        warn("topk", f"{facts.ops['topk']} topk op(s): topk runs on the CPU")
    int64 = sorted(n for n, dtype in facts.output_dtypes.items() if dtype == "int64")
    if int64:
        warn("int64", f"{len(int64)} int64 tensor(s) (e.g. '{int64[0]}'): the ANE has no int64")
    size = sum(p.stat().st_size for p in package.rglob("*") if p.is_file())
    if size > max_shard_mb * MIB:
        warn("oversize", f"package is {size / MIB:,.1f} MiB, over {max_shard_mb} MiB: shards "
             "above ~1.9-2.3 GiB compiled but ran off the ANE (measured, Phi-4-mini)")
    # An LM head (no states, only per-chunk outputs) bigger than any head measured resident,
    # e.g. one built before heads were split: `build --force` splits it.
    head = not facts.states and bool(facts.outputs) and all(
        o.startswith(("logits_", "max_", "argmax_")) for o in facts.outputs)
    if head and size > max_head_mb * MIB:
        warn("head-oversize", f"LM-head package is {size / MIB:,.1f} MiB, over {max_head_mb:g} "
             f"MiB ({HEAD_PACKAGE_SOURCE}); rebuild it with `build --force` to split it into "
             "packages under --max-head-mb")
    return found


def _per_block(data: list[int], scale: list[int]) -> bool:
    """More than per-tensor or one-scale-per-row-of-one-axis: several scales along an axis that
    are not one per element, or scales along more than one axis."""
    split = [(d, s) for d, s in zip(data, scale) if s != 1]
    return len(split) > 1 or any(s != d for d, s in split)
