"""The shard compiler on tiny synthetic models: interface, op inventory, errors, atomicity, reuse."""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import weakref
from collections import Counter
from pathlib import Path

import pytest

from ane_spec.errors import BuildError, GGUFError, ManifestError
from ane_spec.manifests.store import load_manifest
from ane_spec.model.synthetic import preset
from ane_spec.shards import build as build_module
from ane_spec.shards.build import BuildRequest, build
from ane_spec.shards.static_checks import dtype_problems, read_package_facts
from ane_spec.shards.topology import check_budget, parse_topology, plan_topology
from tests.gguf_edit import rewrite_gguf

S = 64


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("topology,layout,weights,argmax", [
    ("2,1", "BCT1", "int8-channel", False),
    ("0:1,1:2,2:3", "BC1T", "q8-block", False),
    ("3", "BCT1", "fp16", True),
])
def test_build_interface_and_ops(tiny_gguf: Path, tmp_path: Path, topology: str, layout: str,
                                 weights: str, argmax: bool) -> None:
    out = tmp_path / "art"
    req = BuildRequest(topology=topology, max_seq=S, layout=layout, weights=weights,
                       head_argmax=argmax, head_chunks=3)
    result = build(tiny_gguf, out, req)
    m = load_manifest(out).manifest
    assert [tuple(s.layers) for s in m.shards] == parse_topology(topology, 3)
    assert len(result.built) == len(m.shards) + 1 and not _leftovers(tmp_path)
    hidden = [1, 192, "T", 1] if layout == "BCT1" else [1, 192, 1, "T"]

    for shard in m.shards:
        facts = read_package_facts(out / shard.file.path)
        a, b = shard.layers
        # Every input carries the one RangeDim(1, 4) token axis, at the position the manifest says.
        assert {s.name: s.shape for s in shard.inputs} == {
            "x": hidden, "rope_cos": ["T", 12], "rope_sin": ["T", 12],
            "attn_mask": [1, 1, "T", S], "kv_write_mask": [1, 1, S, "T"]}
        for spec in shard.inputs:
            shape, ranges = facts.inputs[spec.name]
            assert [r for r, d in zip(ranges, spec.shape) if d == "T"] == [(1, 4)]
            assert all(lo == hi for (lo, hi), d in zip(ranges, spec.shape) if d != "T")
        assert [o.name for o in shard.outputs] == ["hidden"] == facts.outputs
        expected_states = {f"layer_{i}_{kv}": ([1, 2, S, 32], "fp16")
                           for i in range(a, b) for kv in "kv"}
        assert facts.states == expected_states
        n = b - a
        ops = facts.ops
        assert ops["conv"] == 4 * n and ops["layer_norm"] == 2 * n
        assert ops["reduce_max"] == ops["exp"] == ops["real_div"] == n  # the fp16 softmax
        assert ops["write_state"] == 2 * n and ops["matmul"] == 4 * n
        # fp16 only: no casts, no fp32 value anywhere; and no trailing identity.
        assert not {"cast", "softmax", "identity"} & set(ops)
        assert set(facts.output_dtypes.values()) <= {"fp16", "int32", "int8", "bool", "string"}
        assert dtype_problems(facts) == [] and set(facts.io_dtypes.values()) == {"fp16"}
        blockwise = ops["constexpr_blockwise_shift_scale"]
        assert blockwise == (0 if weights == "fp16" else 4 * n)
        for _, dtype, data, scale in facts.conv_weights:
            if weights == "int8-channel":
                assert dtype == "int8" and scale[1:] == [1, 1, 1]
            elif weights == "q8-block":
                assert dtype == "int8" and scale[1] == data[1] // 32
            else:
                assert dtype == "fp16" and scale is None

    head = read_package_facts(out / m.heads[0].file.path)
    assert "fp32" not in head.output_dtypes.values() and dtype_problems(head) == []
    assert not {"cast", "identity"} & set(head.ops)
    assert m.heads[0].chunks == [(0, 341), (341, 682), (682, 1024)]
    if argmax:
        assert head.outputs == ["max_0", "argmax_0", "max_1", "argmax_1", "max_2", "argmax_2"]
        assert [o.dtype for o in m.heads[0].outputs][:2] == ["fp16", "int32"]
        assert head.ops["reduce_argmax"] == 3
    else:
        assert head.outputs == ["logits_0", "logits_1", "logits_2"]
        assert m.heads[0].outputs[0].shape == ([1, 341, "T", 1] if layout == "BCT1" else [1, 341, 1, "T"])
    assert m.embeddings.format == "q8_0" and set(m.embeddings.files) == {"qs", "scales"}
    assert m.rope.factor_set == "short" and m.rope.context_window == S
    q = m.shards[0].quant
    assert q.format == weights and (q.worst_cosine == 1.0 if weights == "q8-block" else
                                    0.999 < q.worst_cosine <= 1.0)


def test_rebuild_reuses_unchanged_packages(tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "art"
    req = BuildRequest(topology="2,1", max_seq=S)
    build(tiny_gguf, out, req)
    again = build(tiny_gguf, out, req, force=True)
    assert again.built == [] and len(again.reused) == 3
    changed_head = build(tiny_gguf, out, req.model_copy(update={"head_chunks": 2}), force=True)
    assert changed_head.built == ["head.mlpackage"] and len(changed_head.reused) == 2
    load_manifest(out)  # hashes still verify after the swap
    assert not _leftovers(tmp_path)


def test_long_context_build_records_long_factors(tiny_gguf: Path, tmp_path: Path) -> None:
    m = load_manifest(build(tiny_gguf, tmp_path / "a", BuildRequest(topology="3",
                                                                    max_seq=8192)).manifest_path)
    assert m.manifest.rope.factor_set == "long"


# --- bad input: a clear error, nothing half-built ------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    ({"topology": "2,2"}, "covers 4 layers; the model has 3"),
    ({"topology": "0:1,2:3"}, "layers 1 are in no shard"),
    ({"topology": "0:2,1:3"}, "layer 1 is in shard 0 and shard 1"),
    ({"topology": "x,y"}, "expected layer counts"),
    ({"max_seq": 100}, "multiple of 32"),
    ({"max_shard_mb": 0, "topology": "3"}, "over --max-shard-mb 0"),
    ({"head_chunks": 0}, "--head-chunks 0"),
    # Issue 28 item 4: a width the ANE cannot take is refused, naming the limit and its source.
    ({"max_seq": 16416}, r"16,384.*ANEMLL.*--force-ane-limits"),
    ({"min_weight_cosine": 0.99999999}, "below --min-weight-cosine"),
])
def test_bad_requests(tiny_gguf: Path, tmp_path: Path, kwargs: dict, message: str) -> None:
    out = tmp_path / "art"
    with pytest.raises(BuildError, match=message):
        build(tiny_gguf, out, BuildRequest(**({"max_seq": S} | kwargs)))
    assert not out.exists() and not _leftovers(tmp_path)


def test_unsupported_gguf(tiny_gguf: Path, tmp_path: Path) -> None:
    bad = rewrite_gguf(tiny_gguf, tmp_path / "gemma2.gguf", arch="gemma2")
    with pytest.raises(GGUFError, match="architecture 'gemma2' is not supported"):
        build(bad, tmp_path / "art", BuildRequest(max_seq=S))
    assert not (tmp_path / "art").exists()


def test_existing_output_needs_force(tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "art"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(BuildError, match="already exists; pass --force"):
        build(tiny_gguf, out, BuildRequest(max_seq=S))
    assert (out / "keep.txt").read_text() == "mine"


def _second_save_finds_the_disk_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """The build's second package write fails as a full disk would (ENOSPC)."""
    real_save = build_module.save_package
    calls = Counter()

    def flaky_save(prog, path, tmp_dir=None, finish_later=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_save(prog, path, tmp_dir, finish_later)

    monkeypatch.setattr(build_module, "save_package", flaky_save)


def test_failure_midway_keeps_the_previous_build(tiny_gguf: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "art"
    build(tiny_gguf, out, BuildRequest(topology="2,1", max_seq=S))
    before = (out / "manifest.json").read_text()
    _second_save_finds_the_disk_full(monkeypatch)
    with pytest.raises(BuildError, match="No space left on device.*layers_01_02.mlpackage"):
        build(tiny_gguf, out, BuildRequest(topology="1,1,1", max_seq=S), force=True)
    assert (out / "manifest.json").read_text() == before
    load_manifest(out)
    assert not _leftovers(tmp_path)


def test_a_failed_build_waits_for_the_package_being_hashed(tiny_gguf: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """Packages are hashed by a helper thread while the next one is made
    (shards/finish_aside.py). A build that fails meanwhile cancels the hashes not started and
    waits for the one under way before its folder is removed: no thread reads a folder being
    deleted, and none outlives the build."""
    import threading
    import time

    from ane_spec.shards import finish_aside

    real_ref = finish_aside.file_ref
    hashed: list[tuple[str, bool]] = []

    def slow_ref(root: Path, path: Path, *, uncached: bool = False, known=None):
        time.sleep(0.5)   # still hashing when the next package fails
        try:
            # Its weight file, hashed from memory, was stopped with the build: this raises.
            return real_ref(root, path, uncached=uncached, known=known)
        finally:
            hashed.append((path.name, root.is_dir()))

    monkeypatch.setattr(finish_aside, "file_ref", slow_ref)
    _second_save_finds_the_disk_full(monkeypatch)
    with pytest.raises(BuildError, match="No space left on device"):
        build(tiny_gguf, tmp_path / "art", BuildRequest(topology="1,1,1", max_seq=S))
    assert hashed == [("layers_00_01.mlpackage", True)]   # ended inside a folder still there
    assert not any(t.name.startswith(("finish-aside", "hash-package"))
                   for t in threading.enumerate())
    assert not _leftovers(tmp_path)


def _slow_weight_writes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each stage of a package's weight file takes 0.2 s to write; the list gets, for each
    package saved, whether its weight files were whole when `_save_checked` returned."""
    import time

    from ane_spec.shards import direct_file

    real_write = direct_file.DirectFile._write_stage

    def slow(self, length: int) -> None:
        if str(self.path).endswith("weight.bin"):
            time.sleep(0.2)
        real_write(self, length)

    whole: list[bool] = []
    real_save = build_module._save_checked

    def recorded(*args, **kwargs):
        path, interface, writing = real_save(*args, **kwargs)
        whole.append(all(w.done.done() for w in writing))
        return path, interface, writing

    monkeypatch.setattr(direct_file.DirectFile, "_write_stage", slow)
    monkeypatch.setattr(build_module, "_save_checked", recorded)
    return whole


def test_packages_are_handed_over_before_their_weights_are_on_disk(
        tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package's weight file is finished by its own thread while the build goes on
    (conversion_passes.weights_written_once `finish_later`): the build still records each
    package's size and hash as the files are once whole, which loading checks."""
    whole = _slow_weight_writes(monkeypatch)
    out = tmp_path / "art"
    build(tiny_gguf, out, BuildRequest(topology="1,1,1", max_seq=S))
    assert len(whole) == 4 and not any(whole)
    loaded = load_manifest(out)   # sizes and sha256 of every file, as written
    for entry in [*loaded.manifest.shards, *loaded.manifest.heads]:
        weights = out / entry.file.path / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
        assert weights.stat().st_size > 64


def test_a_failed_build_stops_the_weights_still_being_written(
        tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that fails while a package's weight file is still being written stops that
    writer before its folder is removed: no thread outlives the build, nothing is left."""
    import threading

    _slow_weight_writes(monkeypatch)
    _second_save_finds_the_disk_full(monkeypatch)
    with pytest.raises(BuildError, match="No space left on device"):
        build(tiny_gguf, tmp_path / "art", BuildRequest(topology="1,1,1", max_seq=S))
    assert not any(t.name == "direct-file" for t in threading.enumerate())
    assert not _leftovers(tmp_path) and not (tmp_path / "art").exists()


def test_a_failed_embeddings_job_ends_the_build_before_the_head(
        tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embeddings are written by the helper once the residual scale is known (before the
    first shard's program): what that job raises ends the build at the next package, not after
    the LM head, and leaves nothing."""
    import threading

    failed = threading.Event()

    def corrupt_table(*args, **kwargs):
        failed.set()
        raise BuildError("tensor 'token_embd.weight' holds NaN at row 7")

    real_shard = build_module._build_shard
    shards: list[int] = []

    def shard_after_the_failure(*args, **kwargs):
        shards.append(1)
        if len(shards) == 2:
            assert failed.wait(30)   # the job ran, and failed, while shard 1 was made
        return real_shard(*args, **kwargs)

    heads: list[int] = []
    real_head = build_module._build_head
    monkeypatch.setattr(build_module, "write_embeddings", corrupt_table)
    monkeypatch.setattr(build_module, "_build_shard", shard_after_the_failure)
    monkeypatch.setattr(build_module, "_build_head",
                        lambda *a, **k: heads.append(1) or real_head(*a, **k))
    with pytest.raises(BuildError, match="token_embd.weight' holds NaN at row 7"):
        build(tiny_gguf, tmp_path / "art", BuildRequest(topology="1,1,1", max_seq=S))
    assert len(shards) in (1, 2) and heads == []   # ended after shard 1 or, at the latest, 2
    assert not _leftovers(tmp_path) and not (tmp_path / "art").exists()


def test_a_full_disk_under_the_weight_file_leaves_the_previous_build(
        tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight file is written by blob_file.py's writer during the conversion: a write it
    cannot make there ends the build with the path and the error, and nothing half-built."""
    from ane_spec.shards import direct_file

    out = tmp_path / "art"
    build(tiny_gguf, out, BuildRequest(topology="2,1", max_seq=S))
    before = (out / "manifest.json").read_text()
    real_write = direct_file.DirectFile._write_stage
    files: list[str] = []

    def full(self, length: int) -> None:
        if not str(self.path).endswith("weight.bin"):   # the embeddings, written beside them
            return real_write(self, length)
        files.extend([self.path] if self.path not in files else [])
        if len(files) > 1:   # the first package's weights are written, the second's are not
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        real_write(self, length)

    monkeypatch.setattr(direct_file.DirectFile, "_write_stage", full)
    with pytest.raises(BuildError, match="No space left on device.*weight.bin"):
        build(tiny_gguf, out, BuildRequest(topology="1,1,1", max_seq=S), force=True)
    assert len(files) == 2
    assert (out / "manifest.json").read_text() == before
    load_manifest(out)
    assert not _leftovers(tmp_path)


def test_pooled_memory_is_reused_and_changes_no_byte(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The build's pools (shards/weight_memory.py): the second of two alike shards converts into
    the first's buffers, and the packages are those of a build without pools, byte for byte."""
    from ane_spec.model import memory_pool
    from ane_spec.model.synthetic import write_synthetic_gguf
    from ane_spec.shards import weight_memory
    from tests.test_conversion_passes import _contents

    gguf = write_synthetic_gguf(tmp_path / "m.gguf", preset("tiny", num_layers=2))
    request = BuildRequest(topology="1,1", max_seq=S, residual_scale="off")
    monkeypatch.setattr(memory_pool, "MIN_POOLED_BYTES", 0)   # the tiny model's are small
    new_buffers: list[int] = []
    real_empty = memory_pool.MemoryPool.empty

    def counted(self, shape, dtype):
        before = self.pooled_bytes()
        a = real_empty(self, shape, dtype)
        if self is weight_memory._current[0]:
            new_buffers.append(self.pooled_bytes() - before)
        return a

    monkeypatch.setattr(memory_pool.MemoryPool, "empty", counted)
    shard_of_call: list[int] = []
    real_shard = build_module._build_shard

    def shard(*args, **kwargs):
        shard_of_call.append(len(new_buffers))
        return real_shard(*args, **kwargs)

    monkeypatch.setattr(build_module, "_build_shard", shard)
    # A package's weights are free for the next shard once written and hashed, by threads of
    # their own; a real shard converts for seconds while they go on (Phi-4-mini's second shard
    # took 16 of its 1,346 MiB fresh). Here the next conversion starts at once: it waits for
    # the hashes, so what is checked is the pool's reuse, not the threads' pace.
    from ane_spec.shards import finish_aside

    finishers: list[finish_aside.FinishAside] = []
    real_init = finish_aside.FinishAside.__init__

    def remembered(self) -> None:
        real_init(self)
        finishers.append(self)

    real_convert = build_module._convert_layers

    def after_hashes(*args, **kwargs):
        finishers[-1]._hashing.submit(lambda: None).result()   # this build's
        return real_convert(*args, **kwargs)

    monkeypatch.setattr(finish_aside.FinishAside, "__init__", remembered)
    monkeypatch.setattr(build_module, "_convert_layers", after_hashes)
    build(gguf, tmp_path / "pooled", request)
    first, second = shard_of_call   # weight allocations made before each shard's package
    assert first > 0 and any(new_buffers[:first])
    assert second > first and not any(new_buffers[first:second])   # all reused
    monkeypatch.setattr(memory_pool.MemoryPool, "empty", real_empty)

    @contextlib.contextmanager
    def no_pools():
        yield None

    monkeypatch.setattr(build_module, "reused_weight_memory", no_pools)
    build(gguf, tmp_path / "plain", request)
    assert _contents(tmp_path / "pooled") == _contents(tmp_path / "plain")
    assert weight_memory._current is None


def _huge_page_advised(array) -> bool:
    """Whether the kernel was asked for huge pages for `array`'s memory (its mapping's VmFlags
    hold "hg"). numpy advises from the page after the one its allocation starts on, which splits
    the mapping: the array's second MB lies in the advised part. The arrays tested are 64 MB,
    over glibc's largest mmap threshold (32 MB): each is a mapping of its own, never heap
    memory an earlier array was advised in."""
    import re

    address = array.__array_interface__["data"][0] + (1 << 20)
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if m := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            inside = int(m[1], 16) <= address < int(m[2], 16)
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()
    raise AssertionError("no mapping holds the array")


_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not _THP.exists()
                    or "[never]" in _THP.read_text(),
                    reason="needs Linux's smaps and transparent huge pages (numpy advises only there)")
def test_the_build_allocates_in_small_pages(tiny_gguf: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """weight_memory.small_pages: numpy's large arrays carry no MADV_HUGEPAGE during a build
    (its docstring has the measurements), and the advice is back afterwards."""
    import numpy as np

    from ane_spec.shards import weight_memory

    switch = weight_memory._huge_page_switch()
    assert switch is not None   # numpy >= 1.20 on Linux
    previous = switch(True)
    try:
        if not _huge_page_advised(np.empty(64 << 20, np.uint8)):
            pytest.skip("this kernel keeps no MADV_HUGEPAGE flag on numpy's memory")
        seen: list[bool] = []
        real = build_module._build_into

        def observed(*args, **kwargs):
            seen.append(_huge_page_advised(np.empty(64 << 20, np.uint8)))
            return real(*args, **kwargs)

        monkeypatch.setattr(build_module, "_build_into", observed)
        build(tiny_gguf, tmp_path / "out", BuildRequest(max_seq=S, residual_scale="off"))
        assert seen == [False]
        assert _huge_page_advised(np.empty(64 << 20, np.uint8))
    finally:
        switch(previous)


def test_each_program_is_freed_before_the_next_shard(tiny_gguf: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory stays bounded by one shard: a MIL program is all reference cycles, so the build's
    own gc.collect() must free it, with no caller still holding it (the collector is off here,
    as it is between its own runs). A shard kept alive into the next one put the real-size
    Qwen3-4B build at 4.27 GB peak instead of ~2.2."""
    alive: list[weakref.ref] = []
    real = build_module.layer_program

    def recorded(*args, **kwargs):
        if kwargs.get("tokens") is None:  # a shard's decode program, made first; its prefill
            # program (same weights, T = P) is made while it lives, by design
            assert all(ref() is None for ref in alive), "the previous shard's ops are alive"
        prog = real(*args, **kwargs)
        alive.append(weakref.ref(prog.functions["main"]))  # its ops hold the weights
        return prog

    monkeypatch.setattr(build_module, "layer_program", recorded)
    gc.disable()
    try:
        build(tiny_gguf, tmp_path / "art", BuildRequest(topology="1,1,1", max_seq=S))
    finally:
        gc.enable()
    assert len(alive) == 6 and all(ref() is None for ref in alive)  # 3 shards x 2 functions


def test_real_size_budgets() -> None:
    c = preset("phi4-mini").to_config()
    check_budget(parse_topology("20,4,6,2", 32), c, "int8-channel", 2000)  # ane-book's layout
    with pytest.raises(BuildError, match=r"shard \[0,24\).*at most 20 layers per shard"):
        check_budget(parse_topology("24,8", 32), c, "int8-channel", 2000)
    assert plan_topology(c, "int8-channel", 2000) == [(0, 20), (20, 32)]
    assert plan_topology(c, "fp16", 2000) == [(0, 10), (10, 20), (20, 30), (30, 32)]


# --- manifest verification --------------------------------------------------------------------

def test_manifest_detects_tampering(tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "art"
    build(tiny_gguf, out, BuildRequest(topology="3", max_seq=S))
    m = load_manifest(out).manifest
    weights = next((out / m.shards[0].file.path).rglob("weight.bin"))
    data = bytearray(weights.read_bytes())
    data[1000] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="does not match its recorded blake3"):
        load_manifest(out)
    load_manifest(out, verify=False)  # --no-verify skips the hashes

    (out / "embeddings" / "embed_scales.npy").unlink()
    with pytest.raises(ManifestError, match="embed_scales.npy' is missing"):
        load_manifest(out, verify=False)

    raw = json.loads((out / "manifest.json").read_text())
    raw["schema_version"] = 99
    (out / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match="schema_version 99"):
        load_manifest(out)
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_manifest(out)
    with pytest.raises(ManifestError, match="no manifest"):
        load_manifest(tmp_path / "nowhere")


def test_artifacts_hashed_with_sha256_by_older_builds_still_verify(tiny_gguf: Path,
                                                                    tmp_path: Path) -> None:
    """A build records BLAKE3 for every artifact; a manifest from before, whose artifacts carry
    sha256, is verified with sha256 (and a changed file still refused); an artifact with both
    digests or neither is refused as malformed. The BLAKE3 recorded is BLAKE3's own (the blake3
    package over the same bytes), not a renamed sha256."""
    import blake3

    from ane_spec.manifests.store import all_file_refs, hash_path

    out = tmp_path / "art"
    build(tiny_gguf, out, BuildRequest(topology="3", max_seq=S))
    loaded = load_manifest(out)
    refs = all_file_refs(loaded.manifest)
    assert refs and {r.algorithm for r in refs} == {"blake3"}
    tokenizer = loaded.manifest.tokenizer
    assert tokenizer.blake3 == blake3.blake3((out / tokenizer.path).read_bytes()).hexdigest()
    assert "sha256" not in json.loads((out / "manifest.json").read_text())["tokenizer"]

    # As an older build wrote it: every artifact's sha256, no blake3.
    raw = json.loads((out / "manifest.json").read_text())

    def as_sha256(node: object) -> None:
        if isinstance(node, dict):
            if "blake3" in node and "path" in node:
                del node["blake3"]
                node["sha256"] = hash_path(out / node["path"], algorithm="sha256")[1]
            for value in node.values():
                as_sha256(value)
        elif isinstance(node, list):
            for value in node:
                as_sha256(value)

    as_sha256(raw)
    (out / "manifest.json").write_text(json.dumps(raw))
    assert {r.algorithm for r in all_file_refs(load_manifest(out).manifest)} == {"sha256"}
    text = (out / tokenizer.path).read_text()
    (out / tokenizer.path).write_text(text.replace("{", "[", 1))   # the same size, changed
    with pytest.raises(ManifestError, match="tokenizer.json' does not match its recorded sha256"):
        load_manifest(out)

    for both_or_neither in ({"blake3": "0" * 64}, {"sha256": None}):
        broken = json.loads(json.dumps(raw))
        broken["tokenizer"].update(both_or_neither)
        broken["tokenizer"] = {k: v for k, v in broken["tokenizer"].items() if v is not None}
        (out / "manifest.json").write_text(json.dumps(broken))
        with pytest.raises(ManifestError, match="exactly one of blake3 and sha256"):
            load_manifest(out, verify=False)


def test_default_shard_budget_keeps_a_margin_under_the_measured_edge() -> None:
    """The auto topology must stay clear of the 1,921 MiB shard measured ANE-resident (the edge
    lies somewhere between it and ~2.3 GiB): at least 5% under it with the default budget."""
    from ane_spec.shards.topology import DEFAULT_MAX_SHARD_MB, MIB, layer_bytes

    c = preset("phi4-mini").to_config()
    ranges = plan_topology(c, "int8-channel", DEFAULT_MAX_SHARD_MB)
    largest = max(b - a for a, b in ranges) * layer_bytes(c, "int8-channel") / MIB
    assert largest <= 0.95 * 1921, (ranges, largest)


def test_auto_weights_plan_shards_as_int8_per_channel() -> None:
    """`auto` is costed at the form real tensors get, so its topology is int8-channel's: costed
    at lut8's size, Qwen 3 4B's 36 layers became 17,17,2 (one more round trip per pass)."""
    for name in ("phi4-mini", "qwen3-4b", "llama-3.2-3b"):
        c = preset(name).to_config()
        assert plan_topology(c, "auto", 1750) == plan_topology(c, "int8-channel", 1750), name
    assert [b - a for a, b in plan_topology(preset("qwen3-4b").to_config(), "auto", 1750)] == [
        18, 18]


# --- ANE limits refused or worked around at build (issue 28 item 4) -----------------------------

def test_force_ane_limits_builds_a_refused_width_and_says_so(tiny_gguf: Path,
                                                              tmp_path: Path) -> None:
    lines: list[str] = []
    result = build(tiny_gguf, tmp_path / "art", BuildRequest(topology="3", max_seq=16416,
                                                             force_ane_limits=True),
                   progress=lines.append)
    assert any(w.startswith("--force-ane-limits overrides: --max-seq 16416") for w in result.warnings)
    assert any("--force-ane-limits overrides" in line for line in lines)
    assert load_manifest(result.manifest_path).manifest.build.max_seq == 16416


def _cosine(a, b):
    import numpy as np
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_reduction_deeper_than_the_ane_takes_is_split_into_partial_sums(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An FFN of 16,416 (> 16,384, chrishayuk/larql#312) builds with its down projection as a sum
    of two convs over <= 16,384 inputs, and computes what the unsplit program computes."""
    import numpy as np

    from ane_spec.model.gguf_file import open_gguf
    from ane_spec.model.reference import ReferenceModel
    from ane_spec.model.synthetic import write_synthetic_gguf
    from ane_spec.runtime.mil_backend import MILBackend
    from ane_spec.runtime.pipeline import ShardPipeline, prefill_logits
    from ane_spec.shards import layer_graph

    spec = preset("tiny", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  ffn_size=16416, vocab_size=512, rope_dims=24, embed_std=1.0,
                  branch_scale=1.0, seed=3)
    gguf = write_synthetic_gguf(tmp_path / "deep.gguf", spec)
    req = BuildRequest(topology="1", max_seq=64)
    split = build(gguf, tmp_path / "split", req).manifest_path.parent
    facts = read_package_facts(split / "shards" / "layers_00_01.mlpackage")
    assert facts.ops["conv"] == 5  # qkv, o, up, and the down projection in two parts
    with monkeypatch.context() as m:  # the program as it was before the split
        m.setattr(layer_graph, "ANE_MAX_REDUCTION", 10**9)
        whole = build(gguf, tmp_path / "whole", req).manifest_path.parent
    assert read_package_facts(whole / "shards" / "layers_00_01.mlpackage").ops["conv"] == 4

    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 512, 48)]
    got = {name: prefill_logits(ShardPipeline(load_manifest(path), MILBackend("fp16")),
                                tokens).astype(np.float64)
           for name, path in (("split", split), ("whole", whole))}
    ref = ReferenceModel(open_gguf(gguf), context_window=64).logits(tokens).astype(np.float64)
    assert _cosine(got["split"], got["whole"]).min() > 0.9999
    assert (got["split"].argmax(-1) == got["whole"].argmax(-1)).mean() >= 0.95
    # Against the fp32 reference the split build is no further off than the unsplit one.
    assert _cosine(got["split"], ref).min() > 0.999
    assert abs(_cosine(got["split"], ref).mean() - _cosine(got["whole"], ref).mean()) < 1e-4


def test_head_argmax_chunks_stay_within_the_ane_argmax_width(tmp_path: Path) -> None:
    """Issue 28 item 3: --head-argmax reduces over at most 16,384 channels a chunk (Anemll), and
    the host's pick over the chunk maxima equals the logits head's argmax."""
    import numpy as np

    from ane_spec.model.synthetic import write_synthetic_gguf
    from ane_spec.runtime.mil_backend import MILBackend
    from ane_spec.runtime.pipeline import ShardPipeline
    from ane_spec.shards.build import head_chunk_bounds

    wide = head_chunk_bounds(200064, 4, argmax=True)
    assert len(wide) == 13 and max(e - s for s, e in wide) <= 16384
    assert wide[0][0] == 0 and wide[-1][1] == 200064
    assert len(head_chunk_bounds(200064, 4, argmax=False)) == 4

    spec = preset("tiny", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  ffn_size=128, vocab_size=32800, rope_dims=24, embed_std=1.0,
                  branch_scale=1.0, seed=5)
    gguf = write_synthetic_gguf(tmp_path / "wide.gguf", spec)
    ids = {}
    for argmax in (False, True):
        out = tmp_path / f"art-{argmax}"
        build(gguf, out, BuildRequest(topology="1", max_seq=64, head_chunks=1, head_argmax=argmax))
        m = load_manifest(out)
        if argmax:
            assert len(m.manifest.head_chunks) == 3 == m.manifest.build.head_chunks
            assert max(e - s for s, e in m.manifest.head_chunks) <= 16384
        pipeline = ShardPipeline(m, MILBackend("fp16"))
        state = pipeline.new_state()
        tokens = [int(t) for t in np.random.default_rng(1).integers(0, 32800, 32)]
        ids[argmax] = np.concatenate([pipeline.run(tokens[i:i + 4], i, state).argmax
                                      for i in range(0, len(tokens), 4)])
    assert (ids[True] == ids[False]).all()


def test_a_vocabulary_over_four_chunks_gets_enough_head_chunks_by_default(tmp_path: Path) -> None:
    """Without --head-chunks, a vocabulary wider than 4 x MAX_HEAD_CHANNELS (Gemma's 262,144)
    builds with as many chunks as keep each within it; an explicit count under that is still
    refused, naming the figure."""
    from ane_spec.model.synthetic import write_synthetic_gguf
    from ane_spec.shards.topology import MAX_HEAD_CHANNELS

    vocab = 4 * MAX_HEAD_CHANNELS + 64
    spec = preset("tiny", hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1,
                  ffn_size=64, vocab_size=vocab, rope_dims=32, seed=3)
    gguf = write_synthetic_gguf(tmp_path / "wide.gguf", spec)
    with pytest.raises(BuildError, match="use at least 5"):
        build(gguf, tmp_path / "four", BuildRequest(topology="1", max_seq=32, head_chunks=4))
    build(gguf, tmp_path / "auto", BuildRequest(topology="1", max_seq=32))
    m = load_manifest(tmp_path / "auto").manifest
    assert m.build.head_chunks == 5 and len(m.head_chunks) == 5
    assert max(e - s for s, e in m.head_chunks) <= MAX_HEAD_CHANNELS
