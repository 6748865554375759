"""Client grammars compiled where a crash or a hang cannot take the server down.

A grammar goes through three gates before the serving process compiles it:

1. `grammar_limits` refuses, in plain Python, anything over a named limit (size, rules, nesting,
   $ref chains, $ref cycles).
2. A warm child process (`python -m ane_spec.decode.grammar_compiler`, holding its own copy of
   the tokenizer) converts and compiles it first, on a thread with a small stack
   (CHILD_STACK_BYTES), under a deadline. A segfault, a stack overflow or an abort in llguidance
   kills only the child; a compile past the deadline gets the child killed. Either way the
   request gets a 400 naming what happened and a fresh child is started for the next one.
3. Only a grammar the child compiled is compiled here, from the child's converted text, on a
   thread whose stack (PARENT_STACK_BYTES) is 16x the child's: the same deterministic code on
   the same input needs the same stack, so what fit there fits here with room to spare.

Compiled grammars (and refusals) are cached by their source, so an agent that sends the same
tools or schema on every turn pays for none of this after the first request
(`scripts/bench_grammar_compiler.py` measures each path).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from ane_spec.decode.grammar import (
    Grammar, GrammarError, _first_line, gbnf_grammar, grammar_tokenizer, json_schema_grammar,
    lark_grammar,
)
from ane_spec.decode.grammar_limits import (
    GrammarLimits, check_grammar_text, check_schema,
)
from ane_spec.model.tokenizer import Tokenizer, TokenizerData

log = logging.getLogger("ane_spec.grammar")

GrammarKind = Literal["json_schema", "gbnf", "lark"]
CHILD_STACK_BYTES = 4 << 20
PARENT_STACK_BYTES = 64 << 20
CACHE_ENTRIES = 64
STARTUP_SECONDS = 120.0  # importing and building the tokenizer: ~2 s at 200k tokens
_FRAME = struct.Struct(">I")
_T = TypeVar("_T")
_stack_size_lock = threading.Lock()


def on_big_stack(fn: Callable[[], _T], stack_bytes: int) -> _T:
    """Run `fn` on a new thread with `stack_bytes` of stack and return (or raise) its result."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = exc

    with _stack_size_lock:  # threading.stack_size is process-wide: set it only for this thread
        previous = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=run, name="ane-spec-grammar", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def grammar_spec(kind: GrammarKind, source: Any) -> str:
    """llguidance's grammar text for a client's JSON schema, GBNF (or Lark) grammar."""
    if kind == "json_schema":
        return json_schema_grammar(source)
    if kind == "gbnf":
        return gbnf_grammar(source)
    return lark_grammar(source)


def check_limits(kind: GrammarKind, source: Any, what: str, limits: GrammarLimits) -> None:
    if kind == "json_schema":
        check_schema(source, what, limits)
    else:
        check_grammar_text(source, what, limits)


class GrammarCompiler:
    """Compiles client grammars for one tokenizer (see the module docstring). Thread-safe:
    compiles through the child are serialized, cache hits are not."""

    def __init__(self, tokenizer: Tokenizer, limits: GrammarLimits = GrammarLimits(),
                 cache_entries: int = CACHE_ENTRIES):
        self.tokenizer = tokenizer
        self.limits = limits
        self._cache: OrderedDict[str, Grammar | GrammarError] = OrderedDict()
        self._cache_entries = cache_entries
        self._cache_lock = threading.Lock()
        self._child_lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self.stats = {"compiled": 0, "cached": 0, "refused": 0, "child_crashes": 0,
                      "child_timeouts": 0, "child_starts": 0}

    def compile(self, kind: GrammarKind, source: Any, what: str) -> Grammar:
        """A compiled grammar, or GrammarError (a 400: the message names the problem)."""
        check_limits(kind, source, what, self.limits)  # first: a deep value cannot be dumped
        key = json.dumps([kind, what, source], sort_keys=True, separators=(",", ":"))
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats["cached"] += 1
        if hit is None:
            hit = self._compile_new(kind, source, what)
            with self._cache_lock:
                self._cache[key] = hit
                while len(self._cache) > self._cache_entries:
                    self._cache.popitem(last=False)
        if isinstance(hit, GrammarError):
            raise GrammarError(str(hit))
        return hit

    def _compile_new(self, kind: GrammarKind, source: Any, what: str) -> Grammar | GrammarError:
        try:
            spec = self._in_child(kind, source, what)
            grammar = on_big_stack(lambda: Grammar(self.tokenizer, spec, what=what),
                                   PARENT_STACK_BYTES)
        except GrammarError as exc:
            self.stats["refused"] += 1
            return exc
        self.stats["compiled"] += 1
        return grammar

    # --- the child ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the child now (it starts on first use otherwise)."""
        with self._child_lock:
            self._ensure_child()

    def close(self) -> None:
        with self._child_lock:
            self._stop_child()

    def _ensure_child(self) -> subprocess.Popen:
        if self._child is not None and self._child.poll() is None:
            return self._child
        self._stop_child()
        child = subprocess.Popen(
            [sys.executable, "-m", "ane_spec.decode.grammar_compiler"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True)  # a terminal's Ctrl-C goes to the server, which stops it
        self._child = child
        self.stats["child_starts"] += 1
        try:  # the compile deadline starts once the child holds its tokenizer
            _write_frame(child.stdin, {"tokenizer": self.tokenizer.data.model_dump(mode="json"),
                                       "split": self.tokenizer.split})
            _read_frame(child.stdout, STARTUP_SECONDS)
        except (OSError, EOFError, TimeoutError):
            self._stop_child()
            raise GrammarError("the grammar compiler could not be started; constrained "
                               "output is unavailable") from None
        return child

    def _stop_child(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        if child.poll() is None:
            child.kill()
        child.wait()
        for stream in (child.stdin, child.stdout):
            stream.close()

    def _in_child(self, kind: GrammarKind, source: Any, what: str) -> str:
        """The child's converted grammar text, once it compiled it; GrammarError otherwise."""
        deadline = self.limits.compile_seconds
        with self._child_lock:
            child = self._ensure_child()
            try:
                _write_frame(child.stdin, {"kind": kind, "source": source, "what": what})
                reply = _read_frame(child.stdout, deadline)
            except TimeoutError:
                self.stats["child_timeouts"] += 1
                self._stop_child()
                raise GrammarError(f"{what} took longer than the {deadline:g} s compile limit "
                                   "(compile_seconds)") from None
            except (OSError, EOFError):
                self.stats["child_crashes"] += 1
                code = child.wait()
                self._stop_child()
                log.warning("the grammar compiler child died (%s) compiling %s", _died(code),
                            what)
                raise GrammarError(f"{what} crashed the grammar compiler ({_died(code)}); it "
                                   "is refused") from None
        if "error" in reply:
            raise GrammarError(reply["error"])
        return reply["spec"]


def _died(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _write_frame(stream: Any, obj: Any) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    stream.write(_FRAME.pack(len(data)) + data)
    stream.flush()


def _read_exactly(fd: int, n: int, deadline: float | None) -> bytes:
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


def _read_frame(stream: Any, seconds: float | None) -> Any:
    """One frame from a pipe (unbuffered reads on its fd, so select() sees every byte)."""
    fd = stream.fileno()
    deadline = None if seconds is None else time.monotonic() + seconds
    (size,) = _FRAME.unpack(_read_exactly(fd, _FRAME.size, deadline))
    return json.loads(_read_exactly(fd, size, deadline))


def _child_main() -> None:
    """The child: read the tokenizer, then compile one grammar per request until stdin ends."""
    inp = sys.stdin.buffer
    # Replies go to the original stdout; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    first = _read_frame(inp, None)
    tok = Tokenizer(TokenizerData.model_validate(first["tokenizer"]), split=first["split"])
    grammar_tokenizer(tok)  # llguidance's view of it, built before the first deadline starts
    _write_frame(out, {"ready": True})

    def compile_one(request: dict[str, Any]) -> dict[str, Any]:
        what = request["what"]
        spec = grammar_spec(request["kind"], request["source"])
        Grammar(tok, spec, what=what)
        return {"spec": spec}

    while True:
        try:
            request = _read_frame(inp, None)
        except EOFError:
            return
        try:
            reply = on_big_stack(lambda: compile_one(request), CHILD_STACK_BYTES)
        except GrammarError as exc:
            reply = {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - llguidance's own error types: the grammar's
            reply = {"error": f"{request['what']} cannot be compiled: {type(exc).__name__}: "
                              f"{_first_line(str(exc))}"}
        _write_frame(out, reply)


if __name__ == "__main__":
    _child_main()
