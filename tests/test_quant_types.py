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
