// Softmax cross-entropy with z-loss over one chunk of logits [rows, V], fused with its
// gradient, which replaces the logits in place. One block per row; with VEC, each thread moves
// 16 bytes at a time (V·sizeof(T) is then a multiple of 16, so every row is aligned).
#include "common.cuh"

#define IGNORE_INDEX (-100)

// loss = lse − x[target] + z · lse². With `train`, the row becomes
// grad_scale · (softmax · (1 + 2 z lse) − onehot(target)); ignored rows get loss 0 (and a
// zero gradient). A target outside [0, V) gives a NaN loss.
template <typename T, bool VEC>
__global__ void cross_entropy(T* logits, float* losses, const int* targets, int V, float z_loss,
                              float grad_scale, int train) {
    constexpr int W = access_width<T, VEC>();
    const long long row = (long long)blockIdx.x * V;
    const int target = targets[blockIdx.x];
    if (target == IGNORE_INDEX) {
        if (threadIdx.x == 0) losses[blockIdx.x] = 0.0f;
        if (train) {
            const float zero[W] = {};
            for (int c = threadIdx.x * W; c < V; c += blockDim.x * W) store_vec<T, W>(logits + row + c, zero);
        }
        return;
    }
    // Online max and sum of exponentials per thread, then merged across the block.
    float m = NEG_INF, s = 0.0f;
    for (int c = threadIdx.x * W; c < V; c += blockDim.x * W) {
        float x[W];
        load_vec<T, W>(x, logits + row + c);
        float local = x[0];
#pragma unroll
        for (int k = 1; k < W; k++) local = fmaxf(local, x[k]);
        if (local > m) {
            s *= expf(m - local);
            m = local;
        }
#pragma unroll
        for (int k = 0; k < W; k++) s += expf(x[k] - m);
    }
    const float max = block_max(m);
    const float sum = block_sum(m == NEG_INF ? 0.0f : s * expf(m - max));
    const float lse = max + logf(sum);
    const bool valid = target >= 0 && target < V;
    if (threadIdx.x == 0) {
        losses[blockIdx.x] =
            valid ? lse - to_f32(logits[row + target]) + z_loss * lse * lse : QUIET_NAN;
    }
    if (!train) return;
    // Everyone has read the row (the max and sum above end with barriers) and thread 0 has
    // read the target logit; wait for it before overwriting.
    __syncthreads();
    const float softmax_scale = grad_scale * (1.0f + 2.0f * z_loss * lse);
    for (int c = threadIdx.x * W; c < V; c += blockDim.x * W) {
        float x[W];
        load_vec<T, W>(x, logits + row + c);
#pragma unroll
        for (int k = 0; k < W; k++) x[k] = expf(x[k] - lse) * softmax_scale - (c + k == target ? grad_scale : 0.0f);
        store_vec<T, W>(logits + row + c, x);
    }
}
