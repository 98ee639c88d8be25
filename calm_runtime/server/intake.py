"""The request intake behind the routes: parsing, every check of a request against the
server's limits and the engine (those of each endpoint and those they share; a request's
checks of itself are its validators in protocol.py), encoding, and admission to the
batcher's queue. Nothing past the intake refuses a request for what it asks."""

from __future__ import annotations

from fastapi import Request

from calm_runtime.errors import CalmError
from calm_runtime.server.batcher import Job, QueueFull, ShuttingDown
from calm_runtime.server.guard import too_large
from calm_runtime.server.json_body import clip, json_object, validated
from calm_runtime.server.protocol import APIError
from calm_runtime.server.state import ECHO_MAX_ENTRIES, PROMPT_CHARS_PER_TOKEN, ServerState

__all__ = ["Intake"]


class Intake:
    """What a request passes before it is answered; the state is the server's."""

    def __init__(self, server: ServerState) -> None:
        self.config = server.config
        self.lm = server.lm
        self.batcher = server.batcher
        self.max_prompt = server.max_prompt
        self.max_prompt_chars = server.max_prompt_chars

    async def parse(self, request: Request, model):
        body = await request.body()
        if len(body) > self.config.max_body_bytes:  # Guard refuses these before
            raise too_large(self.config)
        req = validated(json_object(body), model)  # and its own checks (protocol.py)
        if req.model != self.config.served_name:
            raise APIError(404, f"model {clip(req.model, 80)!r} is not served here; this server "
                           f"serves {self.config.served_name!r} (the engine folder's name, or "
                           "calm serve --model-name); send that as model", param="model",
                           code="model_not_found")
        return req

    # ------------------------------------------------------------- per endpoint
    def completion_prompts(self, req) -> tuple[list[str], bool]:
        """``/v1/completions``: the prompts (``single``: one string was sent), each checked
        against the character limit, and the fields the request combines checked."""
        single = isinstance(req.prompt, str)
        prompts = [req.prompt] if single else list(req.prompt)
        if not prompts or len(prompts) > self.config.max_queue:
            raise APIError(400, f"prompt must be a string or a list of 1 to "
                           f"{self.config.max_queue} strings", param="prompt")
        for index, prompt in enumerate(prompts):
            self.check_chars(len(prompt), "the prompt" if single else f"prompt[{index}]",
                             "prompt")
        self.check_raw(req)
        if req.choices() is not None and req.max_tokens is not None:
            self.max_tokens(req.max_tokens, self.config.default_max_tokens)
        return prompts, single

    def check_echo(self, req, encoded: list[list[int]]) -> None:
        """An echo's answer is bounded before any work: tokens x (1 + alternatives)."""
        entries = sum(len(ids) for ids in encoded) * (1 + (req.logprobs or 0)) * (
            2 if req.wants_raw else 1)
        if entries > ECHO_MAX_ENTRIES:
            raise APIError(400, f"this echo would return {entries:,} log-probabilities "
                           f"(tokens x (1 + logprobs)); the limit is {ECHO_MAX_ENTRIES:,}: "
                           "send fewer or shorter prompts or fewer alternatives",
                           param="logprobs" if req.logprobs else "prompt")

    def chat_messages(self, req) -> tuple[list[dict], list[str], int]:
        """``/v1/chat/completions``: the messages as the chat template takes them, the
        users' texts and the token limit, with the fields the request combines checked."""
        limit = self.max_tokens(req.limit(), self.config.max_tokens_limit)
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.text()} for m in req.messages]
        users = [m["content"] for m in messages if m["role"] == "user"]
        self.check_chars(sum(len(m["content"]) for m in messages), "the messages' text",
                         "messages")
        self.check_raw(req)
        return messages, users, limit

    # ------------------------------------------------------------- shared checks
    def max_tokens(self, asked: int | None, default: int) -> int:
        value = default if asked is None else asked
        if value > self.config.max_tokens_limit:
            raise APIError(400, f"max_tokens {value} exceeds this server's limit of "
                           f"{self.config.max_tokens_limit}; ask for fewer tokens",
                           param="max_tokens")
        return value

    def check_raw(self, req) -> None:
        """Refuse ``calm.raw_logprobs`` on an engine whose raw log-probabilities cannot be
        recovered (per-token calibration); what the request itself must send with it is
        checked by the request (protocol.py)."""
        if not req.wants_raw:
            return
        try:
            _ = self.lm.raw_logit_scale
        except CalmError as exc:
            raise APIError(400, str(exc), param="calm") from None

    def check_chars(self, count: int, what: str, param: str) -> None:
        """Refuse a prompt too long to be worth tokenising (see PROMPT_CHARS_PER_TOKEN)."""
        if count > self.max_prompt_chars:
            raise APIError(400, f"{what} is {count} characters; this server takes prompts of "
                           f"at most {self.max_prompt} tokens, so at most "
                           f"{self.max_prompt_chars} characters ({PROMPT_CHARS_PER_TOKEN} per "
                           "token); shorten it", param=param, code="context_length_exceeded")

    def encode(self, prompts: list[str]) -> list[list[int]]:
        """Token ids of each prompt (blocking: call it on a worker thread)."""
        encoded = []
        for index, prompt in enumerate(prompts):
            label = "the prompt" if len(prompts) == 1 else f"prompt[{index}]"
            try:
                ids = self.lm.encode_prompt(prompt, chat=False, label=label)
            except CalmError as exc:
                raise APIError(400, str(exc), param="prompt") from None
            encoded.append(self._check_prompt(ids, label))
        return encoded

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of the rendered conversation (blocking: call it on a worker thread)."""
        try:
            ids = self.lm.tokenizer.encode_chat(
                messages, allow_special_tokens=self.config.allow_special_tokens)
        except CalmError as exc:
            raise APIError(400, str(exc), param="messages") from None
        return self._check_prompt(ids, "the conversation", "messages")

    def _check_prompt(self, ids: list[int], label: str = "the prompt",
                      param: str = "prompt") -> list[int]:
        if len(ids) > self.max_prompt:
            raise APIError(400, f"the prompt is {len(ids)} tokens; this server takes at most "
                           f"{self.max_prompt}; shorten it", code="context_length_exceeded")
        try:  # a prompt no prefill pass can hold is refused before it is queued
            self.lm.check_prefill(len(ids), label, "--max-prefill-tokens")
        except CalmError as exc:
            raise APIError(400, str(exc), param=param,
                           code="context_length_exceeded") from None
        return ids

    def submit(self, jobs: list[Job]) -> None:
        try:
            for job in jobs:
                self.batcher.submit(job)
        except QueueFull:
            for job in jobs:
                self.batcher.cancel(job)
            raise APIError(429, f"the server's queue is full ({self.batcher.max_queue} rows "
                           "waiting); retry shortly", type="rate_limit_error",
                           code="queue_full") from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down; retry on another replica",
                           type="server_error", code="shutting_down") from None
