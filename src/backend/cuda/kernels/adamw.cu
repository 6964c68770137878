// AdamW with decoupled weight decay and clipping by the global norm read on the device.
//
// This is the CPU's `adamw` step for step: f32 arithmetic in the same order, compiled with
// --fmad=false so that no multiply-add is contracted (division and square root are IEEE's,
// as on the CPU), the bias corrections and the clip factor computed as the CPU does; with the
// same inputs the GPU writes the same bits as the CPU. bf16 moments and weights are
// stochastically rounded with the CPU's hash of (seed, element index).
#include "common.cuh"

// The CPU's `hash_u32` (rounding.rs): the seed folded to 32 bits, index·φ, then the
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

// The CPU's `stochastic_round_bf16`: add 16 random bits below bf16's mantissa, truncate.
__device__ __forceinline__ bf16 stochastic_round_bf16(float x, u64 seed, u64 index) {
    if (!isfinite(x)) return __float2bfloat16_rn(x);
    const u32 noise = hash_u32(seed, index) & 0xFFFFu;
    const u32 bits = (__float_as_uint(x) + noise) & 0xFFFF0000u;
    return __ushort_as_bfloat16((unsigned short)(bits >> 16));
}

// The CPU's `store`: to T, stochastically when T is bf16 and asked, else to nearest.
template <typename T> __device__ __forceinline__ T store(float x, bool stochastic, u64 seed, u64 index);
template <> __device__ __forceinline__ float store<float>(float x, bool, u64, u64) { return x; }
template <> __device__ __forceinline__ bf16 store<bf16>(float x, bool stochastic, u64 seed, u64 index) {
    return stochastic ? stochastic_round_bf16(x, seed, index) : __float2bfloat16_rn(x);
}

// Param P, gradient Gr, moments M and V; with MASTER an f32 master copy is updated and P
// receives it rounded to nearest. `norm_sq` is Σ g² over all gradients (f32, on the device).
// With `amax`, also reports max |param| as stored, for the weights' FP8 copy (common.cuh).
template <typename P, typename Gr, typename M, typename V, bool MASTER>
__global__ void adamw(P* param, float* master, const Gr* grad, M* m, V* v, const float* norm_sq,
                      long long n, float lr, float beta1, float beta2, float eps,
                      float weight_decay, float bias1, float bias2, float grad_clip, u64 seed,
                      float* amax) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    // The CPU's `clip_scale`, in f64 then rounded to f32: once per block rather than an f64
    // square root and division in every thread.
    __shared__ float clip;
    if (threadIdx.x == 0) {
        const double norm = sqrt((double)norm_sq[0]);
        clip = (float)((grad_clip > 0.0f && norm > (double)grad_clip) ? (double)grad_clip / norm : 1.0);
    }
    __syncthreads();
    const float scale = clip;
    float largest = 0.0f;
    // No early return: every thread of the block takes part in the abs-max reduction.
    if (i < n) {
        const float g = to_f32(grad[i]) * scale;
        const float m_new = beta1 * to_f32(m[i]) + (1.0f - beta1) * g;
        const float v_new = beta2 * to_f32(v[i]) + (1.0f - beta2) * g * g;
        m[i] = store<M>(m_new, true, seed ^ 0x6Dull, (u64)i);
        v[i] = store<V>(v_new, true, seed ^ 0x76ull, (u64)i);
        const float update = (m_new / bias1) / (sqrtf(v_new / bias2) + eps);
        const float p = MASTER ? master[i] : to_f32(param[i]);
        const float p_new = p - lr * (update + weight_decay * p);
        P stored;
        if (MASTER) {
            master[i] = p_new;
            stored = store<P>(master[i], false, 0, 0);
        } else {
            stored = store<P>(p_new, true, seed, (u64)i);
        }
        param[i] = stored;
        largest = fabsf(to_f32(stored));
    }
    report_amax(amax, largest);
}
