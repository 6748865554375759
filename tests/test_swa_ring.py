"""Sliding-window KV rings (model/swa_ring.py): the ring size, the ring build against the
full-length one, exact speculative decoding, KV slots (spill, restore, prefix copy, slot files),
the manifest's record and the state budget.

Fixture: `gemma3-tiny` (window 8) at max_seq 64 with a prefill function of P = 24 rows: rings of
W + P = 32 slots, the widest pass's ring and already a multiple of 32 for the ANE's state
dimensions, so the ring is as tight as `ring_rows` makes it (one slot above the least, W + P - 1).
Topology 2,1,1 (an all-local shard, an all-global one and another local one), built twice: with
rings (the default) and with full-length local states (`swa_ring=False`, the layout before
rings). Seed 11 with embedding std 0.02 varies the greedy output, as the drafter needs
(test_gemma3_stack.py). Every prompt below is longer than the ring, so its slots wrap, within a
prefill chunk too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ane_spec.daemon.kv_state import StateLayout
from ane_spec.daemon.slot_files import SlotFileError, _content_hash, load_slot
from ane_spec.daemon.slots import SlotManager
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.errors import ManifestError
from ane_spec.manifests.store import load_manifest
from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.inspect import describe, format_description, kv_rings
from ane_spec.model.swa_ring import RingSlots, kv_state_bytes, ring_rows
from ane_spec.model.synthetic import PRESETS, preset, write_synthetic_gguf
from ane_spec.probes.gates import open_pipeline
from ane_spec.probes.row_invariance import state_arrays
from ane_spec.runtime.pipeline import prefill_logits
from ane_spec.runtime.state_budget import slot_budget, state_bytes
from ane_spec.shards.build import BuildRequest, build
from tests.test_slots import split, with_header

S, W, R, P = 64, 8, 32, 24


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("swa-ring")
    gguf = write_synthetic_gguf(root / "gemma3.gguf", preset("gemma3-tiny", seed=11,
                                                              embed_std=0.02))
    out = {"ring": root / "ring", "full": root / "full", "gguf": gguf}
    build(gguf, out["ring"], BuildRequest(topology="2,1,1", max_seq=S, prefill_t=P))
    build(gguf, out["full"], BuildRequest(topology="2,1,1", max_seq=S, prefill_t=P,
                                          swa_ring=False))
    return out


@pytest.fixture(scope="module")
def ring16(builds):
    return open_pipeline(builds["ring"], "mil", "fp16")[1]


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


# --- the ring size -----------------------------------------------------------------------------

def simulate(rows: int, window: int, seed: int, prefill_t: int = 0) -> int:
    """A conversation of T<=4 passes with random rejections and occasional resumes at shorter
    prefixes (only where `holds_window` allows), on a ring of `rows` slots; with `prefill_t`,
    one pass in four is a prompt chunk of up to that many rows instead (all kept, padding rows
    at the last real row's position, writing nothing), as a new turn's prompt after rejected
    drafts is. Returns how many rows saw a visible set other than exactly their window's
    positions."""
    rng = np.random.default_rng(seed)
    ring, n, wrong = RingSlots(rows, window), 0, 0
    for _ in range(400):
        if rng.random() < 0.05:
            r = int(rng.integers(max(0, n - 6), n + 1))
            n = r if ring.holds_window(r) else 0
        chunk = prefill_t and rng.random() < 0.25
        t = int(rng.integers(1, prefill_t + 1 if chunk else 5))
        positions = np.arange(n, n + t)
        ring.write(positions)
        rows_at = np.concatenate([positions, np.full((prefill_t - t) if chunk else 0,
                                                     n + t - 1, dtype=np.int64)])
        for p, row in zip(rows_at, ring.visible(rows_at)):
            want = sorted(range(max(0, p - window + 1), p + 1))
            wrong += sorted(ring.held[row].tolist()) != want
        # A prompt chunk keeps every row; a verify pass its first (the pending token) at least.
        n += t if chunk else int(rng.integers(1, t + 1))
    return wrong


def test_w_plus_widest_pass_slots_keep_every_window_through_rejections_and_rollbacks() -> None:
    """W + T - 1 is the least ring that keeps every row's window whole, T the widest pass
    (model/swa_ring.py says why); W + T (one spare) does, and W + T - 2 loses positions some
    row needs: T = 4 for decode-shape passes, T = P for prompt chunks between them."""
    assert ring_rows(W, 4) == 32 and ring_rows(512, 4) == 544 and ring_rows(28, 4) == 32
    assert ring_rows(W, P) == R and ring_rows(512, 64) == 576 and ring_rows(1024, 64) == 1088
    for seed in range(3):
        assert simulate(W + 4, W, seed) == 0
        assert simulate(W + 3, W, seed) == 0
        assert simulate(W + P, W, seed, prefill_t=P) == 0
        assert simulate(W + P - 1, W, seed, prefill_t=P) == 0
    assert simulate(W + 2, W, 0) > 0
    assert simulate(W + P - 2, W, 0, prefill_t=P) > 0


def test_ring_slot_positions() -> None:
    ring = RingSlots.filled_to(12, W, 25)  # positions 14..25 in slots 2..11, 0, 1
    assert ring.held.tolist() == [24, 25, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
    # Row n needs n-7..n-1: held for n = 21..26, not for 20 (13 is gone) or 27 (26 unwritten).
    assert all(ring.holds_window(n) for n in range(21, 27))
    assert not ring.holds_window(20) and not ring.holds_window(27)
    ring.forget_from(24)
    assert ring.held[:2].tolist() == [-1, -1] and not ring.holds_window(26)
    with pytest.raises(ValueError, match="not in its slot"):
        RingSlots.from_positions(12, W, [5] + [-1] * 11)
    with pytest.raises(ValueError, match="share a ring slot"):
        RingSlots(12, W).write(np.array([3, 15]))


# --- the build ---------------------------------------------------------------------------------

def test_manifest_programs_and_budget(builds) -> None:
    m = load_manifest(builds["ring"]).manifest
    full = load_manifest(builds["full"]).manifest
    assert (m.build.swa_ring, full.build.swa_ring) == (R, 0)
    shapes = {s.name: s.shape for shard in m.shards for s in shard.states}
    # Layers 0, 1, 3 are local: rings; layer 2 is global: full length.
    assert shapes["layer_0_k"] == [1, 1, R, 64] and shapes["layer_3_v"] == [1, 1, R, 64]
    assert shapes["layer_2_k"] == [1, 1, S, 64]
    for shard in m.shards:
        inputs = {i.name: i.shape for i in shard.inputs}
        assert inputs["attn_mask"] == [1, 1, "T", S + R]
        assert inputs["kv_write_mask"] == [1, 1, S + R, "T"]
    # The state budget counts the rings: 3 local layers x 32 slots + 1 global x 64.
    per_slot = 2 * 1 * 64 * 2
    assert state_bytes(m) == per_slot * (3 * R + S) == kv_state_bytes(m.model, S, R)
    assert state_bytes(full) == per_slot * 4 * S
    budget = slot_budget(m, memory_bytes=2**34)
    assert budget.full_length_bytes == state_bytes(full)
    assert "(0.1 MiB without its KV rings)" in budget.summary()


def test_gemma_3_1b_ring_saving() -> None:
    """The 1B at its full 32,768 context: 22 of 26 layers local with a 512 window."""
    c = PRESETS["gemma-3-1b"].to_config()
    k = kv_rings(c)["kv_state"]
    per_slot = 2 * 1 * 256 * 2
    assert k["ring"] == 544 and k["bytes_full"] == 26 * 32768 * per_slot
    assert k["bytes_ring"] == (4 * 32768 + 22 * 544) * per_slot
    print(f"gemma-3-1b K/V at 32768: {k['bytes_ring'] / 2**20:.1f} MiB with rings, "
          f"{k['bytes_full'] / 2**20:.1f} MiB without")


def test_inspect_shows_the_saving(builds) -> None:
    text = format_description(describe(open_gguf(builds["gguf"])))
    # gemma3-tiny at its 4,096 context: 3 local layers at 32 slots, 1 global at 4,096.
    assert "K/V per conversation at context 4096: 1.0 MiB with 32-slot rings on the local " \
           "layers, 4.0 MiB full-length" in text


def test_manifest_refuses_a_ring_mismatch(builds, tmp_path: Path) -> None:
    import shutil

    art = tmp_path / "art"
    shutil.copytree(builds["ring"], art)
    raw = json.loads((art / "manifest.json").read_text())
    raw["build"]["swa_ring"] = R + 1
    (art / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match=r"build.swa_ring 33 is not the ring this ane-spec "
                                            r"keeps for a window of 8 .*32 slots"):
        load_manifest(art, verify=False)
    raw["build"]["swa_ring"] = 0  # ring states under a manifest that says full-length
    (art / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match=r"state 'layer_0_k' has 32 slots; build.swa_ring 0 "
                                            r"and max_seq 64 say 64"):
        load_manifest(art, verify=False)


# --- exactness ---------------------------------------------------------------------------------

def test_ring_logits_match_the_full_length_build(builds, ring16) -> None:
    """Not bitwise, measured: the ring's visible slots sit in rotated order (slot q mod 32) once
    it wraps, and before that the ring's 32 slots against 64 change how the interpreter's matmul
    blocks its sums; either way the softmax's sum and probs @ V add the same terms (hidden ones
    exactly 0) in another order. fp16 logits then differ by about an ulp on some rows (the
    bitwise-equal count is printed; 84/96 rows before the wrap and 34/96 after, max |diff|
    0.0015, on three 64-token prompts), far below any margin: cosine >= 0.99999 and every
    argmax equal, over 2 x 60 positions."""
    full = open_pipeline(builds["full"], "mil", "fp16")[1]
    same = rows = 0
    for seed in (1, 2):
        toks = prompt(seed, 60)
        a, b = prefill_logits(ring16, toks), prefill_logits(full, toks)
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        assert cos.min() >= 0.99999 and (a.argmax(1) == b.argmax(1)).all()
        same += sum(np.array_equal(x, y) for x, y in zip(a, b))
        rows += len(a)
    print(f"ring vs full-length fp16: {same}/{rows} rows bitwise equal")


def test_speculative_equals_greedy_and_the_full_length_tokens(builds, ring16) -> None:
    """fp16: speculative == greedy on the ring build (rejected drafts leave stale ring slots),
    and the same tokens as the full-length build, prompts 14..40 plus 20 generated (> 32)."""
    full = open_pipeline(builds["full"], "mil", "fp16")[1]
    spec = DecodeSession(ring16)
    rng = np.random.default_rng(5)
    accepted = rejected = 0
    for _ in range(4):
        p = rng.integers(0, 1000, int(rng.integers(14, 41))).tolist()
        greedy = DecodeSession(ring16).generate(p, GenerateOptions(max_tokens=20,
                                                                   speculative=False))
        out = spec.generate(p, GenerateOptions(max_tokens=20))
        want = DecodeSession(full).generate(p, GenerateOptions(max_tokens=20, speculative=False))
        assert out.tokens == greedy.tokens == want.tokens, p
        accepted += out.stats.accepted
        rejected += out.stats.drafted - out.stats.accepted
    print("ring spec: accepted", accepted, "rejected", rejected)
    assert accepted > 0 and rejected > 0


def test_prefill_chunks_past_the_wrap_write_what_decode_passes_write(builds, ring16) -> None:
    """60-token prompts in prefill chunks of 24: the second chunk (positions 24..47) wraps the
    32-slot ring inside one pass, and overwrites positions 0..15 while its first row still needs
    17..23. Every row's logits and every state, ring slots included, bitwise equal to the same
    prompt in T=4 passes (the interpreter is row-invariant across shapes: `probe
    row-invariance`), and the same argmax as the full-length build's prefill chunks."""
    full = open_pipeline(builds["full"], "mil", "fp16")[1]
    for seed in (1, 2):
        toks = prompt(seed, 60)
        by_chunks, by_blocks = ring16.new_state(), ring16.new_state()
        chunked = prefill_logits(ring16, toks, by_chunks, prefill=True)
        blocked = prefill_logits(ring16, toks, by_blocks)
        assert np.array_equal(chunked, blocked)
        assert by_chunks.ring.positions() == by_blocks.ring.positions()
        assert all(np.array_equal(a, b) for a, b in zip(state_arrays(ring16, by_chunks),
                                                        state_arrays(ring16, by_blocks)))
        wide = prefill_logits(full, toks, prefill=True)
        cos = (chunked * wide).sum(1) / np.linalg.norm(chunked, axis=1) / np.linalg.norm(wide,
                                                                                       axis=1)
        assert cos.min() >= 0.99999 and (chunked.argmax(1) == wide.argmax(1)).all()


def test_speculative_equals_greedy_after_prefill_chunks_past_the_wrap(builds, ring16) -> None:
    """Prompts of 48..52 tokens through the prefill function (--prefill on: two full chunks of
    24, the second wrapping the ring while its first row needs the window before it, then the
    rest padded), then 8 tokens with rejected drafts leaving stale ring slots, then a second
    turn whose chunk starts where the first turn ended, over those stale slots: speculative ==
    greedy, == the same prompts prefilled at T=4 (--prefill off), == the full-length build's,
    and the continued turn == a fresh session's."""
    full = open_pipeline(builds["full"], "mil", "fp16")[1]
    rng = np.random.default_rng(6)
    accepted = rejected = 0
    for _ in range(3):
        p = rng.integers(0, 1000, int(rng.integers(48, 53))).tolist()
        options = GenerateOptions(max_tokens=8)
        session = DecodeSession(ring16, prefill="on")
        out = session.generate(p, options)
        greedy = DecodeSession(ring16, prefill="on").generate(
            p, GenerateOptions(max_tokens=8, speculative=False))
        blocks = DecodeSession(ring16, prefill="off").generate(p, options)
        want = DecodeSession(full, prefill="on").generate(p, options)
        assert out.stats.prefill_function_passes == 3
        assert out.tokens == greedy.tokens == blocks.tokens == want.tokens, p
        accepted += out.stats.accepted
        rejected += out.stats.drafted - out.stats.accepted
        follow = [*session.kv_tokens, *rng.integers(0, 1000, 3).tolist()]  # <= 62 tokens
        turn = session.generate(follow, GenerateOptions(max_tokens=2))
        assert turn.stats.reused_prefix_tokens == len(follow) - 3
        fresh = DecodeSession(ring16, prefill="on").generate(follow, GenerateOptions(max_tokens=2))
        assert turn.tokens == fresh.tokens, follow
    print("ring after prefill chunks: accepted", accepted, "rejected", rejected)
    assert accepted > 0 and rejected > 0


def test_a_shorter_prefix_of_a_wrapped_ring_is_recomputed(ring16) -> None:
    """Continuing a conversation reuses its cache; a prefix whose window the ring no longer
    holds is recomputed (reuse 0), and both give the fresh session's tokens."""
    s = DecodeSession(ring16)
    first = prompt(7, 44)  # + 10 generated: the ring holds ~24.. only
    s.generate(first, GenerateOptions(max_tokens=10))
    n = len(s.kv_tokens)
    follow = [*s.kv_tokens, *prompt(8, 5)]
    out = s.generate(follow, GenerateOptions(max_tokens=6))
    assert out.stats.reused_prefix_tokens == n
    assert out.tokens == DecodeSession(ring16).generate(follow, GenerateOptions(max_tokens=6)).tokens
    short = first[:20] + prompt(9, 3)
    out = s.generate(short, GenerateOptions(max_tokens=6))
    assert out.stats.reused_prefix_tokens == 0
    assert out.tokens == DecodeSession(ring16).generate(short, GenerateOptions(max_tokens=6)).tokens


# --- KV slots ----------------------------------------------------------------------------------

def test_spill_restore_and_slot_files_carry_the_ring(ring16, tmp_path: Path) -> None:
    events: list[str] = []
    mgr = SlotManager(ring16, 1, 1 << 24, events.append)
    a = prompt(10, 30)

    def serve(p: list[int], n: int = 8) -> list[int]:
        slot = mgr.acquire(p)
        s = DecodeSession(ring16)
        s.use_slot(slot.state, slot.tokens)
        out = s.generate(p, GenerateOptions(max_tokens=n))
        mgr.release(slot, s.kv_tokens, len(p))
        return out.tokens

    reply = serve(a)
    held = mgr.resident[0].state.ring.positions()
    serve(prompt(11, 20))  # evicts A: spilled with its ring positions
    (spilled,) = mgr.spilled
    assert spilled.ring is not None and spilled.ring == [q if q < len(spilled.tokens) else -1
                                                         for q in held]
    nxt = [*a, *reply[:-1], *prompt(12, 4)]
    got = serve(nxt)
    assert "restore" in events
    assert got == DecodeSession(ring16).generate(nxt, GenerateOptions(max_tokens=8)).tokens

    # Saved to a file and restored into another manager's slot: the same continuation.
    layout = StateLayout(ring16)
    entry = mgr.resident[0]
    n = len(entry.tokens)
    mgr.save(0, tmp_path, "a")
    path = tmp_path / "a.slot"
    contents = load_slot(path, layout)
    assert contents.ring == layout.ring_positions(entry.state, n)
    other = SlotManager(ring16, 1, 1 << 24)
    other.restore(0, tmp_path, "a")
    assert other.resident[0].state.ring.positions() == contents.ring
    more = [*contents.tokens, *prompt(13, 3)]
    s = DecodeSession(ring16)
    s.use_slot(other.resident[0].state, other.resident[0].tokens)
    out = s.generate(more, GenerateOptions(max_tokens=6))
    assert out.stats.reused_prefix_tokens == n
    assert out.tokens == DecodeSession(ring16).generate(more, GenerateOptions(max_tokens=6)).tokens
    # A re-signed file whose positions are not in their slots is refused by name.
    data = path.read_bytes()
    header, body = split(data)
    header["ring"] = [1] * R
    header["content_sha256"] = _content_hash(header, data[body:])
    bad = tmp_path / "bad.slot"
    bad.write_bytes(with_header(data, header))
    with pytest.raises(SlotFileError, match="bad.slot: its KV ring does not fit this build"):
        load_slot(bad, layout)
    del header["ring"]  # a ring build's file must carry its positions
    header["content_sha256"] = _content_hash(header, data[body:])
    bad.write_bytes(with_header(data, header))
    with pytest.raises(SlotFileError, match="need their slots' positions"):
        load_slot(bad, layout)


def test_prefix_copy_only_while_the_ring_holds_the_window(ring16, monkeypatch) -> None:
    """A miss that shares a prefix with another conversation copies it only while that
    conversation's ring still holds the prefix's window: a short one (nothing wrapped) is
    copied, a long one is refused and the prompt recomputed; both give the fresh tokens."""
    import ane_spec.daemon.slots as slots_mod

    monkeypatch.setattr(slots_mod, "MIN_SHARED", 4)
    events: list[str] = []
    mgr = SlotManager(ring16, 2, 1 << 24, events.append)

    def serve(p: list[int], speculative: bool = True) -> tuple[list[int], int]:
        slot = mgr.acquire(p)
        s = DecodeSession(ring16)
        s.use_slot(slot.state, slot.tokens)
        out = s.generate(p, GenerateOptions(max_tokens=6, speculative=speculative))
        mgr.release(slot, s.kv_tokens, len(p))
        fresh = DecodeSession(ring16).generate(p, GenerateOptions(max_tokens=6,
                                                                  speculative=speculative))
        assert out.tokens == fresh.tokens
        return out.tokens, out.stats.reused_prefix_tokens

    # Short: 10 prompt tokens + 1 cached reply token, no drafts: nothing has wrapped.
    short = prompt(20, 10)
    slot = mgr.acquire(short)
    s = DecodeSession(ring16)
    s.use_slot(slot.state, slot.tokens)
    s.generate(short, GenerateOptions(max_tokens=2, speculative=False))
    mgr.release(slot, s.kv_tokens, len(short))
    events.clear()
    _, reused = serve([*short[:6], *prompt(21, 4)])
    assert "copy" in events and reused == 6

    long = prompt(22, 54)  # + 6 generated: the ring holds ~30.., the prefix needs 17..23
    serve(long)
    events.clear()
    _, reused = serve([*long[:24], *prompt(23, 4)])
    assert "copy" not in events and reused == 0


def test_core_ml_runs_the_ring_build_as_the_interpreter_does(coreml_standin, builds,
                                                             capsys) -> None:
    """The ring build through Core ML's path (tests/coreml_standin.py: the real CoreMLBackend
    and its worker process, the packages' declared inputs and state shapes enforced), token for
    token against the fp16 interpreter, past the ring's 32 slots."""
    import json as json_mod

    from ane_spec.cli import main
    from ane_spec.decode.generate import prompt_tokens

    art = builds["ring"]
    mil = open_pipeline(art, "mil", "fp16")[1]
    # Decoded synthetic ids re-tokenize otherwise (special-token texts, merges): the first
    # text that `generate` reads as 25..44 tokens.
    text = next(t for t in (mil.tokenizer.decode(prompt(30, n)) for n in range(8, 60))
                if 25 <= len(prompt_tokens(mil, prompt=t)) <= 44)
    code = main(["generate", "--manifest", str(art), "--prompt", text, "--max-tokens", "12",
                 "--backend", "coreml", "--json"])
    assert code == 0
    got = json_mod.loads(capsys.readouterr().out)
    assert main(["generate", "--manifest", str(art), "--prompt", text, "--max-tokens", "12",
                 "--backend", "mil", "--json"]) == 0
    want = json_mod.loads(capsys.readouterr().out)
    assert got["prompt_tokens"] + 12 > R
    assert got["tokens"] == want["tokens"] and len(want["tokens"]) == 12
