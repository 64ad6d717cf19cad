/* The hot path of Communicator.allreduce in C: a counted in-place MPI_Allreduce(SUM).
 *
 * Optional: built by `python -m hpcnn.parallel.collectives.lean_build` (the Makefile does it)
 * with the MPI compiler wrapper of the MPI that mpi4py uses; without it hpcnn.parallel.collectives
 * uses the same path written in Python, about 0.2-0.3 us slower per call (what matters for
 * 1-4 KiB messages).
 *
 *   Counter(num, den)           calls, raw, seconds, num, den: the counters CommStats sums
 *   Lean(comm, counter, general, ndarray, sampled_below, sample_every)
 *       lean(buf, algorithm="mpi") -> buf
 *   A C-contiguous writable ndarray of a basic numeric type, with algorithm "mpi" (or "auto"
 *   below lean.auto_below bytes, or below lean.private_below outside the address ranges of
 *   lean.shared), is summed in place by MPI_Allreduce with the GIL released;
 *   anything else is handed to general(buf, algorithm), the Python method.
 *   lean.record, lean.fault, lean.name (optional; set by the watchdog, watchdog.py): the
 *   watchdog's [seq, current call, last call] list, its [armed fault] list and the
 *   communicator's name: each call on this path is recorded as the current call
 *   (seq, "allreduce", name, -1, bytes) while MPI_Allreduce runs; while a fault is armed every
 *   call goes to general (which records it and may skip it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <mpi.h>
#include <mpi4py/mpi4py.h>
#include <stdint.h>
#include <time.h>

typedef struct {
    PyObject_HEAD
    long long calls, raw;
    double seconds;
    long long num, den;
} Counter;

static PyMemberDef Counter_members[] = {
    {"calls", T_LONGLONG, offsetof(Counter, calls), 0, "calls"},
    {"raw", T_LONGLONG, offsetof(Counter, raw), 0, "bytes passed (before num/den)"},
    {"seconds", T_DOUBLE, offsetof(Counter, seconds), 0, "seconds inside the calls"},
    {"num", T_LONGLONG, offsetof(Counter, num), READONLY, "numerator of the bytes counted"},
    {"den", T_LONGLONG, offsetof(Counter, den), READONLY, "denominator of the bytes counted"},
    {NULL}
};

static int Counter_init(Counter *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"num", "den", NULL};
    self->num = 1; self->den = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|LL", names, &self->num, &self->den)) return -1;
    self->calls = 0; self->raw = 0; self->seconds = 0.0;
    return 0;
}

static PyTypeObject CounterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpcnn.parallel.collectives._lean.Counter",
    .tp_basicsize = sizeof(Counter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Counter_init,
    .tp_members = Counter_members,
    .tp_doc = "Calls, bytes and seconds of one operation.",
};

typedef struct {
    PyObject_HEAD
    MPI_Comm comm;
    Counter *counter;
    PyObject *general, *ndarray, *s_mpi, *s_auto, *shared;
    PyObject *record, *fault, *name, *s_kind, *minus_one;   /* the watchdog's (optional) */
    long long auto_below, private_below, sampled_below, sample_every;
    vectorcallfunc vectorcall;
} Lean;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static MPI_Datatype datatype(const char *fmt, Py_ssize_t itemsize) {
    char c = fmt ? fmt[0] : 'B';
    if (c == '<' || c == '=' || c == '@') c = fmt[1];
    switch (c) {
    case 'f': return itemsize == 4 ? MPI_FLOAT : MPI_DATATYPE_NULL;
    case 'd': return itemsize == 8 ? MPI_DOUBLE : MPI_DATATYPE_NULL;
    case 'i': return itemsize == 4 ? MPI_INT32_T : MPI_DATATYPE_NULL;
    case 'l': case 'q': return itemsize == 8 ? MPI_INT64_T : MPI_DATATYPE_NULL;
    case 'L': case 'Q': return itemsize == 8 ? MPI_UINT64_T : MPI_DATATYPE_NULL;
    case 'I': return itemsize == 4 ? MPI_UINT32_T : MPI_DATATYPE_NULL;
    case 'h': return itemsize == 2 ? MPI_INT16_T : MPI_DATATYPE_NULL;
    case 'b': return MPI_INT8_T;
    case 'B': return MPI_UINT8_T;
    default: return MPI_DATATYPE_NULL;
    }
}

/* 1 if [p, p + n) lies in one of the (start, stop) address ranges of self->shared. */
static int in_shared(Lean *self, const char *p, Py_ssize_t n) {
    if (self->shared == NULL || !PyList_Check(self->shared)) return 0;
    Py_ssize_t k = PyList_GET_SIZE(self->shared);
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *r = PyList_GET_ITEM(self->shared, i);
        if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) continue;
        unsigned long long a = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(r, 0));
        unsigned long long b = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(r, 1));
        if (PyErr_Occurred()) { PyErr_Clear(); continue; }
        if ((unsigned long long)(uintptr_t)p + (unsigned long long)n > a
            && (unsigned long long)(uintptr_t)p < b) return 1;
    }
    return 0;
}

static PyObject *fallback(Lean *self, PyObject *buf, PyObject *alg) {
    return PyObject_CallFunctionObjArgs(self->general, buf, alg ? alg : self->s_mpi, NULL);
}

/* Record (seq + 1, "allreduce", name, -1, nbytes) as the current call in self->record; returns
   the previous current call (a new reference) for end_record, or NULL (not recording, or an
   error, cleared: recording never fails a call). */
static PyObject *begin_record(Lean *self, Py_ssize_t nbytes) {
    PyObject *rec = self->record;
    if (rec == NULL || !PyList_CheckExact(rec) || PyList_GET_SIZE(rec) != 3) return NULL;
    long long seq = PyLong_AsLongLong(PyList_GET_ITEM(rec, 0));
    if (seq == -1 && PyErr_Occurred()) { PyErr_Clear(); return NULL; }
    PyObject *seqo = PyLong_FromLongLong(seq + 1), *nb = PyLong_FromSsize_t(nbytes);
    PyObject *call = (seqo && nb) ? PyTuple_Pack(5, seqo, self->s_kind,
                                                 self->name ? self->name : Py_None,
                                                 self->minus_one, nb) : NULL;
    Py_XDECREF(nb);
    if (call == NULL) { Py_XDECREF(seqo); PyErr_Clear(); return NULL; }
    PyObject *prev = PyList_GET_ITEM(rec, 1);
    Py_INCREF(prev);
    PyList_SetItem(rec, 0, seqo);       /* steal seqo and call; prev keeps the reference */
    PyList_SetItem(rec, 1, call);       /* taken above, the list's own is dropped */
    return prev;
}

/* The call is over: it becomes the last call, prev (stolen) the current one again. */
static void end_record(Lean *self, PyObject *prev) {
    if (prev == NULL) return;
    PyObject *rec = self->record;
    PyObject *call = PyList_GET_ITEM(rec, 1);
    Py_INCREF(call);
    PyList_SetItem(rec, 2, call);
    PyList_SetItem(rec, 1, prev);
}

static PyObject *Lean_vectorcall(PyObject *obj, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames) {
    Lean *self = (Lean *)obj;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *buf, *alg = NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs < 1 || nargs + nkw > 2) {
        PyErr_SetString(PyExc_TypeError, "allreduce(buf, algorithm='mpi')");
        return NULL;
    }
    buf = args[0];
    if (nargs == 2) alg = args[1];
    else if (nkw == 1) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, 0);
        if (PyUnicode_CompareWithASCIIString(k, "algorithm") != 0) {
            PyErr_Format(PyExc_TypeError, "allreduce() got an unexpected keyword %R", k);
            return NULL;
        }
        alg = args[1];
    }
    if ((PyObject *)Py_TYPE(buf) != self->ndarray) return fallback(self, buf, alg);
    if (self->fault != NULL && PyList_CheckExact(self->fault) && PyList_GET_SIZE(self->fault) > 0
        && PyList_GET_ITEM(self->fault, 0) != Py_None)
        return fallback(self, buf, alg);           /* an armed test-only fault: general decides */
    int is_auto = 0;
    if (alg != NULL && alg != self->s_mpi) {
        if (alg == self->s_auto) is_auto = 1;
        else if (PyUnicode_Check(alg) && PyUnicode_CompareWithASCIIString(alg, "mpi") == 0) ;
        else if (PyUnicode_Check(alg) && PyUnicode_CompareWithASCIIString(alg, "auto") == 0)
            is_auto = 1;
        else return fallback(self, buf, alg);
    }
    Py_buffer view;
    if (PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return fallback(self, buf, alg);
    }
    MPI_Datatype dt = datatype(view.format, view.itemsize);
    /* auto: the library below auto_below, and below private_below for a buffer outside the
       shared windows (those may take the zero-copy shm path) */
    int lib = !is_auto || view.len < self->auto_below
        || (view.len < self->private_below && !in_shared(self, view.buf, view.len));
    if (dt == MPI_DATATYPE_NULL || !lib || view.len / view.itemsize > INT_MAX) {
        PyBuffer_Release(&view);
        return fallback(self, buf, alg);
    }
    Counter *c = self->counter;
    c->calls += 1;
    c->raw += view.len;
    int timed = view.len >= self->sampled_below || (c->calls % self->sample_every) == 0;
    double t0 = timed ? now() : 0.0;
    PyObject *prev = begin_record(self, view.len);
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = MPI_Allreduce(MPI_IN_PLACE, view.buf, (int)(view.len / view.itemsize), dt, MPI_SUM,
                        self->comm);
    Py_END_ALLOW_THREADS
    end_record(self, prev);
    if (timed)
        c->seconds += (now() - t0) * (view.len >= self->sampled_below ? 1 : self->sample_every);
    PyBuffer_Release(&view);
    if (err != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING];
        int n = 0;
        MPI_Error_string(err, msg, &n);
        PyErr_Format(PyExc_RuntimeError, "MPI_Allreduce failed: %s", msg);
        return NULL;
    }
    Py_INCREF(buf);
    return buf;
}

static int Lean_init(Lean *self, PyObject *args, PyObject *kw) {
    PyObject *comm, *counter, *general, *ndarray;
    long long sampled_below, sample_every;
    if (!PyArg_ParseTuple(args, "OO!OOLL", &comm, &CounterType, &counter, &general, &ndarray,
                          &sampled_below, &sample_every))
        return -1;
    MPI_Comm *h = PyMPIComm_Get(comm);
    if (h == NULL) return -1;
    if (sample_every < 1) {
        PyErr_Format(PyExc_ValueError, "sample_every must be >= 1, got %lld", sample_every);
        return -1;
    }
    self->comm = *h;
    Py_INCREF(counter); Py_XSETREF(self->counter, (Counter *)counter);
    Py_INCREF(general); Py_XSETREF(self->general, general);
    Py_INCREF(ndarray); Py_XSETREF(self->ndarray, ndarray);
    Py_XSETREF(self->s_mpi, PyUnicode_InternFromString("mpi"));
    Py_XSETREF(self->s_auto, PyUnicode_InternFromString("auto"));
    self->auto_below = 0;
    self->private_below = 0;
    Py_XSETREF(self->shared, PyList_New(0));
    Py_XSETREF(self->s_kind, PyUnicode_InternFromString("allreduce"));
    Py_XSETREF(self->minus_one, PyLong_FromLong(-1));
    self->sampled_below = sampled_below;
    self->sample_every = sample_every;
    self->vectorcall = Lean_vectorcall;
    return 0;
}

/* general is a method of the Communicator that holds this object: a cycle the GC must see. */
static int Lean_traverse(Lean *self, visitproc visit, void *arg) {
    Py_VISIT(self->counter); Py_VISIT(self->general); Py_VISIT(self->ndarray);
    Py_VISIT(self->shared); Py_VISIT(self->record); Py_VISIT(self->fault);
    Py_VISIT(self->name);
    return 0;
}

static int Lean_clear(Lean *self) {
    Py_CLEAR(self->counter); Py_CLEAR(self->general); Py_CLEAR(self->ndarray);
    Py_CLEAR(self->shared); Py_CLEAR(self->s_mpi); Py_CLEAR(self->s_auto);
    Py_CLEAR(self->record); Py_CLEAR(self->fault); Py_CLEAR(self->name);
    Py_CLEAR(self->s_kind); Py_CLEAR(self->minus_one);
    return 0;
}

static void Lean_dealloc(Lean *self) {
    PyObject_GC_UnTrack(self);
    Lean_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef Lean_members[] = {
    {"auto_below", T_LONGLONG, offsetof(Lean, auto_below), 0,
     "'auto' takes this path below this many bytes"},
    {"private_below", T_LONGLONG, offsetof(Lean, private_below), 0,
     "'auto' also takes this path below this many bytes outside the shared ranges"},
    {"shared", T_OBJECT, offsetof(Lean, shared), 0,
     "list of (start, stop) addresses of the shared windows (zero-copy candidates)"},
    {"counter", T_OBJECT, offsetof(Lean, counter), READONLY, "the Counter bumped per call"},
    {"record", T_OBJECT, offsetof(Lean, record), 0,
     "the watchdog's [seq, current call, last call] list, or None: calls not recorded"},
    {"fault", T_OBJECT, offsetof(Lean, fault), 0,
     "the watchdog's [armed fault] list: while its item is not None, calls go to general"},
    {"name", T_OBJECT, offsetof(Lean, name), 0, "the communicator's name, in the records"},
    {NULL}
};

static PyTypeObject LeanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpcnn.parallel.collectives._lean.Lean",
    .tp_basicsize = sizeof(Lean),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Lean_init,
    .tp_dealloc = (destructor)Lean_dealloc,
    .tp_traverse = (traverseproc)Lean_traverse,
    .tp_clear = (inquiry)Lean_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Lean, vectorcall),
    .tp_members = Lean_members,
    .tp_doc = "Counted in-place MPI_Allreduce(SUM) of NumPy buffers; other cases go to general.",
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_lean", "Counted in-place allreduce in C (optional).", -1, NULL
};

PyMODINIT_FUNC PyInit__lean(void) {
    if (import_mpi4py() < 0) return NULL;
    if (PyType_Ready(&CounterType) < 0 || PyType_Ready(&LeanType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&CounterType);
    Py_INCREF(&LeanType);
    if (PyModule_AddObject(m, "Counter", (PyObject *)&CounterType) < 0 ||
        PyModule_AddObject(m, "Lean", (PyObject *)&LeanType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
