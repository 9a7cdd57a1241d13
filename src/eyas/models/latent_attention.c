/* Decode and verify attention over MLA latents, float32, one thread: the kernel `eyas.models.latent_kernel` builds.

   Per batch row b: R query rows (a sequence's verify positions x heads) over S context positions whose one latent
   of D floats is the key (all of it) and the value (its first DV floats). scores = q . k * scale + bias (bias 0 or
   -inf: the causal mask), softmax over S, out = sum of p * v.

   torch's fused SDPA multiplies [a few query rows x D] by [D x 512 positions] blocks, packing every block of the
   latents for a matrix product whose other side has only a few rows; here each latent is read once per block of
   query rows and used at once, from L1, by every row of the block. Each row's result is computed by the same
   operations in the same order whatever the other rows are: decode and verify give the same numbers. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16      /* one AVX-512 register of floats: the compiler vectorises each 16-wide loop */
#define ROW_BLOCK 8   /* query rows that share each latent while it is in L1 */

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

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));  /* one AVX-512 register */

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The lanes of a + b summed as a tree, in a fixed order. */
static inline float lanes_sum(vec a, vec b) {
    float x[LANES];
    vec both = a + b;
    memcpy(x, &both, sizeof x);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) x[l] += x[l + w];
    return x[0];
}

/* dots[r] = q_r . k for the N query rows at q (row stride D): two accumulators per row, 2N independent chains of
   multiply-adds, over the widest multiple of 2 * LANES; the rest of the width one by one. */
#define DEFINE_SCORES(N)                                                                             \
    static void scores_##N(const float *q, const float *k, int64_t D, float *dots) {                 \
        vec even[N] = {0}, odd[N] = {0};                                                             \
        int64_t wide = D - D % (2 * LANES);                                                          \
        for (int64_t d = 0; d < wide; d += 2 * LANES) {                                              \
            vec k0 = load(k + d), k1 = load(k + d + LANES);                                          \
            for (int r = 0; r < N; r++) {                                                            \
                even[r] += load(q + r * D + d) * k0;                                                 \
                odd[r] += load(q + r * D + d + LANES) * k1;                                          \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < N; r++) {                                                                \
            dots[r] = lanes_sum(even[r], odd[r]);                                                    \
            for (int64_t d = wide; d < D; d++) dots[r] += q[r * D + d] * k[d];                       \
        }                                                                                            \
    }
DEFINE_SCORES(1) DEFINE_SCORES(2) DEFINE_SCORES(3) DEFINE_SCORES(4)
DEFINE_SCORES(5) DEFINE_SCORES(6) DEFINE_SCORES(7) DEFINE_SCORES(8)
static void (*const SCORES[ROW_BLOCK + 1])(const float *, const float *, int64_t, float *) = {
    NULL, scores_1, scores_2, scores_3, scores_4, scores_5, scores_6, scores_7, scores_8};

/* out[r] = sum over s in [begin, end) of p[r][s] * v_s (the first DV floats of latent s) for N rows, 2 * LANES
   columns at a time held in registers across the positions; the columns past the widest multiple of 2 * LANES one
   by one. */
#define DEFINE_VALUES(N)                                                                             \
    static void values_##N(const float *p, int64_t S, const float *k, int64_t stride, int64_t begin, \
                           int64_t end, int64_t DV, float *out) {                                    \
        int64_t wide = DV - DV % (2 * LANES);                                                        \
        for (int64_t d = wide; d < DV; d++)                                                          \
            for (int r = 0; r < N; r++) {                                                            \
                float acc = 0.0f;                                                                    \
                for (int64_t s = begin; s < end; s++) acc += p[r * S + s] * k[s * stride + d];       \
                out[r * DV + d] = acc;                                                               \
            }                                                                                        \
        for (int64_t d = 0; d < wide; d += 2 * LANES) {                                              \
            vec low[N] = {0}, high[N] = {0};                                                         \
            for (int64_t s = begin; s < end; s++) {                                                  \
                vec v0 = load(k + s * stride + d), v1 = load(k + s * stride + d + LANES);            \
                for (int r = 0; r < N; r++) {                                                        \
                    float w = p[r * S + s];                                                          \
                    low[r] += w * v0;                                                                \
                    high[r] += w * v1;                                                               \
                }                                                                                    \
            }                                                                                        \
            for (int r = 0; r < N; r++) {                                                            \
                memcpy(out + r * DV + d, &low[r], sizeof(vec));                                      \
                memcpy(out + r * DV + d + LANES, &high[r], sizeof(vec));                             \
            }                                                                                        \
        }                                                                                            \
    }
DEFINE_VALUES(1) DEFINE_VALUES(2) DEFINE_VALUES(3) DEFINE_VALUES(4)
DEFINE_VALUES(5) DEFINE_VALUES(6) DEFINE_VALUES(7) DEFINE_VALUES(8)
static void (*const VALUES[ROW_BLOCK + 1])(const float *, int64_t, const float *, int64_t, int64_t, int64_t, int64_t,
                                           float *) = {
    NULL, values_1, values_2, values_3, values_4, values_5, values_6, values_7, values_8};

/* q [B, R, D] contiguous; kv: latent s of batch row b at kv + b * kv_batch_stride + s * kv_row_stride; bias
   [B, R / H, S] contiguous, query row r reading bias row r / H (H: a position's heads); out [B, R, DV] contiguous.
   Returns 0; -1 when out of memory, -2 for shapes it does not take (DV > D, R not a multiple of H), -3 when a query
   row sees no position. */
int latent_attention_f32(const float *q, const float *kv, int64_t kv_batch_stride, int64_t kv_row_stride,
                         const float *bias, int64_t H, int64_t B, int64_t R, int64_t S, int64_t D, int64_t DV,
                         float scale, float *out) {
    if (DV > D || H < 1 || R % H) return -2;
    float *p = malloc(sizeof(float) * ROW_BLOCK * (S > 0 ? S : 1));
    if (p == NULL) return -1;
    int code = 0;
    for (int64_t b = 0; b < B && code == 0; b++) {
        const float *k = kv + b * kv_batch_stride;
        for (int64_t r0 = 0; r0 < R && code == 0; r0 += ROW_BLOCK) {
            int64_t rows = R - r0 < ROW_BLOCK ? R - r0 : ROW_BLOCK;
            const float *qb = q + (b * R + r0) * D;
            const float *mask = bias + b * (R / H) * S;
            float *o = out + (b * R + r0) * DV;
            /* the positions some row of the block sees: nothing outside them is read (a cache slot past a
               context may hold anything) */
            int64_t begin = S, end = 0;
            for (int64_t r = 0; r < rows; r++)
                for (int64_t s = 0; s < S; s++)
                    if (mask[(r0 + r) / H * S + s] != -INFINITY) {
                        begin = s < begin ? s : begin;
                        end = s + 1 > end ? s + 1 : end;
                    }
            float dots[ROW_BLOCK];
            for (int64_t s = begin; s < end; s++) {  /* scores: latent s read once for the block's rows */
                SCORES[rows](qb, k + s * kv_row_stride, D, dots);
                for (int64_t r = 0; r < rows; r++) {
                    float m = mask[(r0 + r) / H * S + s];
                    p[r * S + s] = m == -INFINITY ? -INFINITY : dots[r] * scale + m;
                }
            }
            for (int64_t r = 0; r < rows && code == 0; r++) {  /* softmax of each row over begin..end */
                float *pr = p + r * S, top = -INFINITY, total = 0.0f;
                for (int64_t s = begin; s < end; s++) top = pr[s] > top ? pr[s] : top;
                if (top == -INFINITY) {  /* a row that sees nothing */
                    code = -3;
                    break;
                }
                for (int64_t s = begin; s < end; s++) pr[s] = exp_nonpositive(pr[s] - top);
                for (int64_t s = begin; s < end; s++) total += pr[s];
                float inverse = 1.0f / total;
                for (int64_t s = begin; s < end; s++) pr[s] *= inverse;
            }
            if (code == 0) VALUES[rows](p, S, k, kv_row_stride, begin, end, DV, o);
        }
    }
    free(p);
    return code;
}
