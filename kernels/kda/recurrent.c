/* Kimi Delta Attention, token by token, forward and backward, for the CPU (see cpu.py).
 *
 * Per head n, with a_t = exp(g_t) and u_t = beta_t k_t (q pre-scaled by the caller):
 *     S'_t = Diag(a_t) S_{t-1};  e_t = v_t - S'_t^T k_t;  S_t = S'_t + u_t e_t^T;  o_t = S_t^T q_t
 * The forward keeps the state at the start of every C-token chunk; the backward recomputes one
 * chunk's states from there (a [C, K, V] buffer) and walks it backwards carrying dS:
 *     dS += q_t dO_t^T, dq_t = S_t dO_t;  de = dS^T u_t, du = dS e_t;  dv_t = de,
 *     dbeta_t = du . k_t, dk_t = beta_t du - S'_t de;  dS' = dS - k_t de^T,
 *     dg_t = rowsum(dS' * S'_t), dS_{t-1} = Diag(a_t) dS'.
 * Heads run in parallel; each step is a few passes over the [K, V] state, vectorised along V.
 * States, their gradients and every sum are fp64 (inputs and outputs fp32): over 10^5-10^6 steps
 * the recurrence then stays at fp32 round-off of the exact result, so a state carried in pieces
 * (streaming, context parallelism) and the state of one pass agree to the last fp32 digit.
 *
 * Layouts (contiguous): q, k, g [N, T, K], v, o, dO [N, T, V], beta [N, T] fp32; states
 * [N, K, V] and checkpoints [N, ceil(T / C), K, V] fp64.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline double dot(const double *a, const double *b, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One step: S <- S'_t + u e^T, e <- v - S'^T k; returns nothing, leaves e in `e`. */
static inline void step(double *S, const float *k, const float *v, const float *g, float beta,
                        double *e, int64_t K, int64_t V) {
    for (int64_t j = 0; j < V; j++) e[j] = v[j];
    for (int64_t i = 0; i < K; i++) {
        double *row = S + i * V;
        const double a = exp((double)g[i]), ki = k[i];
        for (int64_t j = 0; j < V; j++) {
            row[j] *= a;
            e[j] -= ki * row[j];
        }
    }
    for (int64_t i = 0; i < K; i++) {
        double *row = S + i * V;
        const double ui = (double)beta * k[i];
        for (int64_t j = 0; j < V; j++) row[j] += ui * e[j];
    }
}

int megabase_kda_forward(const float *q, const float *k, const float *v, const float *g,
                         const float *beta, const double *s0, int64_t N, int64_t T, int64_t K,
                         int64_t V, int64_t C, float *o, double *sT, double *ckpt, int threads) {
    const int64_t nck = (T + C - 1) / C;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t n = 0; n < N; n++) {
        double *S = sT + n * K * V, *e = malloc((size_t)V * sizeof(double));
        if (!e) {
            failed = 1;
            continue;
        }
        if (s0) memcpy(S, s0 + n * K * V, (size_t)(K * V) * sizeof *S);
        else memset(S, 0, (size_t)(K * V) * sizeof *S);
        for (int64_t t = 0; t < T; t++) {
            if (t % C == 0) memcpy(ckpt + (n * nck + t / C) * K * V, S, (size_t)(K * V) * sizeof *S);
            const int64_t x = n * T + t;
            step(S, k + x * K, v + x * V, g + x * K, beta[x], e, K, V);
            for (int64_t j = 0; j < V; j++) e[j] = 0.0;
            for (int64_t i = 0; i < K; i++) {
                const double qi = q[x * K + i], *row = S + i * V;
                for (int64_t j = 0; j < V; j++) e[j] += qi * row[j];
            }
            for (int64_t j = 0; j < V; j++) o[x * V + j] = (float)e[j];
        }
        free(e);
    }
    return failed ? -1 : 0;
}

int megabase_kda_backward(const float *q, const float *k, const float *v, const float *g,
                          const float *beta, const double *ckpt, const float *dO, const double *dsT,
                          int64_t N, int64_t T, int64_t K, int64_t V, int64_t C, float *dq,
                          float *dk, float *dv, float *dg, float *dbeta, double *ds0, int threads) {
    const int64_t nck = (T + C - 1) / C, KV = K * V;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t n = 0; n < N; n++) {
        /* states S_t of one chunk (slot 0: the state before it), its e_t, and scratch */
        double *Sb = malloc((size_t)((C + 1) * KV + C * V + 3 * V + K) * sizeof(double));
        if (!Sb) {
            failed = 1;
            continue;
        }
        double *eb = Sb + (C + 1) * KV, *de = eb + C * V, *sp = de + V, *dot_ = sp + V;
        double *du = dot_ + V, *dS = ds0 + n * KV;
        if (dsT) memcpy(dS, dsT + n * KV, (size_t)KV * sizeof *dS);
        else memset(dS, 0, (size_t)KV * sizeof *dS);
        for (int64_t c = nck - 1; c >= 0; c--) {
            const int64_t t0 = c * C, t1 = t0 + C < T ? t0 + C : T;
            memcpy(Sb, ckpt + (n * nck + c) * KV, (size_t)KV * sizeof *Sb);
            for (int64_t t = t0; t < t1; t++) {
                const int64_t x = n * T + t;
                double *S = Sb + (t - t0 + 1) * KV;
                memcpy(S, S - KV, (size_t)KV * sizeof *S);
                step(S, k + x * K, v + x * V, g + x * K, beta[x], eb + (t - t0) * V, K, V);
            }
            for (int64_t t = t1 - 1; t >= t0; t--) {
                const int64_t x = n * T + t;
                const double *S = Sb + (t - t0 + 1) * KV, *Sprev = S - KV, *e = eb + (t - t0) * V;
                const float *qt = q + x * K, *kt = k + x * K, *gt = g + x * K;
                const double bt = beta[x];
                for (int64_t j = 0; j < V; j++) dot_[j] = dO[x * V + j];
                /* o_t = S_t^T q_t */
                for (int64_t i = 0; i < K; i++) {
                    double *drow = dS + i * V;
                    dq[x * K + i] = (float)dot(S + i * V, dot_, V);
                    for (int64_t j = 0; j < V; j++) drow[j] += qt[i] * dot_[j];
                }
                /* S_t = S'_t + u e^T */
                for (int64_t j = 0; j < V; j++) de[j] = 0.0;
                double db = 0.0;
                for (int64_t i = 0; i < K; i++) {
                    const double *drow = dS + i * V, ui = bt * kt[i];
                    for (int64_t j = 0; j < V; j++) de[j] += ui * drow[j];
                    du[i] = dot(drow, e, V);
                    db += du[i] * kt[i];
                }
                for (int64_t j = 0; j < V; j++) dv[x * V + j] = (float)de[j];
                dbeta[x] = (float)db;
                /* e = v - S'^T k and S' = Diag(a) S_{t-1} */
                for (int64_t i = 0; i < K; i++) {
                    double *drow = dS + i * V;
                    const double a = exp((double)gt[i]), ki = kt[i];
                    double dki = bt * du[i], dgi = 0.0;
                    for (int64_t j = 0; j < V; j++) {
                        sp[j] = Sprev[i * V + j] * a;
                        dki -= sp[j] * de[j];
                        drow[j] -= ki * de[j];
                        dgi += drow[j] * sp[j];
                        drow[j] *= a;
                    }
                    dk[x * K + i] = (float)dki;
                    dg[x * K + i] = (float)dgi;
                }
            }
        }
        free(Sb);
    }
    return failed ? -1 : 0;
}
