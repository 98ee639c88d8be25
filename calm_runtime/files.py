"""Filesystem helpers shared by every artifact: atomic directory writes, safe paths, hashes.

Everything that reads a path named by an artifact goes through here, so every way a path
can fail (a NUL character, a name too long for the filesystem, a symlink loop, a dangling
link, a link out of the folder, a FIFO that would block a read) is one
:class:`ArtifactError` with a one-line message, never an ``OSError`` or ``RuntimeError``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from calm_runtime.errors import ArtifactError

logger = logging.getLogger(__name__)

__all__ = ["atomic_directory", "share_like_umask", "install_lock", "resolve_inside",
           "sha256_file", "sha256_bytes",
           "show",
           "show_name",
           "is_dir", "is_file", "read_regular_file", "check_tree", "inside_copier",
           "MAX_NAME_BYTES"]

#: The longest file name (one path component) an artifact may reference, in UTF-8 bytes.
MAX_NAME_BYTES = 255
#: How much of an untrusted value an error message quotes.
_SHOW_CHARS = 120


def show(value: object, limit: int = _SHOW_CHARS) -> str:
    """``repr(value)`` for an error message: one line, at most ``limit`` characters.

    Values from an artifact can be huge, deeply nested or hold newlines; the repr escapes
    newlines, and a repr that cannot be built (too deep) is replaced by the type's name.
    """
    try:
        text = repr(value)
    except (RecursionError, MemoryError, ValueError):
        text = f"<{type(value).__name__} too deeply nested to show>"
    if len(text) > limit:
        text = text[:limit - 1] + "…"
    return text


def show_name(name: str) -> str:
    """A file name for an error message: as it is when it is short and printable, else
    :func:`show` (quoted, escaped, cut)."""
    if isinstance(name, str) and name.isprintable() and len(name) <= _SHOW_CHARS:
        return name
    return show(name)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def is_dir(path: str | os.PathLike) -> bool:
    """``Path.is_dir`` that answers ``False`` instead of raising (too long, NUL, loop)."""
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):
        return False


def is_file(path: str | os.PathLike) -> bool:
    """``Path.is_file`` that answers ``False`` instead of raising (too long, NUL, loop)."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def _check_reference_text(reference: str) -> None:
    if "\x00" in reference:
        raise ArtifactError(f"file reference {show(reference)} contains a NUL character; "
                            "fix the manifest")
    for part in reference.replace("\\", "/").split("/"):
        try:
            size = len(part.encode("utf-8"))
        except UnicodeEncodeError:
            raise ArtifactError(f"file reference {show(reference)} is not valid text (an "
                                "unpaired surrogate); fix the manifest") from None
        if size > MAX_NAME_BYTES:
            raise ArtifactError(f"file reference {show(reference)} has a name of {size} bytes, "
                                f"longer than the {MAX_NAME_BYTES} a file name may have; fix "
                                "the manifest")


def _resolve(path: Path, *, strict: bool) -> Path:
    """``path.resolve()`` with every failure as an :class:`ArtifactError`."""
    try:
        return path.resolve(strict=strict)
    except RuntimeError:  # Python < 3.13 reports a symlink loop this way
        raise ArtifactError(f"{show_name(str(path))} is a symlink loop; replace the links with "
                            "the files") from None
    except FileNotFoundError:
        raise ArtifactError(f"{show_name(str(path))} is a dangling symlink (its target does not "
                            "exist); replace it with the file") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise ArtifactError(f"{show_name(str(path))} cannot be resolved ({reason}); replace the "
                            "links with the files") from None


def _inside(root: Path, resolved: Path) -> bool:
    return resolved == root or root in resolved.parents


def resolve_inside(root: str | os.PathLike, reference: str) -> Path:
    """Resolve a file reference from a manifest, refusing anything that leaves ``root``.

    Absolute paths, ``..`` components, symlinks pointing outside the directory, symlink
    loops, NUL characters and over-long names are refused with :class:`ArtifactError`.
    """
    if not isinstance(reference, str) or not reference:
        raise ArtifactError(f"file reference {show(reference)} is not a non-empty string; "
                            "fix the manifest")
    _check_reference_text(reference)
    candidate = Path(reference)
    if candidate.is_absolute() or reference.startswith(("/", "\\")):
        raise ArtifactError(f"file reference {show(reference)} is an absolute path; artifacts "
                            "may only reference files inside their own directory")
    if ".." in candidate.parts:
        raise ArtifactError(f"file reference {show(reference)} escapes the artifact directory "
                            "with '..'; artifacts may only reference files inside themselves")
    root_resolved = _resolve(Path(root), strict=False)
    resolved = _resolve(root_resolved / candidate, strict=False)
    if not _inside(root_resolved, resolved):
        raise ArtifactError(f"file reference {show(reference)} resolves outside the artifact "
                            f"directory (to {show(str(resolved))}) through a symlink; copy "
                            "the file in")
    return resolved


def read_regular_file(path: str | os.PathLike, *, limit: int | None = None,
                      what: str = "file") -> bytes:
    """The bytes of a regular file, refusing FIFOs, devices, folders and files over ``limit``.

    The file is opened without blocking (a FIFO would otherwise wait for a writer forever)
    and checked with ``fstat`` on the open descriptor.
    """
    name = show_name(str(path))
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ArtifactError(f"{name} is missing; the artifact is incomplete, copy it again or "
                            "re-create it") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise ArtifactError(f"{name} cannot be opened ({reason}); check the {what}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ArtifactError(f"{name} is not a regular file (a folder, FIFO or device); "
                                f"replace it with the {what}")
        if limit is not None and info.st_size > limit:
            raise ArtifactError(f"{name} has {info.st_size} bytes, more than the {limit} a "
                                f"{what} may have; it is not a calm file, re-create it")
        chunks, total = [], 0
        while True:
            block = os.read(fd, 1 << 20)
            if not block:
                break
            chunks.append(block)
            total += len(block)
            if limit is not None and total > limit:
                raise ArtifactError(f"{name} grew past {limit} bytes while it was read; "
                                    f"re-create the {what}")
        return b"".join(chunks)
    except OSError as exc:
        raise ArtifactError(f"{name} cannot be read ({exc.strerror or type(exc).__name__}); "
                            f"check the {what}") from None
    finally:
        os.close(fd)


def check_tree(folder: str | os.PathLike, *, what: str) -> None:
    """Refuse a folder whose contents could carry anything from outside it.

    Every entry below ``folder`` must be a regular file, a folder, or a symlink to a
    regular file that resolves inside ``folder``. Links out of the folder, dangling links,
    link loops, links to folders and special files (FIFOs, devices, sockets) are refused
    with an :class:`ArtifactError` naming the entry. The walk is iterative (no depth limit).
    """
    root = _resolve(Path(folder), strict=False)
    pending = [root]
    while pending:
        current = pending.pop()
        try:
            with os.scandir(current) as entries:
                paths = [entry.path for entry in entries]
        except OSError as exc:
            raise ArtifactError(f"{what} {show_name(str(current))} cannot be listed "
                                f"({exc.strerror or type(exc).__name__}); check the "
                                "folder") from None
        for path in paths:
            rel = show(os.path.relpath(path, root))
            try:
                mode = os.lstat(path).st_mode
            except OSError as exc:
                raise ArtifactError(f"{what} entry {rel} cannot be read "
                                    f"({exc.strerror or type(exc).__name__})") from None
            if stat.S_ISDIR(mode):
                pending.append(Path(path))
            elif stat.S_ISLNK(mode):
                target = _resolve(Path(path), strict=True)
                if not _inside(root, target):
                    raise ArtifactError(f"{what} holds {rel}, a symlink to "
                                        f"{show(str(target))} outside the folder; replace it "
                                        "with a copy of the file, or remove it")
                try:
                    target_mode = os.stat(target).st_mode
                except OSError as exc:
                    raise ArtifactError(f"{what} entry {rel} cannot be read "
                                        f"({exc.strerror or type(exc).__name__})") from None
                if not stat.S_ISREG(target_mode):
                    raise ArtifactError(f"{what} holds {rel}, a symlink to a folder or special "
                                        "file; only links to regular files are allowed, "
                                        "replace it with a copy")
            elif not stat.S_ISREG(mode):
                raise ArtifactError(f"{what} holds {rel}, which is not a regular file (a FIFO, "
                                    "socket or device); remove it")


def inside_copier(folder: str | os.PathLike, *, what: str) -> Callable[[str, str], str]:
    """A ``copy_function`` for :func:`shutil.copytree` that copies only regular files that
    resolve inside ``folder`` (a symlink is copied as the file it points to).

    Each file is checked again as it is copied, so a link swapped in after
    :func:`check_tree` still cannot bring in a file from outside.
    """
    root = _resolve(Path(folder), strict=False)

    def copy(source: str, destination: str) -> str:
        target = _resolve(Path(source), strict=True)
        if not _inside(root, target):
            raise ArtifactError(f"{what} holds {show(os.path.relpath(source, root))}, a symlink "
                                f"to {show(str(target))} outside the folder; replace it with "
                                "a copy of the file, or remove it")
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(target, flags)
        except OSError as exc:
            raise ArtifactError(f"{what} entry {show(os.path.relpath(source, root))} cannot be "
                                f"read ({exc.strerror or type(exc).__name__})") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ArtifactError(f"{what} holds {show(os.path.relpath(source, root))}, which "
                                    "is not a regular file; remove it")
            out = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                          | getattr(os, "O_NOFOLLOW", 0), 0o644)
            with os.fdopen(out, "wb") as sink, os.fdopen(os.dup(fd), "rb") as src:
                shutil.copyfileobj(src, sink, 1 << 20)
            shutil.copymode(target, destination)
        finally:
            os.close(fd)
        return destination

    return copy


def _umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux);
    elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_like_umask(root: Path) -> None:
    """Give every folder and file under ``root`` the permissions the umask gives a new one
    (0755 / 0644 under the usual 022): writers that make private temporary files (safetensors'
    0600 files, folders copied from ``mkdtemp``'s 0700) would otherwise leave an artifact that
    a server running as another user cannot read. Links are left alone."""
    mask = _umask()
    for folder, _dirs, files in os.walk(root):
        os.chmod(folder, 0o777 & ~mask)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success rename it to ``target``.

    If the body raises, the temporary directory is removed and ``target`` is untouched.
    An existing ``target`` is refused unless ``overwrite``; then it is replaced only after
    the new directory is complete (the old one is moved aside first and deleted last).
    """
    target = Path(target)
    if (target.exists() or target.is_symlink()) and not overwrite:
        raise ArtifactError(f"{target} already exists; choose another path or pass "
                            "overwrite=True (--overwrite) to replace it")
    if overwrite and target.is_dir() and not target.is_symlink():
        check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # named before it is made, and made inside the ``try``: a signal raised as an exception
    # (SIGINT, or SIGTERM under calm's CLIs) right after the folder appears still removes it.
    # The umask gives it the usual permissions of an artifact (mkdtemp's would be 0700).
    staging: Path | None = target.parent / f".{target.name}.tmp-{secrets.token_hex(8)}"
    try:
        try:
            staging.mkdir()
        except FileExistsError:  # another run's folder (64 random bits: not in practice)
            staging = None
            raise ArtifactError(f"a staging folder next to {target} has this run's random "
                                "name; run again") from None
        yield staging
        share_like_umask(staging)
    except BaseException:
        if staging is not None:
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


@contextlib.contextmanager
def install_lock(lock_file: str | os.PathLike, what: str) -> Iterator[None]:
    """Hold an exclusive, inter-process lock on ``lock_file`` (created if missing).

    Two processes installing the same model or data set at once would otherwise share one
    download and conversion folder; the second one waits here, then finds the first one's
    result. The lock is released when the process exits, however it exits. Where ``fcntl``
    is missing (Windows) this does not lock.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    path = Path(lock_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is installing %s; waiting for it", what)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def check_creatable(out: Path, what: str = "--out") -> None:
    """Refuse at once (not after the work) an output folder that cannot be created: a name
    the file system cannot take, or a nearest existing ancestor that is not a writable
    folder (tried: an empty folder made and removed, since root passes ``os.access``)."""
    import tempfile

    out = Path(out)
    try:
        str(out).encode("utf-8")  # a non-UTF-8 name (surrogate escapes) breaks the writers
    except UnicodeError:
        raise ArtifactError(f"{what} {show_name(str(out))} is not a valid file name here; "
                            "choose another") from None
    ancestor = out.absolute().parent
    while not ancestor.exists() and not ancestor.is_symlink():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ArtifactError(f"cannot create {show_name(str(out))}: {ancestor} is not a folder; "
                            f"choose another {what}")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ArtifactError(f"cannot create {show_name(str(out))}: {ancestor} is not writable; "
                            f"choose another {what} or fix its permissions")
    try:
        probe = tempfile.mkdtemp(prefix=".calm-write-check-", dir=ancestor)
    except OSError as exc:
        raise ArtifactError(f"cannot create {show_name(str(out))}: {ancestor} refuses new "
                            f"files ({exc.strerror or exc}); choose another {what}") from None
    os.rmdir(probe)


#: the manifests of calm's artifacts; a folder --overwrite may replace holds one of them
_MANIFESTS = ("calm_engine.json", "calm_checkpoint.json", "calm_adapter.json")


def check_replaceable(target: Path) -> None:
    """Refuse to replace (``--overwrite``) a folder that is not entirely a calm artifact: one
    without a calm manifest, or one holding entries its manifest does not account for, so
    that --overwrite never wipes files calm did not write."""
    import json

    entries = {p.name for p in target.iterdir()}
    if not entries:
        return
    manifest = next((m for m in _MANIFESTS if m in entries), None)
    if manifest is None:
        raise ArtifactError(f"{target} is not a calm artifact (no {' / '.join(_MANIFESTS)}); "
                            "--overwrite replaces only what calm wrote: choose another path or "
                            "empty it yourself")
    try:
        data = json.loads((target / manifest).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = {}
    known = {manifest}
    if manifest == "calm_adapter.json":
        known |= {"calibration.safetensors", "lora"}
    elif manifest == "calm_checkpoint.json":
        known |= set((data.get("files") or {}) if isinstance(data, dict) else {})
    else:
        for section in ("model", "tokenizer"):
            files = (data.get(section) or {}).get("files") if isinstance(data, dict) else None
            known |= set(files or {})
        known |= {"genai_config.json"}
        known |= {name for name in entries if name.startswith("model.onnx")}
    stray = sorted(entries - known)
    if stray:
        raise ArtifactError(f"{target} holds {len(stray)} entr{'y' if len(stray) == 1 else 'ies'} "
                            f"calm did not write ({show(stray[:3])}); --overwrite replaces only "
                            "calm's own artifact: move them away or choose another path")
