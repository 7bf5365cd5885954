"""Where eight single-claim clients of one daemon spend their time: the claims a
second, the daemon's CPU per claim, and how its group commits were made.

Starts ``dedupcore serve`` (durable) in a fresh directory, warms it with one
client, then lets ``--clients`` processes (8) each claim ``--claims`` fresh keys
(1500) one at a time after one barrier. Prints, per run, the claims a second
over the span from the first start to the last end, the daemon's CPU (its
process, from ``/proc``) per claim and in cores, the clients' own CPU per
claim (one alone, and each of the eight), and the daemon's
``commit_rounds`` split into those made on the loop and on the native commit
thread (docs/daemon.md, "Group commit")::

    .venv/bin/python -m benchmarks.daemon_groups --runs 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from dedupcore.client import Client


def _client(sock: str, name: str, n: int, barrier: Barrier, out: Any) -> None:
    c = Client(sock)
    c.claim(f"warm-{name}", namespace="groups")
    keys = [f"{name}-{i}" for i in range(n)]
    barrier.wait()
    start = time.perf_counter()
    cpu = time.process_time()
    for k in keys:
        c.claim(k, namespace="groups")
    out.put((start, time.perf_counter(), time.process_time() - cpu))
    c.close()


def _clients(sock: str, procs: int, n: int, tag: str) -> tuple[float, float]:
    """Claims a second of ``procs`` processes claiming ``n`` keys each, and their CPU
    seconds per claim."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(procs)
    out = ctx.Queue()
    children = [
        ctx.Process(target=_client, args=(sock, f"{tag}{i}", n, barrier, out)) for i in range(procs)
    ]
    for p in children:
        p.start()
    spans = [out.get() for _ in children]
    for p in children:
        p.join()
    rate = procs * n / (max(e for _, e, _ in spans) - min(s for s, _, _ in spans))
    return rate, sum(cpu for _, _, cpu in spans) / (procs * n)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(clients: int, claims: int, run_no: int) -> str:
    workdir = Path(tempfile.mkdtemp(prefix="dcgroups"))
    sock = str(workdir / "d.sock")
    argv = [sys.executable, "-m", "dedupcore", "serve", "--data", str(workdir / "data")]
    argv += ["--socket", sock, "--log-level", "ERROR"]
    daemon = subprocess.Popen(argv)
    try:
        while not os.path.exists(sock):
            if daemon.poll() is not None:
                raise RuntimeError("the daemon exited")
            time.sleep(0.05)
        one, one_cpu = _clients(sock, 1, claims, f"r{run_no}w")
        cpu0 = _cpu_seconds(daemon.pid)
        t0 = time.perf_counter()
        many, many_cpu = _clients(sock, clients, claims, f"r{run_no}c")
        cores = (_cpu_seconds(daemon.pid) - cpu0) / (time.perf_counter() - t0)
        with Client(sock) as c:
            figures = c.stats()["daemon"]
        per_claim = cores / many * 1e6
        return (
            f"run {run_no}: one client {one:,.0f} claims/s; {clients} clients {many:,.0f} "
            f"claims/s ({many / one:.2f}x); daemon CPU {per_claim:.0f} us per claim, "
            f"{cores:.2f} cores; client CPU per claim {one_cpu * 1e6:.0f} us alone, "
            f"{many_cpu * 1e6:.0f} us among {clients}; groups {figures['commit_rounds']:,}: "
            f"{figures['inline_commit_rounds']:,} on the loop, "
            f"{figures['native_commit_rounds']:,} on the native thread"
        )
    finally:
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--claims", type=int, default=1500, help="fresh keys per client")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    for i in range(1, args.runs + 1):
        print(run(args.clients, args.claims, i), flush=True)


if __name__ == "__main__":
    main()
