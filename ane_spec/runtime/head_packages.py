"""The LM head as the pipeline sees it: one program, however many packages it was built as.

A head over the build's --max-head-mb is built as several packages (manifest `heads`), each
computing a contiguous run of the head's vocabulary chunks from the same hidden states, with its
outputs named by the chunk's index in the whole head (`schema.head_output_names`). `SplitHead`
runs every package on the same inputs, in vocabulary order, and merges their outputs into the
dict one package would have returned, so everything that reads a head (`ShardPipeline._read_head`,
the doctor, the probes) reads a split one unchanged.

Each package's declared outputs are checked against its manifest entry when it is loaded: a
package that is not the one the manifest describes (a stale or swapped file in a build loaded
without hash verification) is refused by name, rather than merged into a head with a chunk
missing or twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ane_spec.errors import AneSpecError, ManifestError, untrusted
from ane_spec.manifests.schema import HeadEntry
from ane_spec.runtime.backend import LoadedProgram


class SplitHead:
    """The head's packages as one stateless `LoadedProgram`."""

    def __init__(self, parts: Sequence[LoadedProgram], entries: Sequence[HeadEntry],
                 where: Path | str):
        if not parts or len(parts) != len(entries):
            raise ManifestError(f"{where}: {len(parts)} head package(s) loaded for "
                                f"{len(entries)} in the manifest")
        for part, entry in zip(parts, entries):
            want = [o.name for o in entry.outputs]
            if sorted(part.output_names) != sorted(want):
                raise ManifestError(
                    f"{where}: head package {untrusted(entry.file.path)} outputs "
                    f"{untrusted(', '.join(part.output_names[:6]), 160)}, but the manifest "
                    f"records {', '.join(want[:6])} for it: it is not this build's package; "
                    "rebuild with `ane-spec build --force`")
            if part.state_names:
                raise ManifestError(f"{where}: head package {untrusted(entry.file.path)} has "
                                    "states; an LM head has none")
        self.parts = list(parts)
        self.input_names = list(self.parts[0].input_names)
        self.output_names = [name for p in self.parts for name in p.output_names]
        self.state_names: list[str] = []

    def make_state(self) -> None:
        return None

    def predict(self, inputs: dict[str, np.ndarray], state: Any = None) -> dict[str, np.ndarray]:
        """Every package on the same inputs, in vocabulary order; their outputs merged (the
        names are distinct: the manifest's check and the one at load ensure it)."""
        merged: dict[str, np.ndarray] = {}
        for part in self.parts:
            merged.update(part.predict(inputs))
        return merged

    def read_state(self, state: Any, name: str) -> np.ndarray:
        raise AneSpecError(f"the LM head has no state '{name}'")

    def write_state(self, state: Any, name: str, value: np.ndarray) -> None:
        raise AneSpecError(f"the LM head has no state '{name}'")
