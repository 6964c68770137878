// Softmax cross-entropy with z-loss over one chunk of logits [rows, V], fused with its
// gradient, which replaces the logits in place. Two kernels compute the same thing:
// `cross_entropy`, one block per row, reads the row twice (once for the log-sum-exp, once for
// the gradient), and `cross_entropy_cluster` (sm_90 on) holds the row in the registers of a
// cluster of blocks, so it reads it once: at 150k vocabulary entries the logits are 1.2 GB per
// chunk of 4096 rows, far past L2, and the kernel is bound by those bytes.
#include "common.cuh"

#define IGNORE_INDEX (-100)

// Both kernels' loss of a row with a valid target, softmax factor and logit gradient (the
// formulas of `cross_entropy`'s comment); p is a logit's softmax probability.
__device__ __forceinline__ float row_loss(float lse, float target_logit, float z_loss) {
    return lse - target_logit + z_loss * lse * lse;
}
__device__ __forceinline__ float softmax_scale(float grad_scale, float z_loss, float lse) {
    return grad_scale * (1.0f + 2.0f * z_loss * lse);
}
__device__ __forceinline__ float logit_grad(float p, float scale, bool is_target, float grad_scale) {
    return p * scale - (is_target ? grad_scale : 0.0f);
}

// loss = lse − x[target] + z · lse². In training (`grad_scale_at` not null) the row becomes
// grad_scale · (softmax · (1 + 2 z lse) − onehot(target)), the scale read from the device so
// that a recorded pass (a CUDA graph) takes each step's; ignored rows get loss 0 (and a zero
// gradient). A target outside [0, V) gives a NaN loss.
// One block per row; with VEC, each thread moves 16 bytes at a time (V·sizeof(T) is then a
// multiple of 16, so every row is aligned).
template <typename T, bool VEC>
__global__ void cross_entropy(T* logits, float* losses, const int* targets, int V, float z_loss,
                              const float* grad_scale_at) {
    constexpr int W = access_width<T, VEC>();
    const bool train = grad_scale_at != nullptr;
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
    // Online max and sum of exponentials per thread, then merged across the block. While a
    // thread has seen only -inf, its sum stays 0 (exp(-inf - -inf) would be NaN), as the
    // cluster kernel's and the CPU's do.
    float m = NEG_INF, s = 0.0f;
    for (int c = threadIdx.x * W; c < V; c += blockDim.x * W) {
        float x[W];
        load_vec<T, W>(x, logits + row + c);
        float local = x[0];
#pragma unroll
        for (int k = 1; k < W; k++) local = fmaxf(local, x[k]);
        const float m_new = fmaxf(m, local);
        if (m_new != NEG_INF) {
            if (m_new > m) s *= expf(m - m_new);
            m = m_new;
#pragma unroll
            for (int k = 0; k < W; k++) s += expf(x[k] - m);
        }
    }
    const float max = block_max(m);
    const float sum = block_sum(m == NEG_INF ? 0.0f : s * expf(m - max));
    const float lse = max + logf(sum);
    const bool valid = target >= 0 && target < V;
    if (threadIdx.x == 0) {
        losses[blockIdx.x] =
            valid ? row_loss(lse, to_f32(logits[row + target]), z_loss) : QUIET_NAN;
    }
    if (!train) return;
    // Everyone has read the row (the max and sum above end with barriers) and thread 0 has
    // read the target logit; wait for it before overwriting.
    __syncthreads();
    const float grad_scale = *grad_scale_at;
    const float scale = softmax_scale(grad_scale, z_loss, lse);
    for (int c = threadIdx.x * W; c < V; c += blockDim.x * W) {
        float x[W];
        load_vec<T, W>(x, logits + row + c);
#pragma unroll
        for (int k = 0; k < W; k++) x[k] = logit_grad(expf(x[k] - lse), scale, c + k == target, grad_scale);
        store_vec<T, W>(logits + row + c, x);
    }
}

// `cross_entropy_cluster`'s shape, from the host (classifier.rs): CLUSTER_BLOCKS blocks per
// row, one cluster, at most 8, the largest size every cluster launch may use; CLUSTER_THREADS
// threads per block, each keeping up to CLUSTER_UNITS 16-byte units of its block's share of
// the row in registers. A row of up to CLUSTER_BLOCKS · CLUSTER_THREADS · CLUSTER_UNITS · 16
// bytes fits (the host's `cluster_fits`), at 3 blocks per SM.

#if __CUDA_ARCH__ >= 900
#define ROW_CLUSTER __cluster_dims__(CLUSTER_BLOCKS, 1, 1)
#else
#define ROW_CLUSTER
#endif

// Every thread of every block of the cluster arrives; `arrive` publishes this thread's
// earlier shared-memory writes to the cluster, `wait` sees the others'.
__device__ __forceinline__ void cluster_arrive() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// `local`, a variable in this block's shared memory, as block `rank` of the cluster holds it.
__device__ __forceinline__ float2 cluster_read(const float2* local, int rank) {
    float2 v = {0.0f, 0.0f};
#if __CUDA_ARCH__ >= 900
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
                 : "=r"(remote)
                 : "r"(static_cast<u32>(__cvta_generic_to_shared(local))), "r"(rank));
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n"
                 : "=f"(v.x), "=f"(v.y)
                 : "r"(remote)
                 : "memory");
#else
    __trap();
#endif
    return v;
}

// The same loss and gradient as `cross_entropy`, for rows of 16-byte multiples. Block r of
// row n's cluster takes the r-th share of whole 16-byte units of the row, loads it once into
// registers, and reduces its max and sum of exponentials over the block; the cluster merges
// the eight (max, sum) pairs in rank order through distributed shared memory, so every block
// gets the same log-sum-exp, and each then writes its share's gradient from its registers.
template <typename T>
__global__ void __launch_bounds__(CLUSTER_THREADS, 3) ROW_CLUSTER
    cross_entropy_cluster(T* logits, float* losses, const int* targets, int V, float z_loss,
                          const float* grad_scale_at) {
    constexpr int W = 16 / sizeof(T);
    const bool train = grad_scale_at != nullptr;
    const int n = blockIdx.x / CLUSTER_BLOCKS, rank = blockIdx.x % CLUSTER_BLOCKS;
    const long long row = (long long)n * V;
    const int target = targets[n];
    const int share = (V + CLUSTER_BLOCKS * W - 1) / (CLUSTER_BLOCKS * W) * W;
    const int end = min(V, (rank + 1) * share);
    // Unit u of this thread starts at column `first + u · stride`.
    const int first = rank * share + threadIdx.x * W, stride = CLUSTER_THREADS * W;
    if (target == IGNORE_INDEX) {  // the whole cluster takes this branch, so no barrier waits
        if (rank == 0 && threadIdx.x == 0) losses[n] = 0.0f;
        if (train) {
            const float zero[W] = {};
            for (int c = first; c < end; c += stride) store_vec<T, W>(logits + row + c, zero);
        }
        return;
    }
    Packed<T, W> x[CLUSTER_UNITS];
#pragma unroll
    for (int u = 0; u < CLUSTER_UNITS; u++)
        if (first + u * stride < end) x[u] = load_packed<T, W>(logits + row + first + u * stride);
    // The row is in registers, so the max comes first and the exponentials need no
    // rescaling; exp(x - m) is 2^(x·log2 e - m·log2 e), one FFMA and one MUFU instruction
    // (expf's range reduction would make the kernel bound by instructions, not bytes).
    float m = NEG_INF, s = 0.0f;
#pragma unroll
    for (int u = 0; u < CLUSTER_UNITS; u++)
        if (first + u * stride < end)
#pragma unroll
            for (int k = 0; k < W; k++) m = fmaxf(m, x[u][k]);
    const float m_log2 = m * LOG2E;
#pragma unroll
    for (int u = 0; u < CLUSTER_UNITS; u++)
        if (first + u * stride < end)
#pragma unroll
            for (int k = 0; k < W; k++) s += exp2_fast(fmaf(x[u][k], LOG2E, -m_log2));
    __shared__ float2 partial;  // this block's (max, sum of exp(x - max))
    const float block_m = block_max(m);
    const float block_s = block_sum(m == NEG_INF ? 0.0f : s * exp2_fast((m - block_m) * LOG2E));
    if (threadIdx.x == 0) partial = {block_m, block_s};
    // Read the target's logit before the barrier, after which its block may overwrite it.
    const bool valid = target >= 0 && target < V;
    const bool reports = rank == 0 && threadIdx.x == 0;  // the thread that writes the loss
    const float target_logit = reports && valid ? to_f32(logits[row + target]) : 0.0f;
    cluster_arrive();
    cluster_wait();
    float2 p[CLUSTER_BLOCKS];
    float max = NEG_INF;
#pragma unroll
    for (int r = 0; r < CLUSTER_BLOCKS; r++) {
        p[r] = cluster_read(&partial, r);
        max = fmaxf(max, p[r].x);
    }
    float sum = 0.0f;
#pragma unroll
    for (int r = 0; r < CLUSTER_BLOCKS; r++)
        if (p[r].x != NEG_INF) sum += p[r].y * exp2_fast((p[r].x - max) * LOG2E);
    // No block may leave while another can still read its `partial`: this arrival, and the
    // wait at the end, hold every block until all have read.
    cluster_arrive();
    const float lse = max + logf(sum);
    if (reports) losses[n] = valid ? row_loss(lse, target_logit, z_loss) : QUIET_NAN;
    if (train) {
        const float grad_scale = *grad_scale_at;
        const float scale = softmax_scale(grad_scale, z_loss, lse);
        const float lse_log2 = lse * LOG2E;
#pragma unroll
        for (int u = 0; u < CLUSTER_UNITS; u++) {
            const int c = first + u * stride;
            if (c >= end) continue;
            float y[W];
#pragma unroll
            for (int k = 0; k < W; k++) {
                const float p = exp2_fast(fmaf(x[u][k], LOG2E, -lse_log2));
                y[k] = logit_grad(p, scale, c + k == target, grad_scale);
            }
            store_vec<T, W>(logits + row + c, y);
        }
    }
    cluster_wait();
}
