/* Shared by lit_qlora/nf4/kernels.c and lit_qlora/lora/kernels.c, which both include it (lit_qlora.nf4.native
   builds each as one file with this one beside it): gcc vector types of 16 float lanes, the storage formats with
   PyTorch's exact rounding, loads of either, and each OpenMP thread's share of a range. */
#ifndef LIT_QLORA_SIMD_H
#define LIT_QLORA_SIMD_H
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512BF16__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float    v16f  __attribute__((vector_size(64)));
typedef uint32_t v16u  __attribute__((vector_size(64)));
typedef int32_t  v16i  __attribute__((vector_size(64)));
typedef uint16_t v16w  __attribute__((vector_size(32)));
#if defined(__FLT16_MAX__)
#define HAS_F16 1
typedef _Float16 v16hf __attribute__((vector_size(32)));
#else  /* no _Float16 (gcc < 12 on x86): float16 stays on the PyTorch path, see nf4_has_f16, lora_has_f16 */
#define HAS_F16 0
#endif

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
static inline uint16_t bf16_bits1(float x) {
    uint32_t u; memcpy(&u, &x, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
/* x rounded to the storage format fmt and back to float32 (fmt 2, float32: unchanged): a vector, one value. */
static inline v16f round_to(v16f x, int fmt) {
    if (fmt == 0) { v16u b = bf16_bits(x) << 16; v16f r; memcpy(&r, &b, 64); return r; }
#if HAS_F16
    if (fmt == 1) { v16hf h = __builtin_convertvector(x, v16hf); return __builtin_convertvector(h, v16f); }
#endif
    return x;
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

/* Threaded entry points (each kernel file's `*_mt`) run a kernel over [lo, hi), split across `threads` threads of
   torch's own OpenMP team. The libraries link libgomp, which resolves to the copy torch already loaded, so these
   regions reuse the workers torch's ops use. A second pool of our own would compete with those workers while they
   spin after each torch op, and under a competing process that had cut throughput 16-fold (benchmarks/README,
   issue 16). my_share: this thread's part [a, b) of [lo, hi), in whole units. */
static inline void my_share(int64_t lo, int64_t hi, int64_t unit, int64_t* a, int64_t* b) {
#ifdef _OPENMP
    int64_t t = omp_get_thread_num(), k = omp_get_num_threads();
#else
    int64_t t = 0, k = 1;
#endif
    int64_t units = (hi - lo + unit - 1) / unit, per = (units + k - 1) / k;
    *a = lo + t * per * unit < hi ? lo + t * per * unit : hi;
    *b = lo + (t + 1) * per * unit < hi ? lo + (t + 1) * per * unit : hi;
}
#endif
