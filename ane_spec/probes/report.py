"""A gate's verdict: one JSON object on stdout or disk, and a line in the manifest's `gates`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ane_spec.manifests.schema import GateResult
from ane_spec.manifests.store import LoadedManifest, record_gate


@dataclass
class GateReport:
    gate: str
    passed: bool
    backend: str
    precision: str | None
    figures: dict[str, Any] = field(default_factory=dict)   # min_cosine, argmax_agreement, ...
    thresholds: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)   # per-position / per-shard lists
    skipped: str | None = None                               # why, when it could not run here
    decode_shape: str | None = None  # set for figures that depend on the pass width (parity, drift)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        # Scripts read the headline figures at the top level (gate, min_cosine, ...), and the
        # verdict last.
        head = {k: v for k, v in d.items() if k not in ("figures", "passed")}
        return {**head, **self.figures, "passed": self.passed}

    @property
    def _where(self) -> list[str]:
        return [p for p in (self.backend, self.precision, self.decode_shape) if p]

    @property
    def key(self) -> str:
        """`backend-precision[-shape]`: where the figures were measured."""
        return "-".join(self._where)

    @property
    def where(self) -> str:
        """`backend/precision[/shape]`, for people."""
        return "/".join(self._where)

    def summary(self) -> str:
        if self.skipped:
            return f"{self.gate}: SKIPPED ({self.skipped})"
        figs = ", ".join(f"{k} {_fmt(v)}" for k, v in self.figures.items())
        return f"{self.gate} [{self.where}]: {'PASS' if self.passed else 'FAIL'}  {figs}"


def _fmt(v: Any) -> str:
    return f"{v:.6f}" if isinstance(v, float) else str(v)


def save_report(report: GateReport, loaded: LoadedManifest) -> Path:
    """Write the full report next to the manifest and record the verdict in it."""
    folder = loaded.root / "gates"
    folder.mkdir(exist_ok=True)
    path = folder / f"{report.gate}-{report.key}.json"
    path.write_text(json.dumps(report.to_dict(), indent=2, default=float) + "\n")
    if report.skipped is None:
        record_gate(loaded.root, f"{report.gate}:{report.key}", GateResult(
            passed=report.passed, backend=report.backend, precision=report.precision,
            decode_shape=report.decode_shape,
            figures={k: v for k, v in report.figures.items() if not isinstance(v, list)},
            report=path.relative_to(loaded.root).as_posix(),
            at=datetime.now(timezone.utc).isoformat(timespec="seconds")))
    return path
