/*
 * feeder's own Huffman decoder, put in libjpeg-turbo's place for sequential
 * files, so that a later decode of the same bytes can start at the MCU row it
 * needs instead of decoding every row above the crop.
 *
 * Why: a region decode skips the IDCT, upsampling and colour conversion of the
 * rows above the crop (jpeg_skip_scanlines), but not their Huffman decoding:
 * Huffman codes have no byte alignment, so the only way to know where row r
 * starts is to decode rows 0 to r-1, a large share of the region decode
 * (bench/results/region_decode.txt). libjpeg
 * keeps its decoder's position (a bit buffer) and DC predictions private, so
 * no caller can restart it in the middle of a scan; a decoder of our own can.
 *
 * How: libjpeg calls the entropy decoder through the public struct
 * jpeg_entropy_decoder (jpegint.h). entropy_install replaces it after
 * jpeg_start_decompress, when nothing of the scan has been read. Its
 * decode_mcu(cinfo, NULL) (libjpeg's "discard this MCU", which
 * jpeg_skip_scanlines calls for every skipped MCU) only counts the MCU; the
 * first MCU whose coefficients are wanted catches up, from the nearest
 * checkpoint of the index when one was given, else by decoding the skipped
 * MCUs. A checkpoint is the state at the start of an MCU row: the byte and
 * bit of the next unread bit, the DC predictions, the restart counter. A
 * decode records one every few rows, as far down as it reads (to the end in
 * feeder's jpeg_verify pass, to the crop's last row otherwise), and a decode
 * given an index goes on recording past its last point; feeder keeps the
 * index beside the file's fingerprint (feeder/decode/verified.py), so it only
 * ever describes the bytes it was recorded from.
 *
 * What stays libjpeg's: the markers (restart markers and the end of the scan
 * are read by libjpeg's marker reader, positioned where this decoder stopped),
 * the IDCT, upsampling and colour conversion. The decoding follows libjpeg's
 * (jdhuff.c, ITU T.81 F.2.2) to the bit: coefficients in natural order, runs
 * past the 63rd coefficient landing on it, DC predictions wrapping as int.
 * Its warnings are libjpeg's and go through libjpeg's error manager (feeder
 * makes them errors): a code no table has ("bad Huffman code"), data that ends
 * before the MCU does ("premature end of data segment"), bytes before a marker;
 * and one of its own: fill bytes before a stuffed zero (FF FF 00), on which
 * libjpeg-turbo's slow and fast paths disagree.
 * tests/decode/test_jpeg_index.py checks the pixels against libjpeg's own decoder over
 * every layout and scale, and both decoders' verdicts on damaged files.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dladdr */
#endif
#include "_huffman.h"

#include <dlfcn.h>
#include <limits.h>
#include <string.h>

#include <jerror.h>

/* This decoder's own warning, beside libjpeg's (added to the error manager's
 * messages by entropy_install where it has none of its caller's). */
#define OWN_MESSAGE_FIRST 1000
#define JWRN_FILL_BEFORE_STUFFING OWN_MESSAGE_FIRST
static const char *const own_messages[] = {
    "Corrupt JPEG data: %d fill bytes before a stuffed zero byte",
    NULL,
};

#ifdef FEEDER_HAVE_JPEGINT
/* Headers of a release whose entropy decoder is longer than any this file
 * knows: fail the build rather than the decode. */
_Static_assert(sizeof(EntropyPub) >= sizeof(struct jpeg_entropy_decoder),
               "libjpeg's struct jpeg_entropy_decoder outgrew EntropyPub: check its new fields");
#endif

/* Zig-zag position -> natural order, with 16 extra entries: a corrupt run can
 * push the position past 63, and libjpeg writes such coefficients at 63. */
static const int natural_order[64 + 16] = {
    0,  1,  8,  16, 9,  2,  3,  10, 17, 24, 32, 25, 18, 11, 4,  5,
    12, 19, 26, 33, 40, 48, 41, 34, 27, 20, 13, 6,  7,  14, 21, 28,
    35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23, 30, 37, 44, 51,
    58, 59, 52, 45, 38, 31, 39, 46, 53, 60, 61, 54, 47, 55, 62, 63,
    63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63};

#define INDEX_VERSION 5
#define INDEX_HEADER 26
/* Columns between checkpoints along a row, at least: finer grids cost memory
 * for little (bench/results/region_decode.txt) */
#define MIN_CSTRIDE 4

/* 16 bits of the 8 bytes from p (fewer at the end of the data): each
 * checkpoint carries those of the bytes it points at (checked before a jump
 * to it), and the file's length is in the header, so that an index of other
 * bytes is almost never used (feeder itself finds an index by the file's
 * fingerprints). FNV-1a, folded. */
static unsigned bytes_sig(const unsigned char *data, size_t size, size_t p)
{
    uint32_t h = 2166136261u;
    for (size_t i = p; i < size && i < p + 8; i++)
        h = (h ^ data[i]) * 16777619u;
    return (h ^ (h >> 16)) & 0xFFFF;
}

/* A value of s bits (1 <= s <= 16) as JPEG codes it: the lower half negative. */
static inline int extend(unsigned v, int s)
{
    return v < (1u << (s - 1)) ? (int)v - (1 << s) + 1 : (int)v;
}

/* An AC table's pair entries (HuffTable.pair), from its look table. For each
 * PAIR_LOOK bits: the first symbol whose code and value bits lie wholly
 * within them, and, where the next symbol lies wholly within the rest of
 * them too and the first is not an end of block, that one too. A symbol is
 * written as decode_block writes a coefficient: a nonzero coefficient; an
 * end of block (every (r, 0) symbol but ZRL ends a block, as in libjpeg) as
 * a zero at the next position, and the block ends; a run of 16 zeros (ZRL)
 * as a zero 15 positions on, where the block has nothing written yet. A
 * second symbol is a coefficient or an end of block (a ZRL waits for the
 * next lookup). A code is known from its first l bits whatever follows (no
 * code is a prefix of another), so the look table read with the bits past
 * those known set to zero gives it when l of them are known. 0 where the
 * first symbol does not fit (decode_block reads its code from the look
 * table or the slow path, then its value bits); h->pair holds zeros. */
static void build_pairs(HuffTable *h)
{
    for (unsigned i = 0; i < (1u << PAIR_LOOK); i++) {
        unsigned look = h->look[i >> (PAIR_LOOK - HUFF_LOOK)];
        int l1 = look >> 8, rs1 = look & 0xFF, r1 = rs1 >> 4, s1 = rs1 & 15;
        if (l1 == 0 || l1 + s1 > PAIR_LOOK)
            continue;
        int used1 = l1 + s1;
        int v1 = s1 ? extend((i >> (PAIR_LOOK - used1)) & ((1u << s1) - 1), s1) : 0;
        /* without a second symbol: the first's bits, a zero written one
         * position on (see decode_block), no step */
        int used = used1, at2 = 1, step2 = 0, eob = 0, v2 = 0;
        if (s1 == 0 && r1 != 15) { /* the end of the block: a zero at the next position */
            h->pair[i] = (uint64_t)used1 | (uint64_t)1 << 12 | PAIR_EOB | (uint64_t)used1 << 24;
            continue;
        }
        unsigned rest = (i << used1) & ((1u << PAIR_LOOK) - 1);
        unsigned look2 = h->look[rest >> (PAIR_LOOK - HUFF_LOOK)];
        int l2 = look2 >> 8, rs2 = look2 & 0xFF, r2 = rs2 >> 4, s2 = rs2 & 15;
        if (l2 != 0 && l2 + s2 <= PAIR_LOOK - used1) {
            if (s2 == 0 && r2 != 15) { /* the end of the block */
                used = used1 + l2;
                eob = 1;
            } else if (s2 != 0) { /* a run of 16 zeros (0xF0) stays for the next look */
                v2 = extend((rest >> (PAIR_LOOK - l2 - s2)) & ((1u << s2) - 1), s2);
                used = used1 + l2 + s2;
                at2 = step2 = 1 + r2;
            }
        }
        h->pair[i] = (uint64_t)used | (uint64_t)r1 << 8 | (uint64_t)at2 << 12 | (uint64_t)step2 << 18
                     | (eob ? PAIR_EOB : 0) | (uint64_t)used1 << 24
                     | (uint64_t)(uint16_t)v1 << 32 | (uint64_t)(uint16_t)v2 << 48;
    }
}

static void build_table(j_decompress_ptr cinfo, const JHUFF_TBL *t, int is_dc, HuffTable *h)
{
    int count = 0;
    for (int l = 1; l <= 16; l++)
        count += t->bits[l];
    if (count > 256)
        ERREXIT(cinfo, JERR_BAD_HUFF_TABLE);
    memset(h->look, 0, sizeof h->look);
    memcpy(h->huffval, t->huffval, sizeof h->huffval);
    if (is_dc)
        for (int i = 0; i < count; i++)
            if (t->huffval[i] > 15)
                ERREXIT(cinfo, JERR_BAD_HUFF_TABLE);
    int32_t code = 0;
    int k = 0;
    for (int l = 1; l <= 16; l++) {
        int n = t->bits[l];
        /* codes past all-ones: libjpeg refuses the table too (checked before
         * they are written: the look table holds codes of l bits only) */
        if (code + n > (1 << l))
            ERREXIT(cinfo, JERR_BAD_HUFF_TABLE);
        h->valoffset[l] = k - code;
        for (int i = 0; i < n; i++, k++, code++)
            if (l <= HUFF_LOOK) {
                int shift = HUFF_LOOK - l;
                for (int j = 0; j < (1 << shift); j++)
                    h->look[(code << shift) | j] = (uint16_t)((l << 8) | t->huffval[k]);
            }
        h->maxcode[l] = n ? code - 1 : -1;
        code <<= 1;
    }
    h->maxcode[17] = INT32_MAX;
    memset(h->fast_dc, 0, sizeof h->fast_dc);
    if (is_dc) /* a code and its value bits within HUFF_LOOK bits: diff * 65536 + bits used */
        for (int i = 0; i < (1 << HUFF_LOOK); i++) {
            int l = h->look[i] >> 8, sz = h->look[i] & 15;
            if (l == 0 || l + sz > HUFF_LOOK)
                continue;
            int diff = sz ? extend(((unsigned)i >> (HUFF_LOOK - l - sz)) & ((1u << sz) - 1), sz) : 0;
            h->fast_dc[i] = diff * 65536 + l + sz;
        }
    memset(h->pair, 0, sizeof h->pair);
    if (!is_dc)
        build_pairs(h);
}

/* The tables this thread built last, by their definition (DC or AC, the
 * code counts and the symbols): most files of a dataset share theirs (an
 * encoder's standard tables), and building one costs about as much as
 * decoding a 64 px crop's blocks of it (11% of the CPU of a small-image
 * pipeline, bench/results/cost_breakdown.txt). A table found here is the
 * one build_table would build from the same definition, and a decode reads
 * it where it is kept (copying its 6.5 KB, and clearing a decoder that held
 * eight of them, cost about 1% of a 224 px region decode); a table
 * build_table refuses never gets here. Per thread (the decode runs without
 * the GIL in several threads): no lock; a decode runs to its end (or its
 * error) before the thread starts another, so the tables it reads stay put
 * as long as its own install does not replace them (see cached_table). */
#define TABLE_CACHE 8
/* An install takes at most this many tables (DC and AC of each number) and
 * keeps them all: the slots it has taken are never the ones it replaces. */
_Static_assert(TABLE_CACHE >= 2 * NUM_HUFF_TBLS, "an install must find a slot it has not taken");
typedef struct {
    int filled, is_dc, count;
    uint8_t bits[17];
    uint8_t huffval[256];
    HuffTable table; /* an AC table's skip points at skip */
    uint16_t skip[1 << SKIP_LOOK];
} CachedTable;
#if defined(_MSC_VER)
#define THREAD_LOCAL __declspec(thread)
#else
#define THREAD_LOCAL __thread
#endif
static THREAD_LOCAL CachedTable table_cache[TABLE_CACHE];
static THREAD_LOCAL unsigned table_cache_next;

static void build_skip(HuffTable *h);

/* This thread's table of definition t, or NULL. */
static CachedTable *cached_lookup(const JHUFF_TBL *t, int is_dc, int count)
{
    for (int i = 0; i < TABLE_CACHE; i++) {
        CachedTable *c = &table_cache[i];
        if (c->filled && c->is_dc == is_dc && c->count == count
            && memcmp(c->bits, t->bits, sizeof c->bits) == 0
            && memcmp(c->huffval, t->huffval, (size_t)count) == 0)
            return c;
    }
    return NULL;
}

/* This thread's table of definition t, built on the first ask and kept
 * there (an AC table with its skip table): the decode reads it in place.
 * `pinned` marks the slots the install in progress has taken (a bit per
 * slot): a table it builds never replaces one of those, which the same
 * decode reads (the install asks for at most 2 * NUM_HUFF_TBLS tables, so a
 * free slot is always left). */
static const HuffTable *cached_table(j_decompress_ptr cinfo, const JHUFF_TBL *t, int is_dc,
                                     unsigned *pinned)
{
    int count = 0;
    for (int l = 1; l <= 16; l++)
        count += t->bits[l];
    CachedTable *c = count <= 256 ? cached_lookup(t, is_dc, count) : NULL;
    if (c == NULL) {
        unsigned slot = table_cache_next++ % TABLE_CACHE;
        for (int tried = 1; *pinned & (1u << slot); tried++) {
            if (tried == TABLE_CACHE) /* every slot taken: more tables than an install asks for */
                ERREXIT(cinfo, JERR_NOT_COMPILED);
            slot = table_cache_next++ % TABLE_CACHE;
        }
        c = &table_cache[slot];
        c->filled = 0; /* until built: an error longjmps out of build_table */
        build_table(cinfo, t, is_dc, &c->table);
        c->table.skip = NULL;
        if (!is_dc) {
            c->table.skip = c->skip;
            build_skip(&c->table);
        }
        c->is_dc = is_dc;
        c->count = count;
        memcpy(c->bits, t->bits, sizeof c->bits);
        memcpy(c->huffval, t->huffval, (size_t)count);
        c->filled = 1;
    }
    *pinned |= 1u << (unsigned)(c - table_cache);
    return &c->table;
}

/* The skip table of an AC table (see HuffTable.skip): for each SKIP_LOOK
 * bits, the symbols (run/size codes and their value bits) that lie wholly
 * within them, in order, up to an end of block, a code longer than
 * HUFF_LOOK, or more than 63 positions. A code is known from its first l
 * bits whatever follows (no code is a prefix of another), so the look table
 * read with the bits past those known set to zero gives it when l of them
 * are known. */
static void build_skip(HuffTable *h)
{
    /* h->skip: 1 << SKIP_LOOK entries */
    for (unsigned i = 0; i < (1u << SKIP_LOOK); i++) {
        int used = 0, adv = 0, eob = 0;
        while (used < SKIP_LOOK) {
            unsigned bits = (i << used) & ((1u << SKIP_LOOK) - 1);
            unsigned look = h->look[bits >> (SKIP_LOOK - HUFF_LOOK)];
            int l = look >> 8, r = (look >> 4) & 15, sz = look & 15;
            if (l == 0 || l + sz > SKIP_LOOK - used)
                break;
            if (sz == 0 && r != 15) { /* end of block */
                used += l;
                eob = 1;
                break;
            }
            int a = sz ? r + 1 : 16; /* the position after this coefficient (or run of 16 zeros) */
            if (adv + a > 63)
                break;
            adv += a;
            used += l + sz;
        }
        h->skip[i] = (uint16_t)(used ? eob << 15 | adv << 8 | used : 0);
    }
}

static inline int has_ff(uint64_t x)
{
    uint64_t v = ~x;
    return ((v - 0x0101010101010101ULL) & ~v & 0x8080808080808080ULL) != 0;
}

/* A data byte taken from the file bytes [start, end), more than one (FF 00):
 * kept so that the file offset of any byte in the bit buffer is known, not
 * guessed from the bytes (the bit buffer holds at most 8 bytes, so the last 8
 * such suffice). */
static void note_wide(Entropy *e, size_t start, size_t end)
{
    unsigned k = (unsigned)(e->nwide++ % WIDE_RING);
    e->wide_start[k] = start;
    e->wide_end[k] = end;
}

/* Load bytes until acc holds at least 57 bits, undoing the 0xFF00 stuffing;
 * at a marker (or the data's end) zeros come in, counted in pad. */
static void refill_slow(Entropy *e)
{
    while (e->nbits <= 56) {
        unsigned c = 0;
        if (e->marker == 0) {
            if (e->pos >= e->size) {
                /* The data ends with no marker: libjpeg's memory source warns
                 * as soon as its reader needs a byte more, and so does this. */
                WARNMS(e->cinfo, JWRN_JPEG_EOF);
                e->marker = -1;
                e->marker_end = e->size;
            } else {
                c = e->data[e->pos++];
                if (c == 0xFF) {
                    size_t p = e->pos; /* fill bytes: FF FF ... then 00 (a data FF) or a marker */
                    while (p < e->size && e->data[p] == 0xFF)
                        p++;
                    if (p >= e->size) {
                        WARNMS(e->cinfo, JWRN_JPEG_EOF);
                        e->pos--;
                        e->marker = -1;
                        e->marker_end = e->size;
                        c = 0;
                    } else if (e->data[p] == 0) {
                        /* FF 00 is a data FF. Fill bytes may come before a
                         * marker only (T.81 B.1.1.2): before a 00 they are
                         * damage, which libjpeg-turbo's slow path reads as one
                         * FF and its fast path as a marker (zeros), so that
                         * the same file decodes two ways there. Refused. */
                        if (p > e->pos)
                            WARNMS1(e->cinfo, JWRN_FILL_BEFORE_STUFFING, (int)(p - e->pos));
                        note_wide(e, e->pos - 1, p + 1);
                        e->pos = p + 1;
                    } else {
                        e->pos--;
                        e->marker = e->data[p];
                        e->marker_end = p + 1;
                        c = 0;
                    }
                }
            }
        }
        if (e->marker)
            e->pad += 8;
        e->acc |= (uint64_t)c << (56 - e->nbits);
        e->nbits += 8;
    }
}

/* Bits below nbits in acc are either zero or the very bits the next bytes
 * bring (the fast path loads 8 bytes, of which it counts the whole ones), so
 * OR-ing the next bytes in is exact. */
static inline void refill(Entropy *e)
{
    if (e->marker == 0 && e->pos + 8 <= e->size) {
        uint64_t x;
        memcpy(&x, e->data + e->pos, 8);
        x = __builtin_bswap64(x);
        if (!has_ff(x)) {
            e->acc |= x >> e->nbits;
            e->pos += (size_t)((63 - e->nbits) >> 3);
            e->nbits |= 56;
            return;
        }
    }
    refill_slow(e);
}

static inline unsigned take(Entropy *e, int n) /* 1 <= n <= 16 */
{
    unsigned v = (unsigned)(e->acc >> (64 - n));
    e->acc <<= n;
    e->nbits -= n;
    return v;
}

static int slow_symbol(Entropy *e, const HuffTable *h)
{
    int l = HUFF_LOOK + 1;
    int32_t code = (int32_t)(e->acc >> (64 - l));
    while (code > h->maxcode[l]) {
        l++;
        code = (int32_t)(e->acc >> (64 - l));
    }
    if (l > 16) {
        WARNMS(e->cinfo, JWRN_HUFF_BAD_CODE);
        return 0; /* not reached: feeder's warnings are errors */
    }
    e->acc <<= l;
    e->nbits -= l;
    return h->huffval[(code + h->valoffset[l]) & 0xFF];
}

/* The bit reader's state in locals for the hot loop (the compiler cannot
 * keep e->acc in a register across the coefficient stores otherwise). */
/* ... and the read position, with the last position the fast refill may
 * load 8 bytes from (-1: none, a marker met or the data's end near). */
#define LOAD_STATE()                                                      \
    uint64_t acc = e->acc;                                                \
    int nbits = e->nbits;                                                 \
    size_t pos = e->pos;                                                  \
    const unsigned char *data = e->data;                                  \
    ptrdiff_t last = e->marker == 0 && e->size >= 8 ? (ptrdiff_t)(e->size - 8) : -1
#define SAVE_STATE() (e->acc = acc, e->nbits = nbits, e->pos = pos)
#define RELOAD_STATE()                                                    \
    (acc = e->acc, nbits = e->nbits, pos = e->pos,                        \
     last = e->marker == 0 && e->size >= 8 ? (ptrdiff_t)(e->size - 8) : -1)
#define REFILL()                                                          \
    do {                                                                  \
        if (nbits < 32) {                                                 \
            uint64_t x_;                                                  \
            if ((ptrdiff_t)pos <= last                                    \
                && (memcpy(&x_, data + pos, 8), x_ = __builtin_bswap64(x_), !has_ff(x_))) { \
                acc |= x_ >> nbits;                                       \
                pos += (size_t)((63 - nbits) >> 3);                       \
                nbits |= 56;                                              \
            } else {                                                      \
                SAVE_STATE();                                             \
                refill_slow(e);                                           \
                RELOAD_STATE();                                           \
            }                                                             \
        }                                                                 \
    } while (0)
#define TAKE(n, v) ((v) = (unsigned)(acc >> (64 - (n))), acc <<= (n), nbits -= (n))
#define SYMBOL(h, s)                                                      \
    do {                                                                  \
        unsigned look_ = (h)->look[acc >> (64 - HUFF_LOOK)];              \
        if (look_) {                                                      \
            int l_ = look_ >> 8;                                          \
            acc <<= l_;                                                   \
            nbits -= l_;                                                  \
            (s) = look_ & 0xFF;                                           \
        } else {                                                          \
            SAVE_STATE();                                                 \
            (s) = slow_symbol(e, (h));                                    \
            acc = e->acc;                                                 \
            nbits = e->nbits;                                             \
        }                                                                 \
    } while (0)

/* A block's DC difference added to its prediction: the code and its value
 * bits in one look where they fit (the DC table's fast_dc), else the code,
 * then its value bits. */
#define DC_PRED(dc, pred)                                                 \
    do {                                                                  \
        int diff_ = 0;                                                    \
        int32_t g_ = (dc)->fast_dc[acc >> (64 - HUFF_LOOK)];              \
        if (g_) {                                                         \
            int used_ = g_ & 0xFF;                                        \
            acc <<= used_;                                                \
            nbits -= used_;                                               \
            diff_ = g_ >> 16; /* arithmetic shift (gcc, clang) */         \
        } else {                                                          \
            int s_;                                                       \
            unsigned v_;                                                  \
            SYMBOL(dc, s_);                                               \
            if (s_) {                                                     \
                TAKE(s_, v_);                                             \
                diff_ = extend(v_, s_);                                   \
            }                                                             \
        }                                                                 \
        /* wraps as libjpeg's int does */                                 \
        *(pred) = (int)((unsigned)*(pred) + (unsigned)diff_);             \
    } while (0)

static inline void decode_block(Entropy *e, JCOEF *blk, const HuffTable *dc, const HuffTable *ac,
                                int *pred)
{
    LOAD_STATE();
    unsigned v;
    int s;
    REFILL();
    DC_PRED(dc, pred);
    blk[0] = (JCOEF)*pred;
    for (int k = 1; k < 64; k++) {
        REFILL();
        uint64_t p = ac->pair[acc >> (64 - PAIR_LOOK)];
        if (p) { /* a symbol, and the next where it fits in the same look (build_pairs) */
            k += PAIR_RUN(p);
            blk[natural_order[k]] = PAIR_VALUE1(p);
            if (__builtin_expect(k >= 63, 0)) { /* the block is full: the loop ends here */
                int used1 = PAIR_USED1(p);
                acc <<= used1;
                nbits -= used1;
                continue;
            }
            /* Both symbols' bits at once: the next refill may come a symbol
             * later than a one-symbol loop's. Where the bytes are loaded
             * matters only to a decode that stops before the scan's end
             * (jpeg_verify=False): damage in the few bytes past its last
             * code is seen or not as the reader had loaded ahead. */
            int used = PAIR_USED(p);
            acc <<= used;
            nbits -= used;
            /* Written whether or not there is a second coefficient (no branch
             * to mispredict): without one, a zero one position on, where the
             * block (zeros from libjpeg) has had nothing written yet; the
             * positions only grow, and k + 1 <= 63 here. */
            blk[natural_order[k + PAIR_AT2(p)]] = PAIR_VALUE2(p);
            if (p & PAIR_EOB)
                break;
            k += PAIR_STEP2(p);
            continue;
        }
        /* A code whose value bits do not fit in the look, or a longer code:
         * the code, then its value bits. */
        int rs;
        SYMBOL(ac, rs);
        int r = rs >> 4;
        s = rs & 15;
        if (s) {
            k += r;
            TAKE(s, v);
            blk[natural_order[k]] = (JCOEF)extend(v, s);
        } else {
            if (r != 15)
                break;
            k += 15;
        }
    }
    SAVE_STATE();
}

/* decode_block for a block whose coefficients are not kept (a skipped MCU,
 * or one beside the crop): the same bits read, the same DC prediction and
 * the same warnings, several AC codes at a time where the skip table has
 * them. Its entry applies from position k when the positions it advances
 * keep k within the block (k + advanced <= 63: every code it covers is one
 * that the loop of decode_block would read); otherwise one code is read as
 * decode_block reads it. */
static inline void skip_block(Entropy *e, const HuffTable *dc, const HuffTable *ac, int *pred)
{
    LOAD_STATE();
    unsigned v;
    int s;
    REFILL();
    DC_PRED(dc, pred);
    const uint16_t *skip = ac->skip; /* in a register: the refill's stores might alias ac */
    for (int k = 1; k < 64;) {
        REFILL();
        unsigned m = skip[acc >> (64 - SKIP_LOOK)];
        if (m && k + (int)((m >> 8) & 63) <= 63) {
            int used = (int)(m & 0xFF);
            acc <<= used;
            nbits -= used;
            if (m & 0x8000)
                break; /* end of block */
            k += (int)((m >> 8) & 63);
            continue;
        }
        int rs;
        SYMBOL(ac, rs);
        int r = rs >> 4;
        s = rs & 15;
        if (s) {
            k += r;
            TAKE(s, v);
        } else {
            if (r != 15)
                break;
            k += 15;
        }
        k++;
    }
    (void)v;
    SAVE_STATE();
}

/* The file offset of the first of the last n data bytes the reader loaded
 * (n <= 8, pos the offset just past them): each a file byte, or the span
 * note_wide recorded. Bytes loaded before the reader last moved (a jump, a
 * restart) are never asked for. */
static size_t back_over(const Entropy *e, size_t pos, int n)
{
    uint64_t k = e->nwide;
    for (; n > 0; n--) {
        if (k > 0 && e->wide_end[(k - 1) % WIDE_RING] == pos)
            pos = e->wide_start[--k % WIDE_RING];
        else
            pos--;
    }
    return pos;
}

/* Hand libjpeg's source manager the position where the scan's bytes stop
 * being ours, at a restart marker or at the end of the scan. Whole bytes
 * loaded but not read are damage (the segment should end within the last
 * byte read); libjpeg-turbo drops the few its read-ahead took in silently,
 * and catches only those beyond, so it reports such damage or not depending
 * on how far it had read ahead. This decoder reports them all: bytes before a
 * marker already met are a warning here; otherwise the source goes back to
 * the first of them and libjpeg's marker reader counts them (with any more
 * before the marker) and warns. */
static void give_source_back(Entropy *e)
{
    j_decompress_ptr cinfo = e->cinfo;
    int left = (e->nbits - e->pad) / 8;
    if (left > 0 && e->marker > 0) /* counted in the file's bytes, as libjpeg counts them */
        WARNMS2(cinfo, JWRN_EXTRANEOUS_DATA, (int)(e->pos - back_over(e, e->pos, left)), e->marker);
    struct jpeg_source_mgr *src = cinfo->src;
    size_t at = e->marker > 0 ? e->marker_end
              : e->marker < 0 ? e->size : back_over(e, e->pos, left);
    src->next_input_byte = e->data + at;
    src->bytes_in_buffer = e->size - at;
    cinfo->unread_marker = e->marker > 0 ? e->marker : 0;
}

static void restart(Entropy *e)
{
    j_decompress_ptr cinfo = e->cinfo;
    give_source_back(e);
    if (!(*cinfo->marker->read_restart_marker)(cinfo))
        ERREXIT(cinfo, JERR_CANT_SUSPEND); /* a memory source never suspends */
    if (cinfo->unread_marker != 0) /* a resync left a marker for later: it warned first */
        WARNMS(cinfo, JWRN_HIT_MARKER);
    e->pos = (size_t)(cinfo->src->next_input_byte - e->data);
    e->acc = 0;
    e->nbits = e->pad = e->marker = 0;
    e->nwide = 0;
    for (int c = 0; c < e->ncomp; c++)
        e->pred[c] = 0;
    e->restarts_to_go = cinfo->restart_interval;
}

/* The checkpoint of the current state (at an MCU row's start); 0 if it cannot
 * be written (a DC prediction out of int16's range). After a marker was met
 * (a restart marker where the row starts a restart interval, the end), pos is
 * at its first byte and the bits read ahead of it are zeros (pad): the unread
 * bits of the data are still the last ones loaded before pos. */
static int save_point(Entropy *e, Checkpoint *cp)
{
    int unread = e->nbits - e->pad;
    size_t p = back_over(e, e->pos, (unread + 7) / 8); /* the bytes holding unread bits */
    if (p > UINT32_MAX)
        return 0;
    cp->pos = (uint32_t)p;
    cp->skip = (uint8_t)((8 - unread % 8) % 8);
    cp->next_restart = (uint8_t)(e->cinfo->marker->next_restart_num & 7);
    cp->restarts_to_go = (uint16_t)e->restarts_to_go;
    for (int c = 0; c < MAX_COMPS_IN_SCAN; c++) {
        int v = c < e->ncomp ? e->pred[c] : 0;
        if (v < INT16_MIN || v > INT16_MAX)
            return 0;
        cp->pred[c] = (int16_t)v;
    }
    return 1;
}

/* The column of a grid row's point j (0 <= j < ncols): j + (per_row - ncols)
 * * j^2 / ncols^2, rounded down. Column 0 first, strictly increasing, the
 * last before per_row; closer together on the left, where crops start: a
 * crop's first column is uniform over the columns that leave room for its
 * width, so small columns come most often whatever the widths (with
 * RandomResizedCrop's on the ImageNet-like set, 5.7 columns to decode
 * before a crop's first in each row, on average, against 8.4 with the
 * points evenly spaced: bench/experiments/index_columns.py). */
static unsigned grid_col(unsigned per_row, unsigned ncols, unsigned j)
{
    return j + (unsigned)((uint64_t)(per_row - ncols) * j * j / ((uint64_t)ncols * ncols));
}

/* The last point j of a grid row at or before column col. */
static unsigned grid_point(const Entropy *e, unsigned col)
{
    unsigned lo = 0, hi = e->ncols - 1; /* grid_col(.., 0) = 0 <= col */
    while (lo < hi) {
        unsigned mid = lo + (hi - lo + 1) / 2;
        if (grid_col(e->per_row, e->ncols, mid) <= col)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* The MCU at which point p of the grid lies. */
static uint64_t point_mcu(const Entropy *e, unsigned p)
{
    unsigned q = p + 1; /* the grid's first position, the scan's first MCU, is no point */
    return (uint64_t)(q / e->ncols) * e->rstride * e->per_row + grid_col(e->per_row, e->ncols, q % e->ncols);
}

static void restore_point(Entropy *e, const Checkpoint *cp, uint64_t mcu)
{
    e->pos = cp->pos;
    e->acc = 0;
    e->nbits = e->pad = e->marker = 0;
    e->nwide = 0;
    refill(e);
    if (cp->skip)
        take(e, cp->skip);
    for (int c = 0; c < e->ncomp; c++)
        e->pred[c] = cp->pred[c];
    e->restarts_to_go = cp->restarts_to_go;
    e->cinfo->marker->next_restart_num = cp->next_restart;
    e->jumped += mcu - e->mcu;
    e->mcu = mcu;
}

static void decode_one(Entropy *e, JBLOCKROW *blocks)
{
    j_decompress_ptr cinfo = e->cinfo;
    if (e->record && e->mcu == e->next_mcu) {
        /* MCUs are passed one by one from a known point (the first MCU, or a
         * checkpoint up to the last one known), so the next point to record
         * is always reached before any later one. */
        if (save_point(e, &e->points[e->recorded])) {
            e->recorded++;
            if (e->recorded < e->npoints)
                e->next_mcu = point_mcu(e, e->recorded);
            else
                e->record = 0; /* the grid is full */
        } else {
            e->record = 0; /* a prediction out of range: the index ends here */
        }
    }
    if (cinfo->restart_interval) {
        if (e->restarts_to_go == 0)
            restart(e);
        e->restarts_to_go--;
    }
    if (blocks != NULL)
        for (int b = 0; b < cinfo->blocks_in_MCU; b++)
            decode_block(e, blocks[b][0], e->dc[b], e->ac[b], &e->pred[e->member[b]]);
    else
        for (int b = 0; b < cinfo->blocks_in_MCU; b++)
            skip_block(e, e->dc[b], e->ac[b], &e->pred[e->member[b]]);
    if (e->nbits < e->pad) /* read past the end of the data: libjpeg's warning */
        WARNMS(cinfo, JWRN_HIT_MARKER);
    e->mcu++;
}

static void catch_up(Entropy *e, uint64_t target)
{
    if (e->have_index && e->recorded > 0) {
        /* The last point at or before target: in target's row if that row is
         * on the grid, else the last one of the grid row above it. */
        uint64_t row = target / e->per_row, g = row / e->rstride;
        uint64_t j = row == g * e->rstride ? grid_point(e, (unsigned)(target % e->per_row)) : e->ncols - 1;
        uint64_t q = g * e->ncols + j; /* its number + 1 */
        if (q > e->recorded)
            q = e->recorded;
        if (q >= 1) {
            uint64_t at = point_mcu(e, (unsigned)(q - 1));
            const Checkpoint *cp = &e->points[q - 1];
            if (at > e->mcu && q - 1 < e->given
                && cp->sig != bytes_sig(e->data, e->size, cp->pos)) {
                /* A given point whose bytes are not these: the index is of
                 * other bytes (feeder finds its indexes by the file's
                 * fingerprints; this guards a caller that does not). Use
                 * none of it from here on, and record nothing. Checked at
                 * the jump, not when the index is read: a decode uses a few
                 * of its hundreds of points. */
                e->have_index = 0;
                e->record = 0;
                e->recorded = e->given;
            } else if (at > e->mcu) {
                restore_point(e, cp, at);
            }
        }
    }
    while (e->mcu < target)
        decode_one(e, NULL);
}

static boolean own_decode_mcu(j_decompress_ptr cinfo, JBLOCKROW *MCU_data)
{
    Entropy *e = (Entropy *)cinfo->entropy;
    if (e->want >= e->total) /* libjpeg asks for no more than the scan holds */
        return TRUE;
    if (MCU_data == NULL) { /* a skipped MCU: decoded only if a later one needs it */
        e->want++;
        return TRUE;
    }
    if (e->skip_cols) {
        /* A column libjpeg does not IDCT (its coefficients stay the zeros it
         * put there): like a skipped MCU. On the last row those right of the
         * crop are decoded, so that the scan's end is reached as libjpeg's
         * decoder reaches it (jpeg_finish_decompress reads on from there). */
        unsigned col = (unsigned)(e->want % e->per_row);
        if (col < e->col_lo || (col > e->col_hi && e->want / e->per_row + 1 < e->rows)) {
            e->want++;
            return TRUE;
        }
    }
    if (e->want > e->mcu)
        catch_up(e, e->want);
    decode_one(e, MCU_data);
    e->want++;
    if (e->mcu == e->total)
        give_source_back(e); /* libjpeg reads on from here to the end of the file */
    return TRUE;
}

static void own_start_pass(j_decompress_ptr cinfo)
{
    /* One scan, already started when this decoder took over: a second start is
     * a file this decoder was not meant for. */
    ERREXIT(cinfo, JERR_NOT_COMPILED);
}

const char *entropy_library_layout(void)
{
    /* The library that holds jpeg_std_error is the one every call goes to
     * (the dynamic linker's choice, LD_PRELOAD included). 3.0 added lossless
     * mode, its entry points, and the entropy decoder's lossless methods. */
    Dl_info info;
    const char *layout = NULL;
    if (dladdr((void *)(uintptr_t)&jpeg_std_error, &info) && info.dli_fname != NULL) {
        void *lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
        if (lib != NULL) {
            layout = dlsym(lib, "jpeg_enable_lossless") != NULL ? "3.x" : "6b-2.x";
            dlclose(lib);
        }
    }
    return layout;
}

int entropy_supported(j_decompress_ptr cinfo)
{
    return !cinfo->progressive_mode && !cinfo->arith_code && cinfo->data_precision == 8
           && !cinfo->buffered_image && !jpeg_has_multiple_scans(cinfo)
           && cinfo->comps_in_scan >= 1 && cinfo->comps_in_scan <= MAX_COMPS_IN_SCAN
           && cinfo->blocks_in_MCU >= 1 && cinfo->blocks_in_MCU <= D_MAX_BLOCKS_IN_MCU
           && cinfo->Ss == 0 && cinfo->Se == 63 && cinfo->Ah == 0 && cinfo->Al == 0
           && cinfo->unread_marker == 0 && cinfo->MCUs_per_row > 0 && cinfo->MCU_rows_in_scan > 0;
}

static size_t entry_size(const Entropy *e)
{
    return 7 + (e->cinfo->restart_interval ? 2 : 0) + 2 * (size_t)e->ncomp;
}

static void put16(unsigned char *p, unsigned v) { p[0] = (unsigned char)v; p[1] = (unsigned char)(v >> 8); }
static void put32(unsigned char *p, uint32_t v) { put16(p, v & 0xFFFF); put16(p + 2, v >> 16); }
static unsigned get16(const unsigned char *p) { return p[0] | (unsigned)p[1] << 8; }
static uint32_t get32(const unsigned char *p) { return get16(p) | (uint32_t)get16(p + 2) << 16; }

/* Read an index; 0 (and no points) if it does not describe this scan. */
static int parse_index(Entropy *e, const unsigned char *p, size_t n, size_t scan_start)
{
    j_decompress_ptr cinfo = e->cinfo;
    if (n < INDEX_HEADER || p[0] != 'F' || p[1] != 'H' || p[2] != INDEX_VERSION
        || p[3] != e->ncomp || get32(p + 8) != e->per_row || get32(p + 12) != e->rows
        || get16(p + 16) != cinfo->restart_interval || get32(p + 18) != (uint32_t)e->size)
        return 0;
    unsigned rstride = get16(p + 4), npoints = get16(p + 6), count = get16(p + 22);
    unsigned ncols = get16(p + 24);
    if (rstride == 0 || ncols == 0 || ncols > e->per_row)
        return 0;
    if ((uint64_t)((e->rows - 1) / rstride + 1) * ncols - 1 != npoints || npoints == 0 || count == 0
        || count > npoints || n != INDEX_HEADER + count * entry_size(e))
        return 0;
    e->points = (Checkpoint *)(*cinfo->mem->alloc_small)((j_common_ptr)cinfo, JPOOL_PERMANENT,
                                                         npoints * sizeof(Checkpoint));
    const unsigned char *q = p + INDEX_HEADER;
    for (unsigned i = 0; i < count; i++) {
        Checkpoint *cp = &e->points[i];
        memset(cp, 0, sizeof *cp);
        cp->pos = get32(q);
        cp->skip = q[4] & 7;
        cp->next_restart = q[4] >> 3;
        unsigned sig = get16(q + 5);
        q += 7;
        if (cinfo->restart_interval) {
            cp->restarts_to_go = (uint16_t)get16(q);
            q += 2;
        }
        for (int c = 0; c < e->ncomp; c++, q += 2)
            cp->pred[c] = (int16_t)get16(q);
        cp->sig = (uint16_t)sig;
        if (cp->pos < scan_start || cp->pos >= e->size || cp->next_restart > 7
            || cp->restarts_to_go > cinfo->restart_interval || (i > 0 && cp->pos < e->points[i - 1].pos))
            return 0;
    }
    e->rstride = rstride;
    e->ncols = ncols;
    e->npoints = npoints;
    e->recorded = e->given = count;
    if (count < npoints)
        e->next_mcu = point_mcu(e, count);
    return 1;
}

size_t entropy_index(const Entropy *e, unsigned char *out, size_t cap)
{
    /* Whatever rows the decode passed (all of them when it read the file to
     * its end), if that is more than the index it was given. */
    if (e == NULL || e->points == NULL || e->recorded <= e->given || e->size > UINT32_MAX)
        return 0;
    size_t n = INDEX_HEADER + e->recorded * entry_size(e);
    if (out == NULL || cap < n)
        return n;
    out[0] = 'F';
    out[1] = 'H';
    out[2] = INDEX_VERSION;
    out[3] = (unsigned char)e->ncomp;
    put16(out + 4, e->rstride);
    put16(out + 6, e->npoints);
    put32(out + 8, e->per_row);
    put32(out + 12, e->rows);
    put16(out + 16, e->cinfo->restart_interval);
    put32(out + 18, (uint32_t)e->size);
    put16(out + 22, e->recorded);
    put16(out + 24, e->ncols);
    unsigned char *q = out + INDEX_HEADER;
    for (unsigned i = 0; i < e->recorded; i++) {
        const Checkpoint *cp = &e->points[i];
        put32(q, cp->pos);
        q[4] = (unsigned char)(cp->skip | cp->next_restart << 3);
        put16(q + 5, bytes_sig(e->data, e->size, cp->pos));
        q += 7;
        if (e->cinfo->restart_interval) {
            put16(q, cp->restarts_to_go);
            q += 2;
        }
        for (int c = 0; c < e->ncomp; c++, q += 2)
            put16(q, (uint16_t)cp->pred[c]);
    }
    return n;
}

void entropy_install(j_decompress_ptr cinfo, Entropy *e, const unsigned char *data, size_t size,
                     const unsigned char *index, size_t index_len, int record, unsigned max_points)
{
    memset(e, 0, sizeof *e);
    e->cinfo = cinfo;
    e->data = data;
    e->size = size;
    const unsigned char *at = cinfo->src->next_input_byte;
    if (at < data || at > data + size)
        ERREXIT(cinfo, JERR_NOT_COMPILED); /* not the memory source this decoder was given */
    e->pos = (size_t)(at - data);
    e->ncomp = cinfo->comps_in_scan;
    e->per_row = cinfo->MCUs_per_row;
    e->rows = cinfo->MCU_rows_in_scan;
    e->total = (uint64_t)e->per_row * e->rows;
    e->restarts_to_go = cinfo->restart_interval;
    const HuffTable *tables[2 * NUM_HUFF_TBLS] = {NULL};
    unsigned pinned = 0;
    for (int b = 0; b < cinfo->blocks_in_MCU; b++) {
        int ci = cinfo->MCU_membership[b];
        if (ci < 0 || ci >= e->ncomp)
            ERREXIT(cinfo, JERR_NOT_COMPILED);
        jpeg_component_info *comp = cinfo->cur_comp_info[ci];
        int dn = comp->dc_tbl_no, an = comp->ac_tbl_no;
        if (dn < 0 || dn >= NUM_HUFF_TBLS || cinfo->dc_huff_tbl_ptrs[dn] == NULL)
            ERREXIT1(cinfo, JERR_NO_HUFF_TABLE, dn);
        if (an < 0 || an >= NUM_HUFF_TBLS || cinfo->ac_huff_tbl_ptrs[an] == NULL)
            ERREXIT1(cinfo, JERR_NO_HUFF_TABLE, an);
        if (tables[dn] == NULL)
            tables[dn] = cached_table(cinfo, cinfo->dc_huff_tbl_ptrs[dn], 1, &pinned);
        if (tables[NUM_HUFF_TBLS + an] == NULL)
            tables[NUM_HUFF_TBLS + an] = cached_table(cinfo, cinfo->ac_huff_tbl_ptrs[an], 0, &pinned);
        e->member[b] = ci;
        e->dc[b] = tables[dn];
        e->ac[b] = tables[NUM_HUFF_TBLS + an];
    }
    if (index != NULL && parse_index(e, index, index_len, e->pos)) {
        e->have_index = 1;
        e->record = record && e->recorded < e->npoints; /* go on recording past its last point */
    } else if (record && max_points > 0) {
        /* The grid: every row, with as many points as one every cstride
         * columns would give, the closest that fit max_points, placed by
         * grid_col; rows every rstride with one point each (at their
         * start) when not even that fits. */
        unsigned rstride = 1, cstride = MIN_CSTRIDE;
        if (max_points > 0xFFFF)
            max_points = 0xFFFF;
        if (e->rows - 1 > max_points) {
            rstride = (e->rows - 1 + max_points - 1) / max_points;
            cstride = e->per_row;
        } else {
            while (cstride < e->per_row
                   && (uint64_t)e->rows * ((e->per_row + cstride - 1) / cstride) - 1 > max_points)
                cstride *= 2;
        }
        if (cstride > e->per_row)
            cstride = e->per_row;
        unsigned ncols = (e->per_row + cstride - 1) / cstride;
        uint64_t npoints = (uint64_t)((e->rows - 1) / rstride + 1) * ncols - 1;
        if (npoints > 0 && npoints <= 0xFFFF && rstride <= 0xFFFF && ncols <= 0xFFFF) {
            e->rstride = rstride;
            e->ncols = ncols;
            e->npoints = (unsigned)npoints;
            e->points = (Checkpoint *)(*cinfo->mem->alloc_small)(
                (j_common_ptr)cinfo, JPOOL_PERMANENT, e->npoints * sizeof(Checkpoint));
            e->next_mcu = point_mcu(e, 0);
            e->record = 1;
        }
    }
    if (cinfo->err->addon_message_table == NULL) {
        cinfo->err->addon_message_table = own_messages;
        cinfo->err->first_addon_message = OWN_MESSAGE_FIRST;
        cinfo->err->last_addon_message = OWN_MESSAGE_FIRST;
    }
    /* pub's tail stays the zeros memset wrote (see EntropyPub) */
    e->pub.start_pass = own_start_pass;
    e->pub.decode_mcu = own_decode_mcu;
    cinfo->entropy = (struct jpeg_entropy_decoder *)(void *)&e->pub;
}

void entropy_crop(j_decompress_ptr cinfo, unsigned first, unsigned last, int to_end)
{
    Entropy *e = (Entropy *)cinfo->entropy;
    /* With an index, the MCUs beside the crop are jumped over where a
     * checkpoint lets the decode. Without one they must be decoded anyway to
     * reach the next row: a decode that reads to the end of the scan
     * (to_end) decodes them as skipped ones (no coefficient stored), and so
     * judges every MCU of the file as before; one that stops after the crop
     * decodes them whole, so that damage right of its crop fails it, as
     * before. */
    e->skip_cols = (e->have_index || to_end) && first <= last && last < e->per_row
                   && (first > 0 || last + 1 < e->per_row);
    e->col_lo = first;
    e->col_hi = last;
}
