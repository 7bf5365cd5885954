"""Redis as the dedup authority: claims decided atomically by Lua scripts on the server.

Each key is a Redis hash ``<prefix>:{<namespace>:<bucket>}:<key>`` with fields
``s`` (state: 1 PROCESSING, 2 PROCESSED, 3 RELEASED), ``t`` (fencing token),
``o`` (owner), ``f`` (fingerprint), ``d`` (lease deadline), ``c`` and ``u``
(created and last changed; all three in ms of the Redis server's clock) and
``r`` (msgpack result). A new record has only ``s``, ``t``, ``d``, ``c`` and
the ``o`` and ``f`` it was claimed with (absent, or empty after a takeover,
mean none); ``u`` is absent until its first change (updated = created) and
``r`` until it is completed or released. A claim of a RELEASED key replaces
the tombstone with a new record whose token continues the old one.

The NX create, the lease, owner, token and fingerprint checks and the TTL
are one script call per batch (per cluster slot), so racing consumers on any
number of hosts see exactly one NEW per key. Every script checks all its keys
before it writes anything, and a batch split over several calls is checked
as a whole first: a fingerprint conflict or a stale token changes nothing.
The fingerprint check is skipped for a call whose keys have no fingerprints.

**Redis Cluster.** The bucket in the hash tag (``jump_hash`` of the key
into ``buckets``) puts each key in one of ``buckets`` slots per namespace,
spread over the cluster's masters. A batch is grouped by slot: one script
call per slot (at most 1000 keys each), pipelined, so one round trip per
master. On a single server a batch is one script call per 1000 keys.
Scripts are called by ``EVALSHA``;
a server that does not know a script (restarted, failed over, a new node)
gets it by ``SCRIPT LOAD``, which the cluster client sends to every master.
Settings are read from every node (``CONFIG GET`` per node). When a master
cannot answer, calls that need it raise :class:`UnavailableError`; keys on
the other masters keep working as long as the cluster client can route to
them (with ``cluster-require-full-coverage yes``, the default, the
surviving masters refuse every command once the cluster marks the failed
master down).

**Demotion.** Redis expires a record ``exact_window`` after its last
change; :meth:`RedisStore.expiring` lists the PROCESSED keys of a namespace
whose TTL ends soon (``SCAN`` of every master), so that a demoter can copy
them into the cold archive first.

**Connecting.** The constructor sends nothing (redis-py connects lazily),
so a store opens while its server is down; the first call that reaches the
server then checks it: ``maxmemory-policy`` (eviction would forget
processed keys, so a server that can evict them is refused with
:class:`~dedupcore.errors.DedupError` unless ``allow_eviction=True``), the
persistence settings (a server that can lose acknowledged claims on a
restart is logged as a warning, with :meth:`RedisStore.durability`'s
words) and each master's ``run_id``. A server without a script that the
store loaded before (``NOSCRIPT``) has its ``run_id`` read again: a changed
one means it restarted, which is logged as a warning (records it did not
persist are gone: their keys come back NEW) and counted in ``stats()``.

**Timeouts.** A store from :meth:`RedisStore.from_url` gives each call one
deadline, ``timeout`` (5 s) from the call's start: the connect, every send
and every reply read get the time left, never a fresh full ``timeout``, and
the one retry on a fresh connection (after a lost connection or a timeout)
starts only while a tenth of ``timeout`` is left. So a server that stops
answering fails a call with :class:`~dedupcore.errors.UnavailableError`
within ``timeout``, retries and reconnects included (docs/timeouts.md). A
call cut off at its deadline may still run on the server later (its
scripts are safe to run twice: see ``_run``). A client you pass yourself
keeps its own timeouts and retries.

**Bad input** is a ``ValueError``/``TypeError`` raised before anything is
sent: keys, namespace, owner, fingerprints, tokens, leases (at most
:data:`~dedupcore.config.MAX_LEASE_SECONDS`), retention windows and the
size settings are all checked. A reply refusing an argument anyway
(``value is not an integer or out of range``, ``WRONGTYPE``, ...) is a
:class:`~dedupcore.errors.RequestRefusedError` (a ``ValueError``),
never an :class:`~dedupcore.errors.UnavailableError`.
"""

from __future__ import annotations

import logging
import threading
from importlib import resources
from typing import Any

from redis.exceptions import (
    AskError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)

import dedupcore.keys as _keys
from dedupcore._core import shard_many
from dedupcore.api import batches
from dedupcore.api.answers import Claim, KeyRecord, Outcome
from dedupcore.api.contract import ClaimAPI
from dedupcore.config import Retention, check_lease
from dedupcore.errors import (
    DedupError,
    RequestRefusedError,
    StaleTokenError,
    UnavailableError,
)
from dedupcore.record import State
from dedupcore.redis.cluster import routing
from dedupcore.redis.connection import connect
from dedupcore.retry import deadline_scope, one_call
from dedupcore.tiers.base import (
    check_limit,
    check_retention,
    check_timeout,
)

__all__ = ["DEFAULT_TIMEOUT", "RedisStore"]

#: Seconds :meth:`RedisStore.from_url` waits to connect and for each reply.
DEFAULT_TIMEOUT = 5.0
log = logging.getLogger("dedupcore")


def _script(name: str) -> str:
    """The text of a Lua script of this package (dedupcore/redis/*.lua)."""
    return resources.files("dedupcore.redis").joinpath(name).read_text(encoding="utf-8")


#: The claim, the change and the renewal of a batch, decided atomically on the
#: server: their arguments, replies and how the claim follows dedupcore/decision.py
#: are in the scripts' heads (dedupcore/redis/claim.lua, change.lua, extend.lua).
_CLAIM = _script("claim.lua")
_CHANGE = _script("change.lua")
_EXTEND = _script("extend.lua")

_SAFE_POLICIES = ("noeviction",)
#: Errors meaning "the server or cluster could not answer" (DC* replies are decisions).
_DOWN: tuple[type[BaseException], ...] = (RedisError, RedisClusterException)
_STATS_DOWN: tuple[type[BaseException], ...] = (DedupError, *_DOWN)
_DURABILITY_RANK = {"always": 3, "everysec": 2, "no": 1, "": 0}
#: Words of a reply that refuses the request's own arguments or data: retrying
#: cannot help, so it is a RequestRefusedError (ValueError). Every other error
#: reply (LOADING, BUSY, MISCONF, OOM, READONLY, NOPERM, unknown command, a
#: database index out of range, ...) is a state or a setting of the server
#: that holds for every request alike: UnavailableError, which callers retry
#: rather than reject the message.
_REFUSALS = (
    "not an integer or out of range",
    "value is out of range",
    "invalid expire time",
    "not a valid float",
    "wrongtype",
    "would overflow",
    "exceeds maximum allowed size",
)


def _text(raw: Any) -> str | None:
    if raw is None:
        return None
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _unavailable(exc: BaseException) -> UnavailableError:
    return UnavailableError(f"redis unavailable: {type(exc).__name__}: {exc}")


def _refused(exc: BaseException) -> bool:
    """Whether an error reply refuses the request itself (see ``_REFUSALS``)."""
    if not isinstance(exc, ResponseError):
        return False
    text = str(exc).lower()
    return any(words in text for words in _REFUSALS)


def _failure(exc: BaseException) -> DedupError:
    """The error to raise for a failed call: refused request or unavailable server."""
    if _refused(exc):
        return RequestRefusedError(f"redis refused the request: {exc}")
    return _unavailable(exc)


class RedisStore(ClaimAPI):
    """A dedup store whose authority is a Redis server or cluster (see the module docstring).

    ``client`` is a ``redis.Redis`` or ``redis.cluster.RedisCluster`` (bring
    your own, with its own pool and timeouts), or use :meth:`from_url`.
    """

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "dc",
        retention: Retention | None = None,
        namespaces: dict[str, Retention] | None = None,
        lease: float = 30.0,
        max_key_bytes: int = 512,
        max_result_bytes: int = 65536,
        buckets: int = 16,
        allow_eviction: bool = False,
    ) -> None:
        self.client = client
        self.prefix = _keys.check_namespace(prefix)
        self.retention, self.namespaces = check_retention(retention, namespaces)
        self.lease = check_lease(lease)
        self.max_key_bytes = check_limit("max_key_bytes", max_key_bytes, 65536)
        self.max_result_bytes = check_limit("max_result_bytes", max_result_bytes, 16 << 20)
        self.buckets = check_limit("buckets", buckets, 16384)
        self.allow_eviction = bool(allow_eviction)
        self._route = routing(client)  # which server each call goes to (cluster.py)
        self.cluster = self._route.cluster
        # Script objects only hash their source here; nothing is sent before the first call.
        self._claim = client.register_script(_CLAIM)
        self._change = client.register_script(_CHANGE)
        self._extend = client.register_script(_EXTEND)
        self._checked = False
        self._check_lock = threading.Lock()
        self._run_ids: dict[str, str] = {}
        self.restarts = 0
        self._owns_client = False
        #: Seconds one call may take, retries and reconnects included (docs/timeouts.md);
        #: set by :meth:`from_url`. None: the client's own timeouts and retries.
        self.timeout: float | None = None

    def _ready(self) -> None:
        """The first call that reaches the server checks it (see "Connecting" above)."""
        if self._checked:
            return
        with self._check_lock:
            if self._checked:
                return
            try:
                policies = self._config_all("maxmemory-policy")
                level, said = self._durability()
                run_ids = self._read_run_ids()
            except _DOWN as exc:
                raise _failure(exc) from exc
            unsafe = [(n, p) for n, p in policies if p is not None and p not in _SAFE_POLICIES]
            if unsafe and not self.allow_eviction:
                node, policy = unsafe[0]
                where = f" on {node}" if self.cluster else ""
                raise DedupError(
                    f"redis maxmemory-policy is {policy!r}{where}: it can evict dedup records "
                    "and so report processed keys as NEW; set it to noeviction, or pass "
                    "allow_eviction=True to accept that"
                )
            unknown = [node for node, p in policies if p is None]
            if unknown:
                log.warning(
                    "redis %s: CONFIG GET is refused, so maxmemory-policy and persistence are "
                    "unknown; make sure the policy is noeviction",
                    ", ".join(unknown),
                )
            if level < 2:
                log.warning("redis authority can lose acknowledged claims: %s", said)
            else:
                log.info("redis authority durability: %s", said)
            self._run_ids = run_ids
            self._checked = True

    def _read_run_ids(self) -> dict[str, str]:
        """Each master's ``run_id`` (none where INFO is refused, as on some managed Redis)."""
        out: dict[str, str] = {}
        for node, server in self._route.primaries():
            try:
                info = server.info("server")
            except ResponseError:
                continue
            run_id = info.get("run_id") if isinstance(info, dict) else None
            if run_id:
                out[node] = _text(run_id) or ""
        return out

    def _check_restarts(self) -> None:
        """After a NOSCRIPT reply: warns of every master whose ``run_id`` changed."""
        seen = self._read_run_ids()
        with self._check_lock:  # calls from several threads warn and count a restart once
            restarted = sorted(n for n, rid in seen.items() if self._run_ids.get(n, rid) != rid)
            self._run_ids.update(seen)
            self.restarts += len(restarted)
        if not restarted:
            return
        try:
            _, said = self._durability()
        except _DOWN as exc:
            said = f"unknown ({exc})"
        log.warning(
            "redis %s restarted (its run_id changed): records it did not persist are gone "
            "and their keys can come back NEW; its durability: %s",
            ", ".join(restarted),
            said,
        )

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        cluster: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        client_options: dict[str, Any] | None = None,
        **options: Any,
    ) -> RedisStore:
        """A store on ``redis://``, ``rediss://`` or ``unix://`` (redis-py's URL syntax).

        ``timeout`` (seconds, default 5) is the deadline of each call of the
        store: a call returns, or raises :class:`UnavailableError`, within
        ``timeout`` (plus the few milliseconds a failure takes to raise),
        retries and reconnects included. It starts when the call does; the
        connect, every send and every reply get the time left, and the one
        retry on a fresh connection after a connection error or timeout
        starts only while a tenth of ``timeout`` is left (docs/timeouts.md).
        The client also gets TCP keepalive. A call that ends at its deadline
        may still have been run by the server (see "Timeouts" in the module
        docstring). The URL's query parameters (``socket_timeout``,
        ``socket_connect_timeout``, ``socket_keepalive``, ...) win over
        these defaults as caps of each wait, and ``client_options`` (any
        redis-py client argument) over both; a ``retry`` given there replaces
        the deadline-bound retry. Nothing is sent here: a server that is
        down makes the first call fail, not the open. ``cluster=True`` treats
        the URL as one node of a Redis Cluster, whose client reads the slot
        map when it is made (so a cluster that cannot answer fails the open,
        with :class:`UnavailableError`). Other ``options`` go to the
        constructor.
        """
        wait = check_timeout(timeout)
        try:
            client = connect(url, wait, cluster=cluster, options=client_options)
        except _DOWN as exc:
            raise _failure(exc) from exc
        try:
            store = cls(client, **options)
        except BaseException:
            client.close()
            raise
        store._owns_client = True
        store.timeout = wait
        return store

    def close(self) -> None:
        """Closes the client that :meth:`from_url` made (a client you passed in stays open)."""
        if self._owns_client:
            self.client.close()

    # -- server settings ---------------------------------------------------------

    def _config_all(self, name: str) -> list[tuple[str, str | None]]:
        """The setting on every server (None where CONFIG is disabled, as on managed Redis)."""
        out: list[tuple[str, str | None]] = []
        for node, server in self._route.servers():
            try:
                value = server.config_get(name)
            except ResponseError:
                out.append((node, None))
                continue
            out.append((node, _text(value.get(name)) if isinstance(value, dict) else None))
        return out

    @one_call
    def durability(self) -> str:
        """What an acknowledged claim survives, from the server's persistence settings.

        On a cluster this is the weakest node's answer (a key lives on one node).
        """
        return self.durability_report()[1]

    def durability_report(self) -> tuple[int, str]:
        """See :func:`~dedupcore.tiers.base.durability_report`."""
        try:
            with deadline_scope(self.timeout):
                return self._durability()
        except _DOWN as exc:
            raise _failure(exc) from exc

    def _durability(self) -> tuple[int, str]:
        """:meth:`durability`'s level (as ``durability_report``) and words."""
        appendonly = dict(self._config_all("appendonly"))
        fsync = dict(self._config_all("appendfsync"))
        worst: tuple[int, str, str] | None = None
        for node in appendonly:
            if appendonly[node] is None:
                mode = "?"  # CONFIG is disabled (managed Redis): nothing can be promised
            else:
                mode = (fsync.get(node) or "no") if appendonly[node] == "yes" else ""
            rank = _DURABILITY_RANK.get(mode, -1)
            if worst is None or rank < worst[0]:
                worst = (rank, node, mode)
        where = f" (weakest node {worst[1]})" if self.cluster and worst else ""
        if worst is None or worst[2] == "?":
            return (
                -1,
                f"unknown{where}: the server does not report its persistence settings "
                "(CONFIG is disabled); assume a Redis restart can lose acknowledged claims",
            )
        mode = worst[2]
        if mode == "always":
            return 3, f"appendfsync always{where}: survives a Redis crash and a power loss"
        if mode == "everysec":
            return (
                2,
                f"appendfsync everysec{where}: survives a Redis process crash; a power loss "
                "can lose the last second of acknowledged claims",
            )
        if mode:
            return (
                1,
                f"appendfsync no{where}: the OS decides when to write; a power loss can lose "
                "claims",
            )
        return (
            0,
            f"no AOF{where}: a Redis restart loses every record since the last RDB snapshot "
            "(or all of them): processed keys can come back NEW",
        )

    # -- keys --------------------------------------------------------------------

    def _window_ms(self, namespace: str, lease_s: float = 0.0) -> int:
        policy = self.namespaces.get(namespace, self.retention)
        return int(max(policy.exact_window, 2 * lease_s) * 1000)

    def _head(self, ns: bytes) -> bytes:
        return self.prefix + b":{" + ns + b":"

    def _names(self, ns: bytes, raw: list[bytes]) -> list[bytes]:
        buckets = shard_many([ns + b"\x00" + k for k in raw], self.buckets)
        head = self._head(ns)
        if len(raw) < 64:
            return [head + b"%d}:" % b + k for b, k in zip(buckets, raw, strict=True)]
        heads = [head + b"%d}:" % b for b in range(self.buckets)]
        return [heads[b] + k for b, k in zip(buckets, raw, strict=True)]

    def _run(self, script: Any, calls: list[tuple[list[bytes], list[Any]]]) -> list[Any]:
        """Runs ``script`` once per ``(keys, args)``: one pipelined round trip per server.

        The result of each call, or a ``ResponseError`` in its place for a
        script that refused (DC* replies); any other failure is a
        :class:`RequestRefusedError` or an :class:`UnavailableError` (see
        ``_failure``). A call that did not run (the server lacks
        the script, or the slot moved) is sent again; a call that may have
        run (connection lost, timeout) is never re-sent here.
        """
        # (The client's own retry policy may re-send a call after a timeout; the
        # scripts are safe to run twice: a claim then finds its own record and
        # answers IN_PROGRESS, or NEW with the same token to its owner; a
        # completion is a no-op.)
        out: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        try:
            for attempt in range(3):
                self._route.send(script.sha, calls, todo, out)
                noscript = [i for i in todo if isinstance(out[i], NoScriptError)]
                moved = [i for i in todo if isinstance(out[i], (AskError, TryAgainError))]
                todo = sorted(noscript + moved)
                if not todo or attempt == 2:
                    break
                if noscript:
                    # A server without the script (restarted, failed over, a new node):
                    # SCRIPT LOAD goes to every primary of a cluster.
                    self._check_restarts()
                    script.sha = self.client.script_load(script.script)
                if moved:
                    self._route.follow(out[i] for i in moved)
            for res in out:
                if isinstance(res, ResponseError) and str(res).startswith("DC"):
                    continue
                if isinstance(res, BaseException):
                    raise res
        except _DOWN as exc:
            raise _failure(exc) from exc
        return out

    def _pipeline(self, build: Any) -> list[Any]:
        """Runs the commands ``build(pipe)`` queues on a non-transactional pipeline."""
        try:
            pipe = self.client.pipeline(transaction=False)
            build(pipe)
            result: list[Any] = pipe.execute()
            return result
        except _DOWN as exc:
            raise _failure(exc) from exc

    # -- the claim API -----------------------------------------------------------

    @property
    def limits(self) -> batches.Limits:  # type: ignore[override]
        """The keys' and results' limits it was opened with."""
        return batches.Limits(
            max_key_bytes=self.max_key_bytes, max_result_bytes=self.max_result_bytes
        )

    @one_call
    def _claim_batch(self, batch: batches.ClaimBatch) -> list[Claim]:
        """Claims a batch; one script call per cluster slot (see the module docstring).

        When a server of a cluster cannot answer, the batch raises
        :class:`UnavailableError`; the calls that other servers did answer
        stay claimed (an ``owner`` gets them back on retry).
        """
        key_list = batch.keys
        namespace = batch.namespace
        ns = batch.ns
        raw = batch.raw
        lease_s = self.lease if batch.lease is None else batch.lease
        owner_b = batch.owner or b""
        fps = batch.fingerprint_list()
        if not raw:
            return []
        self._ready()
        names = self._names(ns, raw)
        ttl = self._window_ms(namespace, lease_s)
        groups = self._route.groups(names)
        if len(groups) > 1:
            # Each script checks its own keys first; checking every group's
            # fingerprints up front keeps a conflict from claiming other groups.
            self._check_conflicts(names, fps, key_list, namespace)
        head = [int(lease_s * 1000), owner_b, ttl]
        calls: list[tuple[list[bytes], list[Any]]] = []
        for idx in groups:
            group_names = names if len(idx) == len(names) else [names[i] for i in idx]
            group_fps = fps if len(idx) == len(fps) else [fps[i] for i in idx]
            if any(fp is not None for fp in group_fps):
                args = [*head, b"1", *[fp or b"" for fp in group_fps]]
            else:
                args = [*head, b"0"]  # no fingerprint pass in the script
            calls.append((group_names, args))
        claims: list[Any] = [None] * len(raw)
        new, dup, busy = Outcome.NEW, Outcome.DUPLICATE, Outcome.IN_PROGRESS
        for idx, out in zip(groups, self._run(self._claim, calls), strict=True):
            if isinstance(out, ResponseError):
                raise self._error(out, [key_list[i] for i in idx], namespace) from None
            codes, tokens, results = out
            if len(idx) == len(raw) and codes.count(48) == len(codes):  # b"0": all NEW
                return [
                    Claim(k, namespace, new, t)
                    for k, t in zip(key_list, map(int, tokens.split(b",")), strict=True)
                ]
            found = iter(results)
            for i, code, token in zip(idx, codes, map(int, tokens.split(b",")), strict=True):
                if code == 48:  # b"0"
                    claims[i] = Claim(key_list[i], namespace, new, token)
                elif code == 49:  # b"1"
                    value = batches.unpack_result(next(found))
                    claims[i] = Claim(key_list[i], namespace, dup, token, value)
                elif code == 50:  # b"2"
                    claims[i] = Claim(key_list[i], namespace, busy, token)
                else:  # b"3": an expired lease taken over
                    claims[i] = Claim(key_list[i], namespace, new, token, None, True, True)
        return claims

    def _check_conflicts(
        self, names: list[bytes], fps: list[bytes | None], keys: list[Any], namespace: str
    ) -> None:
        if all(fp is None for fp in fps):
            return
        wanted = [i for i, fp in enumerate(fps) if fp is not None]
        stored = self._pipeline(lambda pipe: [pipe.hmget(names[i], "s", "f") for i in wanted])
        for i, (s, f) in zip(wanted, stored, strict=True):
            if s is not None and s != b"3" and f and f != fps[i]:
                raise batches.fingerprint_conflict(keys[i], namespace)

    def _error(
        self, exc: ResponseError, keys: list[Any], namespace: str, action: str = "released"
    ) -> Exception:
        words = str(exc).split()
        if not words or not words[0].startswith("DC"):
            return _failure(exc)
        key = keys[int(words[1]) - 1]
        kind = words[0]
        if kind == "DCCONFLICT":
            return batches.fingerprint_conflict(key, namespace)
        if kind == "DCNOTCLAIMED":
            return StaleTokenError(
                f"key {key!r} in namespace {namespace!r} is not claimed "
                "(never claimed, released, or expired from the store)"
            )
        if kind == "DCDONE":
            return StaleTokenError(f"key {key!r} was already completed; it cannot be {action}")
        return StaleTokenError(
            f"token of key {key!r} is not the key's current token "
            f"{words[2]} (a stale owner whose lease was taken over)"
        )

    @one_call
    def _change_batch(self, batch: batches.ChangeBatch) -> None:
        """Completes or releases a batch; a retried completion with the same token is a
        no-op, a release leaves a tombstone that keeps the token growing."""
        namespace = batch.namespace
        ns = batch.ns
        state = State.PROCESSED if batch.completing else State.RELEASED
        results = batch.results or [None] * len(batch)
        parsed = [
            (key, raw, token, result or b"")
            for key, raw, token, result in zip(
                batch.keys, batch.raw, batch.tokens, results, strict=True
            )
        ]
        if not parsed:
            return
        self._ready()
        names = self._names(ns, [p[1] for p in parsed])
        ttl = self._window_ms(namespace)
        groups = self._route.groups(names)
        if len(groups) > 1:
            # Each script is atomic for its slot; checking the whole batch
            # first keeps a caller's stale token from half-applying a batch.
            self._precheck_change(names, parsed, namespace, state)
        calls = []
        for idx in groups:
            args: list[Any] = [ttl, str(int(state))]
            for i in idx:
                args += [str(parsed[i][2]), parsed[i][3]]
            calls.append(([names[i] for i in idx], args))
        for idx, out in zip(groups, self._run(self._change, calls), strict=True):
            if isinstance(out, ResponseError):
                raise self._error(out, [parsed[i][0] for i in idx], namespace) from None

    def _precheck_change(
        self,
        names: list[bytes],
        parsed: list[Any],
        namespace: str,
        state: State,
        action: str = "released",
    ) -> None:
        stored = self._pipeline(lambda pipe: [pipe.hmget(n, "s", "t") for n in names])
        for i, (s, t) in enumerate(stored):
            kind = None
            if s is None or s == b"3":
                kind = "DCNOTCLAIMED"
            elif int(t) != parsed[i][2]:
                kind = f"DCSTALE 1 {int(t)}"
            elif s == b"2" and state is State.RELEASED:
                kind = "DCDONE"
            if kind is not None:
                words = kind.split()
                raise self._error(
                    ResponseError(" ".join([words[0], "1", *words[2:]])),
                    [parsed[i][0]],
                    namespace,
                    action,
                )

    @one_call
    def _extend_batch(self, batch: batches.ExtendBatch) -> None:
        """Renews a batch's leases on the Redis server's clock, all or nothing; one
        script call per cluster slot (dedupcore/redis/extend.lua). Keys of a batch
        in several slots are checked together first, as completions are; a claim
        lost between that check and its slot's script refuses that slot only."""
        if not batch.keys:
            return
        namespace = batch.namespace
        lease_s = self.lease if batch.lease is None else batch.lease
        parsed = list(zip(batch.keys, batch.raw, batch.tokens, strict=True))
        self._ready()
        names = self._names(batch.ns, batch.raw)
        groups = self._route.groups(names)
        if len(groups) > 1:
            # A renewal refuses a completed claim, as a release does.
            self._precheck_change(names, parsed, namespace, State.RELEASED, "extended")
        head = [int(lease_s * 1000), self._window_ms(namespace, lease_s)]
        calls = [
            ([names[i] for i in idx], [*head, *[str(parsed[i][2]) for i in idx]]) for idx in groups
        ]
        for idx, out in zip(groups, self._run(self._extend, calls), strict=True):
            if isinstance(out, ResponseError):
                keys = [parsed[i][0] for i in idx]
                raise self._error(out, keys, namespace, "extended") from None

    @one_call
    def _get_record(self, ns: bytes, raw: bytes) -> KeyRecord | None:
        name = self._names(ns, [raw])[0]
        self._ready()
        try:
            s, t, o, f, r, c, u = self.client.hmget(name, "s", "t", "o", "f", "r", "c", "u")
        except _DOWN as exc:
            raise _failure(exc) from exc
        if s is None:
            return None
        return KeyRecord(
            State(int(s)),
            int(t),
            o or None,
            f or None,
            batches.unpack_result(r),
            int(c or 0) / 1000.0,  # ms of the Redis server's clock
            int(u or c or 0) / 1000.0,  # a record never changed since its creation has no 'u'
        )

    # -- demotion ----------------------------------------------------------------

    def expiring(self, namespace: str, within: float, *, count: int = 1000) -> list[bytes]:
        """Keys of PROCESSED records of ``namespace`` that Redis expires within ``within`` s.

        A demoter copies them to the cold archive before Redis forgets them.
        Every master is scanned (``SCAN MATCH`` on the namespace's key
        prefix, ``count`` keys per step, ``HGET``/``PTTL`` pipelined per
        step). Keys claimed, released or with no TTL are left out. A server
        that cannot answer raises :class:`UnavailableError` (a partial list
        would let a demoter miss keys).
        """
        ns = _keys.check_namespace(namespace)
        if isinstance(within, bool) or not isinstance(within, (int, float)):
            raise TypeError(f"within must be a number of seconds, not {type(within).__name__}")
        if not within > 0:
            raise ValueError(f"within must be > 0 seconds, got {within!r}")
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"count must be an int, not {type(count).__name__}")
        if not 0 < count <= 1_000_000:
            raise ValueError(f"count must be in 1..1000000, got {count!r}")
        with deadline_scope(self.timeout):
            self._ready()
        head = self._head(ns)
        limit_ms = within * 1000.0
        found: list[bytes] = []
        try:
            for _, server in self._route.primaries():
                cursor = 0
                while True:
                    # A scan is many calls: each step has a deadline of its own.
                    with deadline_scope(self.timeout):
                        cursor, names = server.scan(cursor, match=head + b"*", count=count)
                        names = [n for n in names if self._key_of(head, n) is not None]
                        replies = []
                        if names:
                            pipe = server.pipeline(transaction=False)
                            for n in names:
                                pipe.hget(n, "s")
                                pipe.pttl(n)
                            replies = pipe.execute()
                    if names:
                        for j, n in enumerate(names):
                            state, ttl = replies[2 * j], replies[2 * j + 1]
                            if state == b"2" and 0 <= ttl < limit_ms:
                                key = self._key_of(head, n)
                                assert key is not None
                                found.append(key)
                    if cursor == 0:
                        break
        except _DOWN as exc:
            raise _failure(exc) from exc
        return found

    @staticmethod
    def _key_of(head: bytes, name: bytes) -> bytes | None:
        """The dedup key in ``name`` if it belongs to the namespace of ``head``.

        The match pattern alone would also take namespaces that extend this
        one past a ':' (``a`` would match ``a:1``'s keys): the bucket must be
        digits up to the closing brace.
        """
        if not name.startswith(head):
            return None
        end = name.find(b"}:", len(head))
        if end <= len(head) or not name[len(head) : end].isdigit():
            return None
        return name[end + 2 :]

    @one_call
    def stats(self) -> dict[str, Any]:
        """The server's persistence and memory settings (every node of a cluster).

        A server that cannot answer does not make this raise (it is for
        metrics): ``unavailable`` then says why.
        """
        try:
            policies = self._config_all("maxmemory-policy")
            durability = self.durability()
        except _STATS_DOWN as exc:
            return {"cluster": self.cluster, "unavailable": str(exc), "restarts": self.restarts}
        unsafe = [p for _, p in policies if p is not None and p not in _SAFE_POLICIES]
        return {
            "durability": durability,
            "maxmemory_policy": unsafe[0] if unsafe else (policies[0][1] if policies else None),
            "cluster": self.cluster,
            "servers": len(policies),
            "restarts": self.restarts,
        }
