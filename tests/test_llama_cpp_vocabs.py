"""llama.cpp's own tokenizer test vectors (models/ggml-vocab-*.gguf with .inp/.out) and its
pre-tokenizer table (src/llama-vocab.cpp), from the llama-cpp-python sdist (tests/llama_cpp_source.py
fetches it once into a cache).

Every case of every vocabulary whose tokenizer is supported (byte-level BPE with a supported
pre-tokenizer, SentencePiece `llama-spm` and `phi-3`, Gemma 4's BPE) must give llama.cpp's ids
exactly, tokenized as test-tokenizer-0 does: `common_tokenize(ctx, text, add_special=false,
parse_special=false)`, so no BOS/EOS is added and CONTROL tokens written in the text are text.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ane_spec.errors import TokenizerError
from ane_spec.model.gguf_file import tokenizer_data_from_metadata
from ane_spec.model.gguf_format import read_gguf
from ane_spec.model.tokenizer import (
    PRE_TOKENIZERS,
    PRE_TYPE_EXPRS,
    RAW_UTF8_PRE_TYPES,
    Tokenizer,
    TokenizerData,
)
from tests.llama_cpp_source import cache_dir, llama_cpp_pre_table, llama_cpp_tree, read_cases

# Vocabularies of the sdist not run, and why. The test below asserts this is exactly the set
# left out, so support cannot silently regress (nor grow without this list saying so).
LEFT_OUT = {
    "aquila": "no .inp/.out cases",
    "baichuan": "no .inp/.out cases",
    "gpt-neox": "no .inp/.out cases",
    "nomic-bert-moe": "no .inp/.out cases",
    "bert-bge": "WPM (tokenizer model 'bert'), not byte-level BPE",
}

# Pre types left out of PRE_TYPE_EXPRS, and names left out of PRE_TOKENIZERS (tokenizer.py).
UNSUPPORTED_TYPES = {"TINY_AYA", "AFMOE", "KIMI_K2", "SUPERBPE", "WHITESPACE"}
ADD_SEP_NAMES = {"jina-v1-en", "jina-v2-code", "roberta-bpe"}


@pytest.fixture(scope="session")
def llama_cpp_dir() -> Path:
    return llama_cpp_tree()


def _vocab_names() -> list[str]:
    # The parametrization must not need the download; every file name is checked below.
    return sorted({"command-r", "deepseek-coder", "deepseek-llm", "falcon", "gpt-2", "llama-bpe",
                   "mpt", "qwen2", "qwen35", "refact", "starcoder", "llama-spm", "phi-3",
                   "gemma-4"})


_TOKENIZERS: dict[str, Tokenizer] = {}


def _tokenizer(models: Path, name: str) -> Tokenizer:
    if name not in _TOKENIZERS:
        path = models / f"ggml-vocab-{name}.gguf"
        meta = read_gguf(str(path), path.name).metadata
        _TOKENIZERS[name] = Tokenizer.from_data(tokenizer_data_from_metadata(meta, path.name))
    return _TOKENIZERS[name]


def test_vocabularies_run_and_left_out_are_all_of_them(llama_cpp_dir: Path) -> None:
    models = llama_cpp_dir / "models"
    present = {p.name[len("ggml-vocab-"):-len(".gguf")] for p in models.glob("ggml-vocab-*.gguf")}
    assert present == set(_vocab_names()) | set(LEFT_OUT)
    for name in LEFT_OUT:
        path = models / f"ggml-vocab-{name}.gguf"
        has_cases = (models / f"{path.name}.inp").exists()
        assert has_cases == (LEFT_OUT[name] != "no .inp/.out cases"), name
        if has_cases:  # refused by name, as any unsupported tokenizer model is
            meta = read_gguf(str(path), path.name).metadata
            with pytest.raises(TokenizerError, match="tokenizer model .* is not supported"):
                tokenizer_data_from_metadata(meta, path.name)


@pytest.mark.parametrize("name", _vocab_names())
def test_llama_cpp_vocab_cases(llama_cpp_dir: Path, name: str) -> None:
    models = llama_cpp_dir / "models"
    path = models / f"ggml-vocab-{name}.gguf"
    cases = read_cases(Path(f"{path}.inp"), Path(f"{path}.out"))
    tok = _tokenizer(models, name)
    assert tok.is_spm or tok.data.pre in PRE_TOKENIZERS
    failed = [(text, tok.encode(text), ids) for text, ids in cases.items()
              if tok.encode(text, special=False, add_special=False) != ids]
    assert not failed, f"{name}: {len(failed)}/{len(cases)} cases differ, first: {failed[0]!r}"
    print(f"{name} (pre {tok.data.pre!r}): {len(cases)} cases")


def test_pre_tokenizer_table_mirrors_llama_cpp(llama_cpp_dir: Path) -> None:
    """Every supported name has llama.cpp's pre type and flags, every supported type its
    expressions, verbatim; what is left out is left out on purpose."""
    names, types = llama_cpp_pre_table(llama_cpp_dir / "src" / "llama-vocab.cpp")
    for name, entry in names.items():
        flags = entry["flags"]
        if entry["type"] in UNSUPPORTED_TYPES or name in ADD_SEP_NAMES:
            assert name not in PRE_TOKENIZERS, name
            continue
        ours = PRE_TOKENIZERS[name]
        assert ours.pre_type == entry["type"], name
        assert ours.ignore_merges == (flags.get("ignore_merges") == "true"), name
        assert ours.add_bos == (flags.get("add_bos") == "true"), name
        assert ours.clean_spaces == (flags.get("clean_spaces") != "false"), name
        assert ours.escape_whitespaces == (flags.get("escape_whitespaces") == "true"), name
    assert set(PRE_TOKENIZERS) <= set(names)
    assert set(PRE_TYPE_EXPRS) == set(types) - UNSUPPORTED_TYPES
    for kind, exprs in PRE_TYPE_EXPRS.items():
        assert exprs == types[kind]["exprs"], kind
        assert types[kind]["byte_encode"] == (kind not in RAW_UTF8_PRE_TYPES), kind
    for name in ("smollm", "starcoder", "gpt-2", "deepseek-llm", "deepseek-coder",
                 "deepseek-r1-qwen", "tekken", "gpt-4o", "llama3", "llama-bpe", "qwen2"):
        assert name in PRE_TOKENIZERS


def test_unknown_pre_tokenizer_is_refused_by_name(llama_cpp_dir: Path) -> None:
    tok = _tokenizer(llama_cpp_dir / "models", "gpt-2")
    for name in ("kimi-k2", "afmoe", "no-such-pre"):
        with pytest.raises(TokenizerError, match=f"pre-tokenizer '{name}' is not supported; "
                                                 "supported: .*smollm"):
            TokenizerData(**{**tok.data.model_dump(), "pre": name})


# -- SmolLM2 ---------------------------------------------------------------------------------

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Tokenizer:
    """The real SmolLM2-135M-Instruct file's tokenizer, when the cache holds the file
    ($ANE_SPEC_CACHE/models/ or ~/.cache/ane-spec/models/; `ane-spec pull` puts it there)."""
    roots = [cache_dir()] + ([Path.home() / ".cache" / "ane-spec"]
                             if os.environ.get("ANE_SPEC_CACHE") else [])
    for root in roots:
        path = root / "models" / SMOLLM2
        if path.exists():
            meta = read_gguf(str(path), path.name).metadata
            return Tokenizer.from_data(tokenizer_data_from_metadata(meta, path.name))
    pytest.skip(f"{SMOLLM2} is not in {' or '.join(str(r / 'models') for r in roots)}")


def test_smollm2_tokenizer_as_llama_cpp_has_it(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    assert tok.data.pre == "smollm" and tok.vocab_size == 49152
    assert not tok.data.add_bos_token
    # llama.cpp: EOS <|im_end|>, the EOG texts <|endoftext|> and <|im_end|>, and <reponame>
    # (Granite's FIM repo token, which ends generation).
    assert {tok.token_text(i) for i in tok.eog_ids} == {"<|endoftext|>", "<|im_end|>",
                                                      "<reponame>"}
    # Digits one by one, then GPT-2's split.
    assert tok.pre_tokenize("It's 2024, hi  there") == ["It", "'s", " ", "2", "0", "2", "4", ",",
                                                       " hi", " ", " there"]
    text = "<|im_start|>user\nHi<|im_end|>\n"
    ids = tok.encode(text, special=True, add_special=True)  # no BOS: add_bos_token is false
    assert ids[0] == tok.id_of("<|im_start|>") and tok.id_of("<|im_end|>") in ids
    assert tok.decode(ids) == text


def test_smollm2_chat_template(smollm2_tokenizer: Tokenizer) -> None:
    from ane_spec.model.chat import render_chat

    tok = smollm2_tokenizer
    prompt = render_chat([{"role": "user", "content": "What is 2+2?"}],
                         template=tok.data.chat_template,
                         eos_token=tok.token_text(tok.eos_token_id),
                         bos_token=tok.token_text(tok.bos_token_id), add_bos=False)
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                      "by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    with_system = render_chat([{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi"}],
                              template=tok.data.chat_template)
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


# -- chat templates ----------------------------------------------------------------------------

def test_chat_templates_are_llama_cpps(llama_cpp_dir: Path) -> None:
    """The templates chat_templates.py carries are the files llama.cpp tests against (Qwen3's
    is a later revision of the model's template than llama.cpp's copy, rewritten so that
    list contents render), and llama.cpp's render through the project's renderer."""
    from ane_spec.model.chat import render_chat
    from ane_spec.model.chat_templates import LLAMA32_CHAT_TEMPLATE, QWEN25_CHAT_TEMPLATE

    templates = llama_cpp_dir / "models" / "templates"
    assert (templates / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text() == QWEN25_CHAT_TEMPLATE
    assert (templates / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text() == \
        LLAMA32_CHAT_TEMPLATE
    qwen = render_chat([{"role": "user", "content": "Hi"}],
                       template=(templates / "Qwen-Qwen3-0.6B.jinja").read_text(),
                       eos_token="<|im_end|>", bos_token="<|endoftext|>")
    assert qwen == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
