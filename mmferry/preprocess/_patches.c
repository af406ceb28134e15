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
int mmferry_patches_u8(const uint8_t *src, ptrdiff_t frame_stride, ptrdiff_t row_stride,
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

int mmferry_patches_f32(const uint8_t *src, ptrdiff_t frame_stride, ptrdiff_t row_stride,
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

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_patches", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__patches(void) { return PyModule_Create(&module); }
