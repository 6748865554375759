"""`ane-spec build`: a GGUF file -> layer shards, LM head, embeddings, tokenizer, manifest.

The build writes into a sibling temporary folder and swaps it into place only when every
package has been built and checked, so a failed, killed or interrupted build leaves either the
previous build or nothing: never a manifest that points at partial files (output_dir.py: the
lock, the atomic swap, the clean-up of dead builds' leftovers). Memory is bounded by one shard:
its weights are converted, the package is written, and the GGUF pages it read are released
before the next shard starts.

The GGUF is read through a memory map for the whole build, so it must not change meanwhile: its
size and mtime are compared with those at open between steps, and a file that shrinks under a
read (SIGBUS, which would kill the process without a word) ends the build with one line and
no temporary folder. Tensors are checked to be finite as they are converted (weights.py).

Order of work: the residual scale needs a calibration (the fp32 reference over every layer,
scale_decision.py), but a shard's weights convert the same whatever it decides, since the factor
is folded into them afterwards. On a model of scale_aside.ASIDE_MIN_PARAMETERS or more the
calibration runs in a child process beside the build (calibration_process.py), and the shards
are folded at the k the build can assume until it decides (scale_aside.py): a decision that
differs makes them again. The build waits for the decision before reusing a package of the
previous build (fingerprints hold k), before the LM head and before the manifest. Each shard's
line says how long it waited, the k it was folded at before the decision, and which functions
its package holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import hashlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Generic, TypeVar

import numpy as np
from coremltools.converters.mil.mil import Program, types
from pydantic import BaseModel, ConfigDict

import ane_spec
from ane_spec.ane_limits import (
    ANE_MAX_ARGMAX_CHANNELS,
    FORCE_ANE_LIMITS_FLAG,
    ane_limit_refusals,
    build_warnings,
)
from ane_spec.content_digest import DIGEST
from ane_spec.errors import AneSpecError, BuildError, ManifestError, one_line, untrusted
from ane_spec.manifests.schema import (
    GRAPH_REVISION,
    MAX_HEAD_PACKAGES,
    MAX_PREFILL_T,
    BuildOptions,
    EmbeddingsEntry,
    FileRef,
    HeadEntry,
    Manifest,
    QuantStats,
    ResidualScale,
    ShardEntry,
    TensorQuant,
    SourceInfo,
    TensorSpec,
)
from ane_spec.manifests.residual_report import describe as describe_residual_scale
from ane_spec.manifests.store import file_ref, hash_path, load_manifest, write_manifest
from ane_spec.model.config import ModelConfig
from ane_spec.model.gguf_file import GGUFModel, open_gguf
from ane_spec.model.hash_process import Hashes, HashesAhead
from ane_spec.model.swa_ring import kv_state_bytes, ring_rows, uses_ring
from ane_spec.shards.embeddings import write_embeddings
from ane_spec.shards.frozen_heap import freeze_more, frozen_heap
from ane_spec.shards import scale_aside
from ane_spec.shards.scale_decision import parse_residual_scale
from ane_spec.shards.hash_aside import HashAside
from ane_spec.shards.finish_aside import FinishAside, done
from ane_spec.shards import weight_memory
from ane_spec.shards.weight_memory import reused_weight_memory, small_pages
from ane_spec.shards.kv_traffic import format_bytes, kv_traffic
from ane_spec.shards.layer_graph import CORRECT, GraphVariant, LayerWeights, Layout, MaskForm
from ane_spec.shards.layer_weights import finite_vector, layer_tensor_names, layer_weights
from ane_spec.shards.residual_scale import FoldCount, fold_into_layer, stream_eps
from ane_spec.shards.output_dir import OutputLock, building_dir, recover, swap_into_place
from ane_spec.shards.conversion_passes import PendingWeights, wait_whole
from ane_spec.shards.programs import (
    DEFAULT_PREFILL_T,
    DEFAULT_T,
    DECODE_FUNCTION,
    HIDDEN_IN,
    MAX_T,
    PREFILL_FUNCTION,
    KVWrite,
    HeadLayout,
    head_program,
    kv_write_window,
    layer_program,
    save_package,
    with_prefill,
)
from ane_spec.shards.static_checks import check_package
from ane_spec.shards.topology import (
    DEFAULT_MAX_HEAD_MB,
    DEFAULT_MAX_SHARD_MB,
    HEAD_PACKAGE_SOURCE,
    MAX_HEAD_CHANNELS,
    MIB,
    check_budget,
    head_budget_problems,
    head_chunk_bytes,
    mib,
    min_head_chunks,
    parse_topology,
    plan_head_packages,
    plan_topology,
)
from ane_spec.shards.weights import (
    DEFAULT_MIN_WEIGHT_COSINE,
    Part,
    TensorChoice,
    WeightFormat,
    convert_parts,
    require_finite,
)

Progress = Callable[[str], None]


DEFAULT_HEAD_CHUNKS = 4


class BuildRequest(BaseModel):
    """Everything `ane-spec build` takes, validated before any work starts."""

    model_config = ConfigDict(frozen=True)

    topology: str | None = None
    max_seq: int = 2048
    weights: WeightFormat = "auto"
    layout: Layout = "BCT1"
    mask_form: MaskForm = "select"   # layer_graph's module docstring: what additive gives up
    # How layers write K/V (layer_graph.write_rows): the whole state each pass, or a window of
    # the pass's width (slice_update at a host-given slot; its ANE residency is unproven).
    kv_write: KVWrite = "scatter"
    # The LM head's logits as [1, V_i, T, 1] (channels, the hidden layout's) or [1, T, V_i]
    # (vocab-last, Anemll's): programs.HeadLayout.
    head_layout: HeadLayout = "channels"
    # None: the default 4, or as many more as keep every chunk within MAX_HEAD_CHANNELS (Gemma's
    # 262,144 entries need 6), so no vocabulary needs the flag.
    head_chunks: int | None = None
    head_argmax: bool = False
    force_ane_limits: bool = False   # build what ane_limits refuses (it is said, not silent)
    max_shard_mb: int = DEFAULT_MAX_SHARD_MB
    # Over it the LM head is split into separate packages of whole chunks (topology.py).
    max_head_mb: float = DEFAULT_MAX_HEAD_MB
    min_weight_cosine: float = DEFAULT_MIN_WEIGHT_COSINE
    # auto: calibrate activations and scale the residual stream by 2^k where fp16's margin is
    # small; off: no calibration, no scaling; 2^K: that factor (residual_scale.py).
    residual_scale: str = "auto"
    name: str | None = None
    # Sliding-window layers keep a ring of W + (widest pass) K/V slots (model/swa_ring.py)
    # instead of max_seq; False keeps them full-length (the layout before rings, for comparison).
    swa_ring: bool = True
    # T of each layer package's prefill function (programs.PREFILL_FUNCTION): prompts run in
    # passes of this many rows, layers only. 0: no prefill function (prompts at the decode
    # shape). None: DEFAULT_PREFILL_T, or max_seq where that is shorter.
    prefill_t: int | None = None


@dataclass
class BuildResult:
    manifest_path: Path
    built: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)  # ANE limits the request runs into
    summary: list[str] = field(default_factory=list)   # weights per format, worst tensors


def build(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str],
          request: BuildRequest = BuildRequest(), *, force: bool = False,
          progress: Progress | None = None, variant: GraphVariant = CORRECT,
          calibrate_aside: bool | None = None,
          hashes_ahead: HashesAhead | None = None) -> BuildResult:
    """Build all artifacts for `gguf_path` into `out_dir` (see module docstring).

    `variant` exists only for the gates' tests, which need deliberately broken builds.
    `calibrate_aside`: decide the residual scale in a child process beside the build (True),
    before the conversion in this one (False), or by the model's size (None: scale_aside.py).
    `hashes_ahead`: the file's hashes, being taken by a child process the caller started
    before importing this module (hash_process.py); the caller closes it.
    """
    started = time.monotonic()
    if variant.mask_form not in (CORRECT.mask_form, request.mask_form):
        raise ValueError(f"the variant's mask form {variant.mask_form!r} contradicts the "
                         f"request's {request.mask_form!r}")
    # The request decides the mask form, so the manifest records what the programs are.
    variant = dataclasses.replace(variant, mask_form=request.mask_form)
    say = progress or (lambda _msg: None)
    out = Path(out_dir)
    model = open_gguf(gguf_path)
    if request.prefill_t is None:
        request = request.model_copy(update={"prefill_t": min(DEFAULT_PREFILL_T,
                                                              request.max_seq)})
    if request.head_chunks is None:
        request = request.model_copy(update={"head_chunks": max(
            DEFAULT_HEAD_CHUNKS, min_head_chunks(model.config.vocab_size))})
    ranges = _validate(model, request)
    head_plan, head_refusals = _plan_head(model, request)
    warnings = build_warnings(request.max_seq, request.weights, request.head_argmax)
    if request.force_ane_limits:
        warnings += [f"{FORCE_ANE_LIMITS_FLAG} overrides: {r}"
                     for r in [*ane_limit_refusals(request.max_seq), *head_refusals]]
    for w in warnings:
        say(f"warning: {w}")
    try:
        with OutputLock(out) as lock:
            removed = recover(out, _is_complete)
            if removed:
                say(f"removed {len(removed)} folder(s) left by interrupted builds")
            _check_output(out, force)
            tmp = building_dir(out)
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "shards").mkdir(parents=True)
            try:
                with _sigbus_ends_build(model.path, out, litter=(tmp, lock.path)), \
                        frozen_heap(), reused_weight_memory(), small_pages():
                    result = _build_into(model, request, ranges, head_plan, out, tmp, say,
                                         variant, calibrate_aside, hashes_ahead)
                    model.check_unchanged()
                swap_into_place(tmp, out)
            except BaseException as exc:
                _drop_hidden_tracebacks(exc)
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except OSError as exc:
        where = f" ({untrusted(exc.filename, 200)})" if exc.filename else ""
        raise BuildError(f"cannot write the build for {out}: {exc.strerror or exc}{where}; "
                         "nothing was changed there") from None
    result.seconds = time.monotonic() - started
    result.warnings = warnings
    return result


def _drop_hidden_tracebacks(exc: BaseException) -> None:
    """Free the tracebacks nobody will see: an OSError's (build() turns it into a BuildError
    `from None`) and those of exceptions chained behind a `from None`. Their frames keep
    coremltools' temporary files alive, and those delete themselves when collected: that must
    happen before their folder is removed, or Python prints an "Exception ignored" traceback.
    Closing them may fail again on a full disk; that failure is the one being reported."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda u: None if isinstance(u.exc_value, OSError) else hook(u)
    try:
        if isinstance(exc, OSError):
            exc.__traceback__ = None
        hidden = exc.__context__ if exc.__suppress_context__ else None
        while hidden is not None:
            hidden.__traceback__ = None
            hidden = hidden.__context__
        gc.collect()
    finally:
        sys.unraisablehook = hook


def _build_into(model: GGUFModel, request: BuildRequest, ranges: list[tuple[int, int]],
                head_plan: list[tuple[int, int]], out: Path, tmp: Path, say: Progress,
                variant: GraphVariant, calibrate_aside: bool | None,
                hashes_ahead: HashesAhead | None) -> BuildResult:
    with contextlib.ExitStack() as aside:
        pending = aside.enter_context(
            scale_aside.start(model, request.residual_scale, say, calibrate_aside))
        # With nothing to reuse, the hashes are first needed for the first shard's fingerprint:
        # beside a calibration (a large model), a second helper takes them meanwhile, unless a
        # child process has been taking them since before the imports.
        previous, hashing = _previous_build(out), None
        if hashes_ahead is not None:
            hashing = functools.partial(hashes_ahead.hashes_for, model, say)
        elif pending.aside and previous is None:
            say(f"hashing {model.path.name} beside the conversion")
            hashing = aside.enter_context(HashAside(model)).result
        finishing = aside.enter_context(FinishAside())
        return _build_with(model, request, ranges, head_plan, out, tmp, say, variant, pending,
                           previous, hashing, finishing)


def _build_with(model: GGUFModel, request: BuildRequest, ranges: list[tuple[int, int]],
                head_plan: list[tuple[int, int]], out: Path, tmp: Path, say: Progress,
                variant: GraphVariant, pending: scale_aside.PendingScale,
                previous: PreviousBuild | None, hashing: Callable[[], Hashes] | None,
                finishing: FinishAside) -> BuildResult:
    result = BuildResult(manifest_path=out / "manifest.json")
    options = _options(request, ranges, model.config)
    hashes: Hashes | None = None
    residual: ResidualScale | None = None

    def hashed() -> Hashes:
        nonlocal hashes
        if hashes is None:
            if hashing is not None:
                hashes = hashing()
            else:
                say(f"hashing {model.path.name}")
                hashes = model.content_hashes()
            model.check_unchanged()
            pending.relay()
        return hashes

    # Written by the helper as soon as the residual scale is known or assumed, while the
    # building thread makes the packages; again should the decision differ from the assumption.
    embeddings: Future[tuple[EmbeddingsEntry, int]] | None = None
    embeddings_log2: int | None = None

    def embed_at(log2: int) -> None:
        nonlocal embeddings, embeddings_log2
        if embeddings_log2 == log2:
            return
        if embeddings is not None:   # made at an assumption the decision did not keep
            embeddings.exception()
            shutil.rmtree(tmp / "embeddings")
        embeddings_log2 = log2
        embeddings = finishing.run(functools.partial(_write_embeddings, model, tmp, log2))

    def decided() -> ResidualScale:
        nonlocal residual
        if residual is None:
            residual = pending.result()
            freeze_more()   # torch's modules, imported by the calibration, are long-lived too
            say(describe_residual_scale(residual)[0])
            embed_at(residual.log2_factor)
        return residual

    # Reuse needs the fingerprints (tensor hashes) first; a build with nothing to reuse and a
    # calibration running aside has them taken aside too, and asks after the first shard's
    # conversion.
    if previous is not None or not pending.aside:
        hashed()
    if not pending.aside:
        decided()
    made_at: dict[str, int] = {}   # the k each shard built here was folded at

    def shard_log2() -> int:
        """The k to fold a shard at: the decision where it is known (or must be waited for:
        no assumption), else the assumption (scale_aside.py)."""
        if residual is None and (pending.known or pending.assumed is None):
            decided()
        if residual is not None:
            return residual.log2_factor
        # Not before the first conversion: a build whose file shrinks under it is cleaned up by
        # a SIGBUS handler that cannot stop a thread writing the embeddings' folder meanwhile.
        embed_at(pending.assumed)
        return pending.assumed

    def make_shard(a: int, b: int, label: str, rel: str,
                   fingerprint: Callable[[int], str]) -> Future[ShardEntry]:
        t0, waited = time.monotonic(), pending.waited
        choices: dict[str, TensorChoice] = {}
        with pending.converting():
            layers = _convert_layers(model, request, a, b, choices, pending.relay)
        hashed()
        log2 = shard_log2()
        fold = FoldCount()
        built = _build_shard(model, request, a, b, layers, choices, tmp, rel, fingerprint(log2),
                             variant, log2, fold, finishing)
        made_at[rel], inexact[rel] = log2, fold.inexact
        waiting = pending.waited - waited
        say(f"{label}: built in {time.monotonic() - t0:.1f}s"
            + (f" ({waiting:.1f}s of it waiting for the calibration)" if waiting >= 0.1
               else "")
            + f", {built.bytes / 2**20:,.1f} MiB, functions {built.functions}, "
            f"{_format_counts(built.quant)}, worst weight cosine "
            f"{built.quant.worst_cosine:.6f}"
            + ("" if residual is not None else f"; folded at 2^{log2} until decided"))
        return built.entry

    inexact: dict[str, int] = {}   # per package: values its fold could not scale exactly
    shards: dict[str, Future[ShardEntry]] = {}
    remake: dict[str, Callable[[], Future[ShardEntry]]] = {}
    for n, (a, b) in enumerate(ranges):
        label = f"shard {n + 1}/{len(ranges)} layers [{a},{b})"
        names = [t for i in range(a, b) for t in layer_tensor_names(model.config, i)]

        def fingerprint(log2: int, a: int = a, b: int = b, names: list[str] = names) -> str:
            return _fingerprint(options, request, ("layers", a, b), hashed()[1], model, names,
                                variant, log2)

        rel = f"shards/layers_{a:02d}_{b:02d}.mlpackage"
        # Fingerprints hold k, so reuse needs the decision; a shard no package of the previous
        # build matches at that build's k (every package of a build has its one k) is built
        # whatever k turns out to be, and its weights are converted while k is decided.
        if residual is None and previous is not None and previous.has(fingerprint(previous.log2)):
            decided()
        entry = None if residual is None else _reuse(
            previous, fingerprint(residual.log2_factor), rel, tmp, ShardEntry)
        if entry is not None:
            say(f"{label}: unchanged, reused")
            result.reused.append(rel)
            inexact[rel] = previous.inexact.get(rel, 0)
            shards[rel] = done(entry)
        else:
            remake[rel] = functools.partial(make_shard, a, b, label, rel, fingerprint)
            shards[rel] = remake[rel]()
            result.built.append(rel)
        model.check_unchanged()
        pending.relay()
        _raise_if_failed(embeddings, *shards.values())

    residual = decided()  # a build of reused shards only (or of none) has not asked yet
    log2 = residual.log2_factor
    stale = [rel for rel, k in made_at.items() if k != log2]
    if stale:
        say(f"residual scale: the calibration chose 2^{log2}; building the {len(stale)} "
            f"shard(s) folded at the assumed 2^{made_at[stale[0]]} again")
        for rel in stale:
            shards[rel].exception()   # its helper jobs are done with its files
            shutil.rmtree(tmp / rel)
            shards[rel] = remake[rel]()
            _raise_if_failed(embeddings, *shards.values())
    residual.inexact_values.update(inexact)
    weight_memory.trim()   # the layers' buffers: the head's chunks are larger
    source_digest, tensor_sha = hashed()
    chunks = head_chunk_bounds(model.config.vocab_size, request.head_chunks, request.head_argmax)
    if len(head_plan) > 1:
        say(f"LM head: {len(chunks)} chunks over --max-head-mb {request.max_head_mb:g}, split "
            f"into {len(head_plan)} packages: "
            + ", ".join(f"[{chunks[a][0]},{chunks[b - 1][1]}) ({b - a} chunk"
                        f"{'s' if b - a > 1 else ''})" for a, b in head_plan))
    heads = []
    for k, (first, last) in enumerate(head_plan):
        start, end = chunks[first][0], chunks[last - 1][1]
        whole = len(head_plan) == 1
        # A package of the whole head keeps the fingerprint and name it had before heads could
        # be split: an unchanged build reuses it.
        fp = _fingerprint(options, request, ("head",) if whole else ("head", first, last),
                          tensor_sha, model, ["output_norm.weight", model.lm_head.name], variant,
                          log2)
        rel = "head.mlpackage" if whole else f"head_vocab_{start:06d}_{end:06d}.mlpackage"
        label = ("LM head" if whole else
                 f"LM head package {k + 1}/{len(head_plan)} vocabulary [{start},{end})")
        head = _reuse(previous, fp, rel, tmp, HeadEntry)
        if head is not None:
            say(f"{label}: unchanged, reused")
            result.reused.append(rel)
            heads.append(done(head))
        else:
            t0 = time.monotonic()
            built = _build_head(model, request, tmp, rel, fp, chunks, first, last,
                                None if request.force_ane_limits else request.max_head_mb, log2,
                                finishing)
            count = last - first
            say(f"{label}: {count} chunk{'s' if count > 1 else ''} built in "
                f"{time.monotonic() - t0:.1f}s, "
                f"{built.bytes / 2**20:,.1f} MiB, {_format_counts(built.quant)}")
            result.built.append(rel)
            heads.append(built.entry)
        model.check_unchanged()
        _raise_if_failed(embeddings, *shards.values(), *heads)
    shutil.rmtree(_converter_tmp(tmp), ignore_errors=True)
    weight_memory.trim()   # the head's: nothing after it converts a matrix

    say("embeddings and tokenizer")
    embeddings_entry, residual.inexact_values["embeddings"] = embeddings.result()
    tok_path = tmp / "tokenizer.json"
    tok_path.write_text(model.tokenizer_data.model_dump_json())
    model.check_unchanged()

    manifest = Manifest(
        tool_version=ane_spec.__version__, graph_revision=GRAPH_REVISION,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        name=request.name or out.name,
        source=SourceInfo(path=str(model.path.resolve()), bytes=model.path.stat().st_size,
                          file_type=model.file_type_name, **{DIGEST: source_digest},
                          parameters=model.parameter_count),
        model=model.config, tokenizer=file_ref(tmp, tok_path), build=options,
        rope=model.rope_spec(request.max_seq),
        rope_local=(model.rope_spec(request.max_seq, local=True)
                    if model.config.has_local_layers else None),
        embeddings=embeddings_entry, residual_scale=residual,
        shards=[s.result() for s in shards.values()], heads=[h.result() for h in heads])
    write_manifest(manifest, tmp)
    result.summary = (quant_summary(manifest) + ring_summary(manifest)
                      + kv_write_summary(manifest) + describe_residual_scale(residual))
    return result


def _raise_if_failed(*jobs: Future | None) -> None:
    """Raise what a finished job beside the build raised (a corrupt embedding table, a full
    disk under a package's weights) now, not after the packages still to come."""
    for job in jobs:
        if job is not None and job.done():
            job.result()


def _write_embeddings(model: GGUFModel, tmp: Path, log2: int) -> tuple[EmbeddingsEntry, int]:
    """The embedding table's files, times 2^log2, and their entry; with the count of values
    the fold could not scale exactly."""
    fold = FoldCount()
    fmt, files = write_embeddings(model.tensor("token_embd.weight"), tmp / "embeddings", log2,
                                  fold)
    entry = EmbeddingsEntry(format=fmt, vocab_size=model.config.vocab_size,
                            dim=model.config.hidden_size,
                            files={k: file_ref(tmp, p, uncached=True) for k, p in files.items()})
    return entry, fold.inexact


def _is_complete(folder: Path) -> bool:
    """A dead build's folder is a whole build if its manifest loads (it is written last)."""
    try:
        load_manifest(folder, verify=False)
    except AneSpecError:
        return False
    return True


_SIGNAL_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)


@contextlib.contextmanager
def _sigbus_ends_build(source: Path, out: Path, litter: tuple[Path, Path]) -> Iterator[None]:
    """SIGBUS is what a memory-mapped access gets when the file behind it cannot serve the page:
    the GGUF shrank under a read, or a disk filled up under a write through a map (the
    embeddings are written with open_memmap). Python cannot turn it into an exception (the
    faulting access would just repeat) and by default the process dies with no message, leaving
    its temporary folder. This handler, installed at the C level, prints the one line the CLI
    would print, removes the build's temporary folder and lock file, and exits with status 2."""
    if not hasattr(signal, "SIGBUS"):
        yield
        return
    size = source.stat().st_size
    prefix = "ane-spec build: error: "
    shrank = (one_line(f"{prefix}{source.name} changed during the build (it shrank while being "
                       f"read); {out} was left as it was") + "\n").encode()
    full = (one_line(f"{prefix}a write through a memory map failed: is the disk holding {out} "
                     f"full? {out} was left as it was") + "\n").encode()
    folder, lock_file = litter
    # Threads that read the map (the conversion, the calibration, the hashing beside them) can
    # fault at once: the first says the line and exits; the others wait for that (returning
    # would repeat their faulting access).
    first = threading.Lock()

    def on_sigbus(_signum: int) -> None:
        if not first.acquire(blocking=False):
            while True:
                time.sleep(60)
        try:
            gone = os.stat(source).st_size < size
        except OSError:
            gone = True
        os.write(2, shrank if gone else full)
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            lock_file.unlink()
        os._exit(2)

    handler = _SIGNAL_HANDLER(on_sigbus)
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    previous = libc.signal(signal.SIGBUS, ctypes.cast(handler, ctypes.c_void_p))
    try:
        yield
    finally:
        libc.signal(signal.SIGBUS, previous)


def _validate(model: GGUFModel, r: BuildRequest) -> list[tuple[int, int]]:
    c = model.config
    if r.max_seq < 32 or r.max_seq % 32:
        raise BuildError(f"--max-seq {r.max_seq} must be a positive multiple of 32 (state "
                         "dimensions that are not multiples of 32 fail on the ANE)")
    if r.max_seq > c.context_length:
        raise BuildError(f"--max-seq {r.max_seq} exceeds the model's context length "
                         f"{c.context_length}")
    if r.prefill_t and not MAX_T < r.prefill_t <= min(MAX_PREFILL_T, r.max_seq):
        raise BuildError(f"--prefill-t {r.prefill_t} must be 0 (no prefill function) or from "
                         f"{MAX_T + 1} to {min(MAX_PREFILL_T, r.max_seq)} (at most "
                         f"{MAX_PREFILL_T} and at most --max-seq)")
    if r.head_layout != "channels" and r.head_argmax:
        raise BuildError(f"--head-layout {r.head_layout} needs a logits head: --head-argmax "
                         "emits one value per row, which has no vocabulary axis to move")
    if not 1 <= r.head_chunks <= c.vocab_size:
        raise BuildError(f"--head-chunks {r.head_chunks} must be between 1 and the vocabulary "
                         f"size {c.vocab_size}")
    if r.head_chunks < min_head_chunks(c.vocab_size):
        raise BuildError(f"--head-chunks {r.head_chunks} makes LM-head chunks of up to "
                         f"{-(-c.vocab_size // r.head_chunks):,} channels, over the "
                         f"{MAX_HEAD_CHANNELS:,} known to stay on the ANE; use at least "
                         f"{min_head_chunks(c.vocab_size)}")
    refusals = ane_limit_refusals(r.max_seq)
    if refusals and not r.force_ane_limits:
        raise BuildError(f"{'; '.join(refusals)}. Lower it, or pass {FORCE_ANE_LIMITS_FLAG} to "
                         "build it anyway (it will not run on the Neural Engine)")
    parse_residual_scale(r.residual_scale)
    if not 0 < r.min_weight_cosine <= 1:
        raise BuildError(f"--min-weight-cosine {r.min_weight_cosine} must be in (0, 1]")
    ranges = parse_topology(r.topology, c.num_layers)
    if ranges is None:
        ranges = plan_topology(c, r.weights, r.max_shard_mb)
    check_budget(ranges, c, r.weights, r.max_shard_mb)
    # What `tokenize` and the runtime will refuse is refused before any shard is built.
    model.tokenizer_data  # noqa: B018 (validates the vocabulary and merges)
    rope = model.rope_spec(r.max_seq)
    factors = np.asarray(rope.factors)
    source = ("rope_freqs.weight" if rope.factor_set in ("freqs", "none")
              else f"rope_factors_{rope.factor_set}.weight")
    require_finite(source, factors)
    if (factors <= 0).any():
        raise BuildError(f"tensor '{source}' holds factors <= 0; "
                         "the GGUF file is corrupt")
    return ranges


def _plan_head(model: GGUFModel, r: BuildRequest) -> tuple[list[tuple[int, int]], list[str]]:
    """The LM head's packages, as runs [first, last) of its chunks under --max-head-mb, and the
    chunks too big for any package (refused unless --force-ane-limits, which builds each alone
    in a package over the budget)."""
    c = model.config
    if not r.max_head_mb > 0:
        raise BuildError(f"--max-head-mb {r.max_head_mb} must be a positive number of MiB")
    chunks = head_chunk_bounds(c.vocab_size, r.head_chunks, r.head_argmax)
    sizes = head_chunk_bytes(chunks, c.hidden_size, r.weights)
    refusals = head_budget_problems(chunks, sizes, r.max_head_mb, r.weights, c.hidden_size)
    if refusals and not r.force_ane_limits:
        raise BuildError(f"{'; '.join(refusals)}; or pass {FORCE_ANE_LIMITS_FLAG} to build it "
                         "anyway (a head program this size was never measured resident)")
    plan = plan_head_packages(sizes, r.max_head_mb)
    if len(plan) > MAX_HEAD_PACKAGES:  # a manifest listing more is refused when loaded
        raise BuildError(f"--max-head-mb {r.max_head_mb:g} splits the LM head into {len(plan)} "
                         f"packages, more than the {MAX_HEAD_PACKAGES} a build may have; raise "
                         "it or use fewer --head-chunks")
    return plan, refusals


def _check_output(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise BuildError(f"{out} already exists; pass --force to rebuild it (shards whose "
                         "inputs are unchanged are reused)")
    if out.exists() and not out.is_dir():
        raise BuildError(f"{out} exists and is not a folder")


def ring_summary(m: Manifest) -> list[str]:
    """The saving of a build's KV rings, for the build's report."""
    ring, c, seq = m.build.swa_ring, m.model, m.build.max_seq
    if not ring:
        return []
    with_ring, full = kv_state_bytes(c, seq, ring), kv_state_bytes(c, seq, 0)
    return [f"K/V per conversation at max_seq {seq}: {with_ring / 2**20:,.2f} MiB with "
            f"{ring}-slot rings on the {sum(c.swa_layers)} sliding-window layers "
            f"({full / 2**20:,.2f} MiB full-length)"]


def kv_write_summary(m: Manifest) -> list[str]:
    """What each pass's K/V write moves in this build's form, beside the other form's figure."""
    b, c = m.build, m.model
    other = "scatter" if b.kv_write == "slice" else "slice"
    traffic = {form: kv_traffic(c, b.max_seq, form, kv_write_window(None), b.swa_ring)
               for form in (b.kv_write, other)}

    def moved(form: str) -> str:
        t = traffic[form]
        return f"{format_bytes(t.write_read)} read + {format_bytes(t.write_written)} written"

    attention = traffic[b.kv_write].attention_read
    return [f"K/V write ({b.kv_write}) per decode pass: {moved(b.kv_write)} ({other}: "
            f"{moved(other)}); attention reads {format_bytes(attention)} in both"]


def ring_size(c: ModelConfig, r: BuildRequest) -> int:
    """The local layers' K/V ring (0: full-length states): only for models with sliding-window
    layers, when asked, and where the ring is shorter than the context. It holds the window
    and the widest pass: a prefill chunk of --prefill-t rows, or a decode block."""
    widest = max(MAX_T, r.prefill_t or 0)
    if not (r.swa_ring and c.has_local_layers and uses_ring(c.sliding_window, widest,
                                                            r.max_seq)):
        return 0
    return ring_rows(c.sliding_window, widest)


def _options(r: BuildRequest, ranges: list[tuple[int, int]], c: ModelConfig) -> BuildOptions:
    vocab_size = c.vocab_size
    return BuildOptions(topology=[b - a for a, b in ranges], max_seq=r.max_seq, t_range=(1, MAX_T),
                        default_t=DEFAULT_T, swa_ring=ring_size(c, r),
                        layout=r.layout, weights=r.weights,
                        head_chunks=len(head_chunk_bounds(vocab_size, r.head_chunks,
                                                          r.head_argmax)),
                        head_argmax=r.head_argmax, min_weight_cosine=r.min_weight_cosine,
                        mask_form=r.mask_form, kv_write=r.kv_write,
                        head_layout=r.head_layout, decode_function=DECODE_FUNCTION,
                        prefill_function=PREFILL_FUNCTION if r.prefill_t else None,
                        prefill_t=r.prefill_t or 0)


def _fingerprint(options: BuildOptions, r: BuildRequest, what: tuple, tensor_sha: dict[str, str],
                 model: GGUFModel, tensors: list[str], variant: GraphVariant,
                 residual_log2: int = 0) -> str:
    """Everything a package depends on. Equal fingerprints mean an identical package."""
    relevant = {
        "compiler": GRAPH_REVISION, "what": what, "config": model.config.model_dump(),
        "max_seq": options.max_seq, "layout": options.layout, "weights": options.weights,
        # Only where there is a ring, so every other build's fingerprints stay what they were.
        **({"swa_ring": options.swa_ring} if options.swa_ring else {}),
        # Under auto the floor picks each tensor's format, so it changes the packages.
        "min_weight_cosine": options.min_weight_cosine if options.weights == "auto" else None,
        "variant": repr(variant),
        "head": [options.head_chunks, options.head_argmax] if what[0] == "head" else None,
        "rope": model.rope_spec(r.max_seq).model_dump() if what[0] == "layers" else None,
        "tensors": {t: tensor_sha[t] for t in tensors},
    }
    if residual_log2:  # absent when unscaled: earlier builds' fingerprints stay valid
        relevant["residual_log2"] = residual_log2
    if what[0] == "layers" and options.prefill_t:  # likewise: only where there is one
        relevant["prefill_t"] = options.prefill_t
    if what[0] == "layers" and options.kv_write != "scatter":  # likewise: heads do not change
        relevant["kv_write"] = options.kv_write
    if what[0] == "head" and options.head_layout != "channels":  # likewise: layers do not change
        relevant["head_layout"] = options.head_layout
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


@dataclass
class PreviousBuild:
    """Packages of the build being replaced, by fingerprint, for reuse."""

    root: Path
    entries: dict[str, ShardEntry | HeadEntry]
    inexact: dict[str, int] = field(default_factory=dict)  # residual fold, per package path
    log2: int = 0   # the residual scale its packages were built with (all of them)

    def has(self, fingerprint: str) -> bool:
        return fingerprint in self.entries


def _previous_build(out: Path) -> PreviousBuild | None:
    if not (out / "manifest.json").is_file():
        return None
    try:
        m = load_manifest(out, verify=False).manifest
    except (AneSpecError, OSError):  # an unreadable old build is simply not reused
        return None
    entries: dict[str, ShardEntry | HeadEntry] = {s.fingerprint: s for s in m.shards}
    entries.update({h.fingerprint: h for h in m.heads})
    inexact = m.residual_scale.inexact_values if m.residual_scale is not None else {}
    log2 = m.residual_scale.log2_factor if m.residual_scale is not None else 0
    return PreviousBuild(out, entries, dict(inexact), log2)


def _reuse(previous: PreviousBuild | None, fp: str, rel: str, tmp: Path, kind: type):
    """Hard-link an unchanged package from the previous build, if its files still hash right."""
    entry = previous.entries.get(fp) if previous else None
    if not isinstance(entry, kind):
        return None
    old = previous.root / entry.file.path
    try:
        if hash_path(old, algorithm=entry.file.algorithm) != (entry.file.bytes, entry.file.digest):
            return None
    except (ManifestError, OSError):
        return None
    dest = tmp / rel
    shutil.copytree(old, dest, copy_function=_link_or_copy)
    return entry.model_copy(update={"file": file_ref(tmp, dest)})


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _convert_layers(model: GGUFModel, r: BuildRequest, a: int, b: int,
                    choices: dict[str, TensorChoice], between: Callable[[], None]
                    ) -> list[LayerWeights]:
    """Layers a..b-1's weights in their stored formats, unscaled (the residual fold comes
    after: it does not change which format a tensor gets, and the cosines recorded in `choices`
    are of the unscaled weights). `between` runs after each layer (progress)."""
    layers = []
    for i in range(a, b):
        layers.append(layer_weights(model, i, r.weights, choices, r.min_weight_cosine))
        between()
    return layers


def _build_shard(model: GGUFModel, r: BuildRequest, a: int, b: int, layers: list[LayerWeights],
                 choices: dict[str, TensorChoice], tmp: Path, rel: str, fp: str,
                 variant: GraphVariant, residual_log2: int = 0,
                 fold: FoldCount | None = None, finishing: FinishAside | None = None
                 ) -> BuiltPackage[ShardEntry]:
    """The shard package of `layers` (converted, unscaled; this list is emptied), folded by
    2^residual_log2. Its entry is complete once `finishing` has hashed it (at once without)."""
    c = model.config
    for j in range(len(layers)):   # in place: an fp16 tensor's unscaled copy is freed at once
        layers[j], n = fold_into_layer(layers[j], c.arch, c.rms_eps, residual_log2, a + j)
        if fold is not None:
            fold.add(n)
    quant = _quant_stats(r, choices)
    stored = sum(w.nbytes for lw in layers
                 for w in (lw.qkv, lw.attn_output, lw.ffn_up, lw.ffn_down))
    if stored > r.max_shard_mb * MIB:
        fp16 = sorted(n for n, ch in choices.items() if ch.format == "fp16")
        raise BuildError(f"shard [{a},{b}) holds {stored / MIB:,.0f} MiB of weights, over "
                         f"--max-shard-mb {r.max_shard_mb}"
                         + (f" ({len(fp16)} tensor(s) fell back to fp16, e.g. '{fp16[0]}')"
                            if fp16 else "")
                         + "; give it fewer layers with --topology")
    ring = ring_size(model.config, r)
    program = layer_program(a, layers, model.config, r.max_seq, r.layout, variant, ring=ring,
                            kv_write=r.kv_write)
    if r.prefill_t:  # the same layers (the same weight arrays) at T = P, saved alongside
        program = with_prefill(program, layer_program(a, layers, model.config, r.max_seq,
                                                      r.layout, variant, ring=ring,
                                                      tokens=r.prefill_t, kv_write=r.kv_write))
    holder = [program]
    layers.clear()
    del program
    functions = describe_functions(holder[0])
    path, (inputs, outputs, states), writing = _save_checked(
        holder, tmp, rel, "layers", r.weights, prefill_t=r.prefill_t or 0)
    return _built_package(tmp, path, finishing, quant, functions, lambda ref: ShardEntry(
        layers=(a, b), file=ref, inputs=inputs, outputs=outputs, states=states, quant=quant,
        fingerprint=fp), writing)


def describe_functions(prog: Program) -> str:
    """The functions a program holds and the token counts each takes, e.g. `main (T 1..4)`:
    the axis of the hidden input that is flexible in `main` is the token axis, and another
    function (a fixed-T prefill) states its own size there."""
    main = prog.functions["main"].inputs[HIDDEN_IN].shape
    axis = next(k for k, d in enumerate(main) if not isinstance(d, (int, np.integer)))
    words = []
    for name, func in prog.functions.items():
        t = func.inputs[HIDDEN_IN].shape[axis]
        words.append(f"{name} (T {int(t)})" if isinstance(t, (int, np.integer))
                     else f"{name} (T 1..{MAX_T})")
    return ", ".join(words)


def _build_head(model: GGUFModel, r: BuildRequest, tmp: Path, rel: str, fp: str,
                all_chunks: list[tuple[int, int]], first: int, last: int,
                max_mb: float | None, residual_log2: int = 0,
                finishing: FinishAside | None = None) -> BuiltPackage[HeadEntry]:
    """The head package computing chunks first..last-1 of `all_chunks` (all of them, or one
    contiguous run of a head split over --max-head-mb); refused if its converted weights are
    over `max_mb` (None: no budget). `residual_log2`: the stream's scale (residual_scale.py).
    Its entry is complete once `finishing` has hashed it (at once without)."""
    c = model.config
    t = model.lm_head
    chunks = all_chunks[first:last]
    choices: dict[str, TensorChoice] = {}
    weights = []
    for s, e in chunks:
        w = convert_parts([Part(t, np.arange(s, e), f"{t.name}[{s}:{e}]")], r.weights,
                          r.min_weight_cosine)
        t.release(s, e)
        choices.update({ch.name: ch for ch in w.choices})
        weights.append(w)
    quant = _quant_stats(r, choices)
    stored = sum(w.nbytes for w in weights)
    if max_mb is not None and stored > max_mb * MIB:
        # The plan costed auto as int8 per channel; a chunk that fell back (lut8, fp16) can
        # take a package over: refused like an over-budget shard.
        fallback = sorted(n for n, ch in choices.items() if ch.format != "int8-channel")
        raise BuildError(f"LM-head package [{chunks[0][0]},{chunks[-1][1]}) holds "
                         f"{mib(stored)} MiB of weights, over --max-head-mb "
                         f"{max_mb:g} ({HEAD_PACKAGE_SOURCE})"
                         + (f" ({len(fallback)} chunk(s) fell back from int8, e.g. "
                            f"'{fallback[0]}')" if fallback else "")
                         + f"; use more --head-chunks, or pass {FORCE_ANE_LIMITS_FLAG}")
    norm = finite_vector(model.tensor("output_norm.weight"))
    # output_norm reads the (scaled) stream: eps * s^2; its weight and the head are unchanged.
    holder = [head_program(norm, weights, c, r.layout, r.head_argmax, first_chunk=first,
                           head_layout=r.head_layout,
                           eps=stream_eps(c.rms_eps, residual_log2) if residual_log2 else None)]
    del weights
    path, (inputs, outputs, _), writing = _save_checked(holder, tmp, rel, "head", r.weights)
    return _built_package(tmp, path, finishing, quant, "", lambda ref: HeadEntry(
        chunks=chunks, argmax=r.head_argmax, file=ref, inputs=inputs, outputs=outputs,
        quant=quant, fingerprint=fp), writing)


def build_logits_head(gguf_path: str | os.PathLike[str], manifest: Manifest,
                      folder: Path) -> tuple[Path, list[tuple[int, int]]]:
    """A logits head (no argmax) for `manifest`'s model from its source GGUF, with the build's
    weight format, layout, weight floor and vocabulary chunks, so each chunk's weights are the
    ones its --head-argmax head converted (auto picks a format per chunk, deterministically).
    The doctor's argmax-head check runs both on the same hidden states. Returns (package,
    chunks)."""
    model = open_gguf(gguf_path)
    b = manifest.build
    if (model.config.vocab_size, model.config.hidden_size) != (
            manifest.model.vocab_size, manifest.model.hidden_size):
        raise BuildError(f"{gguf_path} is not this build's model (vocabulary or hidden size "
                         "differ)")
    request = BuildRequest(max_seq=b.max_seq, weights=b.weights, layout=b.layout,
                           head_chunks=len(manifest.head_chunks), head_argmax=False,
                           min_weight_cosine=b.min_weight_cosine)
    folder.mkdir(parents=True, exist_ok=True)
    # A scratch package, never reused: the fingerprint only has to be well formed. It is one
    # package whatever the build's split: it only has to give the same logits per chunk.
    chunks = head_chunk_bounds(model.config.vocab_size, len(manifest.head_chunks), False)
    log2 = manifest.residual_scale.log2_factor if manifest.residual_scale is not None else 0
    head = _build_head(model, request, folder, "logits-head.mlpackage", "0" * 64, chunks, 0,
                       len(chunks), None, log2).entry.result()
    if head.chunks != manifest.head_chunks:
        raise BuildError("the logits head's chunks differ from the build's")
    shutil.rmtree(_converter_tmp(folder), ignore_errors=True)
    return folder / head.file.path, head.chunks


def head_chunk_bounds(vocab_size: int, head_chunks: int, argmax: bool) -> list[tuple[int, int]]:
    """The LM head's vocabulary chunks [start, end): `head_chunks` as even as np.linspace makes
    them, or with --head-argmax as many more as keep each within ANE_MAX_ARGMAX_CHANNELS
    (ane_limits.ARGMAX_SOURCE: Anemll's argmax indices stop at 16,383); the host still takes the best chunk's max."""
    n = head_chunks
    if argmax:
        n = max(n, -(-vocab_size // ANE_MAX_ARGMAX_CHANNELS))
    bounds = np.linspace(0, vocab_size, n + 1).astype(int)
    return [(int(s), int(e)) for s, e in zip(bounds[:-1], bounds[1:])]


def _save_checked(holder: list[Program], tmp: Path, rel: str, kind: str, weights: WeightFormat,
                  prefill_t: int = 0):
    """Record the interface, write the package and free the program before the static checks
    read the package back. Returns the package's path, its interface and its weight files
    still being written (conversion_passes.weights_written_once `finish_later`: they hold the
    program's weights until written; `_built_package` waits for them).

    The program comes in a one-item list that this function empties: a MIL program is a web of
    reference cycles (ops, vars, blocks), so only gc.collect() frees it, and only once no caller
    holds it either. A caller's local kept the last shard's weights (a whole shard, 1.8 GB on
    Llama 3.2 3B) alive into the next one, whose weights piled on top, until some later
    collection happened to run."""
    prog = holder.pop()
    interface = _interface(prog)
    path = tmp / rel
    writing: list[PendingWeights] = []
    try:
        save_package(prog, path, tmp_dir=_converter_tmp(tmp), finish_later=writing)
    except RuntimeError as exc:
        # coremltools' C++ package and weight writers report I/O failures, a full disk among
        # them, as RuntimeError ("[MIL FileWriter]: Unknown error occurred while writing").
        raise _write_failed(tmp, rel, exc) from None
    del prog
    gc.collect()
    try:
        check_package(path, kind=kind, weights=weights, prefill_t=prefill_t)
    except BaseException:
        for w in writing:
            w.discard()
        raise
    return path, interface, writing


def _write_failed(tmp: Path, rel: str, exc: BaseException) -> BuildError:
    free = shutil.disk_usage(tmp).free
    return BuildError(f"writing {rel} failed: {untrusted(str(exc), 200)} "
                      f"({free / 2**20:,.1f} MiB free where the build is written)")


Entry = TypeVar("Entry", ShardEntry, HeadEntry)


@dataclass
class BuiltPackage(Generic[Entry]):
    """A package just written: its manifest entry (once hashed), size, weights and functions."""

    entry: Future[Entry]
    bytes: int
    quant: QuantStats
    functions: str


def _built_package(tmp: Path, path: Path, finishing: FinishAside | None, quant: QuantStats,
                   functions: str, entry: Callable[[FileRef], Entry],
                   writing: Sequence[PendingWeights] = ()) -> BuiltPackage[Entry]:
    """The package at `path`, its entry made from its hash by `finishing` once its weight files
    still `writing` are whole (here, and at once, without)."""
    rel = path.relative_to(tmp).as_posix()
    pending = {os.path.abspath(w.path): w.bytes for w in writing}
    size = sum(pending.get(os.path.abspath(f), f.stat().st_size)
               for f in path.rglob("*") if f.is_file())

    def failed(exc: BaseException) -> BuildError:
        return _write_failed(tmp, rel, exc)

    if finishing is not None:
        made = finishing.hash_package(tmp, path, entry, writing, failed)
    else:
        wait_whole(writing, failed)
        made = done(entry(file_ref(tmp, path, uncached=True)))
    return BuiltPackage(made, size, quant, functions)


def _converter_tmp(tmp: Path) -> Path:
    """Where coremltools' own temporary files go: inside the build's folder, so a killed build
    leaves them with everything else it leaves (removed by the next build)."""
    return tmp / "converter-tmp"


def _quant_stats(r: BuildRequest, choices: dict[str, TensorChoice]) -> QuantStats:
    # A NaN cosine counts as the worst and fails the gate (`NaN < x` is False, so a plain
    # comparison would pass it); weights.py refuses non-finite values before it gets here.
    cosines = {n: ch.cosine for n, ch in choices.items()}
    worst = min(cosines, key=lambda k: -np.inf if np.isnan(cosines[k]) else cosines[k])
    if not cosines[worst] >= r.min_weight_cosine:
        got = choices[worst].format
        advice = ("even fp16 cannot hold them (values beyond or below fp16's range?)"
                  if r.weights == "auto" else
                  "use --weights auto (the default: a finer form where int8 falls short) "
                  "or fp16 for this model")
        raise BuildError(f"{got} weights of '{worst}' reach cosine {cosines[worst]:.6f} "
                         f"against the GGUF values, below --min-weight-cosine "
                         f"{r.min_weight_cosine}; {advice}")
    return QuantStats(format=r.weights, worst_cosine=cosines[worst], worst_tensor=worst,
                      mean_cosine=float(np.mean(list(cosines.values()))),
                      tensors={n: TensorQuant(format=ch.format, cosine=ch.cosine,
                                              reason=ch.reason[:400])
                               for n, ch in choices.items()})


def _format_counts(q: QuantStats) -> str:
    """e.g. `int8-channel x12, lut8 x2`."""
    counts: dict[str, int] = {}
    for t in q.tensors.values():
        counts[t.format] = counts.get(t.format, 0) + 1
    return ", ".join(f"{f} x{n}" for f, n in sorted(counts.items())) or q.format


def quant_summary(manifest: Manifest, worst: int = 5) -> list[str]:
    """A build's weights in a few lines: tensors and bytes per format, the worst tensors."""
    tensors = {n: t for p in [*manifest.shards, *manifest.heads]
               for n, t in p.quant.tensors.items()}
    if not tensors:
        return []
    counts: dict[str, int] = {}
    for t in tensors.values():
        counts[t.format] = counts.get(t.format, 0) + 1
    lines = ["weights: " + ", ".join(f"{f} x{n}" for f, n in sorted(counts.items()))
             + f" (requested {manifest.build.weights}, floor {manifest.build.min_weight_cosine})"]
    for name, t in sorted(tensors.items(), key=lambda kv: kv[1].cosine)[:worst]:
        lines.append(f"  {name}: {t.format}, cos {t.cosine:.6f} ({t.reason})")
    return lines


def _interface(prog: Program) -> tuple[list[TensorSpec], list[TensorSpec], list[TensorSpec]]:
    func = prog.functions["main"]

    def spec(name: str, var) -> TensorSpec:
        shape = [int(d) if isinstance(d, (int, np.integer)) else "T" for d in var.shape]
        return TensorSpec(name=name, shape=shape, dtype=types.builtin_to_string(var.dtype))

    inputs, states = [], []
    for name, var in func.inputs.items():
        if types.is_state(var.sym_type):
            states.append(TensorSpec(name=name, shape=list(var.sym_type.wrapped_type().get_shape()),
                                     dtype="fp16"))
        else:
            inputs.append(spec(name, var))
    outputs = [spec(v.name, v) for v in func.outputs]
    return inputs, outputs, states
