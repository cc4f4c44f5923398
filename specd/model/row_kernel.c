/* A float32 linear layer for a few rows that reads each weight once and gives every row the same
 * bits however many rows share the call.
 *
 * specd_rows_linear(x, M, K, panels, N16, out): out[M][N16] = x[M][K] times the weight, which is
 * given as panels of W = specd_panel_width() output features (the CPU's vector: 8 on AVX2, 16 with
 * AVX-512), panels[N16 / W][K][W] (panel p, input k, lane j holds weight[W p + j][k]; N16 a
 * multiple of 16, padded with zero rows by the caller).
 *
 * Why: a verification pass multiplies a few rows (k + 1 a request) by every weight of the target,
 * which on a CPU is bound by reading the weights from memory. Libraries either run one matrix-
 * vector product per row (MKL below 4 rows: the weights are read once a row) or switch to blocked
 * kernels tuned for many rows. Here a block of rows' sums over a few panels are held in vector
 * registers while the panels stream through once, so a few rows (up to 6 on AVX2, 12 with AVX-512)
 * cost not much more than one.
 * Every output is summed over k in order, in its own accumulator, one row at a time: the result
 * of a row never depends on the other rows, so a one-token decoding step and a verification pass
 * agree to the bit on the rows they share.
 *
 * specd_rows_linear_half (where the CPU converts half precision: F16C, or AVX-512) takes the same
 * panels in IEEE fp16 and widens each weight to float32 as it is read, the arithmetic unchanged:
 * its result is exactly specd_rows_linear's on the weights rounded to fp16. Half the bytes stream
 * from memory; a drafter's layers use it (their products only propose drafts, which the target
 * verifies in float32), the target's never do.
 *
 * specd_layer (at the end) is a whole decoder layer at a few positions on these products (a target's
 * block, or a feature drafter's first layer), one call instead of about 40 torch operations.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* the CPU's own vector: one register each, so the compiler keeps a block's sums in registers (a
 * 64-byte vector on an AVX2 CPU is two registers' worth, and GCC 12 kept such sums on the stack) */
#ifdef __AVX512F__
#define WIDTH 16
#else
#define WIDTH 8
#endif
typedef float lanes __attribute__((vector_size(WIDTH * 4), aligned(4)));

/* sum + value * weights, one rounding (a fused multiply-add) in every block shape: left to
 * -ffp-contract, GCC tuned for Zen (-march=native) keeps some single chains as a multiply and an
 * add (its avoid-fma-max-bits heuristic), which rounds twice and would make a row's bits depend on
 * the block it ran in */
static inline __attribute__((always_inline)) lanes fused(lanes sum, float value, lanes weights) {
#if defined(__AVX512F__)
    return (lanes)_mm512_fmadd_ps(_mm512_set1_ps(value), (__m512)weights, (__m512)sum);
#elif defined(__FMA__)
    return (lanes)_mm256_fmadd_ps(_mm256_set1_ps(value), (__m256)weights, (__m256)sum);
#else
    return sum + value * weights;   /* no fused multiply-add: every shape multiplies and adds alike */
#endif
}

/* Panels one vector wide (PANEL_WIDTH = WIDTH outputs): every vector of a block's sums reads its own
 * panel, a stream of its own through memory. Measured on an AVX2 EPYC (the linear layers of a
 * SmolLM2 pass, one thread): with 16-wide panels a block over one panel streamed at 17 GB/s and one
 * over two at 22, and the blocks that fit the registers for 4-6 rows cover one panel (4 rows cost
 * 1.35 one-row passes, 6 rows 1.5); with 8-wide panels a block covers as many streams as it has
 * vectors (4 rows 1.15, 6 rows 1.25; one row, over 8 streams, 8% faster). */
#define PANEL_WIDTH WIDTH
/* Register blocking, by the vector registers the CPU has: a block's sums (rows x vectors) and, where
 * IN_REGISTERS, its weights (vectors) and one broadcast input must fit, or multiply-adds go through
 * memory: AVX-512 (32 registers) holds up to 12 rows over 4 vectors. AVX2 (16 registers): up to 6
 * rows in one block, over 8 vectors for 1 row, 6 for 2, 4 for 3 (the weights read as operands of the
 * multiply-adds), 3 for 4 and 2 for 5-6 (the weights held in registers: as operands, re-read once a
 * row, the loads outnumbered the multiply-adds, 55 against 80 GFLOP/s over weights in cache at 4 rows).
 * More rows run in blocks of balanced size (8 rows as 4 + 4) over a slab of vectors small enough to
 * stay in cache, so the weights still come from memory once. */
#ifdef __AVX512F__
#define BLOCK_ROWS 12
#define BLOCK_VECTORS(rows) ((rows) <= 6 ? 4 : 2)
#define IN_REGISTERS(rows) 0
#define PREFETCH_STEPS 16   /* inputs ahead (a 64-byte line each) */
#define SLAB_VECTORS 4      /* vectors every row block reads before the next slab */
#else
#define BLOCK_ROWS 6
#define BLOCK_VECTORS(rows) ((rows) == 1 ? 8 : (rows) == 2 ? 6 : (rows) == 3 ? 4 : (rows) == 4 ? 3 : 2)
#ifdef __AVX__
#define IN_REGISTERS(rows) ((rows) >= 4)
#else
#define IN_REGISTERS(rows) 0   /* a vector is two SSE registers: leave the allocation to the compiler */
#endif
#define PREFETCH_STEPS 32   /* inputs ahead (half a 64-byte line each) */
#define SLAB_VECTORS 12
#endif
/* The weights' software prefetches: non-temporal on AMD's Zen (measured on the AVX2 EPYC, where the
 * weights are read once a pass), into every cache level elsewhere: on an Intel Xeon (AVX-512, AMX)
 * non-temporal prefetches made 2-12 rows cost 2-3 one-row products even over weights in cache, and
 * a 2-token SmolLM2 pass about 2.4 one-token passes (1.03-1.04 with these, 1.08 with none) */
#if defined(__znver1__) || defined(__znver2__) || defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
#define PREFETCH_LOCALITY 0
#else
#define PREFETCH_LOCALITY 3
#endif
#define MAX_ROWS 12
#define MAX_VECTORS 8

/* one vector of a panel's weights at element `index`: float32, or fp16 widened (`half`, a constant
 * in every caller, so each kernel is compiled with one kind of load and no branch) */
static inline __attribute__((always_inline)) lanes load_weights(const char *w, size_t index, const int half) {
#if defined(__F16C__)
    if (half) {
#ifdef __AVX512F__
        return (lanes)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 2 * index)));
#else
        return (lanes)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * index)));
#endif
    }
#else
    (void)half;
#endif
    return *(const lanes *)(w + 4 * index);
}

/* rows x vectors sums: x's rows times panels 0 .. vectors - 1 from w, into out's rows (n_size apart) */
static inline __attribute__((always_inline)) void block(const float *x, size_t k_size, const char *w,
                                                        float *out, size_t n_size, const int rows, const int vectors,
                                                        const int half) {
    lanes sums[MAX_VECTORS][MAX_ROWS];
    for (int v = 0; v < vectors; v++)
        for (int m = 0; m < rows; m++) sums[v][m] = (lanes){0};
    const size_t element = half ? 2 : 4, steps_a_line = 64 / (PANEL_WIDTH * element);
    for (size_t k = 0; k < k_size; k++) {
        /* with 2 rows or more, each panel's line PREFETCH_STEPS inputs ahead: with the hardware's
         * prefetcher alone a 3-token SmolLM2 pass cost 1.24 one-token passes on the AVX2 EPYC, with
         * this 1.10; a single row streams as fast without (these instructions slowed it about 10%) */
        if (rows > 1 && k % steps_a_line == 0)
            for (int v = 0; v < vectors; v++)
                __builtin_prefetch(w + ((size_t)v * k_size + k + PREFETCH_STEPS) * PANEL_WIDTH * element, 0,
                                   PREFETCH_LOCALITY);
        lanes weights[MAX_VECTORS];
        for (int v = 0; v < vectors; v++) {
            weights[v] = load_weights(w, ((size_t)v * k_size + k) * PANEL_WIDTH, half);
            if (IN_REGISTERS(rows)) __asm__("" : "+x"(weights[v]));   /* a register, not an operand per row */
        }
        for (int m = 0; m < rows; m++) {
            float value = x[m * k_size + k];
            for (int v = 0; v < vectors; v++) sums[v][m] = fused(sums[v][m], value, weights[v]);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int v = 0; v < vectors; v++) *(lanes *)(out + m * n_size + v * PANEL_WIDTH) = sums[v][m];
}

/* panels v0 .. v1 - 1 for `rows` rows (a constant in each case), BLOCK_VECTORS(rows) at a time,
 * the rest one at a time */
static inline __attribute__((always_inline)) void rows_through(const float *x, size_t k_size, const char *w,
                                                               size_t v0, size_t v1, float *out, size_t n_size,
                                                               const int rows, const int half) {
    const int vectors = BLOCK_VECTORS(rows);
    const size_t panel_bytes = k_size * PANEL_WIDTH * (half ? 2 : 4);
    size_t v = v0;
    for (; v + vectors <= v1; v += vectors)
        block(x, k_size, w + v * panel_bytes, out + v * PANEL_WIDTH, n_size, rows, vectors, half);
    for (; v < v1; v++) block(x, k_size, w + v * panel_bytes, out + v * PANEL_WIDTH, n_size, rows, 1, half);
}

#define ROWS_CASE(n) case n: rows_through(x, k_size, w, v0, v1, out, n_size, n, half); break;

static inline __attribute__((always_inline)) void some_rows(const float *x, size_t rows, size_t k_size, const char *w,
                                                            size_t v0, size_t v1, float *out, size_t n_size,
                                                            const int half) {
    switch (rows) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6)
#if BLOCK_ROWS > 6   /* only the row counts a block can have: the others would be dead code */
        ROWS_CASE(7) ROWS_CASE(8) ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12)
#endif
        default: break;
    }
}

static inline __attribute__((always_inline)) void all_rows(const float *x, long m_size, long k_size, const char *panels,
                                                           long n16, float *out, const int half) {
    const size_t n_panels = (size_t)n16 / PANEL_WIDTH;
    if (m_size <= BLOCK_ROWS) {   /* one block of rows: the weights stream through once */
        some_rows(x, (size_t)m_size, (size_t)k_size, panels, 0, n_panels, out, (size_t)n16, half);
        return;
    }
    for (size_t v0 = 0; v0 < n_panels; v0 += SLAB_VECTORS) {
        const size_t v1 = n_panels - v0 < SLAB_VECTORS ? n_panels : v0 + SLAB_VECTORS;
        long blocks_left = (m_size + BLOCK_ROWS - 1) / BLOCK_ROWS;
        for (long m0 = 0, rows = 0; m0 < m_size; m0 += rows, blocks_left--) {
            rows = (m_size - m0 + blocks_left - 1) / blocks_left;
            some_rows(x + m0 * k_size, (size_t)rows, (size_t)k_size, panels, v0, v1, out + m0 * n16, (size_t)n16,
                      half);
        }
    }
}

int specd_panel_width(void) { return PANEL_WIDTH; }

void specd_rows_linear(const float *x, long m_size, long k_size, const float *panels, long n16, float *out) {
    all_rows(x, m_size, k_size, (const char *)panels, n16, out, 0);
}

#if defined(__F16C__)
void specd_rows_linear_half(const float *x, long m_size, long k_size, const unsigned short *panels, long n16,
                            float *out) {
    all_rows(x, m_size, k_size, (const char *)panels, n16, out, 1);
}
#endif

/* ---- a decoder layer in one call (specd.model.fused_layer) ----------------------------------
 * A Llama layer at a few positions: input = attn_norm(x) (a target's block), or, with an embedding
 * table, [input_norm(embedding of the next token), hidden_norm(x)] (EAGLE-3's first layer, twice
 * the width); attention (rotary, grouped heads) over the slot's cache after writing these
 * positions' keys and values, each position seeing the keys up to its own; then x + attention,
 * post_norm, SwiGLU MLP, residual. Its four products run through the kernel above; the rest is a
 * few loops over the hidden width, where torch spends more time than on the products dispatching
 * about 40 small operations. Every position's result is computed alone, in a fixed order, so it has
 * the same bits however many positions and rows share the call (as the products do). */
typedef struct {
    long hidden, heads, kv_heads, head_dim, inter, max_seq;
    float eps;
    const float *embedding;      /* NULL: a target's block (input_norm is its attn_norm) */
    const float *input_norm, *hidden_norm, *post_norm;
    const float *cos, *sin;      /* [positions, head_dim / 2] */
    const void *panels[4];       /* qkv, o, gate_up, down, in the kernel's layout */
    long padded[4];              /* their output features, padded to whole panels */
    long half[4];                /* 1: fp16 panels */
} specd_layer_t;

static void any_linear(const float *x, long rows, long k_size, const specd_layer_t *layer, int which, float *out) {
#if defined(__F16C__)
    if (layer->half[which]) {
        specd_rows_linear_half(x, rows, k_size, layer->panels[which], layer->padded[which], out);
        return;
    }
#endif
    specd_rows_linear(x, rows, k_size, layer->panels[which], layer->padded[which], out);
}

static void rms_norm(const float *x, long n, const float *weight, float eps, float *out) {
    float sum = 0.0f;
    for (long i = 0; i < n; i++) sum += x[i] * x[i];
    const float scale = 1.0f / sqrtf(sum / (float)n + eps);
    for (long i = 0; i < n; i++) out[i] = x[i] * scale * weight[i];
}

static void rotate(float *x, long half, const float *cos, const float *sin) {  /* HF's rotate_half layout */
    for (long i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

typedef int int_lanes __attribute__((vector_size(WIDTH * 4), aligned(4)));

/* e^x for x in [-87, 88] (callers clamp), lane by lane: x = n ln 2 + r, |r| <= ln 2 / 2, e^r by
 * Cephes's degree-6 polynomial (about 1 ulp), 2^n from n's bits. A plain expf loop does not
 * vectorize, and a drafting step or a target block calls it thousands of times. */
static inline __attribute__((always_inline)) lanes exp_lanes(lanes x) {
    const float round = 12582912.0f;   /* 1.5 * 2^23: added and taken away, rounds to an integer */
    const lanes n = (x * 1.44269504088896341f + round) - round;
    const lanes r = x - n * 0.693359375f + n * 2.12194440e-4f;
    lanes p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const int_lanes bits = (__builtin_convertvector(n, int_lanes) + 127) << 23;
    lanes scale;
    memcpy(&scale, &bits, sizeof scale);
    return (p * r * r + r + 1.0f) * scale;
}

static inline float clamped(float x) { return x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x); }

/* a . b in a fixed order: two vectors of partial sums (a plain float loop would not vectorize, its
 * sum being one long chain), then their lanes, then the tail */
static float dot(const float *a, const float *b, long n) {
    lanes even = {0}, odd = {0};
    long i = 0;
    for (; i + 2 * WIDTH <= n; i += 2 * WIDTH) {
        even += *(const lanes *)(a + i) * *(const lanes *)(b + i);
        odd += *(const lanes *)(a + i + WIDTH) * *(const lanes *)(b + i + WIDTH);
    }
    even += odd;
    float sum = 0.0f;
    for (int lane = 0; lane < WIDTH; lane++) sum += even[lane];
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* one query head over keys 0..last of its key head: softmax(q.k / sqrt(d)) . v into out */
static void attend(const float *q, const float *keys, const float *values, long last, long dim, float *scores,
                   float *out) {
    const float scale = 1.0f / sqrtf((float)dim);
    float top = -INFINITY, total = 0.0f;
    for (long j = 0; j <= last; j++) {
        scores[j] = dot(q, keys + j * dim, dim) * scale;
        top = scores[j] > top ? scores[j] : top;
    }
    long j = 0;   /* scores has WIDTH floats of room past last */
    for (; j <= last; j++) scores[j] = clamped(scores[j] - top);
    for (; j % WIDTH != 0; j++) scores[j] = -87.0f;
    for (long at = 0; at < j; at += WIDTH) *(lanes *)(scores + at) = exp_lanes(*(const lanes *)(scores + at));
    for (j = 0; j <= last; j++) total += scores[j];
    memset(out, 0, (size_t)dim * sizeof(float));
    for (long j = 0; j <= last; j++) {
        const float weight = scores[j] / total;
        for (long i = 0; i < dim; i++) out[i] += weight * values[j * dim + i];
    }
}

/* rotate q and k of every row in qkv [rows, padded[0]], write k and v into the caches, then attend */
static void attention(const specd_layer_t *layer, long rows, long length, float *qkv, const long *positions,
                      float *k_cache, float *v_cache, float *scores, float *attended) {
    const long dim = layer->head_dim, half = dim / 2, q_size = layer->heads * dim, kv_size = layer->kv_heads * dim;
    const long groups = layer->heads / layer->kv_heads, slot_size = layer->kv_heads * layer->max_seq * dim;
    for (long r = 0; r < rows; r++) {  /* every position written before any attends */
        float *q = qkv + r * layer->padded[0], *k = q + q_size, *v = k + kv_size;
        const float *cos = layer->cos + positions[r] * half, *sin = layer->sin + positions[r] * half;
        for (long h = 0; h < layer->heads; h++) rotate(q + h * dim, half, cos, sin);
        for (long g = 0; g < layer->kv_heads; g++) {
            rotate(k + g * dim, half, cos, sin);
            const long at = (r / length) * slot_size + (g * layer->max_seq + positions[r]) * dim;
            memcpy(k_cache + at, k + g * dim, (size_t)dim * sizeof(float));
            memcpy(v_cache + at, v + g * dim, (size_t)dim * sizeof(float));
        }
    }
    for (long r = 0; r < rows; r++)
        for (long h = 0; h < layer->heads; h++) {
            const long at = (r / length) * slot_size + (h / groups) * layer->max_seq * dim;
            attend(qkv + r * layer->padded[0] + h * dim, k_cache + at, v_cache + at, positions[r], dim, scores,
                   attended + r * q_size + h * dim);
        }
}

/* rows = batch x length positions; x and out [rows, hidden]; tokens (read with an embedding only)
 * and positions [rows]; the caches [batch slots, kv_heads, max_seq, head_dim] from the first slot.
 * Returns 0, or -1 without memory (out untouched). */
int specd_layer(const specd_layer_t *layer, long batch, long length, const float *x, const long *tokens,
                const long *positions, float *k_cache, float *v_cache, float *out) {
    const long hidden = layer->hidden, rows = batch * length, q_size = layer->heads * layer->head_dim;
    const long width = layer->embedding != NULL ? 2 * hidden : hidden, *padded = layer->padded;
    float *input = malloc(sizeof(float) * (size_t)(rows * (width + padded[0] + q_size + padded[1] + hidden + padded[2]
                                                            + layer->inter + padded[3]) + layer->max_seq + WIDTH));
    if (input == NULL) return -1;
    float *qkv = input + rows * width, *attended = qkv + rows * padded[0], *o = attended + rows * q_size;
    float *normed = o + rows * padded[1], *gate_up = normed + rows * hidden, *act = gate_up + rows * padded[2];
    float *down = act + rows * layer->inter, *scores = down + rows * padded[3];
    for (long r = 0; r < rows; r++) {
        if (layer->embedding == NULL) {
            rms_norm(x + r * hidden, hidden, layer->input_norm, layer->eps, input + r * width);
            continue;
        }
        rms_norm(layer->embedding + tokens[r] * hidden, hidden, layer->input_norm, layer->eps, input + r * width);
        rms_norm(x + r * hidden, hidden, layer->hidden_norm, layer->eps, input + r * width + hidden);
    }
    any_linear(input, rows, width, layer, 0, qkv);
    attention(layer, rows, length, qkv, positions, k_cache, v_cache, scores, attended);
    any_linear(attended, rows, q_size, layer, 1, o);
    for (long r = 0; r < rows; r++) {
        for (long i = 0; i < hidden; i++) out[r * hidden + i] = x[r * hidden + i] + o[r * padded[1] + i];
        rms_norm(out + r * hidden, hidden, layer->post_norm, layer->eps, normed + r * hidden);
    }
    any_linear(normed, rows, hidden, layer, 2, gate_up);
    for (long r = 0; r < rows; r++) {   /* silu(gate) * up, WIDTH lanes at a time, the tail alone */
        const float *gate = gate_up + r * padded[2], *up = gate + layer->inter;
        float *to = act + r * layer->inter;
        long i = 0;
        for (; i + WIDTH <= layer->inter; i += WIDTH) {
            lanes minus;
            for (int lane = 0; lane < WIDTH; lane++) minus[lane] = clamped(-gate[i + lane]);
            *(lanes *)(to + i) = *(const lanes *)(gate + i) / (1.0f + exp_lanes(minus)) * *(const lanes *)(up + i);
        }
        for (; i < layer->inter; i++) to[i] = gate[i] / (1.0f + expf(clamped(-gate[i]))) * up[i];
    }
    any_linear(act, rows, layer->inter, layer, 3, down);
    for (long r = 0; r < rows; r++)
        for (long i = 0; i < hidden; i++) out[r * hidden + i] += down[r * padded[3] + i];
    free(input);
    return 0;
}
