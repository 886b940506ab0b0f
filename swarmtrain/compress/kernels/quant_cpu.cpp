// Fused CPU codec kernels: blockwise absmax int8/int4 encode, decode, decode-accumulate.
//
// Plain C++ with an extern "C" API (called through ctypes), no torch headers, so it builds in
// seconds. Every result must equal swarmtrain/compress/quant.py bit for bit, hence:
//   * build with -ffp-contract=off and without -ffast-math (no FMA, IEEE division, rint = RNE);
//   * absmax is an integer max over |x|'s bit pattern: for non-negative IEEE floats the bit order
//     is the value order, NaN/Inf compare above every finite value, and integer max vectorizes
//     without fast-math. One pass over the block gives both absmax and "saw a NaN/Inf".
// Each block is read twice (absmax, then quantize) while it sits in L1/L2.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Status : int {
  kOk = 0,
  kNonFinite = 1,       // NaN or Inf in the input of an encode
  kFp16Overflow = 2,    // a block scale does not fit fp16
  kBadScale = 4,        // a decode got a NaN/Inf or negative scale
};

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;

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

inline uint16_t half_bits(_Float16 h) {
  uint16_t u;
  std::memcpy(&u, &h, sizeof u);
  return u;
}

inline _Float16 half_of(uint16_t u) {
  _Float16 h;
  std::memcpy(&h, &u, sizeof h);
  return h;
}

// max over bits(|x_i|); a result >= kInfBits means the block holds a NaN or an Inf.
inline uint32_t absmax_bits(const float* __restrict x, int64_t len) {
  uint32_t m = 0;
  for (int64_t i = 0; i < len; ++i) {
    uint32_t v = bits_of(x[i]) & kAbsMask;
    m = v > m ? v : m;
  }
  return m;
}

// The scale a block is quantized with, as the decoder will see it. Returns kFp16Overflow if an fp16
// scale cannot hold it. fp16 scales round up so that |x / scale| <= qmax still holds.
inline int block_scale(uint32_t amax_bits, float qmax, bool fp16, float* scale, uint16_t* scale16) {
  float s = float_of(amax_bits) / qmax;
  if (fp16) {
    _Float16 h = static_cast<_Float16>(s);
    uint16_t hb = half_bits(h);
    if (static_cast<float>(h) < s) hb = static_cast<uint16_t>(hb + 1);  // next fp16 up (s >= 0)
    if ((hb & 0x7fffu) >= 0x7c00u) return kFp16Overflow;
    *scale16 = hb;
    s = static_cast<float>(half_of(hb));
  }
  *scale = s;
  return kOk;
}

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Quantizes x[0, len) (global index `base`) with one scale into q (|q| <= qmax).
inline void quantize_run(const float* __restrict x, int64_t len, float s, float qmax, bool stochastic,
                         uint64_t seed, int64_t base, int8_t* __restrict q) {
  if (s == 0.0f) {
    std::memset(q, 0, static_cast<size_t>(len));
    return;
  }
  if (!stochastic) {
    for (int64_t i = 0; i < len; ++i) {
      float v = __builtin_rintf(x[i] / s);
      v = v < -qmax ? -qmax : v;
      v = v > qmax ? qmax : v;
      q[i] = static_cast<int8_t>(static_cast<int32_t>(v));
    }
    return;
  }
  // u_i is a hash of (seed, global index i): independent of threads and of the block layout.
  const uint64_t first = static_cast<uint64_t>(base);
  const uint64_t wrap = (first | 0xffffffffull) + 1;  // a run never crosses a 2^32 boundary of i
  if (first + static_cast<uint64_t>(len) > wrap) {
    const int64_t head = static_cast<int64_t>(wrap - first);
    quantize_run(x, head, s, qmax, stochastic, seed, base, q);
    quantize_run(x + head, len - head, s, qmax, stochastic, seed, base + head, q + head);
    return;
  }
  const uint32_t key = static_cast<uint32_t>(seed) ^ mix32(static_cast<uint32_t>(first >> 32) + static_cast<uint32_t>(seed >> 32));
  const uint32_t lo = static_cast<uint32_t>(first);
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t h = mix32((lo + static_cast<uint32_t>(i)) * 0x9e3779b9u ^ key);
    const float u = static_cast<float>(static_cast<int32_t>(h >> 8)) * (1.0f / 16777216.0f);
    float v = __builtin_floorf(x[i] / s + u);
    v = v < -qmax ? -qmax : v;
    v = v > qmax ? qmax : v;
    q[i] = static_cast<int8_t>(static_cast<int32_t>(v));
  }
}

inline void store_scale(void* scales, bool fp16, int64_t b, float s, uint16_t s16) {
  if (fp16) {
    static_cast<uint16_t*>(scales)[b] = s16;
  } else {
    static_cast<float*>(scales)[b] = s;
  }
}

// Encodes block b of x; int8 values land in q8 (q8 == nullptr: int4, packed into p4 in chunks).
int encode_block(const float* x, int64_t n, int64_t bs, int64_t b, float qmax, bool fp16, bool stochastic,
                 uint64_t seed, int8_t* q8, uint8_t* p4, void* scales) {
  const int64_t start = b * bs;
  const int64_t len = (start + bs <= n) ? bs : n - start;
  const uint32_t am = absmax_bits(x + start, len);
  if (am >= kInfBits) return kNonFinite;
  float s = 0.0f;
  uint16_t s16 = 0;
  if (int st = block_scale(am, qmax, fp16, &s, &s16)) return st;
  store_scale(scales, fp16, b, s, s16);
  if (q8 != nullptr) {
    quantize_run(x + start, len, s, qmax, stochastic, seed, start, q8 + start);
    return kOk;
  }
  // int4 with an even block start: pack pairs through a small buffer that stays in L1.
  constexpr int64_t kChunk = 1024;
  int8_t tmp[kChunk];
  for (int64_t c = 0; c < len; c += kChunk) {
    const int64_t m = (len - c < kChunk) ? len - c : kChunk;
    quantize_run(x + start + c, m, s, qmax, stochastic, seed, start + c, tmp);
    uint8_t* out = p4 + (start + c) / 2;
    const int64_t pairs = m / 2;
    for (int64_t j = 0; j < pairs; ++j) {
      out[j] = static_cast<uint8_t>((tmp[2 * j] + 8) | ((tmp[2 * j + 1] + 8) << 4));
    }
    if (m & 1) out[pairs] = static_cast<uint8_t>((tmp[m - 1] + 8) | (8 << 4));  // only the last element of x
  }
  return kOk;
}

int check_scales(const void* scales, bool fp16, int64_t nblocks) {
  int bad = 0;
  if (fp16) {
    const uint16_t* s = static_cast<const uint16_t*>(scales);
    for (int64_t b = 0; b < nblocks; ++b) bad |= ((s[b] & 0x7fffu) >= 0x7c00u) | (s[b] > 0x8000u);
  } else {
    const uint32_t* s = static_cast<const uint32_t*>(scales);
    for (int64_t b = 0; b < nblocks; ++b) bad |= ((s[b] & kAbsMask) >= kInfBits) | (s[b] > 0x80000000u);
  }
  return bad ? kBadScale : kOk;
}

inline float scale_at(const void* scales, bool fp16, int64_t b) {
  if (fp16) return static_cast<float>(half_of(static_cast<const uint16_t*>(scales)[b]));
  return static_cast<const float*>(scales)[b];
}

inline int64_t num_blocks(int64_t n, int64_t bs) { return (n + bs - 1) / bs; }

inline bool go_parallel(int threads, int64_t n) { return threads > 1 && n >= (int64_t{1} << 15); }

}  // namespace

extern "C" {

// q: int8[n]; scales: fp32 or fp16 bits [ceil(n/bs)]. Returns a Status.
int st_int8_encode(const float* x, int64_t n, int64_t bs, int fp16_scales, int stochastic, uint64_t seed,
                   int8_t* q, void* scales, int threads) {
  const int64_t nb = num_blocks(n, bs);
  int st = kOk;
#pragma omp parallel for schedule(static) num_threads(threads) if (go_parallel(threads, n)) reduction(| : st)
  for (int64_t b = 0; b < nb; ++b) {
    st |= encode_block(x, n, bs, b, 127.0f, fp16_scales != 0, stochastic != 0, seed, q, nullptr, scales);
  }
  return (st & kNonFinite) ? kNonFinite : st;
}

// packed: uint8[ceil(n/2)], element 2j in the low nibble of byte j, 2j+1 in the high one; value + 8.
int st_int4_encode(const float* x, int64_t n, int64_t bs, int fp16_scales, int stochastic, uint64_t seed,
                   uint8_t* packed, void* scales, int threads) {
  const int64_t nb = num_blocks(n, bs);
  const bool fp16 = fp16_scales != 0;
  int st = kOk;
  if (bs % 2 == 0) {
#pragma omp parallel for schedule(static) num_threads(threads) if (go_parallel(threads, n)) reduction(| : st)
    for (int64_t b = 0; b < nb; ++b) {
      st |= encode_block(x, n, bs, b, 7.0f, fp16, stochastic != 0, seed, nullptr, packed, scales);
    }
    return (st & kNonFinite) ? kNonFinite : st;
  }
  // Odd block size: a byte may straddle two blocks; quantize everything, then pack.
  std::vector<int8_t> q(static_cast<size_t>(n));
#pragma omp parallel for schedule(static) num_threads(threads) if (go_parallel(threads, n)) reduction(| : st)
  for (int64_t b = 0; b < nb; ++b) {
    st |= encode_block(x, n, bs, b, 7.0f, fp16, stochastic != 0, seed, q.data(), nullptr, scales);
  }
  if (st != kOk) return (st & kNonFinite) ? kNonFinite : st;
  const int64_t nbytes = (n + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (go_parallel(threads, n))
  for (int64_t j = 0; j < nbytes; ++j) {
    const int lo = q[2 * j] + 8;
    const int hi = (2 * j + 1 < n) ? q[2 * j + 1] + 8 : 8;
    packed[j] = static_cast<uint8_t>(lo | (hi << 4));
  }
  return kOk;
}

// out[i] (+)= float(q[i]) * scale[i / bs]. Scales are checked before `out` is touched.
int st_int8_decode(const int8_t* q, int64_t n, int64_t bs, const void* scales, int fp16_scales, float* out,
                   int accumulate, int threads) {
  const int64_t nb = num_blocks(n, bs);
  const bool fp16 = fp16_scales != 0;
  if (int st = check_scales(scales, fp16, nb)) return st;
#pragma omp parallel for schedule(static) num_threads(threads) if (go_parallel(threads, n))
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t start = b * bs;
    const int64_t len = (start + bs <= n) ? bs : n - start;
    const float s = scale_at(scales, fp16, b);
    const int8_t* __restrict qb = q + start;
    float* __restrict ob = out + start;
    if (accumulate) {
      for (int64_t i = 0; i < len; ++i) ob[i] += static_cast<float>(qb[i]) * s;
    } else {
      for (int64_t i = 0; i < len; ++i) ob[i] = static_cast<float>(qb[i]) * s;
    }
  }
  return kOk;
}

int st_int4_decode(const uint8_t* packed, int64_t n, int64_t bs, const void* scales, int fp16_scales,
                   float* out, int accumulate, int threads) {
  const int64_t nb = num_blocks(n, bs);
  const bool fp16 = fp16_scales != 0;
  if (int st = check_scales(scales, fp16, nb)) return st;
#pragma omp parallel for schedule(static) num_threads(threads) if (go_parallel(threads, n))
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t start = b * bs;
    const int64_t len = (start + bs <= n) ? bs : n - start;
    const float s = scale_at(scales, fp16, b);
    float* __restrict ob = out + start;
    if (start % 2 == 0) {
      const uint8_t* __restrict pb = packed + start / 2;
      const int64_t pairs = len / 2;
      if (accumulate) {
        for (int64_t j = 0; j < pairs; ++j) {
          ob[2 * j] += static_cast<float>((pb[j] & 15) - 8) * s;
          ob[2 * j + 1] += static_cast<float>((pb[j] >> 4) - 8) * s;
        }
      } else {
        for (int64_t j = 0; j < pairs; ++j) {
          ob[2 * j] = static_cast<float>((pb[j] & 15) - 8) * s;
          ob[2 * j + 1] = static_cast<float>((pb[j] >> 4) - 8) * s;
        }
      }
      if (len & 1) {
        const float v = static_cast<float>((pb[pairs] & 15) - 8) * s;
        ob[len - 1] = accumulate ? ob[len - 1] + v : v;
      }
      continue;
    }
    for (int64_t i = 0; i < len; ++i) {  // odd block start (odd block size): element by element
      const int64_t g = start + i;
      const int nib = (g & 1) ? (packed[g >> 1] >> 4) : (packed[g >> 1] & 15);
      const float v = static_cast<float>(nib - 8) * s;
      ob[i] = accumulate ? ob[i] + v : v;
    }
  }
  return kOk;
}

}  // extern "C"
