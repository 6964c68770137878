// The optimizer: AdamW with decoupled weight decay and clipping by the global norm read on
// the device, and the deterministic sums of squares that make that norm. Without contracted
// multiply-adds (below), the sums of squares add each rounded square as the CPU does.
//
// This is the CPU's `adamw` step for step: f32 arithmetic in the same order, compiled with
// --fmad=false so that no multiply-add is contracted (division and square root are IEEE's,
// as on the CPU), the bias factors taken from the host and the clip factor computed as the
// CPU does; with the same inputs the GPU writes the same bits as the CPU. bf16 moments and
// weights are stochastically rounded with the CPU's hash of (seed, element index).
//
// The update moves 14 to 30 bytes per parameter for about 90 instructions (one division,
// one square root and two hashes among them), so memory bandwidth and instruction issue
// both bound it: each thread takes W consecutive elements of every tensor at once, grid-
// stride, whenever the tensors can be aligned together. W fills 16 bytes of the widest
// tensor (8 for bf16 alone, 4 with an f32 one, whose bf16 tensors then take 8 bytes), so
// that each access instruction of a warp covers one contiguous span: with 8 f32 values a
// thread, its two 16-byte halves would each touch every other 16 bytes of twice the span,
// which costs nothing from device memory (the caches merge them) but twice the requests
// over PCIe when the state is offloaded to host memory. Each element still hashes its own
// index, so every width writes the same bits.
#include "common.cuh"

// The CPU's `stochastic_round_bf16`: add 16 random bits below bf16's mantissa, truncate.
__device__ __forceinline__ bf16 stochastic_round_bf16(float x, u32 noise) {
    if (!isfinite(x)) return __float2bfloat16_rn(x);
    const u32 bits = (__float_as_uint(x) + noise) & 0xFFFF0000u;
    return __ushort_as_bfloat16((unsigned short)(bits >> 16));
}

// The CPU's `store`: to T, stochastically with 16 bits of `noise` when T is bf16, else to
// nearest. Where the noise goes unused, its hash is dead code.
template <typename T> __device__ __forceinline__ T store(float x, u32 noise);
template <> __device__ __forceinline__ float store<float>(float x, u32) { return x; }
template <> __device__ __forceinline__ bf16 store<bf16>(float x, u32 noise) {
    return stochastic_round_bf16(x, noise);
}

// The CPU's MOMENTS_SEED, mixed into the tensor's seed for the moments' noise.
constexpr u64 MOMENTS_SEED = 0x6D;

// The step's hyperparameters; `scale` is the clip factor that multiplies each gradient, and
// the bias factors are the host's `AdamW::bias_factors`.
struct Hyper {
    float lr, beta1, beta2, eps, weight_decay, inv_bias1, inv_sqrt_bias2, scale;
    u64 seed;
};

// One element's step, the CPU's `step`: the clipped gradient g into the moments m and v,
// then the weight p from the new moments (not from their rounded images).
struct Step {
    float m, v, p;
};
__device__ __forceinline__ Step step(float g, float m, float v, float p, const Hyper& h) {
    const float m_new = h.beta1 * m + (1.0f - h.beta1) * g;
    const float v_new = h.beta2 * v + (1.0f - h.beta2) * g * g;
    const float update = (m_new * h.inv_bias1) / (sqrtf(v_new) * h.inv_sqrt_bias2 + h.eps);
    return {m_new, v_new, p - h.lr * (update + h.weight_decay * p)};
}

// Updates the K elements from index i on: K-wide accesses to every tensor (16-byte units
// when K values fill them, the caller having checked the alignment), then each element as
// the CPU does it. Returns the largest |param| stored, for the abs-max report.
template <int K, typename P, typename Gr, typename M, typename V, bool MASTER>
__device__ __forceinline__ float update(P* param, float* master, const Gr* grad, M* m, V* v,
                                        long long i, const Hyper& h) {
    float g[K], mk[K], vk[K], p[K];
    load_vec<Gr, K>(g, grad + i);
    load_vec<M, K>(mk, m + i);
    load_vec<V, K>(vk, v + i);
    if constexpr (MASTER) load_vec<float, K>(p, master + i);
    else load_vec<P, K>(p, param + i);
    float largest = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        const u64 index = (u64)(i + k);
        const Step s = step(g[k] * h.scale, mk[k], vk[k], p[k], h);
        // The values as stored (exact in M and V, so store_vec's rounding keeps them); the
        // two moments take the two halves of one hash.
        const u32 noise = hash_u32(h.seed ^ MOMENTS_SEED, index);
        mk[k] = to_f32(store<M>(s.m, noise & 0xFFFFu));
        vk[k] = to_f32(store<V>(s.v, noise >> 16));
        // With a master copy the working weights are its round-to-nearest image, which
        // store_vec makes; without one, p_new is rounded stochastically here.
        p[k] = MASTER ? s.p : to_f32(store<P>(s.p, hash_u32(h.seed, index) & 0xFFFFu));
        largest = fmaxf(largest, fabsf(MASTER ? rounded<P>(p[k]) : p[k]));
    }
    store_vec<M, K>(m + i, mk);
    store_vec<V, K>(v + i, vk);
    if constexpr (MASTER) store_vec<float, K>(master + i, p);
    store_vec<P, K>(param + i, p);
    return largest;
}

// `AdamW::clip_scale`, in f64 then rounded to f32: once per block, by one thread, rather
// than an f64 square root and division in every thread.
__device__ __forceinline__ float clip_scale(const float* norm_sq, float grad_clip) {
    const double norm = sqrt((double)norm_sq[0]);
    return (float)((grad_clip > 0.0f && norm > (double)grad_clip) ? (double)grad_clip / norm : 1.0);
}

// One tensor of an AdamW launch: its buffers (master and amax may be null), its length, the
// elements before the 16-byte boundary they all share (0 without the vector path), the seed
// of its rounding, its weight decay, and its run of the launch's blocks.
struct AdamWEntry {
    void* param;
    float* master;
    const void* grad;
    void* m;
    void* v;
    float* amax;
    long long n, head;
    u64 seed;
    float weight_decay;
    unsigned first_block, blocks;
};

// Param P, gradient Gr, moments M and V, for every tensor of `list`; with MASTER an f32
// master copy is updated and P receives it rounded to nearest. `norm_sq` is Σ g² over all
// gradients (f32, on the device). Where an entry has `amax`, also reports max |param| as
// stored, for the weights' FP8 copy (common.cuh). With W > 1 every tensor of an entry is
// 16-byte aligned at element `head` (< 8): elements from there on go W at a time, the `head`
// before and the tail after one at a time; with W = 1, head is 0 and every element goes alone.
// Each entry's run of blocks covers its n elements whatever its length. One launch per list
// rather than per tensor: a model has hundreds, most of them small. Held to 64 registers,
// four blocks of 256 threads per SM (the compiler's 67 fit three): each warp waits on its
// loads and then computes, so more warps keep more loads in flight (ptxas: no spills with
// bf16 states, 4 bytes with f32 ones; on an H100, 3B's update takes 6-9% less time than at
// three blocks).
template <typename P, typename Gr, typename M, typename V, bool MASTER, int W>
__global__ void __launch_bounds__(ADAMW_THREADS, 4)
    adamw(const AdamWEntry* list, int count, const float* norm_sq, float lr, float beta1,
          float beta2, float eps, float inv_bias1, float inv_sqrt_bias2, float grad_clip) {
    __shared__ float clip;
    if (threadIdx.x == 0) clip = clip_scale(norm_sq, grad_clip);
    __syncthreads();
    const AdamWEntry e = list[entry_of_block(list, count)];
    P* param = static_cast<P*>(e.param);
    const Gr* grad = static_cast<const Gr*>(e.grad);
    M* m = static_cast<M*>(e.m);
    V* v = static_cast<V*>(e.v);
    const Hyper h{lr, beta1, beta2, eps, e.weight_decay, inv_bias1, inv_sqrt_bias2, clip, e.seed};
    const EntryShare share = entry_share<W>(e);
    float largest = 0.0f;
    for (long long u = share.first; u < share.units; u += share.stride)
        largest = fmaxf(largest, update<W, P, Gr, M, V, MASTER>(param, e.master, grad, m, v,
                                                               e.head + u * W, h));
    if constexpr (W > 1) {
        const long long i = leftover(share.first, e.head, share.end, e.n);
        if (i >= 0)
            largest = fmaxf(largest,
                            update<1, P, Gr, M, V, MASTER>(param, e.master, grad, m, v, i, h));
    }
    // Every thread reaches this: all of them take part in the block's reduction.
    report_amax(e.amax, largest);
}

// One tensor of an 8-bit AdamW launch (adam8bit.rs): as AdamWEntry, with Q8 moments (a code
// per element) and each block's abs-max of them.
struct AdamW8bitEntry {
    void* param;
    float* master;
    const void* grad;
    unsigned char* m;
    unsigned char* v;
    float* m_absmax;
    float* v_absmax;
    float* amax;
    long long n;
    u64 seed;
    float weight_decay;
    unsigned first_block, blocks;
};

// A map's 255 values from its second on, in breadth-first order of the perfect binary
// search tree over them (node n at level L = bit length of n holds the value of rank
// (2(n - 2^(L-1)) + 1) · 2^(8-L)): a level's nodes are adjacent in shared memory, so the lanes
// of a warp descending together seldom meet in a bank, where bisecting the sorted values
// would send every lane of a level to one bank. Slot 0 holds the first value.
__device__ __forceinline__ void search_tree(float* tree, const float* map) {
    for (int n = threadIdx.x; n < 256; n += blockDim.x) {
        const int level = 32 - __clz(n);
        tree[n] = n == 0 ? map[0] : map[((n - (1 << (level - 1))) * 2 + 1) << (8 - level)];
    }
}

// The CPU's `DynamicMap::quantize`: the code whose value is nearest to x, ties to the lower.
// Eight descents of the tree (right where a node's value is ≤ x) end at leaf 256 + c, c the
// number of values from the second on that are ≤ x, which is the CPU's bisection's lower
// code; the last nodes passed on the right and on the left are that code's value and the
// next one's. So NaN, and values beyond the ends, find the CPU's codes too.
__device__ __forceinline__ unsigned char nearest_code(const float* tree, float x) {
    int n = 1;
    float below = tree[0], above = -NEG_INF;
#pragma unroll
    for (int level = 0; level < 8; level++) {
        const float key = tree[n];
        const bool right = key <= x;
        below = right ? key : below;
        above = right ? above : key;
        n = 2 * n + right;
    }
    const int lo = n - 256;
    return (unsigned char)(lo < 255 && above - x < x - below ? lo + 1 : lo);
}

// A block's scale, the CPU's `block_absmax`: the largest magnitude over the warp (NaN
// ignored, as fmaxf does), or 1 for a block of zeros.
__device__ __forceinline__ float block_scale(float largest) {
    largest = warp_max(largest);
    return largest == 0.0f ? 1.0f : largest;
}

// `adamw` with 8-bit moments (the CPU's `adamw_8bit`), one warp per block of Q8_BLOCK
// elements at a time: lane l takes elements l, l + 32, ... of it, so each access of the warp
// is one contiguous span whatever the tensors' alignment, and the block's new abs-maxes are
// warp reductions. `maps` holds the first moment's 256 values, then the second's. The
// moments are decoded (value · abs-max), stepped as the wider states are, and encoded to the
// codes nearest value / new abs-max. The update issues instructions more than it waits on
// memory (its two searches a value are the most of them), so it is held to 64 registers for
// four blocks an SM: a few bytes spill, and at Qwen2.5-1.5B's shapes the launch takes 10%
// less time than at the compiler's three (H200).
template <typename P, typename Gr, bool MASTER>
__global__ void __launch_bounds__(ADAMW_THREADS, 4)
    adamw_8bit(const AdamW8bitEntry* list, int count, const float* maps, const float* norm_sq,
               float lr, float beta1, float beta2, float eps, float inv_bias1,
               float inv_sqrt_bias2, float grad_clip) {
    constexpr int PER_LANE = Q8_BLOCK / 32;
    __shared__ float clip, map_m[256], map_v[256], tree_m[256], tree_v[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        map_m[i] = maps[i];
        map_v[i] = maps[256 + i];
    }
    search_tree(tree_m, maps);
    search_tree(tree_v, maps + 256);
    if (threadIdx.x == 0) clip = clip_scale(norm_sq, grad_clip);
    __syncthreads();
    const AdamW8bitEntry e = list[entry_of_block(list, count)];
    P* param = static_cast<P*>(e.param);
    const Gr* grad = static_cast<const Gr*>(e.grad);
    const Hyper h{lr, beta1, beta2, eps, e.weight_decay, inv_bias1, inv_sqrt_bias2, clip, e.seed};
    const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const long long blocks = (e.n + Q8_BLOCK - 1) / Q8_BLOCK;
    float largest = 0.0f;
    for (long long q = (blockIdx.x - e.first_block) * (long long)warps + threadIdx.x / 32;
         q < blocks; q += (long long)e.blocks * warps) {
        const float m_scale = e.m_absmax[q], v_scale = e.v_absmax[q];
        const long long first = q * Q8_BLOCK + lane;
        // Every load, then the arithmetic, then every store: the buffers might alias as far
        // as the compiler knows, so it keeps a load after a store before it, and one element
        // after another would each wait for memory.
        float g[PER_LANE], p[PER_LANE], ms[PER_LANE], vs[PER_LANE];
#pragma unroll
        for (int k = 0; k < PER_LANE; k++) {
            const long long i = first + k * 32;
            if (i >= e.n) continue;
            g[k] = to_f32(grad[i]) * h.scale;
            p[k] = MASTER ? e.master[i] : to_f32(param[i]);
            ms[k] = map_m[e.m[i]] * m_scale;
            vs[k] = map_v[e.v[i]] * v_scale;
        }
        float m_top = 0.0f, v_top = 0.0f;
#pragma unroll
        for (int k = 0; k < PER_LANE; k++) {
            const long long i = first + k * 32;
            if (i >= e.n) continue;
            const Step s = step(g[k], ms[k], vs[k], p[k], h);
            ms[k] = s.m;
            vs[k] = s.v;
            p[k] = s.p;
            m_top = fmaxf(m_top, fabsf(s.m));
            v_top = fmaxf(v_top, fabsf(s.v));
        }
#pragma unroll
        for (int k = 0; k < PER_LANE; k++) {
            const long long i = first + k * 32;
            if (i >= e.n) continue;
            P stored;
            if constexpr (MASTER) {
                e.master[i] = p[k];
                stored = from_f32<P>(p[k]);
            } else {
                stored = store<P>(p[k], hash_u32(h.seed, (u64)i) & 0xFFFFu);
            }
            param[i] = stored;
            largest = fmaxf(largest, fabsf(to_f32(stored)));
        }
        m_top = block_scale(m_top);
        v_top = block_scale(v_top);
#pragma unroll
        for (int k = 0; k < PER_LANE; k++) {
            const long long i = first + k * 32;
            if (i >= e.n) continue;
            e.m[i] = nearest_code(tree_m, ms[k] / m_top);
            e.v[i] = nearest_code(tree_v, vs[k] / v_top);
        }
        if (lane == 0) {
            e.m_absmax[q] = m_top;
            e.v_absmax[q] = v_top;
        }
    }
    // Every thread reaches this: all of them take part in the block's reduction.
    report_amax(e.amax, largest);
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
