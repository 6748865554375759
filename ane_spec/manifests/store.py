"""Reading, verifying and writing manifests and the artifacts they name."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from ane_spec.errors import ManifestError
from ane_spec.manifests.schema import MANIFEST_NAME, SCHEMA_VERSION, FileRef, GateResult, Manifest

_CHUNK = 1 << 22


def hash_path(path: Path) -> tuple[int, str]:
    """(bytes, sha256) of a file, or of a folder (an .mlpackage) as its sorted relative paths
    and contents, so renaming or editing any file inside changes the hash."""
    h = hashlib.sha256()
    total = 0
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        if f is not path:
            h.update(f.relative_to(path).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(_CHUNK):
                h.update(block)
                total += len(block)
    return total, h.hexdigest()


def file_ref(root: Path, path: Path) -> FileRef:
    size, digest = hash_path(path)
    return FileRef(path=path.relative_to(root).as_posix(), bytes=size, sha256=digest)


@dataclass
class LoadedManifest:
    manifest: Manifest
    root: Path

    def path(self, ref: FileRef) -> Path:
        return self.root / ref.path

    @property
    def file(self) -> Path:
        return self.root / MANIFEST_NAME


def manifest_path(location: str | os.PathLike[str]) -> Path:
    p = Path(location)
    return p / MANIFEST_NAME if p.is_dir() else p


def all_file_refs(m: Manifest) -> list[FileRef]:
    refs = [m.tokenizer, m.head.file, *(s.file for s in m.shards)]
    return refs + list(m.embeddings.files.values())


def load_manifest(location: str | os.PathLike[str], *, verify: bool = True) -> LoadedManifest:
    """Load `manifest.json` (or the folder holding it); with `verify`, check every named file's
    size and sha256 so a tampered or half-copied artifact is refused before anything runs."""
    path = manifest_path(location)
    if not path.is_file():
        raise ManifestError(f"{path}: no manifest here (build one with `ane-spec build`)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: not valid JSON: {exc}") from None
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version != SCHEMA_VERSION:
        raise ManifestError(f"{path}: schema_version {version!r} is not supported (this ane-spec "
                            f"reads version {SCHEMA_VERSION}); rebuild the artifacts")
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ManifestError(f"{path}: invalid manifest at '{where}': {first['msg']}") from None
    loaded = LoadedManifest(manifest, path.parent)
    for ref in all_file_refs(manifest):
        target = loaded.path(ref)
        if not target.exists():
            raise ManifestError(f"{path}: artifact '{ref.path}' is missing")
        if verify:
            size, digest = hash_path(target)
            if size != ref.bytes:
                raise ManifestError(f"{path}: artifact '{ref.path}' has {size:,} bytes, the "
                                    f"manifest records {ref.bytes:,} (incomplete copy?)")
            if digest != ref.sha256:
                raise ManifestError(f"{path}: artifact '{ref.path}' does not match its recorded "
                                    "sha256 (modified after the build?)")
    return loaded


def write_manifest(manifest: Manifest, folder: Path) -> Path:
    """Write atomically: a reader sees the old manifest or the new one, never half of one."""
    path = folder / MANIFEST_NAME
    tmp = folder / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(manifest.model_dump_json(indent=2) + "\n")
    os.replace(tmp, path)
    return path


def record_gate(location: str | os.PathLike[str], name: str, result: GateResult) -> None:
    """Store a gate's verdict in the manifest (read without re-hashing the artifacts)."""
    loaded = load_manifest(location, verify=False)
    loaded.manifest.gates[name] = result
    write_manifest(loaded.manifest, loaded.root)


def record_drift(location: str | os.PathLike[str], key: str, drift: float) -> None:
    """Store a backend's measured T=4-vs-T=1 logit drift for the exactness guard."""
    loaded = load_manifest(location, verify=False)
    loaded.manifest.drift[key] = drift
    write_manifest(loaded.manifest, loaded.root)
