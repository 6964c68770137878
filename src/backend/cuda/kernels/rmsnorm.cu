// RMSNorm, y = x · rstd · w with rstd = 1/sqrt(mean(x²) + eps), optionally fused with the
// residual add that produces x; and its input gradient, fused with the partial column sums of
// the weight gradient (finished by colsum.cu). With `amax`, the forward reports max |out| and
// the backward max |dinp|, as stored (common.cuh). At the end, Qwen3's per-head norm of the
// query and key heads, forward and backward.
//
// One warp per row: a row of the models' widths (C = 896 .. 3584) is 2-7 KB in bf16, so a
// warp keeps several 16-byte loads per lane and operand in flight, the row's reduction is a
// warp shuffle with no block barrier, and many rows share an SM. With VEC every operand moves
// 16 bytes per access (the host checked that every pointer and C·sizeof(T) are multiples of
// 16); without it, the same code moves one element per access, for views and odd widths.
// Each lane reads back in the second pass only what it wrote in the first, so no barrier is
// needed.
//
// The plain and the fused forward are one kernel: the fused one first rounds `inp + branch`
// to T and stores it in `residual_out`, then both normalize the same values with the same
// per-lane split and reduction tree, so their outputs and rstd agree bit for bit. With `out`
// null the forward stores only rstd (and residual_out) and reports the abs-max: FP8's
// quantization then normalizes the rows itself (fp8.cu, NORM), with the same product.
#include "common.cuh"

// Accesses per lane and operand issued before the first is used: 4 in the forward (2 or 4
// operands, 50-60 registers), 2 in the backward's streaming path (3 or 4 operands, at most
// 80 registers so that 3 blocks fit an SM). With at least 24 warps per SM that keeps 48-64
// KB per SM in flight.
#define FORWARD_UNROLL 4
#define BACKWARD_UNROLL 2

// Walks a warp's row of C in rounds of U accesses per lane: `load(u, c)` for each access of
// a round first, so that the round's loads are in flight together, then `use(u, c)` for each
// in order. c is the access's first column; the access is W wide.
template <int W, int U, typename Load, typename Use>
__device__ __forceinline__ void row_rounds(int C, Load load, Use use) {
    constexpr int STEP = 32 * W;
#pragma unroll 1
    for (int c0 = threadIdx.x % 32 * W; c0 < C; c0 += STEP * U) {
#pragma unroll
        for (int u = 0; u < U; u++)
            if (c0 + u * STEP < C) load(u, c0 + u * STEP);
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (c0 + u * STEP >= C) break;
            use(u, c0 + u * STEP);
        }
    }
}

template <typename T, bool RESIDUAL, bool VEC>
__global__ void rmsnorm_forward(T* out, float* rstd, T* residual_out, const T* inp,
                                const T* branch, const T* weight, long long rows, int C,
                                float eps, float* amax) {
    constexpr int W = access_width<T, VEC>(), U = FORWARD_UNROLL;
    // One row per warp.
    const long long n = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    float largest = 0.0f;
    // No early return: every thread of the block takes part in the abs-max reduction.
    if (n < rows) {
        const long long row = n * C;
        Packed<T, W> a[U], b[U];
        float sum_sq = 0.0f;
        row_rounds<W, U>(
            C,
            [&](int u, int c) {
                a[u] = load_packed<T, W>(inp + row + c);
                if (RESIDUAL) b[u] = load_packed<T, W>(branch + row + c);
            },
            [&](int u, int c) {
                float x[W];
#pragma unroll
                for (int k = 0; k < W; k++) x[k] = RESIDUAL ? rounded<T>(a[u][k] + b[u][k]) : a[u][k];
                if (RESIDUAL) store_vec<T, W>(residual_out + row + c, x);
#pragma unroll
                for (int k = 0; k < W; k++) sum_sq += x[k] * x[k];
            });
        sum_sq = warp_sum(sum_sq);
        const float r = 1.0f / sqrtf(sum_sq / (float)C + eps);
        if (threadIdx.x % 32 == 0) rstd[n] = r;
        const T* x_src = RESIDUAL ? residual_out : inp;
        row_rounds<W, U>(
            C,
            [&](int u, int c) {
                a[u] = load_packed<T, W>(x_src + row + c);
                b[u] = load_packed<T, W>(weight + c);
            },
            [&](int u, int c) {
                float y[W];
#pragma unroll
                for (int k = 0; k < W; k++) {
                    y[k] = a[u][k] * r * b[u][k];
                    largest = fmaxf(largest, fabsf(rounded<T>(y[k])));
                }
                if (out != nullptr) store_vec<T, W>(out + row + c, y);
            });
    }
    report_amax(amax, largest);
}

// Where column c (element k of the access at c) of a warp's weight-gradient accumulator
// lives in shared memory: element k of the accesses of one round of the warp's 32 lanes lie
// side by side, so the lanes' read-modify-writes hit 32 different banks.
template <int W>
__device__ __forceinline__ int acc_index(int c, int k) {
    const int v = c / W;  // the access's index in the row; its lane is v % 32
    return (v / 32) * 32 * W + k * 32 + v % 32;
}

// Floats of one warp's accumulator: C rounded up to whole rounds of 32 accesses.
template <int W>
__device__ __forceinline__ int acc_len(int C) {
    return (C + 32 * W - 1) / (32 * W) * 32 * W;
}

// dinp += rstd · g − x · rstd³ · (g·x) / C with g = dout ⊙ w, one warp per row; and
// partials[block, c] = Σ dout · x · rstd over the block's rows, for the weight gradient.
// Block b has the rows [b·R, (b+1)·R), R = rows_per_block; warp w takes rows w, w + warps,
// ... of them and accumulates its own column sums in shared memory (acc_len(C) floats per
// warp, in the dynamic shared memory); the warps' sums are then added in warp order, so the
// partials do not depend on timing.
//
// With HELD > 0 (the host's choice where C ≤ 32·W·HELD) a lane holds its share of the row's
// dout and x in registers from one round of loads, all issued together, so the second pass
// reads only dinp's old values, which it adds to (loading them with the first round would
// make the 0.5B and 1.5B steps' RMSNorm backward ~4% slower on an H100: the first round would
// wait on a third more bytes, and the warp hold them through the reduction). HELD = 0
// streams the row twice in rounds of BACKWARD_UNROLL. Each lane visits its columns in
// the same order either way, so the two give the same bits. A block has at most
// BACKWARD_MAX_THREADS threads (the host's block size): fewer where shared memory holds the
// sums of fewer warps.
template <typename T, bool VEC, int HELD>
__global__ void __launch_bounds__(BACKWARD_MAX_THREADS, HELD > 4 ? 2 : 3)
    rmsnorm_backward(T* dinp, float* partials, const T* dout, const T* inp, const T* weight,
                     const float* rstd, long long rows, int C, int rows_per_block, float* amax) {
    constexpr int W = access_width<T, VEC>(), U = HELD > 0 ? HELD : BACKWARD_UNROLL;
    extern __shared__ float dweight_acc[];
    const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
    float* acc = dweight_acc + warp * acc_len<W>(C);
    // Each lane zeroes and updates only its own slots, so no barrier until the warps meet.
    for (int c0 = threadIdx.x % 32 * W; c0 < C; c0 += 32 * W) {
#pragma unroll
        for (int k = 0; k < W; k++) acc[acc_index<W>(c0, k)] = 0.0f;
    }
    const long long first = (long long)blockIdx.x * rows_per_block;
    const long long last = min(rows, first + rows_per_block);
    float largest = 0.0f;
    for (long long n = first + warp; n < last; n += warps) {
        const long long row = n * C;
        const float r = rstd[n];
        Packed<T, W> dy[U], x[U], w[U], d0[U];
        // Streaming, the weight travels with each round of loads; held, the registers keep
        // only the row and the weight (a few KB every row reads, so in L1) is read at use.
        auto load_inputs = [&](int u, int c) {
            dy[u] = load_packed<T, W>(dout + row + c);
            x[u] = load_packed<T, W>(inp + row + c);
            if constexpr (HELD == 0) w[u] = load_packed<T, W>(weight + c);
        };
        auto weight_at = [&](int u, int c) {
            if constexpr (HELD > 0) {
                return load_packed<T, W>(weight + c);
            } else {
                return w[u];
            }
        };
        float dot = 0.0f;
        row_rounds<W, U>(C, load_inputs, [&](int u, int c) {
            const Packed<T, W> wu = weight_at(u, c);
#pragma unroll
            for (int k = 0; k < W; k++) {
                dot += dy[u][k] * wu[k] * x[u][k];
                acc[acc_index<W>(c, k)] += dy[u][k] * x[u][k] * r;
            }
        });
        dot = warp_sum(dot);
        const float kx = r * r * r * dot / (float)C;
        auto update = [&](int u, int c) {
            const Packed<T, W> wu = weight_at(u, c);
            float dx[W];
#pragma unroll
            for (int k = 0; k < W; k++) {
                dx[k] = d0[u][k] + (r * dy[u][k] * wu[k] - x[u][k] * kx);
                largest = fmaxf(largest, fabsf(rounded<T>(dx[k])));
            }
            store_vec<T, W>(dinp + row + c, dx);
        };
        row_rounds<W, U>(C, [&](int u, int c) {
            if constexpr (HELD == 0) load_inputs(u, c);  // held, dy and x are still in registers
            d0[u] = load_packed<T, W>(dinp + row + c);
        }, update);
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const int slot = acc_index<W>(c - c % W, c % W);
        float total = 0.0f;
        for (int v = 0; v < warps; v++) total += dweight_acc[v * acc_len<W>(C) + slot];
        partials[(long long)blockIdx.x * C + c] = total;
    }
    report_amax(amax, largest);
}

// Qwen3's QK-norm: an RMSNorm over each query and each key head of the fused QKV rows
// (`[rows, (Hq + 2·Hkv)·D]`), by one weight for the query heads and one for the key heads
// (`[D]` each), the value heads copied as they are. rstd is `[rows, Hq + Hkv]`. One warp per
// item: item i of a row normalizes its head i, and the row's last item copies its value heads.
// Lane j takes the head's elements j, j + 32, ...; the head's sum of squares is one warp
// shuffle.
template <typename T, int D>
__global__ void head_rmsnorm_forward(T* out, float* rstd, const T* x, const T* q_weight,
                                     const T* k_weight, long long rows, int q_heads, int kv_heads,
                                     float eps) {
    constexpr int PER = (D + 31) / 32;
    const int normed = q_heads + kv_heads, width = (normed + kv_heads) * D;
    const int lane = threadIdx.x % 32;
    const long long item = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (item >= rows * (normed + 1)) return;
    const long long n = item / (normed + 1);
    const int h = (int)(item % (normed + 1));
    const long long row = n * width;
    if (h == normed) {
        for (int c = normed * D + lane; c < width; c += 32) out[row + c] = x[row + c];
        return;
    }
    const T* w = h < q_heads ? q_weight : k_weight;
    const long long head = row + (long long)h * D;
    float v[PER];
    float sum_sq = 0.0f;
#pragma unroll
    for (int k = 0; k < PER; k++) {
        const int d = lane + 32 * k;
        v[k] = d < D ? to_f32(x[head + d]) : 0.0f;
        sum_sq += v[k] * v[k];
    }
    sum_sq = warp_sum(sum_sq);
    const float r = 1.0f / sqrtf(sum_sq / (float)D + eps);
    if (lane == 0) rstd[n * normed + h] = r;
#pragma unroll
    for (int k = 0; k < PER; k++) {
        const int d = lane + 32 * k;
        if (d < D) out[head + d] = from_f32<T>(v[k] * r * to_f32(w[d]));
    }
}

// Its gradient, in place: each query and key head of dqkv becomes the gradient of the norm's
// input, rstd · g − x · rstd³ · (g·x) / D with g = dout ⊙ w; the value heads stay. The weights'
// gradients: partials[kind, block, d] = Σ dout · x · rstd over the block's rows and the heads
// of that kind (queries 0, keys 1), finished by colsum_finish. Block b has the rows [b·R,
// (b+1)·R), R = rows_per_block; its warps take the items (row, head) in turn, warp w those of
// index w, w + warps, ..., each lane keeping its own column sums, which the warps then add in
// warp order: the partials do not depend on timing. With amax, the abs-max of all of dqkv as
// stored, value heads included.
template <typename T, int D>
__global__ void __launch_bounds__(BACKWARD_MAX_THREADS)
    head_rmsnorm_backward(T* dqkv, float* partials, const T* x, const T* q_weight,
                          const T* k_weight, const float* rstd, long long rows, int q_heads,
                          int kv_heads, int rows_per_block, float* amax) {
    constexpr int PER = (D + 31) / 32;
    constexpr int MAX_WARPS = BACKWARD_MAX_THREADS / 32;
    __shared__ float sums[MAX_WARPS][2][D];
    const int normed = q_heads + kv_heads, width = (normed + kv_heads) * D;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const long long first = (long long)blockIdx.x * rows_per_block;
    const long long last = min(rows, first + rows_per_block);
    float acc[2][PER] = {};
    float largest = 0.0f;
    for (long long i = warp; i < (last - first) * (normed + 1); i += warps) {
        const long long n = first + i / (normed + 1);
        const int h = (int)(i % (normed + 1));
        const long long row = n * width;
        if (h == normed) {
            if (amax != nullptr)
                for (int c = normed * D + lane; c < width; c += 32)
                    largest = fmaxf(largest, fabsf(to_f32(dqkv[row + c])));
            continue;
        }
        const int kind = h < q_heads ? 0 : 1;
        const T* w = kind == 0 ? q_weight : k_weight;
        const long long head = row + (long long)h * D;
        const float r = rstd[n * normed + h];
        float dy[PER], xv[PER], wv[PER];
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const int d = lane + 32 * k;
            const bool in = d < D;
            dy[k] = in ? to_f32(dqkv[head + d]) : 0.0f;
            xv[k] = in ? to_f32(x[head + d]) : 0.0f;
            wv[k] = in ? to_f32(w[d]) : 0.0f;
            dot += dy[k] * wv[k] * xv[k];
            acc[kind][k] += dy[k] * xv[k] * r;
        }
        dot = warp_sum(dot);
        const float kx = r * r * r * dot / (float)D;
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const int d = lane + 32 * k;
            if (d >= D) continue;
            const T dx = from_f32<T>(r * dy[k] * wv[k] - xv[k] * kx);
            dqkv[head + d] = dx;
            largest = fmaxf(largest, fabsf(to_f32(dx)));
        }
    }
#pragma unroll
    for (int k = 0; k < PER; k++) {
        const int d = lane + 32 * k;
        if (d < D) {
            sums[warp][0][d] = acc[0][k];
            sums[warp][1][d] = acc[1][k];
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < 2 * D; c += blockDim.x) {
        const int kind = c / D, d = c % D;
        float total = 0.0f;
        for (int v = 0; v < warps; v++) total += sums[v][kind][d];
        partials[((long long)kind * gridDim.x + blockIdx.x) * D + d] = total;
    }
    report_amax(amax, largest);
}
