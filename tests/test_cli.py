"""The model-contract subcommands, called through the real argument parser."""

from __future__ import annotations

import argparse
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


def _subcommand_help(*path: str) -> str:
    """The `--help` text of `ane-spec PATH...`, as argparse prints it."""
    from ane_spec.cli import build_parser

    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return " ".join(parser.format_help().split())


def test_help_says_what_the_commands_run() -> None:
    """The demo runs the shipped tiny-code model (ane_spec/assets), and plain greedy decoding is
    one token per pass, a padded T=4 pass in the default fixed decode shape: help that said
    "a generated tiny model" or "plain T=1" described code that no longer exists."""
    from ane_spec.cli import build_parser

    top = " ".join(build_parser().format_help().split())
    assert "shipped tiny-code model" in top and "generated tiny model" not in top
    assert "plain greedy (one token per pass) vs speculative" in top and "T=1 greedy" not in top
    for command in ("generate", "serve"):
        text = _subcommand_help(command)
        assert "plain T=1" not in text and "T=1 greedy" not in text, command
        assert ("plain greedy decoding, one token per pass (padded to T=4 in the fixed decode "
                "shape, T=1 in the mixed one)") in text, command


EXIT_CHECK = """
import atexit, sys
from ane_spec.cli import run
atexit.register(lambda: print("teardown ran", file=sys.stderr, flush=True))
run()
"""


def test_the_command_skips_the_teardown_only_after_a_finished_build(tmp_path: Path) -> None:
    """`ane-spec build` ends with os._exit once it has finished (cli.exit_process): its
    output must still arrive through a pipe, with its status; any other outcome, a failed
    build included, exits through the interpreter's teardown as before."""
    import subprocess
    import sys

    from ane_spec.assets import tiny_code_model

    def command(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", EXIT_CHECK, *args], capture_output=True,
                              text=True, timeout=600)

    built = command("build", str(tiny_code_model()), "--out", str(tmp_path / "b"))
    assert built.returncode == 0, built.stderr
    assert f"-> {tmp_path / 'b' / 'manifest.json'}" in built.stdout   # flushed through a pipe
    assert "[build] embeddings and tokenizer" in built.stderr
    assert "teardown ran" not in built.stderr and (tmp_path / "b" / "manifest.json").is_file()

    refused = command("build", str(tiny_code_model()), "--out", str(tmp_path / "b"))  # no --force
    assert refused.returncode == 2 and "teardown ran" in refused.stderr
    listed = command("inspect", str(tiny_code_model()))
    assert listed.returncode == 0 and "teardown ran" in listed.stderr
