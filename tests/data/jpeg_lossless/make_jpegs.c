/* Writes the JPEGs of this folder (see README.md): lossless and 12- and
 * 16-bit files, whose coding process decides whether a scaled or region
 * decode is right. Built against any libjpeg headers, it must run
 * on libjpeg-turbo 3.x, the first release line that writes lossless and
 * 12/16-bit files, for instance the one Pillow's wheels bundle:
 *
 *   LIB=$(python -c "import glob, os, PIL; print(glob.glob(os.path.join(
 *       os.path.dirname(PIL.__path__[0]), 'pillow.libs', 'libjpeg-*.so*'))[0])")
 *   cc -o make_jpegs make_jpegs.c "$LIB" && ./make_jpegs
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jpeglib.h>

/* libjpeg-turbo 3.0+ API, declared here so that older headers build it. */
extern void jpeg_enable_lossless(j_compress_ptr, int, int);
extern JDIMENSION jpeg12_write_scanlines(j_compress_ptr, short **, JDIMENSION);
extern JDIMENSION jpeg16_write_scanlines(j_compress_ptr, unsigned short **, JDIMENSION);

/* A smooth synthetic scene with a few edges: value in [0, 1). */
static double scene(int c, int y, int x, int h, int w)
{
    double v = 0.15 + 0.6 * (c % 3 == 0 ? (double)x / w : c == 1 ? (double)y / h : (double)(x + y) / (w + h));
    if ((x / 9 + y / 7) % 5 == 0) v += 0.2;
    if (x > w / 2 && y > h / 3) v = 0.9 - 0.5 * v;
    return v;
}

static int write(const char *path, int h, int w, int comps, int precision, int lossless,
                 int predictor, int ycc)
{
    struct jpeg_compress_struct c;
    struct jpeg_error_mgr err;
    FILE *f = fopen(path, "wb");
    if (!f) return 1;
    c.err = jpeg_std_error(&err);
    jpeg_create_compress(&c);
    jpeg_stdio_dest(&c, f);
    c.image_width = w;
    c.image_height = h;
    c.input_components = comps;
    c.in_color_space = comps == 4 ? JCS_CMYK : comps == 3 ? (ycc ? JCS_YCbCr : JCS_RGB) : JCS_GRAYSCALE;
    c.data_precision = precision;
    jpeg_set_defaults(&c);
    /* Lossless: the file's colour space is the input's (libjpeg-turbo sets
     * it so): RGB stored as RGB, or samples given as YCbCr stored as YCbCr
     * (which libjpeg-turbo converts to nothing else in lossless mode). */
    if (comps == 3 && !ycc)
        jpeg_set_colorspace(&c, JCS_RGB);
    if (lossless)
        jpeg_enable_lossless(&c, predictor, 0);
    else
        jpeg_set_quality(&c, 90, TRUE);
    jpeg_start_compress(&c, TRUE);
    int maxv = (1 << precision) - 1;
    for (int y = 0; y < h; y++) {
        unsigned short row16[4096];
        short row12[4096];
        unsigned char row8[4096];
        for (int x = 0; x < w; x++)
            for (int k = 0; k < comps; k++) {
                int v = (int)(scene(k, y, x, h, w) * maxv + 0.5);
                if (v > maxv) v = maxv;
                row16[x * comps + k] = v;
                row12[x * comps + k] = v;
                row8[x * comps + k] = v;
            }
        if (precision == 16) { unsigned short *r = row16; jpeg16_write_scanlines(&c, &r, 1); }
        else if (precision == 12) { short *r = row12; jpeg12_write_scanlines(&c, &r, 1); }
        else { JSAMPROW r = row8; jpeg_write_scanlines(&c, &r, 1); }
    }
    jpeg_finish_compress(&c);
    jpeg_destroy_compress(&c);
    fclose(f);
    return 0;
}

int main(void)
{
    /* path, height, width, components, precision, lossless, predictor,
     * samples given as YCbCr */
    return write("lossless_rgb.jpg", 45, 62, 3, 8, 1, 1, 0)
         | write("lossless_gray.jpg", 45, 62, 1, 8, 1, 7, 0)
         | write("lossless_cmyk.jpg", 45, 62, 4, 8, 1, 1, 0)
         | write("lossless_rgb_8x6.jpg", 6, 8, 3, 8, 1, 1, 0)
         | write("lossless_ycbcr.jpg", 45, 62, 3, 8, 1, 1, 1)
         | write("lossless_gray_12bit.jpg", 45, 62, 1, 12, 1, 1, 0)
         | write("lossless_gray_16bit.jpg", 45, 62, 1, 16, 1, 1, 0)
         | write("gray_12bit.jpg", 45, 62, 1, 12, 0, 1, 0);
}
