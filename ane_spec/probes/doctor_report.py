"""`ane-spec doctor`'s results as terminal lines, one JSON object, or Markdown short enough to
paste into an issue."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from ane_spec.probes.doctor import Check

_MARK = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}


def counts(checks: list[Check]) -> dict[str, int]:
    found = Counter(c.status for c in checks)
    return {status: found[status] for status in ("passed", "failed", "skipped")}


def to_json(checks: list[Check], manifest: str | None) -> str:
    environment = next((c.details for c in checks if c.name == "environment"), {})
    body: dict[str, Any] = {"manifest": manifest, "environment": environment,
                            "counts": counts(checks),
                            "checks": [{"name": c.name, "status": c.status, "summary": c.summary,
                                        "details": c.details} for c in checks]}
    return json.dumps(body, default=_plain)


def to_lines(checks: list[Check]) -> str:
    lines = [f"{_MARK[c.status]}  {c.name}: {c.summary}" for c in checks]
    n = counts(checks)
    lines.append(f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped")
    return "\n".join(lines)


def to_markdown(checks: list[Check], manifest: str | None) -> str:
    n = counts(checks)
    env = next((c for c in checks if c.name == "environment"), None)
    out = ["## ane-spec doctor", ""]
    if env is not None:
        out += [f"- {env.summary}", f"- Core ML: {env.details.get('core_ml', '?')}"]
    out += [f"- build: `{manifest}`" if manifest else "- build: none (no --manifest)",
            f"- {n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped", "",
            "| check | status | result |", "|---|---|---|"]
    out += [f"| {c.name} | {c.status} | {_cell(c.summary)} |" for c in checks
            if c.name != "environment"]
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _plain(value: Any) -> Any:
    """JSON for numpy scalars and anything else a gate put in its details."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)
