"""Write-ahead log of the embedded store: checksummed, group-committed, segmented.

The embedded authority acknowledges a claim only once its record is durably
in this log: appending a batch costs one ``write`` and one ``fdatasync`` of a
small sequential tail (~0.1 ms), where a durable LMDB commit rewrites about a
4 KB page per key. Recent records are served from memory and written into
LMDB in large sorted batches; once LMDB is synced up to an LSN (a
"checkpoint"), :meth:`WriteAheadLog.drop_through` deletes the segments that
hold only older records, and opening the store replays the records after the
checkpoint with :meth:`WriteAheadLog.replay`. Records are opaque bytes here.

Files
-----

A log is a directory of segment files ``wal-<first_lsn:020d>.log``, each
holding the records with consecutive LSNs from its first LSN on. The
package is split by concern:

- ``dedupcore/wal/framing.py``: the segment header and the record framing
  (their layouts), checksums, reading records back and telling a torn tail
  from damage;
- ``dedupcore/wal/segments.py``: the segment files, their creation and
  rotation, the recovery of the last one at open, and the head file (its
  layout: "The head file" there);
- ``dedupcore/wal/log.py``: :class:`WriteAheadLog`, group commit, appends
  and the rule that one thread at a time does the I/O.

Durability
----------

- ``append`` writes the whole batch with one ``write`` and makes it durable
  with one ``fdatasync`` before returning: ``fdatasync`` flushes the data and
  the file size (the metadata needed to read the data back), skipping only
  timestamps. Concurrent appends are group-committed: one leader writes
  everything queued and syncs once for all of them.
- ``sync="none"`` skips that ``fdatasync``: an acknowledged record is in the
  kernel's page cache, so it survives a crash of the process (SIGKILL, OOM
  kill, segfault) but NOT a power loss or kernel crash. The write being that
  mode's whole commit, ``write`` makes it at once for a small queue when no
  other I/O runs (16 KiB, ``WRITE_THROUGH_BYTES``). Use it only where
  losing the last moments of acknowledged claims on power loss is acceptable.
- A new segment is written as a temporary file (header, ``fsync``), renamed
  into place, and then the directory is ``fsync``-ed: a file's ``fsync`` does
  not make its directory entry durable, so without the directory sync a power
  loss could lose the whole new segment with the records acknowledged in it.
  Before a segment is created the previous one is synced even with
  ``sync="none"``, so every segment but the last is complete on disk.
- Cutting a torn tail overwrites it with zeros and fsyncs the segment
  before anything new is appended: cut bytes that came back after a later
  power loss would put stale records under the LSNs that new records
  reuse. Deleting segments (``drop_through``) is followed by a directory
  ``fsync``, which only makes the freed space stick (a dropped segment that
  reappears precedes the checkpoint, is never read and is dropped again).
- ``write`` + ``sync(lsn)`` split ``append`` for a caller (the store) that
  orders records under its own lock and waits for durability outside it.
- A failed ``write`` or ``fdatasync`` (ENOSPC, EIO, a read-only filesystem)
  raises ``OSError`` to every caller whose records were in that commit and
  fails the log: the bytes after the last acknowledged record are unknown,
  and after a failed ``fsync`` the kernel may have dropped the dirty pages
  and report success next time, so nothing is acknowledged after it. Later
  calls raise :class:`WalFailedError` until the log is reopened.
- A new segment that cannot be put in place (out of file descriptors, a full
  disk: opening, writing, syncing or renaming its temporary file) does NOT
  fail the log: no byte of a record was written, so nothing acknowledged is
  in doubt. The temporary file is removed, appends go on in the current
  segment, and the rotation is tried again at the next commit past
  ``segment_bytes`` (or the next ``rotate``, which raises the error). Only
  a failed sync of the current segment before it, or of the directory after
  the rename, fails the log.

The zero-filled tail
--------------------

An ``fdatasync`` after an append that makes the file longer also writes the
file's new size and its new blocks to the filesystem's journal; after an
append that overwrites blocks the file already has, it writes the data alone.
On this project's ext4 test disk the second takes about 115 µs p50 against
155-180 µs for the first, and has a far shorter tail. So in ``fdatasync``
mode the log writes zeros ahead of its appends: when a small commit would
pass the zeros already written, zeros are written first from the end of the
file to as far past the records as the segment already holds (64 KiB to 1
MiB), and that commit's ``fdatasync`` makes them part of the file. The
commits after it land on those blocks. A large commit (more than half a
fill) extends the file itself. A commit made on the native commit thread
(``start_commit``) has the thread write its zeros too, before its records.

The zeros are never part of a record and nothing depends on them: a fill
that fails (a full disk) is given up for the rest of the segment. They stay
where they are: a segment keeps the zeros after its last record when the
next one is created and when the log closes (at most 1 MiB each), because a
file that readers may have mapped (a read-only open, ``dedupcore check``,
while the owner runs) is never made shorter while it is in use; reading a
mapped page past a file's new end would kill the reader (``SIGBUS``).
Replay reads a segment before the last up to its zeros, and the next
segment's first LSN says whether records are missing. After a crash, the
last segment may end in zeros too: they hold nothing of a record, and
nothing a later record could be mistaken for, so opening keeps them for the
appends and changes nothing on disk (a debug message on the
``dedupcore.wal`` logger says how many). Garbage before them is a torn
tail, cut with them by the owner's open (below).

A read-only open while the owner appends can catch a commit half-written over
those zeros, its first bytes still zero and later ones written, which looks
like damage (below). So a read-only open that finds damage in the last
segment scans it again after a pause (50 ms, up to four scans), and reports
the damage only once two scans in a row find it alike. It also lists the
segments twice: a directory listing need not return an entry added while it
runs, so a listing made while the owner rotates can miss one segment and
list a later one, a gap that reads as lost records. Every segment up to the
newest the first listing saw was in place before the second began, so the
second lists them all; the view keeps those and leaves out what the owner
added since.

Recovery: torn tail versus damage
---------------------------------

A crash can leave two things only. A temporary file ``.wal-*.log.tmp`` of a
segment whose creation was interrupted before its rename (it never held a
record; opening deletes it): a segment is renamed into place only once its
header is synced, so a segment *in place* always has a valid header. And a
torn tail: garbage after the last durable record of the *last* segment (a
batch partly written, a zero-filled or garbage tail from the filesystem),
with no valid record after it that continues the log. Opening the log cuts
such a tail at the last valid record: its bytes are overwritten with zeros
and the segment is fsynced, and a warning on the ``dedupcore.wal`` logger
says how many bytes were dropped and why. The file keeps its length, as it
does its zeros (above): a process that has the segment mapped (a read-only
open, ``dedupcore check``) reads zeros where the tail was, where a
truncation made its next read past the new end die of SIGBUS. A tail of
zeros alone is kept (above, "The zero-filled tail"). Records cut off this
way were never acknowledged in ``fdatasync`` mode.

Everything else is damage to acknowledged records (media error, a stray
write, a file from elsewhere), and raises :class:`CorruptFileError` naming
the file, the offset and the first LSN affected, instead of silently
forgetting those records:

- a segment in place without a valid header, whatever its size (empty,
  shorter than a header, zero-filled, garbage);
- invalid bytes in the last segment followed by a valid record that carries
  the next expected LSN or any later one: the records after the damage were
  written, so the ones it covers were too. Opening searches the rest of the
  segment for such a record before it cuts anything. (Should a power loss
  write the pages of an unsynced batch out of order, leaving a hole inside
  that never-acknowledged batch, opening refuses too: the log cannot tell
  that hole from damage, and refusing is the side that loses nothing.)
- an invalid record or header anywhere else: inside a segment followed by
  another segment (zeros alone after its last record excepted), or the
  header of a segment needed for replay (a segment is created only after the
  previous one was synced complete);
- with ``must_exist`` (the store's log once a checkpoint was taken from it):
  a missing log directory, or one without a segment;
- with a head file (below): a log that lacks the newest segment the head
  names, or that is missing altogether while the head says it was not
  closed clean.

The operator decides: restore the file, or truncate it at the offset given
(and delete later segments) to accept the loss.

The head file
-------------

A log deleted whole, or the newest segment of it, leaves nothing inside the
log directory to say that records are missing. A log opened with
``head=PATH`` (outside its directory; the store passes ``<data>/WAL_HEAD``)
keeps there the first LSN of the newest segment it created and whether it
was closed clean, and opening refuses a log that lacks what the head names
(dedupcore/wal/segments.py, "The head file").
"""

from __future__ import annotations

from dedupcore.errors import WalFailedError
from dedupcore.wal.framing import CHECKSUM as CHECKSUM
from dedupcore.wal.framing import FORMAT_VERSION as FORMAT_VERSION
from dedupcore.wal.framing import FRAME_HEAD as FRAME_HEAD
from dedupcore.wal.framing import FRAME_OVERHEAD as FRAME_OVERHEAD
from dedupcore.wal.framing import HEADER as HEADER
from dedupcore.wal.framing import HEADER_SIZE as HEADER_SIZE
from dedupcore.wal.framing import MAGIC as MAGIC
from dedupcore.wal.framing import MAX_LSN as MAX_LSN
from dedupcore.wal.framing import MAX_RECORD_BYTES
from dedupcore.wal.log import DEFAULT_SEGMENT_BYTES, SYNC_MODES, WriteAheadLog
from dedupcore.wal.log import MIN_SEGMENT_BYTES as MIN_SEGMENT_BYTES
from dedupcore.wal.log import SyncMode as SyncMode
from dedupcore.wal.segments import HEAD as HEAD
from dedupcore.wal.segments import HEAD_MAGIC as HEAD_MAGIC
from dedupcore.wal.segments import HEAD_SIZE as HEAD_SIZE
from dedupcore.wal.segments import HEAD_VERSION as HEAD_VERSION
from dedupcore.wal.segments import LogHead, read_head

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "MAX_RECORD_BYTES",
    "SYNC_MODES",
    "LogHead",
    "WalFailedError",
    "WriteAheadLog",
    "read_head",
]
