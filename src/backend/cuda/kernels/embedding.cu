// Token embedding lookup and its deterministic gradient.
//
// The backward sorts (token, position) pairs with a bitonic sort, so that each vocabulary row
// is summed by one block over its positions in increasing order, exactly the CPU's order, with
// no float atomics.
#include "common.cuh"

// out[n, :] = wte[tokens[n], :]. A token outside [0, V) yields a NaN row, which shows in the loss.
template <typename T>
__global__ void embedding_forward(T* out, const int* tokens, const T* wte, int C, int V) {
    const int n = blockIdx.x;
    const int tok = tokens[n];
    const bool ok = tok >= 0 && tok < V;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        out[(long long)n * C + c] = ok ? wte[(long long)tok * C + c] : from_f32<T>(QUIET_NAN);
}

// keys[i] = (token << 32 | i) for i < N, and all ones (sorting last) up to the padded size P.
__global__ void embedding_sort_keys(u64* keys, const int* tokens, int N, int P) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < P) keys[i] = i < N ? ((u64)(u32)tokens[i] << 32) | (u64)i : ~0ull;
}

__device__ __forceinline__ void compare_swap(u64& a, u64& b, bool ascending) {
    if ((a > b) == ascending) {
        const u64 t = a;
        a = b;
        b = t;
    }
}

// One global bitonic step (k, j) with j >= 1024: element i pairs with i ^ j.
__global__ void bitonic_global(u64* keys, int k, int j) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int l = i ^ j;
    if (l > i) compare_swap(keys[i], keys[l], (i & k) == 0);
}

// The steps j < 1024 of one tile of 1024 keys in shared memory, 512 threads a block. With
// k == 0 it runs every stage k = 2..1024 (sorting each tile in its bitonic direction);
// otherwise only the steps j = 512..1 of stage k.
__global__ void bitonic_local(u64* keys, int k) {
    __shared__ u64 tile[1024];
    const int base = blockIdx.x * 1024;
    tile[threadIdx.x] = keys[base + threadIdx.x];
    tile[threadIdx.x + 512] = keys[base + threadIdx.x + 512];
    __syncthreads();
    const int k_first = k == 0 ? 2 : k, k_last = k == 0 ? 1024 : k;
    for (int kk = k_first; kk <= k_last; kk <<= 1) {
        for (int j = min(kk >> 1, 512); j > 0; j >>= 1) {
            // Thread t handles the pair (i, i + j) with i's bit j clear.
            const int t = threadIdx.x;
            const int i = (t / j) * 2 * j + (t % j);
            compare_swap(tile[i], tile[i + j], ((base + i) & kk) == 0);
            __syncthreads();
        }
    }
    keys[base + threadIdx.x] = tile[threadIdx.x];
    keys[base + threadIdx.x + 512] = tile[threadIdx.x + 512];
}

// Block i owns the run of sorted keys that starts at i (if one does): it adds the rows of
// `dout` of that token, in position order, to the token's row of `dwte`.
// With `accumulate` false the caller has zeroed `dwte` first.
template <typename T>
__global__ void embedding_backward(T* dwte, const u64* keys, const T* dout, int N, int C, int V) {
    const int i = blockIdx.x;
    const u32 tok = (u32)(keys[i] >> 32);
    if (i > 0 && (u32)(keys[i - 1] >> 32) == tok) return;
    if (tok >= (u32)V) return;
    int end = i;
    while (end < N && (u32)(keys[end] >> 32) == tok) end++;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = to_f32(dwte[(long long)tok * C + c]);
        for (int s = i; s < end; s++) {
            const long long n = (long long)(keys[s] & 0xffffffffull);
            acc += to_f32(dout[n * C + c]);
        }
        dwte[(long long)tok * C + c] = from_f32<T>(acc);
    }
}
