"""`--draft-memory per-key|shared|off`: which earlier requests a request may learn from.

Cross-request memory makes a request faster when its text matched an earlier one: its drafts
are accepted more often (`DraftMemory`), and its prompt may reuse another conversation's K/V
(`slots`). In a multi-user deployment that timing is a side channel: a client could learn that
someone else sent a given text. A *scope* bounds it:

- ``shared`` (the default on loopback, where every client is the machine's own user): one
  memory, every cache reusable by every request;
- ``per-key`` (the default with an API key): one memory and one set of reusable caches per
  (API key presented, OpenAI ``user`` field). The server accepts a single API key today, so
  clients holding that key are told apart only by the ``user`` field they send: two end users
  of one app that sets ``user`` never share drafts or caches; requests without ``user`` share
  one scope per key. The key is never stored, only a hash of key and user;
- ``off``: no cross-request drafting (each request drafts from its own prompt and output);
  KV caches are still reused, as with one slot.

At most MAX_SCOPES memories are kept, the least recently used going first, each holding at most
`--draft-memory-tokens` tokens.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Literal

from ane_spec.decode.draft_memory import DraftMemory

DraftMemoryMode = Literal["per-key", "shared", "off"]
MAX_SCOPES = 16


def bearer_token(authorization: str | None) -> str:
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def scope_of(mode: DraftMemoryMode, authorization: str | None, user: str | None) -> str | None:
    """The scope a request belongs to: None (everyone's) unless the mode is per-key."""
    if mode != "per-key":
        return None
    key = f"{bearer_token(authorization)}\0{user or ''}".encode()
    return hashlib.sha256(key).hexdigest()[:32]


class DraftMemories:
    """The memory of each scope, created on first use."""

    def __init__(self, mode: DraftMemoryMode, max_tokens: int, ngram_max: int):
        self.mode = mode
        self.max_tokens = max_tokens
        self.ngram_max = ngram_max
        self._by_scope: OrderedDict[str | None, DraftMemory] = OrderedDict()
        self._lock = threading.Lock()  # the worker adds scopes while /health reads them

    def get(self, scope: str | None) -> DraftMemory | None:
        if self.mode == "off":
            return None
        with self._lock:
            memory = self._by_scope.get(scope)
            if memory is None:
                memory = self._by_scope[scope] = DraftMemory(self.max_tokens,
                                                             ngram_max=self.ngram_max)
                while len(self._by_scope) > MAX_SCOPES:
                    self._by_scope.popitem(last=False)
            self._by_scope.move_to_end(scope)
        return memory

    def stats(self) -> dict[str, int | str]:
        with self._lock:
            memories = list(self._by_scope.values())
        return {"mode": self.mode, "scopes": len(memories),
                "tokens": sum(m.size for m in memories),
                "requests": sum(m.requests for m in memories),
                "max_tokens_per_scope": self.max_tokens}
