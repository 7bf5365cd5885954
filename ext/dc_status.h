/*
 * dc_status.h - the status codes of dedupcore's native core.
 *
 * Every fallible function in ext/dc_*.h returns a dc_status, and each Cython
 * module maps it to a Python exception in one place (check_status in
 * ext/_core.pyx and ext/_engine.pyx), so that a code means the same thing at
 * every call site: out of memory is MemoryError, damaged bytes are
 * ValueError, and a business refusal (a fingerprint conflict, a wrong token)
 * is not an error at all but an answer its caller reads from the call's io
 * struct (docs/engine.md, "Status codes").
 */
#ifndef DC_STATUS_H
#define DC_STATUS_H

typedef enum {
    DC_OK = 0,
    DC_ENOMEM = 1,    /* an allocation failed; nothing changed */
    DC_ECORRUPT = 2,  /* bytes that fail their checksum or do not parse */
    DC_ECONFLICT = 3, /* a business refusal; the call's io struct names the item */
    DC_ETOOBIG = 4,   /* more than the structure can hold */
    DC_EBUILD = 5     /* a construction found no seed that works (never seen) */
} dc_status;

/* A short English name of s, for messages. */
static inline const char *dc_status_str(dc_status s) {
    switch (s) {
    case DC_OK: return "ok";
    case DC_ENOMEM: return "out of memory";
    case DC_ECORRUPT: return "damaged or unparsable bytes";
    case DC_ECONFLICT: return "refused";
    case DC_ETOOBIG: return "too large";
    case DC_EBUILD: return "construction failed";
    }
    return "unknown status";
}

#endif /* DC_STATUS_H */
