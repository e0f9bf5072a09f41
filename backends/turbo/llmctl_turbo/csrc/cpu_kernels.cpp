// CPU implementations of turbo's kernels: plain loops over contiguous rows that the
// compiler vectorises (-O3 -march=native), split across threads with at::parallel_for
// (OpenMP) only when there is enough work to pay for waking the threads.
//
// Arithmetic is fp32 whatever the storage type; a value transformers rounds to the
// model dtype between two ops (the residual sum, the normalised row, silu(gate)) is
// rounded here at the same place, so bf16 results follow transformers closely.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

// fp32, bf16 and fp16: the storage types turbo runs in.
#define TURBO_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)            \
  AT_DISPATCH_SWITCH(TYPE, NAME,                               \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace turbo::cpu {
namespace {

// Elements of work below which one thread does it all: waking OpenMP threads costs a few
// microseconds, as much as a thread computes in that time.
constexpr int64_t kMinWorkPerThread = 1 << 14;

int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(1, work_per_item));
}

template <typename scalar_t>
scalar_t round_to(float value) {
  return static_cast<scalar_t>(value);
}

// exp(x) for the softmax numerators (x <= 0), written so the compiler vectorises the
// loop around it (libm's expf is a call per element): x = n ln2 + r with |r| <= ln2 / 2,
// exp(r) by Cephes' degree-6 polynomial, 2^n put straight into the exponent bits.
// Relative error below 2e-7, the size of fp32 rounding.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);  // below this 2^n leaves the normal range; exp is ~0 anyway
  constexpr float kRoundingShift = 12582912.f;  // 1.5 * 2^23: adding it rounds to integer
  const float shifted = x * 1.44269504088896341f + kRoundingShift;
  const float n = shifted - kRoundingShift;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // ln2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &shifted, sizeof(bits));
  bits = (bits - 0x4B400000 + 127) << 23;  // the integer n, as a float exponent
  float two_to_n;
  std::memcpy(&two_to_n, &bits, sizeof(two_to_n));
  return p * two_to_n;
}

// Dot product in 8 independent lanes (one AVX register): a plain `sum += a[i] * b[i]`
// is one chain of dependent adds the compiler may not reorder, as slow for a 128-wide
// head as for a 16-wide one.
inline float dot(const float* a, const float* b, int64_t n) {
  constexpr int kLanes = 8;
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  }
  float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
              ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// The row as fp32: the row itself for fp32 storage, else converted into `buffer`.
template <typename scalar_t>
const float* as_float(const scalar_t* row, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(row[i]);
    return buffer;
  }
}

// ---------------------------------------------------------------------------------
// RMSNorm, optionally with the residual add fused in front.

template <typename scalar_t>
void rms_norm_rows(scalar_t* out, int64_t out_stride, const scalar_t* x, int64_t x_stride,
                   scalar_t* residual, int64_t residual_stride, const scalar_t* weight,
                   int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, grain_for(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* in = x + r * x_stride;
      if (residual != nullptr) {
        // transformers adds in the model dtype, then normalises the rounded sum.
        scalar_t* res = residual + r * residual_stride;
        for (int64_t i = 0; i < dim; ++i) {
          res[i] = round_to<scalar_t>(static_cast<float>(res[i]) + static_cast<float>(in[i]));
        }
        in = res;
      }
      float sum_sq = 0.f;
      for (int64_t i = 0; i < dim; ++i) {
        const float v = static_cast<float>(in[i]);
        sum_sq += v * v;
      }
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(dim) + eps);
      scalar_t* o = out + r * out_stride;
      for (int64_t i = 0; i < dim; ++i) {
        const float normed = static_cast<float>(round_to<scalar_t>(static_cast<float>(in[i]) * inv_rms));
        o[i] = round_to<scalar_t>(static_cast<float>(weight[i]) * normed);
      }
    }
  });
}

// ---------------------------------------------------------------------------------
// Rotary embedding, rotate-half layout: element i pairs with element i + D/2.

template <typename scalar_t>
void rotate_heads(scalar_t* row, int64_t num_heads, int64_t head_dim, const float* cos,
                  const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    scalar_t* x = row + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = static_cast<float>(x[i]);
      const float x2 = static_cast<float>(x[i + half]);
      x[i] = round_to<scalar_t>(x1 * cos[i] - x2 * sin[i]);
      x[i + half] = round_to<scalar_t>(x2 * cos[i] + x1 * sin[i]);
    }
  }
}

template <typename scalar_t>
void rotary_rows(const int32_t* positions, scalar_t* q, int64_t q_stride, int64_t num_heads,
                 scalar_t* k, int64_t k_stride, int64_t num_kv_heads, const float* cos_sin,
                 int64_t num_tokens, int64_t head_dim) {
  const int64_t work = (num_heads + num_kv_heads) * head_dim;
  at::parallel_for(0, num_tokens, grain_for(work), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cos_sin + static_cast<int64_t>(positions[t]) * head_dim;
      const float* sin = cos + head_dim / 2;
      rotate_heads(q + t * q_stride, num_heads, head_dim, cos, sin);
      rotate_heads(k + t * k_stride, num_kv_heads, head_dim, cos, sin);
    }
  });
}

// ---------------------------------------------------------------------------------
// SiLU(gate) * up

template <typename scalar_t>
void silu_and_mul_rows(scalar_t* out, int64_t out_stride, const scalar_t* gate_up,
                       int64_t in_stride, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, grain_for(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = gate_up + r * in_stride;
      const scalar_t* up = gate + width;
      scalar_t* o = out + r * out_stride;
      for (int64_t i = 0; i < width; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float act = static_cast<float>(round_to<scalar_t>(g / (1.f + std::exp(-g))));
        o[i] = round_to<scalar_t>(act * static_cast<float>(up[i]));
      }
    }
  });
}

// ---------------------------------------------------------------------------------
// Paged KV cache write

template <typename scalar_t>
void write_kv_rows(const scalar_t* key, int64_t key_stride, const scalar_t* value,
                   int64_t value_stride, scalar_t* k_cache, scalar_t* v_cache,
                   const int32_t* slots, int64_t num_tokens, int64_t row_elems) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    std::memcpy(k_cache + slot * row_elems, key + t * key_stride, row_elems * sizeof(scalar_t));
    std::memcpy(v_cache + slot * row_elems, value + t * value_stride, row_elems * sizeof(scalar_t));
  }
}

// ---------------------------------------------------------------------------------
// Paged attention. One work item is (query token, kv head): the `group` query heads that
// share a kv head read each key and value row once. Scores are kept for the whole
// context (two-pass softmax), which the context lengths served on a CPU afford.

struct AttentionShape {
  int64_t num_seqs, num_tokens, num_heads, num_kv_heads, head_dim, block_size;
  int64_t q_stride, out_stride, table_stride;
};

template <typename scalar_t>
void paged_attention_rows(scalar_t* out, const scalar_t* q, const scalar_t* k_cache,
                          const scalar_t* v_cache, const int32_t* block_tables,
                          const int32_t* query_start_loc, const int32_t* context_lens,
                          const AttentionShape& s, float scale) {
  const int64_t D = s.head_dim;
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t row_elems = s.num_kv_heads * D;  // one token of one block
  const int64_t block_elems = s.block_size * row_elems;

  std::vector<int32_t> seq_of_token(s.num_tokens);
  int64_t max_context = 1;
  for (int64_t b = 0; b < s.num_seqs; ++b) {
    for (int32_t t = query_start_loc[b]; t < query_start_loc[b + 1]; ++t) seq_of_token[t] = b;
    max_context = std::max<int64_t>(max_context, context_lens[b]);
  }

  const int64_t work_per_item = max_context * group * D * 2;
  at::parallel_for(0, s.num_tokens * s.num_kv_heads, grain_for(work_per_item),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * max_context);
    std::vector<float> q_scaled(group * D), acc(group * D), sums(group), row_buffer(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / s.num_kv_heads;
      const int64_t kv_head = item % s.num_kv_heads;
      const int64_t b = seq_of_token[t];
      const int64_t q_len = query_start_loc[b + 1] - query_start_loc[b];
      const int64_t num_keys = context_lens[b] - q_len + (t - query_start_loc[b]) + 1;
      const int32_t* table = block_tables + b * s.table_stride;
      const int64_t first_head = kv_head * group;

      for (int64_t h = 0; h < group; ++h) {
        const scalar_t* qh = q + t * s.q_stride + (first_head + h) * D;
        for (int64_t d = 0; d < D; ++d) q_scaled[h * D + d] = static_cast<float>(qh[d]) * scale;
      }

      // Pass 1: scores, block by block (no division per key).
      for (int64_t start = 0; start < num_keys; start += s.block_size) {
        const scalar_t* block = k_cache + table[start / s.block_size] * block_elems + kv_head * D;
        const int64_t count = std::min(s.block_size, num_keys - start);
        for (int64_t j = 0; j < count; ++j) {
          const float* k = as_float(block + j * row_elems, row_buffer.data(), D);
          for (int64_t h = 0; h < group; ++h) {
            scores[h * max_context + start + j] = dot(q_scaled.data() + h * D, k, D);
          }
        }
      }

      // Softmax numerators (normalised at the end).
      for (int64_t h = 0; h < group; ++h) {
        float* sh = scores.data() + h * max_context;
        float max_score = sh[0];
        for (int64_t j = 1; j < num_keys; ++j) max_score = std::max(max_score, sh[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < num_keys; ++j) {
          sh[j] = exp_nonpositive(sh[j] - max_score);
          sum += sh[j];
        }
        sums[h] = sum;
      }

      // Pass 2: weighted sum of values.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < num_keys; start += s.block_size) {
        const scalar_t* block = v_cache + table[start / s.block_size] * block_elems + kv_head * D;
        const int64_t count = std::min(s.block_size, num_keys - start);
        for (int64_t j = 0; j < count; ++j) {
          const float* v = as_float(block + j * row_elems, row_buffer.data(), D);
          for (int64_t h = 0; h < group; ++h) {
            const float p = scores[h * max_context + start + j];
            float* ah = acc.data() + h * D;
            for (int64_t d = 0; d < D; ++d) ah[d] += p * v[d];
          }
        }
      }

      for (int64_t h = 0; h < group; ++h) {
        const float inv_sum = 1.f / sums[h];
        scalar_t* oh = out + t * s.out_stride + (first_head + h) * D;
        for (int64_t d = 0; d < D; ++d) oh[d] = round_to<scalar_t>(acc[h * D + d] * inv_sum);
      }
    }
  });
}

}  // namespace

// ---------------------------------------------------------------------------------
// Tensor entry points (shapes were checked by the caller; see kernels.h).

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TURBO_DISPATCH_FLOAT_TYPES(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), x.data_ptr<scalar_t>(),
                            x.stride(0), nullptr, 0, weight.data_ptr<scalar_t>(), x.size(0),
                            x.size(1), static_cast<float>(eps));
  });
}

void add_rms_norm(at::Tensor& out, at::Tensor& residual, const at::Tensor& x,
                  const at::Tensor& weight, double eps) {
  TURBO_DISPATCH_FLOAT_TYPES(x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), x.data_ptr<scalar_t>(),
                            x.stride(0), residual.data_ptr<scalar_t>(), residual.stride(0),
                            weight.data_ptr<scalar_t>(), x.size(0), x.size(1),
                            static_cast<float>(eps));
  });
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                      const at::Tensor& cos_sin_cache) {
  TURBO_DISPATCH_FLOAT_TYPES(q.scalar_type(), "rotary_embedding", [&] {
    rotary_rows<scalar_t>(positions.data_ptr<int32_t>(), q.data_ptr<scalar_t>(), q.stride(0),
                          q.size(1), k.data_ptr<scalar_t>(), k.stride(0), k.size(1),
                          cos_sin_cache.data_ptr<float>(), q.size(0), q.size(2));
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  TURBO_DISPATCH_FLOAT_TYPES(out.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0),
                                gate_up.data_ptr<scalar_t>(), gate_up.stride(0), out.size(0),
                                out.size(1));
  });
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TURBO_DISPATCH_FLOAT_TYPES(key.scalar_type(), "write_kv_cache", [&] {
    write_kv_rows<scalar_t>(key.data_ptr<scalar_t>(), key.stride(0), value.data_ptr<scalar_t>(),
                            value.stride(0), k_cache.data_ptr<scalar_t>(),
                            v_cache.data_ptr<scalar_t>(), slot_mapping.data_ptr<int32_t>(),
                            key.size(0), key.size(1) * key.size(2));
  });
}

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                     double scale) {
  const AttentionShape shape{context_lens.size(0), q.size(0),        q.size(1),
                             k_cache.size(2),      q.size(2),        k_cache.size(1),
                             q.stride(0),          out.stride(0),    block_tables.stride(0)};
  TURBO_DISPATCH_FLOAT_TYPES(q.scalar_type(), "paged_attention", [&] {
    paged_attention_rows<scalar_t>(out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                                   k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                   block_tables.data_ptr<int32_t>(),
                                   query_start_loc.data_ptr<int32_t>(),
                                   context_lens.data_ptr<int32_t>(), shape,
                                   static_cast<float>(scale));
  });
}

}  // namespace turbo::cpu
