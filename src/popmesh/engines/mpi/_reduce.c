/* The in-window all-reduce's arithmetic in one pass (see shared_reduce.py).
 *
 * A member of a node-local group reduces its chunk across every member's copy and writes the result
 * into every copy. numpy takes three passes over the chunk for an average (add, divide, copy out);
 * this takes one, a cache-sized block at a time, with the GIL released. The bits are numpy's: the
 * same additions in rank order, then the division by the member count in the array's own type
 * (unsigned arithmetic for the integer types, which wraps as numpy's does). One exception: where two
 * NaNs are added, which NaN (sign, payload) results is the hardware's choice, as it is within numpy,
 * whose vector and scalar loops differ there. Only SUM (every type) and AVG (floats) are done here;
 * the other operations stay with numpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BLOCK_NBYTES 16384 /* a block of the accumulator: stays in L1 while every copy is added in */
#define MAX_COPIES 256

enum { F32, F64, I32, I64, U32, U64 };

#define COMBINE(NAME, T, ACC)                                                                      \
    static void NAME(char **copies, Py_ssize_t n, size_t count, int average) {                   \
        enum { B = BLOCK_NBYTES / sizeof(T) };                                                     \
        ACC acc[B];                                                                                \
        for (size_t lo = 0; lo < count; lo += B) {                                                 \
            size_t m = count - lo < (size_t)B ? count - lo : (size_t)B;                            \
            const T *first = (const T *)copies[0] + lo;                                            \
            for (size_t i = 0; i < m; i++) acc[i] = (ACC)first[i];                                 \
            for (Py_ssize_t k = 1; k < n; k++) {                                                   \
                const T *other = (const T *)copies[k] + lo;                                        \
                for (size_t i = 0; i < m; i++) acc[i] = (ACC)(acc[i] + (ACC)other[i]);             \
            }                                                                                      \
            if (average) {                                                                         \
                T members = (T)n;                                                                  \
                for (size_t i = 0; i < m; i++) acc[i] = (ACC)((T)acc[i] / members);                \
            }                                                                                      \
            for (Py_ssize_t k = 0; k < n; k++) memcpy((T *)copies[k] + lo, acc, m * sizeof(T));    \
        }                                                                                          \
    }

COMBINE(combine_f32, float, float)
COMBINE(combine_f64, double, double)
COMBINE(combine_i32, int32_t, uint32_t)
COMBINE(combine_i64, int64_t, uint64_t)
COMBINE(combine_u32, uint32_t, uint32_t)
COMBINE(combine_u64, uint64_t, uint64_t)

static const size_t ITEMSIZE[] = {4, 8, 4, 8, 4, 8};

/* combine(copies, kind, average) -> None
 * Reduce the equal-length writable buffers ``copies`` (one member's chunk each, in rank order)
 * element by element: their sum, divided by their number when ``average`` (floats only), written
 * into every one of them. ``kind``: 0 float32, 1 float64, 2 int32, 3 int64, 4 uint32, 5 uint64. */
static PyObject *combine(PyObject *module, PyObject *args) {
    PyObject *seq;
    int kind, average;
    if (!PyArg_ParseTuple(args, "Oip", &seq, &kind, &average)) return NULL;
    if (kind < F32 || kind > U64 || (average && kind > F64)) {
        PyErr_Format(PyExc_ValueError, "combine: kind %d%s is not one this kernel reduces", kind,
                     average ? " with average" : "");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "combine: copies must be a sequence of buffers");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n < 1 || n > MAX_COPIES) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "combine: %zd copies (1 to %d)", n, MAX_COPIES);
        return NULL;
    }
    Py_buffer views[MAX_COPIES];
    char *data[MAX_COPIES];
    Py_ssize_t opened = 0, nbytes = -1;
    PyObject *result = NULL;
    for (; opened < n; opened++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, opened), &views[opened],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        data[opened] = views[opened].buf;
        if (nbytes < 0) nbytes = views[opened].len;
        if (views[opened].len != nbytes || nbytes % (Py_ssize_t)ITEMSIZE[kind] != 0) {
            opened++;
            PyErr_SetString(PyExc_ValueError, "combine: the copies differ in length or hold part of an element");
            goto done;
        }
    }
    size_t count = (size_t)nbytes / ITEMSIZE[kind];
    Py_BEGIN_ALLOW_THREADS
    switch (kind) {
    case F32: combine_f32(data, n, count, average); break;
    case F64: combine_f64(data, n, count, average); break;
    case I32: combine_i32(data, n, count, 0); break;
    case I64: combine_i64(data, n, count, 0); break;
    case U32: combine_u32(data, n, count, 0); break;
    default: combine_u64(data, n, count, 0); break;
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (Py_ssize_t k = 0; k < opened; k++) PyBuffer_Release(&views[k]);
    Py_DECREF(fast);
    return result;
}

static PyMethodDef module_methods[] = {
    {"combine", combine, METH_VARARGS, "Sum (or average) equal chunks of every copy into all of them, in one pass."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_reduce", "The in-window all-reduce's arithmetic in C (see shared_reduce.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__reduce(void) { return PyModule_Create(&module_def); }
