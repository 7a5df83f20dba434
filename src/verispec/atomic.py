"""Files that are never half-written: write beside the target, fsync, rename over it, fsync the directory.

Every file a later run reads (checkpoints, collected answers, n-gram tables, heads, drafts, stamps, traces)
goes through here, so a kill at any instant leaves either the old file or the new one, never a prefix of
the new one, and a reader never sees a mix of two writers (the last rename wins).

- The temporary name is unique per writer: `.NAME.PID.RANDOM.tmp` in the target's own folder (a rename
  never crosses file systems), created with O_EXCL, so two processes or two threads never share one. It is
  hidden and ends in `.tmp`, so a reader listing `*.safetensors` or `*.json` never picks up a write in
  progress. `atomic_path(..., keep_suffix=True)` ends it with the target's suffix instead, for libraries
  that choose a format by it (`np.save` appends `.npy` to a name without it; matplotlib reads the suffix).
- The temporary file, and so the target after the rename, is created 0644 less the umask; `mode=0o600`
  (any explicit mode) sets those bits exactly, from before anything is written to it, for files only their
  owner may read (the suffix store's earlier outputs). The rename replaces an existing target's mode too.
- Any exception (KeyboardInterrupt included) removes the temporary file and leaves the target untouched.
  A writer killed outright (SIGKILL, power loss) leaves its temporary file: the next write to that target
  removes the ones whose process is gone and which are older than `STALE_SECONDS`.
- `atomic_dir` does the same for a folder (a Hugging Face save, a draft head): built aside, every file
  fsynced, then swapped in by rename.

This module imports nothing from verispec but `errors`: every layer may use it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

STALE_SECONDS = 600  # a dead writer's temporary file older than this is removed by the next write


def temp_path(path: str | Path, kind: str = "tmp", keep_suffix: bool = False) -> Path:
    """A fresh name beside `path`, unique to this process and call: .NAME.PID.RANDOM.KIND (then .SUFFIX, the
    target's, with keep_suffix)."""
    path = Path(path)
    suffix = path.suffix if keep_suffix else ""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.{kind}{suffix}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process (or a number we cannot ask about): leave its files alone
    return True


def sweep_stale(path: str | Path, older_than: float = STALE_SECONDS) -> list[Path]:
    """Remove the temporary files and folders of `path` left by writers that died (their pid is gone and the
    file is older than `older_than` seconds); returns what was removed."""
    path = Path(path)
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(\d+)\.[0-9a-f]+\.(tmp|old)(?:{re.escape(path.suffix)})?$")
    removed = []
    try:
        siblings = list(path.parent.iterdir())
    except OSError:
        return removed
    now = time.time()
    for sibling in siblings:
        match = pattern.match(sibling.name)
        if not match or int(match.group(1)) == os.getpid() or _pid_alive(int(match.group(1))):
            continue
        try:
            if now - sibling.lstat().st_mtime < older_than:
                continue
            if sibling.is_dir() and not sibling.is_symlink():
                shutil.rmtree(sibling)
            else:
                sibling.unlink()
            removed.append(sibling)
        except OSError:
            pass  # another writer swept it first, or it is not ours to remove
    return removed


def fsync_dir(folder: str | Path) -> None:
    """Make a rename or a new entry in `folder` durable (a no-op where directories cannot be fsynced)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the rename itself is still atomic
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    """Flush a closed file's data to disk (fsync through any descriptor flushes the file's pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


@contextlib.contextmanager
def atomic_path(path: str | Path, keep_suffix: bool = False, mode: int | None = None) -> Iterator[Path]:
    """A temporary path to write `path`'s new content to, for libraries that write by name (torch.save,
    safetensors' save_file; np.save and savefig with keep_suffix=True, as they read or add the suffix).
    On a normal exit it is fsynced and renamed over `path`; on any exception it is removed and `path` keeps
    its old content. `mode`: the new file's permission bits, set exactly (None: 0o644 less the umask).

        with atomic_path(folder / "checkpoint.pt") as tmp:
            torch.save(state, tmp)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(path)
    tmp = temp_path(path, keep_suffix=keep_suffix)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644 if mode is None else mode & 0o600)  # reserve the name
    try:
        if mode is not None:  # exactly these bits, whatever the umask (created with at most 0600 until then)
            os.fchmod(fd, mode) if hasattr(os, "fchmod") else os.chmod(tmp, mode)
    except BaseException:
        _remove(tmp)
        raise
    finally:
        os.close(fd)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes, mode: int | None = None) -> None:
    """Write `data` as the whole content of `path`, atomically (see the module docstring; `mode` as in atomic_path)."""
    with atomic_path(path, mode=mode) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    """Write `text` as the whole content of `path`, atomically."""
    atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | Path, obj, indent: int | None = None, **dumps) -> None:
    """Write `obj` as JSON (one trailing newline when indented), atomically."""
    text = json.dumps(obj, indent=indent, **dumps)
    atomic_write_text(path, text + "\n" if indent is not None else text)


def fsync_tree(folder: str | Path) -> None:
    """fsync every file and folder under `folder` (before it is renamed into place)."""
    for root, dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # a socket or a file we may not open: nothing to flush
                fsync_file(Path(root) / name)
        fsync_dir(root)


@contextlib.contextmanager
def atomic_dir(path: str | Path, retries: int = 8) -> Iterator[Path]:
    """A fresh empty folder to build `path`'s new content in. On a normal exit every file in it is fsynced
    and it replaces `path` (a folder, or nothing yet); on any exception it is removed and `path` is untouched.

    The swap is two renames (the old folder aside, the new one in, then the old one removed), so a reader
    may find no folder for an instant, but never a half-built or mixed one. With two writers of one path,
    each swap is whole and the last one wins.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(path)
    tmp = temp_path(path)
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        moved: list[Path] = []  # earlier content moved aside, removed once ours is in
        try:
            for _ in range(retries):
                try:
                    os.rename(tmp, path)  # works when `path` is absent (or an empty folder)
                    break
                except OSError as err:
                    if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                        raise
                moved.append(temp_path(path, "old"))
                try:
                    os.rename(path, moved[-1])
                except FileNotFoundError:
                    moved.pop()  # another writer moved it first: try again
            else:
                raise OSError(errno.EBUSY, f"could not move a new {path.name} into place (other writers kept replacing it)")
        except BaseException:
            if moved and not path.exists():
                with contextlib.suppress(OSError):
                    os.rename(moved.pop(), path)  # put the old content back
            raise
        finally:
            for old in moved:
                _remove(old)
    except BaseException:
        _remove(tmp)
        raise
    fsync_dir(path.parent)
