// smelt's own matmul for Hopper (sm_90a): out [M, N] = a [M, K] · b [N, K]ᵀ, both operands
// row-major with K contiguous (the forward's `x · wᵀ`), bf16 or FP8, f32 accumulation, bf16
// output. It exists for the epilogues cuBLASLt does not have:
// - SWIGLU: the MLP's gate/up projection and SwiGLU in one kernel, which writes gate/up
//   [M, 2F] and SwiGLU's output [M, F] from the accumulators, so that no separate pass reads
//   gate/up back;
// - DSWIGLU: the down projection's input gradient dh = dy · w (b given as [K, N], N contiguous:
//   the down weight as stored) and SwiGLU's backward, which reads gate/up and overwrites it
//   with its gradient, so that dh is never written or read (`dswiglu_piece`).
// Each also runs in FP8 (e4m3 operands; SwiGLU's backward takes dy in the gradient's format
// and the weight's transposed copy, [N, K]), where the epilogue also reports the abs-max of
// what the FP8 step quantizes next. The plain product also runs in INT8 (int8 operands summed
// in int32, each row of a and of b with its own descale, and a bias), the epilogue
// ops/int8.rs states. (INT8 with SwiGLU in the epilogue ran no faster than bf16's: at these
// rates the epilogue, not the products, bounds it, and the product and swiglu.cu apart beat
// it.)
//
// The design is that of CUTLASS's warp-specialised Hopper kernels, written small. A persistent
// grid of clusters of two blocks (a block per SM) walks the output tiles, 128 rows by 192
// columns, in pairs: the blocks of a cluster take tiles (2p, n) and (2p + 1, n), which share B's
// tile. Warpgroup 0 of each block produces: one thread issues TMA copies of each k-block's A
// tile (128 rows x 64 columns) into its own block and half of the B tile (192 x 64) into both
// blocks at once (multicast), into a ring of GEMM_STAGES shared buffers. Each buffer has two
// mbarriers: `full` completes when the copies' bytes have landed (its own A and both halves of
// B), `empty` when the consumer warps of both blocks are done reading it (each block refills
// its half of B in both). Warpgroups 1 and 2 consume in turns ("ping-pong"): each takes every
// other tile of its block, multiplying it whole with two wgmma m64n192k16 per 16 columns of K
// (its 128 x 192 accumulator is 192 registers a thread) and keeping one k-block's products in
// flight, then writes the tile to shared memory, from where TMA stores it, while the other
// warpgroup multiplies the next tile. The producer fills the ring with one tile's k-blocks
// after another, so each consumer takes every other tile's. Two more threads of warpgroup 0
// move the epilogue's pieces out (and, with SwiGLU's backward, gate/up's in), one for each
// consumer.
//
// The tile's shape is chosen by measurement: on an H100 at the models' gate/up shapes, this one
// runs at 743-799 TFLOP/s against cuBLAS's 728-782, where 64 x 256 a consumer (a warpgroup's
// one wgmma wide) runs at 593-632, 128 x 128 at 656-665, and both warpgroups sharing one
// 128 x 256 tile (cooperative, storing together while the tensor cores wait) at 715-771.
// The 192 columns keep shared memory's reads per product low (A is read once per 192
// columns, B once per 128 rows) with the accumulator still in the registers.
//
// Shared tiles are in TMA's 128-byte swizzle, which is the layout wgmma reads K-major operands
// in: row r of a tile is one 128-byte line (64 bf16), its 16-byte chunks permuted by XOR with
// r % 8, and 8-row groups 1 KB apart. Outputs go out through slabs of 64 rows x 32 columns in
// the 64-byte swizzle (chunks permuted by (r / 2) % 4), as 96 columns, half a tile, are three of
// them.
//
// SwiGLU's tile: the B box of rows 0..95 comes from gate row g0 and the one of rows 96..191
// from up row F + g0, so that accumulator column c (gate) and c + 96 (up) sit in the same
// thread's registers (columns 8i + 2(lane % 4) of blocks i and i + 12). Where F is not a
// multiple of 96, the last tile's gate box reads on into the first up rows: the columns it
// makes lie past F, where the outputs' maps drop them.
#include "common.cuh"

namespace gemm {

constexpr int BM = 128;          // rows of a tile: two products of 64
constexpr int BN = 192;          // columns of a tile
constexpr int LINE = 128;        // bytes of a k-block's row: one swizzled line
constexpr int HALF = BN / 2;     // rows of B each block of the cluster copies
constexpr int STAGES = GEMM_STAGES;
constexpr int GROUP = 16;  // m-tile pairs walked together, so that their A rows stay in L2
constexpr int A_BYTES = BM * LINE;
constexpr int B_BYTES = BN * LINE;
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int CLUSTER = 2;  // blocks sharing a B tile
constexpr int READERS = 4;  // warps reading each stage in each block: one consumer's
static_assert(GEMM_THREADS == 3 * 128, "a producer warpgroup and two consumers");

// What a launch computes (gemm.rs's `GemmKind`): bf16, FP8 or INT8 operands, and the epilogue:
// none, SwiGLU, or SwiGLU's backward. FP8 operands are e4m3 but for SwiGLU's backward's dy,
// which is in the gradient's format.
enum class Kind {
    PLAIN,
    SWIGLU,
    DSWIGLU,
    FP8_PLAIN,
    FP8_SWIGLU,
    FP8_DSWIGLU_E4M3,
    FP8_DSWIGLU_E5M2,
    INT8_PLAIN
};

// A CUtensorMap, opaque: only its address reaches the TMA instructions.
struct alignas(64) TensorMap {
    u64 opaque[16];
};
// The operands' maps (boxes of one line x 128 rows for A, 96 for B; with SwiGLU's backward in
// bf16, B as [K, N] in boxes of 64 x 32) and the outputs' (boxes of 32 columns x 64 rows; out
// is 3-D [M, 2, F] with SwiGLU, so that a gate box never spills into the up columns, and with
// its backward in boxes of 64 x 64).
struct Maps {
    TensorMap a, b, out, h;
};

extern __shared__ __align__(1024) unsigned char smem[];

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

#ifdef __CUDA_ARCH_FEAT_SM90_ALL
__device__ __forceinline__ void barrier_init(u64* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
// The producer's arrival, announcing the bytes its copies will complete.
__device__ __forceinline__ void barrier_expect(u64* bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}
// Waits until the phase of parity `parity` has completed. A fresh barrier counts the phase
// before its first as complete, so waiting on parity 1 passes at once: the producer's first
// round through the ring does not wait for consumers.
__device__ __forceinline__ void barrier_wait(u64* bar, int parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(smem_u32(bar)), "r"(parity)
            : "memory");
    }
}
// One arrival on `bar`, in this block.
__device__ __forceinline__ void barrier_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// What L2 keeps of each TMA copy. The operands' tiles are read again by the other tiles of
// their row or column of the walk, while the epilogue's tensors (outputs, and gate/up with
// SwiGLU's backward) pass through once: marked evict-first, they do not push the operands out
// of L2, where the main loop's copies would otherwise wait on memory (on an H100 the hints
// take about 0.5 ms off the fused SwiGLU backward of a 0.5B batch-32 step, 1.9 ms at 1.5B,
// in bf16).
// The loads take their policy from the caller; the stores, all the epilogue's, stream.
__device__ __forceinline__ u64 reused() {
    u64 policy;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
__device__ __forceinline__ u64 streamed() {
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}

// Copies the box at (column x, row y) of `map` into `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load(void* dst, const TensorMap* map, int x, int y, u64* bar, u64 policy) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(smem_u32(bar)), "l"(policy)
        : "memory");
}

// As `tma_load`, from (x, z, y) of a 3-D map.
__device__ __forceinline__ void tma_load_3d(void* dst, const TensorMap* map, int x, int z, int y, u64* bar,
                                            u64 policy) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(z), "r"(y), "r"(smem_u32(bar)), "l"(policy)
        : "memory");
}

// As `tma_load`, into the same offset of every block of the cluster, each completing on its
// own barrier at `bar`'s offset.
__device__ __forceinline__ void tma_load_both(void* dst, const TensorMap* map, int x, int y, u64* bar,
                                              u64 policy) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        ".L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5, %6;\n" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(smem_u32(bar)), "h"(static_cast<unsigned short>(3)),
        "l"(policy)
        : "memory");
}
// Arrives on `bar` as block `rank` of the cluster holds it.
__device__ __forceinline__ void barrier_arrive_at(u64* bar, int rank) {
    asm volatile(
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(smem_u32(bar)),
        "r"(rank)
        : "memory");
}
// Every thread of both blocks: what each did to shared memory before (barrier set-up) is
// seen by the other, and neither block leaves while the other may still write to it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Matrix descriptor of a K-major operand in the 128-byte swizzle (PTX ISA, "Matrix Descriptor
// Format"): start address >> 4, leading offset unused (1), 8-row groups 1 KB apart, layout 1.
__device__ __forceinline__ u64 k_major(const void* start) {
    return static_cast<u64>((smem_u32(start) & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<u64>(1024 >> 4) << 32) |
           (1ull << 62);
}

#define GEMM_ACC8(i)                                                                                           \
    "+f"(d[8 * (i) + 0]), "+f"(d[8 * (i) + 1]), "+f"(d[8 * (i) + 2]), "+f"(d[8 * (i) + 3]), "+f"(d[8 * (i) + 4]), \
        "+f"(d[8 * (i) + 5]), "+f"(d[8 * (i) + 6]), "+f"(d[8 * (i) + 7])
// The 96 accumulator operands of an m64n192 wgmma, in the instruction's text.
#define GEMM_D96                                                                                   \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "    \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "   \
    "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "   \
    "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "   \
    "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "   \
    "%92, %93, %94, %95"
#define GEMM_ACC48(i)                                                                                   \
    GEMM_ACC8(6 * (i) + 0), GEMM_ACC8(6 * (i) + 1), GEMM_ACC8(6 * (i) + 2), GEMM_ACC8(6 * (i) + 3), \
        GEMM_ACC8(6 * (i) + 4), GEMM_ACC8(6 * (i) + 5)

// MN-major (B as [K, N] with N contiguous): 64-column slabs 8 KB apart (leading), 8-row groups
// 1 KB apart (stride).
__device__ __forceinline__ u64 mn_major(const void* start) {
    return static_cast<u64>((smem_u32(start) & 0x3FFFF) >> 4) | (static_cast<u64>(8192 >> 4) << 16) |
           (static_cast<u64>(1024 >> 4) << 32) | (1ull << 62);
}

// d (64 x 192, f32) = A · B + (add ? d : 0) over k = 16, A K-major in shared memory, B K-major
// (N_MAJOR false: B given as [N, K]) or MN-major.
template <bool N_MAJOR>
__device__ __forceinline__ void mma_64x192(float (&d)[96], u64 a, u64 b, int add) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {"
        GEMM_D96 "}, "
        "%96, %97, p, 1, 1, 0, %99;\n}\n"
        : GEMM_ACC48(0), GEMM_ACC48(1)
        : "l"(a), "l"(b), "r"(add), "n"(N_MAJOR ? 1 : 0));
}
// As `mma_64x192`, in FP8 over k = 32, B e4m3 and A e4m3 or (A_E5M2) e5m2, both K-major: FP8
// wgmma takes no other layout.
#define GEMM_MMA_FP8(A_TYPE)                                                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"                 \
                 "wgmma.mma_async.sync.aligned.m64n192k32.f32." A_TYPE ".e4m3 {" \
                 GEMM_D96 "}, "                                                \
                 "%96, %97, p, 1, 1;\n}\n"                                      \
                 : GEMM_ACC48(0), GEMM_ACC48(1)                                \
                 : "l"(a), "l"(b), "r"(add))
template <bool A_E5M2>
__device__ __forceinline__ void mma_64x192_fp8(float (&d)[96], u64 a, u64 b, int add) {
    if constexpr (A_E5M2)
        GEMM_MMA_FP8("e5m2");
    else
        GEMM_MMA_FP8("e4m3");
}
#undef GEMM_MMA_FP8
#undef GEMM_ACC48
#undef GEMM_ACC8

#define GEMM_ACC8_S32(i)                                                                                       \
    "+r"(d[8 * (i) + 0]), "+r"(d[8 * (i) + 1]), "+r"(d[8 * (i) + 2]), "+r"(d[8 * (i) + 3]), "+r"(d[8 * (i) + 4]), \
        "+r"(d[8 * (i) + 5]), "+r"(d[8 * (i) + 6]), "+r"(d[8 * (i) + 7])
#define GEMM_ACC48_S32(i)                                                                                           \
    GEMM_ACC8_S32(6 * (i) + 0), GEMM_ACC8_S32(6 * (i) + 1), GEMM_ACC8_S32(6 * (i) + 2), GEMM_ACC8_S32(6 * (i) + 3), \
        GEMM_ACC8_S32(6 * (i) + 4), GEMM_ACC8_S32(6 * (i) + 5)
// As `mma_64x192`, in INT8 over k = 32, both operands K-major s8, into s32 accumulators.
__device__ __forceinline__ void mma_64x192_s8(int (&d)[96], u64 a, u64 b, int add) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k32.s32.s8.s8 {"
        GEMM_D96 "}, "
        "%96, %97, p;\n}\n"
        : GEMM_ACC48_S32(0), GEMM_ACC48_S32(1)
        : "l"(a), "l"(b), "r"(add));
}
#undef GEMM_ACC48_S32
#undef GEMM_ACC8_S32
#undef GEMM_D96

template <int N>
__device__ __forceinline__ void products_pending() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
#endif

// Tile t of the walk: GROUP m-tiles at a time, each group column by column.
__device__ __forceinline__ void tile_at(int t, int tiles_m, int tiles_n, int& tm, int& tn) {
    const int per_group = GROUP * tiles_n;
    const int first = (t / per_group) * GROUP;
    const int rows = min(tiles_m - first, GROUP);
    tm = first + (t % per_group) % rows;
    tn = (t % per_group) / rows;
}

// The epilogue goes through shared memory: the consumer warpgroup writes its tile (or, with
// SwiGLU, its gate, up and SwiGLU pieces) in pieces of 64 rows x 96 columns, three 64-byte-
// swizzled slabs of 32 columns, into a ring of EPI_BUFS buffers, and a thread of the producer
// warpgroup sends each piece to global memory by TMA (`output_copies`) while the consumer goes
// on to the next piece, and then to the next tile's products. A buffer is written again only
// once TMA has read it. SwiGLU's backward uses the same buffers for pieces of 64 x 64 from each
// of gate and up (`dswiglu_piece`, `dswiglu_copies`).
constexpr int PIECE_BYTES = 64 * 64 * 2 * 2;
constexpr int SLAB_BYTES = 64 * 64;  // 64 rows x 32 bf16 columns
constexpr int EPI_BUFS = GEMM_EPI_BUFS;

// The epilogues round, store and read their values two at a time, as `bf16_pair`s.
using Pair = u32;
// Each half of `largest` raised to |that half of p|, in bf16, which is exact; a NaN is dropped,
// as fmaxf drops it.
__device__ __forceinline__ Pair raise_abs_max(Pair largest, Pair p) {
    Pair r;
    asm("max.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(largest), "r"(p & 0x7fff7fffu));
    return r;
}

// Writes 12 accumulator blocks (96 columns), the bf16 pairs `pair(i, half)` of block i, into
// the three slabs at `buf`: this thread's rows 16·warp + lane/4 (+ 8), columns 8i + 2(lane % 4)
// (+1). The swizzle puts a warp's 8 rows of one block in 8 different 16-byte bank groups (rows
// of 64 bytes, chunks permuted by (r / 2) % 4): no bank conflicts.
template <typename Pairs>
__device__ __forceinline__ void write_piece(unsigned char* buf, Pairs pair) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = warp * 16 + lane / 4 + 8 * half;
        unsigned char* line = buf + r * 64 + 4 * (lane % 4);
#pragma unroll
        for (int i = 0; i < 12; ++i)
            *reinterpret_cast<Pair*>(line + (i / 4) * SLAB_BYTES + (((i % 4) ^ ((r / 2) % 4)) * 16)) = pair(i, half);
    }
}

#ifdef __CUDA_ARCH_FEAT_SM90_ALL
// Sends the box at `src` to (x, z, y) of a 3-D map, in the thread's current bulk group.
__device__ __forceinline__ void tma_store_3d(const TensorMap* map, const unsigned char* src, int x, int z, int y) {
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%1, %2, %3}], [%4], %5;\n" ::"l"(
            reinterpret_cast<u64>(map)),
        "r"(x), "r"(z), "r"(y), "r"(smem_u32(src)), "l"(streamed())
        : "memory");
}

// Sends the three slabs at `buf` to (x + 32s, y) of `map` (2-D), or of its 3-D form with middle
// coordinate `z` (SwiGLU's out as [M, 2, F]).
__device__ __forceinline__ void store_piece(const TensorMap* map, const unsigned char* buf, int x, int y, int z,
                                            bool three_d) {
#pragma unroll
    for (int s = 0; s < 3; ++s) {
        if (three_d)
            tma_store_3d(map, buf + s * SLAB_BYTES, x + 32 * s, z, y);
        else
            asm volatile(
                "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%1, %2}], [%3], %4;\n"
                ::"l"(reinterpret_cast<u64>(map)), "r"(x + 32 * s), "r"(y), "r"(smem_u32(buf + s * SLAB_BYTES)),
                "l"(streamed())
                : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// The epilogue's buffers pass between a consumer and its copy thread (`output_copies`,
// `dswiglu_copies`) on two mbarriers each: `ready` completes when the buffer may be written
// (its last piece read by TMA; with SwiGLU's backward, its gate/up values arrived), `written`
// when the consumer's four warps have written it. Piece n of a consumer (counting from its
// first tile) takes buffer n % EPI_BUFS, for that buffer's use n / EPI_BUFS, whose parity both
// sides wait on.
__device__ __forceinline__ unsigned char* piece_buffer(unsigned char* bufs, int n) {
    return bufs + (n % EPI_BUFS) * PIECE_BYTES;
}

// Waits until `bars` (ready or written) completes for piece n's use of its buffer.
__device__ __forceinline__ void await_piece(u64* bars, int n) {
    barrier_wait(&bars[n % EPI_BUFS], (n / EPI_BUFS) & 1);
}

// The consumer's wait. Its address repeats `piece_buffer`'s on purpose: written out, it keeps
// the SASS whose speed the benchmarks measure; through that call, ptxas schedules SwiGLU's
// backward consumer differently, into SASS whose speed is unknown.
__device__ __forceinline__ unsigned char* await_buffer(unsigned char* bufs, u64* ready, int n) {
    await_piece(ready, n);
    return bufs + (n % EPI_BUFS) * PIECE_BYTES;
}

// Each warp's writes to piece n's buffer, seen by TMA, and the buffer handed to the copy thread.
__device__ __forceinline__ void hand_over(u64* written, int n) {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncwarp();
    if (threadIdx.x % 32 == 0) barrier_arrive(&written[n % EPI_BUFS]);
}

// The consumer's piece n: `pair(i, half)` written into its buffer once ready.
template <typename Pairs>
__device__ __forceinline__ void epilogue_piece(unsigned char* bufs, u64* ready, u64* written, int& n, Pairs pair) {
    write_piece(await_buffer(bufs, ready, n), pair);
    hand_over(written, n);
    ++n;
}

// The copies of one consumer's output pieces, over its tiles, in the order the consumer writes
// them: `corner(tile, row, col)` gives the first row and column of its `tile`-th, false past
// the last. A piece is sent once written, and its buffer handed back once TMA has read it, so
// that the consumer's warps never wait for the sends or for each other. Per 64 rows of a tile:
// SwiGLU's gate and up pieces (out as [M, 2, F]) and then h's; otherwise the tile's two halves.
template <bool SWIGLU, typename Corner>
__device__ __forceinline__ void output_copies(unsigned char* bufs, u64* ready, u64* written, const Maps& maps,
                                              Corner corner) {
    for (int b = 0; b < EPI_BUFS; ++b) barrier_arrive(&ready[b]);  // each buffer starts free
    int n = 0, row, col;
    for (int tile = 0; corner(tile, row, col); ++tile)
#pragma unroll 1
        for (int m = 0; m < 2; ++m)
#pragma unroll 1
            for (int k = 0; k < (SWIGLU ? 3 : 2); ++k, ++n) {
                const unsigned char* buf = piece_buffer(bufs, n);
                await_piece(written, n);
                if (!SWIGLU)
                    store_piece(&maps.out, buf, col + HALF * k, row + 64 * m, 0, false);
                else if (k < 2)
                    store_piece(&maps.out, buf, col, row + 64 * m, k, true);
                else
                    store_piece(&maps.h, buf, col, row + 64 * m, 0, false);
                asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
                barrier_arrive(&ready[n % EPI_BUFS]);
            }
}

// SwiGLU's backward in the epilogue of the down projection's input gradient dh, in pieces of
// 64 rows x 64 columns: TMA brings a piece's gate and up values (gate_up as [M, 2, F], boxes
// of 64 x 64 in the 128-byte swizzle) into one of the consumer's buffers (gate's slab, then
// up's), each thread overwrites its own with their gradients from dh (rounded to bf16 first,
// as the separate matmul stores dh), and TMA sends them back in place. The consumer's warps
// wait only for a piece's values to arrive; its copy thread (`dswiglu_copies`) sends the piece
// and refills the buffer. Piece p of a tile covers its rows 64 (p / 3) and columns 64 (p % 3).
constexpr int DSWIGLU_PIECES = 6;
constexpr int DSWIGLU_SLAB = 64 * 128;

// Starts the loads of piece n (the tile's p-th), completing on its buffer's `ready`.
__device__ __forceinline__ void dswiglu_load(unsigned char* bufs, u64* ready, const TensorMap* gate_up, int n,
                                             int col, int row) {
    const int p = n % DSWIGLU_PIECES;
    u64* bar = &ready[n % EPI_BUFS];
    barrier_expect(bar, PIECE_BYTES);
    for (int z = 0; z < 2; ++z)
        tma_load_3d(piece_buffer(bufs, n) + z * DSWIGLU_SLAB, gate_up, col + 64 * (p % 3), z, row + 64 * (p / 3),
                    bar, streamed());
}

// The copies of one consumer's pieces, over its tiles (`corner` as for `output_copies`). A
// buffer is refilled only once TMA has read the piece sent from it, and a tile's first pieces
// load while the consumer computes that tile's products.
template <typename Corner>
__device__ __forceinline__ void dswiglu_copies(unsigned char* bufs, u64* ready, u64* written,
                                               const TensorMap* gate_up, Corner corner) {
    int row, col;
    for (int tile = 0, n = 0; corner(tile, row, col); ++tile) {
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
        for (int b = 0; b < EPI_BUFS; ++b) dswiglu_load(bufs, ready, gate_up, n + b, col, row);
        for (int p = 0; p < DSWIGLU_PIECES; ++p, ++n) {
            const unsigned char* buf = piece_buffer(bufs, n);
            await_piece(written, n);
            for (int z = 0; z < 2; ++z)
                tma_store_3d(gate_up, buf + z * DSWIGLU_SLAB, col + 64 * (p % 3), z, row + 64 * (p / 3));
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
            if (p + EPI_BUFS < DSWIGLU_PIECES) {
                asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
                dswiglu_load(bufs, ready, gate_up, n + EPI_BUFS, col, row);
            }
        }
    }
    // Shared memory stays until TMA has read the last pieces.
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// The consumer's piece n, the p-th of its tile (n % DSWIGLU_PIECES, passed as the unrolled
// loop's constant so that `dh` indexes the accumulators statically): waits for its values,
// computes, and hands the buffer over. `dh(i, half)` reads the bf16 pairs of the piece's rows.
// With AMAX, `largest` is raised to the largest |gradient| as stored, in each half. A half's
// gate and up pairs are all read before any is written: interleaved, every read would wait for
// the write before it (they might alias, for all the compiler knows), one pair's chain of
// arithmetic after another.
template <bool AMAX, typename Dh>
__device__ __forceinline__ void dswiglu_piece(unsigned char* bufs, u64* ready, u64* written, int& n, int p,
                                              Dh dh, Pair& largest) {
    unsigned char* buf = await_buffer(bufs, ready, n);
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = warp * 16 + lane / 4 + 8 * half;
        Pair* gate[8];
        Pair g[8], u[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            gate[j] = reinterpret_cast<Pair*>(buf + r * 128 + ((j ^ (r % 8)) * 16) + 4 * (lane % 4));
            g[j] = *gate[j];
            u[j] = *reinterpret_cast<Pair*>(reinterpret_cast<unsigned char*>(gate[j]) + DSWIGLU_SLAB);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const Pair d = dh(8 * (p % 3) + j, half);
            float dg[2], du[2];
            swiglu_grads<bf16>(bf16_low(g[j]), bf16_low(u[j]), bf16_low(d), dg[0], du[0]);
            swiglu_grads<bf16>(bf16_high(g[j]), bf16_high(u[j]), bf16_high(d), dg[1], du[1]);
            g[j] = bf16_pair(dg[0], dg[1]);
            u[j] = bf16_pair(du[0], du[1]);
            *gate[j] = g[j];
            *reinterpret_cast<Pair*>(reinterpret_cast<unsigned char*>(gate[j]) + DSWIGLU_SLAB) = u[j];
            if constexpr (AMAX) largest = raise_abs_max(raise_abs_max(largest, g[j]), u[j]);
        }
    }
    hand_over(written, n);
    ++n;
}
#endif

#ifdef __CUDA_ARCH_FEAT_SM90_ALL
// The consumers' accumulators: f32, or INT8's s32; and an accumulator's value, f32 as it is or
// the f32 bits INT8's epilogue stored in an s32.
template <bool INT8> struct Accumulator { using type = float; };
template <> struct Accumulator<true> { using type = int; };
__device__ __forceinline__ float acc_value(float x) { return x; }
__device__ __forceinline__ float acc_value(int x) { return __int_as_float(x); }

// INT8's products of tile t: d = f32(sum) · a_descale[row] · b_descale[column] (+ bias[column]),
// each step rounded on its own, as ops/int8.rs states, the f32 results' bits stored over the
// s32 sums (`acc_value` reads them). This thread's accumulators 4i..4i+3 of rows 64m.. lie in
// rows 16·warp + lane/4 (+8 for the last two) and columns 8i + 2(lane % 4) (+1 for the odd
// ones). A column pair's descales (and bias) are one load, and pairs past N read as 0 (those
// columns are not stored; N is even).
__device__ __forceinline__ void int8_epilogue(int (&d)[2][96], int t, int pairs_m, int tiles_n, int M, int N,
                                              const float* a_descale, const float* b_descale,
                                              const bf16* bias) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    int pm, tn;
    tile_at(t, pairs_m, tiles_n, pm, tn);
    const int row0 = (CLUSTER * pm + static_cast<int>(blockIdx.x % CLUSTER)) * BM + 16 * warp + lane / 4;
    float rows[2][2];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = row0 + 64 * m + 8 * half;
            rows[m][half] = r < M ? a_descale[r] : 0.0f;
        }
#pragma unroll
    for (int i = 0; i < 24; ++i) {
        const int col = tn * BN + 8 * i + 2 * (lane % 4);
        const bool inside = col < N;
        const float2 cs = inside ? *reinterpret_cast<const float2*>(b_descale + col) : make_float2(0.0f, 0.0f);
        const Pair bias_pair = (bias != nullptr && inside) ? *reinterpret_cast<const Pair*>(bias + col) : 0u;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int c = 4 * i + e;
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                float v = __fmul_rn(__fmul_rn(__int2float_rn(d[m][c]), rows[m][e / 2]), e % 2 ? cs.y : cs.x);
                if (bias != nullptr) v = __fadd_rn(v, e % 2 ? bf16_high(bias_pair) : bf16_low(bias_pair));
                d[m][c] = __float_as_int(v);
            }
        }
    }
}
#endif

}  // namespace gemm

// out [M, N] = a [M, K] · b [N, K]ᵀ (a_map and b_map: 2-D maps of a and b with boxes of one
// 128-byte line x 128 or 96 rows, 128-byte swizzle). With SWIGLU, N = 2F, and h [M, F] receives
// SwiGLU. N even, K a multiple of 16 bytes (TMA's strides); TMA fills what lies past K with
// zeros. FP8: a and b e4m3 (a in the gradient's format for SwiGLU's backward), each scaled by
// its descale, and `amax` (if not null) raised to the largest |value| of what the FP8 step
// quantizes next: h with SWIGLU, gate/up's gradient with DSWIGLU. INT8: a_descale [M] and
// b_descale [N] hold a descale per row of each, and `bias` (if not null) [N].
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
#define GEMM_CLUSTER __cluster_dims__(2, 1, 1)
#else
#define GEMM_CLUSTER
#endif

template <gemm::Kind KIND>
__global__ void __launch_bounds__(GEMM_THREADS, 1) GEMM_CLUSTER
    gemm_tn(const __grid_constant__ gemm::Maps maps, int M, int N, int K, const float* a_descale,
            const float* b_descale, float* amax, const bf16* bias) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
    using namespace gemm;
    constexpr bool A_E5M2 = KIND == Kind::FP8_DSWIGLU_E5M2;
    constexpr bool DSWIGLU = KIND == Kind::DSWIGLU || KIND == Kind::FP8_DSWIGLU_E4M3 || A_E5M2;
    constexpr bool INT8 = KIND == Kind::INT8_PLAIN;
    constexpr bool FP8 = KIND == Kind::FP8_PLAIN || KIND == Kind::FP8_SWIGLU || KIND == Kind::FP8_DSWIGLU_E4M3 || A_E5M2;
    constexpr bool SWIGLU = KIND == Kind::SWIGLU || KIND == Kind::FP8_SWIGLU;
    constexpr bool B_MN_MAJOR = DSWIGLU && !FP8;  // the bf16 down weight as stored
    constexpr int BK = FP8 || INT8 ? LINE : LINE / 2;  // k-block: elements of one line
    unsigned char* epilogue = smem + STAGES * STAGE_BYTES;  // EPI_BUFS pieces per consumer
    u64* full = reinterpret_cast<u64*>(epilogue + 2 * EPI_BUFS * PIECE_BYTES);
    u64* empty = full + STAGES;
    u64* ready = empty + STAGES;  // the epilogue's buffers: EPI_BUFS a consumer
    // order[c] completes each time the other consumer has taken all of a tile's k-blocks. A
    // consumer starts a tile only then: a barrier's parity tells apart only its last two
    // phases, so a consumer that waited on a ring buffer's barrier while that buffer still held
    // the k-blocks before the other consumer's could see a phase long past as done.
    u64* order = ready + 2 * EPI_BUFS;
    u64* written = order + 2;  // EPI_BUFS a consumer
    // A SwiGLU tile covers 96 gate and 96 up columns. Tiles go in pairs of rows.
    const int tile_cols = SWIGLU ? HALF : BN;
    const int tiles_n = ((SWIGLU ? N / 2 : N) + tile_cols - 1) / tile_cols;
    const int pairs_m = (M + CLUSTER * BM - 1) / (CLUSTER * BM);
    const int pairs = pairs_m * tiles_n;
    const int kblocks = (K + BK - 1) / BK;
    const int rank = blockIdx.x % CLUSTER, cluster = blockIdx.x / CLUSTER, clusters = gridDim.x / CLUSTER;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(&full[s], 1);
            barrier_init(&empty[s], CLUSTER * READERS);
        }
        for (int i = 0; i < 2 * EPI_BUFS + 2; ++i) barrier_init(&ready[i], 1);  // and order's two
        for (int i = 0; i < 2 * EPI_BUFS; ++i) barrier_init(&written[i], READERS);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    cluster_sync();

    const int warpgroup = threadIdx.x / 128;
    int it = 0;  // k-blocks walked so far: the ring's position and phase
    // The producer needs few registers; the consumers' accumulators take 192 of their 240.
    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (threadIdx.x == 0) {
            for (int t = cluster; t < pairs; t += clusters) {
                int pm, tn;
                tile_at(t, pairs_m, tiles_n, pm, tn);
                // This block's half of the B tile: rows 0..95 of it (gate) or 96..191 (up).
                const int b_row = SWIGLU ? rank * (N / 2) + tn * HALF : tn * BN + rank * HALF;
                for (int kb = 0; kb < kblocks; ++kb, ++it) {
                    const int s = it % STAGES;
                    barrier_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
                    unsigned char* stage = smem + s * STAGE_BYTES;
                    barrier_expect(&full[s], STAGE_BYTES);
                    tma_load(stage, &maps.a, kb * BK, (CLUSTER * pm + rank) * BM, &full[s], reused());
                    if constexpr (B_MN_MAJOR) {
                        // b is [K, N]: three slabs of 64 columns, this block copying the half
                        // of each slab's 64 rows of K at its rank.
                        for (int j = 0; j < 3; ++j)
                            tma_load_both(stage + A_BYTES + j * (64 * 128) + rank * (32 * 128), &maps.b,
                                          tn * BN + 64 * j, kb * BK + 32 * rank, &full[s], reused());
                    } else {
                        tma_load_both(stage + A_BYTES + rank * (B_BYTES / 2), &maps.b, kb * BK, b_row, &full[s],
                                      reused());
                    }
                }
            }
        } else if (threadIdx.x == 32 || threadIdx.x == 64) {
            // Warp 1 serves consumer 0, warp 2 consumer 1, over the consumer's every other tile.
            const int consumer = threadIdx.x / 32 - 1;
            unsigned char* bufs = epilogue + consumer * EPI_BUFS * PIECE_BYTES;
            u64* ready_of = &ready[EPI_BUFS * consumer];
            u64* written_of = &written[EPI_BUFS * consumer];
            auto corner = [&](int tile, int& row, int& col) {
                const int t = cluster + (consumer + 2 * tile) * clusters;
                if (t >= pairs) return false;
                int pm, tn;
                tile_at(t, pairs_m, tiles_n, pm, tn);
                row = (CLUSTER * pm + rank) * BM;
                col = tn * tile_cols;
                return true;
            };
            if constexpr (DSWIGLU)
                dswiglu_copies(bufs, ready_of, written_of, &maps.out, corner);
            else
                output_copies<SWIGLU>(bufs, ready_of, written_of, maps, corner);
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
        const int consumer = warpgroup - 1;
        const bool warp_leader = threadIdx.x % 32 == 0;
        // Rows 0..63 and 64..127 of the tile: f32, or INT8's s32 sums, over which its
        // epilogue stores the products' f32 bits (a second array would not fit beside them).
        typename Accumulator<INT8>::type d[2][96];
        // FP8: the accumulators times both operands' descales are the product.
        const float scale = FP8 ? *a_descale * *b_descale : 1.0f;
        // FP8 with an epilogue: the largest |output| as stored in each half of a pair, for `amax`.
        Pair largest = 0;
        unsigned char* bufs = epilogue + consumer * EPI_BUFS * PIECE_BYTES;
        u64* ready_of = &ready[EPI_BUFS * consumer];
        u64* written_of = &written[EPI_BUFS * consumer];
        int pieces = 0;  // pieces written so far: the epilogue buffers' position and phase
        // Every other tile of the block's walk, the ring skipping the other consumer's k-blocks.
        for (int j = consumer, t = cluster + j * clusters; t < pairs; j += 2, t += 2 * clusters) {
            it = j * kblocks;
            if (j > 0) barrier_wait(&order[consumer], (j - 1) / 2 & 1);
            int previous = -1;
            for (int kb = 0; kb < kblocks; ++kb, ++it) {
                const int s = it % STAGES;
                barrier_wait(&full[s], (it / STAGES) & 1);
                const unsigned char* a = smem + s * STAGE_BYTES;
                const unsigned char* b = a + A_BYTES;
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                for (int kk = 0; kk < 4; ++kk)    // 16 bf16 or 32 FP8/INT8 columns: 32 bytes of each line
#pragma unroll
                    for (int m = 0; m < 2; ++m) {  // A's rows 64m..: 8 KB on
                        const u64 a_desc = k_major(a + m * (64 * 128) + kk * 32);
                        if constexpr (INT8)
                            mma_64x192_s8(d[m], a_desc, k_major(b + kk * 32), kb > 0 || kk > 0);
                        else if constexpr (FP8)
                            mma_64x192_fp8<A_E5M2>(d[m], a_desc, k_major(b + kk * 32), kb > 0 || kk > 0);
                        else if constexpr (B_MN_MAJOR)  // 16 rows of each slab: 2 KB
                            mma_64x192<true>(d[m], a_desc, mn_major(b + kk * 2048), kb > 0 || kk > 0);
                        else
                            mma_64x192<false>(d[m], a_desc, k_major(b + kk * 32), kb > 0 || kk > 0);
                    }
                asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                // The previous k-block's products are done: both blocks may refill its buffer.
                products_pending<1>();
                if (previous >= 0 && warp_leader)
                    for (int r = 0; r < CLUSTER; ++r) barrier_arrive_at(&empty[previous], r);
                previous = s;
            }
            if (threadIdx.x % 128 == 0) barrier_arrive(&order[1 - consumer]);
            products_pending<0>();
            if (warp_leader)
                for (int r = 0; r < CLUSTER; ++r) barrier_arrive_at(&empty[previous], r);
            if constexpr (FP8)
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int c = 0; c < 96; ++c) d[m][c] *= scale;
            if constexpr (INT8) int8_epilogue(d, t, pairs_m, tiles_n, M, N, a_descale, b_descale, bias);
            // Accumulator blocks first.. of rows 64m..
            auto pairs = [&](int m, int first) {
                return [&d, m, first](int i, int half) {
                    const int c = 4 * (first + i) + 2 * half;
                    return bf16_pair(acc_value(d[m][c]), acc_value(d[m][c + 1]));
                };
            };
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                // In the order `output_copies` sends them.
                if constexpr (SWIGLU) {
                    epilogue_piece(bufs, ready_of, written_of, pieces, pairs(m, 0));
                    epilogue_piece(bufs, ready_of, written_of, pieces, pairs(m, 12));
                    // SwiGLU of the gate and up values as stored, as swiglu.cu reads them.
                    epilogue_piece(bufs, ready_of, written_of, pieces, [&d, &largest, m](int i, int half) {
                        const int c = 4 * i + 2 * half;
                        // Gate and up rounded one at a time: rounded as pairs, ptxas shares them
                        // with the pieces above and keeps them live across both, which spills.
                        auto value = [&](int e) {
                            return swiglu<bf16>(rounded<bf16>(acc_value(d[m][c + e])),
                                                rounded<bf16>(acc_value(d[m][c + e + 48])));
                        };
                        const Pair h = bf16_pair(value(0), value(1));
                        if constexpr (FP8) largest = raise_abs_max(largest, h);
                        return h;
                    });
                } else if constexpr (!DSWIGLU) {
                    epilogue_piece(bufs, ready_of, written_of, pieces, pairs(m, 0));
                    epilogue_piece(bufs, ready_of, written_of, pieces, pairs(m, 12));
                }
            }
            if constexpr (DSWIGLU) {
#pragma unroll
                for (int p = 0; p < DSWIGLU_PIECES; ++p)
                    dswiglu_piece<FP8>(bufs, ready_of, written_of, pieces, p, pairs(p / 3, 0), largest);
            }
        }
        // As swiglu.cu reports it: an integer max of non-negative floats, in any order.
        if (FP8 && (SWIGLU || DSWIGLU) && amax != nullptr) {
            const float top = warp_max(fmaxf(bf16_low(largest), bf16_high(largest)));
            if (warp_leader) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(top));
        }
    }
    cluster_sync();
#else
    __trap();
#endif
}
