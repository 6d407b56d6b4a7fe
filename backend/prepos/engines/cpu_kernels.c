/* The torch engine's decode step on CPU, float32: the GEMV of every weight matrix and the attention of
 * one new token over a session's cached keys and values.
 *
 * Built with -O3 -march=native -ffast-math -fopenmp by prepos/engines/cpu_kernels.py, on the machine that
 * runs it: the compiler vectorises the fixed-width loops for that CPU, and expf through its vector
 * maths library. OpenMP is the libgomp torch already loaded, so these loops run on torch's threads.
 */

#include <math.h>

int prepos_kernels_abi(void) { return 2; }

/* y = alpha * (x @ W) [+ residual]. W is packed in 32-column blocks, [blocks, k, 32] row-major: block c
 * holds outputs 32c..32c+31 and is one contiguous run of memory. Each thread takes a contiguous range of
 * blocks (schedule static), so each streams its own part of the matrix front to back, which is all a
 * memory-bound GEMV needs. Two rows per iteration, each into its own 32-float accumulator, keep two
 * independent FMA chains per vector register. */
void prepos_gemv32(const float *restrict w, const float *restrict x, float *restrict y,
                   const float *restrict residual, float alpha, long blocks, long k, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (long c = 0; c < blocks; c++) {
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
void prepos_decode_attention(const float *restrict q, const float *restrict k, const float *restrict v,
                             float *restrict out, float *restrict work, long kv_heads, long group,
                             long head_dim, long n, long head_stride, float scale, int threads) {
  const long chunks = (n + ATTN_CHUNK - 1) / ATTN_CHUNK, stride = head_dim + 2;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (long item = 0; item < kv_heads * chunks; item++) {
    const long kv = item / chunks, j0 = (item % chunks) * ATTN_CHUNK;
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
  for (long kv = 0; kv < kv_heads; kv++) {
    for (long g = 0; g < group; g++) {
      float m = work[(kv * chunks * group + g) * stride]; /* chunk 0's max (no infinities under -ffast-math) */
      for (long c = 1; c < chunks; c++) {
        const float mc = work[((kv * chunks + c) * group + g) * stride];
        m = mc > m ? mc : m;
      }
      float l = 0.0f, *o = out + (kv * group + g) * head_dim;
      for (long d = 0; d < head_dim; d++) o[d] = 0.0f;
      for (long c = 0; c < chunks; c++) {
        const float *slot = work + ((kv * chunks + c) * group + g) * stride;
        const float f = expf(slot[0] - m);
        l += f * slot[1];
        for (long d = 0; d < head_dim; d++) o[d] += f * slot[2 + d];
      }
      for (long d = 0; d < head_dim; d++) o[d] /= l;
    }
  }
}
