"""Child processes of the tests: starting them, reading their lines, killing them at a
point the test chooses, waiting for what they do, and reaping them.

A child is killed where the test decides, never at a random moment: it prints a
line at the point of interest (``ACK 7``, ``HELD ...``, ``CKPT begin``) and the
test sends SIGKILL once it has read that line; :meth:`LineProcess.sigkill` then
collects what the child wrote whole before it died.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

#: The checkout (or, for an installed package's test run, the copy of the tests).
ROOT = Path(__file__).resolve().parents[2]
#: Generous bound for anything that should happen "soon" on a loaded machine.
PATIENCE = 90.0
#: The uid and gid of ``nobody``, for the tests that run a client as another user.
NOBODY = 65534


def child_env() -> dict[str, str]:
    """The environment of every subprocess: this checkout first on the path, and no
    DEDUPCORE_SOCKET or DEDUPCORE_DATA from the caller's shell."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.pop("DEDUPCORE_SOCKET", None)
    env.pop("DEDUPCORE_DATA", None)
    return env


def run_cli(
    *argv: str,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    cwd: Path | str | None = None,
    prefix: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """``python -m dedupcore ARGV`` to its end: exit code, stdout and stderr as text.

    ``prefix`` runs it through another command (``setpriv ...``); stdin is empty.
    """
    return subprocess.run(
        [*prefix, sys.executable, "-m", "dedupcore", *argv],
        capture_output=True,
        text=True,
        env=child_env() if env is None else env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        check=False,
    )


def load_script(path: Path) -> ModuleType:
    """The module of a child program beside the tests (``store_child.py``): the test
    imports the names it shares with the child (keys, expected results) from it."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wait_until(
    predicate: Callable[[], bool], what: str, timeout: float = PATIENCE, step: float = 0.05
) -> None:
    """Polls ``predicate`` until it is true; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} ({timeout} s)")
        time.sleep(step)


def call_in_thread(fn: Callable[[], Any], limit: float = PATIENCE) -> Any:
    """``fn()`` in a thread: its value or its exception; fails the test if it has not
    returned after ``limit`` seconds (a hang)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # reported to the caller
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), "the call hung instead of failing"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def run_as(uid: int, gid: int, fn: Callable[[], str], groups: Sequence[int] = ()) -> str:
    """Runs ``fn`` in a forked child with this uid, primary gid and supplementary
    groups; returns what it reports (``"TypeName: message"`` if it raised)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            os.close(r)
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
            message = fn()
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}"
            code = 1
        try:
            os.write(w, message.encode(errors="replace")[:4000])
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        report = fh.read()
    deadline = time.monotonic() + PATIENCE
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the child running as another user hung")
        time.sleep(0.05)
    return report.decode()


class LineProcess:
    """A child process whose stdout lines arrive on a queue as it writes them.

    A line is kept with its newline until it is read, so after a SIGKILL the lines
    the child wrote whole can be told from one it was cut off in.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        stdin: bool = False,
        name: str = "child",
    ) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env() if env is None else env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[bytes] = []
        self._out = threading.Thread(target=self._pump_out, daemon=True)
        self._out.start()
        self._err = threading.Thread(target=self._pump_err, daemon=True)
        self._err.start()

    def _pump_out(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode(errors="replace"))
        self.lines.put(None)

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self._stderr.append(raw)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        """What the child wrote to stderr so far (its last 4000 characters)."""
        return b"".join(self._stderr).decode(errors="replace")[-4000:]

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def next_raw(self, timeout: float = PATIENCE) -> str | None:
        """The next line as written (with its newline, if it got one), None at the end."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"{self.name} said nothing for {timeout} s; stderr:\n{self.stderr()}"
            ) from None

    def next_line(self, timeout: float = PATIENCE) -> str | None:
        """The next stdout line without its newline, or None at the end of output."""
        line = self.next_raw(timeout)
        return None if line is None else line.rstrip("\n")

    def expect(self, prefix: str, timeout: float = PATIENCE) -> str:
        """Skips lines until one starting with ``prefix``; returns the rest of it."""
        while True:
            line = self.next_line(timeout)
            if line is None:
                raise AssertionError(
                    f"{self.name} ended before {prefix!r}; rc={self.proc.poll()} stderr:\n"
                    + self.stderr()
                )
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    def expect_json(self, prefix: str, timeout: float = PATIENCE) -> Any:
        return json.loads(self.expect(prefix, timeout))

    def rest(self, timeout: float = PATIENCE) -> list[str]:
        """Every remaining line until the child's output ends."""
        out = []
        while (line := self.next_line(timeout)) is not None:
            out.append(line)
        return out

    def wait(self, timeout: float = PATIENCE) -> int:
        return self.proc.wait(timeout)

    def sigkill(self) -> list[str]:
        """SIGKILL now; returns the lines not yet read that the child wrote whole."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(PATIENCE)
        self._out.join(PATIENCE)
        assert self.proc.returncode == -signal.SIGKILL, (self.proc.returncode, self.stderr())
        whole = []
        while (line := self.lines.get_nowait()) is not None:
            if line.endswith("\n"):  # written whole before the kill
                whole.append(line.rstrip("\n"))
        return whole

    def sigkill_group(self) -> None:
        """SIGKILL to the child's whole process group at once (a child started through
        ``setsid`` leads its own: a worker and its pool processes), then reaps it."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.sigkill()

    def close_group(self) -> None:
        """:meth:`close`, with the child's whole process group killed first."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.close()

    def kill(self) -> None:
        """SIGKILL (after SIGCONT, should it be stopped) and reap, if it still runs."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(PATIENCE)

    def close(self) -> None:
        """Kills and reaps the child and closes its pipes."""
        self.kill()
        self._out.join(PATIENCE)
        self._err.join(PATIENCE)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def __enter__(self) -> LineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
