"""One resolver from what a user types to a GGUF file path.

- a path to a file that exists (it wins over a catalog name spelled the same);
- a catalog name (model/catalog.py): the cached file, pulled first if it is not cached yet;
- `ollama:NAME[:TAG]`: the blob Ollama's manifest names (model/ollama.py).

Everything after this works on the path alone: nothing below knows where a file came from.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ane_spec.errors import GGUFError, untrusted
from ane_spec.model.catalog import CATALOG
from ane_spec.model.ollama import OLLAMA_PREFIX, resolve_ollama


def resolve_model(arg: str | os.PathLike[str], *, say: Callable[[str], None] | None = None,
                  verify: bool = False) -> Path:
    """The GGUF file `arg` names (see the module docstring). `say` gets a pull's progress."""
    if not isinstance(arg, str):
        return Path(arg)
    if arg.startswith(OLLAMA_PREFIX):
        return resolve_ollama(arg)
    path = Path(arg).expanduser()
    if path.exists():
        return path
    if arg in CATALOG:
        from ane_spec.model.pull import pull

        return pull(arg, verify=verify, say=say)
    raise GGUFError(f"{untrusted(arg, 200)}: no such file, and not a catalog model ("
                    + ", ".join(CATALOG) + ") or ollama:NAME[:TAG]")
