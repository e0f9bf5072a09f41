// CPU implementations of turbo's kernels, compiled once per instruction set and picked at
// run time (cpu/isa.h): the row kernels (cpu/row_kernels.h) and their tensor entry points
// (cpu/tensor_kernels.h) are included below inside namespaces avx512, avx2 and portable,
// each under a target pragma; the functions at the end call the active one.
//
// Every header is included BEFORE the pragmas, so only code defined inside the namespaces
// is compiled for a wider instruction set: nothing shared with the rest of the library
// (an inline function of a header) can carry AVX-512 instructions onto a CPU without it.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/isa.h"
#include "cpu/thread_pool.h"
#include "kernels.h"

// fp32, bf16 and fp16: the storage types turbo runs in.
#define TURBO_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)               \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                  \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// The activation types of the CPU linear kernels (fp16 goes through ATen: see kernels.cpp);
// the weights are that type, or int8 with scales.
#define TURBO_DISPATCH_LINEAR_TYPES(TYPE, NAME, ...)           \
  AT_DISPATCH_SWITCH(TYPE, NAME,                               \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace turbo::cpu {

struct AttentionShape {
  int64_t num_seqs, num_tokens, num_heads, num_kv_heads, head_dim, block_size;
  int64_t q_stride, out_stride, table_stride;
};

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TURBO_CPU_X86 1
#include <immintrin.h>  // before the pragmas, like every header

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#endif
namespace avx512 {
// 32 vector registers: an 8-row x 2-panel tile keeps 16 accumulators in registers.
constexpr int kVectorWidth = 16, kTileRows = 8, kTilePanels = 2;
constexpr bool kVnni = false;
#include "cpu/row_kernels.h"
#include "cpu/block_kernels.h"
#include "cpu/tensor_kernels.h"
#include "cpu/lora_kernels.h"
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// AVX-512 with VNNI (vpdpbusd): the same kernels, and the GGUF block kernels' integer dot
// products (cpu/block_kernels.h). Never AMX: its tiles need the OS's permission.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")
#endif
namespace avx512vnni {
constexpr int kVectorWidth = 16, kTileRows = 8, kTilePanels = 2;
constexpr bool kVnni = true;
#include "cpu/row_kernels.h"
#include "cpu/block_kernels.h"
#include "cpu/tensor_kernels.h"
#include "cpu/lora_kernels.h"
}  // namespace avx512vnni
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
// 16 vector registers: a 6-row x 1-panel tile keeps 12 accumulators in registers.
constexpr int kVectorWidth = 8, kTileRows = 6, kTilePanels = 1;
constexpr bool kVnni = false;
#include "cpu/row_kernels.h"
#include "cpu/block_kernels.h"
#include "cpu/tensor_kernels.h"
#include "cpu/lora_kernels.h"
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // x86-64

// Any CPU: the compiler's baseline (SSE2 on x86-64, NEON on aarch64).
namespace portable {
constexpr int kVectorWidth = 4, kTileRows = 2, kTilePanels = 1;
constexpr bool kVnni = false;
#include "cpu/row_kernels.h"
#include "cpu/block_kernels.h"
#include "cpu/tensor_kernels.h"
#include "cpu/lora_kernels.h"
}  // namespace portable

#ifdef TURBO_CPU_X86
#define TURBO_ON_ACTIVE_ISA(fn, ...)   \
  switch (active_isa()) {              \
    case Isa::kAvx512Vnni:             \
      return avx512vnni::fn(__VA_ARGS__); \
    case Isa::kAvx512:                 \
      return avx512::fn(__VA_ARGS__);  \
    case Isa::kAvx2:                   \
      return avx2::fn(__VA_ARGS__);    \
    default:                           \
      return portable::fn(__VA_ARGS__); \
  }
#else
#define TURBO_ON_ACTIVE_ISA(fn, ...) return portable::fn(__VA_ARGS__)
#endif

at::Tensor pack_linear_weight(const at::Tensor& weight, int64_t groups) {
  const int64_t rows = weight.size(0) / groups, K = weight.size(1);
  const int64_t padded = (rows + kPanelWidth - 1) / kPanelWidth * kPanelWidth;
  std::vector<at::Tensor> panels;
  for (const at::Tensor& group : weight.chunk(groups, 0)) {
    at::Tensor padded_group = at::zeros({padded, K}, weight.options());
    padded_group.narrow(0, 0, rows).copy_(group);
    // [panels, 16, K] -> [panels, K, 16]: a panel's 16 features side by side for each k.
    panels.push_back(padded_group.view({padded / kPanelWidth, kPanelWidth, K}).transpose(1, 2));
  }
  return at::cat(panels).contiguous();
}

namespace {

// One GGUF block of 32 weights (ggml's block_q8_0 / block_q4_0 / block_q4_1) as
// w = d * q + c with unsigned q (cpu/block_kernels.h); d and c as fp16 bits, exactly
// (the file's d and m are fp16; -8d and -128d only move the exponent).
void decode_gguf_block(const uint8_t* block, int64_t ggml_type, uint16_t& d, uint16_t& c,
                       uint8_t (&q)[kGgufBlock]) {
  std::memcpy(&d, block, sizeof(d));
  auto times = [&](float factor) {
    const float value = static_cast<float>(c10::Half(d, c10::Half::from_bits())) * factor;
    TORCH_CHECK(std::fabs(value) <= 65504.f, "a GGUF block's scale ", value / factor,
                " is too large for turbo's block kernels (its offset overflows float16)");
    return c10::Half(value).x;
  };
  if (ggml_type == kGgmlQ8_0) {  // fp16 d, int8 q[32]
    c = times(-128.f);
    for (int i = 0; i < kGgufBlock; ++i) {
      q[i] = static_cast<uint8_t>(static_cast<int8_t>(block[2 + i]) + 128);
    }
    return;
  }
  // Q4_0: fp16 d, 16 bytes; Q4_1: fp16 d, fp16 m, 16 bytes. Byte i holds weight i in its
  // low nibble and weight i + 16 in its high nibble.
  const uint8_t* nibbles = block + (ggml_type == kGgmlQ4_1 ? 4 : 2);
  if (ggml_type == kGgmlQ4_1) {
    std::memcpy(&c, block + 2, sizeof(c));
  } else {
    c = times(-8.f);
  }
  for (int i = 0; i < kGgufBlock / 2; ++i) {
    q[i] = nibbles[i] & 0x0F;
    q[i + kGgufBlock / 2] = nibbles[i] >> 4;
  }
}

}  // namespace

int64_t gguf_block_bytes(int64_t ggml_type) {
  switch (ggml_type) {
    case kGgmlQ8_0:
      return 34;
    case kGgmlQ4_0:
      return 18;
    case kGgmlQ4_1:
      return 20;
  }
  return 0;
}

at::Tensor pack_gguf_weight(const at::Tensor& raw, int64_t ggml_type, int64_t groups) {
  const int bits = ggml_type == kGgmlQ8_0 ? 8 : 4;
  const int64_t rows = raw.size(0) / groups, blocks = raw.size(1) / gguf_block_bytes(ggml_type);
  const int64_t group_panels = (rows + kPanelWidth - 1) / kPanelWidth;
  const int64_t out_block = kGgufScaleBytes + kGgufBlock * kPanelWidth * bits / 8;
  // Zeros: the padding features of a last panel have d = c = 0, so they sum to 0.
  at::Tensor packed = at::zeros({groups * group_panels, blocks, out_block}, raw.options());
  const uint8_t* in = raw.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  const int64_t row_bytes = raw.size(1);
  for (int64_t group = 0; group < groups; ++group) {
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t panel = group * group_panels + row / kPanelWidth;
      const int f = static_cast<int>(row % kPanelWidth);
      for (int64_t b = 0; b < blocks; ++b) {
        uint16_t d, c;
        uint8_t q[kGgufBlock];
        decode_gguf_block(in + (group * rows + row) * row_bytes + b * gguf_block_bytes(ggml_type),
                          ggml_type, d, c, q);
        uint8_t* block = out + (panel * blocks + b) * out_block;
        std::memcpy(block + f * sizeof(d), &d, sizeof(d));
        std::memcpy(block + (kPanelWidth + f) * sizeof(c), &c, sizeof(c));
        uint8_t* quants = block + kGgufScaleBytes;
        for (int k = 0; k < kGgufBlock; ++k) {
          const int g = k / 4, kk = k % 4;
          if (bits == 8) {
            quants[g * 64 + f * 4 + kk] = q[k];
          } else {  // groups 0-3 in the low nibbles of chunks 0-3, groups 4-7 in the high
            quants[(g & 3) * 64 + f * 4 + kk] |= static_cast<uint8_t>(q[k] << (g < 4 ? 0 : 4));
          }
        }
      }
    }
  }
  return packed;
}

void embedding_gguf(at::Tensor& out, const at::Tensor& raw, const at::Tensor& ids,
                    int64_t ggml_type) {
  const int64_t hidden = out.size(1), blocks = hidden / kGgufBlock;
  const int64_t block_bytes = gguf_block_bytes(ggml_type), row_bytes = raw.size(1);
  const uint8_t* table = raw.data_ptr<uint8_t>();
  const int32_t* id = ids.data_ptr<int32_t>();
  TURBO_DISPATCH_FLOAT_TYPES(out.scalar_type(), "embedding_gguf", [&] {
    scalar_t* rows = out.data_ptr<scalar_t>();
    for (int64_t t = 0; t < ids.size(0); ++t) {
      for (int64_t b = 0; b < blocks; ++b) {
        uint16_t d, c;
        uint8_t q[kGgufBlock];
        decode_gguf_block(table + id[t] * row_bytes + b * block_bytes, ggml_type, d, c, q);
        const float df = static_cast<float>(c10::Half(d, c10::Half::from_bits()));
        const float cf = static_cast<float>(c10::Half(c, c10::Half::from_bits()));
        // As gguf.quants dequantizes: d * (q - zero), or Q4_1's d * q + m.
        const int zero = ggml_type == kGgmlQ8_0 ? 128 : (ggml_type == kGgmlQ4_0 ? 8 : 0);
        scalar_t* row = rows + t * out.stride(0) + b * kGgufBlock;
        for (int k = 0; k < kGgufBlock; ++k) {
          const float value = ggml_type == kGgmlQ4_1 ? df * q[k] + cf : df * (q[k] - zero);
          row[k] = static_cast<scalar_t>(value);
        }
      }
    }
  });
}

void linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
            const at::Tensor& bias, const at::Tensor& scale) {
  TURBO_ON_ACTIVE_ISA(linear, out, x, packed, bias, scale);
}

void linear_silu_mul(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                     const at::Tensor& scale) {
  TURBO_ON_ACTIVE_ISA(linear_silu_mul, out, x, packed, scale);
}

void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              at::IntArrayRef out_offsets, at::IntArrayRef sizes, const at::Tensor& rows,
              const at::Tensor& tiles) {
  TURBO_ON_ACTIVE_ISA(lora_add, out, x, a, bt, out_offsets, sizes, rows, tiles);
}

void embedding(at::Tensor& out, const at::Tensor& embed, const at::Tensor& ids) {
  const int64_t row_bytes = embed.size(1) * embed.element_size();
  const char* table = static_cast<const char*>(embed.data_ptr());
  char* rows = static_cast<char*>(out.data_ptr());
  const int32_t* id = ids.data_ptr<int32_t>();
  parallel_for(0, ids.size(0), std::max<int64_t>(1, (256 * 1024) / row_bytes),
               [&](int64_t begin, int64_t end) {
                 for (int64_t t = begin; t < end; ++t) {
                   std::memcpy(rows + t * row_bytes, table + id[t] * row_bytes, row_bytes);
                 }
               });
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TURBO_ON_ACTIVE_ISA(rms_norm, out, x, weight, eps);
}

void add_rms_norm(at::Tensor& out, at::Tensor& residual, const at::Tensor& x,
                  const at::Tensor& weight, double eps) {
  TURBO_ON_ACTIVE_ISA(add_rms_norm, out, residual, x, weight, eps);
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                      const at::Tensor& cos_sin_cache) {
  TURBO_ON_ACTIVE_ISA(rotary_embedding, positions, q, k, cos_sin_cache);
}

void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  TURBO_ON_ACTIVE_ISA(silu_and_mul, out, gate_up);
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping,
                    const at::Tensor& k_scale, const at::Tensor& v_scale) {
  TURBO_ON_ACTIVE_ISA(write_kv_cache, key, value, k_cache, v_cache, slot_mapping, k_scale,
                      v_scale);
}

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                     double scale, const at::Tensor& k_scale, const at::Tensor& v_scale) {
  TURBO_ON_ACTIVE_ISA(paged_attention, out, q, k_cache, v_cache, block_tables,
                      query_start_loc, context_lens, scale, k_scale, v_scale);
}

}  // namespace turbo::cpu
