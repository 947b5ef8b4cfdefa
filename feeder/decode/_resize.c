/*
 * feeder's bilinear resize of uint8 RGB pixels: RandomResizedCrop's resize,
 * written so that the fused decode (_jpeg.c: decode, crop, resize and flip in
 * one call without the GIL) and the transform called on its own give the same
 * bytes on every CPU.
 *
 * Why not cv2.resize: it cannot run inside a C call that has released the GIL,
 * and its INTER_LINEAR is not one function of its input: the vector loop and
 * the scalar tail round differently, and which pixels each takes depends on
 * the CPU's vector width. This one is plain integer arithmetic, so the same
 * everywhere; it stays within one level of cv2's.
 *
 * The mapping is the half-pixel one of cv2's INTER_LINEAR and of torch's
 * bilinear with align_corners=False: output pixel j samples the input at
 * (j + 0.5) * in / out - 0.5, clamped to the first and last pixels. Each axis
 * weighs its two neighbours with weights of 8 fractional bits (a1 =
 * round(frac * 256), a0 = 256 - a1). The vertical blend comes first, exact in
 * 16 bits (255 * 256 fits), over whole rows (the compiler vectorises it);
 * then the horizontal one in 32 bits, rounded once:
 *     out = (a0 * V[x0] + a1 * V[x0 + 1] + 2^15) >> 16,
 *     V = b0 * S[y0] + b1 * S[y0 + 1],
 * which never exceeds 255 (the weights of each axis sum to 256).
 */
/* The loops below are written for the compiler to vectorise, which GCC does at -O3. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O3")
#endif

#include "_resize.h"

#include <stddef.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Source index and the weight of the next pixel, along one axis. */
static void axis(int n_out, int n_in, int *index, uint16_t *weight)
{
    double scale = (double)n_in / (double)n_out;
    for (int j = 0; j < n_out; j++) {
        double f = ((double)j + 0.5) * scale - 0.5;
        double fl = floor(f);
        int i = (int)fl;
        double frac = f - fl;
        if (i < 0) {
            i = 0;
            frac = 0.0;
        }
        if (i >= n_in - 1) {
            i = n_in - 1;
            frac = 0.0;
        }
        index[j] = i;
        weight[j] = (uint16_t)floor(frac * 256.0 + 0.5);
    }
}

/* The vertical blend of one row: vectorised (the loops below are written for it). */
static void blend_rows(const uint8_t *restrict r0, const uint8_t *restrict r1, unsigned b1,
                       uint16_t *restrict out, size_t n)
{
    if (b1 == 0) {
        for (size_t k = 0; k < n; k++)
            out[k] = (uint16_t)(r0[k] << 8);
        return;
    }
    uint16_t w0 = (uint16_t)(256 - b1), w1 = (uint16_t)b1;
    for (size_t k = 0; k < n; k++)
        out[k] = (uint16_t)(r0[k] * w0 + r1[k] * w1);
}

/* The horizontal blend of one row into out, mirrored when flip. xo: each output
 * pixel's first input value (3 * its left neighbour's column); the row holds
 * three values past its last pixel, so that the right neighbour is always
 * readable (its weight is 0 at the last column). */
static void blend_columns(const uint16_t *restrict row, const int *restrict xo,
                          const uint16_t *restrict xw, int dw, uint8_t *restrict out, int flip)
{
    ptrdiff_t step = flip ? -3 : 3;
    uint8_t *o = flip ? out + (size_t)(dw - 1) * 3 : out;
    for (int x = 0; x < dw; x++, o += step) {
        const uint16_t *p = row + xo[x];
        uint32_t a1 = xw[x], a0 = 256 - a1;
        o[0] = (uint8_t)((p[0] * a0 + p[3] * a1 + 32768u) >> 16);
        o[1] = (uint8_t)((p[1] * a0 + p[4] * a1 + 32768u) >> 16);
        o[2] = (uint8_t)((p[2] * a0 + p[5] * a1 + 32768u) >> 16);
    }
}

int resize_bilinear_rgb(const uint8_t *src, size_t src_step, int sh, int sw, uint8_t *dst,
                        int dh, int dw, int flip)
{
    size_t row = (size_t)sw * 3;
    /* One allocation: the axes' tables, then the vertical blend of a row (and
     * three values past it); the ints first, so every table is aligned. */
    size_t bytes = (size_t)(dw + dh) * (sizeof(int) + sizeof(uint16_t)) + (row + 3) * sizeof(uint16_t);
    unsigned char *mem = malloc(bytes);
    if (mem == NULL)
        return -1;
    int *xi = (int *)mem;
    int *yi = xi + dw;
    uint16_t *xw = (uint16_t *)(yi + dh);
    uint16_t *yw = xw + dw;
    uint16_t *blend = yw + dh;
    blend[row] = blend[row + 1] = blend[row + 2] = 0;
    axis(dw, sw, xi, xw);
    axis(dh, sh, yi, yw);
    for (int x = 0; x < dw; x++)
        xi[x] *= 3;
    for (int y = 0; y < dh; y++) {
        const uint8_t *r0 = src + (size_t)yi[y] * src_step;
        /* yw > 0 only where yi < sh - 1: the next row exists. */
        blend_rows(r0, yw[y] ? r0 + src_step : r0, yw[y], blend, row);
        blend_columns(blend, xi, xw, dw, dst + (size_t)y * dw * 3, flip);
    }
    free(mem);
    return 0;
}
