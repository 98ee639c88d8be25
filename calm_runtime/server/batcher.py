"""Micro-batching: concurrent requests become rows of one batched decode.

Requests wait in a bounded queue (:class:`QueueFull` beyond ``max_queue`` rows). When the
first one arrives the batcher waits up to ``window_s`` for others (or until
``max_batch_size`` rows wait), then takes the oldest row and every waiting row with the same
decode settings, up to ``max_batch_size``, and runs them as one
:meth:`CalibratedLM.generation_run` on a worker thread. While that batch decodes new rows
queue up and form the next batch at once. Rows of a batch decode as if alone (the runtime
drops finished rows), so a batched request returns what a serial call returns.

Rows batch together only when their sampling settings, stop strings and number of
alternatives agree. A sampled row with a seed always runs alone: its random stream is the
seed's first child, exactly as in a direct ``generate(prompt, seed=...)`` call.

:meth:`MicroBatcher.cancel` stops a row whose request is gone (client disconnected, or
past its timeout): a waiting row leaves the queue at once, a decoding row leaves its
batch before the next decode step (the other rows decode on), and a batch whose rows are
all cancelled ends, so the next batch starts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from calm_runtime.errors import CalmError
from calm_runtime.inference.results import Generation
from calm_runtime.inference.sampling import DecodeOptions
from calm_runtime.placement import trim_heap

__all__ = ["Job", "JobResult", "MicroBatcher", "QueueFull", "ShuttingDown", "END"]

logger = logging.getLogger(__name__)

#: put on a streaming job's token queue after its last token
END = object()


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
    #: set (on the loop) by :meth:`MicroBatcher.cancel`; read by the decoding thread
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.future = self.loop.create_future()
        if self.stream:
            self.tokens = asyncio.Queue()

    @property
    def key(self) -> tuple:
        """What rows must share to decode in one batch (DecodeOptions.batch_key)."""
        return self.options.batch_key(self)


class MicroBatcher:
    def __init__(self, lm, *, max_batch_size: int, window_s: float, max_queue: int,
                 metrics=None) -> None:
        self.lm = lm
        self.max_batch_size = min(max_batch_size, lm.backend.max_batch or max_batch_size)
        self.window_s = window_s
        self.max_queue = max_queue
        self.metrics = metrics
        self._pending: deque[Job] = deque()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="calm-batch")
        self._closing = False

    @property
    def depth(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        """Start the batching task on the running loop (once; later calls do nothing)."""
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def submit(self, job: Job) -> None:
        if self._closing:
            raise ShuttingDown
        self.start()
        if len(self._pending) >= self.max_queue:
            raise QueueFull
        self._pending.append(job)
        self._set_depth()
        self._wakeup.set()

    def cancel(self, job: Job) -> None:
        """Stop ``job``: out of the queue now, or out of its batch before the next step."""
        job.cancelled = True
        if not job.future.done():
            job.future.cancel()
        try:
            self._pending.remove(job)
        except ValueError:  # already taken into a batch (or never queued)
            return
        self._set_depth()

    async def close(self) -> None:
        """Finish every waiting and running row, then stop."""
        self._closing = True
        if self._task is not None:
            self._wakeup.set()
            await self._task
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ the loop
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            deadline = self._pending[0].enqueued + self.window_s
            while len(self._pending) < self.max_batch_size and not self._closing:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            batch = self._take()
            if batch:
                await loop.run_in_executor(self._executor, self._run, batch)

    def _take(self) -> list[Job]:
        live = [job for job in self._pending  # drop abandoned rows
                if not job.cancelled and not job.future.done()]
        batch, rest = [], deque()
        key = live[0].key if live else None
        for job in live:
            if job.key == key and len(batch) < self.max_batch_size:
                batch.append(job)
            else:
                rest.append(job)
        self._pending = rest
        self._set_depth()
        return batch

    def _set_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._pending))

    def _run(self, batch: list[Job]) -> None:
        """Decode one batch on the worker thread; hand tokens and results to the loop. A
        batch that did not finish (a row cancelled, an error) gives the heap's free pages back
        to the system after it, so a request that ends early leaves no peak behind; a batch
        that finished is not trimmed (the next one would fault the same pages in again)."""
        finished = False
        try:
            finished = self._decode(batch)
        finally:
            if not finished:
                trim_heap()

    def _decode(self, batch: list[Job]) -> bool:
        """The batch's decode; whether every row ran to its end."""
        started = time.monotonic()
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(batch))
            for job in batch:
                self.metrics.queue_wait.observe(started - job.enqueued)
        try:
            run = self.lm.generation_run([j.ids for j in batch],
                                         [j.max_new_tokens for j in batch],
                                         cancelled=lambda row: batch[row].cancelled,
                                         decode=batch[0].options)
            for row, token in run:
                job = batch[row]
                if job.tokens is not None:
                    job.loop.call_soon_threadsafe(job.tokens.put_nowait, token)
            results = run.results
            scores, errors = self._p_true(batch, results)
        except Exception as exc:  # handed to each request; the batcher keeps running
            if isinstance(exc, CalmError):
                logger.warning("a batch of %d rows was refused: %s", len(batch), exc)
            elif isinstance(exc, MemoryError):  # that batch's error; the next one runs
                logger.error("a batch of %d rows ran out of memory: %s", len(batch), exc)
            else:
                logger.exception("a batch of %d rows failed", len(batch))
            for job in batch:
                job.loop.call_soon_threadsafe(_settle, job, None, exc)
            return False
        stopped = sum(job.cancelled for job in batch)
        if stopped:
            logger.info("%d of %d rows stopped early: their requests were cancelled", stopped,
                        len(batch))
        tokens = sum(len(g.tokens) for g in results)
        if self.metrics is not None:
            self.metrics.generated_tokens.inc(tokens)
            self.metrics.prompt_tokens.inc(sum(len(j.ids) for j in batch))
            elapsed = time.monotonic() - started
            if elapsed > 0:
                self.metrics.batch_tokens_per_second.set(tokens / elapsed)
        for job, generation, score, error in zip(batch, results, scores, errors, strict=True):
            job.loop.call_soon_threadsafe(_settle, job, JobResult(generation, score), error)
        return not stopped

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
    else:
        job.future.set_result(result)
