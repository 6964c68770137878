// INT8 with row-wise scales: quantization of a tensor's rows, or of its columns into the
// transposed layout, and the epilogue of the INT8 products that cuBLASLt sums into int32.
//
// The numerics are the CPU's (cpu/int8.rs) bit for bit, whatever NVRTC's math options: the
// scale 127 / amax and its inverse are correctly rounded (__fdiv_rn, __frcp_rn), x · s is one
// correctly rounded product, nearest rounding is rintf (ties to even), stochastic rounding is
// floorf(x · s + u) with u = 24 bits of hash_u32(seed, index of the code) / 2^24, and codes
// saturate at ±127 with NaN as 0. The epilogue multiplies and adds in the order ops/int8.rs
// states, each step rounded on its own (no contraction).
#include "common.cuh"

typedef signed char i8;

__device__ __forceinline__ float int8_scale(float amax) {
    return (amax > 0.0f && isfinite(amax)) ? __fdiv_rn(127.0f, amax) : 1.0f;
}

template <bool STOCHASTIC>
__device__ __forceinline__ i8 int8_code(float x, float s, u64 seed, long long index) {
    const float v = __fmul_rn(x, s);
    float r;
    if constexpr (STOCHASTIC) {
        const float u = (float)(hash_u32(seed, (u64)index) >> 8) * (1.0f / 16777216.0f);
        r = floorf(__fadd_rn(v, u));
    } else {
        r = rintf(v);
    }
    if (isnan(r)) return 0;
    return (i8)fminf(fmaxf(r, -127.0f), 127.0f);
}

// One block per row r of x [R, C]: q[r, :] and descale[r], from the row's abs-max. With VEC,
// in units of 8 values (one 8-byte store of codes): every row then starts 16-byte aligned in
// x and 8-byte aligned in q (C a multiple of 8).
template <typename T, bool STOCHASTIC, bool VEC>
__global__ void quantize_i8_rows(i8* q, float* descale, const T* x, int cols, u64 seed) {
    constexpr int W = VEC ? 8 : 1;
    const long long row = blockIdx.x, base = row * cols;
    const int units = cols / W;
    float largest = 0.0f;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
        float v[W];
        load_vec<T, W>(v, x + base + (long long)u * W);
#pragma unroll
        for (int k = 0; k < W; k++) largest = fmaxf(largest, fabsf(v[k]));
    }
    const float s = int8_scale(block_max(largest));
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
        float v[W];
        const long long at = base + (long long)u * W;
        load_vec<T, W>(v, x + at);
        u32 word[2] = {0, 0};
#pragma unroll
        for (int k = 0; k < W; k++) {
            const i8 code = int8_code<STOCHASTIC>(v[k], s, seed, at + k);
            if constexpr (W == 8) word[k / 4] |= (u32)(unsigned char)code << (8 * (k % 4));
            else q[at] = code;
        }
        if constexpr (W == 8) *reinterpret_cast<uint2*>(q + at) = make_uint2(word[0], word[1]);
    }
    if (threadIdx.x == 0) descale[row] = __frcp_rn(s);
}

// amax[c] = max(amax[c], max_r |x[r, c]|) for x [R, C]: a thread per W columns (8 and 16-byte
// loads with VEC: x 16-byte aligned, C a multiple of 8), walking COL_ROWS rows from its block's
// row, then one integer atomicMax a column (non-negative floats order like their bits; NaN was
// dropped by fmaxf).
template <typename T, bool VEC>
__global__ void abs_max_cols(float* amax, const T* x, int rows, int cols) {
    constexpr int W = VEC ? 8 : 1;
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * W;
    if (c >= cols) return;
    const int first = blockIdx.y * COL_ROWS, last = min(rows, first + COL_ROWS);
    float largest[W];
#pragma unroll
    for (int k = 0; k < W; k++) largest[k] = 0.0f;
    for (int r = first; r < last; ++r) {
        float v[W];
        load_vec<T, W>(v, x + (long long)r * cols + c);
#pragma unroll
        for (int k = 0; k < W; k++) largest[k] = fmaxf(largest[k], fabsf(v[k]));
    }
#pragma unroll
    for (int k = 0; k < W; k++) atomicMax(reinterpret_cast<int*>(amax) + c + k, __float_as_int(largest[k]));
}

// q [C, R] = codes of x [R, C] transposed, column c scaled by 127 / amax[c] (`abs_max_cols`),
// through a shared tile of COL_TILE x COL_TILE: read 8 columns at a time with VEC (x 16-byte
// aligned, C a multiple of 8, R of 4, q 4-byte aligned), written 4 codes (one word) at a time
// along each output row; the blocks of the first row tile also write descale[c].
template <typename T, bool STOCHASTIC, bool VEC>
__global__ void quantize_i8_cols(i8* q, float* descale, const T* x, const float* amax, int rows, int cols,
                                 u64 seed) {
    __shared__ float tile[COL_TILE][COL_TILE + 1];  // [row][column] of x
    constexpr int W = VEC ? 8 : 1;
    const int r0 = blockIdx.y * COL_TILE, c0 = blockIdx.x * COL_TILE;
    for (int u = threadIdx.x; u < COL_TILE * COL_TILE / W; u += blockDim.x) {
        const int i = u / (COL_TILE / W), j = (u % (COL_TILE / W)) * W;
        const int r = r0 + i, c = c0 + j;
        float v[W];
        if (r < rows && c < cols) load_vec<T, W>(v, x + (long long)r * cols + c);
        else
#pragma unroll
            for (int k = 0; k < W; k++) v[k] = 0.0f;
#pragma unroll
        for (int k = 0; k < W; k++) tile[i][j + k] = v[k];
    }
    __syncthreads();
    for (int u = threadIdx.x; u < COL_TILE * COL_TILE / 4; u += blockDim.x) {
        const int j = u / (COL_TILE / 4), i = (u % (COL_TILE / 4)) * 4;
        const int c = c0 + j;
        if (c >= cols) continue;
        const float s = int8_scale(amax[c]);
        const long long at = (long long)c * rows + r0 + i;
        i8 code[4];
#pragma unroll
        for (int k = 0; k < 4; k++) code[k] = int8_code<STOCHASTIC>(tile[i + k][j], s, seed, at + k);
        if (VEC && r0 + i + 4 <= rows) {
            *reinterpret_cast<u32*>(q + at) = (u32)(unsigned char)code[0] | ((u32)(unsigned char)code[1] << 8) |
                                             ((u32)(unsigned char)code[2] << 16) |
                                             ((u32)(unsigned char)code[3] << 24);
        } else {
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (r0 + i + k < rows) q[at + k] = code[k];
        }
        if (blockIdx.y == 0 && i == 0) descale[c] = __frcp_rn(s);
    }
}

// out[m, n] = f32(acc[m, n]) · da[m] · db[n] (+ bias[n]) (+ out[m, n]) over `rows` rows of
// n, rounded once to T: the epilogue of an INT8 product summed into int32 by cuBLASLt.
template <typename T, bool BIAS, bool ACCUMULATE>
__global__ void dequantize_i32(T* out, const int* acc, const float* da, const float* db, const T* bias,
                               long long rows, int n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= rows * n) return;
    const long long m = i / n;
    const int j = (int)(i % n);
    float v = __fmul_rn(__fmul_rn(__int2float_rn(acc[i]), da[m]), db[j]);
    if constexpr (BIAS) v = __fadd_rn(v, to_f32(bias[j]));
    if constexpr (ACCUMULATE) v = __fadd_rn(v, to_f32(out[i]));
    out[i] = from_f32<T>(v);
}
