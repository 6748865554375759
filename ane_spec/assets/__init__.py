"""Files shipped with the package: the embedded default model.

`tiny-code.Q8_0.gguf` is a few-million-parameter Python code model with Phi-4-mini's exact
architecture and GGUF layout (phi3: GQA, partial RoPE, LongRoPE factors, tied embeddings, Q8_0),
trained in under an hour on CPU on the Python standard library's own source by
`scripts/train_tiny_model.py`. It is not Phi-4-mini: it writes plausible stdlib-style code, not
answers. `tiny-code.Q8_0.json` records how it was made (command, corpus hash, steps, wall time,
held-out loss).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from ane_spec.errors import AneSpecError

TINY_CODE_GGUF = "tiny-code.Q8_0.gguf"


def tiny_code_model() -> Path:
    """The installed path of the embedded model (the package is installed as files, not a zip)."""
    path = Path(str(resources.files(__name__) / TINY_CODE_GGUF))
    if not path.is_file():
        raise AneSpecError(f"the embedded model {path} is missing: reinstall ane-spec "
                           "(it ships as package data)")
    return path


def tiny_code_card() -> dict:
    """The training record written next to the model."""
    path = tiny_code_model().with_suffix(".json")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AneSpecError(f"the embedded model's record {path} is unreadable: {exc}") from None
