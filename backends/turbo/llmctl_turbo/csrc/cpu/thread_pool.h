// turbo's CPU threads: a small pool whose parallel loops never wait for a thread that has
// not started, so a machine busy with other work slows a step down but does not stall it.
//
// Why not OpenMP (at::parallel_for): an OpenMP region ends at a barrier every thread must
// reach, and its loop is split into one share per thread. When another process keeps a
// core busy, one of our threads is descheduled for a whole time slice (milliseconds), and
// every region of the step waits for it: turbo's step ran 20-86x slower beside one busy
// process. Here a loop is cut into more chunks than threads; each thread first takes the
// chunks of its own share (so on a quiet machine each core streams its own slice of a
// weight matrix, step after step), then takes chunks left in other shares. The caller
// works too and returns as soon as every chunk is done: a thread that never woke up
// costs nothing, and a late one finds its share already taken. Idle workers poll briefly,
// then sleep; a loop too small to pay for waking one runs without the sleepers.
#pragma once

#include <cstdint>

namespace turbo::cpu {

// A borrowed callable `void(int64_t begin, int64_t end)`, without std::function's
// allocation.
class RangeFn {
 public:
  template <typename F>
  RangeFn(const F& f)  // NOLINT: implicit on purpose, a lambda converts to it
      : object_(&f), call_([](const void* o, int64_t b, int64_t e) {
          (*static_cast<const F*>(o))(b, e);
        }) {}
  void operator()(int64_t begin, int64_t end) const { call_(object_, begin, end); }

 private:
  const void* object_;
  void (*call_)(const void*, int64_t, int64_t);
};

// Threads used by parallel_for, the caller included. Default: torch's intra-op count.
int num_threads();
// Sets the thread count (>= 1), starting or stopping workers; not while a loop runs.
void set_num_threads(int threads);
// The most chunks parallel_for cuts a loop into (a few per thread): a caller with too few
// natural items to fill them can cut its work finer.
int64_t max_chunks();

// Wakes sleeping workers without a loop for them (they poll again, then sleep): a caller
// about to run many loops (a model step) calls it first, so that the workers are awake by
// the first loop that needs them. A wake takes tens of microseconds, and a loop too small
// to wake them (kWakeChunks) would run on the caller alone.
void wake_workers();

// Calls fn(begin, end) on consecutive ranges covering [begin, end), in parallel when the
// loop is worth it: ranges hold at least `grain` items (all in one call when the whole
// loop has fewer). Returns when every range is done. Inside a parallel loop, a nested
// parallel_for runs on the calling thread.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const RangeFn& fn);

}  // namespace turbo::cpu
