"""`--kv-write slice` (issue 35 item 2): the layers write K/V through a window as wide as the
pass (slice_update at a host-given slot) instead of rewriting every slot.

What must hold: the state after every pass is the scatter build's, value for value, so every
logit is too; the block, overflow and row-invariance probes pass; fp16 speculative decoding
equals greedy; the host places the window over the slots a pass writes, also at the end of the
context, and refuses what one window cannot hold; the interpreter's slice_update refuses a slice
outside the tensor instead of clipping it; the Core ML path feeds the int32 window start as
int32. Rings (a block that wraps: two windows) are in test_kv_slice_ring.py; the real catalog
models in scripts/kv_slice_real.py (too slow for the suite).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ane_spec.cli import main
from ane_spec.errors import AneSpecError, ManifestError
from ane_spec.manifests import schema
from ane_spec.manifests.store import load_manifest, parse_manifest
from ane_spec.manifests.inspect_build import describe_build, format_build
from ane_spec.model.synthetic import preset
from ane_spec.probes.gates import open_pipeline
from ane_spec.runtime.host_inputs import HostInputs, window_start
from ane_spec.runtime.pipeline import ShardPipeline
from ane_spec.shards import programs
from ane_spec.shards.build import BuildRequest, build
from ane_spec.shards.kv_traffic import kv_traffic
from ane_spec.shards.static_checks import PackageFacts, dtype_problems, read_package_facts
from tests.kv_slice_checks import (
    assert_probes_pass,
    assert_same_run,
    assert_speculative_is_greedy_and_scatters,
    pipelines,
    side_by_side,
)

S = 64
PREFILL_T = 16  # narrower than S, so the prefill function's window is a window


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`tiny_gguf` (varied greedy output) built both ways; slice through the command line."""
    root = tmp_path_factory.mktemp("kv-slice")
    build(tiny_gguf, root / "scatter", BuildRequest(topology="2,1", max_seq=S,
                                                    prefill_t=PREFILL_T))
    assert main(["build", str(tiny_gguf), "--out", str(root / "slice"), "--topology", "2,1",
                 "--max-seq", str(S), "--prefill-t", str(PREFILL_T),
                 "--kv-write", "slice"]) == 0
    return {"scatter": root / "scatter", "slice": root / "slice"}


@pytest.fixture(scope="module")
def tiny_fp16(tiny: dict) -> dict[str, ShardPipeline]:
    return pipelines(tiny)


def _host(folder: Path) -> HostInputs:
    """A build's host inputs as its pipeline makes them, without loading its programs."""
    m = load_manifest(folder, verify=False).manifest
    return HostInputs(m.rope, m.build.max_seq, m.build.t_range[1], prefill_t=m.build.prefill_t,
                      kv_write=m.build.kv_write)


# --- the programs and the manifest ----------------------------------------------------------


def test_slice_programs_take_an_int32_window_start_and_write_windows(tiny: dict) -> None:
    m = load_manifest(tiny["slice"]).manifest
    assert m.build.kv_write == "slice" and load_manifest(tiny["scatter"]).manifest.build.kv_write \
        == "scatter"
    assert "K/V write slice" in format_build(describe_build(tiny["slice"]))  # `inspect FOLDER`
    for shard in m.shards:
        inputs = {i.name: (i.shape, i.dtype) for i in shard.inputs}
        # The start has the token axis: a fixed-shape input beside RangeDim ones in a stateful
        # program crashes Core ML (coremltools #2548).
        assert inputs["kv_write_start"] == (["T", 1], "int32")
        assert inputs["kv_write_mask"] == ([1, 1, 4, "T"], "fp16")
        path = tiny["slice"] / shard.file.path
        layers = shard.layers[1] - shard.layers[0]
        main_fn, prefill = read_package_facts(path), read_package_facts(path, "prefill")
        for facts in (main_fn, prefill):
            assert facts.ops["slice_update"] == facts.ops["slice_by_size"] == 2 * layers
            assert facts.io_dtypes["kv_write_start"] == "int32"
        assert main_fn.inputs["kv_write_start"][1] == [(1, 4), (1, 1)]
        assert prefill.inputs["kv_write_mask"][0] == [1, 1, PREFILL_T, PREFILL_T]
    for shard in load_manifest(tiny["scatter"]).manifest.shards:
        ops = read_package_facts(tiny["scatter"] / shard.file.path).ops
        assert not ops["slice_update"] and "kv_write_start" not in {i.name for i in shard.inputs}


def test_the_runtime_and_the_compiler_name_the_start_input_alike() -> None:
    assert schema.KV_WRITE_START == programs.KV_WRITE_START


def test_only_the_window_start_may_be_an_int32_input() -> None:
    facts = PackageFacts(inputs={"kv_write_start": ([4, 1], []), "x": ([4], [])}, outputs=[],
                         states={}, io_dtypes={"kv_write_start": "int32", "x": "int32"})
    assert dtype_problems(facts) == ["model input 'x' is int32; only 'kv_write_start' may be"]


def test_a_manifest_naming_the_other_form_is_refused(tiny: dict) -> None:
    where = Path("manifest.json")
    for form, other in (("scatter", "slice"), ("slice", "scatter")):
        doc = json.loads((tiny[form] / "manifest.json").read_text())
        assert parse_manifest(json.dumps(doc), where).build.kv_write == form
        doc["build"]["kv_write"] = other
        with pytest.raises(ManifestError, match=f"build.kv_write is {other}"):
            parse_manifest(json.dumps(doc), where)
    # A manifest from before the option: scatter.
    doc = json.loads((tiny["scatter"] / "manifest.json").read_text())
    del doc["build"]["kv_write"]
    assert parse_manifest(json.dumps(doc), where).build.kv_write == "scatter"


def test_the_slice_form_changes_the_shards_fingerprints_only(tiny_gguf: Path,
                                                             tiny: dict, tmp_path: Path) -> None:
    """Rebuilding a scatter build as slice rebuilds every shard and reuses the head. (A scatter
    build's fingerprint has no kv_write key at all, only a slice build's has, so builds from
    before the option keep theirs and are still reused.)"""
    out = tmp_path / "art"
    shutil.copytree(tiny["scatter"], out)
    r = build(tiny_gguf, out, BuildRequest(topology="2,1", max_seq=S, prefill_t=PREFILL_T,
                                           kv_write="slice"), force=True)
    assert sorted(r.built) == ["shards/layers_00_02.mlpackage", "shards/layers_02_03.mlpackage"]
    assert r.reused == ["head.mlpackage"]
    assert any(line.startswith("K/V write (slice) per decode pass: 3 KiB read + 3 KiB written "
                               "(scatter: 48 KiB read") for line in r.summary), r.summary


# --- host inputs ----------------------------------------------------------------------------


def test_the_window_covers_the_written_slots_and_stays_inside_the_state() -> None:
    assert window_start(np.array([9, 10, 11]), 4, S) == 9
    assert window_start(np.array([62, 63]), 4, S) == 60  # clamped to the state's last 4 slots
    assert window_start(np.array([], dtype=np.int64), 4, S) == 0
    with pytest.raises(AneSpecError, match="slots 3..7; a slice-write build"):
        window_start(np.array([3, 7]), 4, S)


@pytest.mark.parametrize("case", ["block", "end", "rows", "prefill"])
def test_the_window_one_hot_is_the_scatter_mask_over_the_window(tiny: dict, case: str) -> None:
    """For the same rows, the slice form's [width, T] one-hot is the scatter's [S, T] mask cut to
    the window, and the scatter mask is zero outside it; every other input is the same."""
    hosts = {form: _host(folder) for form, folder in tiny.items()}
    calls = {"block": lambda h: h.block(20, 3, 4), "end": lambda h: h.block(S - 1, 1, 4),
             "rows": lambda h: h.rows([30, 12, 31, 5], [True, False, True, False]),
             "prefill": lambda h: h.block(S - 10, 10, PREFILL_T)}
    scatter, window = calls[case](hosts["scatter"]), calls[case](hosts["slice"])
    start = int(window["kv_write_start"][0, 0])
    assert (window["kv_write_start"] == start).all() and window["kv_write_start"].dtype == np.int32
    width = window["kv_write_mask"].shape[2]
    full = scatter["kv_write_mask"][0, 0]
    assert np.array_equal(full[start:start + width], window["kv_write_mask"][0, 0])
    assert not full[:start].any() and not full[start + width:].any()
    assert 0 <= start <= S - width
    for name in ("rope_cos", "rope_sin", "attn_mask"):
        assert np.array_equal(scatter[name], window[name])


def test_rows_one_window_cannot_hold_are_refused(tiny: dict) -> None:
    host = _host(tiny["slice"])
    with pytest.raises(AneSpecError, match="writes slots 3..9"):
        host.rows([3, 9], [True, True])


# --- the interpreter's ops ------------------------------------------------------------------


def test_slice_update_and_slice_by_size_refuse_slices_outside_the_tensor() -> None:
    from ane_spec.runtime.mil_ops import OPS

    x = np.arange(2 * 8, dtype=np.float16).reshape(1, 2, 8, 1)
    update = -np.ones((1, 2, 4, 1), np.float16)
    masks = {"begin_mask": [True, True, False, True], "end_mask": [True, True, False, True]}
    out = OPS["slice_update"].kernel({"x": x, "update": update, "begin": np.array([0, 0, 3, 0]),
                                      "end": np.array([0, 0, 7, 0]), **masks})
    want = x.copy()
    want[:, :, 3:7] = -1
    assert np.array_equal(out, want) and x[0, 0, 3, 0] == 3  # a copy: x is unchanged
    with pytest.raises(ValueError, match="has shape"):
        OPS["slice_update"].kernel({"x": x, "update": update, "begin": np.array([0, 0, 6, 0]),
                                    "end": np.array([0, 0, 10, 0]), **masks})
    size = np.array([1, 2, 4, 1])
    assert np.array_equal(OPS["slice_by_size"].kernel(
        {"x": x, "begin": np.array([0, 0, 4, 0]), "size": size}), x[:, :, 4:8])
    with pytest.raises(ValueError, match="outside"):
        OPS["slice_by_size"].kernel({"x": x, "begin": np.array([0, 0, 5, 0]), "size": size})


# --- exactness ------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_slice_and_scatter_builds_compute_the_same_bits(tiny: dict, tiny_fp16: dict,
                                                        precision: str) -> None:
    """Decode passes of 3 real rows (the window is never aligned with the blocks of 4) up to
    the context's last slot (where the window is clamped to S - 4), then prefill chunks of 16
    from slot 18, the last (50..62) clamped to S - 16."""
    pipes = tiny_fp16 if precision == "fp16" else pipelines(tiny, precision)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 1024, S).tolist()
    assert assert_same_run(pipes, prompt, 3) == S
    assert assert_same_run(pipes, prompt[:S - 1], 2, prefill_at=17) == 18 + 3


def test_the_probes_pass_on_a_slice_build(tiny_fp16: dict) -> None:
    assert_probes_pass(tiny_fp16["slice"])


def test_fp16_speculative_equals_greedy_on_a_slice_build(tiny_fp16: dict) -> None:
    assert_speculative_is_greedy_and_scatters(tiny_fp16, vocab=1024, longest=20)


# --- Core ML path -----------------------------------------------------------------------------


def test_the_core_ml_path_feeds_the_start_as_int32(tiny: dict, tiny_fp16: dict,
                                                   coreml_standin) -> None:
    """Through CoreMLBackend, its worker process and the stand-in (which computes with the
    interpreter in fp16): the same logits as the interpreter. The start must reach the program
    as int32: fed as a float (what the feeds made of every input before), the program refuses
    it."""
    coreml = open_pipeline(tiny["slice"], "coreml", "fp32")[1]
    mil = tiny_fp16["slice"]
    prompt = np.random.default_rng(8).integers(0, 1024, 20).tolist()
    for start, a, b in side_by_side(coreml, mil, prompt):
        for r in range(a.rows):
            assert np.array_equal(a.row_logits(r), b.row_logits(r)), start


# --- traffic --------------------------------------------------------------------------------


def test_state_traffic_per_pass_on_phi4_minis_shapes() -> None:
    """The issue's figure: 2 x 32 x 8 x 2048 x 128 x 2 bytes each way for the scatter, T rows
    (the window: 4) for the slice; attention reads the whole state in both."""
    c = preset("phi4-mini").to_config()
    scatter, window = kv_traffic(c, 2048, "scatter", 4), kv_traffic(c, 2048, "slice", 4)
    assert scatter.write_read == scatter.write_written == 2 * 32 * 8 * 2048 * 128 * 2
    assert window.write_read == window.write_written == 2 * 32 * 8 * 4 * 128 * 2
    assert window.attention_read == scatter.attention_read == scatter.write_read
    assert kv_traffic(c, 8192, "scatter", 4).write_total == 4 * scatter.write_total
    g = preset("gemma3-tiny").to_config()  # 3 local layers of 32 slots, 1 global of 64
    assert kv_traffic(g, 64, "slice", 4, ring=32).write_read == 2 * 64 * 2 * (3 * 8 + 4)
