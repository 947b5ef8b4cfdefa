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
 * The horizontal blend takes four output pixels per AVX2 step where the CPU
 * has AVX2 (the same integer arithmetic, so the same bytes), else one at a time.
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

/* Functions the compiler vectorises twice, for AVX2 and for the baseline
 * (chosen once, by the loader, from the CPU's features): the same integer
 * arithmetic either way, so the same bytes. Where the loader can choose
 * (an ifunc: glibc on x86-64; not musl, not macOS), else the baseline only. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__ELF__) && defined(__GLIBC__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* The vertical blend of one row: vectorised (the loops below are written for it). */
VECTOR_CLONES
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

/* Values past a row's last pixel in the vertical blend's buffer (zeros; see
 * blend_columns). */
#define ROW_PAD 8

/* The scalar blend of output pixels [from, to): off[k] is output pixel k's
 * first input value (3 * its left neighbour's column, flip applied), w[k]
 * its neighbours' weights (a0 | a1 << 16). */
static void blend_scalar(const uint16_t *restrict row, const int *restrict off,
                         const uint32_t *restrict w, uint8_t *restrict out, int from, int to)
{
    for (int k = from; k < to; k++) {
        const uint16_t *p = row + off[k];
        uint32_t a0 = w[k] & 0xFFFF, a1 = w[k] >> 16;
        uint8_t *o = out + (size_t)k * 3;
        o[0] = (uint8_t)((p[0] * a0 + p[3] * a1 + 32768u) >> 16);
        o[1] = (uint8_t)((p[1] * a0 + p[4] * a1 + 32768u) >> 16);
        o[2] = (uint8_t)((p[2] * a0 + p[5] * a1 + 32768u) >> 16);
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
#define HAVE_AVX2_BLEND 1
#include <immintrin.h>
/* The same arithmetic with AVX2, four output pixels per step, one in each
 * 128-bit half of two registers. A pixel's eight loaded values (its two
 * neighbours' six, two more) are made signed around 32768 (x ^ 0x8000 is
 * x - 32768 as an int16) and paired by channel, (R0, R1, G0, G1, B0, B1, 0,
 * 0), so that one multiply-add of 16-bit pairs gives each channel's
 *     a0 * V0 + a1 * V1 - 32768 * 256          (a0 + a1 = 256)
 * in 32 bits, exactly; adding 2^23 back with the rounding's 2^15 and
 * shifting by 16 is the scalar loop's result. The four pixels' twelve bytes
 * are stored with a 16-byte store: the last four bytes land on the next two
 * pixels, written after (so the loop stops two pixels before the row's end,
 * and the scalar loop does the rest). */
__attribute__((target("avx2")))
static int blend_avx2(const uint16_t *restrict row, const int *restrict off,
                      const uint32_t *restrict w, int dw, uint8_t *restrict out)
{
    const __m256i bias = _mm256_set1_epi16((short)0x8000);
    const __m256i pairs = _mm256_setr_epi8(0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11, -1, -1, -1, -1,
                                           0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11, -1, -1, -1, -1);
    const __m256i back = _mm256_set1_epi32((1 << 23) + (1 << 15));
    const __m256i even = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    const __m256i odd = _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3);
    const __m128i squeeze = _mm_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    int k = 0;
    for (; k + 6 <= dw; k += 4) {
        /* a: pixels k and k + 2; b: k + 1 and k + 3 */
        __m256i a = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(row + off[k]))),
            _mm_loadu_si128((const __m128i *)(row + off[k + 2])), 1);
        __m256i b = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(row + off[k + 1]))),
            _mm_loadu_si128((const __m128i *)(row + off[k + 3])), 1);
        __m256i ws = _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(w + k)));
        a = _mm256_madd_epi16(_mm256_shuffle_epi8(_mm256_xor_si256(a, bias), pairs),
                              _mm256_permutevar8x32_epi32(ws, even));
        b = _mm256_madd_epi16(_mm256_shuffle_epi8(_mm256_xor_si256(b, bias), pairs),
                              _mm256_permutevar8x32_epi32(ws, odd));
        a = _mm256_srli_epi32(_mm256_add_epi32(a, back), 16); /* at most 255 */
        b = _mm256_srli_epi32(_mm256_add_epi32(b, back), 16);
        /* 16-bit values: pixels k, k + 1 in the low half, k + 2, k + 3 in the high */
        __m256i v = _mm256_packs_epi32(a, b);
        v = _mm256_packus_epi16(v, v);
        __m128i px = _mm_unpacklo_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storeu_si128((__m128i *)(out + (size_t)k * 3), _mm_shuffle_epi8(px, squeeze));
    }
    return k;
}
#endif

/* The horizontal blend of one row into out. The row holds ROW_PAD values past
 * its last pixel, so that the right neighbour is always readable (its weight
 * is 0 at the last column), and so is the vector load, which reads 8 values
 * from a pixel's first. Every path gives the same bytes. */
static void blend_columns(const uint16_t *restrict row, const int *restrict off,
                          const uint32_t *restrict w, int dw, uint8_t *restrict out)
{
    int done = 0;
#ifdef HAVE_AVX2_BLEND
    if (__builtin_cpu_supports("avx2"))  /* a read of the CPU's recorded features */
        done = blend_avx2(row, off, w, dw, out);
#endif
    blend_scalar(row, off, w, out, done, dw);
}

int resize_bilinear_rgb(const uint8_t *src, size_t src_step, int sh, int sw, uint8_t *dst,
                        int dh, int dw, int flip)
{
    size_t row = (size_t)sw * 3;
    /* One allocation: the axes' tables, each output column's first value and
     * weights in output order (flip applied), then the vertical blend of a
     * row (and ROW_PAD values past it); the 32-bit ones first, so every
     * table is aligned. */
    size_t bytes = (size_t)(dw + dh) * (sizeof(int) + sizeof(uint16_t))
                   + (size_t)dw * (sizeof(int) + sizeof(uint32_t))
                   + (row + ROW_PAD) * sizeof(uint16_t);
    unsigned char *mem = malloc(bytes);
    if (mem == NULL)
        return -1;
    int *xi = (int *)mem;
    int *yi = xi + dw;
    int *off = yi + dh;
    uint32_t *w = (uint32_t *)(off + dw);
    uint16_t *xw = (uint16_t *)(w + dw);
    uint16_t *yw = xw + dw;
    uint16_t *blend = yw + dh;
    memset(blend + row, 0, ROW_PAD * sizeof(uint16_t));
    axis(dw, sw, xi, xw);
    axis(dh, sh, yi, yw);
    for (int k = 0; k < dw; k++) {
        int x = flip ? dw - 1 - k : k;
        off[k] = xi[x] * 3;
        w[k] = (uint32_t)(256 - xw[x]) | (uint32_t)xw[x] << 16;
    }
    for (int y = 0; y < dh; y++) {
        const uint8_t *r0 = src + (size_t)yi[y] * src_step;
        /* yw > 0 only where yi < sh - 1: the next row exists. */
        blend_rows(r0, yw[y] ? r0 + src_step : r0, yw[y], blend, row);
        blend_columns(blend, off, w, dw, dst + (size_t)y * dw * 3);
    }
    free(mem);
    return 0;
}

/* The area shrink (RandomResizedCrop's antialiased resize, where a side
 * shrinks more than 2x): output pixel j of an axis averages the input span
 * [j * s, (j + 1) * s) (s = n_in / n_out >= 1, the last span ending at n_in),
 * each input pixel weighed by the part of the span it covers, as cv2's
 * INTER_AREA does. The weights are integers of AREA_BITS fractional bits:
 * the span covered up to the end of each of its pixels, as a fraction of the
 * span, rounded, less the same for the pixel before (so that they sum to
 * exactly AREA_ONE, and every partial sum is within half a unit of the exact
 * one). The arithmetic is then exact, and the same on every CPU:
 *     V[x] = sum over rows r of wy_r * S[r][x]               (32 bits)
 *     out  = (sum over columns c of wx_c * V[c] + 2^23) >> 24 (32 bits: at most
 *            255 * 2^24 + 2^23)
 * It stays within one level of cv2's float arithmetic for shrinks of up to
 * MAX_AREA_SHRINK per side (each weight is within half a unit of its share,
 * so the error is at most about (span + 2) * 255 / 8192 levels per axis:
 * under a quarter of a level there; past it the error grows with the span,
 * and feeder hands such shrinks to cv2). */
#define AREA_BITS 12
#define AREA_ONE (1 << AREA_BITS)

/* One axis's taps: output pixel j takes count[j] inputs from first[j] with
 * the weights at w + start[j] (at most n_in + n_out taps in all). */
static void area_axis(int n_out, int n_in, int *first, int *count, int *start, uint16_t *w)
{
    double s = (double)n_in / (double)n_out;
    int k = 0;
    for (int j = 0; j < n_out; j++) {
        double lo = (double)j * s, hi = (double)(j + 1) * s;
        if (hi > (double)n_in)
            hi = (double)n_in;
        int i0 = (int)floor(lo), i1 = (int)ceil(hi);
        if (i1 > n_in)
            i1 = n_in;
        if (i1 <= i0)
            i1 = i0 + 1;
        first[j] = i0;
        count[j] = i1 - i0;
        start[j] = k;
        double span = hi - lo;
        int before = 0;
        for (int i = i0; i < i1; i++, k++) {
            int upto = AREA_ONE;
            if (i + 1 < i1) {
                double end = (double)(i + 1) < hi ? (double)(i + 1) : hi;
                upto = (int)floor((end - lo) / span * AREA_ONE + 0.5);
                if (upto < before)
                    upto = before;
                if (upto > AREA_ONE)
                    upto = AREA_ONE;
            }
            w[k] = (uint16_t)(upto - before);
            before = upto;
        }
    }
}

/* The rows' weighted sum, over whole rows (vectorised): acc = sum over the
 * count rows from r of wy[t] * row t. */
VECTOR_CLONES
static void area_rows(const uint8_t *restrict r, size_t step, const uint16_t *restrict wy, int count,
                      uint32_t *restrict acc, size_t n)
{
    uint32_t w0 = wy[0];
    for (size_t k = 0; k < n; k++)
        acc[k] = w0 * r[k];
    for (int t = 1; t < count; t++) {
        const uint8_t *restrict rt = r + (size_t)t * step;
        uint32_t wt = wy[t];
        for (size_t k = 0; k < n; k++)
            acc[k] += wt * rt[k];
    }
}

/* The columns' weighted sums of one row of V (acc) into out, mirrored when
 * flip: output pixels [from, to) in address order. */
static void area_scalar(const uint32_t *restrict acc, const int *restrict xf,
                        const int *restrict xc, const int *restrict xs,
                        const uint16_t *restrict xw, int dw, uint8_t *restrict out, int flip,
                        int from, int to)
{
    for (int k = from; k < to; k++) {
        int x = flip ? dw - 1 - k : k;
        const uint32_t *p = acc + (size_t)xf[x] * 3;
        const uint16_t *wx = xw + xs[x];
        uint32_t c0 = 1u << 23, c1 = 1u << 23, c2 = 1u << 23;
        for (int t = 0; t < xc[x]; t++, p += 3) {
            uint32_t wt = wx[t];
            c0 += wt * p[0];
            c1 += wt * p[1];
            c2 += wt * p[2];
        }
        uint8_t *o = out + (size_t)k * 3;
        o[0] = (uint8_t)(c0 >> 24);
        o[1] = (uint8_t)(c1 >> 24);
        o[2] = (uint8_t)(c2 >> 24);
    }
}

#ifdef HAVE_AVX2_BLEND
/* The same sums with AVX2, two output pixels per step, one in each 128-bit
 * half: a pixel's three values and the next (discarded) times a tap's weight
 * per multiply. Every pixel takes the same number of taps (`taps`, the most
 * any takes; the rest weigh 0 and read zeros or values past the pixel's span,
 * which add nothing), so the loop's branches repeat and the CPU predicts them
 * (pixels taking 2 or 3 taps in no pattern mispredicted about half the time).
 * off[k] and w[k * taps ...] are output pixel k's first value and weights, the
 * flip applied. Four bytes are stored per pixel, the fourth overwritten by the
 * next pixel; the last one or two pixels go through the scalar loop. */
__attribute__((target("avx2")))
static int area_avx2(const uint32_t *restrict acc, const int *restrict off, const uint32_t *restrict w,
                     int taps, int dw, uint8_t *restrict out)
{
    const __m256i half = _mm256_set1_epi32(1 << 23);
    int k = 0;
    for (; k + 2 < dw; k += 2) {
        const uint32_t *p0 = acc + off[k], *p1 = acc + off[k + 1];
        const uint32_t *w0 = w + (size_t)k * taps, *w1 = w0 + taps;
        __m256i c = half;
        for (int t = 0; t < taps; t++) {
            __m256i v = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p0 + 3 * t))),
                _mm_loadu_si128((const __m128i *)(p1 + 3 * t)), 1);
            __m256i wt = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi32((int)w0[t])),
                                                 _mm_set1_epi32((int)w1[t]), 1);
            c = _mm256_add_epi32(c, _mm256_mullo_epi32(v, wt));
        }
        c = _mm256_srli_epi32(c, 24); /* at most 255: the packs below do not saturate */
        c = _mm256_packus_epi16(_mm256_packs_epi32(c, c), c);
        uint32_t v0 = (uint32_t)_mm_cvtsi128_si32(_mm256_castsi256_si128(c));
        uint32_t v1 = (uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(c, 1));
        memcpy(out + (size_t)k * 3, &v0, 4);
        memcpy(out + (size_t)k * 3 + 3, &v1, 4);
    }
    return k;
}
#endif

#ifdef HAVE_AVX2_BLEND
/* area_avx2's tables from area_axis's: each output pixel's first value and
 * its weights, `most` of them (the most any pixel takes, returned; zeros past
 * its own), in output order (flip applied). 0 (no tables) if a pixel takes
 * more than `room` taps, which area_axis never gives (see every_tap). */
static int area_columns(const int *xf, const int *xc, const int *xs, const uint16_t *xw, int dw,
                        int flip, int *off, uint32_t *w, int room)
{
    int most = 0;
    for (int x = 0; x < dw; x++)
        most = xc[x] > most ? xc[x] : most;
    if (most > room)
        return 0;
    memset(w, 0, (size_t)dw * (size_t)most * sizeof(uint32_t));
    for (int k = 0; k < dw; k++) {
        int x = flip ? dw - 1 - k : k;
        off[k] = xf[x] * 3;
        for (int t = 0; t < xc[x]; t++)
            w[(size_t)k * most + t] = xw[xs[x] + t];
    }
    return most;
}
#endif

int resize_area_rgb(const uint8_t *src, size_t src_step, int sh, int sw, uint8_t *dst,
                    int dh, int dw, int flip)
{
    if (dh < 1 || dw < 1 || sh < dh || sw < dw)
        return -2;
    size_t row = (size_t)sw * 3;
    size_t ints = 3 * (size_t)(dw + dh);
    size_t taps = (size_t)(sw + dw) + (size_t)(sh + dh);
    /* At most the taps an output column takes: its span of s = sw / dw
     * pixels touches at most floor(s) + 2 of them (dw * every_tap <= sw + 2 * dw). */
    size_t every_tap = (size_t)(sw / dw) + 2;
    /* acc: a row of V, then zeros, so that every column's every_tap taps
     * (and the vector load's one value more) are readable (see area_avx2) */
    size_t pad = 3 * every_tap + 1;
    size_t bytes = ints * sizeof(int) + (row + pad) * sizeof(uint32_t) + taps * sizeof(uint16_t);
#ifdef HAVE_AVX2_BLEND
    int avx2 = __builtin_cpu_supports("avx2");
    if (avx2) /* each output column's first value and weights, flip applied */
        bytes += (size_t)dw * sizeof(int) + (size_t)dw * every_tap * sizeof(uint32_t);
#endif
    unsigned char *mem = malloc(bytes);
    if (mem == NULL)
        return -1;
    int *xf = (int *)mem, *xc = xf + dw, *xs = xc + dw;
    int *yf = xs + dw, *yc = yf + dh, *ys = yc + dh;
    uint32_t *acc = (uint32_t *)(ys + dh);
    uint32_t *after = acc + row + pad; /* the 32-bit tables first, so every table is aligned */
#ifdef HAVE_AVX2_BLEND
    int *off = NULL;
    uint32_t *w = NULL;
    int most = 0;
    if (avx2) {
        off = (int *)after;
        w = (uint32_t *)(off + dw);
        after = w + (size_t)dw * every_tap;
    }
#endif
    uint16_t *xw = (uint16_t *)after;
    uint16_t *yw = xw + (sw + dw);
    memset(acc + row, 0, pad * sizeof(uint32_t));
    area_axis(dw, sw, xf, xc, xs, xw);
    area_axis(dh, sh, yf, yc, ys, yw);
#ifdef HAVE_AVX2_BLEND
    if (avx2)
        most = area_columns(xf, xc, xs, xw, dw, flip, off, w, (int)every_tap);
    avx2 = avx2 && most > 0;
#endif
    for (int y = 0; y < dh; y++) {
        area_rows(src + (size_t)yf[y] * src_step, src_step, yw + ys[y], yc[y], acc, row);
        uint8_t *o = dst + (size_t)y * dw * 3;
        int done = 0;
#ifdef HAVE_AVX2_BLEND
        if (avx2)
            done = area_avx2(acc, off, w, most, dw, o);
#endif
        area_scalar(acc, xf, xc, xs, xw, dw, o, flip, done, dw);
    }
    free(mem);
    return 0;
}
