"""ane-spec: Phi-4-mini on the Apple Neural Engine."""

from ane_spec import coreml_noise as _coreml_noise

__version__ = "0.1.0"

_coreml_noise.install()  # before any module here imports coremltools
