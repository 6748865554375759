"""The registry of supported GGUF architectures: one module each, one line here."""

from __future__ import annotations

from ane_spec.errors import GGUFError, untrusted
from ane_spec.model.architectures import gemma3, llama, phi3, qwen2, qwen3
from ane_spec.model.architectures.base import Architecture, RopeFactors, RopeType

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a for a in (phi3.ARCHITECTURE, llama.ARCHITECTURE, qwen2.ARCHITECTURE,
                        qwen3.ARCHITECTURE, gemma3.ARCHITECTURE)
}


def get_architecture(name: object) -> Architecture:
    arch = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if arch is None:
        raise GGUFError(f"architecture {untrusted(name)} is not supported; supported: "
                        f"{', '.join(ARCHITECTURES)}")
    return arch


__all__ = ["ARCHITECTURES", "Architecture", "RopeFactors", "RopeType", "get_architecture"]
