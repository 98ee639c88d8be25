"""Run the app with uvicorn on a background thread (tests, benchmarks, notebooks).

    with serve_in_background(create_app(config)) as (url, server):
        openai.OpenAI(base_url=url + "/v1", api_key="unused").models.list()

Port 0 (the default) picks a free port; ``url`` names the one bound. Leaving the block
asks the server to stop the way SIGTERM does (in-flight requests finish) and waits for it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn

__all__ = ["serve_in_background"]


@contextlib.contextmanager
def serve_in_background(app, host: str = "127.0.0.1", port: int = 0, *,
                        start_timeout_s: float = 60.0,
                        graceful_timeout_s: int = 30) -> Iterator[tuple[str, uvicorn.Server]]:
    from calm_runtime.server.connections import protocol_for

    calm = getattr(getattr(app, "state", None), "calm", None)  # a create_app app: its limits
    http = protocol_for(calm.config) if calm is not None else "auto"
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=graceful_timeout_s,
                                           http=http))
    thread = threading.Thread(target=server.run, name="calm-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server did not start on {host}:{port} within "
                               f"{start_timeout_s:g} s; see the log above")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}", server
    finally:
        server.should_exit = True
        thread.join(graceful_timeout_s + 5)
