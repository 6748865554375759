"""A gemma3 build behind a real loopback server: chats through Gemma's own template, tools
answered as content (llama.cpp reads no calls from Gemma 3), and a conversation longer than the
sliding-window ring saved to a slot file and continued after a restart, each reply equal to a
fresh session's greedy output."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from ane_spec.daemon.config import ServeConfig
from ane_spec.decode.session import DecodeSession, GenerateOptions
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
    build(gguf, root / "art", BuildRequest(topology="4", max_seq=S))
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
        follow = [*long, *ref.tokens, 5, 6, 7]
        body = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
            "model": "m", "prompt": follow, "max_tokens": 8}).json()
        want = DecodeSession(pipeline).generate(follow, GenerateOptions(max_tokens=8))
        assert body["choices"][0]["text"] == want.text
        # The restored ring continued: only the new tokens were computed.
        assert body["ane_spec"]["stats"]["reused_prefix_tokens"] == saved.json()["tokens"]
    finally:
        srv.stop()
