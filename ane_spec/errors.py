"""The one exception family users see.

Every failure a user can cause (a bad file, a bad flag, a tampered artifact, a malformed request)
raises a subclass of `AneSpecError` whose message names the problem; the CLI prints it without a
traceback and the daemon turns it into a 4xx. Anything else escaping is a bug.
"""


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
