"""`--draft-model` end to end: the CLI builds the draft from a GGUF, and a real server (uvicorn
on loopback) answers chats with a draft model of its own (other weights, the same vocabulary, so
some of its drafts are rejected) in its own process: text equal to greedy, the draft source of
every pass in the stats, /health and /metrics."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from ane_spec.cli import main
from ane_spec.daemon.config import ServeConfig
from ane_spec.daemon.launchd import serve_arguments
from ane_spec.daemon.server import BackgroundServer
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.probes.gates import open_pipeline
from ane_spec.shards.build import BuildRequest, build
from tests.test_daemon import chat_tokens, wait_ready

S = 128


@pytest.fixture(scope="module")
def target(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("draft-server") / "target"
    build(tiny_gguf, out, BuildRequest(topology="3", max_seq=S, residual_scale="off"))
    return out


def test_the_cli_builds_the_draft_once_and_refuses_another_vocabulary(
        target: Path, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["generate", "--manifest", str(target), "--prompt", "def f(x):", "--max-tokens",
            "12", "--json", "--backend", "mil", "--precision", "fp16",
            "--draft-model", str(tiny_gguf), "--draft-mode", "model", "--no-draft-overlap"]
    assert main(args) == 0
    out = capsys.readouterr()
    spec = json.loads(out.out.strip().splitlines()[-1])
    built = tmp_path / "local-artifacts" / "drafts" / f"tiny-s{S}"
    assert (built / "manifest.json").is_file() and "building tiny.gguf" in out.err
    plain = ["generate", "--manifest", str(target), "--prompt", "def f(x):", "--max-tokens",
             "12", "--json", "--backend", "mil", "--precision", "fp16", "--no-speculative"]
    assert main(plain) == 0
    greedy = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert spec["tokens"] == greedy["tokens"]
    assert spec["stats"]["draft_sources"]["model"]["passes"] == spec["stats"]["passes"]
    assert spec["stats"]["acceptance"] > 0.9  # the target drafting for itself
    assert main(args) == 0  # the second time the build is reused
    assert "reusing the build" in capsys.readouterr().err

    other = write_synthetic_gguf(tmp_path / "other.gguf", preset("tiny", num_layers=1,
                                                                 vocab_size=2048))
    assert main([*args[:-5], "--draft-model", str(other)]) == 2
    err = capsys.readouterr().err
    assert "cannot draft for" in err and "BOS id" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft that is not the target: the tiny preset cut to 2 layers (the target has 3), so
    the same vocabulary and embeddings and other outputs: it guesses about a quarter of the
    target's greedy tokens, so drafts are both accepted and rejected. Built with the target's
    context."""
    root = tmp_path_factory.mktemp("draft-server-draft")
    gguf = write_synthetic_gguf(root / "draft.gguf", preset("tiny", num_layers=2))
    build(gguf, root / "draft", BuildRequest(topology="2", max_seq=S, residual_scale="off"))
    return root / "draft"


@pytest.fixture(scope="module")
def server(target: Path, draft: Path):
    config = ServeConfig(manifest=target, port=0, backend="mil", precision="fp16",
                         log_level="warning", access_log=False, kv_slots=2,
                         draft_manifest=draft, draft_mode="both")
    with BackgroundServer(config) as srv:  # its warm-up starts the draft's process
        wait_ready(srv.url, timeout=600)
        yield srv


def test_chat_with_a_draft_model_is_greedy_text_with_draft_sources(server, target: Path) -> None:
    pipeline = open_pipeline(target, "mil", "fp16", verify=False)[1]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    health = httpx.get(f"{server.url}/health").json()
    draft = health["draft_model"]
    assert draft["mode"] == "both" and draft["overlap"] is True
    assert draft["costs"]["draft_ms"] > 0 and draft["worker"]["running"]
    assert draft["kv_states"] == 2
    messages = [{"role": "user", "content": "def fib(n):"}]
    model, model_passes = {"passes": 0, "drafted": 0, "accepted": 0}, 0
    for turn in range(2):
        prompt = chat_tokens(pipeline, messages)
        greedy = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=48,
                                                                          speculative=False))
        r = client.chat.completions.create(model="any", messages=messages, max_tokens=48)
        assert r.choices[0].message.content == greedy.text
        assert r.usage.completion_tokens == len(greedy.tokens)  # the same text, as many tokens
        stats = r.model_extra["ane_spec"]["stats"]
        sources = stats["draft_sources"]
        assert sum(s["passes"] for s in sources.values()) == stats["passes"]
        model_passes += stats["draft_model_passes"]
        for key in model:
            model[key] += sources["model"][key]
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "again, shorter"}]
    # A draft of other weights: some of its drafts were rejected, and the text is still greedy's.
    assert model["passes"] > 0 and model["drafted"] > model["accepted"], model
    assert model_passes > 0
    metrics = httpx.get(f"{server.url}/metrics").text
    for key, n in model.items():  # the two chats are the server's only requests
        assert f'ane_spec_draft_source_{key}_total{{source="model"}} {n}' in metrics, metrics
    assert "ane_spec_draft_model_passes_total" in metrics


def test_serve_arguments_carry_the_draft_options(target: Path) -> None:
    config = ServeConfig(manifest=target, draft_manifest=target, draft_mode="model",
                         draft_overlap=False, backend="mil")
    args = serve_arguments(config, "python")
    assert args[args.index("--draft-model") + 1] == str(target.resolve())
    assert args[args.index("--draft-mode") + 1] == "model" and "--no-draft-overlap" in args


def test_sweep_with_a_draft_model_reports_who_drafted(target: Path, draft: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`sweep --draft-model`: the speculative runs draft with the model (their tokens equal
    greedy's: `exact`), and each row says who drafted its passes, in JSON and Markdown."""
    out = tmp_path / "sweep"
    assert main(["sweep", "--manifest", str(target), "--lengths", "32,48", "--reps", "1",
                 "--new-tokens", "10", "--backend", "mil", "--precision", "fp16",
                 "--draft-model", str(draft), "--draft-mode", "model", "--out", str(out)]) == 0
    result = json.loads((out / "sweep.json").read_text())
    assert result["draft_mode"] == "model" and len(result["rows"]) == 2
    for row in result["rows"]:
        model = row["draft_sources"]["model"]
        assert row["exact"] and model["passes"] > 0 and model["drafted"] > model["accepted"]
        assert row["draft_model_passes"] > 0
    text = capsys.readouterr().out
    assert "Who drafted the speculative passes (draft mode model" in text
    assert f"- 32 tokens: model {result['rows'][0]['draft_sources']['model']['passes']} passes" \
        in text


def test_a_server_config_refuses_draft_units_with_the_interpreter(target: Path) -> None:
    """Refused when the configuration is made, not at the server's warm-up."""
    from ane_spec.daemon.config import ServeConfigError

    with pytest.raises(ServeConfigError, match="--draft-units picks Core ML compute units"):
        ServeConfig.create(manifest=target, draft_manifest=target, draft_units="gpu",
                           backend="mil")
    ServeConfig.create(manifest=target, draft_manifest=target, draft_units="gpu",
                       backend="coreml")
