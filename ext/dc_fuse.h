/*
 * dc_fuse.h - static binary fuse filters with 16-bit fingerprints.
 *
 * The filter of sealed cold-archive slices (docs/warm-tier.md, "The cold
 * archive"): an immutable set of 64-bit key hashes in about 2.25 bytes per
 * key, with a false-positive rate of 2**-16. The construction is the 3-wise
 * binary fuse filter of Graf & Lemire ("Binary Fuse Filters: Fast and Smaller
 * Than Xor Filters", 2022), written here from the paper.
 *
 * Layout. The body is array_length little-endian uint16 fingerprints, made of
 * segment_count + 2 segments of segment_length slots (a power of two). A key
 * hash h is mixed with the filter's seed into x = murmur64(h + seed); x picks
 * a slot h0 in the first segment_count_length slots (multiply-shift of x),
 * and h1, h2 in the next two segments at offsets taken from other bits of x.
 * The key is held when fp[h0] ^ fp[h1] ^ fp[h2] == (uint16)(x ^ (x >> 32)).
 *
 * Everything here is plain C without the Python API, safe to run without the
 * GIL. Sizes are 64-bit throughout: array_length may reach 2**32 - 1 slots,
 * and products of it overflow 32 bits.
 */
#ifndef DC_FUSE_H
#define DC_FUSE_H

#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "dc_hash.h" /* dc_prefetch, dc_alloc_body */
#include "dc_status.h"

#define DC_FUSE_MAX_SEGMENT_LENGTH 262144u     /* 2**18 */
#define DC_FUSE_MAX_ARRAY_LENGTH 0xFFFFFFFFull /* slots are indexed by uint32 */
#define DC_FUSE_MAX_ATTEMPTS 100               /* seeds tried before giving up */


typedef struct {
    uint64_t seed;                 /* mixed into every key hash */
    uint64_t segment_length;       /* power of two, 1 .. 2**18 */
    uint64_t segment_length_mask;  /* segment_length - 1 */
    uint64_t segment_count_length; /* segment_count * segment_length */
    uint64_t array_length;         /* segment_count_length + 2 * segment_length */
    const unsigned char *fp;       /* array_length little-endian uint16 */
} dc_fuse_t;

/* ---- hashing ------------------------------------------------------------ */

static inline uint64_t dc_fuse_mix(uint64_t h, uint64_t seed) {
    /* The 64-bit finaliser of MurmurHash3: a bijection, so distinct hashes
     * stay distinct under every seed. */
    h += seed;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

/* SplitMix64: the sequence of seeds a construction tries, from the caller's. */
static inline uint64_t dc_fuse_splitmix(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline uint64_t dc_fuse_mulhi(uint64_t a, uint64_t b) {
#if defined(__SIZEOF_INT128__)
    return (uint64_t)(((unsigned __int128)a * b) >> 64);
#else
    uint64_t a_lo = (uint32_t)a, a_hi = a >> 32, b_lo = (uint32_t)b, b_hi = b >> 32;
    uint64_t lo_lo = a_lo * b_lo, hi_lo = a_hi * b_lo, lo_hi = a_lo * b_hi;
    uint64_t cross = (lo_lo >> 32) + (uint32_t)hi_lo + lo_hi;
    return a_hi * b_hi + (hi_lo >> 32) + (cross >> 32);
#endif
}

static inline uint16_t dc_fuse_fingerprint(uint64_t x) { return (uint16_t)(x ^ (x >> 32)); }

/* The three slots of mixed hash x (in three consecutive segments). */
static inline void dc_fuse_slots(const dc_fuse_t *f, uint64_t x, uint32_t s[3]) {
    uint64_t h0 = dc_fuse_mulhi(x, f->segment_count_length);
    uint64_t h1 = h0 + f->segment_length;
    uint64_t h2 = h1 + f->segment_length;
    h1 ^= (x >> 18) & f->segment_length_mask;
    h2 ^= x & f->segment_length_mask;
    s[0] = (uint32_t)h0;
    s[1] = (uint32_t)h1;
    s[2] = (uint32_t)h2;
}

static inline uint16_t dc_fuse_load(const unsigned char *fp, uint32_t i) {
    uint16_t v;
    memcpy(&v, fp + (size_t)i * 2, 2);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap16(v);
#endif
    return v;
}

static inline void dc_fuse_store(unsigned char *fp, uint32_t i, uint16_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap16(v);
#endif
    memcpy(fp + (size_t)i * 2, &v, 2);
}

/* ---- queries ------------------------------------------------------------ */

static inline int dc_fuse_contains_mixed(const dc_fuse_t *f, uint64_t x) {
    uint32_t s[3];
    dc_fuse_slots(f, x, s);
    uint16_t v = (uint16_t)(dc_fuse_load(f->fp, s[0]) ^ dc_fuse_load(f->fp, s[1]) ^
                            dc_fuse_load(f->fp, s[2]));
    return v == dc_fuse_fingerprint(x);
}

static inline int dc_fuse_contains(const dc_fuse_t *f, uint64_t h) {
    return dc_fuse_contains_mixed(f, dc_fuse_mix(h, f->seed));
}

static inline void dc_fuse_prefetch(const dc_fuse_t *f, uint64_t x) {
    uint32_t s[3];
    dc_fuse_slots(f, x, s);
    dc_prefetch(f->fp + (size_t)s[0] * 2);
    dc_prefetch(f->fp + (size_t)s[1] * 2);
    dc_prefetch(f->fp + (size_t)s[2] * 2);
}

#ifndef DC_FUSE_PREFETCH
#define DC_FUSE_PREFETCH 16 /* keys ahead whose slots are prefetched; a power of two */
#endif

/* ORs "may contain" into flags[i] for each of n key hashes. The mixed hashes
 * of the keys ahead wait in a small ring so each is computed once. */
static inline void dc_fuse_contains_batch(const dc_fuse_t *f, const uint64_t *__restrict h,
                                          size_t n, unsigned char *__restrict flags) {
    uint64_t ring[DC_FUSE_PREFETCH];
    size_t i, head = n < DC_FUSE_PREFETCH ? n : DC_FUSE_PREFETCH;
    uint64_t seed = f->seed;
    for (i = 0; i < head; i++) {
        ring[i] = dc_fuse_mix(h[i], seed);
        dc_fuse_prefetch(f, ring[i]);
    }
    for (i = 0; i < n; i++) {
        uint64_t x = ring[i & (DC_FUSE_PREFETCH - 1)];
        if (i + DC_FUSE_PREFETCH < n) {
            uint64_t ahead = dc_fuse_mix(h[i + DC_FUSE_PREFETCH], seed);
            ring[i & (DC_FUSE_PREFETCH - 1)] = ahead;
            dc_fuse_prefetch(f, ahead);
        }
        flags[i] |= (unsigned char)dc_fuse_contains_mixed(f, x);
    }
}

/* ---- geometry ----------------------------------------------------------- */

/* Sizes a filter for n distinct keys (the sizing rules of the paper for
 * 3-wise filters: segments grow with n, and the array holds 1.125 n slots
 * from about a million keys up, more below). Returns DC_ETOOBIG when n keys need
 * more than DC_FUSE_MAX_ARRAY_LENGTH slots. The seed is left alone. */
static inline dc_status dc_fuse_geometry(uint64_t n, dc_fuse_t *f) {
    uint64_t sl = 4, capacity = 0, segments;
    if (n > 1) {
        int e = (int)floor(log((double)n) / log(3.33) + 2.25);
        sl = e >= 18 ? DC_FUSE_MAX_SEGMENT_LENGTH : (uint64_t)1 << e;
        double factor = 0.875 + 0.25 * log(1000000.0) / log((double)n);
        if (factor < 1.125) factor = 1.125;
        double c = round((double)n * factor);
        if (c > 2.0 * (double)DC_FUSE_MAX_ARRAY_LENGTH) return DC_ETOOBIG;
        capacity = (uint64_t)c;
    }
    segments = (capacity + sl - 1) / sl; /* all segments, the two last included */
    if (segments < 3) segments = 3;
    if (segments * sl > DC_FUSE_MAX_ARRAY_LENGTH) return DC_ETOOBIG;
    f->segment_length = sl;
    f->segment_length_mask = sl - 1;
    f->segment_count_length = (segments - 2) * sl;
    f->array_length = segments * sl;
    return DC_OK;
}

/* ---- construction ------------------------------------------------------- */

static inline void *dc_fuse_alloc(size_t size) { return dc_alloc_body(size); }
static inline void dc_fuse_free(void *p, size_t size) {
    if (p) dc_free_body(p, size);
}

/* Sorts a[0..n) ascending (LSD radix sort, 8 passes of 8 bits; a pass whose
 * digit is the same for every key is skipped). tmp holds n keys. Returns DC_ENOMEM
 * if its 16 KiB of counters cannot be allocated. */
static inline dc_status dc_fuse_radix_sort(uint64_t *a, uint64_t *tmp, size_t n) {
    size_t (*count)[256] = (size_t (*)[256])calloc(8 * 256, sizeof(size_t));
    uint64_t *src = a, *dst = tmp;
    size_t i;
    int pass;
    if (count == NULL) return DC_ENOMEM;
    for (i = 0; i < n; i++) {
        uint64_t v = a[i];
        for (pass = 0; pass < 8; pass++) count[pass][(v >> (8 * pass)) & 0xFF]++;
    }
    for (pass = 0; pass < 8; pass++) {
        size_t *c = count[pass], sum = 0, off[256];
        int shift = 8 * pass;
        if (c[(src[0] >> shift) & 0xFF] == n) continue;
        for (int d = 0; d < 256; d++) { off[d] = sum; sum += c[d]; }
        for (i = 0; i < n; i++) {
            uint64_t v = src[i];
            dst[off[(v >> shift) & 0xFF]++] = v;
        }
        uint64_t *t = src; src = dst; dst = t;
    }
    if (src != a) memcpy(a, src, n * sizeof(uint64_t));
    free(count);
    return DC_OK;
}

/* Removes adjacent duplicates from a sorted a[0..n); returns the new length. */
static inline size_t dc_fuse_unique(uint64_t *a, size_t n) {
    size_t i, m = n ? 1 : 0;
    for (i = 1; i < n; i++)
        if (a[i] != a[m - 1]) a[m++] = a[i];
    return m;
}

/* Working memory of one construction. */
typedef struct {
    uint64_t *keys;     /* the distinct key hashes, sorted (m) */
    uint64_t *order;    /* mixed hashes grouped by segment, then the peel stack (n) */
    uint64_t *t2hash;   /* per slot: XOR of the mixed hashes of its keys */
    uint8_t *t2count;   /* per slot: keys << 2 | XOR of their positions (0, 1, 2) */
    uint32_t *alone;    /* slots holding one key, waiting to be peeled */
    uint8_t *revh;      /* per stack entry: the position of its slot */
    size_t *buckets;    /* per segment group: start in order */
    size_t n, m, slots, nbuckets;
} dc_fuse_work_t;

static inline void dc_fuse_work_free(dc_fuse_work_t *w) {
    dc_fuse_free(w->keys, w->n * 8);
    dc_fuse_free(w->order, w->n * 8);
    dc_fuse_free(w->t2hash, w->slots * 8);
    dc_fuse_free(w->t2count, w->slots);
    dc_fuse_free(w->alone, w->slots * 4);
    dc_fuse_free(w->revh, w->m);
    free(w->buckets);
}

#ifndef DC_FUSE_BUILD_PREFETCH
#define DC_FUSE_BUILD_PREFETCH 8 /* keys ahead whose table slots are prefetched */
#endif

/* One attempt with f->seed: 1 if every key peeled (then order[0..m) is the
 * stack and revh the positions), 0 if not. The tables must be zero on entry. */
static inline int dc_fuse_attempt(dc_fuse_work_t *w, const dc_fuse_t *f, int bits) {
    size_t i, m = w->m, slots = w->slots, nb = w->nbuckets, qsize = 0, stack = 0;
    uint64_t *order = w->order, *t2hash = w->t2hash;
    uint8_t *t2count = w->t2count, *revh = w->revh;
    uint32_t *alone = w->alone;
    size_t *start = w->buckets;
    uint64_t seed = f->seed;
    int error = 0;

    /* Group the mixed hashes by their top bits (a counting sort), so that
     * adding them walks the table segment by segment. */
    memset(start, 0, (nb + 1) * sizeof(size_t));
    if (bits > 0) {
        for (i = 0; i < m; i++) start[(dc_fuse_mix(w->keys[i], seed) >> (64 - bits)) + 1]++;
        for (i = 1; i <= nb; i++) start[i] += start[i - 1];
        for (i = 0; i < m; i++) {
            uint64_t x = dc_fuse_mix(w->keys[i], seed);
            order[start[x >> (64 - bits)]++] = x;
        }
    } else {
        for (i = 0; i < m; i++) order[i] = dc_fuse_mix(w->keys[i], seed);
    }

    for (i = 0; i < m; i++) {
        uint64_t x = order[i];
        uint32_t s[3];
        if (i + DC_FUSE_BUILD_PREFETCH < m) {
            dc_fuse_slots(f, order[i + DC_FUSE_BUILD_PREFETCH], s);
            dc_prefetch_w(t2hash + s[0]);
            dc_prefetch_w(t2hash + s[1]);
            dc_prefetch_w(t2hash + s[2]);
            dc_prefetch_w(t2count + s[1]);
            dc_prefetch_w(t2count + s[2]);
        }
        dc_fuse_slots(f, x, s);
        t2count[s[0]] += 4;
        t2hash[s[0]] ^= x;
        t2count[s[1]] += 4;
        t2count[s[1]] ^= 1;
        t2hash[s[1]] ^= x;
        t2count[s[2]] += 4;
        t2count[s[2]] ^= 2;
        t2hash[s[2]] ^= x;
        /* 64 keys in one slot wrap its count: give up on this seed. */
        error |= (t2count[s[0]] < 4) | (t2count[s[1]] < 4) | (t2count[s[2]] < 4);
    }
    if (error) return 0;

    for (i = 0; i < slots; i++)
        if ((t2count[i] >> 2) == 1) alone[qsize++] = (uint32_t)i;
    while (qsize > 0) {
        uint32_t idx = alone[--qsize];
        if ((t2count[idx] >> 2) != 1) continue; /* emptied since it was queued */
        uint64_t x = t2hash[idx];
        uint8_t found = t2count[idx] & 3;
        uint32_t s[5];
        dc_fuse_slots(f, x, s);
        s[3] = s[0];
        s[4] = s[1];
        revh[stack] = found;
        order[stack] = x; /* overwrites only hashes already added */
        stack++;
        for (int k = 1; k <= 2; k++) {
            uint32_t o = s[found + k];
            if ((t2count[o] >> 2) == 2) alone[qsize++] = o; /* about to hold one */
            t2count[o] -= 4;
            t2count[o] ^= (uint8_t)((found + k) % 3);
            t2hash[o] ^= x;
        }
    }
    return stack == m;
}

/* Builds a filter from n key hashes (duplicates allowed). Its geometry is
 * like's (a filter of the stack it is to join, below) when like is not NULL,
 * has the segment length the keys' own geometry has and at least as many
 * slots; else the keys' own. On DC_OK, f describes the filter, *body is its
 * array_length * 2 bytes (free with dc_fuse_free(*body, array_length * 2))
 * and *count the distinct keys. The result depends only on the set of keys,
 * like's geometry and seed. */
static inline dc_status dc_fuse_build(const void *hashes, size_t n, uint64_t seed,
                                      const dc_fuse_t *like, dc_fuse_t *f, unsigned char **body,
                                      uint64_t *count) {
    dc_fuse_work_t w;
    unsigned char *fp = NULL;
    uint64_t state = seed;
    int bits = 0, attempt;
    size_t i, segment_count;

    memset(&w, 0, sizeof(w));
    memset(f, 0, sizeof(*f));
    *body = NULL;
    *count = 0;
    w.n = n;
    if (n > 0) {
        if (n > SIZE_MAX / 8) return DC_ENOMEM;
        w.keys = (uint64_t *)dc_fuse_alloc(n * 8);
        w.order = (uint64_t *)dc_fuse_alloc(n * 8);
        if (w.keys == NULL || w.order == NULL) goto nomem;
        memcpy(w.keys, hashes, n * 8);
        if (dc_fuse_radix_sort(w.keys, w.order, n) != DC_OK) goto nomem;
        w.m = dc_fuse_unique(w.keys, n);
    }
    if (dc_fuse_geometry(w.m, f) != DC_OK) {
        dc_fuse_work_free(&w);
        return DC_ETOOBIG;
    }
    if (like != NULL && like->segment_length == f->segment_length &&
        like->array_length >= f->array_length && like->array_length <= DC_FUSE_MAX_ARRAY_LENGTH &&
        like->segment_count_length + 2 * like->segment_length == like->array_length) {
        f->segment_count_length = like->segment_count_length;
        f->array_length = like->array_length;
    }
    f->seed = dc_fuse_splitmix(&state);
    fp = (unsigned char *)dc_fuse_alloc(f->array_length * 2);
    if (fp == NULL) goto nomem;
    f->fp = fp;
    if (w.m == 0) { /* nothing to hold: an all-zero body (the caller answers False) */
        dc_fuse_work_free(&w);
        *body = fp;
        return DC_OK;
    }

    w.slots = f->array_length;
    segment_count = f->segment_count_length / f->segment_length;
    while (((size_t)1 << bits) < segment_count) bits++;
    w.nbuckets = (size_t)1 << bits;
    w.t2hash = (uint64_t *)dc_fuse_alloc(w.slots * 8);
    w.t2count = (uint8_t *)dc_fuse_alloc(w.slots);
    w.alone = (uint32_t *)dc_fuse_alloc(w.slots * 4);
    w.revh = (uint8_t *)dc_fuse_alloc(w.m);
    w.buckets = (size_t *)malloc((w.nbuckets + 1) * sizeof(size_t));
    if (!w.t2hash || !w.t2count || !w.alone || !w.revh || !w.buckets) goto nomem;

    for (attempt = 0;; attempt++) {
        if (dc_fuse_attempt(&w, f, bits)) break;
        if (attempt + 1 >= DC_FUSE_MAX_ATTEMPTS) {
            dc_fuse_work_free(&w);
            dc_fuse_free(fp, f->array_length * 2);
            return DC_EBUILD;
        }
        f->seed = dc_fuse_splitmix(&state);
        memset(w.t2count, 0, w.slots); /* fresh allocations start zeroed */
        memset(w.t2hash, 0, w.slots * 8);
    }

    /* Assign fingerprints in reverse peel order: each key's own slot is the
     * last of its three to be written. */
    for (i = w.m; i-- > 0;) {
        uint64_t x = w.order[i];
        uint32_t s[5];
        uint8_t found = w.revh[i];
        dc_fuse_slots(f, x, s);
        s[3] = s[0];
        s[4] = s[1];
        dc_fuse_store(fp, s[found],
                      (uint16_t)(dc_fuse_fingerprint(x) ^ dc_fuse_load(fp, s[found + 1]) ^
                                 dc_fuse_load(fp, s[found + 2])));
    }
    *count = w.m;
    *body = fp;
    dc_fuse_work_free(&w);
    return DC_OK;

nomem:
    dc_fuse_work_free(&w);
    if (fp) dc_fuse_free(fp, f->array_length * 2);
    return DC_ENOMEM;
}

/* ---- stacks ------------------------------------------------------------- */

/* Filters that share one seed and one geometry, their fingerprints side by
 * side: slot i of column c is fp[i * width + c]. A key's three slots are the
 * same in every column, so one probe of the stack makes three random reads
 * whatever its width, where separate filters make three each (docs/warm-tier.md,
 * "Stacked fuse slices"). A column answers only while its bit is in live. */
#define DC_FUSE_STACK_MAX_WIDTH 32u

typedef struct {
    dc_fuse_t geo;    /* the shared seed and geometry; geo.fp is unused */
    uint32_t width;   /* columns per slot, 1 .. DC_FUSE_STACK_MAX_WIDTH */
    uint32_t live;    /* bit c set: column c holds a filter */
    uint16_t *fp;     /* array_length * width native-order fingerprints */
} dc_fuse_stack_t;

/* Copies filter f (of the stack's geometry) into column c. */
static inline void dc_fuse_stack_put(dc_fuse_stack_t *st, uint32_t c, const dc_fuse_t *f) {
    uint64_t i, n = st->geo.array_length, w = st->width;
    uint16_t *dst = st->fp + c;
    for (i = 0; i < n; i++) dst[i * w] = dc_fuse_load(f->fp, (uint32_t)i);
}

/* Copies the columns of src into the first src->width columns of dst (same
 * geometry, dst at least as wide). */
static inline void dc_fuse_stack_copy(dc_fuse_stack_t *dst, const dc_fuse_stack_t *src) {
    uint64_t i, n = src->geo.array_length;
    size_t row = (size_t)src->width * 2;
    for (i = 0; i < n; i++) memcpy(dst->fp + i * dst->width, src->fp + i * src->width, row);
}

static inline void dc_fuse_stack_prefetch(const dc_fuse_stack_t *st, uint64_t x) {
    uint32_t s[3];
    dc_fuse_slots(&st->geo, x, s);
    dc_prefetch(st->fp + (size_t)s[0] * st->width);
    dc_prefetch(st->fp + (size_t)s[1] * st->width);
    dc_prefetch(st->fp + (size_t)s[2] * st->width);
}

/* Bytes of a stack's body: its rows, and 32 more so that any row can be read
 * in whole 16-byte groups of eight lanes. */
static inline size_t dc_fuse_stack_bytes(uint64_t array_length, uint32_t width) {
    return (size_t)(array_length * width * 2) + 32;
}

/* Up to DC_FUSE_STACK_MAX_WIDTH columns a row is compared eight lanes at a
 * time with the compiler's vector types (GCC and Clang: SSE2 on x86-64, NEON
 * on AArch64): the lanes past the row (the next row's, or the body's padding)
 * are masked. Without them, and built with -DDC_FUSE_NO_SIMD (the tests
 * build both), a loop over the columns: 2.7 times slower out of cache at
 * eight columns (docs/warm-tier.md, "Stacked fuse slices"). */
#if (defined(__GNUC__) || defined(__clang__)) && !defined(DC_FUSE_NO_SIMD)
#define DC_FUSE_STACK_VECTORS 1
typedef uint16_t dc_u16x8 __attribute__((vector_size(16)));
typedef uint64_t dc_u64x2 __attribute__((vector_size(16)));

/* The live columns as lane masks: lane j of group g is all ones when column
 * 8g + j is live. */
typedef struct {
    dc_u16x8 group[DC_FUSE_STACK_MAX_WIDTH / 8];
    uint32_t groups; /* groups a row spans: ceil(width / 8) */
} dc_fuse_lanes_t;

static inline dc_fuse_lanes_t dc_fuse_stack_lanes(const dc_fuse_stack_t *st) {
    const dc_u16x8 bit = {1, 2, 4, 8, 16, 32, 64, 128};
    dc_fuse_lanes_t l;
    uint32_t g;
    l.groups = (st->width + 7) / 8;
    for (g = 0; g < DC_FUSE_STACK_MAX_WIDTH / 8; g++) {
        dc_u16x8 byte = {0};
        byte += (uint16_t)((st->live >> (8 * g)) & 0xFFu);
        l.group[g] = (dc_u16x8)((byte & bit) != 0);
    }
    return l;
}

/* Eight lanes of three rows XORed (16 unaligned bytes from each). */
static inline dc_u16x8 dc_fuse_row8(const uint16_t *a, const uint16_t *b, const uint16_t *d) {
    dc_u16x8 x, y, z;
    memcpy(&x, a, 16);
    memcpy(&y, b, 16);
    memcpy(&z, d, 16);
    return x ^ y ^ z;
}
#else
typedef struct {
    uint32_t live;
} dc_fuse_lanes_t;

static inline dc_fuse_lanes_t dc_fuse_stack_lanes(const dc_fuse_stack_t *st) {
    dc_fuse_lanes_t l;
    l.live = st->live;
    return l;
}
#endif

/* Whether some live column may hold mixed hash x (lanes: dc_fuse_stack_lanes
 * of the stack). */
static inline int dc_fuse_stack_match(const dc_fuse_stack_t *st, uint64_t x,
                                      const dc_fuse_lanes_t *lanes) {
    uint32_t s[3], w = st->width;
    uint16_t want = dc_fuse_fingerprint(x);
    dc_fuse_slots(&st->geo, x, s);
    const uint16_t *a = st->fp + (size_t)s[0] * w, *b = st->fp + (size_t)s[1] * w,
                   *d = st->fp + (size_t)s[2] * w;
#ifdef DC_FUSE_STACK_VECTORS
    dc_u16x8 key = {0}, hit;
    dc_u64x2 wide;
    uint32_t g;
    key += want;
    hit = (dc_u16x8)(dc_fuse_row8(a, b, d) == key) & lanes->group[0];
    for (g = 1; g < lanes->groups; g++)
        hit |= (dc_u16x8)(dc_fuse_row8(a + 8 * g, b + 8 * g, d + 8 * g) == key) & lanes->group[g];
    memcpy(&wide, &hit, 16);
    return (wide[0] | wide[1]) != 0;
#else
    uint32_t c, match = 0;
    for (c = 0; c < w; c++) match |= (uint32_t)((uint16_t)(a[c] ^ b[c] ^ d[c]) == want) << c;
    return (match & lanes->live) != 0;
#endif
}

/* Whether some live column of the stack may hold mixed hash x. */
static inline int dc_fuse_stack_contains_mixed(const dc_fuse_stack_t *st, uint64_t x) {
    dc_fuse_lanes_t lanes = dc_fuse_stack_lanes(st);
    return dc_fuse_stack_match(st, x, &lanes);
}

/* ORs "may contain" into flags[i] for each of n key hashes (as
 * dc_fuse_contains_batch, over every live column at once). */
static inline void dc_fuse_stack_contains_batch(const dc_fuse_stack_t *st,
                                                const uint64_t *__restrict h, size_t n,
                                                unsigned char *__restrict flags) {
    uint64_t ring[DC_FUSE_PREFETCH];
    size_t i, head = n < DC_FUSE_PREFETCH ? n : DC_FUSE_PREFETCH;
    uint64_t seed = st->geo.seed;
    dc_fuse_lanes_t lanes = dc_fuse_stack_lanes(st);
    if (st->live == 0) return;
    for (i = 0; i < head; i++) {
        ring[i] = dc_fuse_mix(h[i], seed);
        dc_fuse_stack_prefetch(st, ring[i]);
    }
    for (i = 0; i < n; i++) {
        uint64_t x = ring[i & (DC_FUSE_PREFETCH - 1)];
        if (i + DC_FUSE_PREFETCH < n) {
            uint64_t ahead = dc_fuse_mix(h[i + DC_FUSE_PREFETCH], seed);
            ring[i & (DC_FUSE_PREFETCH - 1)] = ahead;
            dc_fuse_stack_prefetch(st, ahead);
        }
        flags[i] |= (unsigned char)dc_fuse_stack_match(st, x, &lanes);
    }
}

#endif /* DC_FUSE_H */
