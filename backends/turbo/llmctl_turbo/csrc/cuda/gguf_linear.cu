// The GGUF-block linear layer for decode (quantization=gguf on CUDA):
// out[r, n] = x[r] . dequantize(w[n]) (+ bias[n]), w[n] row n of a GGUF file's matrix as
// the file stores it (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K blocks back to back), x in the
// model dtype, fp32 accumulation. Also the whole matrix dequantized, for prompt-sized
// batches that go to cuBLAS.
//
// Decode is bound by reading the weight, so the weight is read once per tile of up to
// kMaxRows activation rows and dequantized in registers: the design of llama.cpp's
// mul_mat_vec_q, without its quantization of the activations to 8 bits (this kernel's
// result is the dequantized matrix's product up to fp32 summation order). A thread block
// serves kFeatures output features; its threads take consecutive chunks of a row (a few
// bytes each: llama.cpp's split of a block across threads), so loads are contiguous, and
// all its warps share the row (split K, summed through shared memory at the end): a 4-bit
// row of a few thousand weights is only a few hundred threads' worth of chunks, and the
// more warps stream it, the more bytes are in flight. Blocks of 18, 34 and 210 bytes
// leave rows only 2-byte aligned, so the quants are read 16 bits at a time.
#include "../gguf_types.h"
#include "common.cuh"

namespace turbo_cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = kWarpsPerBlock * kWarp;
constexpr int kFeatures = 2;  // output features per thread block
constexpr int kMaxRows = 8;   // activation rows per tile (a thread block serves one tile)
static_assert(kMaxRows * kFeatures <= kThreads, "one thread writes each output of a tile");

// Four bytes at a 2-byte aligned address (byte i in bits 8i..8i+7).
__device__ __forceinline__ uint32_t load_u32(const uint8_t* p) {
  const uint16_t* half_words = reinterpret_cast<const uint16_t*>(p);
  return static_cast<uint32_t>(half_words[0]) | (static_cast<uint32_t>(half_words[1]) << 16);
}

__device__ __forceinline__ float load_fp16(const uint8_t* p) {
  return __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(p)));
}

__device__ __forceinline__ int byte_of(uint32_t word, int b) { return (word >> (8 * b)) & 0xff; }

// Each format dequantizes chunk c of a block: kRuns runs of 4 consecutive weights, run i
// starting at weight run_start(c, i) of the block, into w[4 i .. 4 i + 3]; a block has
// kChunks chunks (a power of two). The arithmetic is gguf.quants' (fp32).

// Q8_0: fp16 d, int8 q[32]; w = d * q. Chunk c: weights 8c .. 8c + 7.
struct Q8_0 {
  static constexpr int64_t kType = 8, kWeights = 32, kBytes = 34;
  static constexpr int kRuns = 2, kChunks = 4;
  __device__ static void dequantize(const uint8_t* block, int c, float (&w)[4 * kRuns]) {
    const float d = load_fp16(block);
    const uint32_t words[2] = {load_u32(block + 2 + 8 * c), load_u32(block + 6 + 8 * c)};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      w[i] = d * static_cast<float>(static_cast<int8_t>(byte_of(words[i / 4], i % 4)));
    }
  }
  __device__ static int run_start(int c, int run) { return 8 * c + 4 * run; }
};

// Q4_0 (fp16 d, 16 bytes) and Q4_1 (fp16 d, fp16 m, 16 bytes): byte i holds weight i in
// its low nibble and weight i + 16 in its high one; w = d * (q - 8), or Q4_1's d * q + m.
// Chunk c: bytes 4c .. 4c + 3, so weights 4c .. 4c + 3 and 16 + 4c .. 16 + 4c + 3.
template <bool kOffset>
struct Q4Legacy {
  static constexpr int64_t kType = kOffset ? 3 : 2, kWeights = 32, kBytes = kOffset ? 20 : 18;
  static constexpr int kRuns = 2, kChunks = 4;
  __device__ static void dequantize(const uint8_t* block, int c, float (&w)[4 * kRuns]) {
    const float d = load_fp16(block);
    const uint32_t q = load_u32(block + (kOffset ? 4 : 2) + 4 * c);
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int low = byte_of(q, b) & 0xf, high = byte_of(q, b) >> 4;
      if constexpr (kOffset) {
        const float m = load_fp16(block + 2);
        w[b] = d * static_cast<float>(low) + m;
        w[4 + b] = d * static_cast<float>(high) + m;
      } else {
        w[b] = d * static_cast<float>(low - 8);
        w[4 + b] = d * static_cast<float>(high - 8);
      }
    }
  }
  __device__ static int run_start(int c, int run) { return 16 * run + 4 * c; }
};
using Q4_0 = Q4Legacy<false>;
using Q4_1 = Q4Legacy<true>;

// The 6-bit scale and min of sub-block j of a Q4_K / Q5_K block (12 bytes at s).
__device__ __forceinline__ void scale_min_k4(int j, const uint8_t* s, float& scale,
                                             float& min) {
  int sc, m;
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
  scale = static_cast<float>(sc);
  min = static_cast<float>(m);
}

// Q4_K (fp16 d, fp16 dmin, 12 bytes of scales, 128 bytes of nibbles) and Q5_K (the same
// with 32 bytes of fifth bits before the nibbles): 8 sub-blocks of 32, w = (d * scale) *
// q - dmin * min. Group g of 64 weights is 32 bytes: low nibbles sub-block 2g, high ones
// 2g + 1; Q5_K's fifth bit of weight l of sub-block s is bit s of byte l. Chunk c: group
// c / 8, bytes l .. l + 3 with l = 4 (c % 8).
template <bool kFifthBit>
struct QK4 {
  static constexpr int64_t kType = kFifthBit ? 13 : 12, kWeights = 256;
  static constexpr int64_t kBytes = kFifthBit ? 176 : 144;
  static constexpr int kRuns = 2, kChunks = 32;
  __device__ static void dequantize(const uint8_t* block, int c, float (&w)[4 * kRuns]) {
    const int g = c / 8, l = 4 * (c % 8);
    const float d = load_fp16(block), dmin = load_fp16(block + 2);
    float scale[2], min[2];
    scale_min_k4(2 * g, block + 4, scale[0], min[0]);
    scale_min_k4(2 * g + 1, block + 4, scale[1], min[1]);
    const uint32_t q = load_u32(block + (kFifthBit ? 48 : 16) + 32 * g + l);
    const uint32_t fifth = kFifthBit ? load_u32(block + 16 + l) : 0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float dl = d * scale[half], ml = dmin * min[half];
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        int value = (byte_of(q, b) >> (4 * half)) & 0xf;
        if constexpr (kFifthBit) value |= ((byte_of(fifth, b) >> (2 * g + half)) & 1) << 4;
        w[4 * half + b] = dl * static_cast<float>(value) - ml;
      }
    }
  }
  __device__ static int run_start(int c, int run) { return 64 * (c / 8) + 32 * run + 4 * (c % 8); }
};
using Q4_K = QK4<false>;
using Q5_K = QK4<true>;

// Q6_K: ql[128] (low nibbles), qh[64] (2 high bits), int8 scales[16], fp16 d; w =
// (d * scale[i / 16]) * (q - 32). Half h of 128 weights: weight 32s + l (s < 4, l < 32)
// has its low bits in ql[64h + 32 (s % 2) + l] (high nibble for s >= 2) and its high bits
// at bit 2s of qh[32h + l]. Chunk c: half c / 8, l = 4 (c % 8) .. + 3, all four s.
struct Q6_K {
  static constexpr int64_t kType = 14, kWeights = 256, kBytes = 210;
  static constexpr int kRuns = 4, kChunks = 16;
  __device__ static void dequantize(const uint8_t* block, int c, float (&w)[4 * kRuns]) {
    const int h = c / 8, l = 4 * (c % 8);
    const float d = load_fp16(block + 208);
    const uint32_t low[2] = {load_u32(block + 64 * h + l), load_u32(block + 64 * h + 32 + l)};
    const uint32_t high = load_u32(block + 128 + 32 * h + l);
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const float ds = d * static_cast<float>(scales[8 * h + 2 * s + l / 16]);
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int q = ((byte_of(low[s % 2], b) >> (4 * (s / 2))) & 0xf) |
                      (((byte_of(high, b) >> (2 * s)) & 3) << 4);
        w[4 * s + b] = ds * static_cast<float>(q - 32);
      }
    }
  }
  __device__ static int run_start(int c, int run) { return 128 * (c / 8) + 32 * run + 4 * (c % 8); }
};

// Each format's geometry is the one gguf_types.h gives the binding and the checks.
template <typename F>
constexpr bool matches_table() {
  for (const turbo::GgufBlockType& type : turbo::kCudaGgufTypes) {
    if (type.ggml_type == F::kType) return type.weights == F::kWeights && type.bytes == F::kBytes;
  }
  return false;
}
static_assert(matches_table<Q8_0>() && matches_table<Q4_0>() && matches_table<Q4_1>() &&
              matches_table<Q4_K>() && matches_table<Q5_K>() && matches_table<Q6_K>());

// Four consecutive elements of x as floats: one 16- or 8-byte load (kVector), or four.
template <typename T, bool kVector>
__device__ __forceinline__ void load4(const T* p, float (&out)[4]) {
  if constexpr (kVector && std::is_same_v<T, float>) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  } else if constexpr (kVector) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    const uint32_t words[2] = {v.x, v.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const auto bits = static_cast<unsigned short>(words[i / 2] >> (16 * (i % 2)));
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        out[i] = __uint_as_float(static_cast<uint32_t>(bits) << 16);
      } else {
        out[i] = __half2float(__ushort_as_half(bits));
      }
    }
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] = to_float(p[e]);
  }
}

// Grid: (feature tiles of kFeatures, row tiles of kMaxRows).
template <typename T, typename F, bool kVector>
// A block count of 1 lifts the 64-register budget ptxas picks for sm_80 without it (Q5_K
// spilled there); occupancy comes from the grid's many blocks, not from registers.
__global__ void __launch_bounds__(kThreads, 1)
    gguf_linear_kernel(T* out, int64_t out_stride, const T* x, int64_t x_stride,
                       const uint8_t* weight, const T* bias, int64_t rows, int64_t features,
                       int64_t in_features) {
  __shared__ float partial[kWarpsPerBlock][kMaxRows][kFeatures];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t first_feature = static_cast<int64_t>(blockIdx.x) * kFeatures;
  const int64_t first_row = static_cast<int64_t>(blockIdx.y) * kMaxRows;
  const int tile_rows = static_cast<int>(min(static_cast<int64_t>(kMaxRows), rows - first_row));
  const int tile_features =
      static_cast<int>(min(static_cast<int64_t>(kFeatures), features - first_feature));
  const int64_t blocks = in_features / F::kWeights, row_bytes = blocks * F::kBytes;
  const int64_t chunks = blocks * F::kChunks;

  float acc[kMaxRows][kFeatures] = {};
  for (int64_t chunk = threadIdx.x; chunk < chunks; chunk += kThreads) {
    const int64_t block = chunk / F::kChunks;
    const int c = static_cast<int>(chunk % F::kChunks);
    float w[kFeatures][4 * F::kRuns];
#pragma unroll
    for (int f = 0; f < kFeatures; ++f) {
      if (f < tile_features) {
        F::dequantize(weight + (first_feature + f) * row_bytes + block * F::kBytes, c, w[f]);
      } else {
#pragma unroll
        for (int e = 0; e < 4 * F::kRuns; ++e) w[f][e] = 0.f;
      }
    }
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r >= tile_rows) break;
      const T* xr = x + (first_row + r) * x_stride + block * F::kWeights;
#pragma unroll
      for (int run = 0; run < F::kRuns; ++run) {
        float xs[4];
        load4<T, kVector>(xr + F::run_start(c, run), xs);
#pragma unroll
        for (int f = 0; f < kFeatures; ++f) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[r][f] += xs[e] * w[f][4 * run + e];
        }
      }
    }
  }
  // Each warp's sums, then the warps' sums: thread (r, f) adds them in warp order.
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    if (r >= tile_rows) break;
#pragma unroll
    for (int f = 0; f < kFeatures; ++f) {
      const float sum = warp_sum(acc[r][f]);
      if (lane == 0) partial[warp][r][f] = sum;
    }
  }
  __syncthreads();
  const int r = threadIdx.x / kFeatures, f = threadIdx.x % kFeatures;
  if (r < tile_rows && f < tile_features) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarpsPerBlock; ++w) sum += partial[w][r][f];
    const int64_t n = first_feature + f;
    const float value = sum + (bias == nullptr ? 0.f : to_float(bias[n]));
    out[(first_row + r) * out_stride + n] = from_float<T>(value);
  }
}

// One thread per chunk of the whole [features, in_features] matrix: blocks follow one
// another across rows as in the output, so block b's weights land at b * kWeights.
template <typename T, typename F>
__global__ void gguf_dequantize_kernel(T* out, const uint8_t* weight, int64_t chunks) {
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (chunk >= chunks) return;
  const int64_t block = chunk / F::kChunks;
  const int c = static_cast<int>(chunk % F::kChunks);
  float w[4 * F::kRuns];
  F::dequantize(weight + block * F::kBytes, c, w);
  T* o = out + block * F::kWeights;
#pragma unroll
  for (int run = 0; run < F::kRuns; ++run) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[F::run_start(c, run) + e] = from_float<T>(w[4 * run + e]);
  }
}

template <typename F>
cudaError_t launch_linear(int dtype, void* out, int64_t out_stride, const void* x,
                          int64_t x_stride, const uint8_t* weight, const void* bias,
                          int64_t rows, int64_t features, int64_t in_features, bool vector,
                          cudaStream_t stream) {
  const dim3 grid(blocks_for(features, kFeatures), blocks_for(rows, kMaxRows));
  TURBO_CUDA_DISPATCH(
      dtype,
      const auto kernel = vector ? gguf_linear_kernel<T, F, true> : gguf_linear_kernel<T, F, false>;
      TURBO_LAUNCH(kernel, grid, kThreads, 0, stream)(
          static_cast<T*>(out), out_stride, static_cast<const T*>(x), x_stride, weight,
          static_cast<const T*>(bias), rows, features, in_features));
}

template <typename F>
cudaError_t launch_dequantize(int dtype, void* out, const uint8_t* weight, int64_t features,
                              int64_t in_features, cudaStream_t stream) {
  constexpr int kDequantizeThreads = 256;
  const int64_t chunks = features * (in_features / F::kWeights) * F::kChunks;
  TURBO_CUDA_DISPATCH(dtype, TURBO_LAUNCH((gguf_dequantize_kernel<T, F>),
                                          blocks_for(chunks, kDequantizeThreads), kDequantizeThreads, 0,
                                          stream)(
                                 static_cast<T*>(out), weight, chunks));
}

// Calls body(F{}) for the format of ggml_type; cudaErrorInvalidValue for another type.
template <typename Body>
cudaError_t with_format(int64_t ggml_type, const Body& body) {
  switch (ggml_type) {
    case Q8_0::kType:
      return body(Q8_0{});
    case Q4_0::kType:
      return body(Q4_0{});
    case Q4_1::kType:
      return body(Q4_1{});
    case Q4_K::kType:
      return body(Q4_K{});
    case Q5_K::kType:
      return body(Q5_K{});
    case Q6_K::kType:
      return body(Q6_K{});
  }
  return cudaErrorInvalidValue;
}

// Rows must fit whole blocks, and the quants are read 16 bits at a time.
bool weight_fits(int64_t ggml_type, const uint8_t* weight, int64_t in_features) {
  const turbo::GgufBlockType* type = nullptr;
  for (const turbo::GgufBlockType& t : turbo::kCudaGgufTypes) {
    if (t.ggml_type == ggml_type) type = &t;
  }
  return type != nullptr && in_features % type->weights == 0 &&
         reinterpret_cast<uintptr_t>(weight) % 2 == 0;
}

}  // namespace
}  // namespace turbo_cuda

using namespace turbo_cuda;

extern "C" int turbo_cuda_gguf_linear_vectorized(int dtype, const void* x, int64_t x_stride) {
  const int64_t run_bytes = 4 * (dtype == TURBO_FLOAT32 ? 4 : 2);
  return reinterpret_cast<uintptr_t>(x) % run_bytes == 0 && x_stride % 4 == 0;
}

extern "C" cudaError_t turbo_cuda_gguf_linear(int dtype, int64_t ggml_type, void* out,
                                              int64_t out_stride, const void* x,
                                              int64_t x_stride, const uint8_t* weight,
                                              const void* bias, int64_t rows, int64_t features,
                                              int64_t in_features, cudaStream_t stream) {
  if (!weight_fits(ggml_type, weight, in_features)) return cudaErrorInvalidValue;
  if (rows == 0 || features == 0) return cudaSuccess;
  const bool vector = turbo_cuda_gguf_linear_vectorized(dtype, x, x_stride);
  return with_format(ggml_type, [&](auto format) {
    return launch_linear<decltype(format)>(dtype, out, out_stride, x, x_stride, weight, bias,
                                           rows, features, in_features, vector, stream);
  });
}

extern "C" cudaError_t turbo_cuda_gguf_dequantize(int dtype, int64_t ggml_type, void* out,
                                                  const uint8_t* weight, int64_t features,
                                                  int64_t in_features, cudaStream_t stream) {
  if (!weight_fits(ggml_type, weight, in_features)) return cudaErrorInvalidValue;
  if (features == 0 || in_features == 0) return cudaSuccess;
  return with_format(ggml_type, [&](auto format) {
    return launch_dequantize<decltype(format)>(dtype, out, weight, features, in_features,
                                               stream);
  });
}
