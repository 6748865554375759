"""Llama 3, Qwen 2 and Qwen 3 files: read as llama.cpp reads them, built, and run exactly.

Fixtures are odd-sized on purpose (hidden 160 = 5 heads of 32, one KV head, ffn 352, vocab
1031; qwen3 with head_dim 64, so q is 320 wide on a 160-wide residual stream), so a graph that
confuses hidden_size with q_dim, or heads with KV heads, fails here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gguf import GGUFValueType

from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.errors import BuildError, GGUFError
from ane_spec.manifests.store import load_manifest
from ane_spec.model.architectures import ARCHITECTURES, Architecture
from ane_spec.model.gguf_file import expected_tensor_shapes, open_gguf
from ane_spec.model.inspect import describe, format_description
from ane_spec.model.reference import ReferenceModel, apply_rope, apply_rope_norm
from ane_spec.model.synthetic import PRESETS, SyntheticSpec, write_synthetic_gguf
from ane_spec.model.tokenizer import Tokenizer
from ane_spec.probes.block import run_block
from ane_spec.probes.gates import open_pipeline
from ane_spec.probes.parity import run_parity
from ane_spec.probes.row_invariance import run_row_invariance
from ane_spec.shards.build import BuildRequest, build
from ane_spec.shards.static_checks import dtype_problems, read_package_facts
from ane_spec.shards.topology import MAX_HEAD_CHANNELS, check_budget, min_head_chunks, plan_topology
from tests.decode_checks import assert_speculative_equals_greedy
from tests.gguf_edit import rewrite_gguf

S = 64
ARCHS = ("llama", "qwen2", "qwen3")
# llama: Llama 3.1 frequency factors computed for a 64-token original context, so that most
# dims carry factors (up to 32) that change angles within the tests' prompts.
EXTRA = {"llama": {"rope_freqs": True, "original_context_length": 64}, "qwen2": {},
         "qwen3": {"head_dim": 64}}


def spec(arch: str, **kw: object) -> SyntheticSpec:
    values = dict(arch=arch, hidden_size=160, num_layers=3, num_heads=5, num_kv_heads=1,
                  ffn_size=352, vocab_size=1031, **EXTRA[arch])
    return SyntheticSpec(**(values | kw))


@pytest.fixture(scope="module")
def conditioned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Well conditioned (embed std 1, branches x1): logit comparisons."""
    root = tmp_path_factory.mktemp("arch-cond")
    return {a: write_synthetic_gguf(root / f"{a}.gguf",
                                    spec(a, embed_std=1.0, branch_scale=1.0, seed=3))
            for a in ARCHS}


@pytest.fixture(scope="module")
def builds(conditioned: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("arch-builds")
    for a, gguf in conditioned.items():
        build(gguf, root / a, BuildRequest(topology="2,1", max_seq=S))
    return {a: root / a for a in ARCHS}


# -- reading --------------------------------------------------------------------------------------

def test_tensor_layouts_follow_llama_cpp(conditioned: dict[str, Path]) -> None:
    llama = open_gguf(conditioned["llama"])
    names = set(llama.tensors)
    assert {"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight",
            "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "rope_freqs.weight"} <= names
    assert not any(n.endswith((".bias", "attn_qkv.weight", "_norm.weight")) and "blk" in n
                   and "attn_norm" not in n and "ffn_norm" not in n for n in names)
    assert llama.tokenizer_data.add_bos_token and llama.rope_spec(S).factor_set == "freqs"

    qwen2 = open_gguf(conditioned["qwen2"])
    assert qwen2.tensors["blk.2.attn_k.bias"].shape == (32,)
    assert qwen2.rope_spec(S).factor_set == "none"

    qwen3 = open_gguf(conditioned["qwen3"])
    c = qwen3.config
    assert (c.head_dim, c.q_dim, c.hidden_size) == (64, 320, 160)
    assert qwen3.tensors["blk.0.attn_output.weight"].shape == (160, 320)
    assert qwen3.tensors["blk.0.attn_q_norm.weight"].shape == (64,)
    assert "blk.0.attn_q.bias" not in qwen3.tensors
    for m in (llama, qwen2, qwen3):
        assert set(expected_tensor_shapes(m.config)) <= set(m.tensors)


def test_inspect_names_the_architecture_and_its_quirks(conditioned: dict[str, Path]) -> None:
    for arch in ARCHS:
        d = describe(open_gguf(conditioned[arch]))
        assert d["architecture"]["name"] == arch
        assert d["architecture"]["quirks"] == list(ARCHITECTURES[arch].quirks)
        text = format_description(d)
        assert f"architecture {arch} (" in text and ARCHITECTURES[arch].quirks[0] in text
    assert "RoPE NORM, factor tensors: rope_freqs.weight" in format_description(
        describe(open_gguf(conditioned["llama"])))


def test_keys_llama_cpp_refuses_or_defaults(conditioned: dict[str, Path], tmp_path: Path) -> None:
    # llama.cpp: "invalid n_rot" when rope.dimension_count differs from head_dim for llama.
    u32, f32, text = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    p = rewrite_gguf(conditioned["llama"], tmp_path / "rot.gguf", arch="llama",
                     set_keys={"llama.rope.dimension_count": (16, u32)})
    with pytest.raises(GGUFError, match=r"rope_dims \(16\) must equal head_dim \(32\)"):
        open_gguf(p)
    p = rewrite_gguf(conditioned["qwen2"], tmp_path / "yarn.gguf", arch="qwen2",
                     set_keys={"qwen2.rope.scaling.type": ("yarn", text)})
    with pytest.raises(GGUFError, match="'qwen2.rope.scaling.type' is 'yarn'; supported: none, "
                                        "linear"):
        open_gguf(p)
    # Linear scaling: freq_scale = 1 / factor, applied to every angle.
    p = rewrite_gguf(conditioned["qwen2"], tmp_path / "linear.gguf", arch="qwen2",
                     set_keys={"qwen2.rope.scaling.type": ("linear", text),
                               "qwen2.rope.scaling.factor": (4.0, f32)})
    scaled = open_gguf(p).rope_spec(S)
    plain = open_gguf(conditioned["qwen2"]).rope_spec(S)
    assert scaled.freq_scale == 0.25
    cos_s, _ = scaled.tables([8])
    cos_p, _ = plain.tables([2])
    np.testing.assert_allclose(cos_s, cos_p, rtol=1e-6)
    # Without key_length, head_dim is hidden / heads; with it (qwen3 here) it is the key's value.
    p = rewrite_gguf(conditioned["qwen3"], tmp_path / "vlen.gguf", arch="qwen3",
                     set_keys={"qwen3.attention.value_length": (32, u32)})
    with pytest.raises(GGUFError, match="value_length' \\(32\\) differs from the key length"):
        open_gguf(p)
    # Hostile values name their key.
    for key, value, message in (
            ("qwen3.attention.key_length", ("64", text), "key_length' must be an integer"),
            ("qwen3.rope.scaling.factor", (float("nan"), f32), "rope_freq_scale must be a "
                                                                "positive finite number"),
            ("qwen3.attention.key_length", (0, u32), "key_length' must be positive, got 0")):
        p = rewrite_gguf(conditioned["qwen3"], tmp_path / "bad.gguf", arch="qwen3",
                         set_keys={key: value})
        with pytest.raises(GGUFError, match=message):
            open_gguf(p)


def test_rope_type_is_part_of_the_contract(conditioned: dict[str, Path]) -> None:
    """NORM and NEOX rotate different dims: swapping them changes llama's logits a lot, so the
    shards' agreement with the reference below is evidence of the row reordering, not luck."""
    m = open_gguf(conditioned["llama"])
    tokens = list(range(40, 80))
    norm = ReferenceModel(m, context_window=S).logits(tokens)
    ref = ReferenceModel(m, context_window=S)
    ref.rope_fn = apply_rope
    neox = ref.logits(tokens)
    cos = (norm * neox).sum(-1) / np.linalg.norm(norm, axis=-1) / np.linalg.norm(neox, axis=-1)
    assert cos[1:].min() < 0.99  # position 0 has no rotation at all
    # So do the rope_freqs divisors: without them this fixture's logits move as much.
    plain = ReferenceModel(m, context_window=S)
    plain.rope = plain.rope.model_copy(update={"factors": (1.0,) * len(plain.rope.factors)})
    other = plain.logits(tokens)
    cos = (norm * other).sum(-1) / np.linalg.norm(norm, axis=-1) / np.linalg.norm(other, axis=-1)
    assert cos.min() < 0.99
    # And the NORM rotation is the adjacent-pair one: dims (0, 1) rotate together.
    x = torch.zeros(1, 1, 4)
    x[0, 0, 0] = 1.0
    c, s = torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]])
    assert apply_rope_norm(x, c, s).tolist() == [[[0.0, 1.0, 0.0, 0.0]]]


# -- building and running --------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_packages_are_fp16_only_with_each_familys_ops(builds: dict[str, Path], arch: str) -> None:
    m = load_manifest(builds[arch]).manifest
    for shard in m.shards:
        facts = read_package_facts(builds[arch] / shard.file.path)
        n = shard.layers[1] - shard.layers[0]
        assert dtype_problems(facts) == [] and set(facts.io_dtypes.values()) == {"fp16"}
        assert not {"cast", "softmax", "identity"} & set(facts.ops)
        # q|k|v and gate|up stay one conv each; qwen3's head norms are two more layer_norms.
        assert facts.ops["conv"] == 4 * n
        assert facts.ops["layer_norm"] == (4 if arch == "qwen3" else 2) * n
        assert facts.states[f"layer_{shard.layers[0]}_k"] == (
            [1, 1, S, 64 if arch == "qwen3" else 32], "fp16")
    assert dtype_problems(read_package_facts(builds[arch] / m.heads[0].file.path)) == []
    assert m.rope.factor_set == ("freqs" if arch == "llama" else "none")


@pytest.mark.parametrize("arch", ARCHS)
def test_shards_match_the_reference(builds: dict[str, Path], conditioned: dict[str, Path],
                                    arch: str) -> None:
    m = open_gguf(conditioned[arch])
    for precision in ("fp32", "fp16"):
        loaded, pipeline = open_pipeline(builds[arch], "mil", precision)
        parity = run_parity(loaded, pipeline, m, lengths=(3, 17), decode_steps=4)
        print(arch, parity.summary())
        assert parity.passed
        assert parity.figures["gguf_min_cosine"] >= 0.999
        if precision == "fp32":
            assert parity.figures["min_cosine"] >= 0.9999
            assert parity.figures["argmax_agreement"] == 1.0
    block = run_block(pipeline)
    rows = run_row_invariance(pipeline)
    print(arch, block.summary(), "|", rows.summary())
    assert block.passed and rows.passed


@pytest.fixture(scope="module")
def chaotic_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """embed std 0.05, branches x4: varied greedy output (the contract doc's first trap)."""
    # 2*S: Meta's Llama 3.2 template writes a dated system turn even for a bare "hi", 67
    # tokens in this small vocabulary.
    return build_family(tmp_path_factory.mktemp("arch-chaotic"), ARCHS, BuildRequest(
        topology="3", max_seq=2 * S), seed=11)


def build_family(root: Path, archs: tuple[str, ...], request: BuildRequest,
                 **spec_fields: object) -> dict[str, Path]:
    """Write and build the fixture of each architecture: {arch: build folder}."""
    out = {}
    for a in archs:
        gguf = write_synthetic_gguf(root / f"{a}.gguf", spec(a, **spec_fields))
        build(gguf, root / a, request)
        out[a] = root / a
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_fp16_speculative_equals_greedy(chaotic_builds: dict[str, Path], arch: str) -> None:
    pipeline = open_pipeline(chaotic_builds[arch], "mil", "fp16")[1]
    assert_speculative_equals_greedy(pipeline, token_limit=900, longest=20, label=arch)


# -- real shapes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,arch,params,vocab", [
    ("llama-3.2-1b", "llama", 1_235_814_400, 128256),
    ("llama-3.2-3b", "llama", 3_212_749_824, 128256),
    ("qwen2.5-3b", "qwen2", 3_085_938_688, 151936),
    ("qwen3-4b", "qwen3", 4_022_468_096, 151936),
])
def test_real_size_presets(name: str, arch: str, params: int, vocab: int) -> None:
    """The presets have the real models' shapes (parameter counts as HF reports them, tied
    embeddings counted once) and plan under the shard budget with an ANE-sized LM head."""
    c = PRESETS[name].to_config()
    assert (c.arch, c.vocab_size) == (arch, vocab)
    assert c.num_parameters() == params
    ranges = plan_topology(c, "int8-channel", 2000)
    check_budget(ranges, c, "int8-channel", 2000)
    assert ranges[-1][1] == c.num_layers
    assert min_head_chunks(vocab) <= 4  # the default head split stays under the channel limit
    assert -(-vocab // 4) <= MAX_HEAD_CHANNELS


def test_head_chunks_over_the_channel_limit_are_refused(tmp_path: Path) -> None:
    assert min_head_chunks(200064) == 4 and min_head_chunks(151936) == 4
    assert min_head_chunks(128256) == 3 and min_head_chunks(1031) == 1
    # A 100,040-token vocabulary on a 64-wide model: one or two chunks would be too wide.
    wide = write_synthetic_gguf(tmp_path / "wide.gguf", SyntheticSpec(
        arch="qwen2", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, ffn_size=64,
        vocab_size=100_040))
    with pytest.raises(BuildError, match="up to 100,040 channels, over the 50,016 .*at least 3"):
        build(wide, tmp_path / "out", BuildRequest(max_seq=32, head_chunks=1))
    with pytest.raises(BuildError, match="up to 50,020 channels.*at least 3"):
        build(wide, tmp_path / "out", BuildRequest(max_seq=32, head_chunks=2))


# -- tokenizers -------------------------------------------------------------------------------------

def test_family_tokenizers(conditioned: dict[str, Path]) -> None:
    llama = Tokenizer.from_data(open_gguf(conditioned["llama"]).tokenizer_data)
    qwen = Tokenizer.from_data(open_gguf(conditioned["qwen3"]).tokenizer_data)
    text = "They'LL pay 1234567 now"
    assert llama.pre_tokenize(text) == ["They", "'LL", " pay", " ", "123", "456", "7", " now"]
    assert qwen.pre_tokenize(text) == ["They", "'LL", " pay", " ", "1", "2", "3", "4", "5", "6",
                                       "7", " now"]
    # On ASCII text llama.cpp's adapted patterns and the tokenizer.json ones (as HF runs them)
    # cut the same words.
    for data in (llama.data, qwen.data):
        hf = Tokenizer.from_data(data, split="hf")
        for sample in (text, "x = f(a, b) # 99 bottles\n\n  of beer's  ", "DON'T  stop\t\t"):
            assert hf.pre_tokenize(sample) == Tokenizer.from_data(data).pre_tokenize(sample)
    ids = llama.encode("hi", add_special=True)
    assert ids[0] == llama.id_of("<|begin_of_text|>") and llama.data.add_bos_token
    assert qwen.encode("hi", add_special=True) == qwen.encode("hi")  # Qwen adds no BOS
    eog = {llama.token_text(i) for i in llama.eog_ids}
    assert eog == {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"}
    eog = {qwen.token_text(i) for i in qwen.eog_ids}
    assert eog == {"<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
    # FIM tokens are forced to CONTROL (only parsed with special=True); think tags stay
    # USER_DEFINED and are recognised in any text.
    assert qwen.encode("<|fim_prefix|>") != [qwen.id_of("<|fim_prefix|>")]
    assert qwen.encode("<think>") == [qwen.id_of("<think>")]


def test_llama3_ignores_merges_for_whole_words(conditioned: dict[str, Path]) -> None:
    """llama.cpp's LLAMA3 pre-tokenizer emits a word that is itself a token without merging it
    up, even where the merge ranks would build it differently."""
    data = open_gguf(conditioned["llama"]).tokenizer_data
    tok = Tokenizer.from_data(data)
    merged = Tokenizer.from_data(data.model_copy(update={"pre": "qwen2"}))
    differ = 0
    for i, text in enumerate(data.tokens):
        if data.token_types[i] != 1 or len(text) < 3:
            continue
        try:
            word = tok.token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:  # part of a multi-byte character
            continue
        if tok.pre_tokenize(word) != [word]:
            continue
        assert tok.encode(word) == [i]
        differ += merged.encode(word) != [i]
    assert differ > 0, "no token in this vocabulary exercises ignore_merges"


def test_prompts_get_bos_as_llama_cpp_adds_it(chaotic_builds: dict[str, Path]) -> None:
    """Llama 3 prompts start with exactly one BOS, also when its chat template writes one
    (llama.cpp strips the template's); Qwen prompts get none."""
    from ane_spec.decode.generate import prompt_tokens
    from ane_spec.model.chat import render_chat_pieces

    chat = [{"role": "user", "content": "hi"}]
    llama = open_pipeline(chaotic_builds["llama"], "mil", "fp32")[1]
    tok = llama.tokenizer
    assert prompt_tokens(llama, prompt="hi") == [tok.bos_token_id] + tok.encode("hi")
    ids = prompt_tokens(llama, messages=chat)
    assert ids[:2] == [tok.bos_token_id, tok.id_of("<|start_header_id|>")]
    assert tok.id_of("<|eot_id|>") in ids
    # The daemon's path: template markup and message text as pieces, the same single BOS.
    pieces = render_chat_pieces(chat, template=tok.data.chat_template, add_bos=True,
                                bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    assert tok.encode_pieces(pieces, add_special=True) == ids
    qwen = open_pipeline(chaotic_builds["qwen2"], "mil", "fp32")[1]
    assert prompt_tokens(qwen, prompt="hi") == qwen.tokenizer.encode("hi")
    ids = prompt_tokens(qwen, messages=chat)
    assert ids[0] == qwen.tokenizer.id_of("<|im_start|>")
    # Qwen 2.5's template adds its default system turn.
    assert qwen.tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_the_daemon_serves_a_llama_build(chaotic_builds: dict[str, Path]) -> None:
    """The OpenAI server on a real loopback socket, unchanged, over a Llama 3 build: chat and
    completion prompts get one BOS, and the text is what greedy decoding of them gives."""
    import openai

    from ane_spec.daemon.config import ServeConfig
    from ane_spec.daemon.server import BackgroundServer
    from ane_spec.decode.generate import prompt_tokens
    from tests.test_daemon import wait_ready

    art = chaotic_builds["llama"]
    config = ServeConfig(manifest=art, port=0, backend="mil", precision="fp32",
                         log_level="warning", access_log=False)
    chat = [{"role": "user", "content": "hi there"}]
    with BackgroundServer(config) as srv:
        wait_ready(srv.url)
        pipeline = open_pipeline(art, "mil", "fp32")[1]
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        for kind, prompt in (("chat", prompt_tokens(pipeline, messages=chat)),
                             ("text", prompt_tokens(pipeline, prompt="def f(x):"))):
            ref = DecodeSession(pipeline).generate(
                prompt, GenerateOptions(max_tokens=12, speculative=False))
            if kind == "chat":
                r = client.chat.completions.create(model="any", messages=chat, max_tokens=12)
                text = r.choices[0].message.content
            else:
                r = client.completions.create(model="any", prompt="def f(x):", max_tokens=12)
                text = r.choices[0].text
            assert prompt.count(pipeline.tokenizer.bos_token_id) == 1
            assert r.usage.prompt_tokens == len(prompt) and text == ref.text
        # Tool calls in Llama 3's own format: tests/test_tool_formats.py.


def test_a_new_architecture_is_one_description(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """Reader, writer, reference and compiler are driven by the description alone: a made-up
    family mixing every quirk (NORM RoPE over part of each head with rope_freqs, q/k/v biases,
    per-head q/k norms, fused gate|up) needs only its Architecture to build and run exactly.
    It also covers the NORM row reordering of biases and norm weights, which no real family
    needs."""
    hybrid = Architecture(name="hybrid", title="test only", rope_type="norm", fused_qkv=False,
                          fused_gate_up=True, qkv_bias=True, qk_norm=True,
                          rope_factors="freqs", partial_rotary=True, vocab_family="llama3")
    monkeypatch.setitem(ARCHITECTURES, "hybrid", hybrid)
    gguf = write_synthetic_gguf(tmp_path / "hybrid.gguf", SyntheticSpec(
        arch="hybrid", hidden_size=160, num_layers=2, num_heads=5, num_kv_heads=1, ffn_size=352,
        vocab_size=1031, rope_dims=16, rope_freqs=True, original_context_length=64,
        embed_std=1.0, branch_scale=1.0))
    m = open_gguf(gguf)
    assert m.tensors["blk.0.ffn_up.weight"].shape == (704, 160)
    assert {"blk.0.attn_q.bias", "blk.0.attn_k_norm.weight", "rope_freqs.weight"} <= set(m.tensors)
    assert "blk.0.ffn_gate.weight" not in m.tensors and m.config.rope_dims == 16
    build(gguf, tmp_path / "art", BuildRequest(topology="2", max_seq=S))
    for precision in ("fp32", "fp16"):
        loaded, pipeline = open_pipeline(tmp_path / "art", "mil", precision)
        parity = run_parity(loaded, pipeline, m, lengths=(3, 17), decode_steps=4)
        print(precision, parity.summary())
        assert parity.passed and parity.figures["gguf_min_cosine"] >= 0.999
    assert parity.figures["argmax_agreement"] == 1.0


def test_templates_get_strftime_now() -> None:
    """Llama 3.x templates call strftime_now when it is defined, as HF and llama.cpp define it."""
    import datetime

    from ane_spec.model.chat import render_chat

    template = ("{% if strftime_now is defined %}{{ strftime_now('%Y') }}{% else %}2024"
                "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    text = render_chat([{"role": "user", "content": "!"}], template=template)
    assert text == f"{datetime.date.today().year}!"
