"""Stream families where earlier requests matter: requests that come in sessions.

In `ane_spec.bench.streams` every stream is one request on its own. Here a family is a run of
sessions of SESSION_LENGTH requests each, replayed in order, and a later request's output repeats
text that an earlier request saw or wrote but that its own prompt no longer holds, the case a
cross-request drafter (`DraftMemory`) is for. Built from the running Python's standard library
like the other families, deterministic per (seed, session):

* ``agent-loop``: a ReAct-style agent tidying two functions of a stdlib module. Each request's
  prompt holds the tool descriptions, the task, the agent's earlier actions (one line each) and
  only the latest tool output; the agent's thoughts and its edit quote code it read in earlier
  steps, and its actions repeat one JSON shape.
* ``file-edits``: one stdlib function, edited again and again: request j sends the original
  function and the edit list 1..j (renames of identifiers), and the output is the whole
  function with all of them applied, so output j is output j-1 with one more rename, while the
  prompt only has the original.
* ``chat-recall``: a chat about a module's functions whose prompt keeps only the system prompt,
  the previous exchange and the new question (a sliding window); answers quote the answer two
  turns back (out of the window) and the last one summarises them all. Two sessions in a row
  discuss the same module, as two users asking about the same library would.

Outputs are constructed, not sampled from a model (see `streams`).
"""

from __future__ import annotations

import builtins
import inspect
import io
import json
import keyword
import random
import re
import tokenize
from collections.abc import Callable
from functools import lru_cache

from ane_spec.bench.streams import (
    _DOC_MODULES, _MODULES, _doc, _edit_candidates, _functions, _signature, _source,
)
from ane_spec.errors import AneSpecError

__all__ = ["SESSION_FAMILIES", "SESSION_LENGTH", "session_text"]

SESSION_FAMILIES = ("agent-loop", "file-edits", "chat-recall")
SESSION_LENGTH = 5

Request = tuple[str, str]  # (prompt text, output text)


def session_text(family: str, i: int, seed: int) -> Request:
    """Request i of a session family: request i % SESSION_LENGTH of session i // SESSION_LENGTH."""
    return _session(family, i // SESSION_LENGTH, seed)[i % SESSION_LENGTH]


@lru_cache(maxsize=64)
def _session(family: str, session: int, seed: int) -> tuple[Request, ...]:
    rng = random.Random(f"{family}:{seed}:session{session}")
    requests = _SESSIONS[family](rng, session, seed)
    if len(requests) != SESSION_LENGTH:
        raise AneSpecError(f"built-in streams: a {family} session has {len(requests)} requests")
    return tuple(requests)


# -- agent-loop -----------------------------------------------------------------------------------

_TOOLS = """You are a coding agent working in a checkout of CPython's Lib/ directory.
Think briefly, then call exactly one tool per turn with a line
Action: {"tool": NAME, "args": {...}}
Tools:
- read_file {"path": str, "symbol": str}: the source of one function or method.
- grep {"path": str, "pattern": str}: matching lines as "LINE: text".
- edit_file {"path": str, "old": str, "new": str}: replace text, then run the tests.
- finish {"summary": str}: stop and report.
"""


def _action(tool: str, **args: str) -> str:
    return "Action: " + json.dumps({"tool": tool, "args": args})


@lru_cache(maxsize=None)  # every agent-loop request scans every module; callers only sample it
def _sources(module: str, lo: int = 300, hi: int = 2500) -> list[tuple[str, str]]:
    out = []
    for name, fn in _functions(module):
        try:
            src = inspect.cleandoc("\n" + inspect.getsource(fn))  # type: ignore[arg-type]
        except (OSError, TypeError):
            continue
        if lo <= len(src) <= hi and _doc(fn):
            out.append((name, src))
    return out


def _grep(module: str, word: str, limit: int = 12) -> str:
    hits = [f"{no}: {line.strip()}" for no, line in enumerate(_source(module).splitlines(), 1)
            if re.search(rf"\b{re.escape(word)}\b", line)]
    return "\n".join(hits[:limit]) or "(no matches)"


def _agent_session(rng: random.Random, session: int, seed: int) -> list[Request]:
    mods = [m for m in _MODULES if len(_sources(m)) >= 2]
    module = mods[(session * 5 + seed) % len(mods)]
    (n1, s1), (n2, s2) = rng.sample(_sources(module), 2)
    path = f"Lib/{module.replace('.', '/')}.py"
    task = (f"Task: tidy the docstrings of `{n1}` and `{n2}` in {path}: first line a short "
            "summary ending with a period.")
    lines1 = s1.splitlines()
    head1 = "\n".join(lines1[:min(len(lines1), 12)])
    short = n1.rsplit(".", 1)[-1]
    new_head = head1.replace('"""', '"""Tidied: ', 1) if '"""' in head1 else head1 + "  # tidied"
    actions = [
        _action("read_file", path=path, symbol=n1),
        _action("read_file", path=path, symbol=n2),
        _action("grep", path=path, pattern=short),
        _action("edit_file", path=path, old=head1, new=new_head),
        _action("finish", summary=f"tidied the docstrings of {n1} and {n2}"),
    ]
    observations = [
        "(no tool output yet)",
        f"read_file {n1}:\n{s1}",
        f"read_file {n2}:\n{s2}",
        f"grep {short}:\n{_grep(module, short)}",
        f"edit_file: replaced {len(head1)} characters in {path}; tests: "
        f"{rng.randint(40, 400)} passed, 0 failed.",
    ]
    sig1, sig2 = lines1[0], s2.splitlines()[0]
    thoughts = [
        f"Thought: the task is to tidy the docstrings of `{n1}` and `{n2}` in {path}. Plan: "
        f"read `{n1}`, read `{n2}`, check the callers of `{short}` with grep, edit `{n1}`, "
        f"then finish once the tests pass. I need the source of `{n1}` before changing it.",
        f"Thought: `{n1}` starts with\n{head1}\nNow I read `{n2}`.",
        f"Thought: `{n2}` is defined as `{sig2}`. Back to `{n1}`, which I read before:\n{head1}\n"
        f"I should check who calls `{short}`.",
        f"Thought: the call sites do not depend on the docstring. I will edit `{n1}`:\n{head1}",
        f"Thought: the edit of `{n1}` applied and the tests pass. `{n1}` now starts with\n"
        f"{new_head}\nand `{n2}` keeps `{sig2}`; `{sig1}` is unchanged.",
    ]
    requests = []
    for j in range(SESSION_LENGTH):
        done = "\n".join(actions[:j]) or "(none)"
        prompt = (f"<|system|>{_TOOLS}<|end|><|user|>{task}\nPrevious actions:\n{done}\n"
                  f"Observation: {observations[j]}<|end|><|assistant|>")
        requests.append((prompt, f"{thoughts[j]}\n{actions[j]}<|end|>"))
    return requests


# -- file-edits -----------------------------------------------------------------------------------

_NOT_RENAMED = frozenset(keyword.kwlist) | frozenset(dir(builtins)) | {"self", "cls"}


def _names(src: str) -> list[tuple[str, list[tuple[int, int]]]]:
    """Identifiers used at least 3 times as code (not in strings or comments), most used first,
    with the (row, column) of every use."""
    uses: dict[str, list[tuple[int, int]]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.NAME and tok.string not in _NOT_RENAMED and len(tok.string) > 1:
            uses.setdefault(tok.string, []).append(tok.start)
    found = [(w, at) for w, at in uses.items() if len(at) >= 3]
    return sorted(found, key=lambda x: (-len(x[1]), x[0]))


def _rename(src: str, renames: dict[str, str]) -> str:
    """Replace each renamed identifier at its code positions only."""
    lines = src.splitlines(keepends=True)
    edits = sorted(((row, col, word) for word in renames for row, col in
                    next(at for w, at in _names(src) if w == word)), reverse=True)
    for row, col, word in edits:  # right to left, so earlier columns stay valid
        line = lines[row - 1]
        lines[row - 1] = line[:col] + renames[word] + line[col + len(word):]
    return "".join(lines)


@lru_cache(maxsize=1)
def _editable() -> tuple[tuple[str, str, str, tuple[str, ...]], ...]:
    out = []
    for module, name, fn in _edit_candidates():
        src = inspect.cleandoc("\n" + inspect.getsource(fn)) + "\n"  # type: ignore[arg-type]
        words = [w for w, _ in _names(src)]
        if len(words) >= SESSION_LENGTH:
            out.append((module, name, src, tuple(words)))
    if not out:
        raise AneSpecError("built-in streams: no stdlib function with enough names to rename")
    return tuple(out)


def _edits_session(rng: random.Random, session: int, seed: int) -> list[Request]:
    cands = _editable()
    module, name, src, words = cands[(session * 7 + seed * 3) % len(cands)]
    picked = rng.sample(words[:8], SESSION_LENGTH)
    styles = ("{}_value", "the_{}", "{}_arg", "new_{}", "{}2")
    renames = {w: rng.choice(styles).format(w) for w in picked}
    requests = []
    for j in range(1, SESSION_LENGTH + 1):
        steps = "\n".join(f"{i}. rename `{w}` to `{renames[w]}`"
                          for i, w in enumerate(picked[:j], 1))
        prompt = (f"<|user|>Apply these edits to `{name}` from {module} and return the whole "
                  f"function:\n{steps}\n```python\n{src}```<|end|><|assistant|>")
        edited = _rename(src, {w: renames[w] for w in picked[:j]})
        requests.append((prompt, f"```python\n{edited}```<|end|>"))
    return requests


# -- chat-recall ----------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _documented(module: str) -> list[tuple[str, object]]:
    return [(n, f) for n, f in _functions(module) if len(_flat_doc(f)) > 250]


def _flat_doc(fn: object, limit: int = 400) -> str:
    """The docstring on one line, cut at a word boundary near `limit` characters."""
    text = re.sub(r"\s+", " ", _doc(fn)).strip()
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


_SYSTEM = ("<|system|>You are a concise assistant for Python's standard library. Answer with "
           "the function's signature and what its documentation says, in its own words; when "
           "the user compares functions, recall what you said about the earlier one. This chat "
           "keeps only the last exchange in view.<|end|>")


def _recall_session(rng: random.Random, session: int, seed: int) -> list[Request]:
    mods = [m for m in _DOC_MODULES if len(_documented(m)) >= SESSION_LENGTH - 1]
    module = mods[(session // 2 * 5 + seed) % len(mods)]
    picks = rng.sample(_documented(module), SESSION_LENGTH - 1)
    answers: list[str] = []
    exchanges: list[str] = []
    requests = []
    for j, (name, fn) in enumerate(picks):
        q = f"What does `{module}.{name}` do?"
        a = f"`{module}.{name}{_signature(fn)}`: {_flat_doc(fn)}"
        if j >= 2:
            back = answers[j - 2]
            q += f" Is it like `{picks[j - 2][0]}`?"
            a += f" Earlier I described `{picks[j - 2][0]}` like this: {back}"
        window = exchanges[-1] if exchanges else ""
        requests.append((f"{_SYSTEM}{window}<|user|>{q}<|end|><|assistant|>", a + "<|end|>"))
        answers.append(a.split(" Earlier I described")[0])
        exchanges.append(f"<|user|>{q}<|end|><|assistant|>{a}<|end|>")
    q = "Summarise everything you told me, in your own earlier words."
    summary = " ".join(f"({i}) {a}" for i, a in enumerate(answers, 1))
    requests.append((f"{_SYSTEM}{exchanges[-1]}<|user|>{q}<|end|><|assistant|>",
                     f"Here is what I said. {summary}<|end|>"))
    return requests


_SESSIONS: dict[str, Callable[[random.Random, int, int], list[Request]]] = {
    "agent-loop": _agent_session, "file-edits": _edits_session, "chat-recall": _recall_session,
}
