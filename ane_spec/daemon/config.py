"""`ServeConfig`: everything `ane-spec serve` can be told, checked before anything loads.

The one rule with teeth: the daemon binds loopback unless an API key is set. A config asking for
any other host without a key is refused when it is made, so no code path can serve the model to
the network unauthenticated.
"""

from __future__ import annotations

import inspect
import ipaddress
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ane_spec.daemon.draft_scopes import DraftMemoryMode
from ane_spec.decode.draft_memory import DEFAULT_MEMORY_TOKENS
from ane_spec.decode.drafter import NgramDrafter
from ane_spec.errors import AneSpecError
from ane_spec.runtime.backend import default_backend_name
from ane_spec.runtime.decode_shape import DecodeShape, PrefillMode

LOOPBACK_NAMES = ("localhost",)
# Host header values a loopback server always answers to (besides loopback IP literals).
LOCAL_HOST_NAMES = ("localhost", "127.0.0.1", "::1")
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s,]+")
_HOST = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*|[0-9a-f:.]+")
# Requests may pick n-gram lengths up to this; the drafter's index grows with ngram_max.
MAX_NGRAM = 16
_DRAFTER_DEFAULTS = inspect.signature(NgramDrafter).parameters


class ServeConfigError(AneSpecError):
    """A `serve` option is invalid or unsafe (e.g. a public host without an API key)."""


def host_name(host: str) -> str:
    """The name in a Host header or a --host value, without port, brackets, case or a trailing
    dot: "[::1]:8000" -> "::1", "LocalHost.:80" -> "localhost"."""
    h = host.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        return h[1:end] if end > 0 else h
    name, sep, port = h.rpartition(":")
    if sep and ":" not in name and port.isdigit():
        h = name
    return h.rstrip(".")


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


class ServeConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    manifest: Path
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)  # 0: any free port (tests)
    api_key: str | None = Field(None, repr=False)
    backend: Literal["mil", "coreml"] = Field(default_factory=default_backend_name)
    precision: Literal["fp32", "fp16"] = "fp32"
    # fixed: every pass at T=4 (exact, one JIT specialisation per shard); mixed: T=1 + T=4.
    decode_shape: DecodeShape = "fixed"
    # Prompt chunks through the build's prefill function: auto (measured at warm-up), on, off.
    prefill: PrefillMode = "auto"
    max_queue: int = Field(8, ge=0, le=10_000)  # waiting requests beyond the running one
    speculative: bool = True
    ngram_min: int = Field(_DRAFTER_DEFAULTS["ngram_min"].default, ge=1, le=MAX_NGRAM)
    ngram_max: int = Field(_DRAFTER_DEFAULTS["ngram_max"].default, ge=1, le=MAX_NGRAM)
    guard: bool = True  # the mixed shape's best-effort near-tie redo; the fixed shape needs none
    max_body_bytes: int = Field(1 << 20, ge=1024)
    verify: bool = True  # hash every artifact at startup
    model_name: str | None = None  # the id clients see; default: the manifest's name
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    access_log: bool = True
    # Browser origins allowed to call the API (CORS): none by default, since any web page the
    # user opens could otherwise drive a local model; ("*",) allows every origin.
    allowed_origins: tuple[str, ...] = ()
    # Host header names accepted besides localhost, 127.0.0.1, [::1] and --host (DNS rebinding
    # protection, app.HostCheck); ("*",) accepts any. On a public --host the API key guards the
    # server and any name is accepted unless this is given.
    allowed_hosts: tuple[str, ...] = ()
    # llama.cpp's behaviour: special tokens written in message text are parsed as such.
    special_in_content: bool = False
    body_timeout: float = Field(60.0, gt=0.0, le=3600.0)  # seconds for a whole request body
    # A generation's wall-clock limit, from when it starts to run: past it, it ends with
    # finish_reason "length" (a client's own max_tokens or timeout usually comes first).
    request_timeout: float = Field(600.0, gt=0.0, le=86_400.0)
    # What a grammar may cost per generated token, in milliseconds of mask computation on
    # average (after a few tokens' grace): past it, the generation ends with a 400-class error
    # naming the grammar. Real grammars cost well under 1 ms; one ambiguous enough to cost
    # hundreds is refused instead of holding the accelerator for minutes.
    grammar_token_ms: float = Field(50.0, gt=0.0, le=60_000.0)
    # Grammar compiles: new grammars that may wait for the (serial) compiler, and how long one
    # may wait to start before its request gets a 503 (a full queue: 429), both with Retry-After.
    grammar_queue: int = Field(8, ge=1, le=1000)
    grammar_wait: float = Field(30.0, gt=0.0, le=3600.0)
    # KV slots (daemon/slots.py). None: chosen from the build's state size and the machine's
    # memory (runtime/state_budget.py), reported at start and in /health.
    kv_slots: int | None = Field(None, ge=1, le=64)
    slot_spill_mb: int | None = Field(None, ge=0)  # host memory for spilled slots; 0: none
    slot_save_path: Path | None = None  # /slots save|restore, and saved slots loaded at start
    slot_save_max_files: int = Field(32, ge=1, le=100_000)  # quota of .slot files in that folder
    slot_save_max_mb: float = Field(4096.0, gt=0.0)  # ... and of their total size
    # Cross-request drafting (daemon/draft_scopes.py). None: per-key with an API key, else shared.
    draft_memory: DraftMemoryMode | None = None
    draft_memory_tokens: int = Field(DEFAULT_MEMORY_TOKENS, ge=1024, le=1 << 22)
    # A draft model beside the target (decode/draft_setup.py): its build folder (the CLI builds
    # one from a GGUF, a catalog name or ollama:NAME), its Core ML compute units, which source
    # drafts (both: chosen per step), and whether it looks past each block while the target
    # verifies it (None: wherever it has its own process).
    draft_manifest: Path | None = None
    draft_units: Literal["ane", "gpu", "cpu"] | None = None
    draft_mode: Literal["both", "model", "ngram"] = "both"
    draft_overlap: bool | None = None

    @field_validator("api_key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("the API key is empty")
        return v

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _origins(cls, v: Any) -> Any:
        """A comma-separated string (the CLI's form) or a list; each origin is checked."""
        if isinstance(v, str):
            v = [o.strip() for o in v.split(",") if o.strip()]
        for origin in v or ():
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(f"{origin!r} is not an origin: give scheme://host[:port] "
                                 "(e.g. http://localhost:3000) or *")
        if "*" in (v or ()) and len(v) > 1:
            raise ValueError("'*' already allows every origin: give it alone")
        return tuple(v or ())

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _hosts(cls, v: Any) -> Any:
        """A comma-separated string (the CLI's form) or a list of host names or IPs."""
        if isinstance(v, str):
            v = [h.strip() for h in v.split(",") if h.strip()]
        out = []
        for host in v or ():
            name = host if host == "*" else host_name(host)
            if name != "*" and not _HOST.fullmatch(name):
                raise ValueError(f"{host!r} is not a host name or IP address")
            out.append(name)
        if "*" in out and len(out) > 1:
            raise ValueError("'*' already allows every host: give it alone")
        return tuple(out)

    @model_validator(mode="after")
    def _safe(self) -> "ServeConfig":
        if self.ngram_max < self.ngram_min:
            raise ValueError(f"ngram_max ({self.ngram_max}) must be >= ngram_min "
                             f"({self.ngram_min})")
        if self.slot_save_path is not None and self.slot_save_path.exists() \
                and not self.slot_save_path.is_dir():
            raise ValueError(f"slot_save_path: {self.slot_save_path} is not a directory")
        if self.draft_units is not None:  # else the server's warm-up would refuse them
            from ane_spec.decode.draft_setup import check_units
            from ane_spec.errors import AneSpecError

            try:
                check_units(self.backend, self.draft_units)
            except AneSpecError as exc:
                raise ValueError(str(exc)) from None
        if not is_loopback(self.host) and self.api_key is None:
            raise ValueError(
                f"refusing to serve on {self.host!r} without an API key: anything that can reach "
                "that address could use the model. Bind 127.0.0.1 (the default), or set a key "
                "with --api-key / the ANE_SPEC_API_KEY environment variable")
        return self

    @classmethod
    def create(cls, **values: Any) -> "ServeConfig":
        """Like the constructor, but invalid values raise `ServeConfigError` (one readable line
        per problem) instead of pydantic's `ValidationError`; None values mean "the default"."""
        try:
            return cls(**{k: v for k, v in values.items() if v is not None})
        except ValidationError as exc:
            problems = []
            for e in exc.errors():
                where = ".".join(str(p) for p in e["loc"])
                msg = e["msg"].removeprefix("Value error, ")
                problems.append(f"{where}: {msg}" if where else msg)
            raise ServeConfigError("; ".join(problems)) from None

    @property
    def public(self) -> bool:
        return not is_loopback(self.host)

    @property
    def allowed_host_names(self) -> frozenset[str] | None:
        """Host header names to accept (loopback IP literals always pass), or None for any: a
        public bind without --allowed-hosts (as Ollama does: the API key guards it), or '*'."""
        if "*" in self.allowed_hosts or (self.public and not self.allowed_hosts):
            return None
        return frozenset((*LOCAL_HOST_NAMES, host_name(self.host), *self.allowed_hosts))

    @property
    def draft_memory_mode(self) -> DraftMemoryMode:
        """--draft-memory, or its default: per-key once an API key guards the server."""
        if self.draft_memory is not None:
            return self.draft_memory
        return "per-key" if self.api_key is not None else "shared"
