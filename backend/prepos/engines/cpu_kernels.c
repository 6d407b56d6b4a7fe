/* The torch engine's decode step on CPU, float32: the GEMV of every weight matrix and the attention of
 * one new token over a session's cached keys and values; prefill's matrix products (GEMM) on the same
 * packed matrices; and the greedy vocabulary scan of a distribution (prepos/scan_cpu.py).
 *
 * Built with -O3 -march=native -ffast-math -fopenmp by prepos/engines/cpu_kernels.py, on the machine that
 * runs it: the compiler vectorises the fixed-width loops for that CPU, and expf through its vector
 * maths library. OpenMP is the libgomp torch already loaded, so these loops run on torch's threads.
 */

#include <math.h>
#include <stdint.h>

int prepos_kernels_abi(void) { return 8; }

/* y = alpha * (x @ W) [+ residual]. W is packed in 32-column blocks, [blocks, k, 32] row-major: block c
 * holds outputs 32c..32c+31 and is one contiguous run of memory. Each thread takes a contiguous range of
 * blocks (schedule static), so each streams its own part of the matrix front to back, which is all a
 * memory-bound GEMV needs. Two rows per iteration, each into its own 32-float accumulator, keep two
 * independent FMA chains per vector register. */
/* Block c of y = alpha * (x @ W) [+ residual] (residual may be y itself: each element is read before written). */
static inline void gemv_block(const float *restrict w, const float *restrict x, float *y, const float *residual,
                              float alpha, long c, long k) {
  const float *wc = w + c * k * 32;
  float a[32] = {0}, b[32] = {0};
  long i = 0;
  for (; i + 1 < k; i += 2) {
    const float x0 = x[i], x1 = x[i + 1];
    const float *r0 = wc + i * 32, *r1 = r0 + 32;
    for (int j = 0; j < 32; j++) a[j] += x0 * r0[j];
    for (int j = 0; j < 32; j++) b[j] += x1 * r1[j];
  }
  if (i < k) {
    const float x0 = x[i], *r0 = wc + i * 32;
    for (int j = 0; j < 32; j++) a[j] += x0 * r0[j];
  }
  float *out = y + c * 32;
  if (residual) {
    const float *res = residual + c * 32;
    for (int j = 0; j < 32; j++) out[j] = res[j] + alpha * (a[j] + b[j]);
  } else {
    for (int j = 0; j < 32; j++) out[j] = alpha * (a[j] + b[j]);
  }
}

void prepos_gemv32(const float *restrict w, const float *restrict x, float *restrict y,
                   const float *restrict residual, float alpha, long blocks, long k, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (long c = 0; c < blocks; c++) gemv_block(w, x, y, residual, alpha, c, k);
}

/* Rows per GEMM tile: a tile keeps rows x 32 accumulators in vector registers, two 512-bit registers per row
 * with AVX-512 (32 of them), so 8 rows; with 256-bit AVX2 (16 registers) 3 rows ran fastest (2 rows leave
 * too few independent FMA chains, 4 spill), and other machines take 3 too. */
#if defined(__AVX512F__)
#define GEMM_ROWS 8
#else
#define GEMM_ROWS 3
#endif
#define GEMM_PANEL (8 * GEMM_ROWS) /* rows per work item, so many threads share a matrix of few blocks */

/* Rows r0..r0+rows-1 of block c: y[r] = scale[r] * (x[r] @ W_c) [+ residual[r]] (scale null: 1; residual may
 * be y itself). With all GEMM_ROWS rows the tile's accumulators stay in registers while the block's k x 32
 * floats stream past from cache: per k, one row of the block and one broadcast x value per row. */
static inline void gemm_tile(const float *restrict wc, const float *restrict x, float *y, const float *residual,
                             const float *restrict scale, long r0, long rows, long k, long ldy) {
  float acc[GEMM_ROWS][32];
  for (int r = 0; r < GEMM_ROWS; r++)
    for (int j = 0; j < 32; j++) acc[r][j] = 0.0f;
  const float *xr = x + r0 * k;
  if (rows == GEMM_ROWS) {
    for (long i = 0; i < k; i++) {
      const float *w = wc + i * 32;
      for (int r = 0; r < GEMM_ROWS; r++) {
        const float xv = xr[r * k + i];
        for (int j = 0; j < 32; j++) acc[r][j] += xv * w[j];
      }
    }
  } else {
    for (long i = 0; i < k; i++) {
      const float *w = wc + i * 32;
      for (long r = 0; r < rows; r++) {
        const float xv = xr[r * k + i];
        for (int j = 0; j < 32; j++) acc[r][j] += xv * w[j];
      }
    }
  }
  for (long r = 0; r < rows; r++) {
    const float s = scale ? scale[r0 + r] : 1.0f;
    float *out = y + (r0 + r) * ldy;
    if (residual) {
      const float *res = residual + (r0 + r) * ldy;
      for (int j = 0; j < 32; j++) out[j] = res[j] + s * acc[r][j];
    } else {
      for (int j = 0; j < 32; j++) out[j] = s * acc[r][j];
    }
  }
}

/* y [n, blocks * 32] = scale[r] * (x [n, k] @ W) [+ residual [n, blocks * 32]], W packed as for the GEMV;
 * x, y and residual row-major and contiguous; scale (per row) and residual may be null; residual may be y.
 * A work item is one block over a panel of rows, items block by block, so each thread's items share its
 * blocks and a block is read from memory about once per panel. This is compute-bound where the GEMV is
 * memory-bound: the same weights serve every row of the tile. */
static void gemm_for(const float *restrict w, const float *restrict x, float *y, const float *residual,
                     const float *restrict scale, long n, long blocks, long k) {
  const long panels = (n + GEMM_PANEL - 1) / GEMM_PANEL, ldy = blocks * 32;
#pragma omp for schedule(static)
  for (long item = 0; item < blocks * panels; item++) {
    const long c = item / panels, p0 = (item % panels) * GEMM_PANEL;
    const long p1 = n < p0 + GEMM_PANEL ? n : p0 + GEMM_PANEL;
    for (long r0 = p0; r0 < p1; r0 += GEMM_ROWS)
      gemm_tile(w + c * k * 32, x, y + c * 32, residual ? residual + c * 32 : 0, scale, r0,
                p1 - r0 < GEMM_ROWS ? p1 - r0 : GEMM_ROWS, k, ldy);
  }
}

void prepos_gemm32(const float *restrict w, const float *restrict x, float *y, const float *residual,
                   const float *restrict scale, long n, long blocks, long k, int threads) {
#pragma omp parallel num_threads(threads)
  gemm_for(w, x, y, residual, scale, n, blocks, k);
}

#define ATTN_CHUNK 256 /* keys per work item */
#define ATTN_MAX_GROUP 16
#define ATTN_MAX_HEAD_DIM 256

/* Attention of one token: out[h] = softmax(q[h] . K[kv]^T * scale) V[kv] for query head h = kv * group + g.
 * K and V of kv head kv, key j, sit at k + kv * head_stride + j * head_dim (likewise v). The keys of each kv
 * head are cut into chunks of ATTN_CHUNK; a work item is one (kv head, chunk), so two threads share even
 * one kv head's keys. An item scores its keys for the group's query heads, takes its own max and sum of
 * exponentials and its weighted sum of values into work ([kv_heads * chunks, group, head_dim + 2]); the
 * items of a head are then merged, each rescaled by exp(its max - the head's max). */
static void attention_item(const float *restrict q, const float *restrict k, const float *restrict v,
                           float *restrict work, long item, long chunks, long group, long head_dim, long n,
                           long head_stride, float scale) {
  const long stride = head_dim + 2, kv = item / chunks, j0 = (item % chunks) * ATTN_CHUNK;
  const long len = n - j0 < ATTN_CHUNK ? n - j0 : ATTN_CHUNK;
  const float *kh = k + kv * head_stride + j0 * head_dim, *vh = v + kv * head_stride + j0 * head_dim;
  float p[ATTN_MAX_GROUP][ATTN_CHUNK];
  for (long g = 0; g < group; g++) {
    const float *qg = q + (kv * group + g) * head_dim;
    for (long j = 0; j < len; j++) {
      const float *kj = kh + j * head_dim;
      float s = 0.0f;
      for (long d = 0; d < head_dim; d++) s += qg[d] * kj[d];
      p[g][j] = s * scale;
    }
  }
  for (long g = 0; g < group; g++) {
    float m = p[g][0], l = 0.0f;
    for (long j = 1; j < len; j++) m = p[g][j] > m ? p[g][j] : m;
    for (long j = 0; j < len; j++) {
      p[g][j] = expf(p[g][j] - m);
      l += p[g][j];
    }
    float *slot = work + (item * group + g) * stride, *acc = slot + 2;
    float tmp[ATTN_MAX_HEAD_DIM] = {0};
    for (long j = 0; j < len; j++) {
      const float pj = p[g][j], *vj = vh + j * head_dim;
      for (long d = 0; d < head_dim; d++) tmp[d] += pj * vj[d];
    }
    slot[0] = m;
    slot[1] = l;
    for (long d = 0; d < head_dim; d++) acc[d] = tmp[d];
  }
}

/* Query head h = kv * group + g: its chunks' partial results merged into out[h]. */
static void attention_merge(const float *restrict work, float *restrict out, long h, long chunks, long group,
                            long head_dim) {
  const long stride = head_dim + 2, kv = h / group, g = h % group;
  float m = work[(kv * chunks * group + g) * stride]; /* chunk 0's max (no infinities under -ffast-math) */
  for (long c = 1; c < chunks; c++) {
    const float mc = work[((kv * chunks + c) * group + g) * stride];
    m = mc > m ? mc : m;
  }
  float l = 0.0f, *o = out + h * head_dim;
  for (long d = 0; d < head_dim; d++) o[d] = 0.0f;
  for (long c = 0; c < chunks; c++) {
    const float *slot = work + ((kv * chunks + c) * group + g) * stride;
    const float f = expf(slot[0] - m);
    l += f * slot[1];
    for (long d = 0; d < head_dim; d++) o[d] += f * slot[2 + d];
  }
  for (long d = 0; d < head_dim; d++) o[d] /= l;
}

/* Attention of one token: out[h] = softmax(q[h] . K[kv]^T * scale) V[kv] for query head h = kv * group + g.
 * K and V of kv head kv, key j, sit at k + kv * head_stride + j * head_dim (likewise v). The keys of each kv
 * head are cut into chunks of ATTN_CHUNK; a work item is one (kv head, chunk), so two threads share even
 * one kv head's keys. An item scores its keys for the group's query heads, takes its own max and sum of
 * exponentials and its weighted sum of values into work ([kv_heads * chunks, group, head_dim + 2]); the
 * items of a head are then merged, each rescaled by exp(its max - the head's max). */
void prepos_decode_attention(const float *restrict q, const float *restrict k, const float *restrict v,
                             float *restrict out, float *restrict work, long kv_heads, long group,
                             long head_dim, long n, long head_stride, float scale, int threads) {
  const long chunks = (n + ATTN_CHUNK - 1) / ATTN_CHUNK;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (long item = 0; item < kv_heads * chunks; item++)
      attention_item(q, k, v, work, item, chunks, group, head_dim, n, head_stride, scale);
#pragma omp for schedule(static)
    for (long h = 0; h < kv_heads * group; h++) attention_merge(work, out, h, chunks, group, head_dim);
  }
}

#define PREFILL_KEYS 64  /* keys per chunk */
#define PREFILL_ROWS 48  /* query rows (a query position for one head) per work item */

/* acc[r][c] = sum_i x[r][i] * w[i * ldw + c], c < 32, for the rows x[0..rows-1]: the GEMM tile with a row
 * pointer per row (rows of a work item are not evenly spaced) and a row stride for w. */
static inline void rows_tile(const float *const *x, const float *restrict w, long ldw, long k, long rows,
                             float acc[GEMM_ROWS][32]) {
  for (int r = 0; r < GEMM_ROWS; r++)
    for (int j = 0; j < 32; j++) acc[r][j] = 0.0f;
  if (rows == GEMM_ROWS) {
    for (long i = 0; i < k; i++) {
      const float *wi = w + i * ldw;
      for (int r = 0; r < GEMM_ROWS; r++) {
        const float xv = x[r][i];
        for (int j = 0; j < 32; j++) acc[r][j] += xv * wi[j];
      }
    }
  } else {
    for (long i = 0; i < k; i++) {
      const float *wi = w + i * ldw;
      for (long r = 0; r < rows; r++) {
        const float xv = x[r][i];
        for (int j = 0; j < 32; j++) acc[r][j] += xv * wi[j];
      }
    }
  }
}

/* Prefill attention: query i (position start + i) of head h = kv * group + g attends causally to keys
 * 0..start+i of kv head kv. q row i, head h at q + i * q_stride + h * head_dim; keys and values as for
 * prepos_decode_attention (they already hold the new positions); out [n, heads * head_dim] (each token's heads
 * side by side, as the o projection reads them). head_dim is a multiple of 32.
 * First every kv head's keys are transposed, in chunks of 64, into kt [kv_heads, chunks, head_dim, 64] (the
 * caller's scratch, zero-padded past the last key), once for all the items that read them. A work item is then
 * one kv head and up to PREFILL_ROWS query rows (the group's heads for each of a run of query positions), all
 * of which read the same keys; per chunk, the scores and then the values times the probabilities are register
 * tiles as in the GEMM (8 rows x 32 columns), and each row keeps a running max and sum (online softmax: the
 * earlier part of its output is rescaled by exp(old max - new max)). Items are handed out dynamically: under
 * the causal mask later positions have more keys. */
void prepos_prefill_attention(const float *restrict q, long q_stride, const float *restrict k,
                              const float *restrict v, float *restrict out, float *restrict kt_all,
                              long kv_heads, long group, long head_dim, long n, long start, long head_stride,
                              float scale, int threads) {
  const long per_item = group < PREFILL_ROWS ? PREFILL_ROWS / group : 1; /* query positions per item */
  const long tiles = (n + per_item - 1) / per_item, heads = kv_heads * group;
  const long chunks = (start + n + PREFILL_KEYS - 1) / PREFILL_KEYS, chunk_floats = head_dim * PREFILL_KEYS;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (long c = 0; c < kv_heads * chunks; c++) {
      const long j0 = (c % chunks) * PREFILL_KEYS;
      const long len = start + n - j0 < PREFILL_KEYS ? start + n - j0 : PREFILL_KEYS;
      const float *kh = k + (c / chunks) * head_stride + j0 * head_dim;
      float *kt = kt_all + c * chunk_floats;
      for (long j = 0; j < len; j++)
        for (long d = 0; d < head_dim; d++) kt[d * PREFILL_KEYS + j] = kh[j * head_dim + d];
      for (long d = 0; d < head_dim; d++)
        for (long j = len; j < PREFILL_KEYS; j++) kt[d * PREFILL_KEYS + j] = 0.0f;
    }
#pragma omp for schedule(dynamic, 1)
    for (long item = 0; item < kv_heads * tiles; item++) {
      const long kv = item / tiles, i0 = (item % tiles) * per_item;
      const long i1 = n < i0 + per_item ? n : i0 + per_item, rows = (i1 - i0) * group, keys = start + i1;
      const float *vh = v + kv * head_stride;
      const float *qrow[PREFILL_ROWS], *prow[PREFILL_ROWS];
      float *orow[PREFILL_ROWS], mx[PREFILL_ROWS], sum[PREFILL_ROWS];
      float p[PREFILL_ROWS][PREFILL_KEYS], acc[GEMM_ROWS][32];
      for (long r = 0; r < rows; r++) { /* row r: query position i0 + r / group, head kv * group + r % group */
        const long i = i0 + r / group, h = kv * group + r % group;
        qrow[r] = q + i * q_stride + h * head_dim;
        orow[r] = out + (i * heads + h) * head_dim;
        prow[r] = p[r];
        for (long d = 0; d < head_dim; d++) orow[r][d] = 0.0f;
      }
      for (long j0 = 0; j0 < keys; j0 += PREFILL_KEYS) {
        const long len = keys - j0 < PREFILL_KEYS ? keys - j0 : PREFILL_KEYS;
        const float *kt = kt_all + (kv * chunks + j0 / PREFILL_KEYS) * chunk_floats;
        for (long r0 = 0; r0 < rows; r0 += GEMM_ROWS) {
          const long tr = rows - r0 < GEMM_ROWS ? rows - r0 : GEMM_ROWS;
          for (long c0 = 0; c0 < PREFILL_KEYS; c0 += 32) {
            rows_tile(qrow + r0, kt + c0, PREFILL_KEYS, head_dim, tr, acc);
            for (long r = 0; r < tr; r++)
              for (int j = 0; j < 32; j++) p[r0 + r][c0 + j] = acc[r][j] * scale;
          }
        }
        for (long r = 0; r < rows; r++) {
          long lim = start + i0 + r / group + 1 - j0; /* keys of this chunk that the row's query sees */
          lim = lim < len ? lim : len;
          if (lim <= 0) { /* none: the row is unchanged */
            for (long j = 0; j < PREFILL_KEYS; j++) p[r][j] = 0.0f;
            continue;
          }
          float m = p[r][0];
          for (long j = 1; j < lim; j++) m = p[r][j] > m ? p[r][j] : m;
          float l = 0.0f;
          if (j0) { /* key 0 is in every row's first chunk: later chunks merge into the running max and sum */
            m = mx[r] > m ? mx[r] : m;
            const float f = expf(mx[r] - m);
            l = sum[r] * f;
            for (long d = 0; d < head_dim; d++) orow[r][d] *= f;
          }
          for (long j = 0; j < lim; j++) {
            p[r][j] = expf(p[r][j] - m);
            l += p[r][j];
          }
          for (long j = lim; j < PREFILL_KEYS; j++) p[r][j] = 0.0f;
          mx[r] = m;
          sum[r] = l;
        }
        for (long r0 = 0; r0 < rows; r0 += GEMM_ROWS) {
          const long tr = rows - r0 < GEMM_ROWS ? rows - r0 : GEMM_ROWS;
          for (long d0 = 0; d0 < head_dim; d0 += 32) {
            rows_tile(prow + r0, vh + j0 * head_dim + d0, head_dim, len, tr, acc);
            for (long r = 0; r < tr; r++)
              for (int j = 0; j < 32; j++) orow[r0 + r][d0 + j] += acc[r][j];
          }
        }
      }
      for (long r = 0; r < rows; r++) {
        const float inv = 1.0f / sum[r];
        for (long d = 0; d < head_dim; d++) orow[r][d] *= inv;
      }
    }
  }
}

static inline float rms_scale(const float *x, long n, float n_eps) {
  float s = 0.0f;
  for (long i = 0; i < n; i++) s += x[i] * x[i];
  return 1.0f / sqrtf(s + n_eps);
}

/* RoPE at one position: out[d] = x[d] cos[d] + x[d -/+ half] sin_signed[d] (rotate-half, sign folded in). */
static inline void rope(const float *x, float *out, const float *cos, const float *sin_signed, long head_dim) {
  const long half = head_dim / 2;
  for (long d = 0; d < half; d++) out[d] = x[d] * cos[d] + x[d + half] * sin_signed[d];
  for (long d = half; d < head_dim; d++) out[d] = x[d] * cos[d] + x[d - half] * sin_signed[d];
}

/* Every decoder layer of one token at position pos, in one parallel region: x [hidden] in, the residual stream
 * after the last layer out. Per layer: rmsnorm (its weight folded into the matrix) -> q/k/v -> RoPE, k and v
 * written into kv [layers, 2, kv_heads, cap, head_dim] at pos -> attention over positions 0..pos -> o + residual
 * -> rmsnorm -> gate/up -> silu(gate) * up -> down + residual. The matrices are packed in 32-column blocks;
 * scratch holds qkv, q and k after RoPE, the attention output, gate/up, the activation and the attention's
 * partial results (sizes in cpu_kernels.py). */
void prepos_decode_layers(float *restrict x, const float *const *wqkv, const float *const *wo,
                          const float *const *wgu, const float *const *wdown, float *restrict kv,
                          const float *restrict cos, const float *restrict sin_signed, float *restrict scratch,
                          long layers, long hidden, long heads, long kv_heads, long head_dim, long inter,
                          long cap, long pos, float n_eps, int threads) {
  const long group = heads / kv_heads, n = pos + 1, chunks = (n + ATTN_CHUNK - 1) / ATTN_CHUNK;
  const long qkv_width = (heads + 2 * kv_heads) * head_dim, head_stride = cap * head_dim;
  float *qkv = scratch, *qk = qkv + qkv_width, *attn = qk + (heads + kv_heads) * head_dim;
  float *gu = attn + heads * head_dim, *act = gu + 2 * inter, *work = act + inter;
  const float scale = 1.0f / sqrtf((float)head_dim);
#pragma omp parallel num_threads(threads)
  for (long i = 0; i < layers; i++) {
    float *k = kv + i * 2 * kv_heads * head_stride, *v = k + kv_heads * head_stride;
    const float r1 = rms_scale(x, hidden, n_eps);
#pragma omp for schedule(static)
    for (long c = 0; c < qkv_width / 32; c++) gemv_block(wqkv[i], x, qkv, 0, r1, c, hidden);
#pragma omp for schedule(static)
    for (long h = 0; h < heads + kv_heads; h++) {
      rope(qkv + h * head_dim, qk + h * head_dim, cos, sin_signed, head_dim);
      if (h >= heads) { /* this kv head's key (after RoPE) and value go into the cache at pos */
        const long j = h - heads;
        for (long d = 0; d < head_dim; d++) {
          k[j * head_stride + pos * head_dim + d] = qk[h * head_dim + d];
          v[j * head_stride + pos * head_dim + d] = qkv[(heads + kv_heads + j) * head_dim + d];
        }
      }
    }
#pragma omp for schedule(static)
    for (long item = 0; item < kv_heads * chunks; item++)
      attention_item(qk, k, v, work, item, chunks, group, head_dim, n, head_stride, scale);
#pragma omp for schedule(static)
    for (long h = 0; h < heads; h++) attention_merge(work, attn, h, chunks, group, head_dim);
#pragma omp for schedule(static)
    for (long c = 0; c < hidden / 32; c++) gemv_block(wo[i], attn, x, x, 1.0f, c, heads * head_dim);
    const float r2 = rms_scale(x, hidden, n_eps);
#pragma omp for schedule(static)
    for (long c = 0; c < 2 * inter / 32; c++) gemv_block(wgu[i], x, gu, 0, r2, c, hidden);
#pragma omp for schedule(static)
    for (long j = 0; j < inter; j++) {
      const float g = gu[j];
      act[j] = g / (1.0f + expf(-g)) * gu[inter + j];
    }
#pragma omp for schedule(static)
    for (long c = 0; c < hidden / 32; c++) gemv_block(wdown[i], act, x, x, 1.0f, c, inter);
  }
}

/* Every decoder layer of n tokens of n different sessions (a decode batch), in one parallel region: x [n, hidden]
 * in, the residual streams after the last layer out. Token b is at position pos[b] of its session, whose KV is
 * kv[b] ([layers, 2, kv_heads, cap[b], head_dim]); cos and sin_signed are RoPE's whole tables ([max positions,
 * head_dim]). Per layer as prepos_decode_layers, but each matrix product takes the n rows together (the GEMM's
 * tiles, so the weights are read once for the batch) and the attention's work items are (token, kv head,
 * chunk of keys) over all the tokens. scratch holds per token qkv, q and k after RoPE, the attention output,
 * gate/up and the activation, then the attention's partial results (sizes in cpu_kernels.py). */
void prepos_decode_layers_batch(float *restrict x, const float *const *wqkv, const float *const *wo,
                                const float *const *wgu, const float *const *wdown, float *const *kv,
                                const long *cap, const long *pos, const float *restrict cos,
                                const float *restrict sin_signed, float *restrict scratch, long n, long layers,
                                long hidden, long heads, long kv_heads, long head_dim, long inter, float n_eps,
                                int threads) {
  const long group = heads / kv_heads, qkv_width = (heads + 2 * kv_heads) * head_dim;
  const long qk_width = (heads + kv_heads) * head_dim, stride = head_dim + 2;
  long first[n + 1]; /* token b's attention items are first[b] .. first[b + 1] - 1 */
  first[0] = 0;
  for (long b = 0; b < n; b++) first[b + 1] = first[b] + kv_heads * ((pos[b] + ATTN_CHUNK) / ATTN_CHUNK);
  float *qkv = scratch, *qk = qkv + n * qkv_width, *attn = qk + n * qk_width, *gu = attn + n * heads * head_dim;
  float *act = gu + n * 2 * inter, *rows = act + n * inter, *work = rows + n;
  const float scale = 1.0f / sqrtf((float)head_dim);
#pragma omp parallel num_threads(threads)
  for (long i = 0; i < layers; i++) {
#pragma omp for schedule(static)
    for (long b = 0; b < n; b++) rows[b] = rms_scale(x + b * hidden, hidden, n_eps);
    gemm_for(wqkv[i], x, qkv, 0, rows, n, qkv_width / 32, hidden);
#pragma omp for schedule(static)
    for (long t = 0; t < n * (heads + kv_heads); t++) {
      const long b = t / (heads + kv_heads), h = t % (heads + kv_heads);
      const float *src = qkv + b * qkv_width;
      float *dst = qk + b * qk_width;
      rope(src + h * head_dim, dst + h * head_dim, cos + pos[b] * head_dim, sin_signed + pos[b] * head_dim,
           head_dim);
      if (h >= heads) { /* this kv head's key (after RoPE) and value go into the session's cache at pos[b] */
        const long j = h - heads, head_stride = cap[b] * head_dim;
        float *k = kv[b] + i * 2 * kv_heads * head_stride, *v = k + kv_heads * head_stride;
        for (long d = 0; d < head_dim; d++) {
          k[j * head_stride + pos[b] * head_dim + d] = dst[h * head_dim + d];
          v[j * head_stride + pos[b] * head_dim + d] = src[(heads + kv_heads + j) * head_dim + d];
        }
      }
    }
#pragma omp for schedule(static)
    for (long item = 0; item < first[n]; item++) {
      long b = 0;
      while (item >= first[b + 1]) b++;
      const long head_stride = cap[b] * head_dim, chunks = (first[b + 1] - first[b]) / kv_heads;
      const float *k = kv[b] + i * 2 * kv_heads * head_stride;
      attention_item(qk + b * qk_width, k, k + kv_heads * head_stride, work + first[b] * group * stride,
                     item - first[b], chunks, group, head_dim, pos[b] + 1, head_stride, scale);
    }
#pragma omp for schedule(static)
    for (long t = 0; t < n * heads; t++) {
      const long b = t / heads, chunks = (first[b + 1] - first[b]) / kv_heads;
      attention_merge(work + first[b] * group * stride, attn + b * heads * head_dim, t % heads, chunks, group,
                      head_dim);
    }
    gemm_for(wo[i], attn, x, x, 0, n, hidden / 32, heads * head_dim);
#pragma omp for schedule(static)
    for (long b = 0; b < n; b++) rows[b] = rms_scale(x + b * hidden, hidden, n_eps);
    gemm_for(wgu[i], x, gu, 0, rows, n, 2 * inter / 32, hidden);
#pragma omp for schedule(static)
    for (long t = 0; t < n * inter; t++) {
      const long b = t / inter, j = t % inter;
      const float g = gu[b * 2 * inter + j];
      act[t] = g / (1.0f + expf(-g)) * gu[b * 2 * inter + inter + j];
    }
    gemm_for(wdown[i], act, x, x, 0, n, hidden / 32, inter);
  }
}

/* Largest of x[0..n-1]; -inf when n is 0. */
static float max_of(const float *x, long n) {
  float m = -INFINITY;
  for (long i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
  return m;
}

/* The greedy vocabulary scan's numbers for n float32 logits, on the calling thread: out = [first position of
 * the max, the max, the second-largest value (the max again on a tie), S = sum exp(x - max),
 * T = sum exp(x - max) * (x - max)], from which p_max = 1 / S, the runner-up's probability exp(second - max) / S
 * and entropy = log S - T / S. Values more than 87 below the max count as 87 below it, a term under 1e-37.
 * Returns 1, leaving out unset, when n < 1, a value is NaN or +inf, or every value is -inf: the caller's
 * general scan then names the problem. Those checks read the bits, which -ffast-math leaves alone. */
int prepos_scan_greedy(const float *x, long n, double *out) {
  if (n < 1) return 1;
  const uint32_t *u = (const uint32_t *)x;
  uint32_t bad = 0, finite = 0;
  for (long i = 0; i < n; i++) {
    bad |= (u[i] & 0x7fffffffu) > 0x7f800000u || u[i] == 0x7f800000u;  /* NaN, +inf */
    finite |= u[i] != 0xff800000u;                                     /* not -inf */
  }
  if (bad || !finite) return 1;
  const float m = max_of(x, n);
  long arg = 0;
  while (x[arg] != m) arg++;
  const float a = max_of(x, arg), b = max_of(x + arg + 1, n - arg - 1);
  float s = 0.f, t = 0.f;
  for (long i = 0; i < n; i++) {
    const float d = fmaxf(x[i] - m, -87.f);
    const float e = expf(d);
    s += e;
    t += e * d;
  }
  out[0] = (double)arg;
  out[1] = m;
  out[2] = a > b ? a : b;
  out[3] = s;
  out[4] = t;
  return 0;
}
