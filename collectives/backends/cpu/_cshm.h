/* What the files of the cpu backend's compiled helper share (see _cshm.c): the layout's
 * constants, the return codes, the Sync object and the functions one file calls in another. */
#ifndef CSHM_H
#define CSHM_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <time.h>

#include "_cshm_loops.h"

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

/* _cshm.c: posts and waits (see there). */
HIDDEN void post(SyncObject *s, uint32_t p);
HIDDEN int wait_all_sleeping(SyncObject *s, uint32_t target, double limit, double sleep);
HIDDEN int wait_all(SyncObject *s, uint32_t target, double limit);
HIDDEN int addresses(PyObject *seq, int n, void **out, const char *what);
HIDDEN int first_post_args(PyObject *const *args, const char *what, unsigned long long *p,
                           unsigned long long *seq, const char **rec);
HIDDEN int first_post(SyncObject *s, uint32_t target, unsigned long long seq, const char *rec,
                      double limit);
HIDDEN int pick_stream(SyncObject *s, int kind, size_t nb);
HIDDEN void note_stream(SyncObject *s, int kind, size_t nb, int way, double seconds);

/* _cshm_large.c: the large all-reduce's methods (see there). */
HIDDEN PyObject *Sync_rounds(SyncObject *s, PyObject *const *args, Py_ssize_t nargs);
HIDDEN PyObject *Sync_begin_rounds(SyncObject *s, PyObject *const *args, Py_ssize_t nargs);
HIDDEN PyObject *Sync_zero_copy(SyncObject *s, PyObject *const *args, Py_ssize_t nargs);
HIDDEN PyObject *Sync_begin_zero_copy(SyncObject *s, PyObject *const *args, Py_ssize_t nargs);

/* _cshm_many.c: the reduction into several outputs and its worker pool (see there). */
HIDDEN PyObject *cshm_reduce_into_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
HIDDEN PyObject *cshm_pool_stop(PyObject *self, PyObject *unused);
HIDDEN PyObject *cshm_pool_threads(PyObject *self, PyObject *unused);

#endif
