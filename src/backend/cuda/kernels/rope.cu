// Rotary position embedding in place on the fused qkv rows, HF rotate-half layout: element i
// of a head pairs with element i + D/2. `freqs` is [T, D/2, 2] of (cos, sin); `inverse`
// rotates back, which is the gradient of the forward rotation.
//
// Each thread rotates W pairs: W consecutive elements of a head's first half and the W they
// pair with. With VEC those are one 16-byte access each, and their W (cos, sin) pairs are
// read 16 bytes at a time too (the host checked that the qkv and freqs pointers, the row
// width and D/2 in bytes are multiples of 16).
#include "common.cuh"

// qkv: [rows, width]; the q and k heads at the start of each row are rotated, the value
// heads are left alone. A block has `rows_per_block` rows of `units` = (q and k heads)·D/(2W)
// threads' work each (one row's work may take several passes of the block when it is wider).
template <typename T, bool VEC>
__global__ void rope(T* qkv, const float* freqs, long long rows, int seq, int D, int width,
                     int units, int rows_per_block, int inverse) {
    constexpr int W = access_width<T, VEC>();
    const int half = D / 2, per_head = half / W;
    for (int k = threadIdx.x; k < rows_per_block * units; k += blockDim.x) {
        const long long n = (long long)blockIdx.x * rows_per_block + k / units;
        if (n >= rows) return;
        const int unit = k % units;
        const int head = unit / per_head, i = unit % per_head * W;
        const int t = (int)(n % seq);
        float cs[2 * W], a[W], b[W], x1[W], x2[W];
        // The (cos, sin) of the W pairs: 16 bytes at a time with VEC (2·W is then a multiple
        // of 4 floats), one float at a time without (W = 1).
        load_vec<float, 2 * W>(cs, freqs + ((long long)t * half + i) * 2);
        T* x = qkv + n * width + (long long)head * D + i;
        load_vec<T, W>(a, x);
        load_vec<T, W>(b, x + half);
#pragma unroll
        for (int j = 0; j < W; j++) {
            const float co = cs[2 * j], si = inverse ? -cs[2 * j + 1] : cs[2 * j + 1];
            x1[j] = a[j] * co - b[j] * si;
            x2[j] = b[j] * co + a[j] * si;
        }
        store_vec<T, W>(x, x1);
        store_vec<T, W>(x + half, x2);
    }
}
