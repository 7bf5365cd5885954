"""From a request's op and arguments to the store's call (docs/daemon.md).

:class:`Dispatcher` runs PING, CLAIM_MANY, COMPLETE_MANY, RELEASE_MANY, EXTEND_MANY
and GET on the store the daemon serves. Every store is served by :meth:`Dispatcher.call`
in the daemon's thread pool; its reply is kept within the frame limit by the
store itself when it is a :class:`~dedupcore.api.deferred.DeferredStore`, else
by reading the stored results of the batch's keys first (:class:`Gate`). Such a
store decides without waiting for its log (:class:`Abilities`, the embedded store)
has its claims, completions, releases and renewals decided on the event loop
(:meth:`Dispatcher.decide_sync`, :meth:`Dispatcher.decide`, a large claim batch
in slices) and only the wait for the log handed to the group commit
(:class:`~dedupcore.daemon.commit.Committer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import dedupcore._engine as _engine
from dedupcore.api import ChangeBatch, ClaimAPI, ClaimBatch, ExtendBatch, check_fingerprints
from dedupcore.api.deferred import (
    FORM_CHECK,
    FORM_CLAIMS,
    FORM_COLUMNS,
    Admit,
    DeferredStore,
    bounded_reply,
)
from dedupcore.daemon import protocol
from dedupcore.daemon.admission import SmallRequests, within
from dedupcore.daemon.commit import Committer
from dedupcore.daemon.protocol import FrameError, Op
from dedupcore.daemon.waiters import Waiters
from dedupcore.errors import BatchTooLargeError

_T = TypeVar("_T")

__all__ = [
    "CHANGE_OPS",
    "DEFERRED_OPS",
    "INLINE_OPS",
    "REPLY_FIXED",
    "ROW_FIXED",
    "SLICE_ABOVE",
    "SLICE_KEYS",
    "SMALL_FIRST_SECONDS",
    "Abilities",
    "Dispatcher",
    "Gate",
]

#: Ops answered on the event loop itself (they neither block nor touch the log).
INLINE_OPS = frozenset({Op.PING})
#: Size of a CLAIM_MANY reply around its rows: frame header, [id, status, list header].
REPLY_FIXED = 32
#: Upper bound of one claim row without its result: [outcome, token, result, exact, takeover].
ROW_FIXED = 32
#: How long a large batch's next slice waits for the small requests in flight
#: to be answered, at most: under a steady stream of them batches still progress.
SMALL_FIRST_SECONDS = 0.005
#: Keys of one slice: about a millisecond of deciding. One slice of all the large
#: batches in flight is decided per pass of the event loop (they take turns), so a
#: request of another connection waits behind at most one slice per pass.
SLICE_KEYS = 1024
#: A CLAIM_MANY of more keys than this is decided on the event loop in slices of
#: SLICE_KEYS keys, with other connections' requests served between two slices:
#: any batch larger than one slice, so that no step of the loop decides more. (It
#: was 8192: four clients sending batches of 8192 keys then held single claims to
#: 36-39 ms p50 and 323-355 ms p99; docs/performance.md, "The daemon".)
SLICE_ABOVE = SLICE_KEYS
#: Ops the embedded store decides on the event loop (then only the commit is waited
#: for; a renewal is kept in memory and has none).
DEFERRED_OPS = frozenset({Op.CLAIM_MANY, Op.COMPLETE_MANY, Op.RELEASE_MANY, Op.EXTEND_MANY})
#: Completions and releases: large ones are decided in slices (change_sliced); they
#: wake the keys' waiters.
CHANGE_OPS = frozenset({Op.COMPLETE_MANY, Op.RELEASE_MANY})
#: The ops whose first batch in a namespace gives it its id (an LMDB write).
_NAMING_OPS = frozenset({Op.CLAIM_MANY, Op.COMPLETE_MANY, Op.RELEASE_MANY})


@dataclass(frozen=True)
class Abilities:
    """What the daemon reads of its store once, from what the store declares.

    ``decides_on_loop``: the store is a :class:`~dedupcore.api.deferred.DeferredStore`
    (claims, completions and releases decided now, the log's commit waited for
    later, the reply bounded before anything changes). ``unsynced_commits``: a
    commit is a write to the OS, no ``fdatasync``. ``max_result_bytes``: the
    largest result it keeps (its ``limits``).
    """

    decides_on_loop: bool = False
    unsynced_commits: bool = False
    max_result_bytes: int | None = None

    @classmethod
    def of(cls, store: object) -> Abilities:
        limit = store.limits.max_result_bytes if isinstance(store, ClaimAPI) else None
        if isinstance(store, DeferredStore):
            return cls(True, store.unsynced_commits, limit)
        return cls(max_result_bytes=limit)


class Gate:
    """Two kinds of callers, each sharing the gate with its own kind only.

    Claim batches whose reply size was bounded by reading their keys' results
    first hold one side; completions (which store results) hold the other,
    so no result can grow between the reading and the claim.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = [0, 0]
        self._waiting = [0, 0]

    @contextlib.contextmanager
    def side(self, side: int) -> Iterator[None]:
        other = 1 - side
        with self._cond:
            self._waiting[side] += 1
            # Wait while the other side is in, or while it waits and this side is
            # in (so a steady stream of one kind cannot starve the other).
            while self._active[other] or (self._waiting[other] and self._active[side]):
                self._cond.wait()
            self._waiting[side] -= 1
            self._active[side] += 1
        try:
            yield
        finally:
            with self._cond:
                self._active[side] -= 1
                self._cond.notify_all()


#: The two sides of the gate: claims whose reply was bounded by reading ahead, completions.
CLAIMS, COMPLETES = 0, 1


class Dispatcher:
    """Runs requests' ops on one store (see the module docstring).

    ``counters`` is the daemon's (the sliced batches are counted in it), ``small``
    the small requests in flight (a large batch's slices let them go first).
    """

    def __init__(
        self,
        store: Any,
        *,
        max_frame: int,
        request_timeout: float,
        counters: dict[str, int],
        small: SmallRequests,
    ) -> None:
        self.store = store
        self.abilities = Abilities.of(store)
        self.max_frame = max_frame
        self.request_timeout = request_timeout
        self.counters = counters
        self.small = small
        #: The group commit of the requests decided on the loop (:meth:`start`).
        self.committer: Committer | None = None
        self._gate = Gate()
        self._max_result = self.abilities.max_result_bytes or max_frame
        self._slice_turn = asyncio.Lock()  # one large batch's slice per pass of the loop
        #: The WAIT requests waiting, when the daemon wakes them: told of every completion,
        #: release and renewal decided on the loop.
        self.waiters: Waiters | None = None
        #: Namespaces being recorded, with the requests that wait for them (_name).
        self._naming: dict[str, _Naming] = {}
        self._known: set[str] = set()  # namespaces the store has an id for

    def start(
        self, loop: asyncio.AbstractEventLoop, others_in_flight: Callable[[int], bool]
    ) -> None:
        """Starts the group commit, when the store decides on the loop."""
        if self.abilities.decides_on_loop and self.committer is None:
            self.committer = Committer(self.store, loop, others_in_flight)

    def close(self) -> None:
        """Finishes the commits queued and stops the commit thread (blocks)."""
        if self.committer is not None:
            self.committer.close()

    def decides_now(self, op: Op) -> bool:
        """Whether ``op`` is decided on the event loop (then only its commit is waited for)."""
        return self.committer is not None and op in DEFERRED_OPS

    def knows_namespace(self, op: Op, args: dict[str, Any] | protocol.OneKey) -> bool:
        """Whether the store can decide a request without first giving its namespace
        an id: the namespace has one (and no earlier request waits for it), the op
        names none, or the request's own checks refuse what it names. A namespace's
        first requests are not decided at once: :meth:`decide` has the store record
        the namespace in a worker thread first, as that LMDB write can wait seconds
        for a checkpoint's transaction (docs/daemon.md, "A namespace's first batch")."""
        if op not in _NAMING_OPS:
            return True
        ns = _namespace_of(args)
        if type(ns) is not str:
            return True
        if ns in self._naming:
            return False  # behind the requests that wait for it, in their order
        if ns in self._known:
            return True
        try:
            known = bool(self.store.has_namespace(ns))
        except (TypeError, ValueError):
            return True
        if known:
            self._known.add(ns)  # an id is never taken back
        return known

    async def _name(self, op: Op, args: dict[str, Any] | protocol.OneKey) -> None:
        """Waits until a request's namespace has its id, recorded off the event loop.

        The requests that wait for one namespace form a chain: each goes on once the
        one before it has (its decision is made in that same step of the loop), so
        they are decided in the order they came, and one that comes while the chain
        is not through joins its end."""
        if self.knows_namespace(op, args):
            return
        ns = _namespace_of(args)
        naming = self._naming.get(ns)
        if naming is None:
            recorded = asyncio.ensure_future(asyncio.to_thread(self.store.add_namespace, ns))
            naming = self._naming[ns] = _Naming(recorded)
        ahead, mine = naming.last, asyncio.get_running_loop().create_future()
        naming.last = mine
        naming.waiting += 1
        try:
            # Shielded: a request whose connection goes away stops no one ahead of it.
            await asyncio.shield(ahead)
            naming.recorded.result()  # the write's error, for every request that waited
        finally:
            naming.waiting -= 1
            if not naming.waiting and self._naming.get(ns) is naming:
                del self._naming[ns]
            _pass_on(ahead, mine)

    @staticmethod
    def sliced(op: Op, args: dict[str, Any] | protocol.OneKey) -> bool:
        """Whether a request is a claim, completion or release of more than
        SLICE_ABOVE keys: :meth:`decide` decides it in slices, in a task of its own,
        and never in one step (:meth:`decide_sync`)."""
        if type(args) is not dict:  # one key (protocol.OneKey)
            return False
        if op is Op.CLAIM_MANY:
            many = args.get("keys")
        elif op in CHANGE_OPS:
            many = args.get("items")
        else:
            return False
        return (type(many) is list or type(many) is protocol.FrameItems) and len(many) > SLICE_ABOVE

    async def durable(self, durable: asyncio.Future[None] | None) -> None:
        """Waits for a commit (request_timeout); raises what it raised."""
        if durable is None:
            return
        if not durable.done():
            await within(durable, self.request_timeout)
        durable.result()

    async def decide(self, op: Op, args: dict[str, Any]) -> Any:
        """Decides a claim, completion or release on the event loop, then waits (without
        blocking the loop) until the log is durable through every record the answer
        depends on: nothing is answered before that (docs/daemon.md)."""
        await self._name(op, args)
        if self.sliced(op, args):
            if op is Op.CLAIM_MANY:
                options = _claim_options(args)
                columns = bool(args.get(protocol.COLUMNS_ARG))
                result, lsn = await self.claim_sliced(args["keys"], options, columns)
                await self.durable(self.commit(lsn))
                return result
            await self.durable(await self.change_sliced(op, args, args["items"]))
            return None
        result, durable = self.decide_sync(op, args)
        await self.durable(durable)
        return result

    def commit(self, lsn: int, gather: bool = False) -> asyncio.Future[None] | None:
        """The commit through ``lsn`` (None when there is nothing to commit)."""
        if not lsn:
            return None
        assert self.committer is not None
        return self.committer.wait(lsn, gather=gather)

    def decide_sync(
        self, op: Op, args: dict[str, Any] | protocol.OneKey, gather: bool = False
    ) -> tuple[Any, asyncio.Future[None] | None]:
        """Decides a claim (of at most SLICE_ABOVE keys), completion or release now:
        (the answer, the commit it waits for, or None). A one-key request read
        natively (:class:`protocol.OneKey`) is checked as the same args would be, and
        its claim answered with a :class:`protocol.OneClaim` where it can."""
        store: Any = self.store
        if isinstance(args, protocol.OneKey):
            if op is Op.CLAIM_MANY:
                one = ClaimBatch([args.key], namespace=args.namespace, limits=store.limits)
                answer, lsn = store.claim_deferred(
                    one, form=FORM_COLUMNS, admit=self.reply_bound(one)
                )
                return protocol.one_key_payload(answer), self.commit(lsn, gather)
            return self._decide_change(self._changes(op, args.namespace, [args.item(op)]), gather)
        if op is Op.CLAIM_MANY:
            ns, keys = args.get("ns"), args.get("keys")
            options: dict[str, Any]
            if (
                type(ns) is str
                and type(keys) is list
                and args.get("lease") is None
                and args.get("owner") is None
                and args.get("fps") is None
            ):
                # The plain claim (what the clients send for claim()): its arguments
                # need no checking of their types here.
                options = {"namespace": ns}
            else:
                _arg(args, "ns", str)  # checked first, as for every op
                keys = _arg(args, "keys", list)
                options = _claim_options(args)
            batch = ClaimBatch(keys, limits=store.limits, **options)
            form = FORM_COLUMNS if args.get(protocol.COLUMNS_ARG) else FORM_CLAIMS
            answer, lsn = store.claim_deferred(batch, form=form, admit=self.reply_bound(batch))
            if form == FORM_COLUMNS:
                return protocol.columns_payload(answer), self.commit(lsn, gather)
            return [protocol.claim_row(c) for c in answer], self.commit(lsn, gather)
        if op is Op.EXTEND_MANY:
            renewal = self.extension(args, store.limits)
            store._extend_batch(renewal)
            if self.waiters is not None and self.waiters.count:
                self.waiters.renewed(renewal.digests)
            return None, None  # in memory only: no commit to wait for
        return self._decide_change(self.change(op, args), gather)

    def _decide_change(
        self, change: ChangeBatch, gather: bool
    ) -> tuple[None, asyncio.Future[None] | None]:
        store: Any = self.store
        durable = self.commit(store.change_deferred(change), gather)
        if self.waiters is not None:
            self.waiters.changed(change.digests, durable)
        return None, durable

    def change(self, op: Op, args: dict[str, Any]) -> ChangeBatch:
        """The checked batch of a COMPLETE_MANY or RELEASE_MANY request."""
        return self._changes(op, _arg(args, "ns", str), _arg(args, "items", list))

    def _changes(self, op: Op, ns: str, items: list[Any]) -> ChangeBatch:
        return ChangeBatch(
            items, namespace=ns, completing=op is Op.COMPLETE_MANY, limits=self.store.limits
        )

    @staticmethod
    def extension(args: dict[str, Any], limits: Any) -> ExtendBatch:
        """The checked batch of an EXTEND_MANY request."""
        ns = _arg(args, "ns", str)
        items = _arg(args, "items", list)
        lease = _optional(args, "lease", (int, float))
        return ExtendBatch(items, namespace=ns, lease=lease, limits=limits)

    def reply_bound(self, batch: ClaimBatch, limit: int | None = None) -> Admit:
        """What refuses a claim batch whose reply would pass the frame (or ``limit``
        bytes of stored results)."""
        if limit is None:
            return bounded_reply(len(batch), self.max_frame - REPLY_FIXED, ROW_FIXED + 8)
        return bounded_reply(len(batch), limit, 0)

    async def claim_sliced(
        self, keys: list[Any] | protocol.FrameItems, options: dict[str, Any], columns: bool
    ) -> tuple[Any, int]:
        """A large claim batch in slices of SLICE_KEYS keys, yielding to the loop between
        two slices so that other connections are served meanwhile.

        Every slice is first checked (decided, nothing applied): a bad key, a fingerprint
        conflict or an answer over the frame limit refuses the whole batch before any of
        it is claimed. Then the slices are claimed in order; a key repeated across slices
        is IN_PROGRESS in the later one, as within one batch. A conflict that other
        clients create between the check and the claim of a later slice can still refuse
        the batch after its earlier slices were claimed (they stay claimed, as after a
        lost reply). Keys left in their frame (:class:`protocol.FrameItems`) are
        decoded a slice at a time, in the check pass."""
        store: Any = self.store
        count = _slices(keys)
        fps = options.pop("fingerprints")
        if fps is None:
            fp_slices: list[Any] = [None] * count
        else:
            check_fingerprints(fps, len(keys))
            fp_slices = [_slice(fps, i) for i in range(count)]
        rows_bytes = REPLY_FIXED + (ROW_FIXED + 8) * len(keys)
        if rows_bytes > self.max_frame:
            raise BatchTooLargeError(
                f"the answer to a claim of {len(keys)} keys would pass {self.max_frame} bytes "
                "(the frame limit); nothing was claimed: split the batch"
            )
        self.counters["sliced_batches"] += 1
        budget = self.max_frame - rows_bytes
        held: list[int] = []  # bytes of stored results each slice's answer carries
        batches: list[ClaimBatch] = []

        def check(i: int) -> None:
            part = _slice(keys, i)
            batch = ClaimBatch(part, fingerprints=fp_slices[i], limits=store.limits, **options)
            size, _ = store.claim_deferred(
                batch, form=FORM_CHECK, admit=self.reply_bound(batch, budget - sum(held))
            )
            held.append(size)
            batches.append(batch)

        rows: list[list[Any]] = []
        cols = protocol.ClaimColumns()

        def claim(i: int) -> int:
            batch = batches[i]
            # Later slices keep the room the checked answers of the others need.
            room = budget - sum(held[:i]) - sum(held[i + 1 :])
            answer, lsn = store.claim_deferred(
                batch,
                form=FORM_COLUMNS if columns else FORM_CLAIMS,
                admit=self.reply_bound(batch, room),
            )
            if columns:
                cols.add_columns(answer)
            else:
                rows.extend(protocol.claim_row(c) for c in answer)
            return int(lsn)

        await self._by_slice(count, check)
        lsn = max(await self._by_slice(len(batches), claim, applied=True))
        return (cols.payload() if columns else rows), lsn

    async def change_sliced(
        self, op: Op, args: dict[str, Any], items: list[Any] | protocol.FrameItems
    ) -> asyncio.Future[None] | None:
        """A large completion or release in slices of SLICE_KEYS items, yielding to the
        loop between two slices as :meth:`claim_sliced` does; the commit it waits for.

        Every slice is first checked (decided, nothing changed): a bad item or a stale
        token anywhere refuses the whole batch before any of it changes. A key named
        in two slices (which a release refuses, and which a completion takes once)
        is decided with the whole batch in one step instead, as a batch of one slice
        is. A stale token that other clients cause between the check and the change
        of a later slice can still refuse the batch after its earlier slices changed
        (they stay changed, as after a lost reply). Items left in their frame
        (:class:`protocol.FrameItems`) are decoded a slice at a time, in the check
        pass."""
        store: Any = self.store
        ns = _arg(args, "ns", str)
        self.counters["sliced_batches"] += 1
        parts: list[ChangeBatch] = []
        seen: set[bytes] = set()
        repeated = False

        def check(i: int) -> None:
            nonlocal repeated
            part = self._changes(op, ns, _slice(items, i))
            digests = _engine.split_digests(part.digests)
            if not repeated:
                before = len(seen)
                seen.update(digests)
                repeated = len(seen) != before + len(digests)
            store.change_deferred(part, check=True)
            parts.append(part)

        await self._by_slice(_slices(items), check)
        if repeated:
            async with self._turn():
                whole = items.whole() if isinstance(items, protocol.FrameItems) else items
                return self._decide_change(self._changes(op, ns, whole), False)[1]
        lsn = max(
            await self._by_slice(
                len(parts), lambda i: int(store.change_deferred(parts[i])), applied=True
            )
        )
        durable = self.commit(lsn)
        if self.waiters is not None:
            self.waiters.changed(b"".join(part.digests for part in parts), durable)
        return durable

    async def _by_slice(
        self, count: int, step: Callable[[int], _T], applied: bool = False
    ) -> list[_T]:
        """``step(i)`` for each of a large batch's ``count`` slices in order, one per
        turn (:meth:`_turn`): the check pass of :meth:`claim_sliced` and
        :meth:`change_sliced` (nothing changes), or, ``applied``, the pass that
        changes the store (counted in ``batch_slices``)."""
        out: list[_T] = []
        for i in range(count):
            async with self._turn():
                out.append(step(i))
                if applied:
                    self.counters["batch_slices"] += 1
        return out

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        """One slice of one large batch: the batches in flight take turns (the lock
        wakes its waiters in order, one per pass of the loop), every other request
        that became ready meanwhile is served before the next slice, and a small
        request read meanwhile is answered first (up to SMALL_FIRST_SECONDS): its
        decision, its commit and its reply then wait for no slice."""
        async with self._slice_turn:
            if self.small.count:
                self.counters["slices_held_for_small"] += 1
                await self.small.drained(SMALL_FIRST_SECONDS)
            yield
            await asyncio.sleep(0)

    def call(self, op: Op, args: dict[str, Any]) -> Any:
        """Runs a request the ordinary way: the store's own call, in the daemon's thread
        pool (a ping on the event loop). STATS is the server's (it adds its counters)."""
        if op is Op.PING:
            return "pong"
        ns = _arg(args, "ns", str)
        if op is Op.CLAIM_MANY:
            keys = _arg(args, "keys", list)
            options = _claim_options(args)
            fixed = REPLY_FIXED + ROW_FIXED * len(keys)
            if self.abilities.decides_on_loop:
                # The store sizes the answer after deciding and before applying
                # anything: no read-ahead, no gate.
                deferred: Any = self.store
                batch = ClaimBatch(keys, limits=deferred.limits, **options)
                claims, lsn = deferred.claim_deferred(batch, admit=self.reply_bound(batch))
                deferred.wait_durable(lsn)
            elif fixed + len(keys) * (self._max_result + 8) <= self.max_frame:
                claims = self.store.claim_many(keys, **options)
            else:
                # The reply could exceed a frame if enough keys are duplicates with
                # large results: count the results they hold now, with completions
                # held off until the claim is done, and refuse before applying.
                with self._gate.side(CLAIMS):
                    self.check_reply_bound(keys, ns, fixed)
                    claims = self.store.claim_many(keys, **options)
            if args.get(protocol.COLUMNS_ARG):
                return protocol.claim_columns(claims)
            return [protocol.claim_row(c) for c in claims]
        if op is Op.COMPLETE_MANY:
            items = _arg(args, "items", list)
            with self._gate.side(COMPLETES):
                self.store.complete_many(items, namespace=ns)
            return None
        if op is Op.RELEASE_MANY:
            self.store.release_many(_arg(args, "items", list), namespace=ns)
            return None
        if op is Op.EXTEND_MANY:
            lease = _optional(args, "lease", (int, float))
            self.store.extend_many(_arg(args, "items", list), namespace=ns, lease=lease)
            return None
        if op is Op.GET:
            return protocol.record_map(
                self.store.get(_arg(args, "key", (bytes, str)), namespace=ns)
            )
        raise FrameError(f"op {op!r} is not served")

    def check_reply_bound(self, keys: list[Any], ns: str, fixed: int) -> None:
        """BatchTooLargeError if the claim reply for ``keys`` could exceed a frame."""
        sizes: dict[Any, int] = {}
        total = fixed
        for key in keys:
            size = sizes.get(key)
            if size is None:
                try:
                    record = self.store.get(key, namespace=ns)
                except (TypeError, ValueError):
                    record = None  # a bad key: claim_many names it
                size = 0
                if record is not None and record.result is not None:
                    size = 8 + protocol.packed_len(record.result)
                sizes[key] = size
            total += size
            if total > self.max_frame:
                raise BatchTooLargeError(
                    f"a claim of these {len(keys)} keys could be answered with more than "
                    f"{self.max_frame} bytes (the frame limit), counting the stored results "
                    "of the keys already done; nothing was claimed: split the batch"
                )


def _slices(elements: list[Any] | protocol.FrameItems) -> int:
    """The number of slices a large batch's keys or items are decided in."""
    if isinstance(elements, protocol.FrameItems):
        return elements.parts
    return -(-len(elements) // SLICE_KEYS)


def _slice(elements: list[Any] | protocol.FrameItems, i: int) -> list[Any]:
    """Slice ``i`` of a large batch's keys, fingerprints or items: SLICE_KEYS of
    them, decoded from the frame when they were left in it."""
    if isinstance(elements, protocol.FrameItems):
        return elements.part(i)
    return elements[i * SLICE_KEYS : (i + 1) * SLICE_KEYS]


def _namespace_of(args: dict[str, Any] | protocol.OneKey) -> Any:
    """The namespace a request names (None when it names none), unchecked."""
    return args.namespace if isinstance(args, protocol.OneKey) else args.get("ns")


def _arg(args: dict[str, Any], name: str, kind: Any) -> Any:
    if name not in args:
        raise FrameError(f"missing argument {name!r}")
    value = args[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"argument {name!r} has type {type(value).__name__}")
    return value


def _optional(args: dict[str, Any], name: str, kind: Any) -> Any:
    if args.get(name) is None:
        return None
    return _arg(args, name, kind)


def _claim_options(args: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a CLAIM_MANY request for the store's claim methods."""
    return {
        "namespace": _arg(args, "ns", str),
        "lease": _optional(args, "lease", (int, float)),
        "owner": _optional(args, "owner", (bytes, str)),
        "fingerprints": _optional(args, "fps", list),
    }


class _Naming:
    """A namespace being recorded: the write, the last request waiting for it (each
    request's future is done once it has gone on) and how many wait."""

    __slots__ = ("last", "recorded", "waiting")

    def __init__(self, recorded: asyncio.Future[None]) -> None:
        self.recorded = recorded
        self.last: asyncio.Future[None] = recorded
        self.waiting = 0


def _pass_on(ahead: asyncio.Future[None], mine: asyncio.Future[None]) -> None:
    """Lets the request after this one go on: now, or once the one ahead of it has
    (when this one gave up waiting)."""

    def go(_: object = None) -> None:
        if not mine.done():
            mine.set_result(None)

    if ahead.done():
        go()
    else:
        ahead.add_done_callback(go)
