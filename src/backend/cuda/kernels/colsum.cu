// Deterministic column sums over rows, for the RMSNorm weight gradient and the bias
// gradient: each block sums a fixed chunk of rows per column into f32 partials, then one
// pass adds the partials in chunk order. No float atomics, so every run gives the same bits.
#include "common.cuh"

// partials[chunk, c] = Σ_{n in chunk} term(n, c), with term = dy (bias) or dy · x · rstd
// (RMSNorm weight). Grid: (ceil(C / blockDim.x), chunks).
template <typename T, bool NORM>
__global__ void colsum_partial(float* partials, const T* dy, const T* x, const float* rstd,
                               int rows, int C, int rows_per_chunk) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int first = blockIdx.y * rows_per_chunk;
    const int last = min(rows, first + rows_per_chunk);
    float acc = 0.0f;
    for (int n = first; n < last; n++) {
        const long long at = (long long)n * C + c;
        acc += NORM ? to_f32(dy[at]) * to_f32(x[at]) * rstd[n] : to_f32(dy[at]);
    }
    partials[(long long)blockIdx.y * C + c] = acc;
}

// out[c] (+)= Σ_chunk partials[chunk, c], in chunk order.
template <typename T>
__global__ void colsum_finish(T* out, const float* partials, int chunks, int C, int accumulate) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float acc = accumulate ? to_f32(out[c]) : 0.0f;
    for (int k = 0; k < chunks; k++) acc += partials[(long long)k * C + c];
    out[c] = from_f32<T>(acc);
}
