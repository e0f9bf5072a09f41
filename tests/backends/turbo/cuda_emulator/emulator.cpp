// The emulator's runtime: fibers for the threads of a block, barriers, warp exchange,
// and the few CUDA runtime calls the kernels' launchers make. See cuda_emulator.h.
//
// A fiber switch happens at every warp-wide instruction (a tensor-core kernel makes
// thousands per tile), so on x86-64 it is a few instructions of assembly that save the
// callee-saved registers and swap stacks; ucontext's swapcontext, which makes a system
// call per switch, is ten times slower and serves other CPUs.
#include <ucontext.h>

#include <cstdio>
#include <string>
#include <vector>

#include "cuda_emulator.h"

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

namespace turbo_emu {
namespace {

constexpr size_t kStackBytes = 128 * 1024;
constexpr size_t kMaxDeposit = 64;  // bytes one lane may deposit in a warp exchange

#if defined(__x86_64__)
// Saves rbp, rbx, r12-r15 on the current stack, stores the stack pointer in *save and
// continues on the stack `load` (whose top holds the same six registers and a return
// address).
extern "C" void turbo_emu_switch(void** save, void* load);
asm(R"(
  .text
  .globl turbo_emu_switch
  .type turbo_emu_switch, @function
turbo_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size turbo_emu_switch, .-turbo_emu_switch
)");

struct Context {
  void* stack_pointer = nullptr;
};

void switch_to(Context& from, Context& to) { turbo_emu_switch(&from.stack_pointer, to.stack_pointer); }

// A fresh context that starts `entry` (which must never return) on `stack`.
void start_context(Context& context, std::vector<char>& stack, void (*entry)()) {
  auto top = reinterpret_cast<uintptr_t>(stack.data() + stack.size()) & ~uintptr_t{15};
  auto* slots = reinterpret_cast<void**>(top);
  slots[-1] = nullptr;                             // entry's (never used) return address
  slots[-2] = reinterpret_cast<void*>(entry);      // where the first switch's `ret` goes
  for (int i = 3; i <= 8; ++i) slots[-i] = nullptr;  // the six saved registers
  context.stack_pointer = slots - 8;
}
#else
struct Context {
  ucontext_t context;
};

void switch_to(Context& from, Context& to) { swapcontext(&from.context, &to.context); }

void start_context(Context& context, std::vector<char>& stack, void (*entry)()) {
  getcontext(&context.context);
  context.context.uc_stack.ss_sp = stack.data();
  context.context.uc_stack.ss_size = stack.size();
  context.context.uc_link = nullptr;
  makecontext(&context.context, entry, 0);
}
#endif

enum class Wait { kNone, kBlock, kWarp };

struct AsyncCopy {
  void* dst;
  const void* src;
  int bytes;
  uint64_t group;
};

struct Fiber {
  Context context;
  std::vector<AsyncCopy> copies;  // cp.async not yet landed
  uint64_t group = 0;             // the open (uncommitted) group's number
  std::vector<char> stack = std::vector<char>(kStackBytes);
  uint3 thread;
  bool done = false;
  Wait wait = Wait::kNone;
  uint64_t wait_generation = 0;
};

struct Barrier {
  int arrived = 0;
  uint64_t generation = 0;
};

struct Block {
  std::vector<Fiber> fibers;
  Context scheduler;
  int current = 0, live = 0;
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<int> warp_live, warp_size;
  std::vector<char> deposits;  // [warp][parity][lane][kMaxDeposit]
  std::vector<char> shared;
  void (*body)(void*) = nullptr;
  void* closure = nullptr;
  bool failed = false;
};

Block block;
std::string error;
bool launch_failed = false;

int linear_thread(const uint3& t) { return t.x + blockDim.x * (t.y + blockDim.y * t.z); }

void fail(const std::string& why) {
  if (!block.failed) {
    char where[128];
    std::snprintf(where, sizeof where, " (block %u,%u,%u)", blockIdx.x, blockIdx.y, blockIdx.z);
    error = why + where;
  }
  block.failed = true;
}

// Arrive at `barrier` shared by `participants` threads; the last arrival releases it.
void arrive(Barrier& barrier, int participants, Wait kind) {
  Fiber& fiber = block.fibers[block.current];
  fiber.wait_generation = barrier.generation;
  if (++barrier.arrived == participants) {
    barrier.arrived = 0;
    ++barrier.generation;
    return;
  }
  fiber.wait = kind;
  switch_to(fiber.context, block.scheduler);
}

// A fiber's whole life: the kernel body, the bookkeeping of its exit, then back to the
// scheduler for good.
void fiber_main() {
  block.body(block.closure);
  Fiber& fiber = block.fibers[block.current];
  fiber.done = true;
  --block.live;
  const int warp = linear_thread(fiber.thread) / 32;
  --block.warp_live[warp];
  if (block.warp_barriers[warp].arrived > 0) {
    fail("a thread exited while others of its warp waited in a warp-wide operation");
  }
  Barrier& b = block.block_barrier;
  if (b.arrived > 0 && b.arrived == block.live) {  // exited threads no longer count
    b.arrived = 0;
    ++b.generation;
  }
  switch_to(fiber.context, block.scheduler);
}

bool runnable(const Fiber& fiber) {
  if (fiber.done) return false;
  switch (fiber.wait) {
    case Wait::kNone:
      return true;
    case Wait::kBlock:
      return block.block_barrier.generation != fiber.wait_generation;
    case Wait::kWarp:
      return block.warp_barriers[linear_thread(fiber.thread) / 32].generation !=
             fiber.wait_generation;
  }
  return false;
}

void run_block(size_t shared_bytes) {
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  const int warps = (threads + 31) / 32;
  if (static_cast<int>(block.fibers.size()) < threads) block.fibers.resize(threads);
  block.live = threads;
  block.failed = false;
  block.block_barrier = Barrier{};
  block.warp_barriers.assign(warps, Barrier{});
  block.warp_live.assign(warps, 0);
  block.warp_size.assign(warps, 0);
  block.deposits.assign(static_cast<size_t>(warps) * 2 * 32 * kMaxDeposit, 0);
  block.shared.assign(shared_bytes, static_cast<char>(0xff));  // unwritten floats read as NaN
  for (int i = 0; i < threads; ++i) {
    Fiber& fiber = block.fibers[i];
    fiber.thread = make_uint3(i % blockDim.x, (i / blockDim.x) % blockDim.y,
                              i / (blockDim.x * blockDim.y));
    fiber.done = false;
    fiber.wait = Wait::kNone;
    fiber.copies.clear();
    fiber.group = 0;
    ++block.warp_live[i / 32];
    ++block.warp_size[i / 32];
    start_context(fiber.context, fiber.stack, fiber_main);
  }
  while (block.live > 0 && !block.failed) {
    bool progressed = false;
    for (int i = 0; i < threads && !block.failed; ++i) {
      Fiber& fiber = block.fibers[i];
      if (!runnable(fiber)) continue;
      fiber.wait = Wait::kNone;
      block.current = i;
      threadIdx = fiber.thread;
      switch_to(block.scheduler, fiber.context);
      progressed = true;
    }
    if (!progressed && block.live > 0) {
      fail("deadlock: threads wait at barriers that the others never reach");
    }
  }
}

}  // namespace

bool run_grid(dim3 grid, dim3 threads, size_t shared_bytes, void (*body)(void*), void* closure) {
  gridDim = grid;
  blockDim = threads;
  block.body = body;
  block.closure = closure;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = make_uint3(x, y, z);
        run_block(shared_bytes);
        if (block.failed) {
          launch_failed = true;
          return false;
        }
      }
    }
  }
  return true;
}

const char* last_error() { return error.c_str(); }

void* dynamic_shared() { return block.shared.data(); }

int lane_id() { return linear_thread(threadIdx) % 32; }

void sync_threads() { arrive(block.block_barrier, block.live, Wait::kBlock); }

void warp_exchange(const void* mine, void* all, size_t bytes) {
  const int warp = linear_thread(threadIdx) / 32, lane = lane_id();
  if (block.warp_live[warp] != block.warp_size[warp]) {
    fail("a warp-wide operation after some lanes of the warp exited");
    trap();
  }
  Barrier& barrier = block.warp_barriers[warp];
  const int parity = static_cast<int>(barrier.generation % 2);
  char* slots = block.deposits.data() + (static_cast<size_t>(warp) * 2 + parity) * 32 * kMaxDeposit;
  std::memcpy(slots + lane * kMaxDeposit, mine, bytes);
  arrive(barrier, block.warp_size[warp], Wait::kWarp);
  for (int i = 0; i < block.warp_size[warp]; ++i) {
    std::memcpy(static_cast<char*>(all) + i * bytes, slots + i * kMaxDeposit, bytes);
  }
}

void async_copy(void* dst, const void* src, int bytes) {
  Fiber& fiber = block.fibers[block.current];
  fiber.copies.push_back({dst, src, bytes, fiber.group});
}

void async_commit() { ++block.fibers[block.current].group; }

void async_wait(int pending) {
  Fiber& fiber = block.fibers[block.current];
  std::vector<AsyncCopy> still;
  for (const AsyncCopy& copy : fiber.copies) {
    if (copy.group + pending < fiber.group) {  // committed, and not among the newest
      if (copy.bytes > 0) std::memcpy(copy.dst, copy.src, copy.bytes);
      std::memset(static_cast<char*>(copy.dst) + copy.bytes, 0, 16 - copy.bytes);
    } else {
      still.push_back(copy);
    }
  }
  fiber.copies.swap(still);
}

void trap() {
  fail("__trap() in a kernel");
  Fiber& fiber = block.fibers[block.current];
  fiber.done = true;
  switch_to(fiber.context, block.scheduler);
  __builtin_unreachable();
}

}  // namespace turbo_emu

// The CUDA runtime calls of the launchers.
extern "C" {

cudaError_t cudaGetLastError(void) {
  const bool failed = turbo_emu::launch_failed;
  turbo_emu::launch_failed = false;
  return failed ? cudaErrorLaunchFailure : cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void*, enum cudaFuncAttribute, int) { return cudaSuccess; }

// For the tests: the message of the last failed launch.
const char* turbo_emulator_last_error(void) { return turbo_emu::last_error(); }
}
