// megakernel (5/5): the kernel — shared-memory layout, the producer / consumer split, and the stages of
// every layer in order.

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
        for (int c = threadIdx.x; c < NCTR; c += blockDim.x)  // this block's wait totals and phase stamps start at 0
            for (int w = 2; w < PROF_SLOTS; ++w) g_prof[((u64)c * NB + blockIdx.x) * PROF_SLOTS + w] = 0;
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
        if (threadIdx.x == CONSUMERS) produce(tab, sh, err, st);
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
