/* LoRA's dropout kernels for lit_qlora.lora (lit_qlora/lora/dropout.py): the hash-mask dropout, and dropout fused
   with the down projection, forward and backward. lit_qlora/lora/native.py compiles this file on first use (NF4's
   build, lit_qlora.nf4.native.build_library, with lit_qlora/nf4/simd.h copied beside it); dropout.py checks it
   against the PyTorch ops before it is trusted and calls it through ctypes. */
#include "simd.h"

int lora_has_f16(void) { return HAS_F16; }

/* ---- LoRA dropout (lit_qlora/lora/dropout.py):
   dst[i] = keep(i) ? round(src[i] * scale) : 0 over elements [e0, e1), keep(i) = mix(i * 0x9E3779B1 + seed) >=
   threshold, mix = lowbias32 (xorshift-multiply). A counter-based mask: backward regenerates it from the seed. */
static inline v16u mix16(v16u h) {
    h ^= h >> 16; h *= 0x7feb352du; h ^= h >> 15; h *= 0x846ca68bu; h ^= h >> 16;
    return h;
}
static inline uint32_t mix1(uint32_t h) {
    h ^= h >> 16; h *= 0x7feb352du; h ^= h >> 15; h *= 0x846ca68bu; h ^= h >> 16;
    return h;
}
void lora_dropout(const void* src, void* dst, int64_t e0, int64_t e1, uint32_t seed, uint32_t threshold,
                  float scale, int32_t fmt) {
    const v16u lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16u thr = (v16u){0} + threshold;
    int64_t i = e0;
    for (; i + 16 <= e1; i += 16) {
        v16u keep = (v16u)(mix16(((uint32_t)i + lane) * 0x9E3779B1u + seed) >= thr);
        v16f x = load16(src, i, fmt) * scale;
        if (fmt == 0) {
            v16w o = __builtin_convertvector(bf16_bits(x) & keep, v16w);
            memcpy((uint16_t*)dst + i, &o, 32);
#if HAS_F16
        } else if (fmt == 1) {
            v16w o = __builtin_convertvector(f16_bits(x) & keep, v16w);
            memcpy((uint16_t*)dst + i, &o, 32);
#endif
        } else {
            v16u u; memcpy(&u, &x, 64); u &= keep;
            memcpy((float*)dst + i, &u, 64);
        }
    }
    for (; i < e1; ++i) {
        int keep = mix1((uint32_t)i * 0x9E3779B1u + seed) >= threshold;
        float x = keep ? load1(src, i, fmt) * scale : 0.0f;
        if (fmt == 0) ((uint16_t*)dst)[i] = bf16_bits1(x);
#if HAS_F16
        else if (fmt == 1) ((_Float16*)dst)[i] = (_Float16)x;
#endif
        else ((float*)dst)[i] = x;
    }
}

/* ---- LoRA's dropout fused with its down projection (lit_qlora/lora/dropout.py), for n adapters that read the
   same x (rows x cols, storage fmt), each with its own seed: xm_q[t, j] = keep_q(t * cols + j) ? x[t, j] * scale
   : 0, keep as in lora_dropout above. No dropped copy of x is written: it costs a pass over memory and, freshly
   allocated, page faults, more than the hash and the r-wide products together (issue 16).
   lora_drop_down:     h_q[t, :] = xm_q[t, :] @ A_q^T  for rows [t0, t1)      A_q like x (r, cols), h_q fp32 (rows, r)
   lora_drop_down_bwd: gA_q[:, j] = gh_q^T @ xm_q[:, j]  for columns [j0, j1)  gh_q, gA_q fp32
                       gx[:, j] = (acc ? gx[:, j] : 0) + sum_q keep_q * scale * (gh_q @ A_q[:, j])   (storage fmt)
   Columns are the backward's unit of work: a thread owns its columns of every gA and of gx, so nothing is
   reduced across threads; a tile of rows at a time, so x's strided reads stay within a few pages. */
/* h: (i + lane) * 0x9E3779B1 + seed for the 16 elements from i; the callers step it by additions (one multiply
   fewer per vector: the hash is most of these kernels' work). */
static inline v16u hash_start(int64_t i, uint32_t seed) {
    const v16u lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return ((uint32_t)i + lane) * 0x9E3779B1u + seed;
}
static inline v16f drop16(const void* x, int64_t i, v16u h, v16u thr, float scale, int fmt, v16u* keep) {
    *keep = (v16u)(mix16(h) >= thr);
    v16f v = load16(x, i, fmt) * scale;
    v16u u; memcpy(&u, &v, 64); u &= *keep; memcpy(&v, &u, 64);
    return v;
}
static inline int keep1(int64_t i, uint32_t seed, uint32_t thr) {
    return mix1((uint32_t)i * 0x9E3779B1u + seed) >= thr;
}
static inline void store16(void* dst, int64_t i, v16f v, int fmt) {
#if defined(__AVX512BF16__)
    /* the instruction rounds to nearest-even as bf16_bits does (NaN payloads and fp32 denormals aside: those it
       keeps quiet and flushes); a gradient store, where a third of the backward's time went to rounding by hand */
    if (fmt == 0) { __m256bh o = _mm512_cvtneps_pbh((__m512)v); memcpy((uint16_t*)dst + i, &o, 32); return; }
#endif
    if (fmt == 0) { v16w o = __builtin_convertvector(bf16_bits(v), v16w); memcpy((uint16_t*)dst + i, &o, 32); }
#if HAS_F16
    else if (fmt == 1) { v16w o = __builtin_convertvector(f16_bits(v), v16w); memcpy((uint16_t*)dst + i, &o, 32); }
#endif
    else memcpy((float*)dst + i, &v, 64);
}
static inline void store1(void* dst, int64_t i, float v, int fmt) {
    if (fmt == 0) ((uint16_t*)dst)[i] = bf16_bits1(v);
#if HAS_F16
    else if (fmt == 1) ((_Float16*)dst)[i] = (_Float16)v;
#endif
    else ((float*)dst)[i] = v;
}
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
static inline float hsum16(v16f v) {  /* a tree: a lane-by-lane sum is 16 dependent adds */
    v8f lo, hi; memcpy(&lo, &v, 32); memcpy(&hi, (char*)&v + 32, 32);
    v8f s8 = lo + hi;
    v4f l4, h4; memcpy(&l4, &s8, 16); memcpy(&h4, (char*)&s8 + 16, 16);
    v4f s4 = l4 + h4;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}
/* Columns [j0, j1) of rows t and t + 1 (u = 0: t alone), one adapter, ranks [0, kn), kn <= 8: a constant where
   inlined, so the two rows' accumulators and the ranks' A vectors all stay registers (one load of A serves two
   rows: on 512-bit vectors loads, not FMAs, bound the one-row loop). Adds to H[0:kn] and H[r:r + kn]. */
static inline __attribute__((always_inline)) void down_rows(const void* x, int64_t t, int u, int64_t j0, int64_t j1,
        int64_t cols, const void* A, float* H, int64_t r, uint32_t seed, v16u thr, uint32_t threshold, float scale,
        int fmt, const int kn) {
    v16f acc0[8], acc1[8];
    float tail0[8], tail1[8];
    for (int k = 0; k < kn; ++k) { acc0[k] = acc1[k] = (v16f){0}; tail0[k] = tail1[k] = 0.0f; }
    const int64_t base0 = t * cols, base1 = (t + u) * cols;
    int64_t j = j0;
    v16u keep, h0 = hash_start(base0 + j0, seed), h1 = hash_start(base1 + j0, seed);
    const uint32_t step16 = 16u * 0x9E3779B1u;
#if defined(__AVX512BF16__)
    /* bf16 x and A: the dropped x rounded to bf16 (as a dropped bf16 copy would be), then bf16 pair products
       summed in fp32 (vdpbf16ps): half the instructions of fp32 FMAs, the arithmetic of a bf16 matmul. */
    if (fmt == 0) {
        for (; j + 32 <= j1; j += 32, h0 += 2 * step16, h1 += 2 * step16) {
            v16f a0 = drop16(x, base0 + j, h0, thr, scale, fmt, &keep);
            v16f b0 = drop16(x, base0 + j + 16, h0 + step16, thr, scale, fmt, &keep);
            __m512bh x0 = _mm512_cvtne2ps_pbh((__m512)b0, (__m512)a0), x1 = x0;
            if (u) {
                v16f a1 = drop16(x, base1 + j, h1, thr, scale, fmt, &keep);
                v16f b1 = drop16(x, base1 + j + 16, h1 + step16, thr, scale, fmt, &keep);
                x1 = _mm512_cvtne2ps_pbh((__m512)b1, (__m512)a1);
            }
            for (int k = 0; k < kn; ++k) {
                __m512bh w;
                memcpy(&w, (const uint16_t*)A + k * cols + j, 64);
                acc0[k] = (v16f)_mm512_dpbf16_ps((__m512)acc0[k], x0, w);
                if (u) acc1[k] = (v16f)_mm512_dpbf16_ps((__m512)acc1[k], x1, w);
            }
        }
    }
#endif
    for (; j + 16 <= j1; j += 16, h0 += step16, h1 += step16) {
        v16f x0 = drop16(x, base0 + j, h0, thr, scale, fmt, &keep);
        v16f x1 = u ? drop16(x, base1 + j, h1, thr, scale, fmt, &keep) : (v16f){0};
        for (int k = 0; k < kn; ++k) {
            v16f w = load16(A, k * cols + j, fmt);
            acc0[k] += x0 * w;
            if (u) acc1[k] += x1 * w;
        }
    }
    for (; j < j1; ++j) {
        float x0 = keep1(base0 + j, seed, threshold) ? load1(x, base0 + j, fmt) * scale : 0.0f;
        float x1 = u && keep1(base1 + j, seed, threshold) ? load1(x, base1 + j, fmt) * scale : 0.0f;
        for (int k = 0; k < kn; ++k) {
            float w = load1(A, k * cols + j, fmt);
            tail0[k] += x0 * w;
            tail1[k] += x1 * w;
        }
    }
    for (int k = 0; k < kn; ++k) {
        H[k] += hsum16(acc0[k]) + tail0[k];
        if (u) H[r + k] += hsum16(acc1[k]) + tail1[k];
    }
}
#define LORA_JC 512  /* columns per pass of the forward: 8 ranks' A rows of them (16 KB) stay in L1 over the rows */
void lora_drop_down(const void* x, int64_t cols, int64_t t0, int64_t t1, int32_t n, const int64_t* a, int64_t r,
                    const int64_t* h, const int64_t* seeds, uint32_t threshold, float scale, int32_t fmt) {
    const v16u thr = (v16u){0} + threshold;
    for (int32_t q = 0; q < n; ++q) {
        const char* A = (const char*)a[q];
        float* H = (float*)h[q];
        const int64_t size = fmt == 2 ? 4 : 2;
        const uint32_t seed = (uint32_t)seeds[q];
        for (int64_t t = t0; t < t1; ++t)
            for (int64_t k = 0; k < r; ++k) H[t * r + k] = 0.0f;
        for (int64_t k0 = 0; k0 < r; k0 += 8) {
            const int64_t kn = r - k0 < 8 ? r - k0 : 8;
            const void* Ak = A + k0 * cols * size;
            for (int64_t c0 = 0; c0 < cols; c0 += LORA_JC) {
                const int64_t c1 = c0 + LORA_JC < cols ? c0 + LORA_JC : cols;
                for (int64_t t = t0; t < t1; t += 2) {
                    const int u = t + 1 < t1;
                    float* Ht = H + t * r + k0;
                    if (kn == 8 && u) down_rows(x, t, 1, c0, c1, cols, Ak, Ht, r, seed, thr, threshold, scale, fmt, 8);
                    else down_rows(x, t, u, c0, c1, cols, Ak, Ht, r, seed, thr, threshold, scale, fmt, (int)kn);
                }
            }
        }
    }
}
/* One 16-column vector of rows [t0, t1) (at most LORA_TB), one adapter, ranks [0, kn) (A, G and GA start at the
   block's first rank; G's rows are r apart): the ranks' gA sums and A values are registers over the tile's rows;
   the tile's gx terms are added to gsum. A is stored like x, G in fp32 (broadcast from memory, not converted). */
static inline __attribute__((always_inline)) void down_bwd_vec(const void* x, int64_t cols, int64_t t0, int64_t t1,
        int64_t j, const char* A, const float* G, int64_t r, float* GA, uint32_t seed, v16u thr, float scale,
        int fmt, v16f* gsum, const int kn) {
    v16f a[8], s[8];
    for (int k = 0; k < kn; ++k) { a[k] = load16(A, k * cols + j, fmt); s[k] = (v16f){0}; }
    v16u keep, h = hash_start(t0 * cols + j, seed);
    const uint32_t step = (uint32_t)cols * 0x9E3779B1u;
    for (int64_t t = t0; t < t1; ++t, h += step) {
        v16f xm = drop16(x, t * cols + j, h, thr, scale, fmt, &keep);
        const float* g = G + t * r;
        v16f d = {0}, e = {0};  /* two chains: the sum over ranks is a row's longest dependency */
        for (int k = 0; k < kn; ++k) {
            const float gk = g[k];
            s[k] += gk * xm;
            if (k & 1) e += gk * a[k]; else d += gk * a[k];
        }
        d += e;
        v16u du; memcpy(&du, &d, 64); du &= keep; memcpy(&d, &du, 64);
        gsum[t - t0] += d * scale;
    }
    for (int k = 0; k < kn; ++k) {
        v16f ga; memcpy(&ga, GA + k * cols + j, 64); ga += s[k]; memcpy(GA + k * cols + j, &ga, 64);
    }
}
#define LORA_TB 32  /* rows per tile of the backward */
void lora_drop_down_bwd(const void* x, int64_t rows, int64_t cols, int64_t j0, int64_t j1, int32_t n,
                        const int64_t* a, int64_t r, const int64_t* gh, const int64_t* ga, void* gx, int32_t acc,
                        const int64_t* seeds, uint32_t threshold, float scale, int32_t fmt) {
    const v16u thr = (v16u){0} + threshold;
    const int64_t size = fmt == 2 ? 4 : 2;
    const int64_t jv = j0 + ((j1 - j0) & ~(int64_t)15);  /* whole vectors end here; the rest is scalar */
    for (int64_t t0 = 0; t0 < rows; t0 += LORA_TB) {
        const int64_t t1 = t0 + LORA_TB < rows ? t0 + LORA_TB : rows;
        for (int64_t j = j0; j < jv; j += 16) {
            v16f gsum[LORA_TB];
            for (int64_t t = t0; t < t1; ++t) gsum[t - t0] = (v16f){0};
            for (int32_t q = 0; q < n; ++q) {
                const char* A = (const char*)a[q];
                const float* G = (const float*)gh[q];
                float* GA = (float*)ga[q];
                const uint32_t seed = (uint32_t)seeds[q];
                for (int64_t k0 = 0; k0 < r; k0 += 8) {
                    const int64_t kn = r - k0 < 8 ? r - k0 : 8;
                    const char* Ak = A + k0 * cols * size;
                    const float* Gk = G + k0;
                    float* GAk = GA + k0 * cols;
                    /* each rank block hashes again and adds its own ranks' gx terms */
                    if (kn == 8) down_bwd_vec(x, cols, t0, t1, j, Ak, Gk, r, GAk, seed, thr, scale, fmt, gsum, 8);
                    else down_bwd_vec(x, cols, t0, t1, j, Ak, Gk, r, GAk, seed, thr, scale, fmt, gsum, (int)kn);
                }
            }
            if (!gx) continue;
            for (int64_t t = t0; t < t1; ++t) {
                v16f o = gsum[t - t0];
                if (acc) o += load16(gx, t * cols + j, fmt);
                store16(gx, t * cols + j, o, fmt);
            }
        }
        for (int64_t t = t0; t < t1; ++t) {  /* the columns past the last whole vector */
            for (int64_t j = jv; j < j1; ++j) {
                float o = 0.0f;
                for (int32_t q = 0; q < n; ++q) {
                    const uint32_t seed = (uint32_t)seeds[q];
                    if (!keep1(t * cols + j, seed, threshold)) continue;
                    float* GA = (float*)ga[q];
                    float xm = load1(x, t * cols + j, fmt) * scale, d = 0.0f;
                    for (int64_t k = 0; k < r; ++k) {
                        const float gk = ((const float*)gh[q])[t * r + k];
                        GA[k * cols + j] += gk * xm;
                        d += gk * load1((const void*)a[q], k * cols + j, fmt);
                    }
                    o += d * scale;
                }
                if (gx) store1(gx, t * cols + j, o + (acc ? load1(gx, t * cols + j, fmt) : 0.0f), fmt);
            }
        }
    }
}

/* ---- Threaded entry points: the kernels above over [lo, hi) on torch's OpenMP team (simd.h's my_share). */
void lora_dropout_mt(int32_t threads, const void* src, void* dst, int64_t e0, int64_t e1, uint32_t seed,
                     uint32_t threshold, float scale, int32_t fmt) {
    #pragma omp parallel num_threads(threads)
    { int64_t a, b; my_share(e0, e1, 1 << 14, &a, &b); if (a < b) lora_dropout(src, dst, a, b, seed, threshold, scale, fmt); }
}

/* rows in steps of 32 (the kernel blocks rows in pairs) */
void lora_drop_down_mt(int32_t threads, const void* x, int64_t cols, int64_t t0, int64_t t1, int32_t n,
                       const int64_t* a, int64_t r, const int64_t* h, const int64_t* seeds, uint32_t threshold,
                       float scale, int32_t fmt) {
    #pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi; my_share(t0, t1, 32, &lo, &hi);
        if (lo < hi) lora_drop_down(x, cols, lo, hi, n, a, r, h, seeds, threshold, scale, fmt);
    }
}

/* columns in steps of 16, so each thread's columns start on a whole vector */
void lora_drop_down_bwd_mt(int32_t threads, const void* x, int64_t rows, int64_t cols, int64_t j0, int64_t j1,
                           int32_t n, const int64_t* a, int64_t r, const int64_t* gh, const int64_t* ga, void* gx,
                           int32_t acc, const int64_t* seeds, uint32_t threshold, float scale, int32_t fmt) {
    #pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi; my_share(j0, j1, 16, &lo, &hi);
        if (lo < hi) lora_drop_down_bwd(x, rows, cols, lo, hi, n, a, r, gh, ga, gx, acc, seeds, threshold, scale, fmt);
    }
}
