"""Who may connect and where the socket may live: supplementary group members, and every
ancestor directory of the socket path, checked with real processes.
"""

from __future__ import annotations

import grp
import os

from dedupcore.daemon.server import peer_admitted
from tests.support.daemon import Lab, assert_serves, ping_from_child, refused
from tests.support.procs import NOBODY, run_as

# -- group members -------------------------------------------------------------------------


def test_a_member_through_a_supplementary_group_is_admitted(lab: Lab) -> None:
    daemon = lab.daemon("--group", "nogroup")
    os.chmod(daemon.home, 0o711)
    member = grp.getgrnam("nogroup").gr_gid
    primary = grp.getgrnam("daemon").gr_gid
    assert primary != member
    report = run_as(NOBODY, primary, ping_from_child(daemon.socket), groups=[member])
    assert report == "pong True new", report
    # Without the group the same user is refused.
    os.chmod(daemon.socket, 0o666)
    os.chmod(daemon.socket.parent, 0o755)
    report = run_as(NOBODY, primary, ping_from_child(daemon.socket))
    assert report.startswith("UnavailableError"), report


def test_peer_admission_decision() -> None:
    uids, gids = {0}, {50}
    assert peer_admitted(0, 7, {7}, uids, gids)  # the daemon's uid
    assert peer_admitted(9, 50, {50}, uids, gids)  # primary group
    assert peer_admitted(9, 7, {7, 50}, uids, gids)  # supplementary group
    assert not peer_admitted(9, 7, {7, 8}, uids, gids)
    assert not peer_admitted(9, 7, {7, 50}, uids, set())


# -- every ancestor of the socket path -----------------------------------------------------


def test_a_symlinked_ancestor_into_another_users_directory_is_refused(lab: Lab) -> None:
    home = lab.tmpdir()
    theirs = lab.tmpdir()
    os.chmod(theirs, 0o755)
    os.chown(theirs, NOBODY, NOBODY)  # they could rename what is inside
    (theirs / "s").mkdir(mode=0o700)  # ours, but in their directory
    (home / "link").symlink_to(theirs)
    sock = home / "link" / "s" / "d.sock"
    out = refused(lab, "--data", str(home / "data"), "--socket", str(sock))
    assert f"uid {NOBODY}" in out
    assert not sock.exists()


def test_a_symlink_of_another_user_in_the_path_is_refused(lab: Lab) -> None:
    home = lab.tmpdir()
    (home / "real").mkdir(mode=0o700)
    (home / "link").symlink_to(home / "real")
    os.lchown(home / "link", NOBODY, NOBODY)
    out = refused(lab, "--data", str(home / "data"), "--socket", str(home / "link/s/d.sock"))
    assert "symlink" in out and f"uid {NOBODY}" in out


def test_a_symlink_of_another_user_inside_a_symlinks_target_is_refused(lab: Lab) -> None:
    home = lab.tmpdir()
    elsewhere = lab.tmpdir()
    (home / "real").mkdir(mode=0o700)
    (elsewhere / "hop").symlink_to(home / "real")  # theirs: they could point it anywhere
    os.lchown(elsewhere / "hop", NOBODY, NOBODY)
    (home / "link").symlink_to(elsewhere / "hop")  # ours
    out = refused(lab, "--data", str(home / "data"), "--socket", str(home / "link/s/d.sock"))
    assert "symlink" in out and f"uid {NOBODY}" in out
    assert not (home / "real" / "s").exists()


def test_an_ancestor_writable_by_others_without_the_sticky_bit_is_refused(lab: Lab) -> None:
    home = lab.tmpdir()
    (home / "open").mkdir()
    os.chmod(home / "open", 0o777)
    out = refused(lab, "--data", str(home / "data"), "--socket", str(home / "open/s/d.sock"))
    assert "sticky" in out
    assert not (home / "open" / "s").exists()


def test_an_own_symlink_into_a_safe_directory_is_followed(lab: Lab) -> None:
    home = lab.tmpdir()
    (home / "real").mkdir(mode=0o700)
    (home / "link").symlink_to(home / "real")
    daemon = lab.daemon(socket=home / "link" / "s" / "d.sock")
    assert (home / "real" / "s" / "d.sock").exists()
    assert_serves(daemon)
