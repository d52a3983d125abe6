/* NF4 quantize / dequantize kernels for lit_qlora.nf4 (gcc vector extensions, 16 float lanes; gcc picks the
   instructions for -march=native). lit_qlora/nf4/native.py compiles this file on first use, checks it
   against the PyTorch path and calls it through ctypes.

   quantize: one pass per block: absmax, divide, round to the storage dtype, count the thresholds passed,
   pack two codes per byte. dequantize: a 16-entry table of rounded level * scale per block, looked up with
   a vector permute (vpermw / vpermd on AVX-512). */
#include <stdint.h>
#include <string.h>

typedef float    v16f  __attribute__((vector_size(64)));
typedef uint32_t v16u  __attribute__((vector_size(64)));
typedef int32_t  v16i  __attribute__((vector_size(64)));
typedef uint16_t v32w  __attribute__((vector_size(64)));
typedef uint64_t v8q   __attribute__((vector_size(64)));
typedef uint8_t  v16b  __attribute__((vector_size(16)));
typedef uint8_t  v8b   __attribute__((vector_size(8)));
typedef uint16_t v16w  __attribute__((vector_size(32)));
#if defined(__FLT16_MAX__)
#define HAS_F16 1
typedef _Float16 v16hf __attribute__((vector_size(32)));
#else  /* no _Float16 (gcc < 12 on x86): float16 stays on the PyTorch path, see nf4_has_f16 */
#define HAS_F16 0
#endif

int nf4_has_f16(void) { return HAS_F16; }

/* Storage formats: 0 bfloat16, 1 float16, 2 float32. All arithmetic is float32, rounded to the storage
   format exactly where PyTorch rounds (bf16: nearest-even with NaN -> 0x7FC0 like c10::BFloat16). */

static inline v16u bf16_bits(v16f x) {
    v16u u; memcpy(&u, &x, 64);
    v16u r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    v16i nan = (v16i)((u & 0x7FFFFFFFu) > 0x7F800000u);
    return (v16u)(((v16i)r & ~nan) | (nan & 0x7FC0));
}
static inline v16u f16_bits(v16f x) {
#if HAS_F16
    v16hf h = __builtin_convertvector(x, v16hf);
    v16w w; memcpy(&w, &h, 32);
    return __builtin_convertvector(w, v16u);
#else
    v16u u; memcpy(&u, &x, 64); return u;
#endif
}
static inline v16f round_to(v16f x, int fmt) {
    if (fmt == 0) { v16u b = bf16_bits(x) << 16; v16f r; memcpy(&r, &b, 64); return r; }
#if HAS_F16
    if (fmt == 1) { v16hf h = __builtin_convertvector(x, v16hf); return __builtin_convertvector(h, v16f); }
#endif
    return x;
}
static inline uint16_t bf16_bits1(float x) {
    uint32_t u; memcpy(&u, &x, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline float round1(float x, int fmt) {
    if (fmt == 0) { uint32_t u = (uint32_t)bf16_bits1(x) << 16; float r; memcpy(&r, &u, 4); return r; }
#if HAS_F16
    if (fmt == 1) return (float)(_Float16)x;
#endif
    return x;
}
static inline v16f load16(const void* src, int64_t i, int fmt) {
    v16f r;
    if (fmt == 0) {
        v16w w; memcpy(&w, (const uint16_t*)src + i, 32);
        v16u u = __builtin_convertvector(w, v16u) << 16; memcpy(&r, &u, 64);
#if HAS_F16
    } else if (fmt == 1) {
        v16hf h; memcpy(&h, (const _Float16*)src + i, 32); r = __builtin_convertvector(h, v16f);
#endif
    } else {
        memcpy(&r, (const float*)src + i, 64);
    }
    return r;
}
static inline float load1(const void* src, int64_t i, int fmt) {
    if (fmt == 0) { uint32_t u = (uint32_t)((const uint16_t*)src)[i] << 16; float r; memcpy(&r, &u, 4); return r; }
#if HAS_F16
    if (fmt == 1) return (float)((const _Float16*)src)[i];
#endif
    return ((const float*)src)[i];
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
        for (; j + 16 <= hb; j += 16) {
            v16b c; memcpy(&c, qb + j, 16);
            v16u d = __builtin_convertvector(c, v16u);
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
        for (; j + 8 <= hb; j += 8) {
            v8b c; memcpy(&c, qb + j, 8);
            v8q d = __builtin_convertvector(c, v8q);
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

/* ---- LoRA dropout (lit_qlora/lora_dropout.py; here because this file is the project's one compiled unit):
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
