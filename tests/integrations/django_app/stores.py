"""The store factory DEDUPCORE_STORE names: the daemon at DEDUPCORE_SOCKET, else embedded."""

from __future__ import annotations

import os
from typing import Any

from django.conf import settings


def open_store() -> Any:
    """A daemon client when DEDUPCORE_SOCKET is set (server processes), else the embedded
    store in STORE_DIR (the test process)."""
    if os.environ.get("DEDUPCORE_SOCKET"):
        from dedupcore import Client

        return Client()
    from dedupcore import DedupStore

    return DedupStore.open(settings.STORE_DIR)
