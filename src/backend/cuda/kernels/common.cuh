// Shared helpers for every smelt kernel: storage types, conversions and block reductions.
// Storage is `float` or `bf16`; arithmetic is in f32 (all but AdamW's clip factor, which
// adamw.cu computes in f64 as the CPU does).
#pragma once
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;
typedef unsigned long long u64;
typedef unsigned int u32;

#define NEG_INF __int_as_float(0xff800000)
#define QUIET_NAN __int_as_float(0x7fffffff)

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }

// Round-to-nearest-even into the storage type, as the CPU backend's `round_slice` does.
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) { return __float2bfloat16_rn(x); }

// The value `x` takes once stored as T and read back.
template <typename T> __device__ __forceinline__ float rounded(float x) { return to_f32(from_f32<T>(x)); }

constexpr float LOG2E = 1.4426950408889634f;

// 2^x in one MUFU instruction; subnormal results flush to zero, which no probability here
// distinguishes from zero (exp2f adds a range fix-up around the same instruction).
__device__ __forceinline__ float exp2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

struct SumOp {
    static __device__ __forceinline__ float identity() { return 0.0f; }
    static __device__ __forceinline__ float warp(float x) { return warp_sum(x); }
};
struct MaxOp {
    static __device__ __forceinline__ float identity() { return NEG_INF; }
    static __device__ __forceinline__ float warp(float x) { return warp_max(x); }
};

// Reduces over the block in a fixed tree order, so the result is the same on every run.
// Every thread must call it; every thread gets the result. `blockDim.x` is a multiple of 32.
template <typename Op>
__device__ __forceinline__ float block_reduce(float x) {
    __shared__ float partial[32];
    __shared__ float total;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    x = Op::warp(x);
    __syncthreads();  // `partial` and `total` may still be read after a previous call
    if (lane == 0) partial[warp] = x;
    __syncthreads();
    if (warp == 0) {
        float y = lane < warps ? partial[lane] : Op::identity();
        y = Op::warp(y);
        if (lane == 0) total = y;
    }
    __syncthreads();
    return total;
}

__device__ __forceinline__ float block_sum(float x) { return block_reduce<SumOp>(x); }
__device__ __forceinline__ float block_max(float x) { return block_reduce<MaxOp>(x); }

// tanh(x) in one MUFU operation, relative error up to 2^-10.987 (PTX's bound).
__device__ __forceinline__ float tanh_fast(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// σ(x) = 1 / (1 + e^-x) and silu(x) = x σ(x). In f32 from MUFU's 2^x and reciprocal, close to
// exact (a few instructions where expf and an IEEE division take dozens; far out, 2^x gives 0
// or +inf, and the reciprocal 1 or 0). In bf16 from MUFU's one tanh, σ(x) = (1 + tanh(x/2)) / 2:
// one MUFU operation and two steps fewer in each element's chain, which is what bounds the
// fused gate/up matmul's epilogue. That costs accuracy: σ's error is up to about 2^-12 and
// silu's 2^-12 |x|, under bf16's rounding of silu(x) where x > 0, but larger than silu(x)
// itself far left, where σ(x) is below 2^-12 (x < -8). Against the CPU's exact SwiGLU the bf16
// output's relative error is up to 1.6e-4, against 5.3e-5 with the f32 formula (the test's
// tolerance is 1e-2); the FP8 convergence run and transformers' loss on an export stay within
// their run-to-run spread (docs/fp8.md).
template <typename T> __device__ __forceinline__ float sigmoid(float x) {
    if constexpr (sizeof(T) == 2) {
        return fmaf(0.5f, tanh_fast(0.5f * x), 0.5f);
    } else {
        float y;
        asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(1.0f + exp2_fast(-x * LOG2E)));
        return y;
    }
}
template <typename T> __device__ __forceinline__ float silu(float x) {
    if constexpr (sizeof(T) == 2) {
        const float h = 0.5f * x;  // x σ(x) = h + h tanh(h): no constant held in a register
        return fmaf(h, tanh_fast(h), h);
    } else {
        return x * sigmoid<T>(x);
    }
}
// SwiGLU of one gate and up value stored as T: swiglu.cu's forward and gemm_tn.cu's fused
// epilogue share it, so that the two give the same bits.
template <typename T> __device__ __forceinline__ float swiglu(float g, float u) { return silu<T>(g) * u; }
// Its gradients: d gate = dy · u · σ(g)(1 + g(1 − σ(g))), d up = dy · silu(g); swiglu.cu's
// backward and gemm_tn.cu's fused one share it.
template <typename T>
__device__ __forceinline__ void swiglu_grads(float g, float u, float dy, float& dg, float& du) {
    const float s = sigmoid<T>(g);
    dg = dy * u * s * (1.0f + g * (1.0f - s));
    du = dy * g * s;
}

// RoPE's rotation of one pair, HF rotate-half style: a from a head's first half, b the element
// D/2 after it, by the angle of cosine co and sine si (its inverse, the gradient's, by -si).
// rope.cu and colsum.cu's fused backward share it, so that the two give the same bits.
__device__ __forceinline__ void rope_rotate(float a, float b, float co, float si, float& x1, float& x2) {
    x1 = a * co - b * si;
    x2 = b * co + a * si;
}

// Packed documents (attention.rs, `docs`): where each token of sequence b starts its document
// and where that document ends (exclusive), from `docs` [2][B][T] i32; a null `docs` is one
// document a sequence. A token's queries and keys meet only within a document. Whatever the
// values, a start is taken within [0, t] and an end within [t + 1, T], so that no index
// derived from them leaves the sequence.
struct Documents {
    const int* starts;  // this sequence's, or null
    const int* ends;
    int T;
    __device__ __forceinline__ int start(int t) const { return starts ? min(max(starts[t], 0), t) : 0; }
    __device__ __forceinline__ int end(int t) const { return ends ? min(max(ends[t], t + 1), T) : T; }
};
__device__ __forceinline__ Documents documents(const int* docs, int b, int B, int T) {
    if (docs == nullptr) return {nullptr, nullptr, T};
    return {docs + static_cast<long long>(b) * T, docs + (static_cast<long long>(B) + b) * T, T};
}

// FP8 current scaling: raises amax[0] to the largest `x` of the block (each thread's x is the
// max |value| it stored, so ≥ 0; NaN values were dropped by fmaxf, as the CPU drops them).
// Non-negative floats order like their int bits, so one integer atomicMax per block does it,
// and a max does not depend on the order the blocks arrive in: deterministic. A null amax
// (the op was not asked for it) skips the reduction. Every thread of the block must call it.
__device__ __forceinline__ void report_amax(float* amax, float x) {
    if (amax == nullptr) return;
    x = block_max(x);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(x));
}

// The CPU's `hash_u32` (rounding.rs), for stochastic rounding: the seed folded to 32 bits, index·φ, then the
// "lowbias32" finalizer, in 32-bit integer arithmetic (64-bit multiplies are emulated).
__device__ __forceinline__ u32 hash_u32(u64 seed, u64 index) {
    const u32 folded = (u32)seed ^ __funnelshift_l((u32)(seed >> 32), (u32)(seed >> 32), 16);
    u32 z = folded ^ ((u32)index * 0x9E3779B9u);
    z ^= z >> 16;
    z *= 0x7FEB352Du;
    z ^= z >> 15;
    z *= 0x846CA68Bu;
    return z ^ (z >> 16);
}

// The raw word that W values of T fill, for accesses of 16 or 8 bytes.
template <int BYTES> struct raw_word;
template <> struct raw_word<16> { using type = uint4; };
template <> struct raw_word<8> { using type = uint2; };

// Bytes per access of W values of T: 16 when they fill whole 16-byte units, 8 when they fill
// exactly 8 bytes, else 0 (element by element).
template <typename T, int W> __device__ constexpr int vec_bytes() {
    return W * (int)sizeof(T) % 16 == 0 ? 16 : W * (int)sizeof(T) == 8 ? 8 : 0;
}

// W consecutive values at p as f32: 16-byte accesses when W values of T fill whole 16-byte
// units, one 8-byte access when they fill 8 bytes (p must then be aligned to that size),
// else element by element.
template <typename T, int W>
__device__ __forceinline__ void load_vec(float (&v)[W], const T* p) {
    constexpr int BYTES = vec_bytes<T, W>();
    if constexpr (BYTES > 0) {
        using Word = typename raw_word<BYTES>::type;
        constexpr int PER = BYTES / (int)sizeof(T);  // values per access
#pragma unroll
        for (int u = 0; u < W / PER; u++) {
            const Word raw = reinterpret_cast<const Word*>(p)[u];
            const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int i = 0; i < PER; i++) v[u * PER + i] = to_f32(e[i]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < W; i++) v[i] = to_f32(p[i]);
    }
}

// Stores W values rounded to T at p, as `load_vec` reads them.
template <typename T, int W>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[W]) {
    constexpr int BYTES = vec_bytes<T, W>();
    if constexpr (BYTES > 0) {
        using Word = typename raw_word<BYTES>::type;
        constexpr int PER = BYTES / (int)sizeof(T);
#pragma unroll
        for (int u = 0; u < W / PER; u++) {
            Word raw;
            T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
            for (int i = 0; i < PER; i++) e[i] = from_f32<T>(v[u * PER + i]);
            reinterpret_cast<Word*>(p)[u] = raw;
        }
    } else {
#pragma unroll
        for (int i = 0; i < W; i++) p[i] = from_f32<T>(v[i]);
    }
}

// Two bf16 values in one 32-bit word, the first in the low half, as they lie in memory: the
// form in which mma.sync takes bf16 operands from registers, and in which kernels round,
// store and read values two at a time. bf16 is the top half of an f32.
__device__ __forceinline__ u32 bf16_pair(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&v);
}
__device__ __forceinline__ float bf16_low(u32 pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_high(u32 pair) { return __uint_as_float(pair & 0xffff0000u); }

// W values of T as one access loads them, kept packed until used: 16 bytes as four 32-bit
// words (so that the loads in flight per operand cost 4 registers each, a bf16 pair
// sharing one), or a single element without VEC.
template <typename T, int W>
struct Packed {
    u32 word[4];
    // bf16: element k is the low (even k) or high half of a word.
    __device__ __forceinline__ float operator[](int k) const {
        if constexpr (sizeof(T) == 4) return __uint_as_float(word[k]);
        else return k % 2 ? bf16_high(word[k / 2]) : bf16_low(word[k / 2]);
    }
};

template <typename T>
struct Packed<T, 1> {
    T value;
    __device__ __forceinline__ float operator[](int) const { return to_f32(value); }
};

template <typename T, int W>
__device__ __forceinline__ Packed<T, W> load_packed(const T* p) {
    if constexpr (W == 1) {
        return {*p};
    } else {
        static_assert(W * sizeof(T) == 16, "a packed access is one element or 16 bytes");
        const uint4 q = *reinterpret_cast<const uint4*>(p);
        return {{q.x, q.y, q.z, q.w}};
    }
}

// Vector kernels take units of W elements from element `head` (where their pointers are
// aligned) to `end`; the head before and the n - end elements after are left over, fewer than
// 2·W of them when head < W, and thread t of the grid takes leftover number t. Returns its
// index, or -1 when there is none for t.
__device__ __forceinline__ long long leftover(long long t, long long head, long long end,
                                              long long n) {
    return t < head ? t : t - head < n - end ? end + (t - head) : -1;
}

// Multi-tensor launches give each tensor of their table a run of consecutive blocks, in table
// order. Returns the index of the entry whose run holds this block: the last one whose run
// starts at or before it (an empty run shares its start with the next and is skipped).
template <typename Entry>
__device__ __forceinline__ int entry_of_block(const Entry* list, int count) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (list[mid].first_block <= blockIdx.x) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// A thread's share of its entry's elements (the entry found by entry_of_block, with n
// elements of which the `head` before its 16-byte boundary are left over): units of W
// elements from `head` up to `end`, this thread's first unit and the stride between its
// units over the entry's run of blocks. Its leftover, if any, is leftover(first, head, end, n).
struct EntryShare {
    long long first, stride, units, end;
};
template <int W, typename Entry>
__device__ __forceinline__ EntryShare entry_share(const Entry& e) {
    const long long units = (e.n - e.head) / W;
    return {(blockIdx.x - e.first_block) * (long long)blockDim.x + threadIdx.x,
            (long long)e.blocks * blockDim.x, units, e.head + units * W};
}

// Values per access: a whole 16 bytes with `vec` (the caller checked the alignment), else one.
template <typename T, bool VEC>
__host__ __device__ constexpr int access_width() { return VEC ? 16 / (int)sizeof(T) : 1; }
