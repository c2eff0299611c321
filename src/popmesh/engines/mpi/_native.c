/* The small-message path of popmesh's MPI transport, in C (see native.py and docs/messages.md).
 *
 * A small message is one MPI message: the transport's envelope with the whole wire frame inline.
 * This module builds that envelope from a numpy array or bytes (wire format version 2: header
 * CRC32, payload XXH3-64), posts it (MPI_Isend + MPI_Test), and on the receiving side spins on
 * matched probes with the GIL released, receives, checks and decodes the frame into a new array.
 * It does exactly what envelope.inline_envelope / inline_frame and wire's encode_message /
 * _decode_plain do, and gives anything else back to them: a frame it does not decode comes back
 * as the raw envelope, so the Python path raises the precise error.
 *
 * It is built against the MPICH wheel's mpi.h and libmpi.so.12 (the library mpi4py loads); native.py
 * uses it only when the MPI library seen from here is the one mpi4py initialised. XXH3-64 is the
 * xxhash wheel's own function (its extension exports XXH3_64bits), found with dlsym.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <mpi.h>
#include <dlfcn.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <limits.h>
#include <time.h>

/* the transport envelope (engines/envelope.py): <4sHHQIII */
#define ENV_NBYTES 28
#define ENV_VERSION 3
#define INLINE_MAX (65536 - ENV_NBYTES - 8 * 16)
/* the wire frame (wire/format.py): <4sBBBBBBHQQ then the header CRC32 */
#define FRAME_NBYTES 32
#define FRAME_FIXED 28
#define FRAME_VERSION 2
#define KIND_BYTES 1
#define KIND_NDARRAY 2
#define FLAG_PAYLOAD_CRC 1
#define MAX_NDIM 64
#define SMALL_FRAME_MAX 4096
#define PAGE_NBYTES 4096
#define STACK_NBYTES (ENV_NBYTES + FRAME_NBYTES + 8 * MAX_NDIM + SMALL_FRAME_MAX)

typedef uint64_t (*xxh3_fn)(const void *, size_t);

static xxh3_fn xxh3 = NULL;
static uint32_t crc_table[256];
static PyArray_Descr *descr_by_code[256]; /* native-order numpy dtypes by wire code, NULL: not decoded here */
static int uint8_code = -1;
static PyObject *mpi_exception = NULL; /* mpi4py's MPI.Exception: raised with the MPI error code */

/* ---- checksums ---------------------------------------------------------------------------- */

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

/* zlib.crc32(data, crc): the running CRC32 over concatenated pieces */
static uint32_t crc32_update(uint32_t crc, const unsigned char *p, size_t n) {
    uint32_t c = crc ^ 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static inline void put16(unsigned char *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static inline uint16_t get16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t get32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t get64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static PyObject *mpi_error(int code) {
    PyObject *ierr = PyLong_FromLong(code);
    if (ierr == NULL) return NULL;
    PyObject *exc = PyObject_CallOneArg(mpi_exception, ierr);
    Py_DECREF(ierr);
    if (exc == NULL) return NULL;
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
}

/* Whether bind() ran (it loads XXH3 and the dtypes); a RuntimeError otherwise. */
static int bound(void) {
    if (xxh3 != NULL && mpi_exception != NULL) return 1;
    PyErr_SetString(PyExc_RuntimeError, "popmesh.engines.mpi._native: call bind() first (native.load_native does)");
    return 0;
}

/* ---- a send that MPI has not completed yet ------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    MPI_Request requests[2]; /* the envelope's, and the payload segment's (MPI_REQUEST_NULL if none) */
    PyObject *envelope;      /* the envelope MPI reads until the sends complete (NULL once they did) */
    Py_buffer payload;       /* the payload a segment is sent from (obj NULL if none) */
} SendObject;

static void send_release(SendObject *self) {
    Py_CLEAR(self->envelope);
    if (self->payload.obj != NULL) PyBuffer_Release(&self->payload);
}

static int send_test_locked(SendObject *self, int *done) {
    return MPI_Testall(2, self->requests, done, MPI_STATUSES_IGNORE);
}

static PyObject *send_test(SendObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->envelope == NULL) Py_RETURN_TRUE;
    int done = 0, err = send_test_locked(self, &done);
    if (err != MPI_SUCCESS) return mpi_error(err);
    if (!done) Py_RETURN_FALSE;
    send_release(self);
    Py_RETURN_TRUE;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* spin(seconds) -> bool: test back to back, the GIL released (yielding the CPU every 32 tests), until the
 * sends complete or the time is up */
static PyObject *send_spin(SendObject *self, PyObject *arg) {
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    if (self->envelope == NULL) Py_RETURN_TRUE;
    int done = 0, err = MPI_SUCCESS;
    Py_BEGIN_ALLOW_THREADS
    double until = now_s() + seconds;
    for (unsigned polls = 1;; polls++) {
        err = send_test_locked(self, &done);
        if (err != MPI_SUCCESS || done) break;
        if (polls % 32 == 0) { /* the receiver may need this core to take the data */
            if (now_s() >= until) break;
            sched_yield();
        }
    }
    Py_END_ALLOW_THREADS
    if (err != MPI_SUCCESS) return mpi_error(err);
    if (!done) Py_RETURN_FALSE;
    send_release(self);
    Py_RETURN_TRUE;
}

static void send_dealloc(SendObject *self) {
    /* a send still in flight keeps its buffers for the life of the process: MPI may read them */
    if (self->envelope == NULL) send_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef send_methods[] = {
    {"Test", (PyCFunction)send_test, METH_NOARGS, "Whether MPI completed the sends (their buffers are then let go)."},
    {"spin", (PyCFunction)send_spin, METH_O, "Test back to back for up to the given seconds; whether done."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SendType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "popmesh.engines.mpi._native.Send",
    .tp_basicsize = sizeof(SendObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A frame's MPI sends in flight; Test() completes them.",
    .tp_methods = send_methods,
    .tp_dealloc = (destructor)send_dealloc,
};

/* ---- sending ------------------------------------------------------------------------------ */

/* The payload's bytes and layout: bytes, or a C-contiguous buffer (a numpy array) of the wire
 * dtype ``code``. 0 on success; 1 when this path does not frame it (no exception set). */
typedef struct {
    Py_buffer view;
    int kind, ndim;
    long code;
    Py_ssize_t shape1;
    const Py_ssize_t *shape;
} Payload;

static int payload_open(Payload *p, PyObject *obj, long code) {
    if (PyBytes_CheckExact(obj)) {
        if (PyObject_GetBuffer(obj, &p->view, PyBUF_SIMPLE) < 0) return -1;
        p->kind = KIND_BYTES, p->ndim = 1, p->shape1 = p->view.len, p->shape = &p->shape1, p->code = uint8_code;
        return 0;
    }
    if (PyObject_GetBuffer(obj, &p->view, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 1;
    }
    p->kind = KIND_NDARRAY, p->ndim = p->view.ndim, p->shape = p->view.shape, p->code = code;
    if (p->ndim > MAX_NDIM || code < 0 || code > 255 || (p->ndim > 0 && p->shape == NULL)) {
        PyBuffer_Release(&p->view);
        return 1;
    }
    return 0;
}

/* The frame header of ``p`` at ``f`` (32 + 8 * ndim bytes), its payload checksummed if ``covered``. */
static void frame_header(unsigned char *f, const Payload *p, int covered) {
    memcpy(f, "PMSH", 4);
    f[4] = FRAME_VERSION, f[5] = (unsigned char)p->kind, f[6] = covered ? FLAG_PAYLOAD_CRC : 0;
    f[7] = (unsigned char)p->code, f[8] = 0, f[9] = (unsigned char)p->ndim;
    put16(f + 10, 0);
    put64(f + 12, covered ? xxh3(p->view.buf, (size_t)p->view.len) : 0);
    put64(f + 20, (uint64_t)p->view.len);
    for (int i = 0; i < p->ndim; i++) put64(f + FRAME_NBYTES + 8 * i, (uint64_t)(int64_t)p->shape[i]);
    uint32_t crc = crc32_update(0, f, FRAME_FIXED);
    put32(f + FRAME_FIXED, crc32_update(crc, f + FRAME_NBYTES, 8 * (size_t)p->ndim));
}

/* envelope(payload, code, tag, checksum) -> (bytes, frame_nbytes) | None
 * The envelope of ``payload``'s frame on popmesh tag ``tag``, as the Python path builds it
 * (encode_message, then inline_envelope or plan_frame): the whole frame inline when it fits in one
 * envelope, else the frame's header inline and the payload as the one segment (isend sends it
 * from the payload's own memory). Payloads up to 4 KiB always carry their checksum; larger ones
 * when ``checksum`` is true. None when the payload is not one this path frames. */
static PyObject *envelope(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "envelope(payload, code, tag, checksum)");
        return NULL;
    }
    if (!bound()) return NULL;
    long code = PyLong_AsLong(args[1]);
    if (code == -1 && PyErr_Occurred()) return NULL;
    unsigned long tag = PyLong_AsUnsignedLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    int checksum = PyObject_IsTrue(args[3]);
    if (checksum < 0) return NULL;
    Payload p;
    int refused = payload_open(&p, args[0], code);
    if (refused < 0) return NULL;
    if (refused) Py_RETURN_NONE;
    if (p.view.len > INT_MAX - FRAME_NBYTES - 8 * MAX_NDIM) { /* MPI counts are ints: the Python path's */
        PyBuffer_Release(&p.view);
        Py_RETURN_NONE;
    }
    Py_ssize_t header = FRAME_NBYTES + 8 * p.ndim, frame = header + p.view.len;
    int covered = p.view.len <= SMALL_FRAME_MAX || checksum, whole = frame <= INLINE_MAX;
    Py_ssize_t size = whole ? ENV_NBYTES + frame : ENV_NBYTES + 8 + header;
    PyObject *env = PyBytes_FromStringAndSize(NULL, size);
    if (env == NULL) {
        PyBuffer_Release(&p.view);
        return NULL;
    }
    unsigned char *e = (unsigned char *)PyBytes_AS_STRING(env);
    memcpy(e, "PMTE", 4);
    put16(e + 4, ENV_VERSION);
    put16(e + 6, whole ? 0 : 1);
    put64(e + 8, (uint64_t)frame);
    put32(e + 16, (uint32_t)(whole ? frame : header));
    put32(e + 20, (uint32_t)tag);
    put32(e + 24, whole ? 0 : (uint32_t)((uintptr_t)p.view.buf % PAGE_NBYTES));
    unsigned char *f = e + ENV_NBYTES;
    if (!whole) {
        put64(f, (uint64_t)p.view.len);
        f += 8;
    }
    frame_header(f, &p, covered);
    if (whole) memcpy(f + header, p.view.buf, (size_t)p.view.len);
    PyBuffer_Release(&p.view);
    return Py_BuildValue("(Nn)", env, frame);
}

/* isend(comm, envelope, payload, code, dst, mpi_tag) -> None | Send
 * MPI_Isend of ``envelope`` (from envelope()) on ``mpi_tag`` and, when it announces a segment, of
 * ``payload`` from its own memory on ``mpi_tag + 1``; then one test: None when MPI completed them
 * at once (a small message sent eagerly), else the Send to test until it completes. */
static PyObject *isend(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyBytes_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "isend(comm, envelope: bytes, payload, code, dst, mpi_tag)");
        return NULL;
    }
    MPI_Comm comm = MPI_Comm_f2c((MPI_Fint)PyLong_AsLong(args[0]));
    long code = PyLong_AsLong(args[3]);
    int dst = (int)PyLong_AsLong(args[4]), mtag = (int)PyLong_AsLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (!bound()) return NULL;
    PyObject *env = args[1];
    const unsigned char *e = (const unsigned char *)PyBytes_AS_STRING(env);
    Payload p;
    p.view.obj = NULL;
    int segmented = PyBytes_GET_SIZE(env) >= ENV_NBYTES + 8 && get16(e + 6) == 1;
    if (segmented) {
        int refused = payload_open(&p, args[2], code);
        if (refused < 0) return NULL;
        if (refused || (uint64_t)p.view.len != get64(e + ENV_NBYTES) || p.view.len > INT_MAX) {
            if (!refused) PyBuffer_Release(&p.view);
            PyErr_SetString(PyExc_ValueError, "isend: the payload is not the one the envelope announces");
            return NULL;
        }
    }
    MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    int err = MPI_Isend(e, (int)PyBytes_GET_SIZE(env), MPI_BYTE, dst, mtag, comm, &requests[0]);
    if (err == MPI_SUCCESS && segmented)
        err = MPI_Isend(p.view.buf, (int)p.view.len, MPI_BYTE, dst, mtag + 1, comm, &requests[1]);
    int done = 0;
    if (err == MPI_SUCCESS) err = MPI_Testall(2, requests, &done, MPI_STATUSES_IGNORE);
    if (done || (err != MPI_SUCCESS && requests[0] == MPI_REQUEST_NULL && requests[1] == MPI_REQUEST_NULL)) {
        if (p.view.obj != NULL) PyBuffer_Release(&p.view);
        if (err != MPI_SUCCESS) return mpi_error(err);
        Py_RETURN_NONE;
    }
    /* posted and not complete (or failed with a send still posted): MPI may read the buffers until it ends */
    Py_INCREF(env);
    SendObject *op = PyObject_New(SendObject, &SendType);
    if (op == NULL) return NULL; /* the buffers then stay referenced for the life of the process */
    op->requests[0] = requests[0], op->requests[1] = requests[1];
    op->envelope = env;
    op->payload = p.view;
    if (err != MPI_SUCCESS) {
        Py_DECREF(op); /* in flight: dealloc keeps the buffers */
        return mpi_error(err);
    }
    return (PyObject *)op;
}

/* ---- receiving ---------------------------------------------------------------------------- */

/* The value of the frame ``f`` (``n`` bytes), decoded as wire._decode_plain decodes it: bytes, or a
 * numpy array, new or (when ``base`` is given and the data is aligned) a view of ``base``, whose
 * memory holds ``f``. NULL with no exception set when any check fails: the Python path decides. */
static PyObject *decode_plain(const unsigned char *f, size_t n, PyObject *base) {
    if (n < FRAME_NBYTES || memcmp(f, "PMSH", 4) != 0) return NULL;
    int version = f[4], kind = f[5], flags = f[6], code = f[7], device = f[8], ndim = f[9];
    uint16_t reserved = get16(f + 10);
    uint64_t digest = get64(f + 12), nbytes = get64(f + 20);
    uint32_t stored = get32(f + FRAME_FIXED);
    size_t header = FRAME_NBYTES + 8 * (size_t)ndim;
    if (version != FRAME_VERSION || (flags & ~FLAG_PAYLOAD_CRC) || device || reserved || ndim > MAX_NDIM
        || n < header || n - header != nbytes || kind < KIND_BYTES || kind > KIND_NDARRAY || (digest && !flags))
        return NULL;
    if (crc32_update(crc32_update(0, f, FRAME_FIXED), f + FRAME_NBYTES, 8 * (size_t)ndim) != stored) return NULL;
    const unsigned char *data = f + header;
    if (flags && xxh3(data, (size_t)nbytes) != digest) return NULL;
    if (kind == KIND_BYTES) {
        if (code != uint8_code || ndim != 1 || get64(f + FRAME_NBYTES) != nbytes) return NULL;
        return PyBytes_FromStringAndSize((const char *)data, (Py_ssize_t)nbytes);
    }
    PyArray_Descr *descr = descr_by_code[code];
    if (descr == NULL) return NULL;
    npy_intp dims[MAX_NDIM];
    uint64_t count = 1;
    for (int i = 0; i < ndim; i++) {
        int64_t d = (int64_t)get64(f + FRAME_NBYTES + 8 * i);
        if (d < 0 || (d && count > UINT64_MAX / (uint64_t)d)) return NULL;
        dims[i] = (npy_intp)d;
        count *= (uint64_t)d;
    }
    uint64_t itemsize = (uint64_t)PyDataType_ELSIZE(descr);
    if (itemsize && count > UINT64_MAX / itemsize) return NULL;
    if (count * itemsize != nbytes) return NULL;
    int view = base != NULL && (uintptr_t)data % (uintptr_t)PyDataType_ALIGNMENT(descr) == 0;
    Py_INCREF(descr); /* PyArray_NewFromDescr steals it */
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, descr, ndim, dims, NULL, view ? (void *)data : NULL,
                                         view ? NPY_ARRAY_CARRAY : 0, NULL);
    if (arr == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (view) {
        Py_INCREF(base);
        if (PyArray_SetBaseObject((PyArrayObject *)arr, base) < 0) {
            Py_DECREF(arr);
            PyErr_Clear();
            return NULL;
        }
    } else if (nbytes) {
        memcpy(PyArray_DATA((PyArrayObject *)arr), data, (size_t)nbytes);
    }
    return arr;
}

/* Whether the envelope ``e`` of ``n`` bytes carries a frame for popmesh tag ``tag`` whole (``*frame``:
 * its length), or its header inline and the rest as one segment (``*segment``: that segment's length),
 * as parse_envelope reads it; anything else (more segments, or not well formed) returns 0. */
static int envelope_shape(const unsigned char *e, size_t n, uint32_t tag, size_t *frame, size_t *segment) {
    if (n < ENV_NBYTES || memcmp(e, "PMTE", 4) != 0 || get16(e + 4) != ENV_VERSION || get32(e + 20) != tag)
        return 0;
    uint16_t nseg = get16(e + 6);
    uint64_t total = get64(e + 8);
    uint32_t inline_n = get32(e + 16), page = get32(e + 24);
    if (inline_n > INLINE_MAX || page >= PAGE_NBYTES) return 0;
    if (nseg == 0) {
        if (page || inline_n != total || ENV_NBYTES + (size_t)inline_n != n) return 0;
        *frame = inline_n, *segment = 0;
        return 1;
    }
    if (nseg != 1 || ENV_NBYTES + 8 + (size_t)inline_n != n) return 0;
    uint64_t length = get64(e + ENV_NBYTES);
    if (length == 0 || length > INT32_MAX || inline_n + length != total) return 0;
    *frame = (size_t)total, *segment = (size_t)length;
    return 1;
}

/* probe(comm, src, mpi_tag, spin_s, segment_spin_s, segment_max)
 *   -> None | (state, obj, nbytes, request, segment)
 * Matched probes for the next envelope from ``src`` on ``mpi_tag`` for up to ``spin_s`` seconds, the
 * GIL released (yielding the CPU every 32 probes); None if none came. Otherwise it is received, and:
 * - a frame carried whole: (1, value, frame length, 0, 0) when decoded here;
 * - a frame of at most ``segment_max`` bytes with one segment: its buffer (a new uint8 array) takes
 *   the header, the segment's receive is posted into it and tested for up to ``segment_spin_s``
 *   (yielding the CPU every 32 tests): (1, value, frame length, 0, 0) decoded here (an array viewing
 *   the buffer), (3, buffer, frame length, 0, 0) complete but for the Python decoder, (2, buffer,
 *   frame length, request, segment length) still arriving, with the Fortran handle of its MPI
 *   request, or (4, why, frame length, 0, 0) when the segment that came is not as long as the
 *   envelope announced;
 * - anything else: (0, envelope, 0, 0, 0), the received envelope as a new uint8 array for the Python path.
 * A frame that is taken and cannot be held (no memory) has its segment received into nothing, so no
 * later frame's receive can match it. The caller keeps one such receive at a time per source and tag:
 * an envelope and its segment are matched by two calls, which another receive must not come between. */
static PyObject *probe(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "probe(comm, src, mpi_tag, spin_s, segment_spin_s, segment_max)");
        return NULL;
    }
    MPI_Comm comm = MPI_Comm_f2c((MPI_Fint)PyLong_AsLong(args[0]));
    int src = (int)PyLong_AsLong(args[1]), mtag = (int)PyLong_AsLong(args[2]);
    double spin = PyFloat_AsDouble(args[3]), segment_spin = PyFloat_AsDouble(args[4]);
    Py_ssize_t segment_max = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred() || !bound()) return NULL;
    if (!(spin >= 0 && spin <= 3600 && segment_spin >= 0 && segment_spin <= 3600) || segment_max < 0) {
        PyErr_SetString(PyExc_ValueError, "probe: spins are seconds in [0, 3600], segment_max is at least 0");
        return NULL;
    }
    unsigned char stack[STACK_NBYTES];
    unsigned char *buf = stack;
    int err = MPI_SUCCESS, flag = 0, count = 0;
    MPI_Message message;
    MPI_Status status;
    Py_BEGIN_ALLOW_THREADS
    double until = now_s() + spin;
    for (unsigned polls = 1;; polls++) {
        err = MPI_Improbe(src, mtag, comm, &flag, &message, &status);
        if (err != MPI_SUCCESS || flag) break;
        if (polls % 32 == 0) {
            if (now_s() >= until) break;
            sched_yield();
        }
    }
    if (err == MPI_SUCCESS && flag) {
        err = MPI_Get_count(&status, MPI_BYTE, &count);
        if (err == MPI_SUCCESS && count > STACK_NBYTES) {
            buf = malloc((size_t)count);
            if (buf == NULL) { /* taken into no bytes (MPI_ERR_TRUNCATE), so it is not left matched */
                static unsigned char sink;
                MPI_Mrecv(&sink, 0, MPI_BYTE, &message, MPI_STATUS_IGNORE);
                buf = stack;
                count = -1;
            }
        }
        if (err == MPI_SUCCESS && count >= 0) err = MPI_Mrecv(buf, count, MPI_BYTE, &message, MPI_STATUS_IGNORE);
    }
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    size_t n = (size_t)count, frame = 0, segment = 0;
    if (err != MPI_SUCCESS) {
        mpi_error(err);
        goto done;
    }
    if (!flag) {
        Py_INCREF(Py_None);
        out = Py_None;
        goto done;
    }
    if (count < 0) {
        PyErr_NoMemory();
        goto done;
    }
    int shaped = envelope_shape(buf, n, (uint32_t)(mtag / 2), &frame, &segment);
    if (shaped && segment == 0) {
        PyObject *value = decode_plain(buf + ENV_NBYTES, frame, NULL);
        if (value != NULL) {
            out = Py_BuildValue("(iNnin)", 1, value, (Py_ssize_t)frame, 0, (Py_ssize_t)0);
            goto done;
        }
        if (PyErr_Occurred()) goto done;
    } else if (shaped && frame <= (size_t)segment_max) {
        size_t head = frame - segment;
        npy_intp dims[1] = {(npy_intp)frame};
        PyObject *whole = PyArray_SimpleNew(1, dims, NPY_UINT8);
        if (whole == NULL) { /* take the segment into no bytes, so the next frame's receive cannot match it */
            static unsigned char sink;
            Py_BEGIN_ALLOW_THREADS
            MPI_Recv(&sink, 0, MPI_BYTE, src, mtag + 1, comm, MPI_STATUS_IGNORE);
            Py_END_ALLOW_THREADS
            goto done;
        }
        unsigned char *w = PyArray_DATA((PyArrayObject *)whole);
        memcpy(w, buf + ENV_NBYTES + 8, head);
        MPI_Request request = MPI_REQUEST_NULL;
        MPI_Status got;
        int complete = 0, received = -1;
        Py_BEGIN_ALLOW_THREADS
        err = MPI_Irecv(w + head, (int)segment, MPI_BYTE, src, mtag + 1, comm, &request);
        double limit = now_s() + segment_spin;
        for (unsigned polls = 1; err == MPI_SUCCESS; polls++) {
            err = MPI_Test(&request, &complete, &got);
            if (err != MPI_SUCCESS || complete) break;
            if (polls % 32 == 0) { /* the sender may need this core to send the rest */
                if (now_s() >= limit) break;
                sched_yield();
            }
        }
        if (err == MPI_SUCCESS && complete) err = MPI_Get_count(&got, MPI_BYTE, &received);
        Py_END_ALLOW_THREADS
        if (err != MPI_SUCCESS) {
            if (request == MPI_REQUEST_NULL) Py_DECREF(whole); /* else MPI may still write there: kept */
            mpi_error(err);
            goto done;
        }
        if (!complete) { /* whole stays referenced here if the tuple cannot be made: MPI writes into it */
            out = Py_BuildValue("(iOnin)", 2, whole, (Py_ssize_t)frame, (int)MPI_Request_c2f(request),
                                (Py_ssize_t)segment);
            if (out != NULL) Py_DECREF(whole);
            goto done;
        }
        if ((size_t)received != segment) {
            Py_DECREF(whole);
            out = Py_BuildValue("(iNnin)", 4, PyUnicode_FromFormat(
                "a frame's segment of %d bytes arrived where its envelope announced %zu", received, segment),
                (Py_ssize_t)frame, 0, (Py_ssize_t)0);
            goto done;
        }
        PyObject *value = decode_plain(w, frame, whole);
        if (value != NULL) {
            Py_DECREF(whole);
            out = Py_BuildValue("(iNnin)", 1, value, (Py_ssize_t)frame, 0, (Py_ssize_t)0);
        } else if (!PyErr_Occurred()) {
            out = Py_BuildValue("(iNnin)", 3, whole, (Py_ssize_t)frame, 0, (Py_ssize_t)0);
        } else {
            Py_DECREF(whole);
        }
        goto done;
    }
    npy_intp dims[1] = {(npy_intp)n};
    PyObject *raw = PyArray_SimpleNew(1, dims, NPY_UINT8);
    if (raw != NULL) {
        if (n) memcpy(PyArray_DATA((PyArrayObject *)raw), buf, n);
        out = Py_BuildValue("(iNnin)", 0, raw, (Py_ssize_t)0, 0, (Py_ssize_t)0);
    }
done:
    if (buf != stack) free(buf);
    return out;
}

/* ---- set-up ------------------------------------------------------------------------------- */

/* bind(xxh3_library, dtypes, uint8_code, mpi_exception) -> the MPI library version seen from here
 * Load XXH3_64bits from the xxhash extension at ``xxh3_library``; take the numpy dtypes to decode
 * (``dtypes``: wire code -> dtype, native byte order only) and mpi4py's MPI.Exception. The caller
 * compares the returned version with mpi4py's and checks MPI_Initialized through initialized(). */
static PyObject *bind(PyObject *module, PyObject *args) {
    const char *path;
    PyObject *dtypes, *exc;
    int code8;
    if (!PyArg_ParseTuple(args, "sO!iO", &path, &PyDict_Type, &dtypes, &code8, &exc)) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) return PyErr_Format(PyExc_ImportError, "cannot load %s: %s", path, dlerror());
    xxh3 = (xxh3_fn)dlsym(lib, "XXH3_64bits");
    if (xxh3 == NULL) return PyErr_Format(PyExc_ImportError, "%s has no XXH3_64bits", path);
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(dtypes, &pos, &key, &value)) {
        long c = PyLong_AsLong(key);
        if (c < 0 || c > 255) return PyErr_Format(PyExc_ValueError, "dtype code %ld", c);
        PyArray_Descr *descr = NULL;
        if (!PyArray_DescrConverter(value, &descr)) return NULL;
        Py_XSETREF(descr_by_code[c], descr);
    }
    uint8_code = code8;
    Py_INCREF(exc);
    Py_XSETREF(mpi_exception, exc);
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(version, &len);
    return PyUnicode_DecodeLatin1(version, len, NULL);
}

static PyObject *initialized(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    int flag = 0, finalized = 0;
    MPI_Initialized(&flag);
    MPI_Finalized(&finalized);
    return PyBool_FromLong(flag && !finalized);
}

static PyMethodDef module_methods[] = {
    {"bind", bind, METH_VARARGS, "Load XXH3 and the dtypes; the MPI library version seen from here."},
    {"initialized", initialized, METH_NOARGS, "Whether the MPI seen from here is initialised and not finalised."},
    {"envelope", (PyCFunction)(void (*)(void))envelope, METH_FASTCALL, "A payload's envelope and frame length, or None."},
    {"isend", (PyCFunction)(void (*)(void))isend, METH_FASTCALL, "Post an envelope (and its segment); None once done."},
    {"probe", (PyCFunction)(void (*)(void))probe, METH_FASTCALL, "Spin for one source's next frame and take it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_native", "popmesh's MPI small-message path in C (see native.py).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    import_array();
    crc_init();
    if (PyType_Ready(&SendType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    Py_INCREF(&SendType);
    if (PyModule_AddObject(m, "Send", (PyObject *)&SendType) < 0) {
        Py_DECREF(&SendType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
