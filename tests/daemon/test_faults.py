"""Faults with real processes: slow and idle clients, killed clients, socket security.

Each test starts its own ``dedupcore serve`` subprocess when it changes the
daemon's options or kills things; the daemon must keep serving everyone else.
"""

from __future__ import annotations

import grp
import os
import resource
import signal
import socket
import stat
import threading
import time

import pytest

from dedupcore.api import Outcome
from dedupcore.client import Client
from dedupcore.daemon import protocol
from dedupcore.daemon.protocol import Op
from dedupcore.errors import UnavailableError
from tests.support.daemon import (
    HEADER,
    Daemon,
    Lab,
    assert_serves,
    open_connection,
    ping_from_child,
    read_frame,
    read_until_eof,
    refused,
)
from tests.support.procs import NOBODY, PATIENCE, run_as, wait_until
from tests.support.stores import unique_ns


def connections_open(daemon: Daemon) -> int:
    """The daemon's count of open connections, asked over a blocking connect.

    (A blocking connect waits while the accept backlog is full; the Client's
    connect does not, see test_a_client_waits_while_the_accept_backlog_is_full.)
    """
    with open_connection(daemon.socket) as s:
        s.sendall(protocol.encode_request(1, Op.STATS, {}))
        data = read_frame(s)
    _, status, payload = protocol.decode_response(data)
    assert status is protocol.Status.OK, payload
    return int(payload["daemon"]["connections_open"])


# -- slow, idle and killed clients ----------------------------------------------------------


def test_a_client_sending_one_byte_per_second_does_not_stall_others(lab: Lab) -> None:
    daemon = lab.daemon()
    frame = protocol.encode_request(77, Op.PING, {})
    sent = threading.Event()
    reply: list[bytes] = []

    def trickle() -> None:
        with open_connection(daemon.socket) as s:
            for i, byte in enumerate(frame):
                s.sendall(bytes([byte]))
                if i == 1:
                    sent.set()  # mid-header: the daemon is waiting on this connection
                time.sleep(1.0)
            s.shutdown(socket.SHUT_WR)
            reply.append(read_until_eof(s))

    slow = threading.Thread(target=trickle)
    slow.start()
    try:
        assert sent.wait(PATIENCE)
        for _ in range(3):
            assert_serves(daemon)
    finally:
        slow.join()
    # The slow client is served too, once its frame is complete.
    (data,) = reply
    assert protocol.decode_response(data[4:]) == (77, protocol.Status.OK, "pong")


def test_a_stalled_sender_is_cut_off_after_the_request_timeout(lab: Lab) -> None:
    daemon = lab.daemon("--request-timeout", "2")
    with open_connection(daemon.socket) as s:
        s.sendall(HEADER.pack(50) + b"\x93")  # 1 of 50 announced bytes, then nothing
        assert_serves(daemon)
        assert read_until_eof(s) == b""  # closed by the daemon, without a reply
    assert_serves(daemon)


def test_1000_idle_connections_and_another_client_is_served(lab: Lab) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        # The daemon inherits the limit; it needs one descriptor per connection.
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    daemon = lab.daemon("--max-connections", "2000")
    idle: list[socket.socket] = []
    try:
        for _ in range(1000):
            idle.append(open_connection(daemon.socket))
        # Every idle connection has been accepted and is held open by the daemon.
        wait_until(lambda: connections_open(daemon) >= 1001, "1000 connections to be accepted")
        assert_serves(daemon)
        ns = unique_ns()
        with daemon.client() as c:
            claims = c.claim_many([f"k{i}" for i in range(1000)], namespace=ns)
            assert all(x.outcome is Outcome.NEW for x in claims)
    finally:
        for s in idle:
            s.close()
    # Closed connections are forgotten, not leaked.
    wait_until(lambda: connections_open(daemon) == 1, "idle connections to be dropped")
    assert_serves(daemon)


def test_the_connection_cap_refuses_extra_clients_and_recovers(lab: Lab) -> None:
    daemon = lab.daemon("--max-connections", "3")
    main = daemon.client(timeout=PATIENCE)
    assert main.ping()  # connection 1, kept by this thread
    idle = [open_connection(daemon.socket), open_connection(daemon.socket)]
    try:
        wait_until(
            lambda: main.stats()["daemon"]["connections_open"] == 3, "3 connections accepted"
        )
        with (
            pytest.raises(UnavailableError),
            Client(daemon.socket, timeout=PATIENCE, retries=1) as extra,
        ):
            extra.ping()
        assert main.stats()["daemon"]["refused_connections"] >= 1
        assert main.ping()  # the connections already served are unaffected
        idle.pop().close()

        def extra_served() -> bool:
            try:
                with Client(daemon.socket, timeout=PATIENCE, retries=0) as c:
                    return c.ping()
            except UnavailableError:
                return False

        wait_until(extra_served, "a freed slot to be usable")
    finally:
        for s in idle:
            s.close()
        main.close()


def test_a_client_waits_while_the_accept_backlog_is_full(lab: Lab) -> None:
    """Many processes connecting at once can fill the listen backlog for a moment;
    a Client with a 60 s timeout must wait or retry, not fail at once."""
    daemon = lab.daemon()
    daemon.signal(signal.SIGSTOP)  # nothing is accepted while stopped
    pending: list[socket.socket] = []
    answers: list[object] = []
    try:
        while True:  # fill the backlog
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            pending.append(s)
            try:
                s.connect(str(daemon.socket))
            except BlockingIOError:
                break
            assert len(pending) < 10_000

        def ping() -> None:
            try:
                with Client(daemon.socket, timeout=60.0) as c:
                    answers.append(c.ping())
            except BaseException as exc:
                answers.append(exc)

        t = threading.Thread(target=ping)
        t.start()
        time.sleep(1.0)
    finally:
        daemon.signal(signal.SIGCONT)
    t.join()
    for s in pending:
        s.close()
    assert answers == [True], answers
    assert_serves(daemon)


def test_a_client_killed_mid_request_leaves_the_daemon_serving(lab: Lab) -> None:
    daemon = lab.daemon()
    ns = unique_ns()
    n = 100_000
    for round_ in range(2):
        prefix = f"r{round_}-"
        child = lab.child(
            mode="bigclaim", socket=str(daemon.socket), ns=ns, prefix=prefix, n=n, owner="dead"
        )
        child.expect("sending")
        time.sleep(0.05 + 0.2 * round_)
        child.kill()
        assert_serves(daemon)
        # One batch is one decision: all of it was claimed, or none of it.
        with daemon.client(timeout=PATIENCE) as c:
            claims = c.claim_many([f"{prefix}{i}" for i in range(n)], namespace=ns, owner="alive")
        outcomes = {x.outcome for x in claims}
        assert outcomes in ({Outcome.NEW}, {Outcome.IN_PROGRESS}), outcomes
    assert daemon.alive()


# -- socket security ------------------------------------------------------------------------


def open_up_for_others(daemon: Daemon) -> None:
    """Lets any user reach the socket through the file system (as root we may).

    The temporary home is 0700 and the daemon makes its socket directory 0700
    and the socket 0600: another uid could not even connect. Loosening them
    here means the only thing left to refuse that uid is the daemon's
    SO_PEERCRED check, which is what these tests are about.
    """
    os.chmod(daemon.home, 0o711)
    os.chmod(daemon.socket.parent, 0o755)
    os.chmod(daemon.socket, 0o666)


def test_socket_directory_0700_and_socket_0600_by_default(lab: Lab) -> None:
    daemon = lab.daemon()
    d = os.lstat(daemon.socket.parent)
    s = os.lstat(daemon.socket)
    assert stat.S_ISDIR(d.st_mode) and stat.S_IMODE(d.st_mode) == 0o700
    assert stat.S_ISSOCK(s.st_mode) and stat.S_IMODE(s.st_mode) == 0o600
    assert d.st_uid == s.st_uid == os.geteuid()


def test_group_option_gives_0750_and_0660(lab: Lab) -> None:
    daemon = lab.daemon("--group", "root")
    d = os.lstat(daemon.socket.parent)
    s = os.lstat(daemon.socket)
    assert stat.S_IMODE(d.st_mode) == 0o750
    assert stat.S_IMODE(s.st_mode) == 0o660
    assert s.st_gid == grp.getgrnam("root").gr_gid


def test_group_members_can_reach_and_use_the_socket(lab: Lab) -> None:
    """``--group nogroup``: a member of that group (not the daemon's uid) is served."""
    daemon = lab.daemon("--group", "nogroup")
    os.chmod(daemon.home, 0o711)  # our temporary home only; the daemon made everything below
    gid = grp.getgrnam("nogroup").gr_gid
    s = os.lstat(daemon.socket)
    assert s.st_gid == gid and stat.S_IMODE(s.st_mode) == 0o660
    d = os.lstat(daemon.socket.parent)
    assert stat.S_IMODE(d.st_mode) == 0o750
    assert d.st_gid == gid, "the socket directory must belong to the group it is opened for"
    report = run_as(NOBODY, gid, ping_from_child(daemon.socket))
    assert report == "pong True new", report


def test_a_connection_from_another_uid_is_refused(lab: Lab) -> None:
    daemon = lab.daemon()
    open_up_for_others(daemon)
    report = run_as(NOBODY, NOBODY, ping_from_child(daemon.socket))
    assert report.startswith("UnavailableError"), report
    with daemon.client() as c:
        assert c.stats()["daemon"]["refused_connections"] >= 1
    assert "refused connection" in daemon.log_text()
    assert f"uid {NOBODY}" in daemon.log_text()
    assert_serves(daemon)


def test_allow_uid_lets_that_uid_in(lab: Lab) -> None:
    daemon = lab.daemon("--allow-uid", str(NOBODY))
    open_up_for_others(daemon)
    report = run_as(NOBODY, NOBODY, ping_from_child(daemon.socket))
    assert report == "pong True new", report
    # The daemon's own uid is still allowed.
    assert_serves(daemon)


def test_a_user_who_may_not_open_the_socket_gets_unavailable(lab: Lab) -> None:
    """Default permissions: another uid cannot reach the socket; the client says so
    with the error it uses for an unreachable daemon."""
    daemon = lab.daemon()
    os.chmod(daemon.home, 0o711)
    report = run_as(NOBODY, NOBODY, ping_from_child(daemon.socket))
    assert report.startswith("UnavailableError"), report


def test_a_symlink_socket_path_is_refused(lab: Lab) -> None:
    home = lab.tmpdir()
    (home / "s").mkdir(mode=0o700)
    target = home / "elsewhere.sock"
    link = home / "s" / "d.sock"
    link.symlink_to(target)
    out = refused(lab, "--data", str(home / "data"), "--socket", str(link))
    assert "symlink" in out
    assert link.is_symlink() and not target.exists()


def test_a_symlink_to_a_live_socket_is_refused(lab: Lab) -> None:
    other = lab.daemon()
    home = lab.tmpdir()
    (home / "s").mkdir(mode=0o700)
    link = home / "s" / "d.sock"
    link.symlink_to(other.socket)
    out = refused(lab, "--data", str(home / "data"), "--socket", str(link))
    assert "symlink" in out
    assert_serves(other)


def test_a_symlinked_socket_directory_is_refused(lab: Lab) -> None:
    home = lab.tmpdir()
    (home / "real").mkdir(mode=0o700)
    (home / "s").symlink_to(home / "real")
    out = refused(lab, "--data", str(home / "data"), "--socket", str(home / "s" / "d.sock"))
    assert "symlink" in out
    assert not (home / "real" / "d.sock").exists()


def test_a_socket_path_over_107_bytes_is_refused(lab: Lab) -> None:
    home = lab.tmpdir()
    path = home / ("x" * (120 - len(str(home))))
    assert len(os.fsencode(path)) > 107
    out = refused(lab, "--data", str(home / "data"), "--socket", str(path))
    assert "107" in out
    assert not path.exists()


def test_a_socket_directory_owned_by_another_uid_is_refused(lab: Lab) -> None:
    home = lab.tmpdir()
    theirs = home / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    out = refused(lab, "--data", str(home / "data"), "--socket", str(theirs / "d.sock"))
    assert f"uid {NOBODY}" in out
    assert not (theirs / "d.sock").exists()


def test_a_regular_file_at_the_socket_path_is_kept_and_refused(lab: Lab) -> None:
    home = lab.tmpdir()
    (home / "s").mkdir(mode=0o700)
    precious = home / "s" / "d.sock"
    precious.write_text("not a socket")
    out = refused(lab, "--data", str(home / "data"), "--socket", str(precious))
    assert "not a socket" in out
    assert precious.read_text() == "not a socket"


def test_a_second_daemon_on_the_same_data_directory_is_refused(lab: Lab) -> None:
    first = lab.daemon()
    home = lab.tmpdir()
    out = refused(lab, "--data", str(first.data), "--socket", str(home / "s" / "d.sock"))
    assert str(first.pid) in out and "dedupcore serve" in out
    assert not (home / "s" / "d.sock").exists()
    assert_serves(first)


def test_a_second_daemon_on_the_same_socket_is_refused(lab: Lab) -> None:
    first = lab.daemon()
    home = lab.tmpdir()
    out = refused(lab, "--data", str(home / "data"), "--socket", str(first.socket))
    assert "another daemon" in out
    assert stat.S_ISSOCK(os.lstat(first.socket).st_mode)
    assert_serves(first)


def test_a_stale_socket_of_a_killed_daemon_is_replaced(lab: Lab) -> None:
    daemon = lab.daemon()
    ns = unique_ns()
    with daemon.client() as c:
        claim = c.claim("k", namespace=ns)
        c.complete("k", claim.token, namespace=ns, result="kept")
    daemon.kill()
    assert stat.S_ISSOCK(os.lstat(daemon.socket).st_mode)  # left behind
    with pytest.raises(UnavailableError), Client(daemon.socket, retries=0) as c:
        c.ping()
    daemon.start()
    assert "stale socket" in daemon.log_text()
    with daemon.client() as c:
        assert c.claim("k", namespace=ns).result == "kept"
    assert_serves(daemon)


def test_refused_daemons_do_not_disturb_a_running_one(lab: Lab) -> None:
    first = lab.daemon()
    ns = unique_ns()
    with first.client() as c:
        claim = c.claim("k", namespace=ns)
        for _ in range(3):
            refused(lab, "--data", str(first.data), "--socket", str(first.socket))
        c.complete("k", claim.token, namespace=ns)
        assert c.claim("k", namespace=ns).outcome is Outcome.DUPLICATE
    assert_serves(first)
    assert first.alive()
