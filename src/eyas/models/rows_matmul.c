/* out[M, N] = x[M, K] . w[K, N] for linears stored in gemv_layout (w is the weight transposed, N contiguous),
   float32 rows and float32 or bfloat16 weights (widened exactly as they are read), one thread: the kernel
   `eyas.models.rows_matmul` builds, for the logits of a step's few rows. A bfloat16 weight is half the bytes to read,
   and its logits are bit for bit those of its float32 copy.

   CPU BLAS multiplies 2 to 8 rows by the bundled target's lm_head 2-4x slower than one row (it packs the whole
   weight for a matrix product whose other side has a few rows). Here each block of columns of w is read from
   memory once and used from registers and the caches by every row (rows_matmul_f32). Every output element is the
   same chain of fused multiply-adds over k = 0..K-1 whatever the other rows are: a row's logits do not depend on
   the batch it runs in (decode and verify rows agree bit for bit). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* LANES: floats in one vector register, which the compiler fills with each LANES-wide operation. A block keeps 16
   accumulators in registers with AVX-512 (32 registers), 8 without (AVX2 has 16): twice as many there spill every
   multiply-add to memory (32 rows ran 30x slower than CPU BLAS). V2, V4, V8: registers of columns per row in a block
   of 2, 4 and 8 rows; FIRST_ROWS: the rows that read a block of columns from memory together; QUARTERS: four rows
   or more run as quarters of a block; PANEL_ROWS: from this many rows, the quarters run over contiguous copies of
   w's columns (below). */
#if defined(__AVX512F__)
#define LANES 16
#define V2 8
#define V4 4
#define V8 2
#define FIRST_ROWS 2
#define QUARTERS 0
#define PANEL_ROWS 0
#else
#define LANES 8
#define V2 4
#define V4 2
#define V8 1
#define FIRST_ROWS 1
#define QUARTERS 1
#define PANEL_ROWS 10
#endif

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

typedef uint16_t half_vec __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t bits_vec __attribute__((vector_size(LANES * sizeof(uint32_t))));

/* 16 bfloat16 weights as floats: a bfloat16 is a float's top 16 bits */
static inline vec load_bf16(const uint16_t *p) {
    half_vec h;
    memcpy(&h, p, sizeof h);
    bits_vec bits = __builtin_convertvector(h, bits_vec) << 16;
    vec v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline float scalar_f32(const float *p) { return *p; }

static inline float scalar_bf16(const uint16_t *p) {
    uint32_t bits = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Rows 0..m-1 of x (m <= R) times the V * LANES columns of w from n0: R x V accumulators (at most 16 registers,
   so 16 independent chains of multiply-adds, and w's registers beside them). */
#define DEFINE_BLOCK(T, W, LOAD, R, V)                                                                   \
    static void block_##T##_##R##_##V(const float *x, int64_t K, const W *w, int64_t N, int64_t m,       \
                                int64_t n0, float *out) {                                                \
        vec acc[R][V];                                                                                   \
        memset(acc, 0, sizeof acc);                                                                      \
        for (int64_t k = 0; k < K; k++) {                                                                \
            if (V == 8) { /* the pass that reads w from memory: fetch 4 KB of the block ahead */         \
                const char *ahead = (const char *)(w + (k + 4096 / (V * LANES * sizeof(W))) * N + n0);   \
                for (int c = 0; c < V * LANES * (int)sizeof(W); c += 64)                                 \
                    __builtin_prefetch(ahead + c, 0, 3);                                                 \
            }                                                                                            \
            vec wk[V];                                                                                   \
            for (int v = 0; v < V; v++) wk[v] = LOAD(w + k * N + n0 + v * LANES);                        \
            for (int r = 0; r < R; r++) {                                                                \
                if (r < m) {                                                                             \
                    float s = x[r * K + k];                                                              \
                    for (int v = 0; v < V; v++) acc[r][v] += s * wk[v];                                  \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < m; r++)                                                                      \
            for (int v = 0; v < V; v++) store(out + r * N + n0 + v * LANES, acc[r][v]);                  \
    }

/* With 16 registers (AVX2), four rows or more (over w in place at the row counts neither the panels nor the in-order
   path take, and where the panels cannot be allocated; else a panel's last rows, below): a block of 8 * LANES columns
   as four quarters of 2 registers, 4 rows at a time over one quarter (8 accumulators, w's 2 registers used by 4 rows).
   The first rows' pass over the first quarter fetches the block's whole runs of w (8 * LANES of each row of w) 8 rows
   of w ahead: the block then comes from memory as one row reads it, and the other quarters and rows read it from the
   caches. On the bundled target's lm_head on an AVX2 EPYC (`benchmarks/rows_matmul.py --cold`): 4 rows 0.62-0.68 ms
   against 0.80 through the blocks below, 8 rows 0.76-0.93 against 1.32, 16 rows 1.32-1.36 against 1.89, 32 rows 2.50
   against 2.83; from 16 rows up CPU BLAS is faster still (1.26-1.51 ms at 16, 5.2-5.7 at 128 rows against 9.4-9.7). */
#define DEFINE_QUARTER(T, W, LOAD)                                                                       \
    __attribute__((unused)) static void quarter_##T(const float *x, int64_t K, const W *w, int64_t ldw,  \
                                                    int64_t N, int64_t m, int64_t n0, float *out,        \
                                                    int fetch) {                                         \
        vec acc[4][2];                                                                                   \
        memset(acc, 0, sizeof acc);                                                                      \
        for (int64_t k = 0; k < K; k++) {                                                                \
            if (fetch) {                                                                                 \
                const char *ahead = (const char *)(w + (k + 8) * ldw + n0);                              \
                for (int c = 0; c < 8 * LANES * (int)sizeof(W); c += 64)                                 \
                    __builtin_prefetch(ahead + c, 0, 3);                                                 \
            }                                                                                            \
            vec w0 = LOAD(w + k * ldw + n0), w1 = LOAD(w + k * ldw + n0 + LANES);                        \
            for (int r = 0; r < 4; r++) {                                                                \
                if (r < m) {                                                                             \
                    float s = x[r * K + k];                                                              \
                    acc[r][0] += s * w0;                                                                 \
                    acc[r][1] += s * w1;                                                                 \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < m; r++) {                                                                    \
            store(out + r * N + n0, acc[r][0]);                                                          \
            store(out + r * N + n0 + LANES, acc[r][1]);                                                  \
        }                                                                                                \
    }

DEFINE_QUARTER(f32, float, load)
DEFINE_QUARTER(bf16, uint16_t, load_bf16)

/* With 16 registers (AVX2), six rows at a time over a panel (below): 12 accumulators, more independent chains of
   multiply-adds than a quarter's 8 to keep both FMA units busy (over w in place, 1.3-1.4x as fast from 12 rows). */
__attribute__((unused)) static void six_rows(const float *x, int64_t K, const float *panel, int64_t N, float *out) {
    vec acc[6][2];
    memset(acc, 0, sizeof acc);
    for (int64_t k = 0; k < K; k++) {
        vec w0 = load(panel + k * 2 * LANES), w1 = load(panel + k * 2 * LANES + LANES);
        for (int r = 0; r < 6; r++) {
            float s = x[r * K + k];
            acc[r][0] += s * w0;
            acc[r][1] += s * w1;
        }
    }
    for (int r = 0; r < 6; r++) {
        store(out + r * N, acc[r][0]);
        store(out + r * N + LANES, acc[r][1]);
    }
}

/* the names paste V2, V4, V8 unexpanded: block_f32_2_V2 is the block of 2 rows, whatever V2 is here */
#define DEFINE_BLOCKS(T, W, LOAD)    \
    DEFINE_BLOCK(T, W, LOAD, 1, 8)   \
    DEFINE_BLOCK(T, W, LOAD, 2, V2)  \
    DEFINE_BLOCK(T, W, LOAD, 4, V4)  \
    DEFINE_BLOCK(T, W, LOAD, 8, V8)  \
    DEFINE_BLOCK(T, W, LOAD, 1, 1)

DEFINE_BLOCKS(f32, float, load)
DEFINE_BLOCKS(bf16, uint16_t, load_bf16)

/* Ten rows or more on AVX2: a block of 8 * LANES columns is copied (widened to float) into four contiguous panels of
   2 * LANES columns, reading the block's runs of w as one row reads them; then six rows at a time (four for the last
   ones) run over each panel, from L1. Over w in place a quarter's K runs are N floats apart (32 KB on the bundled
   head: a power of two, so they all fall in one set of L1 and two of L2 and evict one another) and every group of
   rows read them from L3 again. On the bundled target's lm_head on an AVX2 EPYC (one thread), the quarters in place
   against the panels, w in L3: 12 rows 1.31 ms against 0.63, 16 rows 1.78 against 0.86, 32 rows 3.53 against 1.51,
   64 rows 7.7 against 2.8 (CPU BLAS, 32 rows: 1.4-1.6); w evicted: 16 rows 1.21-1.24 against 1.09-1.14, 32 rows
   2.31-2.33 against 1.71-1.90, 64 rows 4.56 against 2.72. Below ten rows the panels were faster with w in L3 and
   slower with it evicted (2 rows 0.47 against 0.35, and 0.48 against 0.57). Returns the columns done: 0 where the
   panels cannot be allocated, and the blocks run in place. */
#define DEFINE_PANELS(T, W, LOAD)                                                                        \
    __attribute__((unused)) static int64_t panels_##T(const float *x, int64_t M, int64_t K, const W *w,  \
                                                      int64_t N, float *out) {                           \
        float *panels = malloc((size_t)K * 8 * LANES * sizeof(float));                                   \
        if (panels == NULL) return 0; /* the caller runs the blocks in place */                          \
        int64_t n0 = 0;                                                                                  \
        for (; n0 + 8 * LANES <= N; n0 += 8 * LANES) {                                                   \
            for (int64_t k = 0; k < K; k++)                                                              \
                for (int p = 0; p < 4; p++) {                                                            \
                    float *panel = panels + (p * K + k) * 2 * LANES;                                     \
                    store(panel, LOAD(w + k * N + n0 + p * 2 * LANES));                                  \
                    store(panel + LANES, LOAD(w + k * N + n0 + p * 2 * LANES + LANES));                  \
                }                                                                                        \
            for (int p = 0; p < 4; p++) {                                                                \
                const float *panel = panels + p * K * 2 * LANES;                                         \
                float *o = out + n0 + p * 2 * LANES;                                                     \
                int64_t r0 = 0;                                                                          \
                for (; M - r0 >= 6 && M - r0 != 8; r0 += 6)                                              \
                    six_rows(x + r0 * K, K, panel, N, o + r0 * N);                                       \
                for (; r0 < M; r0 += 4)                                                                  \
                    quarter_f32(x + r0 * K, K, panel, 2 * LANES, N, M - r0 < 4 ? M - r0 : 4, 0,          \
                                o + r0 * N, 0);                                                          \
            }                                                                                            \
        }                                                                                                \
        free(panels);                                                                                    \
        return n0;                                                                                       \
    }

DEFINE_PANELS(f32, float, load)
DEFINE_PANELS(bf16, uint16_t, load_bf16)

/* Up to STREAM_ROWS - 1 rows on AVX2: w is read in order, row by row of w (STREAM_K of them at a time, each run of
   STREAM_N columns), and each row's outputs over those columns are loaded, given STREAM_K multiply-adds and stored
   back: the same chain over k = 0..K-1 for every output (stores and loads round nothing). The hardware fetches w's
   sequential runs ahead by itself, and every run of w is used by every row while it is in registers; the blocks
   below read w down its columns (runs N floats apart), where 2 to 8 rows read each run from memory or L3 again. On
   the bundled target's lm_head on an AVX2 EPYC (one thread, w evicted before each call, the blocks against this): 1
   row 0.29-0.32 ms against 0.21-0.23, 2 rows 0.47-0.52 against 0.28, 4 rows 0.57-0.73 against 0.32-0.39, 8 rows
   0.73-0.84 against 0.58-0.64; from 9 rows slower (with w in L3, 8 rows 0.56 against 0.70). */
#define STREAM_ROWS 9
#define STREAM_K 8
#define STREAM_N 1024
#define DEFINE_STREAMED(T, W, LOAD)                                                                      \
    __attribute__((unused)) static int64_t streamed_##T(const float *x, int64_t M, int64_t K,           \
                                                        const W *w, int64_t N, float *out) {             \
        int64_t full = N - N % (8 * LANES); /* the last columns as every row count runs them */          \
        for (int64_t n0 = 0; n0 < full; n0 += STREAM_N) {                                                \
            int64_t n1 = n0 + STREAM_N < full ? n0 + STREAM_N : full;                                    \
            for (int64_t m = 0; m < M; m++) memset(out + m * N + n0, 0, (n1 - n0) * sizeof(float));      \
            int64_t k = 0;                                                                               \
            for (; k + STREAM_K <= K; k += STREAM_K)                                                     \
                for (int64_t n = n0; n < n1; n += LANES) {                                               \
                    vec wk[STREAM_K];                                                                    \
                    for (int j = 0; j < STREAM_K; j++) wk[j] = LOAD(w + (k + j) * N + n);                \
                    for (int64_t m = 0; m < M; m++) {                                                    \
                        vec acc = load(out + m * N + n);                                                 \
                        for (int j = 0; j < STREAM_K; j++) acc += x[m * K + k + j] * wk[j];              \
                        store(out + m * N + n, acc);                                                     \
                    }                                                                                    \
                }                                                                                        \
            for (; k < K; k++)                                                                           \
                for (int64_t n = n0; n < n1; n += LANES) {                                               \
                    vec wk = LOAD(w + k * N + n);                                                        \
                    for (int64_t m = 0; m < M; m++) {                                                    \
                        vec acc = load(out + m * N + n);                                                 \
                        acc += x[m * K + k] * wk;                                                        \
                        store(out + m * N + n, acc);                                                     \
                    }                                                                                    \
                }                                                                                        \
        }                                                                                                \
        return full;                                                                                     \
    }

DEFINE_STREAMED(f32, float, load)
DEFINE_STREAMED(bf16, uint16_t, load_bf16)

/* x [M, K], w [K, N] and out [M, N], row-major and contiguous. Returns 0. With AVX2 from PANEL_ROWS rows, the panels
   above; below STREAM_ROWS, w read in order (above); both over whole blocks of 8 * LANES columns, the last columns
   running as below for every row count. Otherwise each block of 8 * LANES columns is read from memory once, by the
   first FIRST_ROWS rows, as one row reads it (8 * LANES floats of each of the K rows of w: runs long enough for the
   hardware to fetch ahead; blocks of 2 or 4 registers per row read them too short to, and 4 rows took 1.9 times one
   row's time on an evicted 8192 x 192 head). The other rows then take the block (with AVX-512 96 KB at K = 192) from
   the caches, 8 rows at a time over V8 registers of its columns (a quarter of them, 24 KB, in L1), each weight register
   used by 8 rows. */
#define DEFINE_ROWS_MATMUL(T, W, SCALAR)                                                                              \
int rows_matmul_##T(const float *x, int64_t M, int64_t K, const W *w, int64_t N, float *out) {                        \
    int64_t n0 = 0;                                                                                                   \
    if (QUARTERS && M >= PANEL_ROWS) n0 = panels_##T(x, M, K, w, N, out);                                             \
    else if (QUARTERS && M < STREAM_ROWS) n0 = streamed_##T(x, M, K, w, N, out);                                      \
    for (; QUARTERS && M >= 4 && n0 + 8 * LANES <= N; n0 += 8 * LANES)                                                \
        for (int64_t q = 0; q < 8 * LANES; q += 2 * LANES)                                                            \
            for (int64_t r0 = 0; r0 < M; r0 += 4)                                                                     \
                quarter_##T(x + r0 * K, K, w, N, N, M - r0 < 4 ? M - r0 : 4, n0 + q, out + r0 * N, q == 0 && r0 == 0); \
    for (; n0 + 8 * LANES <= N; n0 += 8 * LANES) {                                                                    \
        int64_t r0 = M >= FIRST_ROWS ? FIRST_ROWS : M;                                                                \
        if (M >= 2 && FIRST_ROWS == 2) block_##T##_2_V2(x, K, w, N, 2, n0, out);                                      \
        else if (M >= 1) block_##T##_1_8(x, K, w, N, 1, n0, out);                                                     \
        for (; r0 + 8 <= M; r0 += 8)                                                                                  \
            for (int64_t c = 0; c < 8 * LANES; c += V8 * LANES)                                                       \
                block_##T##_8_V8(x + r0 * K, K, w, N, 8, n0 + c, out + r0 * N);                                       \
        for (; r0 + 4 <= M; r0 += 4)                                                                                  \
            for (int64_t c = 0; c < 8 * LANES; c += V4 * LANES)                                                       \
                block_##T##_4_V4(x + r0 * K, K, w, N, 4, n0 + c, out + r0 * N);                                       \
        for (; r0 + 2 <= M; r0 += 2)                                                                                  \
            for (int64_t c = 0; c < 8 * LANES; c += V2 * LANES)                                                       \
                block_##T##_2_V2(x + r0 * K, K, w, N, 2, n0 + c, out + r0 * N);                                       \
        if (r0 < M) block_##T##_1_8(x + r0 * K, K, w, N, 1, n0, out + r0 * N);                                        \
    }                                                                                                                 \
    for (; n0 + LANES <= N; n0 += LANES)                                                                              \
        for (int64_t r = 0; r < M; r++) block_##T##_1_1(x + r * K, K, w, N, 1, n0, out + r * N);                      \
    for (int64_t r = 0; r < M; r++)  /* the last columns: the same multiply-adds, one lane at a time */               \
        for (int64_t n = n0; n < N; n++) {                                                                            \
            float s = 0.0f;                                                                                           \
            for (int64_t k = 0; k < K; k++) s = fmaf(x[r * K + k], SCALAR(w + k * N + n), s);                         \
            out[r * N + n] = s;                                                                                       \
        }                                                                                                             \
    return 0;                                                                                                         \
}

DEFINE_ROWS_MATMUL(f32, float, scalar_f32)
DEFINE_ROWS_MATMUL(bf16, uint16_t, scalar_bf16)
