"""Token streams for the drafter replay bench: built from real text on any machine, or JSONL.

A stream is (family, prompt ids, output ids): what a request fed the model and what greedy
decoding then emitted. A model-free drafter only sees token ids, so any realistic text with the
right kind of repetition measures it; the built-in streams are made from the running Python's own
standard library (source files and docstrings), so they need no download and no model:

* ``code``: a contiguous slice of a stdlib source file as the prompt and the next lines of the
  same file as the output (identifiers, idioms and boilerplate repeat).
* ``code-edit``: "rename this identifier" over one stdlib function; the output is the function
  again with the name changed, the prime case for prompt lookup.
* ``quote``: a module's docstrings as a document plus a question; the output quotes sentences
  and clauses from it, joined by a few new words.
* ``structured``: JSON-lines or CSV records describing stdlib functions (repeated keys, new
  values); the prompt holds examples, the output the records of further functions.
* ``chat``: a multi-turn transcript (Phi-4-mini chat markers) about stdlib functions whose last
  assistant turn summarises earlier answers, reusing their phrases.

The last three families (``agent-loop``, ``file-edits``, ``chat-recall``) come in sessions of
requests where a later output repeats what an earlier request saw or wrote: see
`ane_spec.bench.session_streams`. Replay a family's streams in order to measure a drafter that
remembers earlier requests.

The outputs are constructed, not sampled from a model: they show how a drafter ranks on each kind
of overlap, not what acceptance a given model will reach. Selection is deterministic for a given
Python installation, across processes (seeded `random.Random`, sorted names, no object
addresses); another Python version has other stdlib text and so slightly different streams.
Text is tokenized with the synthetic byte-level BPE (`build_synthetic_vocab(4096)`), whose few
merges give long token streams (about 2.1 characters per token).

JSONL: one object per line, ``{"family": str, "prompt": [int], "output": [int]}``.
"""

from __future__ import annotations

import csv
import importlib
import inspect
import io
import json
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ane_spec.errors import AneSpecError
from ane_spec.model.tokenizer import Tokenizer
from ane_spec.model.vocab import build_synthetic_vocab

__all__ = [
    "FAMILIES", "Stream", "builtin_streams", "builtin_texts", "load_streams", "save_streams",
    "stdlib_token_history", "synthetic_tokenizer",
]

FAMILIES = ("code", "code-edit", "quote", "structured", "chat", "agent-loop", "file-edits",
            "chat-recall")

# Modules present in every CPython >= 3.10 with plenty of source and prose.
_MODULES = (
    "argparse", "calendar", "configparser", "csv", "dataclasses", "difflib", "fractions",
    "heapq", "ipaddress", "json.decoder", "pprint", "shlex", "statistics", "string",
    "textwrap", "tokenize",
)
# Modules whose docstrings hold enough prose to quote from and to chat about.
_DOC_MODULES = (
    "base64", "calendar", "cmd", "configparser", "difflib", "doctest", "ftplib", "http.client",
    "inspect", "logging", "pathlib", "platform", "subprocess", "tarfile", "threading",
    "traceback", "urllib.parse", "zipfile",
)


@dataclass(frozen=True)
class Stream:
    """One replayed request: the prompt the drafter is reset with and the tokens decoding emits."""

    family: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]

    def to_json(self) -> dict:
        return {"family": self.family, "prompt": list(self.prompt), "output": list(self.output)}


@lru_cache(maxsize=1)
def synthetic_tokenizer() -> Tokenizer:
    """The tokenizer the built-in streams use: synthetic byte-level BPE, 4096 tokens."""
    return Tokenizer.from_data(build_synthetic_vocab(4096))


# -- real text from the standard library ----------------------------------------------------------

@lru_cache(maxsize=None)
def _source(module: str) -> str:
    try:
        return inspect.getsource(importlib.import_module(module))
    except (ImportError, OSError, TypeError) as exc:  # a Python shipped without sources
        raise AneSpecError(f"built-in streams need the source of stdlib module {module}: {exc}")


@lru_cache(maxsize=None)
def _functions(module: str) -> tuple[tuple[str, object], ...]:
    """Public functions and methods defined in `module`, sorted by qualified name."""
    mod = importlib.import_module(module)
    found: list[tuple[str, object]] = []
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_"):
            continue
        if inspect.isfunction(obj) and obj.__module__ == mod.__name__:
            found.append((name, obj))
        elif inspect.isclass(obj) and obj.__module__ == mod.__name__:
            for meth_name, meth in sorted(vars(obj).items()):
                if inspect.isfunction(meth) and (not meth_name.startswith("_")
                                                 or meth_name == "__init__"):
                    found.append((f"{name}.{meth_name}", meth))
    return tuple(found)


def _doc(obj: object) -> str:
    return inspect.getdoc(obj) or ""


def _params(fn: object) -> list[str]:
    try:
        params = inspect.signature(fn).parameters  # type: ignore[arg-type]
        return [p for p in params if p != "self"]
    except (TypeError, ValueError):
        return []


def _sentences(text: str) -> list[str]:
    flat = re.sub(r"\s+", " ", text).strip()
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z`\"'(])", flat)
    return [p for p in parts if 30 <= len(p) <= 400]


def _line_window(src: str, start: int, length: int) -> tuple[int, int]:
    """[a, b) covering about `length` chars from `start`, on line boundaries."""
    a = src.rfind("\n", 0, start) + 1
    b = src.find("\n", min(len(src), a + length))
    return a, (len(src) if b < 0 else b + 1)


_CONNECTIVES = (
    "The document says:", "According to the text,", "It also states that", "In particular,",
    "Quoting directly:", "A related passage reads:", "Further on, it explains that",
    "The relevant part is this:", "Another point made is that", "Finally, it notes:",
)


def _code_text(rng: random.Random, i: int, seed: int) -> tuple[str, str]:
    module = _MODULES[(i * 7 + seed) % len(_MODULES)]
    src = _source(module)
    prompt_chars, output_chars = 6000, 1600
    if len(src) < prompt_chars + output_chars:
        prompt_chars = len(src) * 3 // 4
        output_chars = len(src) - prompt_chars
    start = rng.randrange(0, max(1, len(src) - prompt_chars - output_chars))
    a, b = _line_window(src, start, prompt_chars)
    _, c = _line_window(src, b, output_chars)
    header = f"# Continue this excerpt of the Python standard library module {module}.\n"
    return header + src[a:b], src[b:c]


def _rename_target(src: str, fn: object) -> str | None:
    """The parameter used most often in the body (>= 3 uses), if any."""
    best, best_uses = None, 2
    for p in _params(fn):
        uses = len(re.findall(rf"\b{re.escape(p)}\b", src))
        if uses > best_uses:
            best, best_uses = p, uses
    return best


def _code_edit_text(rng: random.Random, i: int, seed: int) -> tuple[str, str]:
    cands = _edit_candidates()
    module, name, fn = cands[rng.randrange(len(cands))]
    src = inspect.cleandoc("\n" + inspect.getsource(fn)) + "\n"  # type: ignore[arg-type]
    old = _rename_target(src, fn) or "x"
    new = rng.choice(("{}_value", "the_{}", "{}_arg", "input_{}")).format(old)
    edited = re.sub(rf"\b{re.escape(old)}\b", new, src)
    prompt = (f"<|user|>In this function from {module}, rename the parameter `{old}` to `{new}` "
              f"and return the whole function.\n```python\n{src}```<|end|><|assistant|>")
    output = f"Here is `{name}` with `{old}` renamed to `{new}`:\n```python\n{edited}```<|end|>"
    return prompt, output


@lru_cache(maxsize=1)
def _edit_candidates() -> tuple[tuple[str, str, object], ...]:
    """(module, name, function) of stdlib functions of 500-3500 chars with a renameable
    parameter, in module then name order."""
    cands = []
    for module in _MODULES:
        for name, fn in _functions(module):
            try:
                src = inspect.getsource(fn)  # type: ignore[arg-type]
            except (OSError, TypeError):
                continue
            if 500 <= len(src) <= 3500 and _rename_target(src, fn):
                cands.append((module, name, fn))
    if not cands:
        raise AneSpecError("built-in streams: no stdlib function suitable for a rename edit")
    return tuple(cands)


def _document(module: str, limit: int = 7000) -> str:
    mod = importlib.import_module(module)
    parts = [f"{module}\n\n{_doc(mod)}"] if _doc(mod) else [module]
    for name, fn in _functions(module):
        d = _doc(fn)
        if len(d) > 80:
            parts.append(f"{name}{_signature(fn)}\n{d}")
        if sum(len(p) for p in parts) > limit:
            break
    return "\n\n".join(parts)[:limit]


def _signature(fn: object) -> str:
    """The signature as text, without the memory addresses some default values print."""
    try:
        sig = str(inspect.signature(fn))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", sig)


def _quote_text(rng: random.Random, i: int, seed: int) -> tuple[str, str]:
    module = _DOC_MODULES[(i * 5 + seed) % len(_DOC_MODULES)]
    doc = _document(module)
    sents = _sentences(doc)
    if len(sents) < 4:
        raise AneSpecError(f"built-in streams: docstrings of {module} too short to quote")
    topic = rng.choice(sents).split(" ")[:4]
    prompt = (f"<|user|>{doc}\n\nQuestion: which passages of the document above explain how "
              f"{' '.join(topic)} works? Quote them and connect them in a short answer.<|end|>"
              "<|assistant|>")
    picks = sorted(rng.sample(range(len(sents)), min(len(sents), rng.randint(5, 8))))
    out = []
    for j, s in enumerate(picks):
        sent = sents[s]
        words = sent.split(" ")
        if rng.random() < 0.35 and len(words) > 8:  # lift a clause, not the whole sentence
            sent = " ".join(words[: rng.randint(5, len(words) - 2)]) + " ..."
        conn = _CONNECTIVES[(j + i) % len(_CONNECTIVES)] if j else _CONNECTIVES[0]
        out.append(f"{conn} \"{sent}\"")
    return prompt, " ".join(out) + "<|end|>"


def _records(module: str) -> list[dict]:
    recs = []
    for name, fn in _functions(module):
        params = _params(fn)
        summary = _doc(fn).split("\n")[0][:100]
        recs.append({"module": module, "name": name, "params": params,
                     "n_params": len(params), "has_doc": bool(summary), "summary": summary})
    return recs


_CSV_COLUMNS = ("module", "name", "n_params", "params", "has_doc", "summary")


def _render_records(records: list[dict], fmt: str) -> str:
    if fmt == "jsonl":
        return "".join(json.dumps(r) + "\n" for r in records)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(_CSV_COLUMNS)
    for r in records:
        w.writerow([r["module"], r["name"], r["n_params"], " ".join(r["params"]), r["has_doc"],
                    r["summary"]])
    return buf.getvalue()


def _structured_text(rng: random.Random, i: int, seed: int) -> tuple[str, str]:
    mods = [m for m in _MODULES if len(_records(m)) >= 14]
    module = mods[(i * 3 + seed) % len(mods)]
    recs = _records(module)
    start = rng.randrange(0, len(recs) - 13)
    shown, wanted = recs[start:start + 6], recs[start + 6:start + 14]
    fmt = "jsonl" if i % 2 == 0 else "csv"
    spec = ("JSON lines (one object per function, keys in this order)" if fmt == "jsonl"
            else "CSV rows with a header (same columns)")
    prompt = (f"<|user|>Describe each function of {module} as {spec}. Examples:\n"
              f"{_render_records(shown, fmt)}"
              f"Now describe: {', '.join(r['name'] for r in wanted)}.<|end|><|assistant|>")
    return prompt, _render_records(wanted, fmt) + "<|end|>"


def _first_paragraph(text: str) -> str:
    return re.sub(r"\s+", " ", text.split("\n\n")[0]).strip()


_CHAT_TAILS = ("It is usually called directly.", "It is rarely needed directly.",
               "Most callers never pass the optional arguments.")


def _chat_text(rng: random.Random, i: int, seed: int) -> tuple[str, str]:
    module = _DOC_MODULES[(i * 3 + seed + 1) % len(_DOC_MODULES)]
    documented = [(n, f) for n, f in _functions(module) if len(_first_paragraph(_doc(f))) > 60]
    if len(documented) < 3:
        raise AneSpecError(f"built-in streams: {module} has too few documented functions")
    picks = rng.sample(documented, min(len(documented), 4))
    turns = ["<|system|>You are a concise assistant for Python's standard library.<|end|>"]
    answers = []
    for j, (name, fn) in enumerate(picks):
        q = (f"What does `{module}.{name}` do?" if j == 0 else
             f"And `{module}.{name}`? How is it different from `{picks[j - 1][0]}`?")
        para = _first_paragraph(_doc(fn))
        a = f"`{module}.{name}{_signature(fn)}`: {para} {rng.choice(_CHAT_TAILS)}"
        turns.append(f"<|user|>{q}<|end|><|assistant|>{a}<|end|>")
        answers.append((name, a))
        if j == 0:
            quoted = " ".join(para.split(" ")[:10])
    turns.append(f"<|user|>Earlier you said \"{quoted}\". Summarise all of these functions in one "
                 f"answer, reusing your own wording.<|end|><|assistant|>")
    out = [f"Sure. As I said, \"{quoted}\"."]
    for name, a in answers:
        sents = _sentences(a) or [a]
        lifted = " ".join(sents[: rng.randint(1, 2)])
        out.append(f"For `{module}.{name}`: {lifted}")
    first, last = answers[0][0], answers[-1][0]
    out.append(f"So `{module}.{first}` and `{module}.{last}` cover different needs.")
    return "".join(turns), " ".join(out) + "<|end|>"


_BUILDERS: dict[str, Callable[[random.Random, int, int], tuple[str, str]]] = {
    "code": _code_text, "code-edit": _code_edit_text, "quote": _quote_text,
    "structured": _structured_text, "chat": _chat_text,
}


def builtin_texts(per_family: int = 4, *, seed: int = 0,
                  families: Sequence[str] = FAMILIES) -> list[tuple[str, str, str]]:
    """(family, prompt text, output text) for the built-in streams, deterministic per seed."""
    if per_family < 1:
        raise AneSpecError(f"per_family must be >= 1, got {per_family}")
    from ane_spec.bench.session_streams import SESSION_FAMILIES, session_text

    unknown = [f for f in families if f not in _BUILDERS and f not in SESSION_FAMILIES]
    if unknown:
        raise AneSpecError(f"unknown stream families {unknown}; known: {', '.join(FAMILIES)}")
    out = []
    for family in families:
        for i in range(per_family):
            if family in SESSION_FAMILIES:
                prompt, output = session_text(family, i, seed)
            else:
                rng = random.Random(f"{family}:{seed}:{i}")
                prompt, output = _BUILDERS[family](rng, i, seed)
            out.append((family, prompt, output))
    return out


def builtin_streams(per_family: int = 4, *, seed: int = 0, families: Sequence[str] = FAMILIES,
                    tokenizer: Tokenizer | None = None) -> list[Stream]:
    """The built-in streams, tokenized (chat markers as single special tokens)."""
    tok = tokenizer or synthetic_tokenizer()
    return [Stream(family, tuple(tok.encode(p, special=True)), tuple(tok.encode(o, special=True)))
            for family, p, o in builtin_texts(per_family, seed=seed, families=families)]


def stdlib_token_history(n_tokens: int, *, tokenizer: Tokenizer | None = None) -> list[int]:
    """`n_tokens` tokens of stdlib source (the code modules, in order, repeated if needed): a
    realistic long history for timing drafters."""
    if n_tokens < 1:
        raise AneSpecError(f"n_tokens must be >= 1, got {n_tokens}")
    tok = tokenizer or synthetic_tokenizer()
    out: list[int] = []
    while len(out) < n_tokens:
        for module in _MODULES:
            out += tok.encode(_source(module))
            if len(out) >= n_tokens:
                break
    return out[:n_tokens]


# -- JSONL ----------------------------------------------------------------------------------------

def save_streams(streams: Iterable[Stream], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for s in streams:
            f.write(json.dumps(s.to_json(), separators=(",", ":")) + "\n")


def load_streams(path: str | Path) -> list[Stream]:
    """Streams from JSONL; a malformed line raises AneSpecError naming the file and line."""
    streams = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise AneSpecError(f"cannot read streams file {path}: {exc}") from exc
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            family, prompt, output = obj["family"], obj["prompt"], obj["output"]
            if not isinstance(family, str) or not family:
                raise ValueError("family must be a non-empty string")
            for key, ids in (("prompt", prompt), ("output", output)):
                if not isinstance(ids, list) or not all(
                        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                    raise ValueError(f"{key} must be a list of non-negative integers")
        except (ValueError, KeyError, TypeError) as exc:
            raise AneSpecError(f"{path}:{no}: not a stream ({exc})") from exc
        streams.append(Stream(family, tuple(prompt), tuple(output)))
    return streams
