#!/usr/bin/env python
"""Load test for `ane-spec serve`: concurrent streaming conversations against one server.

    python scripts/load_test.py                       # builds a tiny synthetic model, serves it
    python scripts/load_test.py --url http://127.0.0.1:8000 [--api-key KEY]

Each of --clients clients holds its own multi-turn chat (--requests turns, streamed). First every
conversation runs solo, one after another; then all of them run at once. Passes when:
- every request completes (no 429/5xx/stream errors);
- every concurrent turn's text equals the same turn of the solo run (the server's single KV cache
  is shared by interleaved conversations, so any leak between them would change a text);
- /health, probed every --probe-interval seconds during the load, always answers.
Prints p50/p95 time to first token, throughput and the health probe's latency.
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


@dataclass
class Conversation:
    index: int
    turns: list[Turn] = field(default_factory=list)
    error: str | None = None


def user_turns(client: int, n: int) -> list[str]:
    topics = ["rivers", "stars", "bread", "chess", "rain", "glass", "bees", "maps"]
    return [f"Client {client}, turn {j}: say something about {topics[(client + j) % len(topics)]} "
            f"number {client * 10 + j}." for j in range(n)]


def run_conversation(api: openai.OpenAI, index: int, turns: int, max_tokens: int) -> Conversation:
    conv = Conversation(index)
    messages = [{"role": "system", "content": f"You are assistant {index}. Be brief."}]
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
                                   ext.get("stats", {}).get("reused_prefix_tokens", 0)))
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
                    if r.status_code != 200 or body.get("status") != "ready":
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


def token_counters(url: str, api_key: str) -> dict[str, float]:
    """prefill/reused/generated token totals from /metrics."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {api_key}"},
                     timeout=10).text
    out = {}
    for line in text.splitlines():
        for key in ("prefill", "reused_prefix", "prompt"):
            if line.startswith(f"ane_spec_{key}_tokens_total "):
                out[key] = float(line.split()[-1])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_server(workdir: Path, max_seq: int, max_queue: int) -> tuple[subprocess.Popen, str]:
    """Write a tiny synthetic GGUF, build it, and run `serve` on it in a child process."""
    from ane_spec.daemon.config import ServeConfig
    from ane_spec.model.synthetic import preset, write_synthetic_gguf
    from ane_spec.shards.build import BuildRequest, build

    gguf = write_synthetic_gguf(workdir / "tiny.gguf", preset("tiny"))
    t0 = time.perf_counter()
    build(gguf, workdir / "art", BuildRequest(topology="2,1", max_seq=max_seq))
    print(f"built a tiny synthetic model (max_seq {max_seq}) in {time.perf_counter() - t0:.1f}s",
          file=sys.stderr)
    port = free_port()
    config = ServeConfig(manifest=workdir / "art", port=port, backend="mil", precision="fp32",
                         max_queue=max_queue, log_level="warning", access_log=False)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (default: start one on a tiny synthetic build)")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=5, help="turns per client")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-seq", type=int, default=512, help="context of the synthetic build")
    ap.add_argument("--probe-interval", type=float, default=0.05)
    ap.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = ap.parse_args()

    proc, tmp = None, None
    url = args.url
    if url is None:
        tmp = tempfile.TemporaryDirectory(prefix="ane-spec-load-")
        proc, url = start_local_server(Path(tmp.name), args.max_seq, max(8, args.clients))
    try:
        health = wait_ready(url, proc)
        print(f"server ready: {health['model']} on {health['backend']}, context "
              f"{health['context']}, warm-up {health.get('warmup_seconds')}s", file=sys.stderr)
        api = openai.OpenAI(base_url=f"{url}/v1", api_key=args.api_key, max_retries=0,
                            timeout=600)

        c0 = token_counters(url, args.api_key)
        solo = [run_conversation(api, i, args.requests, args.max_tokens)
                for i in range(args.clients)]
        c1 = token_counters(url, args.api_key)
        failed = [c for c in solo if c.error]
        if failed:
            print(f"solo runs failed: {[c.error for c in failed]}", file=sys.stderr)
            return 1

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
        reuse = {phase: {k: int(b.get(k, 0) - a.get(k, 0)) for k in ("prompt", "prefill",
                                                                      "reused_prefix")}
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

        turns = [t for c in results if c and not c.error for t in c.turns]
        tokens = sum(t.completion_tokens for t in turns)
        ttft = [t.ttft for t in turns]
        solo_ttft = [t.ttft for c in solo for t in c.turns]
        solo_seconds = sum(t.seconds for c in solo for t in c.turns)
        solo_tokens = sum(t.completion_tokens for c in solo for t in c.turns)
        figures = {
            "clients": args.clients, "requests_per_client": args.requests,
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
            "prompt_tokens_reused": reuse,
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
        for phase, r in reuse.items():
            print(f"prompt tokens {phase}: {r['prompt']}, prefilled {r['prefill']}, reused from "
                  f"the KV cache {r['reused_prefix']}")
        print(f"outputs: {distinct} distinct texts over {args.clients * args.requests} turns; "
              f"every concurrent turn equal to its solo run: {not problems}")
        if args.json:
            print(json.dumps(figures))
        for p in problems[:20]:
            print(f"FAIL {p}", file=sys.stderr)
        return 1 if problems or len(turns) != args.clients * args.requests else 0
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
