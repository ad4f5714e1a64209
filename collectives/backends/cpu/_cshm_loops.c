/* The cpu backend helper's loops over data (see _cshm.c): the in-order reductions, the copies
 * (plain and streaming) and AVG's division. Split from _cshm.c, which does the posts, waits
 * and rounds; both are one extension module. */
#include "_cshm_loops.h"

#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

/* The loops that move and reduce data, built twice where the compiler can (GCC, x86-64): with
 * AVX2 and for the baseline; the loader picks the one this CPU runs. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define WIDE __attribute__((target_clones("avx2", "default")))
#else
#define WIDE
#endif

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

/* Indexed by the code Python computes (_cpu_sync.py's _native_code): dtype * 4 + op, dtypes in
 * the order f32 f64 i8 i32 i64 u8 u32 u64 (the
 * integer dtypes the group reduces), ops sum prod min max. Floats have no C
 * min/max (NumPy's NaN and signed-zero rules are its own): NULL means Python reduces. Signed
 * sums and products are the unsigned ones (two's complement wraps the same). */
HIDDEN const reducer REDUCERS[32] = {
    sum_f32, prod_f32, NULL,    NULL,
    sum_f64, prod_f64, NULL,    NULL,
    sum_u8,  prod_u8,  min_i8,  max_i8,
    sum_u32, prod_u32, min_i32, max_i32,
    sum_u64, prod_u64, min_i64, max_i64,
    sum_u8,  prod_u8,  min_u8,  max_u8,
    sum_u32, prod_u32, min_u32, max_u32,
    sum_u64, prod_u64, min_u64, max_u64,
};

/* A plain copy loop (vectorized by the compiler) rather than memcpy: glibc's memcpy of these
 * sizes uses ``rep movsb``, which on this AMD VM ran 2-5x slower on buffers the peer reads
 * or wrote just before (4 MiB all-reduce: the copy of the peers' slices 1160 us, this 305). */
WIDE HIDDEN void copy(char *dst, const char *src, size_t nb) {
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
HIDDEN void copy_stream(char *dst, const char *src, size_t nb) {
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

/* AVG of a float sum, as NumPy's true_divide(out, n, out=out) in the same type. */
HIDDEN void divide(char *buf, long code, size_t count, int n) {
    if (code == 0) {
        float *p = (float *)buf, d = (float)n;
        for (size_t i = 0; i < count; i++) p[i] = p[i] / d;
    } else {
        double *p = (double *)buf, d = (double)n;
        for (size_t i = 0; i < count; i++) p[i] = p[i] / d;
    }
}
