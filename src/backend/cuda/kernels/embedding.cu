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

// One global bitonic step (k, j) with j >= SORT_TILE: element i pairs with i ^ j.
__global__ void bitonic_global(u64* keys, int k, int j) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int l = i ^ j;
    if (l > i) compare_swap(keys[i], keys[l], (i & k) == 0);
}

// The steps j < SORT_TILE (the host's, a power of two) of one tile of that many keys in
// shared memory, half as many threads a block, each holding one pair per step. With k == 0
// it runs every stage k = 2..SORT_TILE (sorting each tile in its bitonic direction);
// otherwise only the steps j = SORT_TILE/2..1 of stage k.
__global__ void bitonic_local(u64* keys, int k) {
    constexpr int HALF = SORT_TILE / 2;
    __shared__ u64 tile[SORT_TILE];
    const int base = blockIdx.x * SORT_TILE;
    tile[threadIdx.x] = keys[base + threadIdx.x];
    tile[threadIdx.x + HALF] = keys[base + threadIdx.x + HALF];
    __syncthreads();
    const int k_first = k == 0 ? 2 : k, k_last = k == 0 ? SORT_TILE : k;
    for (int kk = k_first; kk <= k_last; kk <<= 1) {
        for (int j = min(kk >> 1, HALF); j > 0; j >>= 1) {
            // Thread t handles the pair (i, i + j) with i's bit j clear.
            const int t = threadIdx.x;
            const int i = (t / j) * 2 * j + (t % j);
            compare_swap(tile[i], tile[i + j], ((base + i) & kk) == 0);
            __syncthreads();
        }
    }
    keys[base + threadIdx.x] = tile[threadIdx.x];
    keys[base + threadIdx.x + HALF] = tile[threadIdx.x + HALF];
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
