"""Decoding: sessions, block verification, the exactness guard, drafters, sampling."""

from ane_spec.decode.drafter import Drafter, NgramDrafter

__all__ = ["Drafter", "NgramDrafter"]
