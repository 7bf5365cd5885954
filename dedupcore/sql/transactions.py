"""A SQL store's connection and the transaction loop on it: one deadline a call, retries.

:class:`Transactions` owns the store's one DB-API connection (made by the
store's factory on first use, dropped when it breaks: the next call makes
another), the lock that lets one call at a time use it, and the watchdog
(:mod:`dedupcore.sql.watchdog`). :meth:`Transactions.run` runs a body in one
transaction and commits it, or rolls it back and raises:

- the call has one :class:`~dedupcore.retry.Deadline` (the store's
  ``timeout``; docs/timeouts.md): waiting for the lock, connecting (in a
  thread the call stops waiting for: :func:`connect_within`), the driver's
  waits (``Dialect.arm``) and every retry's backoff get the time left;
- a deadlock or serialization failure (``Dialect.is_transient``: the
  server rolled the transaction back) runs it again, after a wait of the
  store's :class:`~dedupcore.retry.RetryPolicy` (:func:`retry_policy`), as
  does :class:`Retry`; :class:`Fallback` runs it again at once;
- any other driver error fails closed: :class:`UnavailableError` (a
  connection that broke is dropped), or :class:`RequestRefusedError` when
  the server refused the request's data, or :class:`SchemaError` when the
  table is missing. The store's own errors (a conflict, a stale token) roll
  back and propagate.

The first connection logs once what a committed claim survives on the
server (its durability settings), as a warning when a crash can lose one.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from dedupcore.errors import RequestRefusedError, SchemaError, UnavailableError
from dedupcore.retry import Deadline, RetryPolicy, current_deadline, deadline_scope
from dedupcore.sql.dialects import Dialect, dialect_of
from dedupcore.sql.watchdog import Watchdog

__all__ = ["Fallback", "Retry", "Transactions", "close_quietly", "connect_within", "retry_policy"]

log = logging.getLogger("dedupcore")

T = TypeVar("T")


class Retry(Exception):
    """The transaction must be run again (a row vanished between two statements)."""


class Fallback(Retry):
    """A plain INSERT found an existing key: run the transaction again, at once, the safe way."""


def retry_policy(retries: int) -> RetryPolicy:
    """The waits before a transaction runs again: ``retries`` of them, short.

    10 ms doubling up to 0.2 s, each 50..150 % of that: the nominal waits
    are 15 ms doubling up to 0.3 s, which the policy's jitter (2/3) cuts by
    up to two thirds. A deadlock is over when the server answers; the wait
    only spreads the retries of the transactions that collided.
    """
    return RetryPolicy(attempts=retries, initial=0.015, cap=0.3, multiplier=2.0, jitter=2 / 3)


def close_quietly(conn: Any) -> None:
    """Closes a connection that may be broken (and then fail to close)."""
    with contextlib.suppress(Exception):
        conn.close()


def connect_within(factory: Callable[[], Any], wait: float) -> Any:
    """``factory()``, given up after ``wait`` seconds (``TimeoutError``).

    The drivers' own connect timeouts are whole seconds (libpq: 2 at
    least), so the connect runs in a thread of its own that the call stops
    waiting for at its deadline; a connection that arrives after that is
    closed at once.
    """
    lock = threading.Lock()
    done = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            conn = factory()
        except BaseException as exc:
            box["error"] = exc
        else:
            with lock:
                if box.get("abandoned"):
                    close_quietly(conn)
                    return
                box["conn"] = conn
        done.set()

    if wait <= 0:
        raise TimeoutError("the call's deadline passed before connecting")
    threading.Thread(target=run, name="dedupcore-sql-connect", daemon=True).start()
    if not done.wait(wait):
        with lock:
            if "conn" not in box and "error" not in box:
                box["abandoned"] = True
                raise TimeoutError(f"no connection within the call's deadline ({wait:.3f} s)")
    if "error" in box:
        raise box["error"]
    return box["conn"]


class Transactions:
    """The connection of one store and the transactions on it (see the module docstring).

    ``dialect`` None: told from the first connection, which is then passed to
    ``on_dialect`` (that may refuse it with a ValueError). ``timeout``: the
    deadline of each call (None: none); ``hang_timeout``: seconds a
    transaction may wait on the server before its connection is cut, whatever
    the deadline (None: no such limit); ``table``: named in the error for a
    missing table.
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        dialect: Dialect | None,
        *,
        table: str,
        timeout: float | None,
        hang_timeout: float | None,
        retries: int,
        on_dialect: Callable[[Dialect], None],
    ) -> None:
        self.table = table
        self.timeout = timeout
        self.policy = retry_policy(retries)
        self.watchdog = None if hang_timeout is None and timeout is None else Watchdog(hang_timeout)
        #: Connects, retries, unavailability, refusals; the store adds its own counts.
        self.counts: Counter[str] = Counter()
        #: One call at a time on the connection (and the counters' lock).
        self.lock = threading.Lock()
        #: The open connection, None until the next call makes one.
        self.conn: Any = None
        self._connect = connect
        self._dialect = dialect
        self._on_dialect = on_dialect
        self._told_durability = False

    @property
    def dialect(self) -> Dialect:
        """The dialect (known once a connection has been made, if it was not given)."""
        if self._dialect is None:
            raise RuntimeError("the SQL dialect is not known before the first connection")
        return self._dialect

    def connection(self) -> Any:
        """The open connection, or a new one (call with :attr:`lock` held)."""
        if self.conn is not None:
            return self.conn
        deadline = current_deadline()
        try:
            if deadline is None or (self._dialect is not None and self._dialect.connects_locally):
                conn = self._connect()
            else:
                conn = connect_within(self._connect, deadline.budget())
        except Exception as exc:
            self.counts["unavailable"] += 1
            raise UnavailableError(f"cannot connect to the SQL authority: {exc}") from exc
        if self._dialect is None:
            try:
                self._dialect = dialect_of(conn)
            except ValueError:
                close_quietly(conn)
                raise
            self._on_dialect(self._dialect)
        d = self._dialect
        try:
            d.prepare(conn)
        except d.error_classes() as exc:
            close_quietly(conn)
            self.counts["unavailable"] += 1
            raise UnavailableError(f"cannot set up the SQL connection: {exc}") from exc
        self.counts["connects"] += 1
        self.conn = conn
        if not self._told_durability:
            self._told_durability = True
            self._tell_durability(conn)
        return conn

    def _guard(self, conn: Any) -> contextlib.AbstractContextManager[None]:
        """The watchdog over ``conn`` while it waits for the database.

        Inside a call with a deadline, the driver's own waits are given the
        time left first (``Dialect.arm``).
        """
        if self.watchdog is None:
            return contextlib.nullcontext()
        d = self.dialect
        deadline = current_deadline()
        if deadline is not None:
            d.arm(conn, deadline.budget())
        return self.watchdog.guard(d.socket_of(conn), None if deadline is None else deadline.at)

    def _tell_durability(self, conn: Any) -> None:
        """Logs once what committed claims survive: a warning when a crash can lose them."""
        d = self.dialect
        try:
            with self._guard(conn):
                cur = conn.cursor()
                try:
                    level, said = d.durability(cur)
                finally:
                    cur.close()
                conn.rollback()
        except d.error_classes() as exc:
            # Not fatal: a connection that is broken fails the call that needed it.
            log.info("SQL authority (%s): durability unknown: %s", d.name, exc)
            with contextlib.suppress(Exception):
                conn.rollback()
            return
        if level < 2:
            log.warning("SQL authority (%s) can lose committed claims: %s", d.name, said)
        else:
            log.info("SQL authority (%s) durability: %s", d.name, said)

    def close(self) -> None:
        """Closes the connection (a later call opens a new one)."""
        with self.lock:
            self.drop()

    def drop(self) -> None:
        """Closes and forgets the connection (call with :attr:`lock` held)."""
        if self.conn is not None:
            close_quietly(self.conn)
            self.conn = None

    def _rollback(self, conn: Any) -> None:
        """Rolls back; a connection that cannot is dropped."""
        try:
            conn.rollback()
        except Exception:
            self.drop()

    @contextlib.contextmanager
    def _locked(self, deadline: Deadline | None) -> Iterator[None]:
        """The lock (one call at a time on the connection), waited for until the call's
        deadline at most."""
        if deadline is None:
            self.lock.acquire()
        elif not self.lock.acquire(timeout=deadline.left()):
            raise UnavailableError(
                "SQL authority: another call of this store held its connection past this "
                f"call's timeout of {deadline.timeout:g} s"
            )
        try:
            yield
        finally:
            self.lock.release()

    def run(self, body: Callable[[Any], T], *, write: bool = True) -> T:
        """Runs ``body(cursor)`` in one transaction: commit, or roll back and raise.

        ``write=False``: a read, which may run without a transaction where the
        dialect allows (``autocommit_reads``). See the module docstring.
        """
        d = self.dialect
        errors = d.error_classes()
        with deadline_scope(self.timeout) as deadline, self._locked(deadline):
            attempt = 0
            while True:
                if deadline is not None and deadline.expired():
                    self.counts["unavailable"] += 1
                    raise UnavailableError(
                        f"SQL authority ({d.name}): no answer within the call's timeout "
                        f"of {deadline.timeout:g} s"
                    )
                conn = self.connection()
                autocommit = not write and d.autocommit_reads
                try:
                    if autocommit:
                        conn.autocommit = True  # a lone read: no BEGIN, no COMMIT
                    with self._guard(conn):
                        cur = conn.cursor()
                        try:
                            d.begin(cur, write)
                            out = body(cur)
                        finally:
                            cur.close()
                        conn.commit()
                    return out
                except Fallback:
                    self._rollback(conn)
                    continue  # not a retry: the same transaction without the shortcut
                except Retry:
                    self._rollback(conn)
                except errors as exc:
                    self._fail(conn, exc, give_up=attempt >= self.policy.attempts)
                except Exception:
                    self._rollback(conn)  # ConflictError, StaleTokenError, bugs
                    raise
                except BaseException:
                    self.drop()  # interrupted mid-statement: the session state is unknown
                    raise
                finally:
                    if autocommit and self.conn is conn:
                        try:
                            conn.autocommit = False
                        except Exception:
                            self.drop()
                attempt += 1
                time.sleep(self._backoff(attempt, deadline))

    def _fail(self, conn: Any, exc: BaseException, *, give_up: bool) -> None:
        """Ends a transaction the driver failed: raises, unless it is to run again."""
        d = self.dialect
        broken = d.is_broken(conn, exc)
        if broken:
            log.warning("SQL authority (%s): connection lost: %s", d.name, exc)
            self.drop()
        else:
            self._rollback(conn)
        if not broken and d.is_refused(exc):
            self.counts["refused"] += 1
            raise RequestRefusedError(
                f"SQL authority ({d.name}) refused the request: {exc}"
            ) from exc
        if not broken and d.is_missing_table(exc):
            raise SchemaError(
                f"the dedup table {self.table!r} does not exist on {d.name}: "
                "create it with `dedupcore sql init --url ...` or init_schema()"
            ) from exc
        if broken or give_up or not d.is_transient(exc):
            self.counts["unavailable"] += 1
            what = "connection lost" if broken else "error"
            raise UnavailableError(
                f"SQL authority ({d.name}) {what}; nothing was decided "
                f"(a COMMIT cut off may have applied): {exc}"
            ) from exc

    def _backoff(self, attempt: int, deadline: Deadline | None) -> float:
        """The wait before try ``attempt + 1``; UnavailableError when none is to come."""
        self.counts["retries"] += 1
        name = self.dialect.name
        if attempt > self.policy.attempts:
            self.counts["unavailable"] += 1
            raise UnavailableError(
                f"SQL authority ({name}): gave up after {self.policy.attempts} retries"
            )
        # random.random looked up at each call: a source fixed on the module applies.
        backoff = self.policy.delay(attempt - 1, random.random)
        if deadline is None:
            return backoff
        cut = deadline.retry_wait(backoff)
        if cut is None:  # too little of the call's time left to try again
            self.counts["unavailable"] += 1
            raise UnavailableError(
                f"SQL authority ({name}): gave up after {attempt} tries within "
                f"the call's timeout of {deadline.timeout:g} s"
            )
        return cut
