// Paged decode attention: one query token per sequence, split-K over the context
// (flash-decoding).
//
// Decode reads each sequence's whole K/V every step and does little arithmetic per byte,
// so the kernel is shaped around reading the cache at full bandwidth:
// - one thread block per (split, KV head, sequence) serves every query head of its KV
//   head (up to kMaxGroup; a larger GQA group takes several blocks), so a K/V row is read
//   once per step, not once per query head;
// - every cache read is a 16-byte vector, kUnroll of them in flight per thread;
// - the context is cut into splits so that a small batch still fills all SMs; a split
//   writes its output normalised by its own softmax sum, with its (max, sum), and a
//   second kernel combines the splits of a sequence by those weights.
// A split makes two passes over its tokens: K (scores of all heads into shared memory),
// a softmax over the stored scores, then V (the weighted sum). Keeping a split's scores,
// rather than an online softmax tile by tile, leaves no barrier inside either loop.
//
// Layouts (see ../kernels.h): q and out [num_seqs, H, D] with strided rows; the cache
// [num_blocks, block_size, KVH, D]; block_tables [num_seqs, table_stride]. A sequence of
// context length 0 (the padding of a CUDA-graph batch) gets a zero output.
#include <algorithm>

#include "common.cuh"

namespace turbo_cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarp;
constexpr int kMaxGroup = 8;             // query heads per block
constexpr int kUnroll = 4;               // 16-byte loads in flight per thread
constexpr int kSplitGranule = 32;        // split lengths are multiples of this
constexpr int kMinSplitTokens = 128;     // shorter splits cost more to combine than they gain
constexpr int kScoreBytes = 32 * 1024;   // shared memory for one split's scores, all heads
constexpr int kTargetBlocksPerSm = 32;   // several waves, so the last (partial) one is short
constexpr int kCombineThreads = 64;

// How the query heads of one KV head are spread over blocks: `count` blocks of `heads`
// heads each (the last may have fewer), computed as `padded` (a power of two) heads.
struct HeadBlocks {
  int count, heads, padded;
};

HeadBlocks head_blocks_for(int64_t group) {
  const int count = static_cast<int>(ceil_div(group, kMaxGroup));
  const int heads = static_cast<int>(ceil_div(group, count));
  int padded = 1;
  while (padded < heads) padded *= 2;
  return {count, heads, padded};
}

// The longest split whose scores fit in kScoreBytes.
int max_split_tokens(int padded_heads) {
  return kScoreBytes / (4 * padded_heads) / kSplitGranule * kSplitGranule;
}

// Tokens per split of a `context`-token sequence. The same function sizes shared memory on
// the host (for max_context) and cuts each sequence on the device (for its own length).
__host__ __device__ inline int split_tokens(int context, int num_splits) {
  const int even = (context + num_splits - 1) / num_splits;
  const int rounded = (even + kSplitGranule - 1) / kSplitGranule * kSplitGranule;
  return rounded > kMinSplitTokens ? rounded : kMinSplitTokens;
}

template <typename T>
struct DecodeParams : PagedAttentionArgs<T> {
  float* partial_out;    // [num_seqs, num_heads, num_splits, head_dim]
  float* partial_stats;  // [num_seqs, num_heads, num_splits, 2]: max (base 2), sum
  int heads_per_block, head_blocks;
  int num_splits, max_split;  // max_split: tokens the scores buffer holds
};

// The dot products of kGroup heads, each spread over the kLanes lanes of a token, summed
// with a transposing butterfly: at each step a lane keeps half of its heads and trades
// the other half with its partner, so kGroup heads cost kGroup - 1 shuffles (plus one per
// remaining lane bit) instead of kGroup * log2(kLanes). Lane l ends with the sum of head
// head_of_lane(l).
template <int kGroup, int kLanes>
__device__ __forceinline__ float sum_over_lanes(float (&dots)[kGroup], int lane) {
#pragma unroll
  for (int half = kGroup / 2, offset = 1; half >= 1; half /= 2, offset *= 2) {
    const bool upper = lane & offset;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? dots[i] : dots[i + half];
      const float keep = upper ? dots[i + half] : dots[i];
      dots[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
    }
  }
  float sum = dots[0];
#pragma unroll
  for (int offset = kGroup; offset < kLanes; offset *= 2) {
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  }
  return sum;
}

// The head whose sum sum_over_lanes leaves in `lane`: lane bit 0 chose the upper half of
// the heads, bit 1 the upper half of that, and so on.
template <int kGroup>
__device__ __forceinline__ int head_of_lane(int lane) {
  int head = 0;
#pragma unroll
  for (int weight = kGroup / 2, bit = 1; weight >= 1; weight /= 2, bit *= 2) {
    if (lane & bit) head += weight;
  }
  return head;
}

template <typename T, int kHeadDimPad, int kGroup>
__global__ void __launch_bounds__(kThreads) decode_split_kernel(const DecodeParams<T> p) {
  constexpr int kVec = kVecElems<T>;
  // K pass: a token's row is read by kLanes lanes, kVecsPerLane vectors each.
  constexpr int kRowVecs = kHeadDimPad / kVec;
  constexpr int kLanes = kRowVecs < kWarp ? kRowVecs : kWarp;
  constexpr int kVecsPerLane = kRowVecs / kLanes;
  constexpr int kTokensPerWarp = kWarp / kLanes;
  // V pass: warp w owns dims [w, w + 1) * kWarpDims; a token's slice takes kLanesV lanes.
  constexpr int kWarpDims = kHeadDimPad / kWarps;
  constexpr int kLanesV = kWarpDims / kVec;
  constexpr int kTokensPerWarpV = kWarp / kLanesV;
  static_assert(kLanes >= kGroup, "the transposing sum needs a lane per head");
  static_assert(kLanesV >= 1 && kWarpDims % kVec == 0, "a warp's dims are whole vectors");

  TURBO_DYNAMIC_SHARED(float, scores);  // [max_split][kGroup]: scores, then probabilities
  __shared__ float head_max[kGroup], head_sum[kGroup];

  const int split = blockIdx.x;
  const int kv_head = blockIdx.y / p.head_blocks;
  const int first_head = kv_head * p.group + (blockIdx.y % p.head_blocks) * p.heads_per_block;
  const int heads = min(p.heads_per_block, (kv_head + 1) * p.group - first_head);
  const int seq = blockIdx.z;
  const int context = p.context_lens[seq];
  const int per_split = split_tokens(context, p.num_splits);
  const int start = split * per_split;
  if (context == 0 && split == 0) {  // padding of a CUDA-graph batch: attends to nothing
    for (int i = threadIdx.x; i < heads * p.head_dim; i += kThreads) {
      p.out[seq * p.out_stride + static_cast<int64_t>(first_head) * p.head_dim + i] =
          from_float<T>(0.f);
    }
  }
  if (start >= context) return;  // a shorter context uses fewer splits (whole block exits)
  if (per_split > p.max_split) __trap();  // context_lens beyond max_context: invalid input
  const int count = min(context - start, per_split);
  const bool only_split = per_split >= context;  // then write the output directly

  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int32_t* table = p.block_tables + seq * p.table_stride;
  const int64_t row_elems = static_cast<int64_t>(p.num_kv_heads) * p.head_dim;
  const T* k_head = p.k_cache + static_cast<int64_t>(kv_head) * p.head_dim;
  const T* v_head = p.v_cache + static_cast<int64_t>(kv_head) * p.head_dim;
  const uint4 zero = make_uint4(0, 0, 0, 0);

  // ---- K pass: scores[i][h] = q_h . k_i * scale * log2(e)
  {
    const int k_lane = lane % kLanes, k_token = lane / kLanes;
    float q[kGroup][kVecsPerLane][kVec];
#pragma unroll
    for (int h = 0; h < kGroup; ++h) {
#pragma unroll
      for (int v = 0; v < kVecsPerLane; ++v) {
        const int dim = (k_lane + v * kLanes) * kVec;
        const bool present = h < heads && dim < p.head_dim;
        const T* src = p.q + seq * p.q_stride + static_cast<int64_t>(first_head + h) * p.head_dim;
        unpack<T>(present ? load16(src + dim) : zero, q[h][v]);
#pragma unroll
        for (int e = 0; e < kVec; ++e) q[h][v][e] *= p.scale_log2;
      }
    }
    const int my_head = head_of_lane<kGroup>(k_lane);
    constexpr int kRound = kWarps * kTokensPerWarp * kUnroll;
    for (int i0 = 0; i0 < count; i0 += kRound) {  // the same trip count for every lane
      uint4 keys[kUnroll][kVecsPerLane];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + (u * kWarps + warp) * kTokensPerWarp + k_token;
        const T* row = i < count ? k_head + cache_row(table, start + i, p.block_size) * row_elems
                                 : nullptr;
#pragma unroll
        for (int v = 0; v < kVecsPerLane; ++v) {
          const int dim = (k_lane + v * kLanes) * kVec;
          keys[u][v] = row != nullptr && dim < p.head_dim ? load16(row + dim) : zero;
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float dots[kGroup] = {};
#pragma unroll
        for (int v = 0; v < kVecsPerLane; ++v) {
          float k[kVec];
          unpack<T>(keys[u][v], k);
#pragma unroll
          for (int h = 0; h < kGroup; ++h) {
#pragma unroll
            for (int e = 0; e < kVec; ++e) dots[h] += q[h][v][e] * k[e];
          }
        }
        const float score = sum_over_lanes<kGroup, kLanes>(dots, k_lane);
        const int i = i0 + (u * kWarps + warp) * kTokensPerWarp + k_token;
        if (k_lane < kGroup && i < count) scores[i * kGroup + my_head] = score;
      }
    }
  }
  __syncthreads();

  // ---- Softmax of each head over the split (not yet divided by the sum).
  for (int h = warp; h < heads; h += kWarps) {
    float max_score = -INFINITY;
    for (int i = lane; i < count; i += kWarp) max_score = fmaxf(max_score, scores[i * kGroup + h]);
    max_score = warp_max(max_score);
    float sum = 0.f;
    for (int i = lane; i < count; i += kWarp) {
      const float e = exp2f(scores[i * kGroup + h] - max_score);
      scores[i * kGroup + h] = e;
      sum += e;
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      head_max[h] = max_score;
      head_sum[h] = sum;
    }
  }
  __syncthreads();

  // ---- V pass: acc[h] = sum_i p[i][h] * v_i over this warp's dims.
  const int v_lane = lane % kLanesV, v_token = lane / kLanesV;
  const int dim = warp * kWarpDims + v_lane * kVec;
  const bool has_dims = dim < p.head_dim;
  float acc[kGroup][kVec] = {};
  constexpr int kRoundV = kTokensPerWarpV * kUnroll;
  for (int i0 = 0; i0 < count; i0 += kRoundV) {
    uint4 values[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u * kTokensPerWarpV + v_token;
      values[u] = has_dims && i < count
                      ? load16(v_head + cache_row(table, start + i, p.block_size) * row_elems + dim)
                      : zero;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u * kTokensPerWarpV + v_token;
      if (i >= count) break;
      float v[kVec];
      unpack<T>(values[u], v);
#pragma unroll
      for (int h = 0; h < kGroup; ++h) {
        const float prob = scores[i * kGroup + h];
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[h][e] += prob * v[e];
      }
    }
  }
  // The warp's token groups each summed different tokens: add them up in lanes v_token 0.
#pragma unroll
  for (int offset = kLanesV; offset < kWarp; offset *= 2) {
#pragma unroll
    for (int h = 0; h < kGroup; ++h) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[h][e] += __shfl_xor_sync(0xffffffffu, acc[h][e], offset);
    }
  }

  const int64_t stats_base = (static_cast<int64_t>(seq) * p.num_heads + first_head) * p.num_splits;
  if (v_token == 0 && has_dims) {
#pragma unroll
    for (int h = 0; h < kGroup; ++h) {
      if (h >= heads) break;
      const float inv_sum = 1.f / head_sum[h];
      float o[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) o[e] = acc[h][e] * inv_sum;
      if (only_split) {
        store16(p.out + seq * p.out_stride + static_cast<int64_t>(first_head + h) * p.head_dim + dim,
                pack<T>(o));
      } else {
        float* dst = p.partial_out + (stats_base + h * p.num_splits + split) * p.head_dim + dim;
#pragma unroll
        for (int e = 0; e < kVec; e += 4) {
          *reinterpret_cast<float4*>(dst + e) = make_float4(o[e], o[e + 1], o[e + 2], o[e + 3]);
        }
      }
    }
  }
  if (!only_split && threadIdx.x < heads) {
    float* stats = p.partial_stats + (stats_base + threadIdx.x * p.num_splits + split) * 2;
    stats[0] = head_max[threadIdx.x];
    stats[1] = head_sum[threadIdx.x];
  }
}

// One block per (query head, sequence): out = sum_s w_s o_s / sum_s w_s, with
// w_s = sum_s * 2^(max_s - max) over the sequence's splits.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads) decode_combine_kernel(const DecodeParams<T> p) {
  TURBO_DYNAMIC_SHARED(float, weights);  // [num_splits]
  __shared__ float total;
  const int head = blockIdx.x, seq = blockIdx.y;
  const int context = p.context_lens[seq];
  const int per_split = split_tokens(context, p.num_splits);
  const int splits = (context + per_split - 1) / per_split;
  if (splits <= 1) return;  // its only split wrote the output
  const int64_t base = (static_cast<int64_t>(seq) * p.num_heads + head) * p.num_splits;
  const float* stats = p.partial_stats + base * 2;
  if (threadIdx.x < kWarp) {
    const int lane = threadIdx.x;
    float max_score = -INFINITY;
    for (int s = lane; s < splits; s += kWarp) max_score = fmaxf(max_score, stats[2 * s]);
    max_score = warp_max(max_score);
    float sum = 0.f;
    for (int s = lane; s < splits; s += kWarp) {
      const float w = stats[2 * s + 1] * exp2f(stats[2 * s] - max_score);
      weights[s] = w;
      sum += w;
    }
    sum = warp_sum(sum);
    if (lane == 0) total = sum;
  }
  __syncthreads();
  const float inv_total = 1.f / total;
  T* out = p.out + seq * p.out_stride + static_cast<int64_t>(head) * p.head_dim;
  for (int dim = threadIdx.x * 4; dim < p.head_dim; dim += kCombineThreads * 4) {
    float acc[4] = {};
    for (int s = 0; s < splits; ++s) {
      const float4 o = *reinterpret_cast<const float4*>(p.partial_out + (base + s) * p.head_dim + dim);
      acc[0] += weights[s] * o.x;
      acc[1] += weights[s] * o.y;
      acc[2] += weights[s] * o.z;
      acc[3] += weights[s] * o.w;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) out[dim + e] = from_float<T>(acc[e] * inv_total);
  }
}

template <typename T, int kHeadDimPad, int kGroup>
cudaError_t launch(const DecodeParams<T>& p, int num_seqs, cudaStream_t stream) {
  const dim3 grid(p.num_splits, p.num_kv_heads * p.head_blocks, num_seqs);
  const size_t shared = static_cast<size_t>(p.max_split) * kGroup * sizeof(float);
  const auto split_kernel = decode_split_kernel<T, kHeadDimPad, kGroup>;
  TURBO_LAUNCH(split_kernel, grid, kThreads, shared, stream)(p);
  if (p.num_splits > 1) {
    const auto combine_kernel = decode_combine_kernel<T>;
    TURBO_LAUNCH(combine_kernel, dim3(p.num_heads, num_seqs), kCombineThreads,
                 p.num_splits * sizeof(float), stream)(p);
  }
  return cudaGetLastError();
}

template <typename T, int kHeadDimPad>
cudaError_t launch_for_group(const DecodeParams<T>& p, int padded_heads, int num_seqs,
                             cudaStream_t stream) {
  switch (padded_heads) {
    case 1:
      return launch<T, kHeadDimPad, 1>(p, num_seqs, stream);
    case 2:
      return launch<T, kHeadDimPad, 2>(p, num_seqs, stream);
    case 4:
      return launch<T, kHeadDimPad, 4>(p, num_seqs, stream);
    case 8:
      return launch<T, kHeadDimPad, 8>(p, num_seqs, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t run(const DecodeParams<T>& p, int padded_heads, int num_seqs, cudaStream_t stream) {
  if (p.head_dim <= 64) return launch_for_group<T, 64>(p, padded_heads, num_seqs, stream);
  if (p.head_dim <= 128) return launch_for_group<T, 128>(p, padded_heads, num_seqs, stream);
  return launch_for_group<T, 256>(p, padded_heads, num_seqs, stream);
}

template <typename T>
cudaError_t run_decode(void* out, int64_t out_stride, const void* q, int64_t q_stride,
                       const void* k_cache, const void* v_cache, const int32_t* block_tables,
                       int64_t table_stride, const int32_t* context_lens, int64_t num_seqs,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, int64_t max_context, float scale, int num_splits,
                       void* workspace, cudaStream_t stream) {
  const HeadBlocks blocks = head_blocks_for(num_heads / num_kv_heads);
  DecodeParams<T> p{paged_attention_args<T>(out, out_stride, q, q_stride, k_cache, v_cache,
                                            block_tables, table_stride, context_lens, num_heads,
                                            num_kv_heads, head_dim, block_size, scale)};
  p.partial_out = static_cast<float*>(workspace);
  p.partial_stats = num_splits > 1 ? p.partial_out + num_seqs * num_heads * num_splits * head_dim
                                   : nullptr;
  p.heads_per_block = blocks.heads;
  p.head_blocks = blocks.count;
  p.num_splits = num_splits;
  p.max_split = split_tokens(static_cast<int>(max_context), num_splits);
  if (p.max_split > max_split_tokens(blocks.padded)) return cudaErrorInvalidValue;
  return run<T>(p, blocks.padded, static_cast<int>(num_seqs), stream);
}

}  // namespace
}  // namespace turbo_cuda

using namespace turbo_cuda;

extern "C" int turbo_cuda_decode_supported(int64_t head_dim) {
  return head_dim > 0 && head_dim % 8 == 0 && head_dim <= TURBO_CUDA_MAX_HEAD_DIM;
}

extern "C" int turbo_cuda_decode_num_splits(int64_t num_seqs, int64_t num_heads,
                                            int64_t num_kv_heads, int64_t max_context,
                                            int num_sms) {
  const HeadBlocks blocks = head_blocks_for(num_heads / num_kv_heads);
  const int64_t items = std::max<int64_t>(1, num_seqs * num_kv_heads * blocks.count);
  const int64_t required = ceil_div(max_context, max_split_tokens(blocks.padded));
  const int64_t wanted = ceil_div(static_cast<int64_t>(kTargetBlocksPerSm) * num_sms, items);
  const int64_t by_length = std::max<int64_t>(1, max_context / kMinSplitTokens);
  return static_cast<int>(std::max<int64_t>(required, std::min(wanted, by_length)));
}

extern "C" int64_t turbo_cuda_decode_workspace_bytes(int64_t num_seqs, int64_t num_heads,
                                                     int64_t head_dim, int num_splits) {
  if (num_splits <= 1) return 0;
  return num_seqs * num_heads * num_splits * (head_dim + 2) * static_cast<int64_t>(sizeof(float));
}

extern "C" cudaError_t turbo_cuda_paged_decode_attention(
    int dtype, void* out, int64_t out_stride, const void* q, int64_t q_stride,
    const void* k_cache, const void* v_cache, const int32_t* block_tables,
    int64_t table_stride, const int32_t* context_lens, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_context,
    float scale, int num_splits, void* workspace, cudaStream_t stream) {
  if (!turbo_cuda_decode_supported(head_dim) || num_kv_heads <= 0 ||
      num_heads % num_kv_heads != 0 || block_size <= 0 || num_splits < 1 ||
      (num_splits > 1 && workspace == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (num_seqs == 0) return cudaSuccess;
  switch (dtype) {
    case TURBO_FLOAT32:
      return run_decode<float>(out, out_stride, q, q_stride, k_cache, v_cache, block_tables,
                               table_stride, context_lens, num_seqs, num_heads, num_kv_heads,
                               head_dim, block_size, max_context, scale, num_splits, workspace,
                               stream);
    case TURBO_BFLOAT16:
      return run_decode<__nv_bfloat16>(out, out_stride, q, q_stride, k_cache, v_cache,
                                       block_tables, table_stride, context_lens, num_seqs,
                                       num_heads, num_kv_heads, head_dim, block_size,
                                       max_context, scale, num_splits, workspace, stream);
    case TURBO_FLOAT16:
      return run_decode<__half>(out, out_stride, q, q_stride, k_cache, v_cache, block_tables,
                                table_stride, context_lens, num_seqs, num_heads, num_kv_heads,
                                head_dim, block_size, max_context, scale, num_splits,
                                workspace, stream);
    default:
      return cudaErrorInvalidValue;
  }
}
