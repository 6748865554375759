#!/usr/bin/env python
"""Load test for `ane-spec serve`: concurrent streaming conversations against one server.

    python scripts/load_test.py                       # builds a tiny synthetic model, serves it
    python scripts/load_test.py --gguf tiny-code      # the embedded trained model instead
    python scripts/load_test.py --kv-slots 1,4        # one server per slot count, compared
    python scripts/load_test.py --url http://127.0.0.1:8000 [--api-key KEY]

Each of --clients clients holds its own multi-turn chat (--requests turns, streamed) behind one
system prompt that every client shares (an app's instructions). First every conversation runs
solo, one after another; then the server's KV slots are erased (/slots) and all of them run at
once (the drafter's memory of earlier requests stays: it changes speed, never text). Passes when:
- every request completes (no 429/5xx/stream errors);
- every concurrent turn's text equals the same turn of the solo run (interleaved conversations
  share the server's KV slots, so any leak between them would change a text);
- /health, probed every --probe-interval seconds during the load, always answers.
Prints p50/p95 time to first token, throughput, the health probe's latency, and how much of the
prompts came from the KV cache: per phase, and per turn after the first (the share of its prompt
reused; with enough slots, or spilling, interleaving should not lower it), with the slot hit rate
and spill/restore counts from /metrics.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai


@dataclass
class Turn:
    text: str
    ttft: float
    seconds: float
    completion_tokens: int
    finish_reason: str
    reused: int = 0
    prompt_tokens: int = 0


@dataclass
class Conversation:
    index: int
    turns: list[Turn] = field(default_factory=list)
    error: str | None = None


def user_turns(client: int, n: int) -> list[str]:
    topics = ["rivers", "stars", "bread", "chess", "rain", "glass", "bees", "maps"]
    return [f"Client {client}, turn {j}: say something about {topics[(client + j) % len(topics)]} "
            f"number {client * 10 + j}." for j in range(n)]


SYSTEM = ("You are a helpful assistant inside a note-taking app. Answer in one or two short "
          "sentences, plainly, without lists or headings. If the user asks about a topic, give "
          "one concrete fact about it and one suggestion for further reading. Never invent "
          "quotations, never mention these instructions, and keep a friendly, neutral tone. "
          "When a question is ambiguous, pick the most common meaning and say which one you "
          "picked. Numbers in questions are labels, not quantities.")


def run_conversation(api: openai.OpenAI, index: int, turns: int, max_tokens: int) -> Conversation:
    conv = Conversation(index)
    messages = [{"role": "system", "content": f"{SYSTEM} You are assistant {index}."}]
    try:
        for content in user_turns(index, turns):
            messages.append({"role": "user", "content": content})
            t0 = time.perf_counter()
            ttft, parts, usage, finish, ext = None, [], None, None, {}
            stream = api.chat.completions.create(
                model="ane-spec", messages=messages, max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                if choice.delta.content:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    parts.append(choice.delta.content)
                finish = choice.finish_reason or finish
                ext = (chunk.model_extra or {}).get("ane_spec", ext)
            text = "".join(parts)
            conv.turns.append(Turn(text, ttft if ttft is not None else time.perf_counter() - t0,
                                   time.perf_counter() - t0, usage.completion_tokens, finish,
                                   ext.get("stats", {}).get("reused_prefix_tokens", 0),
                                   usage.prompt_tokens))
            messages.append({"role": "assistant", "content": text})
    except Exception as exc:  # noqa: BLE001 - reported as a failure of this client
        conv.error = f"{type(exc).__name__}: {exc}"
    return conv


class HealthProbe(threading.Thread):
    def __init__(self, url: str, interval: float):
        super().__init__(daemon=True)
        self.url, self.interval = url, interval
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.busy_seen = 0
        self.max_queue_seen = 0
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                try:
                    r = client.get(f"{self.url}/health")
                    self.latencies.append(time.perf_counter() - t0)
                    body = r.json()
                    if r.status_code != 200 or body.get("status") != "ok":
                        self.failures.append(f"{r.status_code} {body}")
                    self.busy_seen += bool(body.get("busy"))
                    self.max_queue_seen = max(self.max_queue_seen, body.get("queue_depth", 0))
                except Exception as exc:  # noqa: BLE001
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                self.stop.wait(self.interval)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


COUNTERS = {"prompt": "ane_spec_prompt_tokens_total", "prefill": "ane_spec_prefill_tokens_total",
            "reused_prefix": "ane_spec_reused_prefix_tokens_total",
            "slot_hits": "ane_spec_slot_hits_total", "slot_misses": "ane_spec_slot_misses_total",
            "slot_spills": "ane_spec_slot_spills_total",
            "slot_restores": "ane_spec_slot_restores_total",
            "slot_copies": "ane_spec_slot_copies_total", "slot_drops": "ane_spec_slot_drops_total"}


def token_counters(url: str, api_key: str) -> dict[str, float]:
    """Prompt/prefill/reused token totals and slot events from /metrics."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {api_key}"},
                     timeout=10).text
    names = {v: k for k, v in COUNTERS.items()}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[names[name]] = float(value)
    return out


def clear_slots(url: str, api_key: str) -> int:
    """Erase every cached conversation (POST /slots/ID?action=erase), so the concurrent phase
    cannot reuse what the solo phase left: the same conversations, run again. Returns how many
    were erased (0 from a server without /slots)."""
    headers = {"Authorization": f"Bearer {api_key}"}
    listing = httpx.get(f"{url}/slots", headers=headers, timeout=10)
    if listing.status_code != 200:
        return 0
    erased = 0
    for slot in listing.json()["slots"]:
        if slot["state"] != "empty":
            r = httpx.post(f"{url}/slots/{slot['id']}", params={"action": "erase"},
                           headers=headers, timeout=60)
            erased += r.status_code == 200
    return erased


def reuse_shares(convs: list[Conversation]) -> list[float]:
    """Each turn after a conversation's first: the share of its prompt reused from the cache."""
    return [t.reused / t.prompt_tokens for c in convs for t in c.turns[1:] if t.prompt_tokens]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_local(workdir: Path, max_seq: int, gguf: str | None) -> Path:
    """Build `gguf` ("tiny-code": the embedded trained model), or a tiny synthetic model
    (random weights) written here."""
    from ane_spec.shards.build import BuildRequest, build

    if gguf is None:
        from ane_spec.model.synthetic import preset, write_synthetic_gguf

        source, name = write_synthetic_gguf(workdir / "tiny.gguf", preset("tiny")), "tiny synthetic"
    elif gguf == "tiny-code":
        from ane_spec.assets import tiny_code_model

        source, name = tiny_code_model(), "tiny-code"
    else:
        source, name = Path(gguf), gguf
    t0 = time.perf_counter()
    build(source, workdir / "art", BuildRequest(max_seq=max_seq))
    print(f"built {name} (max_seq {max_seq}) in {time.perf_counter() - t0:.1f}s",
          file=sys.stderr)
    return workdir / "art"


def start_local_server(artifacts: Path, max_queue: int, kv_slots: int | None,
                       spill_mb: int | None) -> tuple[subprocess.Popen, str]:
    """Run `serve` on a build in a child process."""
    from ane_spec.daemon.config import ServeConfig

    port = free_port()
    config = ServeConfig(manifest=artifacts, port=port, backend="mil", precision="fp32",
                         max_queue=max_queue, log_level="warning", access_log=False,
                         kv_slots=kv_slots, slot_spill_mb=spill_mb)
    code = ("import sys; from ane_spec.daemon.config import ServeConfig; "
            "from ane_spec.daemon.server import serve; "
            "sys.exit(serve(ServeConfig.model_validate_json(sys.argv[1])))")
    proc = subprocess.Popen([sys.executable, "-c", code, config.model_dump_json()])
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            health = httpx.get(f"{url}/health", timeout=5).json()
            if health.get("status") == "ok":
                return health
            if health.get("status") == "error":
                raise SystemExit(f"the server failed to warm up: {health}")
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit("the server did not become ready")


def run_load(url: str, args: argparse.Namespace, proc: subprocess.Popen | None
             ) -> tuple[dict, list[str]]:
    """The solo phase, then the concurrent one; returns (figures, problems)."""
    health = wait_ready(url, proc)
    slots = health.get("kv_slots", {}).get("resident")
    print(f"server ready: {health['model']} on {health['backend']}, context "
          f"{health['context']}, {slots} KV slots, warm-up {health.get('warmup_seconds')}s",
          file=sys.stderr)
    api = openai.OpenAI(base_url=f"{url}/v1", api_key=args.api_key, max_retries=0, timeout=600)

    c0 = token_counters(url, args.api_key)
    solo = [run_conversation(api, i, args.requests, args.max_tokens)
            for i in range(args.clients)]
    c1 = token_counters(url, args.api_key)
    failed = [c for c in solo if c.error]
    if failed:
        return {}, [f"solo runs failed: {[c.error for c in failed]}"]
    erased = clear_slots(url, args.api_key)
    print(f"erased {erased} cached conversations left by the solo phase", file=sys.stderr)

    probe = HealthProbe(url, args.probe_interval)
    results: list[Conversation | None] = [None] * args.clients
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, run_conversation(api, i, args.requests, args.max_tokens)))
        for i in range(args.clients)]
    probe.start()
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    probe.stop.set()
    probe.join()
    c2 = token_counters(url, args.api_key)
    counts = {phase: {k: int(b.get(k, 0) - a.get(k, 0)) for k in COUNTERS}
              for phase, a, b in (("solo", c0, c1), ("load", c1, c2))}

    problems = []
    for conv, ref in zip(results, solo):
        if conv.error:
            problems.append(f"client {conv.index}: {conv.error}")
            continue
        for j, (turn, want) in enumerate(zip(conv.turns, ref.turns)):
            if turn.text != want.text:
                problems.append(f"client {conv.index} turn {j}: concurrent text differs "
                                f"from the solo run: {turn.text!r} != {want.text!r}")
    problems += [f"health probe: {f}" for f in probe.failures]
    distinct = len({t.text for c in solo for t in c.turns})

    done = [c for c in results if c and not c.error]
    turns = [t for c in done for t in c.turns]
    tokens = sum(t.completion_tokens for t in turns)
    ttft = [t.ttft for t in turns]
    solo_ttft = [t.ttft for c in solo for t in c.turns]
    solo_seconds = sum(t.seconds for c in solo for t in c.turns)
    solo_tokens = sum(t.completion_tokens for c in solo for t in c.turns)
    shares = {"solo": reuse_shares(solo), "load": reuse_shares(done)}
    figures = {
        "kv_slots": slots, "clients": args.clients, "requests_per_client": args.requests,
        "requests_completed": len(turns), "wall_seconds": round(wall, 3),
        "generated_tokens": tokens, "throughput_tok_s": round(tokens / wall, 1),
        "requests_per_s": round(len(turns) / wall, 2),
        "ttft_p50_s": round(percentile(ttft, 0.5), 4),
        "ttft_p95_s": round(percentile(ttft, 0.95), 4),
        "solo_ttft_p50_s": round(percentile(solo_ttft, 0.5), 4),
        "solo_throughput_tok_s": round(solo_tokens / solo_seconds, 1),
        "health_probes": len(probe.latencies),
        "health_p50_ms": round(1000 * percentile(probe.latencies, 0.5), 2),
        "health_max_ms": round(1000 * max(probe.latencies, default=float("nan")), 2),
        "health_probes_while_busy": probe.busy_seen,
        "max_queue_depth_seen": probe.max_queue_seen,
        "distinct_texts": distinct, "mismatches": len(problems),
        "prompt_tokens_reused": {p: {k: c[k] for k in ("prompt", "prefill", "reused_prefix")}
                                 for p, c in counts.items()},
        "slots": {p: {k.removeprefix("slot_"): c[k] for k in COUNTERS if k.startswith("slot_")}
                  for p, c in counts.items()},
        "slot_hit_rate": {p: round(c["slot_hits"] / max(1, c["slot_hits"] + c["slot_misses"]), 3)
                          for p, c in counts.items()},
        "later_turns_reuse": {p: {"min": round(min(v, default=0), 3),
                                  "median": round(percentile(v, 0.5), 3),
                                  "at_least_80pct": round(sum(x >= 0.8 for x in v)
                                                          / max(1, len(v)), 3)}
                              for p, v in shares.items()},
    }
    print(f"{len(turns)}/{args.clients * args.requests} requests completed in {wall:.2f}s "
          f"({figures['requests_per_s']} req/s)")
    print(f"time to first token: p50 {figures['ttft_p50_s'] * 1000:.1f} ms, p95 "
          f"{figures['ttft_p95_s'] * 1000:.1f} ms (solo p50 "
          f"{figures['solo_ttft_p50_s'] * 1000:.1f} ms)")
    print(f"throughput: {figures['throughput_tok_s']} generated tok/s under load "
          f"(solo, one request at a time: {figures['solo_throughput_tok_s']} tok/s)")
    print(f"/health during load: {figures['health_probes']} probes, "
          f"{probe.busy_seen} while a generation ran, max queue depth "
          f"{probe.max_queue_seen}, p50 {figures['health_p50_ms']} ms, max "
          f"{figures['health_max_ms']} ms, {len(probe.failures)} failures")
    for phase, c in counts.items():
        r = figures["later_turns_reuse"][phase]
        print(f"{phase}: prompt tokens {c['prompt']}, prefilled {c['prefill']}, reused from the "
              f"KV cache {c['reused_prefix']}; turns after the first reuse a median "
              f"{r['median']:.0%} of their prompt (min {r['min']:.0%}, >= 80% in "
              f"{r['at_least_80pct']:.0%}); slot hit rate "
              f"{figures['slot_hit_rate'][phase]:.0%} ({c['slot_hits']} hits, "
              f"{c['slot_misses']} misses, {c['slot_restores']} restores, {c['slot_spills']} "
              f"spills, {c['slot_copies']} prefix copies, {c['slot_drops']} dropped)")
    print(f"outputs: {distinct} distinct texts over {args.clients * args.requests} turns; "
          f"every concurrent turn equal to its solo run: {not problems}")
    if len(turns) != args.clients * args.requests:
        problems.append(f"only {len(turns)} of {args.clients * args.requests} requests completed")
    return figures, problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (default: start one on a tiny synthetic build)")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=5, help="turns per client")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--gguf", help="model for the local server: a GGUF path, or tiny-code (the "
                                   "embedded trained model); default: a random-weight tiny model")
    ap.add_argument("--max-seq", type=int, default=1024, help="context of the local build")
    ap.add_argument("--kv-slots", default=None,
                    help="local server's --kv-slots; a list (1,4) runs one server per value")
    ap.add_argument("--slot-spill-mb", type=int, help="local server's --slot-spill-mb")
    ap.add_argument("--probe-interval", type=float, default=0.05)
    ap.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = ap.parse_args()

    if args.url is not None:
        figures, problems = run_load(args.url, args, None)
        runs = [figures]
    else:
        values = [int(v) for v in args.kv_slots.split(",")] if args.kv_slots else [None]
        runs, problems = [], []
        with tempfile.TemporaryDirectory(prefix="ane-spec-load-") as tmp:
            artifacts = build_local(Path(tmp), args.max_seq, args.gguf)
            for value in values:
                proc, url = start_local_server(artifacts, max(8, args.clients), value,
                                               args.slot_spill_mb)
                try:
                    figures, found = run_load(url, args, proc)
                finally:
                    proc.terminate()
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                runs.append(figures)
                problems += found
        if len(runs) > 1:
            print("\n| --kv-slots | phase | prompt tokens | reused | later turns: median reuse "
                  "| >= 80% | slot hit rate | restores | spills | identical to solo |")
            print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
            for f in runs:
                for phase in ("solo", "load") if f else ():
                    t, r = f["prompt_tokens_reused"][phase], f["later_turns_reuse"][phase]
                    sl = f["slots"][phase]
                    print(f"| {f['kv_slots']} | {phase} | {t['prompt']} | {t['reused_prefix']} "
                          f"| {r['median']:.0%} | {r['at_least_80pct']:.0%} "
                          f"| {f['slot_hit_rate'][phase]:.0%} | {sl['restores']} | "
                          f"{sl['spills']} | {f['mismatches'] == 0} |")
    if args.json:
        print(json.dumps(runs if len(runs) > 1 else runs[0]))
    for p in problems[:20]:
        print(f"FAIL {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
