"""One transformer layer as MIL ops, laid out for the ANE, with a T-row KV scatter.

Channels-first 4-D tensors and 1x1 convs (Apple's ml-ane-transformers rules). The token axis T
(1..4) is symbolic, so one program serves T=1 decode and T=4 verification. One graph serves
every architecture; layer_weights.py maps each family's tensors onto it. Per layer:

    a   = rmsnorm(x)                          layer_norm(concat([x, -x])) keeps fp16 in range
    qkv = conv(a) (+ bias); q, k, v = split   heads -> [1, H, T, hd]      (bias: qwen2)
    q, k = rmsnorm(q), rmsnorm(k) per head    over head_dim               (qwen3)
    q, k = rope(q), rope(k)                   host cos/sin [T, rot/2], attn factor included
                                              (NEOX; NORM files arrive with q/k rows reordered)
    k, v = finite(k), finite(v)               inf -> +-65504, NaN -> 0 (see below)
    K = K * (1 - rowsum(W)) + W @ k           W = kv_write_mask [1, 1, S, T]: T one-hot rows
                                              (--kv-write slice: over a window only, below)
    s = select(visible, q K^T / sqrt(hd), -32768)   over all S slots, GQA by reshaping q's heads
    o = softmax(s) V
    x = x + conv(o as [head, dim, token])     the flatten order seeds/003 got wrong once
    x = x + conv(silu(g) * u), (g, u) = split(conv(rmsnorm(x)))

Gemma 3 (flags of its Architecture, so no other family's program changes by one op): the q
scale is the config's (1/sqrt(key_length)); each branch output is RMS-normed before it is added
(`post_attention_norm`, `post_ffw_norm`); the gate goes through tanh-GELU; and a local
(sliding-window) layer reads the `_local` RoPE tables and visibility mask instead of the global
ones. Its K/V state is a ring of W + 4 (rounded to 32) slots written at position mod ring
(model/swa_ring.py): the shard hands it its own write mask and keep (`BlockInputs.local`), so
`scatter_rows` and `attention` run unchanged over the ring's slots. Built with swa_ring=False,
it keeps a full-length state instead, the host's local mask hiding what left its window.

Every op is fp16, softmax included: the Neural Engine computes only fp16, and one fp32-typed op
sends its layer to the CPU and back (coremltools' typed-execution guide). The build's static
checks refuse any fp32 value in a saved program.

Finite by construction: every pass computes rows that must change nothing (padding, probe
fillers) and rows whose writes are thrown away (rejected drafts), and their activations can
overflow fp16. The scatter multiplies every row by the write mask's zeros, and 0 x inf = NaN,
so one unclean row would poison every slot, for good (`state * keep` cannot clean a NaN). So the
K/V rows are made finite before the scatter (`finite_rows`), and the attention mask selects
instead of adding: a hidden slot's score is replaced, whatever it holds, where an additive mask
loses to any score more than |mask| above the row's visible ones.

Two mask forms (`GraphVariant.mask_form`, `ane-spec build --mask-form`). `select` is the above.
No peer has shown `select`, `equal` or `greater_equal` on the ANE; if they fall to the CPU each
layer pays three round trips. `additive` uses only what Anemll, ml-ane-transformers and ane-book
run there: `finite_rows` is `clip` alone, and the host's mask (0 visible, MASK_VALUE = -32768
hidden) is added to the scores. Why -32768 (fp16; B bounds |score| over a row's slots): a hidden
slot's `score + M` is at most B + M, and exp gives exactly 0 below -17.33 (fp16's smallest
subnormal is 2^-24 = e^-16.6, and e^x under half of it rounds to 0), so hidden weights are 0 when
B + M - (-B) < -17.4, i.e. B < (|M| - 17.4) / 2; and the softmax's `score + M - max` stays
finite (no value of the program relies on how a device treats inf) when -B + M - B > -65504,
i.e. B < (65504 - |M|) / 2. M = -32768 balances the two: both hold for every |score| < 16368
(and the power of two is exact in fp16). Exactness against `select`: where every K/V row is
finite and every score has |score| < 16368, a visible score + 0 is the same value, a hidden
slot's term is exactly 0 in both forms, so the row maximum, the sum and every weight are the
same bits, and 0 x finite V = 0 in both: the outputs are bitwise identical
(tests/test_mask_form.py compares logits and tokens through the fp16 interpreter). What
`additive` loses: (1) a NaN row (an overflowing padding row or rejected draft: inf turns to NaN
at the next layer_norm) passes `clip`, and the scatter's 0 x NaN poisons every slot of the
cache for good; (2) a hidden score more than ~32750 above the row's largest visible one (inf,
from a slot holding FP16_MAX K rows) gets weight, or NaN. The overflow probe shows both and
reports them as the additive form's known exposure (probes/overflow.py); the doctor's mask-ops
check says which form a Mac should use (probes/mask_ops.py).

Two K/V write forms (`ane-spec build --kv-write`, manifest build.kv_write; the shard's inputs
carry it, not `GraphVariant`, whose repr is in every fingerprint). `scatter` (the default) is the line above over all S slots: every pass reads
and writes each layer's whole K and V (shards/kv_traffic.py counts it: 256 MiB each way per pass
for Phi-4-mini at S = 2048). `slice` (`window_rows`) writes only a window of the program's
width (4 slots in the decode program, P in the prefill function) that the host places over the
slots the pass writes (`kv_write_start`): the window is read (slice_by_size), rewritten with the
same algebra over its own [width, T] one-hot, and put back (slice_update). Why a window with a
one-hot rather than Anemll's "the T rows at the position": rows that write nothing (padding,
the probes' fillers at other positions) then write nothing here either, a window slot no row
writes keeps its value, and near the end of the context the window starts at S - width instead
of running past the state, so the state after every pass equals the scatter's and no other
rule changes (rejected drafts still land only in slots the mask hides and a later pass
overwrites). A ring layer (model/swa_ring.py) gets two windows, applied in turn: a block that
wraps writes its last slots in one at the ring's end and the wrapped ones in one at slot 0.
Dynamic slice_update on a state has ANE crash reports (apple/coreai-torch#6) and no residency
measurement here, which is why it is a build option and not the default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Var

from ane_spec.ane_limits import ANE_MAX_REDUCTION
from ane_spec.model.config import ModelConfig
from ane_spec.shards.weights import ConvWeight

Layout = Literal["BC1T", "BCT1"]
LAYOUTS: tuple[Layout, ...] = ("BCT1", "BC1T")
MaskForm = Literal["select", "additive"]


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # fp32 [d]
    qkv: ConvWeight
    attn_output: ConvWeight
    ffn_norm: np.ndarray
    ffn_up: ConvWeight              # gate rows, then up rows
    ffn_down: ConvWeight
    qkv_bias: np.ndarray | None = None   # fp32 [qkv_rows] (qwen2)
    q_norm: np.ndarray | None = None     # fp32 [head_dim] (qwen3, gemma3)
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None  # fp32 [d] (gemma3)
    post_ffn_norm: np.ndarray | None = None
    # eps of the norms whose input is the residual stream (attn_norm, ffn_norm); None: the
    # model's rms_eps. A stream scaled by s takes eps * s^2 (residual_scale.py).
    stream_eps: float | None = None


@dataclass
class SlotWindow:
    """Where a slice-form K/V write lands: `width` consecutive slots of a state from a first
    slot the host picks per pass (runtime/host_inputs.py), and which row writes which slot."""

    begin: Var  # int32 [4]: (0, 0, first slot, 0)
    end: Var    # int32 [4]: begin + width on the slot axis (the other axes are masked)
    write: Var  # [1, 1, width, T] one-hot: window slot <- row (an all-zero row: not written)
    keep: Var   # [1, 1, width, 1]: 1 - rowsum(write)

    @property
    def width(self) -> int:
        return int(self.write.shape[2])


@dataclass
class BlockInputs:
    """The host-fed tensors every layer of a shard shares."""

    cos: Var        # [T, rot/2]
    sin: Var
    attn_mask: Var  # [1, 1, T, S]: 0 visible, MASK_VALUE hidden (added in the additive form)
    visible: Var | None  # [1, 1, T, S] bool: attn_mask >= 0 (select form; None in additive)
    write: Var | None  # [1, 1, S, T] (None in the slice form)
    keep: Var | None   # [1, 1, S, 1]: 1 - rowsum(write), computed once per shard
    # Sliding-window layers' RoPE tables and visibility (models with local layers only).
    local: "BlockInputs | None" = None
    # The slice form (`ane-spec build --kv-write slice`): the windows the K/V rows are written
    # into, in order (a ring's block that wraps needs two); empty in the scatter form.
    windows: tuple["SlotWindow", ...] = ()

    def for_layer(self, local: bool) -> "BlockInputs":
        """The inputs layer reads: the local tables and mask for a sliding-window layer."""
        if not local:
            return self
        if self.local is None:
            raise ValueError("a sliding-window layer needs the shard's local RoPE and mask inputs")
        return self.local


def hidden_shape(d: int, t: object, layout: Layout) -> tuple[object, ...]:
    return (1, d, t, 1) if layout == "BCT1" else (1, d, 1, t)


def conv_weight(w: ConvWeight, name: str) -> Var | np.ndarray:
    """The conv's weight: an fp16 const, or a constexpr that decompresses one at load time
    (int8 x per-row or per-block scale; uint8 indices into per-row-group fp16 tables)."""
    if w.lut is not None:
        return mb.constexpr_lut_to_dense(indices=w.data, lut=w.lut, name=name)
    if w.scale is None:
        return w.data
    return mb.constexpr_blockwise_shift_scale(data=w.data, scale=w.scale, name=name)


def conv_in_chunks(x: Var, w: ConvWeight, name: str, out_name: str | None = None,
                   max_depth: int | None = None) -> Var:
    """The 1x1 conv x -> W x, as one conv when its reduction depth (W's input dim) is at most
    `max_depth`; otherwise a sum of partial convs over input chunks of at most `max_depth`
    channels, because the ANE does not take a longer reduction (ane_limits.REDUCTION_SOURCE,
    chrishayuk/larql#312). Each chunk slices the stored weight (int8 data and its per-row scale,
    per-block scales on their 32-wide block boundaries, LUT indices with the same tables), so the
    weights and the bytes stored are the same as the unsplit conv's.

    Exactness: NOT bit-exact against the unsplit fp16 conv. It changes the summation order: each
    partial sum is rounded to fp16 at its conv's output and the partials are then added in fp16,
    one more rounding (about 2^-11 relative) than one conv accumulating the whole depth. The
    reference (fp32 math) and the parity gates compare with tolerances, not bitwise, so they stay
    correct; a split build is checked against the reference like any other.
    """
    depth = w.shape[1]
    max_depth = max_depth or ANE_MAX_REDUCTION
    if depth <= max_depth:
        return mb.conv(x=x, weight=conv_weight(w, name + "_w"), name=out_name or name)
    cuts = list(range(0, depth, max_depth)) + [depth]
    pieces = mb.split(x=x, split_sizes=[b - a for a, b in zip(cuts[:-1], cuts[1:])], axis=1,
                      name=name + "_in")
    total = None
    for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        part = mb.conv(x=pieces[k], weight=conv_weight(_input_slice(w, a, b), f"{name}_w{k}"),
                       name=f"{name}_part{k}")
        last = k == len(cuts) - 2
        total = part if total is None else mb.add(
            x=total, y=part, name=(out_name or name) if last else f"{name}_sum{k}")
    return total


def _input_slice(w: ConvWeight, a: int, b: int) -> ConvWeight:
    """Columns [a, b) of a conv weight, in its stored form."""
    scale = w.scale
    if scale is not None and scale.shape[1] > 1:  # per-block scales, 32 inputs a block
        block = w.shape[1] // scale.shape[1]
        if a % block or (b % block and b != w.shape[1]):
            raise ValueError(f"input chunk [{a},{b}) splits a {block}-wide scale block")
        scale = scale[:, a // block:-(-b // block)]
    return replace(w, shape=(w.shape[0], b - a), data=np.ascontiguousarray(w.data[:, a:b]),
                   scale=scale)


def rms_norm(x: Var, weight: np.ndarray, eps: float, d: int, name: str) -> Var:
    """RMSNorm as layer_norm over [x, -x]: the mean is exactly 0, the variance mean(x^2), and
    layer_norm's reduction does not overflow fp16 the way a sum of squares over 3072 would.

    `eps` (Phi-4-mini: 1e-5) is below fp16's smallest normal (6.1e-5): stored as an fp16 const
    it is the subnormal 1.0014e-5. The fp16 interpreter keeps it (it computes each op in fp32),
    so an all-zero row normalises to 0. The ANE may flush subnormals to zero (Apple does not
    document it); eps is then 0, and an all-zero row gives 0/sqrt(0) = NaN: `finite_rows` keeps
    it out of every other slot, but the row itself is lost. Real rows are unaffected (their
    mean(x^2) is far above 1e-5), so nothing may feed all-zero rows: the pipeline pads with the
    last token, and the probes use token embeddings."""
    both = mb.concat(values=[x, mb.mul(x=x, y=np.float16(-1.0))], axis=1)
    normed = mb.layer_norm(x=both, axes=[1], epsilon=np.float16(eps))
    half = mb.slice_by_index(x=normed, begin=[0, 0, 0, 0], end=[1, d, 0, 0],
                             end_mask=[True, False, True, True])
    return mb.mul(x=half, y=weight.astype(np.float16).reshape(1, d, 1, 1), name=name)


def head_rms_norm(x: Var, weight: np.ndarray, eps: float, hd: int, name: str) -> Var:
    """RMSNorm of each head's [.., hd] vector in [1, heads, T, hd], the way `rms_norm` does it:
    layer_norm over [x, -x] along the head axis."""
    both = mb.concat(values=[x, mb.mul(x=x, y=np.float16(-1.0))], axis=3)
    normed = mb.layer_norm(x=both, axes=[3], epsilon=np.float16(eps))
    half = mb.slice_by_index(x=normed, begin=[0, 0, 0, 0], end=[0, 0, 0, hd],
                             end_mask=[True, True, True, False])
    return mb.mul(x=half, y=weight.astype(np.float16).reshape(1, 1, 1, hd), name=name)


def to_heads(x: Var, heads: int, hd: int) -> Var:
    """[1, heads*hd, T, 1] or [1, heads*hd, 1, T] -> [1, heads, T, hd]."""
    return mb.transpose(x=mb.reshape(x=x, shape=[1, heads, hd, -1]), perm=[0, 1, 3, 2])


def rope(x: Var, cos: Var, sin: Var, half: int, hd: int) -> Var:
    """NEOX rotate-half on the first 2*half dims of [1, heads, T, hd]; the rest pass through."""
    def part(lo: int, hi: int) -> Var:
        return mb.slice_by_index(x=x, begin=[0, 0, 0, lo], end=[0, 0, 0, hi],
                                 begin_mask=[True, True, True, False],
                                 end_mask=[True, True, True, False])

    x1, x2 = part(0, half), part(half, 2 * half)
    r1 = mb.sub(x=mb.mul(x=x1, y=cos), y=mb.mul(x=x2, y=sin))
    r2 = mb.add(x=mb.mul(x=x2, y=cos), y=mb.mul(x=x1, y=sin))
    parts = [r1, r2] + ([part(2 * half, hd)] if 2 * half < hd else [])
    return mb.concat(values=parts, axis=3)


# fp16's largest finite value. Clamping to it changes no finite fp16 value, so a well-behaved
# row's K/V are written bit for bit as before.
FP16_MAX = np.float16(65504.0)
# What a hidden slot's score becomes. A row whose largest visible score is above -32768 + 17
# gives every hidden slot exactly 0 weight (fp16 exp underflows 17.3 below the row's maximum),
# and the softmax's `score - max` stays finite for maxima below 32736 (-65504 would overflow to
# -inf as soon as a row's maximum passed 16). A row with no visible slot stays finite (uniform),
# never NaN, as it would be with -inf (-inf - -inf). The additive form adds this same value
# (the host's MASK_VALUE) to hidden scores: see the module docstring for its margin.
HIDDEN_SCORE = np.float16(-32768.0)


def finite_rows(rows: Var, name: str, mask_form: MaskForm = "select") -> Var:
    """`rows` with +-inf saturated to +-FP16_MAX and NaN replaced by 0: every value finite.
    In the additive form `clip` only: NaN stays (the exposure the module docstring states).

    The scatter then computes 0 x finite = 0 for every slot a row does not write, exactly, so
    slots other than a row's own are bit-identical whatever that row computed. `clip` alone would
    leave NaN (min/max propagate it), and NaN is what an overflowing row usually holds: an inf
    activation turns to NaN in the next layer_norm (inf - inf)."""
    if mask_form == "additive":
        return mb.clip(x=rows, alpha=-FP16_MAX, beta=FP16_MAX, name=name)
    bounded = mb.clip(x=rows, alpha=-FP16_MAX, beta=FP16_MAX)
    # NaN is the one value not equal to itself.
    return mb.select(cond=mb.equal(x=bounded, y=bounded), a=bounded, b=np.float16(0.0),
                     name=name)


def scatter_rows(state: Var, rows: Var, io: BlockInputs, name: str, clean: bool = True,
                 mask_form: MaskForm = "select") -> Var:
    """Write T new rows [1, kv, T, hd] into slots chosen by the one-hot write mask.
    `clean=False` scatters the rows as computed: only for the overflow probe's test."""
    if clean:
        rows = finite_rows(rows, name + "_rows", mask_form)
    placed = mb.matmul(x=io.write, y=rows)                  # [1, kv, S, hd]
    return mb.add(x=mb.mul(x=state, y=io.keep), y=placed, name=name)


# slice_by_index / slice_update masks that leave only the slot axis to begin and end.
_SLOT_AXIS_ONLY = [True, True, False, True]


def window_rows(state: Var, rows: Var, windows: Sequence[SlotWindow], name: str) -> Var:
    """The slice form of the K/V write: each window's slots are read, rewritten the way the
    scatter rewrites a slot (`old * keep + W @ rows` over the window's one-hot W), and put back
    with slice_update; no other slot is read or written. `rows` are already finite.

    Exactness against `scatter_rows`: a written slot becomes old * 0 + row = row, an unwritten
    one in a window old * 1 + 0 = old, in both forms, and a slot outside every window keeps its
    value, where the scatter writes old * 1 + 0 = old: the state after every pass is the
    scatter build's, value for value (only the sign of a zero may differ, which no later sum,
    product or comparison can tell), so the attention and every logit are too. Windows are
    applied in order, each reading what the previous one wrote (a ring's block that wraps
    spans two; the second keeps the slots the first wrote)."""
    kv, hd = state.shape[1], state.shape[3]
    for n, w in enumerate(windows):
        old = mb.slice_by_size(x=state, begin=w.begin, size=[1, kv, w.width, hd])
        new = mb.add(x=mb.mul(x=old, y=w.keep), y=mb.matmul(x=w.write, y=rows))
        last = n == len(windows) - 1
        state = mb.slice_update(x=state, update=new, begin=w.begin, end=w.end,
                                begin_mask=_SLOT_AXIS_ONLY, end_mask=_SLOT_AXIS_ONLY,
                                name=name if last else f"{name}_{n}")
    return state


def write_rows(state: Var, rows: Var, io: BlockInputs, name: str, clean: bool = True,
               mask_form: MaskForm = "select") -> Var:
    """The K/V write of the build's form: the whole state (`scatter_rows`), or only the windows
    the host picked (`window_rows`). `rows` are made finite first in both."""
    if not io.windows:
        return scatter_rows(state, rows, io, name, clean, mask_form)
    if clean:
        rows = finite_rows(rows, name + "_rows", mask_form)
    return window_rows(state, rows, io.windows, name)


def hide_slots(scores: Var, visible: Var) -> Var:
    """Select, not add: a hidden slot's score is HIDDEN_SCORE whatever q.K gave there, inf or
    NaN included (a rejected draft's slot may hold FP16_MAX K rows)."""
    return mb.select(cond=visible, a=scores, b=HIDDEN_SCORE)


def attention(q: Var, keys: Var, values: Var, io: BlockInputs, c: ModelConfig,
              fp32_softmax: bool = False, additive_mask: bool = False) -> Var:
    """Softmax attention over all S slots; returns [1, H, T, hd]. `additive_mask`: the mask is
    added (the additive form, or the select form's test variant), else selected on."""
    h, kv, hd, slots = c.num_heads, c.num_kv_heads, c.head_dim, keys.shape[2]
    # Query head h uses KV head h // group: fold each group's heads into the row axis.
    grouped = mb.reshape(x=q, shape=[1, kv, -1, hd])                    # [1, kv, G*T, hd]
    scores = mb.matmul(x=grouped, y=keys, transpose_y=True)             # [1, kv, G*T, S]
    scores = mb.reshape(x=scores, shape=[1, h, -1, slots])
    if additive_mask:
        scores = mb.add(x=scores, y=io.attn_mask)
    else:
        scores = hide_slots(scores, io.visible)
    if fp32_softmax:  # the island this compiler once had; only for the static check's test
        probs = mb.cast(x=stable_softmax(mb.cast(x=scores, dtype="fp32")), dtype="fp16")
    else:
        probs = stable_softmax(scores)
    out = mb.matmul(x=mb.reshape(x=probs, shape=[1, kv, -1, slots]), y=values)
    return mb.reshape(x=out, shape=[1, h, -1, hd])


def stable_softmax(scores: Var) -> Var:
    """Softmax over the last axis, spelled out so that every step is an op of its own, in the
    dtype of `scores` (fp16 in every program the compiler writes).

    The max is subtracted before exp, so exp's argument is <= 0 and every term is in [0, 1]: no
    overflow for any finite scores, and a hidden slot (HIDDEN_SCORE) underflows to exactly 0. The
    row's maximum term is exp(0) = 1, so the sum is in [1, S] and the division is safe even for a
    row with every slot masked (it comes out uniform, not NaN). Written out rather than as
    `softmax` so the arithmetic is the program's, not a kernel's unstated choice, and so the fp16
    interpreter rounds where the program says values are fp16: after each of these five ops.
    (Core ML's compiler may still fuse them on a device; the parity gate measures the result.)
    """
    peak = mb.reduce_max(x=scores, axes=[-1], keep_dims=True)
    terms = mb.exp(x=mb.sub(x=scores, y=peak))
    return mb.real_div(x=terms, y=mb.reduce_sum(x=terms, axes=[-1], keep_dims=True))


def merge_heads(o: Var, c: ModelConfig, layout: Layout, flatten: str = "head_dim_token") -> Var:
    """[1, H, T, hd] -> hidden layout with channel = head * hd + dim.

    `flatten="head_token_dim"` reproduces seeds/003's bug (reshape without the transpose); it
    exists only so the gates can prove they catch it.
    """
    if flatten == "head_dim_token":
        o = mb.transpose(x=o, perm=[0, 1, 3, 2])                        # [1, H, hd, T]
    shape = [1, c.q_dim, -1, 1] if layout == "BCT1" else [1, c.q_dim, 1, -1]
    return mb.reshape(x=o, shape=shape)


@dataclass(frozen=True)
class GraphVariant:
    """Which graph to build: the mask form (a build option), and deliberate defects for gate
    tests; the default builds the correct select-form graph."""

    mask_form: MaskForm = "select"  # see the module docstring: what additive keeps and loses

    rotate_all_dims: bool = False
    drop_attn_factor: bool = False
    swap_kv_scatter: bool = False
    flatten: str = "head_dim_token"
    fp32_softmax: bool = False  # cast -> softmax in fp32 -> cast: must fail the static checks
    # The KV write and mask before they were finite-safe: must fail the overflow probe.
    unclean_kv_write: bool = False  # K/V rows scattered as computed: 0 x inf = NaN everywhere
    additive_mask: bool = False     # scores + attn_mask with select-form finite rows: loses to
    #                                 a hidden score above ~|MASK_VALUE|


CORRECT = GraphVariant()


def decoder_layer(x: Var, i: int, w: LayerWeights, io: BlockInputs, k_state: Var, v_state: Var,
               c: ModelConfig, layout: Layout, variant: GraphVariant = CORRECT,
               out_name: str | None = None) -> Var:
    """One layer; its output op is named `out_name` (the program's output, so no trailing
    `identity` is needed to name it) or `layer_{i}_out`."""
    d, hd, kv = c.hidden_size, c.head_dim, c.num_kv_heads
    p = f"layer_{i}_"
    half = hd // 2 if variant.rotate_all_dims else c.rope_dims // 2
    io = io.for_layer(c.is_local(i))
    cos, sin = io.cos, io.sin
    if variant.drop_attn_factor:
        inv = np.float16(1.0 / c.rope_attn_factor)
        cos, sin = mb.mul(x=cos, y=inv), mb.mul(x=sin, y=inv)
    if variant.rotate_all_dims:
        # Stretch the host tables over all head dims, as a graph that ignores rope_dims would.
        cos = _widen_table(cos, hd // 2, c.rope_dims // 2)
        sin = _widen_table(sin, hd // 2, c.rope_dims // 2)

    eps = c.rms_eps if w.stream_eps is None else w.stream_eps
    a = rms_norm(x, w.attn_norm, eps, d, p + "attn_norm")
    qkv = conv_in_chunks(a, w.qkv, p + "qkv")
    if w.qkv_bias is not None:
        qkv = mb.add(x=qkv, y=w.qkv_bias.astype(np.float16).reshape(1, -1, 1, 1),
                     name=p + "qkv_bias")
    q, k, v = mb.split(x=qkv, split_sizes=[c.q_dim, c.kv_dim, c.kv_dim], axis=1)
    # Ops in this order keep a phi3 program exactly what it was before q/k norms existed.
    q = to_heads(q, c.num_heads, hd)
    if w.q_norm is not None:
        q = head_rms_norm(q, w.q_norm, c.rms_eps, hd, p + "q_norm")
    q = rope(q, cos, sin, half, hd)
    q = mb.mul(x=q, y=np.float16(c.attention_scale))  # 1/sqrt(hd) unless the family says
    k = to_heads(k, kv, hd)
    if w.k_norm is not None:
        k = head_rms_norm(k, w.k_norm, c.rms_eps, hd, p + "k_norm")
    k = rope(k, cos, sin, half, hd)
    v = to_heads(v, kv, hd)
    if variant.swap_kv_scatter:
        k, v = v, k
    # Attention reads what coreml_update_state returns: the canonical in-place pattern that
    # coremltools' state passes expect (reading the pre-update var breaks them).
    clean, form = not variant.unclean_kv_write, variant.mask_form
    keys = mb.coreml_update_state(state=k_state, value=write_rows(
        mb.read_state(input=k_state), k, io, p + "k_new", clean, form))
    values = mb.coreml_update_state(state=v_state, value=write_rows(
        mb.read_state(input=v_state), v, io, p + "v_new", clean, form))

    additive = variant.additive_mask or form == "additive"
    o = merge_heads(attention(q, keys, values, io, c, variant.fp32_softmax, additive), c,
                    layout, variant.flatten)
    x = mb.add(x=x, y=post_norm(_conv(o, w.attn_output, p + "o_w"), w.post_attn_norm, c,
                                p + "post_attn_norm"))

    f = _conv(rms_norm(x, w.ffn_norm, eps, d, p + "ffn_norm"), w.ffn_up, p + "up_w")
    g, u = mb.split(x=f, num_splits=2, axis=1)
    down = _conv(mb.mul(x=gate_activation(g, c), y=u), w.ffn_down, p + "down_w")
    down = post_norm(down, w.post_ffn_norm, c, p + "post_ffn_norm")
    return mb.add(x=x, y=down, name=out_name or p + "out")


def post_norm(branch: Var, weight: np.ndarray | None, c: ModelConfig, name: str) -> Var:
    """Gemma 3's RMSNorm of a branch output before the residual add; no op without a weight."""
    if weight is None:
        return branch
    return rms_norm(branch, weight, c.rms_eps, c.hidden_size, name)


def gate_activation(g: Var, c: ModelConfig) -> Var:
    """silu, or llama.cpp's ggml_gelu: the tanh approximation (gemma3's LLM_FFN_GELU)."""
    if c.architecture.ffn_activation == "gelu_tanh":
        return mb.gelu(x=g, mode="TANH_APPROXIMATION")
    return mb.silu(x=g)


def _conv(x: Var, w: ConvWeight, weight_name: str) -> Var:
    """A conv as decoder_layer always wrote it (unnamed, weight `weight_name`) when its depth is
    within the ANE's; split into partial sums (conv_in_chunks) when it is not."""
    if w.shape[1] <= ANE_MAX_REDUCTION:
        return mb.conv(x=x, weight=conv_weight(w, weight_name))
    return conv_in_chunks(x, w, weight_name.removesuffix("_w"))


def _widen_table(t: Var, width: int, have: int) -> Var:
    reps = -(-width // have)
    wide = mb.concat(values=[t] * reps, axis=1)
    return mb.slice_by_index(x=wide, begin=[0, 0], end=[0, width], begin_mask=[True, True],
                             end_mask=[True, False])
