"""Where a Redis store's calls go: one server, or the masters of a Redis Cluster.

The bucket in each key's hash tag puts it in one of ``buckets`` slots per
namespace. On a cluster a batch is grouped by slot, one script call per slot,
and each master gets one pipeline of its calls; a single server takes any keys
in one call (dedupcore/redis/store.py, "Redis Cluster"). The store asks the
routing object of its client (:func:`routing`) and never which kind it has.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import MovedError

__all__ = ["Cluster", "OneServer", "Routing", "routing"]

#: Keys per script call: bounds how long one call holds the (single-threaded) server.
_SCRIPT_KEYS = 1000

#: Script calls as ``(keys, args)``.
Calls = list[tuple[list[bytes], list[Any]]]


class Routing:
    """The servers of a client and which of them each script call goes to."""

    #: Whether the client is a Redis Cluster's.
    cluster = False

    def __init__(self, client: Any) -> None:
        self.client = client

    def servers(self) -> list[tuple[str, Any]]:
        """``(name, client)`` of every server: each node (masters and replicas) of a cluster."""
        return [("redis", self.client)]

    def primaries(self) -> list[tuple[str, Any]]:
        """``(name, client)`` of every master (the one server, when not a cluster)."""
        return [("redis", self.client)]

    def groups(self, names: list[bytes]) -> list[list[int]]:
        """Indexes of the keys each script call gets: at most ``_SCRIPT_KEYS`` keys, of
        one cluster slot on a cluster."""
        return _chunks([list(range(len(names)))])

    def send(self, sha: str, calls: Calls, todo: list[int], out: list[Any]) -> None:
        """``EVALSHA`` of the calls ``todo``, one pipeline per server; replies into ``out``."""
        _evalsha(self.client, sha, calls, todo, out)

    def follow(self, redirects: Iterable[Any]) -> None:
        """Takes note of the MOVED, ASK and TRYAGAIN replies of calls sent again (a
        single server sends none)."""


class OneServer(Routing):
    """A single Redis server: every key on it."""


class Cluster(Routing):
    """A Redis Cluster: a namespace's buckets are slots spread over the masters."""

    cluster = True

    def servers(self) -> list[tuple[str, Any]]:
        return [(n.name, self.client.get_redis_connection(n)) for n in self.client.get_nodes()]

    def primaries(self) -> list[tuple[str, Any]]:
        return [(n.name, self.client.get_redis_connection(n)) for n in self.client.get_primaries()]

    def groups(self, names: list[bytes]) -> list[list[int]]:
        by_slot: dict[int, list[int]] = defaultdict(list)
        slots: dict[bytes, int] = {}
        for i, name in enumerate(names):
            tag = name[: name.index(b"}") + 1]
            slot = slots.get(tag)
            if slot is None:
                slot = slots[tag] = key_slot(name)
            by_slot[slot].append(i)
        return _chunks(idx for _, idx in sorted(by_slot.items()))

    def send(self, sha: str, calls: Calls, todo: list[int], out: list[Any]) -> None:
        # (redis-py's cluster pipeline would ask a node for the keys of every
        # EVALSHA first; the slot of each call is known here, so each master
        # gets a plain pipeline of its own calls.)
        per_server: dict[str, tuple[Any, list[int]]] = {}
        for i in todo:
            node = self.client.get_node_from_key(calls[i][0][0])
            server = self.client.get_redis_connection(node)
            per_server.setdefault(node.name, (server, []))[1].append(i)
        for server, idx in per_server.values():
            _evalsha(server, sha, calls, idx, out)

    def follow(self, redirects: Iterable[Any]) -> None:
        """Routes the slots of MOVED replies to the masters they name, as redis-py's own
        commands do; the slot map is read again only for an ASK or TRYAGAIN, or where
        redis-py cannot patch one slot. (A map read right after a slot moved can still
        come from a node that has not heard of the move yet.)"""
        nodes = self.client.nodes_manager
        move_slot = getattr(nodes, "move_slot", None)
        again = False
        for err in redirects:
            if isinstance(err, MovedError) and move_slot is not None:
                move_slot(err)
            else:
                again = True
        if again:
            nodes.initialize()


def routing(client: Any) -> Routing:
    """The routing of ``client``: a ``redis.cluster.RedisCluster``'s, or one server's."""
    return Cluster(client) if isinstance(client, RedisCluster) else OneServer(client)


def _chunks(groups: Iterable[list[int]]) -> list[list[int]]:
    """Each group of key indexes cut into script calls of at most ``_SCRIPT_KEYS`` keys."""
    return [idx[i : i + _SCRIPT_KEYS] for idx in groups for i in range(0, len(idx), _SCRIPT_KEYS)]


def _evalsha(server: Any, sha: str, calls: Calls, idx: list[int], out: list[Any]) -> None:
    """The calls ``idx`` in one pipeline to ``server``; each reply (or error) into ``out``."""
    pipe = server.pipeline(transaction=False)
    command = pipe.execute_command
    for i in idx:
        keys, args = calls[i]
        command("EVALSHA", sha, len(keys), *keys, *args)
    for i, res in zip(idx, pipe.execute(raise_on_error=False), strict=True):
        out[i] = res
