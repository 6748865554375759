"""Decoding: sessions, block verification, the exactness guard, drafters, sampling."""

from ane_spec.decode.drafter import Drafter, DraftMemory, NgramDrafter

__all__ = ["DraftMemory", "Drafter", "NgramDrafter"]
