/* What _cshm.c uses of _cshm_loops.c: the helper's loops over data. */
#ifndef CSHM_LOOPS_H
#define CSHM_LOOPS_H

#include <stddef.h>
#include <stdint.h>

/* Shared by the module's two files only, not exported from the extension. */
#if defined(__GNUC__)
#define HIDDEN __attribute__((visibility("hidden")))
#else
#define HIDDEN
#endif

/* out = src[0] op src[1] op ... op src[n-1], elementwise over ``count`` items, in rank order. */
typedef void (*reducer)(char *out, char **src, int n, size_t count);

/* Indexed by the code Python computes (_cpu_sync.py's _native_code); NULL: Python reduces. */
HIDDEN extern const reducer REDUCERS[32];

/* ``nb`` bytes from ``src`` to ``dst`` (not overlapping). */
HIDDEN void copy(char *dst, const char *src, size_t nb);

/* copy() with streaming stores, fenced (for data a peer reads next). */
HIDDEN void copy_stream(char *dst, const char *src, size_t nb);

/* AVG: divide ``count`` items of a float32 (code 0) or float64 sum by ``n`` in place. */
HIDDEN void divide(char *buf, long code, size_t count, int n);

#endif
