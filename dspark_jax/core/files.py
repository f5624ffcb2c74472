"""The one home for the project's file I/O: local paths and object-store URLs alike.

Every run folder file, datagen shard, feature cache, decode --output and prompts file goes through
here, so `gs://bucket/...` works wherever a local path does (a multi-host run needs no shared disk).
URLs go through `etils.epath` (its fsspec backend: gs:// needs gcsfs, `pip install
'dspark_jax[gcs]'`; s3:// s3fs, az:// adlfs, hf:// huggingface_hub). Orbax checkpoints handle
gs:// themselves (tensorstore). Target weight files (checkpoints/: HF folders, GGUF) stay local:
`local_only` says so in one line.

Writes are atomic everywhere: locally a temporary file in the same folder, fsynced and renamed over
the target (then the folder synced); on an object store the object is uploaded whole (an upload
is atomic: readers see the old object or the new one; the content is built in host memory
first). An object cannot be appended to, so `open_append` on a URL keeps the text in memory and
rewrites the whole object at most every OBJECT_REWRITE_S seconds and at close (`AppendedObject`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tempfile
import time

from dspark_jax.core.errors import UserError

# The URL schemes etils.epath routes through fsspec, with its fsspec protocol names and what
# provides each; other schemes (http://, memory://, ...) are refused in one line.
URL_PROTOCOLS = {"gs": "gcs", "s3": "s3", "az": "az", "hf": "hf"}
_INSTALL = {"gcs": "pip install 'dspark_jax[gcs]'", "s3": "pip install s3fs", "az": "pip install adlfs",
            "hf": "pip install huggingface_hub"}
OBJECT_REWRITE_S = 30.0  # an appended object (decode --output, metrics.jsonl) is rewritten at most this often
_TEMP_SUFFIX = ".tmp"  # atomic_writer's temporary files: ".<name>.<random>.tmp" (datagen skips *.tmp)


def url_scheme(p) -> str | None:
    """The URL scheme of `p` ("gs" for gs://bucket/x); None for a local path."""
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", os.fspath(p) if isinstance(p, os.PathLike) else str(p))
    return m.group(1).lower() if m else None


def is_url(p) -> bool:
    return url_scheme(p) is not None


def url_problem(p) -> str | None:
    """Why `p` cannot be used (a URL of a scheme epath does not route, or whose fsspec package is
    missing), in one line; None for a local path or a usable URL."""
    scheme = url_scheme(p)
    if scheme is None:
        return None
    if scheme not in URL_PROTOCOLS:
        return f"{p}: {scheme}:// URLs are not supported (use a local path or {', '.join(s + '://' for s in URL_PROTOCOLS)})"
    import fsspec

    try:
        fsspec.get_filesystem_class(URL_PROTOCOLS[scheme])
    except ImportError:
        return f"{p}: {scheme}:// needs its fsspec package: {_INSTALL[URL_PROTOCOLS[scheme]]}"
    return None


def path(p):
    """`p` as an etils.epath.Path; an unusable URL (`url_problem`) is a one-line UserError, not a
    traceback, nor a local folder named "gs:"."""
    from etils import epath

    problem = url_problem(p)
    if problem:
        raise UserError(problem)
    return epath.Path(p)


def local_only(p, what: str) -> None:
    """A one-line UserError for a URL where only a local path works (target weight files)."""
    if is_url(p):
        raise UserError(f"{what} {p}: URLs are not read here: copy it to a local path first")


def absolute(p) -> str:
    """os.path.abspath for a local path; a URL is already absolute (abspath would mangle it)."""
    return str(p) if is_url(p) else os.path.abspath(p)


def exists(p) -> bool:
    return path(p).exists()


def is_dir(p) -> bool:
    """A folder; on an object store, a prefix that holds objects (there are no empty folders)."""
    return path(p).is_dir()


def listdir(p) -> list[str]:
    """The names in folder `p`, sorted; [] if there is none (as on an object store)."""
    folder = path(p)
    return sorted(child.name for child in folder.iterdir()) if folder.is_dir() else []


def makedirs(p) -> None:
    """Create folder `p` and its parents; nothing to do on an object store (folders are prefixes)."""
    if not is_url(p):
        os.makedirs(p, exist_ok=True)


def make_parent(p) -> None:
    """Create the folder that will hold file `p`."""
    if not is_url(p):
        os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)


@contextlib.contextmanager
def folder_lock(p, busy: str):
    """Hold an exclusive lock on local folder `p` (created if missing) while the block runs; if
    another process holds it, a UserError saying `busy`. The kernel drops the lock when its holder
    exits, a kill included, so there is nothing stale to clean up. Object-store folders cannot be
    locked: there the block just runs."""
    if is_url(p):
        yield
        return
    import fcntl

    os.makedirs(p, exist_ok=True)
    fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(busy) from None
        yield
    finally:
        os.close(fd)


def remove(p) -> None:
    """Remove file `p` if it is there."""
    path(p).unlink(missing_ok=True)


def read_bytes(p) -> bytes:
    return path(p).read_bytes()


def read_text(p) -> str:
    # Bytes that are not UTF-8 are carried as surrogate escapes (text fields go through
    # tokenizer.clean_text later), so a stray byte is U+FFFD there, not a crash here.
    return read_bytes(p).decode("utf-8", errors="surrogateescape")


@contextlib.contextmanager
def atomic_writer(p, temp_name: str | None = None):
    """A binary file whose content replaces `p` whole when the block ends without an error; an
    error (or a kill) leaves the old `p`, or none, never a torn one (see the module docstring).
    `temp_name`: the local temporary file's name (in p's folder) when the caller must recognise
    its own leftovers; default a fresh ".<name>.<random>.tmp"."""
    if is_url(p):
        # Built in memory and uploaded in one go only when complete: an error part-way uploads nothing.
        buffer = io.BytesIO()
        yield buffer
        path(p).write_bytes(buffer.getvalue())
        return
    folder = os.path.dirname(os.path.abspath(p))
    if temp_name is None:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(p)}.", suffix=_TEMP_SUFFIX, dir=folder)
    else:
        tmp = os.path.join(folder, temp_name)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # data to share, not mkstemp's private 0600
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    sync_folder(folder)


def sync_folder(folder: str) -> None:
    """fsync a folder so that a rename in it survives a power loss (best effort)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without directory file descriptors (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(p, data: bytes) -> None:
    with atomic_writer(p) as f:
        f.write(data)


def atomic_write_text(p, text: str) -> None:
    atomic_write_bytes(p, text.encode("utf-8"))


def atomic_write_json(p, obj) -> None:
    atomic_write_text(p, json.dumps(obj, indent=1) + "\n")


class AppendedObject:
    """A text file on an object store that grows by appends (decode --output, metrics.jsonl). An
    object cannot be appended to, so the whole text is kept here and the object rewritten (one
    atomic upload) at most every `every_s` seconds, and at close: a kill loses at most the last
    `every_s` seconds of appends (a resume redoes them), never leaves a torn object."""

    def __init__(self, p, text: str = "", every_s: float | None = None):
        self.path, self.text = p, text
        self.every_s = OBJECT_REWRITE_S if every_s is None else every_s
        self.dirty, self.written_at = False, float("-inf")

    def write(self, text: str) -> None:
        self.text += text
        self.dirty = True

    def flush(self) -> None:
        if self.dirty and time.monotonic() - self.written_at >= self.every_s:
            self.rewrite()

    def rewrite(self) -> None:
        atomic_write_text(self.path, self.text)
        self.dirty, self.written_at = False, time.monotonic()

    def close(self) -> None:
        if self.dirty:
            self.rewrite()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_append(p):
    """A text file to append lines to: the local file (mode "a"), or for a URL an `AppendedObject`
    holding the object's current text."""
    if not is_url(p):
        return open(p, "a", encoding="utf-8")
    return AppendedObject(p, read_text(p) if exists(p) else "")


def read_json_object(path: str, what: str, missing: str = "", corrupt: str = "") -> dict:
    """A JSON file holding one object; a missing, unreadable or malformed file is a one-line
    UserError, ending with `missing` / `corrupt` (what to do about it) when given."""
    try:
        obj = json.loads(read_bytes(path))
    except FileNotFoundError:
        raise UserError(f"no such {what} {path}{missing}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{what} {path} is unreadable or not JSON ({type(e).__name__}){corrupt}") from None
    if not isinstance(obj, dict):
        raise UserError(f"{what} {path} is not a JSON object{corrupt}")
    return obj


def read_jsonl(path: str, what: str, allow_partial_last: bool = False) -> list[tuple[int, object]]:
    """(line number, parsed value) of every non-blank line; one-line UserErrors naming `what`.

    allow_partial_last: a final line without a newline that does not parse is a record still being
    written by a live process (e.g. a training log) and is skipped rather than called corrupt.
    """
    try:
        text = read_text(path)
    except FileNotFoundError:
        raise UserError(f"no such {what}: {path}") from None
    except IsADirectoryError:
        raise UserError(f"{what} {path} is a directory") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {what} {path}: {e}") from None
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError:
            if allow_partial_last and number == len(lines) and not text.endswith("\n"):
                break
            raise UserError(f"{path}:{number}: not valid JSON (corrupt {what})") from None
    return rows
