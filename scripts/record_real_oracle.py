"""Record llama.cpp's answers for a real catalog model, for the suite to check against without
llama.cpp installed (tests/test_real_models.py).

    python scripts/record_real_oracle.py smollm2-135m-instruct [--out tests/data/real_models]

Needs `llama-cpp-python` (built as the README says). For the model's GGUF (the file as
downloaded, through `ane-spec pull`'s resolver) it writes `NAME.json` and `NAME.logits.npz`:

1. tokenization: llama.cpp's ids for varied texts, special-token parsing on and off;
2. a chat turn: the file's own chat template renders CHAT[NAME]; llama.cpp tokenizes it (specials
   parsed) and continues it greedily on an F32 copy of the file; the whole sequence is then
   scored by llama.cpp twice, on the F32 copy (the file's own values dequantized by llama.cpp's
   quantizer, `llama_model_quantize` to ALL_F32) and on the file itself. For each position the
   top-K log-probabilities are kept with the probability mass outside them, so KL and top-1
   agreement can be computed later without storing 150k-wide rows;
3. the file's own distance from its F32 copy (top-1 agreement, KL per position): what the
   file's quantization costs before this project requantizes anything.

llama.cpp runs in child processes (its native code can crash). KL(P || Q) from top-K rows: the
K kept entries of P plus one bucket for the rest; by the log-sum inequality this is a lower
bound of the full KL, short by at most the rest's own KL, which is negligible while the rest's
mass is small: the file records it and the test checks it is below 1e-3 everywhere.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
N_CTX = 512
REPLY_TOKENS = 64

TEXTS = [
    "Hello, world! It's a test.",
    "   leading spaces and    runs of   whitespace\t\ttabs",
    "numbers 1 12 123 1234 12345 3.14159 -42 1e10 2026-11-21 0x1F",
    "They'll say I'M sure you've WE'D it's DON'T",
    "naïve café résumé façade Ærøskøbing São Paulo ÉCOLE aÉb",
    "中文测试，日本語のテキスト、한국어 텍스트 नमस्ते",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "line one\nline two\r\nline three\n\n\nend   \n",
    "def f(x):\n    return x ** 2  # square\n",
    "class A(object):\n\tdef __init__(self, *args, **kwargs):\n\t\tsuper().__init__()\n",
    '"""Docstring with `code`, **bold** and a URL: https://docs.python.org/3/."""',
    "x = {'a': [1, 2, 3], \"b\": (4, 5)}; y = x['a'][-1] >> 2 | 0b1010 & ~0o17",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "mixed <|endoftext|> special <|im_end|> tokens <tool_call>{}</tool_call> <|fim_prefix|>",
    "<|notaspecial|> <|im_end <|im_start|",
    "Ünïcödé   \u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "3.14 vs 3,14 vs ３．１４ and 1,000,000",
    "URL: https://example.com/a?b=c&d=e#f and e-mail someone@example.org",
]

# Chat turns: the positions that write the assistant's reply are the ones compared.
CHAT = {
    "smollm2-135m-instruct": [
        [{"role": "user", "content": "Explain in three sentences why the sky is blue."}],
        [{"role": "user", "content": "Give me three tips for writing clear emails."}],
    ],
    "qwen2.5-coder-0.5b-instruct": [
        [{"role": "user",
          "content": "Write a Python function that checks whether a string is a palindrome."}],
        [{"role": "user", "content": "What does the `yield` keyword do in Python? Be brief."}],
    ],
}
# Kept per row: every entry within KEEP_NATS of the row's best. What falls outside is one bucket
# whose mass the file records: below e^-16 of the best, 150k entries hold at most 1.7e-2 of the
# mass in theory and far less in practice (the recorder prints the worst row's).
KEEP_NATS = 16.0


# -- llama.cpp, in a child process --------------------------------------------------------------

def _worker(kind: str, gguf: str, job: dict) -> dict:
    import llama_cpp

    if kind == "f32":
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
        params.allow_requantize = True
        params.nthread = 2
        rc = llama_cpp.llama_model_quantize(gguf.encode(), job["out"].encode(), params)
        return {"rc": int(rc)}
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=N_CTX, n_batch=N_CTX, logits_all=True,
                          verbose=False, n_threads=2, seed=0)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    if kind == "tokenize":
        return {"special": [llm.tokenize(t.encode(), add_bos=False, special=True)
                            for t in job["texts"]],
                "plain": [llm.tokenize(t.encode(), add_bos=False, special=False)
                          for t in job["texts"]],
                "prompts": [llm.tokenize(p.encode(), add_bos=job["add_bos"], special=True)
                            for p in job["prompts"]]}
    if kind == "greedy":
        llm.reset()
        llm.eval(job["ids"])
        out = []
        for _ in range(job["max_tokens"]):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out.append(tok)
            if llama_cpp.llama_vocab_is_eog(vocab, tok):
                break
            llm.eval([tok])
        return {"reply": out}
    if kind == "score":
        llm.reset()
        llm.eval(job["ids"])
        logits = np.asarray(llm.scores[:len(job["ids"])], dtype=np.float64)
        np.save(job["out"], logits.astype(np.float32))
        return {"rows": len(logits)}
    raise SystemExit(f"unknown worker kind {kind!r}")


def call(kind: str, gguf: Path, job: dict, timeout: float = 1800) -> dict:
    proc = subprocess.run([sys.executable, str(HERE), "worker", kind, str(gguf)],
                          input=json.dumps(job), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp {kind} worker exited with {proc.returncode}: "
                           f"{proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- summaries ----------------------------------------------------------------------------------

def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def sparse_rows(logits: np.ndarray) -> dict[str, np.ndarray]:
    """Each row's log-probabilities within KEEP_NATS of its best, as CSR arrays (offsets, ids,
    fp16 log-probs: 2^-6 nat steps at -16..-32, far below the figures compared), plus the mass
    of the rest of the row."""
    lp = log_softmax(logits)
    keep = lp >= lp.max(-1, keepdims=True) - KEEP_NATS
    rows, ids = np.nonzero(keep)
    counts = keep.sum(-1)
    return {"offsets": np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            "ids": ids.astype(np.int32), "logprobs": lp[rows, ids].astype(np.float16),
            "rest": np.clip(1.0 - (np.exp(lp) * keep).sum(-1), 0.0, 1.0).astype(np.float32)}


def sparse_kl(p: dict[str, np.ndarray], q_logits: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row, P sparse (its rest as one bucket), Q full logits. By the log-sum
    inequality this is at most the full KL, short by rest_P x KL of the two rests' shapes."""
    lq = log_softmax(q_logits)
    out = np.empty(len(q_logits))
    for r in range(len(q_logits)):
        a, b = p["offsets"][r], p["offsets"][r + 1]
        ids, lp = p["ids"][a:b], p["logprobs"][a:b].astype(np.float64)
        pk = np.exp(lp)
        kl = float((pk * (lp - lq[r, ids])).sum())
        rest_p = float(p["rest"][r])
        rest_q = max(1.0 - float(np.exp(lq[r, ids]).sum()), 1e-300)
        if rest_p > 0:
            kl += rest_p * (np.log(rest_p) - np.log(rest_q))
        out[r] = kl
    return out


def kl_rows(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """Exact KL(P || Q) per row, from full logits."""
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def render(messages: list[dict], template: str) -> str:
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token="", eos_token="")


def record(name: str, gguf: Path, out: Path) -> dict:
    import llama_cpp
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    template = reader.fields["tokenizer.chat_template"].contents()
    add_bos_field = reader.fields.get("tokenizer.ggml.add_bos_token")
    add_bos = bool(add_bos_field.contents()) if add_bos_field is not None else False
    prompts = [render(chat, template) for chat in CHAT[name]]
    print(f"{name}: tokenizing {len(TEXTS)} texts and {len(prompts)} chat prompts", flush=True)
    tok = call("tokenize", gguf, {"texts": TEXTS, "prompts": prompts, "add_bos": add_bos})
    turns, rows = [], {"f32": [], "file": []}
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        f32 = Path(tmp) / "f32.gguf"
        print(f"{name}: writing an F32 copy with llama.cpp's quantizer", flush=True)
        if call("f32", gguf, {"out": str(f32)})["rc"] != 0:
            raise RuntimeError("llama_model_quantize to F32 failed")
        for chat, text, prompt in zip(CHAT[name], prompts, tok["prompts"]):
            reply = call("greedy", f32, {"ids": prompt, "max_tokens": REPLY_TOKENS})["reply"]
            ids = prompt + reply
            # the rows that write the reply: from the prompt's last token to the reply's last
            first = len(prompt) - 1
            turns.append({"chat": chat, "prompt_text": text, "prompt_ids": prompt,
                          "reply_ids": reply, "first_row": first})
            for label, path in (("f32", f32), ("file", gguf)):
                npy = Path(tmp) / f"{label}.npy"
                call("score", path, {"ids": ids, "out": str(npy)})
                rows[label].append(np.load(npy)[first:first + len(reply)])
            print(f"{name}: turn of {len(prompt)} + {len(reply)} tokens scored", flush=True)
    logits = {label: np.concatenate(r) for label, r in rows.items()}
    arrays, summary = {}, {}
    for label, full in logits.items():
        sparse = sparse_rows(full)
        arrays |= {f"{label}_{k}": v for k, v in sparse.items()}
        summary[f"{label}_max_rest_mass"] = float(sparse["rest"].max())
    kl = kl_rows(logits["f32"], logits["file"])
    kl_sparse = sparse_kl({k[4:]: v for k, v in arrays.items() if k.startswith("f32_")},
                          logits["file"])
    agree = logits["f32"].argmax(-1) == logits["file"].argmax(-1)
    summary |= {"rows": int(len(kl)), "file_vs_f32_top1": float(agree.mean()),
                "file_vs_f32_kl_mean": float(kl.mean()), "file_vs_f32_kl_max": float(kl.max()),
                "file_vs_f32_kl_mean_from_stored_rows": float(kl_sparse.mean())}
    np.savez_compressed(out / f"{name}.logits.npz", **arrays)
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    doc = {"model": name, "gguf_sha256": digest.hexdigest(),
           "llama_cpp_python": llama_cpp.__version__, "keep_nats": KEEP_NATS,
           "texts": TEXTS, "tokens_special": tok["special"], "tokens_plain": tok["plain"],
           "add_bos": add_bos, "turns": turns, "summary": summary}
    (out / f"{name}.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    return summary


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        job = json.loads(sys.stdin.read())
        print(json.dumps(_worker(sys.argv[2], sys.argv[3], job)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", choices=sorted(CHAT))
    parser.add_argument("--gguf", type=Path, help="the file, when not resolved through the cache")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "real_models")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names:
        if args.gguf is not None:
            path = args.gguf
        else:
            from ane_spec.model.resolve import resolve_model

            path = resolve_model(name)
        summary = record(name, path, args.out)
        print(json.dumps({name: summary}, indent=1))


if __name__ == "__main__":
    main()
