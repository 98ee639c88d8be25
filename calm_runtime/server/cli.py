"""The handler of ``calm serve`` (the parser lives in :mod:`calm_runtime.cli.main`)."""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import fields

import uvicorn

from calm_runtime.errors import ConfigError
from calm_runtime.server.app import CONFIG_ENV, create_app
from calm_runtime.server.config import ServeConfig

__all__ = ["serve", "config_from_args"]

logger = logging.getLogger(__name__)


#: where ``--api-key KEY`` (vLLM's flag) is put for this process and its workers
API_KEY_ENV = "CALM_SERVE_API_KEY"


def config_from_args(args) -> ServeConfig:
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
        request_timeout_s=args.request_timeout, max_tokens_limit=args.max_tokens_limit,
        default_max_tokens=min(default_tokens, args.max_tokens_limit),
        max_prompt_tokens=args.max_prompt_tokens, max_body_bytes=args.max_body_bytes,
        max_prefill_tokens=args.max_prefill_tokens,
        api_key_env=args.api_key_env,
        allow_special_tokens=bool(getattr(args, "allow_special_tokens", False)))


def serve(args) -> int:
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
        uvicorn.run(create_app(config), **options)
    else:  # each worker process builds its own app (and engine) from the environment
        os.environ[CONFIG_ENV] = config.to_json()
        uvicorn.run("calm_runtime.server.app:app_from_environment", factory=True,
                    workers=args.workers, **options)
    return 0


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
