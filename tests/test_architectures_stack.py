"""Everything above the compiler on Llama 3 and Qwen 3 builds, unchanged: KV slots (spill,
restore, prefix copy, slot files), the drafter's memory across requests, `doctor --manifest` and
`sweep`. The same code paths are tested in depth on Phi-3 builds (test_slots, test_daemon_slots,
test_doctor, test_decode_cli); here they must hold for the other K/V shapes (Qwen 3's 64-wide
heads on a 160-wide stream, one KV head) and tokenizers (Llama 3's BOS)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ane_spec.cli import main
from ane_spec.daemon.kv_state import StateLayout
from ane_spec.daemon.slot_files import load_slot, save_slot
from ane_spec.daemon.slots import MIN_SHARED, SlotManager
from ane_spec.decode.session import DecodeSession
from ane_spec.probes.gates import open_pipeline
from ane_spec.shards.build import BuildRequest
from tests.test_architectures import build_family
from tests.test_daemon_slots import complete, interleave, metrics, serving, solo
from tests.test_slots import Events, run, serve, tokens

ARCHS = ("llama", "qwen3")
S = 128


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Varied greedy output (embed std 0.05, branches x4, as the drafter needs), two shards so
    slots carry state across shard boundaries, and room for multi-turn conversations."""
    return build_family(tmp_path_factory.mktemp("arch-stack"), ARCHS,
                        BuildRequest(topology="2,1", max_seq=S), seed=13)


@pytest.mark.parametrize("arch", ARCHS)
def test_slot_api_spills_restores_copies_prefixes_and_saves(builds: dict[str, Path], arch: str,
                                                             tmp_path: Path) -> None:
    pipeline = open_pipeline(builds[arch], "mil", "fp32")[1]
    events = Events()
    manager = SlotManager(pipeline, 1, 10**9, events)
    session = DecodeSession(pipeline)
    a, b = tokens(10, 30), tokens(11, 30)
    sa, _ = serve(manager, session, a)
    kv_a = list(sa.tokens)
    serve(manager, session, b)  # one slot: a is spilled
    a2 = [*kv_a, *tokens(12, 5)]
    slot, r = serve(manager, session, a2)
    assert events == ["miss", "miss", "spill", "hit", "spill", "restore"]
    assert r.stats.reused_prefix_tokens == len(kv_a)
    assert r.tokens == run(DecodeSession(pipeline), a2, 6)

    events = Events()
    manager = SlotManager(pipeline, 2, 10**9, events)
    system = tokens(20, 2 * MIN_SHARED)
    long, short = [*system, *tokens(21, 70)], [*system, *tokens(22, 10)]
    owner, _ = serve(manager, session, long)
    held = list(owner.tokens)
    other, rs = serve(manager, session, short)
    assert other is not owner and events == ["miss", "miss", "copy"] and owner.tokens == held
    assert rs.stats.reused_prefix_tokens == len(system)
    assert rs.tokens == run(DecodeSession(pipeline), short, 6)

    layout = StateLayout(pipeline)
    path = tmp_path / "conv.slot"
    save_slot(path, layout, list(owner.tokens), layout.capture(owner.state, len(owner.tokens)))
    loaded = load_slot(path, layout)
    assert loaded.tokens == held
    for want, got in zip(layout.capture(owner.state, len(held)), loaded.arrays):
        assert np.array_equal(want, got)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_daemon_spills_restores_and_drafts_across_requests(builds: dict[str, Path],
                                                               arch: str) -> None:
    pipeline = open_pipeline(builds[arch], "mil", "fp32")[1]
    srv = serving(builds[arch], kv_slots=1, draft_memory="shared")
    try:
        shares = interleave(srv, pipeline, conversations=2, turns=2)
        m = metrics(srv)
        # The same request again: the text is unchanged, and the drafter, remembering the
        # first reply, needs fewer passes.
        prompt = tokens(30, 25)
        first, again = (complete(srv, prompt, 24) for _ in range(2))
    finally:
        srv.stop()
    assert all(s[0] == 0 and s[1] >= 0.8 for s in shares), shares
    assert m["ane_spec_slot_restores_total"] == 2 and m["ane_spec_slot_spills_total"] == 3
    text = solo(pipeline, prompt, 24).text
    assert first["choices"][0]["text"] == again["choices"][0]["text"] == text
    tpp = [body["ane_spec"]["stats"]["tokens_per_pass"] for body in (first, again)]
    assert tpp[1] > tpp[0], tpp


@pytest.mark.parametrize("arch", ARCHS)
def test_doctor_checks_the_build(builds: dict[str, Path], arch: str, capsys) -> None:
    assert main(["doctor", "--manifest", str(builds[arch]), "--json"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    for name in ("fp16-only", "ane-lint", "row-invariance", "overflow", "block", "drift",
                 "parity", "kv-slots"):
        assert checks[name]["status"] == "passed", checks[name]
    assert checks["fp16-only"]["summary"].startswith("3 package(s)")  # 2 shards + head


@pytest.mark.parametrize("arch", ARCHS)
def test_sweep_is_exact(builds: dict[str, Path], arch: str, capsys, tmp_path: Path) -> None:
    assert main(["sweep", "--manifest", str(builds[arch]), "--lengths", "30,60", "--reps", "1",
                 "--new-tokens", "16", "--out", str(tmp_path), "--backend", "mil"]) == 0
    assert "| 30 tokens |" in capsys.readouterr().out
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert [r["prompt_tokens"] for r in rows] == [30, 60] and all(r["exact"] for r in rows)
