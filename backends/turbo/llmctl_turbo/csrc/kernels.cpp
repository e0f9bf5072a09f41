// Device dispatch for the kernels of kernels.h: CUDA tensors go to the CUDA binding when
// this build has one, everything else to the CPU kernels.
#include "kernels.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>

#include "cpu/block_layout.h"

namespace turbo {
namespace {

// A CUDA tensor in a build without CUDA kernels is an error that says how to get them.
void check_cuda_built([[maybe_unused]] const at::Tensor& t) {
#ifndef LLMCTL_TURBO_CUDA
  TORCH_CHECK(!t.is_cuda(), "this build of turbo's native ops has no CUDA kernels (built "
              "without nvcc or with a CPU-only torch); rebuild with `llmctl backends build "
              "turbo` on a machine with the CUDA toolkit");
#endif
}

#ifdef LLMCTL_TURBO_CUDA
#define TURBO_ON_DEVICE(tensor, fn, ...) \
  ((tensor).is_cuda() ? cuda::fn(__VA_ARGS__) : cpu::fn(__VA_ARGS__))
#else
#define TURBO_ON_DEVICE(tensor, fn, ...) \
  do {                                   \
    check_cuda_built(tensor);            \
    cpu::fn(__VA_ARGS__);                \
  } while (0)
#endif

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& weight, int64_t groups) {
  return cpu::pack_linear_weight(weight, groups);
}

int64_t gguf_block_bytes(int64_t ggml_type) { return cpu::gguf_block_bytes(ggml_type); }

int64_t gguf_block_weights(int64_t ggml_type) {
  const int layout = layout_of_ggml_type(ggml_type);
  return layout < 0 ? 0 : (is_super_layout(layout) ? kGgufSuperBlock : kGgufBlock);
}

at::Tensor pack_gguf_weight(const at::Tensor& raw, int64_t ggml_type, int64_t groups,
                            bool offsets) {
  return cpu::pack_gguf_weight(raw, ggml_type, groups, offsets);
}

int64_t gguf_row_type(int64_t row_bytes, int64_t features) {
  if (features <= 0 || features % kGgufBlock != 0) return -1;
  const int64_t blocks = features / kGgufBlock;
  for (int64_t type : {kGgmlQ8_0, kGgmlQ4_0, kGgmlQ4_1}) {
    if (row_bytes == blocks * gguf_block_bytes(type)) return type;
  }
  return -1;
}

void embedding_gguf(at::Tensor& out, const at::Tensor& raw, const at::Tensor& ids,
                    int64_t ggml_type) {
  cpu::embedding_gguf(out, raw, ids, ggml_type);
}

namespace {

// A weight as the checkpoint stores it ([N, K]): ATen's matmul.
void aten_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                 const at::Tensor& bias) {
  if (!bias.defined() || bias.numel() == 0) {
    at::mm_out(out, x, weight.t());
  } else {
    at::addmm_out(out, bias, x, weight.t());
  }
}

}  // namespace

void linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
            const at::Tensor& bias, const at::Tensor& scale, const at::Tensor& argmax) {
  if (weight.dim() == 3 && !weight.is_cuda()) {  // packed for turbo's CPU kernels
    cpu::linear(out, x, weight, bias, scale,
                argmax.defined() ? argmax.data_ptr<int64_t>() : nullptr);
    return;
  }
#ifdef LLMCTL_TURBO_CUDA
  if (weight.is_cuda() && weight.scalar_type() == at::kByte) {  // GGUF blocks (kernels.h)
    cuda::gguf_linear(out, x, weight, bias);
  } else if (weight.scalar_type() == at::kChar) {  // CUDA only (checks.h)
    cuda::int8_linear(out, x, weight, bias, scale);
  } else {
    aten_linear(out, x, weight, bias);
  }
#else
  aten_linear(out, x, weight, bias);
#endif
  if (argmax.defined()) {
    at::Tensor ids = argmax;  // the same storage: argmax_out takes a mutable reference
    at::argmax_out(ids, out, 1);
  }
}

void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              at::IntArrayRef out_offsets, at::IntArrayRef sizes, const at::Tensor& rows,
              const at::Tensor& tiles) {
  TORCH_CHECK(!out.is_cuda(), "lora_add takes host tiles (the CPU pass); on CUDA use "
              "lora_add_slots");
  cpu::lora_add(out, x, a, bt, out_offsets, sizes, rows, tiles);
}

void lora_add_slots(at::Tensor& out, const at::Tensor& x, const at::Tensor& a,
                    const at::Tensor& bt, at::IntArrayRef out_offsets, at::IntArrayRef sizes,
                    const at::Tensor& token_slots) {
  TORCH_CHECK(out.is_cuda(), "lora_add_slots is turbo's CUDA LoRA pass; on the CPU use "
              "lora_add (tiles of one slot: llmctl.engine.lora.slot_tiles)");
  check_cuda_built(out);
#ifdef LLMCTL_TURBO_CUDA
  cuda::lora_add_slots(out, x, a, bt, out_offsets, sizes, token_slots);
#endif
}

void linear_silu_mul(at::Tensor& out, const at::Tensor& x, const at::Tensor& gate_up,
                     const at::Tensor& scale, at::Tensor& gate_up_buffer) {
  if (gate_up.dim() == 3 && gate_up.is_cpu()) {  // packed (on CUDA: GGUF rows, below)
    cpu::linear_silu_mul(out, x, gate_up, scale);
    return;
  }
  if (!gate_up_buffer.defined() || gate_up_buffer.size(0) != x.size(0)) {
    gate_up_buffer = at::empty({x.size(0), gate_up.size(0)}, x.options());
  }
  linear(gate_up_buffer, x, gate_up, at::Tensor(), scale);
  silu_and_mul(out, gate_up_buffer);
}

void embedding(at::Tensor& out, const at::Tensor& embed, const at::Tensor& ids) {
  if (embed.is_cpu()) {
    cpu::embedding(out, embed, ids);  // ATen's would wake its OpenMP threads beside turbo's
  } else {
    at::index_select_out(out, embed, 0, ids);
  }
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TURBO_ON_DEVICE(x, rms_norm, out, x, weight, eps);
}

void add_rms_norm(at::Tensor& out, at::Tensor& residual, const at::Tensor& x,
                  const at::Tensor& weight, double eps) {
  TURBO_ON_DEVICE(x, add_rms_norm, out, residual, x, weight, eps);
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                      const at::Tensor& cos_sin_cache) {
  TURBO_ON_DEVICE(q, rotary_embedding, positions, q, k, cos_sin_cache);
}

void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  TURBO_ON_DEVICE(out, silu_and_mul, out, gate_up);
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping,
                    const at::Tensor& k_scale, const at::Tensor& v_scale) {
#ifdef LLMCTL_TURBO_CUDA
  if (key.is_cuda()) {
    cuda::write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale);
    return;
  }
#endif
  check_cuda_built(key);
  cpu::write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale);
}

void rotary_embedding_and_write_kv(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& cos_sin_cache,
                                   at::Tensor& k_cache, at::Tensor& v_cache,
                                   const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                                   const at::Tensor& v_scale) {
#ifdef LLMCTL_TURBO_CUDA
  if (q.is_cuda()) {
    cuda::rotary_embedding_and_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache,
                                        slot_mapping, k_scale, v_scale);
    return;
  }
#endif
  check_cuda_built(q);
  cpu::rotary_embedding_and_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache,
                                     slot_mapping, k_scale, v_scale);
}

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                     double scale, const at::Tensor& k_scale, const at::Tensor& v_scale) {
#ifdef LLMCTL_TURBO_CUDA
  if (q.is_cuda()) {
    cuda::paged_attention(out, q, k_cache, v_cache, block_tables, query_start_loc,
                          context_lens, scale, k_scale, v_scale);
    return;
  }
#endif
  check_cuda_built(q);
  cpu::paged_attention(out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                       scale, k_scale, v_scale);
}

bool rope_write_and_decode_attention(at::Tensor& out, const at::Tensor& positions,
                                     const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& cos_sin_cache,
                                     at::Tensor& k_cache, at::Tensor& v_cache,
                                     const at::Tensor& slot_mapping,
                                     const at::Tensor& block_tables,
                                     const at::Tensor& query_start_loc,
                                     const at::Tensor& context_lens, double scale) {
  if (q.is_cuda()) return false;
  return cpu::rope_write_and_decode_attention(out, positions, q, k, v, cos_sin_cache, k_cache,
                                              v_cache, slot_mapping, block_tables,
                                              query_start_loc, context_lens, scale);
}

}  // namespace turbo
