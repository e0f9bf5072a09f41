// The GGML block types turbo's CUDA kernels read as they are stored in a GGUF file
// (quantization=gguf on CUDA, cuda/gguf_linear.cu): weights and bytes per block. Plain
// C++, no torch and no CUDA headers, so the argument checks of a CPU build, the binding
// and the kernels share one table.
#pragma once

#include <stdint.h>

namespace turbo {

struct GgufBlockType {
  int64_t ggml_type;  // GGML's type id
  int64_t weights;    // weights per block
  int64_t bytes;      // bytes per block
  const char* name;
};

// Every block size differs, so a weight's last dimension names its type.
inline constexpr GgufBlockType kCudaGgufTypes[] = {
    {8, 32, 34, "Q8_0"},   {2, 32, 18, "Q4_0"},   {3, 32, 20, "Q4_1"},
    {12, 256, 144, "Q4_K"}, {13, 256, 176, "Q5_K"}, {14, 256, 210, "Q6_K"},
};

// The type whose blocks are `block_bytes` long, or nullptr for none of them.
inline const GgufBlockType* cuda_gguf_type_of_block(int64_t block_bytes) {
  for (const GgufBlockType& type : kCudaGgufTypes) {
    if (type.bytes == block_bytes) return &type;
  }
  return nullptr;
}

}  // namespace turbo
