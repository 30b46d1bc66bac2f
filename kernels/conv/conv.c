/* Causal depthwise convolution of width W followed by SiLU, forward and backward (see cpu.py).
 *
 * Per sequence, with xx = [tail; x] ([W - 1 + T, C]) and the weight transposed to wt [W, C]:
 *     pre[t, c] = sum_{j < W} xx[t + j, c] wt[j, c]   (summed in the order j = 0 .. W - 1)
 *     y[t, c] = silu(pre[t, c])
 * An output reads only its own W inputs, so a sequence cut in pieces (tails carried) gives the bits
 * of one pass. The backward recomputes pre instead of keeping it:
 *     dpre = dy * s (1 + pre (1 - s)), s = sigmoid(pre)
 *     dxx[r, c] = sum_{j : 0 <= r - j < T} dpre[r - j, c] wt[j, c]   (dtail: r < W - 1, dx: the rest)
 *     dwt[j, c] = sum_t dpre[t, c] xx[t + j, c]   (fp64, per-thread partial sums added in thread order)
 * Rows of all sequences are split into one contiguous range per thread; the inner loops run along
 * the channels, contiguous in every tensor.
 *
 * Layouts (contiguous, fp32): x, y, dy, dpre, dx [B, T, C]; tail, dtail [B, W - 1, C]; wt, dwt [W, C].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline const float *row_of(const float *x, const float *tail, int64_t b, int64_t r, int64_t T,
                                  int64_t C, int64_t W) {
    /* row r of xx for sequence b: tail rows first, then x */
    return r < W - 1 ? tail + (b * (W - 1) + r) * C : x + (b * T + r - (W - 1)) * C;
}

static inline void pre_row(const float *x, const float *tail, const float *wt, int64_t b, int64_t t,
                           int64_t T, int64_t C, int64_t W, float *pre) {
    const float *r0 = row_of(x, tail, b, t, T, C, W);
    for (int64_t c = 0; c < C; c++) pre[c] = r0[c] * wt[c];
    for (int64_t j = 1; j < W; j++) {
        const float *rj = row_of(x, tail, b, t + j, T, C, W), *wj = wt + j * C;
        for (int64_t c = 0; c < C; c++) pre[c] += rj[c] * wj[c];
    }
}

static inline int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* this thread's contiguous share [lo, hi) of `rows` (inside a parallel region) */
static void my_rows(int64_t rows, int64_t *lo, int64_t *hi) {
    int parts = 1;
#ifdef _OPENMP
    parts = omp_get_num_threads();
#endif
    *lo = rows * thread_id() / parts;
    *hi = rows * (thread_id() + 1) / parts;
}

int megabase_conv_forward(const float *x, const float *tail, const float *wt, int64_t B, int64_t T,
                          int64_t C, int64_t W, float *y, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        my_rows(B * T, &lo, &hi);
        for (int64_t i = lo; i < hi; i++) {
            float *out = y + i * C;
            pre_row(x, tail, wt, i / T, i % T, T, C, W, out);
            for (int64_t c = 0; c < C; c++) out[c] = out[c] / (1.0f + expf(-out[c]));
        }
    }
    return 0;
}

int megabase_conv_backward(const float *x, const float *tail, const float *wt, const float *dy,
                           int64_t B, int64_t T, int64_t C, int64_t W, float *dpre, float *dx,
                           float *dtail, float *dwt, int threads) {
    if (threads < 1) threads = 1;
    double *partial = calloc((size_t)threads * W * C, sizeof(double));
    if (!partial) return 1;
#pragma omp parallel num_threads(threads)
    {
        double *acc = partial + (int64_t)thread_id() * W * C;
        int64_t lo, hi;
        my_rows(B * T, &lo, &hi);
        for (int64_t i = lo; i < hi; i++) {
            const int64_t b = i / T, t = i % T;
            float *d = dpre + i * C;
            const float *g = dy + i * C;
            pre_row(x, tail, wt, b, t, T, C, W, d);
            for (int64_t c = 0; c < C; c++) {
                const float p = d[c], s = 1.0f / (1.0f + expf(-p));
                d[c] = g[c] * s * (1.0f + p * (1.0f - s));
            }
            for (int64_t j = 0; j < W; j++) {
                const float *rj = row_of(x, tail, b, t + j, T, C, W);
                double *aj = acc + j * C;
                for (int64_t c = 0; c < C; c++) aj[c] += (double)d[c] * rj[c];
            }
        }
#pragma omp barrier
        /* every dpre row is written: rows r of xx, r = 0 .. W - 2 + T, per sequence */
        my_rows(B * (T + W - 1), &lo, &hi);
        for (int64_t i = lo; i < hi; i++) {
            const int64_t b = i / (T + W - 1), r = i % (T + W - 1);
            float *out = r < W - 1 ? dtail + (b * (W - 1) + r) * C : dx + (b * T + r - (W - 1)) * C;
            memset(out, 0, (size_t)C * sizeof(float));
            for (int64_t j = 0; j < W; j++) {
                const int64_t t = r - j;
                if (t < 0 || t >= T) continue;
                const float *d = dpre + (b * T + t) * C, *wj = wt + j * C;
                for (int64_t c = 0; c < C; c++) out[c] += d[c] * wj[c];
            }
        }
    }
    for (int64_t k = 0; k < W * C; k++) {
        double s = 0.0;
        for (int p = 0; p < threads; p++) s += partial[(int64_t)p * W * C + k];
        dwt[k] = (float)s;
    }
    free(partial);
    return 0;
}
