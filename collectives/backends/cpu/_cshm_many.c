/* The cpu helper's reduction into several outputs at once (see _cshm.c): one in-order
 * reduction whose result is written to every output while it is in cache, over an item range
 * that a small pool of worker threads shares with the caller.
 *
 * Its users hold one array per logical device and want the reduced sum in each: the context
 * engine of logical CPU devices (a thread that reduced into the first output and then copied
 * it read every byte of that output twice, on one core) and the threads backend's NumPy
 * engine (its ranks' own arrays). Block by block, the sources are reduced in order (the same
 * operations as reduce_into(), so the same bits) into one output, or into a scratch block
 * where none may be written as it is read, and the block is copied from cache to every other
 * output. An output may be a source itself (the threads backend's ranks reduce their own
 * arrays): a block is read whole before any other output is written.
 *
 * The pool: worker threads created on first use (as many as asked, at most POOL_MAX), plain
 * pthreads that never touch Python (no GIL, no thread state: a wake-up costs a futex, not an
 * interpreter hand-off), signals blocked. A call splits its range into chunks that the caller
 * and the workers claim from one counter, so a worker that wakes late takes fewer chunks
 * rather than holding the caller up; the caller returns when every chunk is written. One call
 * uses the pool at a time; another one meanwhile runs on its own thread. pool_stop() ends
 * the workers (atexit, tests); a forked child starts with none.
 */
#include "_cshm.h" /* Python.h first: it sets _GNU_SOURCE (pthread_setname_np) */

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Bytes of each output reduced and written per block: the scratch block stays in L1/L2 while
 * the n - 1 passes of the reduction and the copies read it. */
#define MANY_BLOCK (32 << 10)
/* Blocks per chunk (what one claim takes): big enough that claims are rare, small enough
 * that a worker that wakes late or is descheduled leaves the rest to the others (8 to 64 KiB
 * blocks and 2 to 8 per chunk measured alike within noise from 256 KiB on; 8 KiB blocks
 * were 20-30% slower from 16 MiB). */
#define CHUNK_BLOCKS 4
#define POOL_MAX 16
/* A worker polls this long for the next call before it sleeps on the futex: back-to-back
 * all-reduces (DDP's buckets, a benchmark) then skip a wake-up, which cost 30-80 us on a VM
 * (2 devices, 1 MiB: 157 us without polling, 77 with). */
#define WORKER_SPIN_S 50e-6

typedef struct {
    reducer fn;
    long code;
    int avg, n, k, stream;
    int into; /* the output reduced into (then copied to the others), or -1: the scratch block */
    uint64_t own; /* bit q: output q is a source (in cache once read: plain stores) */
    size_t isz, lo, hi, per; /* items: the range, items per chunk */
    char *const *src;
    char *const *out;
} ManyJob;

static struct {
    ManyJob job;           /* valid while chunks are unclaimed or unfinished */
    uint32_t left;         /* chunks not claimed yet (claims count down) */
    uint32_t done;         /* chunks written */
    uint32_t gen;          /* bumped per call: the futex word idle workers sleep on */
    uint32_t sleepers;     /* workers asleep (or about to be) on ``gen`` */
    int stop;
    int threads;
    pthread_t th[POOL_MAX];
    pthread_mutex_t busy;  /* held by the one call that uses the pool */
} P = {.busy = PTHREAD_MUTEX_INITIALIZER};

static pthread_once_t at_fork_once = PTHREAD_ONCE_INIT;

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* ---------------------------------------------------------------------------- the work */
/* Items [start, start + m) of the job: reduce each block into output ``into`` (or into
 * ``scratch``), then copy it to every other output (streaming stores, fenced, when the job
 * says so, to the outputs that are no source). */
static void many_range(const ManyJob *j, size_t start, size_t m, char *scratch) {
    size_t per = MANY_BLOCK / j->isz;
    char *src[64];
    for (size_t s = start; s < start + m; s += per) {
        size_t b = start + m - s < per ? start + m - s : per;
        size_t off = s * j->isz, nb = b * j->isz;
        for (int q = 0; q < j->n; q++) src[q] = j->src[q] + off;
        char *blk = j->into >= 0 ? j->out[j->into] + off : scratch;
        j->fn(blk, src, j->n, b);
        if (j->avg) divide(blk, j->code, b, j->n);
        for (int q = 0; q < j->k; q++) {
            if (q == j->into)
                continue;
            else if (j->stream && !(j->own >> q & 1))
                copy_stream(j->out[q] + off, blk, nb);
            else
                copy(j->out[q] + off, blk, nb);
        }
    }
}

/* Claim a chunk of whatever call is under way: 1 and its index, or 0 when none is left. The
 * job is read after the claim only, and stays as it is until that chunk is counted done. */
static int claim(uint32_t *chunk) {
    uint32_t t = __atomic_load_n(&P.left, __ATOMIC_ACQUIRE);
    while (t != 0) {
        if (__atomic_compare_exchange_n(&P.left, &t, t - 1, 1, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            *chunk = t - 1;
            return 1;
        }
    }
    return 0;
}

/* Claim and write chunks until none is left. */
static void run_chunks(char *scratch) {
    uint32_t c;
    while (claim(&c)) {
        ManyJob j = P.job;
        size_t start = j.lo + (size_t)c * j.per;
        size_t m = j.hi - start < j.per ? j.hi - start : j.per;
        many_range(&j, start, m, scratch);
        __atomic_add_fetch(&P.done, 1, __ATOMIC_RELEASE);
    }
}

/* ---------------------------------------------------------------------------- the pool */
static void *worker(void *arg) {
    char *scratch = arg;
    for (;;) {
        uint32_t seen = __atomic_load_n(&P.gen, __ATOMIC_ACQUIRE);
        run_chunks(scratch);
        if (__atomic_load_n(&P.stop, __ATOMIC_ACQUIRE)) break;
        double start = now();
        unsigned polls = 0;
        while (__atomic_load_n(&P.gen, __ATOMIC_ACQUIRE) == seen) {
            if ((++polls & 63) != 0) {
                relax();
                continue;
            }
            if (now() - start < WORKER_SPIN_S) continue;
            /* The caller bumps gen, then reads sleepers; this raises sleepers, then re-reads
             * gen (in the kernel's compare): one of the two sees the other. */
            __atomic_add_fetch(&P.sleepers, 1, __ATOMIC_SEQ_CST);
            syscall(SYS_futex, &P.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            __atomic_sub_fetch(&P.sleepers, 1, __ATOMIC_SEQ_CST);
        }
    }
    free(scratch);
    return NULL;
}

/* In a forked child the workers do not exist: start again with none. */
static void pool_after_fork(void) {
    memset(&P.job, 0, sizeof P.job);
    P.left = P.done = P.gen = P.sleepers = 0;
    P.stop = 0;
    P.threads = 0;
    pthread_mutex_init(&P.busy, NULL);
}

static void register_at_fork(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* Start workers until there are ``want`` (P.busy held); as many as could be started. */
static void pool_grow(int want) {
    if (want > POOL_MAX) want = POOL_MAX;
    if (P.threads >= want) return;
    pthread_once(&at_fork_once, register_at_fork);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* inherited: Python's handlers run elsewhere */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 << 10);
    while (P.threads < want) {
        char *scratch = aligned_alloc(64, MANY_BLOCK);
        if (scratch == NULL) break;
        if (pthread_create(&P.th[P.threads], &attr, worker, scratch) != 0) {
            free(scratch);
            break;
        }
        /* Named here, before the call returns, not by the worker itself: whoever looks (top -H,
         * gdb, /proc) right after the first parallel call sees every worker by its name. */
        pthread_setname_np(P.th[P.threads], "dpt-reduce");
        P.threads++;
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* End every worker (waits for a call using the pool to finish first). */
static void pool_stop_all(void) {
    pthread_mutex_lock(&P.busy);
    __atomic_store_n(&P.stop, 1, __ATOMIC_RELEASE);
    __atomic_add_fetch(&P.gen, 1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, &P.gen, FUTEX_WAKE_PRIVATE, 0x7FFFFFFF, NULL, NULL, 0);
    for (int i = 0; i < P.threads; i++) pthread_join(P.th[i], NULL);
    P.threads = 0;
    __atomic_store_n(&P.stop, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&P.busy);
}

/* The job over every thread that joins in: publish it, wake sleepers, write chunks here too,
 * then wait for the chunks the workers claimed. */
static void run_job(const ManyJob *j, int workers, char *scratch) {
    size_t count = j->hi - j->lo;
    size_t chunks = (count + j->per - 1) / j->per;
    if (workers <= 1 || chunks <= 1 || chunks > 0xFFFFFFFFu ||
        pthread_mutex_trylock(&P.busy) != 0) {
        many_range(j, j->lo, count, scratch); /* alone, or another call has the pool */
        return;
    }
    pool_grow(workers - 1);
    P.job = *j;
    __atomic_store_n(&P.done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&P.left, (uint32_t)chunks, __ATOMIC_RELEASE);
    __atomic_add_fetch(&P.gen, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&P.sleepers, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &P.gen, FUTEX_WAKE_PRIVATE, workers - 1, NULL, NULL, 0);
    run_chunks(scratch);
    unsigned polls = 0;
    while (__atomic_load_n(&P.done, __ATOMIC_ACQUIRE) != (uint32_t)chunks) {
        /* At most a chunk's time, unless its worker lost its core: then give it this one. */
        if ((++polls & 63) != 0)
            relax();
        else
            sched_yield();
    }
    pthread_mutex_unlock(&P.busy);
}

/* ---------------------------------------------------------------------------- Python */
/* The bytes of one item of each dtype row of REDUCERS (code / 4). */
static const Py_ssize_t ITEMSIZE[8] = {4, 8, 1, 4, 8, 1, 4, 8};

static int overlap(const Py_buffer *a, const Py_buffer *b) {
    const char *x = a->buf, *y = b->buf;
    return a->len > 0 && b->len > 0 && x < y + b->len && y < x + a->len;
}

/* The buffers of ``outs`` then ``sources`` into ``bufs`` (``*got`` of them held, to release
 * either way), checked: counts, one size, an output overlapping only the source it is. 1; 0
 * when some object is no buffer, not C-contiguous or not of the first one's item format (the
 * caller reduces another way); -1 with an exception set. */
static int many_buffers(PyObject *outs, PyObject *srcs, Py_ssize_t isz, Py_buffer *bufs,
                        int *got) {
    Py_ssize_t k = PySequence_Fast_GET_SIZE(outs), n = PySequence_Fast_GET_SIZE(srcs);
    if (k < 1 || k > 64 || n < 2 || n > 64) {
        PyErr_Format(PyExc_ValueError,
                     "reduce_into_many(): 1 to 64 outputs and 2 to 64 sources, got %zd and %zd",
                     k, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < k + n; i++) {
        int is_out = i < k;
        PyObject *item = is_out ? PySequence_Fast_GET_ITEM(outs, i)
                                : PySequence_Fast_GET_ITEM(srcs, i - k);
        if (!PyObject_CheckBuffer(item)) return 0;
        int flags = PyBUF_STRIDES | PyBUF_FORMAT | (is_out ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(item, &bufs[i], flags) < 0) return -1;
        (*got)++;
        const char *f = bufs[i].format ? bufs[i].format : "B";
        if (!PyBuffer_IsContiguous(&bufs[i], 'C') || bufs[i].itemsize != isz ||
            (i > 0 && strcmp(f, bufs[0].format ? bufs[0].format : "B") != 0))
            return 0;
        if (bufs[i].len != bufs[0].len) {
            PyErr_Format(PyExc_ValueError, "reduce_into_many(): %s %zd has %zd bytes, out 0 %zd",
                         is_out ? "out" : "source", is_out ? i : i - k, bufs[i].len,
                         bufs[0].len);
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        for (Py_ssize_t q = 0; q < k + n; q++) {
            if (q == i || !overlap(&bufs[i], &bufs[q])) continue;
            if (q >= k && bufs[q].buf == bufs[i].buf) continue; /* the source itself */
            if (q < k)
                PyErr_Format(PyExc_ValueError, "reduce_into_many(): outs %zd and %zd overlap", i,
                             q);
            else
                PyErr_Format(PyExc_ValueError,
                             "reduce_into_many(): out %zd overlaps source %zd (an output may "
                             "only be a source itself)",
                             i, q - k);
            return -1;
        }
    }
    return 1;
}

/* reduce_into_many(code, avg, outs, sources, lo, hi, workers, stream) -> bool
 *
 * Items [lo, hi) of every output = sources[0] op sources[1] op ... in order (then ``/ n``
 * when ``avg``), with the compiled loop of ``code`` (as reduce_into()), the GIL released, on
 * up to ``workers`` threads (this one and the pool's), with streaming stores to the outputs
 * when ``stream``; True. ``outs``: 1..64 writable buffers, ``sources``: 2..64, all of one
 * size. An output is either a source itself (the same buffer) or overlaps no source, and
 * outputs overlap no other output. False (nothing written) when some object is no buffer,
 * not C-contiguous, or of another item format than the first output (of ``code``'s item
 * size): the caller reduces another way. */
PyObject *cshm_reduce_into_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "reduce_into_many() takes 8 arguments");
        return NULL;
    }
    long code = PyLong_AsLong(args[0]);
    int avg = PyObject_IsTrue(args[1]);
    Py_ssize_t lo = PyLong_AsSsize_t(args[4]), hi = PyLong_AsSsize_t(args[5]);
    long workers = PyLong_AsLong(args[6]);
    int stream = PyObject_IsTrue(args[7]);
    if (PyErr_Occurred()) return NULL;
    if (code < 0 || code >= 32 || REDUCERS[code] == NULL || (avg && code != 0 && code != 4)) {
        PyErr_Format(PyExc_ValueError, "reduce_into_many(): no compiled reduction for code %ld",
                     code);
        return NULL;
    }
    PyObject *outs = PySequence_Fast(args[2], "reduce_into_many(): outs must be a sequence");
    if (outs == NULL) return NULL;
    PyObject *srcs = PySequence_Fast(args[3], "reduce_into_many(): sources must be a sequence");
    if (srcs == NULL) {
        Py_DECREF(outs);
        return NULL;
    }
    Py_buffer bufs[128];
    Py_ssize_t isz = ITEMSIZE[code / 4];
    int got = 0, rc = many_buffers(outs, srcs, isz, bufs, &got);
    int k = (int)PySequence_Fast_GET_SIZE(outs), n = (int)PySequence_Fast_GET_SIZE(srcs);
    Py_DECREF(outs);
    Py_DECREF(srcs);
    Py_ssize_t count = rc > 0 ? bufs[0].len / isz : 0;
    if (rc > 0 && (lo < 0 || hi < lo || hi > count)) {
        PyErr_Format(PyExc_ValueError, "reduce_into_many(): items [%zd, %zd) of %zd", lo, hi,
                     count);
        rc = -1;
    }
    char *scratch = NULL;
    if (rc > 0 && hi > lo) {
        char *outp[64], *srcp[64];
        for (int i = 0; i < k; i++) outp[i] = bufs[i].buf;
        for (int q = 0; q < n; q++) srcp[q] = bufs[k + q].buf;
        ManyJob job = {REDUCERS[code], code, avg, n, k, stream, -1, 0, (size_t)isz, (size_t)lo,
                       (size_t)hi, (size_t)(MANY_BLOCK / isz) * CHUNK_BLOCKS, srcp, outp};
        /* Reduce straight into an output where the reduction may write as it reads, saving
         * the scratch block's copy: the first or second source (in cache, just read), else,
         * with plain stores, one that is no source. A streaming output is written from
         * the scratch block, and an output that is a source plainly (a streaming store to a
         * line in cache evicts it: the threads backend's 16 MiB all-reduce took 2.8 ms, not
         * 1.5). */
        int free_out = -1;
        for (int i = 0; i < k; i++) {
            int src = -1;
            for (int q = 0; q < n && src < 0; q++)
                if (outp[i] == srcp[q]) src = q;
            if (src >= 0) job.own |= 1ull << i;
            if (src == 0 || src == 1) {
                if (job.into < 0) job.into = i;
            } else if (src < 0 && free_out < 0) {
                free_out = i;
            }
        }
        if (job.into < 0 && !stream) job.into = free_out;
        if (job.into < 0 && (scratch = aligned_alloc(64, MANY_BLOCK)) == NULL) {
            PyErr_NoMemory();
            rc = -1;
        } else {
            Py_BEGIN_ALLOW_THREADS
            run_job(&job, workers < 1 ? 1 : (int)workers, scratch);
            Py_END_ALLOW_THREADS
        }
    }
    free(scratch);
    for (int i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    if (rc < 0) return NULL;
    return PyBool_FromLong(rc);
}

/* pool_stop() -> None: end the pool's worker threads (a later call that asks for more than
 * one thread starts them again). */
PyObject *cshm_pool_stop(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    pool_stop_all();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* pool_threads() -> int: how many worker threads the pool has now. */
PyObject *cshm_pool_threads(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(__atomic_load_n(&P.threads, __ATOMIC_ACQUIRE));
}
