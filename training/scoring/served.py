"""Scoring a model behind an OpenAI-compatible API (vLLM, SGLang, llama.cpp's server, a hosted
API, or ``calm serve``), with the same prompts and option-score conventions as the local path.

A model spec that starts with ``http://`` or ``https://`` is the base URL of such an API
(``.../v1``). The served model name comes from ``GET /models`` when it lists exactly one
model, else from ``model_name``; the key from an environment variable, never an argument.

* **letter**: one completion token with ``logprobs=20``; an option letter's logit is its
  log-probability among the returned alternatives (softmax over the K letters is the same
  as over the logits). A letter that is not among them is scored exactly by echoing the
  prompt followed by the letter (as cloze reads prompts); where the endpoint cannot echo, it
  gets the smallest returned log-probability (an upper bound on its own), and the share of
  questions where that happened is logged and returned.
* **cloze**: the log-probabilities of the prompt itself (``echo=true``, ``max_tokens=0``);
  the option's tokens are the echoed tokens at or after the character where the option
  text starts.
* **P(True)**: the true and false tokens' log-probabilities of the judging prompt's next
  token, read the same way as the letters.

``/v1/completions`` answers its logprobs in one of two shapes, both read by
:func:`completion_logprobs`: OpenAI's (``tokens``, ``token_logprobs``, ``top_logprobs`` as
one ``{token: logprob}`` per position, ``text_offset``: OpenAI, vLLM, SGLang, calm serve) or
the chat shape (``content[]`` of ``{token, logprob, top_logprobs: [{token, logprob}]}``:
llama.cpp's llama-server). llama-server does not echo the prompt's log-probabilities, which
cloze needs: cloze scoring against such an endpoint is one line saying so and naming
``--mode letter``, which works through either shape.

Requests run ``concurrency`` at a time, are retried with exponential backoff on 429, 5xx,
time-outs and connection errors within one total deadline each (``--timeout``), and every
answer (redacted of the key, see :func:`~calm_training.scoring.endpoint.redact`) is appended to a
cache file keyed by the endpoint, the served model and the request, so an interrupted run
resumes where it stopped.
Uses the standard library only (no torch, no HTTP client dependency).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from calm_runtime import modes
from calm_runtime.data.models import is_endpoint
from calm_runtime.data.prompts import (
    cloze_context,
    cloze_continuation,
    letter_prompt,
    letter_tokens,
    option_char_count,
)
from calm_runtime.data.sets import MultipleChoiceRecord
from calm_runtime.errors import CalmError, ConfigError
from calm_runtime.modes import PTrueTemplate
from calm_runtime.paths import cache_dir
from calm_runtime.progress import progress as progress_bar
from calm_training.scoring.answer_logprobs import (
    TOP_LOGPROBS,
    NoPromptLogprobs,
    TokenLogprobs,
    chat_top_alternatives,
    completion_logprobs,
    echo_fields,
    echoed_continuation,
    first_choice,
    top_alternatives,
)
from calm_training.scoring.endpoint import (
    Endpoint,
    RemoteError,
    abort_requests,
    connect,
    redact_url,
)
from calm_training.scoring.option_scores import OptionScores

__all__ = ["Endpoint", "NoPromptLogprobs", "RemoteError", "TOP_LOGPROBS", "TokenLogprobs",
           "completion_logprobs", "connect", "is_endpoint", "remote_answers",
           "remote_option_scores", "remote_p_true", "serves_chat"]

logger = logging.getLogger(__name__)

#: Version of the request formats; part of every cache key.
REMOTE_SCORER_VERSION = 1


#: appended to an echo request's refusal: what the refusal most likely means
NO_ECHO = ("; the endpoint does not seem to score prompts (echo with logprobs and "
           "max_tokens 0) — use --mode letter")


def no_prompt_logprobs(endpoint: Endpoint, exc: NoPromptLogprobs) -> RemoteError:
    """The one-line error of cloze scoring against an endpoint that does not echo."""
    return RemoteError(f"{redact_url(endpoint.base_url)} does not return prompt "
                       f"log-probabilities (echo), which cloze mode needs ({exc}); use "
                       "--mode letter")


# ---------------------------------------------------------------------- the cache
class _Cache:
    """Append-only JSONL of ``{"key": ..., "value": ...}``: answers survive an interruption;
    a torn last line (the process was killed mid-write) is ignored."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.path = cache_dir("remote") / f"{endpoint.cache_key()}.jsonl"
        self.values: dict[str, object] = {}
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    item = json.loads(line)
                    self.values[item["key"]] = item["value"]
                except (ValueError, KeyError, TypeError):
                    continue
        self._handle = None

    def add(self, key: str, value: object) -> None:
        self.values[key] = value
        if self._handle is None:
            self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._handle.write(json.dumps({"key": key, "value": value}) + "\n")
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()


def _key(kind: str, body: dict) -> str:
    material = json.dumps({"v": REMOTE_SCORER_VERSION, "kind": kind, "body": body},
                          sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()


def _run(endpoint: Endpoint, kind: str, bodies: Sequence[dict],
         parse: Callable[[dict, dict], object], *, progress: bool, desc: str,
         path: str = "/completions",
         refused: Callable[[int, str | None], bool] | None = None) -> list:
    """Every body's parsed answer, from the cache or the endpoint (``concurrency`` at once);
    ``parse(payload, body)`` checks an answer against its request before it is kept;
    ``refused``: which 429/5xx answers are not retried (:meth:`Endpoint.request`)."""
    cache = _Cache(endpoint)
    keys = [_key(kind, {**b, "model": endpoint.model}) for b in bodies]
    todo = sorted({k: i for i, k in enumerate(keys) if k not in cache.values}.values())
    if len(todo) < len(bodies):
        logger.info("%s: %d of %d answers from the cache %s", desc, len(bodies) - len(todo),
                    len(bodies), cache.path.name)
    bar = progress_bar(total=len(todo), desc=desc, unit="request", bar=progress)
    pool = concurrent.futures.ThreadPoolExecutor(endpoint.concurrency)
    futures: dict = {}
    try:
        futures = {pool.submit(endpoint.request, "POST", path,
                               {**bodies[i], "model": endpoint.model}, refused=refused): i
                   for i in todo}
        for future in concurrent.futures.as_completed(futures):
            i = futures[future]
            cache.add(keys[i], parse(future.result(), bodies[i]))
            bar.update(1)
    except CalmError:
        # queued requests are dropped; those in flight finish, and what they got is kept
        # (on Ctrl-C or SIGTERM nothing is waited for)
        pool.shutdown(wait=True, cancel_futures=True)
        for future, i in futures.items():
            if keys[i] in cache.values or future.cancelled() or future.exception() is not None:
                continue
            try:
                cache.add(keys[i], parse(future.result(), bodies[i]))
            except CalmError:
                pass
        raise
    except BaseException:  # Ctrl-C or SIGTERM: end what is in flight, keep the cache
        abort_requests()
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        bar.close()
        cache.close()
    return [cache.values[k] for k in keys]


def serves_chat(endpoint: Endpoint) -> bool:
    """Whether the endpoint answers ``/v1/chat/completions`` with token logprobs (a served
    chat model: scored in the format its clients use). One request of one token; a 4xx
    (no chat template, no such route) means no."""
    body = {"model": endpoint.model, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": 1}
    probe = dataclasses.replace(endpoint, retries=0)  # one try: the answer decides the format
    try:
        chat_top_alternatives(probe.request("POST", "/chat/completions", body))
    except RemoteError as exc:
        if exc.status in (401, 403):  # a key problem, not a missing route
            raise
        logger.info("%s: no chat completions with logprobs (%s); prompts go as text",
                    endpoint.base_url, exc)
        return False
    return True


def resolve_chat(endpoint: Endpoint, chat: bool | None) -> bool:
    """The prompt format for letter and P(True) prompts to ``endpoint``, by the rule of the
    local path (``chat=None``: the chat template when the model has one): chat when the
    endpoint serves chat completions with logprobs; ``chat=True`` where it does not is a
    one-line error."""
    served = serves_chat(endpoint)
    if chat and not served:
        raise ConfigError(f"{endpoint.base_url} does not serve chat completions with logprobs "
                          f"for {endpoint.model!r}; pass --no-chat")
    return served if chat is None else bool(chat)


def _names_echo(status: int, message: str | None) -> bool:
    """A 5xx answer to an echo request whose message names echo: the endpoint refuses it
    (llama-server: HTTP 500 "Only no echo is supported"), which no retry changes."""
    return status >= 500 and bool(message) and "echo" in message.lower()


def _echo_run(endpoint: Endpoint, kind: str, bodies: Sequence[dict], *, progress: bool,
              desc: str) -> list:
    """:func:`_run` of echo requests. An endpoint that does not echo prompt
    log-probabilities is a :class:`NoPromptLogprobs` at its first answer, whether it answers
    without them or refuses ``echo`` with a server error that names it (not retried)."""
    try:
        return _run(endpoint, kind, bodies, echo_fields, progress=progress, desc=desc,
                    refused=_names_echo)
    except NoPromptLogprobs:
        raise
    except RemoteError as exc:
        if exc.status is not None and _names_echo(exc.status, exc.detail):
            raise NoPromptLogprobs(f"asked to echo the prompt, it answered HTTP {exc.status} "
                                   f"{exc.detail[:120]!r}") from None
        raise


# ---------------------------------------------------------------------- scoring
@dataclass
class RemoteStats:
    """What the remote path had to approximate."""

    floored: int = 0  # questions where an option token was not among the top alternatives
    total: int = 0

    @property
    def floored_share(self) -> float:
        return self.floored / self.total if self.total else 0.0


def _next_token_logprobs(endpoint: Endpoint, prompts: Sequence[str],
                         tokens: Sequence[Sequence[str]], stats: RemoteStats, *,
                         progress: bool, desc: str, chat: bool = False) -> list[list[float]]:
    """The log-probability of each of ``tokens[i]`` as the next token after ``prompts[i]``.

    One request per prompt reads the top alternatives; a token not among them is then
    scored exactly by echoing ``prompt + token`` (``max_tokens`` 0) and reading the last
    token. Where that is not possible (no echo support, or the token does not come back as
    one token after the prompt) it gets the smallest returned log-probability (an upper
    bound) and the prompt is counted in ``stats.floored``."""
    if chat:  # the prompt as the user's message, scored through the chat template it serves
        bodies = [{"messages": [{"role": "user", "content": p}], "max_tokens": 1,
                   "temperature": 0, "logprobs": True, "top_logprobs": TOP_LOGPROBS}
                  for p in prompts]
        tops = _run(endpoint, "chat-next", bodies, chat_top_alternatives, progress=progress,
                    desc=desc, path="/chat/completions")
    else:
        bodies = [{"prompt": p, "max_tokens": 1, "temperature": 0, "logprobs": TOP_LOGPROBS}
                  for p in prompts]
        tops = _run(endpoint, "next", bodies, top_alternatives, progress=progress, desc=desc)
    missing = [(i, token) for i, top in enumerate(tops) for token in tokens[i]
               if token not in top and not chat]  # a chat prompt cannot be echoed
    exact: dict[tuple[int, str], float | None] = {}
    if missing:
        echo = [{"prompt": prompts[i] + token, "max_tokens": 0, "temperature": 0,
                 "logprobs": 0, "echo": True} for i, token in missing]
        try:
            echoed = _echo_run(endpoint, "echo", echo, progress=progress,
                               desc=f"{desc}, tokens outside the top {TOP_LOGPROBS}")
        except RemoteError as exc:
            logger.warning("exact scores of tokens outside the top %d need echo: %s",
                           TOP_LOGPROBS, exc)
            echoed = [None] * len(missing)
        for (i, token), fields in zip(missing, echoed, strict=True):
            exact[i, token] = None
            if fields is None:
                continue
            offsets, values = fields["text_offset"], fields["token_logprobs"]
            if offsets and offsets[-1] == len(prompts[i]) and isinstance(values[-1], int | float):
                exact[i, token] = float(values[-1])
    out = []
    for i, top in enumerate(tops):
        floor = min(top.values())
        row = []
        for token in tokens[i]:
            value = top.get(token, exact.get((i, token)))
            row.append(floor if value is None else value)
        stats.floored += any(top.get(t, exact.get((i, t))) is None for t in tokens[i])
        out.append(row)
    return out


def remote_option_scores(endpoint: Endpoint, records: Sequence[MultipleChoiceRecord], *,
                         mode: modes.Mode | str, progress: bool = True,
                         chat: bool = False) -> tuple[OptionScores, RemoteStats]:
    """Option scores like :func:`calm_training.scoring.local.score_multiple_choice`: cloze prompts
    as text to ``/v1/completions``; letter prompts there too, or with ``chat`` as the user's
    message to ``/v1/chat/completions`` (letters without a leading space, as the local path
    reads them after a chat prompt)."""
    mode = modes.mode(mode, choice=True)
    out = OptionScores.empty(records, mode)
    values, n_tokens, n_chars, n = out.values, out.n_tokens, out.n_chars, len(records)
    stats = RemoteStats(total=n)
    if mode.token_level:
        letters = [letter_tokens(len(r.choices), chat=chat) for r in records]
        scored = _next_token_logprobs(endpoint, [letter_prompt(r.question, r.choices)
                                                 for r in records], letters, stats,
                                      progress=progress, desc="letter scoring (remote)",
                                      chat=chat)
        for row, row_values in enumerate(scored):
            values[row, :len(row_values)] = row_values
    else:
        bodies, owners = [], []
        for row, record in enumerate(records):
            context = cloze_context(record.question)
            for k, option in enumerate(record.choices):
                bodies.append({"prompt": context + cloze_continuation(option), "max_tokens": 0,
                               "temperature": 0, "logprobs": 0, "echo": True})
                owners.append((row, k, len(context)))
                n_chars[row, k] = option_char_count(option)
        try:
            answers = _echo_run(endpoint, "cloze", bodies, progress=progress,
                                desc="cloze scoring (remote)")
        except NoPromptLogprobs as exc:
            raise no_prompt_logprobs(endpoint, exc) from None
        except RemoteError as exc:
            if exc.status is not None and 400 <= exc.status < 500 and exc.status not in (
                    401, 403, 404, 429):
                raise RemoteError(str(exc) + NO_ECHO, status=exc.status) from None
            raise
        for (row, k, start), echoed in zip(owners, answers, strict=True):
            picked = echoed_continuation(echoed, start)
            if not picked:
                raise RemoteError(f"question {row} option {k}: the endpoint echoed no token "
                                  "for the option text; it does not score prompts — use "
                                  "--mode letter")
            values[row, k] = sum(picked)
            n_tokens[row, k] = len(picked)
    if stats.floored:
        logger.warning("%d of %d questions (%.1f%%) had an option letter that was neither "
                       "among the top %d alternatives nor scorable by echo; it got the "
                       "smallest returned log-probability (an upper bound)", stats.floored, n,
                       100 * stats.floored_share, TOP_LOGPROBS)
    return out, stats


def _completion_text(payload: dict, body: dict | None = None) -> str:
    text = first_choice(payload).get("text")
    if not isinstance(text, str):
        raise RemoteError("the completion has no text; is this an OpenAI-compatible "
                          "completions API?")
    return text


def remote_answers(endpoint: Endpoint, questions: Sequence[str], *, max_new_tokens: int = 24,
                   progress: bool = True) -> list[str]:
    """Greedy answers like :func:`~calm_training.scoring.answers.generate_answers`: the completion
    of ``"Question: ...\nAnswer:"`` (``max_new_tokens`` of it, no stop sequence: a stop at
    ``"\n"`` would end an answer that starts with a newline, which the local path strips),
    stripped and cut at the first newline."""
    bodies = [{"prompt": cloze_context(q), "max_tokens": max_new_tokens, "temperature": 0}
              for q in questions]
    texts = _run(endpoint, "answer", bodies, _completion_text, progress=progress,
                 desc="generating (remote)")
    return [t.strip().split("\n")[0].strip() for t in texts]


def remote_p_true(endpoint: Endpoint, questions: Sequence[str], answers: Sequence[str],
                  template: PTrueTemplate, *, progress: bool = True, chat: bool = False
                  ) -> tuple[np.ndarray, RemoteStats]:
    """Two-way logits ``[N, 2]`` (true, false) like
    :func:`~calm_training.scoring.answers.score_p_true` (with ``chat``: through
    ``/v1/chat/completions``, the tokens without a leading space)."""
    stats = RemoteStats(total=len(questions))
    pair = ((template.true_token.lstrip(), template.false_token.lstrip()) if chat
            else (template.true_token, template.false_token))
    out = np.asarray(_next_token_logprobs(
        endpoint, [template.render(q, a) for q, a in zip(questions, answers, strict=True)],
        [pair] * len(questions), stats, progress=progress, desc="P(True) (remote)",
        chat=chat), dtype=float).reshape(len(questions), 2)
    return out, stats
