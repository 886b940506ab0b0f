// Fused CUDA kernels of the chunked top-k sparse codec: encode and decode-accumulate.
//
// Plain CUDA C++ with extern "C" launchers, built into one library with quant_cuda.cu (see cuda.py).
// Results equal swarmtrain/compress/sparse.py bit for bit: its docstring is the contract (selection and
// tie order, bf16 scales to nearest even, level math, bit packing, layout, decode refusals). Every fp32
// operation is an _rn intrinsic, so nvcc never contracts one into an FMA.
//
// Encode: one block per chunk. Exact top-k by radix select on u = bits(|x|) (for non-negative floats the
// integer order is the value order), 8 bits per pass: T = the k-th largest u, and `need` = how many u == T
// to keep. A value is kept when u > T, or u == T and fewer than `need` ties come before it; its slot (rank
// in index order) = (u > T before it) + min(u == T before it, need), so offsets come out ascending without
// a sort. lo = T and hi = the chunk's largest u. Bits are OR-ed into the zeroed body with 32-bit atomics:
// every bit has one writer, so neighbouring chunks may share a word.
// Decode: one thread per kept slot; a check kernel first, and the accumulate kernel returns at once when
// the check set any status bit, so a refused body leaves out untouched.

#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kWarp = 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;
constexpr uint32_t kBf16Inf = 0x7f80u;

// Device status bits OR-ed into *status (mirrors common.KernelStatus, quant_cuda.cu and quant_cpu.cpp).
enum Status : int {
  kOk = 0,
  kNonFinite = 1,
  kBadScale = 4,        // a chunk scale is NaN/Inf or negative, or lo > hi
  kBadOffset = 8,       // an offset not below its chunk's length or not strictly ascending
  kBadPadding = 16,     // a padding bit after a chunk's codes or offsets is set
  kScaleOverflow = 32,  // a kept magnitude rounds to Inf in bfloat16
};
// A launcher's return for an impossible argument; otherwise it returns a cudaError_t (>= 0).
constexpr int kBadArgument = -8;

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
  for (int off = kWarp / 2; off > 0; off /= 2) v = max(v, __shfl_xor_sync(kFull, v, off));
  return v;
}

constexpr int kSparseThreads = 512;  // encode threads per chunk at most (<= 32 warps: one scan slot each)
constexpr int kSlotThreads = 256;    // decode threads per block
constexpr int64_t kMaxGrid = 1 << 20;
constexpr uint32_t kNoDigit = 0xffffffffu;

struct SparseLayout {  // sparse.sparse_layout, field for field
  int64_t nchunks, last_len, last_k, code_stride, offset_stride, codes_at, offsets_at, body_bytes;
  int chunk, k, bits, w;
};

struct Chunk {
  int64_t start;       // first value (global index)
  int len;             // values in the chunk
  int kept;            // values kept
  int64_t code_bit;    // first bit of its codes in the body
  int64_t offset_bit;  // first bit of its offsets in the body
};

bool make_sparse_layout(int64_t n, int chunk, int k, int bits, SparseLayout* l) {
  if (n < 0 || chunk < 2 || chunk > 65536 || k < 1 || k > chunk || (bits != 2 && bits != 4 && bits != 8)) return false;
  l->chunk = chunk;
  l->k = k;
  l->bits = bits;
  l->w = 1;
  while ((1 << l->w) < chunk) ++l->w;  // bit width of chunk - 1, at least 1
  l->nchunks = (n + chunk - 1) / chunk;
  l->last_len = l->nchunks ? n - (l->nchunks - 1) * chunk : 0;
  const int64_t last_k = (int64_t{k} * l->last_len + chunk - 1) / chunk;
  l->last_k = last_k < l->last_len ? last_k : l->last_len;
  l->code_stride = (int64_t{k} * bits + 7) / 8;
  l->offset_stride = (int64_t{k} * l->w + 7) / 8;
  const int64_t full = l->nchunks > 0 ? l->nchunks - 1 : 0;
  l->codes_at = 4 * l->nchunks;
  l->offsets_at = l->codes_at + full * l->code_stride + (l->last_k * bits + 7) / 8;
  l->body_bytes = l->offsets_at + full * l->offset_stride + (l->last_k * l->w + 7) / 8;
  return true;
}

__device__ __forceinline__ Chunk chunk_of(const SparseLayout& l, int64_t c) {
  const bool last = c == l.nchunks - 1;
  Chunk ch;
  ch.start = c * l.chunk;
  ch.len = last ? static_cast<int>(l.last_len) : l.chunk;
  ch.kept = last ? static_cast<int>(l.last_k) : l.k;
  ch.code_bit = (l.codes_at + c * l.code_stride) * 8;
  ch.offset_bit = (l.offsets_at + c * l.offset_stride) * 8;
  return ch;
}

// fp32 bits -> bf16 bits, to nearest, ties to even (finite input; kBf16Inf is Inf).
__device__ __forceinline__ uint32_t bf16_bits(uint32_t u) { return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; }

__device__ __forceinline__ float bf16_float(uint32_t b) { return __uint_as_float(b << 16); }

// OR `v` (< 2^width, width <= 16) into the bits [bit, bit + width) of the word array.
__device__ __forceinline__ void put_bits(uint32_t* words, int64_t bit, uint32_t v, int width) {
  if (v == 0) return;
  const int64_t w = bit >> 5;
  const int sh = static_cast<int>(bit & 31);
  atomicOr(&words[w], v << sh);
  if (sh + width > 32) atomicOr(&words[w + 1], v >> (32 - sh));
}

// The `width` bits at [bit, bit + width) (width <= 16), reading only the bytes they lie in.
__device__ __forceinline__ uint32_t get_bits(const uint8_t* body, int64_t bit, int width) {
  const int64_t byte = bit >> 3;
  const int sh = static_cast<int>(bit & 7);
  const int nbytes = (sh + width + 7) >> 3;
  uint32_t v = 0;
  for (int b = 0; b < nbytes; ++b) v |= static_cast<uint32_t>(body[byte + b]) << (8 * b);
  return (v >> sh) & ((1u << width) - 1u);
}

// Exclusive prefix sum over the block (every thread calls it); *total gets the block's sum.
__device__ uint32_t block_exclusive_sum(uint32_t v, uint32_t* warp_sums, uint32_t* total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, nwarps = blockDim.x / kWarp;
  uint32_t incl = v;
  for (int off = 1; off < kWarp; off *= 2) {
    const uint32_t up = __shfl_up_sync(kFull, incl, off);
    if (lane >= off) incl += up;
  }
  if (lane == kWarp - 1) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    uint32_t s = lane < nwarps ? warp_sums[lane] : 0;
    for (int off = 1; off < kWarp; off *= 2) {
      const uint32_t up = __shfl_up_sync(kFull, s, off);
      if (lane >= off) s += up;
    }
    if (lane < nwarps) warp_sums[lane] = s;
  }
  __syncthreads();
  const uint32_t before = (warp > 0 ? warp_sums[warp - 1] : 0u) + incl - v;
  *total = warp_sums[nwarps - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before;
}

// Histogram of digit (u >> shift) & 255 over the values whose u matches prefix under mask; on the first
// pass also the chunk's largest u into *max_u. Whole warps loop together (__match_any_sync needs them).
__device__ void radix_histogram(const float* __restrict__ xc, int len, uint32_t prefix, uint32_t mask, int shift,
                                int* hist, uint32_t* max_u) {
  const int lane = threadIdx.x % kWarp;
  uint32_t mx = 0;
  for (int base = 0; base < len; base += blockDim.x) {
    const int i = base + static_cast<int>(threadIdx.x);
    const uint32_t u = i < len ? (__float_as_uint(xc[i]) & kAbsMask) : 0u;
    const bool cand = i < len && (u & mask) == prefix;
    const uint32_t digit = cand ? (u >> shift) & 0xffu : kNoDigit;
    const unsigned peers = __match_any_sync(kFull, digit);
    if (cand && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
    mx = max(mx, u);
  }
  if (max_u != nullptr) {
    mx = warp_max(mx);
    if (lane == 0) atomicMax(max_u, mx);
  }
}

// Warp 0: the digit holding the rem-th largest candidate (1-based), and rem within that digit.
__device__ void select_digit(const int* hist, int rem, uint32_t* digit, int* rem_in_digit) {
  const int lane = threadIdx.x;
  int counts[8];
  int sum = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    counts[j] = hist[255 - 8 * lane - j];
    sum += counts[j];
  }
  int incl = sum;
  for (int off = 1; off < kWarp; off *= 2) {
    const int up = __shfl_up_sync(kFull, incl, off);
    if (lane >= off) incl += up;
  }
  int above = incl - sum;
  if (above < rem && rem <= incl) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (above < rem && rem <= above + counts[j]) {
        *digit = static_cast<uint32_t>(255 - 8 * lane - j);
        *rem_in_digit = rem - above;
      }
      above += counts[j];
    }
  }
}

__device__ __forceinline__ uint32_t level_of(float mag, float lo, float step, int levels) {
  if (!(step > 0.0f)) return 0;
  const float j = floorf(__fdiv_rn(__fsub_rn(mag, lo), step));
  return static_cast<uint32_t>(fminf(fmaxf(j, 0.0f), static_cast<float>(levels - 1)));
}

// Walks the chunk in index order, one value per thread per tile, and packs the kept ones at their slots.
__device__ void pack_kept(const float* __restrict__ xc, const Chunk& ch, const SparseLayout& l, uint32_t t, int need,
                          float lo, float step, uint32_t* words, uint32_t* warp_sums) {
  const int levels = 1 << (l.bits - 1);
  uint32_t gt_run = 0, eq_run = 0;
  for (int base = 0; base < ch.len; base += blockDim.x) {
    const int i = base + static_cast<int>(threadIdx.x);
    const float v = i < ch.len ? xc[i] : 0.0f;
    const uint32_t u = __float_as_uint(v) & kAbsMask;
    const bool gt = i < ch.len && u > t, eq = i < ch.len && u == t;
    uint32_t tile;  // both counts of a tile (<= 1024 each) fit 16 bits
    const uint32_t before = block_exclusive_sum((gt ? 1u : 0u) | (eq ? 0x10000u : 0u), warp_sums, &tile);
    const uint32_t gt_before = gt_run + (before & 0xffffu), eq_before = eq_run + (before >> 16);
    if (gt || (eq && eq_before < static_cast<uint32_t>(need))) {
      const int64_t slot = gt_before + min(eq_before, static_cast<uint32_t>(need));
      const uint32_t code = (v < 0.0f ? 1u << (l.bits - 1) : 0u) | level_of(__uint_as_float(u), lo, step, levels);
      put_bits(words, ch.code_bit + slot * l.bits, code, l.bits);
      put_bits(words, ch.offset_bit + slot * l.w, static_cast<uint32_t>(i), l.w);
    }
    gt_run += tile & 0xffffu;
    eq_run += tile >> 16;
  }
}

struct EncodeShared {
  int hist[256];
  uint32_t warp_sums[kWarp];
  uint32_t max_u;
  uint32_t digit;
  int rem;
};

__device__ void encode_chunk(const float* __restrict__ x, const SparseLayout& l, int64_t c, uint32_t* words,
                             int* status, EncodeShared& sh) {
  const Chunk ch = chunk_of(l, c);
  const float* xc = x + ch.start;
  if (threadIdx.x == 0) sh.max_u = 0;
  uint32_t prefix = 0, mask = 0;
  int rem = ch.kept;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int i = threadIdx.x; i < 256; i += blockDim.x) sh.hist[i] = 0;
    __syncthreads();
    radix_histogram(xc, ch.len, prefix, mask, shift, sh.hist, pass == 0 ? &sh.max_u : nullptr);
    __syncthreads();
    if (sh.max_u >= kInfBits) {  // NaN or Inf (block-uniform: read after the barrier)
      if (threadIdx.x == 0) atomicOr(status, kNonFinite);
      return;
    }
    if (threadIdx.x < kWarp) select_digit(sh.hist, rem, &sh.digit, &sh.rem);
    __syncthreads();
    prefix |= sh.digit << shift;
    mask |= 0xffu << shift;
    rem = sh.rem;
  }
  const uint32_t lo16 = bf16_bits(prefix), hi16 = bf16_bits(sh.max_u);
  if (hi16 >= kBf16Inf) {
    if (threadIdx.x == 0) atomicOr(status, kScaleOverflow);
    return;
  }
  if (threadIdx.x == 0) words[c] = lo16 | (hi16 << 16);  // scales: bf16 lo, hi (little-endian)
  const float lo = bf16_float(lo16), hi = bf16_float(hi16);
  const float step = __fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(1 << (l.bits - 1)));
  pack_kept(xc, ch, l, prefix, rem, lo, step, words, sh.warp_sums);
}

__global__ void sparse_encode_kernel(const float* __restrict__ x, SparseLayout l, uint32_t* words, int* status) {
  __shared__ EncodeShared sh;
  for (int64_t c = blockIdx.x; c < l.nchunks; c += gridDim.x) {
    encode_chunk(x, l, c, words, status, sh);
    __syncthreads();  // the next chunk reuses sh
  }
}

// The decoder's view of a chunk's scales: false when one is NaN/Inf or negative, or lo > hi.
__device__ __forceinline__ bool chunk_scales(const uint8_t* body, int64_t c, float* lo, float* hi) {
  const uint32_t lo16 = body[4 * c] | (static_cast<uint32_t>(body[4 * c + 1]) << 8);
  const uint32_t hi16 = body[4 * c + 2] | (static_cast<uint32_t>(body[4 * c + 3]) << 8);
  *lo = bf16_float(lo16);
  *hi = bf16_float(hi16);
  const bool finite = (lo16 & kBf16Inf) != kBf16Inf && (hi16 & kBf16Inf) != kBf16Inf;
  return finite && !(*lo < 0.0f) && !(*lo > *hi);
}

// Nonzero bits after the first `used` bits of a region of ceil(used / 8) bytes starting at bit `start`.
__device__ __forceinline__ bool padding_set(const uint8_t* body, int64_t start, int64_t used) {
  const int tail = static_cast<int>(used % 8);
  return tail != 0 && (body[(start + used) / 8] >> tail) != 0;
}

// One thread per kept slot: offsets in range and ascending; slot 0 also checks its chunk's scales and padding.
__global__ void sparse_check_kernel(const uint8_t* __restrict__ body, SparseLayout l, int64_t slots, int* status) {
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < slots;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = g / l.k;
    const int64_t s = g - c * l.k;
    const Chunk ch = chunk_of(l, c);
    int bad = kOk;
    const uint32_t off = get_bits(body, ch.offset_bit + s * l.w, l.w);
    if (off >= static_cast<uint32_t>(ch.len)) bad |= kBadOffset;
    if (s > 0 && off <= get_bits(body, ch.offset_bit + (s - 1) * l.w, l.w)) bad |= kBadOffset;
    if (s == 0) {
      float lo, hi;
      if (!chunk_scales(body, c, &lo, &hi)) bad |= kBadScale;
      if (padding_set(body, ch.code_bit, int64_t{ch.kept} * l.bits) ||
          padding_set(body, ch.offset_bit, int64_t{ch.kept} * l.w)) {
        bad |= kBadPadding;
      }
    }
    if (bad != kOk) atomicOr(status, bad);
  }
}

// out[chunk start + offset] += ±(lo + step * (j + 0.5)); nothing at all when the check set a status bit.
__global__ void sparse_accumulate_kernel(const uint8_t* __restrict__ body, SparseLayout l, int64_t slots,
                                         float* __restrict__ out, const int* status) {
  if (*status != kOk) return;
  const int levels = 1 << (l.bits - 1);
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < slots;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = g / l.k;
    const int64_t s = g - c * l.k;
    const Chunk ch = chunk_of(l, c);
    float lo, hi;
    chunk_scales(body, c, &lo, &hi);
    const float step = __fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(levels));
    const uint32_t code = get_bits(body, ch.code_bit + s * l.bits, l.bits);
    const uint32_t off = get_bits(body, ch.offset_bit + s * l.w, l.w);
    const float j = static_cast<float>(code & static_cast<uint32_t>(levels - 1));
    const float mag = __fadd_rn(__fmul_rn(step, __fadd_rn(j, 0.5f)), lo);
    float* o = out + ch.start + off;
    *o = __fadd_rn(*o, (code >> (l.bits - 1)) != 0 ? -mag : mag);
  }
}

unsigned int grid_of(int64_t units, int64_t per_block) {
  const int64_t blocks = (units + per_block - 1) / per_block;
  return static_cast<unsigned int>(blocks < 1 ? 1 : (blocks > kMaxGrid ? kMaxGrid : blocks));
}

int sparse_encode(const float* x, int64_t n, int chunk, int k, int bits, uint8_t* body, int* status,
                  cudaStream_t stream) {
  SparseLayout l;
  if (!make_sparse_layout(n, chunk, k, bits, &l) || reinterpret_cast<uintptr_t>(body) % 4 != 0) return kBadArgument;
  if (l.nchunks == 0) return cudaSuccess;
  const cudaError_t err = cudaMemsetAsync(body, 0, static_cast<size_t>((l.body_bytes + 3) / 4 * 4), stream);
  if (err != cudaSuccess) return err;
  const int threads = chunk < kSparseThreads ? (chunk + kWarp - 1) / kWarp * kWarp : kSparseThreads;
  sparse_encode_kernel<<<grid_of(l.nchunks, 1), threads, 0, stream>>>(x, l, reinterpret_cast<uint32_t*>(body),
                                                                     status);
  return cudaGetLastError();
}

int sparse_decode(const uint8_t* body, int64_t n, int chunk, int k, int bits, float* out, int* status,
                  cudaStream_t stream) {
  SparseLayout l;
  if (!make_sparse_layout(n, chunk, k, bits, &l)) return kBadArgument;
  if (l.nchunks == 0) return cudaSuccess;
  const int64_t slots = (l.nchunks - 1) * k + l.last_k;
  const unsigned int grid = grid_of(slots, kSlotThreads);
  sparse_check_kernel<<<grid, kSlotThreads, 0, stream>>>(body, l, slots, status);
  sparse_accumulate_kernel<<<grid, kSlotThreads, 0, stream>>>(body, l, slots, out, status);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

// Both launchers are asynchronous on `stream`; they return a cudaError_t (0 = launched) or -8 for a bad
// argument, and OR Status bits into *status (device memory, zeroed by the caller).
// Encode writes all of body (sparse_layout's body_bytes, rounded up to whole 32-bit words: body is 4-byte
// aligned and has room for them; the bytes past body_bytes come out zero). Decode adds into out (n floats)
// only when the whole body passed its check.
int st_cuda_sparse_encode(const float* x, int64_t n, int chunk, int k, int bits, uint8_t* body, int* status,
                          void* stream) {
  return sparse_encode(x, n, chunk, k, bits, body, status, static_cast<cudaStream_t>(stream));
}

int st_cuda_sparse_decode(const uint8_t* body, int64_t n, int chunk, int k, int bits, float* out, int* status,
                          void* stream) {
  return sparse_decode(body, n, chunk, k, bits, out, status, static_cast<cudaStream_t>(stream));
}

}  // extern "C"
