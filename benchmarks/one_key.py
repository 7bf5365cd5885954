"""What the native one-key path saves, on each side of a daemon: two A/B measures in
one daemon, the rounds of the two forms alternating (docs/daemon.md, "The client's
round trip" and "The request path of the embedded store").

- *daemon*: the daemon's CPU (its process, from ``/proc``) per claim, for claims
  sent over a bare socket as the sync client frames a one-key claim
  (``_core.one_key_frame``: read and answered natively) against the same claims
  in the map form with every argument (``protocol.claim_args``: msgpack's
  decoder, the checks of a map's fields, the general reply);
- *client*: the client process's CPU per claim and the p50 of one call, for
  ``Client.claim(k, namespace=ns)`` (framed and read natively) against
  ``Client.claim(k, namespace=ns, lease=30.0)``: the same request with a lease,
  which the client sends the general way.

Fresh keys, one claim at a time, the daemon ``power-loss-unsafe`` unless
``--durable`` (then every claim waits for its fdatasync and the spread is the
disk's)::

    .venv/bin/python -m benchmarks.one_key --rounds 6
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from collections.abc import Callable

import dedupcore._core as _core
from benchmarks._support import Daemon, cpu_seconds
from dedupcore.client import Client
from dedupcore.daemon import protocol
from dedupcore.daemon.protocol import Op

NS = "one-key"


def _process_cpu(daemon: Daemon) -> float:
    return sum(cpu_seconds(daemon.proc.pid).values())


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} (spread {min(values):.1f}-{max(values):.1f})"


def daemon_side(daemon: Daemon, rounds: int, n: int) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(daemon.socket)

    def round_trip(frame: bytes) -> None:
        sock.sendall(frame)
        length = int.from_bytes(sock.recv(4, socket.MSG_WAITALL), "big")
        sock.recv(length, socket.MSG_WAITALL)

    def frames(form: str, r: int) -> list[bytes]:
        keys = [b"%s-%d-%012d" % (form.encode(), r, i) for i in range(n)]
        if form == "one-key":
            return [_core.one_key_frame(1, Op.CLAIM_MANY, NS, k) or b"" for k in keys]
        args = [protocol.claim_args(NS, [k], None, None, None) for k in keys]
        return [protocol.encode_request(1, Op.CLAIM_MANY, a) for a in args]

    cpu: dict[str, list[float]] = {"one-key": [], "map": []}
    for r in range(rounds):
        for form in cpu:
            batch = frames(form, r)
            before = _process_cpu(daemon)
            for frame in batch:
                round_trip(frame)
            cpu[form].append((_process_cpu(daemon) - before) / n * 1e6)
    sock.close()
    for form, values in cpu.items():
        print(f"daemon CPU per claim, {form} frames: {_median(values)} us")


def client_side(daemon: Daemon, rounds: int, n: int) -> None:
    client = Client(daemon.socket)
    client.ping()
    calls: dict[str, Callable[[bytes], object]] = {
        "claim(k)": lambda k: client.claim(k, namespace=NS),
        "claim(k, lease=30.0)": lambda k: client.claim(k, namespace=NS, lease=30.0),
    }
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    p50: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        for j, (name, call) in enumerate(calls.items()):
            keys = [b"c%d-%d-%012d" % (j, r, i) for i in range(n)]
            times = []
            before = time.process_time()
            for k in keys:
                t = time.perf_counter_ns()
                call(k)
                times.append(time.perf_counter_ns() - t)
            cpu[name].append((time.process_time() - before) / n * 1e6)
            p50[name].append(statistics.median(times) / 1000)
    client.close()
    for name in calls:
        print(f"client {name}: CPU per call {_median(cpu[name])} us, p50 {_median(p50[name])} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each form")
    parser.add_argument("--claims", type=int, default=3000, help="claims per round")
    parser.add_argument("--durable", action="store_true", help="a durable daemon")
    args = parser.parse_args()
    daemon = Daemon("durable" if args.durable else "power-loss-unsafe")
    try:
        daemon_side(daemon, args.rounds, args.claims)
        client_side(daemon, args.rounds, args.claims)
    finally:
        daemon.stop()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
