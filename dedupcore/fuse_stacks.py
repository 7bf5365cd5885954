"""The stacks of a ring's sealed fuse slices: which slice goes where, and when.

A :class:`~dedupcore._core.FuseStack` keeps the fingerprints of fuse filters
of one geometry side by side, so that one probe reads three rows for all of
them instead of three per filter (docs/warm-tier.md, "Stacked fuse slices").
:class:`FuseStacks` is the policy around them for one
:class:`~dedupcore.ring.BloomRing`: the geometry a slice about to be rebuilt
should take (:meth:`FuseStacks.like`), the width a reopened ring's stacks
need (:meth:`FuseStacks.widths`), moving slices into columns
(:meth:`FuseStacks.stack_loose`) and out of them when they expire
(:meth:`FuseStacks.leave`). The ring keeps its slices; each slice says which
stack and column hold its filter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import dedupcore._core as _core
from dedupcore.errors import CorruptFileError, UnsupportedFormatError
from dedupcore.fuse import fuse_file_params

__all__ = ["STACK_SLACK", "FuseStacks", "Params", "StackMember"]

#: A sealed slice is rebuilt in the geometry of a stack (and joins it) when that
#: geometry has at most this many times the slots its own would have.
STACK_SLACK = 1.15

#: A fuse filter's geometry, as ``FuseFilter.params`` gives it.
Params = tuple[int, ...]


class StackMember(Protocol):
    """A slice as the stacks see it: its fuse filter (None: not rebuilt yet), and
    the stack and column that hold it (None and -1: none)."""

    fuse: _core.FuseFilter | None
    stack: _core.FuseStack | None
    column: int


class FuseStacks:
    """At most one stack per geometry, each at most ``max_width`` columns wide.

    ``lock`` is what the ring takes to change itself (which keeps its probes out).
    :meth:`like`, :meth:`leave`, iteration and ``len`` expect the caller to hold
    the ring's lock; :meth:`stack_loose` and :meth:`info` take ``lock``
    themselves.
    """

    def __init__(self, max_width: int, lock: AbstractContextManager[object]) -> None:
        self.max_width = max_width
        self._lock = lock
        self._stacks: list[_core.FuseStack] = []

    def __iter__(self) -> Iterator[_core.FuseStack]:
        return iter(self._stacks)

    def __len__(self) -> int:
        return len(self._stacks)

    def info(self) -> list[dict[str, int]]:
        """Each stack: its columns, how many are live, and its bytes."""
        with self._lock:
            return [
                {"width": st.width, "live": len(st.live), "nbytes": st.nbytes}
                for st in self._stacks
            ]

    def like(self, keys: int) -> Params | None:
        """The params of the stack a slice rebuilt from ``keys`` hashes should join:
        the one of its segment length with the fewest slots, at least its own and at
        most STACK_SLACK times as many, that has room; None: its own geometry."""
        try:
            segment, _, slots = _core.fuse_geometry(keys)
        except ValueError:
            return None  # too many keys for one filter: the build says so
        fits = [
            st.params
            for st in self._stacks
            if st.params[1] == segment
            and slots <= st.params[3] <= slots * STACK_SLACK
            and (len(st.live) < st.width or st.width < self.max_width)
        ]
        return min(fits, key=lambda params: params[3]) if fits else None

    def widths(self, files: Iterable[Path]) -> dict[Params, int]:
        """How many columns the stack of each geometry needs for these fuse files,
        from their headers (a file that cannot be read is left out: opening it says
        why)."""
        widths: dict[Params, int] = {}
        for path in files:
            try:
                params, count = fuse_file_params(path)
            except (OSError, CorruptFileError, UnsupportedFormatError):
                continue
            if count:
                widths[params] = min(widths.get(params, 0) + 1, self.max_width)
        return widths

    def leave(self, member: StackMember) -> None:
        """An expired slice's column stops answering at once (and is free for the
        next slice of its geometry); a stack with no live column goes."""
        stack = member.stack
        if stack is None:
            return
        stack.drop(member.column)
        if not stack.live:
            self._stacks.remove(stack)

    def _place(
        self, members: Sequence[StackMember]
    ) -> tuple[StackMember, _core.FuseStack | None, int] | None:
        """A fuse slice not in a stack yet, the stack of its params (None: a new one)
        and the column it goes into; None when every slice that can be is stacked.
        A slice whose stack is full and at its widest waits for a column to free."""
        for s in members:
            if s.fuse is None or s.stack is not None or not s.fuse.count:
                continue
            params = s.fuse.params
            stack = next((st for st in self._stacks if st.params == params), None)
            if stack is None:
                return s, None, 0
            live = stack.live
            free = next((c for c in range(stack.width) if c not in live), None)
            if free is not None:
                return s, stack, free
            if stack.width < self.max_width:
                return s, stack, stack.width  # the stack grows by a column
        return None

    def stack_loose(
        self,
        members: Callable[[], Sequence[StackMember]],
        changed: Callable[[], None],
        widths: dict[Params, int] | None = None,
    ) -> None:
        """Moves every fuse slice of ``members()`` (the ring's live slices, read
        under the lock) that can go into a stack there, and calls ``changed()``
        under the lock after each move (the set of filters to probe is another).

        Copies run outside the lock into columns that are not live, so probes go
        on; a column turns live, the stack grown or new takes its place and the
        slice's own body goes, all in one hold of the lock. Only one thread stacks
        at a time (the ring's compaction lock, or its open). A new stack gets the
        width ``widths`` names for its params (a reopened ring: every column it
        will need, so that it never grows), else one column."""
        while True:
            with self._lock:
                plan = self._place(members())
            if plan is None:
                return
            s, old, column = plan
            assert s.fuse is not None
            if old is None:
                stack = _core.FuseStack(s.fuse.params, (widths or {}).get(s.fuse.params, 1))
            elif column >= old.width:
                stack = old.grown(column + 1)
            else:
                stack = old
            stack.put(column, s.fuse)
            with self._lock:
                if s not in members() or (old is not None and old not in self._stacks):
                    # The slice expired meanwhile, or every column of its stack did
                    # (the next pass starts a new stack for it).
                    if stack is old:
                        stack.drop(column)
                    continue
                if old is None:
                    self._stacks.append(stack)
                elif stack is not old:
                    for c in stack.live:
                        if c not in old.live:  # dropped while the copy ran
                            stack.drop(c)
                    self._stacks[self._stacks.index(old)] = stack
                    for t in members():
                        if t.stack is old:
                            t.stack = stack
                stack.set_live(column)
                s.stack, s.column = stack, column
                s.fuse._release()
                changed()
