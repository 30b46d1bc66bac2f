/* Seed candidates of the DSA candidate stage (see seeds.py, whose reference this follows).
 *
 * For each batch row: codes of the k-mers ending at every position (2 bits per base, first base
 * most significant; invalid where the k bases hold a token that is not A/C/G/T), and, through one
 * hash table filled in position order, prev[p] (the last earlier position with the same k-mer) and
 * rc_last[p] (the last earlier position whose k-mer is the reverse complement of p's). A query t
 * then follows, for d = 0..carry and u = t - d, up to cap earlier occurrences e of u's k-mer (key
 * e + 1 + d) and of its reverse complement (key e - k - d), newest first; keys inside the local
 * window (>= L(t)) and repeats are skipped; at most smax are kept. out [B, Tq, smax] int32, -1
 * padded; returns the largest count of any query through *most.
 */
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline uint64_t mix(uint32_t x) { /* a multiplicative hash of a k-mer code */
    return ((uint64_t)x * 0x9E3779B97F4A7C15ull) >> 17;
}

/* prev / rc_last of positions 0..Tk-1 of one sequence; -1 if none. 0 on success. */
static int chains(const int64_t *tok, int64_t Tk, int64_t k, int32_t *prev, int32_t *rc_last,
                  uint8_t *valid) {
    int64_t size = 1;
    while (size < 2 * Tk + 2) size <<= 1;
    uint32_t *keys = malloc((size_t)size * sizeof *keys);
    int32_t *last = malloc((size_t)size * sizeof *last);
    if (!keys || !last) {
        free(keys);
        free(last);
        return -1;
    }
    for (int64_t i = 0; i < size; i++) last[i] = -1;
    const uint32_t mask = k == 16 ? 0xFFFFFFFFu : ((1u << (2 * k)) - 1u);
    uint32_t code = 0, rc = 0;
    int64_t run = 0; /* clean bases ending here */
    for (int64_t p = 0; p < Tk; p++) {
        const int64_t x = tok[p];
        prev[p] = rc_last[p] = -1;
        if (x < 0 || x > 3) {
            run = 0;
            valid[p] = 0;
            continue;
        }
        code = ((code << 2) | (uint32_t)x) & mask;
        rc = (rc >> 2) | ((uint32_t)(3 - x) << (2 * (k - 1)));
        run++;
        valid[p] = run >= k;
        if (!valid[p]) continue;
        int64_t h = (int64_t)(mix(rc) & (uint64_t)(size - 1));
        while (last[h] >= 0 && keys[h] != rc) h = (h + 1) & (size - 1);
        rc_last[p] = last[h];
        h = (int64_t)(mix(code) & (uint64_t)(size - 1));
        while (last[h] >= 0 && keys[h] != code) h = (h + 1) & (size - 1);
        prev[p] = last[h];
        keys[h] = code;
        last[h] = (int32_t)p;
    }
    free(keys);
    free(last);
    return 0;
}

static inline int add(int32_t *row, int64_t *n, int64_t key, int64_t smax) {
    for (int64_t i = 0; i < *n; i++)
        if (row[i] == key) return 0;
    row[(*n)++] = (int32_t)key;
    return *n == smax;
}

int megabase_dsa_seeds(const int64_t *tok, int64_t B, int64_t Tk, int64_t offset, int64_t k,
                       int64_t cap, int64_t carry, int64_t block, int64_t local, int64_t smax,
                       int32_t *out, int64_t *most, int threads) {
    const int64_t Tq = Tk - offset;
    int32_t *prev = malloc((size_t)Tk * 2 * sizeof *prev + 1);
    uint8_t *valid = malloc((size_t)Tk + 1);
    if (!prev || !valid) {
        free(prev);
        free(valid);
        return -1;
    }
    int32_t *rc_last = prev + Tk;
    int64_t largest = 0;
    if (threads < 1) threads = 1;
    for (int64_t b = 0; b < B; b++) {
        if (chains(tok + b * Tk, Tk, k, prev, rc_last, valid) != 0) {
            free(prev);
            free(valid);
            return -1;
        }
#pragma omp parallel for num_threads(threads) schedule(static) reduction(max : largest)
        for (int64_t i = 0; i < Tq; i++) {
            const int64_t t = offset + i;
            const int64_t L = (t + 1 - local > 0 ? (t + 1 - local) / block : 0) * block;
            int32_t *row = out + (b * Tq + i) * smax;
            int64_t n = 0;
            int full = smax == 0;
            for (int64_t d = 0; d <= carry && !full && t - d >= 0; d++) {
                const int64_t u = t - d;
                if (!valid[u]) continue;
                int64_t e = prev[u];
                for (int64_t c = 0; c < cap && e >= 0 && !full; c++, e = prev[e])
                    if (e + 1 + d < L) full = add(row, &n, e + 1 + d, smax);
                e = rc_last[u];
                for (int64_t c = 0; c < cap && e >= 0 && !full; c++, e = prev[e])
                    if (e - k - d >= 0 && e - k - d < L) full = add(row, &n, e - k - d, smax);
            }
            for (int64_t j = n; j < smax; j++) row[j] = -1;
            largest = n > largest ? n : largest;
        }
    }
    free(prev);
    free(valid);
    *most = largest;
    return 0;
}
