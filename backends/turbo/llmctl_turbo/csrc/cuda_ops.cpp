// The C++ binding of turbo's CUDA kernels: turbo::cuda::* (kernels.h) unpack tensors into
// the raw pointers, strides and stream of the C ABI in cuda/turbo_cuda.h, and pick the
// attention kernel for the batch. Compiled only into CUDA builds (build.py), where
// ops.cpp registers the ops for the CUDA key.
#include <algorithm>

#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/turbo_cuda.h"
#include "gguf_types.h"
#include "kernels.h"

namespace turbo::cuda {
namespace {

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return TURBO_FLOAT32;
    case at::kBFloat16:
      return TURBO_BFLOAT16;
    case at::kHalf:
      return TURBO_FLOAT16;
    default:
      TORCH_CHECK(false, "turbo's CUDA kernels run in float32, bfloat16 or float16, not ",
                  t.scalar_type());
  }
}

void check_launch(cudaError_t status, const char* kernel) {
  TORCH_CHECK(status == cudaSuccess, "turbo CUDA kernel ", kernel, " failed: ",
              cudaGetErrorString(status));
}

cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// The vectorised attention kernels read and write whole 16-byte chunks of every row.
bool rows_aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 &&
         (t.stride(0) * t.element_size()) % 16 == 0;
}

// The tensor-core kernels need sm_80 (cp.async, bf16 mma).
bool has_sm80(const at::Tensor& t) {
  int major = 0;
  check_launch(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                      t.device().index()),
               "cudaDeviceGetAttribute");
  return major >= 8;
}

// Split-K decode: the split count and its workspace depend on shapes only (the block
// table's width bounds every context), so a captured CUDA graph stays valid.
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  const int64_t max_context = block_tables.size(1) * block_size;
  int num_sms = 0;
  check_launch(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, q.device().index()),
               "cudaDeviceGetAttribute");
  const int num_splits =
      turbo_cuda_decode_num_splits(num_seqs, num_heads, num_kv_heads, max_context, num_sms);
  const int64_t workspace_bytes =
      turbo_cuda_decode_workspace_bytes(num_seqs, num_heads, head_dim, num_splits);
  const at::Tensor workspace =
      at::empty({std::max<int64_t>(workspace_bytes, 1)}, q.options().dtype(at::kByte));
  check_launch(turbo_cuda_paged_decode_attention(
                   dtype_code(q), out.data_ptr(), out.stride(0), q.data_ptr(), q.stride(0),
                   k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr<int32_t>(),
                   block_tables.stride(0), context_lens.data_ptr<int32_t>(), num_seqs,
                   num_heads, num_kv_heads, head_dim, block_size, max_context,
                   static_cast<float>(scale), num_splits, workspace.data_ptr(),
                   q.scalar_type() != at::kFloat && has_sm80(q), stream_of(q)),
               "paged_decode_attention");
}

// An int8 cache's scales (kernels.h), or nullptr for a float cache.
float* scales_of(const at::Tensor& scale) {
  return scale.defined() && scale.numel() != 0 ? scale.data_ptr<float>() : nullptr;
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(turbo_cuda_rms_norm(dtype_code(x), out.data_ptr(), out.stride(0), x.data_ptr(),
                                   x.stride(0), nullptr, 0, weight.data_ptr(), x.size(0),
                                   x.size(1), static_cast<float>(eps), stream_of(x)),
               "rms_norm");
}

void add_rms_norm(at::Tensor& out, at::Tensor& residual, const at::Tensor& x,
                  const at::Tensor& weight, double eps) {
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(turbo_cuda_rms_norm(dtype_code(x), out.data_ptr(), out.stride(0), x.data_ptr(),
                                   x.stride(0), residual.data_ptr(), residual.stride(0),
                                   weight.data_ptr(), x.size(0), x.size(1),
                                   static_cast<float>(eps), stream_of(x)),
               "add_rms_norm");
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                      const at::Tensor& cos_sin_cache) {
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(turbo_cuda_rotary_embedding(dtype_code(q), positions.data_ptr<int32_t>(),
                                           q.data_ptr(), q.stride(0), q.size(1), k.data_ptr(),
                                           k.stride(0), k.size(1),
                                           cos_sin_cache.data_ptr<float>(), q.size(0),
                                           q.size(2), stream_of(q)),
               "rotary_embedding");
}

void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  const c10::cuda::CUDAGuard guard(out.device());
  check_launch(turbo_cuda_silu_and_mul(dtype_code(out), out.data_ptr(), out.stride(0),
                                       gate_up.data_ptr(), gate_up.stride(0), out.size(0),
                                       out.size(1), stream_of(out)),
               "silu_and_mul");
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping,
                    const at::Tensor& k_scale, const at::Tensor& v_scale) {
  const c10::cuda::CUDAGuard guard(key.device());
  check_launch(turbo_cuda_write_kv_cache(dtype_code(key), key.data_ptr(), key.stride(0),
                                         value.data_ptr(), value.stride(0), k_cache.data_ptr(),
                                         v_cache.data_ptr(), slot_mapping.data_ptr<int32_t>(),
                                         scales_of(k_scale), scales_of(v_scale), key.size(0),
                                         key.size(1), key.size(2), stream_of(key)),
               "write_kv_cache");
}

void rotary_embedding_and_write_kv(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& cos_sin_cache,
                                   at::Tensor& k_cache, at::Tensor& v_cache,
                                   const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                                   const at::Tensor& v_scale) {
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(turbo_cuda_rotary_write_kv(
                   dtype_code(q), positions.data_ptr<int32_t>(), q.data_ptr(), q.stride(0),
                   q.size(1), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k.size(1),
                   cos_sin_cache.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(),
                   slot_mapping.data_ptr<int32_t>(), scales_of(k_scale), scales_of(v_scale),
                   q.size(0), q.size(2), stream_of(q)),
               "rotary_embedding_and_write_kv");
}

// Decode batches (one query per sequence) take the split-K kernel; batches with prompt
// chunks the tensor-core kernel in bf16 / fp16 (from sm_80); fp32 prefill, older GPUs and
// head_dims the vectorised kernels do not take (not a multiple of 8) the SIMT kernel. An
// int8 cache always takes the SIMT kernel, the one that reads it (slower than the
// vectorised ones, allocation- and sync-free like them, so CUDA graphs capture it).
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                     double scale, const at::Tensor& k_scale, const at::Tensor& v_scale) {
  TORCH_CHECK(q.size(2) <= TURBO_CUDA_MAX_HEAD_DIM, "turbo's CUDA attention supports head_dim "
              "up to ", TURBO_CUDA_MAX_HEAD_DIM, ", got ", q.size(2));
  const c10::cuda::CUDAGuard guard(q.device());
  const int dtype = dtype_code(q);
  const int64_t head_dim = q.size(2);
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  const bool vectorised = !int8_cache && rows_aligned(q) && rows_aligned(out) &&
                          rows_aligned(k_cache) && rows_aligned(v_cache);
  if (q.size(0) == context_lens.size(0) && vectorised && turbo_cuda_decode_supported(head_dim)) {
    paged_decode_attention(out, q, k_cache, v_cache, block_tables, context_lens, scale);
    return;
  }
  // The prefill kernels take the same arguments; the SIMT one also an int8 cache's scales.
  const auto launch = [&](auto kernel, const char* name, auto... scales) {
    check_launch(kernel(dtype, out.data_ptr(), out.stride(0), q.data_ptr(), q.stride(0),
                        k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr<int32_t>(),
                        block_tables.stride(0), query_start_loc.data_ptr<int32_t>(),
                        context_lens.data_ptr<int32_t>(), context_lens.size(0), q.size(0),
                        q.size(1), k_cache.size(2), head_dim, k_cache.size(1),
                        static_cast<float>(scale), scales..., stream_of(q)),
                 name);
  };
  if (vectorised && turbo_cuda_prefill_supported(dtype, head_dim) && has_sm80(q)) {
    launch(turbo_cuda_paged_prefill_attention, "paged_prefill_attention");
  } else {
    launch(turbo_cuda_paged_attention, "paged_attention", scales_of(k_scale), scales_of(v_scale));
  }
}

// Decode-sized batches stream the int8 weight through turbo_cuda_int8_linear, which
// reads it once per tile of 8 rows and allocates nothing, so it serves every batch a
// CUDA graph captures. Larger eager batches (prompts) dequantize the weight into a
// temporary in the activation dtype (the size of the unquantized matrix, freed at once)
// and run cuBLAS: from a few dozen rows on, its tensor cores beat re-reading the weight.
constexpr int64_t kInt8KernelMaxRows = 32;

void int8_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                 const at::Tensor& bias, const at::Tensor& scale) {
  const c10::cuda::CUDAGuard guard(x.device());
  const bool has_bias = bias.defined() && bias.numel() != 0;
  if (x.size(0) > kInt8KernelMaxRows && !c10::cuda::isStreamCapturingMayInitCtx(stream_of(x))) {
    // One rounding, as llmctl.engine.quant.dequantize_weight_int8: int8 is exact in every
    // activation dtype, and the in-place multiply computes in float32.
    const at::Tensor dequantized = weight.to(x.scalar_type()).mul_(scale.unsqueeze(1));
    if (has_bias) {
      at::addmm_out(out, bias, x, dequantized.t());
    } else {
      at::mm_out(out, x, dequantized.t());
    }
    return;
  }
  check_launch(turbo_cuda_int8_linear(dtype_code(x), out.data_ptr(), out.stride(0), x.data_ptr(),
                                      x.stride(0), weight.data_ptr<int8_t>(),
                                      scale.data_ptr<float>(), has_bias ? bias.data_ptr() : nullptr,
                                      x.size(0), out.size(1), x.size(1), stream_of(x)),
               "int8_linear");
}

// The same split for GGUF rows (quantization=gguf): decode-sized batches, and every batch
// a CUDA graph captures, stream the blocks through turbo_cuda_gguf_linear; larger eager
// batches dequantize the matrix into a temporary in the activation dtype for cuBLAS.
void gguf_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                 const at::Tensor& bias) {
  const c10::cuda::CUDAGuard guard(x.device());
  const bool has_bias = bias.defined() && bias.numel() != 0;
  const int64_t ggml_type = cuda_gguf_type_of_block(weight.size(2))->ggml_type;  // checks.h
  const auto* blocks = weight.data_ptr<uint8_t>();
  if (x.size(0) > kInt8KernelMaxRows && !c10::cuda::isStreamCapturingMayInitCtx(stream_of(x))) {
    at::Tensor dequantized = at::empty({out.size(1), x.size(1)}, x.options());
    check_launch(turbo_cuda_gguf_dequantize(dtype_code(x), ggml_type, dequantized.data_ptr(),
                                            blocks, out.size(1), x.size(1), stream_of(x)),
                 "gguf_dequantize");
    if (has_bias) {
      at::addmm_out(out, bias, x, dequantized.t());
    } else {
      at::mm_out(out, x, dequantized.t());
    }
    return;
  }
  check_launch(turbo_cuda_gguf_linear(dtype_code(x), ggml_type, out.data_ptr(), out.stride(0),
                                      x.data_ptr(), x.stride(0), blocks,
                                      has_bias ? bias.data_ptr() : nullptr, x.size(0),
                                      out.size(1), x.size(1), stream_of(x)),
               "gguf_linear");
}

// The LoRA pass (cuda/lora.cu): the shrink's float32 [rows, parts x rank] product goes to
// a temporary from the caching allocator (inside a graph capture, from the graph's pool).
void lora_add_slots(at::Tensor& out, const at::Tensor& x, const at::Tensor& a,
                    const at::Tensor& bt, at::IntArrayRef out_offsets, at::IntArrayRef sizes,
                    const at::Tensor& token_slots) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), hr = a.size(1), num_slots = a.size(0);
  const at::Tensor h = at::empty({rows, hr}, x.options().dtype(at::kFloat));
  check_launch(turbo_cuda_lora_shrink(dtype_code(x), h.data_ptr<float>(), h.stride(0),
                                      x.data_ptr(), x.stride(0), a.data_ptr<float>(),
                                      token_slots.data_ptr<int32_t>(), num_slots, rows, hr,
                                      x.size(1), stream_of(x)),
               "lora_shrink");
  check_launch(turbo_cuda_lora_expand(dtype_code(out), out.data_ptr(), out.stride(0),
                                      h.data_ptr<float>(), h.stride(0), bt.data_ptr<float>(),
                                      token_slots.data_ptr<int32_t>(), num_slots, rows,
                                      bt.size(1), static_cast<int64_t>(sizes.size()),
                                      out_offsets.data(), sizes.data(), stream_of(x)),
               "lora_expand");
}

}  // namespace turbo::cuda
