// Products of one row with a weight matrix, as generation runs each new token: y = x · Wᵀ
// (+ bias), W [N, K] as the weights are stored. One row's product is bound by reading W once,
// and by the host's time to enqueue it, which a plain launch keeps to a kernel's; cuBLASLt's
// call costs about twice that. A warp takes one output column: its lanes walk K, W values at
// a time, summing in f32, then add across the warp in a fixed order.
#include "common.cuh"

// Σ_k x[k] · w[k] over K values, on every lane of the warp.
template <typename T, int W>
__device__ __forceinline__ float warp_dot(const T* x, const T* w, int K) {
    const int lane = threadIdx.x % 32;
    float sum = 0.0f;
#pragma unroll 4
    for (int k = lane * W; k < K; k += 32 * W) {
        float a[W], b[W];
        load_vec<T, W>(a, x + k);
        load_vec<T, W>(b, w + k);
#pragma unroll
        for (int i = 0; i < W; i++) sum = fmaf(a[i], b[i], sum);
    }
    return warp_sum(sum);
}

// The output column of this warp, or -1 past N.
__device__ __forceinline__ int warp_column(int N) {
    const int n = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    return n < N ? n : -1;
}

// y [N] = x [K] · Wᵀ (+ bias [N], added in f32 before the one rounding, as cuBLASLt's
// epilogue does). With VEC, x and W's rows are 16-byte aligned and K a whole number of
// 16 bytes.
template <typename T, bool VEC>
__global__ void gemv(T* y, const T* x, const T* w, const T* bias, int N, int K) {
    constexpr int W = access_width<T, VEC>();
    const int n = warp_column(N);
    if (n < 0) return;
    float sum = warp_dot<T, W>(x, w + (long long)n * K, K);
    if (threadIdx.x % 32 == 0) {
        if (bias) sum += to_f32(bias[n]);
        y[n] = from_f32<T>(sum);
    }
}

// The gate/up projection with SwiGLU: gate_up [2F] = x · Wᵀ with W [2F, K], and out [F] the
// SwiGLU of each rounded (gate, up) pair, bitwise what swiglu.cu makes of gate_up. A warp
// takes column j of both halves.
template <typename T, bool VEC>
__global__ void gemv_swiglu(T* gate_up, T* out, const T* x, const T* w, int F, int K) {
    constexpr int W = access_width<T, VEC>();
    const int j = warp_column(F);
    if (j < 0) return;
    const float g = warp_dot<T, W>(x, w + (long long)j * K, K);
    const float u = warp_dot<T, W>(x, w + (long long)(F + j) * K, K);
    if (threadIdx.x % 32 == 0) {
        gate_up[j] = from_f32<T>(g);
        gate_up[F + j] = from_f32<T>(u);
        out[j] = from_f32<T>(swiglu<T>(rounded<T>(g), rounded<T>(u)));
    }
}
