// One launch for a whole one-token forward of a pre-norm GQA decoder (batch 1, bfloat16 weights):
// every layer's norm, q/k/v + bias + RoPE + paged cache write, attention, o + residual, norm, gate/up +
// SiLU·up, down + residual, then the final norm and the LM head. redwood/kernels/megakernel.py compiles it
// with NVRTC (shape constants prepended as #defines) and launches one block per SM.
//
// Why one launch: at batch 1 the per-kernel fixed costs (launch, ramp-up, drain, ~1 µs gaps in a graph)
// and the latency-bound small stages (q/k/v, attention, o) idle the HBM for ~40% of a step. Here each
// block runs two roles at once:
//   - a producer thread streams the block's share of EVERY weight tile of the forward, in the order the
//     block will use them, into a ring of shared-memory slots with bulk copies (cp.async.bulk, the TMA
//     engine's 1-D form), waiting only for a free slot: weights never depend on activations, so the
//     stream runs ahead across stage and layer boundaries while the dependent stages wait;
//   - eight consumer warps run the stages in order; between stages the blocks synchronize through
//     device-side counters (each block adds 1 when its share of a stage is written; a stage starts once
//     its predecessor's counter reaches the block count) instead of kernel boundaries.
//
// Stages of layer l (counter 6·l + s): 0 q/k/v, 1 attention (partials per KV head and key split; the
// last split of a KV head to finish merges its heads), 3 o + residual, 4 gate/up + SiLU·up, 5 down +
// residual (2 is unused); then the LM head. A weight stage's tasks are tiles of 8 weight rows (RD rows for down) assigned round robin to the
// blocks; inside a block warp w computes row w (or a K part of a down row) of each tile from shared
// memory against the activation held in registers.
//
// Rounding follows redwood.kernels.gemv / qkv_rope / fused (the skinny path): float32 sums; the folded
// RMSNorm as s · Σ x_k g_k W_nk; each projection's output rounded to bf16; RoPE, residual adds and
// SiLU·up rounded as eager PyTorch rounds them; the logits rounded to bf16 then widened.
//
// Constants (#define, from the host): H hidden, NI intermediate, HQ / HKV heads, D head dim (128),
// V vocab, NL layers, PS page size, EPS, NB blocks, NSLOT ring slots, SLOT slot bytes, RD down rows per
// tile, SMAX key splits per KV head at most, HAS_QKV_BIAS.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define G (HQ / HKV)
#define DL (D / 32)  // head dims per lane in attention
#if SMAX > 32
#error "merge_heads takes at most 32 splits"
#endif
#define NEG_INF __int_as_float(0xff800000)
#define NCTR (6 * NL + 1)
#define CONSUMERS 256

// Table of device pointers (int64), filled by the host once per (model, cache, buffers).
#define T_EMBED 0
#define T_NORM 1
#define T_HEAD 2
#define T_INV_FREQ 3
#define T_LEN 6
#define T_LIVE 7
#define T_BT 8
#define T_H 10
#define T_Q 11
#define T_PM 12
#define T_PL 13
#define T_PACC 14
#define T_ATTN 15
#define T_ACT 16
#define T_CTR 17
#define T_ERR 18
#define T_HEAD_S 4  // with W8: the head's float32 row scales
#define T_PROF 19  // with PROFILE: [NCTR][NB][2] globaltimer ns at each stage's start (after its wait) and end
#define T_LAYER0 32
#define T_PER_LAYER 16
#define L_QKV 0
#define L_QKV_B 1
#define L_O 2
#define L_GU 3
#define L_DOWN 4
#define L_IN_NORM 5
#define L_POST_NORM 6
#define L_K 7
#define L_V 8
#define L_QKV_S 9  // with W8: float32 row scales of q/k/v, o, gate/up, down
#define L_O_S 10
#define L_GU_S 11
#define L_DOWN_S 12

// W8: the projections and the head as int8 with a float32 scale per row (redwood.kernels.gemv.quantize_int8, a
// draft model's quantize_skinny copies): tiles of EB = 1 byte an element, each row's sum times its scale.
#ifndef W8
#define W8 0
#endif
#define EB (W8 ? 1 : 2)

// ------------------------------------------------------------------------------------------------
// numerics

__device__ __forceinline__ float bf2f(u32 b) { return __uint_as_float(b << 16); }

__device__ __forceinline__ u32 f2bf(float f) {  // round to nearest even (as torch's .to(bfloat16))
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;  // NaN stays NaN
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ float rbf(float f) { return bf2f(f2bf(f)); }

// 8 packed int8 (8 bytes) → float32, in order (exact).
__device__ __forceinline__ void widen8_i8(uint2 v, float (&f)[8]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        f[e] = (float)(int)(signed char)(v.x >> (8 * e));
        f[4 + e] = (float)(int)(signed char)(v.y >> (8 * e));
    }
}

// 8 packed bf16 (16 bytes) → float32, in order.
__device__ __forceinline__ void widen8(uint4 v, float (&f)[8]) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        f[2 * e] = bf2f(w[e] & 0xffffu);
        f[2 * e + 1] = bf2f(w[e] >> 16);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ------------------------------------------------------------------------------------------------
// memory. Data other blocks wrote in this launch is read with ordinary loads after wait_stage: thread 0's
// acquire load of the counter and the block barrier order them as CUTLASS's grid barrier does; ordinary
// loads (not volatile asm) let the compiler keep many in flight.

__device__ __forceinline__ u32 ld_u16(const void* p) { return *(const u16*)p; }
__device__ __forceinline__ uint4 ld_v4(const void* p) { return *(const uint4*)p; }

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bar_consumers() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// A wait that outlives 2 s marks the launch failed (err[0] = 1 + where) and returns, so a bug shows as an
// error flag the host reads rather than a hung GPU. Every wait returns at once after that.
#define TIMEOUT_NS 2000000000ull

__device__ __forceinline__ bool failed(const u32* err) {
    return *(volatile const u32*)err != 0;
}

__device__ void fail(u32* err, u32 where) { atomicCAS(err, 0u, 1u + where); }

__device__ void mbar_wait(u32 bar, u32 parity, u32* err, u32 where) {
    u64 start = 0;
    for (int spin = 0;; ++spin) {
        u32 ok;
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.b32 %0, 1, 0, p;\n}"
            : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
        if (ok) return;
        if ((spin & 255) == 255) {
            if (failed(err)) return;
            u64 t = now_ns();
            if (start == 0) start = t;
            else if (t - start > TIMEOUT_NS) { fail(err, where); return; }
        }
    }
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    u64 state;
    asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];" : "=l"(state) : "r"(bar) : "memory");
}

#ifndef PROFILE
#define PROFILE 0
#endif
// Design switches (REDWOOD_MEGAKERNEL_DEFINES overrides them for experiments; ATTN_NO_MERGE gives wrong outputs
// and is for timing only).
#ifndef ATTN_NO_MERGE
#define ATTN_NO_MERGE 0  // skip the merge of the splits
#endif
#ifndef EARLY_OPERANDS
#define EARLY_OPERANDS 1  // a weight stage loads its norm weights and its epilogues' biases / residual rows before its wait
#endif
#ifndef ATTN_FOLD
#define ATTN_FOLD 32  // up to this many key splits a KV head, the o stage merges them while loading its input
#endif
#ifndef ROW_ACC
#define ROW_ACC 1  // a weight row's dot product as this many interleaved FMA chains a lane (1, 2, 4, 8)
#endif
#ifndef ATTN_FOLD_V2
#define ATTN_FOLD_V2 0  // the fold's loads all issued first (needs ATTN_FOLD <= 8)
#endif
#if ATTN_FOLD_V2 && ATTN_FOLD > 8
#error "ATTN_FOLD_V2 holds ATTN_FOLD splits' partials in registers: ATTN_FOLD <= 8"
#endif
#if ATTN_FOLD && HKV > 16  // the merged input (HQ · D bf16) lives in the attention accumulators' shared memory
#undef ATTN_FOLD
#define ATTN_FOLD 0
#endif
#ifndef KV_RING
#define KV_RING 1  // the context's K/V chunks reach attention through the producer's ring (bulk copies) like weights
#endif
#if KV_RING && 128 * D > SLOT
#error "KV_RING: a chunk's K and V rows (32 keys each) must fit one ring slot"
#endif
#ifndef ATTN_CPB
#define ATTN_CPB 8  // chunks of 32 keys a block takes (one a warp) before a KV head's keys split over more blocks
#endif
#define PS_G 8  // probability rows of 8 heads (the tensor-core N)
__device__ long long* g_prof;  // set at kernel start with PROFILE

// PROFILE: per stage and block, [0] start (after the wait), [1] end, [2] ns the consumers (warp 0) waited for full
// slots, [3] ns the producer waited for free slots while streaming that stage's tiles.
#define PROF_SLOTS 4

__device__ __forceinline__ void stamp(int stage, int which) {
    if (PROFILE && threadIdx.x == 0 && stage >= 0)
        g_prof[((u64)stage * NB + blockIdx.x) * PROF_SLOTS + which] = (long long)now_ns();
}

__device__ __forceinline__ void prof_add(int stage, int which, u64 since) {
    if (PROFILE && stage >= 0) g_prof[((u64)stage * NB + blockIdx.x) * PROF_SLOTS + which] += (long long)(now_ns() - since);
}

// A slot wait, timed into prof[stage][which] when profiling (by thread 0 or the producer: one writer a cell).
__device__ __forceinline__ void mbar_wait_timed(u32 bar, u32 parity, u32* err, u32 where, int stage, int which) {
    if (PROFILE && (threadIdx.x == 0 || threadIdx.x == CONSUMERS)) {
        const u64 t0 = now_ns();
        mbar_wait(bar, parity, err, where);
        prof_add(stage, which, t0);
    } else {
        mbar_wait(bar, parity, err, where);
    }
}

// Block-level dependency: thread 0 waits until counter `c` reached NB, then all consumers go on.
__device__ __forceinline__ void wait_stage(u32* ctr, int c, int stage, u32* err) {
    if (threadIdx.x == 0 && c >= 0) {
        u64 start = 0;
        for (int spin = 0;; ++spin) {
            u32 v;
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ctr + c) : "memory");
            if (v >= NB) break;
            if ((spin & 63) == 63) {
                if (failed(err)) break;
                u64 t = now_ns();
                if (start == 0) start = t;
                else if (t - start > TIMEOUT_NS) { fail(err, 1000 + c); break; }
            }
        }
    }
    bar_consumers();
    stamp(stage, 0);
}

// This block's share of stage `c` is written: publish it.
__device__ __forceinline__ void arrive_stage(u32* ctr, int c) {
    bar_consumers();
    stamp(c, 1);
    if (threadIdx.x == 0)  // release: the block's writes (ordered before it by the barrier) first
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(ctr + c) : "memory");
}

// ------------------------------------------------------------------------------------------------
// weight stages: which tiles, in which order (the producer and the consumers walk the same sequence)

#define K_QKV 0
#define K_O 1
#define K_GU 2
#define K_DOWN 3
#define K_HEAD 4

__host__ __device__ constexpr int num_tasks(int kind) {
    switch (kind) {
        case K_QKV: return (HQ + 2 * HKV) * (D / 8);  // 4 rotation pairs (rows j, j + D/2) per tile
        case K_O: return H / 8;
        case K_GU: return NI / 4;  // 4 gate rows and the same 4 up rows per tile
        case K_DOWN: return H / RD;
        default: return V / 8;
    }
}

// Stage kinds in walking order and each one's rotation (tiles of stage i start at block (i · 7) % NB so
// the blocks that get an extra tile change from stage to stage).
__device__ __forceinline__ int first_task(int seq) {
    int rot = (seq * 7) % NB;
    return (blockIdx.x + NB - rot) % NB;
}

struct Tile {
    const char* a;  // first segment
    const char* b;  // second segment (or null)
    u32 bytes_a, bytes_b;
};

__device__ __forceinline__ const char* layer_ptr(const long long* tab, int layer, int which) {
    return (const char*)tab[T_LAYER0 + layer * T_PER_LAYER + which];
}

__device__ __forceinline__ Tile tile_of(const long long* tab, int kind, int layer, int t) {
    Tile s;
    s.b = 0;
    s.bytes_b = 0;
    if (kind == K_QKV) {
        const char* w = layer_ptr(tab, layer, L_QKV);
        int row = (t / (D / 8)) * D + (t % (D / 8)) * 4;
        s.a = w + (u64)row * H * EB;
        s.b = w + (u64)(row + D / 2) * H * EB;
        s.bytes_a = s.bytes_b = 4 * H * EB;
    } else if (kind == K_O) {
        s.a = layer_ptr(tab, layer, L_O) + (u64)t * 8 * (HQ * D) * EB;
        s.bytes_a = 8 * (HQ * D) * EB;
    } else if (kind == K_GU) {
        const char* w = layer_ptr(tab, layer, L_GU);
        s.a = w + (u64)t * 4 * H * EB;
        s.b = w + (u64)(NI + t * 4) * H * EB;
        s.bytes_a = s.bytes_b = 4 * H * EB;
    } else if (kind == K_DOWN) {
        s.a = layer_ptr(tab, layer, L_DOWN) + (u64)t * RD * NI * EB;
        s.bytes_a = RD * NI * EB;
    } else {
        s.a = (const char*)tab[T_HEAD] + (u64)t * 8 * H * EB;
        s.bytes_a = 8 * H * EB;
    }
    return s;
}

struct Shared {
    char* ring;
    u64* full;
    u64* empty;
    float* red;   // [NSLOT][8] a tile's partial sums, one per consumer warp
    u32* cnt;     // [NSLOT] warps done with the tile in that slot
    float* acc;   // [8][G][D] each warp's attention accumulators
    float* ps;    // [8][32][G] probabilities of a warp's 32 keys
    float* cos;   // [D/2] this token's rotary cos / sin, rounded to bf16 as RotaryEmbedding's
    float* sin;
    u32* word;    // a broadcast word
};

struct Step {  // per-launch values, read once
    long long pos, page, off, lo, hi;  // rope position; the new K/V's page / offset; keys [lo, hi)
    const char* embed_row;             // the input token's embedding (layer 0's residual stream)
    float* logits;                     // [V] output
};

// Block splits per KV head: a block takes ATTN_CPB chunks of 32 keys (one a warp) where the split count allows;
// past SMAX splits (or the blocks there are) a warp walks several.
__device__ __forceinline__ int num_splits(const Step& st) {
    int chunks = (int)((st.hi - st.lo + 31) / 32);
    int n = (chunks + ATTN_CPB - 1) / ATTN_CPB;
    if (n > SMAX) n = SMAX;
    if (n > NB / HKV) n = NB / HKV;
    return n < 1 ? 1 : n;
}

// The producer's walk over this block's tiles in consumption order: layer, stage kind k (q/k/v, o, gate/up,
// down; the head after the last layer), task t.
struct Cursor {
    int layer, k, t;
    __device__ __forceinline__ bool done() const { return layer > NL; }
    __device__ __forceinline__ int kind() const { return layer == NL ? K_HEAD : k; }
    __device__ __forceinline__ int counter() const {  // the stage's counter (its PROFILE row)
        return layer == NL ? NCTR - 1 : 6 * layer + (k == 0 ? 0 : k + 2);
    }
    __device__ void settle() {  // on to the first task at or after (layer, k, t) this block owns
        while (layer <= NL && t >= num_tasks(kind())) {
            if (layer == NL || ++k == 4) {
                ++layer;
                k = 0;
            }
            t = first_task(layer * 4 + k);
        }
    }
    __device__ __forceinline__ void next() {
        t += NB;
        settle();
    }
};

__device__ __forceinline__ Cursor first_tile() {
    Cursor c{0, 0, first_task(0)};
    c.settle();
    return c;
}

#if KV_RING
// This block's attention chunks (attention_stage's item: at most one a block), as the producer streams them.
#define KVR_PAGES 16  // page ids held from the launch's start; chunks past them read the block table per copy
struct KvChunks {
    int n, kvh;           // chunks, KV head
    long long k0, hi;     // the first chunk's first key; keys end at hi
    long long p0;         // page of key k0
    int pg[KVR_PAGES];    // page ids of pages p0, p0 + 1, …
};

__device__ KvChunks kv_chunks(const long long* tab, const Step& st) {
    KvChunks kc;
    kc.n = 0;
    kc.kvh = 0;
    kc.k0 = kc.hi = kc.p0 = 0;
    const int S = num_splits(st);
    if ((int)blockIdx.x < HKV * S) {
        const int chunks = (int)((st.hi - st.lo + 31) / 32);
        const int split = blockIdx.x % S;
        const int c0 = (int)((long long)split * chunks / S), c1 = (int)((long long)(split + 1) * chunks / S);
        kc.n = c1 - c0;
        kc.kvh = blockIdx.x / S;
        kc.k0 = st.lo + 32LL * c0;
        kc.hi = st.hi;
        kc.p0 = kc.k0 / PS;
        const int* bt = (const int*)tab[T_BT];
        const long long end = kc.k0 + 32LL * kc.n < kc.hi ? kc.k0 + 32LL * kc.n : kc.hi;  // the block's keys [k0, end)
        const long long pages = kc.n > 0 ? (end - 1) / PS - kc.p0 + 1 : 0;
#pragma unroll
        for (int i = 0; i < KVR_PAGES; ++i) kc.pg[i] = i < pages ? bt[kc.p0 + i] : 0;
    }
    return kc;
}

// Chunk j's K rows into the slot's first 32 · D elements and its V rows after them (keys past hi not copied:
// attention reads row 0 for them, with probability 0), one bulk copy per page run.
__device__ void issue_kv(const long long* tab, const KvChunks& kc, int layer, int j, u32 dst, u32 full) {
    const long long a = kc.k0 + 32LL * j, b = a + 32 < kc.hi ? a + 32 : kc.hi;
    u64 state;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;"
                 : "=l"(state) : "r"(full), "r"((u32)(b - a) * D * 4) : "memory");
    const char* kbase = layer_ptr(tab, layer, L_K);
    const char* vbase = layer_ptr(tab, layer, L_V);
    for (long long key = a; key < b;) {
        const long long page = key / PS, end = (page + 1) * PS < b ? (page + 1) * PS : b;
        const long long pi = page - kc.p0;
        const int id = pi < KVR_PAGES ? kc.pg[pi] : ((const int*)tab[T_BT])[page];
        const u64 src = (((u64)id * HKV + kc.kvh) * PS + key % PS) * D * 2;
        const u32 off = (u32)(key - a) * D * 2, bytes = (u32)(end - key) * D * 2;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(dst + off), "l"(kbase + src), "r"(bytes), "r"(full) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(dst + 32 * D * 2 + off), "l"(vbase + src), "r"(bytes), "r"(full) : "memory");
        key = end;
    }
}
#define PRODUCE_STEP , const Step& st
#define PRODUCE_STEP_ARG , st
#else
#define PRODUCE_STEP
#define PRODUCE_STEP_ARG
#endif

// The producer (one thread): every weight tile of this block, in order, into the ring; with KV_RING also the
// block's attention chunks of each layer, between the layer's q/k/v tiles and the rest.
__device__ void produce(const long long* tab, Shared sh, u32* err PRODUCE_STEP) {
#if KV_RING
    const KvChunks kc = kv_chunks(tab, st);
    int kv_layer = -1;  // the last layer whose chunks are issued
#endif
    Cursor cp = first_tile();
    for (u32 it = 0; !cp.done(); ++it, cp.next()) {
#if KV_RING
        // a layer's chunks once the walk has passed its q/k/v tiles (all of them before the head)
        while (kv_layer + 1 < NL && (cp.layer > kv_layer + 1 || (cp.layer == kv_layer + 1 && cp.k >= 1))) {
            ++kv_layer;
            for (int j = 0; j < kc.n; ++j, ++it) {
                const u32 slot = it % NSLOT;
                mbar_wait_timed(smem_addr(sh.empty + slot), ((it / NSLOT) & 1u) ^ 1u, err, 1, 6 * kv_layer + 1, 3);
                if (failed(err)) return;
                issue_kv(tab, kc, kv_layer, j, smem_addr(sh.ring + (u64)slot * SLOT), smem_addr(sh.full + slot));
            }
        }
#endif
        u32 slot = it % NSLOT;
        u32 parity = ((it / NSLOT) & 1u) ^ 1u;
        mbar_wait_timed(smem_addr(sh.empty + slot), parity, err, 1, cp.counter(), 3);
        if (failed(err)) return;
        Tile tl = tile_of(tab, cp.kind(), cp.layer, cp.t);
        u32 full = smem_addr(sh.full + slot);
        u32 dst = smem_addr(sh.ring + (u64)slot * SLOT);
        u64 state;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;"
                     : "=l"(state) : "r"(full), "r"(tl.bytes_a + tl.bytes_b) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(dst), "l"(tl.a), "r"(tl.bytes_a), "r"(full) : "memory");
        if (tl.bytes_b)
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         :: "r"(dst + tl.bytes_a), "l"(tl.b), "r"(tl.bytes_b), "r"(full) : "memory");
    }
}

// ------------------------------------------------------------------------------------------------
// consumer side of a weight stage

#define XCHUNKS(K, WPR) (((K) / 8 / (WPR) + 31) / 32)  // 8-element chunks of x a lane holds

// The norm weights' chunks load_x multiplies in, loaded ahead (EARLY_OPERANDS): the same chunks c = lane + 32·j.
template <int K>
__device__ __forceinline__ void load_g(const char* g, uint4 (&gr)[XCHUNKS(K, 1)]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < XCHUNKS(K, 1); ++j) {
        int c = lane + 32 * j;
        gr[j] = c < K / 8 ? *(const uint4*)(g + (u64)c * 16) : make_uint4(0, 0, 0, 0);
    }
}

// The activation a lane multiplies: its chunks of 8 elements c = part·CPW + lane + 32·j (j < MJ) of x [K],
// widened to float32 (times s · g_k when NORM: the folded RMSNorm; g's chunks from gr when PRE). x: bf16.
template <int K, int WPR, bool NORM, bool PRE = false>
__device__ __forceinline__ void load_x(const char* x, const char* g, float (&xr)[(K / 8 / WPR + 31) / 32][8],
                                       const uint4 (&gr)[XCHUNKS(K, WPR)] = {}) {
    constexpr int CPW = K / 8 / WPR;
    constexpr int MJ = (CPW + 31) / 32;
    const int lane = threadIdx.x & 31, part = (threadIdx.x >> 5) % WPR;
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < MJ; ++j) {
        int c = lane + 32 * j;
        if (c < CPW) {
            widen8(ld_v4(x + (u64)(part * CPW + c) * 16), xr[j]);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) xr[j][e] = 0.f;
        }
        if (NORM) {
#pragma unroll
            for (int e = 0; e < 8; ++e) ss += xr[j][e] * xr[j][e];
        }
    }
    if (NORM) {  // WPR == 1: every warp holds the whole vector
        float s = rsqrtf(warp_sum(ss) / (float)K + EPS);
#pragma unroll
        for (int j = 0; j < MJ; ++j) {
            int c = lane + 32 * j;
            if (c < CPW) {
                float gf[8];
                widen8(PRE ? gr[j] : *(const uint4*)(g + (u64)c * 16), gf);
#pragma unroll
                for (int e = 0; e < 8; ++e) xr[j][e] *= gf[e] * s;
            }
        }
    }
}

// Σ_k x'_k W[row, k] over this warp's part of the row (the tile's row r in shared memory), warp-reduced.
template <int K, int WPR>
__device__ __forceinline__ float row_dot(const char* tile_row, const float (&xr)[(K / 8 / WPR + 31) / 32][8]) {
    constexpr int CPW = K / 8 / WPR;
    constexpr int MJ = (CPW + 31) / 32;
    const int lane = threadIdx.x & 31, part = (threadIdx.x >> 5) % WPR;
    float acc = 0.f;
#if ROW_ACC > 1
    float accs[ROW_ACC];  // independent FMA chains (ROW_ACC of them) instead of one serial chain a lane
#pragma unroll
    for (int r = 0; r < ROW_ACC; ++r) accs[r] = 0.f;
#endif
#pragma unroll
    for (int j = 0; j < MJ; ++j) {
        int c = lane + 32 * j;
        if (c < CPW) {
            float wf[8];
#if W8
            widen8_i8(*(const uint2*)(tile_row + (u64)(part * CPW + c) * 8), wf);
#else
            widen8(*(const uint4*)(tile_row + (u64)(part * CPW + c) * 16), wf);
#endif
#if ROW_ACC > 1
#pragma unroll
            for (int e = 0; e < 8; ++e) accs[e % ROW_ACC] = fmaf(xr[j][e], wf[e], accs[e % ROW_ACC]);
#else
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = fmaf(xr[j][e], wf[e], acc);
#endif
        }
    }
#if ROW_ACC > 1
#pragma unroll
    for (int r = 0; r < ROW_ACC; ++r) acc += accs[r];
#endif
    return warp_sum(acc);
}


// A finished tile's outputs from its 8 partial sums red[0..8) (warp w's row or K part), computed by lanes
// of the last warp to finish the tile.
// The tile's sums a lane of the finishing warp needs: (red[lane & 3], red[(lane & 3) + 4]) for the pair
// stages (q/k/v, gate/up), red[lane & 7] for o and the head, the K parts' sum of row lane % RD for down.
template <int KIND, int WPR>
__device__ __forceinline__ void gather(const float* red, int lane, float& a, float& b) {
    if (KIND == K_QKV || KIND == K_GU) {
        a = red[lane & 3];
        b = red[(lane & 3) + 4];
    } else if (KIND == K_DOWN) {
        a = 0.f;
#pragma unroll
        for (int p = 0; p < WPR; ++p) a += red[(lane % RD) * WPR + p];
        b = 0.f;
    } else {
        a = red[lane & 7];
        b = 0.f;
    }
}

// What a tile's epilogue reads from global memory that is final before its stage's wait (EARLY_OPERANDS): the
// q/k/v biases of its pair rows (lanes 0-3), the residual rows o and down add to (lanes 0-7 / 0-RD). The
// residual stream h is final then: this block's previous stage waited for the stage that last wrote it.
template <int KIND>
__host__ __device__ constexpr int pre_tiles() {
    return KIND == K_QKV || KIND == K_O || KIND == K_DOWN ? (num_tasks(KIND) + NB - 1) / NB : 1;
}

template <int KIND>
__device__ __forceinline__ float2 pre_operands(const long long* tab, int layer, int t, int lane, const Step& st) {
    float2 v = make_float2(0.f, 0.f);
    if (KIND == K_QKV) {
        if (HAS_QKV_BIAS && lane < 4) {
            const int head = t / (D / 8), i = (t % (D / 8)) * 4 + lane, r1 = head * D + i;
            const char* b = layer_ptr(tab, layer, L_QKV_B);
            v.x = bf2f(ld_u16(b + 2 * r1));
            v.y = bf2f(ld_u16(b + 2 * (r1 + D / 2)));
        }
    } else if (KIND == K_O) {
        if (lane < 8) v.x = bf2f(ld_u16((layer == 0 ? st.embed_row : (const char*)tab[T_H]) + 2 * (t * 8 + lane)));
    } else if (KIND == K_DOWN) {
        if (lane < RD) v.x = bf2f(ld_u16((const char*)tab[T_H] + 2 * (t * RD + lane)));
    }
    return v;
}

template <int KIND, int WPR>
__device__ __forceinline__ void epilogue(const long long* tab, Shared sh, int layer, int t, float a, float b,
                                         int lane, const Step& st, float2 pre) {
    if (KIND == K_QKV) {
        if (lane < 4) {
            int head = t / (D / 8), i = (t % (D / 8)) * 4 + lane;  // pair (i, i + D/2) of `head`
            int r1 = head * D + i, r2 = r1 + D / 2;
#if W8
            a *= ((const float*)layer_ptr(tab, layer, L_QKV_S))[r1];
            b *= ((const float*)layer_ptr(tab, layer, L_QKV_S))[r2];
#endif
            float y1 = a, y2 = b;
            if (HAS_QKV_BIAS && EARLY_OPERANDS) {
                y1 += pre.x;
                y2 += pre.y;
            } else if (HAS_QKV_BIAS) {
                const char* b = layer_ptr(tab, layer, L_QKV_B);
                y1 += bf2f(*(const u16*)(b + 2 * r1));
                y2 += bf2f(*(const u16*)(b + 2 * r2));
            }
            y1 = rbf(y1);
            y2 = rbf(y2);
            if (head < HQ + HKV) {  // rotate-half RoPE as apply_rotary rounds
                float c = sh.cos[i], s = sh.sin[i];
                float o1 = rbf(rbf(y1 * c) + rbf(-y2 * s));
                float o2 = rbf(rbf(y2 * c) + rbf(y1 * s));
                y1 = o1;
                y2 = o2;
            }
            u16* dst;
            if (head < HQ) {
                dst = (u16*)tab[T_Q] + head * D;
            } else {
                int kv = head < HQ + HKV ? head - HQ : head - HQ - HKV;
                u16* cache = (u16*)layer_ptr(tab, layer, head < HQ + HKV ? L_K : L_V);
                dst = cache + (((u64)st.page * HKV + kv) * PS + st.off) * D;
            }
            dst[i] = (u16)f2bf(y1);
            dst[i + D / 2] = (u16)f2bf(y2);
        }
    } else if (KIND == K_O) {
        if (lane < 8) {
            int r = t * 8 + lane;
#if W8
            a *= ((const float*)layer_ptr(tab, layer, L_O_S))[r];
#endif
            const char* src = layer == 0 ? st.embed_row : (const char*)tab[T_H];
            float h = EARLY_OPERANDS ? pre.x : bf2f(ld_u16(src + 2 * r));
            ((u16*)tab[T_H])[r] = (u16)f2bf(h + rbf(a));
        }
    } else if (KIND == K_GU) {
        if (lane < 4) {
#if W8
            a *= ((const float*)layer_ptr(tab, layer, L_GU_S))[t * 4 + lane];
            b *= ((const float*)layer_ptr(tab, layer, L_GU_S))[NI + t * 4 + lane];
#endif
            float gt = rbf(a), up = rbf(b);
            float sg = rbf(__fdiv_rn(gt, 1.f + expf(-gt)));
            ((u16*)tab[T_ACT])[t * 4 + lane] = (u16)f2bf(sg * up);
        }
    } else if (KIND == K_DOWN) {
        if (lane < RD) {
            float sum = a;
            int r = t * RD + lane;
#if W8
            sum *= ((const float*)layer_ptr(tab, layer, L_DOWN_S))[r];
#endif
            const char* hb = (const char*)tab[T_H];
            float h = EARLY_OPERANDS ? pre.x : bf2f(ld_u16(hb + 2 * r));
            ((u16*)tab[T_H])[r] = (u16)f2bf(h + rbf(sum));
        }
    } else {
#if W8
        if (lane < 8) a *= ((const float*)tab[T_HEAD_S])[t * 8 + lane];
#endif
        if (lane < 8) st.logits[t * 8 + lane] = rbf(a);
    }
}

#if ATTN_FOLD
// The o stage's input with 2 … ATTN_FOLD key splits a KV head: every block merges the splits' partials (M, L, the
// unnormalized output, as attention_stage left them) itself, into shared memory as bf16 — one round of L2 loads
// in place of the attention stage's cross-block count, reload and write. Returns x (shared memory) or null
// (one split: attention wrote the output).
__device__ const char* fold_attention(const long long* tab, Shared sh, const Step& st) {
    const int S = num_splits(st);
    if (S == 1 || S > ATTN_FOLD) return 0;
    const float* pm = (const float*)tab[T_PM];
    const float* pl = (const float*)tab[T_PL];
    const float* pacc = (const float*)tab[T_PACC];
    u16* out = (u16*)sh.acc;  // [HQ · D] bf16 (the accumulators are free after attention)
#if ATTN_FOLD_V2
    // every load first (a thread's E elements × ATTN_FOLD splits, predicated), then the same sums as below:
    // one round of L2 latency where the loop below has two an element
    constexpr int E = (HQ * D + CONSUMERS - 1) / CONSUMERS;
    float m[E][ATTN_FOLD], l[E][ATTN_FOLD], a[E][ATTN_FOLD];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int i = threadIdx.x + CONSUMERS * e, ic = i < HQ * D ? i : 0;
        const int q = ic / D, d = ic % D;
        const int base = (q / G) * SMAX * G + q % G;
#pragma unroll
        for (int s = 0; s < ATTN_FOLD; ++s) {
            const bool on = i < HQ * D && s < S;
            m[e][s] = on ? pm[base + s * G] : NEG_INF;
            l[e][s] = on ? pl[base + s * G] : 0.f;
            a[e][s] = on ? pacc[(u64)(base + s * G) * D + d] : 0.f;
        }
    }
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int i = threadIdx.x + CONSUMERS * e;
        float M = NEG_INF;
#pragma unroll
        for (int s = 0; s < ATTN_FOLD; ++s) M = fmaxf(M, m[e][s]);
        float L = 0.f, o = 0.f;
#pragma unroll
        for (int s = 0; s < ATTN_FOLD; ++s) {
            const float w = m[e][s] == NEG_INF ? 0.f : expf(m[e][s] - M);
            L = fmaf(w, l[e][s], L);
            o = fmaf(w, a[e][s], o);
        }
        if (i < HQ * D) out[i] = (u16)f2bf(o * (1.f / L));
    }
#else
    for (int i = threadIdx.x; i < HQ * D; i += CONSUMERS) {
        const int q = i / D, d = i % D;
        const int base = (q / G) * SMAX * G + q % G;  // idx of split s: base + s · G
        float M = NEG_INF;
        for (int s = 0; s < S; ++s) M = fmaxf(M, pm[base + s * G]);
        float L = 0.f, o = 0.f;
        if (M != NEG_INF) {
            for (int s = 0; s < S; ++s) {
                const float m = pm[base + s * G];
                const float w = m == NEG_INF ? 0.f : expf(m - M);
                L = fmaf(w, pl[base + s * G], L);
                o = fmaf(w, pacc[(u64)(base + s * G) * D + d], o);
            }
        }
        out[i] = (u16)f2bf(o * (1.f / L));
    }
#endif
    bar_consumers();
    return (const char*)out;
}
#endif

// One weight stage for this block: wait for stage `dep`, load x, run the tiles, publish stage `me`.
// Warps do not wait for each other inside a stage: each writes its sum to red[slot][warp] and counts
// itself in (a shared-memory atomic); the eighth warp of a tile runs its epilogue, then frees the slot.
template <int KIND, int K, int WPR, bool NORM>
__device__ __forceinline__ void gemv_stage(const long long* tab, Shared sh, u32& it, int layer, int seq, int dep, int me,
                           const char* x, const char* g, const Step& st) {
    u32* ctr = (u32*)tab[T_CTR];
    u32* err = (u32*)tab[T_ERR];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = warp / WPR;  // this warp's row of each tile
    const int n = num_tasks(KIND);
    float xr[(K / 8 / WPR + 31) / 32][8];
#if EARLY_OPERANDS
    constexpr int PT = pre_tiles<KIND>();
    float2 pre[PT];  // pre[k]: the k-th next tile's epilogue operands
#pragma unroll
    for (int k = 0; k < PT; ++k) {
        const int t = first_task(seq) + k * NB;
        pre[k] = t < n ? pre_operands<KIND>(tab, layer, t, lane, st) : make_float2(0.f, 0.f);
    }
    uint4 gr[XCHUNKS(K, WPR)];
    if constexpr (NORM) load_g<K>(g, gr);
    wait_stage(ctr, dep, me >= 0 ? me : NCTR - 1, err);
#if ATTN_FOLD
    if (KIND == K_O) {
        const char* merged = fold_attention(tab, sh, st);
        if (merged) x = merged;
    }
#endif
    load_x<K, WPR, NORM, NORM>(x, g, xr, gr);
#else
    const float2 pre[1] = {make_float2(0.f, 0.f)};
    wait_stage(ctr, dep, me >= 0 ? me : NCTR - 1, err);
#if ATTN_FOLD
    if (KIND == K_O) {
        const char* merged = fold_attention(tab, sh, st);
        if (merged) x = merged;
    }
#endif
    load_x<K, WPR, NORM>(x, g, xr);
#endif
    for (int t = first_task(seq); t < n; t += NB, ++it) {
        u32 slot = it % NSLOT;
        mbar_wait_timed(smem_addr(sh.full + slot), (it / NSLOT) & 1u, err, 2, me >= 0 ? me : NCTR - 1, 2);
        const char* tile = sh.ring + (u64)slot * SLOT;
        float dot = row_dot<K, WPR>(tile + (u64)row * K * EB, xr);
        u32 arrived = 0;
        if (lane == 0) {
            sh.red[slot * 8 + warp] = dot;
            __threadfence_block();
            arrived = atomicAdd(sh.cnt + slot, 1u);
        }
        arrived = __shfl_sync(0xffffffffu, arrived, 0);
        if (arrived == 7) {  // the tile's last warp: take the sums, free the slot, then write the outputs
            __threadfence_block();
            float a, b;
            gather<KIND, WPR>(sh.red + slot * 8, lane, a, b);
            __syncwarp();
            if (lane == 0) {
                sh.cnt[slot] = 0;
                mbar_arrive(smem_addr(sh.empty + slot));
            }
            epilogue<KIND, WPR>(tab, sh, layer, t, a, b, lane, st, pre[0]);
        } else if (lane == 0) {
            mbar_arrive(smem_addr(sh.empty + slot));
        }
        __syncwarp();
#if EARLY_OPERANDS
#pragma unroll
        for (int k = 0; k + 1 < PT; ++k) pre[k] = pre[k + 1];
#endif
    }
    if (me >= 0) arrive_stage(ctr, me);
    else {
        bar_consumers();
        stamp(NCTR - 1, 1);
    }
}

// c += A · B on tensor cores: mma.sync m16n8k16, bf16 operands (A: 4 registers of 2, B: 2), float32 c.
__device__ __forceinline__ void mma_bf16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ------------------------------------------------------------------------------------------------
// attention: partial softmax sums per (KV head, split) over chunks of 32 keys, then a merge per head

// Attention for one token: the keys of KV head kvh split over num_splits blocks; inside a block each warp
// takes chunks of 32 keys (lane j: key j's K row for the scores; every lane its DL dims of the V rows) with
// an online softmax, the block merges its warps in shared memory, and, with several blocks per KV head,
// the last block of that head to finish merges the blocks' partials.
__device__ __forceinline__ void attention_stage(const long long* tab, Shared sh, u32& it, int layer, const Step& st) {
    u32* ctr = (u32*)tab[T_CTR];
    u32* err = (u32*)tab[T_ERR];
    wait_stage(ctr, 6 * layer, 6 * layer + 1, err);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int S = num_splits(st);
    const int chunks = (int)((st.hi - st.lo + 31) / 32);
#if !KV_RING
    const u16* kc = (const u16*)layer_ptr(tab, layer, L_K);
    const u16* vc = (const u16*)layer_ptr(tab, layer, L_V);
    const int* bt = (const int*)tab[T_BT];
#endif
    float* wacc = sh.acc + warp * G * D;        // [G][D] this warp's accumulators
    float* ps = sh.ps + warp * 32 * PS_G;       // [32][PS_G] this warp's probabilities, then its (m, l)
    const float scale = rsqrtf((float)D);
    for (int item = blockIdx.x; item < HKV * S; item += NB) {
        const int kvh = item / S, split = item % S;
        const int c0 = (int)((long long)split * chunks / S), c1 = (int)((long long)(split + 1) * chunks / S);
        // Chunks on tensor cores (mma.sync m16n8k16 bf16 → f32; gid = lane / 4, tig = lane % 4):
        //   scores S [16 keys × 8 heads] = K [16 keys × 16 dims] · Qᵀ [16 dims × 8 heads], D / 16 steps, 2 key tiles;
        //   O [16 heads (8 real) × 8 dims] += P [heads × 16 keys] · V [16 keys × 8 dims], P as bf16 hi + lo parts.
        // A thread's scores: keys 16t + 8r + gid, heads 2·tig + j; its outputs: head gid, dims 8i + 2·tig + {0, 1}.
        const int gid = lane >> 2, tig = lane & 3;
        u32 qb[D / 16][2];  // Qᵀ fragments: Q[gid][16s + 2tig …], Q[gid][16s + 8 + 2tig …] (zero past G heads)
        {
            const u32* q32 = (const u32*)((const u16*)tab[T_Q] + kvh * G * D);
#pragma unroll
            for (int s = 0; s < D / 16; ++s) {
                qb[s][0] = gid < G ? q32[gid * (D / 2) + 8 * s + tig] : 0u;
                qb[s][1] = gid < G ? q32[gid * (D / 2) + 8 * s + 4 + tig] : 0u;
            }
        }
        float mh[2] = {NEG_INF, NEG_INF}, lh[2] = {0.f, 0.f};  // softmax state of heads 2tig, 2tig + 1
        float o[D / 8][2];
#pragma unroll
        for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = 0.f;
        for (int c = c0 + warp; c < c1; c += 8) {
            const long long first = st.lo + (long long)c * 32;
            long long key = first + lane;
            bool valid = key < st.hi;
#if KV_RING
            // the chunk's K / V rows in the ring: tile it + (c - c0) of this block's walk; lane j's key is row j
            // (row 0, a valid key, stands in past hi: its probability is 0)
            const u32 kv_it = it + (u32)(c - c0), kv_slot = kv_it % NSLOT;
            mbar_wait_timed(smem_addr(sh.full + kv_slot), (kv_it / NSLOT) & 1u, err, 3, 6 * layer + 1, 2);
            u16* ks = (u16*)(sh.ring + (u64)kv_slot * SLOT);
            const u16* kc = ks;
            const u16* vc = ks + 32 * D;
            long long base = valid ? (long long)lane * D : 0;
            const long long rn = st.hi - 1 - first;  // the new token's row, written by this layer's q/k/v stage
            if (rn < 32) {  // after the copy was issued: take it from the cache
                const int half = lane >> 4, l16 = lane & 15;
                if (l16 < D / 8) {
                    const u16* src = (const u16*)layer_ptr(tab, layer, half ? L_V : L_K) +
                                     (((u64)st.page * HKV + kvh) * PS + st.off) * D;
                    *(uint4*)(ks + half * 32 * D + rn * D + l16 * 8) = *(const uint4*)(src + l16 * 8);
                }
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // before the slot's next bulk copy
                __syncwarp();
            }
#else
            long long base = valid ? (((long long)bt[key / PS] * HKV + kvh) * PS + key % PS) * D : 0;
#endif
            float sc[2][4];
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                const long long k0 = __shfl_sync(0xffffffffu, base, 16 * t + gid);
                const long long k1 = __shfl_sync(0xffffffffu, base, 16 * t + 8 + gid);
                const u32* r0 = (const u32*)(kc + k0) + tig;
                const u32* r1 = (const u32*)(kc + k1) + tig;
                u32 ka[D / 16][4];
#pragma unroll
                for (int s = 0; s < D / 16; ++s) {
                    ka[s][0] = r0[8 * s];
                    ka[s][1] = r1[8 * s];
                    ka[s][2] = r0[8 * s + 4];
                    ka[s][3] = r1[8 * s + 4];
                }
                sc[t][0] = sc[t][1] = sc[t][2] = sc[t][3] = 0.f;
#pragma unroll
                for (int s = 0; s < D / 16; ++s) mma_bf16(sc[t], ka[s][0], ka[s][1], ka[s][2], ka[s][3], qb[s][0], qb[s][1]);
            }
            float alpha[2];
#pragma unroll
            for (int j = 0; j < 2; ++j) {  // online softmax of head 2tig + j over the 32 keys (8 lanes × 4 values)
                float v[4], mx = NEG_INF;
#pragma unroll
                for (int q = 0; q < 4; ++q) {  // q = 2t + r: key 16t + 8r + gid
                    const long long k = first + 16 * (q >> 1) + 8 * (q & 1) + gid;
                    v[q] = k < st.hi ? sc[q >> 1][2 * (q & 1) + j] * scale : NEG_INF;
                    mx = fmaxf(mx, v[q]);
                }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
                const float mn = fmaxf(mh[j], mx);
                alpha[j] = mh[j] == NEG_INF ? 0.f : expf(mh[j] - mn);
                float sum = 0.f;
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float p = v[q] == NEG_INF ? 0.f : expf(v[q] - mn);
                    sum += p;
                    ps[(16 * (q >> 1) + 8 * (q & 1) + gid) * 8 + 2 * tig + j] = p;  // P [key][head], 8 heads a row
                }
                sum += __shfl_xor_sync(0xffffffffu, sum, 4);
                sum += __shfl_xor_sync(0xffffffffu, sum, 8);
                sum += __shfl_xor_sync(0xffffffffu, sum, 16);
                lh[j] = lh[j] * alpha[j] + sum;
                mh[j] = mn;
            }
            __syncwarp();
            {  // rescale head gid's outputs: its alpha lives in lane gid / 2 (any gid works: lanes 0-3)
                const float a0 = __shfl_sync(0xffffffffu, alpha[0], gid >> 1);
                const float a1 = __shfl_sync(0xffffffffu, alpha[1], gid >> 1);
                const float ag = (gid & 1) ? a1 : a0;
#pragma unroll
                for (int i = 0; i < D / 8; ++i) {
                    o[i][0] *= ag;
                    o[i][1] *= ag;
                }
            }
#pragma unroll
            for (int u = 0; u < 2; ++u) {  // keys 16u … 16u + 15
                u32 ah[2], al[2];  // P fragments (rows gid; keys 2tig, 2tig + 1 | 2tig + 8, 2tig + 9), hi and lo
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int kk = 16 * u + 2 * tig + 8 * h;
                    const float p0 = ps[kk * 8 + gid], p1 = ps[(kk + 1) * 8 + gid];
                    const u32 h0 = f2bf(p0), h1 = f2bf(p1);
                    ah[h] = h0 | (h1 << 16);
                    al[h] = f2bf(p0 - bf2f(h0)) | (f2bf(p1 - bf2f(h1)) << 16);
                }
                long long vb[4];  // V rows of keys 16u + 2tig, + 1, + 8, + 9
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    vb[q] = __shfl_sync(0xffffffffu, base, 16 * u + 2 * tig + (q & 1) + 8 * (q >> 1));
#pragma unroll
                for (int i = 0; i < D / 8; ++i) {
                    const int d = 8 * i + gid;
                    const u32 b0 = (u32)vc[vb[0] + d] | ((u32)vc[vb[1] + d] << 16);
                    const u32 b1 = (u32)vc[vb[2] + d] | ((u32)vc[vb[3] + d] << 16);
                    float c[4] = {o[i][0], o[i][1], 0.f, 0.f};  // rows 8-15: no heads there
                    mma_bf16(c, ah[0], 0u, ah[1], 0u, b0, b1);
                    mma_bf16(c, al[0], 0u, al[1], 0u, b0, b1);
                    o[i][0] = c[0];
                    o[i][1] = c[1];
                }
            }
            __syncwarp();
#if KV_RING
            if (lane == 0) {  // the slot is free: one warp arrives for the 8 a weight tile has
                u64 state;
                asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1], 8;"
                             : "=l"(state) : "r"(smem_addr(sh.empty + kv_slot)) : "memory");
            }
#endif
        }
#if KV_RING
        it += (u32)(c1 - c0);
#endif
        // this warp's partials into shared memory, as the CUDA-core path leaves them
        if (gid < G) {
#pragma unroll
            for (int i = 0; i < D / 8; ++i) {
                wacc[gid * D + 8 * i + 2 * tig] = o[i][0];
                wacc[gid * D + 8 * i + 2 * tig + 1] = o[i][1];
            }
        }
        __syncwarp();
        if (gid == 0) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                if (2 * tig + j < G) {
                    ps[2 * tig + j] = mh[j];
                    ps[G + 2 * tig + j] = lh[j];
                }
            }
        }
        bar_consumers();
        // warp g merges head g over the 8 warps
        float* pm = (float*)tab[T_PM];
        float* pl = (float*)tab[T_PL];
        float* pacc = (float*)tab[T_PACC];
        if (warp < G) {
            const int g = warp;
            float mw[8], M = NEG_INF;
#pragma unroll
            for (int w = 0; w < 8; ++w) {
                mw[w] = sh.ps[w * 32 * PS_G + g];
                M = fmaxf(M, mw[w]);
            }
            float L = 0.f, o[DL];
#pragma unroll
            for (int e = 0; e < DL; ++e) o[e] = 0.f;
            if (M != NEG_INF) {
#pragma unroll
                for (int w = 0; w < 8; ++w) {
                    float f = mw[w] == NEG_INF ? 0.f : expf(mw[w] - M);
                    L += f * sh.ps[w * 32 * PS_G + G + g];
#pragma unroll
                    for (int e = 0; e < DL; ++e) o[e] = fmaf(f, sh.acc[w * G * D + g * D + lane * DL + e], o[e]);
                }
            }
            if (S == 1) {
                u16* out = (u16*)tab[T_ATTN] + (kvh * G + g) * D + lane * DL;
                float inv = 1.f / L;
#pragma unroll
                for (int e = 0; e < DL; ++e) out[e] = (u16)f2bf(o[e] * inv);
            } else {
                int idx = (kvh * SMAX + split) * G + g;
                if (lane == 0) {
                    pm[idx] = M;
                    pl[idx] = L;
                }
#pragma unroll
                for (int e = 0; e < DL; ++e) pacc[(u64)idx * D + lane * DL + e] = o[e];
            }
        }
        if (S > 1 && S > ATTN_FOLD) {  // the last block of this KV head merges the blocks' partials
            __threadfence();
            bar_consumers();
            u32* actr = ctr + NCTR + layer * HKV + kvh;
            if (threadIdx.x == 0) *sh.word = atomicAdd(actr, 1u);
            bar_consumers();
            const u32 done = *sh.word;
            if (done == (u32)S - 1 && !ATTN_NO_MERGE) {
                __threadfence();
                if (warp < G) {
                    const int g = warp;
                    const bool mine = lane < S;
                    const int idx = (kvh * SMAX + lane) * G + g;
                    float ms = mine ? pm[idx] : NEG_INF;
                    float ls = mine ? pl[idx] : 0.f;
                    float M = warp_max(ms);
                    float w = ms == NEG_INF ? 0.f : expf(ms - M);
                    float L = warp_sum(w * ls);
                    float o[DL];
#pragma unroll
                    for (int e = 0; e < DL; ++e) o[e] = 0.f;
                    for (int j0 = 0; j0 < S; j0 += 8) {
                        float a[8][DL];
#pragma unroll
                        for (int j = 0; j < 8; ++j) {
#pragma unroll
                            for (int e = 0; e < DL; ++e)
                                a[j][e] = j0 + j < S ? pacc[(u64)((kvh * SMAX + j0 + j) * G + g) * D + lane * DL + e] : 0.f;
                        }
#pragma unroll
                        for (int j = 0; j < 8; ++j) {
                            float wj = __shfl_sync(0xffffffffu, w, (j0 + j) & 31);
#pragma unroll
                            for (int e = 0; e < DL; ++e) o[e] = fmaf(wj, a[j][e], o[e]);
                        }
                    }
                    u16* out = (u16*)tab[T_ATTN] + (kvh * G + g) * D + lane * DL;
                    float inv = 1.f / L;
#pragma unroll
                    for (int e = 0; e < DL; ++e) out[e] = (u16)f2bf(o[e] * inv);
                }
                if (threadIdx.x == 0) *actr = 0;
            }
        }
        bar_consumers();
    }
    arrive_stage(ctr, 6 * layer + 1);
}

// ------------------------------------------------------------------------------------------------

// tab: the pointer table; logits [V] out; ids [1] the input token; pos [1] its rotary position; pending:
// uncommitted tokens before it (chain drafting): its K/V go to slot lengths[0] + pending and it attends to
// slots [0, lengths[0] + pending] ([lengths[0], …] for a row that is not live).
extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1)  // ≤ 168 registers: 3 warps in a quadrant
redwood_decode_forward(const long long* __restrict__ tab, float* logits, const long long* ids, const long long* pos,
                       int pending) {
    extern __shared__ __align__(128) char smem[];
    Shared sh;
    sh.ring = smem;  // then 16-byte aligned float arrays, then the barriers and counts
    sh.acc = (float*)(smem + (u64)NSLOT * SLOT);
    sh.ps = sh.acc + 8 * G * D;
    sh.full = (u64*)(sh.ps + 8 * 32 * PS_G);
    sh.empty = sh.full + NSLOT;
    sh.red = (float*)(sh.empty + NSLOT);
    sh.cnt = (u32*)(sh.red + NSLOT * 8);
    sh.cos = (float*)(sh.cnt + NSLOT);
    sh.sin = sh.cos + D / 2;
    sh.word = (u32*)(sh.sin + D / 2);
    u32* err = (u32*)tab[T_ERR];
    if (PROFILE) {
        g_prof = (long long*)tab[T_PROF];
        for (int c = threadIdx.x; c < NCTR; c += blockDim.x)  // this block's wait totals start at 0
            g_prof[((u64)c * NB + blockIdx.x) * PROF_SLOTS + 2] = g_prof[((u64)c * NB + blockIdx.x) * PROF_SLOTS + 3] = 0;
    }
    if (threadIdx.x == 0) {
        for (int s = 0; s < NSLOT; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(sh.full + s)), "r"(1) : "memory");
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(sh.empty + s)), "r"(8) : "memory");
            sh.cnt[s] = 0;
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    Step st;
    {
        const long long len = ((const long long*)tab[T_LEN])[0];
        const long long slot = len + pending;
        st.pos = pos[0];
        st.page = ((const int*)tab[T_BT])[slot / PS];
        st.off = slot % PS;
        st.lo = ((const long long*)tab[T_LIVE])[0] != 0 ? 0 : len;  // a row that is not live reads no context
        st.hi = slot + 1;
        st.embed_row = (const char*)tab[T_EMBED] + (u64)ids[0] * H * 2;
        st.logits = logits;
    }
    if (threadIdx.x >= CONSUMERS) {  // the producer warp: one thread streams, the rest have nothing to do
        if (threadIdx.x == CONSUMERS) produce(tab, sh, err PRODUCE_STEP_ARG);
        return;
    }
    for (int i = threadIdx.x; i < D / 2; i += CONSUMERS) {
        float ang = (float)st.pos * ((const float*)tab[T_INV_FREQ])[i];
        sh.cos[i] = rbf(cosf(ang));
        sh.sin[i] = rbf(sinf(ang));
    }
    bar_consumers();
    u32 it = 0;
    const char* embed_row = st.embed_row;
    for (int layer = 0; layer < NL; ++layer) {
        const char* x = layer == 0 ? embed_row : (const char*)tab[T_H];
        gemv_stage<K_QKV, H, 1, true>(tab, sh, it, layer, layer * 4, layer ? 6 * layer - 1 : -1, 6 * layer,
                                         x, layer_ptr(tab, layer, L_IN_NORM), st);
        attention_stage(tab, sh, it, layer, st);
        gemv_stage<K_O, HQ * D, 1, false>(tab, sh, it, layer, layer * 4 + 1, 6 * layer + 1, 6 * layer + 3,
                                            (const char*)tab[T_ATTN], 0, st);
        gemv_stage<K_GU, H, 1, true>(tab, sh, it, layer, layer * 4 + 2, 6 * layer + 3, 6 * layer + 4,
                                        (const char*)tab[T_H], layer_ptr(tab, layer, L_POST_NORM), st);
        gemv_stage<K_DOWN, NI, 8 / RD, false>(tab, sh, it, layer, layer * 4 + 3, 6 * layer + 4, 6 * layer + 5,
                                                  (const char*)tab[T_ACT], 0, st);
    }
    gemv_stage<K_HEAD, H, 1, true>(tab, sh, it, NL, NL * 4, 6 * NL - 1, -1, (const char*)tab[T_H],
                                      (const char*)tab[T_NORM], st);
    // Last block out resets the counters for the next launch (every block has passed every wait by then).
    bar_consumers();
    if (threadIdx.x == 0) {
        u32* ctr = (u32*)tab[T_CTR];
        __threadfence();
        u32 old = atomicAdd(ctr + NCTR - 1, 1u);
        if (old == NB - 1) {
            for (int c = 0; c < NCTR; ++c) ctr[c] = 0;
            __threadfence();
        }
    }
}
