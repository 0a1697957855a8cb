// Routed FP4 (e2m1) experts at decode sizes on the tensor cores, with weights stored in MMA
// fragment order (dsv4_backend/kernels/fp4_mma.py says why, and how the order is built).
//
// part[split, pair, n] = sum over this split's K of act[pair / row_div] . w[e][n], e = ids[pair],
// for every pair whose expert is valid; fp32, the contract of fp4_moe_decode.fp4_gemv.
//
// One warp owns one 16-row weight tile of one expert and streams it over its K split; a CTA is
// four such warps (64 rows). CTA (x, pair b, split) runs only when b is the first pair routed to
// its expert, and then serves every pair of that expert, eight at a time (the MMA's N side).
//
// Per 32-deep scale group a lane holds two 32-bit words of weights (eight e2m1 nibbles each, one
// m16n8k16 A fragment) and eight e4m3 activation bytes (two B fragments). Each nibble becomes an
// fp16 by moving its bits (value x 2^-14), each activation pair by the hardware's e4m3x2 -> f16x2
// conversion (exact). The two MMAs of a group sum 32 exact products in fp32; the group's sum is
// then multiplied by the weight scale 2^(s - 127) times 2^14 (exact: a power of two), and each
// 128-deep chunk's sum by the activation's 1x128 scale.
//
// Compiled at run time by NVRTC (torch.cuda._compile_kernel): no headers, plain C types.

typedef unsigned int u32;

__device__ __forceinline__ u32 f16x2_from_e4m3x2(unsigned short v) {
    u32 out;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(v));
    return out;
}

// A packed word -> the four fp16x2 A registers of its eight e2m1 weights. Each register's low /
// high half is an fp16 of (value x 2^-14): sign at bit 15 / 31, the code's e1 e0 m at bits
// 11..9 / 27..25. The packing (fp4_mma.py) places register 0's bits there already, register 1's
// three bits lower, and registers 2 and 3 with their signs apart from their magnitudes, so the
// four cost 1 + 2 + 4 + 4 operations.
__device__ __forceinline__ void dequant_word(u32 w, u32* a) {
    a[0] = w & 0x8E008E00u;
    a[1] = (w << 3) & 0x8E008E00u;
    a[2] = ((w << 6) & 0x0E000E00u) | ((w << 1) & 0x80008000u);
    a[3] = ((w << 9) & 0x0E000E00u) | ((w << 2) & 0x80008000u);
}

__device__ __forceinline__ void mma_16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The weight scale of group G of a chunk, 2^(s - 127) x 2^14, from the word of the row's four
// scale bytes, each stored as s + 14 (fp4_mma.py; s <= 240): the byte moved into an fp32's
// exponent field.
template <int G>
__device__ __forceinline__ float group_scale(u32 bytes) {
    return __int_as_float((int)((G < 3 ? bytes << (23 - 8 * G) : bytes >> 1) & 0x7F800000u));
}

__device__ __forceinline__ int pair_expert(const void* ids, int ids64, int j) {
    return ids64 ? (int)((const long long*)ids)[j] : ((const int*)ids)[j];
}

#ifndef PREFETCH
#define PREFETCH 1  // 1 KiB weight chunks in flight per warp while one is multiplied
#endif

#ifndef NB
#define NB 4  // MMA column groups (of eight pairs) that share each dequantised weight fragment
#endif
#define PASS (8 * NB)  // pairs per pass over the weights

// The K loop of one warp for one pass: up to PASS pairs (cols[0 .. n)), ceil(n / 8) MMA column
// groups, each weight chunk dequantised once for all of them.
__device__ __forceinline__ void tile_pairs(
    const uint4* __restrict__ wtile, const u32* __restrict__ stile,
    const unsigned char* __restrict__ act, const float* __restrict__ act_s, float* __restrict__ part,
    const int* cols, int n, int row_div, int N, int K, int P, int row0, int c_lo, int c_hi, int split,
    int lane) {
    const int g = lane >> 2, tig = lane & 3;
    const int KS = K >> 7;
    const int groups = (n + 7) >> 3;
    // per column group: this lane's B column (pair cols[8 q + g]) and its two C columns
    const unsigned char* arow[NB];
    const float* s0row[NB];
    const float* s1row[NB];
#pragma unroll
    for (int q = 0; q < NB; ++q) {
        const int ib = min(8 * q + g, n - 1), i0 = min(8 * q + 2 * tig, n - 1), i1 = min(8 * q + 2 * tig + 1, n - 1);
        arow[q] = act + (size_t)(cols[ib] / row_div) * K + 8 * tig;
        s0row[q] = act_s + (size_t)(cols[i0] / row_div) * KS;
        s1row[q] = act_s + (size_t)(cols[i1] / row_div) * KS;
    }

    float acc[NB][4];
#pragma unroll
    for (int q = 0; q < NB; ++q) acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = 0.f;
    // the weights and scales of the next PREFETCH chunks are in flight while a chunk is multiplied
    uint4 wbuf[PREFETCH][2];
    u32 sbuf[PREFETCH][2];
#pragma unroll
    for (int i = 0; i < PREFETCH; ++i) {
        const int ci = min(c_lo + i, c_hi - 1);
        wbuf[i][0] = wtile[(size_t)ci * 64 + 2 * lane];
        wbuf[i][1] = wtile[(size_t)ci * 64 + 2 * lane + 1];
        sbuf[i][0] = stile[(size_t)ci * 16 + g];
        sbuf[i][1] = stile[(size_t)ci * 16 + g + 8];
    }
    for (int c0 = c_lo; c0 < c_hi; c0 += PREFETCH) {
#pragma unroll
    for (int i = 0; i < PREFETCH; ++i) {
        const int c = c0 + i;
        if (c >= c_hi) break;
        const uint4 wa = wbuf[i][0], wb = wbuf[i][1];
        const u32 slo = sbuf[i][0], shi = sbuf[i][1];
        if (c + PREFETCH < c_hi) {
            wbuf[i][0] = wtile[(size_t)(c + PREFETCH) * 64 + 2 * lane];
            wbuf[i][1] = wtile[(size_t)(c + PREFETCH) * 64 + 2 * lane + 1];
            sbuf[i][0] = stile[(size_t)(c + PREFETCH) * 16 + g];
            sbuf[i][1] = stile[(size_t)(c + PREFETCH) * 16 + g + 8];
        }
        const u32 words[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
        float chunk[NB][4];
#pragma unroll
        for (int q = 0; q < NB; ++q) chunk[q][0] = chunk[q][1] = chunk[q][2] = chunk[q][3] = 0.f;
#define GROUP(G)                                                                                   \
        {                                                                                          \
            u32 a0[4], a1[4];                                                                      \
            dequant_word(words[2 * G], a0);                                                        \
            dequant_word(words[2 * G + 1], a1);                                                    \
            const float sg = group_scale<G>(slo), sh = group_scale<G>(shi);                        \
            _Pragma("unroll") for (int q = 0; q < NB; ++q) {                                       \
                if (q < groups) {                                                                  \
                    const uint2 xa = *(const uint2*)(arow[q] + (size_t)c * 128 + 32 * G);          \
                    float t[4] = {0.f, 0.f, 0.f, 0.f};                                             \
                    mma_16816(t, a0[0], a0[1], a0[2], a0[3],                                       \
                              f16x2_from_e4m3x2((unsigned short)(xa.x & 0xFFFFu)),                 \
                              f16x2_from_e4m3x2((unsigned short)(xa.x >> 16)));                    \
                    mma_16816(t, a1[0], a1[1], a1[2], a1[3],                                       \
                              f16x2_from_e4m3x2((unsigned short)(xa.y & 0xFFFFu)),                 \
                              f16x2_from_e4m3x2((unsigned short)(xa.y >> 16)));                    \
                    chunk[q][0] += t[0] * sg;                                                      \
                    chunk[q][1] += t[1] * sg;                                                      \
                    chunk[q][2] += t[2] * sh;                                                      \
                    chunk[q][3] += t[3] * sh;                                                      \
                }                                                                                  \
            }                                                                                      \
        }
        GROUP(0) GROUP(1) GROUP(2) GROUP(3)
#undef GROUP
#pragma unroll
        for (int q = 0; q < NB; ++q) {
            if (q < groups) {
                const float x0 = s0row[q][c], x1 = s1row[q][c];
                acc[q][0] += chunk[q][0] * x0;
                acc[q][1] += chunk[q][1] * x1;
                acc[q][2] += chunk[q][2] * x0;
                acc[q][3] += chunk[q][3] * x1;
            }
        }
    }
    }
    float* base = part + (size_t)split * P * N;
#pragma unroll
    for (int q = 0; q < NB; ++q) {
        const int i0 = 8 * q + 2 * tig, i1 = i0 + 1;
        if (i0 < n) {
            base[(size_t)cols[i0] * N + row0 + g] = acc[q][0];
            base[(size_t)cols[i0] * N + row0 + g + 8] = acc[q][2];
        }
        if (i1 < n) {
            base[(size_t)cols[i1] * N + row0 + g] = acc[q][1];
            base[(size_t)cols[i1] * N + row0 + g + 8] = acc[q][3];
        }
    }
}

// CTA (x, b, split). Scan mode (routed == 0): b is a pair; the CTA runs only when b is the first
// pair routed to its expert, and then serves every pair of that expert, PASS at a time. Routed
// mode: b is a row block of fp4_moe.route(ids, E, PASS): up to PASS sorted pairs of one expert.
extern "C" __global__ void __launch_bounds__(128) fp4_mma_gemv(
    const uint4* __restrict__ wp, const u32* __restrict__ sp, const unsigned char* __restrict__ act,
    const float* __restrict__ act_s, const void* __restrict__ ids, float* __restrict__ part,
    int P, int E, int N, int K, int row_div, int ids64, int chunks_per_split, int routed,
    const long long* __restrict__ order, const long long* __restrict__ blk_e,
    const long long* __restrict__ blk_r0, const long long* __restrict__ offsets) {
    __shared__ int cols[4][PASS];
#if __CUDA_ARCH__ >= 900
    // Programmatic dependent launch (kernels/pdl.py): wait for the kernel before this one (it
    // writes ids and the activations), then let the next one be scheduled. A no-op when the
    // launch carried no PDL attribute.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int b = blockIdx.y, split = blockIdx.z;
    int e;
    if (routed) {
        e = (int)blk_e[b];
        if (e >= E) return;  // an unused block of the worst-case grid
    } else {
        e = pair_expert(ids, ids64, b);
        if (e < 0 || e >= E) return;
        bool earlier = false;
        for (int j = threadIdx.x; j < b; j += blockDim.x) earlier |= pair_expert(ids, ids64, j) == e;
        if (__syncthreads_or(earlier)) return;
    }
    const int NT = N >> 4, KC = K >> 7;
    const int tile = blockIdx.x * 4 + warp;
    if (tile >= NT) return;
    const int c_lo = split * chunks_per_split;
    const int c_hi = min(c_lo + chunks_per_split, KC);
    if (c_lo >= c_hi) return;
    const uint4* wtile = wp + (size_t)(e * NT + tile) * KC * 64;
    const u32* stile = sp + (size_t)(e * NT + tile) * KC * 16;
    const int row0 = tile * 16;

    if (routed) {
        const long long r0 = blk_r0[b];
        const int n = (int)min((long long)PASS, offsets[e + 1] - r0);
        for (int i = lane; i < n; i += 32) cols[warp][i] = (int)order[r0 + i];
        __syncwarp();
        if (n > 0)
            tile_pairs(wtile, stile, act, act_s, part, cols[warp], n, row_div, N, K, P, row0,
                       c_lo, c_hi, split, lane);
        return;
    }
    int cnt = 0;
    for (int j0 = b; j0 < P; j0 += 32) {
        const int j = j0 + lane;
        const bool hit = j < P && pair_expert(ids, ids64, j) == e;
        u32 m = __ballot_sync(0xFFFFFFFFu, hit);
        while (m) {
            const int room = PASS - cnt;
            const int rank = __popc(m & ((1u << lane) - 1u));
            if (((m >> lane) & 1u) && rank < room) cols[warp][cnt + rank] = j;
            const int placed = min(__popc(m), room);
            for (int i = 0; i < placed; ++i) m &= m - 1u;
            cnt += placed;
            __syncwarp();
            if (cnt == PASS) {
                tile_pairs(wtile, stile, act, act_s, part, cols[warp], PASS, row_div, N, K, P,
                           row0, c_lo, c_hi, split, lane);
                cnt = 0;
                __syncwarp();
            }
        }
    }
    if (cnt > 0)
        tile_pairs(wtile, stile, act, act_s, part, cols[warp], cnt, row_div, N, K, P, row0, c_lo,
                   c_hi, split, lane);
}
