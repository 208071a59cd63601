// megakernel (2/5): which weight tiles each block streams, in which order, and the producer thread that
// streams them (and the context's K/V chunks) into the shared-memory ring.

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

// The producer (one thread): every weight tile of this block, in order, into the ring; also the
// block's attention chunks of each layer, between the layer's q/k/v tiles and the rest.
__device__ void produce(const long long* tab, Shared sh, u32* err, const Step& st) {
    const KvChunks kc = kv_chunks(tab, st);
    int kv_layer = -1;  // the last layer whose chunks are issued
    Cursor cp = first_tile();
    for (u32 it = 0; !cp.done(); ++it, cp.next()) {
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

