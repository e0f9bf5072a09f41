#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TURBO_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define TURBO_CPU_RELAX() asm volatile("yield")
#else
#define TURBO_CPU_RELAX() ((void)0)
#endif

namespace turbo::cpu {
namespace {

// Chunks per thread: enough that a late thread's share can be taken over in pieces.
constexpr int64_t kChunksPerThread = 4;
// How long an idle worker keeps polling before it sleeps: long enough to span the gap
// between two loops of a step (microseconds), short enough not to hold a core another
// thread needs (another process, or torch's own OpenMP threads beside turbo's op in the
// torch backend). Between steps workers sleep; the caller starts without them.
constexpr auto kSpinTime = std::chrono::microseconds(50);

// Grains of work (a few microseconds each) a loop needs for a sleeping worker to be woken.
// Waking one takes tens of microseconds here (a futex wake; in a VM, an interrupt to a
// halted vCPU): the torch backend's attention of a 16-sequence decode step took 58 µs on
// two threads when the worker slept between its calls, 26 µs on one. Loops come back to
// back in turbo's own step, where the workers still poll; in the torch backend, Python
// runs between them and the workers sleep (docs/benchmarks.md).
constexpr int64_t kWakeChunks = 8;

thread_local bool inside_loop = false;

// A claim cursor: the generation of the loop it belongs to (32 bits), the end of its share
// and the next unclaimed chunk (16 bits each), in one word so that one compare-and-swap
// checks all three.
constexpr int kIndexBits = 16;
constexpr uint64_t kIndexMask = (uint64_t{1} << kIndexBits) - 1;

uint64_t pack_cursor(uint64_t generation, int64_t share_end, int64_t next) {
  return (generation << (2 * kIndexBits)) | (static_cast<uint64_t>(share_end) << kIndexBits) |
         static_cast<uint64_t>(next);
}

struct alignas(64) Cursor {
  std::atomic<uint64_t> word{0};
};

// One parallel loop. Two are kept (by generation parity): a thread that read a stale
// cursor fails its compare-and-swap, so it never runs a chunk of a loop that is over.
struct Loop {
  const RangeFn* fn = nullptr;
  int64_t begin = 0, end = 0, chunk = 0, num_chunks = 0;
};

class ThreadPool {
 public:
  ~ThreadPool() { stop_workers(); }

  int num_threads() {
    ensure_started();
    return num_threads_;
  }

  int64_t max_chunks() { return num_threads() * kChunksPerThread; }

  void set_num_threads(int threads) {
    TORCH_CHECK(threads >= 1, "the CPU thread count must be at least 1, got ", threads);
    TORCH_CHECK(!inside_loop, "cannot change the CPU thread count inside a parallel loop");
    std::lock_guard<std::mutex> lock(busy_);
    stop_workers();
    start_workers(threads);
  }

  void wake_workers() {
    ensure_started();
    // Only while no loop runs: a new generation mid-loop would hide the next loop's
    // generation from workers that saw this one.
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (!lock.owns_lock() || inside_loop || sleepers_.load(std::memory_order_seq_cst) == 0) return;
    // A generation without a loop: its cursors are stale, so a worker claims nothing.
    generation_.fetch_add(1, std::memory_order_seq_cst);
    generation_.notify_all();
  }

  void parallel_for(int64_t begin, int64_t end, int64_t grain, const RangeFn& fn) {
    const int64_t items = end - begin;
    if (items <= 0) return;
    ensure_started();
    const int64_t most_chunks = (items + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1);
    // At most kChunksPerThread per thread (thread counts are far below the cursor's 2^16).
    int64_t num_chunks = std::min<int64_t>(most_chunks, max_chunks());
    // Serial: nothing to split, one thread, a nested loop, or another caller already
    // using the pool (two engines in one process).
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    // A loop of fewer than kWakeChunks grains leaves sleeping workers asleep: the caller
    // runs it with the workers still polling, or alone when all sleep.
    const bool small = most_chunks < kWakeChunks;
    if (num_chunks <= 1 || num_threads_ == 1 || inside_loop || !lock.owns_lock() ||
        (small && sleepers_.load(std::memory_order_seq_cst) == num_threads_ - 1)) {
      fn(begin, end);
      return;
    }
    const int64_t chunk = (items + num_chunks - 1) / num_chunks;
    num_chunks = (items + chunk - 1) / chunk;

    const uint32_t generation = generation_.load(std::memory_order_relaxed) + 1;
    Loop& loop = loops_[generation & 1];
    loop = Loop{&fn, begin, end, chunk, num_chunks};
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    for (int s = 0; s < num_threads_; ++s) {
      cursors_[s].word.store(pack_cursor(generation, share_begin(s + 1, num_chunks),
                                         share_begin(s, num_chunks)),
                             std::memory_order_release);
    }
    generation_.store(generation, std::memory_order_seq_cst);
    if (!small && sleepers_.load(std::memory_order_seq_cst) > 0) generation_.notify_all();

    work(0, generation);
    // Wait for chunks other threads are still running (never for a thread that has not
    // claimed one). Yield now and then: the thread we wait for may need this core.
    for (int spins = 0; done_.load(std::memory_order_acquire) < num_chunks; ++spins) {
      if (spins % 64 == 63) {
        std::this_thread::yield();
      } else {
        TURBO_CPU_RELAX();
      }
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  int64_t share_begin(int slot, int64_t num_chunks) const {
    return num_chunks * slot / num_threads_;
  }

  void ensure_started() {
    std::call_once(started_, [this] {
      if (num_threads_ == 0) start_workers(std::max(1, at::get_num_threads()));
    });
  }

  void start_workers(int threads) {
    num_threads_ = threads;
    cursors_ = std::make_unique<Cursor[]>(threads);
    stop_ = false;
    for (int slot = 1; slot < threads; ++slot) {
      workers_.emplace_back([this, slot] { worker_main(slot); });
    }
  }

  void stop_workers() {
    if (workers_.empty()) return;
    stop_.store(true);
    generation_.fetch_add(1);
    generation_.notify_all();
    for (auto& worker : workers_) worker.join();
    workers_.clear();
  }

  void worker_main(int slot) {
    uint32_t seen = generation_.load();
    while (!stop_.load(std::memory_order_relaxed)) {
      const uint32_t generation = wait_for_new_generation(seen);
      if (stop_.load(std::memory_order_relaxed)) return;
      seen = generation;
      work(slot, generation);
    }
  }

  uint32_t wait_for_new_generation(uint32_t seen) {
    const auto deadline = std::chrono::steady_clock::now() + kSpinTime;
    for (int spins = 0;; ++spins) {
      const uint32_t now = generation_.load(std::memory_order_acquire);
      if (now != seen) return now;
      if (spins % 64 == 63) {
        if (std::chrono::steady_clock::now() > deadline) break;
        std::this_thread::yield();  // a thread waiting for this core gets it
      } else {
        TURBO_CPU_RELAX();
      }
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    generation_.wait(seen, std::memory_order_seq_cst);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return generation_.load(std::memory_order_acquire);
  }

  // Runs chunks of loop `generation`: this slot's share first, then what is left of the
  // others' shares.
  void work(int slot, uint64_t generation) {
    inside_loop = true;
    for (int i = 0; i < num_threads_; ++i) {
      const int from = (slot + i) % num_threads_;
      int64_t index;
      while (claim(from, generation, index)) run_chunk(loops_[generation & 1], index);
    }
    inside_loop = false;
  }

  bool claim(int slot, uint64_t generation, int64_t& index) {
    std::atomic<uint64_t>& word = cursors_[slot].word;
    uint64_t cursor = word.load(std::memory_order_acquire);
    while (true) {
      const uint64_t next = cursor & kIndexMask;
      const uint64_t share_end = (cursor >> kIndexBits) & kIndexMask;
      if ((cursor >> (2 * kIndexBits)) != generation || next >= share_end) return false;
      if (word.compare_exchange_weak(cursor, cursor + 1, std::memory_order_acq_rel)) {
        index = static_cast<int64_t>(next);
        return true;
      }
    }
  }

  void run_chunk(const Loop& loop, int64_t index) {
    const int64_t begin = loop.begin + index * loop.chunk;
    try {
      (*loop.fn)(begin, std::min(loop.end, begin + loop.chunk));
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_lock_);
      if (!error_) error_ = std::current_exception();
    }
    done_.fetch_add(1, std::memory_order_release);
  }

  std::once_flag started_;
  std::mutex busy_;  // held by the thread running a parallel loop
  int num_threads_ = 0;
  std::vector<std::thread> workers_;
  std::unique_ptr<Cursor[]> cursors_;
  Loop loops_[2];
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex error_lock_;
  std::exception_ptr error_;
};

ThreadPool& pool() {
  static ThreadPool instance;
  return instance;
}

}  // namespace

int num_threads() { return pool().num_threads(); }

void set_num_threads(int threads) { pool().set_num_threads(threads); }

int64_t max_chunks() { return pool().max_chunks(); }

void wake_workers() { pool().wake_workers(); }

void parallel_for(int64_t begin, int64_t end, int64_t grain, const RangeFn& fn) {
  pool().parallel_for(begin, end, grain, fn);
}

}  // namespace turbo::cpu
