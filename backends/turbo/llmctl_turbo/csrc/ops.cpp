// turbo's ops as seen from Python: torch.ops.llmctl_turbo.<name>. Each checks its
// arguments (a RuntimeError naming the argument and the rule), then runs the kernel of
// kernels.h on the tensors' device. Outputs are written into tensors the caller passes.
#include <ATen/ops/arange.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "checks.h"
#include "cpu/isa.h"
#include "cpu/thread_pool.h"
#include "kernels.h"

namespace turbo {
namespace {

void check_float_rows(const at::Tensor& t, const char* name, const at::Tensor& like) {
  check_float_type(t, name);
  check_tensor(t, name, like.scalar_type(), like.dim(), like);
  check_rows_contiguous(t, name);
}

void check_norm_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2, "x must be [tokens, hidden], got shape ", x.sizes());
  check_float_rows(x, "x", x);
  check_float_rows(out, "out", x);
  check_tensor(weight, "weight", x.scalar_type(), 1, x);
  TORCH_CHECK(out.sizes() == x.sizes(), "out must have x's shape ", x.sizes(), ", got ",
              out.sizes());
  TORCH_CHECK(weight.size(0) == x.size(1) && weight.is_contiguous(), "weight must be a "
              "contiguous [", x.size(1), "] tensor, got shape ", weight.sizes());
}

void rms_norm_op(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(out, x, weight);
  rms_norm(out, x, weight, eps);
}

void add_rms_norm_op(at::Tensor out, at::Tensor residual, const at::Tensor& x,
                     const at::Tensor& weight, double eps) {
  check_norm_args(out, x, weight);
  check_float_rows(residual, "residual", x);
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual must have x's shape ", x.sizes(),
              ", got ", residual.sizes());
  add_rms_norm(out, residual, x, weight, eps);
}

void check_heads(const at::Tensor& t, const char* name, const at::Tensor& like) {
  check_float_type(t, name);
  check_tensor(t, name, like.scalar_type(), 3, like);
  check_rows_contiguous(t, name);
}

void check_rotary_args(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& cos_sin_cache) {
  check_heads(q, "q", q);
  check_heads(k, "k", q);
  check_tensor(positions, "positions", at::kInt, 1, q);
  check_tensor(cos_sin_cache, "cos_sin_cache", at::kFloat, 2, q);
  TORCH_CHECK(cos_sin_cache.is_contiguous(), "cos_sin_cache must be contiguous");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even for rotary embedding, got ", head_dim);
  TORCH_CHECK(k.size(2) == head_dim && k.size(0) == q.size(0) && positions.size(0) == q.size(0),
              "q [T, H, D], k [T, KVH, D] and positions [T] must agree; got ", q.sizes(), ", ",
              k.sizes(), ", ", positions.sizes());
  TORCH_CHECK(cos_sin_cache.size(1) == head_dim, "cos_sin_cache must be [max_positions, ",
              head_dim, "] (cos then sin), got ", cos_sin_cache.sizes());
  check_positions(positions, cos_sin_cache.size(0));
}

void rotary_embedding_op(const at::Tensor& positions, at::Tensor q, at::Tensor k,
                         const at::Tensor& cos_sin_cache) {
  check_rotary_args(positions, q, k, cos_sin_cache);
  rotary_embedding(positions, q, k, cos_sin_cache);
}

void silu_and_mul_op(at::Tensor out, const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "gate_up must be [tokens, 2 * intermediate], got shape ", gate_up.sizes());
  check_float_rows(gate_up, "gate_up", gate_up);
  check_float_rows(out, "out", gate_up);
  TORCH_CHECK(out.size(0) == gate_up.size(0) && out.size(1) == gate_up.size(1) / 2,
              "out must be [", gate_up.size(0), ", ", gate_up.size(1) / 2, "], got ", out.sizes());
  silu_and_mul(out, gate_up);
}

at::Tensor pack_linear_weight_op(const at::Tensor& weight, int64_t groups) {
  const auto type = weight.scalar_type();
  TORCH_CHECK(weight.dim() == 2 && weight.is_cpu() &&
                  (type == at::kFloat || type == at::kBFloat16 || type == at::kChar),
              "pack_linear_weight packs a float32, bfloat16 or int8 [out, in] matrix on the "
              "CPU, got ",
              weight.scalar_type(), " ", weight.sizes(), " on ", weight.device());
  TORCH_CHECK(groups >= 1 && weight.size(0) % groups == 0, "groups (", groups,
              ") must divide the ", weight.size(0), " rows of weight");
  return pack_linear_weight(weight, groups);
}

at::Tensor pack_gguf_weight_op(const at::Tensor& raw, int64_t ggml_type, int64_t groups,
                               bool offsets) {
  const int64_t block = gguf_block_bytes(ggml_type);
  TORCH_CHECK(block != 0, "pack_gguf_weight packs GGML types ", kGgmlQ8_0, " (Q8_0), ",
              kGgmlQ4_0, " (Q4_0), ", kGgmlQ4_1, " (Q4_1), ", kGgmlQ5_0, " (Q5_0), ", kGgmlQ5_1,
              " (Q5_1), ", kGgmlQ4_K, " (Q4_K), ", kGgmlQ5_K,
              " (Q5_K) and ", kGgmlQ6_K, " (Q6_K), got type ", ggml_type);
  TORCH_CHECK(raw.dim() == 2 && raw.is_cpu() && raw.scalar_type() == at::kByte &&
                  raw.is_contiguous() && raw.size(1) % block == 0,
              "pack_gguf_weight packs a GGUF tensor's rows: a contiguous uint8 [out, row "
              "bytes] tensor on the CPU, row bytes a multiple of ", block, ", got ",
              raw.scalar_type(), " ", raw.sizes(), " on ", raw.device());
  TORCH_CHECK(groups >= 1 && raw.size(0) % groups == 0, "groups (", groups,
              ") must divide the ", raw.size(0), " rows of raw");
  return pack_gguf_weight(raw, ggml_type, groups, offsets);
}

// No scale: float weights or a float KV cache; int8 ones need their scales (kernels.h).
at::Tensor scale_or_empty(const std::optional<at::Tensor>& scale) {
  return scale.has_value() ? *scale : at::Tensor();
}

// A linear op's input and output rows: x [rows, in_features], out [rows, out_features].
void check_linear_rows(const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in_features], got shape ", x.sizes());
  check_float_rows(x, "x", x);
  check_float_rows(out, "out", x);
  TORCH_CHECK(out.size(0) == x.size(0), "out must have x's ", x.size(0), " rows, got ",
              out.sizes());
}

void linear_op(at::Tensor out, const at::Tensor& x, const at::Tensor& weight,
               const at::Tensor& bias, const std::optional<at::Tensor>& weight_scale,
               const std::optional<at::Tensor>& argmax) {
  const at::Tensor scale = scale_or_empty(weight_scale);
  check_linear_rows(out, x);
  check_linear_weight(weight, {"weight"}, x, x.size(1), out.size(1), 1, scale);
  if (bias.numel() != 0) {
    check_tensor(bias, "bias", x.scalar_type(), 1, x);
    TORCH_CHECK(bias.size(0) == out.size(1) && bias.is_contiguous(), "bias must be empty "
                "or a contiguous [", out.size(1), "] tensor, got ", bias.sizes());
  }
  if (argmax.has_value()) check_argmax_out(*argmax, x.size(0), x);
  linear(out, x, weight, bias, scale, argmax.value_or(at::Tensor()));
}

// The arguments lora_add and lora_add_slots share: x, out, the parts and the slots' weights.
void check_lora_add_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a,
                         const at::Tensor& bt, at::IntArrayRef out_offsets,
                         at::IntArrayRef sizes) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0),
              "x and out must be [tokens, in] and [tokens, out]; got ", x.sizes(), " and ",
              out.sizes());
  check_float_rows(x, "x", x);
  check_float_rows(out, "out", x);
  TORCH_CHECK(out_offsets.size() == sizes.size() && !sizes.empty(),
              "out_offsets and sizes must name the same parts");
  for (size_t p = 0; p < sizes.size(); ++p) {
    TORCH_CHECK(out_offsets[p] >= 0 && sizes[p] >= 0 && out_offsets[p] + sizes[p] <= out.size(1),
                "part ", p, " (columns ", out_offsets[p], " + ", sizes[p], ") is not inside out");
  }
  check_lora_weights(a, bt, {"lora"}, x.size(1), sizes, x);
}

void lora_add_op(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                 at::IntArrayRef out_offsets, at::IntArrayRef sizes, const at::Tensor& rows,
                 const at::Tensor& tiles) {
  check_lora_add_args(out, x, a, bt, out_offsets, sizes);
  check_lora_tiles(rows, tiles, x.size(0), a.size(0));
  lora_add(out, x, a, bt, out_offsets, sizes, rows, tiles);
}

void lora_add_slots_op(at::Tensor out, const at::Tensor& x, const at::Tensor& a,
                       const at::Tensor& bt, at::IntArrayRef out_offsets, at::IntArrayRef sizes,
                       const at::Tensor& token_slots) {
  check_lora_add_args(out, x, a, bt, out_offsets, sizes);
  check_lora_slots(token_slots, x.size(0), x);
  lora_add_slots(out, x, a, bt, out_offsets, sizes, token_slots);
}

void linear_silu_mul_op(at::Tensor out, const at::Tensor& x, const at::Tensor& gate_up,
                        const std::optional<at::Tensor>& weight_scale) {
  const at::Tensor scale = scale_or_empty(weight_scale);
  check_linear_rows(out, x);
  check_linear_weight(gate_up, {"gate_up"}, x, x.size(1), 2 * out.size(1), 2, scale);
  at::Tensor buffer;
  linear_silu_mul(out, x, gate_up, scale, buffer);
}

// The K and V caches of one layer: one shape and one dtype (an int8 pair with scales).
void check_kv_caches(const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& k_scale, const at::Tensor& v_scale,
                     const at::Tensor& like) {
  check_cache(k_cache, k_scale, "k_cache", like);
  check_cache(v_cache, v_scale, "v_cache", like);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must have one shape and dtype, got ", k_cache.scalar_type(),
              " ", k_cache.sizes(), " and ", v_cache.scalar_type(), " ", v_cache.sizes());
}

void check_kv_write_args(const at::Tensor& key, const at::Tensor& value,
                         const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                         const at::Tensor& v_scale) {
  check_heads(key, "key", key);
  check_heads(value, "value", key);
  check_kv_caches(k_cache, v_cache, k_scale, v_scale, key);
  check_tensor(slot_mapping, "slot_mapping", at::kInt, 1, key);
  TORCH_CHECK(value.sizes() == key.sizes() && slot_mapping.size(0) == key.size(0),
              "key and value [T, KVH, D] and slot_mapping [T] must agree; got ", key.sizes(),
              ", ", value.sizes(), ", ", slot_mapping.sizes());
  TORCH_CHECK(k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2),
              "cache rows [.., .., KVH, D] = ", k_cache.sizes(), " do not match key ", key.sizes());
  check_slots(slot_mapping, k_cache.size(0) * k_cache.size(1));
}

void write_kv_cache_op(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache,
                       at::Tensor v_cache, const at::Tensor& slot_mapping,
                       const std::optional<at::Tensor>& k_cache_scale,
                       const std::optional<at::Tensor>& v_cache_scale) {
  const at::Tensor k_scale = scale_or_empty(k_cache_scale);
  const at::Tensor v_scale = scale_or_empty(v_cache_scale);
  check_kv_write_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale);
}

void rotary_embedding_and_write_kv_op(const at::Tensor& positions, at::Tensor q, at::Tensor k,
                                      const at::Tensor& v, const at::Tensor& cos_sin_cache,
                                      at::Tensor k_cache, at::Tensor v_cache,
                                      const at::Tensor& slot_mapping,
                                      const std::optional<at::Tensor>& k_cache_scale,
                                      const std::optional<at::Tensor>& v_cache_scale) {
  const at::Tensor k_scale = scale_or_empty(k_cache_scale);
  const at::Tensor v_scale = scale_or_empty(v_cache_scale);
  check_rotary_args(positions, q, k, cos_sin_cache);
  check_kv_write_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  rotary_embedding_and_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache,
                                slot_mapping, k_scale, v_scale);
}

void paged_prefill_attention_op(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& query_start_loc,
                                const at::Tensor& context_lens, double scale,
                                const std::optional<at::Tensor>& k_cache_scale,
                                const std::optional<at::Tensor>& v_cache_scale) {
  const at::Tensor k_scale = scale_or_empty(k_cache_scale);
  const at::Tensor v_scale = scale_or_empty(v_cache_scale);
  check_heads(q, "q", q);
  check_heads(out, "out", q);
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape ", q.sizes(), ", got ",
              out.sizes());
  check_kv_caches(k_cache, v_cache, k_scale, v_scale, q);
  TORCH_CHECK(k_cache.size(3) == q.size(2), "head_dim of the cache (", k_cache.size(3),
              ") and of q (", q.size(2), ") differ");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads (", q.size(1),
              ") must be a multiple of kv heads (", k_cache.size(2), ")");
  check_tensor(block_tables, "block_tables", at::kInt, 2, q);
  check_tensor(query_start_loc, "query_start_loc", at::kInt, 1, q);
  check_tensor(context_lens, "context_lens", at::kInt, 1, q);
  check_batch(block_tables, query_start_loc, context_lens, q.size(0), k_cache.size(0),
              k_cache.size(1));
  paged_attention(out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                  k_scale, v_scale);
}

void paged_decode_attention_op(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, double scale,
                               const std::optional<at::Tensor>& k_cache_scale,
                               const std::optional<at::Tensor>& v_cache_scale) {
  // Decode is prefill with one query per sequence.
  TORCH_CHECK(q.dim() == 3 && q.size(0) == context_lens.size(0),
              "decode has one query token per sequence: q must be [num_seqs, H, D] with "
              "num_seqs = len(context_lens) = ", context_lens.size(0), ", got ", q.sizes());
  const at::Tensor query_start_loc =
      at::arange(q.size(0) + 1, context_lens.options().dtype(at::kInt));
  paged_prefill_attention_op(out, q, k_cache, v_cache, block_tables, query_start_loc,
                             context_lens, scale, k_cache_scale, v_cache_scale);
}

}  // namespace

TORCH_LIBRARY(llmctl_turbo, m) {
  m.def("pack_linear_weight(Tensor weight, int groups=1) -> Tensor");
  m.def("pack_gguf_weight(Tensor raw, int ggml_type, int groups=1, bool offsets=False) -> Tensor");
  m.def("linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor bias, "
        "Tensor? weight_scale=None, Tensor(b!)? argmax=None) -> ()");
  m.def("linear_silu_mul(Tensor(a!) out, Tensor x, Tensor gate_up, "
        "Tensor? weight_scale=None) -> ()");
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor a, Tensor bt, int[] out_offsets, "
        "int[] sizes, Tensor rows, Tensor tiles) -> ()");
  m.def("lora_add_slots(Tensor(a!) out, Tensor x, Tensor a, Tensor bt, int[] out_offsets, "
        "int[] sizes, Tensor token_slots) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor x, Tensor weight, "
        "float eps) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin_cache)"
        " -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  // An int8 KV cache (kv_cache_dtype=int8, CPU) passes its scales; a float one none.
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, Tensor(c!)? k_cache_scale=None, "
        "Tensor(d!)? v_cache_scale=None) -> ()");
  m.def("rotary_embedding_and_write_kv(Tensor positions, Tensor(a!) q, Tensor(b!) k, "
        "Tensor v, Tensor cos_sin_cache, Tensor(c!) k_cache, Tensor(d!) v_cache, "
        "Tensor slot_mapping, Tensor(e!)? k_cache_scale=None, "
        "Tensor(f!)? v_cache_scale=None) -> ()");
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, Tensor? k_cache_scale=None, "
        "Tensor? v_cache_scale=None) -> ()");
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor query_start_loc, Tensor context_lens, float scale, "
        "Tensor? k_cache_scale=None, Tensor? v_cache_scale=None) -> ()");
  m.def("llama_step(Tensor input_ids, Tensor positions, Tensor slot_mapping, "
        "Tensor block_tables, Tensor query_start_loc, Tensor context_lens, Tensor[] weights, "
        "Tensor(a!) kv_cache, Tensor cos_sin_cache, int num_heads, float rms_norm_eps, "
        "Tensor[] lora_weights, Tensor(b!)? kv_cache_scale=None, Tensor? logits_indices=None, "
        "Tensor? lora_rows=None, Tensor? lora_tiles=None, Tensor? lora_slots=None, "
        "Tensor? kv_rotation=None, Tensor(c!)? argmax=None) -> Tensor");
  // The CPU kernels' threads and instruction set (cpu/thread_pool.h, cpu/isa.h).
  m.def("cpu_threads() -> int", [] { return static_cast<int64_t>(cpu::num_threads()); });
  m.def("set_cpu_threads(int threads) -> ()", [](int64_t threads) {
    TORCH_CHECK(threads >= 1 && threads <= 4096, "the CPU thread count must be between 1 and "
                "4096, got ", threads);
    cpu::set_num_threads(static_cast<int>(threads));
  });
  m.def("cpu_isa() -> str", [] { return std::string(cpu::isa_name(cpu::active_isa())); });
  m.def("set_cpu_isa(str name) -> ()", [](std::string name) { cpu::set_isa(name); });
}

// The same checked entry points serve CPU and CUDA tensors: kernels.h picks the device.
#define TURBO_REGISTER_OPS(m)                                    \
  m.impl("pack_linear_weight", &pack_linear_weight_op);          \
  m.impl("pack_gguf_weight", &pack_gguf_weight_op);              \
  m.impl("linear", &linear_op);                                  \
  m.impl("linear_silu_mul", &linear_silu_mul_op);                \
  m.impl("lora_add", &lora_add_op);                              \
  m.impl("lora_add_slots", &lora_add_slots_op);                  \
  m.impl("rms_norm", &rms_norm_op);                              \
  m.impl("add_rms_norm", &add_rms_norm_op);                      \
  m.impl("rotary_embedding", &rotary_embedding_op);              \
  m.impl("silu_and_mul", &silu_and_mul_op);                      \
  m.impl("write_kv_cache", &write_kv_cache_op);                  \
  m.impl("rotary_embedding_and_write_kv", &rotary_embedding_and_write_kv_op); \
  m.impl("paged_decode_attention", &paged_decode_attention_op);  \
  m.impl("paged_prefill_attention", &paged_prefill_attention_op)

TORCH_LIBRARY_IMPL(llmctl_turbo, CPU, m) { TURBO_REGISTER_OPS(m); }

#ifdef LLMCTL_TURBO_CUDA
TORCH_LIBRARY_IMPL(llmctl_turbo, CUDA, m) { TURBO_REGISTER_OPS(m); }
#endif

}  // namespace turbo
