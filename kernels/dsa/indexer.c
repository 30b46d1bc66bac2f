/* The DSA lightning indexer with its top-k, fused, for the CPU (see cpu.py).
 *
 * For each query row r (batch b = r / Tq, position pos = offset + r % Tq) the score of key s <= pos
 * is I = sum_j w[r, j] * relu((scale * q[r, j]) . k[b, s]); the row keeps the topk keys in the order
 * (score desc, position desc), as the PyTorch reference. Keys are scanned from pos down to 0, so
 * every key arrives older than all kept ones: once topk are held, a key enters only if its score is
 * strictly above the current k-th (a tie loses to the more recent key already held). Candidates are
 * one int64 each, order_key(score) * 2^32 + position, kept in arrival order; when the buffer fills,
 * the k-th largest is found by radix select and the buffer filtered in place. Arrival order is
 * descending position, so the output needs no sort. Scores never exist beyond one block of keys.
 * Positions must stay below 2^32.
 *
 * Layouts (fp32, contiguous): q [R, HI, DI]; kb [B, ceil(Tk / VW), DI, VW], the keys in blocks of VW
 * (zero-padded), each block transposed so that one dimension of VW keys is one vector; w [R, HI]
 * or NULL; out [R, topk] int64, ascending positions, -1 padded.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define VW 16 /* keys per vector of the layout (kb, sb), on every machine */
#define G 4      /* key blocks scored together */
/* The arithmetic runs in the machine's own vectors, VL lanes (16 with AVX-512, 8 with AVX, else 4),
 * NP = VW / VL of them per layout vector: a generic vector wider than the machine's is lowered
 * lane by lane through the stack (10x slower on an AVX2 machine). Each lane's sum is the same
 * chain of operations at any width, so the scores' bits do not depend on VL. */
#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#include <immintrin.h>
#else
#define VL 4
#endif
#define NP (VW / VL)
typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));

/* The scores of the VW keys of one layout vector, in NP machine vectors. */
typedef struct {
    vf p[NP];
} lanes_t;

static inline float lane(const lanes_t *s, int x) { return s->p[x / VL][x % VL]; }

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf relu(vf x) {
    const vf zero = {0};
    return (vf)((vi)x & (x > zero));
}

/* fp32 -> int32 with the same order (-0.0 folded into +0.0), as reference._order_key */
static inline int64_t order_key(float v) {
    v += 0.0f;
    int32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return bits < 0 ? (int64_t)(bits ^ 0x7FFFFFFF) : (int64_t)bits;
}

/* The k-th largest (0-based) of x[0..n): radix select, 8 bits at a time from the top, keeping the
 * candidates of one bucket in tmp (no data-dependent branches per element, unlike quickselect). */
static int64_t kth_largest(const int64_t *x, int64_t n, int64_t k, int64_t *tmp) {
    const uint64_t flip = (uint64_t)1 << 63; /* signed order -> unsigned order */
    const int64_t *src = x;
    uint64_t diff = 0; /* the bits where some keys differ: bytes above them decide nothing */
    for (int64_t i = 1; i < n; i++) diff |= (uint64_t)(x[i] ^ x[0]);
    if (!diff) return x[0];
    for (int shift = (63 - __builtin_clzll(diff)) / 8 * 8; shift >= 0 && n > 1; shift -= 8) {
        uint32_t hist[256] = {0};
        for (int64_t i = 0; i < n; i++) hist[(((uint64_t)src[i] ^ flip) >> shift) & 255]++;
        int b = 255;
        for (; b > 0 && hist[b] <= (uint64_t)k; b--) k -= hist[b];
        int64_t m = 0;
        for (int64_t i = 0; i < n; i++) { /* branch-free: tmp may be src, m <= i */
            const int64_t y = src[i];
            tmp[m] = y;
            m += ((((uint64_t)y ^ flip) >> shift) & 255) == (uint64_t)b;
        }
        src = tmp;
        n = m;
    }
    return src[0];
}

/* Keep the topk largest of buf[0..n) in arrival order; returns topk, sets *kth to the k-th. */
static int64_t compact(int64_t *buf, int64_t n, int64_t topk, int64_t *tmp, int64_t *kth) {
    const int64_t floor = kth_largest(buf, n, topk - 1, tmp);
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) { /* branch-free, in place: m <= i */
        const int64_t y = buf[i];
        buf[m] = y;
        m += y >= floor;
    }
    *kth = floor;
    return m;
}

/* Bit x set where lane x of score is above floor. */
static inline uint32_t above(const lanes_t *score, float floor) {
    uint32_t bits = 0;
    for (int p = 0; p < NP; p++) {
        const vi hit = score->p[p] > floor; /* -1 where above */
#if VL == 8
        bits |= (uint32_t)_mm256_movemask_ps((__m256)hit) << (p * VL);
#else
        for (int x = 0; x < VL; x++) bits |= (uint32_t)(hit[x] & 1) << (p * VL + x);
#endif
    }
    return bits;
}

static void one_row(const float *q, const float *kb, const float *w, int64_t HI, int64_t DI,
                    int64_t last, int64_t pos, int64_t topk, float scale, int64_t keep_recent,
                    int64_t cap, int64_t *out, int64_t *buf, int64_t *tmp) {
    int64_t n = 0, kth = 0;
    int full = 0;
    float floor = -INFINITY, qs[HI * DI];
    for (int64_t i = 0; i < HI * DI; i++) qs[i] = q[i] * scale;
    const int64_t recent = keep_recent > 0 ? pos - keep_recent : INT64_MAX; /* s > recent: forced */
    for (int64_t top = last / VW; top >= 0; top -= G) {
        /* G blocks of VW keys at once: G independent FMA chains per head hide the FMA latency */
        lanes_t score[G];
        memset(score, 0, sizeof score);
        const int64_t low = top - G + 1 < 0 ? 0 : top - G + 1; /* blocks low..top */
        const float *blocks[G]; /* block top - g, or a repeat of `low` past the row start */
        for (int g = 0; g < G; g++) blocks[g] = kb + (top - g < low ? low : top - g) * DI * VW;
        for (int64_t j = 0; j < HI; j++) {
            vf acc[G][NP];
            memset(acc, 0, sizeof acc);
            for (int64_t d = 0; d < DI; d++) {
                const float qd = qs[j * DI + d];
                for (int g = 0; g < G; g++)
                    for (int p = 0; p < NP; p++) acc[g][p] += qd * load(blocks[g] + d * VW + p * VL);
            }
            const float wj = w ? w[j] : 1.0f;
            for (int g = 0; g < G; g++)
                for (int p = 0; p < NP; p++) score[g].p[p] += wj * relu(acc[g][p]);
        }
        for (int64_t blk = top; blk >= low; blk--) {
            const lanes_t *sv = &score[top - blk];
            const int64_t s0 = blk * VW;
            /* lanes that may enter, newest first: all while the row holds < topk keys */
            const uint32_t all = (1u << VW) - 1;
            uint32_t lanes = full ? above(sv, floor) : all;
            if (s0 + VW - 1 > recent) /* forced keys s > recent */
                lanes |= s0 > recent ? all : all & ~((1u << (recent - s0 + 1)) - 1);
            if (s0 + VW - 1 > last) /* keys past the query */
                lanes &= (1u << (last - s0 + 1)) - 1;
            while (lanes) {
                const int x = 31 - __builtin_clz(lanes);
                lanes &= ~(1u << x);
                const int64_t s = s0 + x;
                const float v = s > recent ? INFINITY : lane(sv, x);
                if (full && !(v > floor)) continue;
                buf[n++] = order_key(v) * ((int64_t)1 << 32) + s;
                if (n == cap || (!full && n == topk)) {
                    if (full) {
                        n = compact(buf, n, topk, tmp, &kth);
                    } else { /* the first topk keys: all held, the k-th is the least */
                        kth = buf[0];
                        for (int64_t i = 1; i < n; i++) kth = buf[i] < kth ? buf[i] : kth;
                        full = 1;
                    }
                    int32_t bits = (int32_t)(kth >> 32);
                    bits = bits < 0 ? bits ^ 0x7FFFFFFF : bits;
                    memcpy(&floor, &bits, sizeof floor);
                }
            }
        }
    }
    if (n > topk) n = compact(buf, n, topk, tmp, &kth);
    for (int64_t i = 0; i < n; i++) out[i] = buf[n - 1 - i] & 0xFFFFFFFF; /* arrival: descending */
    for (int64_t i = n; i < topk; i++) out[i] = -1;
}

int megabase_dsa_indexer(const float *q, const float *kb, const float *w, int64_t B, int64_t Tq,
                         int64_t Tk, int64_t HI, int64_t DI, int64_t topk, float scale,
                         int64_t keep_recent, int64_t offset, int64_t *out, int threads) {
    if (topk <= 0) return 0;
    if (threads < 1) threads = 1;
    const int64_t nblk = (Tk + VW - 1) / VW;
    const int64_t cap = 4 * topk; /* a larger buffer: fewer compactions, a threshold that lags */
    int64_t *pool = malloc((size_t)threads * (size_t)(2 * cap) * sizeof *pool);
    if (!pool) return -1;
    /* later rows scan more keys: small chunks, last rows first */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 8)
    for (int64_t i = 0; i < B * Tq; i++) {
#ifdef _OPENMP
        int64_t *buf = pool + (size_t)omp_get_thread_num() * (size_t)(2 * cap);
#else
        int64_t *buf = pool;
#endif
        int64_t r = B * Tq - 1 - i, b = r / Tq, pos = offset + r % Tq;
        int64_t last = pos < Tk - 1 ? pos : Tk - 1;
        one_row(q + r * HI * DI, kb + b * nblk * DI * VW, w ? w + r * HI : NULL, HI, DI, last, pos,
                topk, scale, keep_recent, cap, out + r * topk, buf, buf + cap);
    }
    free(pool);
    return 0;
}

/* The candidate stage (see stage.py): the same scores, on a query's candidates only.
 *
 * A query at pos scores the summaries of the blocks before its local window, keeps the best
 * `nkeep` blocks, then scores exactly the keys of those blocks, of the local window L..pos and its
 * seeds (int32 [R, S], -1 padded; those inside a kept block or the window are skipped, being
 * there already). Key scores are computed lane by lane as one_row computes them, so a key's score
 * is bit for bit the exact kernel's; blocks and keys are kept by running top-k buffers in the
 * same total order (score desc, position desc), whatever order they arrive in. Summaries:
 * sb [B, ceil(nblk / VW), rows, DI, VW]
 * (rows 1: mean key; rows 2: per-channel max then min).
 */

/* Index scores of G layout vectors at once (vec[g] [DI, VW]: keys, or a block summary's rows
 * for the max summary, whose second row, `lower`, is read where q . k is largest at the minimum):
 * G * NP independent sums hide the FMA latency, as one_row's. Each lane's sum is the exact
 * kernel's. A repeated pointer just scores that vector twice. */
static inline void scores_g(const float *qs, const float *const vec[G], int64_t lower,
                            const float *w, int64_t HI, int64_t DI, lanes_t out[G]) {
    memset(out, 0, G * sizeof *out);
    for (int64_t j = 0; j < HI; j++) {
        const float wj = w ? w[j] : 1.0f;
        vf acc[G][NP];
        memset(acc, 0, sizeof acc);
        for (int64_t d = 0; d < DI; d++) {
            const float qd = qs[j * DI + d];
            const int64_t at = d * VW + (lower && (qd >= 0.0f) != (wj >= 0.0f) ? lower : 0);
            for (int g = 0; g < G; g++)
                for (int p = 0; p < NP; p++) acc[g][p] += qd * load(vec[g] + at + p * VL);
        }
        for (int g = 0; g < G; g++)
            for (int p = 0; p < NP; p++) out[g].p[p] += wj * relu(acc[g][p]);
    }
}

/* The index scores of the VW keys of one layout vector (kblk [DI, VW]). */
static inline lanes_t key_scores(const float *qs, const float *kblk, const float *w, int64_t HI,
                                 int64_t DI) {
    const float *vec[G];
    lanes_t out[G];
    for (int g = 0; g < G; g++) vec[g] = kblk;
    scores_g(qs, vec, 0, w, HI, DI, out);
    return out[0];
}

/* The running top-k of one row's candidates, which may arrive in any order: keys enter while
 * fewer than k are held, then only above the k-th held (ties of score are decided by the whole
 * key, score and position); the buffer is compacted by radix select when it holds cap. A lane of
 * scores below `floor` (the k-th's score) cannot enter, which one vector comparison tells. */
typedef struct {
    int64_t *buf, *tmp; /* cap entries each */
    int64_t n, k, cap, kth;
    int full;
    float floor;
} top_t;

static inline float key_score(int64_t key) {
    int32_t bits = (int32_t)(key >> 32);
    bits = bits < 0 ? bits ^ 0x7FFFFFFF : bits;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline void top_add(top_t *t, int64_t y) {
    if (t->full && y <= t->kth) return;
    t->buf[t->n++] = y;
    if (t->full && t->n == t->cap) {
        t->n = compact(t->buf, t->n, t->k, t->tmp, &t->kth);
    } else if (!t->full && t->n == t->k) {
        t->kth = t->buf[0];
        for (int64_t i = 1; i < t->n; i++) t->kth = t->buf[i] < t->kth ? t->buf[i] : t->kth;
        t->full = 1;
    } else {
        return;
    }
    t->floor = key_score(t->kth);
}

/* Lanes x of `valid` with score s[x] >= floor (a tie may still enter, by position). */
static inline uint32_t at_least(const lanes_t *score, float floor) {
    uint32_t bits = 0;
    for (int p = 0; p < NP; p++) {
        const vi hit = score->p[p] >= floor;
#if VL == 8
        bits |= (uint32_t)_mm256_movemask_ps((__m256)hit) << (p * VL);
#else
        for (int x = 0; x < VL; x++) bits |= (uint32_t)(hit[x] & 1) << (p * VL + x);
#endif
    }
    return bits;
}

/* Offer lanes `valid` of `score`, lane x being entry first + x. */
static inline void top_add_lanes(top_t *t, const lanes_t *score, uint32_t valid, int64_t first) {
    uint32_t m = t->full ? valid & at_least(score, t->floor) : valid;
    while (m) {
        const int x = __builtin_ctz(m);
        m &= m - 1;
        top_add(t, order_key(lane(score, x)) * ((int64_t)1 << 32) + first + x);
    }
}

/* The held keys, the top k of all offered; returns their number (<= k). */
static int64_t top_done(top_t *t) {
    if (t->n > t->k) t->n = compact(t->buf, t->n, t->k, t->tmp, &t->kth);
    return t->n;
}

/* Sort x[0..n) (non-negative, below 2^32) ascending: least significant byte first, skipping the
 * bytes that every entry shares. tmp: n entries. */
static void sort_positions(int64_t *x, int64_t n, int64_t *tmp) {
    uint64_t diff = 0;
    for (int64_t i = 1; i < n; i++) diff |= (uint64_t)(x[i] ^ x[0]);
    int64_t *src = x, *dst = tmp;
    for (int shift = 0; shift < 32; shift += 8) {
        if (!((diff >> shift) & 255)) continue;
        int64_t count[257] = {0};
        for (int64_t i = 0; i < n; i++) count[((src[i] >> shift) & 255) + 1]++;
        for (int b = 0; b < 256; b++) count[b + 1] += count[b];
        for (int64_t i = 0; i < n; i++) dst[count[(src[i] >> shift) & 255]++] = src[i];
        int64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != x) memcpy(x, src, (size_t)n * sizeof *x);
}

static inline void prefetch_block(const float *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes / (int64_t)sizeof(float); i += 64 / sizeof(float))
        __builtin_prefetch(p + i, 0, 0);
}

#define QT 8 /* queries whose block summaries are scored in one pass over the summaries */

/* The best `nkeep` blocks by summary of each of n <= QT queries (qs [n, HI * DI], scaled; wr[i]
 * its index weights or NULL; nbs[i] its blocks before the local window): into bkeys + i * 4 *
 * nkeep, their number into chosen[i]. The queries take turns on each G groups of summaries, which
 * are then read from memory once, not once per query (1 MB of them at a megabase). */
static void choose_blocks(const float *qs, const float *const *wr, const int64_t *nbs, int64_t n,
                          const float *sb, int64_t HI, int64_t DI, int rows, int64_t nkeep,
                          int64_t *bkeys, int64_t *tmp, int64_t *chosen) {
    const uint32_t all = (1u << VW) - 1;
    top_t tops[QT];
    int64_t nbmax = 0;
    for (int64_t i = 0; i < n; i++) {
        tops[i] = (top_t){bkeys + i * 4 * nkeep, tmp, 0, nkeep, 4 * nkeep, 0, 0, -INFINITY};
        nbmax = nbs[i] > nbmax ? nbs[i] : nbmax;
    }
    const int64_t ngroups = (nbmax + VW - 1) / VW, lower = rows == 2 ? DI * VW : 0;
    for (int64_t g0 = 0; g0 < ngroups; g0 += G) {
        const float *vec[G];
        for (int g = 0; g < G; g++)
            vec[g] = sb + (g0 + g < ngroups ? g0 + g : g0) * rows * DI * VW;
        for (int64_t i = 0; i < n; i++) {
            if (g0 * VW >= nbs[i]) continue;
            lanes_t sc[G];
            scores_g(qs + i * HI * DI, vec, lower, wr[i], HI, DI, sc);
            for (int g = 0; g < G; g++) {
                const int64_t left = nbs[i] - (g0 + g) * VW;
                if (left <= 0) break;
                top_add_lanes(&tops[i], &sc[g], left >= VW ? all : all & ((1u << left) - 1),
                              (g0 + g) * VW);
            }
        }
    }
    for (int64_t i = 0; i < n; i++) chosen[i] = top_done(&tops[i]);
}

static inline int64_t window_start(int64_t pos, int64_t local, int64_t block) {
    return (pos + 1 - local > 0 ? (pos + 1 - local) / block : 0) * block;
}

/* One query's top-k among its candidates: the keys of its `chosen` blocks bkeys[0..chosen) (low
 * 32 bits), of its local window and its seeds. qs: the query, scaled. scratch: cand and tmp of
 * 4 * max(topk, nkeep) entries, kept (all zero) of one byte per block. */
static void staged_row(const float *qs, const float *kb, const float *w, const int32_t *seeds,
                       int64_t S, int64_t HI, int64_t DI, int64_t pos, int64_t topk,
                       int64_t keep_recent, int64_t block, int64_t local, const int64_t *bkeys,
                       int64_t chosen, int64_t *out, int64_t *cand, int64_t *tmp,
                       unsigned char *kept) {
    const int64_t L = window_start(pos, local, block), per = block / VW;
    const uint32_t all = (1u << VW) - 1;
    const int64_t recent = keep_recent > 0 ? pos - keep_recent : INT64_MAX;
    /* the local window first: its keys raise the floor that the blocks' keys must pass */
    top_t keys = {cand, tmp, 0, topk, 4 * topk, 0, 0, -INFINITY};
    const int64_t v1 = pos / VW + 1; /* vectors L / VW .. v1 hold the window */
    for (int64_t v0 = L / VW; v0 < v1; v0 += G) {
        const float *vec[G];
        lanes_t sc[G];
        for (int g = 0; g < G; g++) vec[g] = kb + (v0 + g < v1 ? v0 + g : v0) * DI * VW;
        scores_g(qs, vec, 0, w, HI, DI, sc);
        for (int g = 0; g < G && v0 + g < v1; g++) {
            const int64_t s0 = (v0 + g) * VW;
            if (s0 + VW - 1 > recent) { /* forced keys s > recent score as +inf */
                for (int x = 0; x < VW && s0 + x <= pos; x++)
                    top_add(&keys, order_key(s0 + x > recent ? INFINITY : lane(&sc[g], x)) *
                                       ((int64_t)1 << 32) + s0 + x);
                continue;
            }
            top_add_lanes(&keys, &sc[g], pos - s0 >= VW - 1 ? all : all & ((2u << (pos - s0)) - 1),
                          s0);
        }
    }
    for (int64_t c = 0; c < chosen; c++) {
        const int64_t b = bkeys[c] & 0xFFFFFFFF;
        kept[b] = 1;
        const float *next = c + 1 < chosen ? kb + (bkeys[c + 1] & 0xFFFFFFFF) * per * DI * VW : NULL;
        for (int64_t i = 0; i < per; i += G) {
            const float *vec[G];
            lanes_t sc[G];
            for (int g = 0; g < G; g++) vec[g] = kb + (b * per + (i + g < per ? i + g : i)) * DI * VW;
            if (next)
                prefetch_block(next + i * DI * VW, G * DI * VW * (int64_t)sizeof(float));
            scores_g(qs, vec, 0, w, HI, DI, sc);
            for (int g = 0; g < G && i + g < per; g++)
                top_add_lanes(&keys, &sc[g], all, (b * per + i + g) * VW);
        }
    }
    for (int64_t i = 0; i < S; i++) {
        const int64_t s = seeds[i];
        if (s < 0 || s >= L || kept[s / block]) continue;
        const lanes_t v = key_scores(qs, kb + (s / VW) * DI * VW, w, HI, DI);
        top_add(&keys, order_key(s > recent ? INFINITY : lane(&v, (int)(s % VW))) *
                           ((int64_t)1 << 32) + s);
    }
    for (int64_t c = 0; c < chosen; c++) kept[bkeys[c] & 0xFFFFFFFF] = 0;
    const int64_t n = top_done(&keys);
    for (int64_t i = 0; i < n; i++) cand[i] &= 0xFFFFFFFF;
    sort_positions(cand, n, tmp);
    for (int64_t i = 0; i < n; i++) out[i] = cand[i];
    for (int64_t i = n; i < topk; i++) out[i] = -1;
}

/* Queries r of B * Tq, all at positions >= the stage's first (see candidates.Stage.first_staged). */
int megabase_dsa_staged_indexer(const float *q, const float *kb, const float *sb, const float *w,
                                const int32_t *seeds, int64_t S, int64_t B, int64_t Tq,
                                int64_t Tk, int64_t HI, int64_t DI, int64_t topk, float scale,
                                int64_t keep_recent, int64_t offset, int64_t block, int64_t nkeep,
                                int64_t local, int rows, int64_t *out, int threads) {
    if (topk <= 0) return 0;
    if (threads < 1) threads = 1;
    const int64_t nkb = (Tk + VW - 1) / VW, nblk = Tk / block;
    const int64_t nsb = (nblk + VW - 1) / VW;
    const int64_t room = 4 * (topk > nkeep ? topk : nkeep); /* a running top-k's buffer */
    const int64_t width = 2 * room + QT * 4 * nkeep;
    const int64_t tiles = (Tq + QT - 1) / QT; /* per sequence */
    int64_t *pool = malloc((size_t)threads * (size_t)width * sizeof *pool);
    unsigned char *marks = calloc((size_t)threads * (size_t)(nblk + 1), 1);
    if (!pool || !marks) {
        free(pool);
        free(marks);
        return -1;
    }
    /* tiles of QT queries, the last (the most blocks) first */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t i = 0; i < B * tiles; i++) {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
#else
        const int t = 0;
#endif
        int64_t *buf = pool + (size_t)t * (size_t)width, *bkeys = buf + 2 * room;
        const int64_t b = (B * tiles - 1 - i) / tiles, tile = (B * tiles - 1 - i) % tiles;
        const int64_t r0 = b * Tq + tile * QT, n = Tq - tile * QT < QT ? Tq - tile * QT : QT;
        float qs[QT * HI * DI];
        const float *wr[QT];
        int64_t nbs[QT], chosen[QT];
        for (int64_t x = 0; x < n; x++) {
            const int64_t r = r0 + x, pos = offset + r % Tq;
            for (int64_t y = 0; y < HI * DI; y++) qs[x * HI * DI + y] = q[r * HI * DI + y] * scale;
            wr[x] = w ? w + r * HI : NULL;
            nbs[x] = window_start(pos, local, block) / block; /* > nkeep: the caller checked */
        }
        choose_blocks(qs, wr, nbs, n, sb + b * nsb * rows * DI * VW, HI, DI, rows, nkeep, bkeys,
                      buf + room, chosen);
        for (int64_t x = 0; x < n; x++) {
            const int64_t r = r0 + x;
            staged_row(qs + x * HI * DI, kb + b * nkb * DI * VW, wr[x],
                       seeds ? seeds + r * S : NULL, seeds ? S : 0, HI, DI, offset + r % Tq,
                       topk, keep_recent, block, local, bkeys + x * 4 * nkeep, chosen[x],
                       out + r * topk, buf, buf + room, marks + (size_t)t * (size_t)(nblk + 1));
        }
    }
    free(pool);
    free(marks);
    return 0;
}

/* Block summaries of k [B, Tk, DI]: out [B, Tk / block, rows, DI], the mean key (rows 1, summed in
 * key order) or the per-channel max then min (rows 2). */
int megabase_dsa_block_summaries(const float *k, int64_t B, int64_t Tk, int64_t DI, int64_t block,
                                 int rows, float *out) {
    const int64_t nblk = Tk / block;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < nblk; i++) {
            const float *kk = k + (b * Tk + i * block) * DI;
            float *o = out + (b * nblk + i) * rows * DI;
            for (int64_t d = 0; d < DI; d++) {
                float hi = kk[d], lo = kk[d], sum = 0.0f;
                for (int64_t s = 0; s < block; s++) {
                    const float v = kk[s * DI + d];
                    sum += v;
                    hi = v > hi ? v : hi;
                    lo = v < lo ? v : lo;
                }
                if (rows == 1) o[d] = sum / (float)block;
                else {
                    o[d] = hi;
                    o[DI + d] = lo;
                }
            }
        }
    return 0;
}
