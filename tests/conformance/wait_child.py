"""An owner that holds a key until it is told what to do with it, for the tests of
``claim(wait=)`` between processes (test_wait_processes.py, tests/daemon/test_wait.py):
``python wait_child.py '<json config>'``.

It opens the store the config names (as heartbeat_child.py does: ``daemon``, ``redis``
or ``sql``), claims ``key`` in ``ns`` with ``lease`` and says ``HELD <token>``. Then it
reads one command on stdin: ``complete <json result>`` completes the key with that
result, ``release`` releases it, ``exit`` leaves it held. It says ``DONE`` once the
store acknowledged, and exits 0 (1 when the claim was not NEW).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from heartbeat_child import open_store, say


def main(cfg: dict[str, Any]) -> int:
    store = open_store(cfg)
    try:
        claim = store.claim(cfg["key"], namespace=cfg["ns"], lease=cfg["lease"])
        if claim.outcome.value != "new":
            say("NOT-NEW", claim.outcome.value)
            return 1
        say("HELD", claim.token)
        command, _, rest = sys.stdin.readline().strip().partition(" ")
        if command == "complete":
            store.complete(cfg["key"], claim.token, namespace=cfg["ns"], result=json.loads(rest))
        elif command == "release":
            store.release(cfg["key"], claim.token, namespace=cfg["ns"])
        say("DONE")
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
