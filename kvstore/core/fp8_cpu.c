/* fp8 (e4m3fn) quantisation of K/V on the CPU, bit for bit what kvstore.core.codec's
 * eager torch kernels produce, in one pass over memory with loops the compiler vectorises.
 *
 * Built once per host by kvstore/core/fp8_cpu.py (cc -O3 -march=native) and called
 * through ctypes, which lets the GIL go for the call: the caller splits a large tensor
 * between threads by ranges of `outer` (no OpenMP here: its spinning pool fought the
 * engine's threads, 13 ms for a 16K-token load against 6 on one thread).
 *
 * A tensor is seen as [outer, tokens, dim] (outer = chunks x layers x kv_heads), one scale
 * per column of a [tokens, dim] slab (K: per channel, scale[outer][dim]) or per row
 * (V: per token, scale[outer][tokens]).
 *
 * Encode: amax = max |x| over the slab's tokens (K) or the row (V), scale =
 * max(amax, 1e-12) / 448, code = e4m3fn(clamp(x / scale, -448, 448)) rounded to nearest
 * even. The conversion is integer arithmetic on the float's bits (normal range: round the
 * mantissa to 3 bits and re-bias the exponent; below 2^-6: add 2^14, whose ulp is the
 * subnormal step 2^-9, and read the steps off the bits).
 * Decode: the code's 7 magnitude bits shifted to a float32 exponent/mantissa are the value
 * times 2^-120 (normals and subnormals alike), so value = bits * 2^120 * scale exactly as
 * torch's code.float() * scale, then rounded to the output dtype.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };

static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float load(const void *p, int64_t i, int dtype) {
    if (dtype == BF16) return from_bits((uint32_t)((const uint16_t *)p)[i] << 16);
    if (dtype == F16) return (float)((const _Float16 *)p)[i];
    return ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float f, int dtype) {
    if (dtype == BF16) {
        uint32_t u = to_bits(f);
        uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
        ((uint16_t *)p)[i] = (uint16_t)(f != f ? 0x7FC0u : r);
    } else if (dtype == F16) {
        ((_Float16 *)p)[i] = (_Float16)f;
    } else {
        ((float *)p)[i] = f;
    }
}

static inline uint8_t e4m3(float x, float scale) {
    float y = x / scale;
    y = y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y); /* NaN stays NaN */
    uint32_t b = to_bits(y), a = b & 0x7FFFFFFFu, sign = (b >> 24) & 0x80u;
    uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - 960u;
    uint32_t sub = to_bits(from_bits(a) + 16384.0f) - 0x46800000u;
    uint32_t code = a < 0x3C800000u ? sub : normal;
    code = a > 0x7F800000u ? 0x7Fu : code; /* NaN keeps its sign, as torch converts it */
    return (uint8_t)(code | sign);
}

static inline float e4m3_value(uint8_t c) {
    uint32_t b = c;
    float f = from_bits(((b & 0x7Fu) << 20) | ((b & 0x80u) << 24)) * 0x1p120f;
    return (b & 0x7Fu) == 0x7Fu ? __builtin_nanf("") : f;
}

/* |x| as bits: unsigned order is float order for non-negative floats, NaN above them all
 * (so a NaN propagates as in torch's amax), and an integer max reduction vectorises. */
static inline uint32_t abs_bits(float x) { return to_bits(x) & 0x7FFFFFFFu; }

static inline float scale_of(float amax) {
    return (amax < 1e-12f ? 1e-12f : amax) / 448.0f; /* NaN stays NaN */
}

/* The vector encoders: 8 values a step with AVX2 and FMA, 16 with AVX-512, each the same
 * arithmetic as e4m3() written so that it costs fewer instructions (GCC's own
 * vectorisation of e4m3() narrows its selects to bytes early and spills).
 *  - The quotient x / scale without a division: q = x * r with r = 1 / scale rounded, then
 *    q += (x - q * scale) * r with two FMAs, which is the correctly rounded quotient
 *    (Markstein's theorem: r within half an ulp of 1/scale, q within one ulp of x/scale).
 *    Slices whose scale is not finite (a NaN or inf in them) take the scalar loop, which
 *    divides; their NaN codes' signs are the quotient's (torch's own NaN signs vary with
 *    its vector and tail loops, so a NaN code's sign bit is not part of the contract).
 *  - The rounding to 3 mantissa bits in one step for normals and subnormals: adding
 *    c = 2^(e + 20) (e: the exponent of |q|, at least 2^14 = 2^(-9 + 23) for the subnormal
 *    step 2^-9) leaves exactly the bits that e4m3 keeps, rounded to nearest even; the
 *    result times 2^-120 has the code in its bits 20-26 (as in the decoder). The calls
 *    clear FTZ/DAZ for themselves, so that the float32 subnormals this makes are kept.
 *  - With a finite scale, |x| <= amax and the scale positive, so |q| <= 448 (1 + 2^-23),
 *    which rounds to 448: no clamp and no NaN code are needed, and the sign is x's.
 * On AVX2 hosts (bf16 input, one core, 4 MiB): K 0.94 -> 0.70 ms, V 1.06 -> 0.70 ms once
 * the clamp left the division-free path, the signs of 16-bit values came from one byte
 * pack per 32, their maxima were taken on 16 bits and (V) a slab's row scales were all
 * found before its codes; fp16 input 2.1-2.4 -> 0.67-0.81 ms.
 * The vector decoder (values_fast): bf16 0.93 -> 0.35 ms, fp16 2.7 -> 0.21, f32 0.57 ->
 * 0.19 against the compiler's vectorisation of the scalar loop. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 load8(const void *x, int64_t i, int dtype) {
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    if (dtype == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    if (dtype == F16) return _mm256_cvtph_ps(h);
    return _mm256_loadu_ps((const float *)x + i);
}

/* The code's 7 magnitude bits as int32, without the sign (the callers add it); the scale
 * finite (see above). */
static inline __m256i e4m3x8_mag(__m256 x, __m256 s, __m256 r) {
    __m256 q = _mm256_mul_ps(x, r);
    q = _mm256_fmadd_ps(_mm256_fnmadd_ps(q, s, x), r, q);
    __m256 a = _mm256_and_ps(q, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
    __m256i e = _mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(0x7F800000));
    __m256 c = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_set1_epi32(20 << 23)));
    c = _mm256_max_ps(c, _mm256_set1_ps(16384.0f));
    __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_add_ps(a, c), c), _mm256_set1_ps(0x1p-120f));
    return _mm256_srli_epi32(_mm256_castps_si256(v), 20);
}

/* 32 codes with their signs: the signs of 16-bit values (bf16, f16) come from packing
 * their bits to bytes with signed saturation (bit 7 of each byte is the value's sign);
 * those of float32s are added per value. */
static inline __attribute__((always_inline)) void
codes32(const void *x, int64_t i, int dtype, const float *s, const float *r, int per_col,
        uint8_t *c) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256 s1 = _mm256_set1_ps(s[0]), r1 = _mm256_set1_ps(r[0]);
    __m256i q[4];
    for (int j = 0; j < 4; j++) {
        const __m256 si = per_col ? _mm256_loadu_ps(s + i + 8 * j) : s1;
        const __m256 ri = per_col ? _mm256_loadu_ps(r + i + 8 * j) : r1;
        const __m256 xj = load8(x, i + 8 * j, dtype);
        q[j] = e4m3x8_mag(xj, si, ri);
        if (dtype == F32) {
            const __m256i sign = _mm256_srli_epi32(_mm256_castps_si256(xj), 24);
            q[j] = _mm256_or_si256(q[j], _mm256_and_si256(sign, _mm256_set1_epi32(0x80)));
        }
    }
    __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]),
                                    _mm256_packus_epi32(q[2], q[3]));
    w = _mm256_permutevar8x32_epi32(w, order);
    if (dtype != F32) {
        const __m256i *h = (const __m256i *)((const uint16_t *)x + i);
        __m256i sign = _mm256_packs_epi16(_mm256_loadu_si256(h), _mm256_loadu_si256(h + 1));
        sign = _mm256_permute4x64_epi64(sign, 0xD8);
        w = _mm256_or_si256(w, _mm256_and_si256(sign, _mm256_set1_epi8((char)0x80)));
    }
    _mm256_storeu_si256((__m256i *)(c + i), w);
}

#if defined(__AVX512F__)
static inline __m512 load16(const void *x, int64_t i, int dtype) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    if (dtype == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    if (dtype == F16) return _mm512_cvtph_ps(h);
    return _mm512_loadu_ps((const float *)x + i);
}

static inline __m128i e4m3x16(__m512 x, __m512 s, __m512 r) {
    __m512 q = _mm512_mul_ps(x, r);
    q = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, s, x), r, q);
    __m512i a = _mm512_and_si512(_mm512_castps_si512(q), _mm512_set1_epi32(0x7FFFFFFF));
    __m512 m = _mm512_castsi512_ps(a);
    __m512i e = _mm512_and_si512(a, _mm512_set1_epi32(0x7F800000));
    __m512 c = _mm512_castsi512_ps(_mm512_add_epi32(e, _mm512_set1_epi32(20 << 23)));
    c = _mm512_max_ps(c, _mm512_set1_ps(16384.0f));
    __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_add_ps(m, c), c), _mm512_set1_ps(0x1p-120f));
    __m512i code = _mm512_srli_epi32(_mm512_castps_si512(v), 20);
    __m512i sign = _mm512_srli_epi32(_mm512_castps_si512(x), 24);
    code = _mm512_or_si512(code, _mm512_and_si512(sign, _mm512_set1_epi32(0x80)));
    return _mm512_cvtepi32_epi8(code);
}
#endif

/* Codes for x[0:n) with scale s[i] and reciprocal r[i] (per_col) or s[0], r[0]; r NULL (a
 * scale not finite): none. Returns how many it did; the caller converts the rest one at a
 * time. */
static inline __attribute__((always_inline)) int64_t
codes_fast(const void *x, int dtype, const float *s, const float *r, int per_col, uint8_t *c,
           int64_t n) {
#if !defined(__F16C__)
    if (dtype == F16) return 0;
#endif
    if (r == NULL) return 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 s1 = _mm512_set1_ps(s[0]), r1 = _mm512_set1_ps(r[0]);
    for (; i + 16 <= n; i += 16) {
        const __m512 si = per_col ? _mm512_loadu_ps(s + i) : s1;
        const __m512 ri = per_col ? _mm512_loadu_ps(r + i) : r1;
        _mm_storeu_si128((__m128i *)(c + i), e4m3x16(load16(x, i, dtype), si, ri));
    }
#else
    for (; i + 32 <= n; i += 32) codes32(x, i, dtype, s, r, per_col, c);
#endif
    return i;
}

/* The vector decoder, 8 codes a step (AVX2): the code byte sign-extended to 32 bits and
 * shifted left by 20 has its sign in bits 27-31 and its 7 magnitude bits in bits 20-26;
 * keeping bit 31 and bits 20-26 gives e4m3_value's float before its "* 2^120", which is
 * folded into the scale: f = scale * 2^120, exact where |scale| < 2^7 (the caller checks),
 * so bits * f is the one rounding of torch's code.float() * scale. No NaN can come out
 * (finite codes times a finite scale), so bf16's rounding needs no NaN case; a block of
 * 32 codes holding a NaN code (0x7F, 0xFF) ends the vector loop there, for the scalar
 * one to finish. Returns how many values it did. */
static inline __m256 value8(const uint8_t *c, __m256 f) {
    __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c));
    w = _mm256_and_si256(_mm256_slli_epi32(w, 20), _mm256_set1_epi32((int)0x87F00000u));
    return _mm256_mul_ps(_mm256_castsi256_ps(w), f);
}

static inline __m256i bf16_bits8(__m256 x) { /* finite or inf, never NaN: see above */
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd);
    return _mm256_srli_epi32(r, 16);
}

static inline __attribute__((always_inline)) int64_t
values_fast(const uint8_t *c, const float *f, int per_col, void *o, int dtype, int64_t n) {
#if !defined(__F16C__)
    if (dtype == F16) return 0;
#endif
    const __m256 f1 = _mm256_set1_ps(f[0]);
    const __m256i top = _mm256_set1_epi8((char)0x80);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(c + i));
        const __m256i nan = _mm256_cmpeq_epi8(_mm256_or_si256(b, top), _mm256_set1_epi8(-1));
        if (!_mm256_testz_si256(nan, nan)) break;
        __m256 x[4];
        for (int j = 0; j < 4; j++)
            x[j] = value8(c + i + 8 * j, per_col ? _mm256_loadu_ps(f + i + 8 * j) : f1);
        if (dtype == BF16) {
            for (int j = 0; j < 4; j += 2) {
                const __m256i w = _mm256_packus_epi32(bf16_bits8(x[j]), bf16_bits8(x[j + 1]));
                _mm256_storeu_si256((__m256i *)((uint16_t *)o + i + 8 * j),
                                    _mm256_permute4x64_epi64(w, 0xD8));
            }
        } else if (dtype == F16) {
#if defined(__F16C__)
            for (int j = 0; j < 4; j++)
                _mm_storeu_si128((__m128i *)((uint16_t *)o + i + 8 * j),
                                 _mm256_cvtps_ph(x[j], _MM_FROUND_TO_NEAREST_INT));
#endif
        } else {
            for (int j = 0; j < 4; j++) _mm256_storeu_ps((float *)o + i + 8 * j, x[j]);
        }
    }
    return i;
}
#else
static inline int64_t values_fast(const uint8_t *c, const float *f, int per_col, void *o,
                                  int dtype, int64_t n) {
    (void)c, (void)f, (void)per_col, (void)o, (void)dtype, (void)n;
    return 0;
}

static inline int64_t codes_fast(const void *x, int dtype, const float *s, const float *r,
                                 int per_col, uint8_t *c, int64_t n) {
    (void)x, (void)dtype, (void)s, (void)r, (void)per_col, (void)c, (void)n;
    return 0;
}
#endif

/* Where the quotient may skip the division: a finite scale (see above). */
static inline const float *reciprocals(const float *s, float *r, int64_t n) {
    int finite = 1;
    for (int64_t i = 0; i < n; i++) {
        r[i] = 1.0f / s[i];
        finite &= s[i] - s[i] == 0.0f; /* false for NaN and inf */
    }
    return finite ? r : NULL;
}

/* Where the decoder may fold 2^120 into a scale (see values_fast): |s| < 2^7, not NaN. */
static inline int foldable(float s) { return s < 0x1p7f && s > -0x1p7f; }

/* The scales s[0:n) times 2^120 into f, or NULL where one of them may not be folded. */
static inline const float *fold(const float *s, float *f, int64_t n) {
    int ok = 1;
    for (int64_t i = 0; i < n; i++) {
        f[i] = s[i] * 0x1p120f;
        ok &= foldable(s[i]);
    }
    return ok ? f : NULL;
}

/* |x| as bits for 16-bit types: their own bits without the sign, which order as the values
 * do (NaN above inf), so the maximum is taken on 16 bits, 16 values a vector step. */
static inline float half_value(uint16_t b, int dtype) {
    if (dtype == BF16) return from_bits((uint32_t)b << 16);
    _Float16 h;
    memcpy(&h, &b, 2);
    return (float)h;
}

static uint16_t amax16_row(const uint16_t *restrict x, int64_t n) {
    uint16_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t a = x[i] & 0x7FFFu;
        m = a > m ? a : m;
    }
    return m;
}

static void amax16_cols(const uint16_t *restrict x, int64_t n, uint16_t *restrict m) {
    for (int64_t i = 0; i < n; i++) {
        const uint16_t a = x[i] & 0x7FFFu;
        m[i] = a > m[i] ? a : m[i];
    }
}

/* Scratch of the encoders and decoders: per-channel arrays of a slab's head_dim on the stack
 * up to STACK_DIM (every model's), on the heap above; per-token scales a block of ROWS rows
 * at a time. Nothing on the stack grows with the input. */
#define STACK_DIM 1024
#define ROWS 256

struct columns {
    uint32_t *m32; /* float32 sources: |x| bits of the column maxima */
    uint16_t *m16; /* 16-bit sources: the same on 16 bits */
    float *rcp;    /* the reciprocals of the columns' scales */
    void *heap;
    uint32_t m32_stack[STACK_DIM];
    uint16_t m16_stack[STACK_DIM];
    float rcp_stack[STACK_DIM];
};

static int columns_open(struct columns *c, int64_t dim) {
    c->heap = NULL;
    c->m32 = c->m32_stack, c->m16 = c->m16_stack, c->rcp = c->rcp_stack;
    if (dim <= STACK_DIM) return 1;
    const size_t n = (size_t)dim;
    c->heap = malloc(n * (sizeof *c->m32 + sizeof *c->rcp + sizeof *c->m16));
    if (c->heap == NULL) return 0;
    c->m32 = c->heap;
    c->rcp = (float *)(c->m32 + n);
    c->m16 = (uint16_t *)(c->rcp + n);
    return 1;
}

static void columns_close(struct columns *c) { free(c->heap); }

/* Row kernels: one load, one store, no branches and restrict pointers, so that each
 * inner loop vectorises (the outer loops below only pick rows). */
#define DEFINE(DT, NAME)                                                                  \
    static void amax_row_##NAME(const void *restrict x, int64_t n, float *restrict s) {   \
        if (DT != F32) {                                                                  \
            *s = scale_of(half_value(amax16_row(x, n), DT));                              \
            return;                                                                       \
        }                                                                                 \
        uint32_t m = 0;                                                                   \
        for (int64_t i = 0; i < n; i++) {                                                 \
            const uint32_t a = abs_bits(load(x, i, DT));                                  \
            m = a > m ? a : m;                                                            \
        }                                                                                 \
        *s = scale_of(from_bits(m));                                                      \
    }                                                                                     \
    static void amax_cols_##NAME(const void *restrict x, int64_t n, void *restrict m) {   \
        if (DT != F32) {                                                                  \
            amax16_cols(x, n, m);                                                         \
            return;                                                                       \
        }                                                                                 \
        uint32_t *restrict m32 = m;                                                       \
        for (int64_t i = 0; i < n; i++) {                                                 \
            const uint32_t a = abs_bits(load(x, i, DT));                                  \
            m32[i] = a > m32[i] ? a : m32[i];                                             \
        }                                                                                 \
    }                                                                                     \
    static void codes_one_##NAME(const void *restrict x, float s, const float *rp,        \
                                 uint8_t *restrict c, int64_t n) {                        \
        for (int64_t i = codes_fast(x, DT, &s, rp, 0, c, n); i < n; i++)                 \
            c[i] = e4m3(load(x, i, DT), s);                                               \
    }                                                                                     \
    static void codes_cols_##NAME(const void *restrict x, const float *restrict s,        \
                                  const float *r, uint8_t *restrict c, int64_t n) {       \
        for (int64_t i = codes_fast(x, DT, s, r, 1, c, n); i < n; i++)                   \
            c[i] = e4m3(load(x, i, DT), s[i]);                                            \
    }                                                                                     \
    static void values_one_##NAME(const uint8_t *restrict c, float s, void *restrict o,   \
                                  int64_t n) {                                            \
        const float f = s * 0x1p120f;                                                     \
        int64_t i = foldable(s) ? values_fast(c, &f, 0, o, DT, n) : 0;                    \
        for (; i < n; i++) store(o, i, e4m3_value(c[i]) * s, DT);                         \
    }                                                                                     \
    static void values_cols_##NAME(const uint8_t *restrict c, const float *restrict s,    \
                                   const float *f, void *restrict o, int64_t n) {         \
        int64_t i = f != NULL ? values_fast(c, f, 1, o, DT, n) : 0;                       \
        for (; i < n; i++) store(o, i, e4m3_value(c[i]) * s[i], DT);                      \
    }                                                                                     \
    static int encode_##NAME(const char *x, uint8_t *codes, float *scale, int64_t outer,  \
                             int64_t tokens, int64_t dim, int per_token, int64_t esize) {  \
        struct columns cols; /* per channel: a slab's column maxima, their reciprocals */ \
        float rcp_t[ROWS];   /* per token: a block of rows' reciprocals */                \
        if (!per_token && !columns_open(&cols, dim)) return -2;                           \
        for (int64_t o = 0; o < outer; o++) {                                             \
            const int64_t base = o * tokens * dim;                                        \
            if (per_token) { /* a block of rows' scales first: their divisions overlap */ \
                for (int64_t t0 = 0; t0 < tokens; t0 += ROWS) {                           \
                    const int64_t rows = tokens - t0 < ROWS ? tokens - t0 : ROWS;         \
                    float *s = scale + o * tokens + t0;                                   \
                    const char *x0 = x + (base + t0 * dim) * esize;                       \
                    uint8_t *c0 = codes + base + t0 * dim;                                \
                    for (int64_t t = 0; t < rows; t++)                                    \
                        amax_row_##NAME(x0 + t * dim * esize, dim, s + t);                \
                    for (int64_t t = 0; t < rows; t++) rcp_t[t] = 1.0f / s[t];            \
                    for (int64_t t = 0; t < rows; t++) {                                  \
                        const float *rp = s[t] - s[t] == 0.0f ? rcp_t + t : NULL;         \
                        codes_one_##NAME(x0 + t * dim * esize, s[t], rp, c0 + t * dim, dim); \
                    }                                                                     \
                }                                                                         \
            } else {                                                                      \
                float *s = scale + o * dim;                                               \
                if (DT == F32) memset(cols.m32, 0, dim * sizeof *cols.m32);               \
                else memset(cols.m16, 0, dim * sizeof *cols.m16);                         \
                for (int64_t t = 0; t < tokens; t++)                                      \
                    amax_cols_##NAME(x + (base + t * dim) * esize, dim,                   \
                                     DT == F32 ? (void *)cols.m32 : (void *)cols.m16);    \
                for (int64_t d = 0; d < dim; d++)                                         \
                    s[d] = scale_of(DT == F32 ? from_bits(cols.m32[d])                    \
                                              : half_value(cols.m16[d], DT));             \
                const float *r = reciprocals(s, cols.rcp, dim);                           \
                for (int64_t t = 0; t < tokens; t++)                                      \
                    codes_cols_##NAME(x + (base + t * dim) * esize, s, r,                 \
                                      codes + base + t * dim, dim);                       \
            }                                                                             \
        }                                                                                 \
        if (!per_token) columns_close(&cols);                                             \
        return 0;                                                                         \
    }                                                                                     \
    static void decode_##NAME(const uint8_t *codes, const float *scale, char *out,        \
                              int64_t outer, int64_t tokens, int64_t dim, int per_token,  \
                              int64_t esize) {                                            \
        /* per channel: the slab's scales times 2^120 (none if it cannot be had: scalar) */ \
        float stack[STACK_DIM], *folded = stack;                                          \
        if (!per_token && dim > STACK_DIM) folded = malloc(dim * sizeof *folded);         \
        for (int64_t o = 0; o < outer; o++) {                                             \
            const float *f = per_token || folded == NULL ? NULL                           \
                                                         : fold(scale + o * dim, folded, dim); \
            for (int64_t t = 0; t < tokens; t++) {                                        \
                const int64_t row = (o * tokens + t) * dim;                               \
                if (per_token)                                                            \
                    values_one_##NAME(codes + row, scale[o * tokens + t], out + row * esize, dim); \
                else                                                                      \
                    values_cols_##NAME(codes + row, scale + o * dim, f, out + row * esize, dim); \
            }                                                                             \
        }                                                                                 \
        if (folded != stack) free(folded);                                                \
    }
DEFINE(F32, f32)
DEFINE(BF16, bf16)
DEFINE(F16, f16)

/* K's [N, D] -> [D, N] turn, 8 x 8 values at a time: three rounds of vector shuffles
 * instead of 64 scalar moves, for the fp8 block writer (its decoded tile) and the raw copy
 * below. The raw copy into blocks is mostly memory-bound; the tiles took 8 MiB of the ttft
 * model (f32, 1 head x 64) 3.27 -> 3.07 ms from cold caches, 64 MiB of Llama-3-8B
 * geometry (bf16, 8 heads x 128) 18.6 -> 15.1 ms (alternated, AMD host). The tile reads 8
 * rows of src (stride ss) and writes 8 rows of dst (stride ds), values of 2 or 4 bytes;
 * unaligned loads and stores through memcpy. */
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define KV_TILES 1
#endif
#endif
#if defined(KV_TILES)
typedef uint32_t kv_u32x8 __attribute__((vector_size(32)));
typedef uint16_t kv_u16x8 __attribute__((vector_size(16)));
#define KV_LO3 0, 1, 2, 3, 8, 9, 10, 11 /* both sizes: join the low halves */
#define KV_HI3 4, 5, 6, 7, 12, 13, 14, 15
#define KV_TURN(VT, TYPE, LO1, HI1, LO2, HI2, ROW_LO, ROW_HI)                             \
    static inline void turn8_##TYPE(const TYPE *src, int64_t ss, TYPE *dst, int64_t ds) { \
        VT r[8], t[8], u[8];                                                              \
        for (int i = 0; i < 8; i++) memcpy(&r[i], src + i * ss, sizeof(VT));              \
        for (int i = 0; i < 8; i += 2) {                                                  \
            t[i] = __builtin_shufflevector(r[i], r[i + 1], LO1);                          \
            t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], HI1);                      \
        }                                                                                 \
        for (int i = 0; i < 8; i += 4)                                                    \
            for (int k = 0; k < 2; k++) {                                                 \
                u[i + 2 * k] = __builtin_shufflevector(t[i + k], t[i + k + 2], LO2);      \
                u[i + 2 * k + 1] = __builtin_shufflevector(t[i + k], t[i + k + 2], HI2);  \
            }                                                                             \
        for (int k = 0; k < 4; k++) {                                                     \
            VT lo = __builtin_shufflevector(u[k], u[k + 4], KV_LO3);                      \
            VT hi = __builtin_shufflevector(u[k], u[k + 4], KV_HI3);                      \
            memcpy(dst + ROW_LO(k) * ds, &lo, sizeof(VT));                                \
            memcpy(dst + ROW_HI(k) * ds, &hi, sizeof(VT));                                \
        }                                                                                 \
    }
/* 4-byte values, 256-bit rows: pairs interleave within 128-bit halves, so after the
 * second round u[k] holds columns k (low half) and k + 4 (high half) of rows 0-3 (u[k])
 * and 4-7 (u[k + 4]); the third round joins the halves. 2-byte values, 128-bit rows:
 * after the second round u[k] holds columns 2k and 2k + 1 of rows 0-3 (u[k + 4]: 4-7). */
#define KV32_ROW_LO(k) (k)
#define KV32_ROW_HI(k) ((k) + 4)
#define KV32_LO1 0, 8, 1, 9, 4, 12, 5, 13
#define KV32_HI1 2, 10, 3, 11, 6, 14, 7, 15
#define KV32_LO2 0, 1, 8, 9, 4, 5, 12, 13
#define KV32_HI2 2, 3, 10, 11, 6, 7, 14, 15
#define KV16_ROW_LO(k) (2 * (k))
#define KV16_ROW_HI(k) (2 * (k) + 1)
#define KV16_LO1 0, 8, 1, 9, 2, 10, 3, 11
#define KV16_HI1 4, 12, 5, 13, 6, 14, 7, 15
#define KV16_LO2 0, 1, 8, 9, 2, 3, 10, 11
#define KV16_HI2 4, 5, 12, 13, 6, 7, 14, 15
KV_TURN(kv_u32x8, uint32_t, KV32_LO1, KV32_HI1, KV32_LO2, KV32_HI2, KV32_ROW_LO, KV32_ROW_HI)
KV_TURN(kv_u16x8, uint16_t, KV16_LO1, KV16_HI1, KV16_LO2, KV16_HI2, KV16_ROW_LO, KV16_ROW_HI)
#endif

/* One layer of a load's chunks decoded straight into an engine's paged cache (no batch,
 * no staging copy). geo = {chunks, heads, tokens, dim, block tokens N, head stride, K's
 * token and dim strides, V's offset, token and dim strides}, in elements of the cache:
 * chunk j's block i of head h starts at off[j * tokens / N + i] + h * head stride; ptrs
 * holds per chunk the layer's K codes [H, T, D], V codes, K scales [H, D], V scales [H, T].
 * The order is vLLM's CPU "VEC" one: K [D, N] (token stride 1: a row per dim) and V [N, D]
 * (dim stride 1, token stride D: its rows abut); kv_place_ok refuses any other. */
/* src's [N, D] values (D a row) into dst's [D, N] (ksd a row); N and D multiples of 8. The
 * scalar form moves bytes (memcpy): the fp8 writer's tile was written as float or _Float16. */
#if defined(KV_TILES)
#define KV_TURN_TILE(TYPE, src, dst)                                                      \
    for (int64_t d = 0; d < D; d += 8)                                                    \
        for (int64_t n = 0; n < N; n += 8) turn8_##TYPE(src + n * D + d, D, dst + d * ksd + n, ksd);
#else
#define KV_TURN_TILE(TYPE, src, dst)                                                      \
    for (int64_t d = 0; d < D; d++)                                                       \
        for (int64_t n = 0; n < N; n++) memcpy(dst + d * ksd + n, src + n * D + d, sizeof(TYPE));
#endif
#define DEFINE_BLOCKS(DT, NAME, TYPE)                                                     \
    static void blocks_##NAME(const int64_t *ptrs, const int64_t *off, char *out,         \
                              const int64_t *g, int64_t esize) {                          \
        const int64_t m = g[0], heads = g[1], T = g[2], D = g[3], N = g[4], sh = g[5];    \
        const int64_t ksd = g[7], voff = g[8], vsn = g[9], nb = T / N;                    \
        /* K: a block's [N, D] codes decoded row by row (the vector decoder) into a tile, \
         * then turned into the cache's [D, N] 8 x 8 values at a time; without the tile   \
         * (no memory, or N or D not a multiple of 8), one value at a time */             \
        const int tiles = N % 8 == 0 && D % 8 == 0;                                       \
        TYPE *tile = tiles ? malloc((size_t)(N * D) * sizeof(TYPE)) : NULL;               \
        float *fk = tile != NULL ? malloc((size_t)D * sizeof(float)) : NULL;              \
        for (int64_t j = 0; j < m; j++) {                                                 \
            const uint8_t *kc = (const uint8_t *)ptrs[4 * j];                             \
            const uint8_t *vc = (const uint8_t *)ptrs[4 * j + 1];                         \
            const float *ks = (const float *)ptrs[4 * j + 2];                             \
            const float *vs = (const float *)ptrs[4 * j + 3];                             \
            for (int64_t h = 0; h < heads; h++) {                                         \
                const float *kh = ks + h * D;                                             \
                const float *f = fk != NULL ? fold(kh, fk, D) : NULL;                     \
                for (int64_t i = 0; i < nb; i++) {                                        \
                    char *o = out + (off[j * nb + i] + h * sh) * esize;                   \
                    const uint8_t *kb = kc + (h * T + i * N) * D;                         \
                    const uint8_t *vb = vc + (h * T + i * N) * D;                         \
                    const float *vt = vs + h * T + i * N;                                 \
                    if (fk != NULL) {                                                     \
                        for (int64_t n = 0; n < N; n++)                                   \
                            values_cols_##NAME(kb + n * D, kh, f, tile + n * D, D);       \
                        TYPE *ok = (TYPE *)o;                                             \
                        KV_TURN_TILE(TYPE, tile, ok)                                      \
                    } else {                                                              \
                        for (int64_t d = 0; d < D; d++) {                                 \
                            char *od = o + d * ksd * esize;                               \
                            for (int64_t n = 0; n < N; n++)                               \
                                store(od, n, e4m3_value(kb[n * D + d]) * kh[d], DT);      \
                        }                                                                 \
                    }                                                                     \
                    for (int64_t n = 0; n < N; n++)                                       \
                        values_one_##NAME(vb + n * D, vt[n], o + (voff + n * vsn) * esize, D); \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
        free(fk);                                                                         \
        free(tile);                                                                       \
    }
DEFINE_BLOCKS(F32, f32, uint32_t)
DEFINE_BLOCKS(BF16, bf16, uint16_t)
DEFINE_BLOCKS(F16, f16, uint16_t)

typedef int (*encoder)(const char *, uint8_t *, float *, int64_t, int64_t, int64_t, int,
                        int64_t);
typedef void (*decoder)(const uint8_t *, const float *, char *, int64_t, int64_t, int64_t, int,
                        int64_t);
static const encoder ENCODERS[] = {encode_f32, encode_bf16, encode_f16}; /* by dtype */
static const decoder DECODERS[] = {decode_f32, decode_bf16, decode_f16};
typedef void (*block_decoder)(const int64_t *, const int64_t *, char *, const int64_t *, int64_t);
static const block_decoder BLOCK_DECODERS[] = {blocks_f32, blocks_bf16, blocks_f16};
static const int64_t ESIZE[] = {4, 2, 2};

/* Both directions make and read float32 subnormals (the e4m3 subnormals times 2^-120):
 * the calling thread's flush-to-zero and denormals-are-zero modes, if someone set them
 * (torch.set_flush_denormal), are cleared for the call and restored after it. */
#if defined(__SSE__)
#include <xmmintrin.h>
static inline unsigned int exact_fp_begin(void) {
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr & ~0x8040u); /* FTZ (bit 15), DAZ (bit 6) */
    return csr;
}
static inline void exact_fp_end(unsigned int csr) { _mm_setcsr(csr); }
#else
static inline unsigned int exact_fp_begin(void) { return 0; }
static inline void exact_fp_end(unsigned int csr) { (void)csr; }
#endif

int kv_fp8_encode(const void *x, int dtype, uint8_t *codes, float *scale, int64_t outer,
                  int64_t tokens, int64_t dim, int per_token) {
    if (dtype < F32 || dtype > F16) return -1;
    const unsigned int csr = exact_fp_begin();
    const int rc = ENCODERS[dtype](x, codes, scale, outer, tokens, dim, per_token, ESIZE[dtype]);
    exact_fp_end(csr);
    return rc;
}

int kv_fp8_decode(const uint8_t *codes, const float *scale, void *out, int dtype, int64_t outer,
                  int64_t tokens, int64_t dim, int per_token) {
    if (dtype < F32 || dtype > F16) return -1;
    const unsigned int csr = exact_fp_begin();
    DECODERS[dtype](codes, scale, out, outer, tokens, dim, per_token, ESIZE[dtype]);
    exact_fp_end(csr);
    return 0;
}

/* The geometry the block writers take: whole blocks, the VEC order (see DEFINE_BLOCKS). */
static int kv_place_ok(const int64_t *geo) {
    return geo[4] > 0 && geo[2] % geo[4] == 0 && geo[6] == 1 && geo[10] == 1 && geo[9] == geo[3];
}

int kv_fp8_decode_blocks(const int64_t *ptrs, const int64_t *off, void *out, int dtype,
                         const int64_t *geo) {
    if (dtype < F32 || dtype > F16 || !kv_place_ok(geo)) return -1;
    const unsigned int csr = exact_fp_begin();
    BLOCK_DECODERS[dtype](ptrs, off, out, geo, ESIZE[dtype]);
    exact_fp_end(csr);
    return 0;
}

/* The same placement for raw chunks (no codec): chunk j's layer K and V, [H, T, D] values of
 * the cache's own type (2 or 4 bytes), at ptrs[2 j] and ptrs[2 j + 1], copied into the blocks
 * geo and off describe (as kv_fp8_decode_blocks), with no staging copy. */
#if defined(KV_TILES)
#define KV_TURN_TILES(TYPE)                                                               \
    if (N % 8 == 0 && D % 8 == 0) {                                                       \
        KV_TURN_TILE(TYPE, kb, o)                                                         \
        continue;                                                                         \
    }
#else
#define KV_TURN_TILES(TYPE)
#endif
#define DEFINE_COPY(TYPE)                                                                 \
    static void copy_blocks_##TYPE(const int64_t *ptrs, const int64_t *off, TYPE *out,    \
                                   const int64_t *g) {                                    \
        const int64_t m = g[0], heads = g[1], T = g[2], D = g[3], N = g[4], sh = g[5];    \
        const int64_t ksd = g[7], voff = g[8], nb = T / N;                                \
        for (int64_t j = 0; j < m; j++)                                                   \
            for (int64_t h = 0; h < heads; h++)                                           \
                for (int64_t i = 0; i < nb; i++) {                                        \
                    TYPE *o = out + off[j * nb + i] + h * sh;                             \
                    const TYPE *kb = (const TYPE *)ptrs[2 * j] + (h * T + i * N) * D;     \
                    const TYPE *vb = (const TYPE *)ptrs[2 * j + 1] + (h * T + i * N) * D; \
                    memcpy(o + voff, vb, (size_t)(N * D) * sizeof(TYPE)); /* V rows abut */ \
                    KV_TURN_TILES(TYPE)                                                   \
                    for (int64_t d = 0; d < D; d++)                                       \
                        for (int64_t n = 0; n < N; n++)                                   \
                            o[d * ksd + n] = kb[n * D + d];                               \
                }                                                                         \
    }
DEFINE_COPY(uint16_t)
DEFINE_COPY(uint32_t)

int kv_copy_blocks(const int64_t *ptrs, const int64_t *off, void *out, int64_t esize,
                   const int64_t *geo) {
    if (!kv_place_ok(geo)) return -1;
    if (esize == 2) copy_blocks_uint16_t(ptrs, off, out, geo);
    else if (esize == 4) copy_blocks_uint32_t(ptrs, off, out, geo);
    else return -1;
    return 0;
}
