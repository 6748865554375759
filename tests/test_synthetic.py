"""The synthetic writer: exact Phi-4-mini layout, determinism, bounded memory at real size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ane_spec.errors import ConfigError
from ane_spec.model.gguf_file import expected_tensor_shapes, open_gguf
from ane_spec.model.synthetic import preset, write_synthetic_gguf


def test_real_preset_has_the_real_shapes() -> None:
    c = preset("phi4-mini").to_config()
    assert c.num_parameters() == 3_836_021_760  # the real Phi-4-mini-instruct count
    assert len(expected_tensor_shapes(c)) + 2 == 196  # + the two rope factor tensors
    assert c.rope_attn_factor == pytest.approx(1.1902381, abs=1e-7)
    assert (c.head_dim, c.gqa_group, c.qkv_rows) == (128, 3, 5120)


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    spec = preset("tiny", num_layers=1)
    a = write_synthetic_gguf(tmp_path / "a.gguf", spec).read_bytes()
    b = write_synthetic_gguf(tmp_path / "b.gguf", spec).read_bytes()
    c = write_synthetic_gguf(tmp_path / "c.gguf", preset("tiny", num_layers=1, seed=1)).read_bytes()
    assert a == b and a != c


def test_layout_and_metadata(tiny_gguf: Path) -> None:
    m = open_gguf(tiny_gguf)
    names = list(m.tensors)
    assert names[:2] == ["rope_factors_long.weight", "rope_factors_short.weight"]
    assert {m.tensors[n].type_name for n in names if n.endswith("norm.weight")} == {"F32"}
    assert m.metadata["general.file_type"] == 7
    assert m.metadata["phi3.attention.sliding_window"] == 262144
    assert m.metadata["tokenizer.ggml.pre"] == "gpt-4o"
    data = m.tokenizer_data
    assert data.tokens[1024 - 65] == "<|endoftext|>" and data.tokens[1024 - 44] == "<|end|>"
    assert data.eos_token_id == 1024 - 65 and data.chat_template


def test_bad_spec_is_refused() -> None:
    with pytest.raises(ConfigError, match="not a multiple of num_kv_heads"):
        preset("tiny", num_kv_heads=4)
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("huge")


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ane_spec.model.gguf_writer as gguf_writer

    def boom(chunk, qtype):
        raise OSError("disk full")

    monkeypatch.setattr(gguf_writer, "_encode", boom)
    with pytest.raises(OSError):
        write_synthetic_gguf(tmp_path / "x.gguf", preset("tiny", num_layers=1))
    assert list(tmp_path.iterdir()) == []


READ_ONE_LAYER = """
import json, sys
import numpy as np
from ane_spec.model.gguf_file import open_gguf
from ane_spec.peak_memory import peak_rss_bytes  # this process's own peak, not pytest's
m = open_gguf(sys.argv[1])
emb = m.tensor("token_embd.weight")
qs, d = emb.q8_0()                       # whole-table views: no copy
assert np.shares_memory(qs, m.buffer)
rows = emb.rows(np.arange(0, emb.shape[0], 997))   # embedding lookups across the table
checksum = 0.0
for _, chunk in emb.row_chunks(8192):              # every value of the table, dequantized
    checksum += float(chunk.sum())
for name in ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"):
    t = m.layer(0, name)
    w = t.dequantize()
    checksum += float(w[:4].sum())
    del w
    t.release()
print(json.dumps({"peak_rss_mb": peak_rss_bytes() / 2**20,
                  "rows": rows.shape[0], "checksum": checksum}))
"""


@pytest.mark.slow
def test_real_size_layer_reads_under_1gb(tmp_path: Path) -> None:
    path = write_synthetic_gguf(tmp_path / "phi4-1layer.gguf", preset("phi4-mini", num_layers=1))
    assert path.stat().st_size > 750e6  # the real 200064 x 3072 Q8_0 embedding is in there
    out = subprocess.run([sys.executable, "-c", READ_ONE_LAYER, str(path)], check=True,
                         capture_output=True, text=True)
    report = json.loads(out.stdout)
    print(report)
    assert report["peak_rss_mb"] < 1024
