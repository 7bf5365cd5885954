"""The daemon's socket: where it may live, the socket systemd passes, who may connect.

Resolves and checks the socket path (its directory and every ancestor must
not be replaceable by another user), takes over a listening socket passed by
socket activation, and reads a peer's credentials and groups
(docs/daemon.md, "Security").
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import socket
import stat
import struct
from pathlib import Path

from dedupcore.errors import SocketPathError

__all__ = [
    "MAX_SOCKET_PATH",
    "check_peer",
    "check_socket_path",
    "inherited_socket",
    "peer_admitted",
    "peer_groups",
]

log = logging.getLogger("dedupcore.daemon")

#: Longest Unix socket path on Linux (sun_path is 108 bytes with its NUL).
MAX_SOCKET_PATH = 107
_PEERCRED = struct.Struct("3i")
#: The first descriptor passed by systemd socket activation (SD_LISTEN_FDS_START).
_LISTEN_FDS_START = 3
#: Linux SO_PEERGROUPS (the peer's supplementary groups), missing from the socket module.
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)


def _resolve_checked(path: Path) -> Path:
    """``path`` with its symlinks resolved (as far as it exists), refusing any symlink met
    on the way, also inside a symlink's target, that belongs to another user than root
    or this user: that user could point it elsewhere at any time."""
    me = os.geteuid()
    current = Path(path.anchor)
    todo = list(path.parts[1:])
    hops = 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        step = current / part
        try:
            st = os.lstat(step)
        except FileNotFoundError:
            return step.joinpath(*todo)  # the rest is created by this user
        if not stat.S_ISLNK(st.st_mode):
            current = step
            continue
        if st.st_uid not in (0, me):
            raise SocketPathError(
                f"{step} is a symlink of uid {st.st_uid}; that user could redirect the socket"
            )
        hops += 1
        if hops > 40:
            raise SocketPathError(f"too many symlinks on the way to {path}")
        target = Path(os.readlink(step))
        if target.is_absolute():
            current = Path(target.anchor)
            todo = list(target.parts[1:]) + todo
        else:
            todo = list(target.parts) + todo
    return current


def _check_ancestors(parent: Path) -> None:
    """Refuses a directory that another user could swap out from above.

    Every symlink met on the way to ``parent`` must belong to root or to this
    user, and every directory on the resolved path must belong to root or to
    this user and must not be writable by others unless it has the sticky bit
    (like ``/tmp``): otherwise someone else could rename an ancestor and put
    a directory of their own in its place.
    """
    me = os.geteuid()
    real = _resolve_checked(Path(parent).absolute())
    for directory in (*reversed(real.parents), real):
        try:
            st = os.stat(directory)
        except FileNotFoundError:
            return  # created below, by this user
        if st.st_uid not in (0, me):
            raise SocketPathError(
                f"{directory} (on the way to {parent}) belongs to uid {st.st_uid}; "
                "that user could replace the socket's directory"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise SocketPathError(
                f"{directory} (on the way to {parent}) is writable by others without the "
                f"sticky bit (mode {stat.S_IMODE(st.st_mode):o}); another user could replace "
                "the socket's directory"
            )


def check_socket_path(path: str | os.PathLike[str], *, group: str | None = None) -> Path:
    """Prepares the socket's directory and refuses unsafe or stale paths.

    Creates the directory (0700, or 0750 with ``group``); refuses a path that
    is too long, a symlink, owned by another user, under an ancestor another
    user could replace (see :func:`_check_ancestors`), or a live socket of
    another daemon; removes the stale socket file of a killed daemon.
    """
    p = Path(path)
    if len(os.fsencode(p)) > MAX_SOCKET_PATH:
        raise SocketPathError(
            f"socket path is {len(os.fsencode(p))} bytes; the limit is {MAX_SOCKET_PATH}"
        )
    parent = p.parent
    _check_ancestors(parent)
    if not parent.exists():
        parent.mkdir(mode=0o750 if group else 0o700, parents=True)
        if group is not None:
            # Members need to enter the directory to reach the socket.
            os.chown(parent, -1, grp.getgrnam(group).gr_gid)
            os.chmod(parent, 0o750)
    st = os.lstat(parent)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise SocketPathError(f"{parent} is not a directory (a symlink is refused)")
    if st.st_uid != os.geteuid():
        raise SocketPathError(f"{parent} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o022:
        raise SocketPathError(
            f"{parent} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): another user "
            "could replace the socket; use a directory only this user can write"
        )
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return p
    if stat.S_ISLNK(st.st_mode):
        raise SocketPathError(f"{p} is a symlink; refusing to use it")
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketPathError(f"{p} exists and is not a socket")
    if st.st_uid != os.geteuid():
        raise SocketPathError(f"{p} belongs to uid {st.st_uid}, not to this user")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(p))
    except (ConnectionRefusedError, FileNotFoundError):
        log.warning("removing stale socket %s left by a daemon that is gone", p)
        p.unlink()
        return p
    except OSError as exc:
        raise SocketPathError(f"cannot tell whether {p} is in use: {exc}") from exc
    finally:
        probe.close()
    raise SocketPathError(f"another daemon is serving on {p}")


def inherited_socket() -> socket.socket | None:
    """The listening socket systemd passed by socket activation, or None.

    The sd_listen_fds protocol: when ``LISTEN_PID`` is this process and
    ``LISTEN_FDS`` >= 1, descriptor 3 is a listening socket (further ones are
    not used). The variables are removed once read, whoever they were meant
    for, so no child process takes the socket for its own. A descriptor 3 that
    is not a listening Unix stream socket raises :class:`SocketPathError`.
    """
    pid = os.environ.pop("LISTEN_PID", None)
    fds = os.environ.pop("LISTEN_FDS", None)
    os.environ.pop("LISTEN_FDNAMES", None)
    if pid is None or fds is None or not pid.isdigit() or not fds.isdigit():
        return None
    if int(pid) != os.getpid() or int(fds) < 1:
        return None
    try:
        sock = socket.socket(fileno=_LISTEN_FDS_START)
    except OSError as exc:
        raise SocketPathError(f"LISTEN_FDS: descriptor 3 is not a socket ({exc})") from None
    if (
        sock.family != socket.AF_UNIX
        or sock.type != socket.SOCK_STREAM
        or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    ):
        sock.detach()
        raise SocketPathError("LISTEN_FDS: descriptor 3 is not a listening Unix stream socket")
    os.set_inheritable(sock.fileno(), False)
    return sock


def peer_groups(sock: socket.socket, uid: int, gid: int) -> set[int]:
    """The peer's groups: the kernel's ``SO_PEERGROUPS`` (the groups the peer process had
    when it connected), else the groups the user database gives the peer's uid."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 1024)  # 256 groups
        return {gid, *struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])}
    except OSError:
        pass
    try:
        return {gid, *os.getgrouplist(pwd.getpwuid(uid).pw_name, gid)}
    except (KeyError, OSError):
        return {gid}


def peer_admitted(
    uid: int, gid: int, groups: set[int], allowed_uids: set[int], allowed_gids: set[int]
) -> bool:
    """Whether a peer (uid, primary gid, all its groups) may use the daemon."""
    return uid in allowed_uids or gid in allowed_gids or bool(groups & allowed_gids)


def check_peer(
    sock: socket.socket, option: int, allowed_uids: set[int], allowed_gids: set[int]
) -> tuple[bool, str]:
    """Whether the peer connected on ``sock`` may use the daemon, and who it is (for
    the log). ``option`` is the platform's peer-credentials socket option
    (``SO_PEERCRED``, :func:`dedupcore._platform.peer_credentials_option`)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, option, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    who = f"pid {pid} uid {uid} gid {gid}"
    if uid in allowed_uids or gid in allowed_gids:
        return True, who
    if not allowed_gids:
        return False, who
    groups = peer_groups(sock, uid, gid)
    return peer_admitted(uid, gid, groups, allowed_uids, allowed_gids), (
        f"{who} groups {sorted(groups)}"
    )
