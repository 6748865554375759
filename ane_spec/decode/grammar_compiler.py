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
import math
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, MutableMapping
from concurrent.futures import Future
from typing import Any, Literal, TypeVar

from ane_spec.decode.grammar import (
    Grammar, GrammarError, _first_line, gbnf_grammar, grammar_tokenizer, json_schema_grammar,
    lark_grammar,
)
from ane_spec.decode.grammar_limits import (
    GrammarLimits, check_grammar_text, check_schema,
)
from ane_spec.model.tokenizer import Tokenizer
from ane_spec.model.tokenizer_data import TokenizerData

log = logging.getLogger("ane_spec.grammar")

GrammarKind = Literal["json_schema", "gbnf", "lark"]
CHILD_STACK_BYTES = 4 << 20
PARENT_STACK_BYTES = 64 << 20
CACHE_ENTRIES = 64
STARTUP_SECONDS = 120.0  # importing and building the tokenizer: ~2 s at 200k tokens
_FRAME = struct.Struct(">I")
_T = TypeVar("_T")
_stack_size_lock = threading.Lock()
# A client's `grammar` is GBNF. llguidance's converter passes a Lark grammar (one with a
# `start:` rule) through as it is, and Lark's `%json {...}` embeds a schema that none of
# grammar_limits' schema checks would see: such a grammar is refused.
LARK_REFUSED = ("grammar: this is a Lark grammar (llguidance's syntax, with a `start:` rule); "
                "the grammar parameter takes GBNF, llama.cpp's grammar format (`root ::= ...`); "
                "for JSON give json_schema or response_format")


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
        spec = gbnf_grammar(source)
        if spec == source:  # llguidance passes what it takes for Lark through unconverted
            raise GrammarError(LARK_REFUSED)
        return spec
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
        self._queue: CompileQueue | None = None
        self.stats = {"compiled": 0, "cached": 0, "refused": 0, "child_crashes": 0,
                      "child_timeouts": 0, "child_starts": 0}

    def compile(self, kind: GrammarKind, source: Any, what: str) -> Grammar:
        """A compiled grammar, or GrammarError (a 400: the message names the problem)."""
        check_limits(kind, source, what, self.limits)  # first: a deep value cannot be dumped
        key = cache_key(kind, source, what)
        hit = self._cached(key)
        if hit is None:
            hit = self._compile_new(kind, source, what)
            with self._cache_lock:
                self._cache[key] = hit
                while len(self._cache) > self._cache_entries:
                    self._cache.popitem(last=False)
        if isinstance(hit, GrammarError):
            raise GrammarError(str(hit))
        return hit

    def lookup(self, kind: GrammarKind, source: Any, what: str,
               ready: MutableMapping[str, Grammar | GrammarError]) -> Grammar:
        """The grammar without compiling anything: from `ready` (what the queue compiled for
        this request) or the cache; a refusal as GrammarError; NeedsCompile when it must be
        compiled first (through `queue`, which never holds a thread while it waits)."""
        check_limits(kind, source, what, self.limits)
        key = cache_key(kind, source, what)
        hit = ready.get(key) or self._cached(key)
        if hit is None:
            raise NeedsCompile(key, kind, source, what)
        if isinstance(hit, GrammarError):
            raise GrammarError(str(hit))
        return hit

    def _cached(self, key: str) -> Grammar | GrammarError | None:
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats["cached"] += 1
        return hit

    @property
    def queue(self) -> "CompileQueue":
        """The compile queue over this compiler (made on first use; see CompileQueue)."""
        with self._cache_lock:
            if self._queue is None:
                self._queue = CompileQueue(self)
            return self._queue

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
        if self._queue is not None:
            self._queue.close()
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


def cache_key(kind: GrammarKind, source: Any, what: str) -> str:
    return json.dumps([kind, what, source], sort_keys=True, separators=(",", ":"))


class NeedsCompile(Exception):
    """`GrammarCompiler.lookup` found no compiled grammar: compile it through the queue."""

    def __init__(self, key: str, kind: GrammarKind, source: Any, what: str):
        super().__init__(what)
        self.key, self.kind, self.source, self.what = key, kind, source, what


class CompileBusy(Exception):
    """The compile queue cannot take (429) or did not start (503) a compile in time; the
    client should come back after `retry_after` seconds."""

    def __init__(self, status: int, message: str, retry_after: int):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


class _Entry:
    """One grammar to compile, and how many requests wait for it."""

    def __init__(self, need: NeedsCompile):
        self.need = need
        self.future: Future = Future()
        self.waiters = 1
        self.queued = time.monotonic()
        self.started: float | None = None


class CompileQueue:
    """Compiles new grammars one at a time (the compiler's child is serial) on its own thread,
    in arrival order, for requests that wait without holding a thread. At most `max_waiting`
    distinct grammars wait (more: CompileBusy 429); a request whose grammar has not started
    within `wait_seconds` gives up (503); a request for a grammar already queued shares it;
    a grammar every requester has given up on (gone, or out of time) is dropped unstarted. A
    running compile is bounded by the compiler's own deadline (compile_seconds), and its
    result is cached for whoever asks next."""

    def __init__(self, compiler: GrammarCompiler, max_waiting: int = 8,
                 wait_seconds: float = 30.0):
        self.compiler = compiler
        self.max_waiting, self.wait_seconds = max_waiting, wait_seconds
        self._cond = threading.Condition()
        self._waiting: OrderedDict[str, _Entry] = OrderedDict()
        self._running: _Entry | None = None
        self._seconds: deque[float] = deque(maxlen=16)  # recent compile times
        self._thread: threading.Thread | None = None
        self._closed = False
        self.stats = {"queued": 0, "shared": 0, "compiled": 0, "refused_full": 0,
                      "timed_out": 0, "dropped": 0}

    def configure(self, max_waiting: int, wait_seconds: float) -> None:
        self.max_waiting, self.wait_seconds = max_waiting, wait_seconds

    def submit(self, need: NeedsCompile) -> _Entry:
        """The entry this request waits on (shared with any request for the same grammar);
        CompileBusy(429) when max_waiting grammars wait already."""
        with self._cond:
            running = self._running
            entry = self._waiting.get(need.key) or (
                running if running is not None and running.need.key == need.key else None)
            if entry is not None:
                entry.waiters += 1
                self.stats["shared"] += 1
                return entry
            if len(self._waiting) >= self.max_waiting:
                self.stats["refused_full"] += 1
                raise CompileBusy(429, f"{len(self._waiting)} new grammars are waiting to be "
                                  "compiled already (the limit); retry later, or reuse a "
                                  "grammar (compiled ones are cached)", self._retry_after())
            entry = _Entry(need)
            self._waiting[need.key] = entry
            self.stats["queued"] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._main, name="ane-spec-grammars",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
            return entry

    def give_up(self, entry: _Entry, timed_out: bool) -> bool:
        """A requester stops waiting (it left, or its wait ran out). True when the grammar had
        not started, so the requester need not wait any more; the grammar itself is dropped
        once nobody waits for it."""
        with self._cond:
            entry.waiters -= 1
            if timed_out:
                self.stats["timed_out"] += 1
            if entry.started is not None:
                return False
            if entry.waiters <= 0 and self._waiting.pop(entry.need.key, None) is not None:
                self.stats["dropped"] += 1
                entry.future.cancel()
            return True

    def busy_error(self, entry: _Entry) -> CompileBusy:
        return CompileBusy(503, f"the grammar did not start compiling within {self.wait_seconds:g}"
                           " s (other grammars are compiling); retry later", self._retry_after())

    def _retry_after(self) -> int:
        mean = (sum(self._seconds) / len(self._seconds)) if self._seconds else 1.0
        return max(1, min(600, math.ceil(mean * (len(self._waiting) + 1))))

    def snapshot(self) -> dict[str, Any]:
        """For /health and /metrics."""
        with self._cond:
            running = self._running
            return {"waiting": len(self._waiting), "capacity": self.max_waiting,
                    "wait_seconds": self.wait_seconds,
                    "compiling": None if running is None else {
                        "what": running.need.what, "waiters": running.waiters,
                        "seconds": round(time.monotonic() - (running.started or 0.0), 3)},
                    "oldest_wait_seconds": round(time.monotonic() - next(
                        iter(self._waiting.values())).queued, 3) if self._waiting else 0.0,
                    **self.stats}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for entry in self._waiting.values():
                entry.future.cancel()
            self._waiting.clear()
            self._cond.notify_all()

    def _main(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                _, entry = self._waiting.popitem(last=False)
                entry.started = time.monotonic()
                self._running = entry
            t0 = time.monotonic()
            try:
                need = entry.need
                result: Grammar | GrammarError = self.compiler.compile(
                    need.kind, need.source, need.what)
            except GrammarError as exc:
                result = exc
            except Exception as exc:  # noqa: BLE001 - one grammar must not stop the queue
                log.exception("compiling %s failed", entry.need.what)
                result = GrammarError(f"{entry.need.what} cannot be compiled "
                                      f"({type(exc).__name__})")
            with self._cond:
                self._running = None
                self._seconds.append(time.monotonic() - t0)
                self.stats["compiled"] += 1
            entry.future.set_result(result)


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
