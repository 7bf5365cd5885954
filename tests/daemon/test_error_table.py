"""Every exception class the store raises reaches a client as the same class."""

from __future__ import annotations

import socket

import pytest

from dedupcore import errors
from dedupcore.api import InProgressError
from dedupcore.daemon import protocol
from dedupcore.daemon.protocol import FrameError, Status
from dedupcore.store import StoreLockedError
from dedupcore.wal import WalFailedError
from tests.support.daemon import read_frame

ERROR_CLASSES = (
    errors.DedupError,
    errors.ConflictError,
    errors.StaleTokenError,
    errors.UnavailableError,
    errors.CorruptFileError,
    errors.UnsupportedFormatError,
    errors.SchemaError,
    errors.SocketPathError,
    errors.BatchTooLargeError,
    StoreLockedError,
    WalFailedError,
    InProgressError,
    FrameError,
    ValueError,
    TypeError,
)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_store_error_reaches_the_client_as_its_own_class(cls: type[BaseException]) -> None:
    # Encoded by the daemon's encoder, sent over a socket, raised by the client.
    reply = protocol.encode_error(9, cls("why"))
    a, b = socket.socketpair()
    with a, b:
        a.sendall(reply)
        rid, status, payload = protocol.decode_response(read_frame(b))
    assert (rid, status) == (9, Status.ERROR)
    exc = protocol.error_from_payload(payload)
    assert type(exc) is cls and str(exc) == "why"
