"""generate / sweep / bench-drafter / demo through the real argument parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ane_spec.cli import main
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.errors import AneSpecError
from ane_spec.probes.gates import open_pipeline
from ane_spec.shards.build import BuildRequest, build


@pytest.fixture(scope="module")
def built(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli-decode") / "art"
    build(tiny_gguf, out, BuildRequest(topology="3", max_seq=256))
    return out


def test_generate_json_matches_the_session(built: Path, capsys, tmp_path: Path) -> None:
    trace = tmp_path / "trace.ndjson"
    assert main(["generate", "--manifest", str(built), "--prompt", "def f(x): return x",
                 "--max-tokens", "20", "--json", "--backend", "mil", "--trace", str(trace)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"prompt_tokens", "tokens", "text", "finish_reason", "stats"}
    assert {"passes", "tokens_per_pass", "decode_tok_s", "prefill_tok_s"} <= set(out["stats"])
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    prefill = [r for r in records if r.get("prefill")]
    assert len(records) - len(prefill) == out["stats"]["passes"]
    assert len(prefill) == out["stats"]["prefill_passes"] >= 1
    _, pipeline = open_pipeline(built, "mil", "fp32")
    tokens = pipeline.tokenizer.encode("def f(x): return x", special=True)
    expected = DecodeSession(pipeline).generate(tokens, GenerateOptions(max_tokens=20,
                                                                        speculative=False))
    assert out["tokens"] == expected.tokens and out["prompt_tokens"] == len(tokens)


def test_generate_streams_then_stats_and_chat_file(built: Path, capsys, tmp_path: Path) -> None:
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "hi"}]))
    assert main(["generate", "--manifest", str(built), "--chat-file", str(chat),
                 "--max-tokens", "8", "--no-speculative", "--backend", "mil"]) == 0
    captured = capsys.readouterr()
    assert "tok/pass" in captured.err and captured.out.strip() != ""
    chat.write_text('{"not": "messages"}')
    assert main(["generate", "--manifest", str(built), "--chat-file", str(chat),
                 "--backend", "mil"]) == 2
    assert "expected a JSON list" in capsys.readouterr().err


def test_sweep_writes_json_markdown_png(built: Path, capsys, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    assert main(["sweep", "--manifest", str(built), "--lengths", "40,120,400", "--reps", "1",
                 "--new-tokens", "16", "--out", str(out), "--backend", "mil"]) == 0
    table = capsys.readouterr().out
    assert "| 40 tokens |" in table and "Skipped" in table  # 400 + 16 > 256 slots
    result = json.loads((out / "sweep.json").read_text())
    assert [r["prompt_tokens"] for r in result["rows"]] == [40, 120]
    assert all(r["exact"] for r in result["rows"]) and (out / "sweep.png").stat().st_size > 0


def test_bench_drafter(capsys) -> None:
    assert main(["bench-drafter", "--per-family", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"ane-spec", "vllm-ngram"} <= set(result["drafters"])
    # Figures from the project's own streams say what those streams are, in both formats.
    assert "repeat across requests by construction" in result["caveat"]
    assert "memory rule was chosen on these same streams" in result["caveat"]
    assert main(["bench-drafter", "--per-family", "1"]) == 0
    assert "repeat across requests by construction" in capsys.readouterr().out


def test_head_argmax_build_decodes_greedily_and_refuses_sampling(tiny_gguf: Path,
                                                                 built: Path,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "argmax"
    build(tiny_gguf, out, BuildRequest(topology="3", max_seq=256, head_argmax=True))
    _, arg = open_pipeline(out, "mil", "fp32")
    _, full = open_pipeline(built, "mil", "fp32")
    prompt = [5, 6, 7, 8, 9]
    a = DecodeSession(arg).generate(prompt, GenerateOptions(max_tokens=24))
    b = DecodeSession(full).generate(prompt, GenerateOptions(max_tokens=24))
    assert a.tokens == b.tokens
    from ane_spec.decode.sampling import SamplingParams

    with pytest.raises(AneSpecError, match="--head-argmax"):
        DecodeSession(arg).generate(prompt, GenerateOptions(sampling=SamplingParams(temperature=1)))
