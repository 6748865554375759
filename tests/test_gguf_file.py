"""GGUF reading: config, zero-copy Q8_0 views, dequantization, and every error path."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from ane_spec.errors import GGUFError
from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.gguf_format import _Cursor
from ane_spec.model.quant import q8_0_quantize
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from tests.gguf_edit import rewrite_gguf


def test_config_matches_the_preset(tiny_gguf: Path) -> None:
    m = open_gguf(tiny_gguf)
    c = m.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (192, 3, 6, 2)
    assert (c.head_dim, c.rope_dims, c.ffn_size, c.vocab_size) == (32, 24, 512, 1024)
    assert c.context_length == 131072 and c.original_context_length == 4096
    # sqrt(1 + ln(131072/4096)/ln(4096)), stored as f32
    assert c.rope_attn_factor == pytest.approx(1.1902381, abs=1e-6)
    assert c.tied_embeddings and m.lm_head.name == "token_embd.weight"
    assert m.metadata["general.architecture"] == "phi3"
    assert m.file_type == "Q8_0"


@pytest.mark.parametrize("code,name", [(7, "Q8_0"), (15, "Q4_K_M"), (1, "F16"), (0, "F32"),
                                       (None, "Q8_0"), (999, "Q8_0")])
def test_file_type_name(tiny_gguf: Path, tmp_path: Path, code: int | None, name: str) -> None:
    """`general.file_type` as llama.cpp names it; without the key, or with a code gguf-py does
    not know, the attention matrices' stored type."""
    path = rewrite_gguf(tiny_gguf, tmp_path / "m.gguf", drop_keys=("general.file_type",),
                        set_keys={} if code is None else {
                            "general.file_type": (code, GGUFValueType.UINT32)})
    assert open_gguf(path).file_type_name == name


def test_q8_0_views_are_zero_copy_and_dequantize_like_gguf_py(tiny_gguf: Path) -> None:
    m = open_gguf(tiny_gguf)
    t = m.tensor("blk.1.attn_qkv.weight")
    qs, d = t.q8_0()
    assert qs.dtype == np.int8 and qs.shape == (320, 192 // 32, 32)
    assert d.dtype == np.float16 and d.shape == (320, 192 // 32)
    assert np.shares_memory(qs, m.buffer) and np.shares_memory(d, m.buffer)
    expected = gguf_dequantize(np.asarray(t.raw), GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(t.dequantize(), expected)
    rows = t.rows([0, 5, 319])
    np.testing.assert_array_equal(rows, expected[[0, 5, 319]])


def test_q8_0_quantizer_matches_gguf_py() -> None:
    x = np.random.default_rng(0).standard_normal((17, 96)).astype(np.float32)
    x[3, :32] = 0.0  # an all-zero block must not divide by zero
    np.testing.assert_array_equal(q8_0_quantize(x), gguf_quantize(x, GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("weights", ["f16", "bf16"])
def test_float_weight_files(tmp_path: Path, weights: str) -> None:
    path = write_synthetic_gguf(tmp_path / f"{weights}.gguf",
                                preset("tiny", num_layers=1, weight_type=weights))
    m = open_gguf(path)
    t = m.tensor("blk.0.ffn_down.weight")
    assert t.type_name == weights.upper()
    w = t.dequantize()
    assert w.shape == (192, 512) and w.dtype == np.float32
    qtype = GGMLQuantizationType.F16 if weights == "f16" else GGMLQuantizationType.BF16
    np.testing.assert_array_equal(w, gguf_dequantize(np.asarray(t.raw), qtype).reshape(w.shape))
    np.testing.assert_array_equal(t.rows([2, 7]), w[[2, 7]])
    with pytest.raises(GGUFError, match="not Q8_0"):
        t.q8_0()


# --- error paths: each names the problem ------------------------------------------------------

def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="no such file"):
        open_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip, not a gguf" * 10)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        open_gguf(p)


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_file(tiny_gguf: Path, tmp_path: Path, keep: float) -> None:
    data = tiny_gguf.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GGUFError, match="truncated"):
        open_gguf(p)


def test_truncated_in_header(tiny_gguf: Path, tmp_path: Path) -> None:
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny_gguf.read_bytes()[:2000])
    with pytest.raises(GGUFError, match="truncated|unreadable"):
        open_gguf(p)


def test_wrong_architecture(tiny_gguf: Path, tmp_path: Path) -> None:
    p = rewrite_gguf(tiny_gguf, tmp_path / "gemma2.gguf", arch="gemma2")
    with pytest.raises(GGUFError, match="architecture 'gemma2' is not supported; supported: "
                                        "phi3, llama, qwen2, qwen3"):
        open_gguf(p)
    # A phi3 file relabelled as a supported architecture fails on that architecture's keys.
    p = rewrite_gguf(tiny_gguf, tmp_path / "llama.gguf", arch="llama")
    with pytest.raises(GGUFError, match="missing required key 'llama.embedding_length'"):
        open_gguf(p)


def test_unsupported_tensor_type(tiny_gguf: Path, tmp_path: Path) -> None:
    """Q8_1 is a ggml type (llama.cpp's activation format) that gguf-py cannot dequantize: it is
    refused at open, naming the tensor and the type."""
    def to_q8_1(name: str, data: np.ndarray, qtype: GGMLQuantizationType):
        if name == "blk.0.ffn_up.weight":
            rows = gguf_dequantize(data, qtype).shape[0]
            return np.zeros((rows, 192 // 32 * 40), np.uint8), GGMLQuantizationType.Q8_1
        return None

    p = rewrite_gguf(tiny_gguf, tmp_path / "q8_1.gguf", tensor_override=to_q8_1)
    with pytest.raises(GGUFError, match=r"blk\.0\.ffn_up\.weight' has type Q8_1, which gguf-py "
                                        "cannot dequantize"):
        open_gguf(p)


def test_missing_tensor(tiny_gguf: Path, tmp_path: Path) -> None:
    p = rewrite_gguf(tiny_gguf, tmp_path / "m.gguf", drop_tensors=("blk.2.ffn_down.weight",))
    with pytest.raises(GGUFError, match=r"missing tensor 'blk\.2\.ffn_down\.weight'"):
        open_gguf(p)


def test_misshaped_tensor(tiny_gguf: Path, tmp_path: Path) -> None:
    def shrink(name: str, data: np.ndarray, qtype: GGMLQuantizationType):
        return (data[:-1], qtype) if name == "blk.1.attn_output.weight" else None

    p = rewrite_gguf(tiny_gguf, tmp_path / "s.gguf", tensor_override=shrink)
    with pytest.raises(GGUFError, match=r"attn_output\.weight' has shape \(191, 192\), expected "
                                        r"\(192, 192\)"):
        open_gguf(p)


def test_missing_metadata_key(tiny_gguf: Path, tmp_path: Path) -> None:
    p = rewrite_gguf(tiny_gguf, tmp_path / "k.gguf", drop_keys=("phi3.block_count",))
    with pytest.raises(GGUFError, match="missing required key 'phi3.block_count'"):
        open_gguf(p)


def test_inconsistent_heads(tiny_gguf: Path, tmp_path: Path) -> None:
    p = rewrite_gguf(tiny_gguf, tmp_path / "h.gguf",
                     set_keys={"phi3.attention.head_count_kv": (4, GGUFValueType.UINT32)})
    with pytest.raises(GGUFError, match="not a multiple of num_kv_heads"):
        open_gguf(p)


def test_separate_output_head(tmp_path: Path) -> None:
    path = write_synthetic_gguf(tmp_path / "untied.gguf",
                                preset("tiny", num_layers=1, tied_embeddings=False))
    m = open_gguf(path)
    assert not m.config.tied_embeddings and m.lm_head.name == "output.weight"


HASH_PEAK = """
import blake3, json, sys
from ane_spec.model.gguf_file import open_gguf
from ane_spec.peak_memory import peak_rss_bytes
m = open_gguf(sys.argv[1])
before = peak_rss_bytes()
whole, per_tensor = m.content_hashes()
rise = peak_rss_bytes() - before
with open(sys.argv[1], "rb") as fh:
    assert whole == blake3.blake3(fh.read()).hexdigest()
print(json.dumps({"rise_mb": rise / 2**20,
                  "table_mb": m.tensor("token_embd.weight").nbytes / 2**20}))
"""


def test_hashing_gives_back_the_file_pages_as_it_goes(tmp_path: Path) -> None:
    """content_hashes gives back each 64 MB block's pages once hashed, not each tensor's: a
    build hashes while it holds a shard of converted weights, and a whole embedding table
    mapped at once (653 MB on Phi-4-mini) took its peak from 2.8 to 3.4 GB. Here a 213 MB
    table may raise this process's peak by a block and change, not by itself."""
    import json
    import subprocess
    import sys

    spec = preset("tiny", hidden_size=1024, num_heads=8, num_kv_heads=2, num_layers=1,
                  vocab_size=200_000, rope_dims=96)
    path = write_synthetic_gguf(tmp_path / "wide.gguf", spec)
    out = subprocess.run([sys.executable, "-c", HASH_PEAK, str(path)], check=True,
                         capture_output=True, text=True)
    report = json.loads(out.stdout)
    print(report)
    assert report["table_mb"] > 200
    assert report["rise_mb"] < 110, report


def test_content_hashes_identify_the_file_and_each_tensor(tiny_gguf: Path, tmp_path: Path
                                                          ) -> None:
    """The file's digest is its BLAKE3 (what `b3sum` prints); each tensor's is XXH3-128 of its
    own bytes (the build's fingerprints), so a change to one tensor moves the file's digest and
    that tensor's, no other."""
    import shutil

    import blake3
    import xxhash

    whole, per_tensor = open_gguf(tiny_gguf).content_hashes()
    assert whole == blake3.blake3(tiny_gguf.read_bytes()).hexdigest()
    model = open_gguf(tiny_gguf)
    data = tiny_gguf.read_bytes()
    for name, t in model.tensors.items():
        assert per_tensor[name] == xxhash.xxh3_128(
            data[t.file_offset:t.file_offset + t.nbytes]).hexdigest()

    edited = tmp_path / "edited.gguf"
    shutil.copy(tiny_gguf, edited)
    t = model.tensors["blk.0.ffn_down.weight"]
    with open(edited, "r+b") as fh:
        fh.seek(t.file_offset + 3)   # inside the first block's int8 values
        byte = fh.read(1)
        fh.seek(t.file_offset + 3)
        fh.write(bytes([byte[0] ^ 1]))
    whole2, per_tensor2 = open_gguf(edited).content_hashes()
    assert whole2 != whole
    assert {n for n in per_tensor if per_tensor[n] != per_tensor2[n]} == {t.name}


def test_string_arrays_read_as_their_strings_one_by_one_do() -> None:
    """A vocabulary array is read in one loop (`_Cursor._strings`); it gives what reading each
    string does, invalid UTF-8 kept as `string` keeps it, and the same error where the file
    ends inside the array."""
    items = [b"plain", "R\u00e9sum\u00e9 \u6771\u4eac".encode(), b"\xff\xfe not utf-8", b""]
    raw = b"".join(struct.pack("<Q", len(s)) + s for s in items) + b"rest"
    one_by_one = _Cursor(raw, "f.gguf")
    assert _Cursor(raw, "f.gguf")._strings(len(items)) == [one_by_one.string() for _ in items]
    for cut in (8 + 2, 5, 8 + 5 + 4):   # inside a string, inside a length, a length cut short
        errors = []
        for read in (lambda c: c._strings(len(items)),
                     lambda c: [c.string() for _ in items]):
            with pytest.raises(GGUFError) as exc:
                read(_Cursor(raw[:cut], "f.gguf"))
            errors.append(str(exc.value))
        assert errors[0] == errors[1] and "truncated" in errors[0]
