/*
 * test_headers.c - C-level tests of the native core's headers (ext/dc_*.h).
 *
 * Built and run by tests/unit/test_native_headers.py under
 * -fsanitize=address,undefined, so an out-of-bounds access, a leak or
 * undefined behaviour in the headers fails the suite even where the Cython
 * wrappers never reach it. Every header is included twice, to check that
 * each is guarded whole. With an argument "xxh64" it prints the XXH64 of
 * a fixed set of inputs instead, for the Python side to compare with the
 * xxhash library.
 */
#include "dc_status.h"
#include "dc_hash.h"
#include "dc_fuse.h"
#include "dc_engine.h"
#include "dc_sync.h"
#include "dc_wire.h"
#include "dc_mdb.h"
#include "dc_status.h"
#include "dc_hash.h"
#include "dc_fuse.h"
#include "dc_engine.h"
#include "dc_sync.h"
#include "dc_wire.h"
#include "dc_mdb.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

static int checks, failures;

#define CHECK(cond)                                                                    \
    do {                                                                               \
        checks++;                                                                      \
        if (!(cond)) {                                                                 \
            failures++;                                                                \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);   \
        }                                                                              \
    } while (0)

/* A 16-byte digest made from i, as the store's digests are: uniform bytes. */
static void digest_of(uint64_t i, unsigned char d[16]) {
    uint64_t a = dc_xxh64(&i, 8, 1), b = dc_xxh64(&i, 8, 2);
    memcpy(d, &a, 8);
    memcpy(d + 8, &b, 8);
}

static void test_status(void) {
    dc_status all[] = {DC_OK, DC_ENOMEM, DC_ECORRUPT, DC_ECONFLICT, DC_ETOOBIG, DC_EBUILD};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        CHECK(dc_status_str(all[i]) != NULL);
        for (size_t j = 0; j < i; j++) CHECK(strcmp(dc_status_str(all[i]), dc_status_str(all[j])));
    }
    CHECK(DC_OK == 0);
}

static void test_blocks(void) {
    uint64_t nblocks = 64;
    uint64_t *blocks = (uint64_t *)dc_alloc_body(nblocks * DC_BLOCK_BYTES);
    CHECK(blocks != NULL);
    uint64_t h[1000];
    unsigned char flags[1000];
    for (int i = 0; i < 1000; i++) {
        h[i] = dc_xxh64(&i, sizeof(i), 7);
        flags[i] = 0;
    }
    uint64_t added = dc_add_batch(blocks, nblocks, h, 1000, flags);
    CHECK(added > 900 && added <= 1000);
    memset(flags, 0, sizeof(flags));
    dc_contains_batch(blocks, nblocks, h, 1000, flags);
    int all = 1;
    for (int i = 0; i < 1000; i++) all &= flags[i];
    CHECK(all);
    for (int i = 0; i < 1000; i++) CHECK(dc_block_index(h[i], nblocks) < nblocks);
    dc_free_body(blocks, nblocks * DC_BLOCK_BYTES);
}

static void test_jump(void) {
    /* In range, and a key only ever moves to the bucket being added. */
    for (uint64_t k = 0; k < 2000; k++) {
        uint64_t key = dc_xxh64(&k, 8, 3);
        int32_t prev = dc_jump(key, 1);
        CHECK(prev == 0);
        for (int32_t n = 2; n <= 64; n++) {
            int32_t b = dc_jump(key, n);
            CHECK(b >= 0 && b < n);
            CHECK(b == prev || b == n - 1);
            prev = b;
        }
    }
}

static void test_varint(void) {
    uint64_t values[] = {0, 1, 127, 128, 300, 1ull << 35, UINT64_MAX};
    for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); i++) {
        unsigned char buf[16];
        size_t n = dc_put_varint(buf, values[i]), pos = 0;
        uint64_t out = 0;
        CHECK(dc_get_varint(buf, n, &pos, &out) == DC_OK && out == values[i] && pos == n);
        pos = 0;
        if (n > 1) CHECK(dc_get_varint(buf, n - 1, &pos, &out) == DC_ECORRUPT);
    }
    unsigned char endless[11];
    memset(endless, 0xFF, sizeof(endless));
    size_t pos = 0;
    uint64_t out;
    CHECK(dc_get_varint(endless, sizeof(endless), &pos, &out) == DC_ECORRUPT);
}

static void test_record_format(void) {
    dc_rec r;
    memset(&r, 0, sizeof(r));
    digest_of(42, r.digest);
    r.state = DC_PROCESSED;
    r.token = 7;
    r.ns_id = 3;
    r.created = 1700000000.250;
    r.updated = 1700000100.500;
    int oom = 0;
    const unsigned char owner[] = "consumer-1", fp[] = "fingerprint", result[] = "ok";
    r.extra = dc_extra_new(owner, 10, 1, fp, 11, 1, result, 2, 1, &oom);
    CHECK(!oom && r.extra != NULL);

    unsigned char *buf = (unsigned char *)malloc(dc_value_bound(&r));
    size_t len = dc_encode_value(&r, buf);
    CHECK(len > 14 && len <= dc_value_bound(&r));
    dc_rec back;
    CHECK(dc_decode_value(r.digest, buf, len, &back) == DC_OK);
    CHECK(back.state == DC_PROCESSED && back.token == 7 && back.ns_id == 3);
    CHECK(back.created == r.created && back.updated == r.updated);
    CHECK(back.extra && back.extra->owner_len == 10 && back.extra->fp_len == 11);
    CHECK(back.extra && back.extra->result_len == 2 && !memcmp(dc_result(back.extra), "ok", 2));
    dc_decref(back.extra);

    /* Every flipped bit, every truncation and another digest are damage. */
    for (size_t i = 0; i < len; i++) {
        for (int bit = 0; bit < 8; bit++) {
            buf[i] ^= (unsigned char)(1u << bit);
            dc_rec x;
            x.extra = NULL;
            CHECK(dc_decode_value(r.digest, buf, len, &x) == DC_ECORRUPT);
            buf[i] ^= (unsigned char)(1u << bit);
        }
    }
    for (size_t cut = 0; cut < len; cut++) {
        dc_rec x;
        CHECK(dc_decode_value(r.digest, buf, cut, &x) == DC_ECORRUPT);
    }
    unsigned char other[16];
    digest_of(43, other);
    dc_rec x;
    CHECK(dc_decode_value(other, buf, len, &x) == DC_ECORRUPT);
    free(buf);
    dc_decref(r.extra);
}

/* Claims n keys through the decision, staging and apply, as a batch. */
static dc_status claim_batch(dc_table *t, const unsigned char *digests, size_t n,
                             const unsigned char *const *fps, const size_t *fp_lens,
                             double now, unsigned char *outc, uint64_t *toks, uint64_t lsn,
                             int64_t *conflict) {
    dc_stage s;
    const dc_extra **dups = (const dc_extra **)malloc(n * sizeof(void *));
    dc_claim_io io;
    memset(&io, 0, sizeof(io));
    io.digests = digests;
    io.n = n;
    io.fps = fps;
    io.fp_lens = fp_lens;
    io.lease = 30.0f;
    io.now_w = now;
    io.now_m = now;
    io.outcomes = outc;
    io.tokens = toks;
    io.dup_extra = dups;
    dc_status rc = dc_stage_init(&s, n);
    if (rc == DC_OK) {
        rc = dc_decide_claim(t, &s, &io);
        if (rc == DC_OK) rc = dc_apply(t, &s, lsn);
        dc_stage_free(&s);
    }
    *conflict = io.conflict;
    free(dups);
    return rc;
}

static void test_table(void) {
    enum { N = 20000 };
    dc_table t;
    CHECK(dc_table_init(&t, 16) == DC_OK);
    unsigned char *digests = (unsigned char *)malloc(16 * N);
    for (uint64_t i = 0; i < N; i++) digest_of(i, digests + 16 * i);
    unsigned char *outc = (unsigned char *)malloc(N);
    uint64_t *toks = (uint64_t *)malloc(N * sizeof(uint64_t));
    int64_t conflict;

    /* A first batch is all NEW (the table grows on the way), a second all IN_PROGRESS. */
    CHECK(claim_batch(&t, digests, N, NULL, NULL, 1000.0, outc, toks, 1, &conflict) == DC_OK);
    int all = 1;
    for (size_t i = 0; i < N; i++) all &= outc[i] == DC_NEW && toks[i] == 1;
    CHECK(all);
    CHECK(t.count == N && t.inflight == N);
    CHECK(claim_batch(&t, digests, N, NULL, NULL, 1001.0, outc, toks, 2, &conflict) == DC_OK);
    all = 1;
    for (size_t i = 0; i < N; i++) all &= outc[i] == DC_IN_PROGRESS;
    CHECK(all);
    for (uint64_t i = 0; i < N; i += 97) CHECK(dc_find(&t, digests + 16 * i) != NULL);

    /* Completing with a wrong token is refused at that item; with the right one it holds. */
    dc_stage s;
    dc_change_io ch;
    memset(&ch, 0, sizeof(ch));
    uint64_t *tokens = (uint64_t *)malloc(N * sizeof(uint64_t));
    for (size_t i = 0; i < N; i++) tokens[i] = 1;
    tokens[5] = 9;
    ch.digests = digests;
    ch.n = N;
    ch.tokens = tokens;
    ch.state = DC_PROCESSED;
    ch.now_w = 1002.0;
    CHECK(dc_stage_init(&s, N) == DC_OK);
    CHECK(dc_decide_change(&t, &s, &ch) == DC_ECONFLICT);
    CHECK(ch.error_index == 5 && ch.error_kind == DC_ERR_WRONG_TOKEN && ch.current_token == 1);
    dc_stage_free(&s);
    tokens[5] = 1;
    CHECK(dc_stage_init(&s, N) == DC_OK);
    CHECK(dc_decide_change(&t, &s, &ch) == DC_OK);
    CHECK(dc_apply(&t, &s, 3) == DC_OK);
    dc_stage_free(&s);
    CHECK(claim_batch(&t, digests, N, NULL, NULL, 1003.0, outc, toks, 4, &conflict) == DC_OK);
    all = 1;
    for (size_t i = 0; i < N; i++) all &= outc[i] == DC_DUPLICATE;
    CHECK(all);

    /* A fingerprint conflict is an answer, not an error: nothing is applied. */
    unsigned char fresh[16 * 2];
    digest_of(N + 1, fresh);
    digest_of(N + 2, fresh + 16);
    const unsigned char *fps[2] = {(const unsigned char *)"aa", (const unsigned char *)"bb"};
    size_t fp_lens[2] = {2, 2};
    CHECK(claim_batch(&t, fresh, 1, fps, fp_lens, 1004.0, outc, toks, 5, &conflict) == DC_OK);
    CHECK(claim_batch(&t, fresh, 1, fps + 1, fp_lens + 1, 1005.0, outc, toks, 6, &conflict) ==
          DC_ECONFLICT);
    CHECK(conflict == 0);

    /* The checkpoint's export sorts; a buffer that does not hold its records is damage. */
    dc_export x;
    dc_take_changes(&t, &x);
    CHECK(x.n >= 2 * N);
    unsigned char *out = (unsigned char *)malloc(x.items_len ? x.items_len : 1);
    size_t out_len = 0, kept = 0;
    CHECK(dc_sort_packed(x.items, x.items_len, x.n, out, &out_len, &kept) == DC_OK);
    CHECK(kept == N + 1);
    CHECK(dc_sort_packed(x.items, x.items_len - 1, x.n, out, &out_len, &kept) == DC_ECORRUPT);
    CHECK(dc_sort_packed(x.items, x.items_len, x.n + 1, out, &out_len, &kept) == DC_ECORRUPT);
    free(out);
    CHECK(dc_give_back(&t, &x) == DC_OK);
    CHECK(dc_dirty(&t, 0) == N + 1);

    /* Eviction drops the settled records LMDB holds and shrinks the table. */
    int more = 1;
    uint64_t dropped = 0;
    CHECK(dc_evict(&t, 10, 0, &more, &dropped) == DC_OK);
    CHECK(!more && dropped == N);
    CHECK(t.count == 1);

    dc_take_changes(&t, &x);
    free(x.items);
    free(tokens);
    free(toks);
    free(outc);
    free(digests);
    dc_table_free(&t);
}

/* Records read from LMDB for a claim: the settled ones beside the table, sorted;
 * the others in it; a damaged value named by its index. */
/* dc_side_find on orders its first guess does not expect: every digest sharing
 * its first 8 bytes, digests packed at either end, a lone record, and digests
 * between and beyond the ones held. Each is checked against a linear scan. */
/* dc_sort_picks against qsort with dc_pick_cmp (the order it replaced): digests
 * spread evenly, each named up to three times (equal digests keep position
 * order), all sharing their first 8 bytes or packed at one end (crowded
 * buckets), and batches under the size that deals them into buckets. */
static void test_sort_picks(void) {
    enum { MAX = 5000 };
    static unsigned char base[20 * MAX];
    static dc_pick got[MAX], want[MAX];
    uint64_t seed = 7;
    const size_t sizes[] = {0, 1, 2, 63, 64, 65, 1000, MAX};
    for (int shape = 0; shape < 4; shape++) {
        for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
            size_t n = sizes[si];
            for (size_t k = 0; k < n; k++) {
                unsigned char *d = base + 20 * k;
                seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
                if (shape == 1 && k % 3 && k) { /* a digest named again */
                    memcpy(d, base + 20 * ((seed >> 33) % k), 16);
                } else {
                    uint64_t a = dc_xxh64(&seed, 8, 1), b = dc_xxh64(&seed, 8, 2);
                    memcpy(d, &a, 8);
                    memcpy(d + 8, &b, 8);
                    if (shape == 2) memset(d, 0x11, 8); /* one crowded bucket */
                    if (shape == 3) memset(d, 0, 4);    /* packed at the low end */
                }
                memset(d + 16, 0, 4);
            }
            for (size_t k = 0; k < n; k++) {
                uint64_t hi = 0;
                for (int b = 0; b < 8; b++) hi = (hi << 8) | base[20 * k + b];
                got[k].hi = want[k].hi = hi;
                got[k].pos = want[k].pos = 20 * k;
            }
            dc_sort_base = base;
            qsort(want, n, sizeof(dc_pick), dc_pick_cmp);
            dc_sort_picks(got, n, base);
            int same = 1;
            for (size_t k = 0; k < n; k++) same &= got[k].pos == want[k].pos;
            CHECK(same);
        }
    }
}

static void test_side_orders(void) {
    enum { N = 300 };
    static dc_rec side[N];
    for (int shape = 0; shape < 4; shape++) {
        memset(side, 0, sizeof(side));
        for (int i = 0; i < N; i++) {
            unsigned char *d = side[i].digest;
            if (shape == 0) { /* a shared prefix: the guess is the same for all */
                memset(d, 0x5a, 8);
                d[14] = (unsigned char)(i >> 8), d[15] = (unsigned char)i;
            } else if (shape == 1) { /* packed at the low end */
                d[6] = (unsigned char)(i >> 8), d[7] = (unsigned char)i;
            } else if (shape == 2) { /* packed at the high end */
                memset(d, 0xff, 6);
                d[6] = (unsigned char)(i >> 8), d[7] = (unsigned char)i;
            } else { /* spread: every other step of 2^55 */
                uint64_t top = (uint64_t)(2 * i + 1) << 54;
                for (int k = 0; k < 8; k++) d[k] = (unsigned char)(top >> (56 - 8 * k));
            }
        }
        for (size_t n = 0; n <= N; n += (n < 5 ? 1 : 37)) {
            for (int i = 0; i < N; i++) {
                for (int off = -1; off <= 1; off++) {
                    unsigned char q[16];
                    memcpy(q, side[i].digest, 16);
                    q[15] = (unsigned char)(q[15] + off); /* a neighbour, or the digest */
                    const dc_rec *want = NULL;
                    for (size_t k = 0; k < n; k++)
                        if (memcmp(side[k].digest, q, 16) == 0) want = &side[k];
                    CHECK(dc_side_find(side, n, q) == want);
                }
            }
        }
    }
}

static void test_read_records(void) {
    enum { N = 40 };
    dc_table t;
    CHECK(dc_table_init(&t, 16) == DC_OK);
    unsigned char digests[16 * N];
    unsigned char *vals[N];
    size_t lens[N];
    int oom = 0;
    for (int i = 0; i < N; i++) {
        dc_rec r;
        memset(&r, 0, sizeof(r));
        digest_of((uint64_t)(N - i) * 7919, r.digest); /* not in digest order */
        memcpy(digests + 16 * i, r.digest, 16);
        r.state = i % 4 == 0 ? DC_RELEASED : i % 4 == 1 ? DC_PROCESSING : DC_PROCESSED;
        r.token = 1 + (uint64_t)i;
        r.lease = 30.0f;
        r.created = r.updated = 1700000000.0;
        r.extra = dc_extra_new(NULL, 0, 0, NULL, 0, 0, (const unsigned char *)"res", 3, 1, &oom);
        vals[i] = (unsigned char *)malloc(dc_value_bound(&r));
        lens[i] = dc_encode_value(&r, vals[i]);
        dc_decref(r.extra);
    }
    dc_rec side[N];
    size_t n_side = 0, bad = (size_t)-1;
    CHECK(dc_read_records(&t, digests, (const unsigned char *const *)vals, lens, N, 50.0, side,
                          &n_side, &bad) == DC_OK);
    CHECK(n_side == N / 2 && bad == (size_t)-1 && t.count == N / 2);
    for (size_t k = 1; k < n_side; k++) CHECK(memcmp(side[k - 1].digest, side[k].digest, 16) < 0);
    for (int i = 0; i < N; i++) {
        const dc_rec *in_table = dc_find(&t, digests + 16 * i);
        const dc_rec *beside = dc_side_find(side, n_side, digests + 16 * i);
        CHECK((in_table == NULL) != (beside == NULL));
        const dc_rec *r = in_table ? in_table : beside;
        CHECK(r->token == 1 + (uint64_t)i && r->lsn == 0);
        if (i % 4 == 1) CHECK(in_table && r->deadline == 50.0 + 30.0); /* a fresh lease */
        if (beside) CHECK(r->state == DC_PROCESSED && r->extra && r->extra->result_len == 3);
    }
    unsigned char other[16];
    digest_of(123456789, other);
    CHECK(dc_side_find(side, n_side, other) == NULL && dc_side_find(side, 0, digests) == NULL);
    test_side_orders();
    for (size_t k = 0; k < n_side; k++) dc_decref(side[k].extra);
    /* Read again: what the table holds is skipped; a damaged value stops the read. */
    vals[N - 1][0] ^= 0x40;
    n_side = 0;
    CHECK(dc_read_records(&t, digests, (const unsigned char *const *)vals, lens, N, 50.0, side,
                          &n_side, &bad) == DC_ECORRUPT);
    CHECK(bad == N - 1 && n_side == N / 2 - 1);
    for (size_t k = 0; k < n_side; k++) dc_decref(side[k].extra);
    /* Without side (a load), every record goes into the table. */
    vals[N - 1][0] ^= 0x40;
    CHECK(dc_read_records(&t, digests, (const unsigned char *const *)vals, lens, N, 50.0, NULL,
                          &n_side, &bad) == DC_OK);
    CHECK(n_side == 0 && t.count == N);
    for (int i = 0; i < N; i++) free(vals[i]);
    dc_table_free(&t);
}

static void test_fuse(void) {
    enum { N = 100000 };
    uint64_t *h = (uint64_t *)malloc(N * sizeof(uint64_t));
    for (uint64_t i = 0; i < N; i++) h[i] = dc_xxh64(&i, 8, 11);
    h[N - 1] = h[0]; /* duplicates are allowed */
    dc_fuse_t f;
    unsigned char *body = NULL;
    uint64_t count = 0;
    CHECK(dc_fuse_build(h, N, 99, NULL, &f, &body, &count) == DC_OK);
    CHECK(count == N - 1);
    unsigned char *flags = (unsigned char *)calloc(N, 1);
    dc_fuse_contains_batch(&f, h, N, flags);
    int all = 1;
    for (size_t i = 0; i < N; i++) all &= flags[i] && dc_fuse_contains(&f, h[i]);
    CHECK(all);
    uint64_t fp = 0;
    for (uint64_t i = N; i < 11 * (uint64_t)N; i++) fp += dc_fuse_contains(&f, dc_xxh64(&i, 8, 11));
    CHECK(fp < 100); /* 2**-16 of a million is about 15 */
    dc_fuse_free(body, f.array_length * 2);

    CHECK(dc_fuse_build(NULL, 0, 1, NULL, &f, &body, &count) == DC_OK && count == 0);
    dc_fuse_free(body, f.array_length * 2);
    dc_fuse_t big;
    CHECK(dc_fuse_geometry(UINT64_C(1) << 40, &big) == DC_ETOOBIG);
    free(flags);
    free(h);
}

/* Three filters in one geometry (the second and third built like the first),
 * stacked in five columns and grown to seven: every key held while its column
 * is live, none after it is dropped. */
static void test_fuse_stack(void) {
    enum { N = 20000, K = 3 };
    uint64_t *h = (uint64_t *)malloc(K * N * sizeof(uint64_t));
    for (uint64_t i = 0; i < K * N; i++) h[i] = dc_xxh64(&i, 8, 5);
    dc_fuse_t f[K];
    unsigned char *body[K];
    uint64_t count = 0;
    CHECK(dc_fuse_build(h, N, 3, NULL, &f[0], &body[0], &count) == DC_OK);
    for (int k = 1; k < K; k++) {
        CHECK(dc_fuse_build(h + k * N, N - 100 * k, 3, &f[0], &f[k], &body[k], &count) == DC_OK);
        CHECK(f[k].array_length == f[0].array_length);
    }
    dc_fuse_stack_t st, wide;
    memset(&st, 0, sizeof(st));
    st.geo = f[0];
    st.width = 5;
    st.fp = (uint16_t *)dc_fuse_alloc(dc_fuse_stack_bytes(f[0].array_length, st.width));
    int stacked = 0;
    for (int k = 0; k < K; k++) {
        if (f[k].seed != f[0].seed) continue; /* a retried seed: not stackable */
        dc_fuse_stack_put(&st, (uint32_t)(2 * k % 5), &f[k]);
        st.live |= 1u << (2 * k % 5);
        stacked++;
    }
    CHECK(stacked >= 2);
    wide = st;
    wide.width = 7;
    wide.fp = (uint16_t *)dc_fuse_alloc(dc_fuse_stack_bytes(f[0].array_length, wide.width));
    dc_fuse_stack_copy(&wide, &st);
    unsigned char *flags = (unsigned char *)calloc(K * N, 1);
    for (int pass = 0; pass < 2; pass++) {
        const dc_fuse_stack_t *s = pass ? &wide : &st;
        memset(flags, 0, K * N);
        dc_fuse_stack_contains_batch(s, h, K * N, flags);
        int all = 1;
        for (int k = 0; k < K; k++) {
            if (f[k].seed != f[0].seed) continue;
            size_t held = (size_t)(N - 100 * k);
            for (size_t i = 0; i < held; i++)
                all &= flags[k * N + i] && dc_fuse_stack_contains_mixed(
                                               s, dc_fuse_mix(h[k * N + i], s->geo.seed));
        }
        CHECK(all);
    }
    /* 27 columns: a row spans four groups of eight lanes. The first filter again
     * in the last column, alone live: its keys held, the others' not. */
    dc_fuse_stack_t widest = wide;
    widest.width = 27;
    widest.fp = (uint16_t *)dc_fuse_alloc(dc_fuse_stack_bytes(f[0].array_length, widest.width));
    dc_fuse_stack_copy(&widest, &wide);
    dc_fuse_stack_put(&widest, 26, &f[0]);
    widest.live = 1u << 26;
    memset(flags, 0, K * N);
    dc_fuse_stack_contains_batch(&widest, h, K * N, flags);
    size_t first = 0, others = 0;
    for (size_t i = 0; i < N; i++) first += flags[i];
    for (size_t i = N; i < K * N; i++) others += flags[i];
    CHECK(first == N && others < 20);
    CHECK(dc_fuse_stack_contains_mixed(&widest, dc_fuse_mix(h[7], widest.geo.seed)));
    dc_fuse_free(widest.fp, dc_fuse_stack_bytes(f[0].array_length, widest.width));
    wide.live &= ~1u; /* column 0: the first filter */
    memset(flags, 0, K * N);
    dc_fuse_stack_contains_batch(&wide, h, N, flags);
    size_t still = 0;
    for (size_t i = 0; i < N; i++) still += flags[i];
    CHECK(still < 20);
    wide.live = 0;
    memset(flags, 0, K * N);
    dc_fuse_stack_contains_batch(&wide, h, K * N, flags);
    CHECK(memchr(flags, 1, K * N) == NULL);
    dc_fuse_free(st.fp, dc_fuse_stack_bytes(f[0].array_length, st.width));
    dc_fuse_free(wide.fp, dc_fuse_stack_bytes(f[0].array_length, wide.width));
    for (int k = 0; k < K; k++) dc_fuse_free(body[k], f[k].array_length * 2);
    free(flags);
    free(h);
}

/* The XXH64 of inputs 0..n of lengths 0..199, seeds 0 and 2**63+1. */
static void print_xxh64(void) {
    unsigned char buf[200];
    for (int i = 0; i < 200; i++) buf[i] = (unsigned char)(i * 37 + 11);
    for (size_t len = 0; len < 200; len++) {
        printf("%zu %llu %llu\n", len, (unsigned long long)dc_xxh64(buf, len, 0),
               (unsigned long long)dc_xxh64(buf, len, UINT64_C(0x8000000000000001)));
    }
}


/* The commit thread: a job written and synced, its eventfd, one job at a time, an
 * errno reported, and close finishing a queued job. */
static void test_syncer(void) {
    char path[] = "/tmp/dc_sync_test_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    unlink(path);
    int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    CHECK(efd >= 0);
    dc_syncer s;
    CHECK(dc_syncer_init(&s, efd) == 0);
    int err = -1, zero_err = -1;
    size_t written = 0;
    CHECK(dc_syncer_take(&s, &err, &written, &zero_err) == 0); /* nothing done yet */
    static const char data[] = "0123456789";
    CHECK(dc_syncer_start(&s, fd, data, 10, 1, 0, 0) == 0);
    CHECK(dc_syncer_start(&s, fd, data, 10, 1, 0, 0) == -1); /* one at a time */
    dc_syncer_wait(&s);
    uint64_t count = 0;
    CHECK(read(efd, &count, sizeof count) == sizeof count && count == 1);
    CHECK(dc_syncer_take(&s, &err, &written, &zero_err) == 1 && err == 0 && written == 10);
    CHECK(zero_err == 0);
    CHECK(dc_syncer_take(&s, &err, &written, &zero_err) == 0);
    char back[16] = {0};
    CHECK(pread(fd, back, sizeof back, 0) == 10 && !memcmp(back, data, 10));

    CHECK(dc_syncer_start(&s, -1, data, 10, 1, 0, 0) == 0); /* a bad descriptor */
    dc_syncer_wait(&s);
    CHECK(dc_syncer_take(&s, &err, &written, &zero_err) == 1 && err == EBADF && written == 0);

    /* Zeros ahead of the appends: written first, over more than one chunk of them,
     * then the data at the file's position (10) over their start. */
    static char ones[300000];
    memset(ones, 0xFF, sizeof ones);
    CHECK(pwrite(fd, ones, sizeof ones, 10) == (ssize_t)sizeof ones);
    CHECK(dc_syncer_start(&s, fd, data, 4, 1, 10, 290000) == 0);
    dc_syncer_wait(&s);
    CHECK(dc_syncer_take(&s, &err, &written, &zero_err) == 1 && err == 0 && written == 4);
    CHECK(zero_err == 0);
    static char after[300010];
    CHECK(pread(fd, after, sizeof after, 0) == (ssize_t)sizeof after);
    CHECK(!memcmp(after, data, 10) && !memcmp(after + 10, data, 4));
    int zeros = 1;
    for (size_t i = 14; i < 290000; i++)
        zeros &= after[i] == 0;
    CHECK(zeros);
    CHECK((unsigned char)after[290000] == 0xFF); /* past the fill: untouched */
    /* A fill that fails is reported apart; the data is still written. */
    int pipefd[2];
    CHECK(pipe(pipefd) == 0);
    CHECK(dc_syncer_start(&s, pipefd[1], data, 3, 0, 0, 4096) == 0);
    dc_syncer_wait(&s);
    CHECK(dc_syncer_take(&s, &err, &written, &zero_err) == 1 && err == 0 && written == 3);
    CHECK(zero_err == ESPIPE);
    CHECK(read(pipefd[0], back, sizeof back) == 3 && !memcmp(back, data, 3));
    close(pipefd[0]);
    close(pipefd[1]);

    CHECK(dc_syncer_start(&s, fd, data, 5, 0, 0, 0) == 0);
    dc_syncer_close(&s); /* finishes the queued job, then stops */
    CHECK(pread(fd, back, 5, 14) == 5 && !memcmp(back, data, 5)); /* at the position */
    dc_syncer_close(&s); /* twice is fine */
    close(efd);
    close(fd);
}

static void test_wire(void) {
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    int64_t soon = dc_wire_now_ms() + 5000;
    static const unsigned char req[] = {0, 0, 0, 3, 'a', 'b', 'c'};
    CHECK(dc_wire_send(sv[0], req, sizeof req, soon) == 0);
    unsigned char got[8] = {0};
    CHECK(dc_wire_recv(sv[1], got, 4, soon, 1, 0) == 0 && dc_wire_length(got) == 3);
    CHECK(dc_wire_recv(sv[1], got, 3, soon, 0, 0) == 0 && !memcmp(got, "abc", 3));
    static const unsigned char big[] = {0x01, 0x02, 0x03, 0x04};
    CHECK(dc_wire_length(big) == 0x01020304u);
    /* Nothing to read: the deadline passes, after checking without sleeping or not;
     * a deadline already past fails at once. */
    CHECK(dc_wire_recv(sv[1], got, 1, dc_wire_now_ms() + 20, 1, 0) == -ETIMEDOUT);
    CHECK(dc_wire_recv(sv[1], got, 1, dc_wire_now_ms() + 20, 1, 1000000) == -ETIMEDOUT);
    CHECK(dc_wire_recv(sv[1], got, 1, dc_wire_now_ms() - 1, 1, 0) == -ETIMEDOUT);
    /* Checking without sleeping: nothing there (0 when the time is up, none at all
     * for no time), then something there (1 at once); a frame read after it. */
    CHECK(dc_wire_spin(sv[1], 0) == 0);
    CHECK(dc_wire_spin(sv[1], 200000) == 0);
    CHECK(dc_wire_send(sv[0], req, sizeof req, soon) == 0);
    CHECK(dc_wire_spin(sv[1], 200000) == 1);
    CHECK(dc_wire_recv(sv[1], got, 4, soon, 1, 200000) == 0 && dc_wire_length(got) == 3);
    CHECK(dc_wire_recv(sv[1], got, 3, soon, 0, 0) == 0 && !memcmp(got, "abc", 3));
    /* Part of what is asked for, then the peer hangs up. */
    CHECK(send(sv[0], "xy", 2, 0) == 2);
    CHECK(shutdown(sv[0], SHUT_WR) == 0);
    CHECK(dc_wire_recv(sv[1], got, 4, soon, 1, 1000000) == DC_WIRE_EOF);
    close(sv[0]);
    CHECK(dc_wire_send(sv[1], req, sizeof req, soon) == -EPIPE); /* no SIGPIPE */
    close(sv[1]);
    CHECK(dc_wire_send(sv[1], req, sizeof req, soon) == -EBADF);
    CHECK(dc_wire_recv(sv[1], got, 1, soon, 0, 0) == -EBADF);
    CHECK(dc_wire_spin(sv[1], 1000000) == 1); /* a bad descriptor: poll reports it */
}

/* A page of a synthetic LMDB file: its number, kind and nodes (key, then a leaf's
 * value or a branch's child), laid out from the page's end as LMDB lays them. */
static void mdb_page(uint8_t *file, uint32_t psize, uint64_t pgno, unsigned kind, unsigned n,
                     const char *const *keys, const uint64_t *children, const char *const *vals) {
    uint8_t *p = file + pgno * psize;
    memset(p, 0, psize);
    memcpy(p, &pgno, 8);
    uint16_t flags = (uint16_t)kind, lower = (uint16_t)(DC_MDB_PAGEHDR + 2 * n), upper = (uint16_t)psize;
    memcpy(p + 10, &flags, 2);
    for (unsigned i = 0; i < n; i++) {
        uint16_t ks = (uint16_t)strlen(keys[i]);
        uint16_t ds = kind == DC_MDB_P_LEAF ? (uint16_t)strlen(vals[i]) : 0;
        upper = (uint16_t)(upper - (DC_MDB_NODEHDR + ks + ds + 1) / 2 * 2);
        uint8_t *node = p + upper;
        uint16_t lo, hi, nf = 0;
        if (kind == DC_MDB_P_LEAF) {
            lo = ds;
            hi = 0;
        } else {
            lo = (uint16_t)children[i];
            hi = (uint16_t)(children[i] >> 16);
            nf = (uint16_t)(children[i] >> 32);
        }
        memcpy(node, &lo, 2);
        memcpy(node + 2, &hi, 2);
        memcpy(node + 4, &nf, 2);
        memcpy(node + 6, &ks, 2);
        memcpy(node + DC_MDB_NODEHDR, keys[i], ks);
        if (ds)
            memcpy(node + DC_MDB_NODEHDR + ks, vals[i], ds);
        memcpy(p + DC_MDB_PAGEHDR + 2 * i, &upper, 2);
    }
    memcpy(p + 12, &lower, 2);
    memcpy(p + 14, &upper, 2);
}

static int mdb_is(const dc_mdb_map *m, const dc_mdb_db *db, const char *key, const char *want) {
    const uint8_t *v = NULL;
    size_t len = 0;
    dc_mdb_result r = dc_mdb_get(m, db, (const uint8_t *)key, strlen(key), &v, &len);
    if (want == NULL)
        return r == DC_MDB_ABSENT;
    return r == DC_MDB_FOUND && len == strlen(want) && !memcmp(v, want, len);
}

static void test_mdb(void) {
    enum { PS = 512, PAGES = 8 };
    static uint8_t file[PS * PAGES];
    dc_mdb_map m = {file, PAGES, PS};
    /* Page 2: a branch over leaves 3 ("a".."c") and 4 ("m".."z"). */
    const char *left[] = {"a", "b", "c"}, *lv[] = {"1", "2", "3"};
    const char *right[] = {"m", "z"}, *rv[] = {"13", "26"};
    const char *bkeys[] = {"", "m"};
    const uint64_t kids[] = {3, 4};
    mdb_page(file, PS, 2, DC_MDB_P_BRANCH, 2, bkeys, kids, NULL);
    mdb_page(file, PS, 3, DC_MDB_P_LEAF, 3, left, NULL, lv);
    mdb_page(file, PS, 4, DC_MDB_P_LEAF, 2, right, NULL, rv);
    dc_mdb_db db = {2, 0, 2};
    CHECK(mdb_is(&m, &db, "a", "1") && mdb_is(&m, &db, "c", "3"));
    CHECK(mdb_is(&m, &db, "m", "13") && mdb_is(&m, &db, "z", "26"));
    CHECK(mdb_is(&m, &db, "0", NULL) && mdb_is(&m, &db, "d", NULL) && mdb_is(&m, &db, "zz", NULL));
    CHECK(mdb_is(&m, &db, "", NULL));
    /* Several at once, in order; the empty database answers nothing. */
    const uint8_t keys[] = "abcdmz";
    const uint8_t *vals[6];
    size_t lens[6];
    CHECK(dc_mdb_get_many(&m, &db, keys, 6, 1, vals, lens) == 5);
    CHECK(vals[3] == NULL && lens[5] == 2 && !memcmp(vals[5], "26", 2));
    dc_mdb_db empty = {UINT64_MAX, 0, 0};
    CHECK(dc_mdb_get_many(&m, &empty, keys, 6, 1, vals, lens) == 0 && vals[0] == NULL);
    /* Every key in order, in batches; the count the record gives is held to. */
    dc_mdb_walk w;
    uint8_t out[8];
    size_t given = 0;
    CHECK(dc_mdb_walk_start(&m, &db, 5, 1, &w) == DC_MDB_FOUND);
    CHECK(dc_mdb_walk_keys(&m, &w, out, 2, &given) == DC_MDB_FOUND && given == 2 &&
          !memcmp(out, "ab", 2));
    CHECK(dc_mdb_walk_keys(&m, &w, out, 2, &given) == DC_MDB_FOUND && given == 2 &&
          !memcmp(out, "cm", 2));
    CHECK(dc_mdb_walk_keys(&m, &w, out, 2, &given) == DC_MDB_ABSENT && given == 1 && out[0] == 'z');
    CHECK(dc_mdb_walk_keys(&m, &w, out, 2, &given) == DC_MDB_ABSENT && given == 0);
    CHECK(dc_mdb_walk_start(&m, &db, 5, 1, &w) == DC_MDB_FOUND);
    CHECK(dc_mdb_walk_keys(&m, &w, out, 8, &given) == DC_MDB_ABSENT && given == 5 &&
          !memcmp(out, "abcmz", 5));
    CHECK(dc_mdb_walk_start(&m, &db, 4, 1, &w) == DC_MDB_FOUND); /* more keys than counted */
    CHECK(dc_mdb_walk_keys(&m, &w, out, 8, &given) == DC_MDB_UNREADABLE && given == 4);
    CHECK(dc_mdb_walk_start(&m, &db, 6, 1, &w) == DC_MDB_FOUND); /* fewer */
    CHECK(dc_mdb_walk_keys(&m, &w, out, 8, &given) == DC_MDB_UNREADABLE && given == 5);
    CHECK(dc_mdb_walk_start(&m, &db, 5, 2, &w) == DC_MDB_FOUND); /* keys of another length */
    CHECK(dc_mdb_walk_keys(&m, &w, out, 4, &given) == DC_MDB_UNREADABLE && given == 0);
    CHECK(dc_mdb_walk_start(&m, &db, 5, 0, &w) == DC_MDB_UNREADABLE);
    CHECK(dc_mdb_walk_start(&m, &db, 5, 17, &w) == DC_MDB_UNREADABLE);
    CHECK(dc_mdb_walk_start(&m, &empty, 0, 1, &w) == DC_MDB_FOUND);
    CHECK(dc_mdb_walk_keys(&m, &w, out, 8, &given) == DC_MDB_ABSENT && given == 0);
    CHECK(dc_mdb_walk_start(&m, &empty, 1, 1, &w) == DC_MDB_UNREADABLE);
    /* The MDB_db record: its length, flags and depth are checked. */
    uint8_t rec[48] = {0};
    uint16_t depth = 2;
    uint64_t root = 2;
    memcpy(rec + 6, &depth, 2);
    memcpy(rec + 40, &root, 8);
    dc_mdb_db got;
    CHECK(dc_mdb_db_read(rec, 48, &got) == 0 && got.root == 2 && got.depth == 2);
    CHECK(dc_mdb_db_read(rec, 47, &got) == -1);
    rec[4] = 0x04; /* MDB_DUPSORT */
    CHECK(dc_mdb_db_read(rec, 48, &got) == -1);
    rec[4] = 0;
    depth = 0;
    memcpy(rec + 6, &depth, 2);
    CHECK(dc_mdb_db_read(rec, 48, &got) == -1);
    /* What does not fit LMDB's picture is unreadable, never read past. */
    dc_mdb_db deep = {2, 0, 3}; /* a leaf where a branch should be */
    const uint8_t *v;
    size_t len;
    CHECK(dc_mdb_get(&m, &deep, (const uint8_t *)"a", 1, &v, &len) == DC_MDB_UNREADABLE);
    dc_mdb_db far = {PAGES, 0, 1};
    CHECK(dc_mdb_get(&m, &far, (const uint8_t *)"a", 1, &v, &len) == DC_MDB_BEYOND);
    const uint64_t self[] = {2, 2}; /* a branch whose children are itself */
    mdb_page(file, PS, 5, DC_MDB_P_BRANCH, 2, bkeys, self, NULL);
    dc_mdb_db loop = {5, 0, DC_MDB_MAX_DEPTH};
    CHECK(dc_mdb_get(&m, &loop, (const uint8_t *)"a", 1, &v, &len) == DC_MDB_UNREADABLE);
    CHECK(dc_mdb_walk_start(&m, &loop, 5, 1, &w) == DC_MDB_FOUND);
    CHECK(dc_mdb_walk_keys(&m, &w, out, 8, &given) == DC_MDB_UNREADABLE && given == 0);
    const uint64_t twice[] = {3, 3}; /* a leaf reached twice: its keys out of order */
    mdb_page(file, PS, 6, DC_MDB_P_BRANCH, 2, bkeys, twice, NULL);
    dc_mdb_db again = {6, 0, 2};
    CHECK(dc_mdb_walk_start(&m, &again, 6, 1, &w) == DC_MDB_FOUND);
    CHECK(dc_mdb_walk_keys(&m, &w, out, 8, &given) == DC_MDB_UNREADABLE && given == 3);
    CHECK(dc_mdb_walk_start(&m, &far, 1, 1, &w) == DC_MDB_BEYOND);
    uint64_t wrong = 7; /* a page that names another number */
    memcpy(file + 4 * PS, &wrong, 8);
    CHECK(dc_mdb_get(&m, &db, (const uint8_t *)"m", 1, &v, &len) == DC_MDB_UNREADABLE);
    CHECK(mdb_is(&m, &db, "b", "2")); /* the other leaf still answers */
    uint16_t bad = PS - 2; /* a node pointer too near the page's end */
    memcpy(file + 3 * PS + DC_MDB_PAGEHDR, &bad, 2);
    CHECK(dc_mdb_get(&m, &db, (const uint8_t *)"b", 1, &v, &len) == DC_MDB_UNREADABLE ||
          dc_mdb_get(&m, &db, (const uint8_t *)"a", 1, &v, &len) == DC_MDB_UNREADABLE);
    uint16_t huge = 0xffff; /* a value that would run past its page */
    mdb_page(file, PS, 3, DC_MDB_P_LEAF, 3, left, NULL, lv);
    memcpy(file + 3 * PS + PS - 10, &huge, 2);
    CHECK(dc_mdb_get_many(&m, &db, keys, 6, 1, vals, lens) == DC_MDB_UNREADABLE);
}

/* The walk of ext/dc_mdb.h over a real data.mdb ("mdb", "mdb-many" and
 * "mdb-keys" modes, below): tests/unit/test_native_headers.py compares it with
 * LMDB and runs it over damaged copies of the file under the sanitizers. */
static int hexval(int c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

static size_t unhex(const char *s, uint8_t *out, size_t cap) {
    size_t n = 0;
    while (n < cap && hexval(s[2 * n]) >= 0 && hexval(s[2 * n + 1]) >= 0) {
        out[n] = (uint8_t)(hexval(s[2 * n]) << 4 | hexval(s[2 * n + 1]));
        n++;
    }
    return n;
}

/* The file at path in memory of its exact size, so that a read past its end
 * lands in AddressSanitizer's redzone; NULL if it cannot be read. */
static uint8_t *read_whole(const char *path, const char *psize, dc_mdb_map *m) {
    FILE *f = fopen(path, "rb");
    struct stat st;
    if (f == NULL || fstat(fileno(f), &st) != 0 || st.st_size == 0)
        return NULL;
    uint8_t *base = malloc((size_t)st.st_size);
    if (base == NULL || fread(base, 1, (size_t)st.st_size, f) != (size_t)st.st_size)
        return NULL;
    fclose(f);
    m->base = base;
    m->psize = (uint32_t)atoi(psize);
    m->pages = (uint64_t)st.st_size / m->psize;
    return base;
}

/* Prints a value in hex, "-" for none. */
static void mdb_print(const uint8_t *v, size_t vlen) {
    for (size_t i = 0; v != NULL && i < vlen; i++)
        printf("%02x", v[i]);
    printf(v == NULL ? "-\n" : "\n");
}

/* "mdb FILE PSIZE RECORD": the keys on stdin (hex, a line each) looked up one
 * by one in the database whose MDB_db record is RECORD (hex): a line per key, its value in hex, "-" where absent, "?" where the
 * lookup could not be made. "mdb-many": the same keys, 16 bytes each, in one
 * dc_mdb_get_many in the order given: a line per key, or one "?" line. */
static int mdb_walk(const char *path, const char *psize, const char *record, int many) {
    dc_mdb_map m;
    uint8_t *base = read_whole(path, psize, &m);
    if (base == NULL)
        return 2;
    uint8_t rec[64];
    dc_mdb_db db;
    size_t rlen = unhex(record, rec, sizeof rec), n = 0, cap = 1024;
    int readable = dc_mdb_db_read(rec, rlen, &db) == 0;
    uint8_t *keys = malloc(16 * cap);
    char line[1024];
    uint8_t key[512];
    while (keys != NULL && fgets(line, sizeof line, stdin)) {
        size_t klen = unhex(line, key, sizeof key);
        if (many) {
            if (klen != 16)
                return 3;
            if (n == cap) {
                uint8_t *more = realloc(keys, 16 * (cap *= 2));
                if (more == NULL)
                    return 2;
                keys = more;
            }
            memcpy(keys + 16 * n++, key, 16);
            continue;
        }
        const uint8_t *v = NULL;
        size_t vlen = 0;
        dc_mdb_result r = readable ? dc_mdb_get(&m, &db, key, klen, &v, &vlen) : DC_MDB_UNREADABLE;
        if (r >= 0)
            mdb_print(r == DC_MDB_FOUND ? v : NULL, vlen);
        else
            printf("?\n");
    }
    if (many) {
        const uint8_t **vals = malloc((n + 1) * sizeof *vals);
        size_t *lens = malloc((n + 1) * sizeof *lens);
        if (keys == NULL || vals == NULL || lens == NULL)
            return 2;
        int64_t found = readable ? dc_mdb_get_many(&m, &db, keys, n, 16, vals, lens)
                                 : DC_MDB_UNREADABLE;
        for (size_t i = 0; found >= 0 && i < n; i++)
            mdb_print(vals[i], lens[i]);
        if (found < 0)
            printf("?\n");
        free(vals);
        free(lens);
    }
    free(keys);
    free(base);
    return 0;
}

/* "mdb-keys FILE PSIZE RECORD BATCH": every key of the database whose MDB_db
 * record is RECORD (hex), 16 bytes each, walked BATCH at a time: a line per key
 * in hex, then "end", or "?" where the walk could not go on. */
static int mdb_keys(const char *path, const char *psize, const char *record,
                    const char *batch) {
    dc_mdb_map m;
    uint8_t *base = read_whole(path, psize, &m);
    if (base == NULL)
        return 2;
    uint8_t rec[64];
    size_t rlen = unhex(record, rec, sizeof rec), cap = (size_t)atoi(batch), got;
    uint8_t *out = malloc(16 * cap);
    dc_mdb_db db;
    dc_mdb_walk w;
    uint64_t entries;
    dc_mdb_result r = DC_MDB_UNREADABLE;
    if (out != NULL && rlen == 48 && dc_mdb_db_read(rec, rlen, &db) == 0) {
        memcpy(&entries, rec + 32, 8);
        r = dc_mdb_walk_start(&m, &db, entries, 16, &w);
    }
    while (r == DC_MDB_FOUND) {
        r = dc_mdb_walk_keys(&m, &w, out, cap, &got);
        for (size_t i = 0; r >= 0 && i < got; i++) {
            for (size_t j = 0; j < 16; j++)
                printf("%02x", out[16 * i + j]);
            printf("\n");
        }
    }
    printf(r == DC_MDB_ABSENT ? "end\n" : "?\n");
    free(out);
    free(base);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "xxh64")) {
        print_xxh64();
        return 0;
    }
    if (argc == 5 && (!strcmp(argv[1], "mdb") || !strcmp(argv[1], "mdb-many")))
        return mdb_walk(argv[2], argv[3], argv[4], !strcmp(argv[1], "mdb-many"));
    if (argc == 6 && !strcmp(argv[1], "mdb-keys"))
        return mdb_keys(argv[2], argv[3], argv[4], argv[5]);
    test_status();
    test_blocks();
    test_jump();
    test_varint();
    test_record_format();
    test_table();
    test_sort_picks();
    test_read_records();
    test_fuse();
    test_fuse_stack();
    test_syncer();
    test_wire();
    test_mdb();
    printf("%d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
