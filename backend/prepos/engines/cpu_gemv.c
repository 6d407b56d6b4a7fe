/* Decode GEMV of the torch engine on CPU: y = alpha * (x @ W) [+ residual], float32.
 *
 * W is packed in 32-column blocks, [blocks, k, 32] row-major: block c holds outputs 32c..32c+31 and is one
 * contiguous run of memory. Each thread takes a contiguous range of blocks (schedule static), so the two
 * (or n) threads each stream their own part of the matrix front to back, which is all a memory-bound
 * GEMV needs. Two rows per iteration, each into its own 32-float accumulator, keep two independent FMA
 * chains per vector register; the compiler vectorises the 32-wide loops for the machine it runs on
 * (built with -march=native by prepos/engines/cpu_gemv.py).
 */

int prepos_gemv_abi(void) { return 1; }

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
