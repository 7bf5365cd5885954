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
 * pure-Python reference model share one definition of the layout; and the
 * order of 16-byte digests (dc_digest_cmp) that the warm tier's lookups and
 * the claim engine share.
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

/* The steps of XXH64 that both functions below take: the four lanes of a
 * stripe of 32 bytes and their convergence, the steps over the last 8-, 4-
 * and 1-byte words (each mixes in a word's value k, as each step computes
 * it), and the final avalanche. */
static inline void dc_xxh64_lanes_init(uint64_t v[4], uint64_t seed) {
    v[0] = seed + DC_P64_1 + DC_P64_2;
    v[1] = seed + DC_P64_2;
    v[2] = seed;
    v[3] = seed - DC_P64_1;
}

static inline uint64_t dc_xxh64_lanes_end(const uint64_t v[4]) {
    uint64_t h = dc_rotl64(v[0], 1) + dc_rotl64(v[1], 7) + dc_rotl64(v[2], 12) +
                 dc_rotl64(v[3], 18);
    h = dc_xxh64_merge(h, v[0]);
    h = dc_xxh64_merge(h, v[1]);
    h = dc_xxh64_merge(h, v[2]);
    return dc_xxh64_merge(h, v[3]);
}

static inline uint64_t dc_xxh64_step8(uint64_t h, uint64_t k) {
    return dc_rotl64(h ^ k, 27) * DC_P64_1 + DC_P64_4;
}

static inline uint64_t dc_xxh64_step4(uint64_t h, uint64_t k) {
    return dc_rotl64(h ^ k, 23) * DC_P64_2 + DC_P64_3;
}

static inline uint64_t dc_xxh64_step1(uint64_t h, uint64_t k) {
    return dc_rotl64(h ^ k, 11) * DC_P64_1;
}

static inline uint64_t dc_xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= DC_P64_2;
    h ^= h >> 29;
    h *= DC_P64_3;
    return h ^ (h >> 32);
}

/* XXH64 of len bytes at p with the given seed. */
static inline uint64_t dc_xxh64(const void *data, size_t len, uint64_t seed) {
    const unsigned char *p = (const unsigned char *)data;
    const unsigned char *end = p + len;
    uint64_t h;

    if (len >= 32) {
        const unsigned char *limit = end - 32;
        uint64_t v[4];
        dc_xxh64_lanes_init(v, seed);
        do {
            for (int i = 0; i < 4; i++) v[i] = dc_xxh64_round(v[i], dc_read64(p + 8 * i));
            p += 32;
        } while (p <= limit);
        h = dc_xxh64_lanes_end(v);
    } else {
        h = seed + DC_P64_5;
    }
    h += (uint64_t)len;

    for (; p + 8 <= end; p += 8) h = dc_xxh64_step8(h, dc_xxh64_round(0, dc_read64(p)));
    if (p + 4 <= end) {
        h = dc_xxh64_step4(h, (uint64_t)dc_read32(p) * DC_P64_1);
        p += 4;
    }
    for (; p < end; p++) h = dc_xxh64_step1(h, (uint64_t)(*p) * DC_P64_5);
    return dc_xxh64_avalanche(h);
}

/* The XXH64 of len bytes at p with two seeds at once: *a = dc_xxh64(p, len,
 * seed_a), *b = dc_xxh64(p, len, seed_b). The two chains are independent and
 * step by step side by side, so the processor runs them together: a record
 * digest (two hashes of one short key) takes little more than one hash. */
static inline void dc_xxh64_pair(const void *data, size_t len, uint64_t seed_a, uint64_t seed_b,
                                 uint64_t *a, uint64_t *b) {
    const unsigned char *p = (const unsigned char *)data;
    const unsigned char *end = p + len;
    uint64_t ha, hb;

    if (len >= 32) {
        const unsigned char *limit = end - 32;
        uint64_t va[4], vb[4];
        dc_xxh64_lanes_init(va, seed_a);
        dc_xxh64_lanes_init(vb, seed_b);
        do {
            for (int i = 0; i < 4; i++) {
                uint64_t w = dc_read64(p + 8 * i);
                va[i] = dc_xxh64_round(va[i], w);
                vb[i] = dc_xxh64_round(vb[i], w);
            }
            p += 32;
        } while (p <= limit);
        ha = dc_xxh64_lanes_end(va);
        hb = dc_xxh64_lanes_end(vb);
    } else {
        ha = seed_a + DC_P64_5;
        hb = seed_b + DC_P64_5;
    }
    ha += (uint64_t)len;
    hb += (uint64_t)len;

    for (; p + 8 <= end; p += 8) {
        uint64_t k = dc_xxh64_round(0, dc_read64(p));
        ha = dc_xxh64_step8(ha, k);
        hb = dc_xxh64_step8(hb, k);
    }
    if (p + 4 <= end) {
        uint64_t k = (uint64_t)dc_read32(p) * DC_P64_1;
        ha = dc_xxh64_step4(ha, k);
        hb = dc_xxh64_step4(hb, k);
        p += 4;
    }
    for (; p < end; p++) {
        uint64_t k = (uint64_t)(*p) * DC_P64_5;
        ha = dc_xxh64_step1(ha, k);
        hb = dc_xxh64_step1(hb, k);
    }
    *a = dc_xxh64_avalanche(ha);
    *b = dc_xxh64_avalanche(hb);
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

/* A digest's first 8 bytes as a big-endian number: ordered as the digests
 * are by their first 8 bytes, and where a digest falls among evenly spread
 * ones. */
static inline uint64_t dc_digest_top(const unsigned char *d) {
    uint64_t v = 0;
    for (int k = 0; k < 8; k++) v = v << 8 | d[k];
    return v;
}

/* memcmp(a, b, 16) of two 16-byte digests, as two big-endian words without a
 * call where the compiler has the byte swap: the digest order of the warm
 * tier's lookups (LMDB's key order) and of the claim engine's records read
 * for a claim, searched a dozen compares a key. */
static inline int dc_digest_cmp(const unsigned char *a, const unsigned char *b) {
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t x, y;
    memcpy(&x, a, 8);
    memcpy(&y, b, 8);
    if (x == y) {
        memcpy(&x, a + 8, 8);
        memcpy(&y, b + 8, 8);
    }
    x = __builtin_bswap64(x);
    y = __builtin_bswap64(y);
    return (x > y) - (x < y);
#else
    return memcmp(a, b, 16);
#endif
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
