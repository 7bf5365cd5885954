"""One place for every exception (dedupcore/errors.py) and the protocol's table built from it.

Every public exception class of the package is defined in ``dedupcore.errors``
and listed in its ``__all__``; the modules that raise one re-export it from
there. The daemon's error table (``dedupcore/daemon/protocol.py``) is built
from that list, so every one of them reaches a client as its own class, and
the clients never load the embedded store to name an error.
"""

from __future__ import annotations

import ast
import inspect
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import dedupcore.errors as errors
from dedupcore.daemon import protocol
from dedupcore.daemon.protocol import Status

PACKAGE = Path(__file__).resolve().parents[2] / "dedupcore"

#: Where each exception that moved into errors.py was defined before: still importable there.
OLD_HOMES = {
    "dedupcore.api": ("InProgressError", "KeyPathError"),
    "dedupcore.check": ("NotADataDirectoryError",),
    "dedupcore.cli.config": ("SettingsError",),
    "dedupcore.daemon.protocol": ("FrameError",),
    "dedupcore.integrations": ("MissingKeyError",),
    "dedupcore.patterns.tokens": ("InvalidTokenError", "ExpiredTokenError", "UnstoredResultError"),
    "dedupcore.store": ("StoreLockedError",),
    "dedupcore.tiers.base": ("RequestRefusedError",),
    "dedupcore.wal": ("WalFailedError",),
}


def _exception_classes_defined(path: Path) -> list[str]:
    """Public top-level classes of a module whose name says they are exceptions."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and not node.name.startswith("_")
        and node.name.endswith(("Error", "Exception"))
    ]


def test_every_public_exception_is_defined_in_errors() -> None:
    elsewhere = {
        str(path.relative_to(PACKAGE.parent)): names
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "errors.py" or path.parent != PACKAGE
        if (names := _exception_classes_defined(path))
    }
    assert not elsewhere, f"define these in dedupcore/errors.py: {elsewhere}"


def test_errors_lists_every_exception_it_defines() -> None:
    defined = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, BaseException)
    }
    assert set(errors.__all__) == defined
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert cls.__module__ == "dedupcore.errors"
        assert issubclass(cls, errors.DedupError), name


@pytest.mark.parametrize(
    ("module", "name"),
    [(module, name) for module, names in OLD_HOMES.items() for name in names],
)
def test_a_moved_exception_is_still_importable_where_it_was(module: str, name: str) -> None:
    mod = __import__(module, fromlist=[name])
    assert getattr(mod, name) is getattr(errors, name)


def test_missing_key_and_settings_errors_are_dedup_errors_and_value_errors() -> None:
    for cls in (errors.MissingKeyError, errors.SettingsError):
        assert issubclass(cls, errors.DedupError) and issubclass(cls, ValueError)


@pytest.mark.parametrize("name", errors.__all__)
def test_every_exception_of_errors_reaches_a_client_as_its_own_class(name: str) -> None:
    cls = getattr(errors, name)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(protocol.encode_error(4, cls("why")))
        header = b.recv(4)
        body = b""
        while len(body) < protocol.HEADER.unpack(header)[0]:
            body += b.recv(1 << 16)
    rid, status, payload = protocol.decode_response(body)
    assert (rid, status) == (4, Status.ERROR)
    exc = protocol.error_from_payload(payload)
    assert type(exc) is cls and str(exc) == "why"


def test_a_foreign_class_of_the_same_name_is_sent_as_dedup_error() -> None:
    class ConflictError(Exception):  # not dedupcore's
        pass

    body = protocol.encode_error(1, ConflictError("x"))[4:]
    _, _, payload = protocol.decode_response(body)
    assert payload["type"] == "DedupError"
    assert type(protocol.error_from_payload(payload)) is errors.DedupError


@pytest.mark.parametrize("module", ["dedupcore.client", "dedupcore.aio", "dedupcore"])
def test_the_clients_do_not_load_the_store(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "loaded = [m for m in ('lmdb', 'dedupcore.store', 'dedupcore.wal') if m in sys.modules]\n"
        "print(','.join(loaded))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "", f"import {module} loaded {out.stdout.strip()}"


def test_the_store_loads_on_first_use_of_dedupcore_dedup_store() -> None:
    code = (
        "import sys, dedupcore\n"
        "assert 'dedupcore.store' not in sys.modules\n"
        "from dedupcore import DedupStore\n"
        "from dedupcore.store import DedupStore as Real\n"
        "assert DedupStore is Real and 'DedupStore' in dir(dedupcore)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
