/*
 * dc_sync.h - a commit thread that needs no GIL: it writes a buffer at the end
 * of a file, fdatasyncs it, and says so on an eventfd. A job may first write
 * zeros ahead of the appends (dedupcore/wal/__init__.py, "The zero-filled
 * tail"), so that the event loop does not.
 *
 * The daemon's event loop hands it one commit of the write-ahead log at a time
 * and goes on deciding requests while the disk works; the eventfd wakes the
 * loop when the commit is done (docs/daemon.md, "Group commit"). Any other
 * thread that needs the commit may wait for it with dc_syncer_wait. The
 * thread takes no Python lock, so finishing a commit costs one wake-up of the
 * loop and nothing else.
 *
 * One job at a time: dc_syncer_start refuses a second one until the first
 * was taken with dc_syncer_take.
 */
#ifndef DC_SYNC_H
#define DC_SYNC_H

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

/* The daemon runs on Linux only; elsewhere the library may still build this. */
#if defined(__linux__)
#define DC_DATASYNC(fd) fdatasync(fd)
#else
#define DC_DATASYNC(fd) fsync(fd)
#endif

enum { DC_SYNC_IDLE = 0, DC_SYNC_QUEUED = 1, DC_SYNC_RUNNING = 2, DC_SYNC_DONE = 3 };

typedef struct {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t queued; /* signalled when a job is queued or the thread must stop */
    pthread_cond_t done;   /* broadcast when a job is done */
    int efd;               /* eventfd: 1 is added when a job is done */
    int started;           /* the thread runs */
    int stop;
    int state;             /* DC_SYNC_* */
    int sleeping;          /* the thread waits on queued (start signals it only then) */
    /* the job */
    int fd;
    const char *data;
    size_t len;
    int sync;              /* fdatasync after the write */
    off_t zero_from;       /* zeros written over [zero_from, zero_to) before the data */
    off_t zero_to;
    /* its outcome */
    int err;               /* errno of the failed write or fdatasync, 0 if none */
    size_t written;        /* bytes written before a failure (all of them on success) */
    int zero_err;          /* errno of the failed zero fill, 0 if none (or none asked) */
} dc_syncer;

/* The zeros a fill writes from, a chunk at a time. */
static const char dc_zeros[256 << 10];

/* Writes zeros over [from, to) of fd; returns 0 or an errno value. */
static int dc_write_zeros(int fd, off_t from, off_t to) {
    while (from < to) {
        size_t n = (size_t)(to - from) < sizeof dc_zeros ? (size_t)(to - from) : sizeof dc_zeros;
        ssize_t w = pwrite(fd, dc_zeros, n, from);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        from += w;
    }
    return 0;
}

static void *dc_syncer_main(void *arg) {
    dc_syncer *s = (dc_syncer *)arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (s->state != DC_SYNC_QUEUED && !s->stop) {
            s->sleeping = 1;
            pthread_cond_wait(&s->queued, &s->mu);
            s->sleeping = 0;
        }
        if (s->state != DC_SYNC_QUEUED) { /* stopping with no job */
            pthread_mutex_unlock(&s->mu);
            return NULL;
        }
        s->state = DC_SYNC_RUNNING;
        int fd = s->fd, sync = s->sync;
        const char *data = s->data;
        size_t len = s->len;
        off_t zero_from = s->zero_from, zero_to = s->zero_to;
        pthread_mutex_unlock(&s->mu);

        /* A failed fill is only reported: the appends then extend the file. */
        int zero_err = zero_from < zero_to ? dc_write_zeros(fd, zero_from, zero_to) : 0;
        int err = 0;
        size_t done = 0;
        while (done < len) {
            ssize_t n = write(fd, data + done, len - done);
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                err = errno;
                break;
            }
            done += (size_t)n;
        }
        if (!err && sync) {
            while (DC_DATASYNC(fd) != 0) {
                if (errno != EINTR) {
                    err = errno;
                    break;
                }
            }
        }

        pthread_mutex_lock(&s->mu);
        s->err = err;
        s->written = done;
        s->zero_err = zero_err;
        s->state = DC_SYNC_DONE;
        /* Under the mutex: the job cannot be taken (and the next one started) before
         * the eventfd announced it. */
        uint64_t one = 1;
        while (write(s->efd, &one, sizeof one) < 0 && errno == EINTR) {
        }
        pthread_cond_broadcast(&s->done);
        pthread_mutex_unlock(&s->mu);
    }
}

/* Starts the thread; returns 0, or an errno value (nothing started). */
static int dc_syncer_init(dc_syncer *s, int efd) {
    memset(s, 0, sizeof *s);
    s->efd = efd;
    int rc = pthread_mutex_init(&s->mu, NULL);
    if (rc)
        return rc;
    if ((rc = pthread_cond_init(&s->queued, NULL)) != 0) {
        pthread_mutex_destroy(&s->mu);
        return rc;
    }
    if ((rc = pthread_cond_init(&s->done, NULL)) != 0) {
        pthread_cond_destroy(&s->queued);
        pthread_mutex_destroy(&s->mu);
        return rc;
    }
    if ((rc = pthread_create(&s->thread, NULL, dc_syncer_main, s)) != 0) {
        pthread_cond_destroy(&s->done);
        pthread_cond_destroy(&s->queued);
        pthread_mutex_destroy(&s->mu);
        return rc;
    }
    s->started = 1;
    return 0;
}

/* Queues a job: write zeros over [zero_from, zero_to) of fd (none when zero_to
 * <= zero_from), then len bytes of data at fd's position, then fdatasync fd if
 * sync. Returns 0, or -1 while another job is queued, running or not yet taken.
 * data must stay valid until the job is taken. */
static int dc_syncer_start(dc_syncer *s, int fd, const char *data, size_t len, int sync,
                           off_t zero_from, off_t zero_to) {
    pthread_mutex_lock(&s->mu);
    if (s->state != DC_SYNC_IDLE || s->stop) {
        pthread_mutex_unlock(&s->mu);
        return -1;
    }
    s->fd = fd;
    s->data = data;
    s->len = len;
    s->sync = sync;
    s->zero_from = zero_from;
    s->zero_to = zero_to;
    s->err = 0;
    s->written = 0;
    s->zero_err = 0;
    s->state = DC_SYNC_QUEUED;
    int wake = s->sleeping;
    pthread_mutex_unlock(&s->mu);
    /* After the unlock: the woken thread does not block on the mutex at once. */
    if (wake)
        pthread_cond_signal(&s->queued);
    return 0;
}

/* Blocks until the job started is done (returns at once when none is). */
static void dc_syncer_wait(dc_syncer *s) {
    pthread_mutex_lock(&s->mu);
    while (s->state == DC_SYNC_QUEUED || s->state == DC_SYNC_RUNNING)
        pthread_cond_wait(&s->done, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

/* Takes a done job's outcome: returns 1 and sets *err, *written and *zero_err,
 * after which another job may start; returns 0 when no job is done. */
static int dc_syncer_take(dc_syncer *s, int *err, size_t *written, int *zero_err) {
    pthread_mutex_lock(&s->mu);
    int took = s->state == DC_SYNC_DONE;
    if (took) {
        *err = s->err;
        *written = s->written;
        *zero_err = s->zero_err;
        s->state = DC_SYNC_IDLE;
    }
    pthread_mutex_unlock(&s->mu);
    return took;
}

/* Finishes the job under way (if any), stops the thread and frees what init made. */
static void dc_syncer_close(dc_syncer *s) {
    if (!s->started)
        return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_signal(&s->queued);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    pthread_cond_destroy(&s->done);
    pthread_cond_destroy(&s->queued);
    pthread_mutex_destroy(&s->mu);
    s->started = 0;
}

#endif /* DC_SYNC_H */
