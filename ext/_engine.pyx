# cython: language_level=3, embedsignature=True, cdivision=True, boundscheck=False, wraparound=False
"""Native claim engine of the embedded store (private; see docs/engine.md).

:class:`ClaimTable` is the store's in-memory table of records and its batch
decisions over it; ``encode_value``/``decode_value`` are the stored record
format. The engine raises only built-in exceptions: ``ValueError`` for bytes
that fail their checksum or do not parse (the store turns it into
CorruptFileError), ``MemoryError`` when an allocation fails (nothing changed).

The work that touches no Python object runs with the GIL released: the
decision loops, the staging, the log encoding, the checkpoint export's scan.
"""

import threading
import types

_MemberDescriptor = types.MemberDescriptorType

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memcmp
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_FromStringAndSize
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.ref cimport PyObject

include "_status.pxi"


cdef extern from "dc_engine.h" nogil:
    ctypedef struct dc_export:
        unsigned char* items
        size_t items_len
        size_t cap
        size_t n
        double newest
    ctypedef struct dc_extra:
        uint32_t refs
        uint32_t result_len
        uint8_t has
        uint8_t owner_len
        uint8_t fp_len
    ctypedef struct dc_rec:
        unsigned char digest[16]
        uint64_t token
        uint64_t lsn
        double created
        double updated
        double deadline
        dc_extra* extra
        float lease
        uint16_t ns_id
        uint8_t state
        uint8_t renewal
    ctypedef struct dc_table:
        dc_rec* slots
        uint64_t mask
        dc_rec* old
        uint64_t old_mask
        uint64_t count
        uint64_t inflight
        uint64_t clean
        dc_export changes
        size_t jcap, lcap
    ctypedef struct dc_jent:
        unsigned char digest[16]
        uint64_t lsn
    ctypedef struct dc_hit:
        unsigned char digest[16]
        uint64_t token
        double updated
        uint16_t ns_id
    ctypedef struct dc_stage:
        dc_rec* recs
        size_t n
    ctypedef struct dc_claim_io:
        const unsigned char* digests
        size_t n
        const unsigned char* const* fps
        const size_t* fp_lens
        const unsigned char* owner
        size_t owner_len
        const unsigned char* cold
        uint16_t ns_id
        float lease
        double now_w
        double now_m
        const dc_rec* side
        size_t side_n
        unsigned char* outcomes
        uint64_t* tokens
        const dc_extra** dup_extra
        uint64_t depends
        int64_t conflict
        uint64_t takeovers, n_new, n_dup, n_busy, n_writes
    ctypedef struct dc_change_io:
        const unsigned char* digests
        size_t n
        const uint64_t* tokens
        const unsigned char* const* results
        const size_t* result_lens
        uint8_t state
        double now_w
        uint64_t depends
        int64_t error_index
        int error_kind
        uint64_t current_token
        uint64_t n_writes
    ctypedef struct dc_extend_io:
        const unsigned char* digests
        size_t n
        const uint64_t* tokens
        float lease
        double now_m
        int64_t error_index
        int error_kind
        uint64_t current_token

    int DC_PROCESSING, DC_PROCESSED, DC_RELEASED
    int DC_HAS_OWNER, DC_HAS_FP, DC_HAS_RESULT
    const unsigned char* dc_owner(const dc_extra* e)
    const unsigned char* dc_fp(const dc_extra* e)
    const unsigned char* dc_result(const dc_extra* e)
    void dc_incref(dc_extra* e)
    void dc_decref(dc_extra* e)
    dc_extra* dc_extra_new(const unsigned char* owner, size_t owner_len, int has_owner,
                           const unsigned char* fp, size_t fp_len, int has_fp,
                           const unsigned char* result, size_t result_len, int has_result,
                           int* oom)
    dc_status dc_table_init(dc_table* t, uint64_t capacity)
    void dc_table_free(dc_table* t)
    dc_rec* dc_find(const dc_table* t, const unsigned char* digest)
    void dc_prefetch_slot(const dc_table* t, const unsigned char* digest)
    int dc_live(const dc_rec* r)
    dc_status dc_put(dc_table* t, const dc_rec* r, int note)
    dc_status dc_evict(dc_table* t, uint64_t upto, size_t limit, int* more, uint64_t* dropped)
    uint64_t dc_dirty(const dc_table* t, uint64_t after)
    void dc_scan_begin(dc_table* t)
    void dc_scan_end(dc_table* t)
    dc_status dc_scan_step(dc_table* t, size_t limit, size_t max_hits, double deadline_before,
                           double updated_before, dc_hit* hits, size_t* n_hits,
                           size_t* visited, int* more)
    size_t dc_missing(const dc_table* t, const unsigned char* digests, size_t n, size_t* out)
    const dc_rec* dc_side_find(const dc_rec* side, size_t n, const unsigned char* d)
    const dc_rec* dc_find_beside(const dc_table* t, const dc_rec* side, size_t n,
                                 const unsigned char* d)
    dc_status dc_read_records(dc_table* t, const unsigned char* digests,
                              const unsigned char* const* values, const size_t* lens, size_t n,
                              double now_m, dc_rec* side, size_t* side_n, size_t* bad)
    size_t dc_value_bound(const dc_rec* r)
    size_t dc_encode_value(const dc_rec* r, unsigned char* out)
    void dc_take_changes(dc_table* t, dc_export* x)
    dc_status dc_give_back(dc_table* t, dc_export* x)
    dc_status dc_sort_packed(const unsigned char* inp, size_t length, size_t n,
                             unsigned char* out, size_t* out_len, size_t* kept)
    dc_status dc_decode_value(const unsigned char* digest, const unsigned char* p,
                              size_t length, dc_rec* r)
    dc_status dc_stage_init(dc_stage* s, size_t cap)
    void dc_stage_free(dc_stage* s)
    dc_status dc_decide_claim(const dc_table* t, dc_stage* s, dc_claim_io* io)
    dc_status dc_decide_change(const dc_table* t, dc_stage* s, dc_change_io* io)
    dc_status dc_decide_extend(const dc_table* t, dc_stage* s, dc_extend_io* io)
    dc_status dc_apply(dc_table* t, const dc_stage* s, uint64_t lsn)
    uint64_t dc_xxh64(const void* data, size_t length, uint64_t seed)
    void dc_xxh64_pair(const void* data, size_t length, uint64_t seed_a,
                       uint64_t seed_b, uint64_t* a, uint64_t* b)

PROCESSING = 1
PROCESSED = 2
RELEASED = 3


# -- answers built without calling their class ---------------------------------
#
# A Claim is a slotted dataclass whose __init__ only stores its seven fields.
# Calling it costs ~140 ns per key, most of a batch answer's Python work; a
# Claim made the way __init__ would leave it (allocated, its slots filled in)
# costs a fraction of that. A class is taken only after checking that its
# fields are exactly its own object slots (docs/engine.md, "Answers");
# anything else is called as usual.

cdef extern from "Python.h":
    ctypedef struct PyTypeObject:
        Py_ssize_t tp_basicsize
        void* tp_alloc
    ctypedef struct PyMemberDef:
        const char* name
        int type
        Py_ssize_t offset
        int flags
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member
    object PyType_GenericAlloc(PyTypeObject* t, Py_ssize_t nitems)
    void Py_INCREF(object o)
    void PyObject_GC_Track(object o)
    void PyObject_GC_UnTrack(object o)
    int PyObject_GC_IsTracked(object o)

cdef enum:
    _T_OBJECT_EX = 16  # structmember.h: an object slot, AttributeError while unset
    _NFIELDS = 7

cdef object _fast_type = None  # the class bound below, or None
cdef Py_ssize_t _offsets[_NFIELDS]


def bind_record_class(cls, tuple fields):
    """Lets answers of ``cls`` be built by filling its slots (True), after checking
    that ``fields`` (in __init__ order) are exactly its own object slots, that its
    instances have no __dict__ and that nothing runs after __init__. False leaves
    ``cls`` called as usual."""
    global _fast_type
    cdef Py_ssize_t i
    cdef PyMemberDef* m
    cdef PyTypeObject* t
    if len(fields) != _NFIELDS or not isinstance(cls, type):
        return False
    t = <PyTypeObject*><PyObject*>cls
    if t.tp_alloc != <void*>PyType_GenericAlloc:
        return False
    if tuple(getattr(cls, "__slots__", ())) != fields or cls.__dictoffset__ != 0:
        return False
    if hasattr(cls, "__post_init__") or any(
        getattr(base, "__slots__", ()) for base in cls.__mro__[1:]
    ):
        return False
    offsets = []
    for i in range(_NFIELDS):
        desc = cls.__dict__.get(fields[i])
        if type(desc) is not _MemberDescriptor:
            return False
        m = (<PyMemberDescrObject*><PyObject*>desc).d_member
        if m.type != _T_OBJECT_EX or m.flags != 0 or m.offset <= 0 or (
            m.offset + <Py_ssize_t>sizeof(PyObject*) > t.tp_basicsize
        ):
            return False
        offsets.append(m.offset)
    for i in range(_NFIELDS):
        _offsets[i] = offsets[i]
    _fast_type = cls
    return True


cdef inline void _put(char* base, Py_ssize_t offset, object v):
    Py_INCREF(v)
    (<PyObject**>(base + offset))[0] = <PyObject*>v


cdef object _record(object cls, object a, object b, object c, object d,
                    object e, object f, object g):
    """``cls(a, b, c, d, e, f, g)``; for the bound class, by filling its slots, and
    left untracked by the GC until :func:`_track_all` (docs/engine.md, "Answers")."""
    if cls is not _fast_type:
        return cls(a, b, c, d, e, f, g)
    # Zeroed; every slot is set before anything else runs.
    obj = PyType_GenericAlloc(<PyTypeObject*><PyObject*>cls, 0)
    PyObject_GC_UnTrack(obj)
    cdef char* base = <char*><PyObject*>obj
    _put(base, _offsets[0], a)
    _put(base, _offsets[1], b)
    _put(base, _offsets[2], c)
    _put(base, _offsets[3], d)
    _put(base, _offsets[4], e)
    _put(base, _offsets[5], f)
    _put(base, _offsets[6], g)
    return obj


cdef list _track_all(list records):
    """Hands a batch's records made by :func:`_record` to the GC, all at once.

    While a batch is built its records stay out of the GC's youngest
    generation, so the collections its allocations set off do not walk the
    thousand records of the batch again and again; a batch dropped right
    after use is never walked at all. Until this call nothing outside the
    builder holds them, so nothing can make a cycle through them."""
    cdef Py_ssize_t i
    cdef object r
    for i in range(PyList_GET_SIZE(records)):
        r = <object>PyList_GET_ITEM(records, i)
        if not PyObject_GC_IsTracked(r):
            PyObject_GC_Track(r)
    return records


def build_records(cls, list keys, str namespace, bytes outcomes, bytes tokens,
                  tuple by_code):
    """One ``cls(key, namespace, by_code[outcome], token, None, True, False)`` per key:
    the client's claims from a columns reply (tokens native-endian uint64)."""
    cdef Py_ssize_t n = len(keys), i
    if PyBytes_GET_SIZE(outcomes) != n or PyBytes_GET_SIZE(tokens) != n * 8:
        raise ValueError("one outcome and one token per key")
    cdef const unsigned char* codes = <const unsigned char*>PyBytes_AS_STRING(outcomes)
    cdef const char* toks = PyBytes_AS_STRING(tokens)
    cdef uint64_t token
    cdef Py_ssize_t ncodes = len(by_code)
    for i in range(n):
        if codes[i] >= ncodes:
            raise ValueError(f"unknown outcome code {codes[i]}")
    cdef list out = [None] * n
    for i in range(n):
        memcpy(&token, toks + 8 * i, 8)
        out[i] = _record(cls, <object>PyList_GET_ITEM(keys, i), namespace,
                         by_code[codes[i]], token, None, True, False)
    return _track_all(out)

#: Forms of ClaimTable.claim's answers.
cdef enum:
    _FORM_CLAIMS = 0
    _FORM_COLUMNS = 1
    _FORM_CHECK = 2
FORM_CLAIMS = _FORM_CLAIMS
FORM_COLUMNS = _FORM_COLUMNS
FORM_CHECK = _FORM_CHECK

#: Log payload format: u8 version, u32 count, then per record its 16-byte
#: digest, u32 value length and the value (the stored record format).
cdef enum:
    _LOG_VERSION = 2
    _LOG_CHUNK_BYTES = 8 << 20
LOG_VERSION = _LOG_VERSION
#: A log payload is closed once it passes this many bytes (the log takes up to 64 MiB).
LOG_CHUNK_BYTES = _LOG_CHUNK_BYTES


cdef inline const unsigned char* _digests_of(bytes digests, size_t* n) except NULL:
    cdef Py_ssize_t size = PyBytes_GET_SIZE(digests)
    if size % 16:
        raise ValueError("digests must be a multiple of 16 bytes")
    n[0] = <size_t>(size // 16)
    return <const unsigned char*>PyBytes_AS_STRING(digests)


cdef object _blob_part(const dc_extra* e, int which):
    if e == NULL or not (e.has & which):
        return None
    if which == DC_HAS_OWNER:
        return PyBytes_FromStringAndSize(<const char*>dc_owner(e), e.owner_len)
    if which == DC_HAS_FP:
        return PyBytes_FromStringAndSize(<const char*>dc_fp(e), e.fp_len)
    return PyBytes_FromStringAndSize(<const char*>dc_result(e), e.result_len)


cdef tuple _columns(const unsigned char* outc, const uint64_t* toks, const dc_extra** dups,
                    size_t n, unpack):
    """A decided batch as reply columns (see ClaimTable.claim, FORM_COLUMNS)."""
    cdef bytes o = PyBytes_FromStringAndSize(NULL, n)
    cdef bytes t = PyBytes_FromStringAndSize(NULL, n * sizeof(uint64_t))
    cdef unsigned char* op = <unsigned char*>PyBytes_AS_STRING(o)
    cdef uint64_t* tp = <uint64_t*>PyBytes_AS_STRING(t)
    cdef list result_index = [], results = [], cold_index = [], takeovers = []
    cdef size_t i
    cdef unsigned char c
    for i in range(n):
        c = outc[i]
        tp[i] = toks[i]
        if c == 3:  # a takeover: NEW, with its flag
            op[i] = 0
            takeovers.append(i)
        elif c == 4:  # in a cold slice only: DUPLICATE, not exact, no token
            op[i] = 1
            tp[i] = 0
            cold_index.append(i)
        else:
            op[i] = c
            if c == 1 and dups[i] != NULL and (dups[i].has & DC_HAS_RESULT):
                result_index.append(i)
                results.append(unpack(_blob_part(dups[i], DC_HAS_RESULT)))
    return o, t, result_index, results, cold_index, takeovers


cdef tuple _record_tuple(const dc_rec* r):
    return (r.state, r.ns_id, r.token, r.created, r.updated, r.lease,
            _blob_part(r.extra, DC_HAS_OWNER), _blob_part(r.extra, DC_HAS_FP),
            _blob_part(r.extra, DC_HAS_RESULT), r.lsn, r.deadline)


cdef list _encode_stage(const dc_stage* s, uint64_t* written):
    """The staged records (renewals excepted) as log payloads of at most ~8 MiB each."""
    cdef list payloads = []
    cdef size_t i = 0, j, start, size, pos, count, vlen
    cdef uint32_t vlen32, count32
    cdef unsigned char* buf
    cdef bytes out
    written[0] = 0
    while i < s.n:
        start = i
        size = 5
        count = 0
        while i < s.n and (size < _LOG_CHUNK_BYTES or count == 0):
            if not s.recs[i].renewal:
                size += 20 + dc_value_bound(&s.recs[i])
                count += 1
            i += 1
        if count == 0:
            break
        buf = <unsigned char*>malloc(size)
        if buf == NULL:
            raise MemoryError()
        try:
            with nogil:
                buf[0] = _LOG_VERSION
                count32 = <uint32_t>count
                memcpy(buf + 1, &count32, 4)
                pos = 5
                for j in range(start, i):
                    if s.recs[j].renewal:
                        continue
                    memcpy(buf + pos, s.recs[j].digest, 16)
                    vlen = dc_encode_value(&s.recs[j], buf + pos + 20)
                    vlen32 = <uint32_t>vlen
                    memcpy(buf + pos + 16, &vlen32, 4)
                    pos += 20 + vlen
            out = PyBytes_FromStringAndSize(<const char*>buf, pos)
        finally:
            free(buf)
        payloads.append(out)
        written[0] += count
    return payloads


def encode_value(bytes digest, int state, int ns_id, uint64_t token, double created,
                 double updated, float lease, owner, fingerprint, result):
    """The stored bytes of one record (the format of LMDB values and log entries)."""
    if PyBytes_GET_SIZE(digest) != 16:
        raise ValueError("a digest is 16 bytes")
    if state not in (1, 2, 3) or not 0 <= ns_id <= 65535 or token == 0:
        raise ValueError("bad record fields")
    cdef dc_rec r
    cdef int oom = 0
    cdef bytes o = owner if owner is not None else b""
    cdef bytes f = fingerprint if fingerprint is not None else b""
    cdef bytes res = result if result is not None else b""
    if len(o) > 255 or len(f) > 255:
        raise ValueError("owner and fingerprint are at most 255 bytes")
    memcpy(r.digest, PyBytes_AS_STRING(digest), 16)
    r.state = <uint8_t>state
    r.ns_id = <uint16_t>ns_id
    r.token = token
    r.created = created
    r.updated = updated
    r.lease = lease
    r.lsn = 0
    r.renewal = 0
    r.deadline = 0
    r.extra = dc_extra_new(<const unsigned char*>PyBytes_AS_STRING(o), len(o), owner is not None,
                           <const unsigned char*>PyBytes_AS_STRING(f), len(f),
                           fingerprint is not None,
                           <const unsigned char*>PyBytes_AS_STRING(res), len(res),
                           result is not None, &oom)
    if oom:
        raise MemoryError()
    cdef size_t bound = dc_value_bound(&r)
    cdef unsigned char* buf = <unsigned char*>malloc(bound)
    if buf == NULL:
        dc_decref(r.extra)
        raise MemoryError()
    try:
        n = dc_encode_value(&r, buf)
        return PyBytes_FromStringAndSize(<const char*>buf, n)
    finally:
        free(buf)
        dc_decref(r.extra)


def decode_value(bytes digest, value):
    """(state, ns_id, token, created, updated, lease, owner, fingerprint, result) of
    stored bytes; ValueError if they fail their checksum or do not parse."""
    if PyBytes_GET_SIZE(digest) != 16:
        raise ValueError("a digest is 16 bytes")
    cdef const unsigned char[:] view = value
    cdef dc_rec r
    if view.shape[0] == 0:
        raise ValueError("empty record")
    check_status(dc_decode_value(<const unsigned char*>PyBytes_AS_STRING(digest), &view[0],
                                 <size_t>view.shape[0], &r), "record")
    try:
        return _record_tuple(&r)[:9]
    finally:
        dc_decref(r.extra)


cdef class ReadRecords:
    """PROCESSED records read from LMDB for one claim batch and left out of the table
    (:meth:`ClaimTable.read_records`; docs/engine.md, "Records read for a claim")."""

    cdef dc_rec* recs
    cdef size_t n

    def __len__(self):
        return self.n

    def __dealloc__(self):
        cdef size_t i
        if self.recs != NULL:
            for i in range(self.n):
                dc_decref(self.recs[i].extra)
            free(self.recs)
            self.recs = NULL


cdef class ClaimTable:
    """Records in memory, keyed by 16-byte digest, and the batch decisions over them.

    Not thread-safe: the store calls it under its lock. A decision
    (``claim``/``change``) stages its records; ``apply(lsn)`` stores them once
    the log holds them, ``discard()`` forgets them.
    """

    cdef dc_table t
    cdef dc_stage stage
    cdef bint staged

    def __cinit__(self, uint64_t capacity=1024):
        check_status(dc_table_init(&self.t, capacity), "a claim table")
        self.staged = False

    def __dealloc__(self):
        if self.staged:
            dc_stage_free(&self.stage)
        dc_table_free(&self.t)

    def __len__(self):
        return self.t.count

    @property
    def inflight(self):
        """Number of PROCESSING records."""
        return self.t.inflight

    @property
    def clean(self):
        """Number of clean copies read back from LMDB."""
        return self.t.clean

    @property
    def nbytes(self):
        """Bytes of the slot arrays (the old one too while the table grows), the
        journal and the change buffer (blobs not counted)."""
        cdef size_t slots = self.t.mask + 1 + (self.t.old_mask + 1 if self.t.old != NULL else 0)
        return (slots * sizeof(dc_rec) + self.t.jcap * sizeof(dc_jent) + self.t.lcap * 16
                + self.t.changes.cap)

    def missing(self, bytes digests, ReadRecords side=None, list among=None):
        """Indexes of the digests the table holds no record of (nor ``side``).

        With ``among`` (indexes into ``digests``, as an earlier call gave them),
        only those are looked up, ``side`` before the table: a claim's second
        look, after its reads, probes the table only for the keys it did not
        read (docs/engine.md, "Records read for a claim")."""
        cdef size_t n, i, m
        cdef Py_ssize_t j, k
        cdef const unsigned char* d = _digests_of(digests, &n)
        cdef list out
        if among is not None:
            out = []
            for j in range(PyList_GET_SIZE(among)):
                k = <object>PyList_GET_ITEM(among, j)
                if k < 0 or <size_t>k >= n:
                    raise IndexError("a digest index is out of range")
                if dc_find_beside(&self.t, NULL if side is None else side.recs,
                                  0 if side is None else side.n, d + 16 * k) == NULL:
                    out.append(k)
            return out
        cdef size_t* idx = <size_t*>malloc((n + 1) * sizeof(size_t))
        if idx == NULL:
            raise MemoryError()
        try:
            with nogil:
                m = dc_missing(&self.t, d, n, idx)
            if side is None or side.n == 0:
                return [idx[i] for i in range(m)]
            return [idx[i] for i in range(m)
                    if dc_side_find(side.recs, side.n, d + 16 * idx[i]) == NULL]
        finally:
            free(idx)

    def get(self, bytes digest):
        """(state, ns_id, token, created, updated, lease, owner, fingerprint, result, lsn,
        deadline) of a digest, or None."""
        if PyBytes_GET_SIZE(digest) != 16:
            raise ValueError("a digest is 16 bytes")
        cdef const dc_rec* r = dc_find(&self.t, <const unsigned char*>PyBytes_AS_STRING(digest))
        return None if r == NULL else _record_tuple(r)

    def load(self, PackedRecords records not None, double now_m):
        """Adds records read from LMDB (:class:`PackedRecords`, as
        :meth:`PageReader.get_many` finds them) as clean copies (lsn 0), where
        the table has none.

        A PROCESSING record gets a fresh lease from now_m (a holder may still
        be alive). Returns -1, or the index of the first record whose value
        fails its checksum (nothing after it is loaded).
        """
        return self._read(records, now_m, None)

    def read_records(self, PackedRecords records not None, double now_m):
        """Records read from LMDB for a claim batch (:class:`PackedRecords`): the
        PROCESSED ones as :class:`ReadRecords` for :meth:`claim`, which answers
        them without putting them in the table; every other one is put in the
        table as :meth:`load` puts it (ext/dc_engine.h, ``dc_read_records``).
        Returns the ReadRecords, or the index of the first record whose value
        fails its checksum (nothing after it is read).
        """
        cdef ReadRecords out = ReadRecords.__new__(ReadRecords)
        cdef Py_ssize_t bad = self._read(records, now_m, out)
        return out if bad < 0 else bad

    cdef Py_ssize_t _read(self, PackedRecords records, double now_m, ReadRecords side) except -2:
        """load (side None) and read_records: -1, or the index of a damaged value."""
        cdef Py_ssize_t n = records.n, i, pos = 0
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(records.packed)
        cdef unsigned char* digests = <unsigned char*>malloc(16 * n + 1)
        cdef const unsigned char** values = <const unsigned char**>malloc((n + 1) * sizeof(void*))
        cdef size_t* lens = <size_t*>malloc((n + 1) * sizeof(size_t))
        cdef size_t bad = <size_t>-1, kept = 0
        cdef dc_status rc
        try:
            if side is not None:
                side.recs = <dc_rec*>malloc((n + 1) * sizeof(dc_rec))
            if digests == NULL or values == NULL or lens == NULL or (
                side is not None and side.recs == NULL
            ):
                raise MemoryError()
            # The records were checked whole when made (PackedRecords), and hold
            # the bytes alive; the loop reads no Python object.
            for i in range(n):
                memcpy(digests + 16 * i, p + pos, 16)
                lens[i] = _packed_len(p + pos)
                values[i] = p + pos + 20
                pos += 20 + <Py_ssize_t>lens[i]
            with nogil:
                rc = dc_read_records(&self.t, digests, values, lens, <size_t>n, now_m,
                                     NULL if side is None else side.recs, &kept, &bad)
            if side is not None:
                side.n = kept
            if rc == DC_ECORRUPT:
                return <Py_ssize_t>bad
            check_status(rc, "a loaded record")
            return -1
        finally:
            free(digests)
            free(values)
            free(lens)

    def replay(self, payload, uint64_t lsn, double now_m):
        """Applies one log payload with its LSN; returns the digests it held (concatenated).

        ValueError if the payload does not parse or a record fails its checksum.
        """
        cdef const unsigned char[:] view = payload
        cdef size_t size = view.shape[0], pos = 5, k
        cdef uint32_t count, vlen
        cdef dc_rec r
        cdef dc_status rc
        if size < 5 or view[0] != _LOG_VERSION:
            raise ValueError("not a log payload of format 2")
        memcpy(&count, &view[1], 4)
        digests = bytearray(16 * count) if count <= size // 20 else None
        if digests is None:
            raise ValueError("log payload count runs past its end")
        cdef unsigned char[:] out = digests
        for k in range(count):
            if pos + 20 > size:
                raise ValueError("log payload entry runs past its end")
            memcpy(&vlen, &view[pos + 16], 4)
            if vlen == 0 or pos + 20 + vlen > size:
                raise ValueError("log payload entry runs past its end")
            check_status(dc_decode_value(&view[pos], &view[pos + 20], vlen, &r),
                         f"log record {k}")
            r.lsn = lsn
            if r.state == DC_PROCESSING:
                r.deadline = now_m + r.lease
            memcpy(&out[16 * k], &view[pos], 16)
            rc = dc_put(&self.t, &r, 1)
            dc_decref(r.extra)
            check_status(rc, f"log record {k}")
            pos += 20 + vlen
        if pos != size:
            raise ValueError("log payload has trailing bytes")
        return bytes(digests)

    cdef int _begin(self, size_t n) except -1:
        if self.staged:
            dc_stage_free(&self.stage)
            self.staged = False
        check_status(dc_stage_init(&self.stage, n), f"staging a batch of {n}")
        self.staged = True
        return 0

    def claim(self, bytes digests, list keys, str namespace, int ns_id, float lease, owner,
              list fingerprints, cold, double now_w, double now_m, claim_type, tuple outcomes,
              unpack, int form=_FORM_CLAIMS, ReadRecords side=None):
        """Decides a claim batch and stages its new records.

        Returns ``(answers, conflict, depends, payloads, counts)``: on a
        fingerprint conflict ``answers`` is None and ``conflict`` the key's
        index (nothing is staged); otherwise ``payloads`` are the log payloads
        of the staged records and ``counts`` is (new, duplicate, in progress,
        takeovers, writes, bytes of the DUPLICATE answers' stored results).
        ``cold`` is None or one byte per key, 1 where a key without a record
        is in a cold slice. ``side`` holds PROCESSED records read from LMDB that
        the table lacks (:meth:`read_records`); it must stay alive until the
        answers are read. ``answers`` depends on ``form``:

        - FORM_CLAIMS: one object per key, built with ``claim_type(key,
          namespace, outcome, token, result, exact, takeover)`` (``outcomes``
          = (NEW, DUPLICATE, IN_PROGRESS));
        - FORM_COLUMNS: no object per key, the columns of the daemon's reply
          (docs/daemon.md): ``(outcomes, tokens, result_index, results,
          cold_index, takeover_index)``, outcomes one byte per key (0 NEW,
          1 DUPLICATE, 2 IN_PROGRESS), tokens native-endian unsigned 64-bit;
        - FORM_CHECK: an empty list, nothing staged and no payloads: the
          decision only, for its conflict and counts.
        """
        cdef size_t n, i
        cdef const unsigned char* d = _digests_of(digests, &n)
        if <size_t>len(keys) != n:
            raise ValueError("one key per digest")
        cdef dc_claim_io io
        cdef bytes owner_b
        cdef const unsigned char** fps = NULL
        cdef size_t* fp_lens = NULL
        cdef object fp
        cdef const unsigned char[:] cold_view
        io.digests = d
        io.n = n
        io.fps = NULL
        io.fp_lens = NULL
        io.owner = NULL
        io.owner_len = 0
        io.cold = NULL
        io.side = NULL if side is None else side.recs
        io.side_n = 0 if side is None else side.n
        io.ns_id = <uint16_t>ns_id
        io.lease = lease
        io.now_w = now_w
        io.now_m = now_m
        if owner is not None:
            owner_b = owner
            io.owner = <const unsigned char*>PyBytes_AS_STRING(owner_b)
            io.owner_len = PyBytes_GET_SIZE(owner_b)
        if cold is not None:
            cold_view = cold
            if <size_t>cold_view.shape[0] != n:
                raise ValueError("one cold flag per key")
            if n:
                io.cold = &cold_view[0]
        cdef unsigned char* outc = <unsigned char*>malloc(n + 1)
        cdef uint64_t* toks = <uint64_t*>malloc((n + 1) * sizeof(uint64_t))
        cdef const dc_extra** dups = <const dc_extra**>malloc((n + 1) * sizeof(void*))
        if fingerprints is not None:
            fps = <const unsigned char**>malloc((n + 1) * sizeof(void*))
            fp_lens = <size_t*>malloc((n + 1) * sizeof(size_t))
        cdef dc_status rc
        cdef uint64_t written = 0
        cdef list claims
        cdef object new, dup, busy
        try:
            if outc == NULL or toks == NULL or dups == NULL or (
                fingerprints is not None and (fps == NULL or fp_lens == NULL)
            ):
                raise MemoryError()
            if fingerprints is not None:
                if <size_t>len(fingerprints) != n:
                    raise ValueError("one fingerprint per key")
                for i in range(n):
                    fp = <object>PyList_GET_ITEM(fingerprints, i)
                    if fp is None:
                        fps[i] = NULL
                        fp_lens[i] = 0
                    else:
                        fps[i] = <const unsigned char*>PyBytes_AS_STRING(<bytes>fp)
                        fp_lens[i] = PyBytes_GET_SIZE(<bytes>fp)
                io.fps = fps
                io.fp_lens = fp_lens
            io.outcomes = outc
            io.tokens = toks
            io.dup_extra = dups
            self._begin(n)
            with nogil:
                rc = dc_decide_claim(&self.t, &self.stage, &io)
            if rc == DC_ECONFLICT:
                self.discard()
                return None, io.conflict, 0, [], (0, 0, 0, 0, 0, 0)
            check_status(rc, f"a claim batch of {n}")
            result_bytes = 0
            for i in range(n):
                if outc[i] == 1 and dups[i] != NULL and (dups[i].has & DC_HAS_RESULT):
                    result_bytes += dups[i].result_len
            counts = (io.n_new, io.n_dup, io.n_busy, io.takeovers, 0, result_bytes)
            if form == _FORM_CHECK:
                self.discard()
                return [], -1, io.depends, [], counts
            if form == _FORM_COLUMNS:
                answers = _columns(outc, toks, dups, n, unpack)
                payloads = _encode_stage(&self.stage, &written)
                return answers, -1, io.depends, payloads, counts[:4] + (written, result_bytes)
            new, dup, busy = outcomes
            claims = [None] * n
            for i in range(n):
                c = outc[i]
                key = <object>PyList_GET_ITEM(keys, i)
                if c == 0:
                    claims[i] = _record(claim_type, key, namespace, new, toks[i],
                                        None, True, False)
                elif c == 1:
                    if dups[i] != NULL and (dups[i].has & DC_HAS_RESULT):
                        claims[i] = _record(claim_type, key, namespace, dup, toks[i],
                                            unpack(_blob_part(dups[i], DC_HAS_RESULT)),
                                            True, False)
                    else:
                        claims[i] = _record(claim_type, key, namespace, dup, toks[i],
                                            None, True, False)
                elif c == 2:
                    claims[i] = _record(claim_type, key, namespace, busy, toks[i],
                                        None, True, False)
                elif c == 3:
                    claims[i] = _record(claim_type, key, namespace, new, toks[i],
                                        None, True, True)
                else:
                    claims[i] = _record(claim_type, key, namespace, dup, 0, None, False, False)
            _track_all(claims)
            payloads = _encode_stage(&self.stage, &written)
            return claims, -1, io.depends, payloads, counts[:4] + (written, result_bytes)
        except BaseException:
            self.discard()
            raise
        finally:
            free(outc)
            free(toks)
            free(dups)
            free(fps)
            free(fp_lens)

    def change(self, bytes digests, list tokens, list results, int state, double now_w):
        """Decides a complete (state 2) or release (state 3) batch and stages it.

        ``results`` is None or one packed result (bytes) or None per item.
        Returns ``(error_index, error_kind, current_token, depends, payloads,
        writes)``; on an error (kind 1 not claimed, 2 wrong token, 3 already
        completed) nothing is staged.
        """
        cdef size_t n, i
        cdef const unsigned char* d = _digests_of(digests, &n)
        if <size_t>len(tokens) != n or (results is not None and <size_t>len(results) != n):
            raise ValueError("one token (and result) per digest")
        if state != DC_PROCESSED and state != DC_RELEASED:
            raise ValueError("state must be PROCESSED or RELEASED")
        cdef dc_change_io io
        cdef uint64_t* toks = <uint64_t*>malloc((n + 1) * sizeof(uint64_t))
        cdef const unsigned char** res = NULL
        cdef size_t* res_lens = NULL
        cdef object v
        cdef dc_status rc
        cdef uint64_t written = 0
        if results is not None:
            res = <const unsigned char**>malloc((n + 1) * sizeof(void*))
            res_lens = <size_t*>malloc((n + 1) * sizeof(size_t))
        try:
            if toks == NULL or (results is not None and (res == NULL or res_lens == NULL)):
                raise MemoryError()
            for i in range(n):
                toks[i] = tokens[i]
                if res != NULL:
                    v = <object>PyList_GET_ITEM(results, i)
                    if v is None:
                        res[i] = NULL
                        res_lens[i] = 0
                    else:
                        res[i] = <const unsigned char*>PyBytes_AS_STRING(<bytes>v)
                        res_lens[i] = PyBytes_GET_SIZE(<bytes>v)
            io.digests = d
            io.n = n
            io.tokens = toks
            io.results = res
            io.result_lens = res_lens
            io.state = <uint8_t>state
            io.now_w = now_w
            self._begin(n)
            with nogil:
                rc = dc_decide_change(&self.t, &self.stage, &io)
            if rc == DC_ECONFLICT:
                self.discard()
                return io.error_index, io.error_kind, io.current_token, 0, [], 0
            check_status(rc, f"a change batch of {n}")
            payloads = _encode_stage(&self.stage, &written)
            return -1, 0, 0, io.depends, payloads, written
        except BaseException:
            self.discard()
            raise
        finally:
            free(toks)
            free(res)
            free(res_lens)

    def extend(self, bytes digests, list tokens, float lease, double now_m):
        """Decides a renewal batch and stages it: every claim held ``lease`` seconds
        from ``now_m``, kept in memory (nothing to log; :meth:`apply` stores it).

        Returns ``(error_index, error_kind, current_token)``: ``(-1, 0, 0)``, or on
        an error (kind 1 not claimed, 2 wrong token, 3 already completed) the
        first item that cannot be renewed, with nothing staged.
        """
        cdef size_t n, i
        cdef const unsigned char* d = _digests_of(digests, &n)
        if <size_t>len(tokens) != n:
            raise ValueError("one token per digest")
        cdef dc_extend_io io
        cdef uint64_t* toks = <uint64_t*>malloc((n + 1) * sizeof(uint64_t))
        cdef dc_status rc
        try:
            if toks == NULL:
                raise MemoryError()
            for i in range(n):
                toks[i] = tokens[i]
            io.digests = d
            io.n = n
            io.tokens = toks
            io.lease = lease
            io.now_m = now_m
            self._begin(n)
            with nogil:
                rc = dc_decide_extend(&self.t, &self.stage, &io)
            if rc == DC_ECONFLICT:
                self.discard()
                return io.error_index, io.error_kind, io.current_token
            check_status(rc, f"a renewal batch of {n}")
            return -1, 0, 0
        except BaseException:
            self.discard()
            raise
        finally:
            free(toks)

    def apply(self, uint64_t lsn):
        """Stores the staged records with log position ``lsn`` (renewals keep theirs)."""
        cdef dc_status rc = DC_OK
        if not self.staged:
            return
        with nogil:  # a table growing past 70 % is rebuilt here: seconds at millions
            rc = dc_apply(&self.t, &self.stage, lsn)
        self.discard()
        check_status(rc, "applying a batch")

    def discard(self):
        """Forgets the staged records."""
        if self.staged:
            dc_stage_free(&self.stage)
            self.staged = False

    @property
    def pending(self):
        """Records changed since the last :meth:`take_changes` (a record changed twice
        counts twice): what the next checkpoint writes, about."""
        return self.t.changes.n

    def take_changes(self):
        """Moves the records changed since the last call out of the table, encoded as
        a checkpoint writes them (O(1): all a checkpoint does under the store lock).

        :func:`sort_changes` orders them for LMDB; :meth:`give_back` returns
        them if the checkpoint fails.
        """
        cdef Changes c = Changes.__new__(Changes)
        dc_take_changes(&self.t, &c.x)
        return c

    def give_back(self, Changes changes not None):
        """Puts changes taken by :meth:`take_changes` back in front of those since."""
        check_status(dc_give_back(&self.t, &changes.x), "giving changes back")

    def export(self):
        """:meth:`take_changes`, sorted and unpacked: ``(items, inflight, settled,
        newest)`` as :func:`unpack_items` returns them, and the latest ``updated``."""
        changes = self.take_changes()
        packed, n = sort_changes(changes)
        items, inflight, settled = unpack_items(packed, n)
        return items, inflight, settled, changes.newest

    def evict(self, uint64_t upto):
        """Drops the records LMDB holds (lsn <= upto) that are not PROCESSING; returns how many."""
        dropped, _more = self.evict_some(upto, 0)
        return dropped

    def evict_some(self, uint64_t upto, size_t limit):
        """:meth:`evict` over at most ``limit`` journal entries (0 = all); returns
        ``(dropped, more)``, ``more`` True while entries <= upto are left."""
        cdef uint64_t n = 0
        cdef int more = 0
        cdef dc_status rc
        with nogil:
            rc = dc_evict(&self.t, upto, limit, &more, &n)
        check_status(rc, "shrinking the claim table")
        return n, bool(more)

    def dirty(self, uint64_t after):
        """Number of records changed after log position ``after`` (read from the journal)."""
        cdef uint64_t n
        with nogil:
            n = dc_dirty(&self.t, after)
        return n

    def inflight_records(self, double deadline_before, double updated_before):
        """(digest, ns_id, token, updated) of PROCESSING records whose lease deadline is
        <= deadline_before and last change < updated_before, every slot at once (the
        store searches in steps under its lock: :meth:`scan_begin`, :meth:`scan_step`)."""
        cdef uint64_t i
        cdef int a
        cdef dc_rec* r
        cdef dc_rec* arrays[2]
        cdef uint64_t sizes[2]
        cdef list out = []
        self._arrays(arrays, sizes)
        for a in range(2):
            for i in range(sizes[a]):
                r = &arrays[a][i]
                if r.state == DC_PROCESSING and r.deadline <= deadline_before \
                        and r.updated < updated_before:
                    out.append((PyBytes_FromStringAndSize(<const char*>r.digest, 16), r.ns_id,
                                r.token, r.updated))
        return out

    def scan_begin(self):
        """Starts a search of the records in flight in steps (:meth:`scan_step`);
        drops one begun before."""
        dc_scan_begin(&self.t)

    def scan_end(self):
        """Ends the search begun, if any (one given up before :meth:`scan_step` said
        it is over)."""
        dc_scan_end(&self.t)

    def scan_step(self, double deadline_before, double updated_before, size_t limit,
                  size_t max_found=0, bint details=False):
        """Visits up to ``limit`` slots of the search begun, ending the step once it found
        ``max_found`` records (0 = ``limit``); returns ``(digests, details, visited,
        more)``: the digests (concatenated) of the PROCESSING records found whose lease
        deadline is <= deadline_before and last change < updated_before, with
        ``details`` their ``(ns_id, token, updated)`` (else an empty list), the slots
        visited, and whether the search goes on. A record may be found twice
        (docs/engine.md, "Scans in steps"); none in flight throughout is missed."""
        cdef size_t cap = max_found if max_found else limit
        if cap == 0:
            cap = 1
        cdef dc_hit* hits = <dc_hit*>malloc(cap * sizeof(dc_hit))
        cdef size_t n = 0, visited = 0, i
        cdef int more = 0
        cdef dc_status rc
        cdef bytes digests
        cdef unsigned char* out
        cdef list info = []
        if hits == NULL:
            raise MemoryError()
        try:
            with nogil:
                rc = dc_scan_step(&self.t, limit, cap, deadline_before, updated_before, hits,
                                  &n, &visited, &more)
            check_status(rc, "searching the claim table")
            digests = PyBytes_FromStringAndSize(NULL, 16 * n)
            out = <unsigned char*>PyBytes_AS_STRING(digests)
            for i in range(n):
                memcpy(out + 16 * i, hits[i].digest, 16)
                if details:
                    info.append((hits[i].ns_id, hits[i].token, hits[i].updated))
            return digests, info, visited, bool(more)
        finally:
            free(hits)

    cdef void _arrays(self, dc_rec** arrays, uint64_t* sizes):
        """The slot array and, while the table grows, the old one (else 0 slots)."""
        arrays[0] = self.t.slots
        sizes[0] = self.t.mask + 1
        arrays[1] = self.t.old
        sizes[1] = self.t.old_mask + 1 if self.t.old != NULL else 0

    def digests(self):
        """Every digest held, concatenated."""
        cdef uint64_t i
        cdef int a
        cdef dc_rec* arrays[2]
        cdef uint64_t sizes[2]
        cdef list parts = []
        self._arrays(arrays, sizes)
        for a in range(2):
            for i in range(sizes[a]):
                if dc_live(&arrays[a][i]):
                    parts.append(PyBytes_FromStringAndSize(<const char*>arrays[a][i].digest, 16))
        return b"".join(parts)



cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL


_sort_lock = threading.Lock()


cdef class Changes:
    """Records taken out of a :class:`ClaimTable` for a checkpoint (an owned buffer)."""

    cdef dc_export x

    def __dealloc__(self):
        free(self.x.items)
        self.x.items = NULL

    @property
    def n(self):
        """Records held (a record changed twice is held twice)."""
        return self.x.n

    @property
    def newest(self):
        """The latest ``updated`` time among them (0.0 if none)."""
        return self.x.newest

    @property
    def nbytes(self):
        """Bytes of the encoded records."""
        return self.x.items_len


def sort_changes(Changes changes not None):
    """The records of ``changes`` in digest order, each digest once (its latest
    change), sorted without the GIL: ``(packed, n)`` for :func:`unpack_items`."""
    cdef size_t length = changes.x.items_len, out_len = 0, kept = 0
    cdef bytes out = PyBytes_FromStringAndSize(NULL, length)
    cdef unsigned char* o = <unsigned char*>PyBytes_AS_STRING(out)
    cdef dc_status rc
    with _sort_lock:
        with nogil:
            rc = dc_sort_packed(changes.x.items, length, changes.x.n, o, &out_len, &kept)
    check_status(rc, "the changes to sort")
    return (out if out_len == length else out[:out_len]), kept


cdef inline uint32_t _packed_len(const unsigned char* rec) noexcept nogil:
    """The value length of one packed record: [digest(16) | length (u32 LE) | value]."""
    return rec[16] | (rec[17] << 8) | (rec[18] << 16) | (<uint32_t>rec[19] << 24)


cdef class PackedRecords:
    """Records as n x [digest(16) | value length (u32 LE) | value], read in place:
    the change journal's form (a :func:`sort_changes` buffer, which a checkpoint
    hands to LMDB one record at a time) and the form LMDB's lookups answer in
    (:meth:`PageReader.get_many`, which :meth:`ClaimTable.load` and
    :meth:`ClaimTable.read_records` take). Lists of millions of tuples would
    hold the GIL for tens of ms to build and free, and a lookup's pair of bytes
    objects per record was a sixth of a batch of duplicates read from LMDB
    (docs/warm-tier.md, "Lookups in native code").

    Iterating yields ``(digest, value)`` pairs; :attr:`inflight` and
    :attr:`settled` are the digests of PROCESSING records and of the others;
    every one of them can be iterated again (a retried LMDB transaction does).
    The buffer is checked whole when made: ValueError if it does not hold
    exactly ``n`` records. A value may be empty (a damaged one, which a
    checksum then refuses).
    """

    cdef bytes packed
    cdef readonly Py_ssize_t n
    cdef Py_ssize_t n_inflight

    def __cinit__(self, bytes packed not None, Py_ssize_t n):
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(packed)
        cdef Py_ssize_t size = PyBytes_GET_SIZE(packed), pos = 0, i, k = 0
        cdef uint32_t vlen
        if n < 0:
            raise ValueError("a negative number of records")
        for i in range(n):
            if pos + 20 > size:
                raise ValueError("packed records truncated")
            vlen = _packed_len(p + pos)
            if pos + 20 + vlen > size:
                raise ValueError("packed records truncated")
            k += vlen > 0 and (p[pos + 20] & 0x03) == DC_PROCESSING
            pos += 20 + vlen
        if pos != size:
            raise ValueError("packed records hold more than their count")
        self.packed = packed
        self.n = n
        self.n_inflight = k

    def __len__(self):
        return self.n

    def __iter__(self):
        return _PackedIter(self, 0)

    @property
    def inflight(self):
        """The digests of the PROCESSING records (sized, iterable again)."""
        return _PackedView(self, 1)

    @property
    def settled(self):
        """The digests of the other records (sized, iterable again)."""
        return _PackedView(self, 2)

    def digests(self):
        """Every digest, concatenated (16 bytes each)."""
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(self.packed)
        cdef bytes out = PyBytes_FromStringAndSize(NULL, 16 * self.n)
        cdef unsigned char* o = <unsigned char*>PyBytes_AS_STRING(out)
        cdef Py_ssize_t pos = 0, i
        cdef uint32_t vlen
        for i in range(self.n):
            memcpy(o + 16 * i, p + pos, 16)
            pos += 20 + _packed_len(p + pos)
        return out


cdef class _PackedView:
    cdef PackedRecords records
    cdef int mode

    def __cinit__(self, PackedRecords records, int mode):
        self.records = records
        self.mode = mode

    def __len__(self):
        if self.mode == 1:
            return self.records.n_inflight
        return self.records.n - self.records.n_inflight

    def __iter__(self):
        return _PackedIter(self.records, self.mode)


cdef class _PackedIter:
    """mode 0: (digest, value) pairs; 1: digests of PROCESSING records; 2: the others."""

    cdef PackedRecords records
    cdef int mode
    cdef Py_ssize_t pos, i

    def __cinit__(self, PackedRecords records, int mode):
        self.records = records
        self.mode = mode
        self.pos = 0
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(self.records.packed)
        cdef uint32_t vlen
        cdef Py_ssize_t at
        cdef bint processing
        while self.i < self.records.n:
            at = self.pos
            vlen = _packed_len(p + at)
            self.pos += 20 + vlen
            self.i += 1
            if self.mode == 0:
                return (PyBytes_FromStringAndSize(<const char*>p + at, 16),
                        PyBytes_FromStringAndSize(<const char*>p + at + 20, vlen))
            processing = vlen > 0 and (p[at + 20] & 0x03) == DC_PROCESSING
            if processing == (self.mode == 1):
                return PyBytes_FromStringAndSize(<const char*>p + at, 16)
        raise StopIteration


def pack_records(list pairs):
    """:class:`PackedRecords` of ``(digest, value)`` pairs (what py-lmdb's ``getmulti``
    answers where the native walk cannot). TypeError for a pair that is not a tuple
    of two bytes, ValueError for a digest that is not 16 bytes or a value of 4 GiB
    or more."""
    cdef Py_ssize_t n = PyList_GET_SIZE(pairs), i, size = 0
    cdef size_t pos = 0
    cdef object pair, d, v
    for i in range(n):
        pair = <object>PyList_GET_ITEM(pairs, i)
        if type(pair) is not tuple or len(pair) != 2:
            raise TypeError("a found record is a (digest, value) tuple")
        d = (<tuple>pair)[0]
        v = (<tuple>pair)[1]
        if type(d) is not bytes or type(v) is not bytes:
            raise TypeError("a found record's digest and value are bytes")
        if PyBytes_GET_SIZE(d) != 16:
            raise ValueError("a digest is 16 bytes")
        if PyBytes_GET_SIZE(v) > 0xFFFFFFFF:
            raise ValueError("a value of 4 GiB or more")
        size += 20 + PyBytes_GET_SIZE(v)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, size)
    cdef unsigned char* o = <unsigned char*>PyBytes_AS_STRING(out)
    for i in range(n):
        pair = <object>PyList_GET_ITEM(pairs, i)
        d = (<tuple>pair)[0]
        v = (<tuple>pair)[1]
        pos += _put_record(o + pos, <const unsigned char*>PyBytes_AS_STRING(d),
                           <const unsigned char*>PyBytes_AS_STRING(v),
                           <uint32_t>PyBytes_GET_SIZE(v))
    return PackedRecords(out, n)


def join_records(list parts):
    """One :class:`PackedRecords` of several, in their order."""
    cdef Py_ssize_t n = 0
    cdef PackedRecords part
    for part in parts:
        n += part.n
    if len(parts) == 1:
        return parts[0]
    return PackedRecords(b"".join([part.packed for part in parts]), n)


cdef inline size_t _put_record(unsigned char* o, const unsigned char* digest,
                               const unsigned char* value, uint32_t vlen) noexcept nogil:
    """Writes one packed record at o (the form :func:`_packed_len` reads); returns
    its size."""
    memcpy(o, digest, 16)
    o[16] = vlen & 0xFF
    o[17] = (vlen >> 8) & 0xFF
    o[18] = (vlen >> 16) & 0xFF
    o[19] = vlen >> 24
    memcpy(o + 20, value, vlen)
    return 20 + <size_t>vlen


def unpack_items(bytes packed, Py_ssize_t n):
    """The records of a :func:`sort_changes` buffer, in its order.

    Returns ``(items, inflight, settled)``: the (digest, value) pairs, and the
    digests of the PROCESSING records and of the others (read from each value's
    state). Raises ValueError if the buffer does not hold exactly ``n`` records.
    """
    cdef PackedRecords records = PackedRecords(packed, n)  # checks the buffer
    return list(records), list(records.inflight), list(records.settled)


cdef inline bint _key_bytes(object key, const char** data, Py_ssize_t* size,
                            Py_ssize_t max_key_bytes):
    # A key's bytes (str as UTF-8) when it is exactly bytes or str of
    # 1..max_key_bytes bytes; False for any other key, which Python names.
    if type(key) is bytes:
        data[0] = PyBytes_AS_STRING(key)
        size[0] = PyBytes_GET_SIZE(key)
    elif type(key) is str:
        try:
            data[0] = PyUnicode_AsUTF8AndSize(key, size)
        except UnicodeError:
            return False
    else:
        return False
    return 0 < size[0] <= max_key_bytes


def check_keys(list keys, Py_ssize_t max_key_bytes):
    """-1 when every key is bytes/str of 1..max_key_bytes bytes (UTF-8 for str), else
    the index of the first that is not (the caller names what is wrong): the check
    of :func:`digest_keys` without the digests."""
    cdef Py_ssize_t i, klen
    cdef const char* kp
    for i in range(PyList_GET_SIZE(keys)):
        if not _key_bytes(<object>PyList_GET_ITEM(keys, i), &kp, &klen, max_key_bytes):
            return i
    return -1


def digest_keys(bytes namespace, list keys, Py_ssize_t max_key_bytes, uint64_t seed_hi):
    """Record digests of a checked namespace's keys, concatenated (16 bytes each).

    The same bytes as ``dedupcore.keys.digests``: XXH64 of ``namespace \\0 key``
    with seeds 0 and ``seed_hi``, little-endian. Returns ``(digests, bad)``:
    ``bad`` is -1, or the index of the first key that is not bytes/str of
    1..max_key_bytes bytes (UTF-8 for str) - the caller names what is wrong.
    """
    cdef Py_ssize_t n = len(keys), i, klen, nslen = len(namespace)
    cdef const char* kp
    cdef unsigned char* scratch = <unsigned char*>malloc(nslen + 1 + max_key_bytes + 1)
    cdef bytearray out = bytearray(16 * n)
    cdef unsigned char* o = out
    cdef uint64_t lo, hi
    if scratch == NULL:
        raise MemoryError()
    try:
        memcpy(scratch, PyBytes_AS_STRING(namespace), nslen)
        scratch[nslen] = 0
        for i in range(n):
            if not _key_bytes(<object>PyList_GET_ITEM(keys, i), &kp, &klen, max_key_bytes):
                return b"", i
            memcpy(scratch + nslen + 1, kp, klen)
            dc_xxh64_pair(scratch, nslen + 1 + klen, 0, seed_hi, &lo, &hi)
            memcpy(o + 16 * i, &lo, 8)
            memcpy(o + 16 * i + 8, &hi, 8)
        return bytes(out), -1
    finally:
        free(scratch)


def split_items(list items, bint with_results):
    """The keys, tokens and results of complete/release items, checked natively.

    Each item is a tuple or list of (key, token) or, ``with_results``, (key,
    token, result); a token is an int in 1..2**63-1. Returns ``(keys, tokens,
    results, bad)``: ``results`` is None when no item carries a result;
    ``bad`` is -1, or the index of the first item that is not well formed (the
    caller names what is wrong).
    """
    cdef Py_ssize_t n = len(items), i, size
    cdef list keys = [None] * n, tokens = [None] * n
    cdef list results = None
    cdef object item, token, result
    for i in range(n):
        item = <object>PyList_GET_ITEM(items, i)
        if type(item) is tuple or type(item) is list:
            size = len(item)
        else:
            return None, None, None, i
        if size != 2 and not (size == 3 and with_results):
            return None, None, None, i
        token = item[1]
        if type(token) is not int or not 1 <= token <= 0x7FFFFFFFFFFFFFFF:
            return None, None, None, i
        keys[i] = item[0]
        tokens[i] = token
        if size == 3:
            result = item[2]
            if result is not None:
                if results is None:
                    results = [None] * n
                results[i] = result
    return keys, tokens, results, -1


# -- batches of digests ------------------------------------------------------
# The store's lookups pass batches as concatenated 16-byte digests; these pick,
# order and split them without a Python object per digest.

def gather_digests(bytes digests, list indexes):
    """The digests at ``indexes`` (ints in range), concatenated in that order."""
    cdef size_t n
    cdef const unsigned char* d = _digests_of(digests, &n)
    cdef Py_ssize_t m = PyList_GET_SIZE(indexes), k
    cdef Py_ssize_t i
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 16 * m)
    cdef unsigned char* o = <unsigned char*>PyBytes_AS_STRING(out)
    for k in range(m):
        i = <object>PyList_GET_ITEM(indexes, k)
        if i < 0 or <size_t>i >= n:
            raise IndexError(f"digest index {i} out of range for {n} digests")
        memcpy(o + 16 * k, d + 16 * i, 16)
    return out


cdef const unsigned char[::1] _flag_bytes(object flags):
    """A buffer of one-byte flags (bytes, bytearray, a memoryview of bool) as bytes."""
    return memoryview(flags).cast("B")


def select_digests(bytes digests, flags):
    """The digests whose flag (one byte per digest) is set, concatenated in order."""
    cdef size_t n, i, m = 0
    cdef const unsigned char* d = _digests_of(digests, &n)
    cdef const unsigned char[::1] f = _flag_bytes(flags)
    if <size_t>f.shape[0] != n:
        raise ValueError(f"{f.shape[0]} flags for {n} digests")
    for i in range(n):
        m += f[i] != 0
    if m == n:
        return digests
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 16 * m)
    cdef unsigned char* o = <unsigned char*>PyBytes_AS_STRING(out)
    m = 0
    for i in range(n):
        if f[i]:
            memcpy(o + 16 * m, d + 16 * i, 16)
            m += 1
    return out


def sort_digests(bytes digests):
    """The digests in byte order (LMDB's key order), concatenated; repeats kept."""
    cdef size_t n
    cdef const unsigned char* d = _digests_of(digests, &n)
    cdef bytes out = PyBytes_FromStringAndSize(<const char*>d, 16 * n)
    cdef unsigned char* o = <unsigned char*>PyBytes_AS_STRING(out)
    with nogil:
        dc_mdb_sort_digests(o, n)
    return out


def split_digests(bytes digests):
    """The digests as a list of 16-byte bytes objects, in order."""
    cdef size_t n, i
    cdef const unsigned char* d = _digests_of(digests, &n)
    return [PyBytes_FromStringAndSize(<const char*>d + 16 * i, 16) for i in range(n)]


def drop_found(bytes digests, PackedRecords found not None):
    """The sorted ``digests`` less the digests of ``found``, records whose digests are
    among them and in the same order (what a lookup of them found)."""
    cdef size_t n, i, m = 0
    cdef const unsigned char* d = _digests_of(digests, &n)
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(found.packed)
    cdef Py_ssize_t j = 0, pos = 0
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 16 * n)
    cdef unsigned char* o = <unsigned char*>PyBytes_AS_STRING(out)
    for i in range(n):
        if j < found.n and memcmp(d + 16 * i, p + pos, 16) == 0:
            pos += 20 + _packed_len(p + pos)
            j += 1
            continue
        memcpy(o + 16 * m, d + 16 * i, 16)
        m += 1
    if j != found.n:
        raise ValueError("found records that are not among the digests, or out of their order")
    return out[:16 * m]


def scatter_flags(Py_ssize_t n, list indexes, flags):
    """n flag bytes: ``flags[k]`` at ``indexes[k]``, 0 elsewhere; None if no flag is set."""
    cdef Py_ssize_t m = PyList_GET_SIZE(indexes), k, i
    cdef const unsigned char[::1] f = _flag_bytes(flags)
    if f.shape[0] != m:
        raise ValueError(f"{f.shape[0]} flags for {m} indexes")
    for k in range(m):
        if f[k]:
            break
    else:
        return None
    cdef bytearray out = bytearray(n)
    cdef unsigned char* o = out
    for k in range(m):
        i = <object>PyList_GET_ITEM(indexes, k)
        if i < 0 or i >= n:
            raise IndexError(f"index {i} out of range for {n} flags")
        o[i] = f[k] != 0
    return out


# -- LMDB's pages, read in native code (ext/dc_mdb.h) -------------------------------------

cdef extern from "dc_mdb.h" nogil:
    ctypedef struct dc_mdb_map:
        const uint8_t* base
        uint64_t pages
        uint32_t psize
    ctypedef struct dc_mdb_db:
        uint64_t root
        uint16_t flags
        uint16_t depth
    int dc_mdb_db_read(const uint8_t* rec, size_t length, dc_mdb_db* db)
    int64_t dc_mdb_get_many(const dc_mdb_map* m, const dc_mdb_db* db, const uint8_t* keys,
                            size_t n, size_t klen, const uint8_t** vals, size_t* vlens)
    int DC_MDB_UNREADABLE
    int DC_MDB_BEYOND
    int DC_MDB_FOUND
    int DC_MDB_ABSENT
    void dc_mdb_sort_digests(uint8_t* d, size_t n)
    ctypedef struct dc_mdb_walk:
        size_t klen
    int dc_mdb_walk_start(const dc_mdb_map* m, const dc_mdb_db* db, uint64_t entries,
                          size_t klen, dc_mdb_walk* w)
    int dc_mdb_walk_keys(const dc_mdb_map* m, dc_mdb_walk* w, uint8_t* out, size_t cap,
                         size_t* got)

cdef class KeyWalk:
    """Every key of one LMDB database in key order, read from the pages a batch at
    a time (:meth:`PageReader.walk`; docs/warm-tier.md, "Lookups in native code")."""

    cdef object reader  # the PageReader whose mapping the pages are in, kept alive
    cdef dc_mdb_map m
    cdef dc_mdb_walk w

    def next(self, size_t most):
        """Up to ``most`` (at least 1) more keys, concatenated (``b""`` once every
        key was given), walked without the GIL; or PAGES_UNREADABLE, PAGES_BEYOND
        when the walk cannot go on (the keys given before stand; ask LMDB for
        those after them)."""
        if most == 0 or most > (<size_t>1 << 40) // self.w.klen:
            raise ValueError(f"a batch of 1 to {(1 << 40) // self.w.klen} keys, not {most}")
        cdef bytes out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>(most * self.w.klen))
        cdef size_t got = 0
        cdef int r
        cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
        with nogil:
            r = dc_mdb_walk_keys(&self.m, &self.w, o, most, &got)
        if r < 0:
            return r
        if got == most:
            return out
        return out[:got * self.w.klen]


#: What :meth:`PageReader.get_many` answers when it cannot: the walk met what it does
#: not read (ask LMDB), or a page past the mapping (map the grown file again).
PAGES_UNREADABLE = DC_MDB_UNREADABLE
PAGES_BEYOND = DC_MDB_BEYOND


cdef class PageReader:
    """Point lookups in a read-only mapping of an LMDB data file (ext/dc_mdb.h;
    docs/warm-tier.md, "Lookups in native code").

    ``mapping`` is any buffer over the file from its start (an ``mmap``), kept
    referenced for the reader's life; ``psize`` is the environment's page size.
    A lookup is only sound inside a read transaction that pins the snapshot
    whose database record it is given.
    """

    cdef const unsigned char[::1] _view
    cdef dc_mdb_map _map

    def __init__(self, mapping, unsigned int psize):
        if psize < 512 or psize > 65536 or psize & (psize - 1):
            raise ValueError(f"page size {psize} is not a power of two in [512, 65536]")
        self._view = mapping
        self._map.psize = psize
        self._map.pages = <uint64_t>self._view.shape[0] // psize
        self._map.base = &self._view[0] if self._view.shape[0] else NULL

    @property
    def pages(self):
        """Whole pages mapped."""
        return self._map.pages

    def walk(self, bytes db_record, size_t klen=16):
        """A :class:`KeyWalk` over every key of the database whose 48-byte MDB_db
        record is ``db_record``, in key order, each ``klen`` bytes; or
        PAGES_UNREADABLE, PAGES_BEYOND when it cannot start. Sound only inside a
        read transaction that pins the snapshot the record is of, for as long as
        the walk is used."""
        cdef dc_mdb_db db
        cdef const uint8_t* rec = <const uint8_t*>PyBytes_AS_STRING(db_record)
        cdef uint64_t entries
        if dc_mdb_db_read(rec, <size_t>PyBytes_GET_SIZE(db_record), &db) != 0:
            return PAGES_UNREADABLE
        memcpy(&entries, rec + 32, 8)
        cdef KeyWalk w = KeyWalk.__new__(KeyWalk)
        w.reader = self  # keeps the mapping the walk's pages are in
        w.m = self._map
        cdef int r = dc_mdb_walk_start(&w.m, &db, entries, klen, &w.w)
        if r < 0:
            return r
        return w

    def get_many(self, bytes db_record, bytes digests):
        """The records (:class:`PackedRecords`, digest and value) of the concatenated
        16-byte ``digests`` that the database whose 48-byte MDB_db record is
        ``db_record`` holds, in their order (give them in byte order: neighbouring
        walks then share pages), those py-lmdb's ``getmulti`` finds; or
        PAGES_UNREADABLE, PAGES_BEYOND when it cannot answer (nothing is read
        outside the mapping)."""
        cdef dc_mdb_db db
        cdef size_t n, i
        cdef const unsigned char* d = _digests_of(digests, &n)
        if dc_mdb_db_read(<const uint8_t*>PyBytes_AS_STRING(db_record),
                          <size_t>PyBytes_GET_SIZE(db_record), &db) != 0:
            return PAGES_UNREADABLE
        if n == 0:
            return PackedRecords(b"", 0)
        if self._map.pages == 0:
            return PAGES_BEYOND
        cdef const uint8_t** vals = <const uint8_t**>malloc(n * sizeof(uint8_t*))
        cdef size_t* lens = <size_t*>malloc(n * sizeof(size_t))
        cdef int64_t found
        cdef size_t size = 0, pos = 0
        cdef bytes out
        cdef unsigned char* o
        try:
            if vals == NULL or lens == NULL:
                raise MemoryError()
            with nogil:
                found = dc_mdb_get_many(&self._map, &db, d, n, 16, vals, lens)
            if found < 0:
                return <int>found
            for i in range(n):
                if vals[i] != NULL:
                    if lens[i] > 0xFFFFFFFF:
                        return PAGES_UNREADABLE
                    size += 20 + lens[i]
            # One buffer of every record found, not two bytes objects per record.
            out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>size)
            o = <unsigned char*>PyBytes_AS_STRING(out)
            for i in range(n):
                if vals[i] != NULL:
                    pos += _put_record(o + pos, d + 16 * i, vals[i], <uint32_t>lens[i])
            return PackedRecords(out, <Py_ssize_t>found)
        finally:
            free(vals)
            free(lens)
