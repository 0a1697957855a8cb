// One-row FP8 block-scaled projection (batch-1 decode), the contract of fp8_gemv.fp8_row_gemv
// (that module's docstring gives the modes and the numerics), written for memory-level
// parallelism: the Triton kernel holds one or two warps per scheduler and reads its weights no
// faster from L2 than from HBM (docs/PERF.md session 20), so it is bound by its own latency.
//
// y[n] = sum_k w[n, k] * a[k], a[k] = the activation's value at k times the weight's block scale
// sw[n / 128, k / 128] (a power of two: exact). A CTA owns ROWS = RG * RW rows (inside one
// 128-row scale block and one group) and all of K:
//   1. its warps write a[0 .. K) of its group to shared memory, one 128-block per warp at a time
//      (mode 0 rounds x to e4m3 with act_quant's power-of-two scale, as the Triton kernel does);
//   2. warp (g, kw) streams rows g RW .. g RW + RW - 1 over the 512-byte chunks j = kw, kw + KW,
//      ...: each lane loads 16 weight bytes of every row for U chunks at once (U RW 16-byte loads
//      in flight), decodes pairs with the hardware's e4m3x2 -> f16x2 conversion (exact) and
//      accumulates fp32 products (each exact: a 4-bit by an at most 8-bit significand);
//   3. each row's lane sums are reduced across the warp, then across the KW warps in kw order.
// Every term is the Triton kernel's; only the order of the fp32 sums differs (both within
// tests/test_fp8_gemv.py's bound), and the order is fixed, so a run repeats bit for bit.
//
// Compiled at run time by NVRTC (torch.cuda._compile_kernel) with -DRW, -DRG, -DKW, -DU: no
// headers, plain C types.

typedef unsigned int u32;
typedef unsigned short u16;

#ifndef RW
#define RW 4
#endif
#ifndef RG
#define RG 4
#endif
#ifndef KW
#define KW 2
#endif
#ifndef U
#define U 2
#endif
#define WARPS (RG * KW)
#define ROWS (RG * RW)

__device__ __forceinline__ void e4m3x2_to_f32(u16 v, float& lo, float& hi) {
    asm("{.reg .b32 h2; .reg .b16 l16, h16;\n"
        " cvt.rn.f16x2.e4m3x2 h2, %2;\n"
        " mov.b32 {l16, h16}, h2;\n"
        " cvt.f32.f16 %0, l16;\n"
        " cvt.f32.f16 %1, h16;}"
        : "=f"(lo), "=f"(hi) : "h"(v));
}

__device__ __forceinline__ u16 f32x2_to_e4m3x2(float lo, float hi) {
    u16 out;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(out) : "f"(hi), "f"(lo));
    return out;
}

__device__ __forceinline__ float bf16_to_f32(u16 b) { return __int_as_float(((u32)b) << 16); }

__device__ __forceinline__ u16 f32_to_bf16_rn(float f) {
    u16 out;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(f));
    return out;
}

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// 2^k for an int k in fp32's normal range
__device__ __forceinline__ float exp2i(int k) { return __int_as_float((k + 127) << 23); }

// acc += the 16 weights of w (e4m3 bytes, low byte first) times a[0 .. 16)
__device__ __forceinline__ float dot16(uint4 w, const float* a, float acc) {
    const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float f0, f1, f2, f3;
        e4m3x2_to_f32((u16)(words[i] & 0xFFFFu), f0, f1);
        e4m3x2_to_f32((u16)(words[i] >> 16), f2, f3);
        acc = fmaf(f0, a[4 * i], acc);
        acc = fmaf(f1, a[4 * i + 1], acc);
        acc = fmaf(f2, a[4 * i + 2], acc);
        acc = fmaf(f3, a[4 * i + 3], acc);
    }
    return acc;
}

// Where column k (a multiple of 4) of the activations sits in shared memory: inside its 512-column
// chunk, float4 q = (k / 4) % 4 of lane l = (k / 16) % 32 at (32 q + l) x 4, so the warp's q-th
// float4 loads in step 2 are 32 consecutive float4.
__device__ __forceinline__ int a_at(int k) {
    return (k & ~511) + ((((k >> 2) & 3) * 32 + ((k >> 4) & 31)) << 2);
}

// mode: 0 x bf16 rounded here to e4m3 per 128-block (W8A8), 1 x e4m3 codes with fp32 scales xs
// (W8A8), 2 x bf16 as is (W8A16). y: bf16 (out_bf16) or fp32 [N]. K: a group's columns, a
// multiple of 512; x [groups * K]; group_rows: rows per group (N without groups).
extern "C" __global__ void __launch_bounds__(WARPS * 32) fp8_row_gemv_cu(
    const unsigned char* __restrict__ w, const float* __restrict__ ws, const void* __restrict__ x,
    const float* __restrict__ xs, void* __restrict__ y, int N, int K, int NB, int ws_sn,
    int group_rows, int mode, int out_bf16) {
    extern __shared__ float smem[];
    float* a = smem;                      // [K]: the group's activations times the weight scales
    float* red = smem + K;                // [KW][ROWS]: per-warp row sums
#if __CUDA_ARCH__ >= 900
    // Programmatic dependent launch (kernels/pdl.py): wait for the kernel before this one (it
    // writes x), then let the next one be scheduled. A no-op without the PDL attribute.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = blockIdx.x * ROWS;
    const int group = row0 / group_rows;
    const float* sw = ws + (size_t)(row0 >> 7) * ws_sn;

    // 1. a[k] for k in [0, K): warp per 128-block, lane per 4 elements
    for (int kb = warp; kb < (K >> 7); kb += WARPS) {
        const int k = (kb << 7) + 4 * lane;
        const size_t xk = (size_t)group * K + k;
        float v[4];
        float scale = sw[kb];
        if (mode == 1) {
            const u32 c = *(const u32*)((const unsigned char*)x + xk);
            e4m3x2_to_f32((u16)(c & 0xFFFFu), v[0], v[1]);
            e4m3x2_to_f32((u16)(c >> 16), v[2], v[3]);
            scale *= xs[(size_t)group * NB + kb];
        } else {
            const uint2 b = *(const uint2*)((const u16*)x + xk);
            v[0] = bf16_to_f32((u16)(b.x & 0xFFFFu));
            v[1] = bf16_to_f32((u16)(b.x >> 16));
            v[2] = bf16_to_f32((u16)(b.y & 0xFFFFu));
            v[3] = bf16_to_f32((u16)(b.y >> 16));
        }
        if (mode == 0) {   // act_quant_fp8: s = 2^ceil(log2(max(amax, 1e-4) / 448)), codes of x / s
            float m = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
            for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
            const int bits = __float_as_int(fmaxf(m, 1e-4f));
            const int kx = ((bits >> 23) & 255) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000);
            const float inv = exp2i(-kx);
#pragma unroll
            for (int i = 0; i < 4; i += 2) {
                const u16 c = f32x2_to_e4m3x2(fminf(fmaxf(v[i] * inv, -448.f), 448.f),
                                              fminf(fmaxf(v[i + 1] * inv, -448.f), 448.f));
                e4m3x2_to_f32(c, v[i], v[i + 1]);
            }
            scale *= exp2i(kx);
        }
        // stored lane-major inside each 512-column chunk (a_at), so that step 2's loads of
        // the four float4 a lane needs are contiguous across the warp: no bank conflicts
        *(float4*)(a + a_at(k)) = make_float4(v[0] * scale, v[1] * scale, v[2] * scale, v[3] * scale);
    }
    __syncthreads();

    // 2. stream the rows
    const int g = warp / KW, kw = warp % KW;
    const int r0 = row0 + g * RW;
    const int nchunk = K >> 9;
    float acc[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) acc[r] = 0.f;
    const unsigned char* wrow = w + (size_t)r0 * K + 16 * lane;
    for (int j = kw; j < nchunk; j += KW * U) {
        uint4 wv[U][RW];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int jj = j + u * KW;
#pragma unroll
            for (int r = 0; r < RW; ++r)
                wv[u][r] = (jj < nchunk && r0 + r < N)
                    ? load_stream((const uint4*)(wrow + (size_t)r * K + ((size_t)jj << 9)))
                    : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int jj = j + u * KW;
            if (jj < nchunk) {
                // the lane's 16 activations (columns jj 512 + 16 lane + 0 .. 15)
                float av[16];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float4 t = *(const float4*)(a + a_at((jj << 9) + 16 * lane + 4 * q));
                    av[4 * q] = t.x; av[4 * q + 1] = t.y; av[4 * q + 2] = t.z; av[4 * q + 3] = t.w;
                }
#pragma unroll
                for (int r = 0; r < RW; ++r) acc[r] = dot16(wv[u][r], av, acc[r]);
            }
        }
    }

    // 3. reduce: across the warp, then across its KW warps in order
#pragma unroll
    for (int r = 0; r < RW; ++r) {
#pragma unroll
        for (int o = 16; o; o >>= 1) acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], o);
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RW; ++r) red[kw * ROWS + g * RW + r] = acc[r];
    }
    __syncthreads();
    if (threadIdx.x < ROWS && row0 + (int)threadIdx.x < N) {
        float s = 0.f;
#pragma unroll
        for (int q = 0; q < KW; ++q) s += red[q * ROWS + threadIdx.x];
        const int n = row0 + threadIdx.x;
        if (out_bf16) ((u16*)y)[n] = f32_to_bf16_rn(s);
        else ((float*)y)[n] = s;
    }
}
