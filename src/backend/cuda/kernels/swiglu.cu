// SwiGLU, out = silu(gate) ⊙ up, with gate and up side by side in one [N, 2F] row. With VEC,
// each thread moves 16 bytes of every operand at once (F·sizeof(T) is a multiple of 16). With
// `amax`, the forward reports max |out| and the backward max |dgate_up|, as stored
// (common.cuh).
#include "common.cuh"

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename T, bool VEC>
__global__ void swiglu_forward(T* out, const T* gate_up, long long rows, int F, float* amax) {
    constexpr int W = access_width<T, VEC>();
    const long long unit = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    float largest = 0.0f;
    // No early return: every thread of the block takes part in the abs-max reduction.
    if (unit < rows * F / W) {
        const long long n = unit / (F / W);
        const int i = (int)(unit % (F / W)) * W;
        float g[W], u[W], y[W];
        load_vec<T, W>(g, gate_up + n * 2 * F + i);
        load_vec<T, W>(u, gate_up + n * 2 * F + F + i);
#pragma unroll
        for (int k = 0; k < W; k++) {
            y[k] = g[k] * sigmoid(g[k]) * u[k];
            largest = fmaxf(largest, fabsf(rounded<T>(y[k])));
        }
        store_vec<T, W>(out + n * F + i, y);
    }
    report_amax(amax, largest);
}

// d gate = dout · up · σ(g)(1 + g(1 − σ(g))), d up = dout · silu(g).
template <typename T, bool VEC>
__global__ void swiglu_backward(T* dgate_up, const T* dout, const T* gate_up, long long rows,
                                int F, float* amax) {
    constexpr int W = access_width<T, VEC>();
    const long long unit = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    float largest = 0.0f;
    if (unit < rows * F / W) {
        const long long n = unit / (F / W);
        const int i = (int)(unit % (F / W)) * W;
        float g[W], u[W], dy[W], dg[W], du[W];
        load_vec<T, W>(g, gate_up + n * 2 * F + i);
        load_vec<T, W>(u, gate_up + n * 2 * F + F + i);
        load_vec<T, W>(dy, dout + n * F + i);
#pragma unroll
        for (int k = 0; k < W; k++) {
            const float s = sigmoid(g[k]);
            dg[k] = dy[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
            du[k] = dy[k] * g[k] * s;
            largest = fmaxf(largest, fmaxf(fabsf(rounded<T>(dg[k])), fabsf(rounded<T>(du[k]))));
        }
        store_vec<T, W>(dgate_up + n * 2 * F + i, dg);
        store_vec<T, W>(dgate_up + n * 2 * F + F + i, du);
    }
    report_amax(amax, largest);
}
