/* Resized RGB frames (HWC, uint8, 3 or 4 bytes a pixel) -> Qwen-VL patch rows in one pass
 * over the output.
 *
 * torch has no fused de-interleave: gathering from HWC memory into [C][P][P] rows runs its
 * strided copy at 16 elements per inner loop, 3-6x slower than writing the output once. Here
 * each band of merge-block rows is first split into planar lines (cache-resident; vectorised
 * byte shuffles), and the output is then written strictly in order, one 16-value run at a
 * time. The hf variant applies the per-channel affine on the planar lines with fmaf, the same
 * single rounding as torch's vectorised addcmul, so both paths give the same bits.
 *
 * Row order and contents are those of patchify.py: temporal patch, merge block (row-major),
 * the M x M patches inside the block; a row is [C][T][P][P]. `group` source frames make one
 * temporal patch: 1 (an image, broadcast over the T output copies) or T (a video).
 *
 * Loaded with ctypes (kernels.py), which releases the GIL for the call; the caller splits the
 * bands over threads. A Python extension module only so that setuptools builds it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define HOT
#endif

/* One HWC row (3 or 4 bytes a pixel, the 4th unused) -> three planar lines. */
HOT static void split_row(const uint8_t *restrict s, ptrdiff_t w, ptrdiff_t pixel,
                          uint8_t *restrict r, uint8_t *restrict g, uint8_t *restrict b) {
    if (pixel == 4) { /* a constant stride in each loop, so both vectorise */
        for (ptrdiff_t x = 0; x < w; x++) {
            r[x] = s[4 * x];
            g[x] = s[4 * x + 1];
            b[x] = s[4 * x + 2];
        }
        return;
    }
    for (ptrdiff_t x = 0; x < w; x++) {
        r[x] = s[3 * x];
        g[x] = s[3 * x + 1];
        b[x] = s[3 * x + 2];
    }
}

HOT static void affine_line(const uint8_t *restrict in, ptrdiff_t w, float scale, float shift,
                            float *restrict out) {
    for (ptrdiff_t x = 0; x < w; x++) out[x] = fmaf((float)in[x], scale, shift);
}

/* n bytes from s to d. NOTE: a constant size for Qwen-VL's patch widths (16 values: Qwen3-VL,
 * 14: Qwen2-VL and Qwen2.5-VL), so the compiler inlines the copy instead of calling memcpy for
 * every short run. */
static inline void copy_run(void *restrict d, const void *restrict s, size_t n) {
    switch (n) {
    case 14: memcpy(d, s, 14); break;
    case 16: memcpy(d, s, 16); break;
    case 56: memcpy(d, s, 56); break;
    case 64: memcpy(d, s, 64); break;
    default: memcpy(d, s, n);
    }
}

/* Bands [first, last) of temporal patch-major band index (tp * bands_per_frame + i).
 * Returns 0, or -1 when out of memory. */
static int patches_u8_generic(const uint8_t *src, ptrdiff_t frame_stride, ptrdiff_t row_stride,
                       ptrdiff_t pixel_stride,
                       ptrdiff_t h, ptrdiff_t w, ptrdiff_t patch, ptrdiff_t merge,
                       ptrdiff_t group, ptrdiff_t first, ptrdiff_t last, uint8_t *dst) {
    const ptrdiff_t P = patch, M = merge, B = P * M, a = h / B, b = w / B;
    const ptrdiff_t row_bytes = 3 * group * P * P; /* one output row: [C][G][P][P] */
    const ptrdiff_t band_bytes = b * M * M * row_bytes;
    /* planar band: [G][C][B][w] */
    uint8_t *pl = malloc((size_t)(group * 3 * B * w));
    if (!pl) return -1;
    for (ptrdiff_t k = first; k < last; k++) {
        const ptrdiff_t tp = k / a, i = k % a;
        for (ptrdiff_t f = 0; f < group; f++) {
            const uint8_t *frame = src + (tp * group + f) * frame_stride;
            uint8_t *base = pl + f * 3 * B * w;
            for (ptrdiff_t r = 0; r < B; r++)
                split_row(frame + (i * B + r) * row_stride, w, pixel_stride, base + r * w,
                          base + (B + r) * w, base + (2 * B + r) * w);
        }
        uint8_t *out = dst + k * band_bytes;
        for (ptrdiff_t j = 0; j < b; j++)
            for (ptrdiff_t mi = 0; mi < M; mi++)
                for (ptrdiff_t mj = 0; mj < M; mj++)
                    for (ptrdiff_t c = 0; c < 3; c++)
                        for (ptrdiff_t f = 0; f < group; f++) {
                            const uint8_t *plane = pl + (f * 3 + c) * B * w + j * B + mj * P;
                            for (ptrdiff_t pi = 0; pi < P; pi++) {
                                copy_run(out, plane + (mi * P + pi) * w, (size_t)P);
                                out += P;
                            }
                        }
    }
    free(pl);
    return 0;
}

static int patches_f32_generic(const uint8_t *src, ptrdiff_t frame_stride, ptrdiff_t row_stride,
                        ptrdiff_t pixel_stride,
                        ptrdiff_t h, ptrdiff_t w, ptrdiff_t patch, ptrdiff_t merge,
                        ptrdiff_t group, ptrdiff_t temporal, const float *scale,
                        const float *shift, ptrdiff_t first, ptrdiff_t last, float *dst) {
    const ptrdiff_t P = patch, M = merge, B = P * M, a = h / B, b = w / B;
    const ptrdiff_t row_values = 3 * temporal * P * P; /* one output row: [C][T][P][P] */
    const ptrdiff_t band_values = b * M * M * row_values;
    uint8_t *line = malloc((size_t)(3 * w));
    /* normalised planar band: [G][C][B][w] */
    float *pl = malloc(sizeof(float) * (size_t)(group * 3 * B * w));
    if (!line || !pl) {
        free(line);
        free(pl);
        return -1;
    }
    for (ptrdiff_t k = first; k < last; k++) {
        const ptrdiff_t tp = k / a, i = k % a;
        for (ptrdiff_t f = 0; f < group; f++) {
            const uint8_t *frame = src + (tp * group + f) * frame_stride;
            for (ptrdiff_t r = 0; r < B; r++) {
                split_row(frame + (i * B + r) * row_stride, w, pixel_stride, line, line + w,
                          line + 2 * w);
                for (ptrdiff_t c = 0; c < 3; c++)
                    affine_line(line + c * w, w, scale[c], shift[c],
                                pl + ((f * 3 + c) * B + r) * w);
            }
        }
        float *out = dst + k * band_values;
        for (ptrdiff_t j = 0; j < b; j++)
            for (ptrdiff_t mi = 0; mi < M; mi++)
                for (ptrdiff_t mj = 0; mj < M; mj++)
                    for (ptrdiff_t c = 0; c < 3; c++)
                        for (ptrdiff_t t = 0; t < temporal; t++) {
                            /* an image's one frame serves every temporal copy */
                            const ptrdiff_t f = group == 1 ? 0 : t;
                            const float *plane = pl + (f * 3 + c) * B * w + j * B + mj * P;
                            for (ptrdiff_t pi = 0; pi < P; pi++) {
                                copy_run(out, plane + (mi * P + pi) * w, sizeof(float) * P);
                                out += P;
                            }
                        }
    }
    free(line);
    free(pl);
    return 0;
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define MMFERRY_AVX512 1
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi")))

/* The AVX-512 path (VBMI byte permutes; Ice Lake, Sapphire Rapids and later Xeons, Zen 4 and
 * later EPYCs). No planar band: a patch line of P <= 16 pixels is one masked load from the
 * HWC row (3 or 4 bytes a pixel), one byte permute puts a channel's values into the low byte
 * of each 32-bit lane (hf: then converted and normalised with one fma, the same single
 * rounding as fmaf) or into 16 packed bytes (compact-u8), and the output is written in order.
 * The patch's source lines stay in L1 across the three channels (and the T copies).
 *
 * `stream`: the output goes out with non-temporal stores, full 64-byte lines that skip the
 * read-for-ownership of a normal store; measured faster for outputs far past the caches
 * (kernels.py decides by size), slower for small ones that a reader takes from cache. */

/* Byte permute indices: for channel c, lane k's low byte (f32) or byte k (u8) takes source
 * byte pixel * k + c. */
AVX512 static __m512i channel_index(ptrdiff_t pixel, ptrdiff_t c, int spread) {
    uint8_t idx[64];
    memset(idx, 0, sizeof idx);
    for (int k = 0; k < 16; k++) idx[spread ? 4 * k : k] = (uint8_t)(pixel * k + c);
    return _mm512_loadu_si512(idx);
}

AVX512 static int patches_f32_avx512(const uint8_t *src, ptrdiff_t frame_stride,
                                     ptrdiff_t row_stride, ptrdiff_t pixel, ptrdiff_t h,
                                     ptrdiff_t w, ptrdiff_t patch, ptrdiff_t merge,
                                     ptrdiff_t group, ptrdiff_t temporal, const float *scale,
                                     const float *shift, ptrdiff_t first, ptrdiff_t last,
                                     float *dst, int stream) {
    const ptrdiff_t P = patch, M = merge, B = P * M, a = h / B, b = w / B;
    const ptrdiff_t row_values = 3 * temporal * P * P, band_values = b * M * M * row_values;
    /* the bytes a line needs: up to the last pixel's 3rd byte (a 4th may lie past the end) */
    const __mmask64 load = _cvtu64_mask64(~0ULL >> (64 - (pixel * (P - 1) + 3)));
    const __mmask16 keep = (__mmask16)((1u << P) - 1);
    const __mmask64 low = _cvtu64_mask64(0x1111111111111111ULL);
    stream = stream && P == 16 && ((uintptr_t)dst & 63) == 0;
    __m512i idx[3];
    __m512 sc[3], sh[3];
    for (int c = 0; c < 3; c++) {
        idx[c] = channel_index(pixel, c, 1);
        sc[c] = _mm512_set1_ps(scale[c]);
        sh[c] = _mm512_set1_ps(shift[c]);
    }
    for (ptrdiff_t k = first; k < last; k++) {
        const ptrdiff_t tp = k / a, i = k % a;
        float *out = dst + k * band_values;
        for (ptrdiff_t j = 0; j < b; j++)
            for (ptrdiff_t mi = 0; mi < M; mi++)
                for (ptrdiff_t mj = 0; mj < M; mj++, out += row_values)
                    for (ptrdiff_t f = 0; f < group; f++) {
                        const uint8_t *line = src + (tp * group + f) * frame_stride +
                                              (i * B + mi * P) * row_stride +
                                              (j * B + mj * P) * pixel;
                        for (ptrdiff_t pi = 0; pi < P; pi++, line += row_stride) {
                            const __m512i v = _mm512_maskz_loadu_epi8(load, line);
                            for (int c = 0; c < 3; c++) {
                                const __m512i q = _mm512_maskz_permutexvar_epi8(low, idx[c], v);
                                const __m512 x =
                                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), sc[c], sh[c]);
                                /* an image's one frame (f == 0) serves every temporal copy */
                                const ptrdiff_t t0 = group == 1 ? 0 : f;
                                const ptrdiff_t t1 = group == 1 ? temporal : f + 1;
                                for (ptrdiff_t t = t0; t < t1; t++) {
                                    float *o = out + ((c * temporal + t) * P + pi) * P;
                                    if (stream)
                                        _mm512_stream_ps(o, x);
                                    else
                                        _mm512_mask_storeu_ps(o, keep, x);
                                }
                            }
                        }
                    }
    }
    if (stream) _mm_sfence();
    return 0;
}

AVX512 static int patches_u8_avx512(const uint8_t *src, ptrdiff_t frame_stride,
                                    ptrdiff_t row_stride, ptrdiff_t pixel, ptrdiff_t h,
                                    ptrdiff_t w, ptrdiff_t patch, ptrdiff_t merge,
                                    ptrdiff_t group, ptrdiff_t first, ptrdiff_t last,
                                    uint8_t *dst, int stream) {
    const ptrdiff_t P = patch, M = merge, B = P * M, a = h / B, b = w / B;
    const ptrdiff_t row_bytes = 3 * group * P * P, band_bytes = b * M * M * row_bytes;
    const __mmask64 load = _cvtu64_mask64(~0ULL >> (64 - (pixel * (P - 1) + 3)));
    const __mmask16 keep = (__mmask16)((1u << P) - 1);
    /* full lines only: P == 16 gives 4 patch lines of a channel to a 64-byte line */
    stream = stream && P == 16 && ((uintptr_t)dst & 63) == 0;
    __m512i idx[3];
    for (int c = 0; c < 3; c++) idx[c] = channel_index(pixel, c, 0);
    for (ptrdiff_t k = first; k < last; k++) {
        const ptrdiff_t tp = k / a, i = k % a;
        uint8_t *out = dst + k * band_bytes;
        for (ptrdiff_t j = 0; j < b; j++)
            for (ptrdiff_t mi = 0; mi < M; mi++)
                for (ptrdiff_t mj = 0; mj < M; mj++, out += row_bytes)
                    for (ptrdiff_t f = 0; f < group; f++) {
                        const uint8_t *line = src + (tp * group + f) * frame_stride +
                                              (i * B + mi * P) * row_stride +
                                              (j * B + mj * P) * pixel;
                        if (stream) {
                            for (ptrdiff_t pi = 0; pi < P; pi += 4) {
                                __m512i v[4];
                                for (int r = 0; r < 4; r++)
                                    v[r] = _mm512_maskz_loadu_epi8(load, line + r * row_stride);
                                for (int c = 0; c < 3; c++) {
                                    __m512i o = _mm512_castsi128_si512(_mm512_castsi512_si128(
                                        _mm512_permutexvar_epi8(idx[c], v[0])));
                                    for (int r = 1; r < 4; r++)
                                        o = _mm512_inserti32x4(
                                            o,
                                            _mm512_castsi512_si128(
                                                _mm512_permutexvar_epi8(idx[c], v[r])),
                                            r);
                                    _mm512_stream_si512(
                                        (void *)(out + ((c * group + f) * P + pi) * P), o);
                                }
                                line += 4 * row_stride;
                            }
                            continue;
                        }
                        for (ptrdiff_t pi = 0; pi < P; pi++, line += row_stride) {
                            const __m512i v = _mm512_maskz_loadu_epi8(load, line);
                            for (int c = 0; c < 3; c++)
                                _mm_mask_storeu_epi8(
                                    out + ((c * group + f) * P + pi) * P, keep,
                                    _mm512_castsi512_si128(_mm512_permutexvar_epi8(idx[c], v)));
                        }
                    }
    }
    if (stream) _mm_sfence();
    return 0;
}
#endif

/* The widest path this CPU runs: 1 AVX-512 (F, BW, VL, VBMI), 0 the portable one (itself
 * compiled for AVX2/FMA and plain x86-64, picked by target_clones). */
int mmferry_patches_isa(void) {
#ifdef MMFERRY_AVX512
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi"))
        return 1;
#endif
    return 0;
}

/* `isa`: the path to take, at most mmferry_patches_isa() (kernels.py asks it once; a test
 * takes each level the CPU has). Patches wider than 16 pixels take the portable path. */
int mmferry_patches_u8(const uint8_t *src, ptrdiff_t frame_stride, ptrdiff_t row_stride,
                       ptrdiff_t pixel_stride, ptrdiff_t h, ptrdiff_t w, ptrdiff_t patch,
                       ptrdiff_t merge, ptrdiff_t group, ptrdiff_t first, ptrdiff_t last,
                       uint8_t *dst, int isa, int stream) {
#ifdef MMFERRY_AVX512
    if (isa >= 1 && patch <= 16 && mmferry_patches_isa() >= 1)
        return patches_u8_avx512(src, frame_stride, row_stride, pixel_stride, h, w, patch,
                                 merge, group, first, last, dst, stream);
#endif
    (void)isa;
    (void)stream;
    return patches_u8_generic(src, frame_stride, row_stride, pixel_stride, h, w, patch, merge,
                              group, first, last, dst);
}

int mmferry_patches_f32(const uint8_t *src, ptrdiff_t frame_stride, ptrdiff_t row_stride,
                        ptrdiff_t pixel_stride, ptrdiff_t h, ptrdiff_t w, ptrdiff_t patch,
                        ptrdiff_t merge, ptrdiff_t group, ptrdiff_t temporal, const float *scale,
                        const float *shift, ptrdiff_t first, ptrdiff_t last, float *dst,
                        int isa, int stream) {
#ifdef MMFERRY_AVX512
    if (isa >= 1 && patch <= 16 && mmferry_patches_isa() >= 1)
        return patches_f32_avx512(src, frame_stride, row_stride, pixel_stride, h, w, patch,
                                  merge, group, temporal, scale, shift, first, last, dst, stream);
#endif
    (void)isa;
    (void)stream;
    return patches_f32_generic(src, frame_stride, row_stride, pixel_stride, h, w, patch, merge,
                               group, temporal, scale, shift, first, last, dst);
}

/* Rows of RGB in 4-byte pixels (the 4th byte unused; how Pillow and a decoded JPEG hold RGB)
 * -> contiguous 3-byte pixels, `rows` rows of `w` pixels `row_stride` bytes apart. The item
 * key hashes RGB pixels packed (decode.py, pixels_identity): this packs them a cache-sized
 * chunk at a time for the hash, instead of a strided copy of the whole image. */
HOT static void pack_rgb_generic(const uint8_t *restrict src, ptrdiff_t row_stride, ptrdiff_t w,
                                 ptrdiff_t rows, uint8_t *restrict dst) {
    for (ptrdiff_t y = 0; y < rows; y++) {
        const uint8_t *s = src + y * row_stride;
        for (ptrdiff_t x = 0; x < w; x++) {
            dst[3 * x] = s[4 * x];
            dst[3 * x + 1] = s[4 * x + 1];
            dst[3 * x + 2] = s[4 * x + 2];
        }
        dst += 3 * w;
    }
}

#ifdef MMFERRY_AVX512
/* 16 pixels a step: one load, one byte permute, one 48-byte masked store; the row's tail
 * with masked loads and stores (nothing read or written past the row). */
AVX512 static void pack_rgb_avx512(const uint8_t *src, ptrdiff_t row_stride, ptrdiff_t w,
                                   ptrdiff_t rows, uint8_t *dst) {
    uint8_t idx[64];
    for (int j = 0; j < 64; j++) idx[j] = (uint8_t)(j < 48 ? (j / 3) * 4 + j % 3 : 0);
    const __m512i perm = _mm512_loadu_si512(idx);
    for (ptrdiff_t y = 0; y < rows; y++) {
        const uint8_t *s = src + y * row_stride;
        ptrdiff_t x = 0;
        for (; x + 16 <= w; x += 16) {
            __m512i v = _mm512_loadu_si512(s + 4 * x);
            _mm512_mask_storeu_epi8(dst + 3 * x, 0xFFFFFFFFFFFFull,
                                    _mm512_permutexvar_epi8(perm, v));
        }
        ptrdiff_t n = w - x;
        if (n > 0) {
            __m512i v = _mm512_maskz_loadu_epi8(_cvtu64_mask64((~0ull) >> (64 - 4 * n)), s + 4 * x);
            _mm512_mask_storeu_epi8(dst + 3 * x, _cvtu64_mask64((~0ull) >> (64 - 3 * n)),
                                    _mm512_permutexvar_epi8(perm, v));
        }
        dst += 3 * w;
    }
}
#endif

int mmferry_pack_rgb(const uint8_t *src, ptrdiff_t row_stride, ptrdiff_t w, ptrdiff_t rows,
                     uint8_t *dst, int isa) {
#ifdef MMFERRY_AVX512
    if (isa >= 1 && mmferry_patches_isa() >= 1) {
        pack_rgb_avx512(src, row_stride, w, rows, dst);
        return 0;
    }
#endif
    (void)isa;
    pack_rgb_generic(src, row_stride, w, rows, dst);
    return 0;
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_patches", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__patches(void) { return PyModule_Create(&module); }
