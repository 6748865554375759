"""A GGUF's content hashes, taken by a child process that `ane-spec build` starts first thing.

The build's first seconds are one core importing coremltools and torch (~3 s on the 2-core dev
machine) while the other has nothing to do. Hashing a 4 GB file was ~3 s of CPU with sha256 (~1
with BLAKE3 now: content_digest.py), XXH3 of each tensor beside. A thread cannot take that idle
core: the hashing loop's Python fought the imports for the GIL, and the build got slower (measured
twice, issue 33's notes). A process has a GIL of its own and needs only numpy and the GGUF reader
(~0.4 s to import), so it hashes while the parent imports, and the build's busiest stretch (the
first shard's conversion beside the calibration) no longer shares its two cores with the hashing.

The child hashes the file at its path, which may have been replaced in between, so it reports
the identity (device, inode, size, mtime) of what it hashed and checks it again at the end;
`HashesAhead.result` hands back its hashes only if that is the identity of the file the build
holds open. A child that failed, was killed or hashed another file gives None, and the build
hashes in its own process as it did before. The child is the build's to stop: closing it kills
a child still running, and a child whose build was killed stops at its next 64 MB block, so
no hashing outlives its build.

    python -m ane_spec.model.hash_process MODEL.gguf PARENT_PID   # one JSON object on stdout
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    from ane_spec.model.gguf_file import GGUFModel

Hashes = tuple[str, dict[str, str]]
# Below this the file is hashed in the build's own process: the child's start and imports
# (~0.5 s of CPU) would cost about what hashing the file does (~0.7 s per GB).
AHEAD_MIN_BYTES = 512 << 20


class ChildHashes(BaseModel):
    """What the child prints: checked like any input, though it comes from this package."""

    model_config = ConfigDict(extra="forbid")
    identity: tuple[int, int, int, int]
    digest: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]   # content_digest.DIGEST's
    tensors: dict[str, Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]]   # XXH3-128


def start_if_worth_it(path: str | os.PathLike[str]) -> "HashesAhead | None":
    """A HashesAhead for `path` if it is a regular file of AHEAD_MIN_BYTES or more."""
    try:
        worth = os.path.getsize(path) >= AHEAD_MIN_BYTES and os.path.isfile(path)
    except OSError:
        return None   # the build names what is wrong with the path
    return HashesAhead(path) if worth else None


class HashesAhead:
    """`open_gguf(path).content_hashes()` computed by a child process from the moment this is
    made; `result(identity)` waits for it."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self.why_not = ""
        self._child: subprocess.Popen[bytes] | None = subprocess.Popen(
            _child_command(self.path), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def result(self, identity: tuple[int, ...]) -> Hashes | None:
        """The child's hashes if it hashed the file whose identity (gguf_format.file_identity)
        is `identity`; None if it failed or hashed another file (`why_not` says which)."""
        child, self._child = self._child, None
        if child is None:
            self.why_not = "it was stopped"
            return None
        out, err = child.communicate()
        if child.returncode != 0:
            last = err.decode(errors="replace").strip().splitlines()[-1:] or [
                f"exit status {child.returncode}"]
            self.why_not = f"it failed ({last[0][:300]})"
            return None
        try:
            got = ChildHashes.model_validate_json(out)
        except ValidationError as exc:
            self.why_not = f"its output is not what it should be ({exc.error_count()} errors)"
            return None
        if got.identity != tuple(identity):
            self.why_not = "the file it hashed is not the one the build opened"
            return None
        self.why_not = ""
        return got.digest, got.tensors

    def hashes_for(self, model: "GGUFModel", say: Callable[[str], None]) -> Hashes:
        """The child's hashes of `model`'s file, or the model's own (hashed here, and said so)
        where the child's are unusable."""
        got = self.result(model.identity)
        if got is not None and got[1].keys() != model.tensors.keys():
            got, self.why_not = None, "its tensors are not the file's"
        if got is None:
            say(f"hashing {model.path.name} (the hashes taken ahead are unusable: "
                f"{self.why_not})")
            got = model.content_hashes()
        return got

    def close(self) -> None:
        """Kill the child if it still runs, and reap it."""
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.communicate()

    def __enter__(self) -> "HashesAhead":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _child_command(path: str) -> list[str]:
    return [sys.executable, "-m", __name__, path, str(os.getpid())]


class _ParentGone:
    """`content_hashes`' stop, set once the build that started this process has ended (it
    was killed: a build that fails kills its child): its orphan is re-parented."""

    def __init__(self, parent: int):
        self.parent = parent

    def is_set(self) -> bool:
        return os.getppid() != self.parent


def main(argv: list[str]) -> int:
    from ane_spec.model.gguf_file import open_gguf

    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m ane_spec.model.hash_process MODEL.gguf PARENT_PID",
              file=sys.stderr)
        return 2
    try:
        with open_gguf(argv[0]) as model:
            digest, tensors = model.content_hashes(stop=_ParentGone(int(argv[1])))
            model.check_unchanged()
            identity = model.identity
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which hashes itself
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    json.dump({"identity": identity, "digest": digest, "tensors": tensors}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
