"""A model's tokenizer as its identity: ``tokenizer.json``'s sha256, once the file is known to
be a tokenizer (JSON with a ``model`` section, within a size bound), so that a damaged file
is named as such instead of "its sha256 differs"."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from calm_runtime.errors import ArtifactError, IncompatibleModelError
from calm_runtime.files import sha256_file, show_name

__all__ = ["MAX_TOKENIZER_BYTES", "tokenizer_sha256"]


#: the largest ``tokenizer.json`` read (the largest real ones, 256k-token vocabularies,
#: are ~35 MB)
MAX_TOKENIZER_BYTES = 128 * 2 ** 20


@functools.lru_cache(maxsize=32)
def _checked_tokenizer(path: str, size: int, mtime_ns: int) -> str:
    """The sha256 of the ``tokenizer.json`` at ``path`` once it is known to be a JSON object
    (cached by size and modification time)."""
    where = show_name(path)
    try:
        data = json.loads(Path(path).read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
        raise ArtifactError(f"{where} is not a readable tokenizer ({reason}); re-save the "
                            "tokenizer with save_pretrained or re-export the engine") from None
    if not isinstance(data, dict) or "model" not in data:
        raise ArtifactError(f"{where} is JSON but not a tokenizer (no 'model' section); re-save "
                            "the tokenizer with save_pretrained or re-export the engine")
    return sha256_file(Path(path))


def tokenizer_sha256(model_dir: str | os.PathLike) -> str:
    """The tokenizer's identity: sha256 of ``tokenizer.json`` in a model or engine folder,
    which must be a tokenizer (JSON, at most :data:`MAX_TOKENIZER_BYTES`)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise IncompatibleModelError(f"{model_dir} has no tokenizer.json; use a model folder "
                                     "saved with its tokenizer (save_pretrained)")
    info = path.stat()
    if info.st_size > MAX_TOKENIZER_BYTES:
        raise ArtifactError(f"{show_name(str(path))} has {info.st_size / 2 ** 20:.0f} MB, more "
                            f"than a tokenizer's {MAX_TOKENIZER_BYTES // 2 ** 20} MB bound; "
                            "use the model's own tokenizer.json")
    return _checked_tokenizer(str(path), info.st_size, info.st_mtime_ns)
