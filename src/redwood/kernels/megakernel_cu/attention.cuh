// megakernel (4/5): attention of the new token over the cache on tensor cores, split over blocks and warps,
// and the merge of the splits.

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
#if ATTN_EARLY_ROW
        // the new token's K / V row (written by this layer's q/k/v stage, final since the wait), loaded by the warp
        // whose chunk holds it together with q: one round trip for both instead of one after the other
        uint4 new_row = make_uint4(0u, 0u, 0u, 0u);
        {
            const int cn = (int)((st.hi - 1 - st.lo) / 32), l16 = lane & 15;
            if (cn >= c0 && cn < c1 && (cn - c0) % 8 == warp && l16 < D / 8) {
                const u16* src = (const u16*)layer_ptr(tab, layer, (lane >> 4) ? L_V : L_K) +
                                 (((u64)st.page * HKV + kvh) * PS + st.off) * D;
                new_row = *(const uint4*)(src + l16 * 8);
            }
        }
#endif
        float mh[2] = {NEG_INF, NEG_INF}, lh[2] = {0.f, 0.f};  // softmax state of heads 2tig, 2tig + 1
        float o[D / 8][2];
#pragma unroll
        for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = 0.f;
        for (int c = c0 + warp; c < c1; c += 8) {
            const long long first = st.lo + (long long)c * 32;
            long long key = first + lane;
            bool valid = key < st.hi;
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
#if ATTN_EARLY_ROW
                    *(uint4*)(ks + half * 32 * D + rn * D + l16 * 8) = new_row;
#else
                    const u16* src = (const u16*)layer_ptr(tab, layer, half ? L_V : L_K) +
                                     (((u64)st.page * HKV + kvh) * PS + st.off) * D;
                    *(uint4*)(ks + half * 32 * D + rn * D + l16 * 8) = *(const uint4*)(src + l16 * 8);
#endif
                }
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // before the slot's next bulk copy
                __syncwarp();
            }
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
            if (lane == 0) {  // the slot is free: one warp arrives for the 8 a weight tile has
                u64 state;
                asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1], 8;"
                             : "=l"(state) : "r"(smem_addr(sh.empty + kv_slot)) : "memory");
            }
        }
        it += (u32)(c1 - c0);
        stamp(6 * layer + 1, 4);
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
        stamp(6 * layer + 1, 5);
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
        if (S > 1) {  // the last block of this KV head merges the blocks' partials
            u32* actr = ctr + NCTR + layer * HKV + kvh;
            // as arrive_stage / wait_stage order a stage: the barrier orders the block's partials before thread 0's
            // release, and its acquire (then the barrier) orders the other blocks' partials before the merge's loads
            bar_consumers();
            stamp(6 * layer + 1, 6);
            if (threadIdx.x == 0) {
                u32 v;
                asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(v) : "l"(actr) : "memory");
                *sh.word = v;
            }
            bar_consumers();
            stamp(6 * layer + 1, 7);
            const u32 done = *sh.word;
            if (done == (u32)S - 1 && !ATTN_NO_MERGE) {
                if (warp < G) {
                    const int g = warp;
                    const bool mine = lane < S;
                    const int idx = (kvh * SMAX + lane) * G + g;
#if MERGE_PRELOAD
                    // the first 8 splits' partial outputs, loaded with (m, l): they do not depend on the max, and
                    // loaded after its shuffles (as the compiler places them) they were a second round trip
                    float a0[8][DL];
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
#pragma unroll
                        for (int e = 0; e < DL; ++e)
                            a0[j][e] = j < S ? pacc[(u64)((kvh * SMAX + j) * G + g) * D + lane * DL + e] : 0.f;
                    }
#endif
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
#if MERGE_PRELOAD
                                a[j][e] = j0 == 0 ? a0[j][e]
                                        : j0 + j < S ? pacc[(u64)((kvh * SMAX + j0 + j) * G + g) * D + lane * DL + e] : 0.f;
#else
                                a[j][e] = j0 + j < S ? pacc[(u64)((kvh * SMAX + j0 + j) * G + g) * D + lane * DL + e] : 0.f;
#endif
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

