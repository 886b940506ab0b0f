// Fused CUDA codec kernels: blockwise absmax int8/int4 encode, decode, decode-accumulate.
//
// Plain CUDA C++ with extern "C" launchers (called through ctypes with raw pointers and a stream),
// so `nvcc -c quant_cuda.cu` compiles it standalone. Results equal swarmtrain/compress/quant.py bit for
// bit: IEEE division (__fdiv_rn), round half to even (rintf), and every multiply/add spelled as an
// _rn intrinsic so nvcc never contracts q * scale + out into an FMA. Stochastic rounding uses the same
// counter hash as quant_cpu.cpp, so CPU and GPU agree for one seed.
//
// Work unit: one warp per *segment* (<= kSegment consecutive elements inside one quant block).
// Blocks of <= kSegment elements are one segment: absmax, scale and quantization happen in one
// kernel while the block sits in L1. Larger blocks take two kernels (segment absmax -> atomicMax).

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerCta = 8;
constexpr int64_t kSegment = 1024;
constexpr unsigned kFull = 0xffffffffu;
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;

// Device status bits OR-ed into *status (mirrors common.KernelStatus and quant_cpu.cpp).
enum Status : int {
  kOk = 0,
  kNonFinite = 1,
  kFp16Overflow = 2,
  kBadScale = 4,        // a decode got a NaN/Inf or negative scale (sparse: or lo > hi)
  kBadOffset = 8,       // sparse decode: an offset not below its chunk's length or not strictly ascending
  kBadPadding = 16,     // sparse decode: a padding bit after a chunk's codes or offsets is set
  kScaleOverflow = 32,  // sparse encode: a kept magnitude rounds to Inf in bfloat16
};
// A launcher's return for an impossible argument; otherwise it returns a cudaError_t (>= 0).
constexpr int kBadArgument = -8;

struct Layout {
  int64_t n;           // elements
  int64_t bs;          // block size
  int64_t segs;        // segments per block
  int64_t units;       // blocks * segs
};

struct Segment {
  int64_t block;
  int64_t start;       // first element (global index)
  int64_t len;
  bool first;          // the segment that writes the block's scale
};

__device__ __forceinline__ Segment segment_of(const Layout& l, int64_t unit) {
  Segment s;
  s.block = unit / l.segs;
  const int64_t k = unit - s.block * l.segs;
  const int64_t block_start = s.block * l.bs;
  const int64_t block_len = min(l.bs, l.n - block_start);
  s.start = block_start + k * kSegment;
  s.len = max(int64_t{0}, min(kSegment, block_len - k * kSegment));
  s.first = (k == 0);
  return s;
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
  for (int off = kWarp / 2; off > 0; off /= 2) v = max(v, __shfl_xor_sync(kFull, v, off));
  return v;
}

__device__ __forceinline__ uint32_t segment_absmax(const float* __restrict__ x, const Segment& s, int lane) {
  uint32_t m = 0;
  for (int64_t i = lane; i < s.len; i += kWarp) m = max(m, __float_as_uint(x[s.start + i]) & kAbsMask);
  return warp_max(m);
}

// The block's scale as the decoder sees it; false when an fp16 scale overflows.
__device__ __forceinline__ bool block_scale(uint32_t amax_bits, float qmax, bool fp16, float* scale, unsigned short* s16) {
  float s = __fdiv_rn(__uint_as_float(amax_bits), qmax);
  if (fp16) {
    unsigned short hb = __half_as_ushort(__float2half_rn(s));
    if (__half2float(__ushort_as_half(hb)) < s) hb = static_cast<unsigned short>(hb + 1);  // next fp16 up
    if ((hb & 0x7fffu) >= 0x7c00u) return false;
    *s16 = hb;
    s = __half2float(__ushort_as_half(hb));
  }
  *scale = s;
  return true;
}

__device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

__device__ __forceinline__ int quantize_one(float x, float s, float qmax, bool stochastic, uint64_t seed, int64_t g) {
  if (s == 0.0f) return 0;
  float v;
  if (stochastic) {
    const uint64_t gi = static_cast<uint64_t>(g);
    const uint32_t key = static_cast<uint32_t>(seed) ^ mix32(static_cast<uint32_t>(gi >> 32) + static_cast<uint32_t>(seed >> 32));
    const uint32_t h = mix32(static_cast<uint32_t>(gi) * 0x9e3779b9u ^ key);
    const float u = __fmul_rn(static_cast<float>(static_cast<int32_t>(h >> 8)), 1.0f / 16777216.0f);
    v = floorf(__fadd_rn(__fdiv_rn(x, s), u));
  } else {
    v = rintf(__fdiv_rn(x, s));
  }
  v = fminf(fmaxf(v, -qmax), qmax);
  return static_cast<int>(v);
}

__device__ __forceinline__ void store_scale(void* scales, bool fp16, int64_t b, float s, unsigned short s16) {
  if (fp16) {
    static_cast<unsigned short*>(scales)[b] = s16;
  } else {
    static_cast<float*>(scales)[b] = s;
  }
}

__device__ __forceinline__ float load_scale(const void* scales, bool fp16, int64_t b) {
  if (fp16) return __half2float(__ushort_as_half(static_cast<const unsigned short*>(scales)[b]));
  return static_cast<const float*>(scales)[b];
}

// Quantizes one segment with scale s: int8 into q8, or int4 pairs into p4 (segment starts are even).
__device__ __forceinline__ void quantize_segment(const float* __restrict__ x, const Layout& l, const Segment& sg,
                                                 float s, float qmax, bool stochastic, uint64_t seed, int lane,
                                                 int8_t* __restrict__ q8, uint8_t* __restrict__ p4) {
  if (q8 != nullptr) {
    for (int64_t i = lane; i < sg.len; i += kWarp) {
      const int64_t g = sg.start + i;
      q8[g] = static_cast<int8_t>(quantize_one(x[g], s, qmax, stochastic, seed, g));
    }
    return;
  }
  const int64_t pairs = (sg.len + 1) / 2;
  for (int64_t j = lane; j < pairs; j += kWarp) {
    const int64_t g = sg.start + 2 * j;
    const int lo = quantize_one(x[g], s, qmax, stochastic, seed, g) + 8;
    const int hi = (g + 1 < sg.start + sg.len) ? quantize_one(x[g + 1], s, qmax, stochastic, seed, g + 1) + 8 : 8;
    p4[g / 2] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

// One warp per block (bs <= kSegment): absmax, scale and quantization in one pass.
__global__ void encode_fused_kernel(const float* __restrict__ x, Layout l, float qmax, bool fp16, bool stochastic,
                                    uint64_t seed, int8_t* __restrict__ q8, uint8_t* __restrict__ p4, void* scales,
                                    int* status) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  for (int64_t unit = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarp; unit < l.units;
       unit += warps) {
    const Segment sg = segment_of(l, unit);
    const uint32_t am = segment_absmax(x, sg, lane);
    if (am >= kInfBits) {
      if (lane == 0) atomicOr(status, kNonFinite);
      continue;
    }
    float s;
    unsigned short s16 = 0;
    if (!block_scale(am, qmax, fp16, &s, &s16)) {
      if (lane == 0) atomicOr(status, kFp16Overflow);
      continue;
    }
    if (lane == 0) store_scale(scales, fp16, sg.block, s, s16);
    quantize_segment(x, l, sg, s, qmax, stochastic, seed, lane, q8, p4);
  }
}

// Large blocks, pass 1: per-segment absmax folded into amax_bits[block] (zeroed by the launcher).
__global__ void absmax_kernel(const float* __restrict__ x, Layout l, unsigned int* __restrict__ amax_bits) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  for (int64_t unit = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarp; unit < l.units;
       unit += warps) {
    const Segment sg = segment_of(l, unit);
    const uint32_t am = segment_absmax(x, sg, lane);
    if (lane == 0) atomicMax(&amax_bits[sg.block], am);
  }
}

// Large blocks, pass 2: every segment derives the block scale from the block absmax and quantizes.
__global__ void quantize_kernel(const float* __restrict__ x, Layout l, const unsigned int* __restrict__ amax_bits,
                                float qmax, bool fp16, bool stochastic, uint64_t seed, int8_t* __restrict__ q8,
                                uint8_t* __restrict__ p4, void* scales, int* status) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  for (int64_t unit = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarp; unit < l.units;
       unit += warps) {
    const Segment sg = segment_of(l, unit);
    const uint32_t am = amax_bits[sg.block];
    if (am >= kInfBits) {
      if (lane == 0 && sg.first) atomicOr(status, kNonFinite);
      continue;
    }
    float s;
    unsigned short s16 = 0;
    if (!block_scale(am, qmax, fp16, &s, &s16)) {
      if (lane == 0 && sg.first) atomicOr(status, kFp16Overflow);
      continue;
    }
    if (lane == 0 && sg.first) store_scale(scales, fp16, sg.block, s, s16);
    quantize_segment(x, l, sg, s, qmax, stochastic, seed, lane, q8, p4);
  }
}

// Every scale must be finite and >= 0 before any output is written.
__global__ void check_scales_kernel(const void* scales, bool fp16, int64_t nblocks, int* status) {
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < nblocks;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    bool bad;
    if (fp16) {
      const unsigned short v = static_cast<const unsigned short*>(scales)[b];
      bad = ((v & 0x7fffu) >= 0x7c00u) || v > 0x8000u;
    } else {
      const uint32_t v = static_cast<const uint32_t*>(scales)[b];
      bad = ((v & kAbsMask) >= kInfBits) || v > 0x80000000u;
    }
    if (bad) atomicOr(status, kBadScale);
  }
}

// out (+)= float(q) * scale, one segment per warp; skipped entirely when the scale check failed.
__global__ void decode_kernel(const int8_t* __restrict__ q8, const uint8_t* __restrict__ p4, Layout l,
                              const void* scales, bool fp16, float* __restrict__ out, bool accumulate,
                              const int* status) {
  if (*status != kOk) return;
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  for (int64_t unit = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kWarp; unit < l.units;
       unit += warps) {
    const Segment sg = segment_of(l, unit);
    const float s = load_scale(scales, fp16, sg.block);
    if (q8 != nullptr) {
      for (int64_t i = lane; i < sg.len; i += kWarp) {
        const int64_t g = sg.start + i;
        const float v = __fmul_rn(static_cast<float>(q8[g]), s);
        out[g] = accumulate ? __fadd_rn(out[g], v) : v;
      }
      continue;
    }
    const int64_t pairs = (sg.len + 1) / 2;
    for (int64_t j = lane; j < pairs; j += kWarp) {
      const int64_t g = sg.start + 2 * j;
      const uint8_t byte = p4[g / 2];
      const float lo = __fmul_rn(static_cast<float>((byte & 15) - 8), s);
      out[g] = accumulate ? __fadd_rn(out[g], lo) : lo;
      if (g + 1 < sg.start + sg.len) {
        const float hi = __fmul_rn(static_cast<float>((byte >> 4) - 8), s);
        out[g + 1] = accumulate ? __fadd_rn(out[g + 1], hi) : hi;
      }
    }
  }
}

Layout make_layout(int64_t n, int64_t bs) {
  Layout l;
  l.n = n;
  l.bs = bs;
  l.segs = (bs + kSegment - 1) / kSegment;
  l.units = ((n + bs - 1) / bs) * l.segs;
  return l;
}

unsigned int grid_for(int64_t units) {
  const int64_t ctas = (units + kWarpsPerCta - 1) / kWarpsPerCta;
  return static_cast<unsigned int>(ctas < 1 ? 1 : (ctas > 1048576 ? 1048576 : ctas));
}

int encode(const float* x, int64_t n, int64_t bs, bool int4, int fp16_scales, int stochastic, uint64_t seed,
           void* q, void* scales, unsigned int* amax_tmp, int* status, cudaStream_t stream) {
  if (bs < 1 || n < 0 || (int4 && bs % 2 != 0)) return kBadArgument;
  if (n == 0) return cudaSuccess;
  const Layout l = make_layout(n, bs);
  const float qmax = int4 ? 7.0f : 127.0f;
  int8_t* q8 = int4 ? nullptr : static_cast<int8_t*>(q);
  uint8_t* p4 = int4 ? static_cast<uint8_t*>(q) : nullptr;
  const unsigned int grid = grid_for(l.units);
  if (l.segs == 1) {
    encode_fused_kernel<<<grid, kWarp * kWarpsPerCta, 0, stream>>>(x, l, qmax, fp16_scales != 0, stochastic != 0,
                                                                   seed, q8, p4, scales, status);
  } else {
    const int64_t nblocks = (n + bs - 1) / bs;
    cudaError_t err = cudaMemsetAsync(amax_tmp, 0, static_cast<size_t>(nblocks) * sizeof(unsigned int), stream);
    if (err != cudaSuccess) return err;
    absmax_kernel<<<grid, kWarp * kWarpsPerCta, 0, stream>>>(x, l, amax_tmp);
    quantize_kernel<<<grid, kWarp * kWarpsPerCta, 0, stream>>>(x, l, amax_tmp, qmax, fp16_scales != 0,
                                                               stochastic != 0, seed, q8, p4, scales, status);
  }
  return cudaGetLastError();
}

int decode(const void* q, int64_t n, int64_t bs, bool int4, const void* scales, int fp16_scales, float* out,
           int accumulate, int* status, cudaStream_t stream) {
  if (bs < 1 || n < 0 || (int4 && bs % 2 != 0)) return kBadArgument;
  if (n == 0) return cudaSuccess;
  const Layout l = make_layout(n, bs);
  const int64_t nblocks = (n + bs - 1) / bs;
  const unsigned int check_grid = static_cast<unsigned int>(nblocks / 256 + 1 > 65535 ? 65535 : nblocks / 256 + 1);
  check_scales_kernel<<<check_grid, 256, 0, stream>>>(scales, fp16_scales != 0, nblocks, status);
  decode_kernel<<<grid_for(l.units), kWarp * kWarpsPerCta, 0, stream>>>(
      int4 ? nullptr : static_cast<const int8_t*>(q), int4 ? static_cast<const uint8_t*>(q) : nullptr, l, scales,
      fp16_scales != 0, out, accumulate != 0, status);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

// All launchers are asynchronous on `stream`. They return a cudaError_t (0 = launched) or -8 for a bad
// argument; kernel-side problems (Status bits) are OR-ed into *status (device memory, zeroed by the
// caller). Encode with blocks > 1024 elements needs amax_tmp: uint32[ceil(n/bs)] of device scratch.
int st_cuda_int8_encode(const float* x, int64_t n, int64_t bs, int fp16_scales, int stochastic, uint64_t seed,
                        int8_t* q, void* scales, unsigned int* amax_tmp, int* status, void* stream) {
  return encode(x, n, bs, false, fp16_scales, stochastic, seed, q, scales, amax_tmp, status,
                static_cast<cudaStream_t>(stream));
}

int st_cuda_int4_encode(const float* x, int64_t n, int64_t bs, int fp16_scales, int stochastic, uint64_t seed,
                        uint8_t* packed, void* scales, unsigned int* amax_tmp, int* status, void* stream) {
  return encode(x, n, bs, true, fp16_scales, stochastic, seed, packed, scales, amax_tmp, status,
                static_cast<cudaStream_t>(stream));
}

int st_cuda_int8_decode(const int8_t* q, int64_t n, int64_t bs, const void* scales, int fp16_scales, float* out,
                        int accumulate, int* status, void* stream) {
  return decode(q, n, bs, false, scales, fp16_scales, out, accumulate, status, static_cast<cudaStream_t>(stream));
}

int st_cuda_int4_decode(const uint8_t* packed, int64_t n, int64_t bs, const void* scales, int fp16_scales,
                        float* out, int accumulate, int* status, void* stream) {
  return decode(packed, n, bs, true, scales, fp16_scales, out, accumulate, status, static_cast<cudaStream_t>(stream));
}

}  // extern "C"
