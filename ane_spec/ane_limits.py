"""Limits of the Apple Neural Engine this toolchain knows of, each with where its figure comes
from. `build`, `ane_lint` (and through it `probe residency` and the doctor) and the Core ML
pipeline all read them from here, so a figure and its source are stated once.

None of these is measured by this project's tests (there is no Mac in CI); they are the figures
the sources give, and the messages say so.
"""

from __future__ import annotations

import os

# The ANE's largest spatial dimension, as ANEMLL's model code uses it (cited by issue 18's
# audit). The K/V states' sequence axis is max_seq long, so --max-seq above it leaves the ANE.
# `ane_lint` also checks the last two axes of every op output, in each function at its own
# shape: a prefill function's attention scores are [1, kv, G x P, S] (G query heads per K/V head).
ANE_MAX_SPATIAL = 16384
MAX_SEQ_SOURCE = "ANEMLL's model code: the ANE's spatial dimensions stop at 16,384"

# Reduction depth: a matmul/conv whose input dimension (the sum's length) exceeds this did not
# run on the ANE in chrishayuk/larql#312 (Qwen2.5-7B's FFN down projection, 18,944 inputs). The
# build splits such a conv into partial sums over input chunks of at most this many channels
# (layer_graph.conv_in_chunks) rather than refuse it.
ANE_MAX_REDUCTION = 16384
REDUCTION_SOURCE = ("chrishayuk/larql#312: a matmul reducing over more than 16,384 inputs "
                    "(Qwen2.5-7B's FFN down projection, 18,944) does not run on the ANE")

# The in-model argmax: Anemll keeps each argmax over at most 16,384 channels (indices <= 16,383),
# "ANE doesn't support int32 for argmax". --head-argmax builds use vocabulary chunks no wider.
ANE_MAX_ARGMAX_CHANNELS = 16384
ARGMAX_SOURCE = ("Anemll keeps in-model argmax indices <= 16,383 (\"ANE doesn't support int32 "
                 "for argmax\")")

# `build --force-ane-limits`: build what these limits refuse, for someone who knows better.
FORCE_ANE_LIMITS_FLAG = "--force-ane-limits"

# Per-block weight scales: a coremltools issue and an Apple models-repo issue report *wrong
# output* on the ANE (cosine 0.37), not only CPU fallback (coremltools #2510 for the fallback).
Q8_BLOCK_SOURCE = ("per-block scales are reported to give wrong output on the ANE (cosine "
                   "0.37 in a coremltools issue and an Apple models-repo issue), not only CPU "
                   "fallback (coremltools #2510)")
FORCE_Q8_BLOCK_ENV = "ANE_SPEC_FORCE_Q8_BLOCK_ON_ANE"
ANE_COMPUTE_UNITS = ("CPU_AND_NE", "ALL")

# A head with --head-argmax ends in reduce_argmax over a vocabulary chunk (at most 16,384 wide,
# ANE_MAX_ARGMAX_CHANNELS) with an int32 output: an op ending in an integer is one the ANE
# compiler may leave to the CPU. Not measured; the doctor's residency check says where it lands.
ARGMAX_NOTE = ("reduce_argmax over a vocabulary chunk (at most 16,384 wide) with an int32 output "
               "may run on the CPU (not measured; `ane-spec doctor` reports where it lands)")

# --decode-shape mixed changes T every pass, so it loads every package with reshapeFrequency
# Frequent. Apple's flexible-input guide: only Infrequent lets a flexible-shape model run on the
# Neural Engine; coremltools #2600 shows a stateful RangeDim LLM running wholly on the CPU.
# MLComputePlan in coremltools 9.0 takes no hints, so only a measurement says where it runs
# (the doctor's decode-shape check).
MIXED_SHAPE_SOURCE = ("Apple's flexible-input guide: only reshapeFrequency Infrequent lets "
                      "flexible shapes run on the Neural Engine; coremltools #2600: a stateful "
                      "RangeDim LLM ran wholly on the CPU")
MIXED_SHAPE_NOTE = ("--decode-shape mixed loads with reshapeFrequency Frequent and is expected "
                    f"to run off the ANE ({MIXED_SHAPE_SOURCE})")

# Host memory at or below which the doctor's ane-vs-cpu check (a second, CPU_ONLY copy of the
# whole build) may push a Phi-size build into swap.
SMALL_MAC_BYTES = 16 * 10**9


def max_seq_problem(max_seq: int) -> str | None:
    if max_seq <= ANE_MAX_SPATIAL:
        return None
    return (f"--max-seq {max_seq} is above {ANE_MAX_SPATIAL:,}, the ANE's spatial limit "
            f"({MAX_SEQ_SOURCE}): the attention and K/V states will run off the ANE")


def ane_limit_refusals(max_seq: int) -> list[str]:
    """What `build` refuses, because the ANE cannot take it, unless --force-ane-limits."""
    found = []
    if max_seq > ANE_MAX_SPATIAL:
        found.append(f"--max-seq {max_seq} is wider than {ANE_MAX_SPATIAL:,}, the ANE's largest "
                     f"width ({MAX_SEQ_SOURCE}; FluidInference/mobius#61): the attention and "
                     f"K/V states would run off the ANE")
    return found


def q8_block_refusal(weights: str, compute_units: str) -> str | None:
    """Why q8-block weights must not run on `compute_units`, unless the user forced it."""
    if weights != "q8-block" or compute_units not in ANE_COMPUTE_UNITS:
        return None
    if os.environ.get(FORCE_Q8_BLOCK_ENV) == "1":
        return None
    return (f"this build has q8-block weights and Core ML would run it on {compute_units}: "
            f"{Q8_BLOCK_SOURCE}. Rebuild with --weights int8-channel, use CPU_ONLY, or set "
            f"{FORCE_Q8_BLOCK_ENV}=1 to run it anyway")


def build_warnings(max_seq: int, weights: str, head_argmax: bool) -> list[str]:
    """What `build` says about a request that builds fine but will not sit well on the ANE."""
    found = []
    problem = max_seq_problem(max_seq)
    if problem:
        found.append(problem)
    if weights == "q8-block":
        found.append(f"--weights q8-block: {Q8_BLOCK_SOURCE}; Core ML on CPU_AND_NE refuses "
                     f"this build unless {FORCE_Q8_BLOCK_ENV}=1")
    if head_argmax:
        found.append(f"--head-argmax: {ARGMAX_NOTE}")
    return found
