"""The accelerator's single owner: warm-up, a FIFO of requests, and one worker thread.

One accelerator runs one generation at a time, so exactly one thread ever touches the pipeline:
it first warms every shard (and measures what the decode engine needs), then takes requests in
arrival order. The event loop only enqueues jobs and reads their events, so health and metrics
answer while a generation runs.

The worker keeps one `DecodeSession` for the whole process and runs each request on one of
`--kv-slots` KV caches (`slots.SlotManager`): the one holding the conversation it continues, so
it prefills only the new tokens, or, when none does, the least recently used one (whose old
conversation is spilled to host memory, not lost). K/V at position i depend only on tokens
0..i, so reusing a prefix is exact and the output does not depend on the slot.

The drafter remembers earlier requests (`DraftMemory`, one per `--draft-memory` scope) but
drafts from them only where drafts cannot change the output: greedy decoding in the fixed
decode shape (exact by construction), or sampling without a seed. A seeded sample depends on
the drafts' random draws, so it drafts from its own text alone and stays reproducible.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ane_spec.decode.cost import draft_policy
from ane_spec.decode.drafter import NgramDrafter
from ane_spec.decode.grammar_compiler import GrammarCompiler
from ane_spec.decode.prefill_plan import prefill_costs
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.errors import AneSpecError
from ane_spec.manifests.store import record_drift
from ane_spec.probes.drift import measure_drift
from ane_spec.probes.gates import open_pipeline
from ane_spec.runtime.coreml_worker import CoreMLFailure
from ane_spec.runtime.pipeline import ShardPipeline
from ane_spec.worker_process import WorkerDied

from ane_spec.daemon.config import ServeConfig
from ane_spec.daemon.draft_scopes import DraftMemories
from ane_spec.daemon.metrics import Metrics
from ane_spec.daemon.warmup import (
    Warmup, WarmStep, jit_steps, prefill_in_use, scratch_state,
)
from ane_spec.runtime.state_budget import slot_budget
from ane_spec.daemon.slot_files import SlotQuota, SlotQuotaError
from ane_spec.daemon.slots import SlotManager, SlotNotFound

log = logging.getLogger("ane_spec.daemon")



class QueueFull(Exception):
    def __init__(self, capacity: int):
        super().__init__(f"the request queue is full ({capacity} waiting); retry later")
        self.capacity = capacity


class NotReady(Exception):
    def __init__(self, message: str, retry_after: int | None):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class WorkItem:
    """A validated generation request, in tokens."""

    prompt: list[int]
    options: GenerateOptions
    ngram_min: int
    ngram_max: int
    endpoint: str  # "chat" or "completions", for metrics
    scope: str | None = None  # the --draft-memory scope (None: shared by everyone)


@dataclass(frozen=True)
class SlotAction:
    """A /slots action, run by the worker between generations: save, restore or erase."""

    action: str
    slot_id: int
    filename: str | None = None


class Job:
    """One request's journey through the queue. The worker thread posts events to the request's
    event loop: ("text", str) pieces, then ("done", GenerationResult | None) — None when it was
    cancelled before it ran — or ("error", (status, message))."""

    def __init__(self, item: WorkItem | SlotAction, loop: asyncio.AbstractEventLoop):
        self.item = item
        self.loop = loop
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.created = time.perf_counter()
        self.started: float | None = None
        self.first_text: float | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def post(self, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    @property
    def queue_seconds(self) -> float:
        return (self.started or time.perf_counter()) - self.created

    def describe(self) -> dict[str, Any]:
        """What the job is doing, for /health while it runs."""
        item = self.item
        if isinstance(item, SlotAction):
            what = {"task": f"slot {item.action}", "slot": item.slot_id}
            return what | ({"filename": item.filename} if item.filename else {})
        return {"task": item.endpoint, "prompt_tokens": len(item.prompt),
                "cancelled": self.cancelled.is_set()}


class Engine:
    def __init__(self, config: ServeConfig, pipeline: ShardPipeline,
                 metrics: Metrics | None = None):
        self.config = config
        self.pipeline = pipeline
        self.metrics = metrics or Metrics()
        self.tokenizer = pipeline.tokenizer
        self.context = pipeline.max_seq
        self.model_id = config.model_name or pipeline.manifest.name
        self.status = "warming"  # -> "ready" | "error"
        self.error: str | None = None
        self.warmup = Warmup()
        self.session: DecodeSession | None = None
        self.drafter: Any = None  # BothDrafters, with --draft-model (made at warm-up)
        self.fill_drafts: bool | None = None
        self.budget = slot_budget(pipeline.manifest)
        self.kv_slots = config.kv_slots or self.budget.default_slots
        self.spill_bytes = (self.budget.spill_bytes if config.slot_spill_mb is None
                            else config.slot_spill_mb << 20)
        self.slots: SlotManager | None = None
        self.recoveries = 0
        self.last_recovery: dict[str, Any] | None = None
        # Why the prefill function was switched off at warm-up (it killed the worker), if it was.
        self.prefill_disabled: str | None = None
        self.memories = DraftMemories(config.draft_memory_mode, config.draft_memory_tokens,
                                      config.ngram_max)
        self.grammars = GrammarCompiler(self.tokenizer)
        self.slot_quota = SlotQuota(config.slot_save_max_files,
                                    int(config.slot_save_max_mb * 2**20))
        log.info("%s; serving with %d KV slot%s, %.0f MiB for spilled slots, draft memory %s",
                 self.budget.summary(), self.kv_slots, "" if self.kv_slots == 1 else "s",
                 self.spill_bytes / 2**20, config.draft_memory_mode)
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._main, name="ane-spec-worker", daemon=True)

    # --- lifecycle (event loop side) ------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new work, cancel what runs (at its next pass boundary), fail what waits."""
        with self._cond:
            self._stopping.set()
            if self._running is not None:
                self._running.cancel()
            waiting, self._waiting = list(self._waiting), deque()
            self._cond.notify_all()
        for job in waiting:
            job.post("error", (503, "the server is shutting down"))
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.grammars.close()
        if self.drafter is not None:
            from ane_spec.decode.draft_setup import close_drafter

            close_drafter(self.drafter)

    # --- requests (event loop side) -------------------------------------------------------

    def submit(self, item: WorkItem | SlotAction, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a request, or refuse it at once: NotReady (warming, failed, stopping) or
        QueueFull (max_queue requests already wait behind the running one)."""
        if self.status != "ready" or self._stopping.is_set():
            raise self.not_ready()
        job = Job(item, loop)
        with self._cond:
            if len(self._waiting) >= self.config.max_queue and (
                    self._running is not None or self._waiting):
                raise QueueFull(self.config.max_queue)
            self._waiting.append(job)
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job if it still waits, else stop it at the next pass
        boundary (the session stays consistent: slots past `kv_tokens` are never trusted)."""
        job.cancel()
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return
        job.post("done", None)

    def not_ready(self) -> NotReady:
        if self.status == "error":
            return NotReady(f"the model failed to load: {self.error}", None)
        if self._stopping.is_set():
            return NotReady("the server is shutting down", None)
        w = self.warmup
        return NotReady(f"the model is warming up ({w.done}/{w.total} steps: {w.step}); retry "
                        "shortly", self.retry_after())

    def retry_after(self) -> int:
        """Seconds a client should wait: the warm-up's remaining time at its pace so far."""
        w = self.warmup
        if w.done == 0:
            return 5
        remaining = w.seconds / w.done * (w.total - w.done)
        return max(1, min(60, round(remaining)))

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._running is not None

    def health(self) -> dict[str, Any]:
        base = {"status": self.status, "model": self.model_id,
                "backend": self.pipeline.backend.describe(), "context": self.context}
        worker = self.worker_health()
        if worker is not None:
            base["worker"] = worker
        if self.status == "warming":
            return base | {"progress": self.warmup.to_dict()}
        if self.status == "error":
            return base | {"error": self.error}
        return base | {"warmup_seconds": round(self.warmup.seconds, 3),
                       "warmup_jit_seconds": self.warmup.jit_seconds(),
                       "prefill": self.prefill_health(),
                       "busy": self.busy, "running": self.running(),
                       "queue_depth": self.queue_depth,
                       "queue_capacity": self.config.max_queue,
                       "decode_shape": self.pipeline.decode_shape,
                       "speculative": self.config.speculative, "guard": self.config.guard,
                       "guard_margin": self.session.guard_margin if self.session else None,
                       "fill_drafts": self.fill_drafts, "kv_slots": self.slot_health(),
                       "draft_memory": self.memories.stats(),
                       "draft_model": self.draft_health()}

    def prefill_health(self) -> dict[str, Any] | None:
        """The build's prefill function: its T, the mode prompts use it in, and the pass costs
        measured at warm-up (c(P)/c(4) as `ratio`, prefill tok/s); None without one."""
        p = self.pipeline
        if not p.prefill_t:
            return None
        costs = p.measurements.get("prefill_costs")
        return {"prefill_t": p.prefill_t, "mode": p.prefill_mode,
                "disabled": self.prefill_disabled,
                "costs": None if costs is None else costs.to_dict()}

    def worker_health(self) -> dict[str, Any] | None:
        """The backend's worker process (Core ML): running, restarts, the last death and what
        the engine did about it; None for an in-process backend."""
        health = getattr(self.pipeline.backend, "health", None)
        if health is None:
            return None
        return health() | {"recoveries": self.recoveries, "last_recovery": self.last_recovery}

    def running(self) -> dict[str, Any] | None:
        """The job the worker is on and for how long: a worker stuck on one shows here."""
        job = self._running
        if job is None or job.started is None:
            return None
        return job.describe() | {"seconds": round(time.perf_counter() - job.started, 3)}

    def slots_snapshot(self) -> dict[str, Any]:
        """/slots: the slot manager's list, with the running conversation's live token count."""
        assert self.slots is not None
        snap = self.slots.snapshot()
        job, session = self._running, self.session
        if job is not None and session is not None:
            for row in snap["slots"]:
                if row["state"] == "running":
                    row["tokens"] = len(session.kv_tokens)
        return snap

    def slot_health(self) -> dict[str, Any]:
        snap = self.slots.snapshot() if self.slots else {}
        return {"resident": self.kv_slots, "resident_fit": self.budget.ane_slots,
                "state_bytes_per_slot": self.budget.state_bytes,
                "spill_budget_bytes": self.spill_bytes,
                "spilled": snap.get("spilled", 0), "spill_bytes": snap.get("spill_bytes", 0),
                "budget": self.budget.to_dict()}

    def gauges(self) -> dict[str, Any]:
        w = self.warmup
        return {"model": self.model_id, "backend": self.pipeline.backend.describe(),
                "context": self.context, "ready": self.status == "ready",
                "warmup_progress": w.done / w.total, "warmup_seconds": w.seconds,
                "queue_depth": self.queue_depth, "queue_capacity": self.config.max_queue,
                "busy": self.busy, "slots": self.slots.snapshot() if self.slots else None,
                "draft_memory": self.memories.stats()}

    # --- the worker thread ----------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._warm_up()
        except WorkerDied as exc:  # reported through /health; the server stays up
            log.error("warm-up failed: %s", exc)
            self.error = (f"WorkerDied: {exc} at warm-up step '{self.warmup.step}'. A Core ML "
                          "worker killed at a program's first prediction is how a failed ANE "
                          "compile shows (coremltools #2758: the load 'succeeds', the first "
                          "predict kills the process); try a smaller --max-shard-mb build or "
                          "run `ane-spec doctor`")
            self.status = "error"
            return
        except Exception as exc:  # noqa: BLE001 - reported through /health, never raised
            log.exception("warm-up failed")
            self.error = f"{type(exc).__name__}: {exc}"
            self.status = "error"
            return
        if self._stopping.is_set():
            return
        self.status = "ready"
        log.info("ready: %s on %s, warm-up took %.1fs; first passes (JIT): %s", self.model_id,
                 self.pipeline.backend.describe(), self.warmup.seconds, self.warmup.jit_line())
        while True:
            with self._cond:
                while not self._waiting and not self._stopping.is_set():
                    self._cond.wait()
                if self._stopping.is_set():
                    return
                job = self._waiting.popleft()
                self._running = job
            try:
                self._run(job)
            except WorkerDied as exc:  # the request was told; the engine recovers
                self._recover(exc)
            except Exception as exc:  # noqa: BLE001 - any job's failure is that job's error
                self._job_failed(job, exc)
            finally:
                with self._cond:
                    self._running = None

    def _job_failed(self, job: Job, exc: Exception) -> None:
        """A job raised what nothing in it expected (a forged slot file's ring once raised
        OverflowError here and the worker thread died: /health still said ready while every
        request queued until 429). The job gets a 500; the worker goes on, trusting no
        resident conversation the job may have been writing."""
        log.error("a %s job failed: %s: %s", job.describe()["task"], type(exc).__name__, exc,
                  exc_info=exc)
        try:
            if self.session is not None:
                self.session.reset()
            if self.slots is not None:
                self.slots.forget_resident()
        except Exception:  # noqa: BLE001 - the job's answer below matters more
            log.exception("forgetting the resident conversations failed")
        job.post("error", (500, f"internal error ({type(exc).__name__}); the request failed "
                                "and the server goes on; retry it"))

    def _run(self, job: Job) -> None:
        job.started = time.perf_counter()
        if job.cancelled.is_set():
            job.post("done", None)
            return
        if isinstance(job.item, SlotAction):
            return self._slot_action(job)
        item, session, slots = job.item, self.session, self.slots
        assert session is not None and slots is not None
        drafter = session.drafter
        if (drafter.ngram_min, drafter.ngram_max) != (item.ngram_min, item.ngram_max):
            ngram = NgramDrafter(ngram_min=item.ngram_min, ngram_max=item.ngram_max)
            if hasattr(drafter, "ngram"):  # beside a draft model: swap the n-gram half only
                drafter.ngram = ngram
            else:
                session.drafter = ngram
        memory = self.memories.get(item.scope)
        sampling = item.options.sampling
        output_safe = self.pipeline.shape.drafts_cannot_change_output(
            sampling.greedy, sampling.seed is not None)
        session.drafter.memory = memory if output_safe else None
        try:
            slot = slots.acquire(item.prompt, item.scope)
        except WorkerDied as exc:  # moving K/V in or out of the worker: recovered by _main
            job.post("error", (500, self._death_message(exc)))
            raise
        except Exception as exc:  # noqa: BLE001 - one request must never take the worker down
            log.exception("choosing a KV slot failed")
            job.post("error", (500, f"internal error choosing a KV slot ({type(exc).__name__})"))
            return
        session.use_slot(slot.state, slot.tokens)
        try:
            self._generate(job, session)
        finally:
            slots.release(slot, session.kv_tokens, len(item.prompt))
            session.drafter.finish(into=memory)

    def _generate(self, job: Job, session: DecodeSession) -> None:
        item = job.item

        def on_text(piece: str) -> bool:
            if job.first_text is None:
                job.first_text = time.perf_counter()
                if not job.cancelled.is_set():
                    self.metrics.time_to_first_token(job.first_text - job.created)
            job.post("text", piece)
            return not job.cancelled.is_set()

        try:
            result = session.generate(item.prompt, item.options, on_text,
                                      should_stop=job.cancelled.is_set)
        except WorkerDied as exc:
            job.post("error", (500, self._death_message(exc)))
            raise
        except CoreMLFailure as exc:  # Core ML's own error: the server's fault, not the client's
            log.error("generation failed: %s", exc)
            session.reset()
            job.post("error", (500, str(exc)))
            return
        except AneSpecError as exc:
            # The app validates requests before queueing them, so this is a rare corner; the
            # cache may hold a half-written prompt now, so forget it.
            session.reset()
            job.post("error", (400, str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - one request must never take the worker down
            log.exception("generation failed")
            session.reset()
            job.post("error", (500, f"internal error during generation ({type(exc).__name__})"))
            return
        self.metrics.generation(result.stats, result.finish_reason)
        job.post("done", result)

    # --- warm-up --------------------------------------------------------------------------

    def _death_message(self, exc: WorkerDied) -> str:
        return (f"{exc}; the request failed, the worker is being restarted with its programs "
                f"and the KV slots that lived in it are dropped (see /health); retry it")

    def _recover(self, exc: WorkerDied) -> None:
        """The backend's worker died: restart it with its programs (through the warm-up's
        steps, /health reporting them), give every resident KV slot a fresh state (their
        K/V died with the worker; spilled copies live here and stay), then serve again."""
        self.recoveries += 1
        self.status = "warming"
        self.warmup = Warmup(total=1, step=f"restarting after {exc.how}")
        try:
            self.pipeline.start()
            state = scratch_state(self.pipeline)
            steps = jit_steps(self.pipeline, state)
            self.warmup = Warmup(total=len(steps), step="restarting the worker")
            self._run_steps(steps)
            dropped = self.slots.drop_resident(self.pipeline) if self.slots else 0
            if self.session is not None:
                self.session.reset()
                self.session.state = self.slots.resident[0].state if self.slots else state()
        except Exception as again:  # noqa: BLE001 - reported through /health, never raised
            log.exception("restarting the worker failed")
            self.last_recovery = {"cause": str(exc), "ok": False,
                                  "error": f"{type(again).__name__}: {again}"}
            self.error = (f"{exc}; restarting the worker failed: {type(again).__name__}: "
                          f"{again}")
            self.status = "error"
            return
        self.warmup.step = "done"
        self.warmup.finished = time.perf_counter()
        self.last_recovery = {"cause": str(exc), "ok": True, "kv_slots_dropped": dropped,
                              "seconds": round(self.warmup.seconds, 3)}
        log.warning("recovered from %s: worker restarted, %d KV slot conversation%s dropped",
                    exc, dropped, "" if dropped == 1 else "s")
        self.status = "ready"

    def _run_steps(self, steps: list[WarmStep]) -> None:
        for step in steps:
            if self._stopping.is_set():
                return
            self.warmup.step = step.name
            t0 = time.perf_counter()
            try:
                step.run()
            except WorkerDied as exc:
                if not step.prefill:
                    raise
                self._disable_prefill(exc)
            else:
                if step.jit is not None:
                    self.warmup.jit[step.jit] = (self.warmup.jit.get(step.jit, 0.0)
                                                 + time.perf_counter() - t0)
            took = time.perf_counter() - t0
            self.warmup.done += 1
            log.info("warm-up %d/%d: %s (%.2fs)", self.warmup.done, self.warmup.total, step.name,
                     took)

    def _disable_prefill(self, exc: WorkerDied) -> None:
        """The prefill function killed the Core ML worker at its first prediction: serve with
        it off (prompts at the decode shape) rather than not at all. The worker restarts on the
        next call; the decode programs' passes come after the prefill function's."""
        self.pipeline.prefill_mode = "off"
        self.prefill_disabled = (f"{exc}: a silent ANE compile failure shows this way "
                                 "(coremltools #2758); prompts run at the decode shape")
        log.warning("the prefill function killed the Core ML worker at warm-up (%s); serving "
                    "with --prefill off", exc)

    def _warm_up(self) -> None:
        p = self.pipeline
        steps: list[WarmStep] = []
        if hasattr(p.backend, "start"):  # Core ML: load every program in the worker process
            programs = len(p.shards) + len(p.prefill_shards) + len(p.heads)
            steps.append(WarmStep(f"loading {programs} programs ({p.backend.describe()})",
                                  p.start))
        steps += jit_steps(p, scratch_state(p))
        if prefill_in_use(p):  # auto plans prompts by these costs; with on, /health shows them
            steps.append(WarmStep(f"prefill cost (c(P={p.prefill_t}) vs c({p.max_t}) pass time)",
                                  self._measure_prefill))
        if p.shape.needs_pass_costs:
            steps.append(WarmStep("draft cost policy (T=1 vs T=4 pass time)",
                                  self._measure_policy))
        else:
            self.fill_drafts = p.shape.fill_drafts(lambda: 1.0)
        if p.shape.needs_drift and p.manifest.drift.get(p.drift_key) is None:
            steps.append(WarmStep(f"drift for the exactness guard ({p.drift_key})",
                                  self._measure_drift))
        if self.config.draft_manifest is not None:
            steps.append(WarmStep("draft model: start it, measure c_draft and c_verify",
                                  self._start_draft))
        self.warmup = Warmup(total=len(steps))
        log.info("warming %s: %d steps", self.model_id, len(steps))
        self._run_steps(steps)
        if self._stopping.is_set():
            return
        self.session = DecodeSession(
            p, drafter=self.drafter or NgramDrafter(ngram_min=self.config.ngram_min,
                                                    ngram_max=self.config.ngram_max),
            fill_drafts=self.fill_drafts)
        self.slots = SlotManager(p, self.kv_slots, self.spill_bytes, self.metrics.slot_event,
                                 states=[self.session.state])
        save_dir = self.config.slot_save_path
        if save_dir is not None:
            save_dir.mkdir(parents=True, exist_ok=True)
            loaded = self.slots.load_saved(save_dir)
            log.info("restored %d saved slot%s from %s%s", len(loaded),
                     "" if len(loaded) == 1 else "s", save_dir,
                     f": {', '.join(loaded)}" if loaded else "")
        self.warmup.step = "done"
        self.warmup.finished = time.perf_counter()

    def _slot_action(self, job: Job) -> None:
        item, slots, where = job.item, self.slots, self.config.slot_save_path
        assert isinstance(item, SlotAction) and slots is not None
        try:
            if item.action == "save":
                result = slots.save(item.slot_id, where, item.filename, self.slot_quota)
            elif item.action == "restore":
                result = slots.restore(item.slot_id, where, item.filename or "")
            else:
                result = slots.erase(item.slot_id)
        except WorkerDied as exc:
            job.post("error", (500, self._death_message(exc)))
            raise
        except CoreMLFailure as exc:
            job.post("error", (500, str(exc)))
            return
        except AneSpecError as exc:  # a bad id or name, a refused file: the client's to fix
            status = (404 if isinstance(exc, SlotNotFound)
                      else 409 if isinstance(exc, SlotQuotaError) else 400)
            job.post("error", (status, str(exc)))
            return
        except OSError as exc:  # the disk's: say what, never where (no server paths)
            log.error("slot %s failed: %s", item.action, exc)
            job.post("error", (500, f"slot {item.action} failed: {exc.strerror or type(exc).__name__}"))
            return
        job.post("done", result)

    def _measure_prefill(self) -> None:
        """c(4), c(P) and c(P) with the head, once, so the first request's prompt is planned
        without paying for the measurement (decode/prefill_plan.py)."""
        p = self.pipeline
        if not prefill_in_use(p):  # switched off by an earlier step's failure
            return
        costs = prefill_costs(p)
        full = costs.pays(p.prefill_t, last=False)
        log.info("prefill T=%d: c(P)/c(%d) %.2f (decode pass %.1f ms, prefill pass %.1f ms, "
                 "with the head on one row %.1f ms), %.0f prompt tok/s through the prefill "
                 "function: a full chunk %s", p.prefill_t, costs.decode_t, costs.ratio,
                 1000 * costs.decode_seconds, 1000 * costs.prefill_seconds,
                 1000 * costs.prefill_head_seconds, costs.to_dict()["prefill_tok_s"],
                 "pays (--prefill auto uses it)" if full else
                 "does not pay here (--prefill auto keeps prompts at the decode shape)")

    def _measure_policy(self) -> None:
        policy = draft_policy(self.pipeline)
        self.fill_drafts = self.pipeline.shape.fill_drafts(lambda: policy.ratio)
        log.info("pass cost T=1 %.1f ms, T=4 %.1f ms (ratio %.2f): %s", 1000 * policy.t1_seconds,
                 1000 * policy.t4_seconds, policy.ratio,
                 "fill every draft slot" if self.fill_drafts else "draft only confident tokens")

    def _start_draft(self) -> None:
        """The draft model beside the target (decode/draft_setup.py), one KV state per slot."""
        from ane_spec.decode.draft_setup import open_drafter

        c = self.config
        self.drafter = open_drafter(
            self.pipeline, c.draft_manifest, units=c.draft_units, mode=c.draft_mode,
            overlap=c.draft_overlap, states=self.kv_slots, ngram_min=c.ngram_min,
            ngram_max=c.ngram_max, verify=c.verify)
        costs = self.drafter.costs
        log.info("draft model %s: %s", c.draft_manifest,
                 costs.to_dict() if costs is not None else "costs not measured")

    def draft_health(self) -> dict[str, Any] | None:
        """The draft model's figures for /health: costs, policy, its process."""
        d = self.drafter
        if d is None:
            return None
        model = d.model
        out: dict[str, Any] = {
            "manifest": str(self.config.draft_manifest), "mode": d.mode, "overlap": d.overlap,
            "costs": None if d.costs is None else d.costs.to_dict(),
            "p_min": round(d.current_p_min(), 4), "figures": d.figures.to_dict(),
            "kv_states": getattr(getattr(model, "spec", None), "states", None),
            "carries": "resident conversations; a spilled or saved one recomputes the draft's "
                       "prompt when it returns"}
        health = getattr(model, "health", None)
        if health is not None:
            out["worker"] = health()
        return out

    def _measure_drift(self) -> None:
        p = self.pipeline
        drift = float(measure_drift(p).figures["drift"])
        p.manifest.drift[p.drift_key] = drift
        log.info("measured %s drift %.3g (guard margin %.3g)", p.drift_key, drift, 2 * drift)
        try:  # as `ane-spec probe drift` does, so the next start skips this step
            record_drift(self.config.manifest, p.drift_key, drift)
        except (OSError, AneSpecError) as exc:
            log.warning("could not record the drift in the manifest (%s); it is measured "
                        "again at every start", exc)


def load_pipeline(config: ServeConfig) -> ShardPipeline:
    """Load and (with config.verify) hash-check the build and load its programs; raises
    AneSpecError with a readable message when that fails."""
    log.info("loading %s (%s%s)", config.manifest, config.backend,
             f", {config.precision}" if config.backend == "mil" else "")
    # Core ML's programs load in its worker process during the warm-up, with /health answering.
    return open_pipeline(config.manifest, config.backend, config.precision,
                         verify=config.verify, decode_shape=config.decode_shape,
                         defer_start=True, prefill=config.prefill)[1]


def load_engine(config: ServeConfig, metrics: Metrics | None = None) -> Engine:
    """The build's engine (see `load_pipeline`). Warm-up starts with `Engine.start`. A draft
    model whose vocabulary differs from the target's is refused here, before anything runs."""
    pipeline = load_pipeline(config)
    if config.draft_manifest is not None:
        from ane_spec.decode.draft_setup import check_pair

        check_pair(pipeline, config.draft_manifest)
    return Engine(config, pipeline, metrics)
