"""A gemma3 build behind a real loopback server: chats through Gemma's own template, tools
answered as content (llama.cpp reads no calls from Gemma 3), and a conversation longer than the
sliding-window ring saved to a slot file and continued after a restart, each reply equal to a
fresh session's greedy output."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import numpy as np
import pytest

from ane_spec.daemon.config import ServeConfig
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.manifests.store import load_manifest
from ane_spec.model.chat import render_chat
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.probes.gates import open_pipeline
from ane_spec.shards.build import BuildRequest, build
from tests.live_server import started

S = 128


@pytest.fixture(scope="module")
def gemma_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gemma3-server")
    gguf = write_synthetic_gguf(root / "g.gguf", preset("gemma3-tiny", seed=11, embed_std=0.02))
    # A 24-row prefill function keeps the rings at W + 24 = 32 slots, so the conversation below
    # wraps them (with the default 64 they would be 96 slots).
    build(gguf, root / "art", BuildRequest(topology="4", max_seq=S, prefill_t=24))
    assert load_manifest(root / "art").manifest.build.swa_ring == 32
    return root / "art"


def serve(art: Path, **options):
    return started(ServeConfig(manifest=art, port=0, backend="mil", precision="fp32",
                               log_level="warning", access_log=False, **options))


def test_gemma3_chat_tools_and_a_ring_slot_across_restart(gemma_build: Path,
                                                         tmp_path: Path) -> None:
    pipeline = open_pipeline(gemma_build, "mil", "fp32")[1]
    tok = pipeline.tokenizer
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name three prime numbers and say why they are prime."}]
    # As llama.cpp applies a template: BOS added by the tokenizer, the template's own dropped.
    prompt = tok.encode(render_chat(chat, template=tok.data.chat_template, bos_token="<bos>",
                                    eos_token="<eos>", add_bos=tok.data.add_bos_token),
                        special=True, add_special=True)
    assert prompt[0] == tok.data.bos_token_id and prompt.count(tok.data.bos_token_id) == 1
    alone = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=12))
    save_dir = tmp_path / "slots"
    srv = serve(gemma_build, kv_slots=2, slot_save_path=save_dir)
    try:
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": chat, "max_tokens": 12})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == alone.text
        assert r.json()["usage"]["prompt_tokens"] == len(prompt)

        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": chat, "max_tokens": 12, "tools": [tool]})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert message["content"] == alone.text and not message.get("tool_calls")
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": chat, "max_tokens": 12, "tools": [tool],
            "tool_choice": "required"})
        assert r.status_code == 400 and "tool_choice" in r.text

        # A token-level conversation past the 32-slot ring, saved and continued elsewhere.
        long = np.random.default_rng(3).integers(4, 1000, 70).tolist()
        first = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
            "model": "m", "prompt": long, "max_tokens": 8}).json()
        listing = httpx.get(f"{srv.url}/slots").json()
        sid = next(s["id"] for s in listing["slots"] if s["tokens"] >= len(long))
        saved = httpx.post(f"{srv.url}/slots/{sid}?action=save", json={"filename": "ring"})
        assert saved.status_code == 200, saved.text
    finally:
        srv.stop()
    ref = DecodeSession(pipeline).generate(long, GenerateOptions(max_tokens=8))
    assert first["choices"][0]["text"] == ref.text
    srv = serve(gemma_build, kv_slots=2, slot_save_path=save_dir)
    try:
        # The restored ring continued: only the new tokens were computed.
        _continues_the_saved_ring(srv.url, pipeline, [*long, *ref.tokens], saved.json())
    finally:
        srv.stop()


def forge_ring(good: Path, bad: Path, edit) -> None:  # noqa: ANN001
    """`bad`: `good` with its header's ring list passed through `edit`, the (unkeyed) content
    hash recomputed so only the ring's own checks can refuse it."""
    import json
    import struct

    from ane_spec.daemon.slot_files import MAGIC, _content_hash

    raw = good.read_bytes()
    (head_len,) = struct.unpack("<Q", raw[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    header, payload = json.loads(raw[start:start + head_len]), raw[start + head_len:]
    header["ring"] = edit(list(header["ring"]))
    header["content_sha256"] = _content_hash(header, payload)
    head = json.dumps(header, separators=(",", ":")).encode()
    bad.write_bytes(MAGIC + struct.pack("<Q", len(head)) + head + payload)


FORGED_RINGS = {  # name -> (how the ring is edited, what the refusal says)
    "huge": (lambda r: [2**70, *r[1:]], "ring position outside"),
    "negative": (lambda r: [-(2**70), *r[1:]], "ring position outside"),
    "past-the-tokens": (lambda r: [r[0] + 128, *r[1:]], "ring position outside"),
    "float": (lambda r: [float(r[0]), *r[1:]], "unreadable header"),
    "bool": (lambda r: [True, *r[1:]], "unreadable header"),
    "short": (lambda r: r[:-1], "ring of 32 slots"),
    "swapped": (lambda r: [r[1], r[0], *r[2:]], "not in its slot"),
}


def test_forged_ring_slot_files_are_refused_and_skipped_at_start(
        gemma_build: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 36: a ring position of 2**70 in a re-signed slot file raised OverflowError in
    numpy, which nothing caught: the worker thread died with the restore unanswered, and after
    a restart the file failed the warm-up (503 for good; the good files never loaded). Each
    forged ring is now a 400 naming the file, the server stays exact, and at start-up each bad
    file is skipped with its name in the log while the good one loads."""
    pipeline = open_pipeline(gemma_build, "mil", "fp32")[1]
    long = np.random.default_rng(5).integers(4, 1000, 70).tolist()
    ref = DecodeSession(pipeline).generate(long, GenerateOptions(max_tokens=8))
    save_dir = tmp_path / "slots"
    srv = serve(gemma_build, kv_slots=2, slot_save_path=save_dir)
    try:
        httpx.post(f"{srv.url}/v1/completions", timeout=60,
                   json={"model": "m", "prompt": long, "max_tokens": 8})
        sid = next(s["id"] for s in httpx.get(f"{srv.url}/slots").json()["slots"]
                   if s["tokens"])
        saved = httpx.post(f"{srv.url}/slots/{sid}?action=save", json={"filename": "good"})
        assert saved.status_code == 200, saved.text
        for name, (edit, needle) in FORGED_RINGS.items():
            forge_ring(save_dir / "good.slot", save_dir / f"{name}.slot", edit)
            r = httpx.post(f"{srv.url}/slots/{sid}?action=restore", json={"filename": name},
                           timeout=30)
            assert r.status_code == 400, (name, r.status_code, r.text)
            message = r.json()["error"]["message"]
            assert message.startswith(f"{name}.slot: ") and needle in message, (name, message)
            health = httpx.get(f"{srv.url}/health").json()
            assert health["status"] == "ok" and not health["busy"], (name, health)
            body = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                              json={"model": "m", "prompt": long, "max_tokens": 8}).json()
            assert body["choices"][0]["text"] == ref.text, name
    finally:
        srv.stop()
    # The good file is the oldest: the forged ones, tried first, must not keep it out.
    os.utime(save_dir / "good.slot", (1, 1))
    caplog.set_level("WARNING", logger="ane_spec.daemon")
    srv = serve(gemma_build, kv_slots=2, slot_save_path=save_dir)
    try:
        assert httpx.get(f"{srv.url}/health").json()["status"] == "ok"
        skipped = "\n".join(r.getMessage() for r in caplog.records
                            if r.getMessage().startswith("not restoring"))
        for name in FORGED_RINGS:
            assert f"{name}.slot" in skipped, (name, skipped)
        _continues_the_saved_ring(srv.url, pipeline, [*long, *ref.tokens], saved.json())
    finally:
        srv.stop()


def _continues_the_saved_ring(url: str, pipeline, conversation: list[int], saved: dict) -> None:
    """A follow-up of `conversation` answers as a fresh session does, computing only what the
    restored slot did not hold."""
    follow = [*conversation, 5, 6, 7]
    body = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "m", "prompt": follow, "max_tokens": 8}).json()
    want = DecodeSession(pipeline).generate(follow, GenerateOptions(max_tokens=8))
    assert body["choices"][0]["text"] == want.text
    assert body["ane_spec"]["stats"]["reused_prefix_tokens"] == saved["tokens"]
