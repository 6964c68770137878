// Causal grouped-query attention, flash style: scores live in registers one tile at a time,
// never as an S×S matrix. These kernels run on the CUDA cores (f32 math, any storage type),
// which also makes them the simple reference the tensor-core kernels (attention_tc.cu) are
// tested against.
//
// Layout: qkv is [B·T, stride] with stride = (Hq + 2·Hkv)·D: q heads, then k heads, then v
// heads. out is [B·T, Hq·D]; lse and delta are [B, Hq, T] f32.
//
// Each query (or key) row is owned by a group of ROW_LANES = 8 adjacent lanes; lane t of the
// group holds dimensions t, t + 8, t + 16, ... (D/8 of them) in registers. A dot product is
// the lanes' partial sums reduced with three xor shuffles. A block holds TILE rows
// (THREADS / ROW_LANES), and key/value (or query/dout) tiles of TILE rows are staged in
// shared memory as f32.
//
// The backward is deterministic without atomics: one kernel writes dK and dV, one block per
// (key tile, kv head), looping over the group's query heads and the query tiles at or after
// the key tile; another writes dQ, one block per (query tile, query head).
//
// With packed documents (`docs`, common.cuh's Documents) a query sees only the keys of its own
// document, and the loops skip the tiles that no row of the block sees: the key tiles before
// the document of the block's first query, the query tiles after that of its last key.
#include "common.cuh"

// TILE (rows per block) and THREADS (per block) come from the host (attention.rs); a row's
// group of ROW_LANES lanes is fixed by the three shuffles of `group_sum`.
constexpr int ROW_LANES = 8;
static_assert(THREADS == TILE * ROW_LANES, "a block holds TILE rows of ROW_LANES lanes");

// Sum over the ROW_LANES lanes of a row group; every lane of the warp must call it.
__device__ __forceinline__ float group_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    x += __shfl_xor_sync(0xffffffffu, x, 4);
    return x;
}

// p = exp(x·xs·scale − lse) and ds = p · (y·ys − delta) · scale for one (query, key) pair,
// from this lane's dimensions of x, y (registers) and xs, ys (a shared tile row); p is 0
// where the pair is masked. In dK/dV, x = k, xs = q, y = v, ys = dout; in dQ, x = q, xs = k,
// y = dout, ys = v.
template <int DPT>
__device__ __forceinline__ void probs(const float (&x)[DPT], const float* xs, const float (&y)[DPT],
                                      const float* ys, int t, bool live, float lse, float delta,
                                      float scale, float& p, float& ds) {
    float s_part = 0.0f, dp_part = 0.0f;
#pragma unroll
    for (int i = 0; i < DPT; i++) {
        s_part += x[i] * xs[t + ROW_LANES * i];
        dp_part += y[i] * ys[t + ROW_LANES * i];
    }
    const float s = group_sum(s_part), dp = group_sum(dp_part);
    p = live ? expf(s * scale - lse) : 0.0f;
    ds = p * (dp - delta) * scale;
}

// Loads rows [first, first + TILE) of one head (column offset `col`) of a [B·T, stride]
// tensor into `tile` as f32; rows past T are zero.
template <typename T, int D>
__device__ __forceinline__ void load_tile(float (*tile)[D], const T* src, int b, int first, int Tn,
                                          long long stride, long long col) {
    for (int idx = threadIdx.x; idx < TILE * D; idx += blockDim.x) {
        const int j = idx / D, c = idx % D;
        const int row = first + j;
        tile[j][c] = row < Tn ? to_f32(src[((long long)b * Tn + row) * stride + col + c]) : 0.0f;
    }
}

// A thread of the query-tile kernels (forward and dQ; grid (ceil(T / TILE), Hq, B), THREADS
// threads): its tile, query head h and that head's KV head, lane t of its row's group, its
// query row qi (a real one when `valid`), and `stride`, the elements of a qkv row.
struct QueryLane {
    int q_tile, h, b, kvh, t, qi;
    bool valid;
    long long stride;
};

template <int D>
__device__ __forceinline__ QueryLane query_lane(int Tn, int Hq, int Hkv) {
    const int q_tile = blockIdx.x, h = blockIdx.y, qi = q_tile * TILE + threadIdx.x / ROW_LANES;
    return {q_tile, h, (int)blockIdx.z, h / (Hq / Hkv), (int)(threadIdx.x % ROW_LANES), qi,
            qi < Tn, (long long)(Hq + 2 * Hkv) * D};
}

// Grid: (ceil(T / TILE), Hq, B); block THREADS. With `amax`, also reports max |out| as stored.
template <typename T, int D>
__global__ void __launch_bounds__(THREADS)
    attention_forward(T* out, float* lse, const T* qkv, int Tn, int Hq, int Hkv, float scale,
                      float* amax, const int* doc_bounds) {
    constexpr int DPT = D / ROW_LANES;
    __shared__ float ks[TILE][D];
    __shared__ float vs[TILE][D];
    const auto [q_tile, h, b, kvh, t, qi, valid, stride] = query_lane<D>(Tn, Hq, Hkv);

    float q[DPT], o[DPT];
#pragma unroll
    for (int i = 0; i < DPT; i++) {
        q[i] = valid ? to_f32(qkv[((long long)b * Tn + qi) * stride + (long long)h * D + t + ROW_LANES * i])
                     : 0.0f;
        o[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    const Documents docs = documents(doc_bounds, b, gridDim.z, Tn);
    const int row_start = valid ? docs.start(qi) : 0;
    const int k_end = min(Tn, (q_tile + 1) * TILE);  // causal: no key after the tile's last query
    for (int k0 = docs.start(q_tile * TILE) / TILE * TILE; k0 < k_end; k0 += TILE) {
        __syncthreads();  // the previous tile is no longer read
        load_tile<T, D>(ks, qkv, b, k0, Tn, stride, (long long)(Hq + kvh) * D);
        load_tile<T, D>(vs, qkv, b, k0, Tn, stride, (long long)(Hq + Hkv + kvh) * D);
        __syncthreads();
        float s[TILE];
        float tile_max = NEG_INF;
#pragma unroll
        for (int j = 0; j < TILE; j++) {
            float part = 0.0f;
#pragma unroll
            for (int i = 0; i < DPT; i++) part += q[i] * ks[j][t + ROW_LANES * i];
            const float dot = group_sum(part);
            const int kj = k0 + j;
            s[j] = (valid && kj <= qi && kj >= row_start) ? dot * scale : NEG_INF;
            tile_max = fmaxf(tile_max, s[j]);
        }
        const float m_new = fmaxf(m, tile_max);
        // While a row has seen no key, m_new is -inf; use 0 so that every exp below is 0.
        const float m_use = m_new == NEG_INF ? 0.0f : m_new;
        const float correction = expf(m - m_use);
        l *= correction;
#pragma unroll
        for (int i = 0; i < DPT; i++) o[i] *= correction;
#pragma unroll
        for (int j = 0; j < TILE; j++) {
            const float p = expf(s[j] - m_use);
            l += p;
#pragma unroll
            for (int i = 0; i < DPT; i++) o[i] += p * vs[j][t + ROW_LANES * i];
        }
        m = m_new;
    }
    float largest = 0.0f;
    if (valid) {
        const float inv_l = 1.0f / l;
#pragma unroll
        for (int i = 0; i < DPT; i++) {
            const T y = from_f32<T>(o[i] * inv_l);
            out[((long long)b * Tn + qi) * Hq * D + (long long)h * D + t + ROW_LANES * i] = y;
            largest = fmaxf(largest, fabsf(to_f32(y)));
        }
        if (t == 0) lse[((long long)b * Hq + h) * Tn + qi] = m + logf(l);
    }
    report_amax(amax, largest);
}

// An online softmax's state over some keys: `D` output sums, then the running max and sum
// of exponentials, as attention_decode's row groups and blocks leave them.
template <int D>
struct DecodeState {
    float o[D], m, l;
};

// Merges `n` states into one (the max, the sum rescaled to it) and returns output column c,
// normalized when `normalize`. A state that saw no key (m = -inf, l and o 0) weighs 0; at
// least one saw a key, so the max is finite.
template <int D>
__device__ __forceinline__ float merge_states(const DecodeState<D>* states, int n, int c,
                                              bool normalize, float& m_all, float& l_all) {
    m_all = NEG_INF;
    for (int k = 0; k < n; k++) m_all = fmaxf(m_all, states[k].m);
    float acc = 0.0f;
    l_all = 0.0f;
    for (int k = 0; k < n; k++) {
        const float w = expf(states[k].m - m_all);
        l_all += states[k].l * w;
        acc += states[k].o[c] * w;
    }
    return normalize ? acc / l_all : acc;
}

// Generation's attention over a KV cache of `capacity` positions: the query of position *at
// (read when the kernel runs, clamped into the cache) against every key and value up to it,
// which is attention_forward's row at for one sequence. The gridDim.y blocks of head h share
// those keys in even runs, so that even a short context spreads over many SMs (a row group
// walks its keys one after another, each a dependent round of loads: the fewer each takes,
// the sooner the block is done); within a block each row group of ROW_LANES lanes takes every
// GROUPS-th key of the run with a state of its own, read straight from global memory (one
// query needs no shared tiles), and then the groups' states are merged. With one block per
// head the result goes to out; otherwise each block's state goes to partial [Hq, splits] for
// attention_decode_combine, an empty one from a block whose run is empty. Grid: (Hq, splits);
// block THREADS.
template <typename T, int D>
__global__ void __launch_bounds__(THREADS)
    attention_decode(T* out, DecodeState<D>* partial, const T* qkv, int capacity, const int* at,
                     int Hq, int Hkv, float scale) {
    constexpr int DPT = D / ROW_LANES, GROUPS = THREADS / ROW_LANES;
    __shared__ DecodeState<D> groups[GROUPS];
    const int Tn = min(max(*at, 0), capacity - 1) + 1;  // the positions attended
    const int h = blockIdx.x, kvh = h / (Hq / Hkv);
    const int g = threadIdx.x / ROW_LANES, t = threadIdx.x % ROW_LANES;
    const int run = (Tn + gridDim.y - 1) / gridDim.y;
    const int first = blockIdx.y * run, end = min(Tn, first + run);
    if (first >= end) {  // no keys: a state that weighs nothing in the merge
        DecodeState<D>* state = partial + (long long)h * gridDim.y + blockIdx.y;
        for (int c = threadIdx.x; c < D; c += blockDim.x) state->o[c] = 0.0f;
        if (threadIdx.x == 0) {
            state->m = NEG_INF;
            state->l = 0.0f;
        }
        return;
    }
    const long long stride = (long long)(Hq + 2 * Hkv) * D;
    const T* q_row = qkv + (Tn - 1) * stride + (long long)h * D;
    float q[DPT], o[DPT];
#pragma unroll
    for (int i = 0; i < DPT; i++) {
        q[i] = to_f32(q_row[t + ROW_LANES * i]);
        o[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    // Every group of a warp makes the same number of rounds: group_sum needs all its lanes.
    for (int j0 = first; j0 < end; j0 += GROUPS) {
        const int j = j0 + g;
        const bool live = j < end;
        const T* k_row = qkv + (live ? j : 0) * stride + (long long)(Hq + kvh) * D;
        const T* v_row = k_row + (long long)Hkv * D;
        float part = 0.0f;
#pragma unroll
        for (int i = 0; i < DPT; i++) part += live ? q[i] * to_f32(k_row[t + ROW_LANES * i]) : 0.0f;
        const float s = group_sum(part) * scale;
        if (live) {
            // The first key: m is -inf, so the old sum and output are scaled by 0.
            const float m_new = fmaxf(m, s);
            const float correction = expf(m - m_new), p = expf(s - m_new);
            l = l * correction + p;
#pragma unroll
            for (int i = 0; i < DPT; i++) o[i] = o[i] * correction + p * to_f32(v_row[t + ROW_LANES * i]);
            m = m_new;
        }
    }
    if (t == 0) {
        groups[g].m = m;
        groups[g].l = l;
    }
#pragma unroll
    for (int i = 0; i < DPT; i++) groups[g].o[t + ROW_LANES * i] = o[i];
    __syncthreads();
    // Group 0 has seen the block's first key.
    const bool alone = gridDim.y == 1;
    DecodeState<D>* state = partial + (long long)h * gridDim.y + blockIdx.y;
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float m_all, l_all;
        const float y = merge_states(groups, GROUPS, c, alone, m_all, l_all);
        if (alone) {
            out[(long long)h * D + c] = from_f32<T>(y);
        } else {
            state->o[c] = y;
            if (c == 0) {
                state->m = m_all;
                state->l = l_all;
            }
        }
    }
}

// Merges attention_decode's per-block states of head h into its output. Grid: Hq; block D.
template <typename T, int D>
__global__ void attention_decode_combine(T* out, const DecodeState<D>* partial, int splits) {
    const int h = blockIdx.x, c = threadIdx.x;
    float m_all, l_all;
    const float y = merge_states(partial + (long long)h * splits, splits, c, true, m_all, l_all);
    out[(long long)h * D + c] = from_f32<T>(y);
}

// delta[b, h, t] = Σ_d dout · out. A head of D values is U accesses (16 bytes each with VEC,
// both operands then 16-byte aligned; one element each without), shared by L lanes, the
// largest power of two dividing U up to 32 (the host's `delta_lanes`): lane i of a head takes
// accesses i, i + L, ..., so that where L = U (D = 64 and 128 in bf16) each load instruction
// of a warp reads 512 contiguous bytes of each operand; then the head's lanes add their sums
// by shuffles. Grid: ceil(B·T·Hq·L / blockDim).
template <typename T, int D, bool VEC>
__global__ void attention_backward_delta(float* delta, const T* dout, const T* out, int B, int Tn,
                                         int Hq) {
    constexpr int W = access_width<T, VEC>(), U = D / W;
    constexpr int L = (U & -U) < 32 ? (U & -U) : 32;
    const long long task = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / L;
    const int lane = threadIdx.x % L;
    // No early return: the shuffles below need every lane.
    const bool live = task < (long long)B * Tn * Hq;
    float acc = 0.0f;
    if (live) {
        const long long at = task * D;  // rows are Hq heads of D, so task = (b·T + t)·Hq + h
#pragma unroll
        for (int i = 0; i < U / L; i++) {
            const int c = (lane + i * L) * W;
            float g[W], o[W];
            load_vec<T, W>(g, dout + at + c);
            load_vec<T, W>(o, out + at + c);
#pragma unroll
            for (int k = 0; k < W; k++) acc += g[k] * o[k];
        }
    }
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (live && lane == 0) {
        const int h = (int)(task % Hq);
        const long long bt = task / Hq, b = bt / Tn, t = bt % Tn;
        delta[(b * Hq + h) * Tn + t] = acc;
    }
}

// lses[i] and deltas[i] = lse[base + first + i] and delta[...] (0 past T), for i < n, by the
// first n threads: the per-row statistics of one tile of attention rows.
__device__ __forceinline__ void load_row_stats(float* lses, float* deltas, const float* lse,
                                               const float* delta, long long base, int first,
                                               int n, int Tn) {
    if (threadIdx.x < n) {
        const int t = first + threadIdx.x;
        lses[threadIdx.x] = t < Tn ? lse[base + t] : 0.0f;
        deltas[threadIdx.x] = t < Tn ? delta[base + t] : 0.0f;
    }
}

// dK and dV of TILE keys of one kv head: Σ over the group's query heads and the queries at or
// after each key of dv += p · dout, dk += ds · q with p = exp(q·k·scale − lse) and
// ds = p · (dout·v − delta) · scale. Grid: (ceil(T / TILE), Hkv, B); block THREADS.
template <typename T, int D>
__global__ void __launch_bounds__(THREADS)
    attention_backward_dkdv(T* dqkv, const T* dout, const T* qkv, const float* lse,
                            const float* delta, int Tn, int Hq, int Hkv, float scale,
                            const int* doc_bounds) {
    constexpr int DPT = D / ROW_LANES;
    __shared__ float qs[TILE][D];
    __shared__ float dos[TILE][D];
    __shared__ float lses[TILE];
    __shared__ float deltas[TILE];
    const int k_tile = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int group = Hq / Hkv;
    const long long stride = (long long)(Hq + 2 * Hkv) * D;
    const int r = threadIdx.x / ROW_LANES, t = threadIdx.x % ROW_LANES;
    const int kj = k_tile * TILE + r;
    const bool valid = kj < Tn;
    const long long k_at = ((long long)b * Tn + kj) * stride + (long long)(Hq + kvh) * D;
    const long long v_at = ((long long)b * Tn + kj) * stride + (long long)(Hq + Hkv + kvh) * D;

    float k[DPT], v[DPT], dk[DPT], dv[DPT];
#pragma unroll
    for (int i = 0; i < DPT; i++) {
        k[i] = valid ? to_f32(qkv[k_at + t + ROW_LANES * i]) : 0.0f;
        v[i] = valid ? to_f32(qkv[v_at + t + ROW_LANES * i]) : 0.0f;
        dk[i] = 0.0f;
        dv[i] = 0.0f;
    }
    const Documents docs = documents(doc_bounds, b, gridDim.z, Tn);
    const int key_end = valid ? docs.end(kj) : 0;  // the queries that see this key end there
    const int q_end = docs.end(min(Tn, (k_tile + 1) * TILE) - 1);
    for (int g = 0; g < group; g++) {
        const int h = kvh * group + g;
        for (int q0 = k_tile * TILE; q0 < q_end; q0 += TILE) {
            __syncthreads();
            load_tile<T, D>(qs, qkv, b, q0, Tn, stride, (long long)h * D);
            load_tile<T, D>(dos, dout, b, q0, Tn, (long long)Hq * D, (long long)h * D);
            load_row_stats(lses, deltas, lse, delta, ((long long)b * Hq + h) * Tn, q0, TILE, Tn);
            __syncthreads();
            for (int j = 0; j < TILE; j++) {
                const int qi = q0 + j;
                float p, ds;
                probs<DPT>(k, qs[j], v, dos[j], t, qi < key_end && qi >= kj, lses[j], deltas[j], scale,
                           p, ds);
#pragma unroll
                for (int i = 0; i < DPT; i++) {
                    dv[i] += p * dos[j][t + ROW_LANES * i];
                    dk[i] += ds * qs[j][t + ROW_LANES * i];
                }
            }
        }
    }
    if (valid) {
#pragma unroll
        for (int i = 0; i < DPT; i++) {
            dqkv[k_at + t + ROW_LANES * i] = from_f32<T>(dk[i]);
            dqkv[v_at + t + ROW_LANES * i] = from_f32<T>(dv[i]);
        }
    }
}

// dQ of TILE queries of one head: Σ over keys at or before each query of ds · k.
// Grid: (ceil(T / TILE), Hq, B); block THREADS.
template <typename T, int D>
__global__ void __launch_bounds__(THREADS)
    attention_backward_dq(T* dqkv, const T* dout, const T* qkv, const float* lse,
                          const float* delta, int Tn, int Hq, int Hkv, float scale,
                          const int* doc_bounds) {
    constexpr int DPT = D / ROW_LANES;
    __shared__ float ks[TILE][D];
    __shared__ float vs[TILE][D];
    const auto [q_tile, h, b, kvh, t, qi, valid, stride] = query_lane<D>(Tn, Hq, Hkv);
    const long long q_at = ((long long)b * Tn + qi) * stride + (long long)h * D;
    const long long do_at = ((long long)b * Tn + qi) * Hq * D + (long long)h * D;
    const long long stat_at = ((long long)b * Hq + h) * Tn + qi;

    float q[DPT], dO[DPT], dq[DPT];
#pragma unroll
    for (int i = 0; i < DPT; i++) {
        q[i] = valid ? to_f32(qkv[q_at + t + ROW_LANES * i]) : 0.0f;
        dO[i] = valid ? to_f32(dout[do_at + t + ROW_LANES * i]) : 0.0f;
        dq[i] = 0.0f;
    }
    const float row_lse = valid ? lse[stat_at] : 0.0f;
    const float row_delta = valid ? delta[stat_at] : 0.0f;
    const Documents docs = documents(doc_bounds, b, gridDim.z, Tn);
    const int row_start = valid ? docs.start(qi) : 0;
    const int k_end = min(Tn, (q_tile + 1) * TILE);
    for (int k0 = docs.start(q_tile * TILE) / TILE * TILE; k0 < k_end; k0 += TILE) {
        __syncthreads();
        load_tile<T, D>(ks, qkv, b, k0, Tn, stride, (long long)(Hq + kvh) * D);
        load_tile<T, D>(vs, qkv, b, k0, Tn, stride, (long long)(Hq + Hkv + kvh) * D);
        __syncthreads();
        for (int j = 0; j < TILE; j++) {
            const int kj = k0 + j;
            float p, ds;
            probs<DPT>(q, ks[j], dO, vs[j], t, valid && kj <= qi && kj >= row_start, row_lse, row_delta,
                       scale, p, ds);
#pragma unroll
            for (int i = 0; i < DPT; i++) dq[i] += ds * ks[j][t + ROW_LANES * i];
        }
    }
    if (valid) {
#pragma unroll
        for (int i = 0; i < DPT; i++) dqkv[q_at + t + ROW_LANES * i] = from_f32<T>(dq[i]);
    }
}
