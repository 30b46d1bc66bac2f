/* DSA sparse attention for the CPU, forward and backward (see cpu.py).
 *
 * Query row r (batch b = r / Tq) attends with each query head hq over its selected keys
 * s = idx[r, i] >= 0 (key row b * Tk + s, key/value head hq / G):
 *     p_i = softmax_i(scale * q . k_s),  o = sum_i p_i v_s,  lse = log sum_i exp(scale * q . k_s)
 * and probs[r, i] = sum_hq p_i / sum over heads and slots (the head-summed, L1-normalised target
 * of the sparse indexer loss). The backward recomputes p from lse (flash-style):
 *     ds_i = p_i (dO . v_s - dO . o) scale,  dq += ds_i k_s,  dk_s += ds_i q,  dv_s += p_i dO.
 * The forward runs query rows in parallel; the backward runs key/value heads in parallel, so each
 * thread alone adds into its head's dk and dv. The backward adds into dk and dv, which hold Tg >= Tk
 * rows per sequence: a walked window's gradient buffers take the keys' gradients where they are,
 * with no full-length tensor made per call. Sums are fp32, as the reference's.
 *
 * Layouts (fp32, contiguous): q, dq [R, HQ, D]; k [B * Tk, H, D], dk [B * Tg, H, D]; v [B * Tk,
 * H, DV], dv [B * Tg, H, DV];
 * o, dO [R, HQ, DV]; lse [R, HQ]; probs [R, K]; idx [R, K] int64, -1 for no key.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define AHEAD 8 /* slots: rows of later slots are prefetched, the selection being known */

static inline void prefetch_rows(const float *base, int64_t row, int64_t width, int write) {
    for (int64_t j = 0; j < width; j += 16) {
        if (write) __builtin_prefetch(base + row * width + j, 1, 1);
        else __builtin_prefetch(base + row * width + j, 0, 1);
    }
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

int megabase_dsa_attention_forward(const float *q, const float *k, const float *v,
                                   const int64_t *idx, int64_t R, int64_t Tq, int64_t Tk,
                                   int64_t HQ, int64_t H, int64_t D, int64_t DV, int64_t K,
                                   float scale, float *o, float *lse, float *probs, int threads) {
    const int64_t G = HQ / H;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *sc = malloc((size_t)K * sizeof(float));
        int ok = sc != NULL;
        if (!ok) failed = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            if (!ok) continue;
            const int64_t base = r / Tq * Tk, *ir = idx + r * K;
            float *pr = probs + r * K, total = 0.0f;
            memset(pr, 0, (size_t)K * sizeof *pr);
            for (int64_t hq = 0; hq < HQ; hq++) {
                const int64_t h = hq / G;
                const float *qr = q + (r * HQ + hq) * D;
                float m = -INFINITY, l = 0.0f, *orow = o + (r * HQ + hq) * DV;
                for (int64_t i = 0; i < K; i++) {
                    if (i + AHEAD < K && ir[i + AHEAD] >= 0)
                        prefetch_rows(k, (base + ir[i + AHEAD]) * H + h, D, 0);
                    sc[i] = ir[i] < 0 ? -INFINITY : scale * dot(qr, k + ((base + ir[i]) * H + h) * D, D);
                    m = sc[i] > m ? sc[i] : m;
                }
                memset(orow, 0, (size_t)DV * sizeof *orow);
                if (m == -INFINITY) { /* no key: zero output, as the reference */
                    lse[r * HQ + hq] = 0.0f;
                    continue;
                }
                for (int64_t i = 0; i < K; i++) {
                    if (i + AHEAD < K && ir[i + AHEAD] >= 0)
                        prefetch_rows(v, (base + ir[i + AHEAD]) * H + h, DV, 0);
                    if (ir[i] < 0) continue;
                    const float p = expf(sc[i] - m), *vr = v + ((base + ir[i]) * H + h) * DV;
                    sc[i] = p;
                    l += p;
                    for (int64_t j = 0; j < DV; j++) orow[j] += p * vr[j];
                }
                const float inv = 1.0f / l;
                for (int64_t j = 0; j < DV; j++) orow[j] *= inv;
                for (int64_t i = 0; i < K; i++)
                    if (ir[i] >= 0) pr[i] += sc[i] * inv;
                lse[r * HQ + hq] = m + logf(l);
                total += 1.0f;
            }
            if (total > 0.0f)
                for (int64_t i = 0; i < K; i++) pr[i] /= total;
        }
        free(sc);
    }
    return failed ? -1 : 0;
}

int megabase_dsa_attention_backward(const float *q, const float *k, const float *v,
                                    const int64_t *idx, const float *o, const float *lse,
                                    const float *dO, int64_t R, int64_t Tq, int64_t Tk, int64_t Tg,
                                    int64_t HQ, int64_t H, int64_t D, int64_t DV, int64_t K,
                                    float scale, float *dq, float *dk, float *dv, int threads) {
    const int64_t G = HQ / H;
    memset(dq, 0, (size_t)(R * HQ * D) * sizeof *dq);
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t h = 0; h < H; h++) {
        float *delta = malloc((size_t)G * sizeof(float));
        if (!delta) {
            failed = 1;
            continue;
        }
        for (int64_t r = 0; r < R; r++) {
            const int64_t base = r / Tq * Tk, gbase = r / Tq * Tg, *ir = idx + r * K;
            const int64_t x0 = r * HQ + h * G;
            for (int64_t g = 0; g < G; g++) delta[g] = dot(dO + (x0 + g) * DV, o + (x0 + g) * DV, DV);
            for (int64_t i = 0; i < K; i++) {
                if (i + AHEAD < K && ir[i + AHEAD] >= 0) {
                    const int64_t ahead = (base + ir[i + AHEAD]) * H + h;
                    const int64_t gahead = (gbase + ir[i + AHEAD]) * H + h;
                    prefetch_rows(k, ahead, D, 0);
                    prefetch_rows(v, ahead, DV, 0);
                    prefetch_rows(dk, gahead, D, 1);
                    prefetch_rows(dv, gahead, DV, 1);
                }
                if (ir[i] < 0) continue;
                /* one key/value row for the G query heads that share it */
                const int64_t row = (base + ir[i]) * H + h, grow = (gbase + ir[i]) * H + h;
                const float *kr = k + row * D, *vr = v + row * DV;
                float *dkr = dk + grow * D, *dvr = dv + grow * DV;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t x = x0 + g;
                    const float *qr = q + x * D, *dor = dO + x * DV;
                    const float p = expf(scale * dot(qr, kr, D) - lse[x]);
                    const float ds = p * (dot(dor, vr, DV) - delta[g]) * scale;
                    float *dqr = dq + x * D;
                    for (int64_t j = 0; j < D; j++) {
                        dqr[j] += ds * kr[j];
                        dkr[j] += ds * qr[j];
                    }
                    for (int64_t j = 0; j < DV; j++) dvr[j] += p * dor[j];
                }
            }
        }
        free(delta);
    }
    return failed ? -1 : 0;
}

/* The sparse indexer loss, for each query row r:
 *     a_j,i = scale * q_idx[r, j] . k_idx[s_i],  I_i = sum_j w[r, j] relu(a_j,i),
 *     KL_r = sum_i p_i (log p_i - log softmax(I)_i)   over the selected slots, p = target[r].
 * The forward returns sum_r KL_r in *total (fp64) and, where di is not NULL, dI [R, K]:
 * dI_i = softmax(I)_i sum(p) - p_i (0 in empty slots), all the backward needs besides the inputs.
 * w NULL: every index head weighs 1.
 */
int megabase_dsa_indexer_kl(const float *q, const float *kk, const float *w, const int64_t *idx,
                            const float *target, int64_t R, int64_t Tq, int64_t Tk, int64_t HI,
                            int64_t DI, int64_t K, float scale, double *total, float *di,
                            int threads) {
    double sum = 0.0;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sum)
    {
        float *I = malloc((size_t)K * sizeof(float));
        int ok = I != NULL;
        if (!ok) failed = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            if (!ok) continue;
            const int64_t base = r / Tq * Tk, *ir = idx + r * K;
            const float *qr = q + r * HI * DI, *pr = target + r * K;
            float m = -INFINITY, psum = 0.0f;
            for (int64_t i = 0; i < K; i++) {
                if (ir[i] < 0) continue;
                if (i + AHEAD < K && ir[i + AHEAD] >= 0)
                    __builtin_prefetch(kk + (base + ir[i + AHEAD]) * DI, 0, 1);
                const float *kr = kk + (base + ir[i]) * DI;
                I[i] = 0.0f;
                for (int64_t j = 0; j < HI; j++) {
                    const float aj = scale * dot(qr + j * DI, kr, DI);
                    I[i] += (w ? w[r * HI + j] : 1.0f) * (aj > 0.0f ? aj : 0.0f);
                }
                m = I[i] > m ? I[i] : m;
                psum += pr[i];
            }
            float *dr = di ? di + r * K : NULL;
            if (dr) memset(dr, 0, (size_t)K * sizeof *dr);
            if (m == -INFINITY) continue;
            float z = 0.0f;
            for (int64_t i = 0; i < K; i++)
                if (ir[i] >= 0) z += expf(I[i] - m);
            const float logz = m + logf(z);
            for (int64_t i = 0; i < K; i++) {
                if (ir[i] < 0) continue;
                const float logq = I[i] - logz, p = pr[i];
                if (p > 0.0f) sum += (double)p * (double)(logf(p) - logq);
                if (dr) dr[i] = expf(logq) * psum - p;
            }
        }
        free(I);
    }
    *total = sum;
    return failed ? -1 : 0;
}

/* The indexer loss's gradients, scaled by g, from the forward's dI: dq [R, HI, DI] and dw [R, HI]
 * are written, and the key gradients are added into dk, which holds Tg >= Tk rows per sequence
 * (as the attention's backward). dq and dw run query rows in parallel. dk runs in parallel by
 * key: a thread adds only into the keys it owns (16-row groups, round robin), visiting the
 * slots in query order, so each key's sum has one order whatever the number of threads.
 */
int megabase_dsa_indexer_kl_backward(const float *q, const float *kk, const float *w,
                                     const int64_t *idx, const float *di, int64_t R, int64_t Tq,
                                     int64_t Tk, int64_t Tg, int64_t HI, int64_t DI, int64_t K,
                                     float scale, float g, float *dq, float *dk, float *dw,
                                     int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const int64_t base = r / Tq * Tk, *ir = idx + r * K;
        const float *qr = q + r * HI * DI;
        memset(dq + r * HI * DI, 0, (size_t)(HI * DI) * sizeof *dq);
        memset(dw + r * HI, 0, (size_t)HI * sizeof *dw);
        for (int64_t i = 0; i < K; i++) {
            if (ir[i] < 0 || di[r * K + i] == 0.0f) continue;
            const float d = g * di[r * K + i], *kr = kk + (base + ir[i]) * DI;
            for (int64_t j = 0; j < HI; j++) {
                const float aj = scale * dot(qr + j * DI, kr, DI);
                if (aj <= 0.0f) continue;
                dw[r * HI + j] += d * aj;
                const float da = d * (w ? w[r * HI + j] : 1.0f) * scale;
                float *dqj = dq + (r * HI + j) * DI;
                for (int64_t x = 0; x < DI; x++) dqj[x] += da * kr[x];
            }
        }
    }
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
#else
        const int64_t t = 0, n = 1;
#endif
        for (int64_t r = 0; r < R; r++) {
            const int64_t base = r / Tq * Tk, gbase = r / Tq * Tg, *ir = idx + r * K;
            const float *qr = q + r * HI * DI;
            for (int64_t i = 0; i < K; i++) {
                if (ir[i] < 0 || (ir[i] >> 4) % n != t || di[r * K + i] == 0.0f) continue;
                const float d = g * di[r * K + i], *kr = kk + (base + ir[i]) * DI;
                float *dkr = dk + (gbase + ir[i]) * DI;
                for (int64_t j = 0; j < HI; j++) {
                    const float aj = scale * dot(qr + j * DI, kr, DI);
                    if (aj <= 0.0f) continue;
                    const float da = d * (w ? w[r * HI + j] : 1.0f) * scale;
                    const float *qj = qr + j * DI;
                    for (int64_t x = 0; x < DI; x++) dkr[x] += da * qj[x];
                }
            }
        }
    }
    return 0;
}
