"""`--draft-model M`: the draft model's build folder, compiled by the project's own compiler.

M is a build folder (used as it is), or anything `ane-spec build` takes: a GGUF path, a catalog
name (pulled when missing) or `ollama:NAME[:TAG]`. A GGUF is built once into
`local-artifacts/drafts/<file stem>-s<context>` with the default settings and the target's
context window (so the draft can follow the whole conversation), and reused while that build's
source is the same file (size and content hash) with the same window.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ane_spec.errors import AneSpecError, ManifestError
from ane_spec.manifests.schema import MANIFEST_NAME
from ane_spec.manifests.store import hash_path, load_manifest
from ane_spec.model.resolve import resolve_model

DRAFTS_ROOT = Path("local-artifacts/drafts")


def _reusable(out: Path, gguf: Path, max_seq: int) -> bool:
    try:
        m = load_manifest(out, verify=False).manifest
    except (ManifestError, AneSpecError):
        return False
    return (m.build.max_seq == max_seq and m.source.bytes == gguf.stat().st_size
            and m.source.digest == hash_path(gguf, algorithm=m.source.algorithm)[1])


def draft_build(arg: str, *, max_seq: int, root: Path = DRAFTS_ROOT,
                say: Callable[[str], None] = lambda _m: None,
                check: Callable[[Any, str], None] | None = None) -> Path:
    """The build folder of draft model `arg` (module docstring), built first if needed.
    `check(tokenizer_data, name)` may refuse the draft's vocabulary before anything is built."""
    path = Path(arg).expanduser()
    if path.is_dir() or path.name == MANIFEST_NAME:
        folder = path if path.is_dir() else path.parent
        if not (folder / MANIFEST_NAME).is_file():
            raise AneSpecError(f"{arg}: a folder without a {MANIFEST_NAME}: give a build folder, "
                               "a GGUF, a catalog name or ollama:NAME")
        return folder
    gguf = resolve_model(arg, say=say)
    if check is not None:
        from ane_spec.model.gguf_file import open_gguf

        check(open_gguf(gguf).tokenizer_data, gguf.name)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf.stem)[:80] or "draft"
    out = root / f"{stem}-s{max_seq}"
    if _reusable(out, gguf, max_seq):
        say(f"draft model: reusing the build in {out}")
        return out
    from ane_spec.shards.build import BuildRequest, build

    say(f"draft model: building {gguf.name} into {out} (context {max_seq})")
    build(gguf, out, BuildRequest(max_seq=max_seq), force=True, progress=say)
    return out
