"""Every Core ML path of the toolchain, run on Linux through the stand-in for coremltools'
native layer (tests/coreml_standin.py): the real CoreMLBackend, compiled cache, pipeline,
probes, generate, daemon slots and demo. Results are checked against the fp16 MIL interpreter,
which the stand-in computes with: equal tokens, equal logits."""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest

from ane_spec.cli import main
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.probes.gates import GATES, open_pipeline, run_gates


def test_every_probe_runs_on_core_ml(coreml_standin, coreml_build) -> None:
    out, _ = coreml_build
    reports = {r.gate: r for r in run_gates(out, GATES, backend="coreml", precision="fp32",
                                            save=False)}
    for gate in ("row-invariance", "parity", "block", "drift"):
        assert reports[gate].passed and reports[gate].backend == "coreml", reports[gate].summary()
    residency = reports["residency"]  # structure only: placement needs the hardware
    assert residency.skipped.startswith("needs Apple hardware")
    assert "structure only" in residency.skipped
    packages = residency.details["packages"]  # the shard's two functions, then the head
    assert [p["function"] for p in packages] == ["main", "prefill", "main"]
    assert all(p["conv_total"] > 0 for p in packages)


@pytest.mark.parametrize("decode_shape", ["fixed", "mixed"])
def test_generate_on_core_ml_equals_the_fp16_interpreter(coreml_standin, coreml_build,
                                                         decode_shape, capsys) -> None:
    """`generate` through the CLI on Core ML, token for token against the fp16 interpreter."""
    out, _ = coreml_build
    prompt = "def f(x):\n    return"
    code = main(["generate", "--manifest", str(out), "--prompt", prompt, "--max-tokens", "12",
                 "--backend", "coreml", "--decode-shape", decode_shape, "--json"])
    assert code == 0
    got = json.loads(capsys.readouterr().out)
    _, mil = open_pipeline(out, "mil", "fp16", decode_shape=decode_shape)
    want = DecodeSession(mil).generate(mil.tokenizer.encode(prompt),
                                       GenerateOptions(max_tokens=12))
    assert got["tokens"] == want.tokens and len(want.tokens) == 12
    assert got["text"] == want.text


def test_daemon_two_slots_spill_restore_and_prefix_copy(coreml_standin, context_build) -> None:
    """Two resident K/V slots on Core ML, three conversations: spills, restores and a prefix
    copy all move states through MLState.read_state / write_state; every reply equals a fresh
    session's on the same tokens. On `context_build`, whose next tokens depend on the whole
    context (test_coreml_worker shows it), so a slot holding the wrong K/V changes a reply."""
    from ane_spec.daemon.config import ServeConfig
    from ane_spec.daemon.server import BackgroundServer

    out = context_build
    _, pipeline = open_pipeline(out, "coreml", "fp32")
    config = ServeConfig(manifest=out, port=0, backend="coreml", log_level="warning",
                         access_log=False, kv_slots=2)
    server = BackgroundServer(config).start()
    try:
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.url}/health").json()["status"] != "ok":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        rng = np.random.default_rng(11)
        base = [rng.integers(0, 1000, 40).tolist() for _ in range(3)]
        prompts = [*base, base[0][:18] + [7, 8, 9]]  # the last shares 18 tokens with the first
        for turn in range(2):
            for prompt in prompts if turn else prompts[:3]:
                r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                    "model": "m", "prompt": prompt, "max_tokens": 4})
                assert r.status_code == 200, r.text
                want = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=4))
                assert r.json()["choices"][0]["text"] == want.text
        counters = {line.split(" ")[0]: float(line.split(" ")[1])
                    for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                    if line.startswith("ane_spec_slot_")}
    finally:
        server.stop()
    assert counters["ane_spec_slot_spills_total"] >= 1, counters
    assert counters["ane_spec_slot_restores_total"] >= 1, counters
    assert counters["ane_spec_slot_copies_total"] >= 1, counters
