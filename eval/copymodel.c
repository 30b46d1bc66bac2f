/* The copy-model reference of the evaluation (see copymodel.py, whose reference_nll this follows
 * operation for operation: the two agree to the last bit when built with -ffp-contract=off).
 *
 * Experts per position t: M Markov chains (orders[m]; counts[k] holds the order-k counts [4^k, 4],
 * k = 0..kmax, a position with fewer clean bases before it using the longest clean context) and,
 * for each seed length s_j and strand (forward, reverse complement), one copy model that predicts
 * the base after an earlier occurrence of the last s_j bases and follows that occurrence along its
 * diagonal until more than max_miss of its last 16 predictions missed (substitution tolerant). A
 * copy model's distribution puts p on its predicted base and (1 - p) / 3 on the others, with p
 * learned from its hits per state (run of hits, recent misses). The mixture is geometric: log p(y)
 * = sum_i w_i log q_i(y) - log Z, with a weight set per mixer context (the longest run of any active
 * copy model) and one step of gradient ascent on log p(x_t) after every base. A chain enters as
 * log(n(c, y) + alpha): its normaliser is the same for every y, so it cancels in the mixture and in
 * the gradient. Inactive copy models are uniform, which a geometric mixture ignores too.
 * weights [N_CTX, M + 2S] and conf [2S, N_CONF, 2] (hits, predictions) are updated in place; out
 * [n] gets -log p(x_t), NaN where x_t is not a base.
 */
#include <math.h>
#include <stdint.h>

#define N_CTX 7
#define N_CONF 24
#define MAX_EXPERTS 64
#define MAX_CHAINS 16
#define LOG_TABLE 65536
#define BLOCK 2048 /* copymodel.py: BLOCK */
#define AHEAD 12

static double log_table[LOG_TABLE];
static double log_table_alpha = -1.0;

/* log(c + alpha): a table for the small counts that most contexts have */
static inline double log_count(int64_t c, double alpha) {
    return c < LOG_TABLE ? log_table[c] : log((double)c + alpha);
}

static inline int64_t run_bucket(int64_t run) {
    if (run < 2) return run;
    if (run < 4) return 2;
    if (run < 8) return 3;
    if (run < 16) return 4;
    return 5;
}

static inline uint64_t mix(uint64_t x) { return (x * 0x9E3779B97F4A7C15ull) >> 20; }

typedef struct { /* one cache line holds a key and its position */
    uint64_t key;
    int64_t last; /* the end of the k-mer's latest occurrence; -1: an empty slot */
} entry_t;

typedef struct {
    entry_t *slots;
    int64_t mask;
} table_t;

static inline int64_t find(const table_t *t, uint64_t code) {
    int64_t h = (int64_t)(mix(code) & (uint64_t)t->mask);
    while (t->slots[h].last >= 0 && t->slots[h].key != code) h = (h + 1) & t->mask;
    return h;
}

/* The seed tables' slots for a window of n bases: a power of two, at most 2/3 full. */
int64_t megabase_copy_slots(int64_t n) {
    int64_t size = 1;
    while (size < n + n / 2 + 2) size <<= 1;
    return size;
}

/* slots: 2 * S * megabase_copy_slots(n) words; terms: BLOCK * M * 4 (the caller's, reused across
 * windows, so that no window pays for fresh pages). */
int megabase_copy_score(const uint8_t *tok, int64_t n, const uint64_t *counts, int64_t kmax,
                        const int64_t *orders, int64_t M, double alpha, const int64_t *seeds,
                        int64_t S, int64_t max_miss, double lr, double *weights, double *conf,
                        double *out, int64_t *stats, uint64_t *slots, double *terms) {
    const int64_t E = 2 * S, W = M + E;
    if (E > MAX_EXPERTS || M > MAX_CHAINS) return -2;
    if (log_table_alpha != alpha) {
        for (int64_t c = 0; c < LOG_TABLE; c++) log_table[c] = log((double)c + alpha);
        log_table_alpha = alpha;
    }
    /* the chains' terms of a block of positions are gathered before the block is mixed: the loads
     * into the large tables of high orders then overlap instead of waiting one by one */
    uint64_t context = 0; /* the kmax bases before the gathered position, the newest most significant */
    int64_t gclean = 0, pclean = 0;
    uint64_t pcontext = 0;
    for (int64_t u = 0; u < AHEAD - 1 && u < n; u++) {
        if (tok[u] > 3) { pclean = 0; continue; }
        if (kmax) pcontext = (pcontext >> 2) | ((uint64_t)tok[u] << (2 * (kmax - 1)));
        pclean++;
    }
    const int64_t size = megabase_copy_slots(n);
    table_t tables[MAX_EXPERTS / 2];
    for (int64_t j = 0; j < S; j++) {
        tables[j].slots = (entry_t *)slots + j * size;
        tables[j].mask = size - 1;
        for (int64_t i = 0; i < size; i++) tables[j].slots[i].last = -1;
    }
    uint64_t fcode[MAX_EXPERTS / 2] = {0}, rcode[MAX_EXPERTS / 2] = {0}, cmask[MAX_EXPERTS / 2];
    for (int64_t j = 0; j < S; j++) cmask[j] = seeds[j] == 32 ? ~0ull : ((1ull << (2 * seeds[j])) - 1ull);
    /* the codes AHEAD positions on, whose seed-table slots are fetched early: the lookups of
     * one position wait on the mixer's update before them and cannot overlap by themselves */
    uint64_t fahead[MAX_EXPERTS / 2] = {0}, rahead[MAX_EXPERTS / 2] = {0};
    for (int64_t u = 0; u < AHEAD - 1 && u < n; u++)
        for (int64_t j = 0; j < S; j++) {
            const uint64_t x = tok[u] & 3;
            fahead[j] = ((fahead[j] << 2) | x) & cmask[j];
            rahead[j] = (rahead[j] >> 2) | ((3 - x) << (2 * (seeds[j] - 1)));
        }
    int64_t active[MAX_EXPERTS] = {0}, ptr[MAX_EXPERTS], run[MAX_EXPERTS], hist[MAX_EXPERTS];
    int64_t clean = 0;
    double lq[MAX_EXPERTS][4], z[4], p[4];
    int64_t pred[MAX_EXPERTS], state[MAX_EXPERTS];

    for (int64_t t = 0; t < n; t++) {
        if (t % BLOCK == 0) {
            const int64_t stop = t + BLOCK < n ? t + BLOCK : n;
            for (int64_t u = t; u < stop; u++) {
                if (u + AHEAD < n) { /* the count rows AHEAD positions on: misses overlap */
                    const uint8_t x = tok[u + AHEAD - 1];
                    pclean = x > 3 ? 0 : pclean + 1;
                    if (kmax && x <= 3) pcontext = (pcontext >> 2) | ((uint64_t)x << (2 * (kmax - 1)));
                    for (int64_t m = 0; m < M; m++) {
                        const int64_t k = pclean < orders[m] ? pclean : orders[m];
                        __builtin_prefetch((const int64_t *)(uintptr_t)counts[k] +
                                           (pcontext >> (2 * (kmax - k))) * 4);
                    }
                }
                double *row = terms + (u - t) * M * 4;
                for (int64_t m = 0; m < M; m++) {
                    const int64_t k = gclean < orders[m] ? gclean : orders[m];
                    const int64_t *c = (const int64_t *)(uintptr_t)counts[k] +
                                       (context >> (2 * (kmax - k))) * 4;
                    for (int64_t y = 0; y < 4; y++) row[m * 4 + y] = log_count(c[y], alpha);
                }
                if (tok[u] > 3) {
                    gclean = 0;
                    continue;
                }
                if (kmax) context = (context >> 2) | ((uint64_t)tok[u] << (2 * (kmax - 1)));
                gclean++;
            }
        }
        const double *lm = terms + (t % BLOCK) * M * 4;
        if (t + AHEAD - 1 < n) {
            const uint64_t x = tok[t + AHEAD - 1] & 3; /* an N only makes a wasted fetch */
            for (int64_t j = 0; j < S; j++) {
                fahead[j] = ((fahead[j] << 2) | x) & cmask[j];
                rahead[j] = (rahead[j] >> 2) | ((3 - x) << (2 * (seeds[j] - 1)));
                const int64_t hf = (int64_t)(mix(fahead[j]) & (uint64_t)tables[j].mask);
                const int64_t hr = (int64_t)(mix(rahead[j]) & (uint64_t)tables[j].mask);
                __builtin_prefetch(&tables[j].slots[hf], 1);
                __builtin_prefetch(&tables[j].slots[hr]);
            }
        }
        /* per strand, the shortest seed length found nowhere earlier: a longer k-mer ending at
         * t - 1 holds it, so it cannot have occurred either, and is not looked up */
        int64_t unseen[2] = {INT64_MAX, INT64_MAX};
        for (int64_t e = 0; e < E; e++) {
            const int64_t j = e / 2;
            if (active[e] || clean < seeds[j] || seeds[j] > unseen[e % 2]) continue;
            const uint64_t code = (e % 2 == 0) ? fcode[j] : rcode[j];
            const int64_t end = tables[j].slots[find(&tables[j], code)].last;
            if (end < 0) {
                if (seeds[j] < unseen[e % 2]) unseen[e % 2] = seeds[j];
                continue;
            }
            const int64_t at = (e % 2 == 0) ? end + 1 : end - seeds[j];
            if (at < 0 || tok[at] > 3) continue;
            active[e] = 1;
            ptr[e] = at;
            run[e] = 0;
            hist[e] = 0;
            stats[0]++;
        }
        for (int64_t j = 0; j < S; j++)
            if (clean >= seeds[j]) {
                entry_t *slot = &tables[j].slots[find(&tables[j], fcode[j])];
                slot->key = fcode[j];
                slot->last = t - 1;
            }
        const int64_t x = tok[t];
        if (x > 3) {
            out[t] = NAN;
            for (int64_t e = 0; e < E; e++) active[e] = 0;
            clean = 0;
            continue;
        }
        int64_t ctx = 0;
        for (int64_t e = 0; e < E; e++) {
            if (active[e] && tok[ptr[e]] > 3) active[e] = 0;
            if (!active[e]) continue;
            const int64_t b = 1 + run_bucket(run[e]);
            if (b > ctx) ctx = b;
        }
        double *w = weights + ctx * W;
        for (int64_t y = 0; y < 4; y++) {
            double acc = 0.0;
            for (int64_t m = 0; m < M; m++) acc += w[m] * lm[m * 4 + y];
            z[y] = acc;
        }
        for (int64_t e = 0; e < E; e++) {
            if (!active[e]) continue;
            pred[e] = (e % 2 == 0) ? tok[ptr[e]] : 3 - tok[ptr[e]];
            const int64_t miss = __builtin_popcountll((uint64_t)hist[e]);
            state[e] = run_bucket(run[e]) * 4 + (miss < 3 ? miss : 3);
            const double *c = conf + (e * N_CONF + state[e]) * 2;
            const double ph = c[0] / c[1];
            const double hit = log(ph), other = log((1.0 - ph) / 3.0);
            for (int64_t y = 0; y < 4; y++) {
                lq[e][y] = y == pred[e] ? hit : other;
                z[y] += w[M + e] * lq[e][y];
            }
        }
        double top = z[0];
        for (int64_t y = 1; y < 4; y++)
            if (z[y] > top) top = z[y];
        double sum = 0.0;
        for (int64_t y = 0; y < 4; y++) {
            p[y] = z[y] == top ? 1.0 : exp(z[y] - top); /* exp(0) is 1 exactly */
            sum += p[y];
        }
        for (int64_t y = 0; y < 4; y++) p[y] = p[y] / sum;
        out[t] = -(z[x] - top - log(sum));
        for (int64_t m = 0; m < M; m++) {
            double expect = 0.0;
            for (int64_t y = 0; y < 4; y++) expect += p[y] * lm[m * 4 + y];
            w[m] += lr * (lm[m * 4 + x] - expect);
        }
        for (int64_t e = 0; e < E; e++) {
            if (!active[e]) continue;
            double expect = 0.0;
            for (int64_t y = 0; y < 4; y++) expect += p[y] * lq[e][y];
            w[M + e] += lr * (lq[e][x] - expect);
            const int64_t good = pred[e] == x;
            double *c = conf + (e * N_CONF + state[e]) * 2;
            c[0] += (double)good;
            c[1] += 1.0;
            stats[1]++;
            stats[2] += good;
            hist[e] = ((hist[e] << 1) | (1 - good)) & 0xFFFF;
            run[e] = good ? run[e] + 1 : 0;
            ptr[e] += (e % 2 == 0) ? 1 : -1;
            if (__builtin_popcountll((uint64_t)hist[e]) > max_miss || ptr[e] < 0) active[e] = 0;
        }
        for (int64_t j = 0; j < S; j++) {
            fcode[j] = ((fcode[j] << 2) | (uint64_t)x) & cmask[j];
            rcode[j] = (rcode[j] >> 2) | ((uint64_t)(3 - x) << (2 * (seeds[j] - 1)));
        }
        clean++;
    }
    return 0;
}
