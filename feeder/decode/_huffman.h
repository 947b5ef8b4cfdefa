/*
 * feeder's own Huffman decoder for libjpeg-turbo's decompressor, with an index
 * of where MCU rows (and points along them) start (see _huffman.c).
 */
#ifndef FEEDER_HUFFMAN_H
#define FEEDER_HUFFMAN_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <jpeglib.h>

/* The marker reader's struct of libjpeg's internals (this decoder reads its
 * restart markers through it), and the entropy decoder's (for the pointer
 * type of cinfo->entropy). Debian installs jpegint.h; upstream libjpeg-turbo
 * does not, so they are declared here as libjpeg has laid them out since
 * version 6b (the marker reader's fields this decoder uses have not moved
 * since). */
#if defined(__has_include)
#if __has_include(<jpegint.h>)
#include <jpegint.h>
#define FEEDER_HAVE_JPEGINT 1
#endif
#endif
#ifndef FEEDER_HAVE_JPEGINT
struct jpeg_marker_reader {
    void (*reset_marker_reader)(j_decompress_ptr cinfo);
    int (*read_markers)(j_decompress_ptr cinfo);
    jpeg_marker_parser_method read_restart_marker;
    boolean saw_SOI;
    boolean saw_SOF;
    int next_restart_num;
    unsigned int discarded_bytes;
};
struct jpeg_entropy_decoder;
#endif

/* libjpeg's struct jpeg_entropy_decoder as this decoder fills it in. Its two
 * methods come first in every release; what follows changed under the same
 * soname: up to 2.x, insufficient_data; from 3.0, two lossless-mode methods
 * (decode_mcus, process_restart) and then insufficient_data. An extension
 * built against one release's jpegint.h and run on the other would write and
 * read other fields than libjpeg does. So only the two methods are named; the
 * rest is zeros, as long as the longest layout: libjpeg reads
 * insufficient_data as FALSE at either place, and the lossless methods
 * (NULL) are never called for the files this decoder takes (8-bit DCT scans,
 * entropy_supported). */
typedef struct {
    void (*start_pass)(j_decompress_ptr cinfo);
    boolean (*decode_mcu)(j_decompress_ptr cinfo, JBLOCKROW *MCU_data);
    void *tail[3]; /* zeros: 3.x's decode_mcus, process_restart, insufficient_data */
} EntropyPub;

#define WIDE_RING 8 /* the bit buffer's 64 bits: at most 8 bytes loaded and not read */
#define HUFF_LOOK 10 /* bits looked up at once; longer codes take the slow path */
/* Bits of an AC table's pair entries (>= HUFF_LOOK): 11 and 12 were slower
 * than 10 on whole decodes of the ImageNet-like set (tables of 16 and 32 KB
 * against 8 KB). */
#ifndef PAIR_LOOK
#define PAIR_LOOK 10
#endif
/* A pair entry's lookup reads PAIR_LOOK bits of the at least 32 a refill leaves */
_Static_assert(PAIR_LOOK >= HUFF_LOOK && PAIR_LOOK <= 16, "PAIR_LOOK: from HUFF_LOOK to 16 bits");
#ifndef SKIP_LOOK
/* Bits looked up at once in a skipped block (>= HUFF_LOOK): 11 and 12 were
 * no faster on the first reads of the ImageNet-like set (their tables cost
 * more to build). */
#define SKIP_LOOK 10
#endif

typedef struct {
    uint16_t look[1 << HUFF_LOOK]; /* (length << 8) | symbol for codes of up to HUFF_LOOK bits; 0 otherwise */
    int32_t maxcode[18];           /* largest code of each length (-1: none); [17] a sentinel */
    int32_t valoffset[17];         /* symbol index of a code: code + valoffset[length] */
    uint8_t huffval[256];
    /* DC tables, one look of HUFF_LOOK bits: a code and its value bits that
     * fit in them, the difference they give * 65536 + bits used; 0 otherwise.
     * Zeros in AC tables (their pair entries do this) */
    int32_t fast_dc[1 << HUFF_LOOK];
    /* AC tables, for blocks whose coefficients are kept (decode_block): for
     * each PAIR_LOOK bits, a symbol (a coefficient, an end of block, a run of
     * 16 zeros: its code and value bits) and the next where it fits in the
     * same bits (see build_pairs and the PAIR_ fields); 0 where the first
     * does not fit. Zeros in DC tables */
    uint64_t pair[1 << PAIR_LOOK];
    /* AC tables, for blocks whose coefficients are not kept (skip_block);
     * NULL in DC tables: for each
     * SKIP_LOOK bits, the codes and value bits that lie wholly within them,
     * several in one look: EOB << 15 | zig-zag positions advanced << 8 |
     * bits used; 0 when not even the first fits */
    uint16_t *skip;
} HuffTable;

/* An entry of HuffTable.pair. */
#define PAIR_USED(p) ((int)((p) & 0xFF))          /* bits read: both symbols' (the first's without a second) */
#define PAIR_RUN(p) ((int)(((p) >> 8) & 15))      /* zeros before the first symbol's value */
#define PAIR_AT2(p) ((int)(((p) >> 12) & 31))     /* the second's position past the first: 1 + its run (1 without one) */
#define PAIR_STEP2(p) ((int)(((p) >> 18) & 31))   /* positions past the first to go on from: 1 + its run (0 without one) */
#define PAIR_EOB ((uint64_t)1 << 23)              /* the second symbol is the end of the block */
#define PAIR_USED1(p) ((int)(((p) >> 24) & 0xFF)) /* bits of the first symbol alone */
#define PAIR_VALUE1(p) ((JCOEF)(int16_t)((p) >> 32)) /* 0 for an end of block or a run of 16 zeros */
#define PAIR_VALUE2(p) ((JCOEF)(int16_t)((p) >> 48)) /* 0 without a second coefficient */

/* Where the entropy decoder stands at the start of an MCU row. */
typedef struct {
    uint32_t pos;           /* offset in the file of the byte holding the next unread bit */
    uint8_t skip;           /* bits of that byte already read (0-7) */
    uint8_t next_restart;   /* the RSTn expected next (0-7) */
    uint16_t restarts_to_go;
    int16_t pred[MAX_COMPS_IN_SCAN]; /* DC predictions */
    uint16_t sig;           /* of a given point: 16 bits of the bytes at pos, checked before a jump */
} Checkpoint;

typedef struct {
    EntropyPub pub; /* first: libjpeg calls through it */
    j_decompress_ptr cinfo;
    const unsigned char *data;
    size_t size;
    /* the bit reader: acc holds nbits bits, most significant first; the last
     * `pad` of them are zeros added after the end of the data (a marker) */
    size_t pos;
    uint64_t acc;
    int nbits, pad;
    int marker;        /* 0: none met; -1: the data ended; else the marker's code */
    /* The file spans of the last data bytes that took more than one file
     * byte (FF 00), the newest at (nwide - 1) % WIDE_RING: see back_over */
    size_t wide_start[WIDE_RING], wide_end[WIDE_RING];
    uint64_t nwide;
    size_t marker_end; /* offset just past the marker */
    int pred[MAX_COMPS_IN_SCAN];
    unsigned restarts_to_go;
    /* the MCUs: decoded so far, asked for (skipped rows included), in all */
    uint64_t mcu, want, total;
    unsigned per_row, rows;
    int ncomp;
    const HuffTable *dc[D_MAX_BLOCKS_IN_MCU], *ac[D_MAX_BLOCKS_IN_MCU];
    int member[D_MAX_BLOCKS_IN_MCU];
    /* the index: checkpoints on a grid of MCU positions, row-major: rows 0,
     * rstride, 2*rstride, ... and in each of them ncols columns (grid_col:
     * 0 first, closer together on the left), all but the scan's first MCU:
     * npoints in all, the first `recorded` known */
    Checkpoint *points;
    unsigned npoints, rstride, ncols;
    uint64_t next_mcu; /* where the next point to record lies */
    int have_index; /* points were given: jump to them */
    int record;     /* fill in points as the decode passes them */
    unsigned recorded; /* points known: given, then recorded */
    unsigned given;    /* points the index given had */
    uint64_t jumped;   /* MCUs passed over by jumps (for tests and the bench) */
    /* Columns libjpeg will not IDCT (outside the crop, see entropy_crop):
     * their coefficients are not decoded where the index lets the decode
     * jump over them. */
    int skip_cols;
    unsigned col_lo, col_hi;
} Entropy;

/* The layout of libjpeg's entropy decoder struct in the library this process
 * runs (not the headers it was built with): "6b-2.x", "3.x", or NULL where the
 * library cannot be told (the own decoder is then never installed). */
const char *entropy_library_layout(void);

/* Whether the own decoder can run this file: a single sequential Huffman scan
 * of 8-bit samples (baseline or extended), after jpeg_start_decompress. */
int entropy_supported(j_decompress_ptr cinfo);

/* Take over the entropy decoding of `cinfo` (after jpeg_start_decompress; the
 * file is data[0:size], libjpeg's memory source at the first byte of the scan).
 * `index` (may be NULL) is an index that entropy_index wrote for these bytes;
 * one that does not fit this file is not used. `record`: keep a checkpoint
 * every few rows (room for `max_points`, unless an index was given), going on
 * from the given index's last. Every AC table gets its skip table: a
 * skipped MCU (rows above a crop, columns beside it, a read on to the end of
 * the scan) is read without keeping its coefficients (skip_block). Errors
 * longjmp through libjpeg. */
void entropy_install(j_decompress_ptr cinfo, Entropy *e, const unsigned char *data, size_t size,
                     const unsigned char *index, size_t index_len, int record, unsigned max_points);

/* The decode needs only the MCU columns first..last of each row (libjpeg's
 * cropped output, jpeg_crop_scanline): with an index, the others are decoded
 * only when the decode must pass them to reach a needed one (no checkpoint
 * to jump to); without one, only in a decode that reads to the end of the
 * scan (to_end), where they are decoded as skipped MCUs are (no coefficient
 * stored). */
void entropy_crop(j_decompress_ptr cinfo, unsigned first, unsigned last, int to_end);

/* The recorded index in bytes (the rows the decode passed, when more than the
 * index it was given): its size (0 if none), written to out when out is not
 * NULL and cap is enough. */
size_t entropy_index(const Entropy *e, unsigned char *out, size_t cap);

#endif
