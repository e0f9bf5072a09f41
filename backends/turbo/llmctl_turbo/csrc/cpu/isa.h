// The instruction sets turbo's CPU kernels are compiled for, and the one they use.
//
// The row kernels (cpu/row_kernels.h) are compiled once per instruction set in
// cpu_kernels.cpp (AVX-512 and AVX2 on x86-64, plus portable code for any CPU), so one
// build runs everywhere; the entry points pick the best this CPU supports, once, at run
// time. Tests and benchmarks may select a lower one to check every variant.
#pragma once

#include <string>

namespace turbo::cpu {

// kAvx512Vnni: AVX-512 with its 8-bit dot products (the GGUF block kernels use them).
enum class Isa { kPortable, kAvx2, kAvx512, kAvx512Vnni };

// The instruction set the kernels use now (default: the best this CPU supports).
Isa active_isa();
const char* isa_name(Isa isa);
// Selects one by name ("avx512vnni", "avx512", "avx2", "portable"); refuses one this CPU lacks.
void set_isa(const std::string& name);

}  // namespace turbo::cpu
