/*
 * feeder.decode._jpeg: decode only a region of a JPEG, at a DCT scale, with the
 * system's libjpeg-turbo (an optional extension; feeder falls back to
 * simplejpeg without it, see feeder/decode/jpeg.py).
 *
 * Why a C extension: no package on the index exposes libjpeg-turbo's partial
 * decompression (jpeg_crop_scanline + jpeg_skip_scanlines) together with DCT
 * scaling. A random crop keeps on average about half of an image; decoding
 * only its rows and columns skips the IDCT, upsampling and colour conversion
 * of the rest, and stops reading the file after the crop's last row.
 *
 * Its functions:
 *   header(data) -> (width, height, components, colorspace, subsampling, progressive)
 *   frame(data, max_steps) -> headers.py's jpeg_frame walk of the marker segments
 *   decode(data, top, left, height, width, denom, out, max_pixels, compact, verify,
 *          own=True, index=None, record=False, max_points=16)
 *       -> (stride, col_offset), or with record or index
 *          (stride, col_offset, index recorded or None, MCUs jumped)
 *   fused(data, key, ...) -> bool: a JPEG's RandomResizedCrop + flip sample in
 *       one call, the verified-JPEG memory consulted (see JpegDecoder.fused)
 *   resize(src, dst, flip=False, area=False): _resize.c's bilinear resize or
 *       area shrink (decode's into=, crop= and area= run it on the decoded
 *       region in the same call)
 *   crc32c(data, value=0) -> int: the fingerprint of feeder.decode.verified, where the
 *       CPU has the instruction (CRC32C_HARDWARE)
 *   read_file(path) -> bytes: a whole file, with the GIL released once
 *       (feeder.sources reads a sample's file with it)
 * The region is given in the pixels of the image scaled by 1/denom (denom 1, 2,
 * 4 or 8: libjpeg-turbo's other scales, 7/8 to 5/8, have no fast IDCT and are
 * slower than a full decode). Row r of the region is written at out + r *
 * stride * 3, its first wanted pixel at column col_offset: "direct" mode lets
 * libjpeg write straight into `out` (its row is the region widened to the iMCU
 * grid and by a few pixels, see PAD), "compact" mode copies only the wanted
 * columns (stride = width, col_offset = 0).
 *
 * For sequential files the Huffman decoding is feeder's own (_huffman.c,
 * own=False keeps libjpeg's), which can record an index of checkpoints (every
 * MCU row, every few MCUs along it) while it reads a file, and start a later
 * decode of the same bytes at the checkpoint before the region's first column
 * in each of its rows.
 *
 * The decode runs without the GIL and calls no Python API; libjpeg's
 * errors come back through setjmp/longjmp, and its warnings (corrupt data,
 * which it would otherwise paper over with grey) are errors too. Every error
 * becomes feeder.errors.DecodeError with libjpeg's message.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <math.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifndef _WIN32
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define CRC_X86 1
#endif

#include <jpeglib.h>
#include <jerror.h>

#include "_huffman.h"
#include "_resize.h"

/* Pixels added on each side of the requested columns: libjpeg treats the
 * edges of a cropped row as the image's edges for "fancy" chroma upsampling
 * (h2v1, h2v2), so the outermost columns of a crop differ from a full decode.
 * The upsampler reads one chroma sample beyond each output pixel (two pixels
 * at 4:2:x); four pixels keep the wanted columns away from the window's edges
 * at every subsampling and scale, so they are bit-identical to a full decode
 * (tests/decode/test_jpeg.py checks this for 4:4:4, 4:2:2, 4:2:0, 4:4:0 and 4:1:1 at
 * every scale). */
#ifndef PAD
#define PAD 4
#endif

/* A progressive file may hold any number of scans, each a pass over the whole
 * coefficient buffer: a small hostile file with thousands of scans takes
 * seconds. Real encoders write about ten; libjpeg-turbo's own tools use a limit
 * of this kind (djpeg -maxscans). */
#define MAX_SCANS 500

static PyObject *DecodeError; /* feeder.errors.DecodeError */
/* The layout of the running library's entropy decoder struct (see
 * entropy_library_layout): found once at import; NULL: feeder's Huffman
 * decoder is never installed, libjpeg's decodes. */
static const char *entropy_layout;

/* ---- CRC-32C: the fingerprint of feeder.decode.verified ------------------------
 *
 * The memory of files already read to their end keys each file by its length
 * and a CRC of all its bytes, computed for every JPEG in every epoch. CRC-32C
 * (Castagnoli) has an instruction of its own on x86 (SSE4.2): three
 * independent streams over thirds of the data keep the instruction's pipeline
 * full (its latency is three cycles, its throughput one), and the three
 * registers are joined exactly with the shift below, so the result is the
 * CRC-32C of the whole string, about four times as fast as zlib's CRC-32.
 * Without the instruction, feeder.decode.verified uses zlib's CRC-32 instead.
 * Like any CRC of 32 bits, it misses no burst of damage of up to 32 bits, and
 * random damage once in 2^32. */
#define CRC32C_POLY 0x82F63B78u /* x^32 + x^28 + ... + 1, bit-reflected */
static uint32_t crc_x2n[72];    /* x^(2^k) mod P, for shifts of up to 2^64 bytes */
static int crc_hardware;        /* the CPU has the instruction */

/* a * b mod P, in the reflected representation (bit 31 is x^0). */
static uint32_t crc_mulmod(uint32_t a, uint32_t b)
{
    uint32_t m = 1u << 31, p = 0;
    while (a & (m | (m - 1))) { /* stops once no bit of a at or below m is left */
        if (a & m) {
            p ^= b;
            a ^= m;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return p;
}

/* x^(8n) mod P: multiplying a CRC register by it appends n zero bytes. */
static uint32_t crc_zeros(uint64_t n)
{
    uint32_t p = 1u << 31; /* x^0 */
    for (int k = 3; n; n >>= 1, k++)
        if (n & 1)
            p = crc_mulmod(crc_x2n[k], p);
    return p;
}

static void crc_init(void)
{
    crc_x2n[0] = 1u << 30; /* x^1 */
    for (int k = 1; k < 72; k++)
        crc_x2n[k] = crc_mulmod(crc_x2n[k - 1], crc_x2n[k - 1]);
#ifdef CRC_X86
    __builtin_cpu_init();
    crc_hardware = __builtin_cpu_supports("sse4.2") != 0;
#endif
}

#ifdef CRC_X86
#if defined(__x86_64__)
#define CRC_WORD 8
typedef uint64_t crc_word;
#define CRC_STEP(c, w) ((crc_word)_mm_crc32_u64((c), (w)))
#else
#define CRC_WORD 4
typedef uint32_t crc_word;
#define CRC_STEP(c, w) _mm_crc32_u32((c), (w))
#endif
/* The register after the `n` bytes at `p`, from register `crc` (no pre or
 * post inversion). */
__attribute__((target("sse4.2")))
static uint32_t crc_hard(uint32_t crc, const unsigned char *p, size_t n)
{
    crc_word c0 = crc;
    if (n >= 3 * 512) {
        /* Three streams over thirds of the data, joined by shifting: the
         * register after A then B is shift(reg_A, |B|) ^ reg_B(from 0). */
        size_t k = n / 3 / CRC_WORD * CRC_WORD;
        const unsigned char *p1 = p + k, *p2 = p + 2 * k;
        crc_word c1 = 0, c2 = 0, w0, w1, w2;
        for (size_t i = 0; i < k; i += CRC_WORD) {
            memcpy(&w0, p + i, CRC_WORD);
            memcpy(&w1, p1 + i, CRC_WORD);
            memcpy(&w2, p2 + i, CRC_WORD);
            c0 = CRC_STEP(c0, w0);
            c1 = CRC_STEP(c1, w1);
            c2 = CRC_STEP(c2, w2);
        }
        uint32_t shift = crc_zeros(k);
        c0 = crc_mulmod(shift, crc_mulmod(shift, (uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
        p += 3 * k;
        n -= 3 * k;
    }
    for (crc_word w; n >= CRC_WORD; p += CRC_WORD, n -= CRC_WORD) {
        memcpy(&w, p, CRC_WORD);
        c0 = CRC_STEP(c0, w);
    }
    for (; n; p++, n--)
        c0 = _mm_crc32_u8((uint32_t)c0, *p);
    return (uint32_t)c0;
}
#endif

/* Above this, the GIL is given up for the CRC (bench/results/fingerprint_cost.txt
 * times it): below, waiting to get it back could cost more. */
#define CRC_RELEASE_GIL (256 * 1024)

static PyObject *jpeg_crc32c(PyObject *self, PyObject *args)
{
    Py_buffer view;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &value))
        return NULL;
#ifdef CRC_X86
    if (crc_hardware) {
        uint32_t crc;
        if (view.len > CRC_RELEASE_GIL) {
            Py_BEGIN_ALLOW_THREADS
            crc = crc_hard(~(uint32_t)value, view.buf, (size_t)view.len);
            Py_END_ALLOW_THREADS
        } else {
            crc = crc_hard(~(uint32_t)value, view.buf, (size_t)view.len);
        }
        PyBuffer_Release(&view);
        return PyLong_FromUnsignedLong(~crc);
    }
#endif
    PyBuffer_Release(&view);
    return PyErr_Format(PyExc_RuntimeError, "this CPU has no CRC-32C instruction (CRC32C_HARDWARE is 0)");
}

typedef struct {
    struct jpeg_error_mgr pub;
    struct jpeg_progress_mgr progress;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX + 64];
} ErrorManager;

static void on_error(j_common_ptr cinfo)
{
    ErrorManager *err = (ErrorManager *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level)
{
    /* level -1: a warning, i.e. corrupt data that libjpeg would decode as grey
     * or garbage; fail like an error. Trace messages (level >= 0) are ignored. */
    if (level < 0)
        on_error(cinfo);
}

static void on_progress(j_common_ptr cinfo)
{
    if (cinfo->is_decompressor) {
        j_decompress_ptr d = (j_decompress_ptr)cinfo;
        if (d->input_scan_number > MAX_SCANS) {
            ErrorManager *err = (ErrorManager *)cinfo->err;
            snprintf(err->message, sizeof err->message,
                     "more than %d scans (a real encoder writes about ten)", MAX_SCANS);
            longjmp(err->jump, 1);
        }
    }
}

/* Set up the decompressor on `data` and read its header. Errors longjmp to
 * err->jump: call it inside the caller's setjmp. */
static void open_jpeg(struct jpeg_decompress_struct *cinfo, ErrorManager *err,
                      const unsigned char *data, size_t size)
{
    cinfo->err = jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    jpeg_create_decompress(cinfo);
    err->progress.progress_monitor = on_progress;
    cinfo->progress = &err->progress;
    jpeg_mem_src(cinfo, data, (unsigned long)size);
    jpeg_read_header(cinfo, TRUE);
}

static const char *colorspace_name(J_COLOR_SPACE cs)
{
    switch (cs) {
    case JCS_GRAYSCALE: return "Gray";
    case JCS_RGB: return "RGB";
    case JCS_YCbCr: return "YCbCr";
    case JCS_CMYK: return "CMYK";
    case JCS_YCCK: return "YCCK";
    default: return "unknown";
    }
}

static void subsampling_name(struct jpeg_decompress_struct *cinfo, char *out, size_t n)
{
    if (cinfo->num_components == 1) {
        snprintf(out, n, "gray");
        return;
    }
    int h = cinfo->comp_info[0].h_samp_factor, v = cinfo->comp_info[0].v_samp_factor;
    int same = 1;
    for (int c = 1; c < cinfo->num_components; c++)
        same &= cinfo->comp_info[c].h_samp_factor == 1 && cinfo->comp_info[c].v_samp_factor == 1;
    if (same && h == 1 && v == 1) snprintf(out, n, "4:4:4");
    else if (same && h == 2 && v == 1) snprintf(out, n, "4:2:2");
    else if (same && h == 2 && v == 2) snprintf(out, n, "4:2:0");
    else if (same && h == 1 && v == 2) snprintf(out, n, "4:4:0");
    else if (same && h == 4 && v == 1) snprintf(out, n, "4:1:1");
    else snprintf(out, n, "other");
}

static PyObject *jpeg_header(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;
    volatile int ok = 0;
    unsigned width = 0, height = 0;
    int components = 0, progressive = 0;
    const char *cs = "unknown";
    char sub[16] = "";
    /* The GIL stays held: reading a header takes microseconds, and giving the
     * GIL up for that little would cost a wait to get it back whenever another
     * thread took it meanwhile (up to the 5 ms switch interval). */
    if (setjmp(err.jump) == 0) {
        open_jpeg(&cinfo, &err, view.buf, (size_t)view.len);
        width = cinfo.image_width;
        height = cinfo.image_height;
        components = cinfo.num_components;
        progressive = jpeg_has_multiple_scans(&cinfo);
        cs = colorspace_name(cinfo.jpeg_color_space);
        subsampling_name(&cinfo, sub, sizeof sub);
        ok = 1;
    }
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&view);
    if (!ok) {
        PyErr_Format(DecodeError, "corrupt JPEG header: %s", err.message);
        return NULL;
    }
    return Py_BuildValue("(IIissO)", width, height, components, cs, sub,
                         progressive ? Py_True : Py_False);
}

/* headers.py's jpeg_frame walk, in C (the same steps, byte for byte: the
 * Python one runs where the extension is not in use, and a test checks that
 * the two agree): the marker segments from SOI to the first scan, each
 * length checked against the bytes left, until a non-progressive frame
 * header (SOF) or, after a progressive one, the first scan. Returns
 * (marker, precision, height, width, components, position where the walk
 * stopped), None when it found no SOF, False after max_steps segments and
 * fill bytes. It holds the GIL: it reads a few header bytes. */
/* headers.py's jpeg_frame walk of the marker segments of d[0..n): 1 and the frame
 * in f (f[5]: where the walk stopped), 0 when it found no frame header, -1 after
 * max_steps segments and fill bytes. */
static int walk_frame(const unsigned char *d, Py_ssize_t n, int max_steps, unsigned f[5],
                      Py_ssize_t *stop)
{
    Py_ssize_t pos = 2;
    int found = 0, exhausted = 1;
    for (int step = 0; step < max_steps; step++) {
        if (pos + 4 > n || d[pos] != 0xFF) {
            exhausted = 0;
            break;
        }
        unsigned m = d[pos + 1];
        if (m == 0xFF) { /* a fill byte */
            pos += 1;
            continue;
        }
        if (m == 0xDA || m == 0xD9) { /* the first scan, or the end of the image */
            exhausted = 0;
            break;
        }
        Py_ssize_t length = ((Py_ssize_t)d[pos + 2] << 8) | d[pos + 3];
        if (length < 2 || pos + 2 + length > n) {
            exhausted = 0;
            break;
        }
        /* SOF0..SOF15 but DHT (C4), JPG (C8) and DAC (CC); a second one is the decoder's error */
        if (m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC && !found) {
            if (length < 8) {
                exhausted = 0;
                break;
            }
            found = 1;
            f[0] = m; /* marker, precision, height, width, components */
            f[1] = d[pos + 4];
            f[2] = ((unsigned)d[pos + 5] << 8) | d[pos + 6];
            f[3] = ((unsigned)d[pos + 7] << 8) | d[pos + 8];
            f[4] = d[pos + 9];
            if (m != 0xC2 && m != 0xCA) { /* only a progressive frame's scans are counted */
                exhausted = 0;
                break;
            }
        }
        pos += 2 + length;
    }
    *stop = pos;
    return exhausted ? -1 : found;
}

static PyObject *jpeg_frame(PyObject *self, PyObject *args)
{
    Py_buffer view;
    int max_steps;
    if (!PyArg_ParseTuple(args, "y*i", &view, &max_steps))
        return NULL;
    unsigned f[5];
    Py_ssize_t pos;
    int found = walk_frame(view.buf, view.len, max_steps, f, &pos);
    PyBuffer_Release(&view);
    if (found < 0)
        Py_RETURN_FALSE;
    if (!found)
        Py_RETURN_NONE;
    return Py_BuildValue("(IIIIIn)", f[0], f[1], f[2], f[3], f[4], pos);
}

typedef struct {
    /* in */
    const unsigned char *data;
    size_t size;
    unsigned top, left, height, width, denom;
    unsigned char *out;
    size_t out_size;
    unsigned long long max_pixels;
    int compact;
    int verify;
    int own;                    /* feeder's Huffman decoder where it can (_huffman.c) */
    const unsigned char *index; /* a row index of these bytes, or NULL */
    size_t index_len;
    int record;                 /* make an index (a verify pass only) */
    unsigned max_points;
    /* out */
    unsigned char *index_out;   /* malloc'd, index_out_len bytes: record's index */
    size_t index_out_len;
    unsigned long long jumped;  /* MCUs the index let the decode pass over */
    unsigned stride, col_offset;
    int status;  /* 0 ok, 1 libjpeg error (message in err), 2 our own check (message in note) */
    char note[JMSG_LENGTH_MAX + 128];
} Job;

/* The smallest scaled DCT block size of any component (its name depends on
 * the API version libjpeg-turbo was built for). */
#if JPEG_LIB_VERSION >= 70
#define MIN_DCT_SIZE(c) ((c)->min_DCT_h_scaled_size)
#else
#define MIN_DCT_SIZE(c) ((c)->min_DCT_scaled_size)
#endif

/* One of run_decode's own checks failed: say why and leave through `done`
 * (jpeg_destroy_decompress there releases the decompressor in any state). */
#define FAIL(...)                                                   \
    do {                                                            \
        job->status = 2;                                            \
        snprintf(job->note, sizeof job->note, __VA_ARGS__);         \
        goto done;                                                  \
    } while (0)

/* The decode proper: no Python API, run with the GIL released. */
static void run_decode(Job *job)
{
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;
    unsigned char *volatile scratch = NULL;
    unsigned char *volatile tail = NULL;
    Entropy *volatile entropy = NULL;
    JSAMPROW row;

    if (setjmp(err.jump)) {
        job->status = 1;
        snprintf(job->note, sizeof job->note, "%s", err.message);
        jpeg_destroy_decompress(&cinfo);
        free(scratch);
        free(tail);
        return;
    }
    open_jpeg(&cinfo, &err, job->data, job->size);
    if ((unsigned long long)cinfo.image_width * cinfo.image_height > job->max_pixels
        || cinfo.image_width == 0 || cinfo.image_height == 0)
        FAIL("image of %ux%u pixels exceeds max_pixels=%llu", cinfo.image_width,
             cinfo.image_height, job->max_pixels);
    if (!(cinfo.jpeg_color_space == JCS_GRAYSCALE || cinfo.jpeg_color_space == JCS_YCbCr
          || cinfo.jpeg_color_space == JCS_RGB))
        FAIL("colour space %s is not decoded here", colorspace_name(cinfo.jpeg_color_space));
    /* libjpeg-turbo converts gray to RGB by replicating the channel. */
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = job->denom;
    /* jpeg_start_decompress allocates from the header's sizes (a progressive
     * file's whole coefficient buffer: 2 bytes per coefficient per component),
     * bounded above by the max_pixels check; this caps what a hostile header
     * with odd sampling factors could still make it allocate. */
    /* Saturated: a huge max_pixels must not wrap round to a small cap. */
    cinfo.mem->max_memory_to_use =
        job->max_pixels > (unsigned long long)(LONG_MAX - (64L << 20)) / 24
            ? LONG_MAX : (long)(job->max_pixels * 24 + (64u << 20));
    /* For a progressive file this reads every scan (the coefficients of the
     * whole image) before any output: skipping rows can save the IDCT and
     * colour conversion only, not the entropy decoding (little to save). */
    jpeg_start_decompress(&cinfo);
    /* The region is in pixels of the image at 1/denom: the library must have
     * scaled as asked. libjpeg-turbo 3.x decodes a lossless file at full size
     * whatever the scale (DCT scaling means nothing there), and rows read at
     * full size through a region computed for a reduced one are another part
     * of the image, with no error where no crop or skip refuses them. */
    if (cinfo.output_width != (cinfo.image_width + job->denom - 1) / job->denom
        || cinfo.output_height != (cinfo.image_height + job->denom - 1) / job->denom)
        FAIL("the JPEG decodes at %ux%u, not at scale 1/%u of its %ux%u (a lossless JPEG, which "
             "libjpeg-turbo does not scale?): decode it whole at full size",
             cinfo.output_width, cinfo.output_height, job->denom, cinfo.image_width,
             cinfo.image_height);
    if (job->top + (unsigned long long)job->height > cinfo.output_height
        || job->left + (unsigned long long)job->width > cinfo.output_width
        || job->height == 0 || job->width == 0)
        FAIL("region %u+%u x %u+%u is outside the %ux%u image at scale 1/%u", job->left,
             job->width, job->top, job->height, cinfo.output_width, cinfo.output_height,
             job->denom);
    if (job->own && entropy_layout != NULL && entropy_supported(&cinfo)) {
        /* In the permanent pool: jpeg_finish_decompress frees the image pool,
         * and the index is read after it; jpeg_destroy_decompress frees this
         * on every way out. */
        entropy = (Entropy *)(*cinfo.mem->alloc_small)((j_common_ptr)&cinfo, JPOOL_PERMANENT,
                                                        sizeof(Entropy));
        /* A verify pass reads every row: it records a whole index, and uses
         * none. A decode that stops after the region records the rows it
         * passed, going on from the index it was given. */
        entropy_install(&cinfo, entropy, job->data, job->size, job->verify ? NULL : job->index,
                        job->index_len, job->record, job->max_points);
    }
    {
        /* libjpeg-turbo's partial decode assumes the usual chroma layouts: on
         * other sampling factors (valid, rare: a 4x4 luma, a 2x1 Cr beside a 1x1
         * Cb) jpeg_skip_scanlines can loop forever and jpeg_crop_scanline gives
         * wrong pixels at reduced scales. Such files are decoded whole. */
        char sub[16];
        subsampling_name(&cinfo, sub, sizeof sub);
        if (strcmp(sub, "other") == 0
            && (job->top != 0 || job->left != 0 || job->height != cinfo.output_height
                || job->width != cinfo.output_width))
            FAIL("a region of a JPEG with unusual chroma sampling factors cannot be decoded "
                 "(libjpeg-turbo's partial decode does not handle them): decode the whole image");
    }
    {
        /* PAD only where chroma is upsampled: with every component at the
         * same sampling, each pixel's colour is its own blocks' (no
         * neighbour read), and the columns PAD adds would only be decoded
         * for nothing (an MCU column on a side for half the crops of a
         * 4:4:4 file). */
        JDIMENSION pad = 0;
        for (int c = 0; c < cinfo.num_components; c++)
            if (cinfo.comp_info[c].h_samp_factor != cinfo.max_h_samp_factor
                || cinfo.comp_info[c].v_samp_factor != cinfo.max_v_samp_factor)
                pad = PAD;
        JDIMENSION x0 = job->left > pad ? job->left - pad : 0;
        JDIMENSION x1 = job->left + job->width + pad;
        if (x1 > cinfo.output_width) x1 = cinfo.output_width;
        JDIMENSION xoff = x0, cw = x1 - x0;
        int cropped = xoff != 0 || cw != cinfo.output_width;
        if (cropped)
            jpeg_crop_scanline(&cinfo, &xoff, &cw); /* moves xoff left to the iMCU grid */
        /* libjpeg IDCTs only the iMCU columns of the crop and asks the
         * entropy decoder for every MCU of a row: with a checkpoint at the
         * crop's columns, feeder's decoder jumps over the others. Those
         * columns are computed here as jpeg_crop_scanline computes them
         * (master->first_iMCU_col .. last_iMCU_col, jdapistd.c), from its
         * public outputs: the private struct they live in changed layout
         * between libjpeg-turbo 2.x and 3.x under the same soname, and read
         * through the other version's header it gives other columns (their
         * blocks then decode as grey, with no error). A verify pass, which
         * has no index, decodes the other columns too, without storing
         * their coefficients (entropy_crop's to_end). */
        if (entropy != NULL && cropped) {
            int align = MIN_DCT_SIZE(&cinfo);
            if (!(cinfo.comps_in_scan == 1 && cinfo.num_components == 1))
                align *= cinfo.max_h_samp_factor;
            if (align > 0)
                entropy_crop(&cinfo, xoff / (unsigned)align, (xoff + cw + (unsigned)align - 1) / (unsigned)align - 1,
                             job->verify);
        }
        unsigned offset = job->left - xoff;
        unsigned stride = job->compact ? job->width : cinfo.output_width;
        size_t need = (size_t)job->height * stride * 3;
        if (need > job->out_size)
            FAIL("output buffer of %zu bytes is smaller than the %zu the region needs",
                 job->out_size, need);
        if (job->compact) {
            scratch = malloc((size_t)cinfo.output_width * 3);
            if (scratch == NULL)
                FAIL("out of memory");
        }
        /* Rows above the region: no IDCT or colour conversion for whole iMCU
         * rows (their entropy decoding is skipped only with feeder's decoder
         * and a row index: Huffman codes have no byte alignment). libjpeg-turbo decodes the context rows fancy
         * upsampling needs, so the first kept row matches a full decode. */
        if (job->top > 0)
            jpeg_skip_scanlines(&cinfo, job->top);
        for (unsigned r = 0; r < job->height; r++) {
            unsigned char *dst = job->out + (size_t)r * stride * 3;
            row = job->compact ? scratch : dst;
            if (jpeg_read_scanlines(&cinfo, &row, 1) != 1) {
                /* A memory source never suspends, and the end of its data is a
                 * warning (an error here): no row is not expected, but is no loop. */
                FAIL("corrupt JPEG: no data for row %u", job->top + r);
            }
            if (job->compact)
                memcpy(dst, scratch + (size_t)offset * 3, (size_t)job->width * 3);
        }
        job->stride = stride;
        job->col_offset = job->compact ? 0 : offset;
        if (job->verify && cinfo.output_scanline < cinfo.output_height) {
            /* Entropy-decode the rows below the region too (no IDCT: skipped
             * rows; then the last row, one iMCU row of the region's columns),
             * so that jpeg_finish_decompress below reaches the end of the data
             * as a full decode does. Huffman data that lost its sync (a flipped
             * or missing byte anywhere, above and inside the region included)
             * shows only there, as bytes left before the next marker: without
             * this, a region ending above the last row would come back with
             * wrong pixels and no error. */
            JDIMENSION rest = cinfo.output_height - cinfo.output_scanline;
            if (rest > 1)
                jpeg_skip_scanlines(&cinfo, rest - 1);
            tail = malloc((size_t)cinfo.output_width * 3);
            if (tail == NULL)
                FAIL("out of memory");
            row = tail;
            if (jpeg_read_scanlines(&cinfo, &row, 1) != 1)
                FAIL("corrupt JPEG: no data for row %u", cinfo.output_height - 1);
        }
        if (cinfo.output_scanline == cinfo.output_height)
            /* Read on to the end of the data as a full decode does, so damage
             * that the entropy decoder passed over (reported as extraneous
             * bytes before the next marker, a warning: an error here) fails
             * this sample too. */
            jpeg_finish_decompress(&cinfo);
        /* else verify=False: stop here, the rows below the region are never
         * read (damage the entropy decoder has not met goes unseen);
         * jpeg_destroy_decompress below releases the decompressor. */
        if (entropy != NULL) {
            job->jumped = entropy->jumped;
            /* An index only from a decode that ended without an error. */
            size_t n = job->record ? entropy_index(entropy, NULL, 0) : 0;
            if (n > 0 && (job->index_out = malloc(n)) != NULL)
                job->index_out_len = entropy_index(entropy, job->index_out, n);
        }
    }
done:
    jpeg_destroy_decompress(&cinfo);
    free(scratch);
    free(tail);
}
#undef FAIL

static PyObject *jpeg_decode(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"data", "top", "left", "height", "width", "denom", "out",
                            "max_pixels", "compact", "verify", "own", "index", "record",
                            "max_points", "into", "crop", "flip", "area", NULL};
    Py_buffer data, out, index = {0}, into = {0};
    Py_ssize_t region[4]; /* top, left, height, width: range-checked below, never wrapped */
    unsigned denom;
    PyObject *limit, *index_obj = Py_None;
    unsigned long long max_pixels;
    int compact = 0, verify = 1, own = 1, record = 0;
    unsigned max_points = 16;
    PyObject *into_obj = Py_None, *crop_obj = Py_None;
    int flip = 0, area = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*nnnnIw*O|pppOpIOOpp", names, &data, &region[0],
                                     &region[1], &region[2], &region[3], &denom, &out, &limit,
                                     &compact, &verify, &own, &index_obj, &record, &max_points,
                                     &into_obj, &crop_obj, &flip, &area))
        return NULL;
    /* into, crop: resize the crop (top, left, height, width, in the region's
     * pixels) of the decoded region into `into`, an [H, W, 3] uint8 array,
     * mirrored when flip, in the same call (see _resize.c); with the area
     * shrink when area (into no larger than the crop). */
    Py_ssize_t crop[4] = {0, 0, 0, 0}, into_h = 0, into_w = 0;
    if (into_obj != Py_None) {
        if (!PyTuple_Check(crop_obj)) {
            PyBuffer_Release(&data);
            PyBuffer_Release(&out);
            return PyErr_Format(PyExc_TypeError, "crop must be a tuple (top, left, height, "
                                "width), got %s", Py_TYPE(crop_obj)->tp_name);
        }
        if (!PyArg_ParseTuple(crop_obj, "nnnn;crop must be (top, left, height, width)", &crop[0],
                              &crop[1], &crop[2], &crop[3])) {
            PyBuffer_Release(&data);
            PyBuffer_Release(&out);
            return NULL;
        }
        if (PyObject_GetBuffer(into_obj, &into, PyBUF_CONTIG | PyBUF_FORMAT) < 0) {
            PyBuffer_Release(&data);
            PyBuffer_Release(&out);
            return NULL;
        }
        if (into.ndim != 3 || into.shape[2] != 3 || into.itemsize != 1
            || (into.format != NULL && strcmp(into.format, "B") != 0)
            || into.shape[0] > INT_MAX / 3 || into.shape[1] > INT_MAX / 3
            /* each bounded first, so that the sums below cannot overflow (the
             * region is checked against the same bound below) */
            || crop[0] < 0 || crop[1] < 0 || crop[2] <= 0 || crop[3] <= 0
            || crop[0] > JPEG_MAX_DIMENSION || crop[1] > JPEG_MAX_DIMENSION
            || crop[2] > JPEG_MAX_DIMENSION || crop[3] > JPEG_MAX_DIMENSION
            || region[2] < 0 || region[3] < 0
            || crop[0] + crop[2] > region[2] || crop[1] + crop[3] > region[3]
            || (area && (into.shape[0] < 1 || into.shape[1] < 1 || into.shape[0] > crop[2]
                         || into.shape[1] > crop[3]))) {
            PyBuffer_Release(&data);
            PyBuffer_Release(&out);
            PyBuffer_Release(&into);
            return PyErr_Format(PyExc_ValueError, "into must be a C-contiguous [H, W, 3] uint8 "
                                "array and crop a box inside the region (with area, no "
                                "smaller than into)");
        }
        into_h = into.shape[0];
        into_w = into.shape[1];
    }
    if (index_obj != Py_None && PyObject_GetBuffer(index_obj, &index, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        PyBuffer_Release(&index);
        PyBuffer_Release(&into);
        return NULL;
    }
    int extended = record || index_obj != Py_None || into_obj != Py_None;
    static const char *what[] = {"top", "left", "height", "width"};
    for (int k = 0; k < 4; k++) {
        if (region[k] < 0 || (unsigned long long)region[k] > JPEG_MAX_DIMENSION) {
            PyBuffer_Release(&data);
            PyBuffer_Release(&out);
            PyBuffer_Release(&index);
            PyBuffer_Release(&into);
            return PyErr_Format(PyExc_ValueError, "%s must be in [0, %d], got %zd", what[k],
                                JPEG_MAX_DIMENSION, region[k]);
        }
    }
    unsigned top = (unsigned)region[0], left = (unsigned)region[1];
    unsigned height = (unsigned)region[2], width = (unsigned)region[3];
    /* A limit past 64 bits is no limit: saturate instead of wrapping to a small one. */
    if (!PyLong_Check(limit)) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        PyBuffer_Release(&index);
        PyBuffer_Release(&into);
        return PyErr_Format(PyExc_TypeError, "max_pixels must be an int, got %s",
                            Py_TYPE(limit)->tp_name);
    }
    int overflow = 0;
    long long small = PyLong_AsLongLongAndOverflow(limit, &overflow);
    if (small == -1 && PyErr_Occurred()) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        PyBuffer_Release(&index);
        PyBuffer_Release(&into);
        return NULL;
    }
    if (overflow < 0 || (overflow == 0 && small <= 0)) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        PyBuffer_Release(&index);
        PyBuffer_Release(&into);
        return PyErr_Format(PyExc_ValueError, "max_pixels must be positive");
    }
    if (overflow == 0) {
        max_pixels = (unsigned long long)small;
    } else {
        max_pixels = PyLong_AsUnsignedLongLong(limit);
        if (PyErr_Occurred()) { /* 2**64 or more */
            PyErr_Clear();
            max_pixels = ULLONG_MAX;
        }
    }
    if (!(denom == 1 || denom == 2 || denom == 4 || denom == 8)) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        PyBuffer_Release(&index);
        PyBuffer_Release(&into);
        return PyErr_Format(PyExc_ValueError, "denom must be 1, 2, 4 or 8, got %u", denom);
    }
    if (!PyBuffer_IsContiguous(&out, 'C')) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        PyBuffer_Release(&index);
        PyBuffer_Release(&into);
        return PyErr_Format(PyExc_ValueError, "out must be a C-contiguous writable buffer");
    }
    Job job;
    memset(&job, 0, sizeof job);
    job.data = data.buf;
    job.size = (size_t)data.len;
    job.top = top;
    job.left = left;
    job.height = height;
    job.width = width;
    job.denom = denom;
    job.out = out.buf;
    job.out_size = (size_t)out.len;
    job.max_pixels = max_pixels;
    job.compact = compact;
    job.verify = verify;
    job.own = own;
    job.index = index_obj != Py_None ? index.buf : NULL;
    job.index_len = index_obj != Py_None ? (size_t)index.len : 0;
    job.record = record;
    job.max_points = max_points;
    int resized = 0;
    Py_BEGIN_ALLOW_THREADS
    run_decode(&job);
    if (job.status == 0 && into_obj != Py_None) {
        const unsigned char *from = job.out + ((size_t)crop[0] * job.stride + job.col_offset
                                               + (size_t)crop[1]) * 3;
        resized = (area ? resize_area_rgb : resize_bilinear_rgb)(
            from, (size_t)job.stride * 3, (int)crop[2], (int)crop[3], into.buf, (int)into_h,
            (int)into_w, flip);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    PyBuffer_Release(&index);
    PyBuffer_Release(&into);
    if (resized != 0) {
        free(job.index_out);
        return PyErr_NoMemory();
    }
    if (job.status != 0) {
        free(job.index_out);
        if (job.status == 1)
            return PyErr_Format(DecodeError, "corrupt JPEG: %s", job.note);
        return PyErr_Format(DecodeError, "%s", job.note);
    }
    if (!extended)
        return Py_BuildValue("(II)", job.stride, job.col_offset);
    PyObject *made = job.index_out != NULL
        ? PyBytes_FromStringAndSize((const char *)job.index_out, (Py_ssize_t)job.index_out_len)
        : Py_NewRef(Py_None);
    free(job.index_out);
    if (made == NULL)
        return NULL;
    return Py_BuildValue("(IINK)", job.stride, job.col_offset, made, job.jumped);
}

/* SplitMix64's output function (feeder.sample.rng._mix). */
static inline uint64_t splitmix_mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* The high 64 bits of x * y. */
static inline uint64_t mul_high(uint64_t x, uint64_t y)
{
#ifdef __SIZEOF_INT128__
    return (uint64_t)(((unsigned __int128)x * y) >> 64);
#else
    uint64_t xl = x & 0xFFFFFFFFULL, xh = x >> 32, yl = y & 0xFFFFFFFFULL, yh = y >> 32;
    uint64_t ll = xl * yl, lh = xl * yh, hl = xh * yl, hh = xh * yh;
    uint64_t mid = (ll >> 32) + (lh & 0xFFFFFFFFULL) + (hl & 0xFFFFFFFFULL);
    return hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
#endif
}

#define SPLITMIX_GOLDEN 0x9E3779B97F4A7C15ULL
#define SPLITMIX_UNIT (1.0 / 9007199254740992.0)

/* RandomResizedCrop.params' ten tries on a SampleRNG's state (mixed: >= 0),
 * the same IEEE double operations in the same order as the Python (built with
 * -ffp-contract=off: no fused multiply-adds). */
static int rrc_try(uint64_t *state, long long area, long long height, long long width, double lo,
                   double span_s, double log_lo, double span_r, long long box[4])
{
    uint64_t z = *state;
    int found = 0;
    for (int i = 0; i < 10 && !found; i++) {
        z += SPLITMIX_GOLDEN;
        double target = (double)area * (lo + span_s * ((double)(splitmix_mix(z) >> 11) * SPLITMIX_UNIT));
        z += SPLITMIX_GOLDEN;
        double aspect = exp(log_lo + span_r * ((double)(splitmix_mix(z) >> 11) * SPLITMIX_UNIT));
        double w = rint(sqrt(target * aspect)), h = rint(sqrt(target / aspect));
        if (0 < w && w <= (double)width && 0 < h && h <= (double)height) {
            long long hi = (long long)h, wi = (long long)w;
            z += SPLITMIX_GOLDEN;
            box[0] = (long long)mul_high(splitmix_mix(z), (uint64_t)(height - hi + 1));
            z += SPLITMIX_GOLDEN;
            box[1] = (long long)mul_high(splitmix_mix(z), (uint64_t)(width - wi + 1));
            box[2] = hi;
            box[3] = wi;
            found = 1;
        }
    }
    *state = z;
    return found;
}

static PyObject *rrc_draws(PyObject *self, PyObject *args)
{
    PyObject *state;
    long long area, height, width;
    double lo, span_s, log_lo, span_r;
    if (!PyArg_ParseTuple(args, "OLLLdddd", &state, &area, &height, &width, &lo, &span_s,
                          &log_lo, &span_r))
        return NULL;
    uint64_t z = (uint64_t)PyLong_AsUnsignedLongLong(state);
    if (z == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    if (height <= 0 || width <= 0 || area != height * width)
        return PyErr_Format(PyExc_ValueError, "rrc_draws: area must be height * width > 0");
    long long box[4];
    if (rrc_try(&z, area, height, width, lo, span_s, log_lo, span_r, box))
        return Py_BuildValue("(KKLLK)", (unsigned long long)box[0], (unsigned long long)box[1],
                             box[2], box[3], (unsigned long long)z);
    return Py_BuildValue("(OK)", Py_None, (unsigned long long)z);
}

/* The header facts fused needs, read with libjpeg (as header() does;
 * scans: header()'s "progressive", more than one scan): 0, or -1 when libjpeg
 * cannot read it. */
static int header_facts(const unsigned char *data, size_t size, unsigned *width,
                        unsigned *height, J_COLOR_SPACE *cs, char sub[16], int *scans)
{
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;
    volatile int ok = 0;
    if (setjmp(err.jump) == 0) {
        open_jpeg(&cinfo, &err, data, size);
        *width = cinfo.image_width;
        *height = cinfo.image_height;
        *cs = cinfo.jpeg_color_space;
        subsampling_name(&cinfo, sub, 16);
        *scans = jpeg_has_multiple_scans(&cinfo);
        ok = 1;
    }
    jpeg_destroy_decompress(&cinfo);
    return ok ? 0 : -1;
}

static long long min_ll(long long a, long long b) { return a < b ? a : b; }
static long long max_ll(long long a, long long b) { return a > b ? a : b; }
/* -(-a // b) for a >= 0, b > 0 */
static long long ceil_div(long long a, long long b) { return (a + b - 1) / b; }

/* The verified-JPEG memory (feeder/decode/verified.py's VerifiedJpegs), read
 * without the GIL by fused: its table of fingerprints, where each
 * file's index starts in the ring, the ring of indexes and the ring's head.
 * One add at a time writes them, holding the memory's lock and the GIL
 * (memory_put below, or Python without it); fused only reads them. A slot
 * or a head is an aligned 8-byte word, written whole. A
 * record is written after the head has moved past it (VerifiedJpegs._keep),
 * and a reader that copied one looks at the head after the copy: if the head
 * has not come round to the record, nothing wrote over it meanwhile. The
 * record's own CRC is checked as in VerifiedJpegs.index. Only where the CPU
 * has the CRC-32C instruction, the memory's fingerprint there. */
#define MEMORY_WAYS 4        /* verified.WAYS */
#define MEMORY_RECORD 18     /* verified._RECORD, "<QIIH": fingerprint, check, index CRC, length */

typedef struct {
    const uint64_t *table, *where; /* NULL until the first file was added */
    size_t slots;
    const unsigned char *ring;     /* NULL: no indexes kept */
    size_t ring_bytes;
    const uint64_t *head;          /* bytes ever written to the ring */
    unsigned bits;                 /* log2 of the buckets (slots / MEMORY_WAYS) */
    /* VerifiedJpegs.points_of: checkpoints to record for a file */
    unsigned long long points, min_points, bytes_per_point;
} Memory;

#ifdef CRC_X86
static uint32_t crc32c_of(uint32_t value, const unsigned char *p, size_t n)
{
    return ~crc_hard(~value, p, n);
}

/* VerifiedJpegs.fingerprints: (length << 32 | CRC-32C of all, or 1; CRC-32C of the first half) */
static void memory_fingerprints(const unsigned char *d, size_t n, uint64_t *fp, uint32_t *check)
{
    uint32_t half = crc32c_of(0, d, n / 2);
    uint64_t f = ((uint64_t)(n & 0xFFFFFFFFu) << 32) | crc32c_of(half, d + n / 2, n - n / 2);
    *fp = f ? f : 1;
    *check = half;
}
#endif

static uint64_t load_le(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int k = n - 1; k >= 0; k--)
        v = v << 8 | p[k];
    return v;
}

/* VerifiedJpegs.index of the record that starts `at` bytes ever written into
 * the ring: a malloc'd copy of the index (its length in *len), or NULL. */
static unsigned char *memory_record(const Memory *m, uint64_t at, uint64_t fp, uint32_t check,
                                    size_t *len)
{
    size_t start = (size_t)(at % m->ring_bytes);
    if (start + MEMORY_RECORD > m->ring_bytes)
        return NULL;
    const unsigned char *r = m->ring + start;
    uint64_t got_fp = load_le(r, 8);
    uint32_t got_check = (uint32_t)load_le(r + 8, 4), crc = (uint32_t)load_le(r + 12, 4);
    size_t n = (size_t)load_le(r + 16, 2);
    if (n == 0 || start + MEMORY_RECORD + n > m->ring_bytes)
        return NULL;
    unsigned char *copy = malloc(n);
    if (copy == NULL)
        return NULL;
    memcpy(copy, r + MEMORY_RECORD, n);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    uint64_t head = __atomic_load_n(m->head, __ATOMIC_ACQUIRE);
    int whole = head <= at + m->ring_bytes && got_fp == fp && got_check == check;
#ifdef CRC_X86
    whole = whole && crc32c_of(0, copy, n) == crc;
#else
    whole = 0;
#endif
    if (!whole) {
        free(copy);
        return NULL;
    }
    *len = n;
    return copy;
}

/* VerifiedJpegs.seen(fp) (returned) and .index(fp, check) (*index, malloc'd, or NULL). */
static int memory_find(const Memory *m, uint64_t fp, uint32_t check, unsigned char **index,
                       size_t *len)
{
    *index = NULL;
    *len = 0;
    if (m->table == NULL)
        return 0;
    uint64_t h = fp * SPLITMIX_GOLDEN;
    size_t buckets = m->slots / MEMORY_WAYS;
    size_t bases[2] = {(size_t)(h >> (64 - m->bits)) * MEMORY_WAYS,
                       (size_t)((h >> 7) & (buckets - 1)) * MEMORY_WAYS};
    for (int b = 0; b < 2; b++) {
        for (size_t i = bases[b]; i < bases[b] + MEMORY_WAYS; i++) {
            if (__atomic_load_n(&m->table[i], __ATOMIC_ACQUIRE) != fp)
                continue;
            uint64_t where = m->where != NULL ? __atomic_load_n(&m->where[i], __ATOMIC_ACQUIRE) : 0;
            if (where != 0 && m->ring != NULL)
                *index = memory_record(m, where - 1, fp, check, len);
            return 1;
        }
    }
    return 0;
}

typedef struct {
    /* in */
    uint64_t key, crop_stream, flip_stream;
    double flip_p; /* < 0: no flip */
    double lo, span_s, log_lo, span_r;
    long long oh, ow;
    int antialias, verify, max_steps;
    unsigned long long max_pixels;
    unsigned char *dst;
    const Memory *memory; /* or NULL: none consulted */
    /* out: 0 done, 1 not taken (nothing done), 2 decode error (job.status, job.note) */
    int result;
    /* with a memory: the file's fingerprints (fp 0: not looked up, a file of
     * several scans), whether it was read to its end, what it recorded */
    uint64_t fp;
    uint32_t check;
    int verified;
    Job job;
} Fused;

/* JpegDecoder.fused's sample, without the GIL: the same steps, in the same
 * arithmetic, as decode() -> the chain's plan -> decode_region ->
 * FusedCrop.spec (and JpegDecoder._region's use of the memory), for the
 * usual file (see jpeg.py); anything else is left (result 1) for decode()
 * to take. */
static void run_fused(Fused *f, const unsigned char *data, size_t size)
{
    static const int denoms[4] = {8, 4, 2, 1};
    unsigned frame[5];
    Py_ssize_t stop;
    f->result = 1;
    if (walk_frame(data, (Py_ssize_t)size, f->max_steps, frame, &stop) != 1
        || !(frame[0] == 0xC0 || frame[0] == 0xC1 || frame[0] == 0xC2) || frame[1] != 8)
        return;
    unsigned width, height;
    J_COLOR_SPACE cs;
    char sub[16];
    int scans;
    if (header_facts(data, size, &width, &height, &cs, sub, &scans) != 0)
        return;
    long long h = height, w = width;
    if (h <= 0 || w <= 0 || (unsigned long long)(h * w) > f->max_pixels
        || !(cs == JCS_GRAYSCALE || cs == JCS_YCbCr || cs == JCS_RGB) || strcmp(sub, "other") == 0)
        return;
    /* The plan: the crop's draws, on the state SampleRNG(key, at) mixes at its first. */
    uint64_t z = splitmix_mix(f->key + f->crop_stream);
    long long box[4];
    if (!rrc_try(&z, h * w, h, w, f->lo, f->span_s, f->log_lo, f->span_r, box))
        return;
    long long top = box[0], left = box[1], bh = box[2], bw = box[3];
    long long nh = min_ll(h, ceil_div(h * f->oh, bh)), nw = min_ll(w, ceil_div(w * f->ow, bw));
    long long d = 1;
    for (int k = 0; k < 4; k++) {
        if (ceil_div(h, denoms[k]) >= nh && ceil_div(w, denoms[k]) >= nw) {
            d = denoms[k];
            break;
        }
    }
    /* decode_region's region (at 1/d, a pixel wider each side when scaled) */
    long long hs = ceil_div(h, d), ws = ceil_div(w, d), m = d == 1 ? 0 : 2;
    long long y0 = max_ll(0, top / d - m), x0 = max_ll(0, left / d - m);
    long long rh = min_ll(hs, ceil_div(top + bh, d) + m) - y0;
    long long rw = min_ll(ws, ceil_div(left + bw, d) + m) - x0;
    if (hs != h || ws != w) {
        /* RandomResizedCrop's box mapped onto the scaled image (Python's round:
         * half to even, as nearbyint in the default rounding mode) */
        double fy = (double)hs / (double)h, fx = (double)ws / (double)w;
        top = min_ll(hs - 1, (long long)nearbyint((double)top * fy));
        left = min_ll(ws - 1, (long long)nearbyint((double)left * fx));
        bh = max_ll(1, min_ll(hs - top, (long long)nearbyint((double)bh * fy)));
        bw = max_ll(1, min_ll(ws - left, (long long)nearbyint((double)bw * fx)));
    }
    top -= y0;
    left -= x0;
    /* RandomResizedCrop's antialiased shrink (a side more than 2x): the area
     * shrink where neither side grows nor shrinks more than MAX_AREA_SHRINK
     * (feeder.ops.resize's bound), else left to the chain */
    int area = f->antialias && (bh > 2 * f->oh || bw > 2 * f->ow);
    if ((area && (bh < f->oh || bw < f->ow || bh > MAX_AREA_SHRINK * f->oh
                  || bw > MAX_AREA_SHRINK * f->ow))
        || top < 0 || left < 0 || top + bh > rh || left + bw > rw)
        return;
    int flipped = 0;
    if (f->flip_p >= 0) {
        uint64_t u = splitmix_mix(f->key + f->flip_stream) + SPLITMIX_GOLDEN;
        flipped = (double)(splitmix_mix(u) >> 11) * SPLITMIX_UNIT < f->flip_p;
    }
    size_t nbytes = (size_t)rh * (size_t)(rw + 2 * PAD + 32) * 3;
    unsigned char *buf = malloc(nbytes);
    if (buf == NULL)
        return; /* decode() tries, and reports a failure of its own */
    /* JpegDecoder._region's use of the memory: bytes read to their end before
     * stop after the crop; an index kept enters each row near the crop; a
     * file of several scans (all read before any row) is not remembered. */
    int verify = f->verify;
    unsigned char *index = NULL;
    size_t index_len = 0;
    unsigned long long record = 0;
#ifdef CRC_X86
    const Memory *mem = f->memory;
    if (mem != NULL && !scans) {
        memory_fingerprints(data, size, &f->fp, &f->check);
        if (memory_find(mem, f->fp, f->check, &index, &index_len))
            verify = 0;
        if (mem->points)
            record = max_ll((long long)mem->min_points,
                            min_ll((long long)mem->points, (long long)(size / mem->bytes_per_point)));
    }
#endif
    f->verified = verify;
    Job *job = &f->job;
    job->index = index;
    job->index_len = index_len;
    job->record = record > 0;
    job->data = data;
    job->size = size;
    job->top = (unsigned)y0;
    job->left = (unsigned)x0;
    job->height = (unsigned)rh;
    job->width = (unsigned)rw;
    job->denom = (unsigned)d;
    job->out = buf;
    job->out_size = nbytes;
    job->max_pixels = f->max_pixels;
    job->verify = verify;
    job->own = 1;
    job->max_points = record ? (unsigned)record : 16;
    run_decode(job);
    free(index);
    job->index = NULL;
    if (job->status != 0) {
        free(job->index_out);
        job->index_out = NULL;
        free(buf);
        f->result = 2;
        return;
    }
    const unsigned char *from = buf + ((size_t)top * job->stride + job->col_offset + (size_t)left) * 3;
    int resized = (area ? resize_area_rgb : resize_bilinear_rgb)(
        from, (size_t)job->stride * 3, (int)bh, (int)bw, f->dst, (int)f->oh, (int)f->ow, flipped);
    free(buf);
    f->result = resized == 0 ? 0 : 1;
    if (f->result != 0) {
        free(job->index_out);
        job->index_out = NULL;
    }
}

/* A Memory from fused's memory argument (see its doc), its buffers in
 * views[4] (released by the caller, whatever this returns): 0, or -1 with an
 * exception set. */
static int memory_of(PyObject *arg, Memory *m, Py_buffer views[4], int writable)
{
    PyObject *table, *where, *ring, *head;
    int bits;
    long long points, min_points, bytes_per_point;
    if (!PyTuple_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "memory must be a tuple, got %s", Py_TYPE(arg)->tp_name);
        return -1;
    }
    if (!PyArg_ParseTuple(arg, "OOOOiLLL;memory must be (table, where, ring, head, bits, points, "
                          "min_points, bytes_per_point)", &table, &where, &ring, &head, &bits,
                          &points, &min_points, &bytes_per_point))
        return -1;
    if (bits < 0 || points < 0 || points > 0xFFFF || min_points < 0 || min_points > 0xFFFF
        || bytes_per_point < 1) {
        PyErr_SetString(PyExc_ValueError, "memory: bits, points and min_points must be small counts, "
                        "bytes_per_point positive");
        return -1;
    }
    m->points = (unsigned long long)points;
    m->min_points = (unsigned long long)min_points;
    m->bytes_per_point = (unsigned long long)bytes_per_point;
    PyObject *objs[4] = {table, where, ring, head};
    for (int k = 0; k < 4; k++) {
        if (objs[k] != Py_None
            && PyObject_GetBuffer(objs[k], &views[k], writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
            return -1;
    }
    if (head == Py_None || views[3].len != 8 || (table == Py_None && where != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "memory: head must be 8 bytes, and where comes with a table");
        return -1;
    }
    size_t slots = table == Py_None ? 0 : (size_t)views[0].len / 8;
    if (table != Py_None && (bits < 1 || bits > 40 || slots != ((size_t)MEMORY_WAYS << (unsigned)bits)
                             || (where != Py_None && views[1].len != views[0].len))) {
        PyErr_SetString(PyExc_ValueError, "memory: table and where must be 4 << bits slots of 8 bytes");
        return -1;
    }
    m->table = table == Py_None ? NULL : views[0].buf;
    m->where = where == Py_None ? NULL : views[1].buf;
    m->slots = slots;
    m->bits = (unsigned)bits;
    m->ring = ring == Py_None || views[2].len == 0 ? NULL : views[2].buf;
    m->ring_bytes = ring == Py_None ? 0 : (size_t)views[2].len;
    m->head = views[3].buf;
    return 0;
}

static void release_all(Py_buffer *views, int n)
{
    for (int k = 0; k < n; k++)
        if (views[k].obj != NULL)
            PyBuffer_Release(&views[k]);
}

#ifdef CRC_X86
static void store_le(unsigned char *p, uint64_t v, int n)
{
    for (int k = 0; k < n; k++, v >>= 8)
        p[k] = (unsigned char)v;
}

/* VerifiedJpegs._kept_length: the length of the index of (fp, check) kept at
 * `at` (bytes ever written; negative: none), 0 if it is not there any more. */
static size_t memory_kept_length(const Memory *m, long long at, uint64_t fp, uint32_t check)
{
    if (at < 0 || m->ring == NULL || *m->head > (uint64_t)at + m->ring_bytes)
        return 0;
    size_t start = (size_t)((uint64_t)at % m->ring_bytes);
    if (start + MEMORY_RECORD > m->ring_bytes)
        return 0;
    const unsigned char *r = m->ring + start;
    if (load_le(r, 8) != fp || (uint32_t)load_le(r + 8, 4) != check)
        return 0;
    return (size_t)load_le(r + 16, 2);
}

/* VerifiedJpegs._keep: write a record of the index into the ring; where it
 * starts (bytes ever written), or -1 when it cannot be kept. The head moves
 * on before the bytes are written (see memory_record). */
static long long memory_keep(const Memory *m, uint64_t fp, uint32_t check, const unsigned char *index,
                             size_t n)
{
    size_t size = MEMORY_RECORD + n;
    if (m->ring == NULL || size > m->ring_bytes || n > 0xFFFF)
        return -1;
    uint64_t *head = (uint64_t *)m->head;
    uint64_t at = *head;
    if (at % m->ring_bytes + size > m->ring_bytes) /* no record wraps round the end */
        at += m->ring_bytes - at % m->ring_bytes;
    __atomic_store_n(head, at + size, __ATOMIC_SEQ_CST);
    unsigned char *r = (unsigned char *)m->ring + at % m->ring_bytes;
    store_le(r, fp, 8);
    store_le(r + 8, check, 4);
    store_le(r + 12, crc32c_of(0, index, n), 4);
    store_le(r + 16, n, 2);
    memcpy(r + MEMORY_RECORD, index, n);
    return (long long)at;
}

/* VerifiedJpegs._put, the table mapped: remember fp (with its index, when
 * n > 0); replace: keep a longer index of bytes already there. The caller
 * holds the GIL throughout and the memory's lock: the only writer. */
static void memory_put(const Memory *m, uint64_t fp, uint32_t check, const unsigned char *index,
                       size_t n, int replace)
{
    uint64_t *table = (uint64_t *)m->table, *where = (uint64_t *)m->where;
    uint64_t h = fp * SPLITMIX_GOLDEN;
    size_t buckets = m->slots / MEMORY_WAYS;
    size_t a = (size_t)(h >> (64 - m->bits)) * MEMORY_WAYS;
    size_t b = (size_t)((h >> 7) & (buckets - 1)) * MEMORY_WAYS;
    size_t empty = (size_t)-1;
    for (int k = 0; k < 2 * MEMORY_WAYS; k++) {
        size_t i = (k < MEMORY_WAYS ? a : b) + k % MEMORY_WAYS;
        if (table[i] == fp) {
            /* a longer index of the same bytes stays (see VerifiedJpegs._put) */
            if (replace && n && where != NULL
                && memory_kept_length(m, (long long)where[i] - 1, fp, check) < n)
                __atomic_store_n(&where[i], (uint64_t)(1 + memory_keep(m, fp, check, index, n)),
                                 __ATOMIC_SEQ_CST);
            return;
        }
        if (table[i] == 0 && empty == (size_t)-1)
            empty = i;
    }
    size_t slot = empty != (size_t)-1 ? empty
                                      : (fp & 1 ? a : b) + (size_t)((fp >> 1) & (MEMORY_WAYS - 1));
    if (where != NULL && where[slot])
        __atomic_store_n(&where[slot], 0, __ATOMIC_SEQ_CST); /* the old index is not the new file's */
    __atomic_store_n(&table[slot], fp, __ATOMIC_SEQ_CST);
    if (n && where != NULL)
        __atomic_store_n(&where[slot], (uint64_t)(1 + memory_keep(m, fp, check, index, n)),
                         __ATOMIC_SEQ_CST);
}
#endif

static PyObject *jpeg_memory_put(PyObject *self, PyObject *args)
{
    PyObject *memory_obj, *index_obj;
    unsigned long long fp;
    unsigned long check;
    int replace;
    if (!PyArg_ParseTuple(args, "OKkOp", &memory_obj, &fp, &check, &index_obj, &replace))
        return NULL;
    if (!crc_hardware)
        return PyErr_Format(PyExc_RuntimeError, "memory_put needs the CRC-32C instruction "
                            "(CRC32C_HARDWARE is 0)");
    if (fp == 0 || check > 0xFFFFFFFFul)
        return PyErr_Format(PyExc_ValueError, "memory_put: fp must be nonzero and check 32 bits");
    Py_buffer views[4], index = {0};
    memset(views, 0, sizeof views);
    Memory memory;
    memset(&memory, 0, sizeof memory);
    if (memory_of(memory_obj, &memory, views, 1) < 0) {
        release_all(views, 4);
        return NULL;
    }
    if (memory.table == NULL) {
        release_all(views, 4);
        return PyErr_Format(PyExc_ValueError, "memory_put: the memory has no table yet");
    }
    if (index_obj != Py_None && PyObject_GetBuffer(index_obj, &index, PyBUF_SIMPLE) < 0) {
        release_all(views, 4);
        return NULL;
    }
#ifdef CRC_X86
    memory_put(&memory, fp, (uint32_t)check, index.buf, index_obj != Py_None ? (size_t)index.len : 0,
               replace);
#endif
    if (index_obj != Py_None)
        PyBuffer_Release(&index);
    release_all(views, 4);
    Py_RETURN_NONE;
}

#ifndef _WIN32
static int read_whole(const char *path, char **out, size_t *out_len);
#endif

/* fused's first argument: the file's bytes (any buffer), or its path (str or
 * os.PathLike: the file is read in the same call, without the GIL, as
 * read_file reads it). */
typedef struct {
    Py_buffer data;
    PyObject *path, *encoded; /* the path given, and as bytes; NULL for bytes */
    char *file;               /* the file read from path (malloc'd) */
    size_t file_len;
    int read_err;
} FusedInput;

static int input_of(PyObject *arg, FusedInput *in)
{
    memset(in, 0, sizeof *in);
    if (PyObject_CheckBuffer(arg))
        return PyObject_GetBuffer(arg, &in->data, PyBUF_SIMPLE);
#ifdef _WIN32
    PyErr_Format(PyExc_TypeError, "fused: data must be bytes here, got %s", Py_TYPE(arg)->tp_name);
    return -1;
#else
    if (!PyUnicode_FSConverter(arg, &in->encoded))
        return -1;
    in->path = arg;
    return 0;
#endif
}

static void input_release(FusedInput *in)
{
    if (in->data.obj != NULL)
        PyBuffer_Release(&in->data);
    Py_XDECREF(in->encoded);
    free(in->file);
    in->file = NULL;
}

static PyObject *fused_result(Fused *f);

/* The memory argument of fused and fused_run (see memory_of), which needs the
 * CRC-32C instruction: 0, or -1 with an exception set naming the call ``who``
 * (the caller releases views whatever this returns). */
static int fused_memory_of(const char *who, PyObject *arg, Memory *m, Py_buffer views[4])
{
    if (!crc_hardware) {
        PyErr_Format(PyExc_RuntimeError, "%s: a memory needs the CRC-32C instruction "
                     "(CRC32C_HARDWARE is 0)", who);
        return -1;
    }
    return memory_of(arg, m, views, 0);
}

static PyObject *jpeg_fused(PyObject *self, PyObject *args)
{
    Py_buffer out, views[4];
    memset(views, 0, sizeof views);
    Fused f;
    memset(&f, 0, sizeof f);
    Memory memory;
    memset(&memory, 0, sizeof memory);
    FusedInput in;
    unsigned long long key, crop_stream, flip_stream, max_pixels;
    PyObject *source, *memory_obj = Py_None;
    if (!PyArg_ParseTuple(args, "OKKKdddddLLppiKw*|O", &source, &key, &crop_stream, &flip_stream,
                          &f.flip_p, &f.lo, &f.span_s, &f.log_lo, &f.span_r, &f.oh, &f.ow,
                          &f.antialias, &f.verify, &f.max_steps, &max_pixels, &out, &memory_obj))
        return NULL;
    if (input_of(source, &in) < 0) {
        input_release(&in);
        PyBuffer_Release(&out);
        return NULL;
    }
    if (f.oh <= 0 || f.ow <= 0 || f.oh > INT_MAX / 3 || f.ow > INT_MAX / 3
        || out.len != f.oh * f.ow * 3 || !PyBuffer_IsContiguous(&out, 'C')) {
        input_release(&in);
        PyBuffer_Release(&out);
        return PyErr_Format(PyExc_ValueError, "out must be a C-contiguous writable buffer of "
                            "oh * ow * 3 bytes");
    }
    if (memory_obj != Py_None) {
        if (fused_memory_of("fused", memory_obj, &memory, views) < 0) {
            release_all(views, 4);
            input_release(&in);
            PyBuffer_Release(&out);
            return NULL;
        }
        f.memory = &memory;
    }
    f.key = key;
    f.crop_stream = crop_stream;
    f.flip_stream = flip_stream;
    f.max_pixels = max_pixels;
    f.dst = out.buf;
    Py_BEGIN_ALLOW_THREADS
#ifndef _WIN32
    if (in.path != NULL) {
        in.read_err = read_whole(PyBytes_AS_STRING(in.encoded), &in.file, &in.file_len);
        if (in.read_err == 0)
            run_fused(&f, (const unsigned char *)in.file, in.file_len);
    } else
#endif
    {
        run_fused(&f, in.data.buf, (size_t)in.data.len);
    }
    Py_END_ALLOW_THREADS
    release_all(views, 4);
    PyBuffer_Release(&out);
    if (in.read_err) {
        input_release(&in);
        if (in.read_err == ENOMEM)
            return PyErr_NoMemory();
        errno = in.read_err;
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, source);
    }
    if (f.result == 2) {
        input_release(&in);
        if (f.job.status == 1)
            return PyErr_Format(DecodeError, "corrupt JPEG: %s", f.job.note);
        return PyErr_Format(DecodeError, "%s", f.job.note);
    }
    unsigned char *made = f.job.index_out;
    if (f.result != 0 && in.path != NULL) {
        /* not taken: the file's bytes, for decode() to take */
        free(made);
        PyObject *bytes = PyBytes_FromStringAndSize(in.file_len ? in.file : "",
                                                    (Py_ssize_t)in.file_len);
        input_release(&in);
        return bytes;
    }
    input_release(&in);
    return fused_result(&f);
}

/* What fused returns for a sample it did not fail on (result 0 or 1): a bool,
 * or what the memory is to learn of it; frees the index the decode made. */
static PyObject *fused_result(Fused *f)
{
    unsigned char *made = f->job.index_out;
    f->job.index_out = NULL;
    if (f->result != 0 || f->fp == 0 || !(f->verified || made != NULL)) {
        free(made);
        return PyBool_FromLong(f->result == 0);
    }
    /* Done, and the memory learns of it: what JpegDecoder._region adds */
    PyObject *made_obj = made != NULL
        ? PyBytes_FromStringAndSize((const char *)made, (Py_ssize_t)f->job.index_out_len)
        : Py_NewRef(Py_None);
    free(made);
    if (made_obj == NULL)
        return NULL;
    return Py_BuildValue("(KkON)", (unsigned long long)f->fp, (unsigned long)f->check,
                         f->verified ? Py_True : Py_False, made_obj);
}

#ifndef _WIN32
/* A whole file, opened, sized, read and closed in one stretch without the GIL:
 * per sample, the Python way (os.open, os.fstat, os.read, os.close) lets go of
 * the GIL four times, and on a busy process each return waits for another
 * thread's Python to reach its own next release. As feeder.sources._read_file
 * reads: a byte more than fstat reports, and a regular file that returns exactly
 * its size has reached its end; anything else (a file whose size changed, a
 * pipe, a /proc file) reads on until an empty read. Errors are OSError naming
 * the path, as os.open's are. */
/* The whole file at path into a malloc'd buffer (*buf, *got bytes), without
 * touching Python: 0, or an errno (ENOMEM where it does not fit). */
static int read_whole(const char *path, char **out, size_t *out_len)
{
    int err = 0, nomem = 0;
    char *buf = NULL;
    size_t got = 0;
    int fd;
    do {
        fd = open(path, O_RDONLY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        err = errno;
    } else {
        struct stat st;
        if (fstat(fd, &st) != 0) {
            err = errno;
        } else if (S_ISDIR(st.st_mode)) {
            err = EISDIR;
        } else {
            int regular = S_ISREG(st.st_mode) && st.st_size > 0;
            size_t size = regular ? (size_t)st.st_size : 0;
            size_t cap = regular ? size + 1 : (size_t)1 << 16;
            if (regular && (off_t)size != st.st_size)
                nomem = 1; /* larger than this address space */
            else
                buf = malloc(cap);
            int reads = 0;
            while (buf != NULL) {
                if (got == cap) {
                    char *more = cap > SIZE_MAX / 2 ? NULL : realloc(buf, cap * 2);
                    if (more == NULL) {
                        nomem = 1;
                        break;
                    }
                    buf = more;
                    cap *= 2;
                }
                ssize_t n = read(fd, buf + got, cap - got);
                if (n < 0 && errno == EINTR)
                    continue;
                if (n < 0) {
                    err = errno;
                    break;
                }
                if (n == 0)
                    break;
                got += (size_t)n;
                if (++reads == 1 && regular && got == size)
                    break;
            }
            if (buf == NULL && !err)
                nomem = 1;
        }
        close(fd);
    }
    if (err || nomem) {
        free(buf);
        return nomem ? ENOMEM : err;
    }
    *out = buf;
    *out_len = got;
    return 0;
}

static PyObject *read_file(PyObject *self, PyObject *arg)
{
    PyObject *encoded = NULL;
    if (!PyUnicode_FSConverter(arg, &encoded))
        return NULL;
    const char *path = PyBytes_AS_STRING(encoded);
    char *buf = NULL;
    size_t got = 0;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = read_whole(path, &buf, &got);
    Py_END_ALLOW_THREADS
    Py_DECREF(encoded);
    if (err == ENOMEM)
        return PyErr_NoMemory();
    if (err) {
        errno = err;
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, arg);
    }
    PyObject *data = PyBytes_FromStringAndSize(got ? buf : "", (Py_ssize_t)got);
    free(buf);
    return data;
}

/* The most samples one fused_run call takes (a run is up to 8 of a batch). */
#define FUSED_RUN_MAX 1024
/* A file the call reads but does not take comes back as its bytes up to this
 * size; a larger one is freed at once and comes back as None (the caller
 * reads it again alone), so that a run holds at most this much a file. */
#define FUSED_RUN_KEEP ((size_t)1 << 20)

/* One sample of fused_run: its path, its slot, and what became of it. */
typedef struct {
    PyObject *encoded; /* the path, as bytes */
    Py_buffer out;
    char *file;        /* the file read (kept for a file not taken) */
    size_t file_len;
    int read;          /* 1: read, and run_fused ran */
    Fused f;
} RunSample;

static void run_release(RunSample *s, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(s[i].encoded);
        if (s[i].out.obj != NULL)
            PyBuffer_Release(&s[i].out);
        free(s[i].file);
        free(s[i].f.job.index_out);
    }
    free(s);
}

/* fused() on a run of files, all read and decoded with the GIL released once:
 * per sample, what fused(path, ...) returns, or None where the call read
 * nothing the caller can use (not a regular file, a read error, a decode
 * error, a file not taken over FUSED_RUN_KEEP): the caller then takes that
 * sample alone, and meets the error as
 * fused() and the read step raise it. at: a writable int64 buffer where the
 * position of the sample being worked on is written (for naming a sample
 * stuck in a read), or None. */
static PyObject *jpeg_fused_run(PyObject *self, PyObject *args)
{
    PyObject *paths, *keys, *outs, *at_obj, *memory_obj = Py_None;
    unsigned long long crop_stream, flip_stream, max_pixels;
    Fused proto;
    memset(&proto, 0, sizeof proto);
    if (!PyArg_ParseTuple(args, "O!O!O!OKKdddddLLppiK|O", &PyList_Type, &paths, &PyList_Type, &keys,
                          &PyList_Type, &outs, &at_obj, &crop_stream, &flip_stream, &proto.flip_p,
                          &proto.lo, &proto.span_s, &proto.log_lo, &proto.span_r, &proto.oh, &proto.ow,
                          &proto.antialias, &proto.verify, &proto.max_steps, &max_pixels, &memory_obj))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(paths);
    if (PyList_GET_SIZE(keys) != n || PyList_GET_SIZE(outs) != n)
        return PyErr_Format(PyExc_ValueError, "fused_run: paths, keys and outs differ in length");
    if (n > FUSED_RUN_MAX)
        return PyErr_Format(PyExc_ValueError, "fused_run: at most %d samples a call, got %zd",
                            FUSED_RUN_MAX, n);
    if (proto.oh <= 0 || proto.ow <= 0 || proto.oh > INT_MAX / 3 || proto.ow > INT_MAX / 3)
        return PyErr_Format(PyExc_ValueError, "fused_run: bad output size");
    proto.crop_stream = crop_stream;
    proto.flip_stream = flip_stream;
    proto.max_pixels = max_pixels;
    RunSample *s = calloc(n > 0 ? (size_t)n : 1, sizeof *s);
    if (s == NULL)
        return PyErr_NoMemory();
    Py_buffer at, views[4];
    memset(&at, 0, sizeof at);
    memset(views, 0, sizeof views);
    Memory memory;
    memset(&memory, 0, sizeof memory);
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *path = PyList_GET_ITEM(paths, i);
        if (!PyUnicode_Check(path)) {
            PyErr_Format(PyExc_TypeError, "fused_run: paths must be str, got %s", Py_TYPE(path)->tp_name);
            goto done;
        }
        s[i].f = proto;
        s[i].f.key = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(keys, i));
        if (s[i].f.key == (unsigned long long)-1 && PyErr_Occurred())
            goto done;
        if (!PyUnicode_FSConverter(path, &s[i].encoded))
            goto done;
        if (PyObject_GetBuffer(PyList_GET_ITEM(outs, i), &s[i].out, PyBUF_WRITABLE) < 0)
            goto done;
        if (s[i].out.len != proto.oh * proto.ow * 3 || !PyBuffer_IsContiguous(&s[i].out, 'C')) {
            PyErr_Format(PyExc_ValueError, "fused_run: each out must be a C-contiguous writable "
                         "buffer of oh * ow * 3 bytes");
            goto done;
        }
        s[i].f.dst = s[i].out.buf;
    }
    if (at_obj != Py_None) {
        if (PyObject_GetBuffer(at_obj, &at, PyBUF_WRITABLE) < 0)
            goto done;
        if (at.len < (Py_ssize_t)sizeof(int64_t)) {
            PyErr_Format(PyExc_ValueError, "fused_run: at must hold an int64");
            goto done;
        }
    }
    if (memory_obj != Py_None) {
        if (fused_memory_of("fused_run", memory_obj, &memory, views) < 0)
            goto done;
        for (Py_ssize_t i = 0; i < n; i++)
            s[i].f.memory = &memory;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (at.buf != NULL)
            *(volatile int64_t *)at.buf = (int64_t)i;
        struct stat st;
        /* Only regular files here: a pipe or a device could block the whole run
         * (and is named alone when the caller takes it). */
        if (stat(PyBytes_AS_STRING(s[i].encoded), &st) != 0 || !S_ISREG(st.st_mode))
            continue;
        if (read_whole(PyBytes_AS_STRING(s[i].encoded), &s[i].file, &s[i].file_len) != 0)
            continue;
        s[i].read = 1;
        run_fused(&s[i].f, (const unsigned char *)s[i].file, s[i].file_len);
        if (s[i].f.result != 1 || s[i].file_len > FUSED_RUN_KEEP) {
            /* done or failed, or too large to hold for the rest of the run */
            free(s[i].file);
            s[i].file = NULL;
            if (s[i].f.result == 1)
                s[i].read = 0;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    if (result == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *one;
        RunSample *r = &s[i];
        if (!r->read || r->f.result == 2)
            one = Py_NewRef(Py_None);
        else if (r->f.result == 1) {
            one = PyBytes_FromStringAndSize(r->file_len ? r->file : "", (Py_ssize_t)r->file_len);
            free(r->file);
            r->file = NULL;
        } else
            one = fused_result(&r->f);
        if (one == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, one);
    }
done:
    release_all(views, 4);
    if (at.obj != NULL)
        PyBuffer_Release(&at);
    run_release(s, n);
    return result;
}
#endif

/* resize(src, dst, flip=False): _resize.c's bilinear resize of an [h, w, 3]
 * uint8 array (rows at any stride) into a C-contiguous one. */
static PyObject *resize(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"src", "dst", "flip", "area", NULL};
    PyObject *src_obj, *dst_obj;
    int flip = 0, area = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|pp", names, &src_obj, &dst_obj, &flip, &area))
        return NULL;
    Py_buffer src, dst;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_STRIDED_RO | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_CONTIG | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    int ok = src.ndim == 3 && dst.ndim == 3 && src.itemsize == 1 && dst.itemsize == 1
             && (src.format == NULL || strcmp(src.format, "B") == 0)
             && (dst.format == NULL || strcmp(dst.format, "B") == 0)
             && src.shape[2] == 3 && dst.shape[2] == 3 && src.strides[2] == 1
             && src.strides[1] == 3 && src.shape[0] > 0 && src.shape[1] > 0
             && src.strides[0] >= src.shape[1] * 3 && src.shape[0] <= INT_MAX
             && src.shape[1] <= INT_MAX / 3 && dst.shape[0] <= INT_MAX
             && dst.shape[1] <= INT_MAX / 3; /* 3 * a column index fits an int */
    if (!ok) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return PyErr_Format(PyExc_ValueError, "src must be a non-empty [h, w, 3] uint8 array with "
                            "contiguous rows, dst a C-contiguous [H, W, 3] uint8 array");
    }
    if (area && (dst.shape[0] < 1 || dst.shape[1] < 1 || dst.shape[0] > src.shape[0]
                 || dst.shape[1] > src.shape[1])) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return PyErr_Format(PyExc_ValueError, "the area shrink needs a non-empty dst no larger "
                            "than src on either side");
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = (area ? resize_area_rgb : resize_bilinear_rgb)(
        src.buf, (size_t)src.strides[0], (int)src.shape[0], (int)src.shape[1], dst.buf,
        (int)dst.shape[0], (int)dst.shape[1], flip);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (status != 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rrc_draws", rrc_draws, METH_VARARGS,
     "rrc_draws(state, area, height, width, lo, span_s, log_lo, span_r)\n"
     "    -> (top, left, h, w, state) | (None, state)\n\n"
     "feeder.ops.RandomResizedCrop.params' ten tries on a SampleRNG's (mixed)\n"
     "state, drawn as SampleRNG.uniform and .integers draw: the box found (None:\n"
     "none fits) and the state after."},

    {"header", jpeg_header, METH_O,
     "header(data) -> (width, height, components, colorspace, subsampling, progressive)\n\n"
     "Read a JPEG's header. Raises feeder.errors.DecodeError when it cannot."},
    {"frame", jpeg_frame, METH_VARARGS,
     "frame(data, max_steps) -> (marker, precision, height, width, components, stop) | None | False\n\n"
     "feeder.decode.headers.jpeg_frame's walk of the marker segments (None: no\n"
     "frame header found; False: more than max_steps segments and fill bytes)."},
    {"decode", (PyCFunction)(void (*)(void))jpeg_decode, METH_VARARGS | METH_KEYWORDS,
     "decode(data, top, left, height, width, denom, out, max_pixels, compact=False, verify=True,\n"
     "       own=True, index=None, record=False, max_points=16, into=None, crop=None,\n"
     "       flip=False, area=False) -> (stride, col_offset)\n\n"
     "Decode the region (in pixels of the image scaled by 1/denom) as RGB into the\n"
     "writable buffer out: row r at byte r * stride * 3, from column col_offset.\n"
     "own: feeder's Huffman decoder for sequential files (else libjpeg's). With\n"
     "record=True, or an index given, returns (stride, col_offset, index,\n"
     "mcus_jumped): index the bytes of an index of these data as far as the\n"
     "decode read (at most max_points checkpoints: every MCU row and every few\n"
     "MCUs along it, or every few rows when that does not fit; going on from\n"
     "the index given), or None when it knows no more than the one given; a\n"
     "later decode of the same bytes given it (with verify=False) starts each\n"
     "row of the region at the checkpoint before its first column. With into\n"
     "(a C-contiguous [H, W, 3] uint8 array) and crop (top, left, height, width\n"
     "in the region's pixels): then resize the crop into it as resize() does, in\n"
     "the same call (with area, its area shrink), and return as with record.\n"
     "Releases the GIL. Raises feeder.errors.DecodeError on any error or warning."},
    {"fused", jpeg_fused, METH_VARARGS,
     "fused(data, key, crop_stream, flip_stream, flip_p, lo, span_s, log_lo, span_r,\n"
     "      oh, ow, antialias, verify, max_steps, max_pixels, out[, memory])\n"
     "    -> bool | (fp, check, verified, index)\n\n"
     "feeder.decode.jpeg.JpegDecoder.fused's sample in one call without the GIL:\n"
     "the marker walk, the header, RandomResizedCrop's draws and its region, the\n"
     "decode, the resize into out ([oh, ow, 3] uint8) and the flip (flip_p < 0:\n"
     "none). False, having written nothing, for a file it does not take (decode()\n"
     "then takes it). memory: a VerifiedJpegs' (table, where, ring, head, bits,\n"
     "points, min_points, bytes_per_point), consulted as JpegDecoder._region does\n"
     "(table and where None before the first add; needs CRC32C_HARDWARE); when the\n"
     "file is to be added to it or its index kept, returns the fingerprints, whether\n"
     "it was read to its end and the index recorded (or None) instead of True.\n"
     "Raises feeder.errors.DecodeError as decode() does."},
    {"memory_put", jpeg_memory_put, METH_VARARGS,
     "memory_put(memory, fp, check, index, replace) -> None\n\n"
     "feeder.decode.verified.VerifiedJpegs._put on its native memory (see fused;\n"
     "the table mapped): remember fingerprint fp, with its index (bytes, or None)\n"
     "written into the ring; replace: keep a longer index of bytes already there.\n"
     "Holds the GIL throughout; the caller holds the memory's lock. Needs\n"
     "CRC32C_HARDWARE."},
    {"resize", (PyCFunction)(void (*)(void))resize, METH_VARARGS | METH_KEYWORDS,
     "resize(src, dst, flip=False, area=False) -> None\n\n"
     "Resize the [h, w, 3] uint8 array src (rows at any stride) into the C-contiguous\n"
     "[H, W, 3] uint8 array dst, bilinear with the half-pixel mapping (area: the\n"
     "area shrink, dst no larger than src on either side), mirrored left-right\n"
     "when flip; the same bytes on every CPU (see _resize.c). Releases the GIL."},
    {"crc32c", jpeg_crc32c, METH_VARARGS,
     "crc32c(data, value=0) -> int\n\n"
     "The CRC-32C (Castagnoli) of the bytes, with the CPU's instruction, going on\n"
     "from value (the CRC of the bytes before, as zlib.crc32's). Raises\n"
     "RuntimeError where the CPU has none (CRC32C_HARDWARE is 0)."},
#ifndef _WIN32
    {"fused_run", jpeg_fused_run, METH_VARARGS,
     "fused_run(paths, keys, outs, at, crop_stream, flip_stream, flip_p, lo, span_s, log_lo,\n"
     "          span_r, oh, ow, antialias, verify, max_steps, max_pixels[, memory]) -> list\n\n"
     "fused(path, ...) on each of a run of files (lists of str paths, int keys and\n"
     "outs), read and decoded with the GIL released once: per sample, what fused\n"
     "returns, or None where nothing usable was read (not a regular file, a read\n"
     "or decode error, a file not taken over 1 MiB: the caller takes that sample\n"
     "alone). at: a writable int64\n"
     "buffer where the position of the sample in work is written, or None."},
    {"read_file", read_file, METH_O,
     "read_file(path) -> bytes\n\n"
     "The whole file, as open(path, 'rb').read() returns it, opened, sized, read\n"
     "and closed with the GIL released once. Raises OSError naming path."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "feeder.decode._jpeg",
    "Region and scaled JPEG decoding with the system's libjpeg-turbo.", -1, methods,
};

PyMODINIT_FUNC PyInit__jpeg(void)
{
    PyObject *errors = PyImport_ImportModule("feeder.errors");
    if (errors == NULL)
        return NULL;
    DecodeError = PyObject_GetAttrString(errors, "DecodeError");
    Py_DECREF(errors);
    if (DecodeError == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
#ifdef LIBJPEG_TURBO_VERSION
#define FEEDER_STR2(x) #x
#define FEEDER_STR(x) FEEDER_STR2(x)
    PyModule_AddStringConstant(m, "LIBJPEG_TURBO_VERSION", FEEDER_STR(LIBJPEG_TURBO_VERSION));
#else
    PyModule_AddStringConstant(m, "LIBJPEG_TURBO_VERSION", "unknown");
#endif
    entropy_layout = entropy_library_layout();
    if (entropy_layout != NULL)
        PyModule_AddStringConstant(m, "ENTROPY_LAYOUT", entropy_layout);
    else
        PyModule_AddObjectRef(m, "ENTROPY_LAYOUT", Py_None);
    PyModule_AddIntConstant(m, "PAD", PAD);
    PyModule_AddIntConstant(m, "MAX_SCANS", MAX_SCANS);
    crc_init();
    PyModule_AddIntConstant(m, "CRC32C_HARDWARE", crc_hardware);
    return m;
}
