"""`ane-spec daemon install`: a macOS LaunchAgent that runs `ane-spec serve` at login and
restarts it if it dies (RunAtLoad + KeepAlive).

ProgramArguments start with this interpreter's absolute path (`python -m ane_spec.cli serve ...`)
because launchd runs agents with a minimal PATH where `ane-spec` may not be found. An API key
goes into the plist's EnvironmentVariables (ANE_SPEC_API_KEY), never onto the command line where
`ps` would show it, and the file is then written owner-only.

Off macOS, or with `print_only`, nothing is written: the plist is returned for printing with
the place it would go (and the API key, if any, redacted).
"""

from __future__ import annotations

import os
import plistlib
import sys
from dataclasses import dataclass
from pathlib import Path

from ane_spec.daemon.config import ServeConfig
from ane_spec.manifests.store import load_manifest

LABEL = "com.ane-spec.daemon"
API_KEY_ENV = "ANE_SPEC_API_KEY"


@dataclass(frozen=True)
class InstallResult:
    plist_path: Path
    plist: bytes
    written: bool
    message: str


def plist_path(home: Path | None = None) -> Path:
    return (home or Path.home()) / "Library" / "LaunchAgents" / f"{LABEL}.plist"


def log_dir(home: Path | None = None) -> Path:
    return (home or Path.home()) / "Library" / "Logs" / "ane-spec"


def serve_arguments(config: ServeConfig, python: str | None = None) -> list[str]:
    """The command line that reproduces `config` (defaults left out; never the API key)."""
    args = [python or sys.executable, "-m", "ane_spec.cli", "serve",
            "--manifest", str(Path(config.manifest).expanduser().resolve())]
    fields = ServeConfig.model_fields
    flags = {"host": "--host", "port": "--port", "backend": "--backend",
             "precision": "--precision", "decode_shape": "--decode-shape",
             "prefill": "--prefill",
             "max_queue": "--max-queue", "ngram_min": "--ngram-min",
             "ngram_max": "--ngram-max", "max_body_bytes": "--max-body-bytes",
             "model_name": "--model-name", "log_level": "--log-level",
             "kv_slots": "--kv-slots", "slot_spill_mb": "--slot-spill-mb",
             "slot_save_path": "--slot-save-path", "draft_memory": "--draft-memory",
             "draft_memory_tokens": "--draft-memory-tokens", "body_timeout": "--body-timeout",
             "slot_save_max_files": "--slot-save-max-files",
             "slot_save_max_mb": "--slot-save-max-mb",
             "request_timeout": "--request-timeout", "grammar_token_ms": "--grammar-token-ms",
             "grammar_queue": "--grammar-queue", "grammar_wait": "--grammar-wait",
             "draft_manifest": "--draft-model", "draft_units": "--draft-units",
             "draft_mode": "--draft-mode"}
    for field, flag in flags.items():
        value = getattr(config, field)
        if field in ("slot_save_path", "draft_manifest") and value is not None:
            # launchd runs from $HOME
            value = Path(value).expanduser().resolve()
        if field == "backend" or value != fields[field].get_default(call_default_factory=True):
            args += [flag, str(value)]
    for field, flag in (("speculative", "--no-speculative"), ("guard", "--no-guard"),
                        ("verify", "--no-verify")):
        if not getattr(config, field):
            args.append(flag)
    if config.special_in_content:
        args.append("--special-in-content")
    if config.draft_overlap is not None:
        args.append("--draft-overlap" if config.draft_overlap else "--no-draft-overlap")
    for field, flag in (("allowed_origins", "--allowed-origins"),
                        ("allowed_hosts", "--allowed-hosts")):
        if getattr(config, field):
            args += [flag, ",".join(getattr(config, field))]
    return args


REDACTED = "<the API key: written only into the installed file>"


def launch_agent(config: ServeConfig, *, home: Path | None = None,
                 python: str | None = None, redact: bool = False) -> dict:
    logs = log_dir(home)
    agent = {
        "Label": LABEL,
        "ProgramArguments": serve_arguments(config, python),
        "RunAtLoad": True,
        "KeepAlive": True,
        # Without a ProcessType launchd applies "light resource limits ... throttling its CPU
        # usage and I/O bandwidth" (launchd.plist(5)); the daemon answers an editor's keystrokes.
        "ProcessType": "Interactive",
        "WorkingDirectory": str(home or Path.home()),
        "StandardOutPath": str(logs / "daemon.out.log"),
        "StandardErrorPath": str(logs / "daemon.err.log"),
    }
    if config.api_key:
        agent["EnvironmentVariables"] = {API_KEY_ENV: REDACTED if redact else config.api_key}
    return agent


def install_launch_agent(config: ServeConfig, *, print_only: bool = False,
                         home: Path | None = None, platform: str | None = None,
                         python: str | None = None) -> InstallResult:
    """Write the LaunchAgent plist (macOS), or just describe it (elsewhere / `print_only`)."""
    load_manifest(config.manifest, verify=False)  # a missing build would make a crash loop
    platform = platform or sys.platform
    path = plist_path(home)
    write = not print_only and platform == "darwin"
    data = plistlib.dumps(launch_agent(config, home=home, python=python, redact=not write),
                          sort_keys=False)
    if not write:
        why = "--print given" if print_only else f"this is {platform}, not macOS"
        return InstallResult(path, data, False,
                             f"{why}: nothing written; on macOS this plist goes to {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    log_dir(home).mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
    uid = os.getuid()
    return InstallResult(path, data, True,
                         f"wrote {path}; it starts at your next login. To start it now:\n"
                         f"  launchctl bootstrap gui/{uid} {path}\n"
                         f"to stop and remove it:\n"
                         f"  launchctl bootout gui/{uid}/{LABEL} && rm {path}\n"
                         f"logs: {log_dir(home)}")
