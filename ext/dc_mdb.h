/*
 * dc_mdb.h - point lookups in an LMDB data file's B-tree, read straight from
 * a read-only mapping of data.mdb, without LMDB's library and without the GIL
 * (docs/warm-tier.md, "Lookups in native code").
 *
 * The warm tier's batch reads cost about 1.1 us a key through py-lmdb's
 * getmulti, most of it the Python objects and calls around each lookup. This
 * header walks the same pages LMDB would: from a database's root (its MDB_db
 * record in the main database, read through py-lmdb in the read transaction
 * that pins the snapshot, so no page reachable from that root is reused while
 * the walk runs) down the branch pages to the leaf, by binary search with
 * LMDB's default key order (memcmp, then the shorter key first).
 *
 * It reads the on-disk format of LMDB 0.9 (data version 1) on a 64-bit host:
 *   page:  pgno (8) | pad (2) | flags (2) | lower (2) | upper (2) | ptrs[] ...
 *          an overflow page has its page count (4) in place of lower/upper;
 *   node:  lo (2) | hi (2) | flags (2) | ksize (2) | key | data
 *          a branch node's child is lo | hi << 16 | flags << 32, a leaf
 *          node's data size lo | hi << 16; F_BIGDATA puts the data on
 *          overflow pages, its first page number (8) in the node.
 * Everything is checked before it is read: a page number inside the mapping
 * and equal to the one the page records, the page's kind at each level (so a
 * cycle cannot loop), each node and each value inside its page or its
 * overflow run. Whatever does not fit that picture (damage, a sorted-duplicate
 * or nested database, a page past the mapping) is answered DC_MDB_UNREADABLE
 * or DC_MDB_BEYOND and the caller asks LMDB itself, which is the authority on
 * its own format; a walk never reads outside the mapping.
 */
#ifndef DC_MDB_H
#define DC_MDB_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dc_hash.h" /* dc_prefetch, dc_digest_cmp */

#define DC_MDB_PAGEHDR 16u
#define DC_MDB_NODEHDR 8u
#define DC_MDB_P_BRANCH 0x01u
#define DC_MDB_P_LEAF 0x02u
#define DC_MDB_P_OVERFLOW 0x04u
#define DC_MDB_P_LEAF2 0x20u
#define DC_MDB_P_SUBP 0x40u
#define DC_MDB_F_BIGDATA 0x01u
#define DC_MDB_F_SUBDATA 0x02u
#define DC_MDB_F_DUPDATA 0x04u
/* Deeper than any tree of 2^64 entries on 4 KiB pages: a bound, not a limit. */
#define DC_MDB_MAX_DEPTH 64u

typedef enum {
    DC_MDB_ABSENT = 0,
    DC_MDB_FOUND = 1,
    DC_MDB_UNREADABLE = -1, /* not LMDB's format as this header reads it */
    DC_MDB_BEYOND = -2      /* a page past the mapping: map the grown file again */
} dc_mdb_result;

/* A read-only mapping of data.mdb. */
typedef struct {
    const uint8_t *base;
    uint64_t pages; /* whole pages mapped */
    uint32_t psize;
} dc_mdb_map;

/* A database as its MDB_db record names it. */
typedef struct {
    uint64_t root; /* ~0: empty */
    uint16_t flags;
    uint16_t depth;
} dc_mdb_db;

static inline uint16_t dc_mdb_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline uint32_t dc_mdb_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t dc_mdb_u64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* The MDB_db record of a named database (48 bytes: pad 4, flags 2, depth 2,
 * branch/leaf/overflow page counts and entries 8 each, root 8). 0, or -1 when
 * it is not one this header reads: a database with its own key order or with
 * sorted duplicates. */
static inline int dc_mdb_db_read(const uint8_t *rec, size_t len, dc_mdb_db *db) {
    if (len != 48)
        return -1;
    db->flags = dc_mdb_u16(rec + 4);
    db->depth = dc_mdb_u16(rec + 6);
    db->root = dc_mdb_u64(rec + 40);
    if (db->flags != 0) /* MDB_REVERSEKEY, MDB_DUPSORT, MDB_INTEGERKEY, ... */
        return -1;
    if (db->root != UINT64_MAX && (db->depth == 0 || db->depth > DC_MDB_MAX_DEPTH))
        return -1;
    return 0;
}

/* Page pgno, checked to be a page of the kind wanted: a branch or leaf page whose
 * node pointers lie inside it. NULL with *why set otherwise. */
static inline const uint8_t *dc_mdb_page(const dc_mdb_map *m, uint64_t pgno, unsigned kind,
                                         unsigned *nkeys, dc_mdb_result *why) {
    if (pgno >= m->pages) {
        *why = DC_MDB_BEYOND;
        return NULL;
    }
    const uint8_t *p = m->base + pgno * (uint64_t)m->psize;
    *why = DC_MDB_UNREADABLE;
    if (dc_mdb_u64(p) != pgno)
        return NULL;
    unsigned flags = dc_mdb_u16(p + 10);
    if ((flags & (DC_MDB_P_BRANCH | DC_MDB_P_LEAF | DC_MDB_P_OVERFLOW | DC_MDB_P_LEAF2 |
                  DC_MDB_P_SUBP)) != kind)
        return NULL;
    unsigned lower = dc_mdb_u16(p + 12), upper = dc_mdb_u16(p + 14);
    if (lower < DC_MDB_PAGEHDR || (lower & 1u) || lower > upper || upper > m->psize)
        return NULL;
    *nkeys = (lower - DC_MDB_PAGEHDR) >> 1;
    if (*nkeys == 0)
        return NULL; /* LMDB keeps no empty page in a tree */
    return p;
}

/* Node i of a checked page, its key inside the page; NULL if not. */
static inline const uint8_t *dc_mdb_node(const dc_mdb_map *m, const uint8_t *page, unsigned i) {
    unsigned at = dc_mdb_u16(page + DC_MDB_PAGEHDR + 2u * i);
    unsigned upper = dc_mdb_u16(page + 14);
    if (at < upper || (uint64_t)at + DC_MDB_NODEHDR > m->psize)
        return NULL;
    const uint8_t *node = page + at;
    if ((uint64_t)at + DC_MDB_NODEHDR + dc_mdb_u16(node + 6) > m->psize)
        return NULL;
    return node;
}

/* LMDB's default order: memcmp over the common length, then the shorter first.
 * Two 16-byte keys (the warm tier's digests) go through dc_digest_cmp. */
static inline int dc_mdb_cmp(const uint8_t *a, size_t alen, const uint8_t *b, size_t blen) {
    if (alen == 16 && blen == 16)
        return dc_digest_cmp(a, b);
    int c = memcmp(a, b, alen < blen ? alen : blen);
    if (c)
        return c;
    return alen < blen ? -1 : alen > blen;
}

/* A key's first 8 bytes as a big-endian number (zeros past a shorter key): where
 * it falls between two others, for the search's first guess. */
static inline uint64_t dc_mdb_prefix(const uint8_t *k, size_t len) {
    uint64_t v = 0;
    for (size_t i = 0; i < 8; i++)
        v = v << 8 | (i < len ? k[i] : 0);
    return v;
}

/* Where in [lo, hi) (lo < hi) a key whose prefix is kv falls if the keys of the
 * range are spread evenly between the prefixes low and high. */
static inline unsigned dc_mdb_guess(unsigned lo, unsigned hi, uint64_t kv, uint64_t low,
                                    uint64_t high) {
    if (kv <= low || high <= low)
        return lo;
    double at = (double)(kv - low) / (double)(high - low) * (double)(hi - lo);
    return at >= (double)(hi - lo - 1) ? hi - 1 : lo + (unsigned)at;
}

/* The first index in [first, n) of a checked page whose node's key is greater than
 * key (n if none), or -1 if a node it reads is not inside the page.
 *
 * The keys of a page lie between bounds its parent gives (low and high, as
 * dc_mdb_prefix numbers); the warm tier's keys are hash digests, spread evenly,
 * so the search starts where key's prefix falls between them and gallops from
 * there: about 2-3 nodes read on a page of 50-100 instead of a binary search's
 * 6-7, each a cache miss on a page read for one key of a random batch. Any
 * other key order is answered the same, with more nodes read. */
static inline int64_t dc_mdb_upper(const dc_mdb_map *m, const uint8_t *page, unsigned first,
                                   unsigned n, const uint8_t *key, size_t klen, uint64_t low,
                                   uint64_t high) {
    unsigned lo = first, hi = n; /* the answer is in [lo, hi] */
    if (lo >= hi)
        return lo;
    unsigned guess = dc_mdb_guess(lo, hi, dc_mdb_prefix(key, klen), low, high);
    const uint8_t *node = dc_mdb_node(m, page, guess);
    if (node == NULL)
        return -1;
    unsigned step = 1;
    if (dc_mdb_cmp(node + DC_MDB_NODEHDR, dc_mdb_u16(node + 6), key, klen) <= 0) {
        lo = guess + 1; /* gallop up */
        while (lo + step - 1 < hi) {
            unsigned i = lo + step - 1;
            if ((node = dc_mdb_node(m, page, i)) == NULL)
                return -1;
            if (dc_mdb_cmp(node + DC_MDB_NODEHDR, dc_mdb_u16(node + 6), key, klen) > 0) {
                hi = i;
                break;
            }
            lo = i + 1;
            step <<= 1;
        }
    } else {
        hi = guess; /* gallop down */
        while (hi >= lo + step) {
            unsigned i = hi - step;
            if ((node = dc_mdb_node(m, page, i)) == NULL)
                return -1;
            if (dc_mdb_cmp(node + DC_MDB_NODEHDR, dc_mdb_u16(node + 6), key, klen) <= 0) {
                lo = i + 1;
                break;
            }
            hi = i;
            step <<= 1;
        }
    }
    while (lo < hi) {
        unsigned mid = lo + (hi - lo) / 2;
        if ((node = dc_mdb_node(m, page, mid)) == NULL)
            return -1;
        if (dc_mdb_cmp(node + DC_MDB_NODEHDR, dc_mdb_u16(node + 6), key, klen) <= 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Where a key's walk stands on its leaf: the page, its node count, and the bounds
 * its parent gave it. */
typedef struct {
    const uint8_t *leaf;
    unsigned n;
    uint64_t pgno, low, high;
} dc_mdb_at;

/* A subtree a walk goes down into: its page, and the keys that bound it (NULL:
 * unbounded on that side) with their first 8 bytes as numbers (dc_mdb_prefix,
 * for the search's first guess). */
typedef struct {
    uint64_t pgno, low, high;
    const uint8_t *lo, *hi;
    size_t lolen, hilen;
} dc_mdb_sub;

/* The branch pages the last walk went through (docs/warm-tier.md, "Lookups in
 * native code"): for each level, the subtree it went down into. The next key's
 * walk starts below the deepest level whose subtree holds it: for keys in byte
 * order that skips the upper levels' searches for most keys. Any order is
 * answered the same. Valid while the mapping and the snapshot are. */
typedef struct {
    unsigned levels; /* branch levels filled, from the root */
    uint64_t root;
    dc_mdb_sub at[DC_MDB_MAX_DEPTH];
} dc_mdb_path;

static inline void dc_mdb_path_init(dc_mdb_path *p) { p->levels = 0; }

/* Whether key lies inside a subtree's bounds. */
static inline int dc_mdb_sub_holds(const dc_mdb_sub *s, const uint8_t *key, size_t klen) {
    if (s->lo && dc_mdb_cmp(key, klen, s->lo, s->lolen) < 0)
        return 0;
    return !s->hi || dc_mdb_cmp(key, klen, s->hi, s->hilen) < 0;
}

/* The child page a branch node names. */
static inline uint64_t dc_mdb_child(const uint8_t *node) {
    return (uint64_t)dc_mdb_u16(node) | ((uint64_t)dc_mdb_u16(node + 2) << 16) |
           ((uint64_t)dc_mdb_u16(node + 4) << 32);
}

/* Walks down the branch pages of db to the leaf that would hold key: from the
 * root, or (path not NULL) from below the deepest level of the last walk whose
 * subtree holds key. DC_MDB_FOUND with *at set, DC_MDB_ABSENT for an empty
 * database, or why not (the path is then emptied). */
static inline dc_mdb_result dc_mdb_descend(const dc_mdb_map *m, const dc_mdb_db *db,
                                           const uint8_t *key, size_t klen, dc_mdb_at *at,
                                           dc_mdb_path *path) {
    if (db->root == UINT64_MAX)
        return DC_MDB_ABSENT;
    dc_mdb_sub sub = {db->root, 0, UINT64_MAX, NULL, NULL, 0, 0};
    unsigned level = 1;
    if (path != NULL) {
        unsigned l = path->root == db->root ? path->levels : 0;
        while (l > 0 && !dc_mdb_sub_holds(&path->at[l - 1], key, klen))
            l--;
        if (l > 0) {
            sub = path->at[l - 1];
            level = l + 1;
        }
        path->levels = level - 1;
        path->root = db->root;
    }
    dc_mdb_result why;
    unsigned n;
    for (; level < db->depth; level++) {
        const uint8_t *page = dc_mdb_page(m, sub.pgno, DC_MDB_P_BRANCH, &n, &why);
        if (page == NULL)
            goto fail;
        /* The last node whose key is <= key; node 0's key stands for -infinity. */
        int64_t up = dc_mdb_upper(m, page, 1, n, key, klen, sub.low, sub.high);
        why = DC_MDB_UNREADABLE;
        if (up < 0)
            goto fail;
        const uint8_t *child = dc_mdb_node(m, page, (unsigned)up - 1);
        if (child == NULL)
            goto fail;
        if (up > 1) {
            sub.lo = child + DC_MDB_NODEHDR;
            sub.lolen = dc_mdb_u16(child + 6);
            sub.low = dc_mdb_prefix(sub.lo, sub.lolen);
        }
        if ((unsigned)up < n) {
            const uint8_t *next = dc_mdb_node(m, page, (unsigned)up);
            if (next == NULL)
                goto fail;
            sub.hi = next + DC_MDB_NODEHDR;
            sub.hilen = dc_mdb_u16(next + 6);
            sub.high = dc_mdb_prefix(sub.hi, sub.hilen);
        }
        sub.pgno = dc_mdb_child(child);
        if (path != NULL) {
            path->at[level - 1] = sub;
            path->levels = level;
        }
    }
    at->pgno = sub.pgno;
    at->low = sub.low;
    at->high = sub.high;
    return DC_MDB_FOUND;
fail:
    if (path != NULL)
        path->levels = 0;
    return why;
}

/* Reads (and checks) the leaf page a walk reached. */
static inline dc_mdb_result dc_mdb_at_leaf(const dc_mdb_map *m, dc_mdb_at *at) {
    dc_mdb_result why;
    at->leaf = dc_mdb_page(m, at->pgno, DC_MDB_P_LEAF, &at->n, &why);
    return at->leaf == NULL ? why : DC_MDB_FOUND;
}

/* Looks key up in the leaf its walk reached. */
static inline dc_mdb_result dc_mdb_leaf_get(const dc_mdb_map *m, const dc_mdb_at *at,
                                            const uint8_t *key, size_t klen,
                                            const uint8_t **val, size_t *vlen) {
    const uint8_t *leaf = at->leaf;
    int64_t up = dc_mdb_upper(m, leaf, 0, at->n, key, klen, at->low, at->high);
    if (up < 0)
        return DC_MDB_UNREADABLE;
    if (up == 0)
        return DC_MDB_ABSENT;
    const uint8_t *node = dc_mdb_node(m, leaf, (unsigned)up - 1);
    if (node == NULL)
        return DC_MDB_UNREADABLE;
    unsigned ksize = dc_mdb_u16(node + 6);
    if (dc_mdb_cmp(node + DC_MDB_NODEHDR, ksize, key, klen) != 0)
        return DC_MDB_ABSENT;
    unsigned nflags = dc_mdb_u16(node + 4);
    uint64_t dsize = (uint64_t)dc_mdb_u16(node) | ((uint64_t)dc_mdb_u16(node + 2) << 16);
    const uint8_t *data = node + DC_MDB_NODEHDR + ksize;
    if (nflags & (DC_MDB_F_SUBDATA | DC_MDB_F_DUPDATA))
        return DC_MDB_UNREADABLE;
    if (!(nflags & DC_MDB_F_BIGDATA)) {
        if ((uint64_t)(data - leaf) + dsize > m->psize)
            return DC_MDB_UNREADABLE;
        *val = data;
        *vlen = (size_t)dsize;
        return DC_MDB_FOUND;
    }
    if ((uint64_t)(data - leaf) + 8 > m->psize)
        return DC_MDB_UNREADABLE;
    uint64_t first = dc_mdb_u64(data);
    if (first >= m->pages)
        return DC_MDB_BEYOND;
    const uint8_t *ov = m->base + first * (uint64_t)m->psize;
    if (dc_mdb_u64(ov) != first ||
        (dc_mdb_u16(ov + 10) & (DC_MDB_P_BRANCH | DC_MDB_P_LEAF | DC_MDB_P_OVERFLOW |
                                DC_MDB_P_LEAF2 | DC_MDB_P_SUBP)) != DC_MDB_P_OVERFLOW)
        return DC_MDB_UNREADABLE;
    uint64_t count = dc_mdb_u32(ov + 12);
    if (count == 0 || dsize > count * m->psize - DC_MDB_PAGEHDR)
        return DC_MDB_UNREADABLE;
    if (count > m->pages - first)
        return DC_MDB_BEYOND;
    *val = ov + DC_MDB_PAGEHDR;
    *vlen = (size_t)dsize;
    return DC_MDB_FOUND;
}

/* Looks up key in db. FOUND sets *val and *vlen to the value inside the mapping
 * (valid while the snapshot that named db's root stays open and the mapping
 * stays mapped). */
static inline dc_mdb_result dc_mdb_get(const dc_mdb_map *m, const dc_mdb_db *db,
                                       const uint8_t *key, size_t klen,
                                       const uint8_t **val, size_t *vlen) {
    dc_mdb_at at;
    dc_mdb_result r = dc_mdb_descend(m, db, key, klen, &at, NULL);
    if (r == DC_MDB_FOUND)
        r = dc_mdb_at_leaf(m, &at);
    if (r != DC_MDB_FOUND)
        return r;
    return dc_mdb_leaf_get(m, &at, key, klen, val, vlen);
}

#define DC_MDB_GROUP 8

/* Looks up n keys of klen bytes each, concatenated at keys, in db: vals[i] and
 * vlens[i] for each (vals[i] NULL where absent). Returns the number found, or
 * DC_MDB_UNREADABLE / DC_MDB_BEYOND at the first key whose walk could not be
 * made (the caller then asks LMDB for the whole batch). Keys in byte order make
 * neighbouring walks share pages.
 *
 * The keys go in groups of DC_MDB_GROUP: each walks down to its leaf (the upper
 * levels stay in cache), the cache lines of the leaf's node pointer and then of
 * the node where its search starts are fetched for the whole group, and only
 * then are the leaves searched: the group's cache misses overlap instead of
 * following one another. */
static inline int64_t dc_mdb_get_many(const dc_mdb_map *m, const dc_mdb_db *db,
                                      const uint8_t *keys, size_t n, size_t klen,
                                      const uint8_t **vals, size_t *vlens) {
    int64_t found = 0;
    dc_mdb_at at[DC_MDB_GROUP];
    dc_mdb_result r[DC_MDB_GROUP];
    unsigned guess[DC_MDB_GROUP];
    dc_mdb_path path;
    dc_mdb_path_init(&path);
    for (size_t g = 0; g < n; g += DC_MDB_GROUP) {
        size_t size = n - g < DC_MDB_GROUP ? n - g : DC_MDB_GROUP;
        for (size_t j = 0; j < size; j++) {
            const uint8_t *key = keys + (g + j) * klen;
            r[j] = dc_mdb_descend(m, db, key, klen, &at[j], &path);
            if (r[j] == DC_MDB_FOUND && at[j].pgno < m->pages)
                dc_prefetch(m->base + at[j].pgno * (uint64_t)m->psize);
        }
        for (size_t j = 0; j < size; j++) {
            const uint8_t *key = keys + (g + j) * klen;
            if (r[j] == DC_MDB_FOUND)
                r[j] = dc_mdb_at_leaf(m, &at[j]);
            if (r[j] == DC_MDB_FOUND) {
                guess[j] = dc_mdb_guess(0, at[j].n, dc_mdb_prefix(key, klen), at[j].low,
                                        at[j].high);
                dc_prefetch(at[j].leaf + DC_MDB_PAGEHDR + 2u * guess[j]);
            }
        }
        for (size_t j = 0; j < size; j++) {
            if (r[j] != DC_MDB_FOUND)
                continue;
            unsigned ptr = dc_mdb_u16(at[j].leaf + DC_MDB_PAGEHDR + 2u * guess[j]);
            if (ptr < m->psize) /* else the search itself says so */
                dc_prefetch(at[j].leaf + ptr);
        }
        for (size_t j = 0; j < size; j++) {
            size_t i = g + j;
            if (r[j] == DC_MDB_FOUND)
                r[j] = dc_mdb_leaf_get(m, &at[j], keys + i * klen, klen, &vals[i], &vlens[i]);
            if (r[j] < 0)
                return r[j];
            if (r[j] == DC_MDB_ABSENT)
                vals[i] = NULL;
            else
                found++;
        }
    }
    return found;
}

/* -- the digests of a batch, in LMDB's key order ------------------------------- */

static int dc_mdb_digest_cmp(const void *a, const void *b) {
    return dc_digest_cmp((const uint8_t *)a, (const uint8_t *)b);
}

/* Insertion sort of n 16-byte digests (a bucket of a few). */
static inline void dc_mdb_insertion_sort(uint8_t *d, size_t n) {
    uint8_t tmp[16];
    for (size_t i = 1; i < n; i++) {
        size_t j = i;
        memcpy(tmp, d + 16 * i, 16);
        while (j > 0 && dc_digest_cmp(d + 16 * (j - 1), tmp) > 0) {
            memcpy(d + 16 * j, d + 16 * (j - 1), 16);
            j--;
        }
        memcpy(d + 16 * j, tmp, 16);
    }
}

/* Sorts n concatenated 16-byte digests into byte order (repeats kept).
 *
 * Digests are hashes, spread evenly: they are first dealt into about n buckets
 * by their top bits, in one counting pass and one scattering pass, and each
 * bucket of a few is then sorted in place; a bucket that is not small (digests
 * that are not spread evenly) is sorted by qsort. A batch of 1,000 costs a few
 * compares per digest instead of qsort's ten, each through a call. Without the
 * memory for the buckets, all of it goes to qsort. */
static inline void dc_mdb_sort_digests(uint8_t *d, size_t n) {
    if (n < 32) {
        dc_mdb_insertion_sort(d, n);
        return;
    }
    unsigned bits = 4;
    while (bits < 16 && ((size_t)1 << bits) < n)
        bits++;
    size_t nb = (size_t)1 << bits;
    size_t *start = (size_t *)calloc(nb + 1, sizeof(size_t));
    uint8_t *out = (uint8_t *)malloc(16 * n);
    if (start == NULL || out == NULL) {
        free(start);
        free(out);
        qsort(d, n, 16, dc_mdb_digest_cmp);
        return;
    }
    for (size_t i = 0; i < n; i++)
        start[(((size_t)d[16 * i] << 8 | d[16 * i + 1]) >> (16 - bits)) + 1]++;
    for (size_t b = 0; b < nb; b++)
        start[b + 1] += start[b];
    for (size_t i = 0; i < n; i++) {
        size_t b = ((size_t)d[16 * i] << 8 | d[16 * i + 1]) >> (16 - bits);
        memcpy(out + 16 * start[b]++, d + 16 * i, 16);
    }
    /* start[b] is now the end of bucket b, and the start of bucket b + 1. */
    size_t from = 0;
    for (size_t b = 0; b < nb; b++) {
        size_t size = start[b] - from;
        if (size > 32)
            qsort(out + 16 * from, size, 16, dc_mdb_digest_cmp);
        else if (size > 1)
            dc_mdb_insertion_sort(out + 16 * from, size);
        from = start[b];
    }
    memcpy(d, out, 16 * n);
    free(start);
    free(out);
}

/* -- every key of a database, in order ----------------------------------------- */

/* An in-order walk over the keys of a database, a batch at a time: the pages from
 * the root to the current leaf, and where the walk stands in each. Valid while
 * the snapshot that named the root stays open and the mapping stays mapped. */
typedef struct {
    const uint8_t *page[DC_MDB_MAX_DEPTH];
    unsigned n[DC_MDB_MAX_DEPTH];
    unsigned i[DC_MDB_MAX_DEPTH];
    unsigned depth; /* the tree's levels */
    unsigned level; /* levels on the stack; 0 once the walk is over */
    uint64_t left;  /* keys the database's record counts that the walk has not given */
    size_t klen;
    uint8_t last[16]; /* the last key given (the order is checked against it) */
    int given;
} dc_mdb_walk;

/* Pushes page pgno, of the kind level `level` holds, onto the walk's stack. */
static inline dc_mdb_result dc_mdb_walk_push(const dc_mdb_map *m, dc_mdb_walk *w,
                                             uint64_t pgno) {
    unsigned kind = w->level + 1 == w->depth ? DC_MDB_P_LEAF : DC_MDB_P_BRANCH;
    dc_mdb_result why;
    unsigned n;
    const uint8_t *page = dc_mdb_page(m, pgno, kind, &n, &why);
    if (page == NULL)
        return why;
    w->page[w->level] = page;
    w->n[w->level] = n;
    w->i[w->level] = 0;
    w->level++;
    return DC_MDB_FOUND;
}

/* Starts a walk over db, whose record counts `entries` keys, each klen (1..16)
 * bytes long. */
static inline dc_mdb_result dc_mdb_walk_start(const dc_mdb_map *m, const dc_mdb_db *db,
                                              uint64_t entries, size_t klen, dc_mdb_walk *w) {
    memset(w, 0, sizeof(*w));
    if (klen == 0 || klen > sizeof w->last)
        return DC_MDB_UNREADABLE;
    w->klen = klen;
    w->left = entries;
    if (db->root == UINT64_MAX)
        return entries == 0 ? DC_MDB_FOUND : DC_MDB_UNREADABLE;
    w->depth = db->depth;
    return dc_mdb_walk_push(m, w, db->root);
}

/* Copies up to cap more keys into out (klen bytes each); *got says how many.
 * DC_MDB_FOUND while keys may be left, DC_MDB_ABSENT once all were given, or
 * why it cannot go on: a key of another length, keys out of order, more or
 * fewer keys than the database's record counts, or a page that is not what
 * its level holds. The keys given before stay given. */
static inline dc_mdb_result dc_mdb_walk_keys(const dc_mdb_map *m, dc_mdb_walk *w,
                                             uint8_t *out, size_t cap, size_t *got) {
    *got = 0;
    while (w->level > 0) {
        unsigned top = w->level - 1;
        if (w->i[top] >= w->n[top]) {
            w->level--;
            continue;
        }
        const uint8_t *node = dc_mdb_node(m, w->page[top], w->i[top]);
        if (node == NULL)
            return DC_MDB_UNREADABLE;
        if (top + 1 < w->depth) { /* a branch: down to the child */
            if (w->level >= DC_MDB_MAX_DEPTH)
                return DC_MDB_UNREADABLE;
            w->i[top]++;
            dc_mdb_result r = dc_mdb_walk_push(m, w, dc_mdb_child(node));
            if (r != DC_MDB_FOUND)
                return r;
            continue;
        }
        if (*got == cap)
            return DC_MDB_FOUND;
        const uint8_t *key = node + DC_MDB_NODEHDR;
        if (dc_mdb_u16(node + 6) != w->klen || w->left == 0 ||
            (w->given && dc_mdb_cmp(w->last, w->klen, key, w->klen) >= 0))
            return DC_MDB_UNREADABLE;
        memcpy(out + *got * w->klen, key, w->klen);
        memcpy(w->last, key, w->klen);
        w->given = 1;
        w->left--;
        w->i[top]++;
        (*got)++;
    }
    return w->left == 0 ? DC_MDB_ABSENT : DC_MDB_UNREADABLE;
}

#endif /* DC_MDB_H */
