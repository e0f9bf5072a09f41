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
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/block_layout.h"
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
// Compile the functions that follow for the instruction set `isa` (a target string),
// up to TURBO_END_TARGET.
#define TURBO_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define TURBO_BEGIN_TARGET(isa) \
  TURBO_PRAGMA(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define TURBO_END_TARGET TURBO_PRAGMA(clang attribute pop)
#else
#define TURBO_BEGIN_TARGET(isa) TURBO_PRAGMA(GCC push_options) TURBO_PRAGMA(GCC target(isa))
#define TURBO_END_TARGET TURBO_PRAGMA(GCC pop_options)
#endif
#include <immintrin.h>  // before the pragmas, like every header

TURBO_BEGIN_TARGET("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
namespace avx512 {
// 32 vector registers: an 8-row x 2-panel tile keeps 16 accumulators in registers.
constexpr int kVectorWidth = 16, kTileRows = 8, kTilePanels = 2;
constexpr bool kVnni = false;
#include "cpu/isa_kernels.h"
}  // namespace avx512
TURBO_END_TARGET

// AVX-512 with VNNI (vpdpbusd): the same kernels, and the GGUF block kernels' integer dot
// products (cpu/block_kernels.h). Never AMX: its tiles need the OS's permission.
TURBO_BEGIN_TARGET("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")
namespace avx512vnni {
constexpr int kVectorWidth = 16, kTileRows = 8, kTilePanels = 2;
constexpr bool kVnni = true;
#include "cpu/isa_kernels.h"
}  // namespace avx512vnni
TURBO_END_TARGET

TURBO_BEGIN_TARGET("avx2,fma,f16c")
namespace avx2 {
// 16 vector registers: a 6-row x 1-panel tile keeps 12 accumulators in registers.
constexpr int kVectorWidth = 8, kTileRows = 6, kTilePanels = 1;
constexpr bool kVnni = false;
#include "cpu/isa_kernels.h"
}  // namespace avx2
TURBO_END_TARGET
#endif  // x86-64

// Any CPU: the compiler's baseline (SSE2 on x86-64, NEON on aarch64).
namespace portable {
constexpr int kVectorWidth = 4, kTileRows = 2, kTilePanels = 1;
constexpr bool kVnni = false;
#include "cpu/isa_kernels.h"
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
// (the file's d and m are fp16; -8d and -128d only move the exponent). Without `offsets`
// Q8_0's and Q4_0's c is left 0: their layouts imply it (layout_zero_point).
void decode_gguf_block(const uint8_t* block, int64_t ggml_type, uint16_t& d, uint16_t& c,
                       uint8_t (&q)[kGgufBlock], bool offsets) {
  std::memcpy(&d, block, sizeof(d));
  c = 0;
  auto times = [&](float factor) {
    const float value = static_cast<float>(c10::Half(d, c10::Half::from_bits())) * factor;
    TORCH_CHECK(std::fabs(value) <= 65504.f, "a GGUF block's scale ", value / factor,
                " is too large for turbo's block kernels (its offset overflows float16)");
    return c10::Half(value).x;
  };
  if (ggml_type == kGgmlQ8_0) {  // fp16 d, int8 q[32]
    if (offsets) c = times(-128.f);
    for (int i = 0; i < kGgufBlock; ++i) {
      q[i] = static_cast<uint8_t>(static_cast<int8_t>(block[2 + i]) + 128);
    }
    return;
  }
  // Q4_0: fp16 d, 16 bytes; Q4_1: fp16 d, fp16 m, 16 bytes. Byte i holds weight i in its
  // low nibble and weight i + 16 in its high nibble. Q5_0 / Q5_1: the same with uint32 qh
  // (bit i: weight i's 5th bit) after d (and m).
  const bool with_min = ggml_type == kGgmlQ4_1 || ggml_type == kGgmlQ5_1;
  const bool five = ggml_type == kGgmlQ5_0 || ggml_type == kGgmlQ5_1;
  const uint8_t* nibbles = block + (with_min ? 4 : 2) + (five ? 4 : 0);
  if (with_min) {
    std::memcpy(&c, block + 2, sizeof(c));
  } else if (five || offsets) {
    c = times(five ? -16.f : -8.f);
  }
  uint32_t high = 0;
  if (five) std::memcpy(&high, block + (with_min ? 4 : 2), sizeof(high));
  for (int i = 0; i < kGgufBlock / 2; ++i) {
    q[i] = (nibbles[i] & 0x0F) | (((high >> i) & 1) << 4);
    q[i + kGgufBlock / 2] = (nibbles[i] >> 4) | (((high >> (i + 16)) & 1) << 4);
  }
}

// One K-quant super-block of one row (ggml's block_q4_K / block_q5_K / block_q6_K) in the
// factored form of cpu/block_layout.h: fp16 D and M = -Dmin as the file's bits (negating
// only flips the sign bit), the 8 blocks' s0 / s1 bytes, and 256 unsigned quants.
struct SuperBlock {
  uint16_t D, M = 0;
  uint8_t s0[kSuperSubBlocks], s1[kSuperSubBlocks];
  uint8_t q[kGgufSuperBlock];
};

void decode_super_block(const uint8_t* in, int64_t ggml_type, SuperBlock& out) {
  if (ggml_type == kGgmlQ6_K) {
    // ql[128], qh[64], int8 scales[16] (one per 16 weights), fp16 d. Weight e = 128h + r:
    // low nibble of ql[64h + r % 64] (high nibble for r >= 64), 2 high bits from
    // qh[32h + r % 32] at bit 2 (r / 32); as gguf.quants' Q6_K.dequantize_blocks.
    const uint8_t *ql = in, *qh = in + 128, *scales = in + 192;
    std::memcpy(&out.D, in + 208, sizeof(out.D));
    for (int j = 0; j < kSuperSubBlocks; ++j) {
      out.s0[j] = scales[2 * j];
      out.s1[j] = scales[2 * j + 1];
    }
    for (int e = 0; e < kGgufSuperBlock; ++e) {
      const int h = e / 128, r = e % 128;
      const int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
      const int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
      out.q[e] = static_cast<uint8_t>(low | (high << 4));
    }
    return;
  }
  // Q4_K: fp16 d, dmin, 12 bytes of 6-bit scales and mins, qs[128];
  // Q5_K: the same with qh[32] (the 5th bits) before qs.
  uint16_t dmin;
  std::memcpy(&out.D, in, sizeof(out.D));
  std::memcpy(&dmin, in + 2, sizeof(dmin));
  out.M = dmin ^ 0x8000;
  const uint8_t* scales = in + 4;
  for (int j = 0; j < kSuperSubBlocks; ++j) {  // ggml's get_scale_min_k4
    if (j < 4) {
      out.s0[j] = scales[j] & 0x3F;
      out.s1[j] = scales[j + 4] & 0x3F;
    } else {
      out.s0[j] = (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4);
      out.s1[j] = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
    }
  }
  const bool five = ggml_type == kGgmlQ5_K;
  const uint8_t* qh = in + 16;
  const uint8_t* qs = in + (five ? 48 : 16);
  for (int e = 0; e < kGgufSuperBlock; ++e) {
    // Weight e: nibble (e / 32) % 2 of qs[32 (e / 64) + e % 32]; Q5_K's 5th bit is bit
    // e / 32 of qh[e % 32].
    int value = (qs[32 * (e / 64) + e % 32] >> (4 * ((e / 32) % 2))) & 0x0F;
    if (five) value |= ((qh[e % 32] >> (e / 32)) & 1) << 4;
    out.q[e] = static_cast<uint8_t>(value);
  }
}

// Quant k (of 32) of feature f into a packed block's grid (cpu/block_kernels.h): groups
// of 4 inputs; the 4-bit grid holds groups 0-3 in low nibbles, 4-7 in high ones.
void put_quant(uint8_t* quants, int bits, int f, int k, uint8_t q) {
  const int g = k / 4, kk = k % 4;
  if (bits == 8) {
    quants[g * 64 + f * 4 + kk] = q;
  } else {
    quants[(g & 3) * 64 + f * 4 + kk] |= static_cast<uint8_t>(q << (g < 4 ? 0 : 4));
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
    case kGgmlQ5_0:
      return 22;
    case kGgmlQ5_1:
      return 24;
    case kGgmlQ4_K:
      return 144;
    case kGgmlQ5_K:
      return 176;
    case kGgmlQ6_K:
      return 210;
  }
  return 0;
}

at::Tensor pack_gguf_weight(const at::Tensor& raw, int64_t ggml_type, int64_t groups,
                            bool offsets) {
  const int layout = layout_of_ggml_type(ggml_type, offsets);
  const int bits = layout_quant_bits(layout);
  const bool super = is_super_layout(layout);
  const int64_t in_block = gguf_block_bytes(ggml_type);
  const int64_t rows = raw.size(0) / groups, file_blocks = raw.size(1) / in_block;
  const int64_t blocks = file_blocks * (super ? kSuperSubBlocks : 1);  // of 32 inputs
  const int64_t group_panels = (rows + kPanelWidth - 1) / kPanelWidth;
  const int64_t out_block = packed_block_bytes(layout);
  // Zeros: the padding features of a last panel have zero scales, so they sum to 0.
  at::Tensor packed = at::zeros({groups * group_panels, blocks, out_block}, raw.options());
  const uint8_t* in = raw.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  const int64_t row_bytes = raw.size(1);
  for (int64_t group = 0; group < groups; ++group) {
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t panel = group * group_panels + row / kPanelWidth;
      const int f = static_cast<int>(row % kPanelWidth);
      uint8_t* panel_out = out + panel * blocks * out_block;
      const uint8_t* row_in = in + (group * rows + row) * row_bytes;
      for (int64_t b = 0; b < file_blocks; ++b) {
        if (super) {
          SuperBlock sb;
          decode_super_block(row_in + b * in_block, ggml_type, sb);
          uint8_t* block = panel_out + b * super_block_bytes(layout);
          std::memcpy(block + f * 2, &sb.D, 2);
          if (layout != kLayoutQ6K) std::memcpy(block + (kPanelWidth + f) * 2, &sb.M, 2);
          uint8_t* sub_scales = block + super_header_bytes(layout);
          uint8_t* quants = sub_scales + kSuperSubBlocks * kSubScaleBytes;
          for (int j = 0; j < kSuperSubBlocks; ++j) {
            sub_scales[j * kSubScaleBytes + f] = sb.s0[j];
            sub_scales[j * kSubScaleBytes + kPanelWidth + f] = sb.s1[j];
            for (int k = 0; k < kGgufBlock; ++k) {
              put_quant(quants + j * layout_quant_bytes(layout), bits, f, k,
                        sb.q[j * kGgufBlock + k]);
            }
          }
          continue;
        }
        uint16_t d, c;
        uint8_t q[kGgufBlock];
        const bool stores_c = layout_zero_point(layout) == 0;
        decode_gguf_block(row_in + b * in_block, ggml_type, d, c, q, stores_c);
        uint8_t* block = panel_out + b * out_block;
        std::memcpy(block + f * sizeof(d), &d, sizeof(d));
        if (stores_c) std::memcpy(block + (kPanelWidth + f) * sizeof(c), &c, sizeof(c));
        uint8_t* quants = block + layout_scale_bytes(layout);
        for (int k = 0; k < kGgufBlock; ++k) put_quant(quants, bits, f, k, q[k]);
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
  const int zero = layout_zero_point(layout_of_ggml_type(ggml_type));  // Q8_0 128, Q4_0 8
  TURBO_DISPATCH_FLOAT_TYPES(out.scalar_type(), "embedding_gguf", [&] {
    scalar_t* rows = out.data_ptr<scalar_t>();
    for (int64_t t = 0; t < ids.size(0); ++t) {
      for (int64_t b = 0; b < blocks; ++b) {
        uint16_t d, c;
        uint8_t q[kGgufBlock];
        decode_gguf_block(table + id[t] * row_bytes + b * block_bytes, ggml_type, d, c, q, false);
        const float df = static_cast<float>(c10::Half(d, c10::Half::from_bits()));
        const float cf = static_cast<float>(c10::Half(c, c10::Half::from_bits()));
        // As gguf.quants dequantizes: d * (q - zero), or Q4_1's d * q + m.
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
            const at::Tensor& bias, const at::Tensor& scale, int64_t* argmax) {
  TURBO_ON_ACTIVE_ISA(linear, out, x, packed, bias, scale, argmax);
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

void rotary_embedding_and_write_kv(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& cos_sin_cache,
                                   at::Tensor& k_cache, at::Tensor& v_cache,
                                   const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                                   const at::Tensor& v_scale) {
  TURBO_ON_ACTIVE_ISA(rotary_embedding_and_write_kv, positions, q, k, v, cos_sin_cache, k_cache,
                      v_cache, slot_mapping, k_scale, v_scale);
}

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                     double scale, const at::Tensor& k_scale, const at::Tensor& v_scale) {
  TURBO_ON_ACTIVE_ISA(paged_attention, out, q, k_cache, v_cache, block_tables,
                      query_start_loc, context_lens, scale, k_scale, v_scale);
}

bool rope_write_and_decode_attention(at::Tensor& out, const at::Tensor& positions,
                                     const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& cos_sin_cache,
                                     at::Tensor& k_cache, at::Tensor& v_cache,
                                     const at::Tensor& slot_mapping,
                                     const at::Tensor& block_tables,
                                     const at::Tensor& query_start_loc,
                                     const at::Tensor& context_lens, double scale) {
  TURBO_ON_ACTIVE_ISA(rope_write_and_decode_attention, out, positions, q, k, v, cos_sin_cache,
                      k_cache, v_cache, slot_mapping, block_tables, query_start_loc,
                      context_lens, scale);
}

}  // namespace turbo::cpu
