// SwiGLU, out = silu(gate) ⊙ up, with gate and up side by side in one [N, 2F] row.
#include "common.cuh"

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename T>
__global__ void swiglu_forward(T* out, const T* gate_up, long long rows, int F) {
    const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (idx >= rows * F) return;
    const long long n = idx / F;
    const int i = (int)(idx % F);
    const float g = to_f32(gate_up[n * 2 * F + i]), u = to_f32(gate_up[n * 2 * F + F + i]);
    out[idx] = from_f32<T>(g * sigmoid(g) * u);
}

// d gate = dout · up · σ(g)(1 + g(1 − σ(g))), d up = dout · silu(g).
template <typename T>
__global__ void swiglu_backward(T* dgate_up, const T* dout, const T* gate_up, long long rows,
                                int F) {
    const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (idx >= rows * F) return;
    const long long n = idx / F;
    const int i = (int)(idx % F);
    const float g = to_f32(gate_up[n * 2 * F + i]), u = to_f32(gate_up[n * 2 * F + F + i]);
    const float dy = to_f32(dout[idx]);
    const float s = sigmoid(g);
    dgate_up[n * 2 * F + i] = from_f32<T>(dy * u * s * (1.0f + g * (1.0f - s)));
    dgate_up[n * 2 * F + F + i] = from_f32<T>(dy * g * s);
}
