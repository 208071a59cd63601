// megakernel (3/5): the consumer side of a weight stage (q/k/v, o, gate/up, down, the head): activations,
// row dot products from the ring, each tile's epilogue.

// ------------------------------------------------------------------------------------------------
// consumer side of a weight stage

#define XCHUNKS(K, WPR) (((K) / 8 / (WPR) + 31) / 32)  // 8-element chunks of x a lane holds

// The norm weights' chunks load_x multiplies in, loaded before the stage's wait: the same chunks c = lane + 32·j.
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
// widened to float32 (times s · g_k when NORM: the folded RMSNorm, g's chunks in gr from load_g). x: bf16.
template <int K, int WPR, bool NORM>
__device__ __forceinline__ void load_x(const char* x, float (&xr)[(K / 8 / WPR + 31) / 32][8],
                                       const uint4 (&gr)[XCHUNKS(K, WPR)]) {
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
                widen8(gr[j], gf);
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
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = fmaf(xr[j][e], wf[e], acc);
        }
    }
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

// What a tile's epilogue reads from global memory that is final before its stage's wait (loaded before the wait): the
// q/k/v biases of its pair rows (lanes 0-3), the residual rows o and down add to (lanes 0-7 / 0-RD). The
// residual stream h is final then: this block's previous stage waited for the stage that last wrote it.
template <int KIND>
__host__ __device__ constexpr int pre_tiles() {
    return KIND == K_QKV || KIND == K_O || KIND == K_DOWN ? (num_tasks(KIND) + NB - 1) / NB : 1;
}

// q/k/v tile t holds 4 rotation pairs of one head: lane l < 4 of its epilogue writes rows (r, r + D/2), r as here.
__device__ __forceinline__ int qkv_pair_row(int t, int lane) {
    const int head = t / (D / 8), i = (t % (D / 8)) * 4 + lane;
    return head * D + i;
}

template <int KIND>
__device__ __forceinline__ float2 pre_operands(const long long* tab, int layer, int t, int lane, const Step& st) {
    float2 v = make_float2(0.f, 0.f);
    if (KIND == K_QKV) {
        if (HAS_QKV_BIAS && lane < 4) {
            const int r1 = qkv_pair_row(t, lane);
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

// W8: the float32 row scales of the rows a lane of tile t's epilogue writes (a, b: as epilogue's), loaded a tile
// ahead — a global load in the epilogue stalled each tile's last warp, and with it the next tile (session 20).
template <int KIND>
__device__ __forceinline__ float2 w8_scales(const long long* tab, int layer, int t, int lane) {
    float2 v = make_float2(1.f, 1.f);
    if (KIND == K_QKV) {
        if (lane < 4) {
            const float* sc = (const float*)layer_ptr(tab, layer, L_QKV_S);
            const int r1 = qkv_pair_row(t, lane);
            v = make_float2(sc[r1], sc[r1 + D / 2]);
        }
    } else if (KIND == K_O) {
        if (lane < 8) v.x = ((const float*)layer_ptr(tab, layer, L_O_S))[t * 8 + lane];
    } else if (KIND == K_GU) {
        if (lane < 4) {
            const float* sc = (const float*)layer_ptr(tab, layer, L_GU_S);
            v = make_float2(sc[t * 4 + lane], sc[NI + t * 4 + lane]);
        }
    } else if (KIND == K_DOWN) {
        if (lane < RD) v.x = ((const float*)layer_ptr(tab, layer, L_DOWN_S))[t * RD + lane];
    } else {
        if (lane < 8) v.x = ((const float*)tab[T_HEAD_S])[t * 8 + lane];
    }
    return v;
}

template <int KIND, int WPR>
__device__ __forceinline__ void epilogue(const long long* tab, Shared sh, int layer, int t, float a, float b,
                                         int lane, const Step& st, float2 pre, float2 sc) {
    if (W8) {  // the rows' scales (1 where a lane writes nothing, or for an unused b: exact)
        a *= sc.x;
        b *= sc.y;
    }
    if (KIND == K_QKV) {
        if (lane < 4) {
            const int head = t / (D / 8), i = (t % (D / 8)) * 4 + lane;  // pair (i, i + D/2) of `head`
            float y1 = a, y2 = b;
            if (HAS_QKV_BIAS) {
                y1 += pre.x;
                y2 += pre.y;
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
            ((u16*)tab[T_H])[r] = (u16)f2bf(pre.x + rbf(a));
        }
    } else if (KIND == K_GU) {
        if (lane < 4) {
            float gt = rbf(a), up = rbf(b);
            float sg = rbf(__fdiv_rn(gt, 1.f + expf(-gt)));
            ((u16*)tab[T_ACT])[t * 4 + lane] = (u16)f2bf(sg * up);
        }
    } else if (KIND == K_DOWN) {
        if (lane < RD) {
            float sum = a;
            int r = t * RD + lane;
            ((u16*)tab[T_H])[r] = (u16)f2bf(pre.x + rbf(sum));
        }
    } else {
        if (lane < 8) st.logits[t * 8 + lane] = rbf(a);
    }
}

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
    constexpr int PT = pre_tiles<KIND>();
    float2 pre[PT];  // pre[k]: the k-th next tile's epilogue operands
#pragma unroll
    for (int k = 0; k < PT; ++k) {
        const int t = first_task(seq) + k * NB;
        pre[k] = t < n ? pre_operands<KIND>(tab, layer, t, lane, st) : make_float2(0.f, 0.f);
    }
    float2 sc_next = make_float2(1.f, 1.f);  // W8: the next tile's row scales
    if (W8 && first_task(seq) < n) sc_next = w8_scales<KIND>(tab, layer, first_task(seq), lane);
    uint4 gr[XCHUNKS(K, WPR)];
    if constexpr (NORM) load_g<K>(g, gr);
    wait_stage(ctr, dep, me >= 0 ? me : NCTR - 1, err);
    load_x<K, WPR, NORM>(x, xr, gr);
    for (int t = first_task(seq); t < n; t += NB, ++it) {
        const float2 sc = sc_next;
        if (W8 && t + NB < n) sc_next = w8_scales<KIND>(tab, layer, t + NB, lane);
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
            epilogue<KIND, WPR>(tab, sh, layer, t, a, b, lane, st, pre[0], sc);
        } else if (lane == 0) {
            mbar_arrive(smem_addr(sh.empty + slot));
        }
        __syncwarp();
#pragma unroll
        for (int k = 0; k + 1 < PT; ++k) pre[k] = pre[k + 1];
    }
    if (me >= 0) arrive_stage(ctr, me);
    else {
        bar_consumers();
        stamp(NCTR - 1, 1);
    }
}

