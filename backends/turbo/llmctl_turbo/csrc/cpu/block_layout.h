// The packed layouts of GGUF block weights (quantization=gguf) on the CPU: which GGML type
// packs into which layout, and the byte arithmetic that pack_gguf_weight (cpu_kernels.cpp),
// the block kernels (cpu/block_kernels.h) and the weight checks (checks.cpp) share.
// Plain constants, no instructions: safe to include outside the instruction-set namespaces.
#pragma once

#include <cstdint>

#include "../kernels.h"

namespace turbo {

// One layout per block-kernel instantiation. Every layout is panels of kPanelWidth output
// features, K in blocks of 32 inputs whose quants are one of two grids (block_kernels.h):
// 4-bit (two weights a byte) or 8-bit (one a byte).
enum BlockLayout : int {
  kLayoutQ4 = 0,   // Q4_1: per 32-block fp16 d, c; 4-bit q
  kLayoutQ8 = 1,   // Q5_0, Q5_1: per 32-block fp16 d, c; 8-bit q (and Q8_0's, joined to them)
  kLayoutQ4K = 2,  // Q4_K: super-blocks of 256 (below); 4-bit q
  kLayoutQ5K = 3,  // Q5_K: super-blocks; 5-bit q, one a byte
  kLayoutQ6K = 4,  // Q6_K: super-blocks; 6-bit q, one a byte, two 16-input halves a block
  kLayoutQ4Z = 5,  // Q4_0: per 32-block fp16 d alone, c = -8 d implied; 4-bit q
  kLayoutQ8Z = 6,  // Q8_0: per 32-block fp16 d alone, c = -128 d implied; 8-bit q up to 255
};
constexpr int kLastLayout = kLayoutQ8Z;

constexpr int64_t kGgufSuperBlock = 256;            // inputs per K-quant super-block
constexpr int64_t kSuperSubBlocks = kGgufSuperBlock / kGgufBlock;  // 8 blocks of 32

// A K-quant super-block of one panel, 256 inputs x 16 features, keeps the file's factored
// scales (so that it stays near the file's size, and exact: D * sc is at most 11 x 8
// significant bits, exact in fp32 where the kernel multiplies it):
//   fp16 D[16], and (Q4_K, Q5_K) fp16 M[16] = -Dmin           64 bytes (Q6_K: 32)
//   per block j of 8: uint8 s0[16], s1[16]                     8 x 32 bytes
//     Q4_K, Q5_K: s0 = the 6-bit scale, s1 = the 6-bit min:  w = D s0 q + M s1
//     Q6_K: int8 scales of the block's two 16-input halves:  w = D s_half (q - 32)
//   8 blocks of quants, the 4-bit or 8-bit grid               8 x 256 or 8 x 512 bytes
constexpr bool is_super_layout(int layout) {
  return layout == kLayoutQ4K || layout == kLayoutQ5K || layout == kLayoutQ6K;
}
constexpr int layout_quant_bits(int layout) {
  return layout == kLayoutQ4 || layout == kLayoutQ4K || layout == kLayoutQ4Z ? 4 : 8;
}
// A symmetric type's zero point (w = d (q - zero)), which its layout leaves out of the
// blocks: the kernel subtracts zero * sum(xq) from its integer sums. Stored as c, it cost
// Q8_0 half a bit per weight (9 bits against the file's 8.5), a step's bytes being what
// batch-1 decode waits for. 0: the layout stores c.
constexpr int layout_zero_point(int layout) {
  return layout == kLayoutQ4Z ? 8 : (layout == kLayoutQ8Z ? 128 : 0);
}
// Bytes of a (not super) block's scales: fp16 d[16], and c[16] unless implied.
constexpr int64_t layout_scale_bytes(int layout) {
  return layout_zero_point(layout) ? kGgufScaleBytes / 2 : kGgufScaleBytes;
}
constexpr int64_t layout_quant_bytes(int layout) {
  return kGgufBlock * kPanelWidth * layout_quant_bits(layout) / 8;
}
constexpr int64_t kSubScaleBytes = 2 * kPanelWidth;  // s0[16], s1[16]
constexpr int64_t super_header_bytes(int layout) {
  return layout == kLayoutQ6K ? kPanelWidth * 2 : 2 * kPanelWidth * 2;
}
constexpr int64_t super_block_bytes(int layout) {
  return super_header_bytes(layout) +
         kSuperSubBlocks * (kSubScaleBytes + layout_quant_bytes(layout));
}
// Bytes per 32 inputs of a panel: the last dimension of a packed weight
// [panels, K / 32, bytes], distinct for every layout (so the kernels tell them apart).
constexpr int64_t packed_block_bytes(int layout) {
  return is_super_layout(layout) ? super_block_bytes(layout) / kSuperSubBlocks
                                 : layout_scale_bytes(layout) + layout_quant_bytes(layout);
}
static_assert(packed_block_bytes(kLayoutQ4) == 320 && packed_block_bytes(kLayoutQ8) == 576 &&
              packed_block_bytes(kLayoutQ4K) == 296 && packed_block_bytes(kLayoutQ5K) == 552 &&
              packed_block_bytes(kLayoutQ6K) == 548 && packed_block_bytes(kLayoutQ4Z) == 288 &&
              packed_block_bytes(kLayoutQ8Z) == 544);

// The layout a packed weight's last dimension names (-1: none).
constexpr int layout_of_packed_bytes(int64_t bytes) {
  for (int layout = kLayoutQ4; layout <= kLastLayout; ++layout) {
    if (packed_block_bytes(layout) == bytes) return layout;
  }
  return -1;
}

// The layout a GGML type packs into (-1: no kernel for it). With `offsets`, Q4_0 and Q8_0
// pack with their c stored (the layouts of Q4_1 and Q5_0), so that they join parts of
// those types in one fused matrix.
constexpr int layout_of_ggml_type(int64_t ggml_type, bool offsets = false) {
  switch (ggml_type) {
    case kGgmlQ4_0:
      return offsets ? kLayoutQ4 : kLayoutQ4Z;
    case kGgmlQ8_0:
      return offsets ? kLayoutQ8 : kLayoutQ8Z;
    case kGgmlQ4_1:
      return kLayoutQ4;
    case kGgmlQ5_0:
    case kGgmlQ5_1:
      return kLayoutQ8;
    case kGgmlQ4_K:
      return kLayoutQ4K;
    case kGgmlQ5_K:
      return kLayoutQ5K;
    case kGgmlQ6_K:
      return kLayoutQ6K;
  }
  return -1;
}

}  // namespace turbo
