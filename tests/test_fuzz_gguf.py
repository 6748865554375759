"""Hostile GGUF files through the real CLI: every case ends in one clear line or a valid result.

A small file with the exact Phi-4-mini layout (1 layer) is corrupted by hypothesis at its
structure: truncated at every boundary, length/count/type/shape/offset fields overwritten with
edge values, bytes flipped, NaN and Inf written into tensor data. Then a list of named cases
reproduces each defect of issue 14 (block_count 2^31, arrays nested 5,000 deep, wrong value
types, 0-dim and overflowing shapes, misaligned offsets, binary in error messages, bad merges).

Every case runs through `ane-spec inspect` (or `build`, for tensor data) in one long-lived worker
(tests/fuzz_worker.py) under RLIMIT_AS = its warmed-up size + LIMIT_MB and a time limit, with
an audit hook reporting any path touched outside the case's folder. Run with `-s` to see counts.
"""

from __future__ import annotations

import itertools
import struct
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ane_spec.model.synthetic import preset, write_synthetic_gguf
from tests.fuzz_worker import Outcome, Worker
from tests.gguf_edit import Field, gguf_layout, insert_kv, rewrite_gguf, set_field

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the memory limit (RLIMIT_AS) is enforced on Linux only")

# Every case reads a 0.66 MB file; 300 MB over the warmed-up worker is "a few hundred MB".
LIMIT_MB = 300
CASE_TIMEOUT = 60.0
TALLY: Counter = Counter()
SLOWEST: list[tuple[float, str]] = []
_case_ids = itertools.count()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_gguf(tmp_path_factory.mktemp("fuzz-gguf") / "base.gguf",
                                preset("tiny", num_layers=1))


@pytest.fixture(scope="module")
def cases_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-gguf-cases")


@pytest.fixture(scope="module")
def worker(base: Path, cases_dir: Path):
    warm = cases_dir / "warm"
    w = Worker(LIMIT_MB, warmup=[["inspect", str(base), "--json"],
                                 ["build", str(base), "--out", str(warm), "--max-seq", "64"]],
               timeout=CASE_TIMEOUT)
    yield w
    w.close()
    print(f"\nGGUF fuzz: {sum(TALLY.values())} cases: " + ", ".join(
        f"{k} {v}" for k, v in sorted(TALLY.items())) + f"; worker starts {w.started}; "
          f"slowest cases: {sorted(SLOWEST, reverse=True)[:3]}")


def run_case(worker: Worker, cases_dir: Path, data: bytes, label: str,
             command: str = "inspect") -> tuple[Outcome, Path]:
    folder = cases_dir / f"c{next(_case_ids)}"
    folder.mkdir()
    path = folder / "case.gguf"
    path.write_bytes(data)
    argv = (["inspect", str(path), "--json"] if command == "inspect" else
            ["build", str(path), "--out", str(folder / "out"), "--max-seq", "64"])
    outcome = worker.run(argv, [folder])
    TALLY[outcome.kind if not outcome.outside else "touched-outside"] += 1
    SLOWEST.append((round(outcome.seconds, 2), label[:80]))
    assert outcome.ok, f"{label}: {outcome}"
    if outcome.kind == "refused":
        line = outcome.detail
        assert len(line) < 1200 and line.isprintable(), f"{label}: unprintable/long: {line!r}"
    return outcome, folder


# --- hypothesis: structural corruption ------------------------------------------------------

GROUPS = {
    "lengths": ("string_len", "array_count"),
    "type tags": ("value_type", "array_type", "ggml_type"),
    "counts": ("tensor_count", "kv_count"),
    "shapes": ("n_dims", "dim"),
    "offsets": ("tensor_offset",),
}


def edge_values(f: Field, original: int, file_size: int) -> st.SearchStrategy[int]:
    top = 2 ** (8 * f.size) - 1
    edges = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 30, 31, 32, 33, 64, 2**31 - 1, 2**31,
             2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, top, original - 1, original + 1,
             original * 2, original + 32, file_size, file_size + 1]
    return st.sampled_from(sorted({v for v in edges if 0 <= v <= top})) | st.integers(0, top)


@st.composite
def corruption(draw, data: bytes) -> tuple:
    """A mutation drawn as positions and values, never as file bytes (short reports):
    ("truncate", at) | ("flip", at, mask) | ("field", kind, owner, offset, size, value)."""
    layout = gguf_layout(data)
    how = draw(st.sampled_from(["truncate", "field", "field", "field", "flip"]))
    if how == "truncate":
        at = draw(st.sampled_from(layout.boundaries)) + draw(st.integers(-3, 3))
        return ("truncate", min(max(at, 0), len(data) - 1))
    if how == "flip":
        return ("flip", draw(st.integers(0, layout.data_offset - 1)), draw(st.integers(1, 255)))
    group = draw(st.sampled_from(sorted(GROUPS)))
    f = draw(st.sampled_from([f for f in layout.fields if f.kind in GROUPS[group]]))
    original = int.from_bytes(data[f.offset:f.offset + f.size], "little")
    return ("field", f.kind, f.owner, f.offset, f.size,
            draw(edge_values(f, original, len(data))))


def apply(data: bytes, mutation: tuple) -> bytes:
    if mutation[0] == "truncate":
        return data[:mutation[1]]
    if mutation[0] == "flip":
        _, at, mask = mutation
        return data[:at] + bytes([data[at] ^ mask]) + data[at + 1:]
    _, kind, owner, offset, size, value = mutation
    return set_field(data, Field(offset, size, kind, owner), value)


@settings(max_examples=160, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def test_structural_corruption(worker: Worker, cases_dir: Path, base: Path, data) -> None:
    original = base.read_bytes()
    mutation = data.draw(corruption(original))
    run_case(worker, cases_dir, apply(original, mutation), repr(mutation))


# --- hypothesis: non-finite tensor data reaches the build and is refused ----------------------

NON_FINITE_F16 = {"nan": 0x7E00, "inf": 0x7C00, "-inf": 0xFC00}
NON_FINITE_F32 = {"nan": 0x7FC00000, "inf": 0x7F800000, "-inf": 0xFF800000}


@st.composite
def poison(draw, data: bytes) -> tuple[str, int, str]:
    """(tensor, byte offset, value): a Q8_0 block's fp16 scale or an F32 element made
    non-finite."""
    layout = gguf_layout(data)
    name = draw(st.sampled_from(sorted(layout.tensor_data)))
    offset, nbytes, gtype = layout.tensor_data[name]
    width = 34 if gtype == 8 else 4
    return name, offset + width * draw(st.integers(0, nbytes // width - 1)), \
        draw(st.sampled_from(sorted(NON_FINITE_F16)))


def poisoned(data: bytes, name: str, at: int, value: str) -> bytes:
    gtype = gguf_layout(data).tensor_data[name][2]
    raw = struct.pack("<H", NON_FINITE_F16[value]) if gtype == 8 else \
        struct.pack("<I", NON_FINITE_F32[value])
    return data[:at] + raw + data[at + len(raw):]


@settings(max_examples=8, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def test_non_finite_weights_are_refused_by_build(worker: Worker, cases_dir: Path, base: Path,
                                                  data) -> None:
    original = base.read_bytes()
    name, at, value = data.draw(poison(original))
    label = f"{value} in {name} at byte {at}"
    outcome, folder = run_case(worker, cases_dir, poisoned(original, name, at, value), label,
                               command="build")
    if name == "rope_factors_long.weight":
        # A --max-seq 64 build uses the short factors only; it must build and run finite.
        assert outcome.kind == "valid", label
        logits = folder / "l.npy"
        o = worker.run(["logits", "--manifest", str(folder / "out"), "--tokens", "1,2,3",
                        "--out", str(logits), "--backend", "mil"], [folder])
        assert o.kind == "valid" and np.isfinite(np.load(logits)).all(), (label, o)
    else:
        assert outcome.kind == "refused" and "NaN or infinite" in outcome.detail, (label, outcome)
        assert name in outcome.detail and not (folder / "out").exists()


# --- the defects of issue 14, one by one ------------------------------------------------------

def _field(data: bytes, kind: str, owner: str) -> Field:
    return next(f for f in gguf_layout(data).fields if f.kind == kind and f.owner == owner)


def _keys(base: Path, tmp: Path, **keys: tuple) -> bytes:
    return rewrite_gguf(base, tmp / "edited.gguf", set_keys=keys).read_bytes()


U32, U64, STR, F32, BOOL = (GGUFValueType.UINT32, GGUFValueType.UINT64, GGUFValueType.STRING,
                            GGUFValueType.FLOAT32, GGUFValueType.BOOL)
ARR = GGUFValueType.ARRAY


def _zero_dim_last_tensor(data: bytes) -> bytes:
    """The directory's last tensor made an F32 scalar (0 dims, which llama.cpp accepts): its
    dims are dropped and its name grows by as many bytes, so nothing after it moves."""
    layout = gguf_layout(data)
    last = [f for f in layout.fields if f.kind == "n_dims"][-1]
    name_len = [f for f in layout.fields if f.kind == "string_len"
                and f.owner == "tensor name" and f.offset < last.offset][-1]
    n = struct.unpack_from("<Q", data, name_len.offset)[0]
    n_dims = struct.unpack_from("<I", data, last.offset)[0]
    name = data[name_len.offset + 8:name_len.offset + 8 + n] + b"_" * (8 * n_dims)
    rest = last.offset + 4 + 8 * n_dims  # ggml type and offset follow the dims
    return (data[:name_len.offset] + struct.pack("<Q", len(name)) + name
            + struct.pack("<II", 0, 0) + data[rest + 4:])  # n_dims 0, type F32


def named_cases(base: Path, tmp: Path) -> list[tuple[str, bytes, str, str]]:
    """(label, file bytes, command, expected message fragment)."""
    data = base.read_bytes()
    nested = struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 1) + struct.pack("<I", 7)
    binary = bytes(range(256)) * 400 + b"\x1b[2J\x1b]0;pwned\x07\n" * 1000
    qkv_offset = _field(data, "tensor_offset", "blk.0.attn_qkv.weight")
    qkv = int.from_bytes(data[qkv_offset.offset:qkv_offset.offset + 8], "little")
    zero_dim = _zero_dim_last_tensor(data)
    dims = [f for f in gguf_layout(data).fields if f.kind == "dim"
            and f.owner == "blk.0.ffn_up.weight"]
    return [
        ("block_count 2^31", _keys(base, tmp, **{"phi3.block_count": (2**31, U32)}), "inspect",
         "block_count is 2,147,483,648, which needs"),
        ("block_count 2^64-1", _keys(base, tmp, **{"phi3.block_count": (2**64 - 1, U64)}),
         "inspect", "block_count"),
        ("embedding_length as a string",
         _keys(base, tmp, **{"phi3.embedding_length": ("192", STR)}), "inspect",
         "'phi3.embedding_length' must be an integer, not str '192'"),
        ("rms epsilon as a string",
         _keys(base, tmp, **{"phi3.attention.layer_norm_rms_epsilon": ("x", STR)}), "inspect",
         "layer_norm_rms_epsilon' must be a number"),
        ("block_count as a bool", _keys(base, tmp, **{"phi3.block_count": (True, BOOL)}),
         "inspect", "must be an integer, not bool"),
        ("head_count as a float", _keys(base, tmp, **{"phi3.attention.head_count": (6.0, F32)}),
         "inspect", "must be an integer, not float"),
        ("rope freq base NaN", _keys(base, tmp, **{"phi3.rope.freq_base": (float("nan"), F32)}),
         "inspect", "rope_freq_base must be a positive finite number"),
        ("tokens as an int", _keys(base, tmp, **{"tokenizer.ggml.tokens": (5, U32)}), "inspect",
         "'tokenizer.ggml.tokens' must be an array of strings, not int 5"),
        ("tokens as an array of ints",
         _keys(base, tmp, **{"tokenizer.ggml.tokens": ([1, 2, 3], ARR)}), "inspect",
         "must be an array of strings; it holds int 1"),
        ("add_bos_token as a string",
         _keys(base, tmp, **{"tokenizer.ggml.add_bos_token": ("yes", STR)}), "inspect",
         "'tokenizer.ggml.add_bos_token' must be a boolean"),
        ("alignment as a string", _keys(base, tmp, **{"general.alignment": ("32", STR)}),
         "inspect", "general.alignment has value type 8; it must be a uint32"),
        ("alignment 3", _keys(base, tmp, **{"general.alignment": (3, U32)}), "inspect",
         "not a power of two"),
        ("arrays nested 5,000 deep", insert_kv(data, "evil.nested", 9, nested), "inspect",
         "is an array of arrays"),
        ("binary architecture name",
         rewrite_gguf(base, tmp / "arch.gguf", arch=binary.decode("latin-1")).read_bytes(),
         "inspect", "architecture '"),
        ("binary key name", insert_kv(data, binary.decode("latin-1"), 9,
                                      struct.pack("<IQ", 9, 1)), "inspect", "array of arrays"),
        ("0-dim tensor", zero_dim, "inspect", "missing tensor"),
        ("overflowing shape", set_field(set_field(data, dims[0], 2**62), dims[1], 2**62),
         "inspect", "more than any tensor can hold"),
        ("misaligned tensor offset", set_field(data, qkv_offset, qkv + 1), "inspect",
         f"has offset {qkv + 1:,}, expected {qkv:,}"),
        ("aligned but wrong tensor offset", set_field(data, qkv_offset, qkv + 32), "inspect",
         "must follow the directory order"),
        ("merge that is not 'A B'",
         _keys(base, tmp, **{"tokenizer.ggml.merges": (["ab"], ARR)}), "build",
         "merge #0 'ab' is not of the form 'A B'"),
        ("merge naming an unknown token",
         _keys(base, tmp, **{"tokenizer.ggml.merges": (["q 九"], ARR)}), "build",
         "is inconsistent with the vocabulary"),
    ]


def test_issue_14_defects(worker: Worker, cases_dir: Path, base: Path, tmp_path: Path) -> None:
    for label, data, command, expected in named_cases(base, tmp_path):
        outcome, folder = run_case(worker, cases_dir, data, label, command)
        assert outcome.kind == "refused", (label, outcome)
        assert expected in outcome.detail, (label, outcome.detail)
        assert "\x1b" not in outcome.detail and len(outcome.detail) < 600, label
        if command == "build":
            # The same vocabulary is refused by tokenize: build checks what tokenize needs.
            tok = worker.run(["tokenize", str(folder / "case.gguf"), "--text", "hi"], [folder])
            assert tok.kind == "refused" and expected in tok.detail, (label, tok)
            assert not (folder / "out").exists()
