// Paged decode attention: one query token per sequence, split-K over the context
// (flash-decoding).
//
// Decode reads each sequence's whole K/V every step and does little arithmetic per byte,
// so the kernels are shaped around reading the cache at full bandwidth:
// - one thread block per (split, KV head, sequence) serves every query head of its KV
//   head (up to kMaxGroup; a larger GQA group takes several blocks), so a K/V row is read
//   once per step, not once per query head;
// - every cache read is 16 bytes;
// - the context is cut into splits so that a small batch still fills all SMs; a split
//   writes its output normalised by its own softmax sum, with its (max, sum), and a
//   second kernel combines the splits of a sequence by those weights.
// Two split kernels share that plan, the workspace and the combine kernel:
// - decode_tensor_core_kernel (bf16 / fp16 on sm_80+, what turbo runs on a modern GPU):
//   the block's heads are the rows of an mma tile, each warp streams its own K/V tiles
//   through a cp.async ring; little arithmetic per byte, so it stays memory-bound;
// - decode_split_kernel (SIMT: fp32, older GPUs): two passes over the split's tokens, K
//   (scores of all heads into shared memory, kUnroll loads in flight per thread), a
//   softmax over the stored scores, then V; no barrier inside either loop.
//
// Layouts (see ../kernels.h): q and out [num_seqs, H, D] with strided rows; the cache
// [num_blocks, block_size, KVH, D]; block_tables [num_seqs, table_stride]. A sequence of
// context length 0 (the padding of a CUDA-graph batch) gets a zero output.
#include <algorithm>

#include "common.cuh"
#include "ptx.cuh"

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

// What one block of a split kernel computes: query heads [first_head, first_head + heads)
// of KV head kv_head, over tokens [start, start + count) of sequence seq's context.
struct SplitWork {
  int seq, kv_head, first_head, heads, split, start, count;
  bool only_split;  // the sequence's only split: the block writes the output itself
};

// This block's work (grid: split, KV head x head block, sequence); false when it has none,
// its split starting past the context. A context of length 0 (the padding of a
// CUDA-graph batch) gets a zero output here.
template <typename T>
__device__ bool find_split_work(const DecodeParams<T>& p, SplitWork& w) {
  w.split = blockIdx.x;
  w.kv_head = blockIdx.y / p.head_blocks;
  w.first_head = w.kv_head * p.group + (blockIdx.y % p.head_blocks) * p.heads_per_block;
  w.heads = min(p.heads_per_block, (w.kv_head + 1) * p.group - w.first_head);
  w.seq = blockIdx.z;
  const int context = p.context_lens[w.seq];
  const int per_split = split_tokens(context, p.num_splits);
  w.start = w.split * per_split;
  if (context == 0 && w.split == 0) {
    for (int i = threadIdx.x; i < w.heads * p.head_dim; i += kThreads) {
      p.out[w.seq * p.out_stride + static_cast<int64_t>(w.first_head) * p.head_dim + i] =
          from_float<T>(0.f);
    }
  }
  if (w.start >= context) return false;  // a shorter context uses fewer splits
  if (per_split > p.max_split) __trap();  // context_lens beyond max_context: invalid input
  w.count = min(context - w.start, per_split);
  w.only_split = per_split >= context;
  return true;
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

  SplitWork w;
  if (!find_split_work(p, w)) return;
  const int seq = w.seq, kv_head = w.kv_head, first_head = w.first_head, heads = w.heads;
  const int split = w.split, start = w.start, count = w.count;
  const bool only_split = w.only_split;

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

// The split kernel on tensor cores (bf16 / fp16, sm_80+). The block's query heads are the
// rows of one 16-row mma tile (rows past `heads` are zero); each warp streams its own
// 16-token K/V tiles (tiles warp, warp + kWarps, ...) through a two-stage cp.async ring
// in shared memory, so one tile loads while the previous one is multiplied, with no
// block-wide barrier in the loop; S = Q K^T and O += P V are mma.m16n8k16 with fp32
// accumulation and an online softmax in between. At the end the warps' (max, sum, O) are
// combined in shared memory, and the block writes its split's result like the SIMT
// kernel. Per byte of K/V this takes about a sixth of the SIMT kernel's instructions.
template <typename T, int kHeadDimPad>
__global__ void __launch_bounds__(kThreads) decode_tensor_core_kernel(const DecodeParams<T> p) {
  constexpr int kChunks = kHeadDimPad / 8;         // 16-byte chunks per row
  constexpr int kTile = 16;                        // tokens per K/V tile
  constexpr int kTileChunks = kTile * kChunks;     // chunks in one K (or V) tile
  constexpr int kStages = 2;
  constexpr int kRows = 16;                        // mma rows: the block's query heads
  static_assert(kMaxGroup <= kRows, "a block's heads fit one mma tile");
  TURBO_DYNAMIC_SHARED(uint4, shared);
  uint4* q_tile = shared;                          // [kRows][kChunks]
  uint4* stages = q_tile + kRows * kChunks;        // [warp][stage][K, V][kTile][kChunks]

  SplitWork w;
  if (!find_split_work(p, w)) return;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, t = lane % 4;            // this lane's rows g, g + 8; columns 2t, 2t+1
  const int32_t* table = p.block_tables + w.seq * p.table_stride;

  for (int c = threadIdx.x; c < kRows * kChunks; c += kThreads) {
    const int r = c / kChunks, chunk = c % kChunks;
    const bool valid = r < w.heads && chunk * 8 < p.head_dim;
    const T* src = valid ? p.q + w.seq * p.q_stride +
                               static_cast<int64_t>(w.first_head + r) * p.head_dim + chunk * 8
                         : p.q;
    cp_async_16(q_tile + swizzled<kChunks>(r, chunk), src, valid);
  }
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  // Tile `tile` of the split (tokens start + 16 tile ...) into this warp's stage `stage`;
  // tokens past the split and dims past head_dim are zero.
  uint4* my_stages = stages + warp * kStages * 2 * kTileChunks;
  auto load_tile = [&](int tile, int stage) {
    uint4* k_dst = my_stages + stage * 2 * kTileChunks;
    uint4* v_dst = k_dst + kTileChunks;
    const int first = w.start + tile * kTile;
    // A tile inside one KV block (always, for block sizes that are multiples of 16): one
    // block-table lookup for all its tokens.
    const bool one_block = p.block_size.div(first) == p.block_size.div(first + kTile - 1);
    const int64_t first_row = one_block ? cache_row(table, first, p.block_size) : 0;
    for (int c = lane; c < kTileChunks; c += kWarp) {
      const int r = c / kChunks, chunk = c % kChunks;
      const bool valid = tile * kTile + r < w.count && chunk * 8 < p.head_dim;
      int64_t offset = 0;
      if (valid) {
        const int64_t row = one_block ? first_row + r : cache_row(table, first + r, p.block_size);
        offset = (row * p.num_kv_heads + w.kv_head) * p.head_dim + chunk * 8;
      }
      cp_async_16(k_dst + swizzled<kChunks>(r, chunk), p.k_cache + offset, valid);
      cp_async_16(v_dst + swizzled<kChunks>(r, chunk), p.v_cache + offset, valid);
    }
  };

  float o[kHeadDimPad / 8][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  const int num_tiles = (w.count + kTile - 1) / kTile;
  if (warp < num_tiles) load_tile(warp, 0);
  cp_async_commit();
  for (int tile = warp, n = 0; tile < num_tiles; tile += kWarps, ++n) {
    if (tile + kWarps < num_tiles) load_tile(tile + kWarps, (n + 1) % kStages);
    cp_async_commit();             // (an empty group at the end keeps the count right)
    cp_async_wait_all_but_newest();  // this tile's group has landed
    __syncwarp();                  // ...for every lane's copies
    const uint4* k_tile = my_stages + (n % kStages) * 2 * kTileChunks;
    const uint4* v_tile = k_tile + kTileChunks;

    // S = Q K^T: 16 rows x 16 tokens, as two 8-token n-blocks.
    float s[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < kHeadDimPad / 16; ++kk) {
      uint32_t a[4], b[4];
      ldmatrix_x4(a, q_tile + swizzled<kChunks>(lane % 16, 2 * kk + lane / 16));
      ldmatrix_x4(b, k_tile + swizzled<kChunks>(lane % 8 + 8 * (lane / 16), 2 * kk + (lane / 8) % 2));
      mma_16816<T>(s[0], a, b[0], b[1]);
      mma_16816<T>(s[1], a, b[2], b[3]);
    }
    // Online softmax; element e of s[nb] is row g + 8 (e / 2), token nb * 8 + 2t + e % 2.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool inside = tile * kTile + nb * 8 + 2 * t + e % 2 < w.count;
        s[nb][e] = inside ? s[nb][e] * p.scale_log2 : -INFINITY;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], s[nb][e]);
      }
    }
    float correction[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // the 4 lanes of a quad share a row
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
      const float new_max = fmaxf(row_max[i], tile_max[i]);  // finite: the tile has a token
      correction[i] = exp2f(row_max[i] - new_max);
      row_max[i] = new_max;
      row_sum[i] *= correction[i];
    }
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nb][e] = exp2f(s[nb][e] - row_max[e / 2]);
        row_sum[e / 2] += s[nb][e];  // this lane's columns; the quad is summed at the end
      }
    }
    // O = O * correction + P V, P being the S accumulators repacked as an A fragment.
    const uint32_t a[4] = {pack_pair<T>(s[0][0], s[0][1]), pack_pair<T>(s[0][2], s[0][3]),
                           pack_pair<T>(s[1][0], s[1][1]), pack_pair<T>(s[1][2], s[1][3])};
#pragma unroll
    for (int db = 0; db < kHeadDimPad / 16; ++db) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        o[2 * db + j][0] *= correction[0];
        o[2 * db + j][1] *= correction[0];
        o[2 * db + j][2] *= correction[1];
        o[2 * db + j][3] *= correction[1];
      }
      uint32_t b[4];
      ldmatrix_x4_trans(b, v_tile + swizzled<kChunks>(lane % 8 + 8 * ((lane / 8) % 2),
                                                      2 * db + lane / 16));
      mma_16816<T>(o[2 * db], a, b[0], b[1]);
      mma_16816<T>(o[2 * db + 1], a, b[2], b[3]);
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
  }

  // Combine the warps: their O, max and sum through shared memory (the stages are free).
  cp_async_wait_all();
  __syncthreads();
  float* warp_out = reinterpret_cast<float*>(stages);        // [kWarps][kRows][kHeadDimPad]
  float* warp_stats = warp_out + kWarps * kRows * kHeadDimPad;  // [kWarps][kRows][max, sum]
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = g + 8 * i;
    float* dst = warp_out + (warp * kRows + row) * kHeadDimPad + 2 * t;
#pragma unroll
    for (int db = 0; db < kHeadDimPad / 8; ++db) {
      dst[db * 8] = o[db][2 * i];
      dst[db * 8 + 1] = o[db][2 * i + 1];
    }
    if (t == 0) {
      warp_stats[(warp * kRows + row) * 2] = row_max[i];
      warp_stats[(warp * kRows + row) * 2 + 1] = row_sum[i];
    }
  }
  __syncthreads();
  const int64_t stats_base =
      (static_cast<int64_t>(w.seq) * p.num_heads + w.first_head) * p.num_splits;
  for (int i = threadIdx.x; i < w.heads * p.head_dim; i += kThreads) {
    const int h = i / p.head_dim, dim = i % p.head_dim;
    float max_score = -INFINITY;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) max_score = fmaxf(max_score, warp_stats[(v * kRows + h) * 2]);
    float sum = 0.f, acc = 0.f;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) {  // a warp without tiles has max -inf: weight 0
      const float weight = exp2f(warp_stats[(v * kRows + h) * 2] - max_score);
      sum += weight * warp_stats[(v * kRows + h) * 2 + 1];
      acc += weight * warp_out[(v * kRows + h) * kHeadDimPad + dim];
    }
    if (w.only_split) {
      p.out[w.seq * p.out_stride + static_cast<int64_t>(w.first_head + h) * p.head_dim + dim] =
          from_float<T>(acc / sum);
    } else {
      const int64_t part = stats_base + h * p.num_splits + w.split;
      p.partial_out[part * p.head_dim + dim] = acc / sum;
      if (dim == 0) {
        p.partial_stats[part * 2] = max_score;
        p.partial_stats[part * 2 + 1] = sum;
      }
    }
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

template <typename T>
cudaError_t launch_combine(const DecodeParams<T>& p, int num_seqs, cudaStream_t stream) {
  if (p.num_splits > 1) {
    const auto combine_kernel = decode_combine_kernel<T>;
    TURBO_LAUNCH(combine_kernel, dim3(p.num_heads, num_seqs), kCombineThreads,
                 p.num_splits * sizeof(float), stream)(p);
  }
  return cudaGetLastError();
}

template <typename T, int kHeadDimPad, int kGroup>
cudaError_t launch_simt(const DecodeParams<T>& p, int num_seqs, cudaStream_t stream) {
  const dim3 grid(p.num_splits, p.num_kv_heads * p.head_blocks, num_seqs);
  const size_t shared = static_cast<size_t>(p.max_split) * kGroup * sizeof(float);
  const auto split_kernel = decode_split_kernel<T, kHeadDimPad, kGroup>;
  TURBO_LAUNCH(split_kernel, grid, kThreads, shared, stream)(p);
  return launch_combine(p, num_seqs, stream);
}

template <typename T, int kHeadDimPad>
cudaError_t launch_simt_for_group(const DecodeParams<T>& p, int padded_heads, int num_seqs,
                                  cudaStream_t stream) {
  switch (padded_heads) {
    case 1:
      return launch_simt<T, kHeadDimPad, 1>(p, num_seqs, stream);
    case 2:
      return launch_simt<T, kHeadDimPad, 2>(p, num_seqs, stream);
    case 4:
      return launch_simt<T, kHeadDimPad, 4>(p, num_seqs, stream);
    case 8:
      return launch_simt<T, kHeadDimPad, 8>(p, num_seqs, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename T, int kHeadDimPad>
cudaError_t launch_tensor_cores(const DecodeParams<T>& p, int num_seqs, cudaStream_t stream) {
  constexpr int kChunks = kHeadDimPad / 8;
  // The Q tile and each warp's two stages of a 16-token K and V tile, 16-byte chunks.
  constexpr int kShared = (16 * kChunks + kWarps * 2 * 2 * 16 * kChunks) * 16;
  const auto kernel = decode_tensor_core_kernel<T, kHeadDimPad>;
  // Above 48 KiB a kernel must opt in; once per kernel and process is enough.
  static const cudaError_t opted_in = cudaFuncSetAttribute(
      reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
      kShared);
  if (opted_in != cudaSuccess) return opted_in;
  const dim3 grid(p.num_splits, p.num_kv_heads * p.head_blocks, num_seqs);
  TURBO_LAUNCH(kernel, grid, kThreads, kShared, stream)(p);
  return launch_combine(p, num_seqs, stream);
}

template <typename T>
cudaError_t run(const DecodeParams<T>& p, int padded_heads, int num_seqs, bool tensor_cores,
                cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (tensor_cores) {
      if (p.head_dim <= 64) return launch_tensor_cores<T, 64>(p, num_seqs, stream);
      if (p.head_dim <= 128) return launch_tensor_cores<T, 128>(p, num_seqs, stream);
      return launch_tensor_cores<T, 256>(p, num_seqs, stream);
    }
  }
  if (p.head_dim <= 64) return launch_simt_for_group<T, 64>(p, padded_heads, num_seqs, stream);
  if (p.head_dim <= 128) return launch_simt_for_group<T, 128>(p, padded_heads, num_seqs, stream);
  return launch_simt_for_group<T, 256>(p, padded_heads, num_seqs, stream);
}

template <typename T>
cudaError_t run_decode(void* out, int64_t out_stride, const void* q, int64_t q_stride,
                       const void* k_cache, const void* v_cache, const int32_t* block_tables,
                       int64_t table_stride, const int32_t* context_lens, int64_t num_seqs,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, int64_t max_context, float scale, int num_splits,
                       void* workspace, bool tensor_cores, cudaStream_t stream) {
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
  return run<T>(p, blocks.padded, static_cast<int>(num_seqs), tensor_cores, stream);
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
    float scale, int num_splits, void* workspace, int use_tensor_cores, cudaStream_t stream) {
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
                               false, stream);
    case TURBO_BFLOAT16:
      return run_decode<__nv_bfloat16>(out, out_stride, q, q_stride, k_cache, v_cache,
                                       block_tables, table_stride, context_lens, num_seqs,
                                       num_heads, num_kv_heads, head_dim, block_size,
                                       max_context, scale, num_splits, workspace,
                                       use_tensor_cores != 0, stream);
    case TURBO_FLOAT16:
      return run_decode<__half>(out, out_stride, q, q_stride, k_cache, v_cache, block_tables,
                                table_stride, context_lens, num_seqs, num_heads, num_kv_heads,
                                head_dim, block_size, max_context, scale, num_splits,
                                workspace, use_tensor_cores != 0, stream);
    default:
      return cudaErrorInvalidValue;
  }
}
