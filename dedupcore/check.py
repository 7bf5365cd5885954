"""Checks an embedded store's data directory for damage that stays silent until read.

A flipped byte in an LMDB key makes its record unfindable (a lookup goes to
where the key should be and finds nothing), so the key could come back NEW;
a damaged filter file or log frame shows only when it is read. A full scan
catches all of them: every record's checksum covers its digest, and every
file of the store carries checksums its loader verifies.
:func:`check_data_dir` runs that scan; ``dedupcore check`` prints it
(docs/operations.md says what each finding means and what to do).

It only reads, and works while a daemon serves the directory: nothing is
written, the owner's lock is never taken (LMDB registers the check as a
reader in its lock file, as any reader; its read transactions are
snapshots, one per slice so the owner's file does not grow meanwhile), the
log and filter files are opened read-only. Memory stays bounded: records
are read a batch at a time and damage is kept as runs (first and last
digest, count), at most ``max_runs`` per slice.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import lmdb

import dedupcore._engine as _engine
from dedupcore.bloom import BloomFilter
from dedupcore.errors import (
    CorruptFileError,
    NotADataDirectoryError,
    UnsupportedFormatError,
)
from dedupcore.ring import RING_MANIFEST, BloomRing
from dedupcore.store.front import FRONT_COVERS, read_covers
from dedupcore.store.lockfile import LOCK_FILE
from dedupcore.store.store import LOG_HEAD_FILE
from dedupcore.tiers.lmdb import LmdbTier, SliceInfo
from dedupcore.wal import WriteAheadLog

__all__ = [
    "DAMAGE",
    "NOTICE",
    "CheckReport",
    "Finding",
    "NotADataDirectoryError",
    "check_data_dir",
]

#: A finding that means stored data changed or went missing (exit code 1).
DAMAGE = "damage"
#: Something unusual that loses nothing (the store repairs or ignores it).
NOTICE = "notice"

#: Records read and checked per batch (bounded memory whatever the slice's size).
_BATCH = 65_536
#: How often the check reads the log again when a live owner's checkpoint moved
#: under it (segments dropped while they were read are not damage).
_LOG_RETRIES = 5
_SLICE_META = struct.Struct("<QQQB")

#: (stage, done, total) while the check runs: a progress bar's feed.
Progress = Callable[[str, int, int], None]


@dataclass
class Finding:
    """One thing the check found (docs/operations.md, "What a finding means")."""

    severity: str  #: DAMAGE or NOTICE
    kind: str  #: record, slice-filter, lmdb, meta, inflight, front, cold, key-log, wal, head, lock
    path: str  #: the file or directory
    message: str
    slice: int | None = None  #: warm-tier slice id, for records and slice filters
    first: str | None = None  #: hex digest of the first record of a damaged run
    last: str | None = None  #: hex digest of its last record
    count: int = 0  #: records in the run (or items affected)


@dataclass
class CheckReport:
    """What :func:`check_data_dir` found, and what it read."""

    path: str
    findings: list[Finding] = field(default_factory=list)
    #: What was read: records, slices, slice_filters, front_slices, cold_rings,
    #: key_logs, wal_records, ...
    checked: dict[str, int] = field(default_factory=dict)
    #: The pid in the lock file when that process is running (a live owner), else None.
    owner: int | None = None

    @property
    def damaged(self) -> bool:
        """Whether any finding is damage."""
        return any(f.severity == DAMAGE for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (``dedupcore check --json``)."""
        return {
            "path": self.path,
            "damaged": self.damaged,
            "owner": self.owner,
            "checked": dict(self.checked),
            "findings": [asdict(f) for f in self.findings],
        }

    def _add(self, severity: str, kind: str, path: Path | str, message: str, **kw: Any) -> None:
        self.findings.append(Finding(severity, kind, str(path), message, **kw))

    def _count(self, what: str, n: int = 1) -> None:
        self.checked[what] = self.checked.get(what, 0) + n


def check_data_dir(
    path: str | os.PathLike[str], *, progress: Progress | None = None, max_runs: int = 100
) -> CheckReport:
    """Reads every file of a data directory and returns what is damaged.

    Verifies every record of every warm slice (its checksum over digest and
    value, so a record whose key changed fails too) and that the slice's
    filter holds its key; LMDB's meta entries and in-flight index; every
    sealed and saved slice filter; the front filter and the cold archive
    (manifests, Bloom and fuse files through their loaders, key logs); the
    write-ahead log past the checkpoint (frames and payloads) and its head
    file; the lock file. Changes nothing; see the module docstring.

    Raises ``FileNotFoundError`` (no such path), ``NotADirectoryError`` (a
    file), :class:`NotADataDirectoryError` (an empty directory, or one that
    holds no store), ``PermissionError``, and
    :class:`~dedupcore.errors.UnsupportedFormatError` for a directory a newer
    version wrote: nothing was checked.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"{root}: no such data directory")
    if not root.is_dir():
        raise NotADirectoryError(f"{root}: not a directory (give the store's data directory)")
    _check_is_store(root)
    report = CheckReport(str(root))
    say: Progress = progress or (lambda stage, done, total: None)
    _check_lock(root, report)
    tier = _open_lmdb(root, report)
    try:
        if tier is not None:
            _check_meta(tier, report)
            _check_inflight(tier, report)
            _check_slices(tier, root, report, say, max_runs)
        _check_slice_files(root, tier, report)
        _check_front(root, tier, report)
        _check_cold(root, report)
        _check_log(root, tier, report, say)
    finally:
        if tier is not None:
            tier.close()
    return report


# -- the directory and its lock ------------------------------------------------


def _check_is_store(root: Path) -> None:
    entries = os.listdir(root)
    if not entries:
        raise NotADataDirectoryError(f"{root}: empty directory, not a dedupcore data directory")
    if not (
        (root / "lmdb" / "data.mdb").exists()
        or (root / LOG_HEAD_FILE).exists()
        or any((root / "wal").glob("wal-*.log"))
    ):
        raise NotADataDirectoryError(
            f"{root}: not a dedupcore data directory (no lmdb/data.mdb, {LOG_HEAD_FILE} or "
            "wal/ segment); give the directory `dedupcore serve --data` uses"
        )


def _check_lock(root: Path, report: CheckReport) -> None:
    """The owner's lock file: read, never locked (a lock taken here, even shared,
    could make the owner's start fail)."""
    lock = root / LOCK_FILE
    if not lock.exists():
        return
    report._count("lock_files")
    raw = lock.read_bytes()
    if not raw:  # opened before its pid was written, or never written
        return
    match = re.fullmatch(rb"(\d+)\n", raw)
    if match is None:
        report._add(
            NOTICE,
            "lock",
            lock,
            f"holds {raw[:40]!r}, not a process id (rewritten by the next owner; harmless)",
        )
        return
    report.owner = _lock_holder(lock)


def _lock_holder(lock: Path) -> int | None:
    """The pid holding the lock file's flock, from /proc/locks (Linux; None elsewhere
    or when nobody holds it): looked up, never tried, and no stale pid trusted."""
    try:
        st = lock.stat()
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a waiter has "->" first)
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == want:
            try:
                return int(fields[4])
            except ValueError:
                return None
    return None


# -- LMDB ----------------------------------------------------------------------


def _open_lmdb(root: Path, report: CheckReport) -> LmdbTier | None:
    data = root / "lmdb" / "data.mdb"
    if not data.exists():
        report._add(
            DAMAGE,
            "lmdb",
            root / "lmdb",
            "no LMDB environment: every checkpointed record is missing",
        )
        return None
    try:
        # A map as large as the file may become while the check runs (address
        # space only, mapped read-only).
        return LmdbTier(
            root / "lmdb",
            map_size=max(1 << 30, 4 * data.stat().st_size),
            readonly=True,
            sync=False,
            filters=root / "slices",
            load_filters=False,
        )
    except UnsupportedFormatError:
        raise
    except (CorruptFileError, lmdb.Error) as exc:
        report._add(DAMAGE, "lmdb", root / "lmdb", f"cannot be read: {exc}")
        return None


def _check_meta(tier: LmdbTier, report: CheckReport) -> None:
    where = tier.path / "data.mdb"
    with tier.env.begin(db=tier.meta) as txn:
        for key, value in txn.cursor():
            report._count("meta_entries")
            key, value = bytes(key), bytes(value)
            problem = None
            if key == b"checkpoint_lsn" and len(value) != 8:
                problem = f"is {len(value)} bytes, not 8"
            elif key == b"log_head" and value != b"1":
                problem = f"is {value!r}, not b'1'"
            elif key.startswith(b"ns:") and (len(value) != 2 or len(key) == 3):
                problem = f"namespace entry of {len(value)} bytes, not 2"
            if problem is not None:
                report._add(DAMAGE, "meta", where, f"meta entry {key!r} {problem}")


def _check_inflight(tier: LmdbTier, report: CheckReport) -> None:
    where = tier.path / "data.mdb"
    bad = 0
    with tier.env.begin(db=tier.inflight) as txn:
        for key, value in txn.cursor():
            report._count("inflight_entries")
            if len(key) != 16 or len(value):
                bad += 1
    if bad:
        report._add(
            DAMAGE,
            "inflight",
            where,
            f"{bad} in-flight index entries are not a 16-byte digest with an empty value",
            count=bad,
        )


class _Runs:
    """Consecutive damaged records of one slice as (first, last, count) runs."""

    def __init__(self, report: CheckReport, kind: str, where: Path, sid: int, what: str) -> None:
        self.report, self.kind, self.where, self.sid, self.what = report, kind, where, sid, what
        self.first: bytes | None = None
        self.last = b""
        self.count = 0
        self.runs = 0
        self.total = 0

    def bad(self, digest: bytes) -> None:
        if self.first is None:
            self.first = digest
        self.last = digest
        self.count += 1
        self.total += 1

    def good(self) -> None:
        if self.first is not None:
            self.runs += 1
            self.report._add(
                DAMAGE,
                self.kind,
                self.where,
                self.what,
                slice=self.sid,
                first=self.first.hex(),
                last=self.last.hex(),
                count=self.count,
            )
            self.first, self.count = None, 0


def _slice_db(tier: LmdbTier, txn: lmdb.Transaction, info: SliceInfo) -> tuple[Any, bool, int]:
    """(database, sealed, records in its meta entry) of a slice as this snapshot
    has it; None when a live owner dropped it since it was listed."""
    raw = txn.get(info.meta_key(), db=tier.meta)
    if raw is None:
        return None, False, 0
    records, _first, _last, state = _SLICE_META.unpack(bytes(raw))
    name = info.compacted_name if state == 2 else info.inserted_name
    try:
        return tier.env.open_db(name, txn=txn, create=False), state != 0, records
    except lmdb.NotFoundError:
        raise CorruptFileError(f"slice {info.id} is listed but its database is missing") from None


def _check_slices(
    tier: LmdbTier, root: Path, report: CheckReport, say: Progress, max_runs: int
) -> None:
    infos = tier.slice_infos()
    where = tier.path / "data.mdb"
    total = sum(i.records for i in infos)  # as listed (a progress bar's total)
    done = 0
    for info in infos:
        report._count("slices")
        bloom = _sealed_filter(tier, info, report)
        records = _Runs(
            report,
            "record",
            where,
            info.id,
            "records fail their checksum (value, or the key it is stored under): a lookup "
            "of these keys raises, or misses them and answers NEW",
        )
        misses = _Runs(
            report,
            "slice-filter",
            tier.filters.path(info.id),
            info.id,
            "the slice's filter lacks these keys: lookups skip the slice for them",
        )
        try:
            with tier.env.begin(buffers=False) as txn:
                db, sealed, listed = _slice_db(tier, txn, info)
                if db is None:
                    report._add(
                        NOTICE,
                        "lmdb",
                        where,
                        f"slice {info.id} was dropped by the owner while the check ran",
                        slice=info.id,
                    )
                    continue
                entries = int(txn.stat(db)["entries"])
                if entries != listed:
                    report._add(
                        DAMAGE,
                        "meta",
                        where,
                        f"slice {info.id}: its meta entry says {listed} records, its database "
                        f"holds {entries}",
                        slice=info.id,
                    )
                for batch in _batches(txn.cursor(db=db)):
                    done += len(batch)
                    _check_records(batch, records, misses if sealed else None, bloom)
                    say("records", done, total)
                    if records.runs + misses.runs >= max_runs:
                        report._add(
                            DAMAGE,
                            "record",
                            where,
                            f"slice {info.id}: more than {max_runs} damaged runs; the rest of "
                            "the slice was not read",
                            slice=info.id,
                        )
                        break
        except CorruptFileError as exc:
            report._add(DAMAGE, "lmdb", where, str(exc), slice=info.id)
            continue
        records.good()
        misses.good()
        report._count("records", entries)


def _batches(cursor: lmdb.Cursor) -> Iterator[list[tuple[bytes, bytes]]]:
    batch: list[tuple[bytes, bytes]] = []
    for item in cursor:  # bytes: the transaction is opened with buffers=False
        batch.append(cast("tuple[bytes, bytes]", item))
        if len(batch) >= _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _check_records(
    batch: list[tuple[bytes, bytes]],
    records: _Runs,
    misses: _Runs | None,
    bloom: BloomFilter | None,
) -> None:
    good: list[bytes] = []
    for digest, value in batch:
        try:
            if len(digest) != 16:
                raise ValueError("not a digest")
            _engine.decode_value(digest, value)
        except ValueError:
            records.bad(digest)
            continue
        records.good()
        good.append(digest)
    if misses is None or bloom is None or not good:
        return
    joined = b"".join(good)
    held = bloom.contains_many(memoryview(joined).cast("Q")[1::2])
    for digest, hit in zip(good, held, strict=True):
        if hit:
            misses.good()
        else:
            misses.bad(digest)


def _sealed_filter(tier: LmdbTier, info: SliceInfo, report: CheckReport) -> BloomFilter | None:
    """A sealed slice's filter file, verified by its loader (None if absent or damaged)."""
    if not info.sealed:
        return None
    path = tier.filters.path(info.id)
    report._count("slice_filters")
    try:
        return BloomFilter.open(path, mmap=True, verify=True)
    except FileNotFoundError:
        report._add(
            NOTICE,
            "slice-filter",
            path,
            "missing: the next writable open rebuilds it from the slice's keys",
            slice=info.id,
        )
    except CorruptFileError as exc:
        report._add(
            DAMAGE,
            "slice-filter",
            path,
            f"{_reason(exc, path)}: the next writable open rebuilds it from the slice's keys",
            slice=info.id,
        )
    return None


def _check_slice_files(root: Path, tier: LmdbTier | None, report: CheckReport) -> None:
    """The open slice's filters saved at a clean close (``<id>.open-<lsn>-<n>.bloom``)."""
    for path in sorted((root / "slices").glob("*.open-*.bloom")):
        report._count("slice_filters")
        try:
            BloomFilter.open(path, mmap=True, verify=True)
        except CorruptFileError as exc:
            report._add(
                DAMAGE,
                "slice-filter",
                path,
                f"{_reason(exc, path)}: the next open rebuilds the open slice's filter instead",
            )


# -- filters -------------------------------------------------------------------


def _check_front(root: Path, tier: LmdbTier | None, report: CheckReport) -> None:
    front = root / "front"
    if not (front / RING_MANIFEST).exists():
        if tier is not None and tier.slice_infos():
            report._add(
                NOTICE,
                "front",
                front,
                "no saved front filter: the next open rebuilds it from LMDB",
            )
        return
    try:
        ring = BloomRing.open(front, readonly=True, verify=True)
    except CorruptFileError as exc:
        report._add(DAMAGE, "front", front, f"{exc}: the next writable open rebuilds it from LMDB")
        return
    report._count("front_slices", len(ring.slices()))
    covers = front / FRONT_COVERS
    if covers.exists() and read_covers(covers)[0] < 0:
        report._add(
            DAMAGE,
            "front",
            covers,
            "cannot be read: the next open rebuilds the front filter from LMDB",
        )


def _check_cold(root: Path, report: CheckReport) -> None:
    cold = root / "cold"
    if not cold.is_dir():
        return
    for ring_dir in sorted(p for p in cold.iterdir() if p.is_dir()):
        if not (ring_dir / RING_MANIFEST).exists():
            if any(ring_dir.glob("slice-*")):
                report._add(
                    DAMAGE,
                    "cold",
                    ring_dir / RING_MANIFEST,
                    "missing while slice files are present: the store refuses to open (the "
                    "archive cannot be rebuilt)",
                )
            continue
        try:
            ring = BloomRing.open(ring_dir, readonly=True, verify=True, key_logs=True)
        except CorruptFileError as exc:
            report._add(
                DAMAGE,
                "cold",
                ring_dir,
                f"{exc}: the store refuses to open (the archive cannot be rebuilt)",
            )
            continue
        report._count("cold_rings")
        report._count("cold_slices", len(ring.slices()))
        for keylog in ring.vouched_key_logs():
            report._count("key_logs")
            try:
                keylog.check()
            except CorruptFileError as exc:
                report._add(
                    DAMAGE,
                    "key-log",
                    keylog.path,
                    f"{_reason(exc, keylog.path)}: the slice stays a Bloom filter (nothing is "
                    "lost; it is not rebuilt smaller)",
                )


# -- the log -------------------------------------------------------------------


def _check_log(root: Path, tier: LmdbTier | None, report: CheckReport, say: Progress) -> None:
    head_kept = tier.log_head_kept() if tier is not None else False
    for attempt in range(_LOG_RETRIES):
        checkpoint = tier.checkpoint_lsn() if tier is not None else 0
        try:
            records, nbytes = _read_log(root, checkpoint, head_kept, say)
        except (CorruptFileError, FileNotFoundError) as exc:
            # A live owner's checkpoint may have dropped segments while they were
            # read: only damage that stays with the same checkpoint counts.
            moved = tier is not None and tier.checkpoint_lsn() != checkpoint
            if moved and attempt < _LOG_RETRIES - 1:
                continue
            if isinstance(exc, FileNotFoundError):
                report._add(NOTICE, "wal", root / "wal", f"no log: {exc}")
                return
            kind = "head" if LOG_HEAD_FILE in str(exc).split(":")[0] else "wal"
            report._add(DAMAGE, kind, root / "wal", str(exc))
            return
        report._count("wal_records", records)
        report._count("wal_bytes", nbytes)
        return


def _read_log(root: Path, checkpoint: int, head_kept: bool, say: Progress) -> tuple[int, int]:
    """Reads (records, payload bytes) of the log past ``checkpoint``, checking every
    frame and payload; CorruptFileError at the first that fails."""
    wal = WriteAheadLog.open(
        root / "wal",
        readonly=True,
        must_exist=checkpoint > 0,
        head=root / LOG_HEAD_FILE,
        head_required=head_kept,
    )
    try:
        total = wal.last_lsn - checkpoint
        records = nbytes = 0
        for lsn, payload in wal.replay(checkpoint):
            try:
                # A table of its own per payload: memory stays one payload's worth.
                _engine.ClaimTable().replay(payload, lsn, 0.0)
            except ValueError as exc:
                raise CorruptFileError(f"{wal.path}: log record {lsn} is damaged: {exc}") from None
            records += 1
            nbytes += len(payload)
            say("log", records, total)
        return records, nbytes
    finally:
        wal.close()


def _reason(exc: Exception, path: Path) -> str:
    """An error's message without the path it starts with (the finding names it)."""
    text = str(exc)
    prefix = f"{path}: "
    return text[len(prefix) :] if text.startswith(prefix) else text
