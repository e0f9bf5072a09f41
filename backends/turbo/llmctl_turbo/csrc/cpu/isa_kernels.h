// Every CPU kernel, compiled once per instruction set: cpu_kernels.cpp includes this file
// inside each instruction set's namespace, after defining kVectorWidth, kTileRows,
// kTilePanels and kVnni there. The headers are included in this order (each builds on the
// ones before it) and have no include guards on purpose.
#include "row_kernels.h"
#include "block_kernels.h"
#include "tensor_kernels.h"
#include "lora_kernels.h"
