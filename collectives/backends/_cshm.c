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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <linux/futex.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* _cpu_layout.py's header words and offsets (native_module() refuses a build whose H_SIG,
 * SIG_SLOT or COMPARED differ from Python's). */
#define W_CTR 0
#define W_SLEEP 1
#define W_ABORT 2
#define ABORT_CLOSED 3
#define H_SIG 64
#define SIG_BYTES 128
#define SIG_SLOT (SIG_BYTES + 32)
#define COMPARED (SIG_BYTES - 8) /* all of a record but its magic word */

/* What begin() and phase() return. */
#define RC_DONE 0       /* finished (begin: reduced too, when asked to) */
#define RC_WAIT 1       /* posted, but a peer has not posted yet: Python waits */
#define RC_REDUCE 2     /* synchronized and checked; no C loop for this dtype/op: Python reduces */
#define RC_MISMATCH 3   /* a peer's signature differs: Python reports it */
#define RC_ABORTED 4    /* a peer gave up: Python raises its reason */
#define RC_WAIT2 5      /* rounds(): a round reduced, its second post out, a peer not there yet */
#define RC_BEGUN 6      /* begin_rounds(), begin_zero_copy(): posted and checked, Python goes on */

/* A large all-reduce's location flag bit (cpu.py's _COMPILED): the rank runs compiled rounds. */
#define LOC_COMPILED 2

/* The loops that move and reduce data, built twice where the compiler can (GCC, x86-64): with
 * AVX2 and for the baseline; the loader picks the one this CPU runs. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define WIDE __attribute__((target_clones("avx2", "default")))
#else
#define WIDE
#endif

/* Bytes per block of a slice's reduction: the result is copied on while still in cache. */
#define BLOCK (64 << 10)

/* Streaming stores for the data the peers read (the staged rounds' slot copies and reduced
 * slices), chosen per size class by measurement (see pick_stream()). */
#define STREAM_CLASSES 48 /* log2 of the bytes of an all-reduce */
#define STREAM_EXPLORE 64 /* one call in this many tries the other way */
#define TUNE_ROUNDS 0     /* the staged rounds (the time after the first post) */
#define TUNE_SMALL 1      /* the small all-reduce (its copy and reduction, not its wait) */
#define SMALL_STREAM_MIN (16 << 10) /* smaller ones always store plainly */
typedef struct {
    double cost[2]; /* seconds per byte of the timed work: plain, streaming stores; 0: none yet */
    unsigned calls;
} StreamTune;

typedef struct {
    PyObject_HEAD
    int n;
    int rank;
    uint32_t **hdr;     /* every rank's header words */
    char **slot[2];     /* every rank's staging slots */
    char **res;         /* every rank's result areas (large all-reduce) */
    char **src;         /* scratch: the sources of one reduction */
    double spin;        /* seconds of pure spinning, then polls with sched_yield */
    int stream;         /* streaming stores: -1 chosen by measurement, 0 never, 1 always */
    char *scratch;      /* BLOCK bytes: a block's reduction before it is streamed out */
    StreamTune tune[2][STREAM_CLASSES]; /* [TUNE_ROUNDS or TUNE_SMALL][size class] */
} SyncObject;

static inline double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

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

static void post(SyncObject *s, uint32_t p) {
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
static int wait_all_sleeping(SyncObject *s, uint32_t target, double limit, double sleep) {
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

static int wait_all(SyncObject *s, uint32_t target, double limit) {
    return wait_all_sleeping(s, target, limit, 0.0);
}

/* ---------------------------------------------------------------------------- reductions */
/* One pass per source, as NumPy's ``uf(s0, s1, out=out); uf(out, s2, out=out)...``. */
#define REDUCER(NAME, T, EXPR)                                                     \
    WIDE static void NAME(char *out_, char **src_, int n, size_t count) {          \
        T *out = (T *)out_;                                                        \
        const T *a = (const T *)src_[0], *b = (const T *)src_[1];                  \
        for (size_t i = 0; i < count; i++) {                                       \
            T x = a[i], y = b[i];                                                  \
            out[i] = (EXPR);                                                       \
        }                                                                          \
        for (int q = 2; q < n; q++) {                                              \
            b = (const T *)src_[q];                                                \
            for (size_t i = 0; i < count; i++) {                                   \
                T x = out[i], y = b[i];                                            \
                out[i] = (EXPR);                                                   \
            }                                                                      \
        }                                                                          \
    }

#define SUM(x, y) ((x) + (y))
#define PROD(x, y) ((x) * (y))
#define MIN(x, y) ((x) < (y) ? (x) : (y))
#define MAX(x, y) ((x) > (y) ? (x) : (y))

/* Integers wrap as NumPy's do: add and multiply in the unsigned type of the same width. */
REDUCER(sum_f32, float, SUM(x, y))
REDUCER(prod_f32, float, PROD(x, y))
REDUCER(sum_f64, double, SUM(x, y))
REDUCER(prod_f64, double, PROD(x, y))
REDUCER(sum_u8, uint8_t, (uint8_t)SUM(x, y))
REDUCER(prod_u8, uint8_t, (uint8_t)PROD((unsigned)x, (unsigned)y))
REDUCER(sum_u32, uint32_t, SUM(x, y))
REDUCER(prod_u32, uint32_t, PROD(x, y))
REDUCER(sum_u64, uint64_t, SUM(x, y))
REDUCER(prod_u64, uint64_t, PROD(x, y))
REDUCER(min_i8, int8_t, MIN(x, y))
REDUCER(max_i8, int8_t, MAX(x, y))
REDUCER(min_i32, int32_t, MIN(x, y))
REDUCER(max_i32, int32_t, MAX(x, y))
REDUCER(min_i64, int64_t, MIN(x, y))
REDUCER(max_i64, int64_t, MAX(x, y))
REDUCER(min_u8, uint8_t, MIN(x, y))
REDUCER(max_u8, uint8_t, MAX(x, y))
REDUCER(min_u32, uint32_t, MIN(x, y))
REDUCER(max_u32, uint32_t, MAX(x, y))
REDUCER(min_u64, uint64_t, MIN(x, y))
REDUCER(max_u64, uint64_t, MAX(x, y))

typedef void (*reducer)(char *, char **, int, size_t);

/* Indexed by the code Python computes (_cpu_sync.py's _native_code): dtype * 4 + op, dtypes in
 * the order f32 f64 i8 i32 i64 u8 u32 u64 (the
 * integer dtypes the group reduces), ops sum prod min max. Floats have no C
 * min/max (NumPy's NaN and signed-zero rules are its own): NULL means Python reduces. Signed
 * sums and products are the unsigned ones (two's complement wraps the same). */
static const reducer REDUCERS[32] = {
    sum_f32, prod_f32, NULL,    NULL,
    sum_f64, prod_f64, NULL,    NULL,
    sum_u8,  prod_u8,  min_i8,  max_i8,
    sum_u32, prod_u32, min_i32, max_i32,
    sum_u64, prod_u64, min_i64, max_i64,
    sum_u8,  prod_u8,  min_u8,  max_u8,
    sum_u32, prod_u32, min_u32, max_u32,
    sum_u64, prod_u64, min_u64, max_u64,
};

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

static int addresses(PyObject *seq, int n, void **out, const char *what) {
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

/* A plain copy loop (vectorized by the compiler) rather than memcpy: glibc's memcpy of these
 * sizes uses ``rep movsb``, which on this AMD VM ran 2-5x slower on buffers the peer reads
 * or wrote just before (4 MiB all-reduce: the copy of the peers' slices 1160 us, this 305). */
WIDE static void copy(char *dst, const char *src, size_t nb) {
    size_t k = nb / 8;
    uint64_t *d = (uint64_t *)dst;
    const uint64_t *s = (const uint64_t *)src;
    for (size_t i = 0; i < k; i++) d[i] = s[i];
    memcpy(dst + 8 * k, src + 8 * k, nb - 8 * k);
}

/* copy() with streaming stores, which write to memory past the caches: for data a peer reads
 * next. A peer's read of lines this core has just written is a cache-to-cache transfer; when
 * the two cores share no cache (this VM's vCPUs some of the time, separate dies on a real
 * EPYC) it is slow (a staged 1 MiB all-reduce took 430-520 us, not 110-130) and a read from
 * memory is faster. When they share one, the transfer wins: pick_stream() decides. Fenced:
 * the data is visible before the next post. */
static void copy_stream(char *dst, const char *src, size_t nb) {
#if defined(__x86_64__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > nb) head = nb;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    nb -= head;
    size_t k = nb / 16;
    __m128i *d = (__m128i *)dst;
    const __m128i *sp = (const __m128i *)src;
    for (size_t i = 0; i < k; i++) _mm_stream_si128(d + i, _mm_loadu_si128(sp + i));
    memcpy(dst + 16 * k, src + 16 * k, nb - 16 * k);
    _mm_sfence();
#else
    copy(dst, src, nb);
#endif
}

static int stream_class(size_t nb) {
    int c = 0;
    while (nb > 1 && c < STREAM_CLASSES - 1) {
        nb >>= 1;
        c++;
    }
    return c;
}

/* Whether this call (``kind``: TUNE_ROUNDS or TUNE_SMALL) streams what the peers read: as
 * configured, else the way that cost less per byte so far at this kind and size class, and
 * one call in STREAM_EXPLORE the other way (the ranks make the same calls, so they try it
 * together: what is timed is both at once). Neither way is right everywhere: on this VM
 * streaming was 1.4-1.7x faster when the two vCPUs shared no cache and 1.1-2.5x slower when
 * they did, and which held changed within seconds. */
static int pick_stream(SyncObject *s, int kind, size_t nb) {
    if (s->stream >= 0) return s->stream;
    StreamTune *t = &s->tune[kind][stream_class(nb)];
    int best = t->cost[1] > 0.0 && t->cost[1] < t->cost[0];
    return (++t->calls % STREAM_EXPLORE) == 2 ? !best : best;
}

/* Record what ``seconds`` of work over ``nb`` bytes cost the way ``way`` (pick_stream()'s):
 * the way it takes is averaged over calls, the other one's latest try replaces the last. */
static void note_stream(SyncObject *s, int kind, size_t nb, int way, double seconds) {
    if (nb == 0) return;
    StreamTune *t = &s->tune[kind][stream_class(nb)];
    double c = seconds / (double)nb, *old = &t->cost[way];
    int usual = t->cost[1] > 0.0 && t->cost[1] < t->cost[0];
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
static int first_post_args(PyObject *const *args, const char *what, unsigned long long *p,
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
static int first_post(SyncObject *s, uint32_t target, unsigned long long seq, const char *rec,
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

/* AVG of a float sum, as NumPy's true_divide(out, n, out=out) in the same type. */
static void divide(char *buf, long code, size_t count, int n) {
    if (code == 0) {
        float *p = (float *)buf, d = (float)n;
        for (size_t i = 0; i < count; i++) p[i] = p[i] / d;
    } else {
        double *p = (double *)buf, d = (double)n;
        for (size_t i = 0; i < count; i++) p[i] = p[i] / d;
    }
}

/* Reduce ``count`` items from ``src`` (n pointers) into ``out`` block by block, dividing
 * (AVG) and copying each block to ``dst`` (when not NULL) while it is in cache. ``stream``:
 * each block is reduced into the scratch block and streamed to ``out`` (peers read it). */
static void reduce_blocks(SyncObject *s, reducer fn, long code, int avg, char *out,
                          char **src, size_t count, size_t isz, char *dst, int stream) {
    size_t per = BLOCK / isz;
    char *blk[64];
    char **b = s->n <= 64 ? blk : s->src;
    for (size_t start = 0; start < count; start += per) {
        size_t m = count - start < per ? count - start : per;
        size_t off = start * isz;
        for (int q = 0; q < s->n; q++) b[q] = src[q] + off;
        char *o = stream ? s->scratch : out + off;
        fn(o, b, s->n, m);
        if (avg) divide(o, code, m, s->n);
        if (stream) copy_stream(out + off, o, m * isz);
        if (dst) copy(dst + off, o, m * isz);
    }
}

/* The rounds of the large all-reduce (cpu.py's _all_reduce_chunks) over ``total`` items of
 * ``buf``, ``per`` items each (the last one shorter), round r in staging slot ``par0 + r``
 * (mod 2) with posts ``p + 2r`` and ``p + 2r + 1``. A round: copy the peers' slices into the
 * slot, post, wait, reduce this rank's slice from every rank's slot (its own straight from
 * the array) into its result area and into the array, post, wait, copy the peers' reduced
 * slices into the array. Slices as cpu.py's _slices. A wait not over within ``limit`` seconds
 * of spinning and yielding and ``sleep`` seconds asleep on the futex stops the rounds:
 * ``*done`` rounds are complete, and round ``*done`` has RC_WAIT (its first post out) or
 * RC_WAIT2 (both out, reduced) left for Python; RC_DONE when all completed. ``stream``: what
 * the peers read is written with streaming stores. Called with the GIL released; ``sp`` has
 * room for n pointers. */
static int run_rounds(SyncObject *s, reducer fn, long code, int avg, char *buf, size_t total,
                      size_t isz, size_t per, int par0, unsigned long long p, double limit,
                      double sleep, char **sp, long *done, int stream) {
    int n = s->n, me = s->rank;
    long r = 0;
    int rc = RC_DONE;
    /* One empty round for an empty array: every rank still posts. */
    for (size_t start = 0; start < total || (total == 0 && r == 0); start += per, r++) {
        size_t m = total - start < per ? total - start : per;
        int par = (par0 + (int)(r & 1)) & 1;
        uint32_t target = (uint32_t)(p + 2 * (unsigned long long)r);
        char *arr = buf + start * isz;
        char *mine = s->slot[par][me];
        for (int q = 0; q < n; q++) {
            size_t lo = m * q / n, hi = m * (q + 1) / n;
            if (q == me || hi <= lo) continue;
            if (stream)
                copy_stream(mine + lo * isz, arr + lo * isz, (hi - lo) * isz);
            else
                copy(mine + lo * isz, arr + lo * isz, (hi - lo) * isz);
        }
        post(s, target);
        if (!wait_all_sleeping(s, target, limit, sleep)) {
            rc = RC_WAIT;
            break;
        }
        size_t lo = m * me / n, hi = m * (me + 1) / n;
        if (hi > lo) {
            for (int q = 0; q < n; q++) sp[q] = (q == me ? arr : s->slot[par][q]) + lo * isz;
            reduce_blocks(s, fn, code, avg, s->res[me] + lo * isz, sp, hi - lo, isz,
                          arr + lo * isz, stream);
        }
        post(s, target + 1);
        if (!wait_all_sleeping(s, target + 1, limit, sleep)) {
            rc = RC_WAIT2;
            break;
        }
        for (int q = 0; q < n; q++) {
            size_t a = m * q / n, b = m * (q + 1) / n;
            if (q != me && b > a) copy(arr + a * isz, s->res[q] + a * isz, (b - a) * isz);
        }
    }
    *done = r;
    return rc;
}

/* The arguments rounds() and begin_rounds() share, from ``a`` on: array, parity, code, avg,
 * limit, sleep, per. 0, or -1 with an exception set (nothing was written). */
typedef struct {
    Py_buffer view;
    int par;
    long code;
    int avg;
    double limit, sleep;
    size_t per;
    reducer fn;
    char **sp;
    char *src[64];
} RoundArgs;

static int round_args(SyncObject *s, PyObject *const *a, RoundArgs *ra, const char *what) {
    ra->par = PyLong_AsLong(a[1]) & 1;
    ra->code = PyLong_AsLong(a[2]);
    ra->avg = PyObject_IsTrue(a[3]);
    ra->limit = PyFloat_AsDouble(a[4]);
    ra->sleep = PyFloat_AsDouble(a[5]);
    Py_ssize_t per = PyLong_AsSsize_t(a[6]);
    if (PyErr_Occurred()) return -1;
    long code = ra->code;
    if (code < 0 || code >= 32 || REDUCERS[code] == NULL || (ra->avg && code != 0 && code != 4)) {
        PyErr_Format(PyExc_ValueError, "%s(): no compiled reduction for code %ld", what, code);
        return -1;
    }
    if (per <= 0) {
        PyErr_Format(PyExc_ValueError, "%s(): per must be positive", what);
        return -1;
    }
    ra->per = (size_t)per;
    ra->fn = REDUCERS[code];
    ra->sp = s->n <= 64 ? ra->src : PyMem_RawMalloc(sizeof(char *) * s->n);
    if (ra->sp == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (PyObject_GetBuffer(a[0], &ra->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        if (ra->sp != ra->src) PyMem_RawFree(ra->sp);
        return -1;
    }
    return 0;
}

static void round_args_release(RoundArgs *ra) {
    if (ra->sp != ra->src) PyMem_RawFree(ra->sp);
    PyBuffer_Release(&ra->view);
}

/* run_rounds() with streaming as pick_stream() says, timed for note_stream() when complete. */
static int timed_rounds(SyncObject *s, RoundArgs *ra, unsigned long long p, long *done) {
    size_t isz = (size_t)ra->view.itemsize, nb = (size_t)ra->view.len;
    int way = pick_stream(s, TUNE_ROUNDS, nb);
    double t0 = now();
    int rc = run_rounds(s, ra->fn, ra->code, ra->avg, (char *)ra->view.buf, nb / isz, isz,
                        ra->per, ra->par, p, ra->limit, ra->sleep, ra->sp, done, way);
    if (rc == RC_DONE) note_stream(s, TUNE_ROUNDS, nb, way, now() - t0);
    return rc;
}

/* rounds(post, array, parity, code, avg, limit, sleep, per) -> (rc, done)
 *
 * run_rounds() over the C-contiguous ``array`` from post ``post``, with the GIL released once:
 * on the communication thread each return to Python would wait for a busy main thread to drop
 * the GIL. (RC_DONE, number of rounds) when all completed, else as run_rounds(). */
static PyObject *Sync_rounds(SyncObject *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "rounds() takes 8 arguments");
        return NULL;
    }
    unsigned long long p = PyLong_AsUnsignedLongLongMask(args[0]);
    if (PyErr_Occurred()) return NULL;
    RoundArgs ra;
    if (round_args(s, args + 1, &ra, "rounds") < 0) return NULL;
    long done = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = timed_rounds(s, &ra, p, &done);
    Py_END_ALLOW_THREADS
    round_args_release(&ra);
    return Py_BuildValue("(il)", rc, done);
}

/* begin_rounds(post, seq, record, array, parity, code, avg, limit, sleep, per) -> (rc, done)
 *
 * A staged large all-reduce from its first post on, in one call: the signature record (as
 * begin(), its data location saying this rank stages and runs the compiled rounds), post
 * ``post``, wait (``limit``), check; then, when every rank's location says it runs the
 * compiled rounds too, rounds() from post ``post + 1``. Without this, the Python between the
 * two calls ran on caches the previous call's data had evicted: 10-15 us of a 1 MiB call.
 * Returns (rc, -1) when the rounds did not start: RC_WAIT, RC_MISMATCH or RC_ABORTED as
 * begin(), or RC_BEGUN (posted and checked, some rank runs Python: Python goes on); else
 * rounds()' result. */
static PyObject *Sync_begin_rounds(SyncObject *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "begin_rounds() takes 10 arguments");
        return NULL;
    }
    unsigned long long p, seq;
    const char *recp;
    if (first_post_args(args, "begin_rounds", &p, &seq, &recp) < 0) return NULL;
    RoundArgs ra;
    if (round_args(s, args + 3, &ra, "begin_rounds") < 0) return NULL;
    long done = -1;
    int rc;
    uint32_t target = (uint32_t)p;
    Py_BEGIN_ALLOW_THREADS
    rc = first_post(s, target, seq, recp, ra.limit);
    size_t off = H_SIG + (size_t)(target & 1) * SIG_SLOT + SIG_BYTES;
    for (int q = 0; q < s->n && rc == RC_DONE; q++) {
        int64_t flag;
        memcpy(&flag, (const char *)s->hdr[q] + off, sizeof flag);
        if (!(flag & LOC_COMPILED)) rc = RC_BEGUN;
    }
    if (rc == RC_DONE) {
        rc = timed_rounds(s, &ra, p + 1, &done);
    }
    Py_END_ALLOW_THREADS
    round_args_release(&ra);
    return Py_BuildValue("(il)", rc, done);
}

/* zero_copy()'s arguments from ``a`` on: code, avg, arrays, lo, hi, itemsize, scratch, block. */
typedef struct {
    long code;
    int avg;
    char *arrs[64];
    size_t lo, hi, isz, block;
    char *scratch;
    reducer fn;
} ZeroCopyArgs;

static int zero_copy_args(SyncObject *s, PyObject *const *a, ZeroCopyArgs *za, const char *what) {
    za->code = PyLong_AsLong(a[0]);
    za->avg = PyObject_IsTrue(a[1]);
    Py_ssize_t lo = PyLong_AsSsize_t(a[3]), hi = PyLong_AsSsize_t(a[4]);
    Py_ssize_t isz = PyLong_AsSsize_t(a[5]);
    za->scratch = PyLong_AsVoidPtr(a[6]);
    Py_ssize_t block = PyLong_AsSsize_t(a[7]);
    if (PyErr_Occurred()) return -1;
    long code = za->code;
    if (code < 0 || code >= 32 || REDUCERS[code] == NULL || (za->avg && code != 0 && code != 4) ||
        isz <= 0 || lo < 0 || hi < lo || block < isz) {
        PyErr_Format(PyExc_ValueError, "%s(): bad arguments (code %ld)", what, code);
        return -1;
    }
    if (s->n > 64) {
        PyErr_Format(PyExc_ValueError, "%s(): at most 64 ranks", what);
        return -1;
    }
    if (addresses(a[2], s->n, (void **)za->arrs, "arrays") < 0) return -1;
    za->lo = (size_t)lo;
    za->hi = (size_t)hi;
    za->isz = (size_t)isz;
    za->block = (size_t)block;
    za->fn = REDUCERS[code];
    return 0;
}

/* The zero-copy slice's work (see zero_copy()); called with the GIL released. */
static void zero_copy_slice(SyncObject *s, const ZeroCopyArgs *za) {
    int n = s->n, me = s->rank;
    size_t per = za->block / za->isz;
    char *src[64];
    for (size_t start = za->lo; start < za->hi; start += per) {
        size_t m = za->hi - start < per ? za->hi - start : per;
        size_t off = start * za->isz, nb = m * za->isz;
        for (int q = 0; q < n; q++) src[q] = za->arrs[q] + off;
        char *out = me <= 1 ? src[me] : za->scratch;
        za->fn(out, src, n, m);
        if (za->avg) divide(out, za->code, m, n);
        for (int q = 0; q < n; q++)
            if (src[q] != out) copy(src[q], out, nb);
    }
}

/* zero_copy(code, avg, arrays, lo, hi, itemsize, scratch, block) -> None
 *
 * The zero-copy all-reduce's work for this rank's slice [lo, hi) (items): reduce every rank's
 * array (addresses, group-rank order) in rank order and write the result into all of them,
 * block by block. Rank 0 or 1 reduces into its own array (one of the first two operands),
 * others into ``scratch`` (``block`` bytes at least, a multiple of ``itemsize``). No posts, no
 * waits: Python posts after it. */
static PyObject *Sync_zero_copy(SyncObject *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "zero_copy() takes 8 arguments");
        return NULL;
    }
    ZeroCopyArgs za;
    if (zero_copy_args(s, args, &za, "zero_copy") < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    zero_copy_slice(s, &za);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* begin_zero_copy(post, seq, record, expected, code, avg, arrays, lo, hi, itemsize, scratch,
 *                 block, limit) -> rc
 *
 * A zero-copy all-reduce in one call: the signature record (as begin()), post ``post``, wait
 * (``limit``), check; then, when every rank's data location is the one in ``expected`` (the
 * group's locations packed in rank order, from the call that gave ``arrays``), zero_copy()'s
 * work, post ``post + 1`` and wait. RC_DONE when done; RC_WAIT2 when all but the last wait
 * (Python waits); RC_WAIT, RC_MISMATCH or RC_ABORTED as begin(); RC_BEGUN when posted and
 * checked but some rank's array is elsewhere (Python goes on from the first post). */
static PyObject *Sync_begin_zero_copy(SyncObject *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "begin_zero_copy() takes 13 arguments");
        return NULL;
    }
    unsigned long long p, seq;
    const char *recp;
    if (first_post_args(args, "begin_zero_copy", &p, &seq, &recp) < 0) return NULL;
    double limit = PyFloat_AsDouble(args[12]);
    if (PyErr_Occurred()) return NULL;
    PyObject *expected = args[3];
    if (!PyBytes_Check(expected) ||
        PyBytes_GET_SIZE(expected) != (Py_ssize_t)(s->n * (SIG_SLOT - SIG_BYTES))) {
        PyErr_Format(PyExc_ValueError, "begin_zero_copy(): expected must be %d bytes",
                     s->n * (SIG_SLOT - SIG_BYTES));
        return NULL;
    }
    ZeroCopyArgs za;
    if (zero_copy_args(s, args + 4, &za, "begin_zero_copy") < 0) return NULL;
    const char *exp = PyBytes_AS_STRING(expected);
    int rc;
    uint32_t target = (uint32_t)p;
    Py_BEGIN_ALLOW_THREADS
    rc = first_post(s, target, seq, recp, limit);
    size_t off = H_SIG + (size_t)(target & 1) * SIG_SLOT + SIG_BYTES, len = SIG_SLOT - SIG_BYTES;
    for (int q = 0; q < s->n && rc == RC_DONE; q++)
        if (memcmp((const char *)s->hdr[q] + off, exp + q * len, len) != 0) rc = RC_BEGUN;
    if (rc == RC_DONE) {
        zero_copy_slice(s, &za);
        post(s, target + 1);
        if (!wait_all(s, target + 1, limit)) rc = RC_WAIT2;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
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
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "collectives.backends._cshm.Sync",
    .tp_basicsize = sizeof(SyncObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Posts and waits of one rank over its group's segment headers.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Sync_init,
    .tp_dealloc = (destructor)Sync_dealloc,
    .tp_methods = Sync_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_cshm",
    .m_doc = "The cpu backend's posts, waits and small all-reduce in C (see _cpu_sync.py).",
    .m_size = -1,
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
