"""Filesystem helpers shared by every artifact: atomic directory writes, safe paths, hashes."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import ArtifactError

__all__ = ["atomic_directory", "resolve_inside", "sha256_file", "sha256_bytes"]


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def resolve_inside(root: str | os.PathLike, reference: str) -> Path:
    """Resolve a file reference from a manifest, refusing anything that leaves ``root``.

    Absolute paths, ``..`` components and symlinks pointing outside the directory are
    refused with :class:`ArtifactError`.
    """
    if not isinstance(reference, str) or not reference:
        raise ArtifactError(f"file reference {reference!r} is not a non-empty string; "
                            "fix the manifest")
    candidate = Path(reference)
    if candidate.is_absolute() or reference.startswith(("/", "\\")):
        raise ArtifactError(f"file reference {reference!r} is an absolute path; artifacts may "
                            "only reference files inside their own directory")
    if ".." in candidate.parts:
        raise ArtifactError(f"file reference {reference!r} escapes the artifact directory "
                            "with '..'; artifacts may only reference files inside themselves")
    root_resolved = Path(root).resolve()
    resolved = (root_resolved / candidate).resolve()
    if resolved != root_resolved and root_resolved not in resolved.parents:
        raise ArtifactError(f"file reference {reference!r} resolves outside the artifact "
                            f"directory (to {resolved}) through a symlink; copy the file in")
    return resolved


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success rename it to ``target``.

    If the body raises, the temporary directory is removed and ``target`` is untouched.
    An existing ``target`` is refused unless ``overwrite``; then it is replaced only after
    the new directory is complete (the old one is moved aside first and deleted last).
    """
    target = Path(target)
    if target.exists() and not overwrite:
        raise ArtifactError(f"{target} already exists; choose another path or pass "
                            "overwrite=True (--overwrite) to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    # mkdtemp makes the folder private (0700); the artifact gets the usual permissions
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    backup = None
    if target.exists() or target.is_symlink():
        backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        backup.rmdir()
        os.replace(target, backup)
    try:
        os.replace(staging, target)
    except BaseException:
        if backup is not None:
            os.replace(backup, target)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if backup is not None:
        if backup.is_dir() and not backup.is_symlink():
            shutil.rmtree(backup, ignore_errors=True)
        else:
            backup.unlink(missing_ok=True)
