// Fill and convert-copy.
#include "common.cuh"

template <typename T>
__global__ void fill(T* dst, long long n, float value) {
    const T v = from_f32<T>(value);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = v;
}

// One row of `cols` elements: dst[row] = src[0] with `into`, else dst[0] = src[row], where row
// is *at clamped into [0, rows) (the indexed tensor's rows), read when the kernel runs.
template <typename T>
__global__ void copy_row_at(T* dst, const T* src, const int* at, long long rows, long long cols, int into) {
    const long long row = min(max((long long)*at, 0LL), rows - 1);
    T* d = into ? dst + row * cols : dst;
    const T* s = into ? src : src + row * cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < cols;
         i += (long long)gridDim.x * blockDim.x)
        d[i] = s[i];
}

// dst = src, converting with round-to-nearest-even.
template <typename S, typename D>
__global__ void copy(D* dst, const S* src, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = from_f32<D>(to_f32(src[i]));
}
