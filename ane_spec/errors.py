"""The one exception family users see, and the quoting of untrusted text inside its messages.

Every failure a user can cause (a bad file, a bad flag, a tampered artifact, a malformed request)
raises a subclass of `AneSpecError` whose message names the problem; the CLI prints it without a
traceback and the daemon turns it into a 4xx. Anything else escaping is a bug.

Messages often quote what a file says (a key, a tensor name, a path). Those strings are the
file's, not ours: `untrusted` shortens them and escapes everything unprintable, so a message stays
one short line and cannot carry terminal escape sequences.
"""

from __future__ import annotations

from typing import Any

# Long enough for every real tensor name, key and artifact path; short enough for one line.
QUOTE_LIMIT = 80
MESSAGE_LIMIT = 1000


class AneSpecError(Exception):
    """Base class for errors caused by input the user controls."""


class GGUFError(AneSpecError):
    """The GGUF file is not one this project can read as a Phi-4-mini model."""


class ConfigError(AneSpecError):
    """A model configuration value is invalid or inconsistent."""


class TokenizerError(AneSpecError):
    """The tokenizer data in the GGUF file is missing or inconsistent."""


class ManifestError(AneSpecError):
    """A manifest or an artifact it names is missing, malformed or has been tampered with."""


class BuildError(AneSpecError):
    """A build request is invalid (topology, budgets, options) or its output cannot be written."""


def untrusted(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """`value` quoted for a message: repr-escaped (no control characters, no raw bytes, no lone
    surrogates) and cut to `limit` characters with the full length noted. Containers are
    described by size, never printed."""
    if isinstance(value, (str, bytes, bytearray)):
        text = repr(value[:limit])
        return text if len(value) <= limit else f"{text}... ({len(value):,} in all)"
    if isinstance(value, (list, tuple, dict, set)):
        return f"a {type(value).__name__} of {len(value):,} items"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def describe(value: Any) -> str:
    """What a value from a file is, for "must be X, got ..." messages: its type and, for
    scalars and strings, the value itself (quoted with `untrusted`)."""
    if isinstance(value, (list, tuple, dict, set)):
        return untrusted(value)
    return f"{type(value).__name__} {untrusted(value)}"


def one_line(message: str, limit: int = MESSAGE_LIMIT) -> str:
    """A message as a single printable line: line breaks and tabs become spaces, every other
    unprintable character is escaped, and it is cut to `limit` characters."""
    text = "".join(" " if ch in "\n\r\t\v\f" else
                   ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in message[:limit])
    return text if len(message) <= limit else text + "..."
