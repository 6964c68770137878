// FP8 current scaling: the abs-max of a tensor, and its quantization to e4m3 or e5m2 with
// scale = fp8_max / amax, either in place of layout or transposed (the operand layouts the
// backward's FP8 matmuls need).
//
// The numerics are the CPU's (cpu/fp8.rs) bit for bit, whatever NVRTC's math options: the
// scale and its inverse are correctly rounded f32 divisions (__fdiv_rn, __frcp_rn), x·scale is
// one correctly rounded product (__fmul_rn, never contracted into anything), and the
// conversion rounds to nearest even and saturates at ±fp8_max (`satfinite`; NaN stays NaN),
// which is what the CPU's `round_fp8` does.
#include "common.cuh"
#include <cuda_fp8.h>

typedef __nv_fp8_storage_t fp8;

template <__nv_fp8_interpretation_t F> __device__ __forceinline__ float fp8_max();
template <> __device__ __forceinline__ float fp8_max<__NV_E4M3>() { return 448.0f; }
template <> __device__ __forceinline__ float fp8_max<__NV_E5M2>() { return 57344.0f; }

// fp8_max / amax, or 1 where amax is 0 or not finite (nothing sensible to scale by).
template <__nv_fp8_interpretation_t F>
__device__ __forceinline__ float fp8_scale(const float* amax) {
    const float a = amax[0];
    return (a > 0.0f && isfinite(a)) ? __fdiv_rn(fp8_max<F>(), a) : 1.0f;
}

template <__nv_fp8_interpretation_t F>
__device__ __forceinline__ fp8 to_fp8(float x, float scale) {
    return __nv_cvt_float_to_fp8(__fmul_rn(x, scale), __NV_SATFINITE, F);
}

// Four fp8 codes as one little-endian word: byte k is element k.
__device__ __forceinline__ u32 pack4(fp8 a, fp8 b, fp8 c, fp8 d) {
    return (u32)a | ((u32)b << 8) | ((u32)c << 16) | ((u32)d << 24);
}

// Stores W codes at p: as one 8- or 4-byte word when W is 8 or 4 (p then W-byte aligned).
template <int W>
__device__ __forceinline__ void store_codes(fp8* p, const fp8 (&q)[W]) {
    if constexpr (W == 8) {
        *reinterpret_cast<uint2*>(p) =
            make_uint2(pack4(q[0], q[1], q[2], q[3]), pack4(q[4], q[5], q[6], q[7]));
    } else if constexpr (W == 4) {
        *reinterpret_cast<u32*>(p) = pack4(q[0], q[1], q[2], q[3]);
    } else {
#pragma unroll
        for (int k = 0; k < W; k++) p[k] = q[k];
    }
}

// amax[0] = max(amax[0], max |x|) over n elements: W-wide loads (16 bytes with VEC, x then
// 16-byte aligned) grid-stride, the n % W tail element-wise (fewer than W elements, so one
// each for the first threads), then one atomic per block.
template <typename T, bool VEC>
__global__ void abs_max(float* amax, const T* x, long long n) {
    constexpr int W = access_width<T, VEC>();
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    float largest = 0.0f;
    for (long long u = first; u < n / W; u += stride) {
        float v[W];
        load_vec<T, W>(v, x + u * W);
#pragma unroll
        for (int k = 0; k < W; k++) largest = fmaxf(largest, fabsf(v[k]));
    }
    const long long i = leftover(first, 0, n / W * W, n);
    if (i >= 0) largest = fmaxf(largest, fabsf(to_f32(x[i])));
    report_amax(amax, largest);
}

// out = fp8(x · scale) element by element over n elements, one W-wide unit per thread (with
// VEC: x 16-byte and out W-byte aligned), the n % W tail by the first threads; the first
// thread also writes descale[0] = 1 / scale.
template <typename T, __nv_fp8_interpretation_t F, bool VEC>
__global__ void quantize(fp8* out, float* descale, const T* x, const float* amax, long long n) {
    constexpr int W = access_width<T, VEC>();
    const float scale = fp8_scale<F>(amax);
    const long long u = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (u == 0) descale[0] = __frcp_rn(scale);
    if (u < n / W) {
        float v[W];
        fp8 q[W];
        load_vec<T, W>(v, x + u * W);
#pragma unroll
        for (int k = 0; k < W; k++) q[k] = to_fp8<F>(v[k], scale);
        store_codes<W>(out + u * W, q);
    }
    const long long i = leftover(u, 0, n / W * W, n);
    if (i >= 0) out[i] = to_fp8<F>(to_f32(x[i]), scale);
}

namespace qt {
// A block of THREADS transposes a TILE × TILE tile: the host's (fp8.rs), which sizes the grid.
constexpr int TILE = QUANTIZE_TILE;
constexpr int THREADS = QUANTIZE_THREADS;
static_assert(TILE % 16 == 0, "whole 16-byte loads along a tile row, whole words along a column");
// Shared rows of TILE + 4 bytes: word-aligned, and the column reads of the store phase hit
// at most two rows per bank.
constexpr int PITCH = TILE + 4;
}  // namespace qt

// x [R, C] → out [C, R] = fp8(xᵀ · scale), and, when `rows_out` is not null, rows_out [R, C]
// = fp8(x · scale) in the same pass. Grid (ceil(C / TILE), ceil(R / TILE)), THREADS threads.
// A block reads its tile row by row (W-wide loads along C), quantizes into shared memory
// (and rows_out), then writes the tile's columns as rows of out, four codes (one word) per
// thread along R, so every global side is coalesced. With VEC: C·sizeof(T) is a multiple of
// 16, R of 4, x is 16-byte, out 4-byte and rows_out W-byte aligned; otherwise every access
// is one element.
//
// With NORM, x is a norm's input and what is quantized is the norm's output as
// rmsnorm_forward stores it: x[r, c] · rstd[r] · weight[c], rounded to T (the same product in
// the same order, so the same bits), so that the norm's output is never written and read
// back.
//
// With SUMS, block row t also writes col_sums[t, c] = Σ x[r, c] over its tile's rows, in f32
// and a fixed order, for colsum_finish to add up: the QKV projection's output gradient is its
// bias's gradient summed over rows, so one read of it serves both. A flag of the template,
// not a null test: the sums take 11 more registers, which would cost the other passes
// occupancy; with them the kernel is held to 32 registers, so that 8 blocks still fit an SM
// (ptxas spills one word; on an H100 this pass takes 1.77 ms of a 0.5B batch-32 step with
// the bound, against 1.85 at 6 blocks).
template <typename T, __nv_fp8_interpretation_t F, bool VEC, bool SUMS, bool NORM>
__global__ void __launch_bounds__(qt::THREADS, SUMS ? 8 : 1)
    quantize_transposed(fp8* out, fp8* rows_out, float* col_sums, float* descale, const T* x,
                        const float* amax, const float* rstd, const T* norm_weight, int R,
                        int C) {
    using namespace qt;
    constexpr int W = access_width<T, VEC>();
    // A thread's units all lie in the same W columns (THREADS is a multiple of a tile row's
    // units), on rows `threadIdx.x / UNITS` + multiples of GROUPS. With SUMS, PARTS
    // adjacent threads then add up each column's GROUPS sums.
    constexpr int UNITS = TILE / W, GROUPS = THREADS / UNITS, PARTS = THREADS / TILE;
    static_assert(THREADS % UNITS == 0, "a thread's units share their columns");
    static_assert(THREADS % TILE == 0 && GROUPS % PARTS == 0 && 32 % PARTS == 0,
                  "every column's groups split evenly between adjacent lanes");
    __shared__ __align__(16) fp8 tile[TILE][PITCH];  // tile[r][c] = code of x[r0 + r, c0 + c]
    // Per row group, with SUMS. Rows 8 floats apart put the reads of a warp's (column,
    // part) pairs in 32 different banks.
    __shared__ float group_sums[GROUPS][TILE + 8];
    const float scale = fp8_scale<F>(amax);
    const int c0 = blockIdx.x * TILE, r0 = blockIdx.y * TILE;
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) descale[0] = __frcp_rn(scale);
    float sums[W] = {};
    // With NORM, the norm's weight at this thread's columns, read once for all its units.
    float norm_w[W] = {};
    const int own_cols = c0 + threadIdx.x % UNITS * W;
    if (NORM && own_cols < C) load_vec<T, W>(norm_w, norm_weight + own_cols);

#pragma unroll
    for (int i = threadIdx.x; i < TILE * UNITS; i += THREADS) {
        const int r = i / UNITS, c = i % UNITS * W;
        const int gr = r0 + r, gc = c0 + c;
        fp8 q[W];
        // C is a multiple of W, so a unit lies wholly inside or wholly outside x.
        if (gr < R && gc < C) {
            float v[W];
            load_vec<T, W>(v, x + (long long)gr * C + gc);
            if constexpr (NORM) {
                const float r = rstd[gr];
#pragma unroll
                for (int k = 0; k < W; k++) v[k] = rounded<T>(v[k] * r * norm_w[k]);
            }
#pragma unroll
            for (int k = 0; k < W; k++) {
                q[k] = to_fp8<F>(v[k], scale);
                sums[k] += v[k];
            }
            if (rows_out) store_codes<W>(rows_out + (long long)gr * C + gc, q);
        } else {
#pragma unroll
            for (int k = 0; k < W; k++) q[k] = 0;
        }
        if constexpr (W >= 4) {
#pragma unroll
            for (int k = 0; k < W; k += 4)
                *reinterpret_cast<u32*>(&tile[r][c + k]) = pack4(q[k], q[k + 1], q[k + 2], q[k + 3]);
        } else {
            tile[r][c] = q[0];
        }
    }
    if constexpr (SUMS) {
#pragma unroll
        for (int k = 0; k < W; k++)
            group_sums[threadIdx.x / UNITS][threadIdx.x % UNITS * W + k] = sums[k];
    }
    __syncthreads();
    if constexpr (SUMS) {
        const int c = threadIdx.x / PARTS, part = threadIdx.x % PARTS;
        float total = 0.0f;
#pragma unroll
        for (int g = part; g < GROUPS; g += PARTS) total += group_sums[g][c];
#pragma unroll
        for (int d = 1; d < PARTS; d *= 2) total += __shfl_xor_sync(0xffffffffu, total, d);
        if (part == 0 && c0 + c < C) col_sums[(long long)blockIdx.y * C + c0 + c] = total;
    }
#pragma unroll
    for (int i = threadIdx.x; i < TILE * (TILE / 4); i += THREADS) {
        const int c = i / (TILE / 4), r = i % (TILE / 4) * 4;
        const int gc = c0 + c, gr = r0 + r;
        if (gc >= C) continue;
        fp8* dst = out + (long long)gc * R + gr;
        if (VEC) {
            // R is a multiple of 4: the word lies wholly inside or outside the row.
            if (gr < R) *reinterpret_cast<u32*>(dst) = pack4(tile[r][c], tile[r + 1][c], tile[r + 2][c], tile[r + 3][c]);
        } else {
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (gr + k < R) dst[k] = tile[r + k][c];
        }
    }
}
