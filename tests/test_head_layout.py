"""`--head-layout vocab-last` (issue 35 item 1, a variant `ane-spec tune` measures): the LM
head emits each chunk's logits as [1, T, V_i], as Anemll's heads do, instead of the hidden
layout's [1, V_i, T, 1].

What must hold: the head's logits are today's bit for bit (a squeeze and a transpose move values,
they compute nothing), in either hidden layout and in a head split into packages; every reader of
a head (the pipeline, the Core ML worker's kept rows, the overflow probe) reads the new shape;
fp16 speculative == greedy on such a build; an argmax head refuses the layout; the manifest
records it and older manifests read as channels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ane_spec.cli import main
from ane_spec.errors import BuildError
from ane_spec.manifests.inspect_build import describe_build, format_build
from ane_spec.manifests.store import load_manifest
from ane_spec.probes.gates import open_pipeline
from ane_spec.probes.overflow import run_overflow
from ane_spec.probes.row_invariance import run_row_invariance
from ane_spec.runtime.hidden_layout import head_token_major
from ane_spec.shards.build import BuildRequest, build
from tests.kv_slice_checks import assert_speculative_is_greedy_and_scatters, side_by_side

S = 64


@pytest.fixture(scope="module")
def builds(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`tiny_gguf` with today's head and with a vocab-last one (the latter through the command
    line), both layouts; the BC1T pair's head split over two packages."""
    root = tmp_path_factory.mktemp("head-layout")
    out = {}
    for layout in ("BCT1", "BC1T"):
        split = {"max_head_mb": 0.1, "head_chunks": 4} if layout == "BC1T" else {}
        out[f"channels-{layout}"] = root / f"channels-{layout}"
        build(tiny_gguf, out[f"channels-{layout}"],
              BuildRequest(topology="3", max_seq=S, layout=layout, prefill_t=16, **split))
        out[f"vocab-last-{layout}"] = root / f"vocab-last-{layout}"
        args = ["build", str(tiny_gguf), "--out", str(out[f"vocab-last-{layout}"]),
                "--topology", "3", "--max-seq", str(S), "--layout", layout,
                "--prefill-t", "16", "--head-layout", "vocab-last"]
        if split:
            args += ["--max-head-mb", "0.1", "--head-chunks", "4"]
        assert main(args) == 0
    return out


def test_the_manifest_records_the_head_layout_and_the_head_outputs_vocab_last(
        builds: dict) -> None:
    for layout in ("BCT1", "BC1T"):
        old = load_manifest(builds[f"channels-{layout}"]).manifest
        new = load_manifest(builds[f"vocab-last-{layout}"]).manifest
        assert old.build.head_layout == "channels" and new.build.head_layout == "vocab-last"
        # The layer packages are the same packages: only the head's fingerprint changed.
        assert [s.fingerprint for s in old.shards] == [s.fingerprint for s in new.shards]
        assert {h.fingerprint for h in old.heads}.isdisjoint(h.fingerprint for h in new.heads)
        for h_old, h_new in zip(old.heads, new.heads):
            for a, b in zip(h_old.outputs, h_new.outputs):
                assert a.name == b.name
                # [1, V_i, T, 1] / [1, V_i, 1, T] -> [1, T, V_i] (T the RangeDim)
                v = a.shape[1]
                assert b.shape[0] == 1 and b.shape[-1] == v and len(b.shape) == 3
    assert len(load_manifest(builds["vocab-last-BC1T"]).manifest.heads) > 1  # a split head
    assert "head layout vocab-last" in format_build(describe_build(builds["vocab-last-BCT1"]))
    assert "head layout channels" in format_build(describe_build(builds["channels-BCT1"]))


def test_logits_are_todays_bit_for_bit_in_the_interpreter(builds: dict) -> None:
    """Same hidden rows into both heads (fp16 interpreter, and fp32): every chunk's [T, V_i]
    equal bitwise; and whole passes through the pipeline give equal rows."""
    rng = np.random.default_rng(3)
    for layout in ("BCT1", "BC1T"):
        for precision in ("fp16", "fp32"):
            old = open_pipeline(builds[f"channels-{layout}"], "mil", precision)[1]
            new = open_pipeline(builds[f"vocab-last-{layout}"], "mil", precision)[1]
            for t in (1, 4):
                x = old.to_hidden(rng.standard_normal((t, old.config.hidden_size)))
                a, b = old.head.predict({"x": x}), new.head.predict({"x": x})
                assert sorted(a) == sorted(b)
                for name in a:
                    assert b[name].shape == (1, t, a[name].shape[1]), name
                    assert np.array_equal(head_token_major(a[name], layout, "channels"),
                                          head_token_major(b[name], layout, "vocab-last"))
            prompt = rng.integers(0, 1024, 11).tolist()
            states = [old.new_state(), new.new_state()]
            for start in range(0, len(prompt), 4):
                ra, rb = (p.run(prompt[start:start + 4], start, st)
                          for p, st in zip((old, new), states))
                for r in range(ra.rows):
                    assert np.array_equal(ra.row_native(r), rb.row_native(r)), (layout, start)
            pa = old.run_prefill(prompt, 0, old.new_state(), head=True)
            pb = new.run_prefill(prompt, 0, new.new_state(), head=True)
            assert np.array_equal(pa.row_native(0), pb.row_native(0))


def test_probes_pass_and_speculative_equals_greedy_on_a_vocab_last_build(builds: dict) -> None:
    new = open_pipeline(builds["vocab-last-BCT1"], "mil", "fp16")[1]
    rows, overflow = run_row_invariance(new), run_overflow(new)
    print(rows.summary(), "|", overflow.summary())
    assert rows.passed and overflow.passed
    pipes = {"slice": new, "scatter": open_pipeline(builds["channels-BCT1"], "mil", "fp16")[1]}
    # The helper's names: "slice" is the build under test, "scatter" the one it must equal.
    assert_speculative_is_greedy_and_scatters(pipes, vocab=1024, longest=20)


def test_the_core_ml_path_reads_a_vocab_last_head(builds: dict, coreml_standin) -> None:
    """Through CoreMLBackend, its worker (which keeps the head's outputs and reads rows there:
    `HeadRows`) and the stand-in: the interpreter's logits."""
    coreml = open_pipeline(builds["vocab-last-BCT1"], "coreml", "fp32")[1]
    mil = open_pipeline(builds["channels-BCT1"], "mil", "fp16")[1]
    prompt = np.random.default_rng(8).integers(0, 1024, 9).tolist()
    for start, a, b in side_by_side(coreml, mil, prompt):
        for r in range(a.rows):
            assert np.array_equal(a.row_logits(r), b.row_logits(r)), start
            assert a.row_argmax(r) == int(np.argmax(b.row_logits(r)))


def test_an_argmax_head_refuses_the_vocab_last_layout(tiny_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="--head-layout vocab-last needs a logits head"):
        build(tiny_gguf, tmp_path / "x", BuildRequest(topology="3", max_seq=S, head_argmax=True,
                                                      head_layout="vocab-last"))
    assert not (tmp_path / "x").exists()
