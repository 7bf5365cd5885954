"""Connections to Redis that keep the deadline of the call they run in (docs/timeouts.md).

A client from :func:`deadline_client` gives every connect, send and reply
read the time left of the current call (:func:`dedupcore.retry.deadline_scope`),
and starts its one retry on a fresh connection only while the deadline allows.
"""

from __future__ import annotations

import functools
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from dedupcore.retry import current_deadline, deadline_scope

__all__ = ["connect", "deadline_client"]

#: TCP keepalive of the connections from_url makes: probes after 30 s idle, every
#: 10 s, 3 unanswered ones end the connection (where the platform has the options).
_KEEPALIVE = {
    getattr(socket, name): value
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))
    if hasattr(socket, name)
}


# -- one deadline per call (docs/timeouts.md) ------------------------------------------

T = TypeVar("T")


class _DeadlineRetry(Retry):
    """redis-py's retry under the call's deadline (see :mod:`dedupcore.retry`).

    Outside a call with a deadline it is redis-py's own. Inside one, a
    retry starts only while :meth:`~dedupcore.retry.Deadline.retry_wait`
    allows it, and its backoff sleep is cut to the time left.
    """

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        deadline = current_deadline()
        if deadline is None:
            if is_retryable is None and not with_failure_count:
                return super().call_with_retry(do, fail)  # (redis-py 5 has only these two)
            return super().call_with_retry(
                do, fail, is_retryable=is_retryable, with_failure_count=with_failure_count
            )
        self._backoff.reset()  # type: ignore[no-untyped-call]
        failures = 0
        while True:
            try:
                return do()
            except self._supported_errors as error:
                if is_retryable is not None and not is_retryable(error):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                if 0 <= self._retries < failures:
                    raise
                wait = deadline.retry_wait(self._backoff.compute(failures))
                if wait is None:
                    raise  # too little time left for another attempt
                if wait > 0:
                    time.sleep(wait)


class _DeadlineConnection:
    """Mixed into the connection class of the clients :meth:`RedisStore.from_url` makes.

    Inside a call with a deadline, every wait of the connection gets the
    time left (at most its own ``socket_connect_timeout`` or
    ``socket_timeout``): the TCP connect, each send and each reply read.
    With no time left an attempt fails at once with redis-py's
    ``TimeoutError`` (a reply already asked for disconnects the connection,
    as a read timeout does). Outside such a call it is redis-py's own.
    """

    _sock: Any
    socket_timeout: float | None
    socket_connect_timeout: float | None

    def _connect(self) -> Any:
        deadline = current_deadline()
        if deadline is None:
            return super()._connect()  # type: ignore[misc]
        wait = deadline.budget(self.socket_connect_timeout)
        if wait <= 0:
            raise TimeoutError("the call's deadline passed before connecting")
        own = self.socket_connect_timeout
        self.socket_connect_timeout = wait
        try:
            return super()._connect()  # type: ignore[misc]
        finally:
            self.socket_connect_timeout = own

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        deadline = current_deadline()
        if deadline is None:
            super().send_packed_command(command, check_health)  # type: ignore[misc]
            return
        if not self._sock:
            self.connect_check_health(check_health=False)  # type: ignore[attr-defined]
        wait = deadline.budget(self.socket_timeout)
        if wait <= 0:
            raise redis.TimeoutError("Timeout writing to socket: the call's deadline passed")
        sock = self._sock
        sock.settimeout(wait)
        try:
            super().send_packed_command(command, check_health)  # type: ignore[misc]
        finally:
            if self._sock is sock:  # still connected: its own timeout for later calls
                sock.settimeout(self.socket_timeout)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        deadline = current_deadline()
        if deadline is not None and "timeout" not in kwargs:
            wait = deadline.budget(self.socket_timeout)
            if wait <= 0:
                if kwargs.get("disconnect_on_error", True):
                    self.disconnect()  # type: ignore[attr-defined]
                raise redis.TimeoutError("Timeout reading: the call's deadline passed")
            kwargs["timeout"] = wait
        return super().read_response(*args, **kwargs)  # type: ignore[misc]


def deadline_client(url: str, timeout: float, **options: Any) -> Any:
    """A ``redis.Redis`` on ``url`` whose waits keep the deadline of the current call.

    Its connections give every connect, send and reply read the time left
    of the call they run in (:func:`dedupcore.retry.deadline_scope`), and
    its one retry on a fresh connection starts only while the deadline
    allows (docs/timeouts.md). ``timeout`` is each wait's cap (the
    ``socket_timeout`` and ``socket_connect_timeout``); ``options`` (any
    redis-py client argument) win over these defaults.
    """
    kwargs: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": _DeadlineRetry(ExponentialBackoff(cap=0.5, base=0.05), 1),
        **options,
    }
    client = redis.Redis.from_url(url, **kwargs)
    # Nothing is connected yet: every connection of the pool gets the deadline.
    pool = client.connection_pool
    pool.connection_class = _with_deadline(pool.connection_class)
    return client


@functools.cache
def _with_deadline(connection_class: type[Any]) -> type[Any]:
    """``connection_class`` with :class:`_DeadlineConnection` mixed in (once per class)."""
    if issubclass(connection_class, _DeadlineConnection):
        return connection_class
    return type(f"Deadline{connection_class.__name__}", (_DeadlineConnection, connection_class), {})


def connect(
    url: str, timeout: float, *, cluster: bool = False, options: dict[str, Any] | None = None
) -> Any:
    """A client on ``url`` whose waits keep the current call's deadline, with TCP keepalive.

    ``timeout`` caps each wait (connect, send, reply); ``options`` (any redis-py
    client argument) win over these defaults. ``cluster``: the URL is one node
    of a Redis Cluster, whose client reads the slot map here, under a deadline
    of ``timeout``; a plain client sends nothing yet. redis-py's errors pass
    through (the store says what they mean).
    """
    kwargs: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "socket_keepalive": True,
    }
    if cluster:
        # The cluster client gives each node's client its own connection pool.
        tls = url.lower().startswith("rediss://")
        kwargs["connection_class"] = _with_deadline(
            redis.SSLConnection if tls else redis.Connection
        )
    else:
        kwargs["socket_keepalive_options"] = _KEEPALIVE
    kwargs.update(options or {})
    with deadline_scope(timeout):  # a cluster client reads the slot map here
        if cluster:
            return RedisCluster.from_url(url, **kwargs)
        return deadline_client(url, timeout, **kwargs)
