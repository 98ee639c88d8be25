"""Hub ids (``org/name``) resolve through huggingface_hub: with ``HF_HUB_OFFLINE=1`` from the
local hub cache, which the test builds itself (the network is never touched)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("huggingface_hub")
pytest.importorskip("transformers")

CHILD = r"""
import sys
from calm_runtime.data.models import resolve_model
from calm_runtime.errors import CalmError
try:
    print(resolve_model(sys.argv[1]))
except CalmError as exc:
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(1)
"""


def _hub_cache(root, repo: str, model_dir) -> str:
    """The layout huggingface_hub keeps: models--ORG--NAME/{refs/main, snapshots/REV/...}."""
    folder = root / ("models--" + repo.replace("/", "--"))
    revision = "0" * 40
    shutil.copytree(model_dir, folder / "snapshots" / revision)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(revision)
    return revision


def _resolve(spec: str, cache) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache),
           "HF_HOME": str(cache.parent / "hf-home")}
    return subprocess.run([sys.executable, "-c", CHILD, spec], capture_output=True, text=True,
                          env=env, timeout=120)


def test_a_hub_id_resolves_from_the_local_hub_cache(tmp_path, tiny_llama_tied):
    cache = tmp_path / "hub"
    cache.mkdir()
    revision = _hub_cache(cache, "calm-test/tiny-llama", tiny_llama_tied)
    done = _resolve("calm-test/tiny-llama", cache)
    assert done.returncode == 0, done.stderr
    folder = done.stdout.strip()
    assert folder.endswith(revision)
    assert json.loads((tmp_path / "hub" / "models--calm-test--tiny-llama" / "snapshots" /
                       revision / "config.json").read_text())["vocab_size"] == 300


def test_an_uncached_hub_id_offline_is_one_line(tmp_path):
    cache = tmp_path / "hub"
    cache.mkdir()
    done = _resolve("calm-test/not-there", cache)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ModelSourceError: calm-test/not-there is "
                                                   "not in the local Hugging Face cache")
