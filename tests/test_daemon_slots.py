"""KV slots and cross-request drafting through the daemon: real uvicorn on loopback, a tiny
build, every reply checked against a fresh `DecodeSession` on the same tokens."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from ane_spec.daemon.config import ServeConfig
from ane_spec.daemon.server import BackgroundServer
from ane_spec.decode.sampling import SamplingParams
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.model.chat import render_chat
from ane_spec.probes.gates import open_pipeline
from tests.test_slots import builds  # noqa: F401 - the session's shared tiny builds

@pytest.fixture(scope="module")
def artifacts(builds) -> Path:  # noqa: F811
    return builds["art"]


@pytest.fixture(scope="module")
def pipeline(artifacts: Path):
    return open_pipeline(artifacts, "mil", "fp32")[1]


def serving(artifacts: Path, **options) -> BackgroundServer:
    config = ServeConfig(manifest=artifacts, port=0, backend="mil", precision="fp32",
                         log_level="warning", access_log=False, **options)
    server = BackgroundServer(config).start()
    deadline = time.monotonic() + 60
    while httpx.get(f"{server.url}/health").json()["status"] != "ok":
        assert time.monotonic() < deadline, "the server did not become ready"
        time.sleep(0.02)
    return server


def metrics(server: BackgroundServer, headers: dict | None = None) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{server.url}/metrics", headers=headers).text.splitlines():
        if line.startswith("ane_spec_slot"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def complete(server: BackgroundServer, prompt: list[int], max_tokens: int = 8,
             headers: dict | None = None, **extra) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=60, json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, **extra})
    assert r.status_code == 200, r.text
    return r.json()


_SOLO: dict[tuple, object] = {}


def solo(pipeline, prompt: list[int], max_tokens: int = 8):
    """What a fresh session generates (memoised: several servers replay the same chats)."""
    key = (id(pipeline), tuple(prompt), max_tokens)
    if key not in _SOLO:
        _SOLO[key] = DecodeSession(pipeline).generate(prompt,
                                                      GenerateOptions(max_tokens=max_tokens))
    return _SOLO[key]


def interleave(server, pipeline, conversations: int, turns: int) -> list[list[float]]:
    """Token-level conversations (a client keeping token ids, as llama.cpp's /completion
    clients do), taking turns: A1 B1 A2 B2 ... Returns each turn's reused share of its prompt;
    every reply must equal the conversation's solo run."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 1000, 40).tolist() for _ in range(conversations)]
    shares: list[list[float]] = [[] for _ in range(conversations)]
    for _ in range(turns):
        for c in range(conversations):
            ref = solo(pipeline, prompts[c])
            body = complete(server, prompts[c])
            assert body["choices"][0]["text"] == ref.text
            stats = body["ane_spec"]["stats"]
            shares[c].append(stats["reused_prefix_tokens"] / stats["prompt_tokens"])
            prompts[c] = [*prompts[c], *ref.tokens, *rng.integers(0, 1000, 4).tolist()]
    return shares


@pytest.fixture(scope="module")
def server(artifacts: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two slots; per-key draft memory without an API key: scopes by the `user` field."""
    srv = serving(artifacts, kv_slots=2, slot_save_path=tmp_path_factory.mktemp("saved"),
                  draft_memory="per-key")
    yield srv
    srv.stop()


def test_interleaved_conversations_keep_their_caches(server, pipeline) -> None:
    before = metrics(server)
    shares = interleave(server, pipeline, conversations=2, turns=3)
    for conv in shares:
        assert conv[0] == 0 and min(conv[1:]) >= 0.8, shares
    after = metrics(server)
    assert after["ane_spec_slot_hits_total"] - before["ane_spec_slot_hits_total"] == 4
    health = httpx.get(f"{server.url}/health").json()
    assert health["kv_slots"]["resident"] == 2 and health["kv_slots"]["resident_fit"] >= 2
    assert health["draft_memory"]["mode"] == "per-key"


def test_interleaved_chats_reuse_what_they_would_alone(server, pipeline) -> None:
    """Through the chat template the reusable prefix ends where the re-encoded reply differs
    from the generated tokens (a random-weights model emits odd byte tokens); interleaved, each
    chat reuses exactly what the same chat reuses on its own cache, and says the same."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    tok = pipeline.tokenizer
    chats = {c: [{"role": "system", "content": f"You are assistant {c}."}] for c in "AB"}
    mirrors = {c: DecodeSession(pipeline) for c in "AB"}
    for turn in range(3):
        for c in "AB":
            chats[c].append({"role": "user", "content": f"{c} asks question {turn}"})
            prompt = tok.encode(render_chat(chats[c], template=tok.data.chat_template),
                                special=True)
            alone = mirrors[c].generate(prompt, GenerateOptions(max_tokens=10))
            r = client.chat.completions.create(model="m", messages=chats[c], max_tokens=10)
            assert r.choices[0].message.content == alone.text
            reused = r.model_extra["ane_spec"]["stats"]["reused_prefix_tokens"]
            assert reused == alone.stats.reused_prefix_tokens
            chats[c].append({"role": "assistant", "content": alone.text})


def test_one_slot_spills_and_restores_without_spilling_forgets(artifacts, pipeline) -> None:
    srv = serving(artifacts, kv_slots=1)
    try:
        shares = interleave(srv, pipeline, conversations=2, turns=2)
        m = metrics(srv)
    finally:
        srv.stop()
    assert all(s[1] >= 0.8 for s in shares), shares
    assert m["ane_spec_slot_restores_total"] == 2 and m["ane_spec_slot_spills_total"] == 3
    srv = serving(artifacts, kv_slots=1, slot_spill_mb=0)
    try:
        shares = interleave(srv, pipeline, conversations=2, turns=2)
        m = metrics(srv)
    finally:
        srv.stop()
    assert all(s[1] == 0 for s in shares), shares  # the one cache went to the other chat
    assert m["ane_spec_slot_drops_total"] == 3 and m["ane_spec_slot_restores_total"] == 0


def test_slots_route_save_and_restore_across_restart(artifacts, pipeline, tmp_path) -> None:
    save_dir = tmp_path / "slots"
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 1000, 50).tolist()
    srv = serving(artifacts, kv_slots=2, slot_save_path=save_dir)
    try:
        complete(srv, prompt)
        listing = httpx.get(f"{srv.url}/slots").json()
        busy = [s for s in listing["slots"] if s["state"] == "resident"]
        assert len(busy) == 1 and listing["resident_slots"] == 2
        sid = busy[0]["id"]
        saved = httpx.post(f"{srv.url}/slots/{sid}?action=save", json={"filename": "chat1"})
        assert saved.status_code == 200 and saved.json()["filename"] == "chat1.slot"
        assert saved.json()["tokens"] == busy[0]["tokens"]
        empty = 1 - sid
        cases = [(f"/slots/{empty}?action=save", {}, 400, "empty"),
                 ("/slots/7?action=erase", {}, 404, "no slot 7"),
                 (f"/slots/{sid}?action=save", {"filename": "../up"}, 400, "bad slot file"),
                 (f"/slots/{sid}?action=restore", {"filename": "nope"}, 400, "cannot read"),
                 (f"/slots/{sid}?action=restore", {}, 400, "needs a filename"),
                 (f"/slots/{sid}?action=explode", {}, 400, "action")]
        for path, body, status, text in cases:
            r = httpx.post(f"{srv.url}{path}", json=body)
            assert r.status_code == status and text in r.text, (path, r.text)
        assert metrics(srv)["ane_spec_slot_saves_total"] == 1
    finally:
        srv.stop()
    (save_dir / "junk.slot").write_bytes(b"not a slot at all")
    srv = serving(artifacts, kv_slots=2, slot_save_path=save_dir)
    try:
        listing = httpx.get(f"{srv.url}/slots").json()
        assert [s["tokens"] for s in listing["slots"] if s["state"] == "resident"] \
            == [busy[0]["tokens"]]
        assert metrics(srv)["ane_spec_slot_loads_total"] == 1  # junk.slot refused, not fatal
        ref = solo(pipeline, prompt)
        follow = [*prompt, *ref.tokens, 5, 6, 7]
        body = complete(srv, follow)
        assert body["choices"][0]["text"] == solo(pipeline, follow).text
        assert body["ane_spec"]["stats"]["reused_prefix_tokens"] == busy[0]["tokens"]
        r = httpx.post(f"{srv.url}/slots/0?action=restore", json={"filename": "junk"})
        assert r.status_code == 400 and "junk.slot: not an ane-spec slot file" in r.text
    finally:
        srv.stop()


def test_draft_memory_is_scoped_per_key_and_user(server, pipeline) -> None:
    """per-key: a repeated request drafts from the memory of its own (key, user) scope, never
    from another's, and the text never changes."""
    prompt = np.random.default_rng(5).integers(0, 1000, 30).tolist()
    scopes = httpx.get(f"{server.url}/health").json()["draft_memory"]["scopes"]
    first, again, other = (complete(server, prompt, 24, user=u) for u in ("u1", "u1", "u2"))
    health = httpx.get(f"{server.url}/health").json()
    assert health["draft_memory"]["scopes"] == scopes + 2
    text = solo(pipeline, prompt, 24).text
    assert first["choices"][0]["text"] == again["choices"][0]["text"] == \
        other["choices"][0]["text"] == text
    tpp = [b["ane_spec"]["stats"]["tokens_per_pass"] for b in (first, again, other)]
    assert tpp[1] > tpp[0] and tpp[2] == tpp[0], tpp  # u2 learns nothing from u1
    assert other["ane_spec"]["stats"]["reused_prefix_tokens"] == 0  # nor reuses u1's cache


def test_seeded_sampling_stays_reproducible_with_memory(server, pipeline) -> None:
    prompt = np.random.default_rng(9).integers(0, 1000, 20).tolist()
    options = GenerateOptions(max_tokens=16,
                              sampling=SamplingParams(temperature=0.9, top_p=1.0, seed=42))
    fill = httpx.get(f"{server.url}/health").json()["fill_drafts"]
    ref = DecodeSession(pipeline, fill_drafts=fill).generate(prompt, options)
    texts = [complete(server, prompt, 16, temperature=0.9, seed=42)["choices"][0]["text"]
             for _ in range(2)]
    assert texts == [ref.text, ref.text]


def test_slot_and_memory_options_round_trip_through_the_cli(artifacts, tmp_path) -> None:
    from ane_spec.cli import _serve_config, build_parser
    from ane_spec.daemon.config import ServeConfigError
    from ane_spec.daemon.launchd import serve_arguments

    cfg = ServeConfig(manifest=artifacts, kv_slots=3, slot_spill_mb=0,
                      slot_save_path=tmp_path / "s", draft_memory="off",
                      draft_memory_tokens=4096)
    args = build_parser().parse_args(serve_arguments(cfg)[3:])
    back = _serve_config(args)
    for field in ("kv_slots", "slot_spill_mb", "draft_memory", "draft_memory_tokens"):
        assert getattr(back, field) == getattr(cfg, field), field
    assert back.slot_save_path == (tmp_path / "s").resolve()
    assert ServeConfig(manifest=artifacts).draft_memory_mode == "shared"
    assert ServeConfig(manifest=artifacts, api_key="k").draft_memory_mode == "per-key"
    assert ServeConfig(manifest=artifacts, api_key="k", draft_memory="shared") \
        .draft_memory_mode == "shared"
    (tmp_path / "file").write_text("x")
    for bad, message in (({"slot_save_path": tmp_path / "file"}, "is not a directory"),
                         ({"draft_memory": "everyone"}, "draft_memory"),
                         ({"kv_slots": 0}, "kv_slots"),
                         ({"draft_memory_tokens": 10}, "draft_memory_tokens")):
        with pytest.raises(ServeConfigError, match=message):
            ServeConfig.create(manifest=artifacts, **bad)


def test_a_job_that_raises_the_unforeseen_is_that_jobs_error(artifacts, pipeline,
                                                            monkeypatch) -> None:
    """Issue 36: any exception in a job is an error for that job, never a dead worker thread
    (a forged slot file's OverflowError once killed it: the restore never answered, /health
    said ready, and every later request queued until 429). Exceptions nothing in the engine
    names are raised inside a slot action and inside a generation's set-up; each request gets
    a 500, and the worker then serves the fixed greedy completion as before."""
    prompt = np.random.default_rng(11).integers(0, 1000, 30).tolist()
    srv = serving(artifacts, kv_slots=2)
    engine = srv.engine
    try:
        complete(srv, prompt)

        def boom(*args, **kwargs):
            raise OverflowError("Python int too large to convert to C long")

        monkeypatch.setattr(engine.slots, "erase", boom)
        r = httpx.post(f"{srv.url}/slots/0?action=erase", json={}, timeout=30)
        assert r.status_code == 500 and "OverflowError" in r.text, r.text
        monkeypatch.undo()

        def fails(*args, **kwargs):
            raise RuntimeError("nobody saw this coming")

        monkeypatch.setattr(engine.memories, "get", fails)
        r = httpx.post(f"{srv.url}/v1/completions", timeout=30,
                       json={"model": "m", "prompt": prompt, "max_tokens": 8})
        assert r.status_code == 500 and "RuntimeError" in r.text, r.text
        monkeypatch.undo()

        assert engine._thread.is_alive()
        health = httpx.get(f"{srv.url}/health").json()
        assert health["status"] == "ok" and not health["busy"], health
        body = complete(srv, prompt)
        assert body["choices"][0]["text"] == solo(pipeline, prompt).text
        # What the failed jobs might have been writing is not trusted: the prompt is computed
        # again, never continued from a resident state of unknown contents.
        assert body["ane_spec"]["stats"]["reused_prefix_tokens"] == 0
    finally:
        srv.stop()
