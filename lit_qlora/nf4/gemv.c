/* NF4 decode kernel for lit_qlora.nf4.gemv: y[m, n] = x[m, k] @ dequant(W)[n, k]^T for a few rows of x (a decode
   step: one token per sequence), reading W's packed codes and int8 scalers and never writing its dense copy.
   Dequantizing a whole weight to multiply one row by it moves ~8x the bytes the product needs (a dense fp32 weight
   written, then read back, against 0.5 byte per weight read once).

   The weights are the values kernels.c's dequantize writes, bit for bit: per block the double-quantized scale
   s = round(round(qs / factor) + mean) (torchao's dequantize_scalers, each step rounded to the storage format),
   then a 16-entry table round(level * s), rounded once more to bf16 when x is bf16 (the dense bf16 weight the
   matmul it replaces reads). The products accumulate in float32; only their order differs from a matmul's.

   Three builds of this one file, chosen at run time by lit_qlora.nf4.gemv (the build's -march: native, or AVX2
   under the project's AVX2 cap, or a forced one): AVX-512 (a 16-entry table is one zmm; vpermps looks up 16 codes),
   AVX2 (two 8-entry ymm halves, looked up with vpermps and blended on the code's bit 3), and portable C (any
   layout; also the other builds' path for a layout whose rows are not whole blocks).

   The fast paths read a row's codes 16 bytes (AVX-512) or 8 bytes (AVX2) at a time: the high nibbles are the even
   elements, the low nibbles the odd ones. Rather than interleave the looked-up weights, x is reordered once per
   call into the same order (per group of 32 or 16 elements: its even elements, then its odd ones), shared by every
   output row. */
#include "simd.h"

int nf4_gemv_has_f16(void) { return HAS_F16; }

#if defined(__AVX512F__)
#define GROUP 32  /* elements per step of the fast path: 16 code bytes */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_DOT 1  /* bf16 x: the weights looked up as bf16 and multiplied by vdpbf16ps, 64 codes a step */
int nf4_gemv_isa(void) { return 3; }
#else
int nf4_gemv_isa(void) { return 2; }
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define GROUP 16  /* 8 code bytes */
int nf4_gemv_isa(void) { return 1; }
#else
#define GROUP 0   /* portable C only */
int nf4_gemv_isa(void) { return 0; }
#endif

#ifndef BF16_DOT
#define BF16_DOT 0
#endif
/* Whether the fast paths round to float16 in registers (AVX2 without F16C cannot: portable C does it then). */
#if defined(__AVX512F__) || defined(__F16C__)
#define F16_ROUNDS 1
#else
#define F16_ROUNDS 0
#endif

#define TILE 4  /* rows of x per pass over a weight row: their accumulators stay in registers */

typedef struct {
    const uint8_t* q;       /* packed codes, two a byte, the first element in the high nibble */
    const int8_t* qs;       /* one int8 scaler per block */
    const void* factor;     /* one per scaler group, storage format */
    float mean;             /* scaler_mean */
    int64_t n, k, bs, sbs;  /* rows, columns, elements per block, blocks per scaler group */
    int wfmt, tfmt;         /* storage format; the format the table is rounded to for x (2: none) */
} weight_t;

/* The 16-entry tables of blocks [b0, b0 + nb) into tab (16 floats a block): each block's scale as torchao's
   dequantize_scalers computes it (every step rounded to the storage format), then round(level * scale). The scales
   are computed 16 blocks at a time: their divisions are independent, so they pipeline where a block that computed its
   own table inside the product's loop waited on its division (the kernel ran at a quarter of its speed). */
#if defined(__AVX512F__)
static inline __m512 round512(__m512 x, int fmt) {
    if (fmt == 0) {  /* bf16, nearest-even, NaN -> 0x7FC0 (simd.h's bf16_bits) */
        __m512i u = _mm512_castps_si512(x);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd),
                                     _mm512_set1_epi32((int)0xFFFF0000u));
        __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000)));
    }
    if (fmt == 1) return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return x;
}
#elif defined(__AVX2__)
static inline __m256 round256(__m256 x, int fmt) {
    if (fmt == 0) {
        __m256i u = _mm256_castps_si256(x);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd),
                                     _mm256_set1_epi32((int)0xFFFF0000u));
        __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
        return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
    }
#if defined(__F16C__)
    if (fmt == 1) return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    return x;
}
#endif

/* One block's 16 entries, round(level * scale) to the storage format, then to the table's: in registers (gcc kept a
   64-byte vector extension on the stack here, a third of the kernel's time on AVX2). */
static inline void block_table(const float* lv, float s, int wfmt, int tfmt, float* out) {
#if defined(__AVX512F__)
    __m512 t = round512(_mm512_mul_ps(_mm512_loadu_ps(lv), _mm512_set1_ps(s)), wfmt);
    _mm512_storeu_ps(out, tfmt == wfmt ? t : round512(t, tfmt));
#elif defined(__AVX2__) && (defined(__F16C__) || !HAS_F16)
    for (int h = 0; h < 16; h += 8) {
        __m256 t = round256(_mm256_mul_ps(_mm256_loadu_ps(lv + h), _mm256_set1_ps(s)), wfmt);
        _mm256_storeu_ps(out + h, tfmt == wfmt ? t : round256(t, tfmt));
    }
#else
    v16f l; memcpy(&l, lv, 64);
    v16f t = round_to(l * s, wfmt);
    if (tfmt != wfmt) t = round_to(t, tfmt);
    memcpy(out, &t, 64);
#endif
}

#if BF16_DOT
/* The dot path's table of a block with scale s: 16 bf16 words in the low half of a zmm (vpermw reads indices 0-15
   there), computed in registers beside the product, whose loads of the codes it hides behind (computed apart, as
   the float path's tables are, they cost as much as the product). vcvtneps2bf16 rounds to nearest even as round512
   does, in one instruction. */
static inline __m512i table_bf16(__m512 lv, float s, int wfmt) {
    __m512 t = _mm512_mul_ps(lv, _mm512_set1_ps(s));
    if (wfmt == 1) t = round512(t, 1);  /* float16 storage: that rounding first, as dequantize's */
    return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(t));
}
#endif

static void block_tables(const weight_t* w, const float* lv, int64_t b0, int64_t nb, float* tab, int fast) {
    int64_t g = b0 / w->sbs, in_group = b0 % w->sbs;  /* the scaler group of block b0, and b0's place in it */
    for (int64_t j0 = 0; j0 < nb; j0 += 16) {
        const int cnt = nb - j0 < 16 ? (int)(nb - j0) : 16;
        v16f qv, fv;
#if defined(__AVX512F__)
        if (cnt == 16 && in_group + 16 <= w->sbs) {  /* the usual 16 blocks of one scaler group: no scalar loop */
            __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w->qs + b0 + j0))));
            memcpy(&qv, &q, 64);
            fv = (v16f){0} + load1(w->factor, g, w->wfmt);
            if ((in_group += 16) == w->sbs) { in_group = 0; ++g; }
        } else
#endif
        {
            float qf[16] = {0}, ff[16];
            for (int j = 0; j < 16; ++j) ff[j] = 1.0f;
            for (int j = 0; j < cnt; ++j) {
                qf[j] = (float)w->qs[b0 + j0 + j];
                ff[j] = load1(w->factor, g, w->wfmt);
                if (++in_group == w->sbs) { in_group = 0; ++g; }
            }
            memcpy(&qv, qf, 64); memcpy(&fv, ff, 64);
        }
        v16f s = round_to(round_to(qv / fv, w->wfmt) + w->mean, w->wfmt);
        if (fast && GROUP == 32) {  /* AVX-512's paths: the scales alone (each row makes its tables in registers) */
            memcpy(tab + j0, &s, cnt * sizeof(float));
            continue;
        }
        for (int j = 0; j < cnt; ++j) block_table(lv, s[j], w->wfmt, w->tfmt, tab + (j0 + j) * 16);
    }
}

/* ---- portable C: row r for x rows [i0, i0 + mt), any layout (a block may span rows, a row may start mid-byte);
   xp in natural order, tab the tables of the blocks from the one holding the row's first element. */
static void row_portable(const weight_t* w, const float* tab, const float* xp, int64_t i0, int mt, int64_t r,
                         float* sums) {
    float acc[TILE] = {0};
    const int64_t e0 = r * w->k, b0 = e0 / w->bs;
    for (int64_t e = e0; e < e0 + w->k; ++e) {
        float v = tab[(e / w->bs - b0) * 16 + ((w->q[e >> 1] >> ((e & 1) ? 0 : 4)) & 15)];
        const float* xc = xp + i0 * w->k + (e - e0);
        for (int i = 0; i < mt; ++i) acc[i] += v * xc[i * w->k];
    }
    for (int i = 0; i < mt; ++i) sums[i] = acc[i];
}

#if GROUP == 32
/* ---- AVX-512: a row of whole blocks of a multiple of 32 elements. One step: 32 codes at column c looked up in the
   block's table t, times each x row, into that row's pair of accumulators. */
static inline __attribute__((always_inline)) void step512(const __m512 t, const uint8_t* qr, int64_t c, const float* xp,
                                                          int64_t i0, const int mt, int64_t k, __m512* ae, __m512* ao) {
    __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qr + c / 2)));
    __m512 we = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), t);
    __m512 wo = _mm512_permutexvar_ps(_mm512_and_si512(d, _mm512_set1_epi32(15)), t);
    for (int i = 0; i < mt; ++i) {
        const float* xc = xp + (i0 + i) * k + c;
        ae[i] = _mm512_fmadd_ps(we, _mm512_loadu_ps(xc), ae[i]);
        ao[i] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(xc + 16), ao[i]);
    }
}

/* Steps two at a time into two pairs of accumulators: a row's FMAs form four chains instead of two, so a one-row
   tile (a decode step's usual) waits less on the FMA latency (2048x8192, one bf16 row: 938 -> 814 us). */
static inline __attribute__((always_inline)) void row_fast(const weight_t* w, const float* lv, const float* scales,
                                                           const float* xp, int64_t i0, const int mt, int64_t r,
                                                           float* sums) {
    const int64_t bpr = w->k / w->bs, steps = w->bs / GROUP;
    const __m512 l = _mm512_loadu_ps(lv);
    __m512 ae[TILE], ao[TILE], be[TILE], bo[TILE];
    for (int i = 0; i < mt; ++i) {
        ae[i] = _mm512_setzero_ps(); ao[i] = _mm512_setzero_ps(); be[i] = _mm512_setzero_ps(); bo[i] = ae[i];
    }
    const uint8_t* qr = w->q + r * (w->k / 2);
    for (int64_t j = 0; j < bpr; ++j) {
        __m512 t = round512(_mm512_mul_ps(l, _mm512_set1_ps(scales[j])), w->wfmt);  /* as block_table's */
        if (w->tfmt != w->wfmt) t = round512(t, w->tfmt);
        int64_t s = 0;
        for (; s + 1 < steps; s += 2) {
            step512(t, qr, (j * steps + s) * GROUP, xp, i0, mt, w->k, ae, ao);
            step512(t, qr, (j * steps + s + 1) * GROUP, xp, i0, mt, w->k, be, bo);
        }
        if (s < steps) step512(t, qr, (j * steps + s) * GROUP, xp, i0, mt, w->k, ae, ao);
    }
    for (int i = 0; i < mt; ++i)
        sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(ae[i], ao[i]), _mm512_add_ps(be[i], bo[i])));
}
#if BF16_DOT
/* ---- AVX-512 BF16, bf16 x: one step looks up 64 codes (32 bytes) as bf16 weights (vpermw) and multiplies them by x
   with vdpbf16ps, 32 products an instruction, where the float path takes two lookups and two FMAs for 32 codes (a
   1B model's decode step: 2x as fast). For bf16 x the tables hold bf16 values already and x is bf16, so each
   product is exact in float32, as the float path's are; the sums differ in order only (vdpbf16ps adds a pair's two
   products into the accumulator; it reads denormal inputs as zero). xb: x's bf16 bits, per group of 64 elements its
   even elements, then its odd ones (a code byte's high nibble, then its low one). */
static inline __attribute__((always_inline)) void step_dot(const __m512i t, const uint8_t* qr, int64_t c,
                                                           const uint16_t* xb, int64_t i0, const int mt, int64_t k,
                                                           __m512* ae, __m512* ao) {
    __m512i d = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(qr + c / 2)));
    __m512i we = _mm512_permutexvar_epi16(_mm512_srli_epi16(d, 4), t);
    __m512i wo = _mm512_permutexvar_epi16(_mm512_and_si512(d, _mm512_set1_epi16(15)), t);
    for (int i = 0; i < mt; ++i) {
        const uint16_t* xc = xb + (i0 + i) * k + c;
        ae[i] = _mm512_dpbf16_ps(ae[i], (__m512bh)we, (__m512bh)_mm512_loadu_si512(xc));
        ao[i] = _mm512_dpbf16_ps(ao[i], (__m512bh)wo, (__m512bh)_mm512_loadu_si512(xc + 32));
    }
}

/* Steps alternate between two pairs of accumulators (four chains a row), across blocks where a block is one step. */
static inline __attribute__((always_inline)) void row_dot(const weight_t* w, const float* lv, const float* scales,
                                                          const uint16_t* xb, int64_t i0, const int mt, int64_t r,
                                                          float* sums) {
    const int64_t steps = w->bs / 64, total = w->k / 64;
    const __m512 l = _mm512_loadu_ps(lv);
    __m512 ae[TILE], ao[TILE], be[TILE], bo[TILE];
    for (int i = 0; i < mt; ++i) {
        ae[i] = _mm512_setzero_ps(); ao[i] = _mm512_setzero_ps(); be[i] = _mm512_setzero_ps(); bo[i] = ae[i];
    }
    const uint8_t* qr = w->q + r * (w->k / 2);
    int64_t u = 0;
    for (; u + 1 < total; u += 2) {
        step_dot(table_bf16(l, scales[u / steps], w->wfmt), qr, u * 64, xb, i0, mt, w->k, ae, ao);
        step_dot(table_bf16(l, scales[(u + 1) / steps], w->wfmt), qr, (u + 1) * 64, xb, i0, mt, w->k, be, bo);
    }
    if (u < total) step_dot(table_bf16(l, scales[u / steps], w->wfmt), qr, u * 64, xb, i0, mt, w->k, ae, ao);
    for (int i = 0; i < mt; ++i)
        sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(ae[i], ao[i]), _mm512_add_ps(be[i], bo[i])));
}
#endif
#elif GROUP == 16
/* ---- AVX2: the same with 8 lanes; a code's bit 3 picks the table's half (blendv reads the sign bit). */
static inline __m256 lookup16(__m256 lo, __m256 hi, __m256i idx) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                            _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline __attribute__((always_inline)) void step256(const __m256 tlo, const __m256 thi, const uint8_t* qr,
                                                          int64_t c, const float* xp, int64_t i0, const int mt,
                                                          int64_t k, __m256* ae, __m256* ao) {
    __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(qr + c / 2)));
    __m256 we = lookup16(tlo, thi, _mm256_srli_epi32(d, 4));
    __m256 wo = lookup16(tlo, thi, _mm256_and_si256(d, _mm256_set1_epi32(15)));
    for (int i = 0; i < mt; ++i) {
        const float* xc = xp + (i0 + i) * k + c;
        ae[i] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xc), ae[i]);
        ao[i] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xc + 8), ao[i]);
    }
}

/* The tables come from block_tables here: made in the loop (as AVX-512 does) they cost AVX2 6% (its product is
   compute-bound: eight lanes and two lookups a half). */
static inline __attribute__((always_inline)) void row_fast(const weight_t* w, const float* lv, const float* tab,
                                                           const float* xp, int64_t i0, const int mt, int64_t r,
                                                           float* sums) {
    const int64_t bpr = w->k / w->bs, steps = w->bs / GROUP;
    (void)lv;
    __m256 ae[TILE], ao[TILE], be[TILE], bo[TILE];
    for (int i = 0; i < mt; ++i) {
        ae[i] = _mm256_setzero_ps(); ao[i] = _mm256_setzero_ps(); be[i] = _mm256_setzero_ps(); bo[i] = ae[i];
    }
    const uint8_t* qr = w->q + r * (w->k / 2);
    for (int64_t j = 0; j < bpr; ++j) {
        const __m256 tlo = _mm256_loadu_ps(tab + j * 16), thi = _mm256_loadu_ps(tab + j * 16 + 8);
        int64_t s = 0;
        for (; s + 1 < steps; s += 2) {  /* two pairs of accumulators, as the AVX-512 path */
            step256(tlo, thi, qr, (j * steps + s) * GROUP, xp, i0, mt, w->k, ae, ao);
            step256(tlo, thi, qr, (j * steps + s + 1) * GROUP, xp, i0, mt, w->k, be, bo);
        }
        if (s < steps) step256(tlo, thi, qr, (j * steps + s) * GROUP, xp, i0, mt, w->k, ae, ao);
    }
    for (int i = 0; i < mt; ++i) sums[i] = hsum8(_mm256_add_ps(_mm256_add_ps(ae[i], ao[i]), _mm256_add_ps(be[i], bo[i])));
}
#endif

/* Row r's sums for one tile of x rows: the fast path where the layout allows, each tile height its own compiled loop
   (the accumulators then live in registers). */
#define EACH_HEIGHT(row, xs)                                                 \
    switch (mt) {                                                            \
        case 1: row(w, lv, tab, xs, i0, 1, r, sums); return;                 \
        case 2: row(w, lv, tab, xs, i0, 2, r, sums); return;                 \
        case 3: row(w, lv, tab, xs, i0, 3, r, sums); return;                 \
        default: row(w, lv, tab, xs, i0, 4, r, sums); return;                \
    }
static void row_tile(const weight_t* w, const float* lv, const float* tab, const float* xp, int64_t i0, int mt,
                     int fast, int64_t r, float* sums) {
#if BF16_DOT
    if (fast == 2) EACH_HEIGHT(row_dot, (const uint16_t*)xp)  /* tab: the blocks' scales; xp: x's bf16 bits */
#endif
#if GROUP
    if (fast) EACH_HEIGHT(row_fast, xp)
#endif
    (void)fast; (void)lv;
    row_portable(w, tab, xp, i0, mt, r, sums);
}

/* Element c of a row of x is stored at this position of its row in xp: the fast paths' even/odd order. */
static inline int64_t reordered(int64_t c, int fast) {
    if (!GROUP || !fast) return c;
    const int64_t g = fast == 2 ? 64 : (GROUP ? GROUP : 1), p = c % g;
    return c - p + (p & 1) * (g / 2) + p / 2;
}

/* ---- Threaded entry point: x (m, k) in format xfmt (0 bf16, 2 float32), y (m, n) in the same format, bias (n)
   in it or NULL. scratch (the caller's memory: nothing here can fail to allocate): m * k floats for x reordered, then
   per thread the tables of cap blocks (cap >= k / bs + 3, the most one row touches). Each thread reorders a share of
   x, then computes a share of the weight rows, the tables of as many rows as fit computed at once (one row's few
   blocks cost their setup each time: half the time of a 64x64 product). On torch's OpenMP team (simd.h's my_share). */
void nf4_gemv_mt(int32_t threads, const uint8_t* q, const int8_t* qs, const void* factor, const void* mean,
                 const float* levels, int64_t n, int64_t k, int64_t bs, int64_t sbs, int32_t wfmt, const void* x,
                 int64_t m, int32_t xfmt, const void* bias, void* y, float* scratch, int64_t cap) {
    const weight_t w = {q, qs, factor, load1(mean, 0, wfmt), n, k, bs, sbs, wfmt, xfmt == 0 ? 0 : 2};
    /* fast: 1 the float path, 2 the bf16 dot path (bf16 x, rows of whole blocks of 64s), 0 portable C */
    int fast = GROUP && k % bs == 0 && bs % (GROUP ? GROUP : 1) == 0 && (wfmt != 1 || F16_ROUNDS);
    if (BF16_DOT && fast && xfmt == 0 && bs % 64 == 0) fast = 2;
    const int64_t rows_per_chunk = (cap - 2) * bs / k > 1 ? (cap - 2) * bs / k : 1;  /* spanning <= cap blocks */
    float* xp = scratch;
    #pragma omp parallel num_threads(threads)
    {
        int64_t a, b;
        my_share(0, m * k, 1, &a, &b);
        if (fast == 2)  /* x's bf16 bits, reordered (half of xp's floats) */
            for (int64_t e = a; e < b; ++e) ((uint16_t*)xp)[e - e % k + reordered(e % k, 2)] = ((const uint16_t*)x)[e];
        else
            for (int64_t e = a; e < b; ++e) xp[e - e % k + reordered(e % k, fast)] = load1(x, e, xfmt);
        #pragma omp barrier
#ifdef _OPENMP
        float* tab = scratch + m * k + (int64_t)omp_get_thread_num() * cap * 16;
#else
        float* tab = scratch + m * k;
#endif
        my_share(0, n, 16, &a, &b);
        for (int64_t c0 = a; c0 < b; c0 += rows_per_chunk) {
            const int64_t c1 = c0 + rows_per_chunk < b ? c0 + rows_per_chunk : b, cb0 = c0 * k / bs;
            block_tables(&w, levels, cb0, (c1 * k - 1) / bs - cb0 + 1, tab, fast);
            for (int64_t r = c0; r < c1; ++r) {
                /* from the block of the row's first element (AVX-512's paths keep a scale a block) */
                const float* row_tab = tab + (r * k / bs - cb0) * (fast && GROUP == 32 ? 1 : 16);
                for (int64_t i0 = 0; i0 < m; i0 += TILE) {
                    const int mt = m - i0 < TILE ? (int)(m - i0) : TILE;
                    float sums[TILE];
                    row_tile(&w, levels, row_tab, xp, i0, mt, fast, r, sums);
                    for (int i = 0; i < mt; ++i) {
                        float v = sums[i] + (bias ? load1(bias, r, xfmt) : 0.0f);
                        if (xfmt == 0) ((uint16_t*)y)[(i0 + i) * n + r] = bf16_bits1(v);
                        else ((float*)y)[(i0 + i) * n + r] = v;
                    }
                }
            }
        }
    }
}

/* ---- The dense decode product beside it: y[m, n] = x[m, k] @ W[n, k]^T with W and x in bf16 (a decode step's head:
   a tied embedding stays bf16 under NF4, and SmolLM2's 49152x576 head was 15% of a token, read at 17 GB/s by
   PyTorch's one-row matmul where the memory gives 45). Products exact in float32, float32 sums, y rounded to bf16
   once: the matmul's arithmetic in another order. Rows of W split over the threads, tiles of TILE rows of x. */
#if BF16_DOT
static inline __attribute__((always_inline)) void dense_row(const uint16_t* wr, const uint16_t* x, int64_t i0,
                                                            const int mt, int64_t k, float* sums) {
    __m512 a[TILE], b[TILE];
    for (int i = 0; i < mt; ++i) { a[i] = _mm512_setzero_ps(); b[i] = _mm512_setzero_ps(); }
    int64_t c = 0;
    for (; c + 64 <= k; c += 64) {  /* two chains a row */
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + c), w1 = (__m512bh)_mm512_loadu_si512(wr + c + 32);
        for (int i = 0; i < mt; ++i) {
            const uint16_t* xc = x + (i0 + i) * k + c;
            a[i] = _mm512_dpbf16_ps(a[i], w0, (__m512bh)_mm512_loadu_si512(xc));
            b[i] = _mm512_dpbf16_ps(b[i], w1, (__m512bh)_mm512_loadu_si512(xc + 32));
        }
    }
    for (; c + 32 <= k; c += 32) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + c);
        for (int i = 0; i < mt; ++i)
            a[i] = _mm512_dpbf16_ps(a[i], w0, (__m512bh)_mm512_loadu_si512(x + (i0 + i) * k + c));
    }
    for (int i = 0; i < mt; ++i) {
        float s = _mm512_reduce_add_ps(_mm512_add_ps(a[i], b[i]));
        for (int64_t e = c; e < k; ++e) s += load1(wr, e, 0) * load1(x, (i0 + i) * k + e, 0);
        sums[i] = s;
    }
}
#endif

/* 1 where this build has the dense bf16 kernel (AVX512-BF16): elsewhere PyTorch's matmul stays. */
int dense_gemv_available(void) { return BF16_DOT; }

void dense_gemv_mt(int32_t threads, const uint16_t* w, int64_t n, int64_t k, const uint16_t* x, int64_t m,
                   uint16_t* y) {
#if BF16_DOT
    #pragma omp parallel num_threads(threads)
    {
        int64_t a, b;
        my_share(0, n, 16, &a, &b);
        for (int64_t r = a; r < b; ++r) {
            for (int64_t i0 = 0; i0 < m; i0 += TILE) {
                const int mt = m - i0 < TILE ? (int)(m - i0) : TILE;
                float sums[TILE];
                switch (mt) {
                    case 1: dense_row(w + r * k, x, i0, 1, k, sums); break;
                    case 2: dense_row(w + r * k, x, i0, 2, k, sums); break;
                    case 3: dense_row(w + r * k, x, i0, 3, k, sums); break;
                    default: dense_row(w + r * k, x, i0, 4, k, sums); break;
                }
                for (int i = 0; i < mt; ++i) y[(i0 + i) * n + r] = bf16_bits1(sums[i]);
            }
        }
    }
#else
    (void)threads; (void)w; (void)n; (void)k; (void)x; (void)m; (void)y;
#endif
}
