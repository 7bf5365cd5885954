# cython: language_level=3, embedsignature=True, cdivision=True
"""Native core of dedupcore: stable hashing, split-block Bloom filters, binary fuse
filters, sharding.

This module is private. Public names live in :mod:`dedupcore` (``hash64``,
``BloomFilter``, ``BloomRing``, ``shard_of``, ``shard_many``), which add sizing,
file formats and dedupcore's exceptions on top. The core raises only built-in
exceptions.

Batch operations work in chunks: with the GIL held they collect each key's
bytes pointer, then with the GIL released they hash the chunk into a scratch
array and probe the blocks, prefetching a few keys ahead so that the memory
latency of one probe overlaps with the work on the next.

:class:`FuseFilter` is the static filter of sealed cold-archive slices
(docs/warm-tier.md, "The cold archive"): built once from a set of key hashes,
then only queried, alone or next to Bloom filters in :func:`probe_many`.
"""

from libc.stdint cimport uint64_t, uint32_t, uint16_t, int32_t, int64_t
from libc.errno cimport ETIMEDOUT
from libc.stdlib cimport malloc, free
from libc.string cimport memcmp, memcpy, memset
from libc.math cimport log
from cpython.bytes cimport (PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_Check,
                            PyBytes_FromStringAndSize)
from cpython.bytearray cimport (PyByteArray_AS_STRING, PyByteArray_CheckExact,
                                PyByteArray_GET_SIZE, PyByteArray_Resize)
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.ref cimport PyObject
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE,
                             PyBUF_WRITABLE)

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_init(pthread_mutex_t* m, void* attr)
    int pthread_mutex_destroy(pthread_mutex_t* m)
    int pthread_mutex_lock(pthread_mutex_t* m)
    int pthread_mutex_trylock(pthread_mutex_t* m)
    int pthread_mutex_unlock(pthread_mutex_t* m)

cdef extern from "Python.h":
    # Borrowed-pointer forms for the batch hashing loop (no refcount traffic).
    bint _bytes_check_exact "PyBytes_CheckExact"(PyObject* o)
    const char* _bytes_data "PyBytes_AS_STRING"(PyObject* o)
    Py_ssize_t _bytes_size "PyBytes_GET_SIZE"(PyObject* o)
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL
    bint PyUnicode_Check(object o)
    bint PyBytes_CheckExact(object o)

include "_status.pxi"


cdef extern from "dc_hash.h" nogil:
    uint64_t dc_xxh64(const void* data, size_t length, uint64_t seed)
    uint64_t dc_block_index(uint64_t h, uint64_t nblocks)
    int dc_block_add(uint64_t* block, uint64_t h)
    int dc_block_contains(const uint64_t* block, uint64_t h)
    void dc_prefetch(const void* p)
    void dc_prefetch_w(const void* p)
    int32_t dc_jump(uint64_t key, int32_t num_buckets)
    int dc_popcount64(uint64_t x)
    void* dc_alloc_body(size_t size)
    void dc_free_body(void* p, size_t size)
    void dc_contains_batch(const uint64_t* blocks, uint64_t nblocks, const uint64_t* h,
                           size_t n, unsigned char* flags)
    uint64_t dc_add_batch(uint64_t* blocks, uint64_t nblocks, const uint64_t* h, size_t n,
                          unsigned char* flags)
    const uint32_t DC_SALT[8]

cdef extern from "dc_fuse.h" nogil:
    ctypedef struct dc_fuse_t:
        uint64_t seed
        uint64_t segment_length
        uint64_t segment_length_mask
        uint64_t segment_count_length
        uint64_t array_length
        const unsigned char* fp
    enum:
        DC_FUSE_MAX_ATTEMPTS
    const unsigned int DC_FUSE_MAX_SEGMENT_LENGTH
    const unsigned long long DC_FUSE_MAX_ARRAY_LENGTH
    int dc_fuse_contains(const dc_fuse_t* f, uint64_t h)
    void dc_fuse_contains_batch(const dc_fuse_t* f, const uint64_t* h, size_t n,
                                unsigned char* flags)
    dc_status dc_fuse_geometry(uint64_t n, dc_fuse_t* f)
    dc_status dc_fuse_build(const void* hashes, size_t n, uint64_t seed, const dc_fuse_t* like,
                            dc_fuse_t* f, unsigned char** body, uint64_t* count)
    void dc_fuse_free(void* p, size_t size)
    ctypedef struct dc_fuse_stack_t:
        dc_fuse_t geo
        uint32_t width
        uint32_t live
        uint16_t* fp
    const unsigned int DC_FUSE_STACK_MAX_WIDTH
    uint64_t dc_fuse_mix(uint64_t h, uint64_t seed)
    int dc_fuse_stack_contains_mixed(const dc_fuse_stack_t* st, uint64_t x)
    size_t dc_fuse_stack_bytes(uint64_t array_length, uint32_t width)
    void dc_fuse_stack_put(dc_fuse_stack_t* st, uint32_t c, const dc_fuse_t* f)
    void dc_fuse_stack_copy(dc_fuse_stack_t* dst, const dc_fuse_stack_t* src)
    void dc_fuse_stack_contains_batch(const dc_fuse_stack_t* st, const uint64_t* h, size_t n,
                                      unsigned char* flags)

#: Format constants shared with the Python layer and the file header.
HASH_ALGORITHM_XXH64 = 1
BLOCK_BYTES = 64
LANES = 8
MAX_BLOCKS = (1 << 32) - 1
SALTS = tuple(DC_SALT[i] for i in range(8))

DEF PREFETCH = 16         # how many keys ahead blocks are prefetched
DEF KEY_PREFETCH = 8      # how many keys ahead key objects are prefetched


# ---------------------------------------------------------------- hashing --

cdef inline int _key_bytes(object key, const char** data, Py_ssize_t* size) except -1:
    """Points data/size at the bytes of a bytes or str key (no copy)."""
    if PyBytes_Check(key):
        data[0] = PyBytes_AS_STRING(key)
        size[0] = PyBytes_GET_SIZE(key)
        return 0
    if PyUnicode_Check(key):
        data[0] = PyUnicode_AsUTF8AndSize(key, size)
        return 0
    raise TypeError(
        f"key must be bytes, bytearray, memoryview or str, not {type(key).__name__}")


cdef inline object _as_key(object key):
    """Returns key itself if bytes/str, a bytes copy of a bytes-like key."""
    if PyBytes_Check(key) or PyUnicode_Check(key):
        return key
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    raise TypeError(
        f"key must be bytes, bytearray, memoryview or str, not {type(key).__name__}")


cdef inline uint64_t _hash_key(object key, uint64_t seed) except? 0:
    cdef const char* data
    cdef Py_ssize_t size
    if not (PyBytes_Check(key) or PyUnicode_Check(key)):
        key = _as_key(key)
    _key_bytes(key, &data, &size)
    return dc_xxh64(data, <size_t>size, seed)


cdef uint64_t _seed_arg(object seed) except? 0:
    """A seed argument: an int in 0..2**64-1 (a float is refused, not truncated)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, not {type(seed).__name__}")
    return <uint64_t>seed


cdef int32_t _count_arg(object n, str what) except? -1:
    """A bucket/shard count: an int in 1..2**31-1 (a float is refused, not truncated)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{what} must be an int, not {type(n).__name__}")
    if not 1 <= n <= 0x7FFFFFFF:
        raise ValueError(f"{what} must be in 1..2**31-1, got {n}")
    return <int32_t>n


def hash64(key, seed=0):
    """XXH64 of ``key`` (bytes-like, or str as UTF-8) with ``seed``; stable everywhere."""
    return _hash_key(key, _seed_arg(seed))


def hash64_many(keys, seed=0):
    """XXH64 of each key, as a ``memoryview`` of uint64 (format ``'Q'``)."""
    cdef KeyBatch batch = KeyBatch(keys, _seed_arg(seed))
    cdef bytearray out = bytearray(batch.n * 8)
    if batch.n:
        memcpy(PyByteArray_AS_STRING(out), batch.hashes, batch.n * 8)
    return memoryview(out).cast('Q')


def jump_hash(key, num_buckets):
    """Jump consistent hash of a 64-bit key into ``range(num_buckets)``."""
    cdef int32_t n = _count_arg(num_buckets, "num_buckets")
    return dc_jump(_seed_arg(key), n)


def shard_of(key, n):
    """Shard in ``range(n)`` of a key: jump hash of ``hash64(key, seed=0)``.

    Stable across processes, machines and versions: XXH64 with seed 0 and
    Lamping & Veach's jump consistent hash are both fixed by their published
    specifications. Growing ``n`` by one moves only about 1/(n+1) of the keys,
    all of them to the new shard.
    """
    cdef int32_t count = _count_arg(n, "number of shards")
    return dc_jump(_hash_key(key, 0), count)


def shard_many(keys, n):
    """Shard of each key (or pre-hashed uint64), as a ``memoryview`` of uint32."""
    cdef int32_t count = _count_arg(n, "number of shards")
    cdef KeyBatch batch = KeyBatch(keys, 0)
    cdef bytearray out = bytearray(batch.n * 4)
    cdef uint32_t* dst = <uint32_t*>PyByteArray_AS_STRING(out)
    cdef const uint64_t* h = batch.hashes
    cdef Py_ssize_t i
    cdef Py_ssize_t total = batch.n
    with nogil:
        for i in range(total):
            dst[i] = <uint32_t>dc_jump(h[i], count)
    return memoryview(out).cast('I')


_UINT64_FORMATS = frozenset(("Q", "L", "@Q", "@L", "=Q", "=L", "<Q", "<L"))


cdef class KeyBatch:
    """The 64-bit hashes of a batch of keys.

    Either a sequence of bytes/str keys, hashed in one pass with the GIL held
    (every key is type-checked before any filter is touched, so a bad key
    raises without leaving half of a batch applied), or a 1-d buffer of uint64
    hashes, used in place. The probe loops then run on ``hashes`` without the
    GIL.
    """
    cdef object view           # keeps a pre-hashed buffer exported
    cdef uint64_t* owned
    cdef const uint64_t* hashes
    cdef readonly Py_ssize_t n

    def __cinit__(self, keys, uint64_t seed):
        self.view = None
        self.owned = NULL
        self.hashes = NULL
        self.n = 0
        if isinstance(keys, (bytes, str, bytearray)):
            raise TypeError(
                f"expected a sequence of keys or a uint64 buffer, not a single "
                f"{type(keys).__name__} (wrap one key in a list)")
        if not isinstance(keys, (list, tuple)) and _supports_buffer(keys):
            self._init_prehashed(keys)
        else:
            self._init_keys(keys, seed)

    def __dealloc__(self):
        free(self.owned)

    cdef _init_prehashed(self, obj):
        mv = memoryview(obj)
        if mv.ndim != 1 or mv.itemsize != 8 or mv.format not in _UINT64_FORMATS:
            raise TypeError(
                f"pre-hashed keys must be a 1-d buffer of uint64 (format 'Q'), "
                f"got ndim={mv.ndim} format={mv.format!r} itemsize={mv.itemsize}")
        if not mv.c_contiguous:
            mv = memoryview(mv.tobytes()).cast("Q")
        self.n = mv.shape[0]
        cdef const unsigned char[::1] raw
        if self.n:
            raw = mv.cast("B")
            self.hashes = <const uint64_t*>&raw[0]
            self.view = raw

    cdef _init_keys(self, keys, uint64_t seed):
        if not isinstance(keys, (list, tuple)):
            keys = list(keys)
        cdef Py_ssize_t i, n = len(keys)
        cdef const char* data
        cdef Py_ssize_t size
        cdef PyObject* k
        cdef uint64_t* out = <uint64_t*>malloc((n if n else 1) * sizeof(uint64_t))
        if out == NULL:
            raise MemoryError()
        self.owned = out
        self.hashes = out
        cdef bint is_list = isinstance(keys, list)
        i = 0
        while i < n:
            # Another thread may shrink a list between two keys (the
            # interpreter can switch threads inside the str/buffer calls).
            if is_list:
                if i >= PyList_GET_SIZE(keys):
                    raise RuntimeError("list of keys changed size during the batch")
                k = PyList_GET_ITEM(keys, i)
                if i + KEY_PREFETCH < PyList_GET_SIZE(keys):
                    dc_prefetch(PyList_GET_ITEM(keys, i + KEY_PREFETCH))
            else:
                k = PyTuple_GET_ITEM(keys, i)
                if i + KEY_PREFETCH < n:
                    dc_prefetch(PyTuple_GET_ITEM(keys, i + KEY_PREFETCH))
            if _bytes_check_exact(k):
                out[i] = dc_xxh64(_bytes_data(k), <size_t>_bytes_size(k), seed)
            else:
                out[i] = _hash_other(<object>k, i, seed)
            i += 1
        self.n = n


cdef uint64_t _hash_other(object k, Py_ssize_t index, uint64_t seed) except? 0:
    """Hash of a key that is not exactly bytes, with the key's index in errors."""
    cdef const char* data
    cdef Py_ssize_t size
    if PyUnicode_Check(k):
        try:
            data = PyUnicode_AsUTF8AndSize(k, &size)
        except UnicodeEncodeError as exc:
            raise ValueError(f"key at index {index} is not valid UTF-8: {exc}") from None
        return dc_xxh64(data, <size_t>size, seed)
    if PyBytes_Check(k):
        return dc_xxh64(PyBytes_AS_STRING(k), <size_t>PyBytes_GET_SIZE(k), seed)
    if isinstance(k, (bytearray, memoryview)):
        b = bytes(k)
        return dc_xxh64(PyBytes_AS_STRING(b), <size_t>PyBytes_GET_SIZE(b), seed)
    raise TypeError(
        f"key at index {index} must be bytes, bytearray, memoryview or str, "
        f"not {type(k).__name__}")


cdef inline void _export_body(Py_buffer* buffer, object owner, void* body, Py_ssize_t size,
                              bint readonly):
    """Fills ``buffer`` with a filter's body as one flat run of bytes (the buffer
    protocol of BlockFilter and FuseFilter)."""
    buffer.buf = body
    buffer.obj = owner
    buffer.len = size
    buffer.readonly = readonly
    buffer.itemsize = 1
    buffer.format = NULL
    buffer.ndim = 1
    buffer.shape = NULL
    buffer.strides = NULL
    buffer.suboffsets = NULL
    buffer.internal = NULL


cdef inline bint _supports_buffer(obj):
    try:
        memoryview(obj)
    except TypeError:
        return False
    return True


# ----------------------------------------------------------- block filter --

cdef class BlockFilter:
    """A split-block Bloom filter body: ``nblocks`` cache-line blocks.

    This is the native part of :class:`dedupcore.BloomFilter`; construct that
    instead. The body is either owned (anonymous memory) or a view of an
    outside buffer (a memory-mapped file, bytes), read-only if that buffer is.
    """
    cdef uint64_t* blocks
    cdef uint64_t _nblocks
    cdef uint64_t _seed
    cdef uint64_t _count
    cdef uint64_t _capacity
    cdef double _error_rate
    cdef bint _owned
    cdef bint _readonly
    cdef Py_buffer _view
    cdef bint _has_view
    # Serialises writers of the body. A pthread mutex, not a Python lock:
    # its uncontended trylock costs a few nanoseconds (CPython's lock reads
    # the clock on every acquire), which matters on the single-key path.
    cdef pthread_mutex_t _mutex
    cdef bint _mutex_ready

    def __cinit__(self, *args, **kwargs):
        self.blocks = NULL
        self._nblocks = 0
        self._has_view = False
        self._owned = False
        self._readonly = False
        if pthread_mutex_init(&self._mutex, NULL) != 0:
            raise MemoryError("cannot initialise the filter's mutex")
        self._mutex_ready = True

    def __dealloc__(self):
        self._detach()
        if self._mutex_ready:
            pthread_mutex_destroy(&self._mutex)

    cdef void _detach(self):
        if self._owned and self.blocks != NULL:
            dc_free_body(self.blocks, self._nblocks * 64)
        if self._has_view:
            PyBuffer_Release(&self._view)
            self._has_view = False
        self.blocks = NULL
        self._owned = False

    cdef inline int _check(self) except -1:
        if self.blocks == NULL:
            raise ValueError("filter is not initialised")
        return 0

    cdef inline int _check_writable(self) except -1:
        if self.blocks == NULL:
            raise ValueError("filter is not initialised")
        if self._readonly:
            raise ValueError("filter is read-only (opened memory-mapped); "
                             "open it with mmap=False to modify it")
        return 0

    cdef _set_meta(self, uint64_t nblocks, uint64_t seed, uint64_t capacity,
                   double error_rate, uint64_t count):
        if nblocks == 0 or nblocks > MAX_BLOCKS:
            raise ValueError(f"nblocks must be in 1..{MAX_BLOCKS}, got {nblocks}")
        self._nblocks = nblocks
        self._seed = seed
        self._capacity = capacity
        self._error_rate = error_rate
        self._count = count

    def _allocate(self, uint64_t nblocks, uint64_t seed, uint64_t capacity,
                  double error_rate):
        """Gives the filter a new, empty body of ``nblocks`` blocks."""
        self._detach()
        self._set_meta(nblocks, seed, capacity, error_rate, 0)
        cdef void* p = dc_alloc_body(nblocks * 64)
        if p == NULL:
            raise MemoryError(f"cannot allocate a filter body of {nblocks * 64} bytes")
        self.blocks = <uint64_t*>p
        self._owned = True
        self._readonly = False

    def _attach(self, buffer, uint64_t nblocks, uint64_t seed, uint64_t capacity,
                double error_rate, uint64_t count, bint writable):
        """Uses ``buffer`` (exactly ``nblocks * 64`` bytes) as the body, without copying."""
        self._detach()
        self._set_meta(nblocks, seed, capacity, error_rate, count)
        flags = PyBUF_SIMPLE | (PyBUF_WRITABLE if writable else 0)
        PyObject_GetBuffer(buffer, &self._view, flags)
        self._has_view = True
        if <uint64_t>self._view.len != nblocks * 64:
            self._detach()
            raise ValueError(f"body is {self._view.len} bytes, expected {nblocks * 64}")
        self.blocks = <uint64_t*>self._view.buf
        self._readonly = not writable

    def _copy_body_from(self, BlockFilter other):
        """Copies other's body and count into this filter (same geometry)."""
        self._check_writable()
        other._check()
        if other._nblocks != self._nblocks:
            raise ValueError("bodies differ in size")
        memcpy(self.blocks, other.blocks, self._nblocks * 64)
        self._count = other._count

    # -- geometry and state ------------------------------------------------

    @property
    def nblocks(self):
        """Number of 64-byte blocks."""
        return self._nblocks

    @property
    def seed(self):
        """Seed of the XXH64 hash of keys."""
        return self._seed

    @property
    def capacity(self):
        """Number of keys the filter was sized for."""
        return self._capacity

    @property
    def error_rate(self):
        """Target false-positive rate at ``capacity`` keys."""
        return self._error_rate

    @property
    def count(self):
        """Keys added that were new to the filter (an estimate of distinct keys)."""
        return self._count

    @property
    def nbytes(self):
        """Size of the bit array in bytes."""
        return self._nblocks * 64

    @property
    def readonly(self):
        """True when the body cannot be modified (a read-only memory map)."""
        return self._readonly

    def __len__(self):
        return self._count

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        self._check()
        if (flags & PyBUF_WRITABLE) and self._readonly:
            raise BufferError("filter body is read-only")
        _export_body(buffer, self, <void*>self.blocks, self._nblocks * 64, self._readonly)

    def __releasebuffer__(self, Py_buffer* buffer):
        pass

    # -- single keys ---------------------------------------------------------

    cdef inline void _lock_write(self) noexcept:
        if pthread_mutex_trylock(&self._mutex) != 0:
            # Never wait for the lock while holding the GIL: a batch writer
            # that holds the lock may be waiting for the GIL.
            with nogil:
                pthread_mutex_lock(&self._mutex)

    def add(self, key):
        """Adds ``key``; returns True if it was definitely not in the filter before."""
        self._check_writable()
        cdef uint64_t h = _hash_key(key, self._seed)
        cdef int new
        self._lock_write()
        new = dc_block_add(self.blocks + dc_block_index(h, self._nblocks) * 8, h)
        self._count += new
        pthread_mutex_unlock(&self._mutex)
        return bool(new)

    def add_hash(self, uint64_t h):
        """Adds a pre-hashed key (``hash64(key, seed=self.seed)``)."""
        self._check_writable()
        self._lock_write()
        cdef int new = dc_block_add(self.blocks + dc_block_index(h, self._nblocks) * 8, h)
        self._count += new
        pthread_mutex_unlock(&self._mutex)
        return bool(new)

    def __contains__(self, key):
        self._check()
        cdef uint64_t h = _hash_key(key, self._seed)
        return bool(dc_block_contains(self.blocks + dc_block_index(h, self._nblocks) * 8, h))

    def contains_hash(self, uint64_t h):
        """True if a pre-hashed key may be in the filter."""
        self._check()
        return bool(dc_block_contains(self.blocks + dc_block_index(h, self._nblocks) * 8, h))

    # -- batches -------------------------------------------------------------

    def add_many(self, keys):
        """Adds a batch; returns per-key flags, True where the key was new.

        ``keys`` is a list/tuple/iterable of bytes or str keys, or a 1-d buffer
        of uint64 hashes. A key repeated inside the batch is new only at its
        first occurrence. The result is a ``memoryview`` of bools.
        """
        return probe_many((), keys, self, self._seed)

    def contains_many(self, keys):
        """Membership of each key of a batch, as a ``memoryview`` of bools."""
        return probe_many((self,), keys, None, self._seed)

    def update(self, keys):
        """Adds every key of an iterable (or uint64 buffer); returns the number that were new."""
        return sum(probe_many((), keys, self, self._seed))

    # -- whole-filter operations ---------------------------------------------

    def _union_update(self, BlockFilter other):
        """ORs other's bits into this filter (same geometry and seed)."""
        self._check_writable()
        other._check()
        if other._nblocks != self._nblocks or other._seed != self._seed:
            raise ValueError("filters differ in geometry or seed")
        cdef uint64_t i, nwords = self._nblocks * 8
        cdef uint64_t* dst = self.blocks
        cdef const uint64_t* src = other.blocks
        with nogil:
            pthread_mutex_lock(&self._mutex)
            for i in range(nwords):
                dst[i] |= src[i]
            pthread_mutex_unlock(&self._mutex)

    def _set_count(self, uint64_t count):
        self._count = count

    def _bits_set(self):
        """Number of bits set in the body."""
        self._check()
        cdef uint64_t i, total = 0, nwords = self._nblocks * 8
        cdef const uint64_t* w = self.blocks
        with nogil:
            for i in range(nwords):
                total += dc_popcount64(w[i])
        return total

    def _fpr_now(self):
        """Probability that an absent key tests positive, given the bits set now.

        Exact for a uniformly random absent key: the mean over blocks of the
        product of each lane's fill.
        """
        self._check()
        cdef uint64_t b, nblocks = self._nblocks
        cdef int i
        cdef double p, total = 0.0
        cdef const uint64_t* blk
        with nogil:
            for b in range(nblocks):
                blk = self.blocks + b * 8
                p = 1.0
                for i in range(8):
                    p *= dc_popcount64(blk[i]) / 64.0
                total += p
        return total / nblocks

    def _estimated_count(self):
        """Distinct keys estimated from the bits set (each key sets one bit per lane)."""
        cdef double lane_bits = self._nblocks * 64.0
        cdef double zero = 1.0 - self._bits_set() / (lane_bits * 8)
        if zero <= 0.0:
            return float("inf")
        return -log(zero) * lane_bits

    def _snapshot(self):
        """(body bytes, count, XXH64 of the body) taken under the write lock.

        A consistent copy for saving while other threads may be adding.
        """
        self._check()
        cdef bytes body = PyBytes_FromStringAndSize(NULL, self._nblocks * 64)
        cdef char* dst = PyBytes_AS_STRING(body)
        cdef uint64_t count, h
        cdef size_t n = self._nblocks * 64
        with nogil:
            pthread_mutex_lock(&self._mutex)
            memcpy(dst, self.blocks, n)
            count = self._count
            pthread_mutex_unlock(&self._mutex)
            h = dc_xxh64(dst, n, 0)
        return body, count, h

    def _checksum(self):
        """XXH64 (seed 0) of the body bytes, as stored in the file header."""
        self._check()
        cdef uint64_t h
        cdef const void* p = self.blocks
        cdef size_t n = self._nblocks * 64
        with nogil:
            h = dc_xxh64(p, n, 0)
        return h


# ------------------------------------------------------------ fuse filter --

#: Largest segment and array lengths a fuse filter may have (its slots are
#: indexed by uint32).
FUSE_MAX_SEGMENT_LENGTH = DC_FUSE_MAX_SEGMENT_LENGTH
FUSE_MAX_ARRAY_LENGTH = DC_FUSE_MAX_ARRAY_LENGTH
#: Most columns a FuseStack may have.
FUSE_STACK_MAX_WIDTH = DC_FUSE_STACK_MAX_WIDTH

_BYTE_FORMATS = frozenset(("B", "b", "c", "@B", "@b", "=B", "=b", "<B", "<b"))


cdef object _hash_buffer(object obj, str what):
    """``obj`` as a C-contiguous memoryview of uint64 hashes, or a precise error.

    Accepts a 1-d buffer of format 'Q' (or 'L' of 8 bytes) or a bytes-like
    object whose length is a multiple of 8 (native byte order).
    """
    if isinstance(obj, str):
        raise TypeError(f"{what} must be a buffer of uint64 hashes, not str")
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"{what} must be a buffer of uint64 hashes (format 'Q') or bytes, "
                        f"not {type(obj).__name__}") from None
    if mv.ndim != 1:
        raise TypeError(f"{what} must be a 1-d buffer of uint64 hashes, got ndim={mv.ndim}")
    if mv.format in _BYTE_FORMATS and mv.itemsize == 1:
        if mv.nbytes % 8:
            raise ValueError(f"{what} is {mv.nbytes} bytes, not a multiple of 8 "
                             f"(a whole number of uint64 hashes)")
    elif mv.format not in _UINT64_FORMATS or mv.itemsize != 8:
        raise TypeError(f"{what} must be a buffer of uint64 hashes (format 'Q') or bytes, "
                        f"got format={mv.format!r} itemsize={mv.itemsize}")
    if not mv.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (copy a strided view first)")
    return mv


cdef uint64_t _param_arg(object v, str what) except? 0:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"fuse filter parameter {what} must be an int, not {type(v).__name__}")
    if not 0 <= v <= 0xFFFFFFFFFFFFFFFF:
        raise ValueError(f"fuse filter parameter {what} must be in 0..2**64-1, got {v}")
    return <uint64_t>v


cdef dc_fuse_t _fuse_geometry(object params) except *:
    """The seed and geometry of ``params`` (``FuseFilter.params``), checked to be
    self-consistent (ValueError or TypeError naming the parameter otherwise)."""
    cdef dc_fuse_t geo
    if not isinstance(params, tuple):
        raise TypeError(f"params must be a tuple of ints, not {type(params).__name__}")
    if len(params) != 4:
        raise ValueError(f"expected 4 fuse filter parameters (seed, segment_length, "
                         f"segment_count_length, array_length), got {len(params)}")
    cdef uint64_t seed = _param_arg(params[0], "seed")
    cdef uint64_t sl = _param_arg(params[1], "segment_length")
    cdef uint64_t scl = _param_arg(params[2], "segment_count_length")
    cdef uint64_t al = _param_arg(params[3], "array_length")
    if sl == 0 or sl > DC_FUSE_MAX_SEGMENT_LENGTH or (sl & (sl - 1)) != 0:
        raise ValueError(f"segment_length must be a power of two in "
                         f"1..{DC_FUSE_MAX_SEGMENT_LENGTH}, got {sl}")
    if scl == 0 or scl % sl != 0:
        raise ValueError(f"segment_count_length must be a positive multiple of "
                         f"segment_length {sl}, got {scl}")
    if al > DC_FUSE_MAX_ARRAY_LENGTH:
        raise ValueError(f"array_length must be at most {DC_FUSE_MAX_ARRAY_LENGTH}, "
                         f"got {al}")
    if scl >= al:
        raise ValueError(f"segment_count_length {scl} must be less than "
                         f"array_length {al}")
    if al != scl + 2 * sl:
        raise ValueError(f"array_length must be segment_count_length + 2 * "
                         f"segment_length = {scl + 2 * sl}, got {al}")
    memset(&geo, 0, sizeof(dc_fuse_t))
    geo.seed = seed
    geo.segment_length = sl
    geo.segment_length_mask = sl - 1
    geo.segment_count_length = scl
    geo.array_length = al
    return geo


ctypedef void (*_batch_probe)(const void* filt, const uint64_t* h, size_t n,
                              unsigned char* flags) noexcept nogil


cdef void _fuse_batch(const void* filt, const uint64_t* h, size_t n,
                      unsigned char* flags) noexcept nogil:
    dc_fuse_contains_batch(<const dc_fuse_t*>filt, h, n, flags)


cdef void _stack_batch(const void* filt, const uint64_t* h, size_t n,
                       unsigned char* flags) noexcept nogil:
    dc_fuse_stack_contains_batch(<const dc_fuse_stack_t*>filt, h, n, flags)


cdef object _hash_flags(object hashes, _batch_probe probe, const void* filt, bint holds):
    """Per hash of a uint64 buffer, whether ``probe`` finds it in ``filt`` (the GIL
    released; nothing probed unless the filter ``holds`` keys), as a memoryview of
    bools: the ``contains_many`` of FuseFilter and FuseStack."""
    mv = _hash_buffer(hashes, "hashes")
    cdef Py_buffer view
    cdef size_t n
    cdef unsigned char* flags
    PyObject_GetBuffer(mv, &view, PyBUF_SIMPLE)
    try:
        n = <size_t>view.len // 8
        out = bytearray(n)
        flags = <unsigned char*>PyByteArray_AS_STRING(out)
        if n and holds:
            with nogil:
                probe(filt, <const uint64_t*>view.buf, n, flags)
    finally:
        PyBuffer_Release(&view)
    return memoryview(out).cast("?")


def fuse_geometry(n):
    """``(segment_length, segment_count_length, array_length)`` of a fuse filter
    built from ``n`` distinct keys (ValueError: more than one filter holds)."""
    cdef uint64_t keys = _param_arg(n, "n")
    cdef dc_fuse_t geo
    check_status(dc_fuse_geometry(keys, &geo), f"a fuse filter of {keys} keys")
    return (geo.segment_length, geo.segment_count_length, geo.array_length)


cdef class FuseFilter:
    """A binary fuse filter with 16-bit fingerprints: a static set of key hashes.

    About 2.25 bytes per key (1.125 slots of 16 bits) with a false-positive
    rate of 2**-16, three memory accesses per query. It cannot take keys: it
    is built once from every key hash of a sealed slice with :meth:`build`,
    or attached to a saved body (a memory-mapped file) with :meth:`_attach`,
    and is immutable afterwards, so queries from any number of threads need
    no lock (docs/warm-tier.md, "The cold archive").

    A key hash ``h`` (``hash64(key, seed)`` with the seed of the ring) is
    mixed with the filter's internal seed, ``x = murmur64(h + seed)``; ``x``
    picks three slots in three consecutive segments, and the key is held
    when the XOR of their fingerprints is the 16-bit fingerprint of ``x``.
    The body is ``array_length`` little-endian uint16 fingerprints.

    ``params`` is ``(seed, segment_length, segment_count_length,
    array_length)``: everything besides the body a query needs. A filter
    built from no keys holds nothing (``count == 0``).
    """
    cdef dc_fuse_t f
    cdef uint64_t _count
    cdef unsigned char* _owned      # the body when built here (else NULL)
    cdef Py_buffer _view            # the body when attached
    cdef bint _has_view

    def __cinit__(self):
        memset(&self.f, 0, sizeof(dc_fuse_t))
        self._count = 0
        self._owned = NULL
        self._has_view = False

    def __dealloc__(self):
        if self._owned != NULL:
            dc_fuse_free(self._owned, self.f.array_length * 2)
            self._owned = NULL
        if self._has_view:
            PyBuffer_Release(&self._view)
            self._has_view = False
        self.f.fp = NULL

    cdef inline int _check(self) except -1:
        if self.f.fp == NULL:
            raise ValueError("fuse filter is not initialised: make one with "
                             "FuseFilter.build() or attach a body with _attach()")
        return 0

    @staticmethod
    def build(hashes, seed=0, like=None):
        """A filter holding every hash of ``hashes`` (a C-contiguous uint64 buffer).

        ``hashes`` is a 1-d buffer of format 'Q' or a bytes-like object of a
        multiple of 8 bytes; duplicates are allowed (``count`` is the number
        of distinct hashes) and so is an empty buffer. The GIL is released
        for the whole construction. Should a construction fail it is retried
        with the next internal seed of a sequence derived from ``seed``, so
        the same set of hashes, ``seed`` and ``like`` always give the same
        bytes, whatever the order and repetition of the hashes.

        ``like`` (the :attr:`params` of another filter, or None): take that
        filter's geometry when it has the segment length the hashes' own
        geometry (:func:`fuse_geometry`) has and at least as many slots, so
        that filters of one ``seed`` share their params and can be columns
        of one :class:`FuseStack` (unless a first internal seed failed, which
        the params then show). Otherwise the hashes' own geometry.
        """
        cdef uint64_t s = _seed_arg(seed)
        cdef dc_fuse_t like_geo
        cdef const dc_fuse_t* like_p = NULL
        if like is not None:
            like_geo = _fuse_geometry(like)
            like_p = &like_geo
        mv = _hash_buffer(hashes, "hashes")
        cdef Py_buffer view
        cdef dc_fuse_t geo
        cdef unsigned char* body = NULL
        cdef uint64_t count = 0
        cdef dc_status rc
        cdef size_t n
        PyObject_GetBuffer(mv, &view, PyBUF_SIMPLE)
        try:
            n = <size_t>view.len // 8
            with nogil:
                rc = dc_fuse_build(view.buf, n, s, like_p, &geo, &body, &count)
        finally:
            PyBuffer_Release(&view)
        check_status(rc, f"a fuse filter of {n} keys (at most {DC_FUSE_MAX_ARRAY_LENGTH} "
                         f"slots, {DC_FUSE_MAX_ATTEMPTS} seeds, about {int(n) * 32} bytes "
                         f"of working memory)")
        cdef FuseFilter ff = FuseFilter.__new__(FuseFilter)
        ff.f = geo
        ff.f.fp = body
        ff._owned = body
        ff._count = count
        return ff

    def _attach(self, buffer, params, count, copy=False):
        """Uses ``buffer`` as the body, without copying (a memory-mapped file, bytes).

        ``params`` as :attr:`params` returns them, ``(seed, segment_length,
        segment_count_length, array_length)``, and ``count`` the number of
        keys the filter was built from. They must be self-consistent and the
        buffer exactly ``array_length * 2`` bytes (C-contiguous), else
        ValueError. The buffer stays exported until the filter is dropped.
        A filter takes a body once: it is immutable afterwards.

        ``copy=True`` copies the body (GIL released) into memory of the
        filter's own, in transparent huge pages where the kernel gives them,
        and keeps no reference to ``buffer``: a query's three random reads
        then miss no TLB entry for a 4 KiB page of a file mapping
        (docs/warm-tier.md, "Sealed slices become fuse filters").
        """
        if self.f.fp != NULL:
            raise ValueError("fuse filter already has a body (a FuseFilter is immutable)")
        cdef dc_fuse_t geo = _fuse_geometry(params)
        cdef uint64_t al = geo.array_length
        cdef uint64_t n = _param_arg(count, "count")
        if n > al:
            raise ValueError(f"count {n} exceeds the {al} slots of the filter")
        if isinstance(buffer, str):
            raise TypeError("body must be a bytes-like buffer, not str")
        try:
            mv = memoryview(buffer)
        except TypeError:
            raise TypeError(f"body must be a bytes-like buffer, "
                            f"not {type(buffer).__name__}") from None
        if not mv.c_contiguous:
            raise ValueError("body must be a C-contiguous buffer")
        if <uint64_t>mv.nbytes != al * 2:
            raise ValueError(f"body is {mv.nbytes} bytes, the parameters need "
                             f"{al * 2} (array_length {al} * 2)")
        cdef unsigned char* body = NULL
        cdef Py_buffer src
        cdef size_t nbytes = <size_t>(al * 2)
        if copy:
            body = <unsigned char*>dc_alloc_body(nbytes)
            if body == NULL:
                raise MemoryError(f"cannot allocate a fuse filter body of {nbytes} bytes")
            PyObject_GetBuffer(mv, &src, PyBUF_SIMPLE)
            try:
                with nogil:
                    memcpy(body, src.buf, nbytes)
            finally:
                PyBuffer_Release(&src)
            self._owned = body
        else:
            PyObject_GetBuffer(mv, &self._view, PyBUF_SIMPLE)
            self._has_view = True
        self.f = geo
        self._count = n
        self.f.fp = body if copy else <const unsigned char*>self._view.buf

    # -- geometry and state ------------------------------------------------

    @property
    def params(self):
        """``(seed, segment_length, segment_count_length, array_length)``.

        With the body and ``count``, everything :meth:`_attach` needs (and
        still there after :meth:`_release`).
        """
        if self.f.array_length == 0:
            self._check()
        return (self.f.seed, self.f.segment_length, self.f.segment_count_length,
                self.f.array_length)

    @property
    def count(self):
        """Number of distinct key hashes the filter was built from."""
        return self._count

    @property
    def nbytes(self):
        """Size of the body in bytes (``array_length * 2``)."""
        return self.f.array_length * 2

    def __len__(self):
        return self._count

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        self._check()
        if flags & PyBUF_WRITABLE:
            raise BufferError("fuse filter body is read-only")
        _export_body(buffer, self, <void*>self.f.fp, self.f.array_length * 2, True)

    def __releasebuffer__(self, Py_buffer* buffer):
        pass

    # -- queries -----------------------------------------------------------

    def contains_hash(self, uint64_t h):
        """True if a pre-hashed key may be in the filter."""
        self._check()
        return self._count != 0 and bool(dc_fuse_contains(&self.f, h))

    def contains_many(self, hashes):
        """Membership of each hash of a uint64 buffer, as a ``memoryview`` of bools."""
        self._check()
        return _hash_flags(hashes, _fuse_batch, &self.f, self._count != 0)

    def _checksum(self):
        """XXH64 (seed 0) of the body bytes, as stored in the file header."""
        self._check()
        cdef uint64_t h
        cdef const void* p = self.f.fp
        cdef size_t n = self.f.array_length * 2
        with nogil:
            h = dc_xxh64(p, n, 0)
        return h

    def _release(self):
        """Frees the body (once a :class:`FuseStack` holds a copy of it).

        ``params``, ``count`` and ``nbytes`` stay; a query or a buffer export
        raises ValueError afterwards. The caller makes sure no probe of the
        filter is running (the ring's lock).
        """
        if self._owned != NULL:
            dc_fuse_free(self._owned, self.f.array_length * 2)
            self._owned = NULL
        if self._has_view:
            PyBuffer_Release(&self._view)
            self._has_view = False
        self.f.fp = NULL


cdef class FuseStack:
    """Fuse filters of one seed and geometry, their fingerprints side by side.

    Column ``c`` of a stack of ``width`` columns holds one filter; slot ``i``
    of every column lies in ``width * 2`` consecutive bytes. A key's three
    slots are the same in every column, so a probe makes three random reads
    for the whole stack where separate filters make three each: the cold
    archive's sealed slices, probed by every fresh key, are stacked
    (docs/warm-tier.md, "Stacked fuse slices"). A column answers only once
    :meth:`set_live` said so, and no longer after :meth:`drop`.

    Only :meth:`put` writes a column, and only one that is not live: the
    owner (the ring) copies a filter in outside its lock while probes go on,
    then makes the column live under the lock that probes take.
    """
    cdef dc_fuse_stack_t st
    cdef uint64_t _counts[32]

    def __cinit__(self, params, width):
        memset(&self.st, 0, sizeof(dc_fuse_stack_t))
        memset(self._counts, 0, sizeof(self._counts))
        cdef dc_fuse_t geo = _fuse_geometry(params)
        if isinstance(width, bool) or not isinstance(width, int):
            raise TypeError(f"width must be an int, not {type(width).__name__}")
        if not 1 <= width <= DC_FUSE_STACK_MAX_WIDTH:
            raise ValueError(f"width must be in 1..{DC_FUSE_STACK_MAX_WIDTH}, got {width}")
        cdef size_t nbytes = dc_fuse_stack_bytes(geo.array_length, <uint32_t>width)
        self.st.fp = <uint16_t*>dc_alloc_body(nbytes)
        if self.st.fp == NULL:
            raise MemoryError(f"cannot allocate a fuse stack body of {nbytes} bytes")
        self.st.geo = geo
        self.st.width = <uint32_t>width

    def __dealloc__(self):
        if self.st.fp != NULL:
            dc_free_body(self.st.fp, dc_fuse_stack_bytes(self.st.geo.array_length, self.st.width))
            self.st.fp = NULL

    cdef int _column(self, object column) except -1:
        if isinstance(column, bool) or not isinstance(column, int):
            raise TypeError(f"column must be an int, not {type(column).__name__}")
        if not 0 <= column < self.st.width:
            raise ValueError(f"column must be in 0..{self.st.width - 1}, got {column}")
        return <int>column

    @property
    def params(self):
        """The ``FuseFilter.params`` every column's filter has."""
        return (self.st.geo.seed, self.st.geo.segment_length, self.st.geo.segment_count_length,
                self.st.geo.array_length)

    @property
    def width(self):
        """Columns per slot."""
        return self.st.width

    @property
    def live(self):
        """The live columns, in order."""
        return tuple(c for c in range(self.st.width) if (self.st.live >> c) & 1)

    @property
    def count(self):
        """Keys the live columns' filters were built from."""
        return sum(self._counts[c] for c in self.live)

    @property
    def nbytes(self):
        """Size of the body in bytes, columns not live included."""
        return self.st.geo.array_length * self.st.width * 2

    def put(self, column, FuseFilter fuse not None):
        """Copies ``fuse`` (its params those of the stack, built from some keys) into
        ``column``, which must not be live. The GIL is released for the copy."""
        cdef int c = self._column(column)
        fuse._check()
        if (self.st.live >> c) & 1:
            raise ValueError(f"column {c} is live: drop it before putting another filter there")
        if fuse.params != self.params:
            raise ValueError(f"the filter's params {fuse.params} are not the stack's "
                             f"{self.params}")
        if fuse._count == 0:
            raise ValueError("a filter built from no keys holds nothing: it needs no column")
        with nogil:
            dc_fuse_stack_put(&self.st, <uint32_t>c, &fuse.f)
        self._counts[c] = fuse._count

    def set_live(self, column):
        """Makes a column that :meth:`put` filled answer probes."""
        cdef int c = self._column(column)
        if self._counts[c] == 0:
            raise ValueError(f"column {c} holds no filter: put one first")
        self.st.live |= (<uint32_t>1) << c

    def drop(self, column):
        """Stops a column answering; a later :meth:`put` may reuse it."""
        cdef int c = self._column(column)
        self.st.live &= ~((<uint32_t>1) << c)
        self._counts[c] = 0

    def grown(self, width):
        """A copy of this stack with ``width`` columns (at least as many), the same
        columns live. The GIL is released for the copy."""
        if isinstance(width, int) and width < self.st.width:
            raise ValueError(f"width must be at least {self.st.width}, got {width}")
        cdef FuseStack out = FuseStack(self.params, width)
        with nogil:
            dc_fuse_stack_copy(&out.st, &self.st)
        out.st.live = self.st.live
        memcpy(out._counts, self._counts, sizeof(self._counts))
        return out

    def contains_hash(self, uint64_t h):
        """True if some live column may hold a pre-hashed key."""
        return self.st.live != 0 and bool(
            dc_fuse_stack_contains_mixed(&self.st, dc_fuse_mix(h, self.st.geo.seed)))

    def contains_many(self, hashes):
        """Membership of each hash of a uint64 buffer in some live column, as a
        ``memoryview`` of bools."""
        return _hash_flags(hashes, _stack_batch, &self.st, self.st.live != 0)


cdef struct FilterRef:
    uint64_t* blocks
    uint64_t nblocks


cdef struct Probe:
    # The filters of one probe, as the nogil loops take them.
    FilterRef* refs
    Py_ssize_t nbloom
    dc_fuse_t* fuses
    Py_ssize_t nfuse
    dc_fuse_stack_t* stacks
    Py_ssize_t nstack


cdef int _gather_filters(tuple filters, uint64_t seed, Probe* p) except -1:
    """Fills ``p`` from BlockFilter, FuseFilter and FuseStack objects (empty fuse
    filters and stacks left out); free it with _free_probe, also after an error."""
    cdef Py_ssize_t nf = len(filters), f
    cdef BlockFilter bf
    cdef FuseFilter ff
    cdef FuseStack fs
    p.nbloom = 0
    p.nfuse = 0
    p.fuses = NULL
    p.nstack = 0
    p.stacks = NULL
    p.refs = <FilterRef*>malloc((nf + 1) * sizeof(FilterRef))
    if p.refs == NULL:
        raise MemoryError()
    for f in range(nf):
        obj = filters[f]
        if isinstance(obj, BlockFilter):  # the common case first
            bf = <BlockFilter>obj
            bf._check()
            if bf._seed != seed:
                raise ValueError("filters of one probe must share their hash seed")
            p.refs[p.nbloom].blocks = bf.blocks
            p.refs[p.nbloom].nblocks = bf._nblocks
            p.nbloom += 1
            continue
        if isinstance(obj, FuseStack):
            fs = <FuseStack>obj
            if fs.st.live == 0:
                continue  # holds nothing
            if p.stacks == NULL:
                p.stacks = <dc_fuse_stack_t*>malloc(nf * sizeof(dc_fuse_stack_t))
                if p.stacks == NULL:
                    raise MemoryError()
            p.stacks[p.nstack] = fs.st
            p.nstack += 1
            continue
        if not isinstance(obj, FuseFilter):
            raise TypeError(f"filters must be BlockFilter, FuseFilter or FuseStack objects, "
                            f"not {type(obj).__name__}")
        ff = <FuseFilter>obj
        ff._check()
        if ff._count == 0:
            continue  # holds nothing
        if p.fuses == NULL:
            p.fuses = <dc_fuse_t*>malloc(nf * sizeof(dc_fuse_t))
            if p.fuses == NULL:
                raise MemoryError()
        p.fuses[p.nfuse] = ff.f
        p.nfuse += 1
    return 0


cdef void _free_probe(Probe* p) noexcept:
    free(p.refs)
    free(p.fuses)
    free(p.stacks)
    p.refs = NULL
    p.fuses = NULL
    p.stacks = NULL


cdef void _contains_hashes(const Probe* p, const uint64_t* h, size_t m,
                           unsigned char* flags) noexcept nogil:
    """Sets the flag of every hash some filter of ``p`` may hold (others untouched)."""
    cdef Py_ssize_t f
    for f in range(p.nbloom):
        dc_contains_batch(p.refs[f].blocks, p.refs[f].nblocks, h, m, flags)
    # Fuse filters in a second pass over the same hashes (each batch prefetches
    # its own slots ahead).
    for f in range(p.nfuse):
        dc_fuse_contains_batch(&p.fuses[f], h, m, flags)
    for f in range(p.nstack):
        dc_fuse_stack_contains_batch(&p.stacks[f], h, m, flags)


def probe_many(tuple filters, keys, target, uint64_t seed):
    """Probes a batch of keys against several filters, optionally adding them to one.

    Each key is hashed once (with the seed every filter shares). Without
    ``target`` the result says, per key, whether any filter may hold it;
    ``filters`` may mix :class:`BlockFilter` and :class:`FuseFilter`
    objects, a fuse filter being probed with the same 64-bit hash (it mixes
    in its own seed). With ``target`` (a BlockFilter) each key is then added
    to it, and the result says whether the key was new: absent from every
    filter (``target`` included) before. A fuse filter only answers; it can
    never be the target (it is static).
    This serves ``BloomFilter.add_many``/``contains_many`` and the ring.
    """
    cdef BlockFilter tgt = None
    if target is not None:
        if isinstance(target, FuseFilter):
            raise TypeError("a FuseFilter cannot be the target of probe_many: "
                            "it is static and takes no keys")
        if not isinstance(target, BlockFilter):
            raise TypeError(f"target must be a BlockFilter or None, "
                            f"not {type(target).__name__}")
        tgt = <BlockFilter>target
        tgt._check_writable()
        if tgt._seed != seed:
            raise ValueError("filters of one probe must share their hash seed")
    cdef Probe p
    _gather_filters(filters, seed, &p)
    try:
        if tgt is None and isinstance(keys, (list, tuple)):
            # Nothing changes, so nothing needs validating up front: hash and
            # probe chunk by chunk, prefetching each block as soon as its key
            # is hashed, so fetching blocks overlaps walking the key objects.
            out = bytearray(len(keys))
            _contains_chunked(&p, keys, seed, <unsigned char*>PyByteArray_AS_STRING(out))
            return memoryview(out).cast("?")
        batch = KeyBatch(keys, seed)
        out = bytearray(batch.n)
        _probe_batch(&p, <KeyBatch>batch, tgt, <unsigned char*>PyByteArray_AS_STRING(out))
        return memoryview(out).cast("?")
    finally:
        _free_probe(&p)


DEF CONTAINS_CHUNK = 2048


cdef int _contains_chunked(const Probe* p, object keys, uint64_t seed,
                           unsigned char* flags) except -1:
    cdef uint64_t h[CONTAINS_CHUNK]
    cdef Py_ssize_t n = len(keys), start = 0, i, m, f
    cdef Py_ssize_t nf = p.nbloom
    cdef PyObject* k
    cdef bint is_list = isinstance(keys, list)
    cdef uint64_t x
    while start < n:
        m = n - start
        if m > CONTAINS_CHUNK:
            m = CONTAINS_CHUNK
        for i in range(m):
            if is_list:
                if start + i >= PyList_GET_SIZE(keys):
                    raise RuntimeError("list of keys changed size during the batch")
                k = PyList_GET_ITEM(keys, start + i)
            else:
                k = PyTuple_GET_ITEM(keys, start + i)
            if _bytes_check_exact(k):
                x = dc_xxh64(_bytes_data(k), <size_t>_bytes_size(k), seed)
            else:
                x = _hash_other(<object>k, start + i, seed)
            h[i] = x
            for f in range(nf if nf < 2 else 2):
                dc_prefetch(p.refs[f].blocks + dc_block_index(x, p.refs[f].nblocks) * 8)
        with nogil:
            _contains_hashes(p, h, <size_t>m, flags + start)
        start += m
    return 0


cdef int _probe_batch(const Probe* p, KeyBatch batch, BlockFilter target,
                      unsigned char* flags) except -1:
    cdef size_t m = <size_t>batch.n
    cdef const uint64_t* h = batch.hashes
    cdef bint has_target = target is not None
    cdef uint64_t* tblocks = target.blocks if has_target else NULL
    cdef uint64_t tnblocks = target._nblocks if has_target else 0
    cdef pthread_mutex_t* tlock = &target._mutex if has_target else NULL
    cdef uint64_t* tcount = &target._count if has_target else NULL
    if m == 0:
        return 0
    with nogil:
        _contains_hashes(p, h, m, flags)  # "present in another filter", fuse ones too
        if has_target:
            pthread_mutex_lock(tlock)
            tcount[0] += dc_add_batch(tblocks, tnblocks, h, m, flags)
            pthread_mutex_unlock(tlock)
    return 0


def probe_digests(tuple filters, bytes digests, uint64_t seed, int half=0):
    """Probes concatenated 16-byte record digests against several filters.

    As :func:`probe_many` without a target, over the digests' front hashes:
    the first 8 bytes of each digest, in native byte order (the hash the
    store's front filter and cold archive are keyed by; docs/warm-tier.md,
    "Lookups"); with ``half`` 1, over their second 8 bytes (the hash the
    warm tier's slice filters are keyed by). No buffer or key object is made
    per call: this is the exact and cold tiers' lookup of every claim.
    """
    cdef Py_ssize_t size = len(digests)
    if size % 16:
        raise ValueError(f"digests must be a multiple of 16 bytes, got {size}")
    if half != 0 and half != 1:
        raise ValueError(f"half is 0 (the first 8 bytes) or 1 (the second), got {half}")
    cdef Py_ssize_t n = size // 16, start = 0, i, m
    out = bytearray(n)
    if not filters:
        return memoryview(out).cast("?")
    cdef const unsigned char* src = <const unsigned char*>PyBytes_AS_STRING(digests) + 8 * half
    cdef unsigned char* flags = <unsigned char*>PyByteArray_AS_STRING(out)
    cdef uint64_t h[CONTAINS_CHUNK]
    cdef Probe p
    _gather_filters(filters, seed, &p)  # checked even for no digests, as probe_many does
    try:
        with nogil:
            while start < n:
                m = n - start
                if m > CONTAINS_CHUNK:
                    m = CONTAINS_CHUNK
                for i in range(m):
                    memcpy(&h[i], src + (start + i) * 16, 8)
                _contains_hashes(&p, h, <size_t>m, flags + start)
                start += m
    finally:
        _free_probe(&p)
    return memoryview(out).cast("?")


# -- write-ahead-log framing ------------------------------------------------------

cdef inline void _put_le(unsigned char* p, uint64_t v, int n) noexcept nogil:
    cdef int i
    for i in range(n):
        p[i] = <unsigned char>(v >> (8 * i))


def frame_records(bytearray out, list payloads, uint64_t first_lsn, Py_ssize_t max_bytes):
    """Appends payloads to ``out`` framed as write-ahead-log records.

    Record ``i`` gets log position ``first_lsn + i`` and is framed as
    ``[length u32 LE][lsn u64 LE][payload][checksum u64 LE]``, the checksum
    being XXH64 (seed 0) of the head and payload (the format is described in
    ``dedupcore/wal.py``; docs/architecture.md names the layers). Returns -1.
    A payload that is not ``bytes`` or ``bytearray`` of at most ``max_bytes``
    stops it before anything is appended: it returns that payload's index and
    the caller (``dedupcore.wal``) names what is wrong, or converts it.
    """
    cdef Py_ssize_t n = PyList_GET_SIZE(payloads), i, size, total = 0, start
    cdef PyObject* item
    for i in range(n):
        item = PyList_GET_ITEM(payloads, i)
        if _bytes_check_exact(item):
            size = _bytes_size(item)
        elif PyByteArray_CheckExact(<object>item) and item != <PyObject*>out:
            size = PyByteArray_GET_SIZE(<object>item)
        else:
            return i  # (``out`` itself is resized below: the caller copies it)
        if size > max_bytes or size > 0xFFFFFFFF:
            return i
        total += 20 + size
    start = PyByteArray_GET_SIZE(out)
    PyByteArray_Resize(out, start + total)
    cdef unsigned char* dst = <unsigned char*>PyByteArray_AS_STRING(out) + start
    cdef const char* data
    for i in range(n):
        item = PyList_GET_ITEM(payloads, i)
        if _bytes_check_exact(item):
            data = _bytes_data(item)
            size = _bytes_size(item)
        else:
            data = PyByteArray_AS_STRING(<object>item)
            size = PyByteArray_GET_SIZE(<object>item)
        _put_le(dst, <uint64_t>size, 4)
        _put_le(dst + 4, first_lsn + <uint64_t>i, 8)
        if size:
            memcpy(dst + 12, data, <size_t>size)
        _put_le(dst + 12 + size, dc_xxh64(dst, <size_t>(12 + size), 0), 8)
        dst += 20 + size
    return -1


from posix.unistd cimport close, read


cdef extern from "dc_sync.h" nogil:
    ctypedef struct dc_syncer:
        pass
    int dc_syncer_init(dc_syncer* s, int efd)
    int dc_syncer_start(dc_syncer* s, int fd, const char* data, size_t len, int sync,
                        int64_t zero_from, int64_t zero_to)
    void dc_syncer_wait(dc_syncer* s)
    int dc_syncer_take(dc_syncer* s, int* err, size_t* written, int* zero_err)
    void dc_syncer_close(dc_syncer* s)


cdef class Syncer:
    """A native thread that writes a buffer at the end of a file and fdatasyncs it
    without the GIL, then adds 1 to an eventfd (``fileno()``) for an event loop to
    watch (ext/dc_sync.h; docs/daemon.md, "Group commit").

    One job at a time: :meth:`start` queues it, :meth:`take` returns its outcome
    once it is done (``(errno, bytes written, errno of the zero fill)``, or None
    while it runs), after which the next may start. :meth:`wait` blocks, the GIL released, until the
    job is done; :meth:`drain` clears the eventfd. The buffer is held (and a bytearray cannot be resized) until
    the job is taken.
    """

    cdef dc_syncer s
    cdef int efd
    cdef bint running  # the native thread was started and not closed
    cdef Py_buffer view
    cdef bint holding  # ``view`` is held for the job under way

    def __cinit__(self):
        import os
        self.efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        cdef int rc = dc_syncer_init(&self.s, self.efd)
        if rc != 0:
            os.close(self.efd)
            self.efd = -1
            raise OSError(rc, f"cannot start the commit thread: {os.strerror(rc)}")
        self.running = True

    def fileno(self) -> int:
        """The eventfd that becomes readable when a job is done."""
        if self.efd < 0:
            raise ValueError("the syncer is closed")
        return self.efd

    def start(self, int fd, data, bint sync=True, zeros=None):
        """Queues a job: write zeros over ``zeros`` (``(start, end)`` offsets of
        ``fd``, or None), then ``data`` (bytes-like) at ``fd``'s position, then
        fdatasync ``fd`` when ``sync``. A failed zero fill is reported by
        :meth:`take` and changes nothing else. RuntimeError while another job is
        not taken."""
        cdef int64_t zero_from = 0, zero_to = 0
        if not self.running:
            raise ValueError("the syncer is closed")
        if self.holding:
            raise RuntimeError("a commit is under way: take it before starting another")
        if zeros is not None:
            zero_from, zero_to = zeros
            if not 0 <= zero_from <= zero_to:
                raise ValueError(f"zeros must be (start, end) with 0 <= start <= end, got {zeros!r}")
        PyObject_GetBuffer(data, &self.view, PyBUF_SIMPLE)
        self.holding = True
        if dc_syncer_start(&self.s, fd, <const char*>self.view.buf, <size_t>self.view.len,
                           sync, zero_from, zero_to) != 0:
            PyBuffer_Release(&self.view)
            self.holding = False
            raise RuntimeError("a commit is under way: take it before starting another")

    def busy(self) -> bool:
        """Whether a job was started and not yet taken."""
        return self.holding

    def wait(self):
        """Blocks, the GIL released, until the job started is done (at once if none)."""
        if self.running:
            with nogil:
                dc_syncer_wait(&self.s)

    def take(self):
        """The done job's ``(errno, bytes written, errno of the zero fill)`` (errno 0:
        written and synced; the fill's 0 also when none was asked), or None when no
        job is done. Any thread may take it; the eventfd stays readable until
        :meth:`drain`, so the loop watching it learns of the job either way."""
        cdef int err = 0, zero_err = 0
        cdef size_t written = 0
        if not self.running or not dc_syncer_take(&self.s, &err, &written, &zero_err):
            return None
        PyBuffer_Release(&self.view)
        self.holding = False
        return err, written, zero_err

    def drain(self):
        """Clears the eventfd (the loop watching it, when it became readable); a read
        of an eventfd already clear fails with EAGAIN, which is all right."""
        cdef uint64_t count
        if self.efd >= 0:
            read(self.efd, &count, sizeof(count))

    def close(self):
        """Finishes the job under way, stops the thread and closes the eventfd."""
        self._shut()

    def __dealloc__(self):
        self._shut()

    cdef void _shut(self) noexcept:
        if self.running:
            with nogil:
                dc_syncer_close(&self.s)
            self.running = False
        if self.holding:
            PyBuffer_Release(&self.view)
            self.holding = False
        if self.efd >= 0:
            close(self.efd)
            self.efd = -1


# -- the daemon client's round trip -------------------------------------------------

cdef extern from "dc_wire.h" nogil:
    int DC_WIRE_EOF
    int64_t dc_wire_now_ms()
    int dc_wire_send(int fd, const unsigned char* buf, size_t len, int64_t deadline_ms)
    int dc_wire_recv(int fd, unsigned char* buf, size_t len, int64_t deadline_ms,
                     int wait_first, int64_t spin_ns)
    uint32_t dc_wire_length(const unsigned char* h)


cdef object _wire_error(int rc, str doing):
    import os
    if rc == DC_WIRE_EOF:
        return ConnectionResetError(f"the daemon closed the connection {doing}")
    if rc == -ETIMEDOUT:
        return TimeoutError(f"timed out {doing}")
    return OSError(-rc, f"{os.strerror(-rc)} {doing}")


#: The longest ``exchange`` may check for its reply without sleeping, in seconds
#: (also the bound of every spin setting: dedupcore._spin.MAX_SPIN).
MAX_SPIN = 0.01


def exchange(int fd, const unsigned char[::1] request, Py_ssize_t max_frame, double timeout,
             double spin=0.0):
    """Sends ``request`` (a whole frame, or nothing when empty) on the connected
    stream socket ``fd``, then reads the next frame and returns its body (bytes),
    the GIL released while it sends and waits (ext/dc_wire.h; docs/daemon.md,
    "The client's round trip").

    The request must be sent within ``timeout`` seconds, and the reply must come
    whole within ``timeout`` of that. Before it sleeps in ``poll()`` for the
    reply, the call checks the socket without sleeping for up to ``spin``
    seconds (0: not at all), letting other runnable threads have the core
    between two checks (docs/daemon.md, "Polling for the reply"). When the
    request could not be sent whole,
    nothing was read and the errno of the failure is returned (an int: the
    daemon cannot have read a whole frame, so nothing of it was applied). Once it
    was sent, a failure raises: TimeoutError, ConnectionResetError (the daemon
    closed the connection), OSError, or ValueError for a reply whose length is
    not within 1..``max_frame``.
    """
    if timeout <= 0 or timeout != timeout:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    if max_frame < 1:
        raise ValueError(f"max_frame must be positive, got {max_frame!r}")
    if not 0.0 <= spin <= MAX_SPIN:
        raise ValueError(f"spin must be 0 to {MAX_SPIN} seconds, got {spin!r}")
    cdef double ms = timeout * 1000.0
    cdef int64_t span = <int64_t>ms if ms < 1e15 else <int64_t>1e15
    if span < 1:
        span = 1
    # Checking for the reply never outlasts the time it may take.
    cdef int64_t spin_ns = <int64_t>(spin * 1e9)
    if spin_ns > span * 1000000:
        spin_ns = span * 1000000
    cdef int rc = 0
    cdef size_t n = <size_t>request.shape[0]
    cdef unsigned char header[4]
    cdef int64_t deadline = 0
    cdef bint sent = n == 0
    with nogil:
        if n:
            rc = dc_wire_send(fd, &request[0], n, dc_wire_now_ms() + span)
            sent = rc == 0
        if sent:
            deadline = dc_wire_now_ms() + span
            rc = dc_wire_recv(fd, header, 4, deadline, 1, spin_ns)
    if not sent:
        return -rc
    if rc != 0:
        raise _wire_error(rc, "waiting for the reply")
    cdef uint32_t length = dc_wire_length(header)
    if length == 0 or length > <uint64_t>max_frame:
        raise ValueError(
            "empty frame" if length == 0
            else f"frame of {length} bytes exceeds the limit of {max_frame}"
        )
    body = PyBytes_FromStringAndSize(NULL, length)
    cdef unsigned char* dst = <unsigned char*>PyBytes_AS_STRING(body)
    with nogil:
        rc = dc_wire_recv(fd, dst, length, deadline, 0, 0)
    if rc != 0:
        raise _wire_error(rc, "reading the reply")
    return body


# -- one-key requests and their replies, as the protocol frames them ----------------
#
# dedupcore/daemon/protocol.py defines the frames: a 4-byte big-endian length and a
# msgpack body. The client's one-key calls build their request here and read the
# usual answer here; anything else (a result, a cold or takeover answer, an error,
# another request's reply) is left to protocol.py, which decodes every frame.

cdef inline void _be(unsigned char* p, uint64_t v, int n) noexcept:
    cdef int i
    for i in range(n):
        p[i] = <unsigned char>(v >> (8 * (n - 1 - i)))


cdef inline unsigned char* _mp_uint(unsigned char* p, uint64_t v) noexcept:
    # msgpack's shortest form of an unsigned integer, as msgpack-python packs it.
    if v < 0x80:
        p[0] = <unsigned char>v
        return p + 1
    if v <= 0xFF:
        p[0] = 0xCC
        p[1] = <unsigned char>v
        return p + 2
    if v <= 0xFFFF:
        p[0] = 0xCD
        _be(p + 1, v, 2)
        return p + 3
    if v <= 0xFFFFFFFF:
        p[0] = 0xCE
        _be(p + 1, v, 4)
        return p + 5
    p[0] = 0xCF
    _be(p + 1, v, 8)
    return p + 9


cdef inline unsigned char* _mp_raw(unsigned char* p, const char* data, Py_ssize_t n,
                                   bint text) noexcept:
    # str (use_bin_type: str8 and up) or bin, then the bytes.
    if text and n < 32:
        p[0] = <unsigned char>(0xA0 | n)
        p += 1
    elif n <= 0xFF:
        p[0] = 0xD9 if text else 0xC4
        p[1] = <unsigned char>n
        p += 2
    elif n <= 0xFFFF:
        p[0] = 0xDA if text else 0xC5
        _be(p + 1, <uint64_t>n, 2)
        p += 3
    else:
        p[0] = 0xDB if text else 0xC6
        _be(p + 1, <uint64_t>n, 4)
        p += 5
    if n:
        memcpy(p, data, <size_t>n)
    return p + n


def one_key_frame(uint64_t request_id, int op, str namespace, key, token=0, packed=None):
    """The request frame of a one-key call, byte for byte what
    ``protocol.encode_request`` makes of the same request: CLAIM_MANY (2) of
    ``key`` in ``namespace`` with columns asked for (``{"ns", "keys", "cols": 1}``),
    COMPLETE_MANY (3) of ``[key, token, result]`` with ``packed`` the result's
    msgpack bytes (None: nil), RELEASE_MANY (4) of ``[key, token]``. None when
    the key is neither exactly bytes nor str, or the op is another: the caller
    encodes such a request the general way.
    """
    cdef Py_ssize_t ns_len, key_len, packed_len = 1
    cdef const char* ns_data = PyUnicode_AsUTF8AndSize(namespace, &ns_len)
    cdef const char* key_data
    cdef bint key_text
    cdef uint64_t tok = 0
    if op < 2 or op > 4:
        return None
    if PyBytes_CheckExact(key):
        key_data = PyBytes_AS_STRING(key)
        key_len = PyBytes_GET_SIZE(key)
        key_text = False
    elif type(key) is str:
        key_data = PyUnicode_AsUTF8AndSize(key, &key_len)
        key_text = True
    else:
        return None
    if op != 2:
        tok = token  # OverflowError/TypeError for a token that is no u64 (checked before)
        if op == 3 and packed is not None:
            if not PyBytes_CheckExact(packed):
                raise TypeError("packed must be bytes or None")
            packed_len = PyBytes_GET_SIZE(packed)
    # Header, array and map heads, three short keys, two raw heads, two u64s: < 64.
    cdef Py_ssize_t cap = 64 + ns_len + key_len + packed_len
    out = PyBytes_FromStringAndSize(NULL, cap)
    cdef unsigned char* start = <unsigned char*>PyBytes_AS_STRING(out)
    cdef unsigned char* p = start + 4
    p[0] = 0x93  # [request_id, op, args]
    p = _mp_uint(p + 1, request_id)
    p[0] = <unsigned char>op
    p[1] = 0x83 if op == 2 else 0x82
    p = _mp_raw(p + 2, "ns", 2, True)
    p = _mp_raw(p, ns_data, ns_len, True)
    if op == 2:
        p = _mp_raw(p, "keys", 4, True)
        p[0] = 0x91
        p = _mp_raw(p + 1, key_data, key_len, key_text)
        p = _mp_raw(p, "cols", 4, True)
        p[0] = 0x01
        p += 1
    else:
        p = _mp_raw(p, "items", 5, True)
        p[0] = 0x91
        p[1] = 0x93 if op == 3 else 0x92
        p = _mp_raw(p + 2, key_data, key_len, key_text)
        p = _mp_uint(p, tok)
        if op == 3:
            if packed is None:
                p[0] = 0xC0
                p += 1
            else:
                memcpy(p, PyBytes_AS_STRING(packed), <size_t>packed_len)
                p += packed_len
    cdef Py_ssize_t body = (p - start) - 4
    _be(start, <uint64_t>body, 4)
    return out[: body + 4]


cdef inline unsigned char* _mp_array(unsigned char* p, Py_ssize_t n) noexcept:
    # An array head of n items, msgpack's shortest form.
    if n < 16:
        p[0] = <unsigned char>(0x90 | n)
        return p + 1
    if n <= 0xFFFF:
        p[0] = 0xDC
        _be(p + 1, <uint64_t>n, 2)
        return p + 3
    p[0] = 0xDD
    _be(p + 1, <uint64_t>n, 4)
    return p + 5


def claim_frame(uint64_t request_id, str namespace, list keys):
    """The request frame of a plain claim batch (no lease, owner or fingerprints):
    ``[request_id, CLAIM_MANY, {"ns": namespace, "keys": keys, "cols": 1}]``, byte
    for byte what ``protocol.encode_request`` makes of those args, built without
    an object per key. None when a key is not exactly bytes or str: the caller
    encodes such a batch the general way. For one key, the same bytes as
    :func:`one_key_frame`."""
    cdef Py_ssize_t n = PyList_GET_SIZE(keys), i, ns_len, size
    cdef Py_ssize_t* lens
    cdef const char** datas
    cdef unsigned char* texts
    cdef const char* ns_data = PyUnicode_AsUTF8AndSize(namespace, &ns_len)
    cdef object key, out
    cdef unsigned char* start
    cdef unsigned char* p
    # Header, array and map heads, three short keys, the namespace's head: < 64.
    cdef Py_ssize_t cap = 64 + ns_len
    lens = <Py_ssize_t*>malloc((n + 1) * sizeof(Py_ssize_t))
    datas = <const char**>malloc((n + 1) * sizeof(const char*))
    texts = <unsigned char*>malloc(n + 1)
    if lens == NULL or datas == NULL or texts == NULL:
        free(lens)
        free(datas)
        free(texts)
        raise MemoryError()
    try:
        for i in range(n):
            key = <object>PyList_GET_ITEM(keys, i)
            if PyBytes_CheckExact(key):
                datas[i] = PyBytes_AS_STRING(key)
                lens[i] = PyBytes_GET_SIZE(key)
                texts[i] = 0
            elif type(key) is str:
                datas[i] = PyUnicode_AsUTF8AndSize(key, &size)
                lens[i] = size
                texts[i] = 1
            else:
                return None
            cap += 5 + lens[i]
        out = PyBytes_FromStringAndSize(NULL, cap)
        start = <unsigned char*>PyBytes_AS_STRING(out)
        p = start + 4
        p[0] = 0x93  # [request_id, op, args]
        p = _mp_uint(p + 1, request_id)
        p[0] = 2  # Op.CLAIM_MANY
        p[1] = 0x83
        p = _mp_raw(p + 2, "ns", 2, True)
        p = _mp_raw(p, ns_data, ns_len, True)
        p = _mp_raw(p, "keys", 4, True)
        p = _mp_array(p, n)
        for i in range(n):
            p = _mp_raw(p, datas[i], lens[i], texts[i])
        p = _mp_raw(p, "cols", 4, True)
        p[0] = 0x01
        p += 1
    finally:
        free(lens)
        free(datas)
        free(texts)
    cdef Py_ssize_t body = (p - start) - 4
    _be(start, <uint64_t>body, 4)
    return out[: body + 4]


cdef inline uint64_t _mp_be(const unsigned char* p, int width) noexcept:
    # The big-endian unsigned integer of ``width`` bytes at p: msgpack's lengths
    # and integers.
    cdef uint64_t v = 0
    cdef int i
    for i in range(width):
        v = (v << 8) | p[i]
    return v


cdef inline Py_ssize_t _mp_read_uint(const unsigned char* p, Py_ssize_t n,
                                     uint64_t* v) noexcept:
    # An unsigned integer at p (n bytes left): its length, or 0 when it is none.
    cdef int width
    if n < 1:
        return 0
    if p[0] < 0x80:
        v[0] = p[0]
        return 1
    if p[0] == 0xCC:
        width = 1
    elif p[0] == 0xCD:
        width = 2
    elif p[0] == 0xCE:
        width = 4
    elif p[0] == 0xCF:
        width = 8
    else:
        return 0
    if n < 1 + width:
        return 0
    v[0] = _mp_be(p + 1, width)
    return 1 + width


# The columns of one answer with nothing sparse, after "o"'s and "t"'s values.
cdef bytes _EMPTY_SPARSE = b"\xa2ri\x90\xa2rv\x90\xa1x\x90\xa1k\x90"


def one_key_reply(const unsigned char[::1] body, uint64_t request_id):
    """The usual answer to a one-key request, read from its reply's body: for a
    claim, ``(outcome code, token)`` when the reply is OK, for ``request_id``, in
    columns with nothing but the outcome (0 NEW, 1 DUPLICATE, 2 IN_PROGRESS) and
    the token (no result, exact, no takeover); for a completion or a release,
    True when the reply is OK with nil. None for any other body, which the
    caller decodes the general way (``protocol.decode_response``)."""
    cdef Py_ssize_t n = body.shape[0], pos, used
    cdef uint64_t rid = 0, token = 0
    cdef const unsigned char* p
    if n < 4:
        return None
    p = &body[0]
    if p[0] != 0x93:
        return None
    used = _mp_read_uint(p + 1, n - 1, &rid)
    if not used or rid != request_id:
        return None
    pos = 1 + used
    if pos + 2 > n or p[pos] != 0x00:  # Status.OK
        return None
    pos += 1
    if p[pos] == 0xC0:
        return True if pos + 1 == n else None
    # {"o": bin(1), "t": bin(8), "ri": [], "rv": [], "x": [], "k": []}
    if n - pos != 18 + len(_EMPTY_SPARSE):
        return None
    if memcmp(p + pos, b"\x86\xa1o\xc4\x01", 5) != 0 or p[pos + 5] > 2:
        return None
    if memcmp(p + pos + 6, b"\xa1t\xc4\x08", 4) != 0:
        return None
    if memcmp(p + pos + 18, <const char*>_EMPTY_SPARSE, len(_EMPTY_SPARSE)) != 0:
        return None
    cdef int i
    for i in range(8):
        token |= (<uint64_t>p[pos + 10 + i]) << (8 * i)
    return p[pos + 5], token


cdef extern from "Python.h":
    object PyUnicode_DecodeUTF8(const char* s, Py_ssize_t size, const char* errors)


cdef inline Py_ssize_t _mp_read_raw(const unsigned char* p, Py_ssize_t n, bint* text,
                                    Py_ssize_t* length) noexcept:
    # A str or bin head at p (n bytes left): its length, the data's length in
    # ``length`` and whether it is str in ``text``; 0 when it is neither or cut off.
    cdef unsigned char b
    cdef Py_ssize_t head, size
    if n < 1:
        return 0
    b = p[0]
    if 0xA0 <= b <= 0xBF:
        text[0], head, size = True, 1, b & 0x1F
    elif 0xD9 <= b <= 0xDB or 0xC4 <= b <= 0xC6:  # str or bin 8/16/32
        text[0] = b >= 0xD9
        head = 1 + (1 << (b - (0xD9 if b >= 0xD9 else 0xC4)))
        if n < head:
            return 0
        size = <Py_ssize_t>_mp_be(p + 1, head - 1)
    else:
        return 0
    if n - head < size:
        return 0
    length[0] = size
    return head


cdef inline Py_ssize_t _mp_request_head(const unsigned char* p, Py_ssize_t n, uint64_t* rid,
                                        int* op, int* fields) noexcept:
    # The head of a request body as the clients build it natively, up to its
    # namespace: [request_id, op, {"ns": ... (``fields`` keys in the map, the
    # first "ns"). The bytes it takes, or 0 when the body does not start so.
    cdef Py_ssize_t used, pos
    if n < 1 or p[0] != 0x93:
        return 0
    used = _mp_read_uint(p + 1, n - 1, rid)
    if not used:
        return 0
    pos = 1 + used
    if n - pos < 5 or p[pos] > 0x7F or not 0x80 <= p[pos + 1] <= 0x8F:
        return 0
    if memcmp(p + pos + 2, b"\xa2ns", 3) != 0:
        return 0
    op[0] = p[pos]
    fields[0] = p[pos + 1] & 0x0F
    return pos + 5


cdef object _mp_take_raw(const unsigned char* p, Py_ssize_t n, Py_ssize_t* pos,
                         bint text_only):
    # The str (as str, UTF-8) or bin (as bytes) at p + pos[0], n bytes in all, and
    # pos[0] moved past it; None when there is none there (or, with text_only, a
    # bin), or its text is not UTF-8.
    cdef bint text
    cdef Py_ssize_t size
    cdef const unsigned char* at = p + pos[0]
    cdef Py_ssize_t used = _mp_read_raw(at, n - pos[0], &text, &size)
    if not used or (text_only and not text):
        return None
    at += used
    if text:
        try:
            value = PyUnicode_DecodeUTF8(<const char*>at, size, "strict")
        except UnicodeDecodeError:
            return None
    else:
        value = PyBytes_FromStringAndSize(<const char*>at, size)
    pos[0] += used + size
    return value


def one_key_request(const unsigned char[::1] body):
    """The request of a frame body that is exactly what :func:`one_key_frame` builds:
    ``(request_id, op, namespace, key, token, packed)`` (token 0 and packed None for
    a claim; packed, for a completion, the result's msgpack bytes as sent, None for
    nil). None for any other body, which the caller decodes the general way
    (``protocol.decode_request``), as it does a body whose strings are not UTF-8."""
    cdef Py_ssize_t n = body.shape[0], pos = 0, used
    cdef uint64_t rid = 0, token = 0
    cdef int op, fields
    if n < 8:
        return None
    cdef const unsigned char* p = &body[0]
    pos = _mp_request_head(p, n, &rid, &op, &fields)
    if not pos or op < 2 or op > 4 or fields != (3 if op == 2 else 2):
        return None
    namespace = _mp_take_raw(p, n, &pos, True)
    if namespace is None:
        return None
    if op == 2:
        if n - pos < 6 or memcmp(p + pos, b"\xa4keys\x91", 6) != 0:
            return None
        pos += 6
    else:
        if n - pos < 8 or memcmp(p + pos, b"\xa5items\x91", 7) != 0:
            return None
        if p[pos + 7] != (0x93 if op == 3 else 0x92):
            return None
        pos += 8
    key = _mp_take_raw(p, n, &pos, False)
    if key is None:
        return None
    if op == 2:
        if n - pos != 6 or memcmp(p + pos, b"\xa4cols\x01", 6) != 0:
            return None
        return rid, op, namespace, key, 0, None
    used = _mp_read_uint(p + pos, n - pos, &token)
    if not used:
        return None
    pos += used
    if op == 4:
        return (rid, op, namespace, key, token, None) if pos == n else None
    if pos >= n:
        return None
    if p[pos] == 0xC0 and pos + 1 == n:
        return rid, op, namespace, key, token, None
    return rid, op, namespace, key, token, PyBytes_FromStringAndSize(<const char*>p + pos, n - pos)


cdef Py_ssize_t _mp_skip(const unsigned char* p, Py_ssize_t n) noexcept:
    # The bytes the msgpack value at p takes (n bytes left), nested values
    # included, without reading it: 0 when it is cut off or not msgpack (0xC1).
    # No recursion: the values still to skip are counted.
    cdef Py_ssize_t pos = 0, width, size
    cdef uint64_t left = 1
    cdef unsigned char b
    while left:
        if pos >= n or left > <uint64_t>(n - pos):  # each value takes a byte at least
            return 0
        left -= 1
        b = p[pos]
        pos += 1
        if b <= 0x7F or b >= 0xE0 or b == 0xC0 or b == 0xC2 or b == 0xC3:
            continue
        if b <= 0x8F:
            left += 2 * <uint64_t>(b & 0x0F)
            continue
        if b <= 0x9F:
            left += b & 0x0F
            continue
        if b <= 0xBF:
            size = b & 0x1F
        elif b == 0xC1:
            return 0
        elif b == 0xCA or b == 0xCB:  # float 32/64
            size = 4 if b == 0xCA else 8
        elif 0xCC <= b <= 0xD3:  # uint 8-64, int 8-64
            size = 1 << ((b - 0xCC) & 3)
        elif 0xD4 <= b <= 0xD8:  # fixext 1-16: its type byte and data
            size = 1 + (1 << (b - 0xD4))
        else:
            # A length of 1, 2 or 4 bytes: bin/ext/str 8-32, array/map 16-32.
            if 0xC4 <= b <= 0xC6:
                width = 1 << (b - 0xC4)
            elif 0xC7 <= b <= 0xC9:
                width = 1 << (b - 0xC7)
            elif 0xD9 <= b <= 0xDB:
                width = 1 << (b - 0xD9)
            else:  # 0xDC-0xDF
                width = 2 if b == 0xDC or b == 0xDE else 4
            if n - pos < width:
                return 0
            size = <Py_ssize_t>_mp_be(p + pos, width)
            pos += width
            if b >= 0xDC:
                left += <uint64_t>size * (2 if b >= 0xDE else 1)
                continue
            if 0xC7 <= b <= 0xC9:
                size += 1  # the ext's type byte
        if n - pos < size:
            return 0
        pos += size
    return pos


def batch_request(const unsigned char[::1] body, Py_ssize_t part, Py_ssize_t at_least=0):
    """The request of a frame body of a batch in the form the clients send one in,
    read without an object per key or item: a plain claim, ``[request_id,
    CLAIM_MANY, {"ns": namespace, "keys": [...], "cols": 1}]`` (what
    :func:`claim_frame` builds), or a completion or release, ``[request_id, op,
    {"ns": namespace, "items": [...]}]``. ``(request_id, op, namespace, count,
    starts)``, ``starts`` the offsets in ``body`` of elements 0, ``part``, 2 *
    ``part``, ... and of the end of the last, so that the caller decodes one
    part at a time (docs/daemon.md, "Large batches in slices"). Every element is
    checked to be whole msgpack, not decoded. None for any other body (other
    args, bytes left over, a cut-off body), and for a batch of fewer than
    ``at_least`` elements (known before the elements are read), which the
    caller decodes whole."""
    if part < 1:
        raise ValueError(f"part must be at least 1, got {part}")
    cdef Py_ssize_t n = body.shape[0], pos = 0, used, count, i
    cdef uint64_t rid = 0
    cdef int op, fields
    if n < 12:
        return None
    cdef const unsigned char* p = &body[0]
    pos = _mp_request_head(p, n, &rid, &op, &fields)
    if not pos or fields != (3 if op == 2 else 2) or not 2 <= op <= 4:
        return None
    namespace = _mp_take_raw(p, n, &pos, True)
    if namespace is None or n - pos < 7:
        return None
    if op == 2 and memcmp(p + pos, b"\xa4keys", 5) == 0:
        pos += 5
    elif op != 2 and memcmp(p + pos, b"\xa5items", 6) == 0:
        pos += 6
    else:
        return None
    if 0x90 <= p[pos] <= 0x9F:
        count, pos = p[pos] & 0x0F, pos + 1
    elif p[pos] == 0xDC and n - pos >= 3:
        count, pos = <Py_ssize_t>_mp_be(p + pos + 1, 2), pos + 3
    elif p[pos] == 0xDD and n - pos >= 5:
        count, pos = <Py_ssize_t>_mp_be(p + pos + 1, 4), pos + 5
    else:
        return None
    if count > n - pos or count < at_least:  # every element takes a byte at least
        return None
    starts = []
    for i in range(count):
        if i % part == 0:
            starts.append(pos)
        used = _mp_skip(p + pos, n - pos)
        if not used:
            return None
        pos += used
    starts.append(pos)
    if op == 2:
        if n - pos != 6 or memcmp(p + pos, b"\xa4cols\x01", 6) != 0:
            return None
    elif pos != n:
        return None
    return rid, op, namespace, count, starts


def one_key_answer(uint64_t request_id, int code, uint64_t token):
    """The reply frame of a one-key claim answered with outcome ``code`` (0 NEW,
    1 DUPLICATE, 2 IN_PROGRESS) and ``token``, nothing else in it: byte for byte
    what ``protocol.encode_response`` makes of its columns (what
    :func:`one_key_reply` reads)."""
    if code < 0 or code > 2:
        raise ValueError(f"no outcome has code {code}")
    cdef Py_ssize_t size = 4 + 1 + 9 + 1 + 18 + len(_EMPTY_SPARSE)
    out = PyBytes_FromStringAndSize(NULL, size)
    cdef unsigned char* start = <unsigned char*>PyBytes_AS_STRING(out)
    cdef unsigned char* p = start + 4
    p[0] = 0x93
    p = _mp_uint(p + 1, request_id)
    p[0] = 0x00  # Status.OK
    memcpy(p + 1, b"\x86\xa1o\xc4\x01", 5)
    p[6] = <unsigned char>code
    memcpy(p + 7, b"\xa1t\xc4\x08", 4)
    _put_le(p + 11, token, 8)
    memcpy(p + 19, <const char*>_EMPTY_SPARSE, len(_EMPTY_SPARSE))
    p += 19 + len(_EMPTY_SPARSE)
    cdef Py_ssize_t body = (p - start) - 4
    _be(start, <uint64_t>body, 4)
    return out[: body + 4]
