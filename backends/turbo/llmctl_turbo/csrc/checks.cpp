#include "checks.h"

#include <c10/util/StringUtil.h>

#include <string>

#include "cpu/block_layout.h"
#include "kernels.h"

namespace turbo {

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim,
                  const at::Tensor& device_of) {
  TORCH_CHECK(t.defined(), name, " is missing");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got shape ", t.sizes());
  TORCH_CHECK(t.device() == device_of.device(), name, " is on ", t.device(),
              " but the other tensors are on ", device_of.device());
}

void check_float_type(const at::Tensor& t, const char* name) {
  const auto type = t.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf,
              "turbo's kernels run in float32, bfloat16 or float16, but ", name, " is ", type);
}

void check_rows_contiguous(const at::Tensor& t, const char* name) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    TORCH_CHECK(t.size(d) == 1 || t.stride(d) == expected, name,
                ": each row (all dimensions after the first) must be contiguous; got strides ",
                t.strides(), " for shape ", t.sizes(), " (call .contiguous())");
    expected *= t.size(d);
  }
}

std::ostream& operator<<(std::ostream& out, const WeightName& weight) {
  if (weight.layer >= 0) out << "layer " << weight.layer << ": ";
  return out << weight.name;
}

namespace {

// An int8 weight's scales: contiguous float32, one per output feature (packed like the
// weight on the CPU), beside the weight.
void check_int8_scale(const at::Tensor& scale, bool scaled, WeightName name, int64_t count,
                      const at::Tensor& w) {
  TORCH_CHECK(scaled && scale.scalar_type() == at::kFloat && scale.dim() == 1 &&
                  scale.is_contiguous() && scale.device() == w.device() &&
                  scale.size(0) == count,
              name, " is int8, so its scales must be a contiguous float32 [", count, "] tensor "
              "on ", w.device(), " (one per output feature", w.dim() == 3 ? ", packed like the "
              "weight" : "", "), got ", scaled ? c10::str(scale.scalar_type(), " ", scale.sizes(),
              " on ", scale.device()) : std::string("none"));
}

}  // namespace

void check_linear_weight(const at::Tensor& w, WeightName name, const at::Tensor& like,
                         int64_t in_features, int64_t features, int64_t groups,
                         const at::Tensor& scale) {
  const bool int8 = w.scalar_type() == at::kChar;
  const bool scaled = scale.defined() && scale.numel() != 0;
  if (w.scalar_type() == at::kByte && w.is_cuda()) {  // GGUF rows as stored (kernels.h)
    const GgufBlockType* type = w.dim() == 3 ? cuda_gguf_type_of_block(w.size(2)) : nullptr;
    TORCH_CHECK(type != nullptr && w.is_contiguous() && w.device() == like.device() &&
                    w.size(0) == features && w.size(1) * type->weights == in_features,
                name, " is uint8 on CUDA, so it must be a GGUF matrix's rows as stored: a "
                "contiguous [", features, ", blocks, block bytes] tensor of Q8_0 (34), Q4_0 "
                "(18), Q4_1 (20), Q4_K (144), Q5_K (176) or Q6_K (210) blocks for ",
                in_features, " inputs on ", like.device(), ", got ", w.sizes(), " on ",
                w.device());
    TORCH_CHECK(!scaled, name, " is GGUF blocks: their scales are inside (pass none)");
    return;
  }
  if (w.scalar_type() == at::kByte) {  // GGUF blocks (pack_gguf_weight)
    const int64_t panels = groups * ((features / groups + kPanelWidth - 1) / kPanelWidth);
    const int layout = w.dim() == 3 ? layout_of_packed_bytes(w.size(2)) : -1;
    TORCH_CHECK(w.is_cpu() && like.is_cpu() && w.dim() == 3 && w.is_contiguous() &&
                    w.size(0) == panels && w.size(1) * kGgufBlock == in_features &&
                    layout >= 0 &&
                    (!is_super_layout(layout) || in_features % kGgufSuperBlock == 0),
                name, " is uint8, so it must be GGUF blocks packed by pack_gguf_weight for ",
                features, " outputs and ", in_features, " inputs in ", groups,
                " group(s), on the CPU: [", panels, ", ", in_features / kGgufBlock,
                ", block bytes], got ", w.sizes(), " on ", w.device());
    TORCH_CHECK(!scaled, name, " is GGUF blocks: their scales are inside (pass none)");
    return;
  }
  TORCH_CHECK((int8 || w.scalar_type() == like.scalar_type()) && w.device() == like.device(),
              name, " is ", w.scalar_type(), " on ", w.device(), " but must be ",
              like.scalar_type(), " (or packed int8) on ", like.device());
  TORCH_CHECK((w.dim() == 2 || w.dim() == 3) && w.size(1) == in_features, name, " must take ",
              in_features, " input features: [", features, ", ", in_features,
              "] or packed [panels, ", in_features, ", ", kPanelWidth, "], got shape ",
              w.sizes());
  TORCH_CHECK(int8 || !scaled, name, " is ", w.scalar_type(), ": scales go with int8 "
              "weights only (pass an empty tensor)");
  if (w.dim() == 2) {
    TORCH_CHECK(!int8 || w.is_cuda(), name, " is int8: on the CPU int8 weights run on "
                "turbo's CPU kernels, packed by pack_linear_weight");
    TORCH_CHECK(w.size(0) == features && w.stride(1) == 1, name, " must be a [", features,
                ", ", in_features, "] matrix with contiguous rows (row-major, as nn.Linear "
                "stores it), got shape ", w.sizes(), " and strides ", w.strides());
    if (!int8) return;
    // turbo's CUDA int8 kernel (cuda/turbo_cuda.h) reads the rows back to back.
    TORCH_CHECK(w.is_contiguous(), name, " is int8 on CUDA, so it must be contiguous");
    check_int8_scale(scale, scaled, name, features, w);
    return;
  }
  const int64_t panels = groups * ((features / groups + kPanelWidth - 1) / kPanelWidth);
  TORCH_CHECK(w.is_cpu() && w.scalar_type() != at::kHalf, "packed weights run on turbo's CPU "
              "kernels, in float32, bfloat16 or int8; ", name, " is ", w.scalar_type(), " on ",
              w.device());
  TORCH_CHECK(w.is_contiguous() && w.size(0) == panels && w.size(2) == kPanelWidth, name,
              " must be packed by pack_linear_weight for ", features, " outputs in ", groups,
              " group(s): a contiguous [", panels, ", ", in_features, ", ", kPanelWidth,
              "] tensor, got ", w.sizes());
  if (int8) check_int8_scale(scale, scaled, name, panels * kPanelWidth, w);
}

void check_cache(const at::Tensor& cache, const at::Tensor& scale, const char* name,
                 const at::Tensor& like) {
  const bool int8 = cache.defined() && cache.scalar_type() == at::kChar;
  check_tensor(cache, name, int8 ? at::kChar : like.scalar_type(), 4, like);
  TORCH_CHECK(cache.is_contiguous(), name,
              " must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]");
  check_cache_scale(cache, scale, name);
}

void check_cache_scale(const at::Tensor& cache, const at::Tensor& scale, const char* name) {
  const bool scaled = scale.defined() && scale.numel() != 0;
  if (cache.scalar_type() != at::kChar) {
    TORCH_CHECK(!scaled, name, " is ", cache.scalar_type(),
                ": scales go with an int8 cache only (pass none)");
    return;
  }
  const auto rows = cache.sizes().slice(0, cache.dim() - 1);
  TORCH_CHECK(scaled && scale.scalar_type() == at::kFloat && scale.device() == cache.device() &&
                  scale.is_contiguous() && scale.sizes() == rows,
              name, " is int8, so its scales must be a contiguous float32 ", rows, " tensor on ",
              cache.device(), " (one per token and kv head), got ",
              scaled ? c10::str(scale.scalar_type(), " ", scale.sizes(), " on ", scale.device())
                     : std::string("none"));
}

void check_batch(const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                 const at::Tensor& context_lens, int64_t num_tokens, int64_t num_blocks,
                 int64_t block_size) {
  const int64_t num_seqs = context_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1, "query_start_loc must have ",
              num_seqs + 1, " entries (num_seqs + 1), got ", query_start_loc.size(0));
  TORCH_CHECK(block_tables.size(0) == num_seqs, "block_tables must have one row per sequence (",
              num_seqs, "), got ", block_tables.size(0));
  TORCH_CHECK(block_tables.stride(1) == 1, "block_tables rows must be contiguous");
  TORCH_CHECK(query_start_loc.is_contiguous() && context_lens.is_contiguous(),
              "query_start_loc and context_lens must be contiguous");
  if (!context_lens.device().is_cpu()) return;

  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_width = block_tables.size(1);
  TORCH_CHECK(qsl[0] == 0, "query_start_loc[0] must be 0, got ", qsl[0]);
  TORCH_CHECK(qsl[num_seqs] == num_tokens, "query_start_loc[-1] must equal the number of query "
              "tokens (", num_tokens, "), got ", qsl[num_seqs]);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    TORCH_CHECK(q_len >= 1, "sequence ", b, " has no query tokens (query_start_loc must grow)");
    TORCH_CHECK(ctx[b] >= q_len, "sequence ", b, ": context_lens (", ctx[b],
                ") must include its ", q_len, " query tokens");
    const int64_t blocks = (ctx[b] + block_size - 1) / block_size;
    TORCH_CHECK(blocks <= table_width, "sequence ", b, " needs ", blocks, " blocks for ", ctx[b],
                " tokens but its block_tables row has ", table_width);
    for (int64_t i = 0; i < blocks; ++i) {
      const int32_t block = tables[b * block_tables.stride(0) + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", b, "][", i, "] = ", block,
                  " is outside the cache's ", num_blocks, " blocks");
    }
  }
}

namespace {

// Every entry of the int32 index tensor `values` (named `name`) lies in [low, high); the
// message for the first that does not ends with `before`, the bound, `after` (built only
// then: these checks run every step). Only CPU tensors are read: a device tensor's
// values would need a copy back each step.
void check_index_range(const at::Tensor& values, const char* name, int64_t low, int64_t high,
                       const char* before, int64_t bound, const char* after) {
  TORCH_CHECK(values.is_contiguous(), name, " must be contiguous");
  if (!values.device().is_cpu()) return;
  const int32_t* v = values.data_ptr<int32_t>();
  for (int64_t i = 0; i < values.size(0); ++i) {
    TORCH_CHECK(v[i] >= low && v[i] < high, name, "[", i, "] = ", v[i], before, bound, after);
  }
}

}  // namespace

void check_slots(const at::Tensor& slot_mapping, int64_t num_slots) {
  check_index_range(slot_mapping, "slot_mapping", -1, num_slots, " is outside the cache's ",
                    num_slots, " slots (-1 skips a token)");
}

void check_token_ids(const at::Tensor& input_ids, int64_t vocab_size) {
  check_index_range(input_ids, "input_ids", 0, vocab_size, " is outside the vocabulary of ",
                    vocab_size, " tokens");
}

void check_positions(const at::Tensor& positions, int64_t max_positions) {
  check_index_range(positions, "positions", 0, max_positions, " has no row in cos_sin_cache (",
                    max_positions, " positions)");
}

void check_token_indices(const at::Tensor& indices, int64_t num_tokens) {
  check_index_range(indices, "logits_indices", 0, num_tokens, " is not one of the step's ",
                    num_tokens, " tokens");
}

void check_argmax_out(const at::Tensor& argmax, int64_t rows, const at::Tensor& like) {
  check_tensor(argmax, "argmax", at::kLong, 1, like);
  TORCH_CHECK(argmax.size(0) == rows && argmax.is_contiguous(), "argmax must be a "
              "contiguous [", rows, "] tensor (one index per row of logits), got shape ",
              argmax.sizes());
}

void check_lora_weights(const at::Tensor& a, const at::Tensor& bt, WeightName name,
                        int64_t in_features, at::IntArrayRef sizes, const at::Tensor& like) {
  int64_t features = 0;
  for (int64_t size : sizes) features += size;
  const auto parts = static_cast<int64_t>(sizes.size());
  TORCH_CHECK(a.defined() && bt.defined() && a.device() == like.device() &&
                  bt.device() == like.device() && a.scalar_type() == at::kFloat &&
                  bt.scalar_type() == at::kFloat && a.is_contiguous() && bt.is_contiguous() &&
                  a.dim() == 3 && bt.dim() == 3,
              name, ": LoRA A and B must be contiguous float32 tensors [slots, parts x rank, ",
              "in] and [slots, rank, out] on ", like.device());
  // TURBO_CUDA_LORA_MAX_PARTS (cuda/turbo_cuda.h): q, k and v.
  TORCH_CHECK(!like.is_cuda() || parts <= 3, name, ": turbo's CUDA LoRA pass takes at most 3 ",
              "parts, got ", parts);
  const int64_t rank = bt.size(1);
  TORCH_CHECK(a.size(0) == bt.size(0) && a.size(1) == parts * rank && a.size(2) == in_features &&
                  bt.size(2) == features,
              name, ": LoRA A must be [slots, ", parts, " x rank, ", in_features,
              "] and B [slots, rank, ", features, "]; got ", a.sizes(), " and ", bt.sizes());
}

void check_lora_slots(const at::Tensor& token_slots, int64_t num_tokens, const at::Tensor& like) {
  TORCH_CHECK(token_slots.scalar_type() == at::kInt && token_slots.dim() == 1 &&
                  token_slots.size(0) == num_tokens && token_slots.is_contiguous() &&
                  token_slots.device() == like.device(),
              "lora_slots must be a contiguous int32 [", num_tokens, "] tensor (one slot per "
              "token, -1: none) on ", like.device(), "; got ", token_slots.scalar_type(), " ",
              token_slots.sizes(), " on ", token_slots.device());
}

void check_lora_tiles(const at::Tensor& rows, const at::Tensor& tiles, int64_t num_tokens,
                      int64_t num_slots) {
  TORCH_CHECK(rows.is_cpu() && tiles.is_cpu() && rows.scalar_type() == at::kInt &&
                  tiles.scalar_type() == at::kInt && rows.dim() == 1 && tiles.dim() == 2 &&
                  tiles.size(0) == 3 && rows.is_contiguous() && tiles.is_contiguous(),
              "lora_rows must be a contiguous int32 [n] and lora_tiles an int32 [3, tiles] "
              "CPU tensor; got ", rows.sizes(), " and ", tiles.sizes());
  const int32_t* row = rows.data_ptr<int32_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < num_tokens, "lora_rows[", i, "] = ", row[i],
                " is not one of the step's ", num_tokens, " tokens");
  }
  const int32_t* tile = tiles.data_ptr<int32_t>();
  const int64_t n = tiles.size(1);
  for (int64_t t = 0; t < n; ++t) {
    const int32_t slot = tile[t], start = tile[n + t], end = tile[2 * n + t];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "lora tile ", t, ": slot ", slot,
                " is not one of the ", num_slots, " LoRA slots");
    TORCH_CHECK(start >= 0 && start <= end && end <= rows.size(0), "lora tile ", t, ": rows ",
                start, "..", end, " are not inside lora_rows (", rows.size(0), ")");
  }
}

}  // namespace turbo
