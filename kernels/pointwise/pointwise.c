/* Sigmoid and SwiGLU element by element, forward and backward (see cpu.py).
 *
 *     sigmoid(x) = 1 / (1 + exp(-x))
 *     swiglu(ab) = silu(a) * b,  ab = [a | b] along the last dim, silu(a) = a * sigmoid(a)
 *
 * Why our own: PyTorch's CPU loops run a vectorised exp on whole vector widths and a scalar one
 * (another rounding) on the rest of each thread's range, and those ranges move with the tensor's
 * size and the thread count, so a value's last bit depended on how long the sequence was: a piece
 * of a stream and the full pass differed, and DSA's top-k turned that into other selections. Here
 * exp is a polynomial of plain IEEE operations (compiled without FMA contraction), which give the
 * same bits in the vector body and in the scalar tail: an output depends on its input only.
 *
 * exp: x clamped to [-87, 88], x = n ln2 + r (Cody-Waite, |r| <= ln2 / 2), exp(r) by Cephes'
 * degree-7 polynomial (about 1 ulp), 2^n built in the exponent bits. Layouts: contiguous fp32;
 * sigmoid on n values, swiglu on `rows` rows of 2h inputs -> h outputs.
 */
#include <stdint.h>
#include <string.h>

static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer in the low bits */
    const float t = x * 1.44269504088896341f + magic;
    const float n = t - magic;
    int32_t ti;
    memcpy(&ti, &t, sizeof ti);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t bits = (ti - 0x4B400000 + 127) << 23;
    float s;
    memcpy(&s, &bits, sizeof s);
    return p * s;
}

static inline float sigmoid1(float x) { return 1.0f / (1.0f + exp_poly(-x)); }

int megabase_sigmoid_forward(const float *restrict x, float *restrict y, int64_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; i++) y[i] = sigmoid1(x[i]);
    return 0;
}

/* dx = dy * y (1 - y) */
int megabase_sigmoid_backward(const float *restrict y, const float *restrict dy, float *restrict dx,
                              int64_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; i++) dx[i] = dy[i] * (y[i] * (1.0f - y[i]));
    return 0;
}

int megabase_swiglu_forward(const float *restrict ab, float *restrict out, int64_t rows, int64_t h,
                            int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *a = ab + r * 2 * h, *b = a + h;
        float *o = out + r * h;
        for (int64_t c = 0; c < h; c++) o[c] = a[c] * sigmoid1(a[c]) * b[c];
    }
    return 0;
}

/* s = sigmoid(a): da = dout * b * s (1 + a (1 - s)), db = dout * a * s */
int megabase_swiglu_backward(const float *restrict ab, const float *restrict dout, float *restrict dab,
                             int64_t rows, int64_t h, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *a = ab + r * 2 * h, *b = a + h, *g = dout + r * h;
        float *da = dab + r * 2 * h, *db = da + h;
        for (int64_t c = 0; c < h; c++) {
            const float s = sigmoid1(a[c]);
            da[c] = g[c] * b[c] * (s * (1.0f + a[c] * (1.0f - s)));
            db[c] = g[c] * (a[c] * s);
        }
    }
    return 0;
}
