/* The cpu backend's hot path in C: posts, the wait on the peers' posts, signature checks, the
 * small all-reduce's copy and in-order reduction, and the large all-reduce's rounds (staged and
 * zero copy), all with the GIL released.
 *
 * It speaks exactly the protocol of _cpu_sync.py over the layout of _cpu_layout.py (a header
 * per rank: u32 words [0] post counter, [1] sleeping flag, [2] abort kind; signature slots at
 * H_SIG), so ranks may mix it with the pure-Python path. It does only the common case: a wait
 * that is not over within the spin and yield times, a signature mismatch or a peer's abort
 * returns a code and Python takes over (sleeping on the futex, timeouts, peer death, every
 * error message). The reduction is elementwise in rank order (rank 0's data, then rank 1's...),
 * one pass per rank as _reduce.py does with NumPy, so results are bitwise the same.
 *
 * This file: the posts and waits, the object, the small all-reduce and the module. The large
 * all-reduce's rounds and zero copy are in _cshm_large.c, the loops over data in
 * _cshm_loops.c; _cshm.h is what they share.
 */
#include <linux/futex.h>
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "_cshm.h"
#include "_cshm_loops.h"

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int reached(uint32_t value, uint32_t target) {
    return (uint32_t)(value - target) < 0x80000000u;
}

void post(SyncObject *s, uint32_t p) {
    uint32_t *mine = s->hdr[s->rank];
    __atomic_store_n(&mine[W_CTR], p, __ATOMIC_RELEASE);
    /* The post must be visible before the sleeping flags are read (a sleeper sets its flag,
     * then re-reads the counter): a full fence, not only release. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int q = 0; q < s->n; q++) {
        if (q != s->rank && __atomic_load_n(&s->hdr[q][W_SLEEP], __ATOMIC_RELAXED)) {
            syscall(SYS_futex, &mine[W_CTR], FUTEX_WAKE, 0x7FFFFFFF, NULL, NULL, 0);
            return;
        }
    }
}

/* Sleep on ``ctr`` (a peer's post counter) for at most 1 ms unless it reached ``target``, with
 * this rank's sleeping flag up (as _cpu_sync.py's wait_word: a post wakes sleepers). */
static void nap(SyncObject *s, uint32_t *ctr, uint32_t target) {
    uint32_t *flag = &s->hdr[s->rank][W_SLEEP];
    __atomic_store_n(flag, 1, __ATOMIC_SEQ_CST);
    uint32_t v = __atomic_load_n(ctr, __ATOMIC_SEQ_CST);
    if (!reached(v, target)) {
        struct timespec ts = {0, 1000000};
        syscall(SYS_futex, ctr, FUTEX_WAIT, v, &ts, NULL, 0);
    }
    __atomic_store_n(flag, 0, __ATOMIC_RELEASE);
}

/* Spin, then poll yielding the core until ``limit`` seconds passed, then (``sleep`` > 0) sleep
 * on the futex until ``limit + sleep``; 0 when some peer has not reached ``target`` by then,
 * or a peer set its abort flag while this slept (Python finds out why). */
int wait_all_sleeping(SyncObject *s, uint32_t target, double limit, double sleep) {
    double start = 0.0;
    for (int q = 0; q < s->n; q++) {
        if (q == s->rank) continue;
        uint32_t *ctr = &s->hdr[q][W_CTR];
        unsigned polls = 0;
        while (!reached(__atomic_load_n(ctr, __ATOMIC_ACQUIRE), target)) {
            if ((++polls & 63) != 0) {
                cpu_relax();
                continue;
            }
            double t = now();
            if (start == 0.0) start = t;
            double spent = t - start;
            if (spent >= limit) {
                if (spent >= limit + sleep) return 0;
                if (__atomic_load_n(&s->hdr[q][W_ABORT], __ATOMIC_ACQUIRE)) return 0;
                nap(s, ctr, target);
            } else if (spent >= s->spin) {
                sched_yield();
            }
        }
    }
    return 1;
}

int wait_all(SyncObject *s, uint32_t target, double limit) {
    return wait_all_sleeping(s, target, limit, 0.0);
}

/* ---------------------------------------------------------------------------- the object */
static void Sync_dealloc(SyncObject *s) {
    PyMem_Free(s->hdr);
    PyMem_Free(s->slot[0]);
    PyMem_Free(s->slot[1]);
    PyMem_Free(s->src);
    PyMem_Free(s->res);
    PyMem_Free(s->scratch);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

int addresses(PyObject *seq, int n, void **out, const char *what) {
    if (!PyTuple_Check(seq) || PyTuple_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected a tuple of %d addresses", what, n);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        out[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(seq, i));
        if (out[i] == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "%s: address %d is NULL", what, i);
            return -1;
        }
    }
    return 0;
}

static int Sync_init(SyncObject *s, PyObject *args, PyObject *kwds) {
    int rank;
    PyObject *hdrs, *slots0, *slots1, *ress;
    double spin;
    int stream = -1;
    static char *kwlist[] = {"rank", "headers", "slots0", "slots1", "res", "spin", "stream", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOOOOd|i", kwlist, &rank, &hdrs, &slots0,
                                     &slots1, &ress, &spin, &stream))
        return -1;
    if (stream < -1 || stream > 1) {
        PyErr_Format(PyExc_ValueError, "stream must be -1 (measure), 0 or 1, got %d", stream);
        return -1;
    }
    if (!PyTuple_Check(hdrs) || PyTuple_GET_SIZE(hdrs) < 1) {
        PyErr_SetString(PyExc_ValueError, "headers: expected a non-empty tuple of addresses");
        return -1;
    }
    int n = (int)PyTuple_GET_SIZE(hdrs);
    if (rank < 0 || rank >= n) {
        PyErr_Format(PyExc_ValueError, "rank %d is not in a group of %d", rank, n);
        return -1;
    }
    s->n = n;
    s->rank = rank;
    s->spin = spin;
    s->stream = stream;
    memset(s->tune, 0, sizeof s->tune);
    s->hdr = PyMem_Calloc(n, sizeof(uint32_t *));
    s->slot[0] = PyMem_Calloc(n, sizeof(char *));
    s->slot[1] = PyMem_Calloc(n, sizeof(char *));
    s->src = PyMem_Calloc(n, sizeof(char *));
    s->res = PyMem_Calloc(n, sizeof(char *));
    s->scratch = PyMem_Malloc(BLOCK);
    if (!s->hdr || !s->slot[0] || !s->slot[1] || !s->src || !s->res || !s->scratch) {
        PyErr_NoMemory();
        return -1;
    }
    if (addresses(hdrs, n, (void **)s->hdr, "headers") < 0 ||
        addresses(slots0, n, (void **)s->slot[0], "slots0") < 0 ||
        addresses(slots1, n, (void **)s->slot[1], "slots1") < 0 ||
        addresses(ress, n, (void **)s->res, "res") < 0)
        return -1;
    return 0;
}

static int stream_class(size_t nb) {
    int c = 0;
    while (nb > 1 && c < STREAM_CLASSES - 1) {
        nb >>= 1;
        c++;
    }
    return c;
}

/* Whether streaming cost less than plain stores so far (0 while it is untried). */
static int streaming_is_cheaper(const StreamTune *t) {
    return t->cost[1] > 0.0 && t->cost[1] < t->cost[0];
}

/* Whether this call (``kind``: TUNE_ROUNDS or TUNE_SMALL) streams what the peers read: as
 * configured, else the way that cost less per byte so far at this kind and size class, and
 * one call in STREAM_EXPLORE the other way (the ranks make the same calls, so they try it
 * together: what is timed is both at once). Neither way is right everywhere: on this VM
 * streaming was 1.4-1.7x faster when the two vCPUs shared no cache and 1.1-2.5x slower when
 * they did, and which held changed within seconds. */
int pick_stream(SyncObject *s, int kind, size_t nb) {
    if (s->stream >= 0) return s->stream;
    StreamTune *t = &s->tune[kind][stream_class(nb)];
    int best = streaming_is_cheaper(t);
    return (++t->calls % STREAM_EXPLORE) == 2 ? !best : best;
}

/* Record what ``seconds`` of work over ``nb`` bytes cost the way ``way`` (pick_stream()'s):
 * the way it takes is averaged over calls, the other one's latest try replaces the last. */
void note_stream(SyncObject *s, int kind, size_t nb, int way, double seconds) {
    if (nb == 0) return;
    StreamTune *t = &s->tune[kind][stream_class(nb)];
    double c = seconds / (double)nb, *old = &t->cost[way];
    int usual = streaming_is_cheaper(t);
    *old = *old > 0.0 && way == usual ? 0.75 * *old + 0.25 * c : c;
}

/* Post ``target``'s signature slot: ``seq`` as 8 little-endian bytes, then ``rec`` (the rest of
 * the record and the data location, SIG_SLOT - 8 bytes). */
static void write_signature(SyncObject *s, uint32_t target, unsigned long long seq,
                            const char *rec) {
    char *sig = (char *)s->hdr[s->rank] + H_SIG + (size_t)(target & 1) * SIG_SLOT;
    for (int i = 0; i < 8; i++) sig[i] = (char)((seq >> (8 * i)) & 0xFF);
    memcpy(sig + 8, rec, SIG_SLOT - 8);
}

/* After every peer posted ``p``: compare signatures, then look for aborts. */
static int check(SyncObject *s, uint32_t p) {
    size_t off = H_SIG + (size_t)(p & 1) * SIG_SLOT;
    const char *mine = (const char *)s->hdr[s->rank] + off;
    for (int q = 0; q < s->n; q++)
        if (q != s->rank && memcmp((const char *)s->hdr[q] + off, mine, COMPARED) != 0)
            return RC_MISMATCH;
    for (int q = 0; q < s->n; q++) {
        uint32_t kind = q == s->rank ? 0 : __atomic_load_n(&s->hdr[q][W_ABORT], __ATOMIC_ACQUIRE);
        if (kind && kind != ABORT_CLOSED) return RC_ABORTED;
    }
    return RC_DONE;
}

/* The first three arguments of the calls that make a collective's first post: post, seq and
 * the record (SIG_SLOT - 8 bytes). 0, or -1 with an exception set. */
int first_post_args(PyObject *const *args, const char *what, unsigned long long *p,
                           unsigned long long *seq, const char **rec) {
    *p = PyLong_AsUnsignedLongLongMask(args[0]);
    *seq = PyLong_AsUnsignedLongLongMask(args[1]);
    if (PyErr_Occurred()) return -1;
    if (!PyBytes_Check(args[2]) || PyBytes_GET_SIZE(args[2]) != SIG_SLOT - 8) {
        PyErr_Format(PyExc_ValueError, "%s(): the record must be %d bytes", what, SIG_SLOT - 8);
        return -1;
    }
    *rec = PyBytes_AS_STRING(args[2]);
    return 0;
}

/* A collective's first post, with the GIL released: the signature record (see
 * write_signature()), post ``target``, wait for every peer (at most ``limit`` seconds), check.
 * RC_DONE, RC_WAIT (a peer has not posted yet), RC_MISMATCH or RC_ABORTED. */
int first_post(SyncObject *s, uint32_t target, unsigned long long seq, const char *rec,
                      double limit) {
    write_signature(s, target, seq, rec);
    post(s, target);
    if (!wait_all(s, target, limit)) return RC_WAIT;
    return check(s, target);
}

/* begin(post, seq, record, array, parity, code, limit) -> rc
 *
 * A collective's first post: (with ``array``: copy it into staging slot ``parity``), write
 * the signature record (``seq`` as 8 little-endian bytes, then ``record``: the rest of the
 * record and the data location, SIG_SLOT - 8 bytes), post, wait for every peer (at most
 * ``limit`` seconds), check. With ``array`` and ``code`` >= 0, then reduce every rank's slot
 * into ``array`` in rank order. Arguments are checked before anything is written. */
static PyObject *Sync_begin(SyncObject *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "begin() takes 7 arguments");
        return NULL;
    }
    unsigned long long p, seq;
    const char *recp;
    if (first_post_args(args, "begin", &p, &seq, &recp) < 0) return NULL;
    int par = PyLong_AsLong(args[4]) & 1;
    long code = PyLong_AsLong(args[5]);
    double limit = PyFloat_AsDouble(args[6]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer view = {0};
    int have = args[3] != Py_None;
    if (have) {
        if (PyObject_GetBuffer(args[3], &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            return NULL;
    }
    reducer fn = have && code >= 0 && code < 32 ? REDUCERS[code] : NULL;
    int rc;
    uint32_t target = (uint32_t)p;
    size_t nb = have ? (size_t)view.len : 0;
    /* Timed for the choice of stores: the copy and the reduction, not the wait between. */
    int tuned = fn != NULL && nb >= SMALL_STREAM_MIN;
    Py_BEGIN_ALLOW_THREADS
    int way = tuned ? pick_stream(s, TUNE_SMALL, nb) : 0;
    double t0 = tuned ? now() : 0.0, spent = 0.0;
    if (way)
        copy_stream(s->slot[par][s->rank], view.buf, nb);
    else if (nb)
        copy(s->slot[par][s->rank], view.buf, nb);
    if (tuned) spent = now() - t0;
    rc = first_post(s, target, seq, recp, limit);
    if (rc == RC_DONE && have) {
        if (fn == NULL) {
            rc = RC_REDUCE;
        } else if (nb) {
            if (tuned) t0 = now();
            for (int q = 0; q < s->n; q++) s->src[q] = s->slot[par][q];
            fn((char *)view.buf, s->src, s->n, nb / (size_t)view.itemsize);
            if (tuned) note_stream(s, TUNE_SMALL, nb, way, spent + now() - t0);
        }
    }
    Py_END_ALLOW_THREADS
    if (have) PyBuffer_Release(&view);
    return PyLong_FromLong(rc);
}

/* phase(post, limit) -> rc: a plain post, then the wait for every peer (RC_DONE, or RC_WAIT
 * after ``limit`` seconds). */
static PyObject *Sync_phase(SyncObject *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "phase() takes 2 arguments");
        return NULL;
    }
    unsigned long long p = PyLong_AsUnsignedLongLongMask(args[0]);
    double limit = PyFloat_AsDouble(args[1]);
    if (PyErr_Occurred()) return NULL;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    post(s, (uint32_t)p);
    ok = wait_all(s, (uint32_t)p, limit);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(ok ? RC_DONE : RC_WAIT);
}

/* stream_costs(nbytes, small) -> (plain, streaming): the seconds per byte pick_stream() has
 * seen each way at the size class of ``nbytes``, of the small all-reduce (``small``) or of
 * the staged rounds (0.0: not tried yet). */
static PyObject *Sync_stream_costs(SyncObject *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "stream_costs() takes 2 arguments");
        return NULL;
    }
    Py_ssize_t nb = PyLong_AsSsize_t(args[0]);
    int small = PyObject_IsTrue(args[1]);
    if (nb < 0 || small < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "nbytes must be >= 0");
        return NULL;
    }
    const StreamTune *t = &s->tune[small ? TUNE_SMALL : TUNE_ROUNDS][stream_class((size_t)nb)];
    return Py_BuildValue("(dd)", t->cost[0], t->cost[1]);
}

static PyMethodDef Sync_methods[] = {
    {"stream_costs", (PyCFunction)(void (*)(void))Sync_stream_costs, METH_FASTCALL,
     "stream_costs(nbytes, small) -> (plain, streaming): seconds per byte each way."},
    {"begin", (PyCFunction)(void (*)(void))Sync_begin, METH_FASTCALL,
     "begin(post, seq, record, array, parity, code, limit) -> rc: a collective's first post."},
    {"phase", (PyCFunction)(void (*)(void))Sync_phase, METH_FASTCALL,
     "phase(post, limit) -> rc: post, then wait for all."},
    {"rounds", (PyCFunction)(void (*)(void))Sync_rounds, METH_FASTCALL,
     "rounds(post, array, parity, code, avg, limit, sleep, per) -> (rc, done): the large "
     "all-reduce's rounds."},
    {"begin_rounds", (PyCFunction)(void (*)(void))Sync_begin_rounds, METH_FASTCALL,
     "begin_rounds(post, seq, record, array, parity, code, avg, limit, sleep, per) -> (rc, "
     "done): a staged large all-reduce's first post and rounds."},
    {"begin_zero_copy", (PyCFunction)(void (*)(void))Sync_begin_zero_copy, METH_FASTCALL,
     "begin_zero_copy(post, seq, record, expected, code, avg, arrays, lo, hi, itemsize, "
     "scratch, block, limit) -> rc: a zero-copy all-reduce in one call."},
    {"zero_copy", (PyCFunction)(void (*)(void))Sync_zero_copy, METH_FASTCALL,
     "zero_copy(code, avg, arrays, lo, hi, itemsize, scratch, block): the zero-copy slice's work."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SyncType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "collectives.backends.cpu._cshm.Sync",
    .tp_basicsize = sizeof(SyncObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Posts and waits of one rank over its group's segment headers.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Sync_init,
    .tp_dealloc = (destructor)Sync_dealloc,
    .tp_methods = Sync_methods,
};

/* The bytes of one item of each dtype row of REDUCERS (code / 4). */
static const Py_ssize_t CODE_ITEMSIZE[8] = {4, 8, 1, 4, 8, 1, 4, 8};

static void release_all(Py_buffer *bufs, int k) {
    for (int q = 0; q < k; q++) PyBuffer_Release(&bufs[q]);
}

/* reduce_into(code, avg, out, sources) -> None
 *
 * ``out = sources[0] op sources[1] op ...`` in order (then ``/ n`` when ``avg``), elementwise,
 * with the compiled loop of ``code`` (dtype * 4 + op, as _native_code), the GIL released.
 * ``out`` (writable) and the 2..64 sources are C-contiguous buffers of the same size; ``out``
 * may be the first or second source itself, never a later one (as NumPy's out= calls). */
static PyObject *cshm_reduce_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "reduce_into() takes 4 arguments");
        return NULL;
    }
    long code = PyLong_AsLong(args[0]);
    int avg = PyObject_IsTrue(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (code < 0 || code >= 32 || REDUCERS[code] == NULL || (avg && code != 0 && code != 4)) {
        PyErr_Format(PyExc_ValueError, "reduce_into(): no compiled reduction for code %ld", code);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[3], "reduce_into(): sources must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 2 || n > 64) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "reduce_into(): 2 to 64 sources, got %zd", n);
        return NULL;
    }
    Py_buffer bufs[65];
    if (PyObject_GetBuffer(args[2], &bufs[0], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    int got = 1;
    char *src[64];
    for (Py_ssize_t q = 0; q < n; q++, got++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, q);
        if (PyObject_GetBuffer(item, &bufs[got], PyBUF_C_CONTIGUOUS) < 0) break;
        if (bufs[got].len != bufs[0].len) {
            PyErr_Format(PyExc_ValueError, "reduce_into(): source %zd has %zd bytes, out %zd", q,
                         bufs[got].len, bufs[0].len);
            got++;
            break;
        }
        src[q] = (char *)bufs[got].buf;
    }
    Py_DECREF(seq);
    if (PyErr_Occurred()) {
        release_all(bufs, got);
        return NULL;
    }
    size_t count = (size_t)(bufs[0].len / CODE_ITEMSIZE[code / 4]);
    char *out = (char *)bufs[0].buf;
    reducer fn = REDUCERS[code];
    Py_BEGIN_ALLOW_THREADS
    fn(out, src, (int)n, count);
    if (avg) divide(out, code, count, (int)n);
    Py_END_ALLOW_THREADS
    release_all(bufs, got);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"reduce_into", (PyCFunction)(void (*)(void))cshm_reduce_into, METH_FASTCALL,
     "reduce_into(code, avg, out, sources): out = sources reduced in order, compiled."},
    {"reduce_into_many", (PyCFunction)(void (*)(void))cshm_reduce_into_many, METH_FASTCALL,
     "reduce_into_many(code, avg, outs, sources, lo, hi, workers, stream): items [lo, hi) of "
     "every output = sources reduced in order, compiled, on up to ``workers`` threads."},
    {"pool_stop", cshm_pool_stop, METH_NOARGS, "pool_stop(): end the pool's worker threads."},
    {"pool_threads", cshm_pool_threads, METH_NOARGS,
     "pool_threads() -> int: the pool's worker threads now."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_cshm",
    .m_doc = "The cpu backend's posts, waits and small all-reduce in C (see _cpu_sync.py).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__cshm(void) {
    if (PyType_Ready(&SyncType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&SyncType);
    if (PyModule_AddObject(m, "Sync", (PyObject *)&SyncType) < 0) {
        Py_DECREF(&SyncType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "H_SIG", H_SIG);
    PyModule_AddIntConstant(m, "SIG_SLOT", SIG_SLOT);
    PyModule_AddIntConstant(m, "COMPARED", COMPARED);
    return m;
}
