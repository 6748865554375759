"""Every GGUF tensor type gguf-py can dequantize, read row-chunked through the project's reader,
and the errors a hostile block-typed file gets.

The reference is always `gguf.quants.dequantize` over the whole tensor: the reader must agree
with it exactly, whichever rows it is asked for and however it chunks them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants

from ane_spec.errors import GGUFError
from ane_spec.model.gguf_file import SUPPORTED_TYPES, _map_tensors
from ane_spec.model.gguf_format import read_gguf
from ane_spec.model.quant import FLOAT_TYPES
from ane_spec.shards.weights import convert_matrix
from tests.gguf_edit import gguf_layout, set_field

T = GGMLQuantizationType
# Types gguf-py can write from floats; the others are raw random blocks.
QUANTIZABLE = {t for t, c in gguf_quants._type_traits.items() if "quantize_blocks" in c.__dict__}
BLOCK_TYPES = sorted((t for t in SUPPORTED_TYPES if t not in FLOAT_TYPES), key=lambda t: t.value)
ROWS = 37  # odd, so chunks of 5 or 16 rows end mid-way


def random_blocks(qtype: GGMLQuantizationType, rows: int, row: int,
                  rng: np.random.Generator) -> np.ndarray:
    """Random bytes with bit 6 of every byte clear: every fp16 (and bf16) scale field then has an
    exponent below all-ones (finite, |d| < 2), and every E8M0 scale is finite too, whatever the
    type's layout. The other fields stay random, which is all dequantization cares about."""
    block, size = GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 256, (rows, row // block * size), dtype=np.uint8) & np.uint8(0xBF)


def make_raw(qtype: GGMLQuantizationType, rows: int, row: int, rng: np.random.Generator
             ) -> np.ndarray:
    if qtype in QUANTIZABLE:
        return gguf_quants.quantize(rng.standard_normal((rows, row)).astype(np.float32), qtype)
    return random_blocks(qtype, rows, row, rng)


@pytest.fixture(scope="module")
def every_type(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """One GGUF holding a [ROWS, 512] tensor of every supported type (512: a whole number of
    blocks of every type, 256-wide K-quant super-blocks included)."""
    rng = np.random.default_rng(27)
    path = tmp_path_factory.mktemp("types") / "types.gguf"
    w = GGUFWriter(path, "llama")
    expected: dict[str, np.ndarray] = {}
    for qtype in SUPPORTED_TYPES:
        values = rng.standard_normal((ROWS, 512)).astype(np.float32)
        if qtype == T.F32:
            raw = values
        elif qtype == T.F16:
            raw = values.astype(np.float16)
        else:
            raw = make_raw(qtype, ROWS, 512, rng)
        w.add_tensor(qtype.name, raw, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
        expected[qtype.name] = gguf_quants.dequantize(raw, qtype).reshape(ROWS, 512)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, expected


def test_the_reader_covers_gguf_quants() -> None:
    names = {t.name for t in SUPPORTED_TYPES}
    assert {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
            "IQ4_NL", "IQ4_XS", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
            "IQ3_S", "TQ1_0", "TQ2_0", "MXFP4", "BF16", "F16", "F32"} <= names
    assert names == {t.name for t in gguf_quants._type_traits} | {"F32", "F16"}


def test_rows_and_chunks_equal_whole_tensor_dequantize(every_type) -> None:
    path, expected = every_type
    contents = read_gguf(str(path), path.name)
    tensors = _map_tensors(contents, path.name)
    assert set(tensors) == set(expected)
    for name, ref in expected.items():
        t = tensors[name]
        assert t.type_name == name and t.shape == (ROWS, 512)
        assert np.isfinite(ref).all(), name
        np.testing.assert_array_equal(t.dequantize(), ref, err_msg=name)
        np.testing.assert_array_equal(t.rows([36, 0, 17, 17]), ref[[36, 0, 17, 17]],
                                      err_msg=name)
        for step in (5, 16, ROWS):
            chunks = list(t.row_chunks(step))
            assert [r0 for r0, _ in chunks] == list(range(0, ROWS, step))
            np.testing.assert_array_equal(np.concatenate([c for _, c in chunks]), ref,
                                          err_msg=f"{name} in chunks of {step}")


def _write_one(path: Path, raw: np.ndarray, qtype: GGMLQuantizationType) -> Path:
    w = GGUFWriter(path, "llama")
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K])
@pytest.mark.parametrize("fmt", ["fp16", "int8-channel"])
def test_read_ahead_stores_every_chunk_of_a_k_quant_tensor(tmp_path: Path, monkeypatch,
                                                           qtype: GGMLQuantizationType,
                                                           fmt: str) -> None:
    """A K-quant tensor is converted a chunk at a time, the next chunk dequantized on a helper
    thread meanwhile (shards/weights.py `_read_ahead`). Chunks are forced to 8 of the 48 rows,
    all the same size, so a chunk dequantized twice (or skipped) has the right shape and only
    the stored values can tell: they must be the tensor's own rows, each chunk asked for once.
    The conversion's cosine gate cannot tell: it compares the stored values with the same,
    wrong, input."""
    rows = 48
    raw = make_raw(qtype, rows, 512, np.random.default_rng(36))
    path = _write_one(tmp_path / "k.gguf", raw, qtype)
    t = _map_tensors(read_gguf(str(path), path.name), path.name)["blk.0.attn_q.weight"]
    want = gguf_quants.dequantize(raw, qtype).reshape(rows, 512)
    assert np.isfinite(want).all() and t.type_name == qtype.name
    tensor_type = type(t)
    asked: list[list[int]] = []
    dequantize = tensor_type.rows

    def rows_of(self, index, dtype=np.float32):  # noqa: ANN001, ANN202
        asked.append([int(i) for i in index])
        return dequantize(self, index, dtype)

    monkeypatch.setattr(tensor_type, "rows_per_chunk", lambda self, budget_elements=0: 8)
    monkeypatch.setattr(tensor_type, "rows", rows_of)
    w = convert_matrix(t, fmt)
    data = w.data[:, :, 0, 0].astype(np.float32)
    if fmt == "fp16":
        np.testing.assert_array_equal(data, want.astype(np.float16).astype(np.float32))
    else:  # each row's int8 values times its scale: within half a step of the row
        scale = w.scale[:, :, 0, 0].astype(np.float32)
        assert (np.abs(data * scale - want) <= 0.5 * scale * (1 + 1e-3) + 1e-6).all()
    assert sorted(asked) == [list(range(r, r + 8)) for r in range(0, rows, 8)]
    assert w.cosine > 0.999


def _bad_row_file(tmp_path: Path) -> Path:
    """4 rows of one 144-byte Q4_K block, the row length in the directory rewritten to 192."""
    p = _write_one(tmp_path / "q4k.gguf", np.zeros((4, 144), np.uint8), T.Q4_K)
    data = p.read_bytes()
    row_dim = next(f for f in gguf_layout(data).fields if f.kind == "dim")  # innermost first
    bad = tmp_path / "bad_row.gguf"
    bad.write_bytes(set_field(data, row_dim, 192))
    return bad


def test_row_length_not_a_whole_number_of_blocks(tmp_path: Path) -> None:
    """A Q4_K tensor whose rows are 192 values (K-quant blocks are 256): one clear error."""
    p = _bad_row_file(tmp_path)
    with pytest.raises(GGUFError, match=r"rows of 192 are not a multiple of the Q4_K block "
                                        r"size 256"):
        read_gguf(str(p), p.name)


def test_truncated_k_quant_data(tmp_path: Path) -> None:
    raw = random_blocks(T.Q6_K, 64, 512, np.random.default_rng(0))
    p = _write_one(tmp_path / "whole.gguf", raw, T.Q6_K)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(p.read_bytes()[:-1000])
    with pytest.raises(GGUFError, match="file is truncated: tensor 'blk.0.attn_q.weight' ends"):
        read_gguf(str(cut), cut.name)


def test_hostile_file_is_one_line_from_the_cli(tmp_path: Path) -> None:
    """The CLI prints one line, no traceback, for the bad row length."""
    p = _bad_row_file(tmp_path)
    run = subprocess.run([sys.executable, "-m", "ane_spec.cli", "inspect", str(p)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if "libcoremlpython" not in line
             and "Torch version" not in line]
    assert len(lines) == 1 and "not a multiple of the Q4_K block size 256" in lines[0], lines
    assert "Traceback" not in run.stderr
