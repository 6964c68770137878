// RMSNorm, y = x · rstd · w with rstd = 1/sqrt(mean(x²) + eps), optionally fused with the
// residual add that produces x; and its input gradient. The weight gradient is a column sum
// (colsum.cu). With `amax`, the forward also reports max |out| as stored (common.cuh).
//
// The plain and the fused forward are one kernel: the fused one first rounds `residual +
// branch` to T and stores it, then both normalize the same values with the same per-thread
// split and reduction tree, so their outputs and rstd agree bit for bit.
#include "common.cuh"

template <typename T, bool RESIDUAL>
__global__ void rmsnorm_forward(T* out, float* rstd, T* residual_out, const T* inp,
                                const T* branch, const T* weight, int C, float eps,
                                float* amax) {
    const long long row = (long long)blockIdx.x * C;
    float sum_sq = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float x;
        if (RESIDUAL) {
            const T sum = from_f32<T>(to_f32(inp[row + c]) + to_f32(branch[row + c]));
            residual_out[row + c] = sum;
            x = to_f32(sum);
        } else {
            x = to_f32(inp[row + c]);
        }
        sum_sq += x * x;
    }
    sum_sq = block_sum(sum_sq);
    const float r = 1.0f / sqrtf(sum_sq / (float)C + eps);
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
    // Each thread reads back only the elements it wrote itself, so no barrier is needed.
    const T* x_src = RESIDUAL ? residual_out : inp;
    float largest = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const T y = from_f32<T>(to_f32(x_src[row + c]) * r * to_f32(weight[c]));
        out[row + c] = y;
        largest = fmaxf(largest, fabsf(to_f32(y)));
    }
    report_amax(amax, largest);
}

// dinp += rstd · g − x · rstd³ · (g·x) / C with g = dout ⊙ w, one block per row.
template <typename T>
__global__ void rmsnorm_backward(T* dinp, const T* dout, const T* inp, const T* weight,
                                 const float* rstd, int C) {
    const long long row = (long long)blockIdx.x * C;
    float dot = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        dot += to_f32(dout[row + c]) * to_f32(weight[c]) * to_f32(inp[row + c]);
    dot = block_sum(dot);
    const float r = rstd[blockIdx.x];
    const float k = r * r * r * dot / (float)C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const float dy = to_f32(dout[row + c]), w = to_f32(weight[c]), x = to_f32(inp[row + c]);
        dinp[row + c] = from_f32<T>(to_f32(dinp[row + c]) + (r * dy * w - x * k));
    }
}
