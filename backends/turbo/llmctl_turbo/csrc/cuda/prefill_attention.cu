// Paged prefill attention on tensor cores (bfloat16 / float16), FlashAttention-2 style.
//
// One thread block computes a tile of 64 rows for one KV head, where a row is a (query
// token, query head) pair of that KV head's GQA group: the group's heads of a token are
// adjacent rows, so a K/V tile loaded once serves every head of the group. Each of the
// 4 warps owns 16 rows. Per K/V tile of kTileTokens tokens (gathered through the block
// table into shared memory with cp.async): S = Q K^T and O += P V with mma.m16n8k16
// (fp32 accumulation), an online softmax in between (base 2, running max and sum per
// row). The V tile loads while S is computed, the next K tile while O is.
//
// Sequences may mix prompt chunks after earlier cached context with single decode
// tokens (kernels.h: the queries of sequence b are its last q_len tokens). A block finds
// its (sequence, row tile) by a prefix sum over query_start_loc, so the grid needs only
// the token count, known on the host without reading the device.
#include "common.cuh"
#include "ptx.cuh"

namespace turbo_cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarp;
constexpr int kTileRows = 16 * kWarps;  // (token, head) rows per block

template <int kHeadDimPad>
constexpr int kTileTokens = kHeadDimPad <= 128 ? 64 : 32;  // K/V tile: smem and registers

template <typename T>
struct PrefillParams : PagedAttentionArgs<T> {
  const int32_t* query_start_loc;
  int num_seqs;
  FastDivmod group_size;
};

// Warp 0 finds the (sequence, row tile) of tile number `tile`: sequence b has
// ceil(q_len_b * group / kTileRows) tiles. Sets seq = -1 past the last tile.
template <typename T>
__device__ void find_tile(const PrefillParams<T>& p, int tile, int lane, int& seq, int& index) {
  if (lane == 0) seq = -1;
  __syncwarp();
  int before = 0;  // tiles of the sequences already passed
  for (int b0 = 0; b0 < p.num_seqs && before <= tile; b0 += kWarp) {
    const int b = b0 + lane;
    const int q_len = b < p.num_seqs ? p.query_start_loc[b + 1] - p.query_start_loc[b] : 0;
    const int tiles = (q_len * p.group + kTileRows - 1) / kTileRows;
    int inclusive = tiles;
#pragma unroll
    for (int offset = 1; offset < kWarp; offset *= 2) {
      const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += other;
    }
    const int first = before + inclusive - tiles;
    if (tile >= first && tile < first + tiles) {
      seq = b;
      index = tile - first;
    }
    before += __shfl_sync(0xffffffffu, inclusive, kWarp - 1);
  }
}

// Gathers tokens [first, first + kTileTokens) of one KV head into a swizzled tile;
// tokens from `end` on and dims from head_dim on are zero.
template <typename T, int kHeadDimPad>
__device__ __forceinline__ void load_kv_tile(uint4* tile, const T* cache, const int32_t* table,
                                             int first, int end, int kv_head,
                                             const PrefillParams<T>& p) {
  constexpr int kChunks = kHeadDimPad / 8;
  for (int c = threadIdx.x; c < kTileTokens<kHeadDimPad> * kChunks; c += kThreads) {
    const int r = c / kChunks, chunk = c % kChunks, token = first + r;
    const bool valid = token < end && chunk * 8 < p.head_dim;
    const T* src = cache;
    if (valid) {
      const int64_t row = cache_row(table, token, p.block_size) * p.num_kv_heads + kv_head;
      src = cache + row * p.head_dim + chunk * 8;
    }
    cp_async_16(tile + swizzled<kChunks>(r, chunk), src, valid);
  }
}

template <typename T, int kHeadDimPad>
__global__ void __launch_bounds__(kThreads) prefill_kernel(const PrefillParams<T> p) {
  constexpr int kChunks = kHeadDimPad / 8;
  constexpr int kTokens = kTileTokens<kHeadDimPad>;
  constexpr int kDimSteps = kHeadDimPad / 16;  // k-steps of S = Q K^T
  constexpr int kTokenSteps = kTokens / 16;    // k-steps of O = P V
  TURBO_DYNAMIC_SHARED(uint4, shared);
  uint4* q_tile = shared;                      // [kTileRows][kChunks]
  uint4* k_tile = q_tile + kTileRows * kChunks;  // [kTokens][kChunks]
  uint4* v_tile = k_tile + kTokens * kChunks;    // [kTokens][kChunks]
  __shared__ int tile_seq, tile_index;

  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (warp == 0) find_tile(p, blockIdx.x, lane, tile_seq, tile_index);
  __syncthreads();
  const int seq = tile_seq;
  if (seq < 0) return;  // the grid is sized for the worst case
  const int kv_head = blockIdx.y;
  const int q_begin = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - q_begin;
  const int context = p.context_lens[seq];
  const int cached = context - q_len;  // tokens before this step's queries
  const int row0 = tile_index * kTileRows;
  const int rows = min(kTileRows, q_len * p.group - row0);
  const int32_t* table = p.block_tables + seq * p.table_stride;
  const int first_head = kv_head * p.group;

  // Q tile: row r is (token, head) = divmod(row0 + r, group).
  for (int c = threadIdx.x; c < kTileRows * kChunks; c += kThreads) {
    const int r = c / kChunks, chunk = c % kChunks;
    const bool valid = r < rows && chunk * 8 < p.head_dim;
    const T* src = p.q;
    if (valid) {
      uint32_t token, head;
      p.group_size.divmod(row0 + r, token, head);
      src = p.q + (q_begin + token) * p.q_stride + (first_head + head) * p.head_dim + chunk * 8;
    }
    cp_async_16(q_tile + swizzled<kChunks>(r, chunk), src, valid);
  }
  // Keys any row of the tile sees: up to the last row's own position.
  const int first_query = cached + static_cast<int>(p.group_size.div(row0));
  const int kv_end = cached + static_cast<int>(p.group_size.div(row0 + rows - 1)) + 1;
  load_kv_tile<T, kHeadDimPad>(k_tile, p.k_cache, table, 0, kv_end, kv_head, p);
  cp_async_commit();

  // This thread's two rows (g and g + 8 of its warp's 16): the position of their query
  // (padding rows past `rows` see everything; they are never written).
  const int g = lane / 4, t = lane % 4;
  int query_pos[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp * 16 + g + 8 * i;
    query_pos[i] = r < rows ? cached + static_cast<int>(p.group_size.div(row0 + r)) : kv_end - 1;
  }
  float o[kHeadDimPad / 8][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

  const int num_kv_tiles = (kv_end + kTokens - 1) / kTokens;
  for (int j = 0; j < num_kv_tiles; ++j) {
    const int n0 = j * kTokens;
    cp_async_wait_all();
    __syncthreads();  // K_j (and Q) landed; every warp is done with V_{j-1}
    load_kv_tile<T, kHeadDimPad>(v_tile, p.v_cache, table, n0, kv_end, kv_head, p);
    cp_async_commit();

    // S = Q K^T for this warp's 16 rows and the tile's tokens.
    float s[kTokens / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < kDimSteps; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, q_tile + swizzled<kChunks>(warp * 16 + lane % 16, 2 * kk + lane / 16));
#pragma unroll
      for (int nb = 0; nb < kTokens / 16; ++nb) {
        uint32_t b[4];
        ldmatrix_x4(b, k_tile + swizzled<kChunks>(nb * 16 + lane % 8 + 8 * (lane / 16),
                                                  2 * kk + (lane / 8) % 2));
        mma_16816<T>(s[2 * nb], a, b[0], b[1]);
        mma_16816<T>(s[2 * nb + 1], a, b[2], b[3]);
      }
    }

    // Online softmax. Element e of s[nb] is row g + 8 (e / 2), token n0 + nb*8 + 2t + e%2.
    const bool on_diagonal = n0 + kTokens - 1 > first_query;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nb = 0; nb < kTokens / 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = n0 + nb * 8 + 2 * t + e % 2;
        float score = s[nb][e] * p.scale_log2;
        if (on_diagonal && key > query_pos[e / 2]) score = -INFINITY;
        s[nb][e] = score;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], score);
      }
    }
    float correction[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // the 4 lanes of a quad share a row
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
      const float new_max = fmaxf(row_max[i], tile_max[i]);  // finite: key 0 is in tile 0
      correction[i] = exp2f(row_max[i] - new_max);
      row_max[i] = new_max;
      row_sum[i] *= correction[i];
    }
#pragma unroll
    for (int nb = 0; nb < kTokens / 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nb][e] = exp2f(s[nb][e] - row_max[e / 2]);
        row_sum[e / 2] += s[nb][e];  // this lane's columns; the quad is summed at the end
      }
    }
#pragma unroll
    for (int db = 0; db < kHeadDimPad / 8; ++db) {
      o[db][0] *= correction[0];
      o[db][1] *= correction[0];
      o[db][2] *= correction[1];
      o[db][3] *= correction[1];
    }

    cp_async_wait_all();
    __syncthreads();  // V_j landed; every warp is done with K_j
    if (j + 1 < num_kv_tiles) {
      load_kv_tile<T, kHeadDimPad>(k_tile, p.k_cache, table, n0 + kTokens, kv_end, kv_head, p);
      cp_async_commit();
    }

    // O += P V: the S accumulators of two n-blocks form one A fragment of P.
#pragma unroll
    for (int kk = 0; kk < kTokenSteps; ++kk) {
      const uint32_t a[4] = {
          pack_pair<T>(s[2 * kk][0], s[2 * kk][1]), pack_pair<T>(s[2 * kk][2], s[2 * kk][3]),
          pack_pair<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
          pack_pair<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int db = 0; db < kHeadDimPad / 16; ++db) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_tile + swizzled<kChunks>(kk * 16 + lane % 8 + 8 * ((lane / 8) % 2),
                                                        2 * db + lane / 16));
        mma_16816<T>(o[2 * db], a, b[0], b[1]);
        mma_16816<T>(o[2 * db + 1], a, b[2], b[3]);
      }
    }
  }

  // out = O / sum for the valid rows; this lane holds dims 8 db + 2t, 2t + 1.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
    const int r = warp * 16 + g + 8 * i;
    if (r >= rows) continue;
    uint32_t token, head;
    p.group_size.divmod(row0 + r, token, head);
    T* dst = p.out + (q_begin + token) * p.out_stride + (first_head + head) * p.head_dim;
    const float inv_sum = 1.f / row_sum[i];
#pragma unroll
    for (int db = 0; db < kHeadDimPad / 8; ++db) {
      const int dim = db * 8 + 2 * t;
      if (dim < p.head_dim) {
        *reinterpret_cast<uint32_t*>(dst + dim) =
            pack_pair<T>(o[db][2 * i] * inv_sum, o[db][2 * i + 1] * inv_sum);
      }
    }
  }
}

template <typename T, int kHeadDimPad>
cudaError_t launch(const PrefillParams<T>& p, int64_t num_tokens, cudaStream_t stream) {
  const auto kernel = prefill_kernel<T, kHeadDimPad>;
  const int shared =
      (kTileRows + 2 * kTileTokens<kHeadDimPad>) * kHeadDimPad * static_cast<int>(sizeof(T));
  // Above 48 KiB a kernel must opt in; once per kernel and process is enough.
  static const cudaError_t opted_in =
      cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                           cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
  if (opted_in != cudaSuccess) return opted_in;
  // Every sequence's tiles: at most ceil(rows / kTileRows) + 1 each.
  const int64_t tiles = ceil_div(num_tokens * p.group, kTileRows) + p.num_seqs;
  const dim3 grid(static_cast<unsigned int>(tiles), p.num_kv_heads);
  TURBO_LAUNCH(kernel, grid, kThreads, shared, stream)(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t run_prefill(void* out, int64_t out_stride, const void* q, int64_t q_stride,
                        const void* k_cache, const void* v_cache, const int32_t* block_tables,
                        int64_t table_stride, const int32_t* query_start_loc,
                        const int32_t* context_lens, int64_t num_seqs, int64_t num_tokens,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, float scale, cudaStream_t stream) {
  PrefillParams<T> p{paged_attention_args<T>(out, out_stride, q, q_stride, k_cache, v_cache,
                                             block_tables, table_stride, context_lens, num_heads,
                                             num_kv_heads, head_dim, block_size, scale)};
  p.query_start_loc = query_start_loc;
  p.num_seqs = static_cast<int>(num_seqs);
  p.group_size = FastDivmod(static_cast<uint32_t>(p.group));
  if (head_dim <= 64) return launch<T, 64>(p, num_tokens, stream);
  if (head_dim <= 128) return launch<T, 128>(p, num_tokens, stream);
  return launch<T, 256>(p, num_tokens, stream);
}

}  // namespace
}  // namespace turbo_cuda

using namespace turbo_cuda;

extern "C" int turbo_cuda_prefill_supported(int dtype, int64_t head_dim) {
  return (dtype == TURBO_BFLOAT16 || dtype == TURBO_FLOAT16) && head_dim > 0 &&
         head_dim % 8 == 0 && head_dim <= TURBO_CUDA_MAX_HEAD_DIM;
}

extern "C" cudaError_t turbo_cuda_paged_prefill_attention(
    int dtype, void* out, int64_t out_stride, const void* q, int64_t q_stride,
    const void* k_cache, const void* v_cache, const int32_t* block_tables,
    int64_t table_stride, const int32_t* query_start_loc, const int32_t* context_lens,
    int64_t num_seqs, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, cudaStream_t stream) {
  if (!turbo_cuda_prefill_supported(dtype, head_dim) || num_kv_heads <= 0 ||
      num_heads % num_kv_heads != 0 || block_size <= 0) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0) return cudaSuccess;
  if (dtype == TURBO_BFLOAT16) {
    return run_prefill<__nv_bfloat16>(out, out_stride, q, q_stride, k_cache, v_cache,
                                      block_tables, table_stride, query_start_loc,
                                      context_lens, num_seqs, num_tokens, num_heads,
                                      num_kv_heads, head_dim, block_size, scale, stream);
  }
  return run_prefill<__half>(out, out_stride, q, q_stride, k_cache, v_cache, block_tables,
                             table_stride, query_start_loc, context_lens, num_seqs, num_tokens,
                             num_heads, num_kv_heads, head_dim, block_size, scale, stream);
}
