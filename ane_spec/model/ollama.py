"""`ollama:NAME[:TAG]`: the GGUF blob of a model already in Ollama's store.

Ollama keeps models under `$OLLAMA_MODELS` (default `~/.ollama/models`):
`manifests/<host>/<namespace>/<model>/<tag>` is a JSON manifest whose layer of media type
`application/vnd.ollama.image.model` names the GGUF by digest, stored at
`blobs/sha256-<hex>`. Names follow Ollama's `types/model/name.go`: `[host/][namespace/]model[:tag]`,
host `registry.ollama.ai`, namespace `library` and tag `latest` by default; every part starts
with a letter, digit or '_' and holds only those, '-' and '.' after it (no '.' in a namespace,
':' only in a host, for its port); a host is at most 350 characters, the others 80. So no part
can be `..` or hold a '/': a name never reaches outside the store. Ollama matches names without
regard to case; so does this lookup when the exact spelling is not on disk.

The blob is not re-hashed (Ollama verified it when it pulled it; a multi-GB hash per build
would be slow); its size is checked against the manifest's, which must be a JSON integer.

The store is read as hostile (issue 36): a manifest or blob is used only if it is a regular
file whose resolved location lies inside the store (a blob linked to /etc/passwd was opened
and read, manifests linked to files outside were parsed); a manifest is opened without following
a link and without blocking (a FIFO), and read up to MAX_MANIFEST_BYTES + 1 bytes.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ane_spec.errors import AneSpecError, untrusted

OLLAMA_PREFIX = "ollama:"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
MAX_MANIFEST_BYTES = 1 << 20
MAX_LISTED = 20
_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})\Z")  # \Z: `$` also matches before a final \n


class OllamaError(AneSpecError):
    """An `ollama:` reference that names no usable model in Ollama's store."""


@dataclass(frozen=True)
class OllamaName:
    host: str
    namespace: str
    model: str
    tag: str

    def parts(self) -> tuple[str, str, str, str]:
        return (self.host, self.namespace, self.model, self.tag)

    def short(self) -> str:
        """As Ollama displays it: default host and namespace left out."""
        prefix = ""
        if self.host.lower() != DEFAULT_HOST:
            prefix = f"{self.host}/{self.namespace}/"
        elif self.namespace.lower() != DEFAULT_NAMESPACE:
            prefix = f"{self.namespace}/"
        return f"{prefix}{self.model}:{self.tag}"


def _valid_part(kind: str, s: str) -> bool:
    if not 1 <= len(s) <= (350 if kind == "host" else 80):
        return False
    if not (s[0].isascii() and (s[0].isalnum() or s[0] == "_")):
        return False
    for c in s[1:]:
        if c.isascii() and (c.isalnum() or c in "_-"):
            continue
        if c == "." and kind != "namespace":
            continue
        if c == ":" and kind == "host":
            continue
        return False
    return True


def parse_ollama_name(name: str) -> OllamaName:
    """`[host/][namespace/]model[:tag]` as Ollama's ParseNameBare splits it, defaults filled,
    every part checked; a bad name raises OllamaError."""
    raw = name
    if raw.startswith(OLLAMA_PREFIX):
        raw = raw[len(OLLAMA_PREFIX):]
    tag = DEFAULT_TAG
    if raw.rfind(":") > raw.rfind("/"):
        raw, tag = raw.rsplit(":", 1)
    pieces = raw.split("/")
    if len(pieces) > 3:
        raise OllamaError(f"{untrusted(name)} is not an Ollama model name "
                          "([host/][namespace/]model[:tag])")
    model = pieces[-1]
    namespace = pieces[-2] if len(pieces) >= 2 else DEFAULT_NAMESPACE
    host = pieces[-3] if len(pieces) == 3 else DEFAULT_HOST
    parsed = OllamaName(host, namespace, model, tag)
    for kind, value in zip(("host", "namespace", "model", "tag"), parsed.parts()):
        if not _valid_part(kind, value):
            raise OllamaError(
                f"{untrusted(name)} is not an Ollama model name: its {kind} {untrusted(value)} "
                "must start with a letter, digit or '_' and hold only those, '-' and '.'"
                + (" (no '.')" if kind == "namespace" else "")
                + f", at most {350 if kind == 'host' else 80} characters")
    return parsed


def ollama_models_dir() -> Path:
    """`$OLLAMA_MODELS`, else `~/.ollama/models`, as Ollama itself chooses."""
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def resolve_ollama(ref: str, models_dir: str | os.PathLike[str] | None = None) -> Path:
    """The GGUF blob that `ref`'s (`ollama:NAME[:TAG]` or `NAME[:TAG]`) manifest names."""
    name = parse_ollama_name(ref)
    root = Path(models_dir) if models_dir is not None else ollama_models_dir()
    manifests = root / "manifests"
    if not manifests.is_dir():
        raise OllamaError(f"no Ollama model store at {root} (no manifests folder): install "
                          "Ollama and `ollama pull` a model, or set OLLAMA_MODELS to the folder "
                          "that holds its models")
    manifest = _find_manifest(manifests, name)
    if manifest is None:
        have = list_ollama_models(root)
        listing = (", ".join(have[:MAX_LISTED]) + (f" and {len(have) - MAX_LISTED} more"
                                                    if len(have) > MAX_LISTED else "")
                   ) if have else "none"
        raise OllamaError(f"Ollama has no model {name.short()} in {root} (`ollama pull "
                          f"{name.short()}` fetches it); models there: {listing}")
    layer = _model_layer(root, manifest, name)
    digest = _DIGEST.match(layer["digest"]) if isinstance(layer.get("digest"), str) else None
    if digest is None:
        raise OllamaError(f"{manifest}: the model layer's digest "
                          f"{untrusted(layer.get('digest'))} is not sha256:<64 hex digits>")
    blob = root / "blobs" / f"sha256-{digest.group(1)}"
    if not os.path.lexists(blob):
        raise OllamaError(f"{name.short()}: its manifest names blob {blob.name}, which is not "
                          f"in {root / 'blobs'} (an interrupted pull? `ollama pull "
                          f"{name.short()}` again)")
    info = _in_store(root, blob, "blob")
    size = layer.get("size")
    if not isinstance(size, int) or isinstance(size, bool):
        raise OllamaError(f"{manifest}: the model layer's size {untrusted(size)} is not an "
                          "integer")
    if info.st_size != size:
        raise OllamaError(f"{blob}: {info.st_size:,} bytes, but the manifest of "
                          f"{name.short()} says {size:,} (an interrupted pull?)")
    return blob


def _in_store(root: Path, path: Path, what: str) -> os.stat_result:
    """`path`'s stat, if it is a regular file whose resolved location is inside the store;
    else OllamaError."""
    try:
        where = path.resolve(strict=True)
        home = root.resolve(strict=True)
        info = os.stat(where)
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise OllamaError(f"{path}: cannot read the {what}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    if not where.is_relative_to(home):
        raise OllamaError(f"{path}: the {what} is a link to {where}, outside the Ollama store "
                          f"{home}; refused")
    if not stat.S_ISREG(info.st_mode):
        raise OllamaError(f"{path}: the {what} is not a regular file (a folder, FIFO or "
                          "device); refused")
    return info


def _find_manifest(manifests: Path, name: OllamaName) -> Path | None:
    """The manifest file for `name`: the exact spelling, else a case-insensitive match, one
    folder level at a time (names are validated, so no level can leave `manifests`)."""
    exact = manifests.joinpath(*name.parts())
    if os.path.lexists(exact):  # (whatever it is: `_model_layer` refuses it if it must)
        return exact
    here = manifests
    for i, part in enumerate(name.parts()):
        try:
            matches = [p for p in here.iterdir() if p.name.lower() == part.lower()]
        except OSError:
            return None
        want_file = i == 3
        matches = [p for p in matches if (os.path.lexists(p) if want_file else p.is_dir())]
        if len(matches) != 1:
            return None
        here = matches[0]
    return here


def _model_layer(root: Path, manifest: Path, name: OllamaName) -> dict:
    _in_store(root, manifest, "manifest")
    try:  # the resolved path, without following a link swapped in since, nor blocking
        fd = os.open(manifest.resolve(), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise OllamaError(f"{manifest}: the manifest is not a regular file; refused")
            os.set_blocking(f.fileno(), True)
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise OllamaError(f"{manifest}: cannot read the manifest: {exc.strerror or exc}") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise OllamaError(f"{manifest}: a manifest over {MAX_MANIFEST_BYTES:,} bytes is not "
                          "one Ollama writes")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise OllamaError(f"{manifest}: not a JSON manifest") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list):
        raise OllamaError(f"{manifest}: not an Ollama manifest (no \"layers\" list)")
    models = [layer for layer in layers
              if isinstance(layer, dict) and layer.get("mediaType") == MODEL_MEDIA_TYPE]
    if not models:
        kinds = sorted({str(layer.get("mediaType")) for layer in layers if isinstance(layer, dict)})
        raise OllamaError(f"{name.short()}: its manifest has no model layer ({MODEL_MEDIA_TYPE}); "
                          f"it has {untrusted(', '.join(kinds) or 'no layers', 200)}")
    return models[-1]  # Ollama's GetModel keeps the last model layer it reads


def list_ollama_models(root: str | os.PathLike[str] | None = None, limit: int = 1000
                       ) -> list[str]:
    """The models in Ollama's store, as Ollama displays their names (sorted, at most `limit`)."""
    manifests = Path(root if root is not None else ollama_models_dir()) / "manifests"
    found: list[str] = []

    def children(p: Path) -> list[Path]:
        try:
            return sorted(p.iterdir())
        except OSError:
            return []

    for host in children(manifests):
        for ns in children(host):
            for model in children(ns):
                for tag in children(model):
                    if len(found) >= limit:
                        return sorted(found)
                    if tag.is_file():
                        found.append(OllamaName(host.name, ns.name, model.name, tag.name).short())
    return sorted(found)
