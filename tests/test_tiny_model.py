"""The embedded tiny-code model and the script that trains it.

The shipped file is checked for the Phi-4-mini schema and for having learned Python; the training
script is run for a few steps on a slice of the corpus (never really trained here) to show that it
is deterministic, resumes to the same bytes, and exports a GGUF the reference reproduces.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ane_spec.assets import tiny_code_card, tiny_code_model
from ane_spec.model.chat import PHI4_MINI_CHAT_TEMPLATE
from ane_spec.model.config import longrope_attn_factor
from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.reference import ReferenceModel
from ane_spec.model.stdlib_corpus import split, stdlib_corpus
from ane_spec.model.tokenizer import TOKEN_CONTROL, Tokenizer
from ane_spec.model.vocab import SPECIAL_TOKENS_FROM_END, phi4_mini_layout

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_tiny_model.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_tiny_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


# -- the shipped model -------------------------------------------------------------------------

def test_shipped_model_has_the_phi4_mini_schema() -> None:
    path = tiny_code_model()
    assert path.stat().st_size <= 16 * 2**20
    m = open_gguf(path)
    c = m.config
    assert m.metadata["general.architecture"] == "phi3" and m.file_type == "Q8_0"
    assert c.head_dim == 64 and c.rope_dims == 48  # Phi-4-mini's 0.75 partial rotary
    assert c.num_heads > c.num_kv_heads and c.num_heads % c.num_kv_heads == 0  # GQA
    assert c.tied_embeddings and "output.weight" not in m.tensors
    assert c.original_context_length == 4096 and c.context_length == 131072
    assert c.rope_attn_factor == pytest.approx(longrope_attn_factor(131072, 4096), abs=1e-6)
    assert np.all(m.rope_factors("short") == 1.0) and m.rope_factors("long").max() > 1.0
    for t in m.tensors.values():
        assert t.type_name == ("Q8_0" if len(t.shape) == 2 else "F32"), t.name
    assert 3e6 <= c.num_parameters() <= 20e6  # a few million: what trained in the time


def test_shipped_tokenizer_is_phi4_minis_layout() -> None:
    data = open_gguf(tiny_code_model()).tokenizer_data
    n = len(data.tokens)
    assert (data.model, data.pre, data.add_bos_token) == ("gpt2", "gpt-4o", False)
    assert data.chat_template == PHI4_MINI_CHAT_TEMPLATE
    for offset, text in SPECIAL_TOKENS_FROM_END:
        assert data.tokens[n - offset] == text and data.token_types[n - offset] == TOKEN_CONTROL
    assert {data.bos_token_id, data.eos_token_id, data.unknown_token_id,
            data.padding_token_id} == {n - 65}
    # Exactly what the shared layout function makes of the file's own merges.
    pairs = [tuple(m.split(" ", 1)) for m in data.merges]
    assert phi4_mini_layout(pairs, n) == data
    assert len(data.merges) > 3000  # a trained vocabulary, not the synthetic one


def test_shipped_card_matches_the_file() -> None:
    card = tiny_code_card()
    c = open_gguf(tiny_code_model()).config
    # Float keys are stored as f32 in the file: equal up to that rounding.
    shipped, read = dict(card["config"]), c.model_dump()
    assert shipped.pop("arch") == read.pop("arch") == "phi3"
    # Fields the card predates (gemma3's window, for one) are not in it; the model has none.
    assert not c.has_local_layers
    read = {k: v for k, v in read.items() if k in shipped}
    floats = {k for k, v in read.items() if isinstance(v, float)}
    assert {k: shipped.pop(k) for k in floats} == pytest.approx(
        {k: read.pop(k) for k in floats}, rel=1e-6)
    assert shipped == read
    assert card["parameters"] == c.num_parameters()
    assert len(card["corpus"]["sha256"]) == 64 and card["steps"] > 0 and card["wall_s"] > 0
    assert card["command"].startswith("python scripts/train_tiny_model.py")
    v = card["verification"]
    assert v["min_cosine_vs_q8_weights"] > 0.99999 and v["min_cosine_vs_trained"] > 0.999


def test_shipped_model_predicts_held_out_python() -> None:
    """Mean loss through the project's reference on 512-token windows from the middle of each
    held-out stdlib file of >= 1024 tokens (files the model never saw).

    The training stream's unigram entropy is 6.8 nats/token (a model ignoring context) and a
    uniform guess 8.3; below 5.0 needs the context. The shipped model measures about 3.8.
    """
    m = open_gguf(tiny_code_model())
    tok = Tokenizer.from_data(m.tokenizer_data)
    ref = ReferenceModel(m, context_window=512)
    losses = []
    for f in split(stdlib_corpus())[1]:
        ids = tok.encode(f.text)
        if len(ids) >= 1024:
            window = ids[len(ids) // 2 - 256:len(ids) // 2 + 257]
            logits = torch.from_numpy(ref.logits(window[:-1]))
            losses.append(torch.nn.functional.cross_entropy(
                logits, torch.tensor(window[1:])).item())
    print(f"held-out loss over {len(losses)} windows: {np.mean(losses):.3f} nats/token")
    assert len(losses) >= 3 and np.mean(losses) < 5.0


# -- the training script -----------------------------------------------------------------------

QUICK = ["--max-files", "12", "--steps", "4", "--dim", "128", "--layers", "2", "--kv-heads", "1",
         "--ffn", "256", "--vocab-size", "768", "--seq-len", "64", "--batch", "2", "--warmup", "2",
         "--eval-every", "2", "--eval-windows", "2", "--checkpoint-every", "2", "--log-every", "1"]


def _train(work: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *QUICK, "--work-dir", str(work),
                           "--out", str(work / "m.gguf"), *extra],
                          capture_output=True, text=True, check=True, cwd=ROOT)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("train-a")
    out = _train(work)
    assert "step 4/4" in out.stdout and "held-out loss" in out.stdout
    return work


def test_training_export_loads_and_the_reference_reproduces_it(quick_run: Path) -> None:
    train = _load_script()
    path = quick_run / "m.gguf"
    m = open_gguf(path)
    assert (m.config.hidden_size, m.config.num_layers, m.config.vocab_size) == (128, 2, 768)
    assert m.config.rope_dims == 48 and m.config.num_kv_heads == 1

    # The training forward with the GGUF's (dequantized Q8_0) weights vs the reference on the
    # file: identical math, so only float32 summation order differs.
    tokens = Tokenizer.from_data(m.tokenizer_data).encode(SCRIPT.read_text())[:96]
    ours = train.TinyPhi3.from_gguf(path)
    cos, sin = train.rope_cos_sin(ours.config, len(tokens))
    with torch.no_grad():
        mine = ours(torch.tensor([tokens]), cos, sin)[0].numpy()
    ref = ReferenceModel(m, context_window=128).logits(tokens)
    assert _cosine(mine, ref).min() > 0.99999
    assert (mine.argmax(-1) == ref.argmax(-1)).all()

    card = json.loads(path.with_suffix(".json").read_text())
    assert card["steps"] == 4 and card["parameters"] == m.config.num_parameters()
    assert math.isfinite(card["final_held_out_loss"]) and card["corpus"]["train_files"] == 12
    assert card["verification"]["min_cosine_vs_q8_weights"] > 0.99999


def test_training_is_deterministic_and_resumes_to_the_same_bytes(
        quick_run: Path, tmp_path: Path) -> None:
    stopped = _train(tmp_path, "--stop-after", "2")
    assert "stopped at step 2" in stopped.stdout and not (tmp_path / "m.gguf").exists()
    resumed = _train(tmp_path)
    assert "resumed from" in resumed.stdout
    assert (tmp_path / "m.gguf").read_bytes() == (quick_run / "m.gguf").read_bytes()


def test_a_checkpoint_of_another_run_is_refused(quick_run: Path, tmp_path: Path) -> None:
    work = tmp_path / "w"
    _train(work, "--stop-after", "2")
    out = subprocess.run([sys.executable, str(SCRIPT), *QUICK, "--seed", "1", "--work-dir",
                          str(work), "--out", str(work / "m.gguf")],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode != 0 and "belongs to another run" in out.stderr
