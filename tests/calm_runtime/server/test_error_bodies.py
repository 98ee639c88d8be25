"""Every error body stays under 1 KB, whatever a request puts into its message or param
(property test over arbitrary text, escapes and non-ASCII included)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from calm_runtime.server.protocol import APIError  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(message=st.text(max_size=5000), param=st.none() | st.text(max_size=3000))
def test_an_error_body_is_at_most_one_kilobyte(message, param):
    error = APIError(400, f"unknown model {message!r}; use 'm'", param=param)
    body = json.dumps(error.body(), ensure_ascii=False).encode()
    assert len(body) <= 1024
    if len(json.dumps(message, ensure_ascii=False)) < 300:  # short messages are kept whole
        assert message in error.message or repr(message) in error.message
