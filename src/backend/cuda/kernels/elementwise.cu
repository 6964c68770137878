// Fill, convert-copy and the deterministic sum of squares.
#include "common.cuh"

template <typename T>
__global__ void fill(T* dst, long long n, float value) {
    const T v = from_f32<T>(value);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = v;
}

// dst = src, converting with round-to-nearest-even.
template <typename S, typename D>
__global__ void copy(D* dst, const S* src, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = from_f32<D>(to_f32(src[i]));
}

// One tensor of a sum-of-squares list: its elements, their count, the elements before its
// first 16-byte boundary, and its run of blocks (which is also its run of partials).
struct SquaresEntry {
    const void* x;
    long long n, head;
    unsigned first_block, blocks;
};

// partials[block] = Σ x² over a fixed grid-stride pattern within the tensor whose run of
// blocks holds this one: 16-byte units from element `head`, the leftovers element-wise. The
// runs depend only on each n, and head only on x's address, so with `sum_ranges` the
// total is the same on every run. One launch covers a whole list of tensors (all of a
// model's gradients, several per layer, most of them small), whose launches one by one
// would cost more than their reads.
template <typename T>
__global__ void sum_squares_partial(float* partials, const SquaresEntry* list, int count) {
    const SquaresEntry e = list[entry_of_block(list, count)];
    const T* x = static_cast<const T*>(e.x);
    constexpr int W = access_width<T, true>();
    const EntryShare share = entry_share<W>(e);
    float acc = 0.0f;
    for (long long u = share.first; u < share.units; u += share.stride) {
        float v[W];
        load_vec<T, W>(v, x + e.head + u * W);
#pragma unroll
        for (int k = 0; k < W; k++) acc += v[k] * v[k];
    }
    const long long i = leftover(share.first, e.head, share.end, e.n);
    if (i >= 0) {
        const float v = to_f32(x[i]);
        acc += v * v;
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// out[r] = Σ x[offsets[r] .. offsets[r + 1]), each range by one block in a fixed order.
__global__ void sum_ranges(float* out, const float* x, const unsigned long long* offsets) {
    const long long end = offsets[blockIdx.x + 1];
    float acc = 0.0f;
    for (long long i = offsets[blockIdx.x] + threadIdx.x; i < end; i += blockDim.x) acc += x[i];
    acc = block_sum(acc);
    if (threadIdx.x == 0) out[blockIdx.x] = acc;
}
