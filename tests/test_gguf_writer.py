"""The one GGUF writer: it refuses what llama.cpp or the phi3 layout would not accept."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from ane_spec.errors import ConfigError
from ane_spec.model.gguf_file import expected_tensor_shapes, open_gguf
from ane_spec.model.gguf_writer import TensorSource, longrope_factor_tensors, write_gguf
from ane_spec.model.synthetic import preset
from ane_spec.model.vocab import build_synthetic_vocab

Q8, F32 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.F32


def _tensors(config, rng=np.random.default_rng(0)) -> dict[str, TensorSource]:
    tensors = longrope_factor_tensors(config)
    for name, shape in expected_tensor_shapes(config).items():
        tensors[name] = TensorSource.from_array(rng.standard_normal(shape) * 0.05,
                                                Q8 if len(shape) == 2 else F32)
    return tensors


@pytest.fixture(scope="module")
def setup():
    config = preset("tiny", num_layers=1, vocab_size=512).to_config()
    return config, build_synthetic_vocab(512)


def test_arrays_round_trip(setup, tmp_path: Path) -> None:
    config, vocab = setup
    tensors = _tensors(config)
    path = write_gguf(tmp_path / "m.gguf", config, vocab, tensors, name="tiny-code")
    m = open_gguf(path)
    # Float keys are stored as f32 (rms_eps, attention factor): equal up to that rounding.
    read, written = m.config.model_dump(), config.model_dump()
    assert read.pop("arch") == written.pop("arch") == "phi3"
    for key in ("swa_layers", "query_scale"):  # not numbers: compared exactly
        assert read.pop(key) == written.pop(key)
    assert read == pytest.approx(written, rel=1e-6)
    assert m.tokenizer_data == vocab
    assert m.metadata["general.name"] == "tiny-code" and m.file_type == "Q8_0"
    norm = tensors["blk.0.attn_norm.weight"].chunks().__next__()
    assert np.array_equal(m.tensor("blk.0.attn_norm.weight").dequantize(), norm)
    # Q8_0: half a quantization step (d = amax/127 per block of 32) from the input, plus the
    # fp16 rounding of d (relative 2^-11) times |q| <= 127.
    qkv = next(tensors["blk.0.attn_qkv.weight"].chunks())
    step = np.abs(qkv.reshape(-1, 32)).max(-1, keepdims=True) / 127
    err = np.abs(m.tensor("blk.0.attn_qkv.weight").dequantize() - qkv).reshape(-1, 32)
    assert (err <= step * (0.5 + 127 / 2048) + 1e-7).all()


def test_a_name_llama_cpp_would_reject_is_refused(setup, tmp_path: Path) -> None:
    config, vocab = setup
    with pytest.raises(ConfigError, match="phi3"):
        write_gguf(tmp_path / "m.gguf", config, vocab, _tensors(config), name="my Phi3 model")
    assert list(tmp_path.iterdir()) == []


def test_wrong_tensors_are_refused(setup, tmp_path: Path) -> None:
    config, vocab = setup
    tensors = _tensors(config)
    del tensors["blk.0.ffn_down.weight"]
    with pytest.raises(ConfigError, match="missing.*ffn_down"):
        write_gguf(tmp_path / "m.gguf", config, vocab, tensors, name="x")
    tensors = _tensors(config)
    tensors["output_norm.weight"] = TensorSource.from_array(np.ones(7), F32)
    with pytest.raises(ConfigError, match="output_norm.weight has shape"):
        write_gguf(tmp_path / "m.gguf", config, vocab, tensors, name="x")
    with pytest.raises(ConfigError, match="512 tokens but the config says vocab_size 1024"):
        write_gguf(tmp_path / "m.gguf", preset("tiny").to_config(), vocab, tensors,
                        name="x")
    assert list(tmp_path.iterdir()) == []
