"""Where a package's ops run: Core ML's compute plan (macOS), and a static lint (anywhere).

`residency_report` is the measurement: it asks Core ML which device each op of the compiled
program prefers, and applies the gate as ane-book ran it: every `conv` prefers the Neural Engine,
and the Neural Engine carries at least MIN_ANE_COST_SHARE of the plan's estimated cost; every op
off it is listed with its cost rather than failing a correct build over a `reshape` on the CPU.
`strict` (`--strict`) asks for every op Core ML dispatches on the Neural Engine. Consts and
`constexpr_*` weight decompression are weights, not work.
An op for which the plan returns no device usage (None) is not dispatched at all: const-like ops,
state reads, casts, identities. Apple's own tests and executorch's plan tool skip those; they are
reported as "unplanned", by op type, and do not fail the gate, except a `conv`: a conv is the work
the gate is about, so an undetermined one cannot count as on the ANE. `ane_lint` only reads the
package for patterns known to fall off the ANE; a clean lint is never a claim of residency.

A layer package with a prefill function holds two programs (`main` at the decode shape,
`prefill` at T = P). Core ML plans a compiled model with no function name set (coremltools 9.0
CoreMLPython.mm, Model::getComputePlan) and its structure lists every function by name
(toPythonObject(MLModelStructureProgram); models/compute_plan.py
`MLModelStructureProgram.functions`), so one plan per package is walked once per function
(`residency_reports`), each function with its own verdict: the prefill function's ops at T = P are
different ops from the decode function's at T = 4, and either may leave the ANE alone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ane_spec.ane_limits import (
    ANE_MAX_ARGMAX_CHANNELS,
    ANE_MAX_REDUCTION,
    ANE_MAX_SPATIAL,
    ARGMAX_NOTE,
    ARGMAX_SOURCE,
    MAX_SEQ_SOURCE,
    Q8_BLOCK_SOURCE,
    REDUCTION_SOURCE,
)
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


# The share of a program's estimated cost (MLComputePlan's per-op cost weights) that must run on
# the Neural Engine, with every conv there, for the default gate to pass. Our stated bar, not a
# figure from Apple: an op off the ANE costs a round trip, and a few percent of the work is
# where a reshape, a cast or a state read lands; --strict asks for every op.
MIN_ANE_COST_SHARE = 0.95


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
    function: str = "main"  # which of the package's functions this is about
    # Why the plan says nothing of this function at all (its structure lacks it): never a pass.
    not_in_plan: str | None = None

    # Estimated cost (MLComputePlanCost.weight: each op's share of the program's) of the
    # planned ops, and of those on the ANE; an op whose cost the plan does not give adds to
    # `uncosted` instead.
    total_cost: float = 0.0
    ane_cost: float = 0.0
    uncosted: int = 0
    strict: bool = False  # --strict: every planned op on the ANE, whatever it costs
    min_ane_cost_share: float = 0.0  # set from MIN_ANE_COST_SHARE by plan_residency

    @property
    def ane_cost_share(self) -> float | None:
        """The ANE's share of the planned ops' estimated cost (None: no costs given)."""
        return self.ane_cost / self.total_cost if self.total_cost > 0 else None

    @property
    def passed(self) -> bool:
        """Every conv prefers the ANE, and (the gate as ane-book ran it) the ANE carries at
        least `min_ane_cost_share` of the estimated cost, with every op off it costed: a
        `reshape` on the CPU does not fail a build whose work is on the ANE; each op off it is
        listed in `non_ane_ops` with its cost. `strict`: every planned op on the ANE. A plan
        with no planned op proves nothing, so it never passes."""
        if self.compute_total == 0 or self.conv_non_ane or self.not_in_plan is not None:
            return False
        if self.strict or self.compute_non_ane == 0:
            return self.compute_non_ane == 0
        share = self.ane_cost_share
        uncosted_off = any(o["cost"] is None for o in self.non_ane_ops)
        return not uncosted_off and share is not None and share >= self.min_ane_cost_share

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"passed": self.passed, "ane_cost_share": self.ane_cost_share}


def residency_report(package: Path, compute_units: str = "CPU_AND_NE",
                     digest: str | None = None, function: str = "main",
                     strict: bool = False) -> ResidencyReport:
    """One function of the package (its default, `main`, unless named)."""
    plan = _load_plan(package, compute_units, digest)
    report = plan_residency(plan, str(package), compute_units, function, strict)
    report.undetermined = hardware_problem()
    return report


def residency_reports(package: Path, compute_units: str = "CPU_AND_NE",
                      digest: str | None = None, strict: bool = False
                      ) -> list[ResidencyReport]:
    """Every function of the package, default first, from one compute plan."""
    from ane_spec.package_spec import package_functions, read_spec

    functions = package_functions(read_spec(package))
    plan = _load_plan(package, compute_units, digest)
    reports = [plan_residency(plan, str(package), compute_units, f, strict) for f in functions]
    for report in reports:
        report.undetermined = hardware_problem()
    return reports


def _load_plan(package: Path, compute_units: str, digest: str | None) -> Any:
    check_compute_units(compute_units)
    require_macos("the residency report")
    import coremltools as ct
    from coremltools.models.compute_plan import MLComputePlan

    compiled = compile_package(package, digest)
    # MLComputePlan.load_from_path(path, compute_units) on the .mlmodelc (models/compute_plan.py)
    return MLComputePlan.load_from_path(str(compiled),
                                        compute_units=ct.ComputeUnit[compute_units])


def op_kind(operator_name: str) -> str:
    """`ios18.conv` -> `conv`: compiled programs may carry the opset in operator names."""
    return operator_name.rsplit(".", 1)[-1]


def plan_residency(plan: Any, package: str, compute_units: str,
                   function: str = "main", strict: bool = False) -> ResidencyReport:
    """Walk one function of an `MLComputePlan` (coremltools' dataclasses in
    models/compute_plan.py, walked as test_compute_plan_utils.py does) and count where each op
    goes."""
    from coremltools.models.compute_device import MLNeuralEngineComputeDevice

    program = plan.model_structure.program
    if program is None:
        raise AneSpecError(f"{package} is not an ML program")
    report = ResidencyReport(package, compute_units, function=function, strict=strict,
                             min_ane_cost_share=MIN_ANE_COST_SHARE)
    if function not in program.functions:
        report.not_in_plan = (f"the compute plan has no function '{function}' (it has "
                              f"{', '.join(sorted(program.functions))}): its placement is "
                              "unknown")
        return report
    unplanned: Counter[str] = Counter()
    for op in program.functions[function].block.operations:
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
            cost = plan.get_estimated_cost_for_mlprogram_operation(op)
        else:
            report.compute_total += 1
            device = usage.preferred_compute_device
            cost = plan.get_estimated_cost_for_mlprogram_operation(op)  # MLComputePlanCost|None
            if cost is None:
                report.uncosted += 1
            else:
                report.total_cost += cost.weight
            if isinstance(device, MLNeuralEngineComputeDevice):  # as test_compute_plan_utils.py
                report.ane_cost += cost.weight if cost is not None else 0.0
                continue
            report.compute_non_ane += 1
            device_name = type(device).__name__
        report.conv_non_ane += is_conv
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
    function: str = "main"  # the package's function it was found in (weights and states: main)


def ane_lint(package: Path, *, max_shard_mb: int = DEFAULT_MAX_SHARD_MB,
             max_head_mb: float = DEFAULT_MAX_HEAD_MB) -> list[LintWarning]:
    """Patterns in the package known to keep ops off the ANE. Reads the spec, not the weights.
    What the package shares between its functions (weights, states, its size) is read once;
    the programs themselves are read function by function, at their own shapes (a prefill
    function's ops at T = P)."""
    from ane_spec.package_spec import package_functions, read_spec

    package = Path(package)
    functions = package_functions(read_spec(package))
    facts = read_package_facts(package, functions[0])
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
    for name, (shape, _) in facts.states.items():
        if any(d != 1 and d % 32 for d in shape[-2:]):
            warn("state-dim-not-32", f"state '{name}' has shape {shape}: a state dimension that "
                 "is not a multiple of 32 fails on the ANE (coremltools #2631)")
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
    for function in functions:
        program = facts if function == functions[0] else read_package_facts(package, function)
        where = "" if function == functions[0] else f"function '{function}': "
        found += [LintWarning(str(package), code, where + message, function)
                  for code, message in program_lint(program)]
    return found


def program_lint(facts) -> list[tuple[str, str]]:  # noqa: ANN001 - static_checks.PackageFacts
    """(code, message) for each pattern known to keep one function's ops off the ANE, read at
    that function's own shapes: a prefill function at T = P has wider ops than the decode
    function at T = 4 (the attention's [1, kv, G x P, S] scores), so every limit that depends
    on a shape is checked per function, with the source of its figure (ane_limits)."""
    found: list[tuple[str, str]] = []
    if facts.ops["reduce_argmax"]:
        found.append(("argmax", f"{facts.ops['reduce_argmax']} reduce_argmax op(s): "
                      f"{ARGMAX_NOTE}"))
    flexible = {n for n, (_, ranges) in facts.inputs.items() if any(a != b for a, b in ranges)}
    fixed = set(facts.inputs) - flexible - set(facts.enumerated_inputs)
    if facts.states and flexible and fixed:
        found.append(("mixed-fixed-range", f"stateful program mixes fixed-shape inputs "
                      f"{sorted(fixed)} with RangeDim inputs {sorted(flexible)}: crashes Core ML "
                      "(coremltools #2548)"))
    if facts.states and facts.enumerated_inputs:
        found.append(("enumerated-shapes-state", f"inputs {facts.enumerated_inputs} use "
                      "EnumeratedShapes in a stateful program: fails with std::bad_cast; use one "
                      "RangeDim"))
    if facts.ops["topk"]:
        found.append(("topk", f"{facts.ops['topk']} topk op(s): topk runs on the CPU"))
    int64 = sorted(n for n, dtype in facts.output_dtypes.items() if dtype == "int64")
    if int64:
        found.append(("int64", f"{len(int64)} int64 tensor(s) (e.g. '{int64[0]}'): the ANE "
                      "has no int64"))
    wide = [(name, op, shape) for name, (op, shape) in facts.output_shapes.items()
            if max(shape[-2:], default=0) > ANE_MAX_SPATIAL]
    if wide:
        name, op, shape = wide[0]
        found.append(("width", f"{len(wide)} op output(s) wider than {ANE_MAX_SPATIAL:,} on a "
                      f"spatial axis (e.g. '{name}', {op} {shape}): {MAX_SEQ_SOURCE}"))
    deep = [r for r in facts.reductions if r[2] > ANE_MAX_REDUCTION]
    if deep:
        name, op, depth = deep[0]
        found.append(("reduction-depth", f"{len(deep)} conv/matmul op(s) sum over more than "
                      f"{ANE_MAX_REDUCTION:,} inputs (e.g. '{name}', {op} over {depth:,}): "
                      f"{REDUCTION_SOURCE}"))
    searched = [a for a in facts.argmax_widths if a[1] > ANE_MAX_ARGMAX_CHANNELS]
    if searched:
        name, width = searched[0]
        found.append(("argmax-width", f"{len(searched)} reduce_argmax op(s) search more than "
                      f"{ANE_MAX_ARGMAX_CHANNELS:,} values (e.g. '{name}', {width:,}): "
                      f"{ARGMAX_SOURCE}"))
    return found


def _per_block(data: list[int], scale: list[int]) -> bool:
    """More than per-tensor or one-scale-per-row-of-one-axis: several scales along an axis that
    are not one per element, or scales along more than one axis."""
    split = [(d, s) for d, s in zip(data, scale) if s != 1]
    return len(split) > 1 or any(s != d for d, s in split)
