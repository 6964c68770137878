// Causal grouped-query attention on the tensor cores (FlashAttention-2 style), for bf16 storage:
// bf16 operands and f32 accumulation, through mma.sync m16n8k16 (sm_80 on) or Hopper's wgmma
// (sm_90a). Same layouts and results as attention.cu (the CUDA-core version, the reference
// these are tested against), within bf16 rounding.
//
// Layouts (row-major): qkv [B, T, (Hq + 2 Hkv) * D] holding q heads, then k heads, then v heads;
// out [B, T, Hq * D]; lse [B, Hq, T] (natural log-sum-exp of each scaled score row, f32);
// dqkv like qkv. The head size D is a template parameter (one of kernels.rs's HEAD_DIMS).
// qkv, dout, out and dqkv start 16-byte aligned: attention.rs runs attention.cu otherwise.
//
// Forward: one block of 4 warps per (64 queries, q head, batch); each warp owns 16 query rows
// and streams 64-key tiles of K and V through shared memory with an online softmax.
// Backward, deterministic (no atomics): `attention_backward_dq_*` gives one block per
// (64 queries, q head, batch), each warp owning 16 queries, and writes their delta =
// rowsum(dout * out) too; then `attention_backward_dkdv_*` gives one block per (64 keys,
// kv head, batch) that loops over the group's q heads (or a share of them, when the launcher
// splits the group: see `attention_dkdv_sum`) and the query tiles at or after the diagonal,
// each warp owning 16 keys. Both recompute the scores. Only
// the diagonal tile and the one at the sequence's end apply the causal mask; the others, all
// but one or two of a block's tiles, skip its index arithmetic (together with `exp2_fast`,
// this cuts the backward's time at D = 64 by a third).
//
// With packed documents (`docs`, common.cuh's Documents) a query sees only the keys of its own
// document. The blocks skip the tiles no row of theirs sees (a query tile's loop starts at the
// key tile of its first query's document start, a key tile's ends at the query tile of its
// last key's document end), and mask only the tiles that a document boundary crosses.
//
// Shared memory is dynamic (it exceeds the 48 KB static limit at D = 128): the launcher passes
// `tiles * 64 * (D + padding) * 2` bytes — 3 tiles for the forward, 6 for dq, and 6 tiles
// plus 1 KB for dkdv — and 16 more for two barriers (attention.rs, `TensorCoreKernels`), and
// raises the kernel's limit to match. Tiles arrive by cp.async, which copies global to shared
// memory without holding a warp: the backward kernels double-buffer the tiles they stream and
// issue the next tile's copies before working on the current one, so the copies overlap a
// whole iteration. (With plain loads and stores, a fifth of the warps' time would go to
// stores waiting on their loads.) On Hopper (the Wgmma policy) one thread issues each tile as
// TMA copies instead, completing on an mbarrier: cp.async costs every thread 8 (D = 64) or 16
// (D = 128) instructions a tile, and issuing them is the largest stall of dK/dV. With TMA
// the forward runs 13-28% faster and the backward 18-20% on an H100 at the benchmark's
// shapes, on the same bits.
//
// The products come from one of two policies with the same interface: `SyncMma` (mma.sync
// with ldmatrix from padded rows, sm_80 and later) and `Wgmma` (Hopper's warpgroup MMA, which
// reads its shared operands directly from 128-byte-swizzled tiles; sm_90a, D a multiple of
// 64). Each kernel body is written once over the policy; the `_mma` and `_wgmma` kernels are
// its two instantiations, and they give the same bits (tests/cuda_attention.rs checks it at
// the models' shapes).
//
// Tensor-core fragments follow PTX's mma.m16n8k16 layouts: in a 16x8 f32 accumulator, lane l
// holds rows l/4 and l/4 + 8, columns 2(l%4) and 2(l%4) + 1; an accumulator pair over 16
// columns is, packed to bf16, exactly the A operand of the next product (the FA2 trick).

#include "common.cuh"

namespace tc {

// Queries or keys per block tile, and threads per block: the host's (attention.rs), which
// sizes the grid and the shared memory by them.
constexpr int TILE = ATTENTION_TILE;
constexpr int THREADS = ATTENTION_THREADS;
constexpr int WARPS = THREADS / 32;
static_assert(TILE == 64 && WARPS * 16 == TILE, "4 warps of 16 rows: one warpgroup for wgmma");
constexpr float LN2 = 0.6931471805599453f;
extern __shared__ __align__(1024) unsigned char smem[];

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes from global to shared memory asynchronously; with `valid` false it writes
// zeros and reads nothing (`src` must still be a mapped address).
__device__ __forceinline__ void copy_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copy_async4(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(valid ? 4 : 0));
}

// Starts copying rows [0, valid) of a TILE x D tile (row stride `stride` elements) into
// shared memory at the element offsets `Layout::offset(row, chunk)` of its 16-byte chunks,
// zero-filling the rest so padded rows contribute nothing. Each thread keeps one chunk column
// and steps down the rows STEP at a time, moving its two addresses by constants: this runs
// while the tensor cores work, where per-chunk index arithmetic (a division, the swizzle,
// 64-bit address products) would hold half of dK/dV's warp samples at D = 128. The loops
// stay rolled: unrolled, the compiler keeps every round's addresses in registers.
template <int D, class Layout>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, int valid, size_t stride) {
    constexpr int CHUNKS = D / 8, STEP = THREADS / CHUNKS;  // D = 80 and 96 leave a few threads idle
    static_assert(Layout::template rows_advance<STEP>(), "the layout must advance by whole rows");
    const unsigned t = threadIdx.x;
    if (t >= STEP * CHUNKS) return;
    int row = t / CHUNKS;
    bf16* d = dst + Layout::template offset<D>(row, t % CHUNKS);
    const bf16* s = src + row * stride + t % CHUNKS * 8;
    constexpr int d_step = STEP * Layout::template line<D>();
    const size_t s_step = STEP * stride;
#pragma unroll 1
    for (; row < valid; row += STEP, d += d_step, s += s_step) copy_async16(d, s, true);
#pragma unroll 1
    for (; row < TILE; row += STEP, d += d_step) copy_async16(d, src, false);
}

// Closes the group of copies this thread issued since the last call.
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most the PENDING most recent groups of this thread's copies are in flight;
// the block's barrier that follows makes every thread's finished copies visible.
template <int PENDING>
__device__ __forceinline__ void copies_done() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// A CUtensorMap, opaque: only its address reaches the TMA instructions.
struct alignas(64) TensorMap {
    u64 opaque[16];
};
// qkv and dout as 3-D tensors (column, token, batch) in boxes of 64 columns x 64 tokens,
// 128-byte swizzled, tokens past the sequence read as zeros (attention.rs, `tile_maps`): a box
// is one slab of the Wgmma layout, so TMA lands a tile exactly as `load_tile` would.
struct TileMaps {
    TensorMap qkv, dout;
};

// TMA and its barriers exist on sm_90a only; elsewhere these trap, and only the Wgmma policy,
// whose kernels trap there anyway, calls them.
__device__ __forceinline__ void barrier_init(u64* bar) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n"
                 "fence.mbarrier_init.release.cluster;\n" ::"r"(smem_u32(bar))
                 : "memory");
#else
    __trap();
#endif
}
// The one arrival of a phase, announcing the bytes of the `tiles` TILE x D tiles that its
// copies complete.
template <int D>
__device__ __forceinline__ void barrier_expect(u64* bar, int tiles) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
                 "r"(tiles * TILE * D * 2)
                 : "memory");
#else
    __trap();
#endif
}
// Waits until `bar` has completed phase n (of parity n % 2).
__device__ __forceinline__ void barrier_wait(u64* bar, int n) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
    unsigned done = 0;
    while (!done) {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(smem_u32(bar)), "r"(n & 1)
            : "memory");
    }
#else
    __trap();
#endif
}
// Copies the TILE x D tile at (column, token, batch) of `map` into `dst`, one box per slab,
// completing on `bar`. One thread issues it.
template <int D>
__device__ __forceinline__ void load_tile_tma(bf16* dst, const TensorMap& map, int column, int token, int batch,
                                              u64* bar) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
#pragma unroll
    for (int n = 0; n < D / 64; ++n)
        asm volatile(
            "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
            "[%5];\n" ::"r"(smem_u32(dst + n * TILE * 64)),
            "l"(reinterpret_cast<u64>(&map)), "r"(column + n * 64), "r"(token), "r"(batch), "r"(smem_u32(bar))
            : "memory");
#else
    __trap();
#endif
}

// The backward kernels' double buffers by TMA: buffer i % 2 holds the i-th pair of streamed
// tiles and completes on full[i % 2], the i-th filling being phase i / 2. Phase 0 of full[0]
// also carries the block's two fixed tiles. Thread 0 issues the copies; every thread waits.
struct TmaTile {
    bf16* dst;
    const TensorMap& map;
    int column;
};
// Two tiles at `token` on `bar`.
template <int D>
__device__ __forceinline__ void load_pair(u64* bar, TmaTile first, TmaTile second, int token, int batch) {
    load_tile_tma<D>(first.dst, first.map, first.column, token, batch, bar);
    load_tile_tma<D>(second.dst, second.map, second.column, token, batch, bar);
}
// Thread 0: initialises both barriers and starts the fixed tiles, with the bytes of the first
// buffer's pair too.
template <int D>
__device__ __forceinline__ void start_buffers(u64* full, TmaTile first, TmaTile second, int token, int batch) {
    barrier_init(&full[0]);
    barrier_init(&full[1]);
    barrier_expect<D>(&full[0], 4);
    load_pair<D>(&full[0], first, second, token, batch);
}
// Thread 0: the i-th pair.
template <int D>
__device__ __forceinline__ void fill_buffer(u64* full, int i, TmaTile first, TmaTile second, int token, int batch) {
    if (i > 0) barrier_expect<D>(&full[i % 2], 2);  // the first's were announced with the fixed tiles
    load_pair<D>(&full[i % 2], first, second, token, batch);
}
__device__ __forceinline__ void filled(u64* full, int i) { barrier_wait(&full[i % 2], i / 2); }

// A pair of accumulator values in the type of the row they go to, stored as one access.
__device__ __forceinline__ __nv_bfloat162 pair_for(const bf16*, float lo, float hi) {
    return __floats2bfloat162_rn(lo, hi);
}
__device__ __forceinline__ float2 pair_for(const float*, float lo, float hi) { return make_float2(lo, hi); }

// The A fragment of 16 rows x 16 columns kk*16.. of an accumulator tile, packed to bf16.
__device__ __forceinline__ void a_fragment(unsigned a[4], const float p[TILE / 8][4], int kk) {
    a[0] = bf16_pair(p[2 * kk][0], p[2 * kk][1]);
    a[1] = bf16_pair(p[2 * kk][2], p[2 * kk][3]);
    a[2] = bf16_pair(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    a[3] = bf16_pair(p[2 * kk + 1][2], p[2 * kk + 1][3]);
}

// mma.sync m16n8k16 per warp, operands through ldmatrix from rows padded by 16 bytes (which
// keeps ldmatrix's eight rows off one bank). Each warp computes its own 16 rows.
struct SyncMma {
    static constexpr bool TMA = false;  // tiles arrive by cp.async
    template <int D> __host__ __device__ static constexpr int ld() { return D + 8; }
    template <int D> __host__ __device__ static constexpr int tile_elems() { return TILE * ld<D>(); }

    // Where 16-byte chunk c of row r goes in a tile; each row is `line` elements after the
    // one before, for any step.
    template <int D> static __device__ __forceinline__ int offset(int r, int c) { return r * ld<D>() + c * 8; }
    template <int D> __host__ __device__ static constexpr int line() { return ld<D>(); }
    template <int STEP> __host__ __device__ static constexpr bool rows_advance() { return true; }

    // Waits for this thread's tile copies but the PENDING latest groups; ldmatrix sees them
    // after the block's barrier.
    template <int PENDING = 0> static __device__ __forceinline__ void staged() { copies_done<PENDING>(); }
    // The products are done when issued.
    static __device__ __forceinline__ void wait() {}

    // acc (the warp's 16 rows x 64) = A(rows warp*16.., D) * B(64 rows, D)ᵀ.
    template <int D>
    static __device__ __forceinline__ void scores(float acc[TILE / 8][4], const bf16* a, const bf16* b, int warp,
                                                  int lane) {
#pragma unroll
        for (int nb = 0; nb < TILE / 8; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            unsigned af[4];
            ldsm_x4(af, a_addr<D>(a, warp * 16, kk * 16, lane));
#pragma unroll
            for (int nb = 0; nb < TILE / 8; nb += 2) {
                unsigned bf[4];
                ldsm_x4(bf, b_addr<D>(b, nb * 8, kk * 16, lane));
                mma(acc[nb], af, bf[0], bf[1]);
                mma(acc[nb + 1], af, bf[2], bf[3]);
            }
        }
    }

    // acc (the warp's 16 rows x D) += P (16 x 64, accumulator layout) * B (64 rows, D), B's
    // rows being the contracted index.
    template <int D>
    static __device__ __forceinline__ void accumulate(float acc[D / 8][4], const float p[TILE / 8][4], const bf16* b,
                                                      int lane) {
#pragma unroll
        for (int kk = 0; kk < TILE / 16; ++kk) {
            unsigned pf[4];
            a_fragment(pf, p, kk);
#pragma unroll
            for (int db = 0; db < D / 8; db += 2) {
                unsigned vf[4];
                ldsm_x4_t(vf, a_addr<D>(b, kk * 16, db * 8, lane));
                mma(acc[db], pf, vf[0], vf[1]);
                mma(acc[db + 1], pf, vf[2], vf[3]);
            }
        }
    }

  private:
    static __device__ __forceinline__ void ldsm_x4(unsigned r[4], const bf16* p) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
    }
    static __device__ __forceinline__ void ldsm_x4_t(unsigned r[4], const bf16* p) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
    }

    // c += a * b for one 16x8 tile, k = 16.
    static __device__ __forceinline__ void mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }

    // Address of lane's row for an A operand (16 rows x 16 cols at row0, col0), which with
    // .trans is also a B pair of an operand stored [k rows, n cols], or for a non-transposed
    // B pair (two 8-row blocks of n, 16 of k): matrix j = lane/8 covers rows +8*(j%2) and
    // cols +8*(j/2) for A; rows +8*(j/2) and cols +8*(j%2) for B.
    template <int D>
    static __device__ __forceinline__ const bf16* a_addr(const bf16* s, int row0, int col0, int lane) {
        return s + (row0 + (lane % 8) + ((lane / 8) % 2) * 8) * ld<D>() + col0 + (lane / 16) * 8;
    }
    template <int D>
    static __device__ __forceinline__ const bf16* b_addr(const bf16* s, int row0, int col0, int lane) {
        return s + (row0 + (lane % 8) + (lane / 16) * 8) * ld<D>() + col0 + ((lane / 8) % 2) * 8;
    }
};

// Hopper's wgmma: the block's 4 warps are one warpgroup, and each product covers all 64 rows
// (warp w still holds rows 16w.. in the mma.sync accumulator layout). Shared tiles use the
// 128-byte swizzle: a tile is D/64 slabs of 64 columns (8 KB each, 1 KB aligned), each row of
// a slab one 128-byte line whose 16-byte chunks are permuted by XOR with the row's index mod
// 8. The same tile then serves as a K-major operand (its columns contracted: scores) and as an
// MN-major one (its rows contracted: accumulate). The swizzle is what makes wgmma pay: on an
// H100, with unswizzled "core matrix" tiles it runs 8-25% slower than mma.sync, swizzled
// 13-21% faster.
struct Wgmma {
    static constexpr bool TMA = true;  // the streamed tiles arrive by TMA
    template <int D> __host__ __device__ static constexpr int tile_elems() { return TILE * D; }

    // Where 16-byte chunk c of row r goes in a tile: slab c / 8, line r, position permuted
    // by the swizzle.
    template <int D> static __device__ __forceinline__ int offset(int r, int c) {
        return (c / 8) * TILE * 64 + r * 64 + ((c % 8) ^ (r % 8)) * 8;
    }
    // A row is a 128-byte line, but the swizzle repeats only every 8 rows: a copy may step
    // by multiples of 8.
    template <int D> __host__ __device__ static constexpr int line() { return 64; }
    template <int STEP> __host__ __device__ static constexpr bool rows_advance() { return STEP % 8 == 0; }

    // Waits for this thread's tile copies but the PENDING latest groups. wgmma reads shared
    // memory through the async proxy, so they are fenced into it before the barrier that
    // precedes the products.
    template <int PENDING = 0> static __device__ __forceinline__ void staged() {
        copies_done<PENDING>();
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
    }

    // Waits for every product issued so far; until then their accumulators, A fragments and
    // shared operands must be left alone.
    static __device__ __forceinline__ void wait() {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
        asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
    }

    // Issues acc (64 x 64) = A(64 rows, D) * B(64 rows, D)ᵀ, both contracted over their
    // columns.
    template <int D>
    static __device__ __forceinline__ void scores(float acc[TILE / 8][4], const bf16* a, const bf16* b, int, int) {
        fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)  // 16 columns: 32 bytes of each line; the first overwrites
            mma_ss(acc, k_major(a + (kk / 4) * TILE * 64 + (kk % 4) * 16),
                   k_major(b + (kk / 4) * TILE * 64 + (kk % 4) * 16), kk > 0);
    }

    // Issues acc (64 x D) += P (64 x 64, accumulator layout) * B (64 rows, D), contracted
    // over B's rows, in products of 64 columns.
    template <int D>
    static __device__ __forceinline__ void accumulate(float acc[D / 8][4], const float p[TILE / 8][4], const bf16* b,
                                                      int) {
        static_assert(D % 64 == 0, "wgmma attention needs D a multiple of 64");
        // Every fragment is packed before the fence, so that none of the products waits on
        // registers written between them.
        unsigned pf[TILE / 16][4];
#pragma unroll
        for (int kk = 0; kk < TILE / 16; ++kk) a_fragment(pf[kk], p, kk);
        fence();
#pragma unroll
        for (int kk = 0; kk < TILE / 16; ++kk)
#pragma unroll
            for (int n = 0; n < D / 64; ++n)  // 16 rows, 2 KB; 64 columns, a slab
                mma_rs(acc + n * 8, pf[kk], mn_major(b + n * TILE * 64 + kk * 16 * 64));
    }

  private:
    // Matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading and
    // stride byte offsets, each >> 4, and layout type 1, the 128-byte swizzle.
    static __device__ __forceinline__ u64 descriptor(const bf16* start, unsigned leading, unsigned stride) {
        return static_cast<u64>((smem_u32(start) & 0x3FFFF) >> 4) | (static_cast<u64>(leading >> 4) << 16) |
               (static_cast<u64>(stride >> 4) << 32) | (1ull << 62);
    }
    // K-major: 8-row groups 1 KB apart; K advances inside the swizzled line by moving the
    // start (the leading offset is unused).
    static __device__ __forceinline__ u64 k_major(const bf16* start) { return descriptor(start, 16, 1024); }
    // MN-major: 64-column slabs 8 KB apart (leading), 8-row groups 1 KB apart (stride).
    static __device__ __forceinline__ u64 mn_major(const bf16* start) {
        return descriptor(start, TILE * 128, 1024);
    }

    static __device__ __forceinline__ void fence() {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
    }

#define WG_ACC4(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define WG_ACC32(d) \
    WG_ACC4(d, 0), WG_ACC4(d, 1), WG_ACC4(d, 2), WG_ACC4(d, 3), WG_ACC4(d, 4), WG_ACC4(d, 5), WG_ACC4(d, 6), WG_ACC4(d, 7)
#define WG_REGS32                                                                                                  \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31}"

    // d (64 x 64, f32) = A * Bᵀ + (add ? d : 0) over k = 16, both operands K-major in shared
    // memory.
    static __device__ __forceinline__ void mma_ss(float d[][4], u64 a, u64 b, bool add) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_REGS32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
            : WG_ACC32(d)
            : "l"(a), "l"(b), "r"(static_cast<int>(add)));
#else
        __trap();
#endif
    }

    // d (64 x 64, f32) += A * B over k = 16, A from registers, B MN-major in shared memory.
    static __device__ __forceinline__ void mma_rs(float d[][4], const unsigned a[4], u64 b) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %36, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_REGS32 ", {%32, %33, %34, %35}, %37, p, 1, 1, 1;\n}\n"
            : WG_ACC32(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(1), "l"(b));
#else
        __trap();
#endif
    }
#undef WG_REGS32
#undef WG_ACC32
#undef WG_ACC4
};

// The i-th 64-row tile of dynamic shared memory in policy M's layout.
template <int D, class M>
__device__ __forceinline__ bf16* smem_tile(int i) {
    return reinterpret_cast<bf16*>(smem) + i * M::template tile_elems<D>();
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The block's tile, head and batch. Blocks start in the order of their linear index, and a
// tile's work grows with its distance from the causal edge, so the grid is walked heaviest
// tiles first across every head and batch: the blocks that start last are the shortest, and
// the SMs finish together. `rank` 0 is the heaviest tile.
struct Place {
    int rank, head, batch;
};
__device__ __forceinline__ Place place() {
    const int pairs = gridDim.y * gridDim.z;
    const int linear = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int rest = linear % pairs;
    return {linear / pairs, static_cast<int>(rest % gridDim.y), static_cast<int>(rest / gridDim.y)};
}

struct Heads {
    size_t stride;            // elements per token row of qkv
    int q_col, k_col, v_col;  // where this head's q, k and v column blocks start in a row
    const bf16* q;            // this (batch, head)'s q column block at token 0
    const bf16* k;
    const bf16* v;
};

template <int D>
__device__ __forceinline__ Heads heads(const bf16* qkv, int T, int Hq, int Hkv, int b, int h) {
    const int g = h / (Hq / Hkv), q_col = h * D, k_col = (Hq + g) * D, v_col = (Hq + Hkv + g) * D;
    const size_t stride = static_cast<size_t>(Hq + 2 * Hkv) * D;
    const bf16* base = qkv + static_cast<size_t>(b) * T * stride;
    return {stride, q_col, k_col, v_col, base + q_col, base + k_col, base + v_col};
}

// A lane's two query rows (the accumulator layout's l/4 and l/4 + 8 of its warp's 16) and
// where their documents start.
struct QueryRows {
    int row[2], start[2];
};
__device__ __forceinline__ QueryRows query_rows(int q0, int warp, int lane, const Documents& docs) {
    QueryRows q;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        q.row[r] = q0 + warp * 16 + lane / 4 + 8 * r;
        q.start[r] = q.row[r] < docs.T ? docs.start(q.row[r]) : 0;
    }
    return q;
}

// Whether element e of column block nb, in a score tile of query rows against the 64 keys
// from k0, is a key its query sees (at or before it, in its document, inside the sequence).
// Without MASK the caller knows every key is.
template <bool MASK>
__device__ __forceinline__ bool visible(int k0, int nb, int e, const QueryRows& rows, int T, int lane) {
    const int key = k0 + nb * 8 + (lane % 4) * 2 + (e & 1);
    return !MASK || (key <= rows.row[e / 2] && key >= rows.start[e / 2] && key < T);
}

// Scores of 16 query rows against the 64 keys from k0, into log2 units; with MASK, keys after
// a row's query, before its document or past the sequence get -inf.
template <bool MASK>
__device__ __forceinline__ void scale_scores(float s[TILE / 8][4], float log2_scale, int k0, const QueryRows& rows,
                                             int T, int lane) {
#pragma unroll
    for (int nb = 0; nb < TILE / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            s[nb][e] = visible<MASK>(k0, nb, e, rows, T, lane) ? s[nb][e] * log2_scale : NEG_INF;
}

// The key tiles a query tile from q0 sees: from the one holding its first query's document
// start to the diagonal. Keys from `unmasked` on lie in every row's document (the documents
// start in order), so only the tiles before it and the diagonal need the mask.
struct KeyTiles {
    int first, count, unmasked;
};
__device__ __forceinline__ KeyTiles key_tiles(int q0, const Documents& docs) {
    const int last = min(q0 + TILE, docs.T) - 1, first = docs.start(q0) / TILE;
    return {first, last / TILE + 1 - first, docs.start(last)};
}

// The dK/dV kernel's Pᵀ and dSᵀ over 16 keys x 64 queries from q0, in place of Sᵀ in `p` and
// dPᵀ in `ds`: p = exp2(s·scale·log2e − lse·log2e) and ds = p (dp − delta), with each query's
// lse and delta from shared memory. With MASK, queries before their key or at or after
// `ends`, the end of its document (0 for keys past the sequence), get zeros.
template <bool MASK>
__device__ __forceinline__ void dkdv_probabilities(float p[TILE / 8][4], float ds[TILE / 8][4], float log2_scale,
                                                   const float* sL, const float* sD, int q0, const int keys[2],
                                                   const int ends[2], int lane) {
#pragma unroll
    for (int nb = 0; nb < TILE / 8; ++nb) {
        const int qi = nb * 8 + (lane % 4) * 2;
        const float2 l = *reinterpret_cast<const float2*>(sL + qi), d = *reinterpret_cast<const float2*>(sD + qi);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int query = q0 + qi + (e & 1);
            const bool live = !MASK || (query >= keys[e / 2] && query < ends[e / 2]);
            const float pe = live ? exp2_fast(fmaf(p[nb][e], log2_scale, -((e & 1) ? l.y : l.x) * LOG2E)) : 0.f;
            p[nb][e] = pe;
            ds[nb][e] = pe * (ds[nb][e] - ((e & 1) ? d.y : d.x));
        }
    }
}

// The dQ kernel's dS over 16 queries x 64 keys from k0 (scores in place), as above with each
// row's lse and delta.
template <bool MASK>
__device__ __forceinline__ void dq_probabilities(float p[TILE / 8][4], float ds[TILE / 8][4], float log2_scale,
                                                 const float row_lse[2], const float row_delta[2], int k0,
                                                 const QueryRows& rows, int T, int lane) {
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


template <int D, class M>
__device__ __forceinline__ void forward(bf16* __restrict__ out, float* __restrict__ lse, const bf16* __restrict__ qkv,
                                        int T, int Hq, int Hkv, float scale, float* __restrict__ amax,
                                        const int* __restrict__ doc_bounds, const TileMaps& maps) {
    bf16 *sQ = smem_tile<D, M>(0), *sK = smem_tile<D, M>(1), *sV = smem_tile<D, M>(2);
    const Place at = place();  // the last query tiles see the most keys
    const int q0 = (gridDim.x - 1 - at.rank) * TILE, h = at.head, b = at.batch;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const Heads hd = heads<D>(qkv, T, Hq, Hkv, b, h);
    const float log2_scale = scale * LOG2E;  // scores in log2 units
    const Documents docs = documents(doc_bounds, b, gridDim.z, T);
    const QueryRows rows = query_rows(q0, warp, lane, docs);
    const KeyTiles keys = key_tiles(q0, docs);

    // K and V of the i-th key tile the block sees, each in its own group of copies (or with
    // TMA, completing on its own barrier, K's i-th filling being phase i of kv[0] and V's of
    // kv[1]): K is replaced as soon as the scores have read it, and arrives while the softmax
    // and P·V run; V while the next scores and softmax do.
    u64* kv = reinterpret_cast<u64*>(smem_tile<D, M>(3));
    auto load_k = [&](int i) {
        const int k0 = (keys.first + i) * TILE;
        if constexpr (M::TMA) {
            if (threadIdx.x != 0) return;
            if (i > 0) barrier_expect<D>(&kv[0], 1);  // the first's is with Q
            load_tile_tma<D>(sK, maps.qkv, hd.k_col, k0, b, &kv[0]);
        } else {
            load_tile<D, M>(sK, hd.k + k0 * hd.stride, min(TILE, T - k0), hd.stride);
            commit_copies();
        }
    };
    auto load_v = [&](int i) {
        const int k0 = (keys.first + i) * TILE;
        if constexpr (M::TMA) {
            if (threadIdx.x != 0) return;
            barrier_expect<D>(&kv[1], 1);
            load_tile_tma<D>(sV, maps.qkv, hd.v_col, k0, b, &kv[1]);
        } else {
            load_tile<D, M>(sV, hd.v + k0 * hd.stride, min(TILE, T - k0), hd.stride);
            commit_copies();
        }
    };
    if constexpr (M::TMA) {
        if (threadIdx.x == 0) {
            barrier_init(&kv[0]);
            barrier_init(&kv[1]);
            barrier_expect<D>(&kv[0], 2);  // Q and the first K
            load_tile_tma<D>(sQ, maps.qkv, hd.q_col, q0, b, &kv[0]);
        }
        __syncthreads();  // the barriers are initialised before anyone waits on them
    } else {
        load_tile<D, M>(sQ, hd.q + q0 * hd.stride, min(TILE, T - q0), hd.stride);
    }
    load_k(0);
    load_v(0);
    float o[D / 8][4] = {};
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    const int tiles = keys.count;
    for (int t = 0; t < tiles; ++t) {
        const int k0 = (keys.first + t) * TILE;
        if constexpr (M::TMA)
            barrier_wait(&kv[0], t);
        else
            M::template staged<1>();  // all but V
        __syncthreads();
        float s[TILE / 8][4];
        M::template scores<D>(s, sQ, sK, warp, lane);
        M::wait();
        __syncthreads();  // every warp's products are done with sK
        const bool more = t + 1 < tiles;
        if (more) load_k(t + 1);
        // Only the diagonal tile, the last, holds keys after a row's query or past the end, and
        // only tiles before `unmasked` keys before a row's document.
        if (t == tiles - 1 || k0 < keys.unmasked)
            scale_scores<true>(s, log2_scale, k0, rows, T, lane);
        else
            scale_scores<false>(s, log2_scale, k0, rows, T, lane);
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int nb = 0; nb < TILE / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], s[nb][e]);
        float corr[2], sum[2] = {0.f, 0.f}, base[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = quad_max(mx[r]);
            // A row that has seen no key yet (its document starts after these) keeps m = -inf;
            // exponents taken from 0 then make its sums and output 0, not NaN.
            base[r] = mx[r] == NEG_INF ? 0.f : mx[r];
            corr[r] = exp2_fast(m[r] - base[r]);  // exp2(-inf) = 0 on the row's first keys
            m[r] = mx[r];
        }
#pragma unroll
        for (int nb = 0; nb < TILE / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nb][e] = exp2_fast(s[nb][e] - base[e / 2]);
                sum[e / 2] += s[nb][e];
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) l[r] = l[r] * corr[r] + quad_sum(sum[r]);
#pragma unroll
        for (int db = 0; db < D / 8; ++db) {
            o[db][0] *= corr[0]; o[db][1] *= corr[0];
            o[db][2] *= corr[1]; o[db][3] *= corr[1];
        }
        if constexpr (M::TMA)
            barrier_wait(&kv[1], t);
        else if (more)
            M::template staged<1>();  // all but the next K
        else
            M::staged();
        __syncthreads();
        M::template accumulate<D>(o, s, sV, lane);
        M::wait();
        __syncthreads();  // every warp's products are done with sV
        if (more) load_v(t + 1);
    }
    float largest = 0.f;  // max |out| as stored, for FP8 scaling (report_amax)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows.row[r] >= T) continue;
        const float inv = 1.f / l[r];
        bf16* dst = out + (static_cast<size_t>(b) * T + rows.row[r]) * Hq * D + h * D + (lane % 4) * 2;
#pragma unroll
        for (int db = 0; db < D / 8; ++db) {
            const __nv_bfloat162 y = __floats2bfloat162_rn(o[db][2 * r] * inv, o[db][2 * r + 1] * inv);
            *reinterpret_cast<__nv_bfloat162*>(dst + db * 8) = y;
            largest = fmaxf(largest, fmaxf(fabsf(__low2float(y)), fabsf(__high2float(y))));
        }
        if (lane % 4 == 0) lse[(static_cast<size_t>(b) * Hq + h) * T + rows.row[r]] = (m[r] + log2f(l[r])) * LN2;
    }
    report_amax(amax, largest);
}

// A key's dK and dV rows in memory, each at this lane's first column.
template <class Out>
struct DkDvRows {
    Out* dk;
    Out* dv;
};

// Stores this lane's part of a warp's 16 rows of dK (times `scale`) and dV, at `at(key)` (bf16
// or f32), skipping keys past the sequence's end.
template <int D, class At>
__device__ __forceinline__ void store_dkdv(const float dk[D / 8][4], const float dv[D / 8][4], float scale,
                                           const int keys[2], int T, At at) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (keys[r] >= T) continue;
        const auto dst = at(keys[r]);
        using Pair = decltype(pair_for(dst.dk, 0.f, 0.f));
#pragma unroll
        for (int db = 0; db < D / 8; ++db) {
            *reinterpret_cast<Pair*>(dst.dk + db * 8) =
                pair_for(dst.dk, dk[db][2 * r] * scale, dk[db][2 * r + 1] * scale);
            *reinterpret_cast<Pair*>(dst.dv + db * 8) = pair_for(dst.dv, dv[db][2 * r], dv[db][2 * r + 1]);
        }
    }
}

// dK and dV for 64 keys of one kv head, summed over the group's q heads and the query tiles
// that see them, in a fixed order. Each warp owns 16 keys and works with transposed scores
// Sᵀ = K Qᵀ so that its accumulators are rows of dK and dV.
template <int D, class M>
__device__ __forceinline__ void backward_dkdv(bf16* __restrict__ dqkv, float* __restrict__ shares,
                                              const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                                              const float* __restrict__ lse, const float* __restrict__ delta, int T,
                                              int Hq, int Hkv, int splits, float scale,
                                              const int* __restrict__ doc_bounds, const TileMaps& maps) {
    // K and V, then two buffers of a query tile's Q and dout, then two of its lse and delta:
    // the next tile loads while the tensor cores work on this one.
    bf16 *sK = smem_tile<D, M>(0), *sV = smem_tile<D, M>(1);
    float* stats = reinterpret_cast<float*>(smem_tile<D, M>(6));
    u64* full = reinterpret_cast<u64*>(stats + 4 * TILE);  // with TMA (`fill_buffer`)
    const Place at = place();  // the first key tiles are seen by the most queries
    const int k0 = at.rank * TILE, g = at.head / splits, share = at.head % splits, b = at.batch;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // Share s takes the group's q heads [s·group/splits, (s+1)·group/splits): at least one
    // each, since splits <= group, and any split count works, not only divisors.
    const int group = Hq / Hkv, first_head = g * group + share * group / splits,
              share_heads = (share + 1) * group / splits - share * group / splits;
    const Heads kv = heads<D>(qkv, T, Hq, Hkv, b, g * group);
    const int keys[2] = {k0 + warp * 16 + lane / 4, k0 + warp * 16 + lane / 4 + 8};
    const float log2_scale = scale * LOG2E;
    // Where the queries that see each key end: its document's end (0 past the sequence).
    const Documents docs = documents(doc_bounds, b, gridDim.z, T);
    const int ends[2] = {keys[0] < T ? docs.end(keys[0]) : 0, keys[1] < T ? docs.end(keys[1]) : 0};
    // This share's q heads in turn, each over the query tiles from the diagonal to the one
    // holding the end of the last key's document. Queries before the first key's document end
    // see every key of the tile at or before them (the documents end in order).
    const int q_end = docs.end(min(k0 + TILE, T) - 1), unmasked_end = docs.end(k0);
    const int per_head = (q_end - k0 + TILE - 1) / TILE, tiles = share_heads * per_head;
    auto query_tile = [&](int i) { return k0 + (i % per_head) * TILE; };
    auto stage = [&](int i) {
        const int h = first_head + i / per_head, q0 = query_tile(i),
                  valid = min(TILE, T - q0);
        if constexpr (M::TMA) {
            if (threadIdx.x == 0)
                fill_buffer<D>(full, i, {smem_tile<D, M>(2 + 2 * (i % 2)), maps.qkv, h * D},
                               {smem_tile<D, M>(3 + 2 * (i % 2)), maps.dout, h * D}, q0, b);
        } else {
            const Heads qh = heads<D>(qkv, T, Hq, Hkv, b, h);
            load_tile<D, M>(smem_tile<D, M>(2 + 2 * (i % 2)), qh.q + q0 * qh.stride, valid, qh.stride);
            load_tile<D, M>(smem_tile<D, M>(3 + 2 * (i % 2)),
                            dout + (static_cast<size_t>(b) * T + q0) * Hq * D + h * D, valid,
                            static_cast<size_t>(Hq) * D);
        }
        // One thread per query row: its lse (natural log; log2 units at use), or its delta.
        static_assert(THREADS == 2 * TILE, "one stat per thread");
        const int r = threadIdx.x % TILE;
        const float* src = (threadIdx.x < TILE ? lse : delta) + (static_cast<size_t>(b) * Hq + h) * T + q0;
        copy_async4(stats + (i % 2) * 2 * TILE + threadIdx.x, src + (r < valid ? r : 0), r < valid);
        commit_copies();
    };

    if constexpr (M::TMA) {
        if (threadIdx.x == 0)
            start_buffers<D>(full, {sK, maps.qkv, kv.k_col}, {sV, maps.qkv, kv.v_col}, k0, b);
        __syncthreads();  // the barriers are initialised before anyone waits on them
    } else {
        load_tile<D, M>(sK, kv.k + k0 * kv.stride, min(TILE, T - k0), kv.stride);
        load_tile<D, M>(sV, kv.v + k0 * kv.stride, min(TILE, T - k0), kv.stride);
    }
    stage(0);
    M::staged();  // the stats (cp.async)
    if constexpr (M::TMA) filled(full, 0);
    __syncthreads();
    float dk[D / 8][4] = {}, dv[D / 8][4] = {};
    for (int i = 0; i < tiles; ++i) {
        const int q0 = query_tile(i);
        const bf16 *sQ = smem_tile<D, M>(2 + 2 * (i % 2)), *sO = smem_tile<D, M>(3 + 2 * (i % 2));
        const float *sL = stats + (i % 2) * 2 * TILE, *sD = sL + TILE;
        float p[TILE / 8][4], ds[TILE / 8][4];
        M::template scores<D>(p, sK, sQ, warp, lane);   // Sᵀ: keys x queries
        M::template scores<D>(ds, sV, sO, warp, lane);  // dPᵀ = V doutᵀ
        // The other buffers' readers finished before the last barrier.
        if (i + 1 < tiles) stage(i + 1);
        M::wait();
        // Off the diagonal tile and the first key's document end (the sequence's without
        // documents), every query sees every key.
        if (q0 == k0 || q0 + TILE > unmasked_end)
            dkdv_probabilities<true>(p, ds, log2_scale, sL, sD, q0, keys, ends, lane);
        else
            dkdv_probabilities<false>(p, ds, log2_scale, sL, sD, q0, keys, ends, lane);
        M::template accumulate<D>(dv, p, sO, lane);   // dV += Pᵀ dout
        M::template accumulate<D>(dk, ds, sQ, lane);  // dK += dSᵀ Q (scaled below)
        M::wait();
        M::staged();
        if constexpr (M::TMA) {
            if (i + 1 < tiles) filled(full, i + 1);
        }
        __syncthreads();
    }
    if (splits > 1) {  // this share, in f32, for attention_dkdv_sum
        const size_t rows = static_cast<size_t>(gridDim.z) * T, part = (static_cast<size_t>(share) * 2) * rows;
        store_dkdv<D>(dk, dv, scale, keys, T, [&](int key) {
            const size_t row = (static_cast<size_t>(b) * T + key) * Hkv + g;
            float* dk_row = shares + (part * Hkv + row) * D + (lane % 4) * 2;
            return DkDvRows<float>{dk_row, dk_row + rows * Hkv * D};
        });
        return;
    }
    bf16* base = dqkv + static_cast<size_t>(b) * T * kv.stride;
    store_dkdv<D>(dk, dv, scale, keys, T, [&](int key) {
        return DkDvRows<bf16>{base + key * kv.stride + kv.k_col + (lane % 4) * 2,
                              base + key * kv.stride + kv.v_col + (lane % 4) * 2};
    });
}

// delta = rowsum(dout ⊙ out) of a warp's two rows of this lane (the accumulator layout's l/4
// and l/4 + 8): each lane takes its pairs of columns, the row's quad adds them. Every lane
// must call it (the shuffles); rows past the sequence give 0.
template <int D>
__device__ __forceinline__ void row_deltas(float delta[2], const bf16* __restrict__ dout,
                                           const bf16* __restrict__ out, const int rows[2], int T, int b, int Hq,
                                           int h, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float acc = 0.f;
        if (rows[r] < T) {
            const size_t at = (static_cast<size_t>(b) * T + rows[r]) * Hq * D + h * D + (lane % 4) * 2;
            __nv_bfloat162 g[D / 8], o[D / 8];  // every load in flight before the sums
#pragma unroll
            for (int db = 0; db < D / 8; ++db) {
                g[db] = *reinterpret_cast<const __nv_bfloat162*>(dout + at + db * 8);
                o[db] = *reinterpret_cast<const __nv_bfloat162*>(out + at + db * 8);
            }
#pragma unroll
            for (int db = 0; db < D / 8; ++db) {
                const float2 gf = __bfloat1622float2(g[db]), of = __bfloat1622float2(o[db]);
                acc = fmaf(gf.x, of.x, fmaf(gf.y, of.y, acc));
            }
        }
        delta[r] = quad_sum(acc);
    }
}

// dQ for 64 queries of one q head: each warp owns 16 queries and loops over the key tiles up
// to the diagonal, recomputing P and dS. It runs before dK/dV and computes the rows' delta
// (`row_deltas`), which it writes for dK/dV, so that no pass of its own reads dout and out
// once more.
template <int D, class M>
__device__ __forceinline__ void backward_dq(bf16* __restrict__ dqkv, const bf16* __restrict__ dout,
                                            const bf16* __restrict__ qkv, const float* __restrict__ lse,
                                            float* __restrict__ delta, int T, int Hq, int Hkv, float scale,
                                            const int* __restrict__ doc_bounds, const bf16* __restrict__ out,
                                            const TileMaps& maps) {
    bf16 *sQ = smem_tile<D, M>(0), *sO = smem_tile<D, M>(1);  // then two buffers of K and V
    const Place at = place();  // the last query tiles see the most keys
    const int q0 = (gridDim.x - 1 - at.rank) * TILE, h = at.head, b = at.batch;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const Heads hd = heads<D>(qkv, T, Hq, Hkv, b, h);
    const Documents docs = documents(doc_bounds, b, gridDim.z, T);
    const QueryRows rows = query_rows(q0, warp, lane, docs);
    const KeyTiles keys = key_tiles(q0, docs);
    const float log2_scale = scale * LOG2E;
    float row_lse[2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
        row_lse[r] = rows.row[r] < T ? lse[(static_cast<size_t>(b) * Hq + h) * T + rows.row[r]] * LOG2E : 0.f;
    // The i-th key tile's K and V go to buffer i % 2: the next loads while the tensor cores
    // work on this one.
    u64* full = reinterpret_cast<u64*>(smem_tile<D, M>(6));  // with TMA (`fill_buffer`)
    auto stage = [&](int t) {
        const int k0 = (keys.first + t) * TILE;
        bf16 *k = smem_tile<D, M>(2 + 2 * (t % 2)), *v = smem_tile<D, M>(3 + 2 * (t % 2));
        if constexpr (M::TMA) {
            if (threadIdx.x == 0)
                fill_buffer<D>(full, t, {k, maps.qkv, hd.k_col}, {v, maps.qkv, hd.v_col}, k0, b);
        } else {
            load_tile<D, M>(k, hd.k + k0 * hd.stride, min(TILE, T - k0), hd.stride);
            load_tile<D, M>(v, hd.v + k0 * hd.stride, min(TILE, T - k0), hd.stride);
            commit_copies();
        }
    };
    if constexpr (M::TMA) {
        if (threadIdx.x == 0) start_buffers<D>(full, {sQ, maps.qkv, hd.q_col}, {sO, maps.dout, h * D}, q0, b);
        __syncthreads();  // the barriers are initialised before anyone waits on them
    } else {
        load_tile<D, M>(sQ, hd.q + q0 * hd.stride, min(TILE, T - q0), hd.stride);
        load_tile<D, M>(sO, dout + (static_cast<size_t>(b) * T + q0) * Hq * D + h * D, min(TILE, T - q0),
                        static_cast<size_t>(Hq) * D);
    }
    stage(0);
    // While the first tiles arrive.
    float row_delta[2];
    row_deltas<D>(row_delta, dout, out, rows.row, T, b, Hq, h, lane);
#pragma unroll
    for (int r = 0; r < 2; ++r)
        if (rows.row[r] < T && lane % 4 == 0)
            delta[(static_cast<size_t>(b) * Hq + h) * T + rows.row[r]] = row_delta[r];
    M::staged();
    if constexpr (M::TMA) filled(full, 0);
    __syncthreads();
    float dq[D / 8][4] = {};
    const int tiles = keys.count;
    for (int t = 0; t < tiles; ++t) {
        const int k0 = (keys.first + t) * TILE;
        const bf16 *sK = smem_tile<D, M>(2 + 2 * (t % 2)), *sV = smem_tile<D, M>(3 + 2 * (t % 2));
        float p[TILE / 8][4], ds[TILE / 8][4];
        M::template scores<D>(p, sQ, sK, warp, lane);   // S = Q Kᵀ
        M::template scores<D>(ds, sO, sV, warp, lane);  // dP = dout Vᵀ
        // The other buffers' readers finished before the last barrier.
        if (t + 1 < tiles) stage(t + 1);
        M::wait();
        // Only the diagonal tile, the last, holds keys after a row's query or past the end, and
        // only tiles before `unmasked` keys before a row's document.
        if (t == tiles - 1 || k0 < keys.unmasked)
            dq_probabilities<true>(p, ds, log2_scale, row_lse, row_delta, k0, rows, T, lane);
        else
            dq_probabilities<false>(p, ds, log2_scale, row_lse, row_delta, k0, rows, T, lane);
        M::template accumulate<D>(dq, ds, sK, lane);  // dQ += dS K
        M::wait();
        M::staged();
        if constexpr (M::TMA) {
            if (t + 1 < tiles) filled(full, t + 1);
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows.row[r] >= T) continue;
        bf16* dst = dqkv + (static_cast<size_t>(b) * T + rows.row[r]) * hd.stride + h * D + (lane % 4) * 2;
#pragma unroll
        for (int db = 0; db < D / 8; ++db)
            *reinterpret_cast<__nv_bfloat162*>(dst + db * 8) =
                __floats2bfloat162_rn(dq[db][2 * r] * scale, dq[db][2 * r + 1] * scale);
    }
}

}  // namespace tc

// The kernels: each body with mma.sync (`_mma`, sm_80 on) and with wgmma (`_wgmma`, sm_90a
// only; elsewhere they trap). Registers: the forward is capped at 128 so that 4 blocks
// (16 warps) share an SM with no spills at any D; dQ for 4 blocks per SM at D = 64 (a few
// bytes spill) and 3 above (4 would spill hundreds of bytes at D = 128); dK/dV at D = 64 for
// 3 blocks (168 registers, 4 bytes spilled; left alone, the compiler takes 186 and fits 2).
#define ATTENTION_KERNELS(SUFFIX, POLICY)                                                                           \
    template <int D>                                                                                               \
    __global__ void __launch_bounds__(tc::THREADS, 4)                                                              \
        attention_forward_##SUFFIX(bf16* __restrict__ out, float* __restrict__ lse, const bf16* __restrict__ qkv, \
                                   int T, int Hq, int Hkv, float scale, float* __restrict__ amax,                 \
                                   const int* __restrict__ docs, const __grid_constant__ tc::TileMaps maps) {      \
        tc::forward<D, tc::POLICY>(out, lse, qkv, T, Hq, Hkv, scale, amax, docs, maps);                            \
    }                                                                                                              \
    template <int D>                                                                                               \
    __global__ void __launch_bounds__(tc::THREADS, D == 64 ? 3 : 1)                                                \
        attention_backward_dkdv_##SUFFIX(bf16* __restrict__ dqkv, const bf16* __restrict__ dout,                 \
                                         const bf16* __restrict__ qkv, const float* __restrict__ lse,              \
                                         const float* __restrict__ delta, int T, int Hq, int Hkv, float scale,     \
                                         const int* __restrict__ docs, float* __restrict__ shares, int splits,     \
                                         const __grid_constant__ tc::TileMaps maps) {                              \
        tc::backward_dkdv<D, tc::POLICY>(dqkv, shares, dout, qkv, lse, delta, T, Hq, Hkv, splits, scale, docs,     \
                                         maps);                                                                    \
    }                                                                                                              \
    template <int D>                                                                                               \
    __global__ void __launch_bounds__(tc::THREADS, D == 64 ? 4 : 3)                                                \
        attention_backward_dq_##SUFFIX(bf16* __restrict__ dqkv, const bf16* __restrict__ dout,                     \
                                       const bf16* __restrict__ qkv, const float* __restrict__ lse,                \
                                       float* __restrict__ delta, int T, int Hq, int Hkv, float scale,            \
                                       const int* __restrict__ docs, const bf16* __restrict__ out,                 \
                                       const __grid_constant__ tc::TileMaps maps) {                                \
        tc::backward_dq<D, tc::POLICY>(dqkv, dout, qkv, lse, delta, T, Hq, Hkv, scale, docs, out, maps);           \
    }

ATTENTION_KERNELS(mma, SyncMma)
ATTENTION_KERNELS(wgmma, Wgmma)
#undef ATTENTION_KERNELS

// dK and dV when the launcher split each kv head's group of q heads over `splits` dK/dV
// blocks per key tile: at 3B's shape the grid is about one wave of blocks whose work spans
// 16 : 1 (the first key tile is seen by every query tile), so unsplit the kernel lasts as
// long as its heaviest blocks, twice the average; at small batches the grid leaves most SMs
// idle. Each
// share is [2][rows][Hkv][D] f32 (dK already scaled, then dV), shares one after another; this
// adds them in share order and writes bf16 into dqkv's k and v columns. One thread per 4
// columns.
__global__ void attention_dkdv_sum(bf16* __restrict__ dqkv, const float* __restrict__ shares, long long rows,
                                   int Hq, int Hkv, int D, int splits) {
    const long long quads = rows * Hkv * D / 4, i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
    if (i >= 2 * quads) return;
    const float4* in = reinterpret_cast<const float4*>(shares);
    float4 sum = in[i];
    for (int s = 1; s < splits; ++s) {
        const float4 v = in[s * 2 * quads + i];
        sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w;
    }
    const long long kind = i / quads, rest = i % quads, row = rest / (Hkv * D / 4);
    const int column = static_cast<int>(rest % (Hkv * D / 4)) * 4;  // within the k (or v) heads
    bf16* dst = dqkv + row * (Hq + 2 * Hkv) * D + (Hq + kind * Hkv) * D + column;
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(sum.x, sum.y);
    *reinterpret_cast<__nv_bfloat162*>(dst + 2) = __floats2bfloat162_rn(sum.z, sum.w);
}
