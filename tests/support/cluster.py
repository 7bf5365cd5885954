"""Private Redis servers and a 3-master Redis Cluster for tests, on free loopback ports.

Everything runs in a temporary directory as child processes of the test
run, so tests can stop, pause or kill these servers without disturbing the
machine's shared Redis (or anyone else's tests on it).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (the kernel's pick for port 0)."""
    # Cluster nodes also listen on port + 10000: pick ports whose bus port is free too.
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair found")


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (scripts/services.sh installs redis-server)")
    return path


def _ping(port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    """One private redis-server process (start/stop/pause it at will)."""

    port: int
    workdir: Path
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            [
                _binary("redis-server"),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.workdir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                *self.args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while not _ping(self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited: {self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not answer")
            time.sleep(0.05)

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
        return ""

    def client(self, **options: Any) -> Any:
        import redis

        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            **{"socket_timeout": 5, "socket_connect_timeout": 5, **options},
        )

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            [_binary("redis-cli"), "-p", str(self.port), *args],
            capture_output=True,
            timeout=30,
            check=False,
        )
        return out.stdout.decode(errors="replace") + out.stderr.decode(errors="replace")

    def wait_exit(self, timeout: float = 20.0) -> None:
        assert self.proc is not None
        self.proc.wait(timeout)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL (after SIGCONT, in case it was paused) and reap."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(20)


@contextlib.contextmanager
def redis_server(workdir: Path, *args: str) -> Iterator[RedisServer]:
    """A private redis-server (extra ``args`` after the defaults), killed on exit."""
    server = RedisServer(free_port(), workdir, list(args))
    try:
        server.start()
        yield server
    finally:
        server.kill()


@dataclass
class Cluster:
    """A Redis Cluster of private masters (no replicas)."""

    nodes: list[RedisServer]

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def client(self, **options: Any) -> Any:
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(
            startup_nodes=[ClusterNode("127.0.0.1", p) for p in self.ports],
            **{"socket_timeout": 5, "socket_connect_timeout": 5, **options},
        )

    def node_of_slot(self, slot: int) -> int:
        """The port of the master that owns ``slot`` (asked of a live node)."""
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            for start, end, master, *_ in _cluster_slots(node):
                if start <= slot <= end:
                    return int(master[1])
        raise LookupError(f"no live node knows slot {slot}")

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()


def _cluster_slots(node: RedisServer) -> list[Any]:
    client = node.client()
    try:
        slots: list[Any] = client.execute_command("CLUSTER SLOTS")
        return slots
    finally:
        client.close()


def _cluster_ok(node: RedisServer) -> bool:
    client = node.client(socket_timeout=2)
    try:
        info = client.execute_command("CLUSTER INFO")
        if isinstance(info, bytes):
            info = info.decode()
        state = info if isinstance(info, str) else ""
        if isinstance(info, dict):
            return str(info.get("cluster_state")) == "ok"
        return "cluster_state:ok" in state
    except Exception:
        return False
    finally:
        client.close()


@contextlib.contextmanager
def redis_cluster(workdir: Path, masters: int = 3, *args: str) -> Iterator[Cluster]:
    """A cluster of ``masters`` private masters, all slots covered; killed on exit.

    ``args`` go to every redis-server (e.g. ``cluster-node-timeout``).
    """
    nodes: list[RedisServer] = []
    cluster = Cluster(nodes)
    try:
        for _ in range(masters):
            port = free_port()
            node = RedisServer(
                port,
                workdir / f"node-{port}",
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"nodes-{port}.conf",
                    *args,
                ],
            )
            nodes.append(node)
            node.start()
        out = subprocess.run(
            [
                _binary("redis-cli"),
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            timeout=60,
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed: {out.stdout.decode()} {out.stderr.decode()}"
            )
        deadline = time.monotonic() + 30
        while not all(_cluster_ok(n) for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("cluster_state did not become ok on every node")
            time.sleep(0.1)
        yield cluster
    finally:
        cluster.kill()
