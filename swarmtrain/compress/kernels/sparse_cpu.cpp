// Fused CPU kernels for the chunked top-k sparse codec: encode and decode-accumulate.
//
// Plain C++ with an extern "C" API (called through ctypes), built into the same library as
// quant_cpu.cpp. Every result must equal swarmtrain/compress/sparse.py bit for bit (its docstring is
// the contract), hence -ffp-contract=off and no fast-math: the level math is the reference's fp32
// division, multiply and add, one rounding each.
//
// Magnitudes are compared as u = bits(|x|) (uint32): for non-negative IEEE floats the bit order is the
// value order, and NaN/Inf sit above every finite value. Encode, per chunk of `len` values, kc kept:
//   1. a sample of 256 magnitudes (16 evenly spaced runs of 16) gives a threshold t that about 2-4x kc
//      values reach;
//   2. one vector pass turns u > t into a bit mask (and takes max u, which flags NaN/Inf), a second
//      walks the set bits: the candidates, in ascending offset;
//   3. counting passes narrow the kc-th largest candidate u_k to a small bucket, which is then ordered
//      exactly; kept = every u > u_k plus the lowest offsets with u == u_k (the reference's tie rule),
//      still in ascending offset. With fewer than kc candidates but enough values equal to t, u_k = t:
//      kept = the candidates plus the first values equal to t (a chunk of zeros costs no selection);
//   4. bf16 scales (round to nearest even on the bit pattern), level codes, bit packing.
// If fewer than kc values reach t, the same runs with t = 0: the sample decides how much work the
// exact selection does, never which values are kept. Counting passes are branch-free; a sort of the
// candidates would mispredict on most comparisons. Without AVX-512 the same steps run as plain loops
// (same results, slower).
//
// Decode checks the whole body before it touches `out`, then adds chunk by chunk, prefetching the
// lines the next chunk will add into.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
// GCC 12's AVX-512 reductions start from _mm*_undefined_*(), written as a self-initialized local
// (`__m512i __Y = __Y;`), which -Wuninitialized flags wherever they inline. Nothing here reads an
// undefined lane; the warning is the header's, so it is silenced for this file only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace {

enum Status : int {  // mirrors KernelStatus in common.py
  kOk = 0,
  kNonFinite = 1,       // NaN or Inf in the input of an encode
  kBadScale = 4,        // a chunk's scales are NaN/Inf or negative, or lo > hi
  kBadOffset = 8,       // an offset not below its chunk's length, or not strictly ascending
  kBadPadding = 16,     // a padding bit after a chunk's codes or offsets is set
  kScaleOverflow = 32,  // a kept magnitude rounds to Inf in bfloat16
};

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;
constexpr uint32_t kBf16Inf = 0x7f80u;
constexpr int64_t kSamples = 256;

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// fp32 bits (finite, non-negative) -> bf16 bits, to nearest, ties to even; kBf16Inf means it overflowed.
inline uint32_t bf16_rne(uint32_t u) { return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; }

inline float bf16_float(uint32_t h) { return float_of(h << 16); }

inline bool go_parallel(int threads, int64_t n) { return threads > 1 && n >= (int64_t{1} << 15); }

// Where everything sits in a body (sparse.sparse_layout).
struct Shape {
  int64_t n, chunk, k, bits, width, nchunks, code_stride, offset_stride, codes_at, offsets_at;

  Shape(int64_t n_, int chunk_, int k_, int bits_) : n(n_), chunk(chunk_), k(k_), bits(bits_) {
    width = 1;
    while ((int64_t{1} << width) < chunk) ++width;  // the bit length of chunk - 1, at least 1
    nchunks = (n + chunk - 1) / chunk;
    code_stride = (k * bits + 7) / 8;
    offset_stride = (k * width + 7) / 8;
    codes_at = 4 * nchunks;
    offsets_at = codes_at;
    if (nchunks > 0) offsets_at += (nchunks - 1) * code_stride + (kept(nchunks - 1) * bits + 7) / 8;
  }
  int64_t len(int64_t c) const { return c + 1 < nchunks ? chunk : n - c * chunk; }
  int64_t kept(int64_t c) const {
    const int64_t r = len(c);
    return std::min(r, (k * r + chunk - 1) / chunk);
  }
  template <typename Byte>
  Byte* codes(Byte* body, int64_t c) const { return body + codes_at + c * code_stride; }
  template <typename Byte>
  Byte* offsets(Byte* body, int64_t c) const { return body + offsets_at + c * offset_stride; }
};

// m values of `width` (<= 16) bits, LSB first, into exactly ceil(m * width / 8) bytes, zero-padded.
void pack_bits(const uint32_t* __restrict v, int64_t m, int width, uint8_t* __restrict dst) {
  uint64_t acc = 0;
  int nbits = 0;
  for (int64_t i = 0; i < m; ++i) {
    acc |= uint64_t{v[i]} << nbits;
    nbits += width;
    if (nbits >= 32) {
      for (int b = 0; b < 4; ++b) dst[b] = static_cast<uint8_t>(acc >> (8 * b));
      dst += 4;
      acc >>= 32;
      nbits -= 32;
    }
  }
  for (; nbits > 0; nbits -= 8, acc >>= 8) *dst++ = static_cast<uint8_t>(acc);
}

// The inverse of pack_bits; reads only the ceil(m * width / 8) bytes the values occupy.
void unpack_bits(const uint8_t* __restrict src, int64_t m, int width, uint32_t* __restrict v) {
  const uint32_t mask = (1u << width) - 1u;
  uint64_t acc = 0;
  int nbits = 0;
  for (int64_t i = 0; i < m; ++i) {
    while (nbits < width) {
      acc |= uint64_t{*src++} << nbits;
      nbits += 8;
    }
    v[i] = static_cast<uint32_t>(acc) & mask;
    acc >>= width;
    nbits -= width;
  }
}

// The bits after m values of `width` bits in their last byte are zero.
inline bool padding_clear(const uint8_t* src, int64_t m, int width) {
  const int64_t used = m * width;
  return used % 8 == 0 || (src[used / 8] >> (used % 8)) == 0;
}

inline int64_t count_ge(const uint32_t* __restrict v, int64_t m, uint32_t t) {
  uint32_t c = 0;  // a 32-bit count: the loop vectorizes
  for (int64_t i = 0; i < m; ++i) c += v[i] >= t ? 1u : 0u;
  return c;
}

// c[j] = how many of v[0, m) are >= t[j], j < 3.
inline void count3_ge(const uint32_t* __restrict v, int64_t m, const uint32_t* t, int64_t* c) {
  int64_t i = 0;
  c[0] = c[1] = c[2] = 0;
#if defined(__AVX512F__)
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i t0 = _mm512_set1_epi32(static_cast<int>(t[0]));
  const __m512i t1 = _mm512_set1_epi32(static_cast<int>(t[1]));
  const __m512i t2 = _mm512_set1_epi32(static_cast<int>(t[2]));
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0;
  for (; i < m; i += 16) {
    const __mmask16 live = m - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (m - i)) - 1u);
    const __m512i u = _mm512_maskz_loadu_epi32(live, v + i);
    a0 = _mm512_mask_add_epi32(a0, _mm512_mask_cmpge_epu32_mask(live, u, t0), a0, one);
    a1 = _mm512_mask_add_epi32(a1, _mm512_mask_cmpge_epu32_mask(live, u, t1), a1, one);
    a2 = _mm512_mask_add_epi32(a2, _mm512_mask_cmpge_epu32_mask(live, u, t2), a2, one);
  }
  c[0] = _mm512_reduce_add_epi32(a0);
  c[1] = _mm512_reduce_add_epi32(a1);
  c[2] = _mm512_reduce_add_epi32(a2);
#endif
  for (; i < m; ++i) {
    c[0] += v[i] >= t[0];
    c[1] += v[i] >= t[1];
    c[2] += v[i] >= t[2];
  }
}

// The largest T with at least `need` of v[0, m) >= T, given that `base` is such a T and that the
// answer differs from it only in bits [low, high]: two bits per pass (three independent counts).
uint32_t search_ge(const uint32_t* v, int64_t m, int64_t need, uint32_t base, int high, int low) {
  uint32_t t = base;
  int b = high;
  for (; b > low; b -= 2) {
    const uint32_t cand[3] = {t | (1u << (b - 1)), t | (2u << (b - 1)), t | (3u << (b - 1))};
    int64_t c[3];
    count3_ge(v, m, cand, c);
    t |= static_cast<uint32_t>((c[0] >= need) + (c[1] >= need) + (c[2] >= need)) << (b - 1);
  }
  if (b == low && count_ge(v, m, t | (1u << b)) >= need) t |= 1u << b;
  return t;
}

// A threshold about 2-4x kc of the len values reach (0: take them all), from a sample of 16 evenly
// spaced runs of 16 values, to 12 significant bits (exponent and 4 mantissa bits).
uint32_t sample_threshold(const float* x, int64_t len, int64_t kc, uint32_t* tmp) {
  if (len < 4 * kSamples) return 0;
  const double expect = static_cast<double>(kc) * kSamples / static_cast<double>(len);
  const int64_t r = static_cast<int64_t>(std::ceil(expect + 2.0 * std::sqrt(expect) + 3.0));
  if (r >= kSamples) return 0;
  const int64_t stride = len / 16;
  for (int64_t run = 0; run < 16; ++run) {
    for (int64_t i = 0; i < 16; ++i) tmp[16 * run + i] = bits_of(x[run * stride + i]) & kAbsMask;
  }
  return search_ge(tmp, kSamples, r, 0, 30, 19);
}

struct Scratch {  // per thread; ci has room for the walk in collect() to write 8 slots past its count
  std::vector<uint32_t> cu, ci, sel, kept, codes;
  std::vector<uint64_t> words;
  explicit Scratch(int64_t chunk)
      : cu(chunk + 16), ci(chunk + 64), sel(chunk + 16), kept(chunk + 16), codes(chunk + 16),
        words(chunk / 64 + 1) {}
};

// dst <- val[c] for every c < cnt with lo <= key[c] < hi, in order; returns how many (dst holds cnt + 16).
int64_t pick_in(const uint32_t* __restrict key, const uint32_t* __restrict val, int64_t cnt, uint32_t lo,
                uint32_t hi, uint32_t* __restrict dst) {
  int64_t m = 0, c = 0;
#if defined(__AVX512F__)
  const __m512i vlo = _mm512_set1_epi32(static_cast<int>(lo)), vhi = _mm512_set1_epi32(static_cast<int>(hi));
  for (; c < cnt; c += 16) {
    const __mmask16 live = cnt - c >= 16 ? 0xffff : static_cast<__mmask16>((1u << (cnt - c)) - 1u);
    const __m512i k = _mm512_maskz_loadu_epi32(live, key + c);
    const __mmask16 in = _mm512_mask_cmplt_epu32_mask(_mm512_mask_cmpge_epu32_mask(live, k, vlo), k, vhi);
    _mm512_storeu_si512(dst + m, _mm512_maskz_compress_epi32(in, _mm512_maskz_loadu_epi32(live, val + c)));
    m += __builtin_popcount(static_cast<unsigned>(in));
  }
#endif
  for (; c < cnt; ++c) {
    dst[m] = val[c];
    m += (key[c] >= lo) & (key[c] < hi);
  }
  return m;
}

// Candidates u > t in ascending offset: offsets into s.ci, u into s.cu; returns their number and sets
// *umax = max u over the chunk. Prefetches `next` (as long as x, or x itself) into L2, half of it in
// each pass: a burst of a whole chunk's prefetches overruns the outstanding misses the core can track.
int64_t collect(const float* __restrict x, int64_t len, uint32_t t, [[maybe_unused]] const float* next, Scratch& s,
                uint32_t* umax) {
  uint32_t* __restrict ci = s.ci.data();
  int64_t c = 0, i = 0;
  uint32_t mx = 0;
#if defined(__AVX512F__)
  // First only compare (a mask per 64 values), then walk the set bits: at a few % of candidates that
  // beats storing a compressed vector per 16 values.
  const __m512i vt = _mm512_set1_epi32(static_cast<int>(t));
  const __m512i abs_mask = _mm512_set1_epi32(static_cast<int>(kAbsMask));
  __m512i vmax = _mm512_setzero_si512();
  uint64_t* __restrict words = s.words.data();
  const int64_t nwords = len / 64;
  for (int64_t q = 0; q < nwords; ++q) {
    __builtin_prefetch(next + 32 * q, 0, 2);
    __builtin_prefetch(next + 32 * q + 16, 0, 2);
    uint64_t word = 0;
    for (int j = 0; j < 4; ++j) {
      const __m512i u = _mm512_and_si512(_mm512_loadu_si512(x + 64 * q + 16 * j), abs_mask);
      vmax = _mm512_max_epu32(vmax, u);
      word |= uint64_t{_mm512_cmpgt_epu32_mask(u, vt)} << (16 * j);
    }
    words[q] = word;
  }
  // Eight set bits per word unconditionally (slots past the word's count are overwritten next), the
  // rest in a loop that rarely runs: no branch per word to mispredict.
  for (int64_t q = 0; q < nwords; ++q) {
    __builtin_prefetch(next + 32 * (nwords + q), 0, 2);
    __builtin_prefetch(next + 32 * (nwords + q) + 16, 0, 2);
    uint64_t word = words[q];
    const int bits = __builtin_popcountll(word);
    const uint32_t at = static_cast<uint32_t>(64 * q);
    uint32_t* out = ci + c;
    for (int j = 0; j < 8; ++j) {
      out[j] = at + static_cast<uint32_t>(__builtin_ctzll(word | (uint64_t{1} << 63)));
      word &= word - 1;
    }
    for (int j = 8; j < bits; ++j) {
      out[j] = at + static_cast<uint32_t>(__builtin_ctzll(word));
      word &= word - 1;
    }
    c += bits;
  }
  mx = _mm512_reduce_max_epu32(vmax);
  i = 64 * nwords;
#endif
  for (; i < len; ++i) {  // branch-free: a candidate's slot is kept by advancing c
    const uint32_t u = bits_of(x[i]) & kAbsMask;
    mx = u > mx ? u : mx;
    ci[c] = static_cast<uint32_t>(i);
    c += u > t;
  }
  for (int64_t j = 0; j < c; ++j) s.cu[j] = bits_of(x[ci[j]]) & kAbsMask;
  *umax = mx;
  return c;
}

// The kc-th largest of the cnt >= kc candidates, all in (t, umax]. Counting passes narrow it to a
// bucket [base, end) of at most kBucket candidates (or of one or two values), which is then ordered.
uint32_t kth_largest(Scratch& s, int64_t cnt, int64_t kc, uint32_t t, uint32_t umax) {
  constexpr int64_t kBucket = 16;
  const uint32_t* cu = s.cu.data();
  int b = 31 - __builtin_clz(t ^ umax);  // the candidates share every bit above b: bits [0, b] are open
  uint32_t base = umax & ~((2u << b) - 1u);
  int64_t from_base = cnt, from_end = 0;  // how many are >= base and >= end = base + 2^(b+1)
  while (b >= 1 && from_base - from_end > kBucket) {
    const uint32_t cand[3] = {base | (1u << (b - 1)), base | (2u << (b - 1)), base | (3u << (b - 1))};
    int64_t c[3];
    count3_ge(cu, cnt, cand, c);
    const int j = (c[0] >= kc) + (c[1] >= kc) + (c[2] >= kc);  // counts fall as j grows
    from_base = j == 0 ? from_base : c[j - 1];
    from_end = j == 3 ? from_end : c[j];
    base |= static_cast<uint32_t>(j) << (b - 1);
    b -= 2;
  }
  if (b < 0) return base;
  const uint32_t end = base + (2u << b);
  const int64_t need = kc - from_end;
  const int64_t m = pick_in(cu, cu, cnt, base, end, s.sel.data());
  std::nth_element(s.sel.begin(), s.sel.begin() + (need - 1), s.sel.begin() + m, std::greater<uint32_t>());
  return s.sel[need - 1];
}

// s.kept <- the ascending offsets of the kc largest keys among the candidates; returns the smallest
// kept u.
uint32_t select_exact(Scratch& s, int64_t cnt, int64_t kc, uint32_t t, uint32_t umax) {
  const uint32_t uk = kth_largest(s, cnt, kc, t, umax);
  const uint32_t* cu = s.cu.data();
  const uint32_t* ci = s.ci.data();
  uint32_t* kept = s.kept.data();
  const int64_t above = count_ge(cu, cnt, uk + 1);
  int64_t ties = kc - above;  // values equal to uk that fit: the lowest offsets
  if (count_ge(cu, cnt, uk) - above == ties) {
    pick_in(cu, ci, cnt, uk, kInfBits, kept);  // every candidate is finite: u < kInfBits
    return uk;
  }
  int64_t m = 0;
  for (int64_t c = 0; c < cnt; ++c) {
    const int64_t eq = cu[c] == uk;
    const int64_t take = (cu[c] > uk) | (eq & (ties > 0));
    ties -= eq & take;
    kept[m] = ci[c];
    m += take;
  }
  return uk;
}

inline int64_t count_eq(const float* __restrict x, int64_t len, uint32_t t) {
  uint32_t c = 0;  // a 32-bit count: the loop vectorizes
  for (int64_t i = 0; i < len; ++i) c += (bits_of(x[i]) & kAbsMask) == t ? 1u : 0u;
  return c;
}

// When fewer than kc values are > t but at least kc are >= t: s.kept <- the cnt candidates (u > t)
// merged with the first kc - cnt offsets where u == t. Returns t, the smallest kept u.
uint32_t keep_ties(const float* __restrict x, int64_t len, uint32_t t, Scratch& s, int64_t cnt, int64_t kc) {
  uint32_t* __restrict ties = s.sel.data();
  int64_t m = 0;
  for (int64_t i = 0; i < len && m < kc - cnt; ++i) {
    ties[m] = static_cast<uint32_t>(i);
    m += (bits_of(x[i]) & kAbsMask) == t;
  }
  const uint32_t* ci = s.ci.data();
  uint32_t* kept = s.kept.data();
  int64_t a = 0, b = 0;
  for (int64_t j = 0; j < kc; ++j) {  // two ascending lists of distinct offsets
    const bool from_ci = b == m || (a < cnt && ci[a] < ties[b]);
    kept[j] = from_ci ? ci[a++] : ties[b++];
  }
  return t;
}

// codes[i] = sign << (bits - 1) | j for the kept values, j = floor((|x| - lo) / step) in [0, L-1].
void level_codes(const float* __restrict xc, const uint32_t* __restrict kept, int64_t kc, float lo,
                 float step, int bits, uint32_t* __restrict codes) {
  const float top = static_cast<float>((1 << (bits - 1)) - 1);
  const int sign_at = bits - 1;
  if (!(step > 0.0f)) {
    for (int64_t i = 0; i < kc; ++i) codes[i] = static_cast<uint32_t>(xc[kept[i]] < 0.0f) << sign_at;
    return;
  }
  for (int64_t i = 0; i < kc; ++i) {
    const float v = xc[kept[i]];
    float j = __builtin_floorf((__builtin_fabsf(v) - lo) / step);
    j = j < 0.0f ? 0.0f : j;
    j = j > top ? top : j;
    codes[i] = (static_cast<uint32_t>(v < 0.0f) << sign_at) | static_cast<uint32_t>(j);
  }
}

int encode_chunk(const float* x, const Shape& sh, int64_t c, uint8_t* body, Scratch& s) {
  const int64_t len = sh.len(c), kc = sh.kept(c);
  const float* xc = x + c * sh.chunk;
  const float* next = (c + 1 < sh.nchunks && sh.len(c + 1) == len) ? xc + len : xc;
  uint32_t t = sample_threshold(xc, len, kc, s.sel.data());
  uint32_t umax = 0;
  int64_t cnt = collect(xc, len, t, next, s, &umax);
  if (umax >= kInfBits) return kNonFinite;
  if (cnt < kc && cnt + count_eq(xc, len, t) < kc) {  // the sample misjudged: count(u >= 0) = len >= kc
    t = 0;
    cnt = collect(xc, len, t, next, s, &umax);
  }
  const uint32_t uk = cnt >= kc ? select_exact(s, cnt, kc, t, umax) : keep_ties(xc, len, t, s, cnt, kc);
  const uint32_t lo16 = bf16_rne(uk), hi16 = bf16_rne(umax);
  if (hi16 >= kBf16Inf) return kScaleOverflow;  // lo <= hi: lo is finite too
  const uint8_t scales[4] = {static_cast<uint8_t>(lo16), static_cast<uint8_t>(lo16 >> 8),
                             static_cast<uint8_t>(hi16), static_cast<uint8_t>(hi16 >> 8)};
  std::memcpy(body + 4 * c, scales, 4);
  const float lo = bf16_float(lo16), hi = bf16_float(hi16);
  const int bits = static_cast<int>(sh.bits);
  const float step = (hi - lo) / static_cast<float>(1 << (bits - 1));
  level_codes(xc, s.kept.data(), kc, lo, step, bits, s.codes.data());
  pack_bits(s.codes.data(), kc, bits, sh.codes(body, c));
  pack_bits(s.kept.data(), kc, static_cast<int>(sh.width), sh.offsets(body, c));
  return kOk;
}

inline void chunk_scales(const uint8_t* body, int64_t c, float* lo, float* hi) {
  const uint8_t* p = body + 4 * c;
  *lo = bf16_float(uint32_t{p[0]} | (uint32_t{p[1]} << 8));
  *hi = bf16_float(uint32_t{p[2]} | (uint32_t{p[3]} << 8));
}

int check_chunk(const uint8_t* body, const Shape& sh, int64_t c, uint32_t* offsets) {
  const int64_t len = sh.len(c), kc = sh.kept(c);
  float lo, hi;
  chunk_scales(body, c, &lo, &hi);
  if (!(std::isfinite(lo) && std::isfinite(hi)) || lo < 0.0f || lo > hi) return kBadScale;
  const int width = static_cast<int>(sh.width), bits = static_cast<int>(sh.bits);
  int st = kOk;
  if (!padding_clear(sh.offsets(body, c), kc, width) || !padding_clear(sh.codes(body, c), kc, bits)) {
    st |= kBadPadding;
  }
  unpack_bits(sh.offsets(body, c), kc, width, offsets);
  uint32_t bad = offsets[kc - 1] >= len;
  for (int64_t i = 1; i < kc; ++i) bad |= offsets[i] <= offsets[i - 1];
  return bad ? st | kBadOffset : st;
}

// Adds chunk c into out; its offsets are already in `offsets`.
void accumulate_chunk(const uint8_t* body, const Shape& sh, int64_t c, const uint32_t* offsets,
                      uint32_t* codes, float* out) {
  const int64_t kc = sh.kept(c);
  const int bits = static_cast<int>(sh.bits);
  float lo, hi;
  chunk_scales(body, c, &lo, &hi);
  unpack_bits(sh.codes(body, c), kc, bits, codes);
  const uint32_t jmask = (1u << (bits - 1)) - 1u;
  const float step = (hi - lo) / static_cast<float>(1 << (bits - 1));
  float* __restrict oc = out + c * sh.chunk;
  for (int64_t i = 0; i < kc; ++i) {
    float mag = step * (static_cast<float>(codes[i] & jmask) + 0.5f);
    mag = mag + lo;
    oc[offsets[i]] = oc[offsets[i]] + ((codes[i] >> (bits - 1)) ? -mag : mag);
  }
}

// Chunks [c0, c1): unpack the next chunk's offsets and prefetch its targets before adding this one.
void accumulate_range(const uint8_t* body, const Shape& sh, int64_t c0, int64_t c1, float* out) {
  if (c0 >= c1) return;
  std::vector<uint32_t> here(sh.k + 1), ahead(sh.k + 1), codes(sh.k + 1);
  const int width = static_cast<int>(sh.width);
  unpack_bits(sh.offsets(body, c0), sh.kept(c0), width, here.data());
  for (int64_t c = c0; c < c1; ++c) {
    if (c + 1 < c1) {
      const int64_t kn = sh.kept(c + 1);
      unpack_bits(sh.offsets(body, c + 1), kn, width, ahead.data());
      const float* on = out + (c + 1) * sh.chunk;
      // Into L2 and without write intent: measured faster than into L1 or with it.
      for (int64_t i = 0; i < kn; ++i) __builtin_prefetch(on + ahead[i], 0, 2);
    }
    accumulate_chunk(body, sh, c, here.data(), codes.data(), out);
    std::swap(here, ahead);
  }
}

}  // namespace

extern "C" {

// body: scales | codes | offsets as sparse_layout lays them out, every byte written. Returns a Status.
int st_sparse_encode(const float* x, int64_t n, int chunk, int k, int bits, uint8_t* body, int threads) {
  const Shape sh(n, chunk, k, bits);
  int st = kOk;
#pragma omp parallel num_threads(threads) if (go_parallel(threads, n)) reduction(| : st)
  {
    Scratch scratch(chunk);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < sh.nchunks; ++c) st |= encode_chunk(x, sh, c, body, scratch);
  }
  return (st & kNonFinite) ? kNonFinite : st;
}

// out[chunk start + offset] = out[...] + (±level). The whole body is checked before `out` is touched.
int st_sparse_decode(const uint8_t* body, int64_t n, int chunk, int k, int bits, float* out, int threads) {
  const Shape sh(n, chunk, k, bits);
  int st = kOk;
#pragma omp parallel num_threads(threads) if (go_parallel(threads, n)) reduction(| : st)
  {
    std::vector<uint32_t> offsets(k + 1);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < sh.nchunks; ++c) st |= check_chunk(body, sh, c, offsets.data());
  }
  if (st != kOk) return st;
#pragma omp parallel num_threads(threads) if (go_parallel(threads, n))
  {
    const int64_t nt = omp_get_num_threads(), per = (sh.nchunks + nt - 1) / nt;
    const int64_t c0 = std::min(sh.nchunks, omp_get_thread_num() * per);
    accumulate_range(body, sh, c0, std::min(sh.nchunks, c0 + per), out);
  }
  return kOk;
}

}  // extern "C"
