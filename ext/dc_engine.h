/*
 * dc_engine.h - the native claim engine of the embedded store.
 *
 * Plain C, no Python objects: ext/_engine.pyx wraps it. See docs/engine.md for
 * the record format and the decision; the decision here must answer exactly
 * like the pure reference in dedupcore/decision.py (a differential test drives
 * both side by side).
 *
 * The table holds the records the store keeps in memory: every PROCESSING
 * record (its lease deadline lives on this process's monotonic clock), every
 * record changed since the last checkpoint, and records read back from LMDB
 * (clean copies, dropped at the next eviction). It is open addressing with
 * linear probing over fixed 72-byte slots keyed by the 16-byte digest; the
 * variable parts (owner, fingerprint, result) live in one reference-counted
 * heap blob per record, or none.
 *
 * Beside the slots the table keeps a journal of what changed: (digest, lsn)
 * for every record stored with a log position, and the digests of the clean
 * copies loaded. A checkpoint's export, the count of records not yet in LMDB
 * and the eviction after a checkpoint walk the journal, not the slots, so
 * their cost follows the records changed since the last checkpoint and not
 * the records held (a table of millions of open claims is not scanned while
 * claims wait on the store's lock; docs/engine.md, "The change journal").
 * For the same reason the table grows without a rebuild: a doubling keeps
 * the old array beside the new one and later puts move its records over a
 * few at a time (dc_grow, dc_migrate; docs/engine.md, "Growing").
 *
 * A batch is decided in two steps: dc_decide_* reads the table and stages the
 * new records (nothing changes, so an error such as a fingerprint conflict
 * leaves no trace), the caller logs the staged records, then dc_apply puts
 * them into the table with the log position they got.
 */
#ifndef DC_ENGINE_H
#define DC_ENGINE_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "dc_hash.h"
#include "dc_status.h"

#define DC_PROCESSING 1
#define DC_PROCESSED 2
#define DC_RELEASED 3
/* A slot of the old array while the table grows (see dc_grow): its record
 * moved on. Lookups in the old array probe past it, as past any record. */
#define DC_GONE 0xFF

/* Outcomes of a claim, per key. */
#define DC_NEW 0
#define DC_DUPLICATE 1
#define DC_IN_PROGRESS 2
#define DC_NEW_TAKEOVER 3
#define DC_DUPLICATE_COLD 4

/* Errors of a complete/release, per batch (the first bad item). */
#define DC_ERR_NOT_CLAIMED 1
#define DC_ERR_WRONG_TOKEN 2
#define DC_ERR_COMPLETED 3

#define DC_HAS_OWNER 1
#define DC_HAS_FP 2
#define DC_HAS_RESULT 4

/* Seed of the per-record checksum (XXH64 of digest + value, low 32 bits). */
#define DC_RECORD_SEED 0x64656475703276ULL

typedef struct dc_extra {
    uint32_t refs;
    uint32_t result_len;
    uint8_t has;
    uint8_t owner_len;
    uint8_t fp_len;
    uint8_t pad;
    unsigned char data[]; /* owner, fingerprint, result */
} dc_extra;

typedef struct {
    unsigned char digest[16];
    uint64_t token;
    uint64_t lsn; /* log position of the last change; 0 = a clean copy of LMDB */
    double created;
    double updated;
    double deadline; /* monotonic; PROCESSING only */
    dc_extra *extra;
    float lease;
    uint16_t ns_id;
    uint8_t state; /* 0 = empty slot */
    uint8_t renewal; /* staged only: a lease renewal, kept in memory, not logged */
} dc_rec;

/* One journal entry: a record stored with log position lsn. The entry is
 * current while the record's lsn is still lsn; a later change appends a new
 * entry and the old one no longer matches. */
typedef struct {
    unsigned char digest[16];
    uint64_t lsn;
} dc_jent;

/* Records changed since the last checkpoint took them, encoded as a
 * checkpoint writes them: n x [digest(16) | value length (u32 LE) | value],
 * in the order stored (a record changed twice is in it twice). */
typedef struct {
    unsigned char *items;
    size_t items_len, cap, n;
    double newest; /* the latest `updated` among them */
} dc_export;

typedef struct {
    dc_rec *slots;
    uint64_t mask;
    /* One bit per 4 KiB page of slots: set once a record was written on the
     * page that holds a slot's state byte. A slot whose page is unmarked is
     * empty without reading it (dc_empty): a probe of a page never written
     * would fault in the kernel's zero page, and the put that follows would
     * fault again to replace it (docs/engine.md, "Growing"). */
    uint64_t *touched;
    /* While the table grows, the array it grows out of: its records move to
     * slots a few per put (dc_migrate), so no put waits for all of them. */
    dc_rec *old;
    uint64_t old_mask;
    uint64_t mig_pos, mig_left; /* next old slot to move; old slots left to visit */
    uint64_t count;
    uint64_t inflight;
    uint64_t clean;
    dc_export changes; /* what the next checkpoint writes */
    dc_jent *journal; /* changes with a log position, in the order stored */
    size_t jhead, jlen, jcap; /* [jhead, jlen) not yet visited by an eviction */
    unsigned char *loaded; /* digests of clean copies loaded (16 bytes each) */
    size_t lhead, llen, lcap; /* [lhead, llen) not yet visited */
    /* While an eviction goes in steps: the clean copies it visits end at lstop
     * (those loaded since wait for the next one, or a claim that keeps loading
     * would keep the eviction going forever). */
    size_t lstop;
    int evicting;
    /* A search of the records in flight in steps (dc_scan_begin, dc_scan_step;
     * docs/engine.md, "Scans in steps"): the old array (phase 0), then the
     * current one (phase 1), up to scan_pos. A grow moves the search on to the
     * array it leaves behind (dc_grow); a rebuild bumps epoch and the search
     * starts over; a backward shift that moves a record in flight from ahead
     * of scan_pos to behind it leaves its digest in scan_late, visited by the
     * next step. */
    uint64_t epoch;
    uint64_t scan_epoch, scan_pos;
    int scan_on, scan_phase;
    unsigned char *scan_late; /* 16 bytes each */
    size_t slen, scap;
} dc_table;

/* ---- variable parts --------------------------------------------------- */

static inline const unsigned char *dc_owner(const dc_extra *e) { return e->data; }
static inline const unsigned char *dc_fp(const dc_extra *e) { return e->data + e->owner_len; }
static inline const unsigned char *dc_result(const dc_extra *e) {
    return e->data + e->owner_len + e->fp_len;
}

static inline void dc_incref(dc_extra *e) {
    if (e) e->refs++;
}
static inline void dc_decref(dc_extra *e) {
    if (e && --e->refs == 0) free(e);
}

/* A new blob (refs 1); NULL when nothing is present or on allocation failure (*oom set). */
static dc_extra *dc_extra_new(const unsigned char *owner, size_t owner_len, int has_owner,
                              const unsigned char *fp, size_t fp_len, int has_fp,
                              const unsigned char *result, size_t result_len, int has_result,
                              int *oom) {
    if (!has_owner && !has_fp && !has_result) return NULL;
    dc_extra *e = (dc_extra *)malloc(sizeof(dc_extra) + owner_len + fp_len + result_len);
    if (!e) {
        *oom = 1;
        return NULL;
    }
    e->refs = 1;
    e->has = (has_owner ? DC_HAS_OWNER : 0) | (has_fp ? DC_HAS_FP : 0) |
             (has_result ? DC_HAS_RESULT : 0);
    e->owner_len = (uint8_t)owner_len;
    e->fp_len = (uint8_t)fp_len;
    e->pad = 0;
    e->result_len = (uint32_t)result_len;
    if (owner_len) memcpy(e->data, owner, owner_len);
    if (fp_len) memcpy(e->data + owner_len, fp, fp_len);
    if (result_len) memcpy(e->data + owner_len + fp_len, result, result_len);
    return e;
}

static inline int dc_bytes_eq(const unsigned char *a, size_t alen, const unsigned char *b,
                              size_t blen) {
    return alen == blen && (alen == 0 || memcmp(a, b, alen) == 0);
}

/* ---- the table -------------------------------------------------------- */

static inline uint64_t dc_slot_of(const unsigned char *digest) {
    uint64_t h;
    memcpy(&h, digest + 8, 8); /* the digest's second XXH64: already uniform */
    return h;
}

/* A slot that holds a record (not empty, not a moved-on slot of the old array). */
static inline int dc_live(const dc_rec *r) { return r->state && r->state != DC_GONE; }

/* Slot arrays of 4 MiB and more are mapped on their own, so that a table
 * that grows or shrinks gives the old array back to the system at once.
 * Zeroed either way. Small pages on purpose: a huge page is zeroed (and, in
 * madvise mode, compacted for) at its first touch, so the first batch after
 * a grow paid for the whole new array at once (0.8 s at 8M slots, measured);
 * small pages spread that cost over the puts that land on them. */
#define DC_MAP_MIN ((size_t)4 << 20)

static dc_rec *dc_slots_alloc(uint64_t n) {
    size_t bytes = (size_t)n * sizeof(dc_rec);
    if (bytes < DC_MAP_MIN) return (dc_rec *)calloc(n, sizeof(dc_rec));
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    return (dc_rec *)p;
}

/* The page map of an array of n slots (see dc_table.touched), zeroed. */
static uint64_t *dc_touched_alloc(uint64_t n) {
    size_t pages = ((size_t)n * sizeof(dc_rec) + 4095) >> 12;
    return (uint64_t *)calloc((pages + 63) / 64, sizeof(uint64_t));
}

static inline size_t dc_state_page(uint64_t i) {
    return ((size_t)i * sizeof(dc_rec) + offsetof(dc_rec, state)) >> 12;
}

/* Slot i of the current array holds nothing: its page was never written,
 * or its state says so. */
static inline int dc_empty(const dc_table *t, uint64_t i) {
    size_t p = dc_state_page(i);
    return !((t->touched[p >> 6] >> (p & 63)) & 1) || !t->slots[i].state;
}

/* Marks slot i's page as written: called before a record is written there. */
static inline void dc_touch(dc_table *t, uint64_t i) {
    size_t p = dc_state_page(i);
    t->touched[p >> 6] |= (uint64_t)1 << (p & 63);
}

static void dc_slots_free(dc_rec *slots, uint64_t n) {
    size_t bytes = (size_t)n * sizeof(dc_rec);
    if (!slots) return;
    if (bytes < DC_MAP_MIN)
        free(slots);
    else
        munmap(slots, bytes);
}

static dc_status dc_table_init(dc_table *t, uint64_t capacity) {
    uint64_t n = 1024;
    while (n < capacity * 2) n <<= 1;
    t->slots = dc_slots_alloc(n);
    t->touched = dc_touched_alloc(n);
    if (!t->slots || !t->touched) {
        dc_slots_free(t->slots, n);
        free(t->touched);
        t->slots = NULL;
        t->touched = NULL;
        return DC_ENOMEM;
    }
    t->mask = n - 1;
    t->old = NULL;
    t->old_mask = t->mig_pos = t->mig_left = 0;
    t->count = t->inflight = t->clean = 0;
    memset(&t->changes, 0, sizeof(t->changes));
    t->journal = NULL;
    t->jhead = t->jlen = t->jcap = 0;
    t->loaded = NULL;
    t->lhead = t->llen = t->lcap = 0;
    t->lstop = 0;
    t->evicting = 0;
    t->epoch = t->scan_epoch = t->scan_pos = 0;
    t->scan_on = t->scan_phase = 0;
    t->scan_late = NULL;
    t->slen = t->scap = 0;
    return DC_OK;
}

static void dc_table_free(dc_table *t) {
    if (!t->slots) return;
    for (uint64_t i = 0; i <= t->mask; i++)
        if (t->slots[i].state) dc_decref(t->slots[i].extra);
    dc_slots_free(t->slots, t->mask + 1);
    t->slots = NULL;
    free(t->touched);
    t->touched = NULL;
    if (t->old) {
        for (uint64_t i = 0; i <= t->old_mask; i++)
            if (dc_live(&t->old[i])) dc_decref(t->old[i].extra);
        dc_slots_free(t->old, t->old_mask + 1);
        t->old = NULL;
    }
    free(t->journal);
    t->journal = NULL;
    t->jhead = t->jlen = t->jcap = 0;
    free(t->loaded);
    t->loaded = NULL;
    t->lhead = t->llen = t->lcap = 0;
    free(t->changes.items);
    memset(&t->changes, 0, sizeof(t->changes));
    free(t->scan_late);
    t->scan_late = NULL;
    t->slen = t->scap = 0;
    t->scan_on = 0;
}

static inline size_t dc_value_bound(const dc_rec *r);
static size_t dc_encode_value(const dc_rec *r, unsigned char *out);

/* Appends r, encoded, to x. DC_ENOMEM on allocation failure (x unchanged). */
static dc_status dc_export_add(dc_export *x, const dc_rec *r) {
    size_t need = 20 + dc_value_bound(r);
    if (x->items_len + need > x->cap) {
        size_t cap = x->cap ? x->cap : 65536;
        while (cap < x->items_len + need) cap *= 2;
        unsigned char *items = (unsigned char *)realloc(x->items, cap);
        if (!items) return DC_ENOMEM;
        x->items = items;
        x->cap = cap;
    }
    unsigned char *p = x->items + x->items_len;
    memcpy(p, r->digest, 16);
    uint32_t vlen = (uint32_t)dc_encode_value(r, p + 20);
    p[16] = (unsigned char)vlen;
    p[17] = (unsigned char)(vlen >> 8);
    p[18] = (unsigned char)(vlen >> 16);
    p[19] = (unsigned char)(vlen >> 24);
    x->items_len += 20 + vlen;
    x->n++;
    if (r->updated > x->newest) x->newest = r->updated;
    return DC_OK;
}

/* Moves the changes out of the table (the next checkpoint's records start
 * empty): O(1), so it is all a checkpoint does under the store's lock. */
static void dc_take_changes(dc_table *t, dc_export *x) {
    *x = t->changes;
    memset(&t->changes, 0, sizeof(t->changes));
}

/* Puts changes taken out back in front of those stored since (a checkpoint
 * that failed). Frees x's buffer. DC_ENOMEM on allocation failure (nothing changed). */
static dc_status dc_give_back(dc_table *t, dc_export *x) {
    dc_export *c = &t->changes;
    size_t len = x->items_len + c->items_len;
    unsigned char *items = (unsigned char *)malloc(len ? len : 1);
    if (!items) return DC_ENOMEM;
    if (x->items_len) memcpy(items, x->items, x->items_len);
    if (c->items_len) memcpy(items + x->items_len, c->items, c->items_len);
    free(x->items);
    free(c->items);
    c->items = items;
    c->items_len = c->cap = len;
    c->n += x->n;
    if (x->newest > c->newest) c->newest = x->newest;
    memset(x, 0, sizeof(*x));
    return DC_OK;
}

/* Notes that r is about to be stored (lsn 0 = a clean copy): with a log
 * position it goes to the journal and, encoded, to the changes the next
 * checkpoint writes. DC_ENOMEM on allocation failure, before anything changed. */
static dc_status dc_journal_note(dc_table *t, const dc_rec *r) {
    const unsigned char *digest = r->digest;
    uint64_t lsn = r->lsn;
    if (lsn) {
        if (t->jlen == t->jcap) {
            size_t cap = t->jcap ? t->jcap * 2 : 1024;
            dc_jent *j = (dc_jent *)realloc(t->journal, cap * sizeof(dc_jent));
            if (!j) return DC_ENOMEM;
            t->journal = j;
            t->jcap = cap;
        }
        if (dc_export_add(&t->changes, r) != DC_OK) return DC_ENOMEM;
        memcpy(t->journal[t->jlen].digest, digest, 16);
        t->journal[t->jlen].lsn = lsn;
        t->jlen++;
    } else {
        if (t->llen == t->lcap) {
            size_t cap = t->lcap ? t->lcap * 2 : 1024;
            unsigned char *l = (unsigned char *)realloc(t->loaded, cap * 16);
            if (!l) return DC_ENOMEM;
            t->loaded = l;
            t->lcap = cap;
        }
        memcpy(t->loaded + 16 * t->llen, digest, 16);
        t->llen++;
    }
    return DC_OK;
}

/* The slot of digest in the old array (growing only), or NULL. */
static inline dc_rec *dc_find_old(const dc_table *t, const unsigned char *digest) {
    if (!t->old) return NULL;
    uint64_t i = dc_slot_of(digest) & t->old_mask;
    for (;;) {
        dc_rec *r = &t->old[i];
        if (!r->state) return NULL;
        if (r->state != DC_GONE && memcmp(r->digest, digest, 16) == 0) return r;
        i = (i + 1) & t->old_mask;
    }
}

/* The digest's record (read only: a put may move it), or NULL. */
static inline dc_rec *dc_find(const dc_table *t, const unsigned char *digest) {
    uint64_t i = dc_slot_of(digest) & t->mask;
    for (;;) {
        if (dc_empty(t, i)) return dc_find_old(t, digest);
        dc_rec *r = &t->slots[i];
        if (memcmp(r->digest, digest, 16) == 0) return r;
        i = (i + 1) & t->mask;
    }
}

/* Asks for the cache lines a lookup of digest starts with: its home slot, and
 * while the table grows its home slot in the old array too, where a lookup
 * that finds no record in the new array goes on (dc_find_old). */
static inline void dc_prefetch_slot(const dc_table *t, const unsigned char *digest) {
    uint64_t h = dc_slot_of(digest);
    dc_prefetch(&t->slots[h & t->mask]);
    if (t->old) dc_prefetch(&t->old[h & t->old_mask]);
}

/* Writes the indexes of the digests the table has no record of to out;
 * returns how many. */
static size_t dc_missing(const dc_table *t, const unsigned char *digests, size_t n, size_t *out) {
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (i + 8 < n) dc_prefetch_slot(t, digests + 16 * (i + 8));
        if (!dc_find(t, digests + 16 * i)) out[m++] = i;
    }
    return m;
}

static inline void dc_count(dc_table *t, const dc_rec *r, int sign) {
    if (r->state == DC_PROCESSING) t->inflight += sign;
    if (r->lsn == 0) t->clean += sign;
}

/* Moves a record into a table with room (no count changes, no refcounting). */
static inline void dc_place(dc_table *t, const dc_rec *r) {
    uint64_t i = dc_slot_of(r->digest) & t->mask;
    while (!dc_empty(t, i)) i = (i + 1) & t->mask;
    dc_touch(t, i);
    t->slots[i] = *r;
}

/* Moves up to k slots of the old array into slots (counts and references go
 * with the records: nothing else changes). A record that moved leaves
 * DC_GONE behind, never an empty slot: an empty slot would end the probe of
 * a record further along that has not moved yet. The old array goes when
 * every slot was visited. */
static void dc_migrate(dc_table *t, uint64_t k) {
    while (t->old && k--) {
        dc_rec *s = &t->old[t->mig_pos];
        if (dc_live(s)) dc_place(t, s);
        if (s->state) s->state = DC_GONE;
        t->mig_pos = (t->mig_pos + 1) & t->old_mask;
        if (--t->mig_left == 0) {
            dc_slots_free(t->old, t->old_mask + 1);
            t->old = NULL;
            t->old_mask = t->mig_pos = 0;
        }
    }
}

/* Old slots visited per put while the table grows. A grow starts at 70 % of
 * n slots with 2n new ones; the table is 70 % full again only after 0.7n
 * more records, by when 4 per put have visited all n old slots (n/4 puts). */
#define DC_MIGRATE_STEP 4

/* Doubles the table without moving its records now: the new array starts
 * empty and the records move over a few per put (dc_migrate), so the put
 * that crosses 70 % costs an allocation, not a rebuild of millions of slots.
 * An old array still there is emptied first (not with DC_MIGRATE_STEP as it
 * is; a shrink does it too). */
static dc_status dc_grow(dc_table *t) {
    if (t->old) dc_migrate(t, UINT64_MAX);
    uint64_t n = (t->mask + 1) * 2;
    dc_rec *slots = dc_slots_alloc(n);
    uint64_t *touched = dc_touched_alloc(n);
    if (!slots || !touched) {
        dc_slots_free(slots, n);
        free(touched);
        return DC_ENOMEM;
    }
    /* The old array is 70 % full: every page of it holds records, so its
     * probes (dc_find_old) need no page map. */
    free(t->touched);
    t->touched = touched;
    t->old = t->slots;
    t->old_mask = t->mask;
    t->slots = slots;
    t->mask = n - 1;
    /* Any order of visit is right: moved records leave DC_GONE, so the probe
     * of a record not yet moved still reaches it. */
    t->mig_pos = 0;
    t->mig_left = t->old_mask + 1;
    if (t->scan_on) {
        /* A search in steps goes on over the array now old, then the new one:
         * from where it was if it was visiting the array now old (the slots
         * before were visited, and records move out of it only into the new
         * one); from its start if it was still in the array emptied above (its
         * records not yet visited all moved into the one now old). */
        if (t->scan_phase == 0) t->scan_pos = 0;
        t->scan_phase = 0;
    }
    return DC_OK;
}

static dc_status dc_resize(dc_table *t, uint64_t n) {
    if (t->old) dc_migrate(t, UINT64_MAX);
    dc_rec *old = t->slots;
    uint64_t *old_touched = t->touched;
    uint64_t old_n = t->mask + 1;
    dc_rec *slots = dc_slots_alloc(n);
    uint64_t *touched = dc_touched_alloc(n);
    if (!slots || !touched) {
        dc_slots_free(slots, n);
        free(touched);
        return DC_ENOMEM;
    }
    free(old_touched);
    t->touched = touched;
    t->slots = slots;
    t->mask = n - 1;
    for (uint64_t i = 0; i < old_n; i++)
        if (old[i].state) dc_place(t, &old[i]);
    dc_slots_free(old, old_n);
    t->epoch++; /* a search in steps starts over */
    return DC_OK;
}

/* Stores a copy of r (taking a new reference to its blob), replacing the
 * digest's record if any; with note, the journal records the change (a lease
 * renewal keeps its log position and is not noted again). DC_ENOMEM on
 * allocation failure (the table is unchanged). */
static dc_status dc_put(dc_table *t, const dc_rec *r, int note) {
    if ((t->count + 1) * 10 > (t->mask + 1) * 7) {
        if (dc_grow(t) != DC_OK) return DC_ENOMEM;
    }
    if (note && dc_journal_note(t, r) != DC_OK) return DC_ENOMEM;
    if (t->old) {
        /* The digest's record moves to the new array with this change. */
        dc_rec *o = dc_find_old(t, r->digest);
        if (o) {
            dc_place(t, o);
            o->state = DC_GONE;
        }
        dc_migrate(t, DC_MIGRATE_STEP);
    }
    uint64_t i = dc_slot_of(r->digest) & t->mask;
    for (;;) {
        dc_rec *s = &t->slots[i];
        if (dc_empty(t, i)) {
            dc_touch(t, i);
            *s = *r;
            s->renewal = 0;
            dc_incref(s->extra);
            t->count++;
            dc_count(t, s, 1);
            return DC_OK;
        }
        if (memcmp(s->digest, r->digest, 16) == 0) {
            dc_count(t, s, -1);
            dc_incref(r->extra);
            dc_decref(s->extra);
            *s = *r;
            s->renewal = 0;
            dc_count(t, s, 1);
            return DC_OK;
        }
        i = (i + 1) & t->mask;
    }
}

/* A record in flight moves from slot j of the current array to slot to:
 * if a search in steps visited to but not yet j, the next step visits the
 * record from scan_late. Out of memory, the search starts over instead. */
static void dc_scan_moved(dc_table *t, uint64_t j, uint64_t to) {
    if (!t->scan_on || t->scan_phase != 1 || t->scan_epoch != t->epoch) return;
    if (!(to < t->scan_pos && j >= t->scan_pos) || t->slots[j].state != DC_PROCESSING) return;
    if (t->slen == t->scap) {
        size_t cap = t->scap ? t->scap * 2 : 64;
        unsigned char *l = (unsigned char *)realloc(t->scan_late, cap * 16);
        if (!l) {
            t->scan_epoch = t->epoch - 1;
            return;
        }
        t->scan_late = l;
        t->scap = cap;
    }
    memcpy(t->scan_late + 16 * t->slen, t->slots[j].digest, 16);
    t->slen++;
}

/* Removes the record at slot i by backward shift (linear probing keeps no
 * tombstones): later records of the cluster that may live at i move up. */
static void dc_remove_at(dc_table *t, uint64_t i) {
    uint64_t hole = i, j = (i + 1) & t->mask;
    while (!dc_empty(t, j)) {
        uint64_t home = dc_slot_of(t->slots[j].digest) & t->mask;
        /* j may move to the hole if the hole lies on its probe path [home, j]. */
        if (((j - home) & t->mask) >= ((j - hole) & t->mask)) {
            dc_scan_moved(t, j, hole);
            t->slots[hole] = t->slots[j];
            hole = j;
        }
        j = (j + 1) & t->mask;
    }
    memset(&t->slots[hole], 0, sizeof(dc_rec));
}

static inline int dc_find_at(const dc_table *t, const unsigned char *digest, uint64_t *at) {
    uint64_t i = dc_slot_of(digest) & t->mask;
    for (;;) {
        if (dc_empty(t, i)) return 0;
        const dc_rec *r = &t->slots[i];
        if (memcmp(r->digest, digest, 16) == 0) {
            *at = i;
            return 1;
        }
        i = (i + 1) & t->mask;
    }
}

/* Drops digest's record if its log position is still lsn and it is not
 * PROCESSING; 1 if dropped. */
static inline int dc_drop_if(dc_table *t, const unsigned char *digest, uint64_t lsn) {
    uint64_t i;
    dc_rec *r;
    int in_old = !dc_find_at(t, digest, &i);
    if (in_old) {
        r = dc_find_old(t, digest);
        if (!r) return 0;
    } else {
        r = &t->slots[i];
    }
    if (r->lsn != lsn || r->state == DC_PROCESSING) return 0;
    dc_count(t, r, -1);
    dc_decref(r->extra);
    t->count--;
    if (in_old)
        r->state = DC_GONE; /* the old array only ever empties: no shift there */
    else
        dc_remove_at(t, i);
    return 1;
}

/* Gives back most of a journal array left far bigger than what it holds. */
static void *dc_trim(void *p, size_t len, size_t *cap, size_t size) {
    if (*cap <= 4096 || len * 4 > *cap) return p;
    size_t n = 4096;
    while (n < len * 2) n <<= 1;
    void *q = realloc(p, n * size);
    if (!q) return p; /* keeping the bigger array is fine */
    *cap = n;
    return q;
}

/* Moves the entries [*head, *len) of an array to its start once the visited
 * prefix is at least half of it, or when a pass is over (done): each call of a
 * stepwise eviction moves nothing or at most as much as it visited, so a pass
 * over n entries costs O(n), not a move of the whole rest per step. */
static void dc_consume(void *p, size_t *head, size_t *len, size_t size, int done) {
    if (!*head) return;
    if (*head == *len) {
        *head = *len = 0;
    } else if (done || *head * 2 >= *len) {
        memmove(p, (char *)p + *head * size, (*len - *head) * size);
        *len -= *head;
        *head = 0;
    }
}

/* Drops records that LMDB holds (lsn <= upto) and are not PROCESSING: the
 * records the journal names with a position <= upto that still have it, and
 * the clean copies loaded before the eviction began (a pass: the calls until
 * *more is 0). The entries visited are consumed (a record kept
 * because it is in flight gets a new entry when it changes). At most `limit`
 * entries per call (0 = no limit), so a caller can let go of its lock between
 * calls; *more is set if entries <= upto are left. In place: the records in
 * flight stay where they are; the table is rebuilt smaller only when it is
 * left under 1/16 full. Sets *dropped to how many were dropped; DC_ENOMEM if
 * that rebuild cannot allocate (the records stay where they are). */
static dc_status dc_evict(dc_table *t, uint64_t upto, size_t limit, int *more,
                          uint64_t *dropped_out) {
    uint64_t dropped = 0;
    size_t k = t->jhead, budget = limit ? limit : SIZE_MAX;
    /* The journal is in log order: what is <= upto is a prefix. */
    for (; k < t->jlen && budget; k++, budget--) {
        if (k + 8 < t->jlen) dc_prefetch_slot(t, t->journal[k + 8].digest);
        const dc_jent e = t->journal[k];
        if (e.lsn > upto) break;
        dropped += dc_drop_if(t, e.digest, e.lsn);
    }
    t->jhead = k;
    if (!t->evicting) {
        t->evicting = 1;
        t->lstop = t->llen;
    }
    size_t c = t->lhead;
    for (; c < t->lstop && budget; c++, budget--) {
        if (c + 8 < t->lstop) dc_prefetch_slot(t, t->loaded + 16 * (c + 8));
        dropped += dc_drop_if(t, t->loaded + 16 * c, 0);
    }
    t->lhead = c;
    *more = t->lhead < t->lstop || (t->jhead < t->jlen && t->journal[t->jhead].lsn <= upto);
    dc_consume(t->journal, &t->jhead, &t->jlen, sizeof(dc_jent), !*more);
    dc_consume(t->loaded, &t->lhead, &t->llen, 16, !*more);
    t->lstop -= c - t->lhead; /* the entries moved down by what was consumed */
    if (!*more) {
        t->evicting = 0;
        t->journal = (dc_jent *)dc_trim(t->journal, t->jlen, &t->jcap, sizeof(dc_jent));
        t->loaded = (unsigned char *)dc_trim(t->loaded, t->llen, &t->lcap, 16);
        uint64_t n = t->mask + 1;
        if (n > 1024 && t->count * 16 < n) {
            uint64_t m = 1024;
            while (m * 7 < t->count * 10 * 2) m <<= 1; /* at most 35 % full afterwards */
            if (dc_resize(t, m) != DC_OK) {
                *dropped_out = dropped;
                return DC_ENOMEM;
            }
        }
    }
    *dropped_out = dropped;
    return DC_OK;
}

/* How many records changed after log position after (not yet in LMDB): the
 * journal entries past it that are still their record's latest change. */
static uint64_t dc_dirty(const dc_table *t, uint64_t after) {
    uint64_t n = 0;
    for (size_t k = t->jhead; k < t->jlen; k++) {
        if (k + 8 < t->jlen) dc_prefetch_slot(t, t->journal[k + 8].digest);
        const dc_jent *e = &t->journal[k];
        if (e->lsn <= after) continue;
        const dc_rec *r = dc_find(t, e->digest);
        n += r && r->lsn == e->lsn;
    }
    return n;
}

/* ---- searches of the records in flight, in steps ------------------------- */

/* A record a search found: what the store needs of a claim in flight. */
typedef struct {
    unsigned char digest[16];
    uint64_t token;
    double updated;
    uint16_t ns_id;
} dc_hit;

static inline int dc_scan_match(const dc_rec *r, double deadline_before, double updated_before) {
    return r->state == DC_PROCESSING && r->deadline <= deadline_before &&
           r->updated < updated_before;
}

static inline void dc_hit_of(dc_hit *h, const dc_rec *r) {
    memcpy(h->digest, r->digest, 16);
    h->token = r->token;
    h->updated = r->updated;
    h->ns_id = r->ns_id;
}

/* Starts a search of the records in flight (one at a time: a search begun
 * drops the one before). */
static void dc_scan_begin(dc_table *t) {
    t->scan_on = 1;
    t->scan_epoch = t->epoch;
    t->scan_phase = t->old ? 0 : 1;
    t->scan_pos = 0;
    t->slen = 0;
}

/* Ends the search begun, if any (one given up half way: no more notes of
 * moved records are kept for it). */
static void dc_scan_end(dc_table *t) {
    t->scan_on = 0;
    t->slen = 0;
}

/* Visits up to limit (>= 1) slots and late digests of the search begun, writing to
 * hits (room for max_hits >= 1; the step ends when it is full) the PROCESSING
 * records whose lease deadline is <= deadline_before and last change <
 * updated_before. Sets *n_hits, *visited, and *more (0 once the search is
 * over, or when none was begun). DC_OK.
 *
 * Every record in flight from the search's beginning to its end is visited
 * at least once: the old array is visited before the current one (its
 * records only move into the current array); a grow between two steps moves
 * the search on to the array it leaves behind and the new one after it
 * (dc_grow); a rebuild starts the search over (bumped epoch); a backward
 * shift that moves a record from a slot not yet visited to one visited notes
 * it (dc_scan_moved).
 * A record may be visited twice, so what a caller does with a hit must be
 * harmless done twice. */
static dc_status dc_scan_step(dc_table *t, size_t limit, size_t max_hits, double deadline_before,
                              double updated_before, dc_hit *hits, size_t *n_hits,
                              size_t *visited, int *more) {
    size_t n = 0, budget = limit ? limit : 1;
    if (!max_hits) max_hits = 1;
    *n_hits = *visited = 0;
    *more = 0;
    if (!t->scan_on) return DC_OK;
    if (t->scan_epoch != t->epoch) dc_scan_begin(t); /* the slots moved: start over */
    while (t->slen && budget && n < max_hits) {
        budget--;
        t->slen--;
        const dc_rec *r = dc_find(t, t->scan_late + 16 * t->slen);
        if (r && dc_scan_match(r, deadline_before, updated_before)) dc_hit_of(&hits[n++], r);
    }
    if (t->scan_phase == 0) {
        if (!t->old) { /* its records all moved into the current array, not yet visited */
            t->scan_phase = 1;
            t->scan_pos = 0;
        } else {
            for (; t->scan_pos <= t->old_mask && budget && n < max_hits; t->scan_pos++, budget--) {
                const dc_rec *r = &t->old[t->scan_pos];
                if (dc_live(r) && dc_scan_match(r, deadline_before, updated_before))
                    dc_hit_of(&hits[n++], r);
            }
            if (t->scan_pos > t->old_mask) {
                t->scan_phase = 1;
                t->scan_pos = 0;
            }
        }
    }
    if (t->scan_phase == 1) {
        for (; t->scan_pos <= t->mask && budget && n < max_hits; t->scan_pos++, budget--) {
            if (dc_empty(t, t->scan_pos)) continue;
            const dc_rec *r = &t->slots[t->scan_pos];
            if (dc_scan_match(r, deadline_before, updated_before)) dc_hit_of(&hits[n++], r);
        }
        if (t->scan_pos > t->mask && !t->slen) t->scan_on = 0;
    }
    *n_hits = n;
    *visited = (limit ? limit : 1) - budget;
    *more = t->scan_on;
    return DC_OK;
}

/* ---- the record format (docs/engine.md) -------------------------------- */

#define DC_F_OWNER 0x04
#define DC_F_FP 0x08
#define DC_F_RESULT 0x10
#define DC_F_CREATED 0x20
#define DC_MAX_HEAD 64 /* fixed part + varints, without owner/fp/result */

static inline size_t dc_put_varint(unsigned char *p, uint64_t v) {
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (unsigned char)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (unsigned char)v;
    return n;
}

static inline dc_status dc_get_varint(const unsigned char *p, size_t len, size_t *pos, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (*pos >= len) return DC_ECORRUPT;
        unsigned char b = p[(*pos)++];
        v |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return DC_OK;
        }
    }
    return DC_ECORRUPT;
}

static inline int64_t dc_ms(double seconds) { return (int64_t)llround(seconds * 1000.0); }

/* The stored size of r's value (an upper bound is enough for buffers). */
static inline size_t dc_value_bound(const dc_rec *r) {
    size_t n = DC_MAX_HEAD;
    if (r->extra) n += 2 + r->extra->owner_len + r->extra->fp_len + 10 + r->extra->result_len;
    return n;
}

/* Encodes r's value (without the digest) at out; returns its length. */
static size_t dc_encode_value(const dc_rec *r, unsigned char *out) {
    const dc_extra *e = r->extra;
    int64_t updated = dc_ms(r->updated), created = dc_ms(r->created);
    uint64_t updated_u = updated < 0 ? 0 : (uint64_t)updated;
    unsigned char head = r->state & 0x03;
    if (e && (e->has & DC_HAS_OWNER)) head |= DC_F_OWNER;
    if (e && (e->has & DC_HAS_FP)) head |= DC_F_FP;
    if (e && (e->has & DC_HAS_RESULT)) head |= DC_F_RESULT;
    if (created != updated) head |= DC_F_CREATED;
    size_t n = 0;
    out[n++] = head;
    out[n++] = (unsigned char)(r->ns_id & 0xFF);
    out[n++] = (unsigned char)(r->ns_id >> 8);
    for (int i = 0; i < 6; i++) out[n++] = (unsigned char)(updated_u >> (8 * i));
    if (head & DC_F_CREATED) {
        int64_t delta = updated - created; /* zigzag: a wall clock may step back */
        n += dc_put_varint(out + n, ((uint64_t)delta << 1) ^ (uint64_t)(delta >> 63));
    }
    n += dc_put_varint(out + n, r->token);
    if (r->state == DC_PROCESSING) {
        double ms = ceil((double)r->lease * 1000.0);
        uint32_t lease_ms = ms < 1 ? 1 : ms > 4294967295.0 ? 4294967295u : (uint32_t)ms;
        memcpy(out + n, &lease_ms, 4);
        n += 4;
    }
    if (head & DC_F_OWNER) {
        out[n++] = e->owner_len;
        memcpy(out + n, dc_owner(e), e->owner_len);
        n += e->owner_len;
    }
    if (head & DC_F_FP) {
        out[n++] = e->fp_len;
        memcpy(out + n, dc_fp(e), e->fp_len);
        n += e->fp_len;
    }
    if (head & DC_F_RESULT) {
        n += dc_put_varint(out + n, e->result_len);
        memcpy(out + n, dc_result(e), e->result_len);
        n += e->result_len;
    }
    /* The checksum covers the digest too: a value under another key is damage. */
    uint64_t h = dc_xxh64(r->digest, 16, DC_RECORD_SEED);
    h = dc_xxh64(out, n, h);
    uint32_t sum = (uint32_t)h;
    memcpy(out + n, &sum, 4);
    return n + 4;
}

/* ---- checkpoint export ------------------------------------------------- */

typedef struct {
    uint64_t hi; /* the digest's first 8 bytes, big-endian: orders like memcmp */
    size_t pos;
} dc_pick;

static const unsigned char *dc_sort_base;

static int dc_pick_cmp(const void *a, const void *b) {
    const dc_pick *x = (const dc_pick *)a, *y = (const dc_pick *)b;
    if (x->hi != y->hi) return x->hi < y->hi ? -1 : 1;
    int c = memcmp(dc_sort_base + x->pos + 8, dc_sort_base + y->pos + 8, 8);
    if (c) return c;
    return x->pos < y->pos ? -1 : x->pos > y->pos; /* the later change last */
}

/* Whether pick x sorts after pick y by digest alone (bytes 8..16 read from
 * base, as two big-endian words would compare). */
static inline int dc_pick_after(const dc_pick *x, const dc_pick *y, const unsigned char *base) {
    if (x->hi != y->hi) return x->hi > y->hi;
    return dc_digest_cmp(base + x->pos, base + y->pos) > 0;
}

/* Insertion sort of n picks by digest; equal digests keep their order. */
static void dc_pick_insertion_sort(dc_pick *picks, size_t n, const unsigned char *base) {
    for (size_t i = 1; i < n; i++) {
        dc_pick x = picks[i];
        size_t j = i;
        while (j > 0 && dc_pick_after(&picks[j - 1], &x, base)) {
            picks[j] = picks[j - 1];
            j--;
        }
        picks[j] = x;
    }
}

/* Sorts n picks of base into dc_pick_cmp's order: by digest, a digest's picks
 * in position order. Digests are hashes, spread evenly: the picks are dealt
 * into about n/2 buckets by the top bits of hi in one counting pass and one
 * scattering pass, which keeps the position order of equal digests (the picks
 * come in position order), and each bucket of a few is sorted by insertion,
 * which keeps it too. A crowded bucket (digests not spread evenly) goes to
 * qsort with dc_pick_cmp, and so does everything without the memory for the
 * buckets: a checkpoint of a million records sorted in a few tens of ms
 * instead of qsort's hundreds, each compare a call. Uses dc_sort_base. */
static void dc_sort_picks(dc_pick *picks, size_t n, const unsigned char *base) {
    dc_sort_base = base;
    if (n < 64) {
        dc_pick_insertion_sort(picks, n, base);
        return;
    }
    unsigned bits = 4;
    while (bits < 20 && ((size_t)2 << bits) < n) bits++;
    size_t nb = (size_t)1 << bits;
    size_t *start = (size_t *)calloc(nb + 1, sizeof(size_t));
    dc_pick *dealt = (dc_pick *)malloc(n * sizeof(dc_pick));
    if (start == NULL || dealt == NULL) {
        free(start);
        free(dealt);
        qsort(picks, n, sizeof(dc_pick), dc_pick_cmp);
        return;
    }
    for (size_t i = 0; i < n; i++) start[(picks[i].hi >> (64 - bits)) + 1]++;
    for (size_t b = 0; b < nb; b++) start[b + 1] += start[b];
    for (size_t i = 0; i < n; i++) dealt[start[picks[i].hi >> (64 - bits)]++] = picks[i];
    /* start[b] is now the end of bucket b, and the start of bucket b + 1. */
    size_t from = 0;
    for (size_t b = 0; b < nb; b++) {
        size_t size = start[b] - from;
        if (size > 32)
            qsort(dealt + from, size, sizeof(dc_pick), dc_pick_cmp);
        else
            dc_pick_insertion_sort(dealt + from, size, base);
        from = start[b];
    }
    memcpy(picks, dealt, n * sizeof(dc_pick));
    free(start);
    free(dealt);
}

/* Writes the n packed records of in (len bytes) to out (room for len bytes)
 * in digest order, each digest once: of a digest packed several times only
 * the last (its latest change) is kept. Sets *out_len and *kept. DC_ENOMEM,
 * or DC_ECORRUPT for a buffer that does not hold n records. Not reentrant (a
 * crowded bucket's qsort has no context argument): callers serialise it. */
static dc_status dc_sort_packed(const unsigned char *in, size_t len, size_t n, unsigned char *out,
                          size_t *out_len, size_t *kept) {
    dc_pick *picks = (dc_pick *)malloc((n ? n : 1) * sizeof(dc_pick));
    if (!picks) return DC_ENOMEM;
    size_t pos = 0;
    for (size_t k = 0; k < n; k++) {
        if (pos + 20 > len) {
            free(picks);
            return DC_ECORRUPT;
        }
        picks[k].hi = dc_digest_top(in + pos);
        picks[k].pos = pos;
        uint32_t vlen = (uint32_t)in[pos + 16] | ((uint32_t)in[pos + 17] << 8) |
                        ((uint32_t)in[pos + 18] << 16) | ((uint32_t)in[pos + 19] << 24);
        pos += 20 + (size_t)vlen;
    }
    if (pos != len) {
        free(picks);
        return DC_ECORRUPT;
    }
    dc_sort_picks(picks, n, in);
    size_t o = 0, m = 0;
    for (size_t k = 0; k < n; k++) {
        const unsigned char *p = in + picks[k].pos;
        /* equal digests sort by position: the next one is a later change */
        if (k + 1 < n && memcmp(p, in + picks[k + 1].pos, 16) == 0) continue;
        uint32_t vlen = (uint32_t)p[16] | ((uint32_t)p[17] << 8) | ((uint32_t)p[18] << 16) |
                        ((uint32_t)p[19] << 24);
        memcpy(out + o, p, 20 + (size_t)vlen);
        o += 20 + (size_t)vlen;
        m++;
    }
    free(picks);
    *out_len = o;
    *kept = m;
    return DC_OK;
}

/* Decodes a value stored under digest into r (lsn 0, deadline 0, a new blob).
 * DC_ECORRUPT if the bytes are damaged, DC_ENOMEM on allocation failure. */
static dc_status dc_decode_value(const unsigned char *digest, const unsigned char *p, size_t len,
                           dc_rec *r) {
    if (len < 14) return DC_ECORRUPT;
    uint32_t sum;
    memcpy(&sum, p + len - 4, 4);
    uint64_t h = dc_xxh64(digest, 16, DC_RECORD_SEED);
    if ((uint32_t)dc_xxh64(p, len - 4, h) != sum) return DC_ECORRUPT;
    len -= 4;
    unsigned char head = p[0];
    if ((head & 0x03) == 0 || (head & 0xC0)) return DC_ECORRUPT;
    memset(r, 0, sizeof(*r));
    memcpy(r->digest, digest, 16);
    r->state = head & 0x03;
    r->ns_id = (uint16_t)(p[1] | (p[2] << 8));
    uint64_t updated = 0;
    for (int i = 0; i < 6; i++) updated |= (uint64_t)p[3 + i] << (8 * i);
    size_t pos = 9;
    int64_t created = (int64_t)updated;
    if (head & DC_F_CREATED) {
        uint64_t z;
        if (dc_get_varint(p, len, &pos, &z) != DC_OK) return DC_ECORRUPT;
        created = (int64_t)updated - (int64_t)((z >> 1) ^ (~(z & 1) + 1));
    }
    r->updated = (double)updated / 1000.0;
    r->created = (double)created / 1000.0;
    if (dc_get_varint(p, len, &pos, &r->token) != DC_OK || r->token == 0) return DC_ECORRUPT;
    if (r->state == DC_PROCESSING) {
        uint32_t lease_ms;
        if (pos + 4 > len) return DC_ECORRUPT;
        memcpy(&lease_ms, p + pos, 4);
        pos += 4;
        r->lease = (float)(lease_ms / 1000.0);
    }
    const unsigned char *owner = NULL, *fp = NULL, *result = NULL;
    size_t owner_len = 0, fp_len = 0;
    uint64_t result_len = 0;
    if (head & DC_F_OWNER) {
        if (pos >= len) return DC_ECORRUPT;
        owner_len = p[pos++];
        if (pos + owner_len > len) return DC_ECORRUPT;
        owner = p + pos;
        pos += owner_len;
    }
    if (head & DC_F_FP) {
        if (pos >= len) return DC_ECORRUPT;
        fp_len = p[pos++];
        if (pos + fp_len > len) return DC_ECORRUPT;
        fp = p + pos;
        pos += fp_len;
    }
    if (head & DC_F_RESULT) {
        if (dc_get_varint(p, len, &pos, &result_len) != DC_OK || result_len > len - pos) return DC_ECORRUPT;
        result = p + pos;
        pos += result_len;
    }
    if (pos != len) return DC_ECORRUPT;
    int oom = 0;
    r->extra = dc_extra_new(owner, owner_len, head & DC_F_OWNER, fp, fp_len, head & DC_F_FP,
                            result, (size_t)result_len, head & DC_F_RESULT, &oom);
    return oom ? DC_ENOMEM : DC_OK;
}

/* ---- staging: the records a batch is about to write -------------------- */

typedef struct {
    dc_rec *recs;      /* staged records, in batch order */
    int32_t *map;      /* open addressing over recs by digest, -1 = empty */
    uint64_t map_mask;
    size_t n;
} dc_stage;

static dc_status dc_stage_init(dc_stage *s, size_t cap) {
    uint64_t m = 16;
    while (m < cap * 2) m <<= 1;
    s->recs = (dc_rec *)malloc((cap ? cap : 1) * sizeof(dc_rec));
    s->map = (int32_t *)malloc(m * sizeof(int32_t));
    if (!s->recs || !s->map) {
        free(s->recs);
        free(s->map);
        s->recs = NULL;
        s->map = NULL;
        return DC_ENOMEM;
    }
    memset(s->map, 0xFF, m * sizeof(int32_t));
    s->map_mask = m - 1;
    s->n = 0;
    return DC_OK;
}

/* Releases the stage and the blob references its records hold. */
static void dc_stage_free(dc_stage *s) {
    if (s->recs)
        for (size_t i = 0; i < s->n; i++) dc_decref(s->recs[i].extra);
    free(s->recs);
    free(s->map);
    s->recs = NULL;
    s->map = NULL;
    s->n = 0;
}

static inline dc_rec *dc_stage_find(const dc_stage *s, const unsigned char *digest,
                                    uint64_t *slot) {
    uint64_t i = dc_slot_of(digest) & s->map_mask;
    for (;;) {
        int32_t k = s->map[i];
        if (k < 0) {
            *slot = i;
            return NULL;
        }
        if (memcmp(s->recs[k].digest, digest, 16) == 0) {
            *slot = i;
            return &s->recs[k];
        }
        i = (i + 1) & s->map_mask;
    }
}

/* Stages r (taking over its blob reference) in map slot `slot` or over `existing`. */
static inline void dc_stage_put(dc_stage *s, dc_rec *existing, uint64_t slot, const dc_rec *r) {
    if (existing) {
        dc_decref(existing->extra);
        *existing = *r;
    } else {
        s->recs[s->n] = *r;
        s->map[slot] = (int32_t)s->n;
        s->n++;
    }
}

/* ---- the claim decision --------------------------------------------------- */

/* The record of digest d among n records sorted by digest, or NULL.
 *
 * Digests are hashes, spread evenly, so the search starts where d's first 8
 * bytes fall among n and gallops from there: 1-3 compares for a batch's
 * thousand records against a binary search's 10, each a branch the CPU
 * cannot predict. Any other order of digests is answered the same, with more
 * compares (docs/engine.md, "Records read for a claim"). */
static inline const dc_rec *dc_side_find(const dc_rec *side, size_t n, const unsigned char *d) {
    if (n == 0) return NULL;
    double at = (double)dc_digest_top(d) / 18446744073709551616.0 * (double)n;
    size_t g = at >= (double)(n - 1) ? n - 1 : (size_t)at;
    int c = dc_digest_cmp(side[g].digest, d);
    if (c == 0) return &side[g];
    size_t lo, hi, step = 1; /* the digest, if there, is in [lo, hi) */
    if (c < 0) {
        lo = g + 1;
        hi = n;
        while (lo + step - 1 < n) { /* gallop up: side[lo - 1] < d */
            size_t i = lo + step - 1;
            c = dc_digest_cmp(side[i].digest, d);
            if (c == 0) return &side[i];
            if (c > 0) {
                hi = i;
                break;
            }
            lo = i + 1;
            step <<= 1;
        }
    } else {
        lo = 0;
        hi = g;
        while (hi >= step) { /* gallop down: d < side[hi] */
            size_t i = hi - step;
            c = dc_digest_cmp(side[i].digest, d);
            if (c == 0) return &side[i];
            if (c < 0) {
                lo = i + 1;
                break;
            }
            hi = i;
            step <<= 1;
        }
    }
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        c = dc_digest_cmp(side[mid].digest, d);
        if (c == 0) return &side[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

/* The record of digest d for a claim: among the n records read for it (side,
 * sorted; dc_read_records), then in the table. The records read are all of
 * digests the table lacked, and dc_read_records put none of them there, so
 * looking beside the table first saves the table's probe (a cache miss) for
 * the keys it does not hold. */
static inline const dc_rec *dc_find_beside(const dc_table *t, const dc_rec *side, size_t n,
                                           const unsigned char *d) {
    const dc_rec *r = n ? dc_side_find(side, n, d) : NULL;
    return r ? r : dc_find(t, d);
}

static int dc_rec_digest_cmp(const void *a, const void *b) {
    return dc_digest_cmp(((const dc_rec *)a)->digest, ((const dc_rec *)b)->digest);
}

/* Records read from LMDB: n (digest, stored bytes) values, decoded and put in
 * the table as clean copies (lsn 0; a PROCESSING one with a fresh lease from
 * now_m), where it has none. For a claim batch (side not NULL; docs/engine.md,
 * "Records read for a claim"), a PROCESSED record, which the claim only reads
 * (DUPLICATE, or a fingerprint conflict), goes into side instead (sorted by
 * digest; *side_n of them): putting it in the table, and evicting it again
 * later, cost more than reading it again from LMDB. *bad is the index of the
 * first value that fails its checksum (DC_ECORRUPT; nothing after it is read).
 * The caller frees side's blobs (dc_decref) and side itself. */
static dc_status dc_read_records(dc_table *t, const unsigned char *digests,
                                 const unsigned char *const *values, const size_t *lens, size_t n,
                                 double now_m, dc_rec *side, size_t *side_n, size_t *bad) {
    size_t m = 0;
    dc_status rc = DC_OK;
    for (size_t i = 0; i < n && rc == DC_OK; i++) {
        const unsigned char *d = digests + 16 * i;
        if (i + 8 < n) dc_prefetch_slot(t, digests + 16 * (i + 8));
        if (dc_find(t, d) != NULL) continue;
        dc_rec r;
        rc = dc_decode_value(d, values[i], lens[i], &r);
        if (rc == DC_ECORRUPT) {
            *bad = i;
            break;
        }
        if (rc != DC_OK) break;
        if (side && r.state == DC_PROCESSED) {
            side[m++] = r;
            continue;
        }
        if (r.state == DC_PROCESSING) r.deadline = now_m + r.lease;
        rc = dc_put(t, &r, 1);
        dc_decref(r.extra);
    }
    /* LMDB gives a slice's records in digest order: sorted already, unless the
     * batch was read from several slices (or arrived in another order). */
    size_t k = 1;
    while (k < m && dc_digest_cmp(side[k - 1].digest, side[k].digest) < 0)
        k++;
    if (k < m) qsort(side, m, sizeof(dc_rec), dc_rec_digest_cmp);
    *side_n = m;
    return rc;
}

typedef struct {
    /* inputs */
    const unsigned char *digests; /* n * 16 */
    size_t n;
    const unsigned char *const *fps; /* per key, NULL = none; or fps == NULL */
    const size_t *fp_lens;
    const unsigned char *owner; /* NULL = none */
    size_t owner_len;
    const unsigned char *cold; /* per key 1 = in a cold slice (for keys with no record) */
    /* PROCESSED records read from LMDB and left out of the table, sorted by digest
     * (dc_read_records), of digests the table lacks: a key is looked up here
     * first, then in the table. NULL = none. */
    const dc_rec *side;
    size_t side_n;
    uint16_t ns_id;
    float lease;
    double now_w, now_m;
    /* outputs */
    unsigned char *outcomes;
    uint64_t *tokens;
    const dc_extra **dup_extra; /* DUPLICATE answers: the record's blob (result) */
    uint64_t depends;
    int64_t conflict; /* index of a fingerprint conflict, -1 if none */
    uint64_t takeovers, n_new, n_dup, n_busy, n_writes;
} dc_claim_io;

/* Decides a claim batch against the table, staging new records in s.
 * Returns DC_OK, DC_ECONFLICT on a fingerprint conflict (io->conflict set,
 * nothing staged that matters: the caller drops the stage), DC_ENOMEM on
 * allocation failure. */
static dc_status dc_decide_claim(const dc_table *t, dc_stage *s, dc_claim_io *io) {
    dc_extra *owner_blob = NULL; /* shared by the batch's new records without a fingerprint */
    int oom = 0;
    if (io->owner) {
        owner_blob = dc_extra_new(io->owner, io->owner_len, 1, NULL, 0, 0, NULL, 0, 0, &oom);
        if (oom) return DC_ENOMEM;
    }
    double deadline = io->now_m + (double)io->lease;
    io->conflict = -1;
    io->depends = io->takeovers = io->n_new = io->n_dup = io->n_busy = io->n_writes = 0;
    dc_status rc = DC_OK;
    for (size_t i = 0; i < io->n; i++) {
        const unsigned char *d = io->digests + 16 * i;
        if (i + 8 < io->n) dc_prefetch_slot(t, io->digests + 16 * (i + 8));
        uint64_t slot;
        dc_rec *staged = dc_stage_find(s, d, &slot);
        const dc_rec *r = staged ? staged : dc_find_beside(t, io->side, io->side_n, d);
        const unsigned char *fp = io->fps ? io->fps[i] : NULL;
        size_t fp_len = fp ? io->fp_lens[i] : 0;
        int takeover = 0;
        io->dup_extra[i] = NULL;
        if (r && r->state != DC_RELEASED) {
            const dc_extra *e = r->extra;
            if (fp && e && (e->has & DC_HAS_FP) && !dc_bytes_eq(fp, fp_len, dc_fp(e), e->fp_len)) {
                io->conflict = (int64_t)i;
                rc = DC_ECONFLICT;
                break;
            }
            if (!staged && r->lsn > io->depends) io->depends = r->lsn;
            if (r->state == DC_PROCESSED) {
                io->outcomes[i] = DC_DUPLICATE;
                io->tokens[i] = r->token;
                io->dup_extra[i] = e;
                io->n_dup++;
                continue;
            }
            if (io->owner && e && (e->has & DC_HAS_OWNER) &&
                dc_bytes_eq(io->owner, io->owner_len, dc_owner(e), e->owner_len)) {
                /* Its own claim back: the lease is renewed in memory only. */
                dc_rec renewed = *r;
                renewed.deadline = deadline;
                if (!staged) {
                    renewed.renewal = 1;
                    dc_incref(renewed.extra);
                    dc_stage_put(s, NULL, slot, &renewed);
                } else {
                    staged->deadline = deadline;
                }
                io->outcomes[i] = DC_NEW;
                io->tokens[i] = r->token;
                io->n_new++;
                continue;
            }
            if (r->deadline > io->now_m) {
                io->outcomes[i] = DC_IN_PROGRESS;
                io->tokens[i] = r->token;
                io->n_busy++;
                continue;
            }
            takeover = 1;
        } else if (!r && io->cold && io->cold[i]) {
            io->outcomes[i] = DC_DUPLICATE_COLD;
            io->tokens[i] = 0;
            io->n_dup++;
            continue;
        }
        dc_rec nr;
        memset(&nr, 0, sizeof(nr));
        memcpy(nr.digest, d, 16);
        nr.state = DC_PROCESSING;
        nr.ns_id = io->ns_id;
        nr.token = r ? r->token + 1 : 1;
        nr.created = takeover ? r->created : io->now_w;
        nr.updated = io->now_w;
        nr.lease = io->lease;
        nr.deadline = deadline;
        /* A takeover keeps the first claim's fingerprint when none is given. */
        const unsigned char *keep_fp = fp;
        size_t keep_len = fp_len;
        if (!fp && takeover && r->extra && (r->extra->has & DC_HAS_FP)) {
            keep_fp = dc_fp(r->extra);
            keep_len = r->extra->fp_len;
        }
        if (keep_fp) {
            nr.extra = dc_extra_new(io->owner, io->owner_len, io->owner != NULL, keep_fp,
                                    keep_len, 1, NULL, 0, 0, &oom);
            if (oom) {
                rc = DC_ENOMEM;
                break;
            }
        } else {
            nr.extra = owner_blob;
            dc_incref(owner_blob);
        }
        dc_stage_put(s, staged, slot, &nr);
        io->outcomes[i] = takeover ? DC_NEW_TAKEOVER : DC_NEW;
        io->tokens[i] = nr.token;
        io->takeovers += takeover;
        io->n_new++;
    }
    dc_decref(owner_blob);
    if (rc == DC_OK)
        for (size_t k = 0; k < s->n; k++) io->n_writes += !s->recs[k].renewal;
    return rc;
}

/* ---- the complete / release decision ------------------------------------- */

/* Whether token holds r: 0 when r is PROCESSING with it, else why not
 * (DC_ERR_NOT_CLAIMED, DC_ERR_WRONG_TOKEN, DC_ERR_COMPLETED). */
static inline int dc_token_kind(const dc_rec *r, uint64_t token) {
    if (!r || r->state == DC_RELEASED) return DC_ERR_NOT_CLAIMED;
    if (r->token != token) return DC_ERR_WRONG_TOKEN;
    return r->state == DC_PROCESSED ? DC_ERR_COMPLETED : 0;
}

typedef struct {
    const unsigned char *digests;
    size_t n;
    const uint64_t *tokens;
    const unsigned char *const *results; /* per item, NULL = no result; or results == NULL */
    const size_t *result_lens;
    uint8_t state; /* DC_PROCESSED or DC_RELEASED */
    double now_w;
    uint64_t depends;
    int64_t error_index;
    int error_kind;
    uint64_t current_token;
    uint64_t n_writes;
} dc_change_io;

/* Decides a complete/release batch against the table, staging the changed
 * records in s. DC_ECONFLICT at the first item that cannot change (io's
 * error_index, error_kind and current_token say which and why), DC_ENOMEM on
 * allocation failure. */
static dc_status dc_decide_change(const dc_table *t, dc_stage *s, dc_change_io *io) {
    io->depends = io->n_writes = 0;
    io->error_index = -1;
    io->error_kind = 0;
    for (size_t i = 0; i < io->n; i++) {
        const unsigned char *d = io->digests + 16 * i;
        uint64_t slot;
        dc_rec *staged = dc_stage_find(s, d, &slot);
        const dc_rec *r = staged ? staged : dc_find(t, d);
        int kind = dc_token_kind(r, io->tokens[i]);
        if (kind == DC_ERR_COMPLETED && io->state == DC_PROCESSED) {
            /* a retried completion: already done */
            if (!staged && r->lsn > io->depends) io->depends = r->lsn;
            continue;
        }
        if (kind) {
            io->error_index = (int64_t)i;
            io->error_kind = kind;
            io->current_token = r ? r->token : 0;
            return DC_ECONFLICT;
        }
        dc_rec nr = *r;
        nr.state = io->state;
        nr.updated = io->now_w;
        nr.renewal = 0;
        nr.deadline = 0;
        const dc_extra *e = r->extra;
        const unsigned char *res = io->results ? io->results[i] : NULL;
        int has_owner = e && (e->has & DC_HAS_OWNER), has_fp = e && (e->has & DC_HAS_FP);
        int has_res = io->state == DC_PROCESSED && res != NULL;
        int oom = 0;
        nr.extra = dc_extra_new(has_owner ? dc_owner(e) : NULL, has_owner ? e->owner_len : 0,
                                has_owner, has_fp ? dc_fp(e) : NULL, has_fp ? e->fp_len : 0,
                                has_fp, res, has_res ? io->result_lens[i] : 0, has_res, &oom);
        if (oom) return DC_ENOMEM;
        dc_stage_put(s, staged, slot, &nr);
    }
    io->n_writes = s->n;
    return DC_OK;
}

/* ---- the extend (lease renewal) decision ---------------------------------- */

typedef struct {
    const unsigned char *digests;
    size_t n;
    const uint64_t *tokens;
    float lease;
    double now_m;
    int64_t error_index;
    int error_kind;
    uint64_t current_token;
} dc_extend_io;

/* Decides a renewal batch against the table, staging each claim with deadline
 * now_m + lease (and that lease) as a renewal: kept in memory, not logged, as an
 * owner's re-claim is (docs/reliability.md, "Heartbeats"). A claim is renewed
 * while its token is the key's current one and the key is PROCESSING, its lease
 * run out or not. DC_ECONFLICT at the first item that cannot be renewed (io's
 * error_index, error_kind and current_token say which and why; nothing that
 * matters is staged), DC_ENOMEM on allocation failure. */
static dc_status dc_decide_extend(const dc_table *t, dc_stage *s, dc_extend_io *io) {
    double deadline = io->now_m + (double)io->lease;
    io->error_index = -1;
    io->error_kind = 0;
    for (size_t i = 0; i < io->n; i++) {
        const unsigned char *d = io->digests + 16 * i;
        uint64_t slot;
        dc_rec *staged = dc_stage_find(s, d, &slot);
        const dc_rec *r = staged ? staged : dc_find(t, d);
        int kind = dc_token_kind(r, io->tokens[i]);
        if (kind) {
            io->error_index = (int64_t)i;
            io->error_kind = kind;
            io->current_token = r ? r->token : 0;
            return DC_ECONFLICT;
        }
        if (staged) {
            staged->deadline = deadline;
            staged->lease = io->lease;
            continue;
        }
        dc_rec renewed = *r;
        renewed.deadline = deadline;
        renewed.lease = io->lease;
        renewed.renewal = 1;
        dc_incref(renewed.extra);
        dc_stage_put(s, NULL, slot, &renewed);
    }
    return DC_OK;
}

/* Puts the staged records into the table with log position lsn (renewals keep
 * theirs). DC_ENOMEM on allocation failure. */
static dc_status dc_apply(dc_table *t, const dc_stage *s, uint64_t lsn) {
    for (size_t i = 0; i < s->n; i++) {
        /* The slots of a large table are cache misses: fetch eight records ahead. */
        if (i + 8 < s->n) dc_prefetch_slot(t, s->recs[i + 8].digest);
        dc_rec r = s->recs[i];
        if (!r.renewal) r.lsn = lsn;
        if (dc_put(t, &r, !r.renewal) != DC_OK) return DC_ENOMEM;
    }
    return DC_OK;
}

#endif /* DC_ENGINE_H */
