"""An owner that holds a key under ``processing(heartbeat=True)``, for
test_heartbeat_processes.py: ``python heartbeat_child.py '<json config>'``.

It opens the store the config names (``daemon``: a Client of ``socket``;
``redis``: ``url`` and ``prefix``; ``sql``: ``url`` and ``table``), claims
``key`` with ``lease`` and a heartbeat, and reports on stdout: ``HELD
<token>``, then ``RENEWED <n>`` after each renewal that the store accepted.
After renewal ``stop_after`` it stops itself with SIGSTOP: the process
freezes at a known point, between two renewals, with no request or
transaction open. Once continued it reads ``finish`` on stdin and leaves the
block, which completes the key. The exit code says how the completion went:
0 done, 3 StaleTokenError (the key was taken over), 1 anything else.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from dedupcore.errors import StaleTokenError

EXIT_DONE, EXIT_OTHER, EXIT_STALE = 0, 1, 3


def say(*parts: object) -> None:
    print(*parts, flush=True)


def open_store(cfg: dict[str, Any]) -> Any:
    if cfg["kind"] == "daemon":
        from dedupcore.client import Client

        return Client(cfg["socket"], timeout=60.0)
    if cfg["kind"] == "redis":
        from dedupcore.redis import RedisStore

        return RedisStore.from_url(cfg["url"], prefix=cfg["prefix"])
    from dedupcore.sql import SqlStore

    return SqlStore.from_url(cfg["url"], table=cfg["table"])


def main(cfg: dict[str, Any]) -> int:
    store = open_store(cfg)
    extend = store.extend
    renewals = 0

    def reporting_extend(*args: Any, **kwargs: Any) -> None:
        nonlocal renewals
        extend(*args, **kwargs)
        renewals += 1
        say("RENEWED", renewals)
        if renewals == cfg["stop_after"]:
            os.kill(os.getpid(), signal.SIGSTOP)

    store.extend = reporting_extend
    try:
        with store.processing(
            cfg["key"], namespace=cfg["ns"], lease=cfg["lease"], heartbeat=True
        ) as c:
            say("HELD", c.token)
            if sys.stdin.readline().strip() != "finish":
                return EXIT_OTHER
            c.result = "done by the child"
    except StaleTokenError as exc:
        say("COMPLETE", type(exc).__name__)
        return EXIT_STALE
    finally:
        store.close()
    say("COMPLETE ok")
    return EXIT_DONE


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
