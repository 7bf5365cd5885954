"""A client process for the daemon tests: ``python child.py '<json config>'``.

It talks to the daemon through :class:`dedupcore.Client` only and reports on
stdout, one line per event, so that the test can kill, stop or resume it at
a known point. Keys are ``f"{prefix}{i}"`` and are reported by index ``i``.

Modes (``config["mode"]``):

- ``claim``: prints ``ready``, waits for ``go`` on stdin (if ``wait_go``),
  claims the keys in batches (shuffled with ``seed``), then prints
  ``result {"new": [[i, token, takeover], ...], "counts": {...}}``.
- ``hold``: claims the keys in one batch, prints ``claims [[i, outcome,
  token], ...]``, then obeys stdin: ``complete`` / ``release`` (of its NEW
  claims; prints ``complete ok`` or ``complete <ExceptionClass>``), ``exit``.
- ``bigclaim``: prints ``sending`` and claims all keys in one batch, then
  ``done``.
- ``stream``: for batch 0, 1, ...: claims 1000 fresh keys (prints
  ``claimed b``), completes them with result ``b`` (prints ``acked b``); on
  an error prints ``error <ExceptionClass>`` and exits.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

from dedupcore.api import Outcome
from dedupcore.client import Client


def say(*parts: object) -> None:
    print(*parts, flush=True)


def keys_of(cfg: dict[str, Any]) -> list[str]:
    return [f"{cfg['prefix']}{i}" for i in range(cfg["n"])]


def index(cfg: dict[str, Any], key: str) -> int:
    return int(key[len(cfg["prefix"]) :])


def run_claim(client: Client, cfg: dict[str, Any]) -> None:
    keys = keys_of(cfg)
    if cfg.get("seed") is not None:
        random.Random(cfg["seed"]).shuffle(keys)
    client.ping()
    say("ready")
    if cfg.get("wait_go") and sys.stdin.readline().strip() != "go":
        return
    batch = cfg.get("batch", 1000)
    new: list[list[Any]] = []
    counts = {o.value: 0 for o in Outcome}
    for start in range(0, len(keys), batch):
        claims = client.claim_many(
            keys[start : start + batch],
            namespace=cfg["ns"],
            lease=cfg.get("lease"),
            owner=cfg.get("owner"),
        )
        for c in claims:
            counts[c.outcome.value] += 1
            if c.outcome is Outcome.NEW:
                new.append([index(cfg, c.key), c.token, c.takeover])
    say("result", json.dumps({"new": new, "counts": counts}))


def run_hold(client: Client, cfg: dict[str, Any]) -> None:
    claims = client.claim_many(
        keys_of(cfg), namespace=cfg["ns"], lease=cfg.get("lease"), owner=cfg.get("owner")
    )
    say("claims", json.dumps([[index(cfg, c.key), c.outcome.value, c.token] for c in claims]))
    mine = [(c.key, c.token) for c in claims if c.outcome is Outcome.NEW]
    for line in sys.stdin:
        command = line.strip()
        if command == "exit":
            return
        call = {"complete": client.complete_many, "release": client.release_many}[command]
        try:
            call(mine, namespace=cfg["ns"])
        except Exception as exc:  # report the class for the test to check
            say(command, type(exc).__name__)
        else:
            say(command, "ok")


def run_bigclaim(client: Client, cfg: dict[str, Any]) -> None:
    keys = keys_of(cfg)
    client.ping()
    say("sending")
    client.claim_many(keys, namespace=cfg["ns"], owner=cfg.get("owner"))
    say("done")


def run_stream(client: Client, cfg: dict[str, Any]) -> None:
    batch = 0
    while batch < cfg.get("max_batches", 10**9):
        keys = [f"{cfg['prefix']}{batch}-{j}" for j in range(cfg.get("batch", 1000))]
        try:
            claims = client.claim_many(keys, namespace=cfg["ns"])
            if any(c.outcome is not Outcome.NEW for c in claims):
                say("wrong", batch, json.dumps([c.outcome.value for c in claims][:20]))
                return
            say("claimed", batch)
            client.complete_many([(c.key, c.token, batch) for c in claims], namespace=cfg["ns"])
        except Exception as exc:  # the daemon was killed: report and stop
            say("error", type(exc).__name__)
            return
        say("acked", batch)
        batch += 1


def main() -> None:
    cfg = json.loads(sys.argv[1])
    client = Client(cfg["socket"], timeout=cfg.get("timeout", 60.0), retries=cfg.get("retries", 5))
    {
        "claim": run_claim,
        "hold": run_hold,
        "bigclaim": run_bigclaim,
        "stream": run_stream,
    }[cfg["mode"]](client, cfg)


if __name__ == "__main__":
    main()
