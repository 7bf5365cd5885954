"""FuseStacks on its own: the geometry a rebuild takes, moving slices into columns and
out of them, and the widths a reopened ring needs (the ring's use of it is in
test_ring_fuse.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import dedupcore._core as _core
from dedupcore._files import atomic_write
from dedupcore.fuse import fuse_file_chunks
from dedupcore.fuse_stacks import STACK_SLACK, FuseStacks

SEED = 7


@dataclass(eq=False)
class Member:
    fuse: _core.FuseFilter | None
    stack: _core.FuseStack | None = None
    column: int = -1


def _hashes(n: int, salt: int) -> np.ndarray:
    return np.random.default_rng(salt).integers(0, 2**64, size=n, dtype=np.uint64)


def _built(n: int, salt: int, stacks: FuseStacks | None = None) -> Member:
    like = stacks.like(n) if stacks is not None else None
    return Member(_core.FuseFilter.build(memoryview(_hashes(n, salt)), SEED, like))


def _stacked(stacks: FuseStacks, members: list[Member]) -> int:
    changes = [0]

    def changed() -> None:
        changes[0] += 1

    stacks.stack_loose(lambda: members, changed)
    return changes[0]


def _holds(member: Member, n: int, salt: int) -> bool:
    assert member.stack is not None
    flags = member.stack.contains_many(memoryview(_hashes(n, salt)))
    return bool(np.frombuffer(flags, dtype=bool).all())


def test_slices_of_one_geometry_go_into_one_stack_and_answer_from_it() -> None:
    stacks = FuseStacks(4, threading.RLock())
    members = [_built(20_000, salt) for salt in range(3)]
    assert members[0].fuse is not None
    assert _stacked(stacks, members) == 3
    (stack,) = stacks
    assert (stack.width, stack.live) == (3, (0, 1, 2))  # grew a column per slice
    assert [(m.stack, m.column) for m in members] == [(stack, 0), (stack, 1), (stack, 2)]
    assert all(_holds(m, 20_000, salt) for salt, m in enumerate(members))
    assert stacks.info() == [{"width": 3, "live": 3, "nbytes": stack.nbytes}]
    assert _stacked(stacks, members) == 0  # nothing left loose


def test_a_rebuild_takes_the_smallest_stack_within_the_slack() -> None:
    stacks = FuseStacks(4, threading.RLock())
    small, large = _built(20_000, 1), _built(21_000, 2)
    assert small.fuse is not None and large.fuse is not None
    _stacked(stacks, [small, large])
    assert len(stacks) == 2
    # 19,000 keys fit both geometries (more slots than their own, within the slack):
    # the one with the fewest slots.
    _, _, slots = _core.fuse_geometry(19_000)
    assert slots <= small.fuse.params[3] < large.fuse.params[3] <= slots * STACK_SLACK
    assert stacks.like(19_000) == small.fuse.params
    # 20,500 need more slots than the smaller stack has.
    assert stacks.like(20_500) == large.fuse.params
    # Far fewer keys than a stack's slots, or more than it holds: their own geometry.
    assert stacks.like(2_000) is None
    assert stacks.like(200_000) is None


def test_a_full_stack_at_its_widest_is_not_offered_and_leaves_slices_loose() -> None:
    stacks = FuseStacks(2, threading.RLock())
    members = [_built(20_000, salt) for salt in range(3)]
    _stacked(stacks, members)
    (stack,) = stacks
    assert [m.stack is stack for m in members] == [True, True, False]
    assert stacks.like(20_000) is None  # no room: a rebuild keeps its own geometry
    stacks.leave(members[0])
    assert stack.live == (1,)
    assert stacks.like(20_000) == stack.params
    _stacked(stacks, members[1:])
    assert (members[2].stack, members[2].column) == (stack, 0)  # the freed column
    assert _holds(members[2], 20_000, 2)


def test_leaving_the_last_column_removes_the_stack() -> None:
    stacks = FuseStacks(4, threading.RLock())
    member = _built(20_000, 0)
    stacks.leave(member)  # not stacked: nothing to do
    _stacked(stacks, [member])
    assert len(stacks) == 1
    stacks.leave(member)
    assert len(stacks) == 0 and stacks.info() == []


def test_a_slice_gone_while_it_was_copied_is_not_stacked() -> None:
    stacks = FuseStacks(4, threading.RLock())
    member = _built(20_000, 0)
    calls = [0]

    def members() -> list[Member]:
        calls[0] += 1
        return [member] if calls[0] == 1 else []  # expired after the plan was made

    stacks.stack_loose(members, lambda: None)
    assert member.stack is None and len(stacks) == 0


def test_widths_come_from_the_headers_capped_and_skip_unreadable_files(
    tmp_path: Path,
) -> None:
    stacks = FuseStacks(2, threading.RLock())
    files, params = [], set()
    for salt in range(3):
        member = _built(20_000, salt)
        assert member.fuse is not None
        params.add(member.fuse.params)
        path = tmp_path / f"{salt}.fuse"
        atomic_write(path, fuse_file_chunks(member.fuse, SEED))
        files.append(path)
    assert len(params) == 1  # three slices of one geometry
    (tmp_path / "bad.fuse").write_bytes(b"not a fuse file")
    found = stacks.widths([*files, tmp_path / "bad.fuse", tmp_path / "missing.fuse"])
    assert found == {params.pop(): 2}  # three, capped at the widest stack


@pytest.mark.parametrize("width", [1, 3])
def test_a_new_stack_takes_the_width_it_is_given(width: int) -> None:
    stacks = FuseStacks(4, threading.RLock())
    member = _built(20_000, 0)
    assert member.fuse is not None
    stacks.stack_loose(lambda: [member], lambda: None, {member.fuse.params: width})
    (stack,) = stacks
    assert stack.width == width and stack.live == (0,)
