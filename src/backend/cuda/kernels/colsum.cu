// Deterministic column sums over rows, for the bias gradient (in bf16 QKV's, with RoPE's
// backward on the way) and (finishing the partials of rmsnorm_backward) the RMSNorm weight
// gradient: fixed chunks of rows are summed per column into f32 partials, then one pass adds
// the partials up. Every sum runs in an order fixed by the shapes alone, and there are no
// float atomics, so every run gives the same bits.
#include "common.cuh"

// Rows of a chunk in flight per warp and lane: independent loads before the first add.
constexpr int ROWS_IN_FLIGHT = 4;

// partials[chunk, c] = Σ_{n in chunk} dy[n, c]. Grid: (strips, chunks), PARTIAL_THREADS
// threads (the host's block size). A block covers a strip of 32·W columns, each lane W of them
// in one access: 16 bytes with VEC (the host checked that dy's pointer and C·sizeof(T) are
// multiples of 16), so that each warp then reads whole 512-byte strip rows. A chunk is
// `per_chunk` rows, of which warp w adds rows w, w + WARPS, ...; then the warps' sums are
// added in warp order.
//
// With ROPE, dy is QKV's output gradient [rows, C] (rows of `seq` positions), and the pass is
// also RoPE's backward (rope.cu's inverse rotation of the q and k heads, the first `rotated`
// columns) applied in place on the way, so that the sums are QKV's bias gradient, of the
// rotated gradient as stored, in one pass over it. A strip is then `strip` columns, whole heads
// of D, the lanes past it idle: a lane's W columns of a head's first half pair with the W
// columns D/2 on, which the lane D/(2W) on holds, and the two trade values by shuffle each row.
// A chunk is then `per_chunk` positions, and warp w takes positions w, w + WARPS, ... of it
// with every sequence's row at each, so that a position's (cos, sin) are loaded once for the
// whole batch rather than once a row. The host runs it with VEC only, and where a head fits
// a strip.
template <typename T, bool VEC, bool ROPE>
__global__ void colsum_partial(float* partials, T* dy, int rows, int C, int per_chunk,
                               const float* freqs, int seq, int D, int rotated, int strip) {
    constexpr int W = access_width<T, VEC>();
    constexpr int WARPS = PARTIAL_THREADS / 32;
    __shared__ float sums[WARPS][W][32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int c = ROPE ? blockIdx.x * strip + lane * W : (blockIdx.x * 32 + lane) * W;
    const bool active = c < C && (!ROPE || lane * W < strip);
    // RoPE: this lane's first pair (the element's index in its head's half) and its partner.
    const int half = D / 2, in_head = ROPE ? c % D : 0, pair = ROPE ? in_head % half : 0;
    const bool first_half = in_head < half, rotates = ROPE && active && c < rotated;
    const int partner = rotates ? lane + (first_half ? half / W : -half / W) : lane;
    float acc[W];
#pragma unroll
    for (int k = 0; k < W; k++) acc[k] = 0.0f;
    // Adds the `count` (at most ROWS_IN_FLIGHT) rows first, first + step, ... (the same rows for
    // every lane of the warp: with ROPE, the shuffles need the whole warp), each rotated by the
    // (cos, sin) in cs before it is added where this lane rotates. Only active lanes read and
    // write.
    auto add_rows = [&](int first, int step, int count, const float* cs) {
        float v[ROWS_IN_FLIGHT][W] = {};
#pragma unroll
        for (int u = 0; u < ROWS_IN_FLIGHT; u++) {
            if (u < count && active) load_vec<T, W>(v[u], dy + (long long)(first + u * step) * C + c);
        }
#pragma unroll
        for (int u = 0; u < ROWS_IN_FLIGHT; u++) {
            if (u >= count) break;
            const int n = first + u * step;
            if constexpr (ROPE) {
                float other[W];
#pragma unroll
                for (int k = 0; k < W; k++) other[k] = __shfl_sync(0xffffffffu, v[u][k], partner);
                if (rotates) {
#pragma unroll
                    for (int k = 0; k < W; k++) {
                        float x1, x2;
                        const float a = first_half ? v[u][k] : other[k], b = first_half ? other[k] : v[u][k];
                        rope_rotate(a, b, cs[2 * k], -cs[2 * k + 1], x1, x2);
                        v[u][k] = rounded<T>(first_half ? x1 : x2);
                    }
                    store_vec<T, W>(dy + (long long)n * C + c, v[u]);
                }
            }
#pragma unroll
            for (int k = 0; k < W; k++) acc[k] += v[u][k];
        }
    };
    if constexpr (ROPE) {
        const int sequences = rows / seq, last = min(seq, (blockIdx.y + 1) * per_chunk);
        for (int t = blockIdx.y * per_chunk + warp; t < last; t += WARPS) {
            float cs[2 * W] = {};
            if (rotates) load_vec<float, 2 * W>(cs, freqs + ((long long)t * half + pair) * 2);
            for (int s0 = 0; s0 < sequences; s0 += ROWS_IN_FLIGHT) {
                add_rows(s0 * seq + t, seq, min(ROWS_IN_FLIGHT, sequences - s0), cs);
            }
        }
    } else {
        const int last = min(rows, (blockIdx.y + 1) * per_chunk);
        for (int n0 = blockIdx.y * per_chunk + warp; n0 < last; n0 += WARPS * ROWS_IN_FLIGHT) {
            add_rows(n0, WARPS, min(ROWS_IN_FLIGHT, (last - n0 + WARPS - 1) / WARPS), nullptr);
        }
    }
#pragma unroll
    for (int k = 0; k < W; k++) sums[warp][k][lane] = acc[k];
    __syncthreads();
    if (warp == 0 && active) {
#pragma unroll
        for (int k = 0; k < W; k++) {
            float total = 0.0f;
            for (int v = 0; v < WARPS; v++) total += sums[v][k][lane];
            partials[(long long)blockIdx.y * C + c + k] = total;
        }
    }
}

// out[c] (+)= Σ_chunk partials[chunk, c]. Grid: ceil(C / 32) blocks of FINISH_THREADS (the
// host's COLSUM_FINISH_THREADS), 32 lanes (columns) × WARPS warps: warp w adds chunks w,
// w + WARPS, ..., then the warps' sums are added in warp order.
template <typename T>
__global__ void colsum_finish(T* out, const float* partials, int chunks, int C, int accumulate) {
    constexpr int WARPS = FINISH_THREADS / 32;
    __shared__ float sums[WARPS][32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int c = blockIdx.x * 32 + lane;
    float acc = 0.0f;
    if (c < C) {
#pragma unroll 4
        for (int k = warp; k < chunks; k += WARPS) acc += partials[(long long)k * C + c];
    }
    sums[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && c < C) {
        float total = 0.0f;
        for (int v = 0; v < WARPS; v++) total += sums[v][lane];
        out[c] = from_f32<T>(accumulate ? to_f32(out[c]) + total : total);
    }
}
