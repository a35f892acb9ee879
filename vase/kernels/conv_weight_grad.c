/* Weight gradient of a 4x4, stride-2, padding-1 convolution on channels_last float32 tensors [ours].
 *
 *   dW[co][kh][kw][ci] = sum over (n, oh, ow) of G[n][oh][ow][co] * X[n][2oh+kh-1][2ow+kw-1][ci]
 *
 * X is the conv's input (N, H, W, Ci), G the gradient of its output (N, H/2, W/2, Co), both
 * NHWC-contiguous; dW is written as (Co, 4, 4, Ci), the memory of a channels_last weight.
 * Transposed convs use the same kernel with the two maps swapped (vase/conv_paths.py, `_weight_grad`).
 *
 * Why: oneDNN computes this gradient for the paper network's 64->64 layers at about 125-130
 * GFLOP/s on our 2-core AVX2 machine, where its forward conv of the same shape reaches the matmul
 * peak (~190). This is one register-blocked GEMM per kernel tap, dW_tap (Co x Ci) += G^T X_tap,
 * reducing over the output pixels of a chunk of images:
 *   - G is packed per chunk into blocks of 6 output channels, X per tap into 16-channel rows with
 *     zeros where the tap reads the padding, so the inner loop is one contiguous stream of each;
 *   - a 6 x 16 tile of dW stays in 12 AVX registers over the whole chunk (2 loads of X and 6
 *     broadcasts of G feed 12 FMAs per pixel);
 *   - the threads split the input channels, so each owns its part of dW and nothing is reduced.
 * Threads come from OpenMP: loaded into a PyTorch process, this library binds to PyTorch's own
 * OpenMP runtime and reuses its thread pool (vase/kernels/__init__.py checks that). A second
 * pool would fight PyTorch's spinning workers for the cores.
 * The sums differ from oneDNN's in the last bits in training (bit-identical on random inputs
 * called alone); tests/test_kernels.py compares both with a float64 reference.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 6   /* output channels per register tile */
#define COLS 16  /* input channels per register tile: two 8-float AVX registers */
#define CHUNK 512 /* output pixels per chunk (whole images): long register-tile sums, packed G stays in L2 */

typedef struct {
    const float *x, *g;
    float *dw, *db;
    int n, h, w, ci, co, ci0, ci1; /* this thread owns input channels [ci0, ci1) */
    int co0, co1;                  /* and the bias gradient of output channels [co0, co1) */
} part_t;

/* dW tile (R x 16) += sum over k < K of g[k][0..R) (outer) x[k][0..16) */
#define TILE(R)                                                                                        \
    static inline __attribute__((always_inline)) void tile##R(float *d, size_t ds, const float *g,     \
                                                              const float *x, int K) {                 \
        __m256 lo[R], hi[R];                                                                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                          \
            lo[r] = _mm256_loadu_ps(d + r * ds);                                                       \
            hi[r] = _mm256_loadu_ps(d + r * ds + 8);                                                   \
        }                                                                                              \
        for (int k = K; k > 0; k--, g += ROWS, x += COLS) {                                            \
            __m256 x0 = _mm256_load_ps(x), x1 = _mm256_load_ps(x + 8);                                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                      \
                __m256 b = _mm256_broadcast_ss(g + r);                                                 \
                lo[r] = _mm256_fmadd_ps(b, x0, lo[r]);                                                 \
                hi[r] = _mm256_fmadd_ps(b, x1, hi[r]);                                                 \
            }                                                                                          \
        }                                                                                              \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                          \
            _mm256_storeu_ps(d + r * ds, lo[r]);                                                       \
            _mm256_storeu_ps(d + r * ds + 8, hi[r]);                                                   \
        }                                                                                              \
    }
TILE(6) TILE(5) TILE(4) TILE(3) TILE(2) TILE(1)

static void tile(int rows, float *d, size_t ds, const float *g, const float *x, int K) {
    switch (rows) {
    case 6: tile6(d, ds, g, x, K); break;
    case 5: tile5(d, ds, g, x, K); break;
    case 4: tile4(d, ds, g, x, K); break;
    case 3: tile3(d, ds, g, x, K); break;
    case 2: tile2(d, ds, g, x, K); break;
    default: tile1(d, ds, g, x, K); break;
    }
}

/* db[co] = sum of G[.][co] over every output pixel, added one pixel after the other: the order of
 * oneDNN's bias gradient, so the two agree bit for bit. */
static void bias_grad(const part_t *p) {
    const size_t pixels = (size_t)p->n * (p->h / 2) * (p->w / 2);
    for (int co = p->co0; co < p->co1; co++) p->db[co] = 0.0f;
    for (size_t k = 0; k < pixels; k++) {
        const float *row = p->g + k * p->co;
        int co = p->co0;
        for (; co + 8 <= p->co1; co += 8)
            _mm256_storeu_ps(p->db + co, _mm256_add_ps(_mm256_loadu_ps(p->db + co), _mm256_loadu_ps(row + co)));
        for (; co < p->co1; co++) p->db[co] += row[co];
    }
}

static int run(const part_t *p) {
    const int OH = p->h / 2, OW = p->w / 2, P = OH * OW, blocks = (p->co + ROWS - 1) / ROWS;
    const int IMAGES = P >= CHUNK ? 1 : (CHUNK + P - 1) / P;
    const size_t ds = (size_t)16 * p->ci; /* from one output channel of dW to the next */
    const size_t gsize = sizeof(float) * (size_t)blocks * IMAGES * P * ROWS;
    float *gpack = aligned_alloc(64, (gsize + 63) / 64 * 64); /* C11: a multiple of the alignment */
    float *xpack = aligned_alloc(64, sizeof(float) * (size_t)IMAGES * P * COLS);
    if (!gpack || !xpack) {
        free(gpack);
        free(xpack);
        return -1;
    }
    memset(gpack, 0, gsize); /* the last block's unused rows stay 0 */
    for (int co = 0; co < p->co; co++)
        for (int tap = 0; tap < 16; tap++)
            memset(p->dw + ((size_t)co * 16 + tap) * p->ci + p->ci0, 0, sizeof(float) * (p->ci1 - p->ci0));
    for (int n0 = 0; n0 < p->n; n0 += IMAGES) {
        const int images = p->n - n0 < IMAGES ? p->n - n0 : IMAGES, K = images * P;
        /* G: [block of output channels][pixel of the chunk][ROWS] */
        for (int k = 0; k < K; k++) {
            const float *src = p->g + ((size_t)n0 * P + k) * p->co;
            for (int b = 0; b < blocks; b++) {
                const int m = p->co - b * ROWS < ROWS ? p->co - b * ROWS : ROWS;
                memcpy(gpack + ((size_t)b * IMAGES * P + k) * ROWS, src + b * ROWS, sizeof(float) * m);
            }
        }
        for (int kh = 0; kh < 4; kh++)
            for (int kw = 0; kw < 4; kw++)
                for (int ci = p->ci0; ci < p->ci1; ci += COLS) {
                    /* X under tap (kh, kw) of every output pixel: [pixel][COLS], 0 in the padding */
                    float *dst = xpack;
                    for (int i = 0; i < images; i++)
                        for (int oh = 0; oh < OH; oh++) {
                            const int ih = 2 * oh + kh - 1;
                            if (ih < 0 || ih >= p->h) {
                                memset(dst, 0, sizeof(float) * COLS * OW);
                                dst += COLS * OW;
                                continue;
                            }
                            const float *row = p->x + ((size_t)(n0 + i) * p->h + ih) * p->w * p->ci + ci;
                            for (int ow = 0; ow < OW; ow++, dst += COLS) {
                                const int iw = 2 * ow + kw - 1;
                                if (iw < 0 || iw >= p->w) {
                                    _mm256_store_ps(dst, _mm256_setzero_ps());
                                    _mm256_store_ps(dst + 8, _mm256_setzero_ps());
                                } else {
                                    _mm256_store_ps(dst, _mm256_loadu_ps(row + (size_t)iw * p->ci));
                                    _mm256_store_ps(dst + 8, _mm256_loadu_ps(row + (size_t)iw * p->ci + 8));
                                }
                            }
                        }
                    for (int b = 0; b < blocks; b++) {
                        const int co = b * ROWS, m = p->co - co < ROWS ? p->co - co : ROWS;
                        tile(m, p->dw + ((size_t)co * 16 + kh * 4 + kw) * p->ci + ci, ds,
                             gpack + (size_t)b * IMAGES * P * ROWS, xpack, K);
                    }
                }
    }
    free(gpack);
    free(xpack);
    return 0;
}

/* Fills dW and, unless db is NULL, the bias gradient db (Co). Returns 0, or -1 for shapes it does
 * not handle (Ci not a multiple of 16, odd H or W) or when out of memory; dW is then undefined. */
int conv_weight_grad(const float *x, const float *g, float *dw, float *db, int n, int h, int w, int ci, int co,
                     int threads) {
    if (ci % COLS || h % 2 || w % 2 || n < 1 || co < 1)
        return -1;
    const int blocks = ci / COLS;
    if (threads > blocks) threads = blocks;
    if (threads < 1) threads = 1;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        part_t part = {x, g, dw, db, n, h, w, ci, co, COLS * (blocks * t / nt), COLS * (blocks * (t + 1) / nt),
                       co * t / nt, co * (t + 1) / nt};
        failed |= run(&part) != 0;
        if (db) bias_grad(&part);
    }
    return failed ? -1 : 0;
}
