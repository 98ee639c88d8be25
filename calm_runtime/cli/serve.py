"""``calm serve``'s command line, in one home: the parser, whose defaults come from
:class:`~calm_runtime.server.config.ServeConfig`, the settings it makes of the arguments, and
the handler that starts the server (uvicorn, or Ray Serve with ``--ray``). It imports neither
the serve extra nor torch until the command runs, so ``calm --help`` works without them."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from dataclasses import fields

from calm_runtime.cli.common import missing_extra_message
from calm_runtime.errors import BackendUnavailableError, ConfigError

__all__ = ["DefaultsHelpFormatter", "add_serve"]


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written, and every option's default shown in ``--help`` (those that
    are not None/False and not already named in the help text)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default in (None, False, argparse.SUPPRESS) or "default" in text
                or action.option_strings == []):
            return text
        return f"{text} (default: {default})"


def _serve_default(name: str):
    """A ``calm serve`` option's default: ServeConfig's field (one place for both)."""
    import dataclasses

    from calm_runtime.server.config import ServeConfig

    return next(f.default for f in dataclasses.fields(ServeConfig) if f.name == name)


def add_serve(sub) -> None:
    """Register ``calm serve`` (its handler imports the serve extra only when it runs)."""
    p = sub.add_parser(
        "serve", help="serve an engine over OpenAI's HTTP API with calibrated confidences",
        description="An OpenAI-compatible server (POST /v1/completions, /v1/chat/completions; "
        "GET /v1/models, /health, /metrics) whose logprobs are calibrated and whose choices "
        "carry a 'calm' object with token confidences, the sequence confidence and, on "
        "request, P(True). Concurrent requests decode in one continuously batched loop "
        "(rows join and leave between decode steps). Needs the serve extra.",
        epilog="examples:\n  calm serve engine/ --port 8000\n"
        "  CALM_API_KEY=secret calm serve engine/ --api-key-env CALM_API_KEY --workers 2\n"
        "  calm serve engine/ --ray --replicas 2\n\n"
        "then, with the openai client:\n"
        "  client = openai.OpenAI(base_url=\"http://127.0.0.1:8000/v1\", api_key=\"unused\")\n"
        "  client.completions.create(model=\"engine\", prompt=\"Question: ...\", max_tokens=16)",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("engine", help="engine directory written by calm-export")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (loopback only; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument("--workers", type=int, default=1,
                   help="server processes, each with its own engine and batcher")
    p.add_argument("--api-key-env", metavar="VAR", default=None,
                   help="require 'Authorization: Bearer KEY' with KEY read from this variable")
    p.add_argument("--api-key", metavar="KEY", default=None,
                   help="vLLM's flag: the key itself (visible in the process list; prefer "
                        "--api-key-env)")
    p.add_argument("--model-name", "--served-model-name", dest="model_name", default=None,
                   help="model id clients send (vLLM: --served-model-name; default: the "
                        "engine folder name)")
    p.add_argument("--backend", default="onnxruntime",
                   choices=["onnxruntime", "torch", "tensorrt"], help="engine backend")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per worker (default: all cores)")
    p.add_argument("--max-batch-size", type=int, default=_serve_default("max_batch_size"),
                   help="most rows in the running batch; rows join and leave between decode "
                   "steps (1: one request at a time)")
    p.add_argument("--max-step-prefill-tokens", type=int,
                   default=_serve_default("max_step_prefill_tokens"),
                   help="most prompt tokens admitted into the running batch at one step "
                   "boundary while more rows run than wait (what a new request's prefill may "
                   "stall the running rows for); a burst is admitted at once")
    p.add_argument("--batch-window-ms", type=float, default=_serve_default("batch_window_ms"),
                   help="on an idle server, how long the first request waits for others to "
                   "arrive with it")
    p.add_argument("--max-queue", type=int, default=_serve_default("max_queue"),
                   help="rows waiting before HTTP 429")
    p.add_argument("--request-timeout", type=float, default=_serve_default("request_timeout_s"),
                   metavar="SECONDS", help="per request, then HTTP 504")
    p.add_argument("--max-tokens-limit", type=int, default=_serve_default("max_tokens_limit"),
                   help="the largest max_tokens a request may ask for")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt (default: the model's context - 1)")
    p.add_argument("--max-body-bytes", type=int, default=_serve_default("max_body_bytes"),
                   help="largest request body, then HTTP 413")
    p.add_argument("--max-prefill-tokens", "--max-num-batched-tokens", dest="max_prefill_tokens",
                   type=int, default=_serve_default("max_prefill_tokens"),
                   help="most tokens (rows x padded length) one prefill pass takes, with at "
                        "most 64 KiB of attention scores and logits per token (vLLM: "
                        "--max-num-batched-tokens): bigger batches are split, longer prompts "
                        "prefilled in pieces; a prompt that cannot fit gets HTTP 400")
    p.add_argument("--header-timeout", type=float, default=_serve_default("header_timeout_s"),
                   metavar="SECONDS", help="a request's headers must arrive within this "
                   "(from the connection's start or its previous answer), else the connection "
                   "is closed (HTTP 408 when part of a request came)")
    p.add_argument("--body-timeout", type=float, default=_serve_default("body_timeout_s"),
                   metavar="SECONDS", help="a request's body must arrive within this after its "
                   "headers, else HTTP 408")
    p.add_argument("--max-connections", type=int, default=_serve_default("max_connections"),
                   help="open connections; past it the oldest one not running a request is "
                        "closed (lowered to fit ulimit -n)")
    p.add_argument("--max-connections-per-client", type=int,
                   default=_serve_default("max_connections_per_client"),
                   help="the same, per client address")
    p.add_argument("--allow-special-tokens", action="store_true",
                   help="encode special-token text inside chat messages as special tokens "
                        "(as transformers does); by default it is plain text, so a message "
                        "cannot forge a turn")
    p.add_argument("--ray", action="store_true", help="serve on a local Ray Serve instance")
    p.add_argument("--replicas", type=int, default=2, help="Ray Serve replicas (with --ray)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per Ray replica")
    p.set_defaults(handler=_serve)


logger = logging.getLogger(__name__)

#: where ``--api-key KEY`` (vLLM's flag) is put for this process and its workers
API_KEY_ENV = "CALM_SERVE_API_KEY"


def config_from_args(args):
    """The :class:`~calm_runtime.server.config.ServeConfig` the arguments ask for."""
    from calm_runtime.server.config import ServeConfig

    api_key = getattr(args, "api_key", None)
    if api_key is not None:
        if args.api_key_env is not None:
            raise ConfigError("pass --api-key or --api-key-env, not both")
        logger.warning("--api-key puts the key in the process list; --api-key-env VAR keeps "
                       "it in the environment")
        os.environ[API_KEY_ENV] = api_key
        args.api_key_env = API_KEY_ENV
    default_tokens = next(f.default for f in fields(ServeConfig) if f.name == "default_max_tokens")
    return ServeConfig(
        engine=str(args.engine), model_name=args.model_name, backend=args.backend,
        threads=args.threads, max_batch_size=args.max_batch_size,
        batch_window_ms=args.batch_window_ms, max_queue=args.max_queue,
        max_step_prefill_tokens=args.max_step_prefill_tokens,
        request_timeout_s=args.request_timeout, max_tokens_limit=args.max_tokens_limit,
        default_max_tokens=min(default_tokens, args.max_tokens_limit),
        max_prompt_tokens=args.max_prompt_tokens, max_body_bytes=args.max_body_bytes,
        max_prefill_tokens=args.max_prefill_tokens,
        api_key_env=args.api_key_env,
        allow_special_tokens=bool(getattr(args, "allow_special_tokens", False)),
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client)


def _serve(args) -> int:
    try:
        import uvicorn

        from calm_runtime.server.app import CONFIG_ENV, create_app
    except ImportError as exc:
        logger.debug("serve extra missing: %s", exc)
        raise BackendUnavailableError(missing_extra_message("serve")) from None
    config = config_from_args(args)
    config.api_key()  # an unset key variable fails here, before anything starts
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be 1..65535, got {args.port}")
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    if not _loopback(args.host) and config.api_key_env is None:
        logger.warning("binding %s without --api-key-env: anyone who can reach this address "
                       "can use the server", args.host)
    if args.ray:
        from calm_runtime.server.ray_serve import run_ray

        run_ray(config, host=args.host, port=args.port, replicas=args.replicas,
                replica_cpus=args.replica_cpus)
        return 0
    log_level = logging.getLogger().getEffectiveLevel()
    options = dict(host=args.host, port=args.port, log_level=log_level,
                   timeout_graceful_shutdown=int(config.request_timeout_s) + 5)
    if args.workers == 1:
        from calm_runtime.server.connections import protocol_for

        uvicorn.run(create_app(config), http=protocol_for(config), **options)
    else:  # each worker process builds its own app (and engine) from the environment
        os.environ[CONFIG_ENV] = config.to_json()
        uvicorn.run("calm_runtime.server.app:app_from_environment", factory=True,
                    workers=args.workers,
                    http="calm_runtime.server.connections:CalmH11Protocol", **options)
    return 0


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
