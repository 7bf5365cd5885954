# The one mapping from the native core's status codes (ext/dc_status.h) to
# Python exceptions, included by ext/_core.pyx and ext/_engine.pyx
# (docs/engine.md, "Status codes").

cdef extern from "dc_status.h" nogil:
    ctypedef enum dc_status:
        DC_OK
        DC_ENOMEM
        DC_ECORRUPT
        DC_ECONFLICT
        DC_ETOOBIG
        DC_EBUILD


cdef int check_status(dc_status rc, str what) except -1:
    """Returns 0 for DC_OK, else raises the exception of ``rc`` about ``what``.

    A business refusal (DC_ECONFLICT) is an answer its caller reads before it
    gets here; one that arrives here is a defect of the caller."""
    if rc == DC_OK:
        return 0
    if rc == DC_ENOMEM:
        raise MemoryError(f"out of memory: {what}")
    if rc == DC_ECORRUPT:
        raise ValueError(f"{what} fails its checksum or does not parse")
    if rc == DC_ETOOBIG:
        raise ValueError(f"{what}: more than the structure can hold")
    if rc == DC_EBUILD:
        raise RuntimeError(f"{what}: construction found no seed that works")
    raise SystemError(f"{what}: native status {<int>rc} not handled by its caller")
