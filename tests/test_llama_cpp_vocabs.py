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


# -- SentencePiece (llama-spm, phi-3) and Gemma 4 ---------------------------------------------

SPM_NAMES = ("llama-spm", "phi-3", "gemma-4")
ROUND_TRIP = ["Hello world", " leading space", "trailing  ", "  two\n\nlines\t\ttabs\r\n",
              "naïve café, straße — “quotes” …", "数学 日本語 한국어 ไทย हिन्दी", "😀👍🏽🇺🇸 \u200d",
              "\x00\x01\x1b[0m\x7f", "<s> </s> <unk> <|end|> <start_of_turn> <0x0A>",
              "def f(x):\n    return x ** 2  # ▁ is U+2581", "▁▁ ▁", "\U0010ffff\ufeff"]


@pytest.mark.parametrize("name", SPM_NAMES)
def test_spm_round_trip(llama_cpp_dir: Path, name: str) -> None:
    """decode(encode(text)) == text for llama.cpp's cases and varied text; pieces and the
    incremental decoder agree with decode."""
    models = llama_cpp_dir / "models"
    path = models / f"ggml-vocab-{name}.gguf"
    tok = _tokenizer(models, name)
    texts = list(read_cases(Path(f"{path}.inp"), Path(f"{path}.out"))) + ROUND_TRIP
    for original in texts:
        ids = tok.encode(original)
        # Text's own "▁" is a space once escaped: llama.cpp cannot tell them apart either.
        text = original.replace("▁", " ")
        assert tok.decode(ids) == text, (name, text)
        det = tok.detokenizer(starts_text=True)
        assert "".join(det.push(i) for i in ids) + det.flush() == text
        with_bos = tok.encode(text, add_special=True)
        assert with_bos[0] == tok.bos_token_id and tok.data.add_bos_token
        assert tok.decode(with_bos, skip_special=True) == (
            " " + text if tok.data.add_space_prefix and text else text)


def test_spm_vocabularies_as_llama_cpp_reads_them(llama_cpp_dir: Path) -> None:
    models = llama_cpp_dir / "models"
    llama = _tokenizer(models, "llama-spm")
    assert llama.is_spm and llama.data.add_space_prefix and llama.data.scores is not None
    assert [llama.token_text(i) for i in llama.encode("Hello world")] == ["▁Hello", "▁world"]
    assert llama.encode("Hi", add_special=True)[0] == 1
    assert {llama.token_text(i) for i in llama.eog_ids} == {"</s>"}
    assert llama.token_bytes(llama.id_of("<0x0A>")) == b"\n"

    phi3 = _tokenizer(models, "phi-3")
    assert phi3.data.strip_rule == "phi3"  # general.name "Phi3"
    assert {phi3.token_text(i) for i in phi3.eog_ids} >= {"<|end|>", "<|endoftext|>"}
    # Phi-3's special tokens swallow the whitespace after them (llama.cpp: RSTRIP by name).
    ids = phi3.encode("<|user|>\nHi<|end|>\n<|assistant|>\n", special=True, add_special=True)
    assert [phi3.token_text(i) for i in ids] == [
        "<s>", "<|user|>", "▁Hi", "<|end|>", "<|assistant|>"]

    gemma = _tokenizer(models, "gemma-4")
    assert not gemma.is_spm and gemma.data.pre == "gemma4" and not gemma.data.add_space_prefix
    assert gemma.data.add_bos_token and gemma.bos_token_id == gemma.id_of("<bos>")
    assert [gemma.token_text(i) for i in gemma.encode("Hello world\n\n")] == [
        "Hello", "▁world", "\n\n"]


def test_spm_speed(llama_cpp_dir: Path) -> None:
    """A few thousand tokens of prompt take milliseconds (cold cache: every word merged)."""
    import time

    text = (Path(__file__).read_text() + (Path(__file__).parent.parent / "README.md")
            .read_text())[:60_000]
    for name in ("llama-spm", "phi-3"):
        data = _tokenizer(llama_cpp_dir / "models", name).data
        tok = Tokenizer.from_data(data)  # fresh: nothing cached
        t0 = time.perf_counter()
        ids = tok.encode(text)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert tok.encode(text) == ids
        warm = time.perf_counter() - t0
        print(f"{name}: {len(text)} chars, {len(ids)} tokens: {len(ids) / cold:,.0f} tokens/s "
              f"cold, {len(ids) / warm:,.0f} warm")
        assert len(ids) / cold > 20_000  # measured ~400k on one shared core


@pytest.mark.oracle
@pytest.mark.parametrize("name", SPM_NAMES)
def test_spm_matches_llama_cpp_on_random_text(llama_cpp_dir: Path, name: str) -> None:
    """Encoding (special and add_special both ways), llama_detokenize (clean_spaces,
    remove_special) and every piece, against llama.cpp itself."""
    import random

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    path = llama_cpp_dir / "models" / f"ggml-vocab-{name}.gguf"
    tok = _tokenizer(llama_cpp_dir / "models", name)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    buf = (llama_cpp.ctypes.c_char * 4096)()
    alphabet = ["a", "Z", "re", "'s", "0", "12345", " ", "  ", "   ", "\t", "\r", "\n", "\n\n",
                "/", ".", " .", " ,", " ' ", "!", "é", "ß", "ж", "中", "あ", "\u0301", "्", "😀",
                "👍🏽", "\u00a0", "\u2028", "\x85", "\x00", "\u3000", "▁", "<s>", "</s>", "<unk>",
                "<0x0A>", "<|end|>", "<|user|>", "<|endoftext|>", "<start_of_turn>", "<eos>",
                "<bos>", "<mask>", " the", " hello", "world"]
    rng = random.Random(name)
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        for special in (False, True):
            for add in (False, True):
                theirs = llm.tokenize(text.encode(), add_bos=add, special=special)
                assert tok.encode(text, special=special, add_special=add) == theirs, text
        ids = tok.encode(text, special=True, add_special=True)
        arr = (llama_cpp.llama_token * len(ids))(*ids)
        for unparse in (False, True):
            for remove in (False, True):
                n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, len(buf), remove,
                                               unparse)
                assert tok.detokenize(ids, skip_special=not unparse,
                                      remove_special=remove).encode() == bytes(buf[:n]), text
    for i in [*range(400), *range(tok.vocab_size - 400, tok.vocab_size)]:
        for special in (False, True):
            n = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, special)
            assert tok.decode_bytes([i], skip_special=not special) == bytes(buf[:n]), i


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
