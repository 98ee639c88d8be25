"""The response writers over the :class:`~.serving.ServerState`: OpenAI's completion and
chat objects, streamed or whole, echo and constrained choices, each with calm's extension,
the admission of scoring calls, and the waiting on results with the client's disconnect
and the timeout."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
import uuid

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from calm_runtime import modes
from calm_runtime.errors import CalmError
from calm_runtime.placement import trim_heap
from calm_runtime.server.batcher import END, Job
from calm_runtime.server.guard import CLIENT_CLOSED, request_deadline
from calm_runtime.server.protocol import (
    FINISH_REASONS,
    APIError,
    CalmOptions,
    CompletionChoice,
    CompletionResponse,
    Usage,
    choice_extension,
    echo_logprobs,
)
from calm_runtime.server.state import ServerState

__all__ = ["EventStream", "ResponseShape", "ResponseWriter", "out_of_memory"]

logger = logging.getLogger(__name__)


def out_of_memory(exc: BaseException) -> APIError:
    """The 503 of a request whose pass could not allocate its memory (logged; the server
    goes on with the next request)."""
    logger.warning("a request ran out of memory: %s", exc)
    return APIError(503, "the server ran out of memory for this request; retry, or send fewer "
                    "or shorter prompts (the server's --max-prefill-tokens bounds a pass)",
                    type="server_error", code="out_of_memory")


def _event(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class EventStream(StreamingResponse):
    """The SSE response: while it streams it listens for the client's disconnect (whatever
    the ASGI server's spec version), and when the client leaves early the request's rows
    stop decoding."""

    def __init__(self, server: ServerState, jobs: list[Job], events) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._server = server
        self._jobs = jobs

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def respond() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client left while an event was written
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(respond)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
            self._server.abandon(self._jobs)



class ResponseShape:
    """How one endpoint's answers look: OpenAI's completions or chat completions objects.
    The writer asks the shape, never the endpoint's name; each serving module
    (completions.py, chat.py) defines its own on this base."""

    #: the response id's prefix ("cmpl", "chatcmpl")
    id_prefix = ""
    #: the non-streaming response's model (protocol.py)
    response_model: type = CompletionResponse
    #: a stream opens each choice with a chunk holding the assistant's role
    opens_with_role = False

    def object_name(self, chunk: bool) -> str:
        raise NotImplementedError

    def choice(self, index: int, text: str, finish: str, logprobs, calm: dict):
        raise NotImplementedError

    def logprobs(self, tokens, req, *, offset: int = 0, raw: bool = False, token_bytes=None):
        """The ``logprobs`` object of ``tokens`` as this endpoint writes it (``raw``: the
        uncalibrated ones, for the ``calm`` object)."""
        raise NotImplementedError

    def asks_logprobs(self, req) -> bool:
        raise NotImplementedError

    def chunk_choice(self, index: int, text: str | None) -> dict:
        """A streamed choice carrying ``text`` (``None``: no text in this chunk)."""
        raise NotImplementedError

    def final_text(self, text: str, sent: int) -> str | None:
        """What the last chunk of a streamed choice carries after ``sent`` characters."""
        return text[sent:]


class ResponseWriter:
    """What the server answers with; the state is the server's, the admission of scoring
    calls (one at a time, at most ``max_queue`` waiting) the writer's."""

    def __init__(self, server: ServerState) -> None:
        self.server = server
        self.config = server.config
        self.lm = server.lm
        self.metrics = server.metrics
        self._scoring_gate: asyncio.Semaphore | None = None  # made in the event loop
        self._scoring_waiting = 0

    async def scoring(self, request: Request, fn, *args, **kwargs):
        """Run a prompt-scoring call (an echo, a constrained choice) under the same admission
        control as generation: at most ``max_queue`` waiting (then 429), one at a time on the
        engine beside the batcher, cut at the request's one deadline (504: however many
        prompts or choices the request scores, they share it) or when the client disconnects
        (``None``). The call stops between its steps (``should_stop``); the answer does not
        wait for the step running at the deadline: the engine is handed to the next scoring
        call when that step ends. Its memory is bounded inside the call (the scoring budget
        of :mod:`calm_runtime.inference.scoring_passes`) and given back when it returns."""
        loop = asyncio.get_running_loop()
        if self._scoring_gate is None:
            self._scoring_gate = asyncio.Semaphore(1)
        if self._scoring_waiting >= self.config.max_queue:
            raise APIError(429, f"{self._scoring_waiting} scoring requests are waiting (the "
                           "limit is --max-queue); retry later", type="rate_limit_error",
                           code="queue_full")
        deadline = self._deadline(request, loop)
        if deadline <= loop.time():
            raise self._scoring_timeout()
        stop = threading.Event()
        gone = asyncio.ensure_future(_client_gone(request.receive))
        self._scoring_waiting += 1
        waiting, held = True, False
        try:
            try:
                await asyncio.wait_for(self._scoring_gate.acquire(),
                                       timeout=max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise self._scoring_timeout() from None
            held = True
            self._scoring_waiting -= 1
            waiting = False
            task = asyncio.ensure_future(run_in_threadpool(
                functools.partial(fn, *args, should_stop=stop.is_set, **kwargs)))
            gate = self._scoring_gate

            def hand_over() -> None:  # the call returns at its next step; the gate then
                nonlocal held
                stop.set()
                task.add_done_callback(lambda t: (t.cancelled() or t.exception(),
                                                  gate.release(), _trim_soon()))
                held = False

            try:
                done, _ = await asyncio.wait({task, gone},
                                             timeout=max(0.0, deadline - loop.time()),
                                             return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the server is stopping this request
                hand_over()
                raise
            if task in done:
                try:
                    return task.result()
                except MemoryError as exc:
                    raise out_of_memory(exc) from None
            hand_over()
            self.metrics.cancelled.inc()
            if gone in done and gone.exception() is None:
                return None
            raise self._scoring_timeout()
        finally:
            if held:
                self._scoring_gate.release()
            if waiting:
                self._scoring_waiting -= 1
            gone.cancel()

    def _deadline_monotonic(self, request: Request | None) -> float:
        """The request's deadline (``time.monotonic()``): set once when its body was read
        (:class:`~calm_runtime.server.guard.Guard`), else ``request_timeout_s`` from now."""
        mono = request_deadline(request.scope) if request is not None else None
        return time.monotonic() + self.config.request_timeout_s if mono is None else mono

    def _deadline(self, request: Request | None, loop) -> float:
        """:meth:`_deadline_monotonic` on ``loop``'s clock."""
        return loop.time() + (self._deadline_monotonic(request) - time.monotonic())

    def _scoring_timeout(self) -> APIError:
        return APIError(504, f"the request did not finish within "
                        f"{self.config.request_timeout_s:g} s; retry with shorter prompts or "
                        "fewer choices", type="timeout_error", code="timeout")

    def _timeout(self, jobs: list[Job]) -> APIError:
        for job in jobs:
            self.server.batcher.cancel(job)
        return APIError(504, f"the request did not finish within "
                        f"{self.config.request_timeout_s:g} s; retry or ask for fewer tokens",
                        type="timeout_error", code="timeout")

    def _observe(self, result) -> None:
        for token in result.generation.tokens:
            self.metrics.token_confidence.observe(token.confidence)
        self.metrics.sequence_confidence.observe(result.generation.sequence_confidence)
        if result.p_true is not None:
            self.metrics.p_true.observe(result.p_true)

    def _envelope(self, rid: str, shape: ResponseShape, chunk: bool = False) -> dict:
        return {"id": rid, "object": shape.object_name(chunk), "created": int(time.time()),
                "model": self.config.served_name, "system_fingerprint": self.server.fingerprint}

    def _response(self, shape: ResponseShape, choices: list, usage: Usage) -> dict:
        """A non-streaming response body, built through its model (protocol.py)."""
        return shape.response_model(
            id=f"{shape.id_prefix}-{uuid.uuid4().hex}", created=int(time.time()),
            model=self.config.served_name, system_fingerprint=self.server.fingerprint,
            choices=choices, usage=usage, calm=self.server.identity).model_dump()

    async def _results(self, jobs: list[Job], request: Request):
        """The jobs' results; ``None`` when the client disconnected first (the rows are then
        stopped), a 504 past the timeout."""
        loop = asyncio.get_running_loop()
        deadline = self._deadline(request, loop)
        waiter = asyncio.gather(*(j.future for j in jobs), return_exceptions=True)
        gone = asyncio.ensure_future(_client_gone(request.receive))
        waiting = {waiter, gone}
        try:
            while True:
                done, _ = await asyncio.wait(waiting, timeout=max(0.0, deadline - loop.time()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if waiter in done:
                    return waiter.result()
                if gone in done:
                    if gone.exception() is None:
                        self.server.abandon(jobs)
                        return None
                    waiting = {waiter}  # the connection cannot be watched: wait for the answer
                    continue
                raise self._timeout(jobs)
        except asyncio.CancelledError:  # the server is stopping this request
            self.server.abandon(jobs)
            raise
        finally:
            gone.cancel()

    async def constrained(self, encoded: list[list[int]], questions: list[str],
                          choices: list[str], req, shape: ResponseShape, request: Request):
        """A constrained choice: the answer is the most probable of ``choices``; the
        ``calm`` object carries the calibrated ``option_probabilities`` (in the given order).
        Cloze: each choice's text continues the prompt as given; letter: the choices are
        listed as ``A. ...`` after the question (the prompt, or the last user message)."""
        options = req.calm or CalmOptions()
        mode = options.choice_mode or self.lm.choice_mode  # the request's, else the engine's
        continued = not modes.mode(mode, choice=True).token_level  # cloze
        out = []
        for index, (ids, question) in enumerate(zip(encoded, questions, strict=True)):
            try:
                if continued:
                    picked = await self.scoring(request, self.lm.choose_continuation, ids,
                                                choices)
                else:
                    if not question.strip():
                        raise APIError(400, "letter-mode choice needs a question: a non-empty "
                                       "prompt or user message", param="calm.choice_mode")
                    picked = await self.scoring(request, _one_pass(self.lm.choose), question,
                                                choices, "letter", chat=False)
            except CalmError as exc:
                raise APIError(400, str(exc)) from None
            if picked is None:  # the client went away: nobody to answer
                return Response(status_code=CLIENT_CLOSED)
            text = choices[picked.prediction]
            extension = {"option_probabilities": [float(p) for p in picked.probabilities],
                         "confidence": picked.confidence, "choice_mode": mode,
                         "variant": picked.variant,
                         "answer_temperature": picked.answer_temperature,
                         "calibrated": self.lm.calibrated_outputs_in(mode)}
            below = (options.abstain_below if options.abstain_below is not None
                     else self.lm.abstain_below)  # the request's, else the engine's
            if below is not None:
                extension["abstained"] = picked.confidence < below
                extension["abstain_below"] = below
            out.append(shape.choice(index, text, "stop", None, extension))
        return self._response(shape, out, Usage.of(sum(len(ids) for ids in encoded)))

    async def echo(self, prompts: list[str], req, shape: ResponseShape, request: Request):
        """``echo`` with ``max_tokens`` 0: every prompt token's calibrated log-probability
        (and ``logprobs`` alternatives), text offsets and no generated text."""
        try:
            response = await self._echo(prompts, req, shape, request)
        except BaseException:
            _trim_soon()  # what the request built is freed as the error leaves
            raise
        response.background = BackgroundTask(trim_heap)  # after the body is sent
        return response

    async def _echo(self, prompts: list[str], req, shape: ResponseShape, request: Request):
        top = req.logprobs or 0
        choices, prompt_tokens = [], 0
        for index, prompt in enumerate(prompts):
            try:
                scored = await self.scoring(request, self.lm.prompt_logprobs, prompt, top=top,
                                            raw_logprobs=req.wants_raw)
            except CalmError as exc:
                raise APIError(400, str(exc), param="prompt") from None
            if scored is None:  # the client went away: nobody to answer
                return Response(status_code=CLIENT_CLOSED)
            prompt_tokens += len(scored)
            choices.append(await run_in_threadpool(self._echo_choice, shape, index, prompt,
                                                   scored, req, top))
        # a long echo with alternatives is megabytes of JSON: built and encoded off the loop
        content = await run_in_threadpool(
            lambda: _encode_json(self._response(shape, choices, Usage.of(prompt_tokens))))
        return Response(content=content, media_type="application/json")

    def _echo_choice(self, shape: ResponseShape, index: int, prompt: str, scored, req,
                     top: int) -> CompletionChoice:
        calm = {"calibrated": self.server.calibrated}
        if req.wants_raw:
            calm["raw_logprobs"] = echo_logprobs(scored, top, raw=True)
        return shape.choice(index, prompt, "length",
                            echo_logprobs(scored, top) if req.logprobs is not None else None,
                            calm)

    async def complete(self, jobs: list[Job], req, shape: ResponseShape, request: Request):
        results = await self._results(jobs, request)
        if results is None:  # nobody to answer
            return Response(status_code=CLIENT_CLOSED)
        for result in results:
            if isinstance(result, CalmError):
                raise APIError(400, str(result))
            if isinstance(result, MemoryError):
                raise out_of_memory(result)
            if isinstance(result, asyncio.CancelledError):
                raise APIError(503, "the request was cancelled by the server; retry",
                               type="server_error", code="cancelled")
            if isinstance(result, BaseException):
                raise result
        choices = []
        for index, result in enumerate(results):
            self._observe(result)
            g = result.generation
            token_bytes = self.lm.tokenizer.token_bytes
            logprobs = (shape.logprobs(g.tokens, req, token_bytes=token_bytes)
                        if shape.asks_logprobs(req) else None)
            calm = {**choice_extension(g, result.p_true, req.wants_p_true),
                    "calibrated": self.server.calibrated}
            if req.wants_raw:
                calm["raw_logprobs"] = shape.logprobs(g.tokens, req, raw=True,
                                                      token_bytes=token_bytes)
            choices.append(shape.choice(index, g.text, FINISH_REASONS[g.finish_reason],
                                        logprobs, calm))
        return self._response(shape, choices, Usage.of(
            sum(len(j.ids) for j in jobs), sum(len(r.generation.tokens) for r in results)))

    async def stream(self, jobs: list[Job], req, shape: ResponseShape,
                     request: Request | None = None):
        """SSE events: one chunk per token, a final chunk per choice, usage, ``[DONE]``.

        The text of a chunk is released only once no stop string can still begin in it, so
        the chunks' texts join to exactly the non-streaming text. Closed early (the client
        left), it stops the unfinished rows.
        """
        rid = f"{shape.id_prefix}-{uuid.uuid4().hex}"
        token_bytes = self.lm.tokenizer.token_bytes
        deadline = self._deadline_monotonic(request)
        stops = req.stops()
        hold = max((len(s) for s in stops), default=1) - 1
        usage = [0, 0]
        ended = False  # the stream ran to its end (an error event included)

        def chunk(index: int, text: str | None, logprobs, finish, extension) -> dict:
            choice = shape.chunk_choice(index, text)
            choice.update(logprobs=logprobs, finish_reason=finish, calm=extension)
            return {**self._envelope(rid, shape, chunk=True), "choices": [choice]}

        try:
            for index, job in enumerate(jobs):
                if shape.opens_with_role:
                    first = chunk(index, None, None, None, None)
                    first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                    yield _event(first)
                full, sent, offset = "", 0, 0
                while True:
                    token = await asyncio.wait_for(job.tokens.get(), deadline - time.monotonic())
                    if token is END:
                        break
                    full += token.text
                    upto = len(full) - hold
                    for stop in stops:
                        at = full.find(stop, max(0, sent - hold))
                        if at >= 0:
                            upto = min(upto, at)
                    text = full[sent:upto] if upto > sent else ""
                    sent = max(sent, upto)
                    logprobs = (shape.logprobs([token], req, offset=offset,
                                               token_bytes=token_bytes)
                                if shape.asks_logprobs(req) else None)
                    extension = {"token_confidence": token.confidence}
                    if req.wants_raw:
                        extension["raw_logprobs"] = shape.logprobs(
                            [token], req, offset=offset, raw=True, token_bytes=token_bytes)
                    offset += len(token.text)
                    yield _event(chunk(index, text, logprobs, None, extension))
                result = await job.future
                self._observe(result)
                g = result.generation
                yield _event(chunk(index, shape.final_text(g.text, sent), None,
                                   FINISH_REASONS[g.finish_reason],
                                   {**choice_extension(g, result.p_true, req.wants_p_true),
                                    "calibrated": self.server.calibrated}))
                usage[0] += len(job.ids)
                usage[1] += len(g.tokens)
            if req.stream_options and req.stream_options.include_usage:
                yield _event({**self._envelope(rid, shape, chunk=True), "choices": [],
                              "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                                        "total_tokens": sum(usage)}})
            ended = True
            yield _event("[DONE]")
        except asyncio.TimeoutError:
            ended = True
            error = self._timeout(jobs)
            self.metrics.errors.labels(error.type).inc()
            yield _event(error.body())
        except MemoryError as exc:  # the batch could not allocate its memory
            ended = True
            error = out_of_memory(exc)
            self.metrics.errors.labels(error.type).inc()
            yield _event(error.body())
        except CalmError as exc:  # the request's input was refused while it ran (P(True))
            ended = True
            self.metrics.errors.labels("invalid_request_error").inc()
            yield _event(APIError(400, str(exc)).body())
        except Exception as exc:  # headers are sent: report in-band, log the details
            ended = True
            logger.error("a streaming request failed", exc_info=exc)
            self.metrics.errors.labels("server_error").inc()
            yield _event(APIError(500, "the server failed on this request; the details are "
                                  "in its log", type="server_error").body())
        finally:
            self.server.abandon(jobs, client_left=not ended)


def _encode_json(body: dict) -> bytes:
    return json.dumps(body, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode("utf-8")


def _one_pass(fn):
    """``fn`` for :meth:`ResponseWriter.scoring`: one forward pass, too short to stop
    inside."""
    def call(*args, should_stop=None, **kwargs):
        return fn(*args, **kwargs)
    return call


def _trim_soon() -> None:
    """Give the heap's free pages back (:func:`~calm_runtime.placement.trim_heap`) on a
    worker thread, once the current callbacks have freed what they hold."""
    loop = asyncio.get_running_loop()
    loop.call_soon(lambda: loop.run_in_executor(None, trim_heap))


async def _client_gone(receive) -> None:
    """Return once the client has disconnected (called after the body was read, when the
    server's ``receive`` waits for the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a server that repeats empty messages: do not spin
