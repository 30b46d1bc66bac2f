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

#define VW 16
#define G 4 /* key blocks scored together */
typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t))));

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
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
    for (int shift = 56; shift >= 0 && n > 1; shift -= 8) {
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
static inline uint32_t above(vf score, float floor) {
    uint32_t bits = 0;
    for (int x = 0; x < VW; x++) bits |= (uint32_t)(score[x] > floor) << x;
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
        vf score[G];
        for (int g = 0; g < G; g++) score[g] = (vf){0};
        const int64_t low = top - G + 1 < 0 ? 0 : top - G + 1; /* blocks low..top */
        for (int64_t j = 0; j < HI; j++) {
            vf acc[G];
            for (int g = 0; g < G; g++) acc[g] = (vf){0};
            for (int64_t d = 0; d < DI; d++) {
                const float qd = qs[j * DI + d];
                for (int g = 0; g < G; g++) /* block top - g, or a repeat of `low` past the row start */
                    acc[g] += qd * load(kb + ((top - g < low ? low : top - g) * DI + d) * VW);
            }
            const float wj = w ? w[j] : 1.0f;
            for (int g = 0; g < G; g++) {
                vf zero = {0};
                score[g] += wj * (vf)((vi)acc[g] & (acc[g] > zero)); /* relu */
            }
        }
        for (int64_t blk = top; blk >= low; blk--) {
            const vf sv = score[top - blk];
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
                const float v = s > recent ? INFINITY : sv[x];
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

/* ---- The candidate stage (see candidates.py): the same scores, on a query's candidates only.
 *
 * A query at pos scores the summaries of the blocks before its local window, keeps the best
 * `nkeep` blocks, then scores exactly the keys of those blocks, of the local window L..pos and its
 * seeds (int32 [R, S], -1 padded; those inside a kept block or the window are skipped, being
 * there already). Key scores are computed lane by lane as one_row computes them, so a key's score
 * is bit for bit the exact kernel's; the top-k of the candidates is taken by radix select in the
 * same total order (score desc, position desc). Summaries: sb [B, ceil(nblk / VW), rows, DI, VW]
 * (rows 1: mean key; rows 2: per-channel max then min).
 */

/* Index scores of the VW keys of one key block (kblk [DI, VW]), as one_row's lanes. */
static inline vf key_scores(const float *qs, const float *kblk, const float *w, int64_t HI,
                            int64_t DI) {
    vf score = {0};
    for (int64_t j = 0; j < HI; j++) {
        vf acc = {0};
        for (int64_t d = 0; d < DI; d++) acc += qs[j * DI + d] * load(kblk + d * VW);
        const float wj = w ? w[j] : 1.0f;
        vf zero = {0};
        score += wj * (vf)((vi)acc & (acc > zero));
    }
    return score;
}

/* Scores (mean) or upper bounds (max) of VW blocks from their summaries (sblk [rows, DI, VW]). */
static inline vf summary_scores(const float *qs, const float *sblk, const float *w, int64_t HI,
                                int64_t DI, int rows) {
    if (rows == 1) return key_scores(qs, sblk, w, HI, DI);
    vf score = {0}, zero = {0};
    const float *top = sblk, *bottom = sblk + DI * VW;
    for (int64_t j = 0; j < HI; j++) {
        const float wj = w ? w[j] : 1.0f;
        vf acc = {0};
        for (int64_t d = 0; d < DI; d++) { /* q . k is largest at max where q > 0, min where q < 0 */
            const float qd = qs[j * DI + d];
            const float *row = (qd >= 0.0f) == (wj >= 0.0f) ? top : bottom;
            acc += qd * load(row + d * VW);
        }
        score += wj * (vf)((vi)acc & (acc > zero));
    }
    return score;
}

/* Move the k largest of x[0..n) into x[0..k) (any order); returns min(n, k). A running floor lets
 * only keys above the k-th so far into the buffer, compacted by radix select when it holds 4k:
 * one comparison per key where the exact sort of n would cost several passes. tmp: 4k entries. */
static int64_t select_top(int64_t *x, int64_t n, int64_t k, int64_t *tmp) {
    if (n <= k) return n;
    int64_t floor = x[0], m = k, kth;
    for (int64_t i = 1; i < k; i++) floor = x[i] < floor ? x[i] : floor;
    for (int64_t i = k; i < n; i++) {
        const int64_t y = x[i];
        if (y <= floor) continue;
        x[m++] = y; /* m <= i: in place */
        if (m == 4 * k) {
            m = compact(x, m, k, tmp, &kth);
            floor = kth;
        }
    }
    return m > k ? compact(x, m, k, tmp, &kth) : m;
}

static int cmp_desc(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x < y) - (x > y);
}

static void staged_row(const float *q, const float *kb, const float *sb, const float *w,
                       const int32_t *seeds, int64_t S, int64_t HI, int64_t DI, int64_t pos,
                       int64_t topk, float scale, int64_t keep_recent, int64_t block,
                       int64_t nkeep, int64_t local, int rows, int64_t *out, int64_t *cand,
                       int64_t *tmp, int64_t *bkeys, unsigned char *kept) {
    float qs[HI * DI];
    for (int64_t i = 0; i < HI * DI; i++) qs[i] = q[i] * scale;
    const int64_t L = (pos + 1 - local > 0 ? (pos + 1 - local) / block : 0) * block;
    const int64_t nb = L / block, per = block / VW; /* nb > nkeep: the caller checked */
    for (int64_t g = 0; g * VW < nb; g++) {
        const vf s = summary_scores(qs, sb + g * rows * DI * VW, w, HI, DI, rows);
        for (int x = 0; x < VW && g * VW + x < nb; x++)
            bkeys[g * VW + x] = order_key(s[x]) * ((int64_t)1 << 32) + g * VW + x;
    }
    const int64_t chosen = select_top(bkeys, nb, nkeep, tmp);
    const int64_t recent = keep_recent > 0 ? pos - keep_recent : INT64_MAX;
    int64_t n = 0;
#define TAKE(s, v) cand[n++] = order_key((s) > recent ? INFINITY : (v)) * ((int64_t)1 << 32) + (s)
    for (int64_t c = 0; c < chosen; c++) {
        const int64_t b = bkeys[c] & 0xFFFFFFFF;
        kept[b] = 1;
        for (int64_t i = 0; i < per; i++) {
            const int64_t v0 = b * per + i;
            const vf s = key_scores(qs, kb + v0 * DI * VW, w, HI, DI);
            for (int x = 0; x < VW; x++) TAKE(v0 * VW + x, s[x]);
        }
    }
    for (int64_t v0 = L / VW; v0 * VW <= pos; v0++) {
        const vf s = key_scores(qs, kb + v0 * DI * VW, w, HI, DI);
        for (int x = 0; x < VW && v0 * VW + x <= pos; x++) TAKE(v0 * VW + x, s[x]);
    }
    for (int64_t i = 0; i < S; i++) {
        const int64_t s = seeds[i];
        if (s < 0 || s >= L || kept[s / block]) continue;
        const vf v = key_scores(qs, kb + (s / VW) * DI * VW, w, HI, DI);
        TAKE(s, v[s % VW]);
    }
#undef TAKE
    for (int64_t c = 0; c < chosen; c++) kept[bkeys[c] & 0xFFFFFFFF] = 0;
    n = select_top(cand, n, topk, tmp);
    for (int64_t i = 0; i < n; i++) cand[i] &= 0xFFFFFFFF;
    qsort(cand, (size_t)n, sizeof *cand, cmp_desc);
    for (int64_t i = 0; i < n; i++) out[i] = cand[n - 1 - i];
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
    const int64_t most = nkeep * block + local + block + S; /* candidates of one query, at most */
    int64_t room = most > nblk ? most : nblk; /* scratch of a selection from either list */
    room = room > 4 * topk ? room : 4 * topk;
    room = room > 4 * nkeep ? room : 4 * nkeep;
    const int64_t width = 2 * room + nblk + 1;
    int64_t *pool = malloc((size_t)threads * (size_t)width * sizeof *pool);
    unsigned char *marks = calloc((size_t)threads * (size_t)(nblk + 1), 1);
    if (!pool || !marks) {
        free(pool);
        free(marks);
        return -1;
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 8)
    for (int64_t i = 0; i < B * Tq; i++) {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
#else
        const int t = 0;
#endif
        int64_t *buf = pool + (size_t)t * (size_t)width;
        const int64_t r = B * Tq - 1 - i, b = r / Tq, pos = offset + r % Tq;
        staged_row(q + r * HI * DI, kb + b * nkb * DI * VW, sb + b * nsb * rows * DI * VW,
                   w ? w + r * HI : NULL, seeds ? seeds + r * S : NULL, seeds ? S : 0, HI, DI,
                   pos, topk, scale, keep_recent, block, nkeep, local, rows, out + r * topk, buf,
                   buf + room, buf + 2 * room, marks + (size_t)t * (size_t)(nblk + 1));
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
