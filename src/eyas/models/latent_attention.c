/* Decode and verify attention over MLA latents on one thread, over latents kept in float32 or bfloat16: the kernel
   `eyas.models.latent_kernel` builds.

   Per batch row b: R query rows (a sequence's verify positions x heads) over S context positions whose one latent
   of D numbers is the key (all of it) and the value (its first DV). scores = q . k * scale + bias (bias 0 or -inf:
   the causal mask), softmax over S, out = sum of p * v.

   torch's fused SDPA multiplies [a few query rows x D] by [D x 512 positions] blocks, packing every block of the
   latents for a matrix product whose other side has only a few rows. Here the context is read once: BLOCK
   positions at a time, their scores and then their weighted sum while the latents are in cache, the softmax kept
   running (each row's maximum and total so far, the sums rescaled when the maximum rises). Four query rows meet four
   latents at a time, all sixteen dot products in registers, summed across their lanes together by one tree of
   shuffles; the next four latents are prefetched meanwhile (on AVX2, with half the registers, four rows meet two
   latents at a time: NARROW below). Each row's result is computed by the same operations in
   the same order whatever the other rows are (the blocks start at multiples of BLOCK; a missing row of a group of
   four computes a copy of a present one, a missing position a copy of the last; a position a row does not see adds
   a weight of exactly 0): decode and verify give the same numbers.

   Arithmetic is float32 (every multiply-add fused: the vector ones by -ffp-contract=fast, the scalar ones by
   fmaf). Over bfloat16 latents on a CPU with AVX512-BF16 the scores are bfloat16 dot products (the queries rounded
   to bfloat16, which a bfloat16 model's queries already are; each product exact, added in float32), half the
   instructions of widening the latents; the weighted sums stay float32. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define NARROW 1  /* AVX2's 16 registers of 8 floats: the scores and the sums have their own blocking below */
#else
#define NARROW 0
#endif
#if defined(__AVX512BF16__) || defined(__AMX_TILE__) || NARROW
#include <immintrin.h>
#endif

#define LANES 16      /* one AVX-512 register of floats: the compiler vectorises each 16-wide operation */
#define ROW_BLOCK 8   /* query rows that take the context together */
#define GROUP 4       /* query rows, and positions, scored together: 16 dot products in registers */
#define BLOCK 32      /* positions scored, then summed, while their latents are in cache */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef uint32_t uvec __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t hvec __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint16_t hvec2 __attribute__((vector_size(2 * LANES * sizeof(uint16_t))));

/* exp(x) for x <= 0 to about 1 ulp, written so the compiler vectorises it (the C library's expf is a call per
   element): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor polynomial, 2^n from the exponent bits. */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) return 0.0f;
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } two_n = { .i = ((int32_t)n + 127) << 23 };
    return p * two_n.f;
}

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* LANES numbers of a latent from element i on: float32, or bfloat16 (the high half of a float32's bits). The
   `half` argument is a constant at every call, so each kernel below is compiled for one storage type. */
static inline vec load_latent(const void *latent, int64_t i, int half) {
    if (!half) return load((const float *)latent + i);
    hvec h;
    memcpy(&h, (const uint16_t *)latent + i, sizeof h);
    uvec u = __builtin_convertvector(h, uvec) << 16;
    vec v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline float latent_at(const void *latent, int64_t i, int half) {
    if (!half) return ((const float *)latent)[i];
    uint32_t u = (uint32_t)((const uint16_t *)latent)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The lanes of each of a[0..15] summed, into lane j of the result for a[j]: every sum by the same tree
   ((x0 + x8) + (x4 + x12)) + ... whatever its j. */
static inline vec lanes_sums(const vec a[16]) {
    vec t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = __builtin_shufflevector(a[i], a[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(a[i], a[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        u[i] = __builtin_shufflevector(t[i], t[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
             + __builtin_shufflevector(t[i], t[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        w[i] = __builtin_shufflevector(u[i], u[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
             + __builtin_shufflevector(u[i], u[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    return __builtin_shufflevector(w[0], w[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
         + __builtin_shufflevector(w[0], w[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

/* A float32 rounded to the nearest bfloat16 (ties to even), as its 16 high bits. */
static inline uint16_t to_bfloat16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays a NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512BF16__)
/* scores_4x4 over bfloat16 queries and latents: each instruction multiplies 32 pairs and adds each two neighbours'
   products into one float32 lane (AVX512-BF16), half the instructions of widening the latents to float32. */
static inline void scores_4x4_bf16(const uint16_t *const q[GROUP], const void *const latent[GROUP], int64_t D,
                                   int64_t ahead, float dots[GROUP * GROUP]) {
    __m512 acc[GROUP * GROUP];
    for (int i = 0; i < GROUP * GROUP; i++) acc[i] = _mm512_setzero_ps();
    int64_t wide = D - D % (2 * LANES);
    for (int64_t d = 0; d < wide; d += 2 * LANES) {
        __m512bh k[GROUP];
        for (int j = 0; j < GROUP; j++) {
            k[j] = (__m512bh)_mm512_loadu_si512((const uint16_t *)latent[j] + d);
            __builtin_prefetch((const char *)latent[j] + ahead + 2 * d, 0, 2);
        }
        for (int r = 0; r < GROUP; r++) {
            __m512bh qr = (__m512bh)_mm512_loadu_si512(q[r] + d);
            for (int j = 0; j < GROUP; j++) acc[r * GROUP + j] = _mm512_dpbf16_ps(acc[r * GROUP + j], qr, k[j]);
        }
    }
    vec a[GROUP * GROUP];
    memcpy(a, acc, sizeof a);
    vec sums = lanes_sums(a);
    memcpy(dots, &sums, sizeof sums);
    for (int r = 0; r < GROUP; r++)
        for (int j = 0; j < GROUP; j++)
            for (int64_t d = wide; d < D; d++)
                dots[r * GROUP + j] = fmaf(latent_at(q[r], d, 1), latent_at(latent[j], d, 1), dots[r * GROUP + j]);
}
#endif

/* dots[r * GROUP + j] = q[r] . latent[j] for four query rows and four latents of D numbers; the bytes `ahead` of
   each latent are prefetched (into the second-level cache) as it is read. */
static inline void scores_4x4(const float *const q[GROUP], const void *const latent[GROUP], int64_t D, int half,
                              int64_t ahead, float dots[GROUP * GROUP]) {
    vec acc[GROUP * GROUP] = {0};
    int64_t wide = D - D % LANES;
    for (int64_t d = 0; d < wide; d += LANES) {
        vec k[GROUP];
        for (int j = 0; j < GROUP; j++) {
            k[j] = load_latent(latent[j], d, half);
            if (!half || d % (2 * LANES) == 0)  /* one 64-byte line a time */
                __builtin_prefetch((const char *)latent[j] + ahead + (half ? 2 : 4) * d, 0, 2);
        }
        for (int r = 0; r < GROUP; r++) {
            vec qr = load(q[r] + d);
            for (int j = 0; j < GROUP; j++) acc[r * GROUP + j] += qr * k[j];
        }
    }
    vec sums = lanes_sums(acc);
    memcpy(dots, &sums, sizeof sums);
    for (int r = 0; r < GROUP; r++)
        for (int j = 0; j < GROUP; j++)
            for (int64_t d = wide; d < D; d++)
                dots[r * GROUP + j] = fmaf(q[r][d], latent_at(latent[j], d, half), dots[r * GROUP + j]);
}

/* 2 * LANES bfloat16 numbers from element i on as float32, in two registers: each 128-bit lane of the first holds
   the lane's first four numbers, of the second its last four (one interleave with zeros each, no shift). */
static inline void load_latent_pair(const void *latent, int64_t i, vec *lo, vec *hi) {
    hvec2 x, zero = {0};
    memcpy(&x, (const uint16_t *)latent + i, sizeof x);
    hvec2 a = __builtin_shufflevector(zero, x, 0, 32, 1, 33, 2, 34, 3, 35, 8, 40, 9, 41, 10, 42, 11, 43,
                                      16, 48, 17, 49, 18, 50, 19, 51, 24, 56, 25, 57, 26, 58, 27, 59);
    hvec2 b = __builtin_shufflevector(zero, x, 4, 36, 5, 37, 6, 38, 7, 39, 12, 44, 13, 45, 14, 46, 15, 47,
                                      20, 52, 21, 53, 22, 54, 23, 55, 28, 60, 29, 61, 30, 62, 31, 63);
    memcpy(lo, &a, sizeof *lo);
    memcpy(hi, &b, sizeof *hi);
}

/* The 2 * LANES numbers load_latent_pair's registers hold, at out in their order. */
static inline void unscramble(float *out) {
    vec lo = load(out), hi = load(out + LANES);
    vec a = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    vec b = __builtin_shufflevector(lo, hi, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    memcpy(out, &a, sizeof a);
    memcpy(out + LANES, &b, sizeof b);
}

/* values_4's columns from `first` to DV one by one, for the widths its vectors do not cover. */
static inline void values_one_by_one(const float *const p[GROUP], const float factor[GROUP], const char *kv,
                                     int64_t stride, int64_t begin, int64_t end, int64_t first, int64_t DV, int half,
                                     float *const out[GROUP]) {
    for (int64_t d = first; d < DV; d++)
        for (int r = 0; r < GROUP; r++) {
            float acc = factor[r] * out[r][d];
            for (int64_t s = begin; s < end; s++)
                acc = fmaf(p[r][s - begin], latent_at(kv + s * stride, d, half), acc);
            out[r][d] = acc;
        }
}

/* out[r] = factor[r] * out[r] + sum over s in [begin, end) of p[r][s - begin] * (the first DV numbers of latent s),
   for four rows, 4 * LANES columns at a time in registers across the positions, then LANES at a time, then one by
   one: each column's sum is the same sequence of multiply-adds in every case. */
static inline void values_4(const float *const p[GROUP], const float factor[GROUP], const char *kv, int64_t stride,
                            int64_t begin, int64_t end, int64_t DV, int half, float *const out[GROUP]) {
    int64_t d = 0;
    for (; d + 4 * LANES <= DV; d += 4 * LANES) {
        vec acc[GROUP][4];
        for (int r = 0; r < GROUP; r++)
            for (int i = 0; i < 4; i++) acc[r][i] = factor[r] * load(out[r] + d + i * LANES);
        for (int64_t s = begin; s < end; s++) {
            const void *v = kv + s * stride;
            vec v0, v1, v2, v3;
            if (half) {  /* in load_latent_pair's order: put back in place by unscramble at the end */
                load_latent_pair(v, d, &v0, &v1);
                load_latent_pair(v, d + 2 * LANES, &v2, &v3);
            } else {
                v0 = load_latent(v, d, half), v1 = load_latent(v, d + LANES, half);
                v2 = load_latent(v, d + 2 * LANES, half), v3 = load_latent(v, d + 3 * LANES, half);
            }
            for (int r = 0; r < GROUP; r++) {
                float w = p[r][s - begin];
                acc[r][0] += w * v0;
                acc[r][1] += w * v1;
                acc[r][2] += w * v2;
                acc[r][3] += w * v3;
            }
        }
        for (int r = 0; r < GROUP; r++) memcpy(out[r] + d, acc[r], sizeof acc[r]);
    }
    for (; d + LANES <= DV; d += LANES) {
        vec acc[GROUP];
        for (int r = 0; r < GROUP; r++) acc[r] = factor[r] * load(out[r] + d);
        for (int64_t s = begin; s < end; s++) {
            vec v0 = load_latent(kv + s * stride, d, half);
            for (int r = 0; r < GROUP; r++) acc[r] += p[r][s - begin] * v0;
        }
        for (int r = 0; r < GROUP; r++) memcpy(out[r] + d, &acc[r], sizeof acc[r]);
    }
    values_one_by_one(p, factor, kv, stride, begin, end, d, DV, half, out);
}

#if NARROW
/* AVX2 has 16 registers of 8 floats: the 16 accumulators of scores_4x4 and values_4 would spill on every
   multiply-add. Here four query rows meet two latents at a time (8 accumulators, the two latents and a query row in
   registers: 6 loads for 8 multiply-adds), and the weighted sums take 16 columns of four rows at a time. Every dot
   product and every column's sum is still one fixed sequence of fused multiply-adds whatever the rows and
   positions beside it. */

/* LANES numbers of a latent from element i on as float32 (bfloat16: the high half of a float32's bits). */
static inline __m256 load_latent_8(const void *latent, int64_t i, int half) {
    if (!half) return _mm256_loadu_ps((const float *)latent + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)latent + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The 8 lanes of each of a0..a7 summed, into lane j of the result for aj, every one by the same tree
   ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)). */
static inline __m256 lanes_sums_8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                                  __m256 a7) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* acc[2r + i] += w_r * x_i for four rows' factors w0..w3 and two vectors x0, x1: the eight accumulators both blockings
   keep (inlined, they stay in registers). */
static inline void rows_times_pair(__m256 w0, __m256 w1, __m256 w2, __m256 w3, __m256 x0, __m256 x1, __m256 acc[8]) {
    acc[0] = _mm256_fmadd_ps(w0, x0, acc[0]), acc[1] = _mm256_fmadd_ps(w0, x1, acc[1]);
    acc[2] = _mm256_fmadd_ps(w1, x0, acc[2]), acc[3] = _mm256_fmadd_ps(w1, x1, acc[3]);
    acc[4] = _mm256_fmadd_ps(w2, x0, acc[4]), acc[5] = _mm256_fmadd_ps(w2, x1, acc[5]);
    acc[6] = _mm256_fmadd_ps(w3, x0, acc[6]), acc[7] = _mm256_fmadd_ps(w3, x1, acc[7]);
}

/* dots[r * GROUP + j] for the four query rows q0..q3 and the latents j and j + 1 at k0 and k1; the bytes `ahead` of
   each latent are prefetched as it is read. */
static inline void scores_4x2_narrow(const float *q0, const float *q1, const float *q2, const float *q3,
                                     const void *k0, const void *k1, int64_t D, int half, int64_t ahead, int j,
                                     float dots[GROUP * GROUP]) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    int64_t wide = D - D % 8, line = half ? 32 : 16;  /* numbers in a 64-byte line */
    for (int64_t d = 0; d < wide; d += 8) {
        __m256 x0 = load_latent_8(k0, d, half), x1 = load_latent_8(k1, d, half);
        if (d % line == 0) {
            __builtin_prefetch((const char *)k0 + ahead + (half ? 2 : 4) * d, 0, 2);
            __builtin_prefetch((const char *)k1 + ahead + (half ? 2 : 4) * d, 0, 2);
        }
        rows_times_pair(_mm256_loadu_ps(q0 + d), _mm256_loadu_ps(q1 + d), _mm256_loadu_ps(q2 + d),
                        _mm256_loadu_ps(q3 + d), x0, x1, acc);
    }
    float sums[8];
    _mm256_storeu_ps(sums, lanes_sums_8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]));
    const float *q[GROUP] = {q0, q1, q2, q3};
    for (int r = 0; r < GROUP; r++)
        for (int i = 0; i < 2; i++) {
            float dot = sums[2 * r + i];
            for (int64_t d = wide; d < D; d++) dot = fmaf(q[r][d], latent_at(i ? k1 : k0, d, half), dot);
            dots[r * GROUP + j + i] = dot;
        }
}

static inline void scores_4x4_narrow(const float *const q[GROUP], const void *const latent[GROUP], int64_t D,
                                     int half, int64_t ahead, float dots[GROUP * GROUP]) {
    scores_4x2_narrow(q[0], q[1], q[2], q[3], latent[0], latent[1], D, half, ahead, 0, dots);
    scores_4x2_narrow(q[0], q[1], q[2], q[3], latent[2], latent[3], D, half, ahead, 2, dots);
}

/* values_4 in AVX2's registers: 16 columns of the four rows at a time (8 accumulators), then 8, then one by one. */
static inline void values_4_narrow(const float *const p[GROUP], const float factor[GROUP], const char *kv,
                                   int64_t stride, int64_t begin, int64_t end, int64_t DV, int half,
                                   float *const out[GROUP]) {
    /* the weights as one pointer each, indexed by position, for the multiply-adds' loop */
    const float *p0 = p[0] - begin, *p1 = p[1] - begin, *p2 = p[2] - begin, *p3 = p[3] - begin;
    __m256 f[GROUP];
    for (int r = 0; r < GROUP; r++) f[r] = _mm256_set1_ps(factor[r]);
    int64_t d = 0;
    for (; d + 16 <= DV; d += 16) {
        __m256 acc[8];
        for (int r = 0; r < GROUP; r++)
            for (int i = 0; i < 2; i++) acc[2 * r + i] = _mm256_mul_ps(f[r], _mm256_loadu_ps(out[r] + d + 8 * i));
        for (int64_t s = begin; s < end; s++) {
            const void *v = kv + s * stride;
            rows_times_pair(_mm256_broadcast_ss(p0 + s), _mm256_broadcast_ss(p1 + s), _mm256_broadcast_ss(p2 + s),
                            _mm256_broadcast_ss(p3 + s), load_latent_8(v, d, half), load_latent_8(v, d + 8, half),
                            acc);
        }
        for (int r = 0; r < GROUP; r++)
            for (int i = 0; i < 2; i++) _mm256_storeu_ps(out[r] + d + 8 * i, acc[2 * r + i]);
    }
    for (; d + 8 <= DV; d += 8) {  /* at most once: 8 columns left */
        __m256 acc[GROUP];
        for (int r = 0; r < GROUP; r++) acc[r] = _mm256_mul_ps(f[r], _mm256_loadu_ps(out[r] + d));
        for (int64_t s = begin; s < end; s++) {
            __m256 v0 = load_latent_8(kv + s * stride, d, half);
            for (int r = 0; r < GROUP; r++) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p[r] + s - begin), v0, acc[r]);
        }
        for (int r = 0; r < GROUP; r++) _mm256_storeu_ps(out[r] + d, acc[r]);
    }
    values_one_by_one(p, factor, kv, stride, begin, end, d, DV, half, out);
}
#endif

/* One row's scores over a block of positions turned into its softmax weights against the row's running maximum
   `top`, which rises to the block's: the factor its earlier sums are rescaled by. Its running total of weights
   grows by the block's. */
static inline float block_weights(float *p, int64_t n, float *top, float *total) {
    float high = *top;
    for (int64_t i = 0; i < n; i++) high = p[i] > high ? p[i] : high;
    if (high == -INFINITY) {  /* nothing visible yet: the weights are 0 and there is nothing to rescale */
        for (int64_t i = 0; i < n; i++) p[i] = 0.0f;
        return 1.0f;
    }
    float factor = exp_nonpositive(*top - high), sum = 0.0f;
    for (int64_t i = 0; i < n; i++) p[i] = exp_nonpositive(p[i] - high);
    for (int64_t i = 0; i < n; i++) sum += p[i];
    *top = high;
    *total = *total * factor + sum;
    return factor;
}

/* One batch row's block of `rows` (<= ROW_BLOCK) query rows at qb (qh: their bfloat16 copies, scratch) over the
   latents at k (element stride `stride` bytes apart), mask rows of S, out rows at o. The positions are taken
   BLOCK at a time, at multiples of BLOCK whatever the rows, each block's latents scored and then summed while
   they are in cache: one pass over the latents, the softmax kept running (its maximum and total per row). The
   queries in float32 (qb) or, where the scores are bfloat16 dot products, in bfloat16 (qh). p: ROW_BLOCK * BLOCK
   floats of scratch, spare: DV floats. */
static inline int attend_block(const float *qb, const uint16_t *qh, const char *k, int64_t stride, const float *mask,
                               int64_t H, int64_t r0, int64_t rows, int64_t S, int64_t D, int64_t DV, float scale,
                               int half, float *p, float *spare, float *o) {
    /* the positions some row of the block sees: nothing outside them is read (a cache slot past a context may
       hold anything) */
    int64_t begin = S, end = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t s = 0; s < S; s++)
            if (mask[(r0 + r) / H * S + s] != -INFINITY) {
                begin = s < begin ? s : begin;
                end = s + 1 > end ? s + 1 : end;
            }
    if (begin >= end) return -3;
    float top[ROW_BLOCK], total[ROW_BLOCK], factor[ROW_BLOCK];
    for (int64_t r = 0; r < rows; r++) top[r] = -INFINITY, total[r] = 0.0f;
    memset(o, 0, sizeof(float) * rows * DV);
    memset(spare, 0, sizeof(float) * DV);
    for (int64_t s0 = begin - begin % BLOCK; s0 < end; s0 += BLOCK) {
        int64_t lo = s0 > begin ? s0 : begin, hi = s0 + BLOCK < end ? s0 + BLOCK : end;
        for (int64_t g = 0; g < rows; g += GROUP) {
            const float *q[GROUP];
            const uint16_t *qr[GROUP];
            for (int r = 0; r < GROUP; r++) {
                int64_t row = g + r < rows ? g + r : g;
                q[r] = qb != NULL ? qb + row * D : NULL;
                qr[r] = qh != NULL ? qh + row * D : NULL;
            }
            for (int64_t s = lo; s < hi; s += GROUP) {  /* four latents read once for the group's rows */
                const void *latent[GROUP];
                for (int j = 0; j < GROUP; j++) latent[j] = k + (s + j < hi ? s + j : hi - 1) * stride;
                float dots[GROUP * GROUP];
#if defined(__AVX512BF16__)
                if (half)
                    scores_4x4_bf16(qr, latent, D, GROUP * stride, dots);
                else
#endif
#if NARROW
                    scores_4x4_narrow(q, latent, D, half, GROUP * stride, dots);
#else
                    scores_4x4(q, latent, D, half, GROUP * stride, dots);
#endif
                for (int r = 0; r < GROUP && g + r < rows; r++)
                    for (int j = 0; j < GROUP && s + j < hi; j++) {
                        float m = mask[(r0 + g + r) / H * S + s + j];
                        p[(g + r) * BLOCK + s - lo + j] = m == -INFINITY ? -INFINITY : dots[r * GROUP + j] * scale + m;
                    }
            }
        }
        for (int64_t r = 0; r < rows; r++) factor[r] = block_weights(p + r * BLOCK, hi - lo, top + r, total + r);
        for (int64_t g = 0; g < rows; g += GROUP) {
            const float *pr[GROUP];
            float *out[GROUP], f[GROUP];
            for (int r = 0; r < GROUP; r++) {
                pr[r] = p + (g + r < rows ? g + r : g) * BLOCK;
                out[r] = g + r < rows ? o + (g + r) * DV : spare;
                f[r] = factor[g + r < rows ? g + r : g];
            }
#if NARROW
            values_4_narrow(pr, f, k, stride, lo, hi, DV, half, out);
#else
            values_4(pr, f, k, stride, lo, hi, DV, half, out);
#endif
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        if (total[r] == 0.0f) return -3;
        float inverse = 1.0f / total[r];
        if (half && !NARROW)
            for (int64_t d = 0; d < DV - DV % (4 * LANES); d += 2 * LANES) unscramble(o + r * DV + d);
        for (int64_t d = 0; d < DV; d++) o[r * DV + d] *= inverse;
    }
    return 0;
}

#if defined(__AVX512BF16__)
#define DOT_BF16 1  /* bfloat16 latents are scored by bfloat16 dot products, their queries in bfloat16 */
#else
#define DOT_BF16 0
#endif

/* n bfloat16 numbers widened to float32; n float32 numbers rounded to bfloat16 (nearest, ties to even). */
static inline void widen(const uint16_t *x, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = latent_at(x, i, 1);
}

static inline void narrow(const float *x, int64_t n, uint16_t *y) {
    for (int64_t i = 0; i < n; i++) y[i] = to_bfloat16(x[i]);
}

/* q [B, R, D] contiguous, float32 or (q_half) bfloat16; kv: latent s of batch row b at kv + (b * kv_batch_stride +
   s * kv_row_stride) elements, float32 or (half) bfloat16; bias [B, R / H, S] contiguous, query row r reading bias
   row r / H (H: a position's heads); out [B, R, DV] contiguous, float32 or (out_half) bfloat16, rounded to nearest.
   Returns 0; -1 when out of memory, -3 when a query row sees no position (latent_attention_run returns -2 first for
   shapes neither path takes: DV > D, R not a multiple of H). */
static inline int latent_attention(const void *q, int q_half, const void *kv, int64_t kv_batch_stride,
                                   int64_t kv_row_stride, const float *bias, int64_t H, int64_t B, int64_t R,
                                   int64_t S, int64_t D, int64_t DV, float scale, void *out, int out_half, int half) {
    int64_t size = half ? 2 : 4, q_size = q_half ? 2 : 4, out_size = out_half ? 2 : 4;
    int dot_bf16 = half && DOT_BF16;
    /* scratch: the block's weights, a spare output row, its queries converted, its outputs before rounding */
    float *p = malloc(sizeof(float) * (ROW_BLOCK * BLOCK + DV + ROW_BLOCK * D + ROW_BLOCK * DV));
    if (p == NULL) return -1;
    float *spare = p + ROW_BLOCK * BLOCK, *queries = spare + DV, *sums = queries + ROW_BLOCK * D;
    int code = 0;
    for (int64_t b = 0; b < B && code == 0; b++)
        for (int64_t r0 = 0; r0 < R && code == 0; r0 += ROW_BLOCK) {
            int64_t rows = R - r0 < ROW_BLOCK ? R - r0 : ROW_BLOCK;
            const char *qb = (const char *)q + (b * R + r0) * D * q_size;
            char *ob = (char *)out + (b * R + r0) * DV * out_size;
            const float *qf = NULL;
            const uint16_t *qh = NULL;
            if (dot_bf16 && q_half)
                qh = (const uint16_t *)qb;
            else if (dot_bf16)
                narrow((const float *)qb, rows * D, (uint16_t *)queries), qh = (const uint16_t *)queries;
            else if (q_half)
                widen((const uint16_t *)qb, rows * D, queries), qf = queries;
            else
                qf = (const float *)qb;
            code = attend_block(qf, qh, (const char *)kv + b * kv_batch_stride * size, kv_row_stride * size,
                                bias + b * (R / H) * S, H, r0, rows, S, D, DV, scale, half, p, spare,
                                out_half ? sums : (float *)ob);
            if (out_half && code == 0) narrow(sums, rows * DV, (uint16_t *)ob);
        }
    free(p);
    return code;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define TILES 1
#else
#define TILES 0
#endif

/* Where the CPU has AMX tiles (and Linux lets the process use them: tiles_ready), attention over bfloat16 latents runs
   on them: each tile product multiplies a 16 x 32 block of bfloat16 numbers by a 32 x 16 one, in pairs, into 16 x 16
   float32 sums, in one instruction. Per block of 16 query rows, 64 positions at a time:

     scores, transposed: the keys (16 positions x 32 numbers of their latents, read in place) times the queries (32
       numbers x the 16 rows, packed once per block as pairs), summed over the latent's width;
     softmax in float32, each position's 16 rows one vector, against each row's running maximum (the sums so far
       rescaled when it rises, as the vector path does); the weights rounded to bfloat16, as attention on
       accelerators rounds them;
     values: the weights (16 rows x 16 positions, each weight paired with a 0) times 16 positions' latents as they lie
       in memory (32 numbers each): the pairs split the product into the values' even and odd numbers, two output
       tiles, and nothing is repacked.

   A row gets the same numbers in any block of rows and over any longer context: its sums read only its own query
   and weights, the blocks of positions start at multiples of 64, and a position it does not see gets a weight of
   exactly 0 (one past the context: a latent of zeros, never a read). Every call over bfloat16 latents takes this
   path, so decode and verify agree. One sequence over 200 positions, one decode row (4 query rows): 17 us against 20
   on the vector path; a verify step's 16 rows: 21 against 73 (latent_kernel.py). */
#if TILES
#define TILE 16  /* rows of a tile; positions of a scores tile; value numbers of an output tile */

static int tiles_ready = 0;

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

static inline void configure_tiles(void) {
    tile_config config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = TILE;
    _tile_loadconfig(&config);
}

/* Where the 16 latents from position s are read as a tile: in place when all lie in [lo, hi) and the width is whole
   steps; else copied into `edge` (16 rows of DP numbers, 0 past D, and 0 for positions outside [lo, hi), whose
   weights are 0), so that nothing outside the context is read; NULL when none lies inside (nothing to compute).
   Sets the bytes between its rows. */
static inline const char *latent_tile(const char *k, int64_t stride, int64_t s, int64_t lo, int64_t hi, int64_t D,
                                      int64_t DP, uint16_t *edge, int64_t *row_bytes) {
    if (s + TILE <= lo || s >= hi) return NULL;
    if (s >= lo && s + TILE <= hi && D == DP) {
        *row_bytes = stride;
        return k + s * stride;
    }
    memset(edge, 0, TILE * DP * 2);
    for (int64_t i = s < lo ? lo - s : 0; i < TILE && s + i < hi; i++)
        memcpy(edge + i * DP, k + (s + i) * stride, D * 2);
    *row_bytes = DP * 2;
    return (const char *)edge;
}

/* 16 x 16 32-bit numbers transposed: out[j][i] = in[i][j], rows 64 bytes apart in both (pairs, then quads, then
   128-bit lanes exchanged). */
static inline void transpose_16x16(const uint32_t *in, uint32_t *out) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(in + 16 * i);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 8; i++) {
        int a = i / 4 * 8 + i % 4;
        t[i] = _mm512_shuffle_i32x4(r[a], r[a + 4], 0x88);
        t[i + 8] = _mm512_shuffle_i32x4(r[a], r[a + 4], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 4], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 4], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 8], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 8], t[i + 12], 0xdd);
    }
    for (int i = 0; i < 16; i++) _mm512_store_si512(out + 16 * i, r[i]);
}

/* exp_nonpositive for 16 numbers at once, lane by lane the same operations. */
static inline __m512 exp_nonpositive_16(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __mmask16 low = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    n = _mm512_mask_mov_ps(n, low, _mm512_setzero_ps());  /* keeps the exponent bits in range */
    __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~low, p, _mm512_castsi512_ps(two_n));
}

/* Row `row` of the mask (S numbers): the first position it sees and one past its last, in *first and *end; returns
   whether it is 0 everywhere between (the usual causal mask: its blocks inside need no mask). */
static inline int visible_run(const float *row, int64_t S, int64_t *first, int64_t *end) {
    int64_t a = S, b = 0;
    int plain = 1;
    for (int64_t s = 0; s < S; s++)
        if (row[s] != -INFINITY) {
            a = s < a ? s : a;
            b = s + 1;
        }
    for (int64_t s = a; s < b; s++) plain &= row[s] == 0.0f;
    *first = a, *end = b;
    return plain;
}

/* One batch row's block of `rows` (<= 16) query rows, packed by the caller (`packed`: the queries as the scores'
   right tiles), over the latents at k; mask rows of S (query row r reads row (r0 + r) / H); out: 16 rows of DV
   float32. The positions are taken 64 at a time, at multiples of 64 whatever the rows: their scores, then their
   weights against each row's running maximum (the sums so far rescaled when it rises, as the vector path does),
   then their weighted values while their latents are in cache. Scratch: `sums` 16 x DV rounded up to 32 floats,
   `weights` 8 tiles of 32-bit numbers, `edge` 16 latents padded to whole steps (latent_tile). */
static int attend_tiles(const uint16_t *packed, const char *k, int64_t stride, const float *mask, int64_t H,
                        int64_t r0, int64_t rows, int64_t S, int64_t D, int64_t DV, float scale, float *sums,
                        uint32_t *weights, uint16_t *edge, float *out) {
    const int64_t block = 4 * TILE, steps = (D + 31) / 32, chunks = (DV + 31) / 32;
    /* the positions some row sees (nothing outside them is read: a cache slot past a context may hold anything),
       and the positions every row sees with a bias of 0 */
    const float *bias[TILE];
    int64_t lo = S, hi = 0, all_from = 0, all_to = S;
    int plain = 1;
    for (int64_t n = 0; n < TILE; n++) {
        bias[n] = mask + (r0 + (n < rows ? n : 0)) / H * S;  /* a padding row reads the block's first */
        if (n > 0 && bias[n] == bias[n - 1]) continue;
        int64_t a, b;
        plain &= visible_run(bias[n], S, &a, &b);
        lo = a < lo ? a : lo, hi = b > hi ? b : hi;
        all_from = a > all_from ? a : all_from, all_to = b < all_to ? b : all_to;
    }
    if (lo >= hi) return -3;
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY), one = _mm512_set1_ps(1.0f);
    __m512 top = minus_inf, total = _mm512_setzero_ps();
    float scores[4 * TILE * TILE] __attribute__((aligned(64))), masks[4 * TILE * TILE] __attribute__((aligned(64)));
    uint32_t columns[4 * TILE * TILE] __attribute__((aligned(64)));
    memset(sums, 0, sizeof(float) * chunks * 2 * TILE * TILE);
    for (int64_t s0 = lo - lo % block; s0 < hi; s0 += block) {
        /* the block's four position tiles: where each is read from (NULL: no position inside) */
        const char *at[4];
        int64_t row_bytes[4];
        for (int j = 0; j < 4; j++)
            at[j] = latent_tile(k, stride, s0 + j * TILE, lo, hi, D, steps * 32, edge + j * TILE * steps * 32,
                                row_bytes + j);
        /* scores[s][n] = latent s0 + s . query n, each position tile over every step (a tile's number is part of
           its instruction: each tile is written out) */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t = 0; t < steps; t++) {
            _tile_loadd(6, packed + t * TILE * 2 * TILE, 4 * TILE);
            if (at[0]) {
                _tile_loadd(4, at[0] + t * 64, row_bytes[0]);
                _tile_dpbf16ps(0, 4, 6);
            }
            if (at[1]) {
                _tile_loadd(5, at[1] + t * 64, row_bytes[1]);
                _tile_dpbf16ps(1, 5, 6);
            }
            if (at[2]) {
                _tile_loadd(4, at[2] + t * 64, row_bytes[2]);
                _tile_dpbf16ps(2, 4, 6);
            }
            if (at[3]) {
                _tile_loadd(5, at[3] + t * 64, row_bytes[3]);
                _tile_dpbf16ps(3, 5, 6);
            }
        }
        _tile_stored(0, scores, 4 * TILE);
        _tile_stored(1, scores + TILE * TILE, 4 * TILE);
        _tile_stored(2, scores + 2 * TILE * TILE, 4 * TILE);
        _tile_stored(3, scores + 3 * TILE * TILE, 4 * TILE);
        /* softmax, each position's 16 rows one vector: x = score * scale + bias (-inf where the bias is, and past
           the context; a block every row sees with a bias of 0 needs none), weights exp(x - the running maximum),
           0 for a row that has seen nothing yet */
        __m512 high_now = top, scaling = _mm512_set1_ps(scale);
        if (plain && s0 >= all_from && s0 + block <= all_to) {
            for (int64_t s = 0; s < block; s++) {
                __m512 x = _mm512_mul_ps(_mm512_load_ps(scores + s * TILE), scaling);
                high_now = _mm512_max_ps(high_now, x);
                _mm512_store_ps(scores + s * TILE, x);
            }
        } else {
            for (int n = 0; n < TILE; n++)
                for (int64_t s = 0; s < block; s++) masks[s * TILE + n] = s0 + s < hi ? bias[n][s0 + s] : -INFINITY;
            for (int64_t s = 0; s < block; s++) {
                __m512 m = _mm512_load_ps(masks + s * TILE);
                __m512 x = _mm512_fmadd_ps(_mm512_load_ps(scores + s * TILE), scaling, m);
                x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(m, minus_inf, _CMP_EQ_OQ), minus_inf);
                high_now = _mm512_max_ps(high_now, x);
                _mm512_store_ps(scores + s * TILE, x);
            }
        }
        __mmask16 seen = _mm512_cmp_ps_mask(high_now, minus_inf, _CMP_NEQ_OQ);
        __m512 factor = _mm512_mask_blend_ps(seen, one, exp_nonpositive_16(_mm512_sub_ps(top, high_now)));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t s = 0; s < block; s++) {
            __m512 p = _mm512_maskz_mov_ps(seen, exp_nonpositive_16(_mm512_sub_ps(_mm512_load_ps(scores + s * TILE),
                                                                                  high_now)));
            sum = _mm512_add_ps(sum, p);
            __m256i h = (__m256i)_mm512_cvtneps_pbh(p);  /* the weights in bfloat16, each in a 32-bit lane */
            _mm512_store_si512(columns + s * TILE, _mm512_cvtepu16_epi32(h));
        }
        total = _mm512_fmadd_ps(total, factor, sum);
        top = high_now;
        __mmask16 rescale = _mm512_cmp_ps_mask(factor, one, _CMP_NEQ_OQ);
        if (rescale) {
            float f[TILE];
            _mm512_storeu_ps(f, factor);
            for (int64_t c = 0; c < 2 * chunks; c++)
                for (int n = 0; n < TILE; n++)
                    if (rescale >> n & 1) {
                        float *row = sums + (c * TILE + n) * TILE;
                        _mm512_storeu_ps(row, _mm512_mul_ps(_mm512_loadu_ps(row), _mm512_set1_ps(f[n])));
                    }
        }
        /* the weights as left tiles, one per position tile and half of each pair: row n holds (w, 0) for each
           position for the even numbers of the values, (0, w) for the odd ones */
        for (int g = 0; g < 4; g++) {
            uint32_t *even = weights + 2 * g * TILE * TILE;
            transpose_16x16(columns + g * TILE * TILE, even);
            for (int n = 0; n < TILE; n++)
                _mm512_store_si512(even + (TILE + n) * TILE, _mm512_slli_epi32(_mm512_load_si512(even + n * TILE), 16));
        }
        /* sums += weights . values: a right tile is 16 positions' latents as they lie (32 numbers of each), which
           the pairwise product splits into their even and odd numbers: two output tiles */
        for (int64_t c = 0; c < chunks; c += 2) {
            int two = c + 1 < chunks;
            float *at_c = sums + c * 2 * TILE * TILE;
            _tile_loadd(0, at_c, 4 * TILE);
            _tile_loadd(1, at_c + TILE * TILE, 4 * TILE);
            if (two) {
                _tile_loadd(2, at_c + 2 * TILE * TILE, 4 * TILE);
                _tile_loadd(3, at_c + 3 * TILE * TILE, 4 * TILE);
            }
            for (int g = 0; g < 4; g++) {
                if (!at[g]) continue;
                _tile_loadd(4, weights + 2 * g * TILE * TILE, 4 * TILE);
                _tile_loadd(5, weights + (2 * g + 1) * TILE * TILE, 4 * TILE);
                _tile_loadd(6, at[g] + c * 64, row_bytes[g]);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 5, 6);
                if (two) {
                    _tile_loadd(7, at[g] + (c + 1) * 64, row_bytes[g]);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, at_c, 4 * TILE);
            _tile_stored(1, at_c + TILE * TILE, 4 * TILE);
            if (two) {
                _tile_stored(2, at_c + 2 * TILE * TILE, 4 * TILE);
                _tile_stored(3, at_c + 3 * TILE * TILE, 4 * TILE);
            }
        }
    }
    /* row n's numbers 32c.. 32c + 31: row n of chunk c's even tile and of its odd one, interleaved */
    static const int32_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                           8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i low = _mm512_loadu_si512(interleave), high = _mm512_loadu_si512(interleave + 16);
    float totals[TILE];
    _mm512_storeu_ps(totals, total);
    for (int64_t n = 0; n < rows; n++) {
        if (totals[n] == 0.0f) return -3;
        __m512 inverse = _mm512_set1_ps(1.0f / totals[n]);
        for (int64_t c = 0; c < chunks; c++) {
            __m512 even = _mm512_load_ps(sums + (2 * c * TILE + n) * TILE);
            __m512 odd = _mm512_load_ps(sums + ((2 * c + 1) * TILE + n) * TILE);
            int64_t left = DV - 32 * c;
            __mmask16 first = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            __mmask16 second = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
            _mm512_mask_storeu_ps(out + n * DV + 32 * c, first,
                                  _mm512_mul_ps(_mm512_permutex2var_ps(even, low, odd), inverse));
            _mm512_mask_storeu_ps(out + n * DV + 32 * c + 16, second,
                                  _mm512_mul_ps(_mm512_permutex2var_ps(even, high, odd), inverse));
        }
    }
    return 0;
}

/* This thread's scratch of at least `bytes`, kept from call to call: a few hundred KB, which allocated and freed
   each call came from fresh pages each time (glibc maps allocations that large on their own). NULL when out of
   memory. */
static char *thread_scratch(size_t bytes) {
    static __thread char *memory = NULL;
    static __thread size_t size = 0;
    if (bytes > size) {
        free(memory);
        size = (bytes + 4095) / 4096 * 4096;
        memory = aligned_alloc(64, size);
        if (memory == NULL) size = 0;
    }
    return memory;
}

/* latent_attention over bfloat16 latents on tiles (its arguments, checked by the caller; half is 1). */
static int latent_attention_on_tiles(const void *q, int q_half, const void *kv, int64_t kv_batch_stride,
                                     int64_t kv_row_stride, const float *bias, int64_t H, int64_t B, int64_t R,
                                     int64_t S, int64_t D, int64_t DV, float scale, void *out, int out_half) {
    int64_t steps = (D + 31) / 32, chunks = (DV + 31) / 32, q_size = q_half ? 2 : 4, out_size = out_half ? 2 : 4;
    /* scratch: packed queries, the weights' 8 tiles, 64 padded latents, the sums in tiles, the outputs */
    size_t packed_size = (size_t)steps * TILE * 2 * TILE;
    size_t bytes = packed_size * 2 + (size_t)8 * TILE * TILE * 4 + (size_t)4 * TILE * steps * 32 * 2
                 + (size_t)chunks * 2 * TILE * TILE * 4 + (size_t)TILE * DV * 4;
    char *memory = thread_scratch(bytes);
    if (memory == NULL) return -1;
    uint16_t *packed = (uint16_t *)memory;
    uint32_t *weights = (uint32_t *)(packed + packed_size);
    uint16_t *edge = (uint16_t *)(weights + 8 * TILE * TILE);
    float *sums = (float *)(edge + 4 * TILE * steps * 32), *rows_out = sums + chunks * 2 * TILE * TILE;
    configure_tiles();
    int code = 0;
    for (int64_t b = 0; b < B && code == 0; b++)
        for (int64_t r0 = 0; r0 < R && code == 0; r0 += TILE) {
            int64_t rows = R - r0 < TILE ? R - r0 : TILE;
            const char *qb = (const char *)q + (b * R + r0) * D * q_size;
            /* the queries as the scores' right tiles: step t's row i holds numbers 32t + 2i and 32t + 2i + 1 of each
               query row (as one 32-bit pair), 0 past D and for missing rows */
            uint32_t *pairs = (uint32_t *)packed;
            memset(packed, 0, packed_size * 2);
            for (int64_t n = 0; n < rows; n++) {
                if (q_half && D % 2 == 0) {
                    const uint32_t *row = (const uint32_t *)qb + n * D / 2;
                    for (int64_t c = 0; c < D / 2; c++) pairs[c / TILE * TILE * TILE + c % TILE * TILE + n] = row[c];
                    continue;
                }
                for (int64_t c = 0; c < D; c++) {
                    uint16_t h = q_half ? ((const uint16_t *)qb)[n * D + c]
                                        : to_bfloat16(((const float *)qb)[n * D + c]);
                    packed[(c / 32 * TILE * TILE + c % 32 / 2 * TILE + n) * 2 + c % 2] = h;
                }
            }
            code = attend_tiles(packed, (const char *)kv + b * kv_batch_stride * 2, kv_row_stride * 2,
                                bias + b * (R / H) * S, H, r0, rows, S, D, DV, scale, sums, weights, edge, rows_out);
            char *ob = (char *)out + (b * R + r0) * DV * out_size;
            if (code == 0 && out_half)
                narrow(rows_out, rows * DV, (uint16_t *)ob);
            else if (code == 0)
                memcpy(ob, rows_out, rows * DV * 4);
        }
    _tile_release();
    return code;
}
#endif

/* Whether calls over bfloat16 latents run on tiles from now on: where `wanted`, and the CPU has them, and Linux lets
   this process use them (asked each time; granted once, it stays). The library's loader calls this before any call,
   so every call goes the same way; a benchmark may turn them off to time the vector path. */
int latent_attention_tiles(int wanted) {
#if TILES
    tiles_ready = wanted && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return tiles_ready;
#else
    (void)wanted;
    return 0;
#endif
}

/* Whether the vector path's accumulators fit this CPU's registers: built for AVX-512 (32 registers of 16 floats) or
   AVX2 with FMA (16 of 8: the NARROW blocking). Elsewhere they spill, and over float32 latents SDPA is faster
   (latent_kernel.reads). */
int latent_attention_fits_registers(void) {
#if defined(__AVX512F__) || NARROW
    return 1;
#else
    return 0;
#endif
}

int latent_attention_run(const void *q, int q_half, const void *kv, int kv_half, int64_t kv_batch_stride,
                         int64_t kv_row_stride, const float *bias, int64_t H, int64_t B, int64_t R, int64_t S,
                         int64_t D, int64_t DV, float scale, void *out, int out_half) {
    if (DV > D || H < 1 || R % H) return -2;
#if TILES
    if (kv_half && tiles_ready)
        return latent_attention_on_tiles(q, q_half, kv, kv_batch_stride, kv_row_stride, bias, H, B, R, S, D, DV, scale,
                                         out, out_half);
#endif
    if (kv_half)
        return latent_attention(q, q_half, kv, kv_batch_stride, kv_row_stride, bias, H, B, R, S, D, DV, scale, out,
                                out_half, 1);
    return latent_attention(q, q_half, kv, kv_batch_stride, kv_row_stride, bias, H, B, R, S, D, DV, scale, out,
                            out_half, 0);
}
