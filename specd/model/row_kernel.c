/* A float32 linear layer for a few rows that reads each weight once and gives every row the same
 * bits however many rows share the call.
 *
 * specd_rows_linear(x, M, K, panels, N16, out): out[M][N16] = x[M][K] times the weight, which is
 * given as panels of 16 output features, panels[N16 / 16][K][16] (panel p, input k, lane j holds
 * weight[16 p + j][k]; N16 a multiple of 16, padded with zero rows by the caller).
 *
 * Why: a verification pass multiplies a few rows (k + 1 a request) by every weight of the target,
 * which on a CPU is bound by reading the weights from memory. Libraries either run one matrix-
 * vector product per row (MKL below 4 rows: the weights are read once a row) or switch to blocked
 * kernels tuned for many rows. Here a block of rows (up to MAX_ROWS) and a few panels are held in
 * vector registers while the panel streams through once, so 2-12 rows cost about what one does.
 * Every output is summed over k in order, in its own accumulator, one row at a time: the result
 * of a row never depends on the other rows, so a one-token decoding step and a verification pass
 * agree to the bit on the rows they share.
 */
#include <stddef.h>

typedef float lanes16 __attribute__((vector_size(64), aligned(4)));

#define MAX_ROWS 12
#define MAX_PANELS 4
/* panels in flight per block: more for few rows (independent sums to hide the add latency), fewer
 * when the rows' accumulators fill the registers (rows x panels + panels <= 32) */
#define FEW_ROWS 6
#define PANELS_FEW_ROWS 4
#define PANELS_MANY_ROWS 2

static inline __attribute__((always_inline)) void block(const float *x, size_t k_size, const float *w,
                                                        float *out, size_t n_size, const int rows, const int panels) {
    lanes16 sums[MAX_PANELS][MAX_ROWS];
    for (int p = 0; p < panels; p++)
        for (int m = 0; m < rows; m++) sums[p][m] = (lanes16){0};
    for (size_t k = 0; k < k_size; k++) {
        lanes16 weights[MAX_PANELS];
        for (int p = 0; p < panels; p++) weights[p] = *(const lanes16 *)(w + (p * k_size + k) * 16);
        for (int m = 0; m < rows; m++) {
            float value = x[m * k_size + k];
            for (int p = 0; p < panels; p++) sums[p][m] += value * weights[p];
        }
    }
    for (int m = 0; m < rows; m++)
        for (int p = 0; p < panels; p++) *(lanes16 *)(out + m * n_size + p * 16) = sums[p][m];
}

static inline __attribute__((always_inline)) void rows_through(const float *x, size_t k_size, const float *w,
                                                               size_t n_panels, float *out, size_t n_size,
                                                               const int rows) {
    const int panels = rows <= FEW_ROWS ? PANELS_FEW_ROWS : PANELS_MANY_ROWS;
    size_t p = 0;
    for (; p + panels <= n_panels; p += panels) block(x, k_size, w + p * k_size * 16, out + p * 16, n_size, rows, panels);
    for (; p < n_panels; p++) block(x, k_size, w + p * k_size * 16, out + p * 16, n_size, rows, 1);
}

#define ROWS_CASE(n) case n: rows_through(x, k_size, w, n_panels, out, n_size, n); break;

static void some_rows(const float *x, size_t rows, size_t k_size, const float *w, size_t n_panels, float *out,
                      size_t n_size) {
    switch (rows) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6)
        ROWS_CASE(7) ROWS_CASE(8) ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12)
        default: break;
    }
}

void specd_rows_linear(const float *x, long m_size, long k_size, const float *panels, long n16, float *out) {
    for (long m0 = 0; m0 < m_size; m0 += MAX_ROWS) {
        long rows = m_size - m0 < MAX_ROWS ? m_size - m0 : MAX_ROWS;
        some_rows(x + m0 * k_size, (size_t)rows, (size_t)k_size, panels, (size_t)(n16 / 16), out + m0 * n16,
                  (size_t)n16);
    }
}
