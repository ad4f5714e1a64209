/* The cpu backend helper's large all-reduce (see _cshm.c): the staged rounds, with the choice
 * of stores for what the peers read, and the zero-copy reduction over shared arrays. */
#include "_cshm.h"

#include <string.h>

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
PyObject *Sync_rounds(SyncObject *s, PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *Sync_begin_rounds(SyncObject *s, PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *Sync_zero_copy(SyncObject *s, PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *Sync_begin_zero_copy(SyncObject *s, PyObject *const *args, Py_ssize_t nargs) {
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
