"""Private local folders for the staging areas and the shard cache, and which job owns an area.

A staging area and a cache hold bytes that a job trains on, so no other local user may
make, replace or write anything in them. Every folder they use is checked with ``lstat``
before it is used (never through a symbolic link): it must be a directory, owned by this
process's effective user, and writable by nobody else. Folders shardflow names itself
(the per-user folder ``shardflow-<uid>`` inside a shared temporary folder, each staging
area) are created with mode 0700 and refused when another user made them. Files inside
are opened with ``O_NOFOLLOW``: a symbolic link there is refused, never followed.

Where the staging areas live (:func:`staging_base`): directly in ``staging_dir`` when only
this user can write it; in ``<folder>/shardflow-<uid>`` (0700) when the folder is a shared
one with the sticky bit, as the system's temporary folder is (others cannot rename or
remove what is ours there); anything else is refused.

An area belongs to one job (:func:`job_id`): the process that owns the DataLoader, named by
its pid and its start time (a job restarted under the same pid, as in a container, has
another start time, so it never reads the area a killed job left).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import tempfile

from ..errors import UnsafeFolderError

logger = logging.getLogger(__name__)

__all__ = [
    "check_folder",
    "job_alive",
    "job_id",
    "lock_held",
    "open_private",
    "own_file_size",
    "private_folder",
    "same_file",
    "staging_base",
    "user_folder",
]

USER_PREFIX = "shardflow-"  # the per-user folder in a shared temporary folder: shardflow-<uid>
_TOKEN = (os.getpid(), secrets.token_hex(8))  # where a process start time is not known (no /proc)


def _describe(path: str, st: os.stat_result) -> str:
    return f"{path} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})"


def check_folder(path: str, *, private: bool, what: str) -> os.stat_result:
    """Check that ``path`` is a folder only this user can write (``private``: use at all).

    Args:
        path: the folder (not followed when it is a symbolic link).
        private: also refuse a folder others can read or enter (mode must be 0700 or less).
        what: what the folder is for, named in the error ("staging area", "shard cache").

    Returns:
        Its ``lstat`` result.

    Raises:
        UnsafeFolderError: a symbolic link, not a folder, owned by another user, or writable
            (``private``: usable) by others.
        FileNotFoundError: nothing at ``path``.
    """
    st = os.lstat(path)
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link (never followed)"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder"
    elif st.st_uid != uid:
        problem = f"belongs to another user (uid {st.st_uid}, not {uid}): it may hold files planted for this job"
    elif st.st_mode & (0o077 if private else 0o022):
        problem = "can be " + ("used" if private else "written") + " by other users (group or others' bits set)"
    else:
        return st
    raise UnsafeFolderError(
        f"{what} {_describe(path, st)} {problem}; refusing it. Remove it, or give a folder that only "
        f"you (uid {uid}) can write"
    )


def private_folder(path: str, what: str, *, private: bool = True) -> str:
    """Make ``path`` (mode 0700) unless it exists, and check it with :func:`check_folder`.

    A folder that this user owns and that others may read or enter only is made 0700 when
    ``private`` (a per-user folder or area that an older version made with the umask's mode).

    Returns:
        ``path``.

    Raises:
        UnsafeFolderError: see :func:`check_folder`.
        OSError: the folder cannot be made (a parent is missing or read-only).
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if (private and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077
            and not st.st_mode & 0o022):
        os.chmod(path, 0o700, follow_symlinks=False)  # ours, and nobody else could write in it
    check_folder(path, private=private, what=what)
    return path


def user_folder(base: str, what: str) -> str:
    """The folder of this user's areas in ``base``: ``base`` itself when only this user can
    write it, else ``<base>/shardflow-<uid>`` (0700) when ``base`` is a shared folder with
    the sticky bit (owned by this user or by root), or root's and writable by nobody else.

    Raises:
        UnsafeFolderError: ``base`` is a symbolic link, not a folder, owned by another user
            (not root), or writable by others without the sticky bit; or the per-user
            folder is unsafe (see :func:`check_folder`).
    """
    st = os.lstat(base)
    uid = os.geteuid()
    if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022:
        return base
    # shared with the sticky bit (others cannot rename what is ours), or root's and written by
    # nobody else (a folder this user may not write in: making the per-user folder fails)
    sticky, written = st.st_mode & stat.S_ISVTX, st.st_mode & 0o022
    if stat.S_ISDIR(st.st_mode) and st.st_uid in (uid, 0) and (sticky or not written):
        return private_folder(os.path.join(base, f"{USER_PREFIX}{uid}"), what)
    check_folder(base, private=False, what=what)  # raises: says what is wrong with it
    raise UnsafeFolderError(
        f"{what} {_describe(base, st)} is shared without the sticky bit; refusing it. "
        "Give a folder that only you can write"
    )


def staging_base(staging_dir: str | None) -> str:
    """The folder that holds this user's staging areas (see :func:`user_folder`): in
    ``staging_dir`` (made when missing) or the system's temporary folder.

    Raises:
        UnsafeFolderError: the folder is not safe to use.
        OSError: it cannot be made.
    """
    base = staging_dir if staging_dir is not None else tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    return user_folder(base, "staging folder")


def open_private(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` of a file in a private area, never through a symbolic link.

    Raises:
        UnsafeFolderError: ``path`` is a symbolic link.
        OSError: as ``os.open``.
    """
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise UnsafeFolderError(f"{path} is a symbolic link; refusing to open it (it is never followed)") from exc


def own_file_size(path: str) -> int | None:
    """The size of ``path`` when it is a regular file of this user's, else None (nothing there,
    or a symbolic link, another user's file or anything else: logged, never used).

    Used for the entries of a cache, which are served without being read first.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        logger.warning("%s is not a regular file of this user's; not served (a link is never followed)", path)
        return None
    return st.st_size


def same_file(fd: int, path: str) -> bool:
    """Whether ``fd`` is still the file at ``path`` (it was not removed or replaced meanwhile)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def lock_held(path: str) -> bool | None:
    """Probe the ``flock`` on an area's lock or claim file without waiting: True when another
    open file holds it, False when it is free (taken and let go at once), None when there is
    no such file. Opened as :func:`open_private` opens (never through a link)."""
    import fcntl

    try:
        fd = open_private(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _stat(pid: str) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the command's ``)``: state, ppid, ... (stat(5))."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def _start_time(parent: bool) -> str | None:
    """The start time (clock ticks after boot) of this process or its parent, or None.

    Found from ``/proc/self`` (a pid seen inside a container's pid namespace names another
    process in a ``/proc`` mounted outside it).
    """
    try:
        fields = _stat("self")
        if parent:
            fields = _stat(fields[1].decode())
        return fields[19].decode()  # field 22 of stat(5)
    except (OSError, IndexError, ValueError):
        return None


def job_id(in_worker: bool) -> str:
    """Who owns a staging area: the process that owns the DataLoader (a worker's parent, or
    this process), by pid and start time. Without ``/proc``, its pid and a random token that
    forked workers inherit (a spawned worker then has an area of its own).
    """
    pid = os.getppid() if in_worker else os.getpid()
    start = _start_time(in_worker)
    if start is not None:
        return f"{pid}@{start}"
    if _TOKEN[0] == pid:  # this process, or (forked) the worker's parent
        return f"{pid}@{_TOKEN[1]}"
    return f"{os.getpid()}@{_own_token()}"  # a spawned worker, no /proc: an area of its own


def job_alive(job: str | None) -> bool:
    """Whether the job that :func:`job_id` named ``job`` still runs on this machine.

    With a start time (``<pid>@<ticks>``), the process ``<pid>`` must have started then (a
    pid reused by another process is not the job); with a token (no ``/proc``), a process
    ``<pid>`` must exist. False for None or an unreadable ``job``.
    """
    pid_text, _, start = (job or "").partition("@")
    if not pid_text.isdigit():
        return False
    if start.isdigit():
        try:
            return _stat(pid_text)[19].decode() == start
        except (OSError, IndexError, ValueError):
            return False  # no such process (or no /proc to tell)
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: a pid that exists
    return True


def _own_token() -> str:
    global _TOKEN
    if _TOKEN[0] != os.getpid():
        _TOKEN = (os.getpid(), secrets.token_hex(8))
    return _TOKEN[1]
