// Rotary position embedding in place on the fused qkv rows, HF rotate-half layout: element i
// of a head pairs with element i + D/2. `freqs` is [T, D/2, 2] of (cos, sin); `inverse`
// rotates back, which is the gradient of the forward rotation.
#include "common.cuh"

// One thread per (row, rotated head, pair). qkv: [B·T, W]; the first q_heads + kv_heads heads
// of each row are rotated, the value heads are left alone.
template <typename T>
__global__ void rope(T* qkv, const float* freqs, long long rows, int seq, int heads, int D,
                     int W, int inverse) {
    const int half = D / 2;
    const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (idx >= rows * heads * half) return;
    const int i = (int)(idx % half);
    const int head = (int)((idx / half) % heads);
    const long long n = idx / ((long long)half * heads);
    const int t = (int)(n % seq);
    const float cs = freqs[((long long)t * half + i) * 2];
    const float sn_f = freqs[((long long)t * half + i) * 2 + 1];
    const float sn = inverse ? -sn_f : sn_f;
    T* x = qkv + n * W + (long long)head * D;
    const float a = to_f32(x[i]), b = to_f32(x[i + half]);
    x[i] = from_f32<T>(a * cs - b * sn);
    x[i + half] = from_f32<T>(b * cs + a * sn);
}
