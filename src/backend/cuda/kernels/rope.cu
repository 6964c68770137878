// Rotary position embedding in place on the fused qkv rows, HF rotate-half layout: element i
// of a head pairs with element i + D/2. `freqs` is [T, D/2, 2] of (cos, sin); `inverse`
// rotates back, which is the gradient of the forward rotation. A row's position is its place
// in its sequence, or with packed documents (`docs`, common.cuh's Documents) in its document.
//
// Each thread rotates W pairs: W consecutive elements of a head's first half and the W they
// pair with. With VEC those are one 16-byte access each, and their W (cos, sin) pairs are
// read 16 bytes at a time too (the host checked that the qkv and freqs pointers, the row
// width and D/2 in bytes are multiples of 16).
#include "common.cuh"

// qkv: [rows, width]; the q and k heads at the start of each row are rotated, the value
// heads are left alone. A block has `rows_per_block` rows of `units` threads' work each (one
// row's work may take several passes of the block when it is wider): the first `rotated` =
// (q and k heads)·D/(2W) units rotate, and any beyond them read the value heads W at a time.
// With `amax`, every unit reports max |x| over what it rotated (as stored) or read, so that
// over the whole gradient, value heads included, it is the QKV projection's output gradient's
// abs-max, and no pass of its own is needed for its FP8 copy.
template <typename T, bool VEC>
__global__ void rope(T* qkv, const float* freqs, long long rows, int seq, int D, int width,
                     int rotated, int units, int rows_per_block, int inverse, float* amax,
                     const int* docs) {
    constexpr int W = access_width<T, VEC>();
    const int half = D / 2, per_head = half / W;
    float largest = 0.0f;
    for (int k = threadIdx.x; k < rows_per_block * units; k += blockDim.x) {
        const long long n = (long long)blockIdx.x * rows_per_block + k / units;
        if (n >= rows) break;
        const int unit = k % units;
        if (unit >= rotated) {
            float v[W];
            load_vec<T, W>(v, qkv + n * width + 2 * rotated * W + (unit - rotated) * W);
#pragma unroll
            for (int j = 0; j < W; j++) largest = fmaxf(largest, fabsf(v[j]));
            continue;
        }
        const int head = unit / per_head, i = unit % per_head * W;
        const int place = (int)(n % seq);
        const int t = place - documents(docs, (int)(n / seq), (int)(rows / seq), seq).start(place);
        float cs[2 * W], a[W], b[W], x1[W], x2[W];
        // The (cos, sin) of the W pairs: 16 bytes at a time with VEC (2·W is then a multiple
        // of 4 floats), one float at a time without (W = 1).
        load_vec<float, 2 * W>(cs, freqs + ((long long)t * half + i) * 2);
        T* x = qkv + n * width + (long long)head * D + i;
        load_vec<T, W>(a, x);
        load_vec<T, W>(b, x + half);
#pragma unroll
        for (int j = 0; j < W; j++) {
            rope_rotate(a[j], b[j], cs[2 * j], inverse ? -cs[2 * j + 1] : cs[2 * j + 1], x1[j], x2[j]);
            largest = fmaxf(largest, fmaxf(fabsf(rounded<T>(x1[j])), fabsf(rounded<T>(x2[j]))));
        }
        store_vec<T, W>(x, x1);
        store_vec<T, W>(x + half, x2);
    }
    report_amax(amax, largest);
}
