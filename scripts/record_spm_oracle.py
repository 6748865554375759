"""Record llama.cpp's tokenizations of a few hundred varied texts on the SentencePiece
vocabularies of llama.cpp's own test material, for the suite to check against without llama.cpp
installed (tests/test_spm_oracle.py).

    python scripts/record_spm_oracle.py --llama-python /path/to/venv/bin/python \\
        [--out tests/data/spm_oracle.json]

`--llama-python`: an interpreter with `llama-cpp-python` (the README says how to build one);
llama.cpp runs there, in a child process per vocabulary (its native code can crash), while this
process (the project's interpreter) finds the vocabularies: `models/ggml-vocab-*.gguf` of the
llama-cpp-python sdist, fetched and checked as tests/llama_cpp_source.py does. Every vocabulary
there whose `tokenizer.ggml.model` is `llama` is recorded: llama-spm (LLaMA's 32k), phi-3 (the
same plus Phi-3's specials, stripped by name) and baichuan (64k, CJK-heavy; it has no .inp/.out
cases of its own).

Two modes, as `llama_tokenize(text, add_special, parse_special)`: `plain` (False, False: what
test-tokenizer-0 runs) for every text, and `special` (True, True: a prompt) where it differs from
BOS + `plain`. The file records each vocabulary's sha256, the sdist's, and llama-cpp-python's
version, so a test can tell a changed input from a changed tokenizer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
OUT = ROOT / "tests" / "data" / "spm_oracle.json"
SEED = 36

# Written out: what a merge or the text around it has to get right.
FIXED = [
    "Hello, world! It's a test.",
    " leading space", "  two leading spaces", "trailing spaces   ", "   ", " ", "a",
    "multiple   spaces    between     words",
    "line one\nline two\r\nline three\n\n\nend   \n",
    "\ttabs\tand\t\tmore tabs", "\n\nleading newlines", "x\u00a0nbsp\u2009thin\u3000ideographic",
    "They'll say I'M sure you've WE'D it's DON'T",
    "antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
    "internationalization localization tokenization unbelievably",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "ababababababababab", "the the the the the",
    "    ", "________", "--------", "========", "........", "!!!???", "1111111111",
    "numbers 1 12 123 1234 12345 3.14159 -42 1e10 2026-11-21 0x1F",
    "naïve café résumé façade Ærøskøbing São Paulo ÉCOLE aÉb",
    "Straße über schön Größe Ölförderung", "Привет, мир! Как дела?",
    "中文测试，日本語のテキスト、한국어 텍스트 नमस्ते", "你好世界，我爱编程。北京欢迎你",
    "مرحبا بالعالم", "שלום עולם", "Γειά σου Κόσμε", "ภาษาไทย", "Tiếng Việt có dấu",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 ∑∫∂√∞ ≤≥≠",
    "control \x01\x02\x1b[0m \x7f chars", "▁already▁escaped▁text", "▁", "▁▁ ▁",
    "def f(x):\n    return x ** 2  # square\n",
    "class A(object):\n\tdef __init__(self, *args, **kwargs):\n\t\tsuper().__init__()\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "SELECT name, COUNT(*) FROM users WHERE age > 21 GROUP BY name;",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "<html><body><p class=\"x\">Hi &amp; bye</p></body></html>",
    "https://example.com/a?b=c&d=e#f and someone@example.org",
    "<s> begins, </s> ends, <unk> is unknown",
    "<s>[INST] Hello [/INST] Hi</s><s>[INST] again [/INST]",
    "<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n4<|end|>\n<|endoftext|>",
    "<|system|> You are helpful.<|end|><|user|>  Hi  <|end|><|assistant|>",
    "text <|placeholder1|> more <|notatoken|> <|end", "<<<>>> <|<|>|> <s<s>>",
]

WORDS = (
    "the of and to in is was for that with as on by at from it this be are an or have not "
    "which but they his her their one all would there been has were when who will more no if "
    "out so said what up its about into than them can only other new some could time these "
    "two may then do first any my now such like our over man me even most made after also "
    "did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work "
    "long get here between both life being under never day same another know while last "
    "might us great old year off come since against go came right used take three tokenizer "
    "sentencepiece merging vocabulary unbelievable misunderstanding counterrevolutionary "
    "photosynthesis thermodynamics extraordinarily responsibilities hippopotamus "
    "quizzical jukebox zephyr syzygy rhythm crwth llama phi baichuan transformer attention"
).split()
FOREIGN = ("café naïve Zürich façade Ångström jalapeño piñata coöperate über Straße "
           "Москва спасибо привет 北京 上海 谢谢 你好 東京 ありがとう カタカナ 서울 감사합니다 "
           "नमस्ते धन्यवाद مرحبا شكرا Ελλάδα ευχαριστώ ไทย ขอบคุณ 😀 🎉 👍🏽 🇯🇵 ∑ √ ∞ € £ ¥ "
           "°C ½ ¾ ™ © ® ‰ • … — – “quoted” ‘single’ «guillemets»").split()
CODE = ("def class return import from if else elif while for in lambda yield async await "
        "self None True False == != <= >= += -= ** // -> => { } ( ) [ ] ; : , . :: && || ! "
        "#include <stdio.h> printf(\"%d\\n\", x); std::vector<int> console.log() $HOME "
        "~/path/to/file.txt C:\\Windows\\System32 0xDEADBEEF 1_000_000 3.14e-10 x_1 __init__"
        ).split(" ")
SPECIALS = ("<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>",
            "<|endoftext|>", "<|placeholder2|>")
GAPS = (" ", " ", " ", " ", "  ", "   ", "\n", "\n\n", "\t", " \n", "", ", ", ". ")


def generated(rng: random.Random, count: int) -> list[str]:
    """Texts from word pools with varied gaps: words, foreign scripts and symbols, code, now
    and then a special token's text, and runs over a tiny alphabet (score ties)."""
    out: list[str] = []
    while len(out) < count:
        kind = rng.random()
        if kind < 0.1:
            out.append("".join(rng.choice("ab ") for _ in range(rng.randint(1, 24))))
            continue
        parts = []
        for _ in range(rng.randint(1, 10)):
            pool = rng.random()
            word = (rng.choice(FOREIGN) if pool < 0.2 else rng.choice(CODE) if pool < 0.35
                    else rng.choice(SPECIALS) if pool < 0.4 else rng.choice(WORDS))
            if rng.random() < 0.15:
                word = word.capitalize() if rng.random() < 0.5 else word.upper()
            parts.append(word + rng.choice(GAPS))
        text = "".join(parts)
        if rng.random() < 0.2:
            text = rng.choice(GAPS) + text
        out.append(text)
    return out


def texts() -> list[str]:
    out = list(FIXED)
    for text in generated(random.Random(SEED), 300 - len(FIXED)):
        if text not in out:
            out.append(text)
    return out


# -- llama.cpp, in a child process of the llama-cpp-python interpreter -------------------------

def _worker(gguf: str, job: dict) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, vocab_only=True, verbose=False)
    return {"version": llama_cpp.__version__,
            "bos": llm.tokenize(b"", add_bos=True, special=True),
            "plain": [llm.tokenize(t.encode(), add_bos=False, special=False)
                      for t in job["texts"]],
            "special": [llm.tokenize(t.encode(), add_bos=True, special=True)
                        for t in job["texts"]]}


def call(python: str, gguf: Path, job: dict) -> dict:
    proc = subprocess.run([python, str(HERE), "worker", str(gguf)], input=json.dumps(job),
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp worker exited with {proc.returncode}: "
                           f"{proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the table --------------------------------------------------------------------------------

def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def spm_vocabularies(models: Path) -> list[Path]:
    from ane_spec.model.gguf_format import read_gguf

    return [p for p in sorted(models.glob("ggml-vocab-*.gguf"))
            if read_gguf(str(p), p.name).metadata.get("tokenizer.ggml.model") == "llama"]


def dump(doc: dict) -> str:
    """JSON with one text or one id list a line: small, and a diff shows what changed."""
    lines = ["{"]
    for key in ("about", "llama_cpp_python", "sdist", "sdist_sha256", "modes"):
        lines.append(f" {json.dumps(key)}: {json.dumps(doc[key], ensure_ascii=False)},")
    lines.append(' "texts": [')
    lines.append(",\n".join("  " + json.dumps(t, ensure_ascii=False) for t in doc["texts"]))
    lines.append(" ],")
    lines.append(' "vocabularies": {')
    blocks = []
    for name, v in doc["vocabularies"].items():
        block = [f"  {json.dumps(name)}: {{",
                 f'   "file": {json.dumps(v["file"])}, "sha256": {json.dumps(v["sha256"])},',
                 f'   "bos": {json.dumps(v["bos"])},',
                 '   "plain": [',
                 ",\n".join("    " + json.dumps(ids, separators=(",", ":"))
                            for ids in v["plain"]),
                 "   ],",
                 '   "special": {',
                 ",\n".join(f"    {json.dumps(k)}: {json.dumps(ids, separators=(',', ':'))}"
                            for k, ids in v["special"].items()),
                 "   }",
                 "  }"]
        blocks.append("\n".join(block))
    lines.append(",\n".join(blocks))
    lines.append(" }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def record(python: str, out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.llama_cpp_source import SDIST, SDIST_SHA256, VERSION, llama_cpp_tree

    tree = llama_cpp_tree()
    all_texts = texts()
    doc: dict = {
        "about": "llama.cpp's token ids for `texts` on the SentencePiece vocabularies of its "
                 "own test material (scripts/record_spm_oracle.py)",
        "llama_cpp_python": None, "sdist": SDIST, "sdist_sha256": SDIST_SHA256,
        "modes": {"plain": "llama_tokenize(add_special=false, parse_special=false), every text",
                  "special": "llama_tokenize(add_special=true, parse_special=true), by text "
                             "index, where it is not `bos` followed by plain"},
        "texts": all_texts, "vocabularies": {}}
    for path in spm_vocabularies(tree / "models"):
        name = path.name[len("ggml-vocab-"):-len(".gguf")]
        print(f"{name}: tokenizing {len(all_texts)} texts", flush=True)
        got = call(python, path, {"texts": all_texts})
        if got["version"] != VERSION:
            raise SystemExit(f"{python} has llama-cpp-python {got['version']}, the sdist is "
                             f"{VERSION}: record with the same version")
        doc["llama_cpp_python"] = got["version"]
        bos = got["bos"]  # what add_special puts before an empty text
        special = {str(k): ids for k, (ids, plain) in enumerate(zip(got["special"],
                                                                    got["plain"]))
                   if ids != bos + plain}
        doc["vocabularies"][name] = {"file": path.name, "sha256": sha256(path), "bos": bos,
                                     "plain": got["plain"], "special": special}
        print(f"{name}: {sum(map(len, got['plain']))} ids, {len(special)} texts differ "
              "with specials parsed", flush=True)
    out.write_text(dump(doc), encoding="utf-8")
    json.loads(out.read_text(encoding="utf-8"))  # what was written reads back
    print(f"wrote {out} ({out.stat().st_size / 1024:.1f} KiB)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        print(json.dumps(_worker(sys.argv[2], json.loads(sys.stdin.read()))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", required=True,
                        help="an interpreter that can import llama_cpp (llama-cpp-python)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    record(args.llama_python, args.out)


if __name__ == "__main__":
    main()
