/* NF4 quantize / dequantize kernels for lit_qlora.nf4 (gcc vector extensions, 16 float lanes: simd.h, which LoRA's
   kernels share; gcc picks the instructions for -march=native). lit_qlora/nf4/native.py compiles this file on first
   use, checks it against the PyTorch path and calls it through ctypes.

   quantize: one pass per block: absmax, divide, round to the storage dtype, count the thresholds passed,
   pack two codes per byte. dequantize: a 16-entry table of rounded level * scale per block, looked up with
   a vector permute (vpermw / vpermd on AVX-512). */
#include "simd.h"

typedef uint16_t v32w  __attribute__((vector_size(64)));
typedef uint64_t v8q   __attribute__((vector_size(64)));
typedef uint8_t  v16b  __attribute__((vector_size(16)));
typedef uint8_t  v8b   __attribute__((vector_size(8)));

int nf4_has_f16(void) { return HAS_F16; }

/* Codes zero-extended to wider lanes: 16 bytes to 16 uint32, 8 bytes to 8 uint64. One vpmovzx where the ISA has it:
   gcc 12 compiles __builtin_convertvector from 8-bit lanes a byte at a time, which made dequantize ~8x slower. */
static inline v16u widen16(const uint8_t* p) {
    v16u r;
#if defined(__AVX512F__)
    __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    memcpy(&r, &d, 64);
#elif defined(__AVX2__)
    __m128i c = _mm_loadu_si128((const __m128i*)p);
    __m256i a = _mm256_cvtepu8_epi32(c), b = _mm256_cvtepu8_epi32(_mm_srli_si128(c, 8));
    memcpy(&r, &a, 32); memcpy((char*)&r + 32, &b, 32);
#else
    v16b c; memcpy(&c, p, 16); r = __builtin_convertvector(c, v16u);
#endif
    return r;
}
static inline v8q widen8(const uint8_t* p) {
    v8q r;
#if defined(__AVX512F__)
    __m512i d = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i*)p));
    memcpy(&r, &d, 64);
#elif defined(__AVX2__)
    __m128i c = _mm_loadl_epi64((const __m128i*)p);
    __m256i a = _mm256_cvtepu8_epi64(c), b = _mm256_cvtepu8_epi64(_mm_srli_si128(c, 4));
    memcpy(&r, &a, 32); memcpy((char*)&r + 32, &b, 32);
#else
    v8b c; memcpy(&c, p, 8); r = __builtin_convertvector(c, v8q);
#endif
    return r;
}
/* ---- quantize: blocks [b0, b1) of bs elements; absmax per block -> amax_out (storage format),
   code = #{i : round_to(x / absmax) >= thr[i]} (15 thresholds, NaN -> 0), two codes per byte, high first */
void nf4_quantize(const void* w, int64_t b0, int64_t b1, int64_t bs, const float* thr, uint8_t* qout,
                  void* amax_out, int32_t fmt) {
    v16f T[15];
    for (int i = 0; i < 15; ++i) { v16f t = {0}; T[i] = t + thr[i]; }
    const v16i even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i odd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    for (int64_t b = b0; b < b1; ++b) {
        const int64_t base = b * bs;
        float m = 0.0f;
        int nan = 0;
        int64_t j = 0;
        if (bs >= 16) {
            v16f vm = {0};
            v16i vn = {0};
            for (; j + 16 <= bs; j += 16) {
                v16f x = load16(w, base + j, fmt);
                v16u ab; memcpy(&ab, &x, 64); ab &= 0x7FFFFFFFu;
                v16f ax; memcpy(&ax, &ab, 64);
                v16i gt = (v16i)(ax > vm);
                vm = (v16f)(((v16i)ax & gt) | ((v16i)vm & ~gt));
                vn |= (v16i)(x != x);
            }
            for (int k = 0; k < 16; ++k) { if (vm[k] > m) m = vm[k]; nan |= vn[k]; }
        }
        for (; j < bs; ++j) {
            float x = load1(w, base + j, fmt), ax = x < 0 ? -x : x;
            if (x != x) nan = 1; else if (ax > m) m = ax;
        }
        if (nan) m = __builtin_nanf("");
        if (fmt == 0) ((uint16_t*)amax_out)[b] = bf16_bits1(m);
#if HAS_F16
        else if (fmt == 1) ((_Float16*)amax_out)[b] = (_Float16)m;
#endif
        else ((float*)amax_out)[b] = m;

        uint8_t* qb = qout + base / 2;
        j = 0;
        for (; j + 32 <= bs; j += 32) {
            v16f q0 = round_to(load16(w, base + j, fmt) / m, fmt);
            v16f q1 = round_to(load16(w, base + j + 16, fmt) / m, fmt);
            v16i c0 = {0}, c1 = {0};
            for (int i = 0; i < 15; ++i) { c0 -= (v16i)(q0 >= T[i]); c1 -= (v16i)(q1 >= T[i]); }
            v16i hi = __builtin_shuffle(c0, c1, even), lo = __builtin_shuffle(c0, c1, odd);
            v16b packed = __builtin_convertvector((hi << 4) | lo, v16b);
            memcpy(qb + j / 2, &packed, 16);
        }
        for (; j < bs; j += 2) {
            float qa = round1(load1(w, base + j, fmt) / m, fmt), qc = round1(load1(w, base + j + 1, fmt) / m, fmt);
            int ca = 0, cc = 0;
            for (int i = 0; i < 15; ++i) { ca += qa >= thr[i]; cc += qc >= thr[i]; }
            qb[j / 2] = (uint8_t)((ca << 4) | cc);
        }
    }
}

/* ---- dequantize, 16-bit output in the storage format fmt (0 bf16, 1 fp16): blocks [b0, b1), hb bytes
   (2 * hb values) per block; a 16-entry table of rounded level * scale per block, looked up by permute */
void nf4_dequant16(const uint8_t* q, const float* scale, const float* levels, int64_t b0, int64_t b1,
                   int64_t hb, uint16_t* out, int32_t fmt) {
    v16f lv; memcpy(&lv, levels, 64);
    const v32w even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                       0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    for (int64_t b = b0; b < b1; ++b) {
        v16f p = lv * scale[b];
        v16u bits = fmt == 0 ? bf16_bits(p) : f16_bits(p);
        v32w table = __builtin_shuffle((v32w)bits, even);
        const uint8_t* qb = q + b * hb;
        uint16_t* ob = out + 2 * b * hb;
        int64_t j = 0;
#if defined(__AVX2__) && !defined(__AVX512BW__)
        /* No 16-bit permute on AVX2 (gcc made the one below scalar): the table's low and high bytes as two pshufb
           tables, each byte's high and low code interleaved as indices, the two result bytes zipped into words. */
        uint8_t tl[16], th[16];
        for (int k = 0; k < 16; ++k) { tl[k] = (uint8_t)table[k]; th[k] = (uint8_t)(table[k] >> 8); }
        __m256i tlo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)tl));
        __m256i thi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)th));
        for (; j + 16 <= hb; j += 16) {
            __m128i c = _mm_loadu_si128((const __m128i*)(qb + j));
            __m128i h = _mm_and_si128(_mm_srli_epi16(c, 4), _mm_set1_epi8(15)), l = _mm_and_si128(c, _mm_set1_epi8(15));
            __m256i idx = _mm256_set_m128i(_mm_unpackhi_epi8(h, l), _mm_unpacklo_epi8(h, l));
            __m256i lb = _mm256_shuffle_epi8(tlo, idx), hbyte = _mm256_shuffle_epi8(thi, idx);
            __m256i w0 = _mm256_unpacklo_epi8(lb, hbyte), w1 = _mm256_unpackhi_epi8(lb, hbyte);
            _mm256_storeu_si256((__m256i*)(ob + 2 * j), _mm256_permute2x128_si256(w0, w1, 0x20));
            _mm256_storeu_si256((__m256i*)(ob + 2 * j + 16), _mm256_permute2x128_si256(w0, w1, 0x31));
        }
#endif
        for (; j + 16 <= hb; j += 16) {
            v16u d = widen16(qb + j);
            v16u idx = (d >> 4) | ((d & 15u) << 16);
            v32w o = __builtin_shuffle(table, (v32w)idx);
            memcpy(ob + 2 * j, &o, 64);
        }
        for (; j < hb; ++j) {
            ob[2 * j] = table[qb[j] >> 4];
            ob[2 * j + 1] = table[qb[j] & 15];
        }
    }
}

/* ---- dequantize to float32; the products are first rounded to the storage format fmt (0, 1, 2) */
void nf4_dequant32(const uint8_t* q, const float* scale, const float* levels, int64_t b0, int64_t b1,
                   int64_t hb, float* out, int32_t fmt) {
    v16f lv; memcpy(&lv, levels, 64);
    for (int64_t b = b0; b < b1; ++b) {
        v16f p = round_to(lv * scale[b], fmt);
        v16u table; memcpy(&table, &p, 64);
        const uint8_t* qb = q + b * hb;
        float* ob = out + 2 * b * hb;
        int64_t j = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
        /* gcc lowers the 16-lane permute below to scalar code on AVX2 (dequantize ran at ~1/5 of memory speed):
           here two 8-entry vpermps halves, the code's bit 3 choosing between them, and unpack to interleave
           each byte's high and low code. */
        __m256 t0 = _mm256_loadu_ps((const float*)&p), t1 = _mm256_loadu_ps((const float*)&p + 8);
        for (; j + 8 <= hb; j += 8) {
            __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(qb + j)));
            __m256i hi = _mm256_srli_epi32(d, 4), lo = _mm256_and_si256(d, _mm256_set1_epi32(15));
            __m256 vh = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, hi), _mm256_permutevar8x32_ps(t1, hi),
                                         _mm256_castsi256_ps(_mm256_slli_epi32(hi, 28)));
            __m256 vl = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, lo), _mm256_permutevar8x32_ps(t1, lo),
                                         _mm256_castsi256_ps(_mm256_slli_epi32(lo, 28)));
            __m256 a = _mm256_unpacklo_ps(vh, vl), c = _mm256_unpackhi_ps(vh, vl);
            _mm256_storeu_ps(ob + 2 * j, _mm256_permute2f128_ps(a, c, 0x20));
            _mm256_storeu_ps(ob + 2 * j + 8, _mm256_permute2f128_ps(a, c, 0x31));
        }
#endif
        for (; j + 8 <= hb; j += 8) {
            v8q d = widen8(qb + j);
            v8q idx = (d >> 4) | ((d & 15u) << 32);
            v16u o = __builtin_shuffle(table, (v16u)idx);
            memcpy(ob + 2 * j, &o, 64);
        }
        for (; j < hb; ++j) {
            ob[2 * j] = p[qb[j] >> 4];
            ob[2 * j + 1] = p[qb[j] & 15];
        }
    }
}

/* ---- Threaded entry points: the kernels above over [lo, hi) on torch's OpenMP team (simd.h's my_share). */
void nf4_quantize_mt(int32_t threads, const void* w, int64_t b0, int64_t b1, int64_t bs, const float* thr,
                     uint8_t* qout, void* amax_out, int32_t fmt) {
    #pragma omp parallel num_threads(threads)
    { int64_t a, b; my_share(b0, b1, 1, &a, &b); if (a < b) nf4_quantize(w, a, b, bs, thr, qout, amax_out, fmt); }
}

void nf4_dequant16_mt(int32_t threads, const uint8_t* q, const float* scale, const float* levels, int64_t b0,
                      int64_t b1, int64_t hb, uint16_t* out, int32_t fmt) {
    #pragma omp parallel num_threads(threads)
    { int64_t a, b; my_share(b0, b1, 1, &a, &b); if (a < b) nf4_dequant16(q, scale, levels, a, b, hb, out, fmt); }
}

void nf4_dequant32_mt(int32_t threads, const uint8_t* q, const float* scale, const float* levels, int64_t b0,
                      int64_t b1, int64_t hb, float* out, int32_t fmt) {
    #pragma omp parallel num_threads(threads)
    { int64_t a, b; my_share(b0, b1, 1, &a, &b); if (a < b) nf4_dequant32(q, scale, levels, a, b, hb, out, fmt); }
}
