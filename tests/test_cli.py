"""The model-contract subcommands, called through the real argument parser."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ane_spec.cli import main
from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.reference import ReferenceModel


def test_synth_inspect_tokenize_logits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gguf = tmp_path / "m.gguf"
    assert main(["synth", str(gguf), "--preset", "tiny", "--layers", "2", "--quiet"]) == 0
    assert "random weights" in capsys.readouterr().out

    assert main(["inspect", str(gguf), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config"]["num_layers"] == 2 and info["tokenizer"]["vocab_size"] == 1024
    assert main(["inspect", str(gguf)]) == 0
    assert "layers 2, hidden 192" in capsys.readouterr().out

    assert main(["tokenize", str(gguf), "--text", "<|user|>hi<|end|>", "--special"]) == 0
    ids = json.loads(capsys.readouterr().out)
    assert ids[0] == 1024 - 43 and ids[-1] == 1024 - 44  # <|user|> ... <|end|>

    out = tmp_path / "l.npy"
    assert main(["logits", str(gguf), "--tokens", "1,2,3,400", "--out", str(out)]) == 0
    logits = np.load(out)
    assert logits.shape == (4, 1024) and logits.dtype == np.float32
    expected = ReferenceModel(open_gguf(gguf)).logits([1, 2, 3, 400])
    np.testing.assert_array_equal(logits, expected)


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not a GGUF file" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["logits", str(bad), "--tokens", "a,b", "--out", "x.npy"])
