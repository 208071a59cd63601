"""Lane-by-lane emulation of megakernel.cu's ATTN_MMA attention chunks (the tensor-core path, not yet run on a GPU) in
numpy, with mma.sync m16n8k16's fragment layout as the PTX ISA documents it, against softmax(q kᵀ / √D) v in float64: a
check of the kernel's indexing (fragments, the online softmax across chunks, P's transpose through shared memory, the
alpha shuffles, P as bf16 hi + lo) before a GPU run. It mirrors the kernel's code by hand, so it does not replace
the GPU tests.

Usage: python benchmarks/megakernel_mma_emulation.py   (prints max |Δ| per case; a few minutes on the CPU)
"""
import numpy as np
rng = np.random.default_rng(0)

def bf(x):  # round to bf16 (nearest even), as float32
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return u.view(np.float32)

def mma(A_frag, B_frag, C_frag):
    """A_frag[lane] = 4 pairs, B_frag[lane] = 2 pairs, C_frag[lane] = 4 floats → new C_frag (m16n8k16 layout)."""
    A = np.zeros((16, 16)); B = np.zeros((16, 8)); C = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a = A_frag[lane]
        A[g, 2*t:2*t+2] = a[0]; A[g+8, 2*t:2*t+2] = a[1]; A[g, 2*t+8:2*t+10] = a[2]; A[g+8, 2*t+8:2*t+10] = a[3]
        b = B_frag[lane]
        B[2*t:2*t+2, g] = b[0]; B[2*t+8:2*t+10, g] = b[1]
        c = C_frag[lane]
        C[g, 2*t:2*t+2] = c[0:2]; C[g+8, 2*t:2*t+2] = c[2:4]
    Dm = A @ B + C
    return [np.array([Dm[l>>2, 2*(l&3)], Dm[l>>2, 2*(l&3)+1], Dm[(l>>2)+8, 2*(l&3)], Dm[(l>>2)+8, 2*(l&3)+1]]) for l in range(32)]

def run(G, D, n):
    Q = bf(rng.standard_normal((G, D))); K = bf(rng.standard_normal((n, D))); V = bf(rng.standard_normal((n, D)))
    scale = 1 / np.sqrt(D)
    lo, hi = 0, n
    chunks = (n + 31) // 32
    NEG = -np.inf
    def q_at(h, d): return Q[h, d] if h < G else 0.0
    qb = [[(np.array([q_at(l>>2, 16*s + 2*(l&3)), q_at(l>>2, 16*s + 2*(l&3)+1)]),
            np.array([q_at(l>>2, 16*s + 8 + 2*(l&3)), q_at(l>>2, 16*s + 9 + 2*(l&3))])) for s in range(D//16)] for l in range(32)]
    mh = [[NEG, NEG] for _ in range(32)]; lh = [[0.0, 0.0] for _ in range(32)]
    o = [np.zeros((D//8, 2)) for _ in range(32)]
    for c in range(chunks):
        first = lo + 32*c
        valid_key = lambda k: k < hi
        row = lambda k: K[min(k, n-1)] if k < n else K[0]
        vrow = lambda k: V[k] if k < n else V[0]
        sc = [[np.zeros(4) for _ in range(2)] for _ in range(32)]
        for t in range(2):
            C = [np.zeros(4) for _ in range(32)]
            for s in range(D//16):
                Af = []
                for l in range(32):
                    g, ti = l >> 2, l & 3
                    k0, k1 = first + 16*t + g, first + 16*t + 8 + g
                    r0, r1 = (K[k0] if k0 < n else K[0]), (K[k1] if k1 < n else K[0])
                    Af.append([r0[16*s+2*ti:16*s+2*ti+2], r1[16*s+2*ti:16*s+2*ti+2], r0[16*s+8+2*ti:16*s+10+2*ti], r1[16*s+8+2*ti:16*s+10+2*ti]])
                C = mma(Af, [qb[l][s] for l in range(32)], C)
            for l in range(32): sc[l][t] = C[l]
        ps = np.zeros((32, 8))
        alpha = [[0.0, 0.0] for _ in range(32)]
        # per head j: lane-local then xor-shuffles over gid bits (emulated as a group reduction over lanes with equal tig)
        for j in range(2):
            v = [[None]*4 for _ in range(32)]; mx = [NEG]*32
            for l in range(32):
                g = l >> 2
                for q in range(4):
                    k = first + 16*(q>>1) + 8*(q&1) + g
                    v[l][q] = sc[l][q>>1][2*(q&1)+j] * scale if k < hi else NEG
                    mx[l] = max(mx[l], v[l][q])
            mxg = [max(mx[l2] for l2 in range(32) if (l2 & 3) == (l & 3)) for l in range(32)]
            sums = [0.0]*32
            for l in range(32):
                mn = max(mh[l][j], mxg[l]); alpha[l][j] = 0.0 if mh[l][j] == NEG else np.exp(mh[l][j] - mn)
                g, ti = l >> 2, l & 3
                for q in range(4):
                    p = 0.0 if v[l][q] == NEG else np.exp(v[l][q] - mn)
                    sums[l] += p
                    ps[16*(q>>1) + 8*(q&1) + g, 2*ti + j] = p
                mh[l][j] = mn
            sg = [sum(sums[l2] for l2 in range(32) if (l2 & 3) == (l & 3)) for l in range(32)]
            for l in range(32): lh[l][j] = lh[l][j]*alpha[l][j] + sg[l]
        for l in range(32):
            g = l >> 2
            src = g >> 1
            ag = alpha[src][g & 1]
            o[l] *= ag
        for u in range(2):
            Ah, Al = [], []
            for l in range(32):
                g, ti = l >> 2, l & 3
                hs, ls_ = [], []
                for h in range(2):
                    kk = 16*u + 2*ti + 8*h
                    p0, p1 = ps[kk, g], ps[kk+1, g]
                    h0, h1 = bf(p0), bf(p1)
                    hs.append(np.array([h0, h1])); ls_.append(np.array([bf(p0 - h0), bf(p1 - h1)]))
                Ah.append([hs[0], np.zeros(2), hs[1], np.zeros(2)]); Al.append([ls_[0], np.zeros(2), ls_[1], np.zeros(2)])
            for i in range(D//8):
                Bf = []
                for l in range(32):
                    g, ti = l >> 2, l & 3
                    d = 8*i + g
                    keys = [first + 16*u + 2*ti + (q & 1) + 8*(q >> 1) for q in range(4)]
                    vv = [vrow(k)[d] for k in keys]
                    Bf.append((np.array([vv[0], vv[1]]), np.array([vv[2], vv[3]])))
                C = [np.array([o[l][i][0], o[l][i][1], 0, 0]) for l in range(32)]
                C = mma(Ah, Bf, C); C = mma(Al, Bf, C)
                for l in range(32): o[l][i] = C[l][:2]
    out = np.zeros((G, D))
    for l in range(32):
        g, ti = l >> 2, l & 3
        if g < G:
            for i in range(D//8):
                out[g, 8*i + 2*ti] = o[l][i][0]; out[g, 8*i + 2*ti + 1] = o[l][i][1]
    L = np.zeros(G); M = np.zeros(G)
    for l in range(4):
        for j in range(2):
            if 2*l + j < G: L[2*l+j] = lh[l][j]; M[2*l+j] = mh[l][j]
    out = out / L[:, None]
    s = (Q.astype(np.float64) @ K.T.astype(np.float64)) * scale
    p = np.exp(s - s.max(1, keepdims=True)); p /= p.sum(1, keepdims=True)
    ref = p @ V
    return np.abs(out - ref).max(), np.abs(ref).max()

for G, D, n in [(6, 128, 32), (6, 128, 45), (8, 64, 70), (7, 64, 5), (2, 128, 96)]:
    err, scale = run(G, D, n)
    print(G, D, n, f"max|Δ| {err:.2e} of {scale:.2f}")
