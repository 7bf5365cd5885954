"""Where a Redis store's keys live: one server, or the masters of a Redis Cluster.

The bucket in each key's hash tag puts it in one of ``buckets`` slots per
namespace; a batch is grouped by slot, one script call per slot, and each
master gets one pipeline of its calls (dedupcore/redis/store.py, "Redis
Cluster").
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from redis.crc import key_slot
from redis.exceptions import MovedError

__all__ = ["Routing"]

#: Keys per script call: bounds how long one call holds the (single-threaded) server.
_SCRIPT_KEYS = 1000


class Routing:
    """Where :class:`~dedupcore.redis.RedisStore`'s calls go (mixed in)."""

    client: Any
    cluster: bool

    def _servers(self) -> list[tuple[str, Any]]:
        """``(name, client)`` of every server: each node (masters and replicas) of a cluster."""
        if not self.cluster:
            return [("redis", self.client)]
        return [(n.name, self.client.get_redis_connection(n)) for n in self.client.get_nodes()]

    def _primaries(self) -> list[tuple[str, Any]]:
        if not self.cluster:
            return [("redis", self.client)]
        return [(n.name, self.client.get_redis_connection(n)) for n in self.client.get_primaries()]

    def _groups(self, names: list[bytes]) -> list[list[int]]:
        """Indexes of the keys each script call gets: one cluster slot per call.

        A single server takes any keys in one call, so a batch is one call
        per ``_SCRIPT_KEYS`` keys; a cluster gets one call per slot (the
        buckets of a namespace are spread over the masters).
        """
        by_slot: dict[int, list[int]] = defaultdict(list)
        if self.cluster:
            slots: dict[bytes, int] = {}
            for i, name in enumerate(names):
                tag = name[: name.index(b"}") + 1]
                slot = slots.get(tag)
                if slot is None:
                    slot = slots[tag] = key_slot(name)
                by_slot[slot].append(i)
        else:
            by_slot[0] = list(range(len(names)))
        return [
            idx[i : i + _SCRIPT_KEYS]
            for _, idx in sorted(by_slot.items())
            for i in range(0, len(idx), _SCRIPT_KEYS)
        ]

    def _follow(self, redirects: Iterable[Any]) -> None:
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

    def _send(
        self, sha: str, calls: list[tuple[list[bytes], list[Any]]], todo: list[int], out: list[Any]
    ) -> None:
        """``EVALSHA`` of the calls ``todo``, one pipeline per server; replies into ``out``.

        (redis-py's cluster pipeline would ask a node for the keys of every
        ``EVALSHA`` first; the slot of each call is known here, so each
        master gets a plain pipeline of its own calls.)
        """
        per_server: dict[str, tuple[Any, list[int]]] = {}
        for i in todo:
            if self.cluster:
                node = self.client.get_node_from_key(calls[i][0][0])
                server = self.client.get_redis_connection(node)
                name = node.name
            else:
                server, name = self.client, ""
            per_server.setdefault(name, (server, []))[1].append(i)
        for server, idx in per_server.values():
            pipe = server.pipeline(transaction=False)
            command = pipe.execute_command
            for i in idx:
                keys, args = calls[i]
                command("EVALSHA", sha, len(keys), *keys, *args)
            for i, res in zip(idx, pipe.execute(raise_on_error=False), strict=True):
                out[i] = res
