"""What an adapter folder is made of on disk: every file and folder readable by others under
the usual umask (a server running as another user reads it), and a tokenizer.json that is not
one gets its own one-line error rather than a "sha256 differs" that misleads."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from calm_runtime.errors import ArtifactError
from calm_runtime.formats.artifact import CalibrationAdapter, ModelIdentity
from calm_runtime.formats.tokenizer_file import MAX_TOKENIZER_BYTES, tokenizer_sha256


def test_adapter_files_and_folders_get_the_umask_modes(tmp_path):
    lora = tmp_path / "private-lora"
    lora.mkdir(mode=0o700)
    (lora / "adapter_config.json").write_text("{}")
    (lora / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    os.chmod(lora / "adapter_model.safetensors", 0o600)
    adapter = CalibrationAdapter(base_model=ModelIdentity("m", 4, None),
                                 tau=np.ones(4, np.float32), shift=np.zeros(4, np.float32),
                                 temperature=1.5, lora_path=lora)
    old = os.umask(0o022)
    try:
        out = adapter.save_pretrained(tmp_path / "adapter")
    finally:
        os.umask(old)
    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in [out, *out.rglob("*")]}
    assert modes["."] == 0o755 and modes["lora"] == 0o755
    for name in ("calibration.safetensors", "calm_adapter.json", "lora/adapter_config.json",
                 "lora/adapter_model.safetensors"):
        assert modes[name] == 0o644, (name, oct(modes[name]))


@pytest.mark.parametrize("content, match", [
    (b"{ this is not json", "not a readable tokenizer"),
    (b'{"version": "1.0"}', "not a tokenizer"),
    (b"\xff\xfe", "not a readable tokenizer"),
])
def test_a_malformed_tokenizer_is_named_as_such(tmp_path, content, match):
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(ArtifactError, match=match):
        tokenizer_sha256(tmp_path)


def test_an_oversized_tokenizer_is_refused_before_it_is_read(tmp_path):
    with open(tmp_path / "tokenizer.json", "wb") as handle:
        handle.truncate(MAX_TOKENIZER_BYTES + 1)  # sparse: nothing is written
    with pytest.raises(ArtifactError, match="MB bound"):
        tokenizer_sha256(tmp_path)
