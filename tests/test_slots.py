"""KV slots below the HTTP layer: state capture and install, slot choice, spill, slot files and
the resident-slot budget, on real tiny builds run by the MIL interpreter."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from ane_spec.daemon.kv_state import StateLayout
from ane_spec.runtime.state_budget import ANE_PROCESS_BYTES, slot_budget, state_bytes
from ane_spec.daemon.slot_files import (
    MAGIC, SlotFileError, _content_hash, load_slot, save_slot, slot_path,
)
from ane_spec.daemon.slots import MIN_SHARED, SlotManager
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.probes.gates import open_pipeline
from ane_spec.shards.build import BuildRequest, build

S = 128


@pytest.fixture(scope="session")
def builds(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model as `art` (shared with test_daemon_slots)."""
    out = {"art": tmp_path_factory.mktemp("slots") / "art"}
    build(tiny_gguf, out["art"], BuildRequest(topology="2,1", max_seq=S))
    return out


@pytest.fixture(scope="module")
def stale_build(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another build of the same model under the same name with other shard packages (one
    shard of 3 layers): what a rebuild leaves for old slot files."""
    out = tmp_path_factory.mktemp("stale") / "art"
    build(tiny_gguf, out, BuildRequest(topology="3", max_seq=S))
    return out


@pytest.fixture(scope="module", params=["fp32", "fp16"])
def any_precision(builds, request):
    return open_pipeline(builds["art"], "mil", request.param)[1]


@pytest.fixture(scope="module")
def pipeline(builds):
    return open_pipeline(builds["art"], "mil", "fp32")[1]


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def run(session: DecodeSession, prompt: list[int], n: int = 8) -> list[int]:
    return session.generate(prompt, GenerateOptions(max_tokens=n)).tokens


def states(pipeline, state) -> list[np.ndarray]:
    return [program.read_state(state.shard_states[k], name)
            for k, program in enumerate(pipeline.shards) for name in program.state_names]


# --- capture / install -------------------------------------------------------------------------

def test_capture_and_install_round_trip_bit_for_bit(any_precision) -> None:
    pipeline = any_precision
    session = DecodeSession(pipeline)
    run(session, tokens(0, 41), 10)
    n = len(session.kv_tokens)
    layout = StateLayout(pipeline)
    captured = layout.capture(session.state, n)
    assert all(a.dtype == layout.dtype for a in captured)
    assert layout.dtype == (np.float32 if pipeline.backend.precision == "fp32" else np.float16)
    assert sum(a.nbytes for a in captured) == layout.nbytes(n)

    dirty = DecodeSession(pipeline)  # a slot that held a longer, different conversation
    run(dirty, tokens(1, 90), 10)
    layout.install(dirty.state, captured, n)
    for want, got in zip(states(pipeline, session.state), states(pipeline, dirty.state)):
        assert np.array_equal(got[:, :, :n], want[:, :, :n])
        assert not got[:, :, n:].any()  # past the conversation: what a fresh state holds
    # ... and decoding continues from it exactly as from the original
    follow = tokens(2, 7)
    restored = DecodeSession(pipeline)
    restored.use_slot(dirty.state, session.kv_tokens)
    prompt = [*session.kv_tokens, *follow]
    assert run(restored, prompt, 12) == run(session, prompt, 12)
    assert restored.generate(prompt[:5], GenerateOptions(max_tokens=1)).stats \
        .reused_prefix_tokens == 4


def test_a_stale_slot_changes_no_logit(any_precision) -> None:
    """The property everything rests on: K/V past the current position (another conversation's
    leftovers) never reach a logit, so a used state gives bitwise the logits of a fresh one."""
    pipeline = any_precision
    prompt = tokens(3, 37)
    fresh, used = pipeline.new_state(), pipeline.new_state()
    run_in = DecodeSession(pipeline)
    run_in.use_slot(used, [])
    run(run_in, tokens(4, S - 20), 16)  # fill nearly every slot with something else
    for start in range(0, len(prompt), pipeline.max_t):
        block = prompt[start:start + pipeline.max_t]
        a = pipeline.run(block, start, fresh).logits
        b = pipeline.run(block, start, used).logits
        assert np.array_equal(a, b), start


# --- choosing a slot ---------------------------------------------------------------------------

class Events(list):
    def __call__(self, event: str) -> None:
        self.append(event)


def serve(manager: SlotManager, session: DecodeSession, prompt: list[int], scope=None,
          n: int = 6) -> tuple[object, object]:
    slot = manager.acquire(prompt, scope)
    session.use_slot(slot.state, slot.tokens)
    result = session.generate(prompt, GenerateOptions(max_tokens=n))
    manager.release(slot, session.kv_tokens, len(prompt))
    return slot, result


def test_conversations_keep_their_slots_spill_and_restore(pipeline) -> None:
    events = Events()
    manager = SlotManager(pipeline, 2, 10**9, events)
    session = DecodeSession(pipeline)
    a, b, c = tokens(10, 30), tokens(11, 30), tokens(12, 30)
    sa, ra = serve(manager, session, a)
    kv_a = list(sa.tokens)
    sb, rb = serve(manager, session, b)
    kv_b = list(sb.tokens)
    assert sa is not sb and events == ["miss", "miss"]
    assert kv_a[:len(a)] == a and kv_b[:len(b)] == b
    a2 = [*a, *ra.tokens, *tokens(13, 5)]
    slot, r = serve(manager, session, a2)  # the next turn of a: its own slot, whole history
    assert slot is sa and events[-1] == "hit"
    assert r.stats.reused_prefix_tokens == len(kv_a)
    assert r.tokens == run(DecodeSession(pipeline), a2, 6)
    events.clear()
    sc, _ = serve(manager, session, c)  # cold: takes the LRU slot (b's); b is spilled
    assert sc is sb and events == ["miss", "spill"]
    assert [e["tokens"] for e in manager.snapshot()["slots"] if e["state"] == "spilled"] \
        == [len(kv_b)]
    events.clear()
    b2 = [*b, *rb.tokens, *tokens(14, 5)]
    slot, r = serve(manager, session, b2)  # b comes back: restored into the LRU slot (a's)
    assert slot is sa and events == ["hit", "spill", "restore"]
    assert r.stats.reused_prefix_tokens == len(kv_b)
    assert r.tokens == run(DecodeSession(pipeline), b2, 6)


def test_a_shared_prefix_is_copied_and_its_owner_kept(pipeline) -> None:
    events = Events()
    manager = SlotManager(pipeline, 2, 10**9, events)
    session = DecodeSession(pipeline)
    system = tokens(20, 2 * MIN_SHARED)
    a = [*system, *tokens(21, 80)]
    d = [*system, *tokens(22, 10)]
    sa, _ = serve(manager, session, a)
    held = list(sa.tokens)
    sd, rd = serve(manager, session, d)  # shares < half of a's tokens: a cold request
    assert sd is not sa and events == ["miss", "miss", "copy"]
    assert sa.tokens == held  # the owner keeps its conversation
    assert rd.stats.reused_prefix_tokens == len(system)
    assert rd.tokens == run(DecodeSession(pipeline), d, 6)


def test_spill_budget_and_scopes(pipeline) -> None:
    events = Events()
    layout = StateLayout(pipeline)
    one = layout.nbytes(40)  # room for one spilled 30-token conversation, not two
    manager = SlotManager(pipeline, 1, one, events)
    session = DecodeSession(pipeline)
    prompts = [tokens(30 + i, 30) for i in range(3)]
    for p in prompts:
        serve(manager, session, p)
    assert events == ["miss", "miss", "spill", "miss", "drop", "spill"]
    snap = manager.snapshot()
    assert snap["spilled"] == 1 and snap["spill_bytes"] <= one
    # another scope never reuses this conversation, resident or spilled
    events.clear()
    slot, r = serve(manager, session, prompts[2], scope="other")
    assert events == ["miss", "drop", "spill"] and r.stats.reused_prefix_tokens == 0
    events.clear()
    slot, r = serve(manager, session, prompts[2], scope=None)  # its own scope: restored
    assert events == ["hit", "spill", "restore"]
    assert r.stats.reused_prefix_tokens == len(prompts[2]) - 1
    # no spill budget: evicted conversations are dropped
    events.clear()
    manager = SlotManager(pipeline, 1, 0, events)
    for p in prompts[:2]:
        serve(manager, session, p)
    assert events == ["miss", "miss", "drop"]


# --- slot files --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(builds, tmp_path_factory) -> tuple[Path, list[int], object]:
    pipeline = open_pipeline(builds["art"], "mil", "fp32")[1]
    session = DecodeSession(pipeline)
    run(session, tokens(40, 50), 8)
    layout = StateLayout(pipeline)
    path = tmp_path_factory.mktemp("saved") / "conv.slot"
    save_slot(path, layout, session.kv_tokens, layout.capture(session.state,
                                                              len(session.kv_tokens)))
    return path, session.kv_tokens, layout


def test_slot_file_round_trip(saved) -> None:
    path, kv, layout = saved
    got_tokens, arrays, scope, _ = load_slot(path, layout)
    assert got_tokens == kv and scope is None
    state = layout.pipeline.new_state()
    layout.install(state, arrays, len(kv))
    again = layout.capture(state, len(kv))
    assert all(np.array_equal(a, b) for a, b in zip(arrays, again))
    assert path.stat().st_size == len(MAGIC) + 8 + int.from_bytes(
        path.read_bytes()[len(MAGIC):len(MAGIC) + 8], "little") + layout.nbytes(len(kv))
    scoped = path.with_name("scoped.slot")  # a per-key scope (a hash) comes back with it
    save_slot(scoped, layout, kv, arrays, scope="0f" * 16)
    assert load_slot(scoped, layout).scope == "0f" * 16


def test_stale_files_are_refused(saved, builds, stale_build) -> None:
    path, _, _ = saved
    rebuilt = StateLayout(open_pipeline(stale_build, "mil", "fp32")[1])
    with pytest.raises(SlotFileError, match=r"conv.slot: stale: saved from another build of "
                                            r"'art' \(its shard package hashes differ"):
        load_slot(path, rebuilt)
    elsewhere = StateLayout(open_pipeline(builds["art"], "mil", "fp16")[1])
    with pytest.raises(SlotFileError, match=r"computed on mil fp32 fixed; this server runs "
                                            r"mil fp16 fixed"):
        load_slot(path, elsewhere)


def split(data: bytes) -> tuple[dict, int]:
    """A slot file's header and where its arrays start."""
    head_len = struct.unpack("<Q", data[len(MAGIC):len(MAGIC) + 8])[0]
    body = len(MAGIC) + 8 + head_len
    return json.loads(data[len(MAGIC) + 8:body]), body


def with_header(data: bytes, header: dict) -> bytes:
    head = json.dumps(header).encode()
    return MAGIC + struct.pack("<Q", len(head)) + head + data[split(data)[1]:]


def test_foreign_files_are_refused(saved, tmp_path: Path) -> None:
    """A well-formed file, its content hash intact, saved by another model: refused by name."""
    path, _, layout = saved
    data = path.read_bytes()
    header, body = split(data)
    header["build"] |= {"model": "phi4", "max_seq": 2048}
    header["content_sha256"] = _content_hash(header, data[body:])
    foreign = tmp_path / "foreign.slot"
    foreign.write_bytes(with_header(data, header))
    with pytest.raises(SlotFileError, match=r"foreign.slot: foreign: saved by model 'phi4' with "
                                            r"a 2048-token context; this server runs 'art' "
                                            r"with 128"):
        load_slot(foreign, layout)


def test_damaged_files_are_refused(saved, tmp_path: Path) -> None:
    path, _, layout = saved
    data = path.read_bytes()
    header, body = split(data)
    head_len = body - len(MAGIC) - 8
    cases = {
        "flipped": data[:-5] + bytes([data[-5] ^ 1]) + data[-4:],
        "truncated": data[:-1],
        "grown": data + b"\0",
        "not-a-slot": b"PK\x03\x04" + data[4:],
        "empty": b"",
        "huge-header": data[:len(MAGIC)] + struct.pack("<Q", 1 << 40) + data[len(MAGIC) + 8:],
        "bad-json": data[:len(MAGIC) + 8] + b"{" * head_len + data[body:],
    }
    header["tokens"][0] = (header["tokens"][0] + 1) % 1000  # tokens are under the hash too
    cases["tokens-edited"] = with_header(data, header)
    for name, content in cases.items():
        target = tmp_path / f"{name}.slot"
        target.write_bytes(content)
        with pytest.raises(SlotFileError) as err:
            load_slot(target, layout)
        text = str(err.value)
        assert text.startswith(f"{name}.slot: ") and "\n" not in text, text
        assert ("not an ane-spec slot file" in text) == (name in ("not-a-slot", "empty")), text


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", "", "x" * 65, "sp ace"])
def test_slot_names_cannot_leave_the_directory(tmp_path: Path, name: str) -> None:
    with pytest.raises(SlotFileError, match="bad slot file name"):
        slot_path(tmp_path, name)


def test_symlinked_slot_files_are_refused(saved, tmp_path: Path) -> None:
    path, tokens, layout = saved
    link = tmp_path / "link.slot"
    link.symlink_to(path)
    with pytest.raises(SlotFileError, match="link.slot is a symbolic link"):
        load_slot(link, layout)
    contents = load_slot(path, layout)
    with pytest.raises(SlotFileError, match="link.slot exists and is not a regular file"):
        save_slot(link, layout, contents.tokens, contents.arrays)  # never written through
    assert link.is_symlink() and load_slot(path, layout).tokens == tokens
    assert slot_path(tmp_path, "ok.slot") == tmp_path / "ok.slot"


def test_erase_zeroes_the_state_and_running_slots_say_so(pipeline) -> None:
    manager = SlotManager(pipeline, 1, 10**9)
    session = DecodeSession(pipeline)
    prompt = tokens(30, 20)
    slot = manager.acquire(prompt)
    (row,) = manager.snapshot()["slots"]
    assert row["state"] == "running" and row["tokens"] == row["prompt_tokens"] == 20
    session.use_slot(slot.state, slot.tokens)
    session.generate(prompt, GenerateOptions(max_tokens=4))
    manager.release(slot, session.kv_tokens, len(prompt))
    assert manager.snapshot()["slots"][0]["state"] == "resident"
    assert any(np.abs(a).max() > 0 for a in states(pipeline, slot.state))
    manager.erase(slot.id)
    assert manager.snapshot()["slots"][0]["state"] == "empty"
    assert all(not a.any() for a in states(pipeline, slot.state))  # nothing of it survives


def test_non_finite_files_are_not_loaded_at_start(saved, tmp_path: Path) -> None:
    """A file re-signed with NaN K/V (the hash has no key) is refused on load, at start too."""
    path, kv, layout = saved
    contents = load_slot(path, layout)
    for name, poison in (("nan", np.nan), ("inf", -np.inf)):
        arrays = [a.copy() for a in contents.arrays]
        arrays[-1].reshape(-1)[-1] = poison
        save_slot(tmp_path / f"{name}.slot", layout, contents.tokens, arrays)
        with pytest.raises(SlotFileError, match=f"{name}.slot: holds K/V that are not finite"):
            load_slot(tmp_path / f"{name}.slot", layout)
    save_slot(tmp_path / "good.slot", layout, contents.tokens, contents.arrays)
    manager = SlotManager(layout.pipeline, 2, 10**9)
    assert manager.load_saved(tmp_path) == ["good.slot"]


# --- the resident-slot budget ------------------------------------------------------------------

def test_state_bytes_match_the_states_a_pipeline_makes(builds) -> None:
    pipeline = open_pipeline(builds["art"], "mil", "fp16")[1]
    made = sum(a.nbytes for a in states(pipeline, pipeline.new_state())) // 2  # read as fp32
    assert state_bytes(pipeline.manifest) == made == 3 * 2 * 2 * S * 32 * 2  # 3 layers K+V fp16


def test_slot_budget_counts_states_against_the_ane_limit(builds) -> None:
    manifest = open_pipeline(builds["art"], "mil", "fp32")[1].manifest
    per = state_bytes(manifest)
    budget = slot_budget(manifest, memory_bytes=16 << 30)
    assert budget.ane_slots == ANE_PROCESS_BYTES // per and budget.default_slots == 4
    assert budget.spill_bytes == 2 << 30
    # Phi-4-mini sized states (256 MiB at 2048): 11 fit 3 GB; 8192 slots (1 GiB) fit 2
    phi = manifest.model_copy(deep=True)
    for shard in phi.shards:
        for spec in shard.states:
            spec.shape = [1, 8, 8192, 128]
    phi.shards = [phi.shards[0]] * 16  # 16 shards x 2 states = 32 layers' K and V
    big = slot_budget(phi, memory_bytes=16 << 30)
    assert big.state_bytes == 64 * 8 * 8192 * 128 * 2 == 1 << 30
    assert (big.ane_slots, big.host_slots, big.default_slots) == (2, 2, 2)
    assert "default --kv-slots 2" in big.summary()
    assert slot_budget(phi, memory_bytes=4 << 30).default_slots == 1
