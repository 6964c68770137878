// smelt's own bf16 matmul for Hopper (sm_90a): out [M, N] = a [M, K] · b [N, K]ᵀ, both operands
// row-major with K contiguous (the forward's `x · wᵀ`), f32 accumulation, bf16 output. It exists
// for the epilogues cuBLASLt does not have:
// - SWIGLU: the MLP's gate/up projection and SwiGLU in one kernel, which writes gate/up
//   [M, 2F] and SwiGLU's output [M, F] from the accumulators, so that no separate pass reads
//   gate/up back;
// - DSWIGLU: the down projection's input gradient dh = dy · w (b given as [K, N], N contiguous:
//   the down weight as stored) and SwiGLU's backward, which reads gate/up and overwrites it
//   with its gradient, so that dh is never written or read (`dswiglu_piece`).
//
// The design is that of CUTLASS's warp-specialised Hopper kernels, written small. A persistent
// grid of clusters of two blocks (a block per SM) walks the output tiles in pairs: the blocks
// of a cluster take tiles (2p, n) and (2p + 1, n), which share B's tile. Warpgroup 0 of each
// block produces: one thread issues TMA copies of each k-block's A tile (128 rows x 64
// columns) into its own block and half of the B tile (256 x 64, two boxes of 128 rows) into
// both blocks at once (multicast), into a ring of GEMM_STAGES shared buffers. Sharing B cuts
// the L2-to-SM traffic per tile by a third: alone, a 128 x 256 tile's 48 KB per k-block
// held the kernel to ~6-7 TB/s of L2 reads and 500-610 TFLOP/s. Each buffer has two mbarriers:
// `full` completes when the copies' bytes have landed (its own A and both halves of B),
// `empty` when every consumer warp of both blocks is done reading it (the block refills its
// half of B in both). Warpgroups 1 and 2 consume: each multiplies its 64 rows of the A tile
// by the whole B tile with wgmma m64n256k16 (its 64 x 256 accumulator is 128 registers a
// thread), keeping one k-block's products in flight, and then writes its accumulator to
// shared memory, from where TMA stores it while the warpgroup goes on to the next tile (see
// `epilogue_piece`). The producer runs ahead into the next tile meanwhile. Storing straight
// from the registers instead held the matmul to 503-613 TFLOP/s at the models' gate/up shapes;
// through shared memory it reaches 698-747, within 0-6% of cuBLASLt. That is the cooperative
// schedule; the ping-pong one (below, the host's choice where K is small) gives each consumer
// its own tiles.
//
// Shared tiles are in TMA's 128-byte swizzle, which is the layout wgmma reads K-major operands
// in: row r of a tile is one 128-byte line (64 bf16), its 16-byte chunks permuted by XOR with
// r % 8, and 8-row groups 1 KB apart.
//
// SwiGLU's tile: the B box of rows 0..127 comes from gate row g0 and the one of rows 128..255
// from up row F + g0, so that accumulator column c (gate) and c + 128 (up) sit in the same
// thread's registers (columns 8i + 2(lane % 4) of blocks i and i + 16).
#include "common.cuh"

namespace gemm {

// Two schedules. Cooperative: a block's tile is 128 x 256, each consumer warpgroup multiplying
// 64 of its rows, and both store at once while the tensor cores wait. Ping-pong (PINGPONG): a
// block's tile is 64 x 256 and the consumers take turns, each a whole tile: one stores while
// the other multiplies. The ring's order makes the turns: the producer fills it with one
// tile's k-blocks after another, and each consumer takes every other tile's.
template <bool PINGPONG> constexpr int BM = PINGPONG ? 64 : 128;  // rows of a block's tile
constexpr int BN = 256;    // columns of a tile
constexpr int BK = 64;     // k-block: one 128-byte line per row
constexpr int HALF = 128;  // rows of one B box
template <bool PINGPONG> constexpr int STAGES = PINGPONG ? GEMM_STAGES + 1 : GEMM_STAGES;
constexpr int GROUP = 16;  // m-tiles walked together, so that their A rows stay in L2
template <bool PINGPONG> constexpr int A_BYTES = BM<PINGPONG> * BK * 2;
constexpr int B_BYTES = BN * BK * 2;
template <bool PINGPONG> constexpr int STAGE_BYTES = A_BYTES<PINGPONG> + B_BYTES;
constexpr int CLUSTER = 2;  // blocks sharing a B tile
// Warps reading each stage, in each block.
template <bool PINGPONG> constexpr int READERS = PINGPONG ? 4 : 8;
static_assert(GEMM_THREADS == 3 * 128, "a producer warpgroup and two consumers");

// A CUtensorMap, opaque: only its address reaches the TMA instructions.
struct alignas(64) TensorMap {
    u64 opaque[16];
};
// The operands' maps (boxes of 64 columns x 128 rows) and the outputs' (boxes of 64 x 64; with
// SwiGLU, out is 3-D [M, 2, F] so that a gate box never spills into the up columns).
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
// Copies the box at (column x, row y) of `map` into `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load(void* dst, const TensorMap* map, int x, int y, u64* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            smem_u32(dst)),
        "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(smem_u32(bar))
        : "memory");
}

// As `tma_load`, from (x, z, y) of a 3-D map.
__device__ __forceinline__ void tma_load_3d(void* dst, const TensorMap* map, int x, int z, int y, u64* bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
            smem_u32(dst)),
        "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(z), "r"(y), "r"(smem_u32(bar))
        : "memory");
}

// As `tma_load`, into the same offset of every block of the cluster, each completing on its
// own barrier at `bar`'s offset.
__device__ __forceinline__ void tma_load_both(void* dst, const TensorMap* map, int x, int y, u64* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, "
        "%3}], [%4], %5;\n" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<u64>(map)), "r"(x), "r"(y), "r"(smem_u32(bar)), "h"(static_cast<unsigned short>(3))
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
#define GEMM_ACC64(i)                                                                                       \
    GEMM_ACC8(8 * (i) + 0), GEMM_ACC8(8 * (i) + 1), GEMM_ACC8(8 * (i) + 2), GEMM_ACC8(8 * (i) + 3), \
        GEMM_ACC8(8 * (i) + 4), GEMM_ACC8(8 * (i) + 5), GEMM_ACC8(8 * (i) + 6), GEMM_ACC8(8 * (i) + 7)

// MN-major (B as [K, N] with N contiguous): 64-column slabs 8 KB apart (leading), 8-row groups
// 1 KB apart (stride).
__device__ __forceinline__ u64 mn_major(const void* start) {
    return static_cast<u64>((smem_u32(start) & 0x3FFFF) >> 4) | (static_cast<u64>(8192 >> 4) << 16) |
           (static_cast<u64>(1024 >> 4) << 32) | (1ull << 62);
}

// d (64 x 256, f32) = A · B + (add ? d : 0) over k = 16, A K-major in shared memory, B K-major
// (N_MAJOR false: B given as [N, K]) or MN-major.
template <bool N_MAJOR>
__device__ __forceinline__ void mma_64x256(float (&d)[128], u64 a, u64 b, int add) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, 0, %131;\n}\n"
        : GEMM_ACC64(0), GEMM_ACC64(1)
        : "l"(a), "l"(b), "r"(add), "n"(N_MAJOR ? 1 : 0));
}
#undef GEMM_ACC64
#undef GEMM_ACC8

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

// The epilogue goes through shared memory: each consumer warpgroup writes its 64 x 256 tile
// (or, with SwiGLU, its gate, up and SwiGLU pieces) in pieces of 64 rows x 128 columns into
// a ring of EPI_BUFS buffers of two 128-byte-swizzled slabs, and one thread sends each piece
// to global memory by TMA, which runs on while the warpgroup goes on to the next tile's
// products. A buffer is written again only once TMA has read it.
constexpr int PIECE_BYTES = 64 * 128 * 2;
constexpr int EPI_BUFS = GEMM_EPI_BUFS;

// The consumer warpgroup's own barrier (named barriers 1 and 2; 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_sync(int consumer) {
    asm volatile("bar.sync %0, 128;\n" ::"r"(consumer + 1) : "memory");
}

// Writes 16 accumulator blocks (128 columns), the values `value(i, half, e)` of block i, into
// the buffer at `buf`: this thread's rows 16·warp + lane/4 (+ 8), columns 8i + 2(lane % 4) (+1).
// The swizzle puts a warp's 8 rows of one block in 8 different 16-byte chunks: no bank
// conflicts.
template <typename Value>
__device__ __forceinline__ void write_piece(unsigned char* buf, Value value) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = warp * 16 + lane / 4 + 8 * half;
        unsigned char* line = buf + r * 128 + 4 * (lane % 4);
#pragma unroll
        for (int i = 0; i < 16; ++i)
            *reinterpret_cast<__nv_bfloat162*>(line + (i / 8) * (64 * 128) + (((i % 8) ^ (r % 8)) * 16)) =
                __floats2bfloat162_rn(value(i, half, 0), value(i, half, 1));
    }
}

#ifdef __CUDA_ARCH_FEAT_SM90_ALL
// Sends the two 64 x 64 slabs at `buf` to (x, y) and (x + 64, y) of `map` (2-D), or of its
// 3-D form with middle coordinate `z` (SwiGLU's out as [M, 2, F]).
__device__ __forceinline__ void store_piece(const TensorMap* map, const unsigned char* buf, int x, int y, int z,
                                            bool three_d) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        if (three_d)
            asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
                             reinterpret_cast<u64>(map)),
                         "r"(x + 64 * s), "r"(z), "r"(y), "r"(smem_u32(buf + s * 64 * 128))
                         : "memory");
        else
            asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                             reinterpret_cast<u64>(map)),
                         "r"(x + 64 * s), "r"(y), "r"(smem_u32(buf + s * 64 * 128))
                         : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// One piece through buffer `n % EPI_BUFS`: waits until TMA has read the piece that last used
// it, writes, and sends.
template <typename Value>
__device__ __forceinline__ void epilogue_piece(unsigned char* bufs, int& n, int consumer, const TensorMap* map, int x,
                                               int y, int z, bool three_d, Value value) {
    unsigned char* buf = bufs + (n % EPI_BUFS) * PIECE_BYTES;
    const bool leader = threadIdx.x % 128 == 0;
    if (leader) asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(EPI_BUFS - 1) : "memory");
    warpgroup_sync(consumer);
    write_piece(buf, value);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the writes, seen by TMA
    warpgroup_sync(consumer);
    if (leader) store_piece(map, buf, x, y, z, three_d);
    ++n;
}

// SwiGLU's backward in the epilogue of the down projection's input gradient dh, in pieces of
// 64 columns: TMA brings a piece's gate and up values (gate_up as [M, 2, F]) into one of the
// warpgroup's two buffers (gate's slab, then up's), each thread overwrites its own with their
// gradients from dh (rounded to bf16 first, as the separate matmul stores dh), and TMA sends
// them back in place. The two buffers take turns: the first two pieces' loads are issued while
// the tile's products run, and each later one as soon as the store two pieces before it has
// read its buffer, so a piece's load waits under the arithmetic of the one before.
constexpr int DSWIGLU_PIECES = 4;  // of a warpgroup's 256 columns

// Leader: starts piece p's loads, columns col + 64p.
__device__ __forceinline__ void dswiglu_load(unsigned char* bufs, u64* bars, const TensorMap* gate_up, int p,
                                             int col, int row) {
    unsigned char* buf = bufs + (p % 2) * PIECE_BYTES;
    barrier_expect(&bars[p % 2], PIECE_BYTES);
    for (int z = 0; z < 2; ++z) tma_load_3d(buf + z * 64 * 128, gate_up, col + 64 * p, z, row, &bars[p % 2]);
}

// Piece p: waits for its values, computes, and sends them; then (leader) starts piece p + 2's
// loads into the same buffer.
template <typename Dh>
__device__ __forceinline__ void dswiglu_piece(unsigned char* bufs, u64* bars, int consumer, const TensorMap* gate_up,
                                              int p, int col, int row, Dh dh) {
    static_assert(EPI_BUFS == 2, "two buffers take turns");
    unsigned char* buf = bufs + (p % 2) * PIECE_BYTES;
    barrier_wait(&bars[p % 2], (p / 2) & 1);  // each buffer fills twice a tile
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = warp * 16 + lane / 4 + 8 * half;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            auto* gp = reinterpret_cast<__nv_bfloat162*>(buf + r * 128 + ((j ^ (r % 8)) * 16) + 4 * (lane % 4));
            auto* up = reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<unsigned char*>(gp) + 64 * 128);
            const __nv_bfloat162 g = *gp, u = *up;
            float dg[2], du[2];
            swiglu_grads(__low2float(g), __low2float(u), rounded<bf16>(dh(8 * p + j, half, 0)), dg[0], du[0]);
            swiglu_grads(__high2float(g), __high2float(u), rounded<bf16>(dh(8 * p + j, half, 1)), dg[1], du[1]);
            *gp = __floats2bfloat162_rn(dg[0], dg[1]);
            *up = __floats2bfloat162_rn(du[0], du[1]);
        }
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    warpgroup_sync(consumer);
    if (threadIdx.x % 128 == 0) {
        for (int z = 0; z < 2; ++z)
            asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
                             reinterpret_cast<u64>(gate_up)),
                         "r"(col + 64 * p), "r"(z), "r"(row), "r"(smem_u32(buf + z * 64 * 128))
                         : "memory");
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        if (p + 2 < DSWIGLU_PIECES) {
            asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
            dswiglu_load(bufs, bars, gate_up, p + 2, col, row);
        }
    }
}
#endif

}  // namespace gemm

// out [M, N] = a [M, K] · b [N, K]ᵀ (a_map and b_map: 2-D bf16 maps of a and b with boxes of
// 64 columns x 128 rows, 128-byte swizzle). With SWIGLU, N = 2F, and h [M, F] receives SwiGLU.
// N even, K a multiple of 8 (TMA's 16-byte strides); TMA fills what lies past K with zeros.
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
#define GEMM_CLUSTER __cluster_dims__(2, 1, 1)
#else
#define GEMM_CLUSTER
#endif

template <bool SWIGLU, bool DSWIGLU, bool PINGPONG>
__global__ void __launch_bounds__(GEMM_THREADS, 1) GEMM_CLUSTER
    gemm_tn(const __grid_constant__ gemm::Maps maps, int M, int N, int K) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
    using namespace gemm;
    constexpr int STAGES = gemm::STAGES<PINGPONG>, STAGE_BYTES = gemm::STAGE_BYTES<PINGPONG>;
    constexpr int BM = gemm::BM<PINGPONG>, A_BYTES = gemm::A_BYTES<PINGPONG>;
    unsigned char* epilogue = smem + STAGES * STAGE_BYTES;  // EPI_BUFS pieces per consumer
    u64* full = reinterpret_cast<u64*>(epilogue + 2 * EPI_BUFS * PIECE_BYTES);
    u64* empty = full + STAGES;
    u64* epi_bar = empty + STAGES;  // two a consumer warpgroup, for its buffers' loads (DSWIGLU)
    // Ping-pong: order[c] completes each time the other consumer has taken all of a tile's
    // k-blocks. A consumer starts a tile only then: a barrier's parity tells apart only its
    // last two phases, so a consumer that waited on a ring buffer's barrier while that buffer
    // still held the k-blocks before the other consumer's could see a phase long past as done.
    u64* order = epi_bar + 4;
    // A SwiGLU tile covers 128 gate and 128 up columns. Tiles go in pairs of rows.
    const int tile_cols = SWIGLU ? HALF : BN;
    const int tiles_n = ((SWIGLU ? N / 2 : N) + tile_cols - 1) / tile_cols;
    const int pairs_m = (M + CLUSTER * BM - 1) / (CLUSTER * BM);
    const int pairs = pairs_m * tiles_n;
    const int kblocks = (K + BK - 1) / BK;
    const int rank = blockIdx.x % CLUSTER, cluster = blockIdx.x / CLUSTER, clusters = gridDim.x / CLUSTER;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(&full[s], 1);
            barrier_init(&empty[s], CLUSTER * READERS<PINGPONG>);
        }
        for (int i = 0; i < 6; ++i) barrier_init(&epi_bar[i], 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    cluster_sync();

    const int warpgroup = threadIdx.x / 128;
    int it = 0;  // k-blocks walked so far: the ring's position and phase
    // The producer needs few registers; the consumers' accumulators take 128 of their 240.
    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (threadIdx.x == 0) {
            for (int t = cluster; t < pairs; t += clusters) {
                int pm, tn;
                tile_at(t, pairs_m, tiles_n, pm, tn);
                // This block's half of the B tile: rows 0..127 of it (gate) or 128..255 (up).
                const int b_row = SWIGLU ? rank * (N / 2) + tn * HALF : tn * BN + rank * HALF;
                for (int kb = 0; kb < kblocks; ++kb, ++it) {
                    const int s = it % STAGES;
                    barrier_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
                    unsigned char* stage = smem + s * STAGE_BYTES;
                    barrier_expect(&full[s], STAGE_BYTES);
                    tma_load(stage, &maps.a, kb * BK, (CLUSTER * pm + rank) * BM, &full[s]);
                    if constexpr (DSWIGLU) {  // b is [K, N]: this block's 128 columns, two slabs
                        for (int j = 0; j < 2; ++j)
                            tma_load_both(stage + A_BYTES + (2 * rank + j) * (64 * 128), &maps.b,
                                          tn * BN + rank * HALF + 64 * j, kb * BK, &full[s]);
                    } else {
                        tma_load_both(stage + A_BYTES + rank * (B_BYTES / 2), &maps.b, kb * BK, b_row, &full[s]);
                    }
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
        const int consumer = warpgroup - 1;
        const bool warp_leader = threadIdx.x % 32 == 0;
        float d[128];
        unsigned char* bufs = epilogue + consumer * EPI_BUFS * PIECE_BYTES;
        int pieces = 0;  // pieces sent so far: the epilogue ring's position
        // Cooperative: every tile of the block's walk; ping-pong: every other one, the ring
        // skipping the other consumer's k-blocks.
        const int step = PINGPONG ? 2 : 1;
        for (int j = PINGPONG ? consumer : 0, t = cluster + j * clusters; t < pairs; j += step, t += step * clusters) {
            int pm, tn;
            tile_at(t, pairs_m, tiles_n, pm, tn);
            it = j * kblocks;
            if (PINGPONG && j > 0) barrier_wait(&order[consumer], (j - 1) / 2 & 1);
            int previous = -1;
            for (int kb = 0; kb < kblocks; ++kb, ++it) {
                const int s = it % STAGES;
                barrier_wait(&full[s], (it / STAGES) & 1);
                const unsigned char* a = smem + s * STAGE_BYTES + (PINGPONG ? 0 : consumer * 64 * 128);
                const unsigned char* b = smem + s * STAGE_BYTES + A_BYTES;
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk)  // 16 columns: 32 bytes of each line
                    if constexpr (DSWIGLU)  // 16 rows of each slab: 2 KB
                        mma_64x256<true>(d, k_major(a + kk * 32), mn_major(b + kk * 2048), kb > 0 || kk > 0);
                    else
                        mma_64x256<false>(d, k_major(a + kk * 32), k_major(b + kk * 32), kb > 0 || kk > 0);
                asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                // While the first products run: the first two pieces of the epilogue's gate/up,
                // once TMA has read the last tile's from the buffers.
                if (DSWIGLU && kb == 0 && threadIdx.x % 128 == 0) {
                    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
                    const int row = (CLUSTER * pm + rank) * BM + (PINGPONG ? 0 : consumer * 64);
                    for (int p = 0; p < 2; ++p) dswiglu_load(bufs, &epi_bar[2 * consumer], &maps.out, p, tn * BN, row);
                }
                // The previous k-block's products are done: both blocks may refill its buffer.
                products_pending<1>();
                if (previous >= 0 && warp_leader)
                    for (int r = 0; r < CLUSTER; ++r) barrier_arrive_at(&empty[previous], r);
                previous = s;
            }
            if (PINGPONG && threadIdx.x % 128 == 0) barrier_arrive(&order[1 - consumer]);
            products_pending<0>();
            if (warp_leader)
                for (int r = 0; r < CLUSTER; ++r) barrier_arrive_at(&empty[previous], r);
            const int row = (CLUSTER * pm + rank) * BM + (PINGPONG ? 0 : consumer * 64), col = tn * tile_cols;
            auto acc = [&](int first) {
                return [&d, first](int i, int half, int e) { return d[4 * (first + i) + 2 * half + e]; };
            };
            if constexpr (SWIGLU) {
                epilogue_piece(bufs, pieces, consumer, &maps.out, col, row, 0, true, acc(0));
                epilogue_piece(bufs, pieces, consumer, &maps.out, col, row, 1, true, acc(16));
                // SwiGLU of the gate and up values as stored, as swiglu.cu reads them.
                epilogue_piece(bufs, pieces, consumer, &maps.h, col, row, 0, false, [&d](int i, int half, int e) {
                    const int j = 4 * i + 2 * half + e;
                    return swiglu(rounded<bf16>(d[j]), rounded<bf16>(d[j + 64]));
                });
            } else if constexpr (DSWIGLU) {
#pragma unroll
                for (int p = 0; p < DSWIGLU_PIECES; ++p)
                    dswiglu_piece(bufs, &epi_bar[2 * consumer], consumer, &maps.out, p, col, row, acc(0));
            } else {
                epilogue_piece(bufs, pieces, consumer, &maps.out, col, row, 0, false, acc(0));
                epilogue_piece(bufs, pieces, consumer, &maps.out, col + 128, row, 0, false, acc(16));
            }
        }
        // Shared memory stays until TMA has read the last pieces.
        if (threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    }
    cluster_sync();
#else
    __trap();
#endif
}
