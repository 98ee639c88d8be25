"""The Ray Serve deployment: 2 replicas on a local Ray instance answer like direct calls."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'calm-llm[ray]')")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from calm_runtime.inference.lm import CalibratedLM  # noqa: E402
from calm_runtime.server import ServeConfig  # noqa: E402
from calm_runtime.server.ray_serve import calm_deployment  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_server(runtime_engine):
    engine = str(runtime_engine[2])
    # Ray is installed (the import above): a failure to start it is a failure, not a skip.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServeConfig(engine=engine, model_name="tiny", threads=1)
        serve.run(calm_deployment(config, replicas=2, replica_cpus=0.5), name="calm",
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}", engine
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_answer_like_direct_calls(ray_server):
    url, engine = ray_server
    status = serve.status().applications["calm"]
    replicas = status.deployments["calm"].replica_states
    assert replicas.get("RUNNING") == 2, replicas
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    direct = CalibratedLM.load(engine, threads=1)
    prompts = ["The cat sat on", "One two three four", "Question: what is red?\nAnswer:"]
    started = time.monotonic()
    for prompt in prompts * 2:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=10,
                                        temperature=0)
        ref = direct.generate(prompt, max_new_tokens=10)
        assert out.choices[0].text == ref.text
        np.testing.assert_allclose(out.choices[0].model_extra["calm"]["token_confidences"],
                                   [t.confidence for t in ref.tokens], atol=1e-4)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Name a color."}], max_tokens=8,
        temperature=0, stream=True))
    ref = direct.generate("Name a color.", max_new_tokens=8, chat=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert time.monotonic() - started < 120
