/* One decode step of a Llama-style block stack in C (lit_qlora.model.decode_step): one token of one sequence through
   every block, its keys and values written into the blocks' KV caches. The products are gemv.c's NF4 kernel (this
   file includes it); the rest (norms, RoPE, attention over the cache, SiLU, residual adds) is plain C here, where
   PyTorch spent two thirds of a SmolLM2 step dispatching some 450 small operations.

   The arithmetic is transformer.py's, rounding where it rounds: every value a PyTorch op would write in the model's
   dtype (bf16: xfmt 0) is rounded to it here too (a norm's output, each RoPE product and their sum, the attention's
   output, SiLU and its product with up, each residual add); norms, softmax and attention compute in float32 as
   there. Only the order of float32 sums differs. */
#include "gemv.c"

#include <math.h>

typedef struct {         /* one NF4 projection, as nf4_gemv_mt takes it */
    const uint8_t* q;
    const int8_t* qs;
    const void* factor;
    const void* mean;
    const float* levels;
    const void* bias;    /* in x's format, or NULL */
    int64_t n, k, bs, sbs;
    int32_t wfmt;
    const float* lora_a;   /* a LoRA adapter's A (r, k) and B transposed (r, n), as float32 copies of its factors in */
    const float* lora_bt;  /* x's dtype (LoRALinear casts them so), or NULL */
    int64_t r;
    float lora_scale;
} proj_t;

typedef struct {
    proj_t p[7];         /* q, k, v, o, gate, up, down */
    const void* norm1;   /* input_layernorm's weight, x's format */
    const void* norm2;   /* post_attention_layernorm's */
    void* kc;            /* this block's cache (n_kv, max_len, head_dim), x's format */
    void* vc;
    const void* cos;     /* RoPE's (max_len, head_dim) tables for this block's kind, x's format */
    const void* sin;
    int64_t sliding;     /* attends within the shape's window */
} block_t;

typedef struct {
    int64_t d, heads, kv_heads, head_dim, inter, max_len, max_r, window;  /* window: sliding blocks' (0: none) */
    float eps, scale;
    int32_t xfmt;        /* 0 bf16, 2 float32 */
    int32_t threads;
} shape_t;

static inline float ld(const void* p, int64_t i, int fmt) { return load1(p, i, fmt); }
static inline void st(void* p, int64_t i, float v, int fmt) {  /* a value written in the model's dtype */
    if (fmt == 0) ((uint16_t*)p)[i] = bf16_bits1(v);
    else ((float*)p)[i] = v;
}
static inline float rd(float v, int fmt) { return round1(v, fmt); }

/* RMSNorm as transformer.rms_norm: x / rms(x) in float32, rounded to the dtype, times the weight (rounded again). */
static void rms_norm(const void* x, const void* w, int64_t d, float eps, int fmt, void* out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < d; ++i) { float v = ld(x, i, fmt); ss += v * v; }
    const float rstd = 1.0f / sqrtf(ss / (float)d + eps);
    for (int64_t i = 0; i < d; ++i) st(out, i, ld(w, i, fmt) * rd(ld(x, i, fmt) * rstd, fmt), fmt);
}

/* LoRALinear's term added to y = the base's output: out + (x @ A^T @ B^T) * scale, each product and the sum rounded
   to the dtype as PyTorch's ops round them. buf: k + r + n floats. */
static void lora_add(const shape_t* s, const proj_t* p, const void* x, void* y, float* buf) {
    const int fmt = s->xfmt;
    const int64_t k = p->k, n = p->n, r = p->r;
    float *xf = buf, *t = buf + k, *u = t + r;
    for (int64_t i = 0; i < k; ++i) xf[i] = ld(x, i, fmt);
    for (int64_t j = 0; j < r; ++j) {  /* x @ A^T: sixteen partial sums (the lanes), then theirs */
        const float* a = p->lora_a + j * k;
        float acc[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= k; i += 16)
            for (int l = 0; l < 16; ++l) acc[l] += xf[i + l] * a[i + l];
        float sum = 0.0f;
        for (; i < k; ++i) sum += xf[i] * a[i];
        for (int l = 0; l < 16; ++l) sum += acc[l];
        t[j] = rd(sum, fmt);
    }
    for (int64_t i = 0; i < n; ++i) u[i] = 0.0f;
    for (int64_t j = 0; j < r; ++j) {  /* @ B^T, a row of B^T at a time */
        const float tj = t[j], *b = p->lora_bt + j * n;
        for (int64_t i = 0; i < n; ++i) u[i] += tj * b[i];
    }
    for (int64_t i = 0; i < n; ++i) st(y, i, ld(y, i, fmt) + rd(rd(u[i], fmt) * p->lora_scale, fmt), fmt);
}

int decode_step_has_f16(void) { return HAS_F16; }

/* Threads as gemv.py's _threads gives them: one per 2^17 multiply-adds (waking one costs ~30 us of work), one per
   16 rows at most. */
static void project(const shape_t* s, const proj_t* p, const void* x, int64_t rows, void* y, float* scratch,
                    int64_t cap) {
    int64_t threads = p->n * p->k * rows >> 17;
    if (threads > p->n / 16) threads = p->n / 16;
    if (threads > s->threads) threads = s->threads;
    if (threads < 1) threads = 1;
    nf4_gemv_mt((int32_t)threads, p->q, p->qs, p->factor, p->mean, p->levels, p->n, p->k, p->bs, p->sbs, p->wfmt, x,
                rows, s->xfmt, p->bias, y, scratch, cap);
    const int64_t e = s->xfmt == 0 ? 2 : 4;
    for (int64_t b = 0; p->r && b < rows; ++b)  /* the kernel is done with its scratch */
        lora_add(s, p, (const char*)x + e * b * p->k, (char*)y + e * b * p->n, scratch);
}

/* apply_rope on one head in place: x * cos + rotate_half(x) * sin, each product and the sum rounded. */
static void rope(void* x, int64_t off, const void* cos, const void* sin, int64_t hd, int fmt, float* tmp) {
    for (int64_t i = 0; i < hd; ++i) tmp[i] = ld(x, off + i, fmt);
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < hd; ++i) {
        const float rot = i < half ? -tmp[i + half] : tmp[i - half];
        st(x, off + i, rd(tmp[i] * ld(cos, i, fmt), fmt) + rd(rot * ld(sin, i, fmt), fmt), fmt);
    }
}

/* A row of the cache as float32, 16 lanes at a time (the loops vectorize; a value-by-value load with the format's
   branch took ~0.5 ms a block of a 1B model at 180 cached positions). */
static inline void load_row(const void* src, int64_t off, int64_t n, int fmt, float* out) {
    if (fmt == 0) {
        const uint16_t* b = (const uint16_t*)src + off;
        for (int64_t i = 0; i < n; ++i) { uint32_t u = (uint32_t)b[i] << 16; memcpy(out + i, &u, 4); }
    } else {
        memcpy(out, (const float*)src + off, n * 4);
    }
}

static inline float dot16(const float* a, const float* b, int64_t n) {  /* sixteen partial sums, then theirs */
    float acc[16] = {0}, sum = 0.0f;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; ++l) acc[l] += a[i + l] * b[i + l];
    for (; i < n; ++i) sum += a[i] * b[i];
    for (int l = 0; l < 16; ++l) sum += acc[l];
    return sum;
}

/* decode_attention for one query head over cached positions [start, pos]: float32 scores times the scale, softmax,
   the values' weighted sum, rounded to the dtype. buf: 2 * head_dim floats. */
static void attend_head(const shape_t* s, const void* q, int64_t h, int64_t pos, int64_t start, const char* kc,
                        const char* vc, void* out, float* scores, float* buf) {
    const int64_t hd = s->head_dim, g = h / (s->heads / s->kv_heads);
    const int fmt = s->xfmt;
    float *qf = buf, *row = buf + hd, acc[512];  /* head_dim <= 512 (checked by the caller) */
    load_row(q, h * hd, hd, fmt, qf);
    float top = -INFINITY;
    for (int64_t t = start; t <= pos; ++t) {
        load_row(kc, (g * s->max_len + t) * hd, hd, fmt, row);
        scores[t] = dot16(qf, row, hd) * s->scale;
        if (scores[t] > top) top = scores[t];
    }
    float sum = 0.0f;
    for (int64_t t = start; t <= pos; ++t) { scores[t] = expf(scores[t] - top); sum += scores[t]; }
    for (int64_t i = 0; i < hd; ++i) acc[i] = 0.0f;
    for (int64_t t = start; t <= pos; ++t) {
        const float p = scores[t] / sum;
        load_row(vc, (g * s->max_len + t) * hd, hd, fmt, row);
        for (int64_t i = 0; i < hd; ++i) acc[i] += p * row[i];
    }
    for (int64_t i = 0; i < hd; ++i) st(out, h * hd + i, acc[i], fmt);
}

/* Every block for `rows` tokens, row b's embedding at x + b * d (x's format; the final hidden states on return), at
   position pos[b] of its own KV cache row. work: the step's buffers, decode_step_work_bytes(s, rows) bytes;
   scratch/cap: nf4_gemv_mt's. */
int64_t decode_step_work_bytes(const shape_t* s, int64_t rows) {
    const int64_t e = s->xfmt == 0 ? 2 : 4;
    return rows * (e * (2 * s->d + 2 * s->heads * s->head_dim + 2 * s->kv_heads * s->head_dim + 3 * s->inter) +
                   4 * s->heads * (s->max_len + 2 * s->head_dim)) + 4 * s->head_dim + 64;
}

static inline void add_rows(void* x, const void* o, int64_t count, int fmt) {  /* a residual add, rounded */
    for (int64_t i = 0; i < count; ++i) st(x, i, ld(x, i, fmt) + ld(o, i, fmt), fmt);
}

void decode_step(const shape_t* s, const block_t* blocks, int64_t n_blocks, int64_t rows, const int64_t* pos, char* x,
                 char* work, float* scratch, int64_t cap) {
    const int fmt = s->xfmt;
    const int64_t e = fmt == 0 ? 2 : 4, hd = s->head_dim, qn = s->heads * hd, kvn = s->kv_heads * hd, d = s->d;
    char* at = work;
    char *h = at, *o = (at += e * rows * d), *q = (at += e * rows * d), *att = (at += e * rows * qn),
         *k = (at += e * rows * qn), *v = (at += e * rows * kvn), *gate = (at += e * rows * kvn),
         *up = (at += e * rows * s->inter), *act = (at += e * rows * s->inter);
    float *scores = (float*)(at += e * rows * s->inter), *bufs = scores + rows * s->max_len * s->heads,
          *tmp = bufs + rows * s->heads * 2 * hd;  /* attention's per-head buffers, RoPE's */
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; ++r) longest = pos[r] > longest ? pos[r] : longest;
    for (int64_t l = 0; l < n_blocks; ++l) {
        const block_t* b = blocks + l;
        for (int64_t r = 0; r < rows; ++r) rms_norm(x + e * r * d, b->norm1, d, s->eps, fmt, h + e * r * d);
        project(s, &b->p[0], h, rows, q, scratch, cap);
        project(s, &b->p[1], h, rows, k, scratch, cap);
        project(s, &b->p[2], h, rows, v, scratch, cap);
        for (int64_t r = 0; r < rows; ++r) {
            const char *cos = (const char*)b->cos + e * pos[r] * hd, *sin = (const char*)b->sin + e * pos[r] * hd;
            for (int64_t i = 0; i < s->heads; ++i) rope(q + e * r * qn, i * hd, cos, sin, hd, fmt, tmp);
            for (int64_t g = 0; g < s->kv_heads; ++g) {
                rope(k + e * r * kvn, g * hd, cos, sin, hd, fmt, tmp);
                const int64_t at_pos = e * (((r * s->kv_heads + g) * s->max_len + pos[r]) * hd);
                memcpy((char*)b->kc + at_pos, k + e * (r * kvn + g * hd), e * hd);
                memcpy((char*)b->vc + at_pos, v + e * (r * kvn + g * hd), e * hd);
            }
        }
        #pragma omp parallel for num_threads(s->threads) schedule(static) if (rows * s->heads * longest * hd > 1 << 16)
        for (int64_t rh = 0; rh < rows * s->heads; ++rh) {
            const int64_t r = rh / s->heads, first = b->sliding && s->window ? pos[r] - s->window + 1 : 0;
            const int64_t cache = e * r * s->kv_heads * s->max_len * hd;
            attend_head(s, q + e * r * qn, rh % s->heads, pos[r], first > 0 ? first : 0, (const char*)b->kc + cache,
                        (const char*)b->vc + cache, att + e * r * qn, scores + rh * s->max_len, bufs + rh * 2 * hd);
        }
        project(s, &b->p[3], att, rows, o, scratch, cap);
        add_rows(x, o, rows * d, fmt);
        for (int64_t r = 0; r < rows; ++r) rms_norm(x + e * r * d, b->norm2, d, s->eps, fmt, h + e * r * d);
        project(s, &b->p[4], h, rows, gate, scratch, cap);
        project(s, &b->p[5], h, rows, up, scratch, cap);
        for (int64_t i = 0; i < rows * s->inter; ++i) {
            const float g = ld(gate, i, fmt);
            st(act, i, rd(g / (1.0f + expf(-g)), fmt) * ld(up, i, fmt), fmt);
        }
        project(s, &b->p[6], act, rows, o, scratch, cap);
        add_rows(x, o, rows * d, fmt);
    }
}
