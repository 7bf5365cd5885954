"""Redis as the dedup authority: claims decided atomically by Lua scripts on the server.

Each key is a Redis hash ``<prefix>:{<namespace>:<bucket>}:<key>`` with fields
``s`` (state: 1 PROCESSING, 2 PROCESSED, 3 RELEASED), ``t`` (fencing token),
``o`` (owner), ``f`` (fingerprint), ``d`` (lease deadline, ms of the Redis
server's clock) and ``r`` (msgpack result). The NX create, the lease, owner,
token and fingerprint checks and the TTL are one script call per batch (per
hash-tag bucket), so racing consumers on any number of hosts see exactly one
NEW per key. Every script checks the whole batch before it writes anything:
a fingerprint conflict or a stale token changes nothing.

The bucket in the hash tag (``jump_hash`` of the key into ``buckets``) keeps
the keys of one script in one Redis Cluster slot while spreading a batch
over the cluster's masters.

Durability is Redis's own: :meth:`RedisStore.durability` reads the server's
persistence settings and says what an acknowledged claim survives. Eviction
would forget processed keys, so a server whose ``maxmemory-policy`` can
evict them is refused unless ``allow_eviction=True``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dedupcore import keys as _keys
from dedupcore._core import shard_many
from dedupcore.api import (
    Claim,
    ClaimAPI,
    KeyRecord,
    Outcome,
    change_items,
    check_fingerprints,
    check_owner,
    pack_result,
    unpack_result,
)
from dedupcore.config import Retention, check_lease
from dedupcore.errors import ConflictError, DedupError, StaleTokenError, UnavailableError
from dedupcore.record import State

__all__ = ["RedisStore"]

_CLAIM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local owner = ARGV[2]
local ttl = tonumber(ARGV[3])
for i, k in ipairs(KEYS) do
  local fp = ARGV[3 + i]
  local r = redis.call('HMGET', k, 's', 'f')
  if r[1] and r[1] ~= '3' and fp ~= '' and r[2] and r[2] ~= '' and r[2] ~= fp then
    return redis.error_reply('DCCONFLICT ' .. i)
  end
end
local out = {}
for i, k in ipairs(KEYS) do
  local fp = ARGV[3 + i]
  local r = redis.call('HMGET', k, 's', 't', 'o', 'd', 'r')
  local s = r[1]
  if (not s) or s == '3' then
    local token = (tonumber(r[2]) or 0) + 1
    redis.call('HSET', k, 's', '1', 't', token, 'o', owner, 'f', fp, 'd', now + lease, 'r', '')
    redis.call('PEXPIRE', k, ttl)
    out[i] = {0, token, false}
  elseif s == '2' then
    out[i] = {1, tonumber(r[2]), r[5]}
  elseif owner ~= '' and r[3] == owner then
    redis.call('HSET', k, 'd', now + lease)
    out[i] = {0, tonumber(r[2]), false}
  elseif tonumber(r[4]) > now then
    out[i] = {2, tonumber(r[2]), false}
  else
    local token = tonumber(r[2]) + 1
    redis.call('HSET', k, 't', token, 'o', owner, 'd', now + lease)
    redis.call('PEXPIRE', k, ttl)
    out[i] = {3, token, false}
  end
end
return out
"""

# ARGV: ttl_ms, new_state ('2' complete / '3' release), then token, result per key.
_CHANGE = """
local ttl = tonumber(ARGV[1])
local state = ARGV[2]
for i, k in ipairs(KEYS) do
  local token = ARGV[1 + 2 * i]
  local r = redis.call('HMGET', k, 's', 't')
  if (not r[1]) or r[1] == '3' then
    return redis.error_reply('DCNOTCLAIMED ' .. i)
  end
  if r[2] ~= token then
    return redis.error_reply('DCSTALE ' .. i .. ' ' .. r[2])
  end
  if r[1] == '2' and state == '3' then
    return redis.error_reply('DCDONE ' .. i)
  end
end
for i, k in ipairs(KEYS) do
  local r = redis.call('HGET', k, 's')
  if r == '1' then
    redis.call('HSET', k, 's', state, 'r', ARGV[2 + 2 * i])
    redis.call('PEXPIRE', k, ttl)
  end
end
return #KEYS
"""

_SAFE_POLICIES = ("noeviction",)


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
        self.retention = retention or Retention()
        self.namespaces = dict(namespaces or {})
        self.lease = check_lease(lease)
        self.max_key_bytes = max_key_bytes
        self.max_result_bytes = max_result_bytes
        self.buckets = buckets
        try:
            self._claim = client.register_script(_CLAIM)
            self._change = client.register_script(_CHANGE)
            policy = self._config("maxmemory-policy")
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise UnavailableError(f"redis unreachable: {exc}") from exc
        if policy is not None and policy not in _SAFE_POLICIES and not allow_eviction:
            raise DedupError(
                f"redis maxmemory-policy is {policy!r}: it can evict dedup records and so "
                "report processed keys as NEW; set it to noeviction, or pass "
                "allow_eviction=True to accept that"
            )

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisStore:
        """A store on ``redis://``, ``rediss://`` or ``unix://`` (redis-py's URL syntax)."""
        return cls(redis.Redis.from_url(url), **options)

    def _config(self, name: str) -> str | None:
        try:
            value = self.client.config_get(name)
        except ResponseError:
            return None  # CONFIG may be disabled (managed Redis)
        if isinstance(value, dict) and value:
            # A cluster client answers per node; any unsafe node is unsafe.
            raw = next(iter(value.values())) if name not in value else value[name]
            if isinstance(raw, dict):
                raw = raw.get(name)
            return None if raw is None else (raw.decode() if isinstance(raw, bytes) else str(raw))
        return None

    def durability(self) -> str:
        """What an acknowledged claim survives, from the server's persistence settings."""
        appendonly = self._config("appendonly")
        fsync = self._config("appendfsync")
        if appendonly == "yes" and fsync == "always":
            return "appendfsync always: survives a Redis crash and a power loss"
        if appendonly == "yes" and fsync == "everysec":
            return (
                "appendfsync everysec: survives a Redis process crash; a power loss can "
                "lose the last second of acknowledged claims"
            )
        if appendonly == "yes":
            return "appendfsync no: the OS decides when to write; a power loss can lose claims"
        return (
            "no AOF: a Redis restart loses every record since the last RDB snapshot "
            "(or all of them): processed keys can come back NEW"
        )

    # -- keys --------------------------------------------------------------------

    def _window_ms(self, namespace: str, lease_s: float = 0.0) -> int:
        policy = self.namespaces.get(namespace, self.retention)
        return int(max(policy.exact_window, 2 * lease_s) * 1000)

    def _names(self, ns: bytes, raw: list[bytes]) -> list[bytes]:
        buckets = shard_many([ns + b"\x00" + k for k in raw], self.buckets)
        head = self.prefix + b":{" + ns + b":"
        return [head + str(b).encode() + b"}:" + k for b, k in zip(buckets, raw, strict=True)]

    @staticmethod
    def _groups(names: list[bytes]) -> dict[bytes, list[int]]:
        groups: dict[bytes, list[int]] = defaultdict(list)
        for i, name in enumerate(names):
            groups[name[: name.index(b"}") + 1]].append(i)
        return groups

    def _run(self, script: Any, keys: list[bytes], args: list[Any]) -> Any:
        try:
            return script(keys=keys, args=args)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise UnavailableError(f"redis unavailable: {exc}") from exc

    # -- the claim API -----------------------------------------------------------

    def claim_many(
        self,
        keys: Iterable[bytes | str],
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprints: Sequence[bytes | None] | None = None,
    ) -> list[Claim]:
        """Claims a batch; one script call per hash-tag bucket (see the module docstring)."""
        key_list = list(keys)
        ns = _keys.check_namespace(namespace)
        raw = [_keys.check_key(k, self.max_key_bytes) for k in key_list]
        lease_s = self.lease if lease is None else check_lease(lease)
        owner_b = check_owner(owner) or b""
        fps = check_fingerprints(fingerprints, len(raw))
        if not raw:
            return []
        names = self._names(ns, raw)
        rows: list[Any] = [None] * len(raw)
        ttl = self._window_ms(namespace, lease_s)
        groups = self._groups(names)
        # Check every group for conflicts first, so a conflict claims nothing.
        for idx in groups.values():
            self._check_conflicts(
                [names[i] for i in idx],
                [fps[i] for i in idx],
                [key_list[i] for i in idx],
                namespace,
            )
        for idx in groups.values():
            args = [int(lease_s * 1000), owner_b, ttl, *[fps[i] or b"" for i in idx]]
            try:
                out = self._run(self._claim, [names[i] for i in idx], args)
            except ResponseError as exc:
                raise self._error(exc, [key_list[i] for i in idx], namespace) from None
            for i, row in zip(idx, out, strict=True):
                rows[i] = row
        claims = []
        for k, (code, token, result) in zip(key_list, rows, strict=True):
            outcome = (Outcome.NEW, Outcome.DUPLICATE, Outcome.IN_PROGRESS, Outcome.NEW)[code]
            value = unpack_result(result) if code == 1 else None
            claims.append(Claim(k, namespace, outcome, int(token), value, True, code == 3))
        return claims

    def _check_conflicts(
        self, names: list[bytes], fps: list[bytes | None], keys: list[Any], namespace: str
    ) -> None:
        if all(fp is None for fp in fps):
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for n in names:
                pipe.hmget(n, "s", "f")
            stored = pipe.execute()
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise UnavailableError(f"redis unavailable: {exc}") from exc
        for (s, f), fp, k in zip(stored, fps, keys, strict=True):
            if s is not None and s != b"3" and fp is not None and f and f != fp:
                raise ConflictError(
                    f"key {k!r} in namespace {namespace!r} was claimed with a different "
                    "fingerprint (same idempotency key, another request)"
                )

    def _error(self, exc: ResponseError, keys: list[Any], namespace: str) -> Exception:
        words = str(exc).split()
        if not words or not words[0].startswith("DC"):
            return UnavailableError(f"redis error: {exc}")
        key = keys[int(words[1]) - 1]
        kind = words[0]
        if kind == "DCCONFLICT":
            return ConflictError(
                f"key {key!r} in namespace {namespace!r} was claimed with a "
                "different fingerprint (same idempotency key, another request)"
            )
        if kind == "DCNOTCLAIMED":
            return StaleTokenError(
                f"key {key!r} in namespace {namespace!r} is not claimed "
                "(never claimed, released, or expired from the store)"
            )
        if kind == "DCDONE":
            return StaleTokenError(f"key {key!r} was already completed; it cannot be released")
        return StaleTokenError(
            f"token of key {key!r} is not the key's current token "
            f"{words[2]} (a stale owner whose lease was taken over)"
        )

    def _change_many(self, items: Iterable[Any], namespace: str, state: State) -> None:
        ns = _keys.check_namespace(namespace)
        parsed = [
            (
                key,
                _keys.check_key(key, self.max_key_bytes),
                token,
                pack_result(result, self.max_result_bytes) or b"",
            )
            for key, token, result in change_items(items, with_results=state is State.PROCESSED)
        ]
        if not parsed:
            return
        names = self._names(ns, [p[1] for p in parsed])
        ttl = self._window_ms(namespace)
        groups = self._groups(names)
        if len(groups) > 1:
            # Each script is atomic for its bucket; checking the whole batch
            # first keeps a caller's stale token from half-applying a batch.
            self._precheck_change(names, parsed, namespace, state)
        for idx in groups.values():
            args: list[Any] = [ttl, str(int(state))]
            for i in idx:
                args += [str(parsed[i][2]), parsed[i][3]]
            try:
                self._run(self._change, [names[i] for i in idx], args)
            except ResponseError as exc:
                raise self._error(exc, [parsed[i][0] for i in idx], namespace) from None

    def _precheck_change(
        self, names: list[bytes], parsed: list[Any], namespace: str, state: State
    ) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for n in names:
                pipe.hmget(n, "s", "t")
            stored = pipe.execute()
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise UnavailableError(f"redis unavailable: {exc}") from exc
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
                    ResponseError(" ".join([words[0], "1", *words[2:]])), [parsed[i][0]], namespace
                )

    def complete_many(
        self,
        items: Iterable[tuple[bytes | str, int] | tuple[bytes | str, int, Any]],
        *,
        namespace: str,
    ) -> None:
        """Completes many claims; a retried completion with the same token is a no-op."""
        self._change_many(items, namespace, State.PROCESSED)

    def release_many(self, items: Iterable[tuple[bytes | str, int]], *, namespace: str) -> None:
        """Releases many claims (a tombstone keeps the token growing)."""
        self._change_many(items, namespace, State.RELEASED)

    def get(self, key: bytes | str, *, namespace: str) -> KeyRecord | None:
        """The key's record without claiming it."""
        ns = _keys.check_namespace(namespace)
        name = self._names(ns, [_keys.check_key(key, self.max_key_bytes)])[0]
        try:
            s, t, o, f, r = self.client.hmget(name, "s", "t", "o", "f", "r")
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise UnavailableError(f"redis unavailable: {exc}") from exc
        if s is None:
            return None
        return KeyRecord(
            State(int(s)),
            int(t),
            o or None,
            f or None,
            unpack_result(r),
            0.0,
            0.0,
        )

    def stats(self) -> dict[str, Any]:
        """The server's persistence and memory settings."""
        return {
            "durability": self.durability(),
            "maxmemory_policy": self._config("maxmemory-policy"),
        }
