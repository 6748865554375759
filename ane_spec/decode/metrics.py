"""Per-request statistics (defined once, reported everywhere) and the optional per-pass trace.

- tokens per pass: tokens produced by decode passes / decode passes, counting passes that had no
  draft (vLLM's "acceptance length" skips those: not comparable). The first generated token
  comes from the prefill's last row and is not counted. Plain T=1 decoding gives exactly 1.0.
- draft hit rate: passes with a non-empty draft / passes.
- acceptance: accepted drafts / drafted tokens.
- backend_seconds / host_seconds split the decode passes' time (prefill has prefill_seconds):
  host is everything but backend compute (drafting, masks, verification, detokenizing).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import IO, Any


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    decode_shape: str = "fixed"  # the pipeline's: every pass at T=4, or T=1 decode + T=4 verify
    reused_prefix_tokens: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_passes: int = 0
    prefill_function_passes: int = 0  # of those, passes of the build's prefill function
    # The widest prefill pass this request ran: the build's prefill T where it used the prefill
    # function, else the decode shape's T (0: nothing was prefilled).
    prefill_t: int = 0
    ttft_seconds: float = 0.0  # from the request's start to its first token chosen
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    passes: int = 0
    pass_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    passes_with_draft: int = 0
    accepted_histogram: Counter = field(default_factory=Counter)
    guard_interventions: int = 0
    t1_redo_passes: int = 0
    backend_seconds: float = 0.0
    host_seconds: float = 0.0
    # Per draft source ("model", "ngram", "grammar", "none"): passes, drafted, accepted.
    sources: dict[str, list[int]] = field(default_factory=dict)
    draft_model_passes: int = 0     # the draft model's passes on the critical path
    draft_seconds: float = 0.0      # wall time spent waiting for drafts (part of host time)

    def record_prefill_pass(self, width: int, prefill_function: bool) -> None:
        self.prefill_passes += 1
        self.prefill_function_passes += prefill_function
        self.prefill_t = max(self.prefill_t, width)

    def record_pass(self, drafted: int, accepted: int, produced: int) -> None:
        self.passes += 1
        self.drafted += drafted
        self.accepted += accepted
        self.pass_tokens += produced
        self.passes_with_draft += drafted > 0
        self.accepted_histogram[accepted] += 1

    def record_source(self, source: str, drafted: int, accepted: int, model_passes: int,
                      seconds: float) -> None:
        row = self.sources.setdefault(source, [0, 0, 0])
        row[0] += 1
        row[1] += drafted
        row[2] += accepted
        self.draft_model_passes += model_passes
        self.draft_seconds += seconds

    def to_dict(self) -> dict[str, Any]:
        def rate(n: float, d: float) -> float:
            return round(n / d, 4) if d else 0.0

        return {
            "decode_shape": self.decode_shape,
            "prompt_tokens": self.prompt_tokens,
            "reused_prefix_tokens": self.reused_prefix_tokens,
            "prefill_tokens": self.prefill_tokens,
            "prefill_passes": self.prefill_passes,
            "prefill_function_passes": self.prefill_function_passes,
            "prefill_t": self.prefill_t,
            "prefill_tok_s": rate(self.prefill_tokens, self.prefill_seconds),
            "ttft_seconds": round(self.ttft_seconds, 4),
            "generated_tokens": self.generated_tokens,
            "decode_tok_s": rate(self.pass_tokens, self.decode_seconds),
            "passes": self.passes,
            "tokens_per_pass": rate(self.pass_tokens, self.passes),
            "draft_hit_rate": rate(self.passes_with_draft, self.passes),
            "acceptance": rate(self.accepted, self.drafted),
            "accepted_histogram": {str(k): v for k, v in sorted(self.accepted_histogram.items())},
            "guard_interventions": self.guard_interventions,
            "draft_sources": {k: {"passes": v[0], "drafted": v[1], "accepted": v[2]}
                              for k, v in sorted(self.sources.items())},
            "draft_model_passes": self.draft_model_passes,
            "draft_seconds": round(self.draft_seconds, 4),
            "backend_seconds": round(self.backend_seconds, 4),
            "host_seconds": round(self.host_seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
        }

    def summary(self) -> str:
        d = self.to_dict()
        return (f"prompt {d['prompt_tokens']} tok (prefilled {d['prefill_tokens']} in "
                f"{d['prefill_passes']} passes of T={d['prefill_t']}, {d['prefill_tok_s']} tok/s, "
                f"first token at {d['ttft_seconds']}s) | generated {d['generated_tokens']} tok, decode "
                f"{d['decode_tok_s']} tok/s | {d['passes']} passes, {d['tokens_per_pass']} "
                f"tok/pass, hit rate {d['draft_hit_rate']}, acceptance {d['acceptance']}, "
                f"guard {d['guard_interventions']} | {d['decode_shape']} shape | backend {d['backend_seconds']}s, host "
                f"{d['host_seconds']}s")


class Trace:
    """One JSON line per pass. Sessions hold None when tracing is off, so the decode loop pays
    one `is None` test per pass and builds nothing."""

    def __init__(self, stream: IO[str]):
        self.stream = stream

    def write(self, **record: Any) -> None:
        self.stream.write(json.dumps(record) + "\n")
