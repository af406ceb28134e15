"""Writing a command's output file so that it appears complete or not at all.

The file is created under a temporary name beside its target (one filesystem, so the rename is
atomic), written, synced, renamed over the target, and the folder is synced. SIGINT and SIGTERM
are only recorded from the creation of the temporary file to the end of the folder sync: one that
arrives before the rename stops the write there and removes the temporary file; one that arrives
after it is raised once the folder is synced, the output complete. None can land between
creating the file and the code that removes it, or between the rename and the record that it
happened.
The process umask is never changed: the file is created with mode 0o666 and the umask applies.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from mmferry.commands.interrupts import Interrupted, recorded_interrupts

# errno values that say the path given cannot be written (a mistake in the command line), as
# opposed to a write that failed on a usable path (no space, quota, I/O error, file too large).
_PATH_ERRORS = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.EISDIR,
        errno.ENOTDIR,
        errno.ENOENT,
        errno.EEXIST,
        errno.ENAMETOOLONG,
        errno.ELOOP,
    }
)


class OutputError(Exception):
    """The output could not be written and nothing was left behind; `user`: the path is unusable."""

    def __init__(self, message: str, *, user: bool) -> None:
        super().__init__(message)
        self.user = user


def check_target(out: Path) -> None:
    """OutputError unless a file can be created at `out`: checked before any work is done."""
    out = out.resolve()
    if out.is_dir():
        raise OutputError(f"{out} is a folder; --out names the file to write", user=True)
    folder = out.parent
    while not folder.exists():  # the folders to be created: check the nearest that exists
        folder = folder.parent
    if not folder.is_dir():
        raise OutputError(f"cannot create a folder for {out}: {folder} is not a folder", user=True)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {out}: {folder} is not writable", user=True)


def write_atomic(out: Path, write: Callable[[BinaryIO], None], done: list[Path]) -> None:
    """Write `out` with `write(file)`, atomically and synced; `done` gets `out` at the rename.

    `Interrupted` (SIGINT or SIGTERM) before the rename: nothing is left (no temporary file,
    no folder this call created) and `out` is as it was; after it: raised once the folder is
    synced, `out` complete and in `done`. OutputError when it cannot be written (nothing is
    left either).
    """
    out = out.resolve()
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(6)}.tmp")
    try:
        with recorded_interrupts() as caught:
            made = _make_folders(out.parent)
            try:
                # O_EXCL: the name is ours alone, so removing it below never removes another
                # file (and a failed open removes none).
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                try:
                    with open(fd, "wb") as f:
                        write(f)
                        f.flush()
                        os.fsync(f.fileno())  # on disk before the name points at them
                    if caught:
                        raise Interrupted(caught[0])
                    os.replace(tmp, out)
                    done.append(out)
                except BaseException:
                    tmp.unlink(missing_ok=True)
                    raise
            except BaseException:
                _remove_folders(made)
                raise
            _sync_folder(out.parent)
        # NOTE: checked once the handlers are back, so that no signal falls between the check
        # and them. One recorded before the rename stopped the write above; one recorded after
        # it stops the command here, the output complete.
        if caught:
            raise Interrupted(caught[0])
    except OSError as e:
        # The path the system names, when it is not the output or its temporary (a folder).
        where = f" ({e.filename})" if e.filename and Path(e.filename) not in (out, tmp) else ""
        why = e.strerror or str(e)
        raise OutputError(f"cannot write {out}{where}: {why}", user=e.errno in _PATH_ERRORS) from e


def _make_folders(folder: Path) -> list[Path]:
    """Create `folder` and its missing parents; returns the ones this call created, outermost
    first. A failure part way removes those it created before raising."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    made: list[Path] = []
    try:
        for f in reversed(missing):
            try:
                f.mkdir()
            except FileExistsError:  # another process made it meanwhile: not ours to remove
                continue
            made.append(f)
    except BaseException:
        _remove_folders(made)
        raise
    return made


def _remove_folders(made: list[Path]) -> None:
    """Remove the folders `_make_folders` created, innermost first, while they are empty (one
    that another process wrote into stays, and so do its parents)."""
    for f in reversed(made):
        try:
            f.rmdir()
        except OSError:
            return


def _sync_folder(folder: Path) -> None:
    """Make the rename durable. Some filesystems cannot sync a folder: the rename then is as
    durable as they make it, and the file itself is already synced."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
