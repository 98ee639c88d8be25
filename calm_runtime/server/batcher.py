"""Step-level scheduling (continuous batching): requests join and leave a running batch
between decode steps.

Requests wait in a bounded queue (:class:`QueueFull` beyond ``max_queue`` rows). One worker
thread drives one :class:`~calm_runtime.inference.continuous.DecodeBatch`: at every step
boundary it admits waiting rows in arrival order, up to ``max_batch_size`` running rows and,
while more rows run than wait, ``max_step_prefill_tokens`` prompt tokens per boundary (a row
that does not fit waits for the next boundary, and none behind it passes it); a burst (as
many rows waiting as running, or more) is admitted at once, as vLLM prefills first. It
chooses every running row's next token, hands the tokens to their requests (streams get
them at once), finishes the rows that ended (length, stop string, end of sequence, a
cancelled request) and runs one forward pass for the rest. A finished
row leaves before the next step; a new one is prefilled at the next boundary, so a request
never waits for another request's answer to end, only for at most one step and one
boundary's prefill.

Every kind of generation shares the batch: rows keep their own sampling settings, seeds,
stop strings, alternatives and limits, and a row decodes as if alone (its own cache, mask,
positions and generator: a seeded row samples what ``generate(prompt, seed=...)`` samples).
P(True) of a finished row is scored at the boundary after it finishes (one batched pass for
the rows that finished together).

When the server is idle the first request waits up to ``window_s`` for others to arrive
with it (one prefill for a burst). :meth:`StepScheduler.cancel` stops a row whose request
is gone (client disconnected, or past its deadline): a waiting row leaves the queue at once,
a running row leaves before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from calm_runtime.errors import CalmError
from calm_runtime.inference.continuous import DecodeBatch
from calm_runtime.inference.prefill import PrefillStopped, release
from calm_runtime.inference.results import Generation
from calm_runtime.inference.sampling import DecodeOptions
from calm_runtime.placement import trim_heap

__all__ = ["DEFAULT_MAX_STEP_PREFILL_TOKENS", "Job", "JobResult", "QueueFull", "ShuttingDown",
           "StepScheduler", "END"]

logger = logging.getLogger(__name__)

#: put on a streaming job's token queue after its last token
END = object()
#: prompt tokens admitted at one step boundary by default (``calm serve
#: --max-step-prefill-tokens``): what one boundary's prefill may stall the running rows for
DEFAULT_MAX_STEP_PREFILL_TOKENS = 512


class QueueFull(Exception):
    """The queue holds ``max_queue`` rows already."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests."""


@dataclass(frozen=True)
class JobResult:
    generation: Generation
    p_true: float | None


@dataclass(eq=False)
class Job:
    """One row: an encoded prompt, its limit and decode options, where its results go."""

    ids: list[int]
    max_new_tokens: int
    options: DecodeOptions  # the request's, made once at the server's edge
    p_true_question: str | None = None
    stream: bool = False
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    future: asyncio.Future = None  # type: ignore[assignment]
    tokens: asyncio.Queue | None = None
    enqueued: float = field(default_factory=time.monotonic)
    #: set (on the loop) by :meth:`StepScheduler.cancel`; read by the decoding thread
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.future = self.loop.create_future()
        if self.stream:
            self.tokens = asyncio.Queue()


class StepScheduler:
    """The server's decode loop (see the module docstring)."""

    def __init__(self, lm, *, max_batch_size: int, window_s: float, max_queue: int,
                 max_step_prefill_tokens: int = DEFAULT_MAX_STEP_PREFILL_TOKENS,
                 metrics=None) -> None:
        self.lm = lm
        self.max_batch_size = min(max_batch_size, lm.backend.max_batch or max_batch_size)
        self.window_s = window_s
        self.max_queue = max_queue
        self.max_step_prefill_tokens = max_step_prefill_tokens
        self.metrics = metrics
        self._pending: deque[Job] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._running = 0

    @property
    def depth(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        """Rows in the running batch."""
        return self._running

    def start(self) -> None:
        """Start the worker thread (once; later calls do nothing)."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="calm-decode",
                                                daemon=True)
                self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closing:
                raise ShuttingDown
            if len(self._pending) >= self.max_queue:
                raise QueueFull
            self._pending.append(job)
            self._set_depth()
            self._cond.notify()
        self.start()

    def cancel(self, job: Job) -> None:
        """Stop ``job``: out of the queue now, or out of the batch before the next step."""
        job.cancelled = True
        if not job.future.done():
            job.future.cancel()
        with self._cond:
            try:
                self._pending.remove(job)
            except ValueError:  # already running (or never queued)
                return
            self._set_depth()

    async def close(self) -> None:
        """Finish every waiting and running row, then stop."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, thread.join)

    # ------------------------------------------------------------------ the worker
    def _work(self) -> None:
        batch = DecodeBatch(self.lm.backend, self.lm.tokenizer)
        dirty = False  # a row ended early or failed since the heap was last trimmed
        while True:
            with self._cond:
                while not self._pending and not len(batch):
                    if self._closing:
                        return
                    self._cond.wait()
                if not len(batch):  # idle: let a burst arrive together
                    deadline = self._pending[0].enqueued + self.window_s
                    while len(self._pending) < self.max_batch_size and not self._closing:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        self._cond.wait(remaining)
                admitted = self._take(len(batch))
            if admitted:
                dirty |= not self._admit(batch, admitted)
            if not len(batch):
                self._set_running(0)
                if dirty:
                    trim_heap()
                    dirty = False
                continue
            self._set_running(len(batch))
            try:
                dirty |= self._step(batch)
            except Exception as exc:  # the batch's error; every row gets it, the loop goes on
                self._fail(list(batch.handles), exc)
                batch.clear()
                release(self.lm.backend)
                dirty = True
            if not len(batch):
                release(self.lm.backend)  # the cache is gone: give its memory back

    def _take(self, running: int) -> list[Job]:
        """The waiting rows admitted at this boundary (under the lock)."""
        live = [job for job in self._pending if not job.cancelled and not job.future.done()]
        # a burst (at least as many rows waiting as running) is prefilled at once, up to the
        # row limit; a trickle into a busy batch keeps to the step budget, so the running
        # rows' time per token stays bounded
        burst = len(live) >= running
        taken = []
        budget = sum(len(job.ids) for job in live) if burst else self.max_step_prefill_tokens
        for job in live:
            if running + len(taken) >= self.max_batch_size:
                break
            if len(job.ids) > budget and (taken or running):
                break  # it waits for the next boundary; nothing behind it passes it
            taken.append(job)
            budget -= len(job.ids)
        chosen = set(map(id, taken))
        self._pending = deque(job for job in live if id(job) not in chosen)
        self._set_depth()
        return taken

    def _admit(self, batch: DecodeBatch, jobs: list[Job]) -> bool:
        """Prefill ``jobs`` into ``batch``; whether all went in (a refused or failed row gets
        its error, the running rows decode on)."""
        started = time.monotonic()
        specs, ok = [], []
        for job in jobs:
            try:
                run = self.lm.generation_run([job.ids], job.max_new_tokens, decode=job.options)
                specs.append(run.row_specs()[0])
                ok.append(job)
            except CalmError as exc:
                job.loop.call_soon_threadsafe(_settle, job, None, exc)
        if not ok:
            return False
        if self.metrics is not None:
            for job in ok:
                self.metrics.queue_wait.observe(started - job.enqueued)
            self.metrics.prompt_tokens.inc(sum(len(j.ids) for j in ok))
        try:
            batch.admit(specs, ok, should_stop=lambda: all(j.cancelled for j in ok))
        except PrefillStopped:
            for job in ok:
                job.loop.call_soon_threadsafe(_settle, job, None, None)
            return False
        except Exception as exc:  # noqa: BLE001 - these rows' error; the batch decodes on
            self._fail(ok, exc)
            return False
        return len(ok) == len(jobs)

    def _step(self, batch: DecodeBatch) -> bool:
        """One decode step of every running row; whether a row ended early."""
        started = time.monotonic()
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(batch))
        events, finished = batch.choose()
        for job, token in events:
            if job.tokens is not None:
                job.loop.call_soon_threadsafe(job.tokens.put_nowait, token)
        dropped = batch.drop(lambda job: job.cancelled)
        if finished:
            self._finish(finished)
        for job, _ in dropped:
            job.loop.call_soon_threadsafe(_settle, job, None, None)
        if dropped:
            logger.info("%d running rows stopped early: their requests were cancelled",
                        len(dropped))
        batch.advance()
        if self.metrics is not None:
            self.metrics.generated_tokens.inc(len(events))
            elapsed = time.monotonic() - started
            if elapsed > 0:
                self.metrics.batch_tokens_per_second.set(len(events) / elapsed)
        return bool(dropped)

    def _finish(self, finished: list[tuple[Job, Generation]]) -> None:
        """Hand finished rows their results (P(True) scored first where asked)."""
        jobs = [job for job, _ in finished]
        results = [generation for _, generation in finished]
        scores, errors = self._p_true(jobs, results)
        for job, generation, score, error in zip(jobs, results, scores, errors, strict=True):
            job.loop.call_soon_threadsafe(_settle, job, JobResult(generation, score), error)

    def _fail(self, jobs: list[Job], exc: BaseException) -> None:
        if isinstance(exc, CalmError):
            logger.warning("%d rows were refused: %s", len(jobs), exc)
        elif isinstance(exc, MemoryError):  # these rows' error; the next ones run
            logger.error("%d rows ran out of memory: %s", len(jobs), exc)
        else:
            logger.exception("%d rows failed", len(jobs), exc_info=exc)
        for job in jobs:
            job.loop.call_soon_threadsafe(_settle, job, None, exc)

    def _set_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._pending))

    def _set_running(self, n: int) -> None:
        self._running = n
        if self.metrics is not None:
            self.metrics.running_rows.set(n)

    def _p_true(self, batch: list[Job], results: list[Generation]):
        """P(True) of the rows that ask for it; a row whose P(True) prompt is refused (say,
        longer than the context) gets that error, the other rows their scores."""
        scores: list[float | None] = [None] * len(batch)
        errors: list[BaseException | None] = [None] * len(batch)
        asking = [i for i, job in enumerate(batch)
                  if job.p_true_question is not None and not job.cancelled]
        if not asking:
            return scores, errors
        try:
            values = self.lm.p_true_batch([batch[i].p_true_question for i in asking],
                                          [results[i].text for i in asking])
            for i, value in zip(asking, values, strict=True):
                scores[i] = float(value)
        except CalmError:  # find the rows at fault, one by one
            for i in asking:
                try:
                    scores[i] = float(self.lm.p_true(batch[i].p_true_question, results[i].text))
                except CalmError as exc:
                    errors[i] = exc
        return scores, errors


def _settle(job: Job, result: JobResult | None, error: BaseException | None) -> None:
    if job.tokens is not None:
        job.tokens.put_nowait(END)
    if job.future.done():  # the request gave up (timeout, disconnect)
        return
    if error is not None:
        job.future.set_exception(error)
    elif result is not None:
        job.future.set_result(result)
    else:
        job.future.cancel()
