// megakernel (3/5): the consumer side of a weight stage (q/k/v, o, gate/up, down, the head): activations,
// row dot products from the ring, each tile's epilogue, and the o stage's fold of the attention splits.

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

