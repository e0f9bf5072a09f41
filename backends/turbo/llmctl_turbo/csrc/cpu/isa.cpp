#include "isa.h"

#include <c10/util/Exception.h>

#include <atomic>

namespace turbo::cpu {
namespace {

bool supported(Isa isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  switch (isa) {
    case Isa::kAvx512Vnni:
      return supported(Isa::kAvx512) && __builtin_cpu_supports("avx512vnni");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma");
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::kPortable:
      return true;
  }
  return false;
#else
  return isa == Isa::kPortable;
#endif
}

Isa best_isa() {
  for (Isa isa : {Isa::kAvx512Vnni, Isa::kAvx512, Isa::kAvx2}) {
    if (supported(isa)) return isa;
  }
  return Isa::kPortable;
}

std::atomic<Isa>& selected() {
  static std::atomic<Isa> isa{best_isa()};
  return isa;
}

}  // namespace

Isa active_isa() { return selected().load(std::memory_order_relaxed); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni:
      return "avx512vnni";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kPortable:
      return "portable";
  }
  return "unknown";
}

void set_isa(const std::string& name) {
  for (Isa isa : {Isa::kAvx512Vnni, Isa::kAvx512, Isa::kAvx2, Isa::kPortable}) {
    if (name == isa_name(isa)) {
      TORCH_CHECK(supported(isa), "this CPU does not support ", name, "; the best it supports "
                  "is ", isa_name(best_isa()));
      selected().store(isa, std::memory_order_relaxed);
      return;
    }
  }
  TORCH_CHECK(false, "unknown instruction set '", name, "': use avx512vnni, avx512, avx2 or portable");
}

}  // namespace turbo::cpu
