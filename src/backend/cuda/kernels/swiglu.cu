// SwiGLU, out = silu(gate) ⊙ up, with gate and up side by side in one [N, 2F] row. With VEC,
// each thread moves 16 bytes of every operand at once (F·sizeof(T) is a multiple of 16). With
// `amax`, the forward reports max |out| and the backward max |dgate_up|, as stored
// (common.cuh).
#include "common.cuh"

// Each thread takes one unit: W consecutive columns of one row of the [rows, F] output, from
// column i of row n.
struct Unit {
    long long n;
    int i;
};
template <int W>
__device__ __forceinline__ Unit unit_at(long long unit, int F) {
    return {unit / (F / W), (int)(unit % (F / W)) * W};
}

// A unit's columns in the gate half and in the up half of row n of a [rows, 2F] tensor.
template <typename T, int W>
__device__ __forceinline__ void load_halves(float (&gate)[W], float (&up)[W], const T* x, Unit at,
                                            int F) {
    load_vec<T, W>(gate, x + at.n * 2 * F + at.i);
    load_vec<T, W>(up, x + at.n * 2 * F + F + at.i);
}
template <typename T, int W>
__device__ __forceinline__ void store_halves(T* x, const float (&gate)[W], const float (&up)[W],
                                             Unit at, int F) {
    store_vec<T, W>(x + at.n * 2 * F + at.i, gate);
    store_vec<T, W>(x + at.n * 2 * F + F + at.i, up);
}

template <typename T, bool VEC>
__global__ void swiglu_forward(T* out, const T* gate_up, long long rows, int F, float* amax) {
    constexpr int W = access_width<T, VEC>();
    const long long unit = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    float largest = 0.0f;
    // No early return: every thread of the block takes part in the abs-max reduction.
    if (unit < rows * F / W) {
        const Unit at = unit_at<W>(unit, F);
        float g[W], u[W], y[W];
        load_halves<T, W>(g, u, gate_up, at, F);
#pragma unroll
        for (int k = 0; k < W; k++) {
            y[k] = swiglu<T>(g[k], u[k]);
            largest = fmaxf(largest, fabsf(rounded<T>(y[k])));
        }
        store_vec<T, W>(out + at.n * F + at.i, y);
    }
    report_amax(amax, largest);
}

// d gate = dout · up · σ(g)(1 + g(1 − σ(g))), d up = dout · silu(g). In place when dgate_up
// is gate_up: a thread writes only the elements it has read.
template <typename T, bool VEC>
__global__ void swiglu_backward(T* dgate_up, const T* dout, const T* gate_up, long long rows,
                                int F, float* amax) {
    constexpr int W = access_width<T, VEC>();
    const long long unit = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    float largest = 0.0f;
    if (unit < rows * F / W) {
        const Unit at = unit_at<W>(unit, F);
        float g[W], u[W], dy[W], dg[W], du[W];
        load_halves<T, W>(g, u, gate_up, at, F);
        load_vec<T, W>(dy, dout + at.n * F + at.i);
#pragma unroll
        for (int k = 0; k < W; k++) {
            swiglu_grads<T>(g[k], u[k], dy[k], dg[k], du[k]);
            largest = fmaxf(largest, fmaxf(fabsf(rounded<T>(dg[k])), fabsf(rounded<T>(du[k]))));
        }
        store_halves<T, W>(dgate_up, dg, du, at, F);
    }
    report_amax(amax, largest);
}
