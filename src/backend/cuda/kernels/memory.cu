// Fill and convert-copy.
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
