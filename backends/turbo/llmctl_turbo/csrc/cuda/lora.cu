// Multi-LoRA on CUDA: each adapted token's output row of a linear layer gets
// B[slot] @ (A[slot] @ x) added after the base linear wrote it (punica's BGMV, with the
// segment reuse of its SGMV where neighbouring rows share an adapter).
//
// Two kernels, as the CPU pass (../cpu/lora_kernels.h):
// - shrink: h[t, j] = A[slot_t, j] . x[t] (fp32), one warp per kRanks rank rows of A,
//   lanes striding the input features, summed by warp shuffles;
// - expand: out[t, col] += h[t, part's ranks] . Bt[slot_t, :, col], one thread per output
//   column (coalesced B loads and out stores), summed over the rank in a register, one
//   rounding to the output dtype.
// Each block serves a tile of kMaxRows consecutive token rows and, within it, one slot at
// a time: the rows of a tile that share a slot (a prompt chunk's tokens all do) read that
// slot's A or B once. The slots come per token from a device int32 array (-1: the base
// model, left untouched), never sorted or read on the host, so the launch shapes depend
// on the token count alone and a CUDA graph can capture the pass. A slot at or past
// num_slots traps (a launch failure) instead of reading another tensor's memory.
//
// Ranks are not bounded by anything here: the rank loops are plain loops, not register
// arrays, so any max_lora_rank works.
#include "common.cuh"

namespace turbo_cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
// Rank rows of A per warp (shrink). One: a decode step has few rows, so more warps fill
// more of the GPU, and the registers left keep 4 iterations of loads in flight (with 2
// rows and 4 iterations ptxas spills).
constexpr int kRanks = 1;
constexpr int kMaxRows = 8;    // token rows per tile (a block serves one tile)
constexpr int kColumns = 128;  // output columns per block (expand), one per thread

// The tile's slots (-1 past its last row), and whether row g is the first of its slot:
// a row whose slot an earlier row of the tile has is served with that row.
struct TileSlots {
  int32_t slot[kMaxRows];

  __device__ void load(const int32_t* slots, int64_t first_row, int tile_rows,
                       int64_t num_slots) {
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      slot[r] = r < tile_rows ? slots[first_row + r] : -1;
      if (slot[r] >= num_slots) __trap();  // not one of the slots: never a silent wrong sum
    }
  }

  __device__ bool leads(int g) const {
    if (slot[g] < 0) return false;
#pragma unroll
    for (int j = 0; j < kMaxRows; ++j) {
      if (j < g && slot[j] == slot[g]) return false;
    }
    return true;
  }
};

// Grid: (rank tiles of kWarpsPerBlock * kRanks, row tiles of kMaxRows).
template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarp)
    lora_shrink_kernel(float* h, int64_t h_stride, const T* x, int64_t x_stride,
                       const float* a, const int32_t* slots, int64_t num_slots, int64_t rows,
                       int64_t hr, int64_t in_features) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t first_rank = (static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp) * kRanks;
  const int64_t first_row = static_cast<int64_t>(blockIdx.y) * kMaxRows;
  const int tile_rows = static_cast<int>(min(static_cast<int64_t>(kMaxRows), rows - first_row));
  if (first_rank >= hr) return;  // whole warps only: the shuffles below stay full
  const int tile_ranks = static_cast<int>(min(static_cast<int64_t>(kRanks), hr - first_rank));
  TileSlots tile;
  tile.load(slots, first_row, tile_rows, num_slots);

#pragma unroll
  for (int g = 0; g < kMaxRows; ++g) {
    if (!tile.leads(g)) continue;  // the same for every lane: the warp stays converged
    const int32_t slot = tile.slot[g];
    const float* as = a + (static_cast<int64_t>(slot) * hr + first_rank) * in_features;
    float acc[kMaxRows][kRanks] = {};
    // Unrolled so that several iterations' loads are in flight at once: a decode step
    // has few blocks, and each would otherwise wait out one load latency per iteration.
#pragma unroll 4
    for (int64_t k = lane; k < in_features; k += kWarp) {
      float w[kRanks];
#pragma unroll
      for (int f = 0; f < kRanks; ++f) w[f] = f < tile_ranks ? as[f * in_features + k] : 0.f;
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        if (tile.slot[r] != slot) continue;
        const float xv = to_float(x[(first_row + r) * x_stride + k]);
#pragma unroll
        for (int f = 0; f < kRanks; ++f) acc[r][f] += xv * w[f];
      }
    }
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (tile.slot[r] != slot) continue;
#pragma unroll
      for (int f = 0; f < kRanks; ++f) {
        const float sum = warp_sum(acc[r][f]);
        if (lane == 0 && f < tile_ranks) h[(first_row + r) * h_stride + first_rank + f] = sum;
      }
    }
  }
}

// The output parts of one fused linear (q/k/v, gate/up): part p's columns of Bt are
// b_offset[p] .. b_offset[p] + size[p] - 1 (the parts side by side), written to out's
// columns out_offset[p] ..; its ranks are h's columns p * rank .. p * rank + rank - 1.
struct LoraParts {
  int64_t out_offset[TURBO_CUDA_LORA_MAX_PARTS];
  int64_t b_offset[TURBO_CUDA_LORA_MAX_PARTS];
  int num_parts;
};

// Grid: (column tiles of kColumns over all parts, row tiles of kMaxRows).
template <typename T>
__global__ void __launch_bounds__(kColumns)
    lora_expand_kernel(T* out, int64_t out_stride, const float* h, int64_t h_stride,
                       const float* bt, const int32_t* slots, int64_t num_slots, int64_t rows,
                       int64_t rank, int64_t columns, LoraParts parts) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColumns + threadIdx.x;
  const int64_t first_row = static_cast<int64_t>(blockIdx.y) * kMaxRows;
  const int tile_rows = static_cast<int>(min(static_cast<int64_t>(kMaxRows), rows - first_row));
  if (col >= columns) return;  // no barriers or shuffles below
  // The column's part: the last one starting at or before it (unrolled, so the parts
  // stay in registers).
  int64_t out_col = col, h_col = 0;
#pragma unroll
  for (int p = 0; p < TURBO_CUDA_LORA_MAX_PARTS; ++p) {
    if (p < parts.num_parts && col >= parts.b_offset[p]) {
      out_col = parts.out_offset[p] + (col - parts.b_offset[p]);
      h_col = p * rank;
    }
  }
  const float* hp = h + h_col;
  TileSlots tile;
  tile.load(slots, first_row, tile_rows, num_slots);

#pragma unroll
  for (int g = 0; g < kMaxRows; ++g) {
    if (!tile.leads(g)) continue;
    const int32_t slot = tile.slot[g];
    const float* bs = bt + static_cast<int64_t>(slot) * rank * columns + col;
    float acc[kMaxRows] = {};
#pragma unroll 4
    for (int64_t r = 0; r < rank; ++r) {
      const float b = bs[r * columns];
#pragma unroll
      for (int q = 0; q < kMaxRows; ++q) {
        if (tile.slot[q] == slot) acc[q] += hp[(first_row + q) * h_stride + r] * b;
      }
    }
#pragma unroll
    for (int q = 0; q < kMaxRows; ++q) {
      if (tile.slot[q] != slot) continue;
      T* o = out + (first_row + q) * out_stride + out_col;
      *o = from_float<T>(to_float(*o) + acc[q]);
    }
  }
}

}  // namespace
}  // namespace turbo_cuda

using namespace turbo_cuda;

extern "C" cudaError_t turbo_cuda_lora_shrink(int dtype, float* h, int64_t h_stride,
                                              const void* x, int64_t x_stride, const float* a,
                                              const int32_t* slots, int64_t num_slots,
                                              int64_t rows, int64_t hr, int64_t in_features,
                                              cudaStream_t stream) {
  if (rows == 0 || hr == 0) return cudaSuccess;
  const dim3 grid(blocks_for(hr, kWarpsPerBlock * kRanks), blocks_for(rows, kMaxRows));
  TURBO_CUDA_DISPATCH(
      dtype, TURBO_LAUNCH(lora_shrink_kernel<T>, grid, kWarpsPerBlock * kWarp, 0, stream)(
                 h, h_stride, static_cast<const T*>(x), x_stride, a, slots, num_slots, rows,
                 hr, in_features));
}

extern "C" cudaError_t turbo_cuda_lora_expand(int dtype, void* out, int64_t out_stride,
                                              const float* h, int64_t h_stride,
                                              const float* bt, const int32_t* slots,
                                              int64_t num_slots, int64_t rows, int64_t rank,
                                              int64_t num_parts, const int64_t* out_offsets,
                                              const int64_t* sizes, cudaStream_t stream) {
  if (num_parts < 1 || num_parts > TURBO_CUDA_LORA_MAX_PARTS) return cudaErrorInvalidValue;
  LoraParts parts{};
  parts.num_parts = static_cast<int>(num_parts);
  int64_t columns = 0;
  for (int64_t p = 0; p < num_parts; ++p) {
    parts.out_offset[p] = out_offsets[p];
    parts.b_offset[p] = columns;
    columns += sizes[p];
  }
  if (rows == 0 || columns == 0 || rank == 0) return cudaSuccess;
  const dim3 grid(blocks_for(columns, kColumns), blocks_for(rows, kMaxRows));
  TURBO_CUDA_DISPATCH(
      dtype, TURBO_LAUNCH(lora_expand_kernel<T>, grid, kColumns, 0, stream)(
                 static_cast<T*>(out), out_stride, h, h_stride, bt, slots, num_slots, rows,
                 rank, columns, parts));
}
