/*
 * dc_hash.h - the stable hashes of dedupcore's native core.
 *
 * XXH64 is written here from the published xxHash specification
 * (doc/xxhash_spec.md, "XXH64 algorithm description"). It is part of the
 * on-disk format of every filter dedupcore saves, so it must never change:
 * a change needs a new hash-algorithm id in the file header.
 *
 * Also here: the split-block filter's probe arithmetic and jump consistent
 * hashing (Lamping & Veach, 2014), so the Cython loops and the tests'
 * pure-Python reference model share one definition of the layout.
 */
#ifndef DC_HASH_H
#define DC_HASH_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>

#include "dc_status.h"

#define DC_P64_1 0x9E3779B185EBCA87ULL
#define DC_P64_2 0xC2B2AE3D27D4EB4FULL
#define DC_P64_3 0x165667B19E3779F9ULL
#define DC_P64_4 0x85EBCA77C2B2AE63ULL
#define DC_P64_5 0x27D4EB2F165667C5ULL

static inline uint64_t dc_rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t dc_read64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint32_t dc_read32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline uint64_t dc_xxh64_round(uint64_t acc, uint64_t input) {
    acc += input * DC_P64_2;
    acc = dc_rotl64(acc, 31);
    return acc * DC_P64_1;
}

static inline uint64_t dc_xxh64_merge(uint64_t acc, uint64_t val) {
    acc ^= dc_xxh64_round(0, val);
    return acc * DC_P64_1 + DC_P64_4;
}

/* XXH64 of len bytes at p with the given seed. */
static inline uint64_t dc_xxh64(const void *data, size_t len, uint64_t seed) {
    const unsigned char *p = (const unsigned char *)data;
    const unsigned char *end = p + len;
    uint64_t h;

    if (len >= 32) {
        const unsigned char *limit = end - 32;
        uint64_t v1 = seed + DC_P64_1 + DC_P64_2;
        uint64_t v2 = seed + DC_P64_2;
        uint64_t v3 = seed;
        uint64_t v4 = seed - DC_P64_1;
        do {
            v1 = dc_xxh64_round(v1, dc_read64(p));
            v2 = dc_xxh64_round(v2, dc_read64(p + 8));
            v3 = dc_xxh64_round(v3, dc_read64(p + 16));
            v4 = dc_xxh64_round(v4, dc_read64(p + 24));
            p += 32;
        } while (p <= limit);
        h = dc_rotl64(v1, 1) + dc_rotl64(v2, 7) + dc_rotl64(v3, 12) + dc_rotl64(v4, 18);
        h = dc_xxh64_merge(h, v1);
        h = dc_xxh64_merge(h, v2);
        h = dc_xxh64_merge(h, v3);
        h = dc_xxh64_merge(h, v4);
    } else {
        h = seed + DC_P64_5;
    }
    h += (uint64_t)len;

    while (p + 8 <= end) {
        h ^= dc_xxh64_round(0, dc_read64(p));
        h = dc_rotl64(h, 27) * DC_P64_1 + DC_P64_4;
        p += 8;
    }
    if (p + 4 <= end) {
        h ^= (uint64_t)dc_read32(p) * DC_P64_1;
        h = dc_rotl64(h, 23) * DC_P64_2 + DC_P64_3;
        p += 4;
    }
    while (p < end) {
        h ^= (uint64_t)(*p) * DC_P64_5;
        h = dc_rotl64(h, 11) * DC_P64_1;
        p++;
    }
    h ^= h >> 33;
    h *= DC_P64_2;
    h ^= h >> 29;
    h *= DC_P64_3;
    h ^= h >> 32;
    return h;
}

/* The XXH64 of len bytes at p with two seeds at once: *a = dc_xxh64(p, len,
 * seed_a), *b = dc_xxh64(p, len, seed_b). The two chains are independent, so
 * the processor runs them side by side: a record digest (two hashes of one
 * short key) takes little more than one hash. */
static inline void dc_xxh64_pair(const void *data, size_t len, uint64_t seed_a, uint64_t seed_b,
                                 uint64_t *a, uint64_t *b) {
    const unsigned char *p = (const unsigned char *)data;
    const unsigned char *end = p + len;
    uint64_t ha, hb;

    if (len >= 32) {
        const unsigned char *limit = end - 32;
        uint64_t a1 = seed_a + DC_P64_1 + DC_P64_2, b1 = seed_b + DC_P64_1 + DC_P64_2;
        uint64_t a2 = seed_a + DC_P64_2, b2 = seed_b + DC_P64_2;
        uint64_t a3 = seed_a, b3 = seed_b;
        uint64_t a4 = seed_a - DC_P64_1, b4 = seed_b - DC_P64_1;
        do {
            uint64_t w1 = dc_read64(p), w2 = dc_read64(p + 8);
            uint64_t w3 = dc_read64(p + 16), w4 = dc_read64(p + 24);
            a1 = dc_xxh64_round(a1, w1);
            b1 = dc_xxh64_round(b1, w1);
            a2 = dc_xxh64_round(a2, w2);
            b2 = dc_xxh64_round(b2, w2);
            a3 = dc_xxh64_round(a3, w3);
            b3 = dc_xxh64_round(b3, w3);
            a4 = dc_xxh64_round(a4, w4);
            b4 = dc_xxh64_round(b4, w4);
            p += 32;
        } while (p <= limit);
        ha = dc_rotl64(a1, 1) + dc_rotl64(a2, 7) + dc_rotl64(a3, 12) + dc_rotl64(a4, 18);
        hb = dc_rotl64(b1, 1) + dc_rotl64(b2, 7) + dc_rotl64(b3, 12) + dc_rotl64(b4, 18);
        ha = dc_xxh64_merge(ha, a1);
        hb = dc_xxh64_merge(hb, b1);
        ha = dc_xxh64_merge(ha, a2);
        hb = dc_xxh64_merge(hb, b2);
        ha = dc_xxh64_merge(ha, a3);
        hb = dc_xxh64_merge(hb, b3);
        ha = dc_xxh64_merge(ha, a4);
        hb = dc_xxh64_merge(hb, b4);
    } else {
        ha = seed_a + DC_P64_5;
        hb = seed_b + DC_P64_5;
    }
    ha += (uint64_t)len;
    hb += (uint64_t)len;

    while (p + 8 <= end) {
        uint64_t k = dc_xxh64_round(0, dc_read64(p));
        ha = dc_rotl64(ha ^ k, 27) * DC_P64_1 + DC_P64_4;
        hb = dc_rotl64(hb ^ k, 27) * DC_P64_1 + DC_P64_4;
        p += 8;
    }
    if (p + 4 <= end) {
        uint64_t k = (uint64_t)dc_read32(p) * DC_P64_1;
        ha = dc_rotl64(ha ^ k, 23) * DC_P64_2 + DC_P64_3;
        hb = dc_rotl64(hb ^ k, 23) * DC_P64_2 + DC_P64_3;
        p += 4;
    }
    while (p < end) {
        uint64_t k = (uint64_t)(*p) * DC_P64_5;
        ha = dc_rotl64(ha ^ k, 11) * DC_P64_1;
        hb = dc_rotl64(hb ^ k, 11) * DC_P64_1;
        p++;
    }
    ha ^= ha >> 33;
    hb ^= hb >> 33;
    ha *= DC_P64_2;
    hb *= DC_P64_2;
    ha ^= ha >> 29;
    hb ^= hb >> 29;
    ha *= DC_P64_3;
    hb *= DC_P64_3;
    ha ^= ha >> 32;
    hb ^= hb >> 32;
    *a = ha;
    *b = hb;
}

/*
 * Split-block Bloom filter layout (format version 1).
 *
 * A filter is nblocks blocks of 64 bytes (one cache line), each 8 lanes of
 * 64 bits. A key's 64-bit hash h picks one block by multiply-shift of its
 * high 32 bits (uniform over any nblocks, unlike a power-of-two mask) and
 * sets one bit in every lane: lane i gets bit ((uint32)h * SALT[i]) >> 26.
 * The salts are the odd constants of the Parquet split-block filter spec.
 */
static const uint32_t DC_SALT[8] = {
    0x47b6137bU, 0x44974d91U, 0x8824ad5bU, 0xa2b7289dU,
    0x705495c7U, 0x2df1424bU, 0x9efc4947U, 0x5c6bfb31U,
};

#define DC_LANES 8
#define DC_BLOCK_BYTES 64

static inline uint64_t dc_block_index(uint64_t h, uint64_t nblocks) {
    return ((h >> 32) * nblocks) >> 32;
}

/* Sets the key's bits; returns 1 if any bit was clear (the key was new). */
static inline int dc_block_add(uint64_t *block, uint64_t h) {
    uint32_t lo = (uint32_t)h;
    uint64_t missing = 0;
    for (int i = 0; i < DC_LANES; i++) {
        uint64_t mask = 1ULL << ((uint32_t)(lo * DC_SALT[i]) >> 26);
        missing |= mask & ~block[i];
        block[i] |= mask;
    }
    return missing != 0;
}

static inline int dc_block_contains(const uint64_t *block, uint64_t h) {
    uint32_t lo = (uint32_t)h;
    uint64_t missing = 0;
    for (int i = 0; i < DC_LANES; i++) {
        uint64_t mask = 1ULL << ((uint32_t)(lo * DC_SALT[i]) >> 26);
        missing |= mask & ~block[i];
    }
    return missing == 0;
}

static inline void dc_prefetch(const void *p) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p, 0, 3);
#endif
}

static inline void dc_prefetch_w(const void *p) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(p, 1, 3);
#endif
}

/* Jump consistent hash (Lamping & Veach, "A Fast, Minimal Memory, Consistent
 * Hash Algorithm", 2014), exactly as published. */
static inline int32_t dc_jump(uint64_t key, int32_t num_buckets) {
    int64_t b = -1, j = 0;
    while (j < num_buckets) {
        b = j;
        key = key * 2862933555777941757ULL + 1;
        j = (int64_t)((double)(b + 1) * ((double)(1LL << 31) / (double)((key >> 33) + 1)));
    }
    return (int32_t)b;
}

static inline int dc_popcount64(uint64_t x) {
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_popcountll(x);
#else
    int c = 0;
    while (x) { x &= x - 1; c++; }
    return c;
#endif
}

/* ---- memory for filter bodies ------------------------------------------ */
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
/* Zeroed, page-aligned memory for a filter body. Anonymous mappings are
 * zero-filled lazily by the kernel, so a large, mostly empty filter costs
 * only the pages it touches; large bodies ask for transparent huge pages,
 * which removes most TLB misses from random probes. */
static inline void *dc_alloc_body(size_t size) {
    if (size == 0) size = DC_BLOCK_BYTES;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    if (size >= (2u << 20)) madvise(p, size, MADV_HUGEPAGE);
#endif
    return p;
}
static inline void dc_free_body(void *p, size_t size) {
    if (p) munmap(p, size == 0 ? DC_BLOCK_BYTES : size);
}
#else
#include <stdlib.h>
static inline void *dc_alloc_body(size_t size) {
    void *p = NULL;
    if (size == 0) size = DC_BLOCK_BYTES;
    p = _aligned_malloc(size, DC_BLOCK_BYTES);
    if (p) memset(p, 0, size);
    return p;
}
static inline void dc_free_body(void *p, size_t size) { (void)size; _aligned_free(p); }
#endif

/* ---- batch probes ----------------------------------------------------------
 * The loops the Cython layer runs without the GIL. Blocks are prefetched
 * DC_PREFETCH keys ahead so that the memory latency of one probe overlaps the
 * work on the next; restrict lets the compiler keep hashes in registers
 * across the block writes. */
#ifndef DC_PREFETCH
#define DC_PREFETCH 16
#endif

/* ORs "may contain" into flags[i] for each of n hashes. */
static inline void dc_contains_batch(const uint64_t *__restrict blocks, uint64_t nblocks,
                                     const uint64_t *__restrict h, size_t n,
                                     unsigned char *__restrict flags) {
    size_t i;
    size_t head = n < DC_PREFETCH ? n : DC_PREFETCH;
    for (i = 0; i < head; i++) dc_prefetch(blocks + dc_block_index(h[i], nblocks) * 8);
    for (i = 0; i < n; i++) {
        if (i + DC_PREFETCH < n)
            dc_prefetch(blocks + dc_block_index(h[i + DC_PREFETCH], nblocks) * 8);
        uint64_t x = h[i];
        flags[i] |= (unsigned char)dc_block_contains(blocks + dc_block_index(x, nblocks) * 8, x);
    }
}

/* Adds n hashes. On entry flags[i] says "present in another filter"; on exit
 * it says "was new" (absent everywhere before). Returns how many keys set a
 * new bit in this filter (its count increment). */
static inline uint64_t dc_add_batch(uint64_t *__restrict blocks, uint64_t nblocks,
                                    const uint64_t *__restrict h, size_t n,
                                    unsigned char *__restrict flags) {
    size_t i;
    uint64_t added = 0;
    size_t head = n < DC_PREFETCH ? n : DC_PREFETCH;
    for (i = 0; i < head; i++) dc_prefetch_w(blocks + dc_block_index(h[i], nblocks) * 8);
    for (i = 0; i < n; i++) {
        if (i + DC_PREFETCH < n)
            dc_prefetch_w(blocks + dc_block_index(h[i + DC_PREFETCH], nblocks) * 8);
        uint64_t x = h[i];
        int new_bits = dc_block_add(blocks + dc_block_index(x, nblocks) * 8, x);
        added += (uint64_t)new_bits;
        flags[i] = (unsigned char)(new_bits & !flags[i]);
    }
    return added;
}

#endif /* DC_HASH_H */
