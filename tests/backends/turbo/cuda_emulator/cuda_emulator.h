// A small SIMT emulator that runs turbo's CUDA kernels on the CPU, for the tests.
//
// The .cu files are compiled as C++ with this header force-included (-include) and
// TURBO_CUDA_EMULATOR defined. Each CUDA thread of a block is a fiber (ucontext) on one
// OS thread; a fiber runs until it reaches a barrier (__syncthreads, or the warp-wide
// exchange behind every shuffle, ldmatrix and mma), then the next one runs. Blocks run
// one after another, so `__shared__` variables are plain statics. The tensor-core
// instructions (ldmatrix, mma.sync, cp.async) are emulated from the PTX ISA's fragment
// layouts in emulated_ptx.h.
//
// This checks a kernel's indexing, masking, barriers and arithmetic on the CPU, where a
// mistake is cheap to find; it says nothing about speed, and memory-model races that
// only real concurrency exposes are out of its reach. scripts/gpu_check.py runs the
// same kernels on a GPU.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __forceinline__ inline
#define __launch_bounds__(...)

namespace turbo_emu {

// Runs `body` on every thread of every block of the grid; false (and a message in
// last_error()) when a kernel trapped or the threads of a block deadlocked at a barrier.
bool run_grid(dim3 grid, dim3 block, size_t dynamic_shared_bytes, void (*body)(void*),
              void* closure);
const char* last_error();
void* dynamic_shared();

// Warp-wide exchange: every lane of the calling warp deposits `bytes` bytes, waits for
// the others, and gets back the deposits of all 32 lanes (lane i at out + i * bytes).
void warp_exchange(const void* mine, void* all, size_t bytes);
void sync_threads();
// The calling thread's cp.async copies: queued (`bytes` of 16 copied, the rest zeroed),
// grouped by commits, completed by a wait that leaves at most `pending` groups open.
void async_copy(void* dst, const void* src, int bytes);
void async_commit();
void async_wait(int pending);
[[noreturn]] void trap();
int lane_id();

template <typename Kernel>
struct Launch {
  Kernel kernel;
  dim3 grid, block;
  size_t shared;

  template <typename... Args>
  void operator()(const Args&... args) const {
    auto call = std::make_tuple(kernel, args...);
    auto body = [](void* closure) {
      auto& c = *static_cast<decltype(call)*>(closure);
      std::apply([](auto k, const auto&... a) { k(a...); }, c);
    };
    run_grid(grid, block, shared, body, &call);
  }
};

template <typename Kernel>
Launch<Kernel> launch(Kernel kernel, dim3 grid, dim3 block, size_t shared) {
  return {kernel, grid, block, shared};
}

template <typename T>
T shuffle(T value, int source_lane) {
  static_assert(sizeof(T) <= 8, "shuffles move up to 8 bytes");
  T all[32];
  warp_exchange(&value, all, sizeof(T));
  return all[source_lane & 31];
}

}  // namespace turbo_emu

extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;

#define TURBO_LAUNCH(kernel, grid, block, shared_bytes, stream) \
  turbo_emu::launch(kernel, dim3(grid), dim3(block), shared_bytes)
#define TURBO_DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(turbo_emu::dynamic_shared())

inline void __syncthreads() { turbo_emu::sync_threads(); }
inline void __syncwarp(unsigned = 0xffffffffu) {
  char none = 0, all[32];
  turbo_emu::warp_exchange(&none, all, 1);
}
[[noreturn]] inline void __trap() { turbo_emu::trap(); }

template <typename T>
T __shfl_xor_sync(unsigned, T value, int lane_mask, int = 32) {
  return turbo_emu::shuffle(value, turbo_emu::lane_id() ^ lane_mask);
}
template <typename T>
T __shfl_sync(unsigned, T value, int source_lane, int = 32) {
  return turbo_emu::shuffle(value, source_lane);
}
template <typename T>
T __shfl_up_sync(unsigned, T value, unsigned delta, int = 32) {
  const int lane = turbo_emu::lane_id();
  const T other = turbo_emu::shuffle(value, lane >= static_cast<int>(delta) ? lane - delta : lane);
  return lane >= static_cast<int>(delta) ? other : value;
}

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }
inline unsigned __umulhi(unsigned a, unsigned b) {
  return static_cast<unsigned>((static_cast<uint64_t>(a) * b) >> 32);
}
inline float __uint_as_float(uint32_t v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t v;
  std::memcpy(&v, &f, 4);
  return v;
}
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
// Round to nearest, ties to even: the default rounding mode of nearbyint.
inline int __float2int_rn(float x) { return static_cast<int>(std::nearbyint(x)); }
using std::exp2f;
using std::fmaxf;
using std::fminf;
