"""The Core ML worker's memory and copies (issue 35 item 3): slot swaps move only n rows of fp16
through shared memory, the zeros are made in the worker, `write_state` values are not kept in
the feed ring, pass-wide inputs are converted once per pass and lent to every shard, the ring is
bounded by bytes as well as time, and readState/writeState run inside an autorelease pool."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from ane_spec.runtime.coreml_backend import FeedRing


def pipe_bytes(monkeypatch, worker) -> list[int]:  # noqa: ANN001
    """Record the pickled size of every message to and from `worker` (what crosses the
    pipe; arrays in shared memory do not)."""
    seen: list[int] = []
    send, receive = worker._send, worker._receive

    def counted_send(message, during):  # noqa: ANN001, ANN202
        seen.append(len(pickle.dumps(message)))
        return send(message, during)

    def counted_receive(during):  # noqa: ANN001, ANN202
        kind, payload = receive(during)
        seen.append(len(pickle.dumps((kind, payload))))
        return kind, payload

    monkeypatch.setattr(worker, "_send", counted_send)
    monkeypatch.setattr(worker, "_receive", counted_receive)
    return seen


def test_a_slot_swap_moves_n_fp16_rows_through_shared_memory(coreml_standin, context_build,
                                                              monkeypatch) -> None:
    """Capture, clear and install through the worker: the capture is n rows of fp16 per
    tensor, the pipe carries no state (a few hundred bytes a call), and an install reads back
    as those rows over zeros, bit for bit."""
    from ane_spec.daemon.kv_state import StateLayout
    from ane_spec.decode.session import DecodeSession, GenerateOptions
    from ane_spec.probes.gates import open_pipeline

    _, pipeline = open_pipeline(context_build, "coreml", "fp16")
    layout = StateLayout(pipeline)
    session = DecodeSession(pipeline)
    session.generate(list(range(5, 25)), GenerateOptions(max_tokens=4))
    n = len(session.kv_tokens)
    worker = pipeline.backend.worker
    sent = pipe_bytes(monkeypatch, worker)
    captured = layout.capture(session.state, n)
    assert all(a.dtype == np.float16 and a.flags.c_contiguous for a in captured)
    assert sum(a.nbytes for a in captured) == layout.nbytes(n)
    other = pipeline.new_state()
    layout.install(other, captured, n)
    layout.clear(session.state)
    full_fp32 = sum(4 * int(np.prod(e.shape)) for e in layout.entries)
    assert max(sent) < 2048 and sum(sent) < full_fp32 // 10, (sent, full_fp32)

    # What the install wrote: the captured rows, then zeros (read whole, through the worker).
    for e, rows in zip(layout.entries, captured):
        program = pipeline.shards[e.shard]
        whole = program.read_state(other.shard_states[e.shard], e.name)
        assert whole.shape == e.shape and whole.dtype == np.float32
        assert whole[:, :, :n].astype(np.float16).tobytes() == rows.tobytes()
        assert not whole[:, :, n:].any()
        cleared = program.read_state(session.state.shard_states[e.shard], e.name)
        assert not cleared.any()


def test_write_state_values_are_not_ringed_and_the_pool_frees_what_state_calls_autorelease(
        coreml_standin, coreml_build) -> None:
    """readState and writeState have no @autoreleasepool of their own (CoreMLPython.mm); the
    program pushes and pops one around each, so 1,000 reads leave nothing behind, and the
    written value is not kept in the feed ring (writeState copies synchronously)."""
    from ane_spec.runtime.coreml_backend import FEEDS, CoreMLBackend

    art, manifest = coreml_build
    shard = manifest.shards[0]
    program = CoreMLBackend().load(art / shard.file.path, digest=shard.file.digest)
    state = program.make_state()
    name = program.state_names[0]
    value = np.ones(program.read_state(state, name).shape, dtype=np.float32)
    program.write_state(state, name, value)
    assert not FEEDS.holds(value)
    for _ in range(1000):
        program.read_state(state, name)
    assert coreml_standin.unreleased == []  # every autoreleased copy went with its pool
    assert np.array_equal(program.read_state(state, name), value)


def test_a_pass_lends_one_converted_set_of_pass_wide_inputs_to_every_shard(
        coreml_standin, tiny_gguf, tmp_path) -> None:
    """Through the worker's handler (in this process): after a 3-shard pass the ring holds
    one copy of each mask and RoPE table, lent to all three, not one copy per shard."""
    from ane_spec.manifests.store import load_manifest
    from ane_spec.runtime import coreml_worker
    from ane_spec.runtime.coreml_backend import FEEDS
    from ane_spec.runtime.pipeline import ShardPipeline  # noqa: F401 - the layout's owner
    from ane_spec.shards.build import BuildRequest, build

    art = tmp_path / "art"
    build(tiny_gguf, art, BuildRequest(topology="1,1,1", max_seq=64))
    manifest = load_manifest(art).manifest
    handler = coreml_worker._Handler(None, "CPU_AND_NE", "Infrequent")
    calls = []
    for k, shard in enumerate(manifest.shards):
        handler.load(k, str(art / shard.file.path), shard.file.digest)
        handler.make_state(k, 100 + k)
        calls.append((k, 100 + k))
    entry = manifest.shards[0]
    shapes = {s.name: [1 if d == "T" else d for d in s.shape] for s in entry.inputs}
    rng = np.random.default_rng(0)
    arrays = {name: rng.standard_normal(shape).astype(np.float16)
              for name, shape in shapes.items()}
    FEEDS._kept.clear()
    FEEDS.nbytes = 0
    handler.run_pass(calls, [], [], 1, [], None, [], arrays=arrays)
    held = [feed for _, feed, _ in FEEDS._kept]
    wide = [name for name in arrays if name != "x"]
    for name in wide:
        copies = {id(feed[name]) for feed in held if name in feed}
        assert len(copies) == 1, (name, len(copies))
    assert FEEDS.nbytes == sum(a.nbytes for feed in held for a in feed.values())
    # One float32 set of the pass-wide inputs, and each shard's x (the input, then each
    # shard's output handed on as it came back): nothing converted twice.
    wide_bytes = sum(4 * arrays[name].size for name in wide)
    assert FEEDS.nbytes == wide_bytes + len(calls) * 4 * arrays["x"].size


def test_the_feed_ring_is_bounded_by_bytes_above_a_lifetime_floor() -> None:
    """Past max_bytes the oldest feeds go, but none younger than min_seconds (the bridge's
    lifetime rule): at 20 passes/s the ring settles at its byte bound, not at 10 s of feeds."""
    now = [0.0]
    ring = FeedRing(seconds=10.0, max_bytes=1 << 20, min_seconds=2.0, clock=lambda: now[0])
    lent: list[tuple[float, np.ndarray]] = []
    peak = 0
    for i in range(1000):
        a = np.zeros(16 * 1024, np.float32)  # 64 KiB a pass
        with ring.lend({"x": a}):
            pass
        lent.append((now[0], a))
        peak = max(peak, ring.nbytes)
        now[0] += 0.05
        # Nothing lent in the last 2 s has gone.
        assert all(ring.holds(a) for t, a in lent if now[0] - t < 2.0)
    # 2 s of feeds at 20 passes/s is 40 * 64 KiB = 2.5 MiB, above the 1 MiB bound: the floor.
    assert peak <= (40 + 1) * 64 * 1024
    bounded = FeedRing(seconds=10.0, max_bytes=8 << 20, min_seconds=2.0, clock=lambda: now[0])
    for _ in range(1000):
        with bounded.lend({"x": np.zeros(16 * 1024, np.float32)}):
            pass
        now[0] += 0.05
        assert bounded.nbytes <= (8 << 20) + 64 * 1024
    assert len(bounded) < 200  # 10 s at 20/s would be 200 entries; bytes ended it sooner
