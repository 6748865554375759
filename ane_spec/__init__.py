"""ane-spec: Phi-4-mini on the Apple Neural Engine."""

__version__ = "0.1.0"
