// Causal grouped-query attention on the tensor cores (FlashAttention-2 style), for bf16 storage:
// mma.sync m16n8k16 with bf16 operands and f32 accumulation. Same layouts and results as
// attention.cu (the CUDA-core version, the reference this is tested against), within bf16
// rounding.
//
// Layouts (row-major): qkv [B, T, (Hq + 2 Hkv) * D] holding q heads, then k heads, then v heads;
// out [B, T, Hq * D]; lse [B, Hq, T] (natural log-sum-exp of each scaled score row, f32);
// dqkv like qkv. The head size D is a template parameter (64, 80, 96 or 128).
//
// Forward: one block of 4 warps per (64 queries, q head, batch); each warp owns 16 query rows
// and streams 64-key tiles of K and V through shared memory with an online softmax.
// Backward, deterministic (no atomics), after attention.cu's `attention_backward_delta`
// (delta = rowsum(dout * out)): `attention_backward_dkdv_tc` gives one block per (64 keys,
// kv head, batch) that loops over the group's q heads and the query tiles at or after the
// diagonal, each warp owning 16 keys; `attention_backward_dq_tc` gives one block per
// (64 queries, q head, batch), each warp owning 16 queries. Both recompute the scores. Only
// the diagonal tile and the one at the sequence's end apply the causal mask; the others, all
// but one or two of a block's tiles, skip its index arithmetic (with `exp2_fast`, that took
// a third off the backward's time at D = 64).
//
// Shared memory is dynamic (it exceeds the 48 KB static limit at D = 128): the launcher passes
// `tiles * 64 * (D + 8) * 2` bytes — 3 tiles for the forward, 4 for dq, and 4 tiles plus 512
// bytes for dkdv (attention.rs, `tc_smem`) — and raises the kernel's limit to match.
//
// Tensor-core fragments follow PTX's mma.m16n8k16 layouts: in a 16x8 f32 accumulator, lane l
// holds rows l/4 and l/4 + 8, columns 2(l%4) and 2(l%4) + 1; an accumulator pair over 16
// columns is, packed to bf16, exactly the A operand of the next product (the FA2 trick).

#include "common.cuh"

namespace tc {

constexpr int TILE = 64;            // queries or keys per block tile
constexpr int WARPS = 4;            // 16 rows each
constexpr int THREADS = WARPS * 32;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
// Padded shared row of a D-wide tile: 16 bytes keep ldmatrix rows off one bank.
template <int D> __host__ __device__ constexpr int ld() { return D + 8; }

extern __shared__ __align__(16) unsigned char smem[];

// The i-th 64-row tile of dynamic shared memory.
template <int D>
__device__ __forceinline__ bf16* smem_tile(int i) {
    return reinterpret_cast<bf16*>(smem) + i * TILE * ld<D>();
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(unsigned r[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldsm_x4_t(unsigned r[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}

// c += a * b for one 16x8 tile, k = 16.
__device__ __forceinline__ void mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// Copies rows [0, valid) of a TILE x D tile (row stride `stride` elements) into shared memory,
// zero-filling the rest so padded rows contribute nothing.
template <int D>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, int valid, size_t stride) {
    constexpr int CHUNKS = D / 8;
    for (int i = threadIdx.x; i < TILE * CHUNKS; i += THREADS) {
        const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < valid) v = *reinterpret_cast<const uint4*>(src + r * stride + c);
        *reinterpret_cast<uint4*>(dst + r * ld<D>() + c) = v;
    }
}

// Address of lane's row for an A operand (16 rows x 16 cols at row0, col0) or for a
// non-transposed B pair (two 8-row blocks of n, 16 of k): matrix j = lane/8 covers
// rows +8*(j%2) and cols +8*(j/2) for A; rows +8*(j/2) and cols +8*(j%2) for B.
template <int D>
__device__ __forceinline__ const bf16* a_addr(const bf16* s, int row0, int col0, int lane) {
    return s + (row0 + (lane % 8) + ((lane / 8) % 2) * 8) * ld<D>() + col0 + (lane / 16) * 8;
}
template <int D>
__device__ __forceinline__ const bf16* b_addr(const bf16* s, int row0, int col0, int lane) {
    return s + (row0 + (lane % 8) + (lane / 16) * 8) * ld<D>() + col0 + ((lane / 8) % 2) * 8;
}
// A transposed-B pair for an operand stored [k rows, n cols]: rows +8*(j%2), cols +8*(j/2).
template <int D>
__device__ __forceinline__ const bf16* bt_addr(const bf16* s, int row0, int col0, int lane) {
    return a_addr<D>(s, row0, col0, lane);
}

// acc[nb] (16 rows x 8*nb) += A(16 x D, from shared rows row0..) * Bᵀ where B rows are
// `n` rows of shared tile `b` (n = 8 * NB): scores of 16 rows against NB*8 rows.
template <int D, int NB>
__device__ __forceinline__ void scores(float acc[NB][4], const bf16* a, int a_row0, const bf16* b, int b_row0, int lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        unsigned af[4];
        ldsm_x4(af, a_addr<D>(a, a_row0, kk * 16, lane));
#pragma unroll
        for (int nb = 0; nb < NB; nb += 2) {
            unsigned bf[4];
            ldsm_x4(bf, b_addr<D>(b, b_row0 + nb * 8, kk * 16, lane));
            mma(acc[nb], af, bf[0], bf[1]);
            mma(acc[nb + 1], af, bf[2], bf[3]);
        }
    }
}

// acc (16 x D) += P (16 x 8*NB, accumulator layout, packed to bf16) * V where V rows are
// shared rows v_row0.. of `v` (row = the contracted index).
template <int D, int NB>
__device__ __forceinline__ void accumulate_pv(float acc[D / 8][4], const float p[NB][4], const bf16* v, int v_row0, int lane) {
#pragma unroll
    for (int kk = 0; kk < NB / 2; ++kk) {
        const unsigned pf[4] = {pack(p[2 * kk][0], p[2 * kk][1]), pack(p[2 * kk][2], p[2 * kk][3]),
                                pack(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
        for (int db = 0; db < D / 8; db += 2) {
            unsigned vf[4];
            ldsm_x4_t(vf, bt_addr<D>(v, v_row0 + kk * 16, db * 8, lane));
            mma(acc[db], pf, vf[0], vf[1]);
            mma(acc[db + 1], pf, vf[2], vf[3]);
        }
    }
}

// 2^x in one MUFU instruction; subnormal results flush to zero, which no probability here
// distinguishes from zero (exp2f adds a range fix-up around the same instruction).
__device__ __forceinline__ float exp2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

struct Heads {
    size_t stride;   // elements per token row of qkv
    const bf16* q;   // this (batch, head)'s q column block at token 0
    const bf16* k;
    const bf16* v;
};

template <int D>
__device__ __forceinline__ Heads heads(const bf16* qkv, int T, int Hq, int Hkv, int b, int h) {
    const int g = h / (Hq / Hkv);
    const size_t stride = static_cast<size_t>(Hq + 2 * Hkv) * D;
    const bf16* base = qkv + static_cast<size_t>(b) * T * stride;
    return {stride, base + h * D, base + (Hq + g) * D, base + (Hq + Hkv + g) * D};
}

// Whether element e of column block nb, in a score tile of query rows against the 64 keys
// from k0, is a key its query sees (at or before it, inside the sequence). Without MASK the
// caller knows every key is.
template <bool MASK>
__device__ __forceinline__ bool visible(int k0, int nb, int e, const int rows[2], int T, int lane) {
    const int key = k0 + nb * 8 + (lane % 4) * 2 + (e & 1);
    return !MASK || (key <= rows[e / 2] && key < T);
}

// Scores of 16 query rows against the 64 keys from k0, into log2 units; with MASK, keys after
// a row's query or past the sequence get -inf.
template <bool MASK>
__device__ __forceinline__ void scale_scores(float s[TILE / 8][4], float log2_scale, int k0, const int rows[2], int T,
                                             int lane) {
#pragma unroll
    for (int nb = 0; nb < TILE / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            s[nb][e] = visible<MASK>(k0, nb, e, rows, T, lane) ? s[nb][e] * log2_scale : NEG_INF;
}

// The dK/dV kernel's Pᵀ and dSᵀ over 16 keys x 64 queries from q0 (scores in place):
// p = exp2(s·scale·log2e − lse) and ds = p (dp − delta), with each query's lse (log2 units)
// and delta from shared memory. With MASK, keys after their query and queries past the
// sequence get zeros.
template <bool MASK>
__device__ __forceinline__ void dkdv_probabilities(float p[TILE / 8][4], float dp[TILE / 8][4], float log2_scale,
                                                   const float* sL, const float* sD, int q0, const int keys[2],
                                                   int T, int lane) {
#pragma unroll
    for (int nb = 0; nb < TILE / 8; ++nb) {
        const int qi = nb * 8 + (lane % 4) * 2;
        const float2 l = *reinterpret_cast<const float2*>(sL + qi), d = *reinterpret_cast<const float2*>(sD + qi);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int query = q0 + qi + (e & 1);
            const bool live = !MASK || (query >= keys[e / 2] && query < T);
            const float pe = live ? exp2_fast(fmaf(p[nb][e], log2_scale, -((e & 1) ? l.y : l.x))) : 0.f;
            p[nb][e] = pe;
            dp[nb][e] = pe * (dp[nb][e] - ((e & 1) ? d.y : d.x));
        }
    }
}

// The dQ kernel's dS over 16 queries x 64 keys from k0 (scores in place), as above with each
// row's lse and delta.
template <bool MASK>
__device__ __forceinline__ void dq_probabilities(float p[TILE / 8][4], float ds[TILE / 8][4], float log2_scale,
                                                 const float row_lse[2], const float row_delta[2], int k0,
                                                 const int rows[2], int T, int lane) {
#pragma unroll
    for (int nb = 0; nb < TILE / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float pe = visible<MASK>(k0, nb, e, rows, T, lane)
                                 ? exp2_fast(fmaf(p[nb][e], log2_scale, -row_lse[e / 2]))
                                 : 0.f;
            ds[nb][e] = pe * (ds[nb][e] - row_delta[e / 2]);
        }
}

}  // namespace tc

// Registers capped at 128 so that 4 blocks (16 warps) share an SM: no spills at any D.
template <int D>
__global__ void __launch_bounds__(tc::THREADS, 4)
    attention_forward_tc(bf16* __restrict__ out, float* __restrict__ lse, const bf16* __restrict__ qkv, int T, int Hq,
                         int Hkv, float scale, float* __restrict__ amax) {
    using namespace tc;
    bf16 *sQ = smem_tile<D>(0), *sK = smem_tile<D>(1), *sV = smem_tile<D>(2);
    // Causal work grows with the query tile, so the last tiles go first: fewer stragglers.
    const int q0 = (gridDim.x - 1 - blockIdx.x) * TILE, h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const Heads hd = heads<D>(qkv, T, Hq, Hkv, b, h);
    const float log2_scale = scale * LOG2E;  // scores in log2 units
    const int rows[2] = {q0 + warp * 16 + lane / 4, q0 + warp * 16 + lane / 4 + 8};

    load_tile<D>(sQ, hd.q + q0 * hd.stride, min(TILE, T - q0), hd.stride);
    float o[D / 8][4] = {};
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    const int tiles = (min(q0 + TILE, T) - 1) / TILE + 1;  // key tiles up to the diagonal
    for (int t = 0; t < tiles; ++t) {
        const int k0 = t * TILE;
        load_tile<D>(sK, hd.k + k0 * hd.stride, min(TILE, T - k0), hd.stride);
        load_tile<D>(sV, hd.v + k0 * hd.stride, min(TILE, T - k0), hd.stride);
        __syncthreads();
        float s[TILE / 8][4] = {};
        scores<D, TILE / 8>(s, sQ, warp * 16, sK, 0, lane);
        // Only the diagonal tile, the last, holds keys after a row's query or past the end.
        if (t == tiles - 1)
            scale_scores<true>(s, log2_scale, k0, rows, T, lane);
        else
            scale_scores<false>(s, log2_scale, k0, rows, T, lane);
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int nb = 0; nb < TILE / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], s[nb][e]);
        float corr[2], sum[2] = {0.f, 0.f};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = quad_max(mx[r]);
            corr[r] = exp2_fast(m[r] - mx[r]);  // exp2(-inf) = 0 on the first tile
            m[r] = mx[r];
        }
#pragma unroll
        for (int nb = 0; nb < TILE / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nb][e] = exp2_fast(s[nb][e] - m[e / 2]);
                sum[e / 2] += s[nb][e];
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) l[r] = l[r] * corr[r] + quad_sum(sum[r]);
#pragma unroll
        for (int db = 0; db < D / 8; ++db) {
            o[db][0] *= corr[0]; o[db][1] *= corr[0];
            o[db][2] *= corr[1]; o[db][3] *= corr[1];
        }
        accumulate_pv<D, TILE / 8>(o, s, sV, 0, lane);
        __syncthreads();  // before the next tile overwrites sK and sV
    }
    float largest = 0.f;  // max |out| as stored, for FP8 scaling (report_amax)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= T) continue;
        const float inv = 1.f / l[r];
        bf16* dst = out + (static_cast<size_t>(b) * T + rows[r]) * Hq * D + h * D + (lane % 4) * 2;
#pragma unroll
        for (int db = 0; db < D / 8; ++db) {
            const __nv_bfloat162 y = __floats2bfloat162_rn(o[db][2 * r] * inv, o[db][2 * r + 1] * inv);
            *reinterpret_cast<__nv_bfloat162*>(dst + db * 8) = y;
            largest = fmaxf(largest, fmaxf(fabsf(__low2float(y)), fabsf(__high2float(y))));
        }
        if (lane % 4 == 0) lse[(static_cast<size_t>(b) * Hq + h) * T + rows[r]] = (m[r] + log2f(l[r])) * LN2;
    }
    report_amax(amax, largest);
}

// dK and dV for 64 keys of one kv head, summed over the group's q heads and the query tiles
// that see them, in a fixed order. Each warp owns 16 keys and works with transposed scores
// Sᵀ = K Qᵀ so that its accumulators are rows of dK and dV.
template <int D>
__global__ void __launch_bounds__(tc::THREADS)
    attention_backward_dkdv_tc(bf16* __restrict__ dqkv, const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                               const float* __restrict__ lse, const float* __restrict__ delta, int T, int Hq, int Hkv,
                               float scale) {
    using namespace tc;
    bf16 *sK = smem_tile<D>(0), *sV = smem_tile<D>(1), *sQ = smem_tile<D>(2), *sO = smem_tile<D>(3);  // sO: dout
    float* sL = reinterpret_cast<float*>(smem_tile<D>(4));  // lse of the query tile, log2 units
    float* sD = sL + TILE;                               // delta of the query tile
    const int k0 = blockIdx.x * TILE, g = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = Hq / Hkv;
    const Heads kv = heads<D>(qkv, T, Hq, Hkv, b, g * group);
    const int keys[2] = {k0 + warp * 16 + lane / 4, k0 + warp * 16 + lane / 4 + 8};
    const float log2_scale = scale * LOG2E;

    load_tile<D>(sK, kv.k + k0 * kv.stride, min(TILE, T - k0), kv.stride);
    load_tile<D>(sV, kv.v + k0 * kv.stride, min(TILE, T - k0), kv.stride);
    float dk[D / 8][4] = {}, dv[D / 8][4] = {};
    for (int h = g * group; h < (g + 1) * group; ++h) {
        const Heads qh = heads<D>(qkv, T, Hq, Hkv, b, h);
        const bf16* dout_h = dout + static_cast<size_t>(b) * T * Hq * D + h * D;
        for (int q0 = k0; q0 < T; q0 += TILE) {  // query tiles at or after the diagonal
            __syncthreads();  // the previous tile's readers are done
            load_tile<D>(sQ, qh.q + q0 * qh.stride, min(TILE, T - q0), qh.stride);
            load_tile<D>(sO, dout_h + static_cast<size_t>(q0) * Hq * D, min(TILE, T - q0), static_cast<size_t>(Hq) * D);
            for (int i = threadIdx.x; i < TILE; i += THREADS) {
                const bool ok = q0 + i < T;
                sL[i] = ok ? lse[(static_cast<size_t>(b) * Hq + h) * T + q0 + i] * LOG2E : 0.f;
                sD[i] = ok ? delta[(static_cast<size_t>(b) * Hq + h) * T + q0 + i] : 0.f;
            }
            __syncthreads();
            float p[TILE / 8][4] = {}, dp[TILE / 8][4] = {};
            scores<D, TILE / 8>(p, sK, warp * 16, sQ, 0, lane);   // Sᵀ: keys x queries
            scores<D, TILE / 8>(dp, sV, warp * 16, sO, 0, lane);  // dPᵀ = V doutᵀ
            // Off the diagonal tile and the sequence's end, every query sees every key.
            if (q0 == k0 || q0 + TILE > T)
                dkdv_probabilities<true>(p, dp, log2_scale, sL, sD, q0, keys, T, lane);
            else
                dkdv_probabilities<false>(p, dp, log2_scale, sL, sD, q0, keys, T, lane);
            accumulate_pv<D, TILE / 8>(dv, p, sO, 0, lane);   // dV += Pᵀ dout
            accumulate_pv<D, TILE / 8>(dk, dp, sQ, 0, lane);  // dK += dSᵀ Q (scaled below)
        }
    }
    bf16* base = dqkv + static_cast<size_t>(b) * T * kv.stride;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (keys[r] >= T) continue;
        bf16* dk_row = base + keys[r] * kv.stride + (Hq + g) * D + (lane % 4) * 2;
        bf16* dv_row = base + keys[r] * kv.stride + (Hq + Hkv + g) * D + (lane % 4) * 2;
#pragma unroll
        for (int db = 0; db < D / 8; ++db) {
            *reinterpret_cast<__nv_bfloat162*>(dk_row + db * 8) =
                __floats2bfloat162_rn(dk[db][2 * r] * scale, dk[db][2 * r + 1] * scale);
            *reinterpret_cast<__nv_bfloat162*>(dv_row + db * 8) = __floats2bfloat162_rn(dv[db][2 * r], dv[db][2 * r + 1]);
        }
    }
}

// dQ for 64 queries of one q head: each warp owns 16 queries and loops over the key tiles up
// to the diagonal, recomputing P and dS.
// Registers capped for 4 blocks per SM at D = 64 (a few bytes spill) and 3 above (4 would
// spill hundreds of bytes at D = 128).
template <int D>
__global__ void __launch_bounds__(tc::THREADS, D == 64 ? 4 : 3)
    attention_backward_dq_tc(bf16* __restrict__ dqkv, const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                             const float* __restrict__ lse, const float* __restrict__ delta, int T, int Hq, int Hkv,
                             float scale) {
    using namespace tc;
    bf16 *sQ = smem_tile<D>(0), *sO = smem_tile<D>(1), *sK = smem_tile<D>(2), *sV = smem_tile<D>(3);  // sO: dout
    // Causal work grows with the query tile, so the last tiles go first: fewer stragglers.
    const int q0 = (gridDim.x - 1 - blockIdx.x) * TILE, h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const Heads hd = heads<D>(qkv, T, Hq, Hkv, b, h);
    const int rows[2] = {q0 + warp * 16 + lane / 4, q0 + warp * 16 + lane / 4 + 8};
    const float log2_scale = scale * LOG2E;
    float row_lse[2], row_delta[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const bool ok = rows[r] < T;
        row_lse[r] = ok ? lse[(static_cast<size_t>(b) * Hq + h) * T + rows[r]] * LOG2E : 0.f;
        row_delta[r] = ok ? delta[(static_cast<size_t>(b) * Hq + h) * T + rows[r]] : 0.f;
    }
    load_tile<D>(sQ, hd.q + q0 * hd.stride, min(TILE, T - q0), hd.stride);
    load_tile<D>(sO, dout + (static_cast<size_t>(b) * T + q0) * Hq * D + h * D, min(TILE, T - q0), static_cast<size_t>(Hq) * D);
    float dq[D / 8][4] = {};
    const int tiles = (min(q0 + TILE, T) - 1) / TILE + 1;
    for (int t = 0; t < tiles; ++t) {
        const int k0 = t * TILE;
        __syncthreads();
        load_tile<D>(sK, hd.k + k0 * hd.stride, min(TILE, T - k0), hd.stride);
        load_tile<D>(sV, hd.v + k0 * hd.stride, min(TILE, T - k0), hd.stride);
        __syncthreads();
        float p[TILE / 8][4] = {}, ds[TILE / 8][4] = {};
        scores<D, TILE / 8>(p, sQ, warp * 16, sK, 0, lane);   // S = Q Kᵀ
        scores<D, TILE / 8>(ds, sO, warp * 16, sV, 0, lane);  // dP = dout Vᵀ
        // Only the diagonal tile, the last, holds keys after a row's query or past the end.
        if (t == tiles - 1)
            dq_probabilities<true>(p, ds, log2_scale, row_lse, row_delta, k0, rows, T, lane);
        else
            dq_probabilities<false>(p, ds, log2_scale, row_lse, row_delta, k0, rows, T, lane);
        accumulate_pv<D, TILE / 8>(dq, ds, sK, 0, lane);  // dQ += dS K
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= T) continue;
        bf16* dst = dqkv + (static_cast<size_t>(b) * T + rows[r]) * hd.stride + h * D + (lane % 4) * 2;
#pragma unroll
        for (int db = 0; db < D / 8; ++db)
            *reinterpret_cast<__nv_bfloat162*>(dst + db * 8) =
                __floats2bfloat162_rn(dq[db][2 * r] * scale, dq[db][2 * r + 1] * scale);
    }
}
