/* feeder's bilinear resize and area shrink of uint8 RGB pixels (see _resize.c). */
#ifndef FEEDER_RESIZE_H
#define FEEDER_RESIZE_H

#include <stddef.h>
#include <stdint.h>

/* Resize the sh x sw RGB image at src (row r at src + r * src_step bytes) to
 * dh x dw at dst (rows of dw * 3 bytes, contiguous), mirrored left-right when
 * flip. Returns 0, or -1 when out of memory (dst then untouched). */
int resize_bilinear_rgb(const uint8_t *src, size_t src_step, int sh, int sw, uint8_t *dst,
                        int dh, int dw, int flip);

/* The area shrink of the same (see _resize.c): dh <= sh and dw <= sw. Returns
 * 0, -1 when out of memory, -2 when a side would grow (dst then untouched).
 * Within one level of cv2's INTER_AREA for shrinks of up to MAX_AREA_SHRINK
 * per side: its weights' rounding adds up over longer spans (exact to its
 * formula at any size, but up to tens of levels off the average on
 * adversarial stripes). */
#define MAX_AREA_SHRINK 6
int resize_area_rgb(const uint8_t *src, size_t src_step, int sh, int sw, uint8_t *dst,
                    int dh, int dw, int flip);

#endif
