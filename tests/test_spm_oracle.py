"""SentencePiece tokenization against llama.cpp's own answers, recorded, with no llama.cpp here.

tests/data/spm_oracle.json holds llama.cpp's ids for 300 varied texts (words, whitespace runs,
scripts and symbols that need byte fallback, code, special tokens' texts, runs of `a`/`b` whose
merges tie) on every SentencePiece vocabulary of llama.cpp's test material: llama-spm, phi-3 and
baichuan, in two modes (`plain`, as test-tokenizer-0 runs; `special`, a prompt: BOS added and
special tokens parsed). scripts/record_spm_oracle.py recorded it with llama-cpp-python; the
vocabularies themselves come from the llama-cpp-python sdist (tests/llama_cpp_source.py), checked
against the sha256 the table names, so a changed file is told apart from a changed tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ane_spec.model.gguf_file import tokenizer_data_from_metadata
from ane_spec.model.gguf_format import read_gguf
from ane_spec.model.tokenizer import Tokenizer
from tests.llama_cpp_source import SDIST_SHA256, VERSION, llama_cpp_tree

TABLE = Path(__file__).resolve().parent / "data" / "spm_oracle.json"
VOCABULARIES = ("baichuan", "llama-spm", "phi-3")


@pytest.fixture(scope="module")
def table() -> dict:
    return json.loads(TABLE.read_text(encoding="utf-8"))


def test_the_table_is_what_it_says(table: dict) -> None:
    assert table["llama_cpp_python"] == VERSION and table["sdist_sha256"] == SDIST_SHA256
    texts = table["texts"]
    assert len(texts) == len(set(texts)) == 300
    assert sorted(table["vocabularies"]) == list(VOCABULARIES)
    for name, v in table["vocabularies"].items():
        assert len(v["plain"]) == len(texts), name
        assert all(0 <= int(k) < len(texts) for k in v["special"]), name
    # Not a table of trivia: long texts, and the modes differ where specials are spelled.
    assert sum(map(len, table["vocabularies"]["llama-spm"]["plain"])) > 3000
    assert len(table["vocabularies"]["phi-3"]["special"]) >= 20


@pytest.mark.parametrize("name", VOCABULARIES)
def test_spm_tokenization_is_llama_cpps(table: dict, name: str) -> None:
    v = table["vocabularies"][name]
    path = llama_cpp_tree() / "models" / v["file"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == v["sha256"], path
    tok = Tokenizer.from_data(tokenizer_data_from_metadata(
        read_gguf(str(path), path.name).metadata, path.name))
    assert tok.is_spm
    assert tok.encode("", special=True, add_special=True) == v["bos"]
    failed = []
    for k, (text, plain) in enumerate(zip(table["texts"], v["plain"])):
        if tok.encode(text) != plain:
            failed.append(("plain", text, tok.encode(text), plain))
        special = v["special"].get(str(k), v["bos"] + plain)
        ours = tok.encode(text, special=True, add_special=True)
        if ours != special:
            failed.append(("special", text, ours, special))
    assert not failed, (f"{name}: {len(failed)} of {2 * len(table['texts'])} differ from "
                        f"llama.cpp; first (mode, text, ours, llama.cpp's): {failed[0]!r}")
