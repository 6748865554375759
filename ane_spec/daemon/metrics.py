"""The daemon's counters, rendered in the Prometheus text exposition format (version 0.0.4).

Written by hand (a few dozen lines) rather than pulling in prometheus_client. The worker thread
and the event loop both record, so every update and the rendering hold one lock.
Per-request figures use the definitions of `ane_spec.decode.metrics.RequestStats`.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable

from ane_spec.decode.metrics import RequestStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# daemon/slots.py events: (counter name, help)
SLOT_COUNTERS = {
    "hit": ("ane_spec_slot_hits_total",
            "Requests served by a cached conversation they continue (resident or restored)."),
    "miss": ("ane_spec_slot_misses_total",
             "Requests that found no conversation to continue and took the LRU slot."),
    "spill": ("ane_spec_slot_spills_total",
              "Conversations copied to host memory when their slot was taken."),
    "restore": ("ane_spec_slot_restores_total",
                "Spilled conversations written back into a slot for a request."),
    "copy": ("ane_spec_slot_copies_total",
             "Shared prefixes copied from another conversation into a cold request's slot."),
    "drop": ("ane_spec_slot_drops_total",
             "Conversations dropped: over the spill budget (or spilling turned off)."),
    "save": ("ane_spec_slot_saves_total", "Slots saved to --slot-save-path."),
    "load": ("ane_spec_slot_loads_total",
             "Slots loaded from --slot-save-path (at start or by /slots restore)."),
}

# outcome of a generation request, as counted by ane_spec_requests_total
OUTCOMES = ("completed", "cancelled", "failed", "rejected_queue_full", "rejected_warming",
            "rejected_invalid", "rejected_unauthorized", "rejected_host", "rejected_origin")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _num(x: float) -> str:
    if isinstance(x, bool):
        return "1" if x else "0"
    if isinstance(x, int):
        return str(x)
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, str]] = Counter()  # (endpoint, outcome) -> n
        self.finishes: Counter[str] = Counter()  # engine finish reason -> generations
        self.tokens: Counter[str] = Counter()   # prompt, prefill, reused, generated, pass, ...
        self.seconds: Counter[str] = Counter()  # prefill, decode, backend, host
        self.ttft_buckets = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.last_decode_tok_s = 0.0
        self.slot_events: Counter[str] = Counter()  # the keys of SLOT_COUNTERS
        # (draft source, "passes" | "drafted" | "accepted") -> n; draft-model passes
        self.sources: Counter[tuple[str, str]] = Counter()

    def request(self, endpoint: str, outcome: str) -> None:
        with self._lock:
            self.requests[(endpoint, outcome)] += 1

    def generation(self, stats: RequestStats, finish: str) -> None:
        """One `generate` call's work (also for cancelled ones: the passes were run)."""
        with self._lock:
            self.finishes[finish] += 1
            t = self.tokens
            t["prompt"] += stats.prompt_tokens
            t["prefill"] += stats.prefill_tokens
            t["prefill_passes"] += stats.prefill_passes
            t["prefill_function_passes"] += stats.prefill_function_passes
            t["reused"] += stats.reused_prefix_tokens
            t["generated"] += stats.generated_tokens
            t["passes"] += stats.passes
            t["pass_tokens"] += stats.pass_tokens
            t["drafted"] += stats.drafted
            t["accepted"] += stats.accepted
            t["guard"] += stats.guard_interventions
            t["draft_model_passes"] += stats.draft_model_passes
            for source, row in stats.sources.items():
                for what, n in zip(("passes", "drafted", "accepted"), row):
                    self.sources[(source, what)] += n
            s = self.seconds
            s["prefill"] += stats.prefill_seconds
            s["decode"] += stats.decode_seconds
            s["backend"] += stats.backend_seconds
            s["host"] += stats.host_seconds
            if stats.decode_seconds > 0:
                self.last_decode_tok_s = stats.pass_tokens / stats.decode_seconds

    def slot_event(self, event: str) -> None:
        with self._lock:
            self.slot_events[event] += 1

    def time_to_first_token(self, seconds: float) -> None:
        with self._lock:
            i = next((i for i, b in enumerate(TTFT_BUCKETS) if seconds <= b), len(TTFT_BUCKETS))
            self.ttft_buckets[i] += 1
            self.ttft_sum += seconds
            self.ttft_count += 1

    def render(self, gauges: Callable[[], dict]) -> str:
        """`gauges()` supplies the live state: queue depth, busy, readiness, warm-up figures."""
        live = gauges()
        out: list[str] = []

        def metric(name: str, kind: str, help_: str,
                   samples: list[tuple[dict[str, str], float]] | float) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            if not isinstance(samples, list):
                samples = [({}, samples)]
            for labels, value in samples:
                out.append(f"{name}{_labels(labels)} {_num(value)}")

        def ratio(n: float, d: float) -> float:
            return n / d if d else 0.0

        with self._lock:
            req = [({"endpoint": e, "outcome": o}, n)
                   for (e, o), n in sorted(self.requests.items())]
            fin = [({"finish_reason": f}, n) for f, n in sorted(self.finishes.items())]
            t, s = dict(self.tokens), dict(self.seconds)
            buckets, ttft_sum, ttft_count = list(self.ttft_buckets), self.ttft_sum, self.ttft_count
            last = self.last_decode_tok_s
            slot_events = dict(self.slot_events)
        g = lambda k: t.get(k, 0)  # noqa: E731
        metric("ane_spec_info", "gauge", "The served model and backend.",
               [({"model": live["model"], "backend": live["backend"],
                  "context": str(live["context"])}, 1)])
        metric("ane_spec_ready", "gauge", "1 once warm-up has finished and requests are served.",
               live["ready"])
        metric("ane_spec_warmup_progress", "gauge", "Fraction of warm-up steps done.",
               live["warmup_progress"])
        metric("ane_spec_warmup_seconds", "gauge",
               "Seconds warm-up took (or has taken so far).", live["warmup_seconds"])
        metric("ane_spec_requests_total", "counter", "Generation requests by endpoint and outcome.",
               req)
        metric("ane_spec_generations_total", "counter",
               "Generations run by the engine, by how they ended (cancelled: the client left).",
               fin)
        metric("ane_spec_queue_depth", "gauge", "Requests waiting for the accelerator.",
               live["queue_depth"])
        metric("ane_spec_queue_capacity", "gauge", "Waiting requests admitted before 429.",
               live["queue_capacity"])
        metric("ane_spec_generation_in_progress", "gauge", "1 while a generation runs.",
               live["busy"])
        metric("ane_spec_prompt_tokens_total", "counter", "Prompt tokens of all generations.",
               g("prompt"))
        metric("ane_spec_prefill_tokens_total", "counter",
               "Prompt tokens actually run through the shards.", g("prefill"))
        metric("ane_spec_prefill_passes_total", "counter",
               "Prompt passes, by program: the build's prefill function (P rows, layers only) "
               "or the decode program (T=4 rows and the head).",
               [({"function": "prefill"}, g("prefill_function_passes")),
                ({"function": "decode"}, g("prefill_passes") - g("prefill_function_passes"))])
        metric("ane_spec_reused_prefix_tokens_total", "counter",
               "Prompt tokens whose KV cache was reused from the previous request.", g("reused"))
        metric("ane_spec_generated_tokens_total", "counter", "Tokens generated.", g("generated"))
        metric("ane_spec_prefill_seconds_total", "counter", "Seconds spent in prefill.",
               s.get("prefill", 0.0))
        metric("ane_spec_decode_seconds_total", "counter", "Seconds spent decoding.",
               s.get("decode", 0.0))
        metric("ane_spec_decode_tokens_per_second", "gauge",
               "Decode throughput over all generations (pass tokens / decode seconds).",
               ratio(g("pass_tokens"), s.get("decode", 0.0)))
        metric("ane_spec_last_decode_tokens_per_second", "gauge",
               "Decode throughput of the last generation.", last)
        metric("ane_spec_decode_passes_total", "counter", "Decode passes (T=1..4 blocks).",
               g("passes"))
        metric("ane_spec_decode_pass_tokens_total", "counter", "Tokens produced by decode passes.",
               g("pass_tokens"))
        metric("ane_spec_tokens_per_pass", "gauge", "Decode pass tokens / decode passes.",
               ratio(g("pass_tokens"), g("passes")))
        metric("ane_spec_drafted_tokens_total", "counter", "Draft tokens proposed.", g("drafted"))
        metric("ane_spec_accepted_tokens_total", "counter", "Draft tokens accepted.",
               g("accepted"))
        metric("ane_spec_draft_acceptance", "gauge", "Accepted / drafted tokens.",
               ratio(g("accepted"), g("drafted")))
        metric("ane_spec_guard_interventions_total", "counter",
               "Rows recomputed at T=1 by the exactness guard.", g("guard"))
        for what, help_ in (("passes", "Decode passes by who drafted them (model, ngram, "
                                       "grammar, none)."),
                            ("drafted", "Draft tokens proposed, by source."),
                            ("accepted", "Draft tokens accepted, by source.")):
            with self._lock:
                rows = [({"source": src}, n) for (src, w), n in sorted(self.sources.items())
                        if w == what]
            metric(f"ane_spec_draft_source_{what}_total", "counter", help_, rows)
        metric("ane_spec_draft_model_passes_total", "counter",
               "Draft-model passes on the decode's critical path.", g("draft_model_passes"))
        for event, (counter, help_) in SLOT_COUNTERS.items():
            metric(counter, "counter", help_, slot_events.get(event, 0))
        slots = live.get("slots")
        if slots:
            metric("ane_spec_slots_resident", "gauge", "Resident KV slots (--kv-slots).",
                   slots["resident_slots"])
            metric("ane_spec_slots_in_use", "gauge", "Resident KV slots holding a conversation.",
                   sum(r["state"] == "resident" for r in slots["slots"]))
            metric("ane_spec_slots_spilled", "gauge",
                   "Conversations whose KV rows are spilled to host memory.", slots["spilled"])
            metric("ane_spec_slot_spill_bytes", "gauge", "Host memory held by spilled slots.",
                   slots["spill_bytes"])
        memory = live.get("draft_memory")
        if memory:
            metric("ane_spec_draft_memory_tokens", "gauge",
                   "Tokens of earlier requests the drafter remembers, over all scopes.",
                   memory["tokens"])
        name = "ane_spec_time_to_first_token_seconds"
        out.append(f"# HELP {name} Time from request arrival to the first generated text.")
        out.append(f"# TYPE {name} histogram")
        cumulative = 0
        for bound, n in zip((*TTFT_BUCKETS, math.inf), buckets):
            cumulative += n
            out.append(f'{name}_bucket{{le="{_num(float(bound))}"}} {cumulative}')
        out.append(f"{name}_sum {_num(ttft_sum)}")
        out.append(f"{name}_count {ttft_count}")
        return "\n".join(out) + "\n"


def grammar_queue_metrics(queue: dict) -> str:
    """The grammar compile queue (`CompileQueue.snapshot()`), in the exposition format."""
    rows = [
        ("ane_spec_grammar_queue_depth", "gauge", "New grammars waiting to be compiled.",
         queue["waiting"]),
        ("ane_spec_grammar_queue_capacity", "gauge",
         "New grammars admitted to wait before 429 (--grammar-queue).", queue["capacity"]),
        ("ane_spec_grammar_compiling", "gauge", "1 while a new grammar compiles.",
         int(queue["compiling"] is not None)),
        ("ane_spec_grammar_queue_oldest_wait_seconds", "gauge",
         "How long the oldest waiting grammar has waited.", queue["oldest_wait_seconds"]),
        ("ane_spec_grammar_compiles_total", "counter", "New grammars compiled by the queue.",
         queue["compiled"]),
        ("ane_spec_grammar_queue_refused_total", "counter",
         "Requests refused with 429: the compile queue was full.", queue["refused_full"]),
        ("ane_spec_grammar_queue_timeouts_total", "counter",
         "Requests that gave up with 503: their grammar did not start in time.",
         queue["timed_out"]),
        ("ane_spec_grammar_queue_dropped_total", "counter",
         "Queued grammars dropped unstarted: every requester had left or given up.",
         queue["dropped"])]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {_num(value)}"]
    return "\n".join(out) + "\n"
