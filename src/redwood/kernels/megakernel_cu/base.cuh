// One launch for a whole one-token forward of a pre-norm GQA decoder (batch 1, bfloat16 weights):
// every layer's norm, q/k/v + bias + RoPE + paged cache write, attention, o + residual, norm, gate/up +
// SiLU·up, down + residual, then the final norm and the LM head. redwood/kernels/megakernel.py compiles it
// with NVRTC (shape constants prepended as #defines) and launches one block per SM. Its source is five parts
// compiled as one, in order: this file (the table layout, design switches, numerics, memory and barrier
// primitives, stage waits, profiling), producer.cuh, gemv_stage.cuh, attention.cuh, forward.cu.
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
// Stages of layer l (counter 6·l + s): 0 q/k/v, 1 attention (partials per KV head and key split, the context's
// K/V chunks arriving through the producer's ring like weight tiles; with several splits the last block of a KV head
// to finish merges them), 3 o + residual, 4 gate/up +
// SiLU·up, 5 down + residual (2 is unused); then the LM head. A weight stage's tasks are tiles of 8 weight rows (RD rows for down) assigned round robin to the
// blocks; inside a block warp w computes row w (or a K part of a down row) of each tile from shared
// memory against the activation held in registers.
//
// Rounding follows redwood.kernels.gemv / qkv_rope / fused (the skinny path): float32 sums; the folded
// RMSNorm as s · Σ x_k g_k W_nk; each projection's output rounded to bf16; RoPE, residual adds and
// SiLU·up rounded as eager PyTorch rounds them; the logits rounded to bf16 then widened.
//
// Constants (#define, from the host): H hidden, NI intermediate, HQ / HKV heads, D head dim (64 or 128),
// V vocab, NL layers, PS page size, EPS, NB blocks, NSLOT ring slots, SLOT slot bytes, RD down rows per
// tile, SMAX key splits per KV head at most, HAS_QKV_BIAS, W8 (int8 weights), PROFILE; the design switches
// below have defaults.

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

// 8 packed int8 (8 bytes) → float32, in order; exact, without the int → float conversion instruction (a quarter-rate pipe, which bound the W8 build's consumers:
// session 20): byte b + 128 placed as the low mantissa bits of 2^23 is the float 2^23 + b + 128 (one byte permute),
// and one subtraction of 2^23 + 128 leaves b.
__device__ __forceinline__ void widen8_i8(uint2 v, float (&f)[8]) {
    const u32 x = v.x ^ 0x80808080u, y = v.y ^ 0x80808080u;  // b + 128 in each byte
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        f[e] = __int_as_float(__byte_perm(x, 0x4B000000u, 0x7440u + e)) - 8388736.f;
        f[4 + e] = __int_as_float(__byte_perm(y, 0x4B000000u, 0x7440u + e)) - 8388736.f;
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
#if 128 * D > SLOT
#error "a K/V chunk's K and V rows (32 keys each) must fit one ring slot"
#endif
#ifndef ATTN_EARLY_ROW
#define ATTN_EARLY_ROW 0  // experiment: the new token's K / V row loaded with q, before the chunk loop
#endif
#ifndef MERGE_PRELOAD
#define MERGE_PRELOAD 0  // experiment: the split merge loads the partial outputs with (m, l), before the reductions
#endif
#ifndef ATTN_CPB
#define ATTN_CPB 8  // chunks of 32 keys a block takes (one a warp) before a KV head's keys split over more blocks
                    // (16: slower at every shape and context, session 21)
#endif
#define PS_G 8  // probability rows of 8 heads (the tensor-core N)
__device__ long long* g_prof;  // set at kernel start with PROFILE

// PROFILE: per stage and block, [0] start (after the wait), [1] end, [2] ns the consumers (warp 0) waited for full
// slots, [3] ns the producer waited for free slots while streaming that stage's tiles; attention, in a block holding
// key chunks: [4] warp 0's chunks done, [5] every warp's partials in shared memory, [6] (several splits) the block's
// merged partials stored, [7] its arrival counted (the time stamps of thread 0; 0 where not reached).
#define PROF_SLOTS 8

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

