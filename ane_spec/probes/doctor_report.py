"""`ane-spec doctor`'s results as terminal lines, one JSON object, or Markdown short enough to
paste into an issue."""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from ane_spec.probes.doctor import Check

_MARK = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}


def counts(checks: list[Check]) -> dict[str, int]:
    found = Counter(c.status for c in checks)
    return {status: found[status] for status in ("passed", "failed", "skipped")}


def mask_form_advice(checks: list[Check]) -> dict[str, Any] | None:
    """The mask-ops check's advice, {"mask_form": "select"|"additive"|None, "reason": ...}, or
    None where it did not run to a result (skipped, or not in this run)."""
    check = next((c for c in checks if c.name == "mask-ops"), None)
    if check is None or "recommended_mask_form" not in (check.details or {}):
        return None
    return {"mask_form": check.details["recommended_mask_form"],
            "reason": check.details["reason"]}


def _advice_line(checks: list[Check]) -> str | None:
    advice = mask_form_advice(checks)
    if advice is None:
        return None
    form = f"--mask-form {advice['mask_form']}" if advice["mask_form"] else "undetermined"
    return f"mask form for this Mac: {form} ({advice['reason']})"


def to_json(checks: list[Check], manifest: str | None) -> str:
    environment = next((c.details for c in checks if c.name == "environment"), {})
    body: dict[str, Any] = {"manifest": manifest, "environment": environment,
                            "counts": counts(checks), "cost": cost(checks),
                            "mask_form": mask_form_advice(checks),
                            "checks": [{"name": c.name, "status": c.status, "summary": c.summary,
                                        "seconds": c.seconds, "details": c.details}
                                       for c in checks]}
    return json.dumps(body, default=_plain)


def cost(checks: list[Check]) -> dict[str, Any]:
    """What the doctor cost: wall seconds in all, and the input-shape switches under
    reshapeFrequency Infrequent per check (each may be a re-specialisation, minutes on Phi)."""
    switches = {c.name: c.details["shape_switches"] for c in checks
                if isinstance(c.details, dict) and c.details.get("shape_switches")}
    return {"seconds": round(sum(c.seconds for c in checks), 1),
            "shape_switches": sum(switches.values()), "shape_switches_by_check": switches}


def _cost_line(checks: list[Check]) -> str:
    c = cost(checks)
    by_check = ", ".join(f"{k} {v}" for k, v in c["shape_switches_by_check"].items())
    return (f"took {c['seconds']:.0f}s; {c['shape_switches']} input-shape switch(es) under "
            f"reshapeFrequency Infrequent" + (f" ({by_check})" if by_check else ""))


def to_lines(checks: list[Check]) -> str:
    lines = [f"{_MARK[c.status]}  {c.name}: {c.summary}" for c in checks]
    n = counts(checks)
    advice = _advice_line(checks)
    if advice:
        lines.append(advice)
    lines.append(f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped; "
                 + _cost_line(checks))
    return "\n".join(lines)


def to_markdown(checks: list[Check], manifest: str | None) -> str:
    n = counts(checks)
    env = next((c for c in checks if c.name == "environment"), None)
    out = ["## ane-spec doctor", ""]
    if env is not None:
        out += [f"- {env.summary}", f"- Core ML: {env.details.get('core_ml', '?')}"]
    out += [f"- build: `{manifest}`" if manifest else "- build: none (no --manifest)",
            f"- {n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped",
            f"- {_cost_line(checks)}"]
    advice = _advice_line(checks)
    out += [f"- {advice}"] if advice else []
    out += ["",
            "| check | status | result |", "|---|---|---|"]
    out += [f"| {c.name} | {c.status} | {_cell(c.summary)} |" for c in checks
            if c.name != "environment"]
    return "\n".join(out) + "\n"


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` in one step, so a reader (or a crash) never sees half a report."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _plain(value: Any) -> Any:
    """JSON for numpy scalars and anything else a gate put in its details."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)
