/*
 * dc_wire.h - one request frame out and one reply frame in, on a connected
 * stream socket, for the daemon's synchronous client (docs/daemon.md, "The
 * client's round trip").
 *
 * Plain C, no Python objects: the caller releases the GIL around each call.
 * The socket may be blocking or not (Python's socket.settimeout makes it
 * non-blocking): every send and receive is MSG_DONTWAIT and a wait for the
 * socket is a poll() bounded by the caller's deadline, so a call returns by
 * its deadline whatever the peer does. A frame is a 4-byte big-endian length
 * and that many bytes (dedupcore/daemon/protocol.py).
 */
#ifndef DC_WIRE_H
#define DC_WIRE_H

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>

/* The peer closed the connection before the bytes asked for arrived. */
#define DC_WIRE_EOF 1

/* Milliseconds of the monotonic clock. */
static int64_t dc_wire_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* poll() of one descriptor for events, up to timeout_ms (0: not at all). */
static int dc_wire_poll(int fd, short events, int timeout_ms) {
    struct pollfd p;
    p.fd = fd;
    p.events = events;
    p.revents = 0;
    return poll(&p, 1, timeout_ms);
}

/* Waits until fd has one of events (or an error or hang-up, which the call that
 * follows reports) or the deadline passes: 0, -ETIMEDOUT or -errno. */
static int dc_wire_wait(int fd, short events, int64_t deadline_ms) {
    for (;;) {
        int64_t left = deadline_ms - dc_wire_now_ms();
        if (left <= 0) return -ETIMEDOUT;
        int r = dc_wire_poll(fd, events, left > INT_MAX ? INT_MAX : (int)left);
        if (r > 0) return 0;
        if (r == 0) return -ETIMEDOUT;
        if (errno != EINTR) return -errno;
    }
}

/* Sends all len bytes of buf: 0, or -errno (-ETIMEDOUT past the deadline). */
static int dc_wire_send(int fd, const unsigned char *buf, size_t len, int64_t deadline_ms) {
    while (len) {
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            buf += n;
            len -= (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int w = dc_wire_wait(fd, POLLOUT, deadline_ms);
            if (w) return w;
            continue;
        }
        return n < 0 ? -errno : -EIO;
    }
    return 0;
}

/* Checks fd for something to read without sleeping, for up to spin_ns
 * nanoseconds, giving the core to any other runnable thread between two checks
 * (sched_yield); 1 as soon as there is something (or an error or a hang-up:
 * the read that follows reports it), 0 when the time is up. A reply that
 * arrives while its caller checks needs no wake-up of a sleeping thread, which
 * is most of a round trip on a virtual machine (docs/daemon.md, "Polling for
 * the reply"). */
static int dc_wire_spin(int fd, int64_t spin_ns) {
    struct timespec t0, t;
    if (spin_ns <= 0) return 0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        if (dc_wire_poll(fd, POLLIN, 0) > 0) return 1;
        clock_gettime(CLOCK_MONOTONIC, &t);
        if ((int64_t)(t.tv_sec - t0.tv_sec) * 1000000000 + (t.tv_nsec - t0.tv_nsec) >= spin_ns)
            return 0;
        sched_yield();
    }
}

/* Reads exactly len bytes into buf: 0, DC_WIRE_EOF, or -errno (-ETIMEDOUT past
 * the deadline). With wait_first the socket is polled before the first read: a
 * reply to a request just sent is not there yet, and a read would find it
 * empty; the body after its header is usually there already. The poll is
 * preceded by up to spin_ns of checking without sleeping (dc_wire_spin). */
static int dc_wire_recv(int fd, unsigned char *buf, size_t len, int64_t deadline_ms,
                        int wait_first, int64_t spin_ns) {
    int waited = !wait_first || dc_wire_spin(fd, spin_ns);
    while (len) {
        if (!waited) {
            int w = dc_wire_wait(fd, POLLIN, deadline_ms);
            if (w) return w;
            waited = 1;
        }
        ssize_t n = recv(fd, buf, len, MSG_DONTWAIT);
        if (n > 0) {
            buf += n;
            len -= (size_t)n;
            continue;
        }
        if (n == 0) return DC_WIRE_EOF;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            waited = 0;
            continue;
        }
        return -errno;
    }
    return 0;
}

/* The body length a frame header announces. */
static inline uint32_t dc_wire_length(const unsigned char h[4]) {
    return ((uint32_t)h[0] << 24) | ((uint32_t)h[1] << 16) | ((uint32_t)h[2] << 8) | h[3];
}

#endif /* DC_WIRE_H */
