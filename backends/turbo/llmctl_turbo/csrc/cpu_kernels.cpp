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
#include "cpu/row_kernels.h"
#include "cpu/tensor_kernels.h"
}  // namespace avx512
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
#include "cpu/row_kernels.h"
#include "cpu/tensor_kernels.h"
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
#include "cpu/row_kernels.h"
#include "cpu/tensor_kernels.h"
}  // namespace portable

#ifdef TURBO_CPU_X86
#define TURBO_ON_ACTIVE_ISA(fn, ...)   \
  switch (active_isa()) {              \
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

void linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
            const at::Tensor& bias, const at::Tensor& scale) {
  TURBO_ON_ACTIVE_ISA(linear, out, x, packed, bias, scale);
}

void linear_silu_mul(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                     const at::Tensor& scale) {
  TURBO_ON_ACTIVE_ISA(linear_silu_mul, out, x, packed, scale);
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
