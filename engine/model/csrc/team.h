// The threads of one decoder step, kept together for all its kernels (decoder_layers.cpp).
//
// Why: a decode step makes ~150 threaded kernel calls (4 products and attention per layer), and
// each at::parallel_for forks torch's OpenMP threads and joins them again (~1.3 us back to back
// here, more when the helper has to be woken). In a B = 1 Q4_1 decode on the 2-core Zen 4 VM, 8%
// of the calling thread's perf samples were in libgomp. ``with_team`` forks once for the whole
// call; inside it, the kernels' ``parallel_for`` hands each helper its chunk through shared memory
// (a generation counter it spins on) and waits for its acknowledgement: a cache-line round trip,
// not a fork. Measured step by step (scripts/decoder_team_ab.py, reports/decoder-team-zen4-s39):
// B = 1 steps 1.029x faster, B = 4 1.012x, B = 16 and 32 ~1.004x, null control 1.000x; libgomp
// 3% of the caller's samples. What the caller still waits for is mostly its helper finishing the
// same share of a product later (12% longer in one perf run, 2% in another); chunks claimed first come
// first served instead of equal shares were slower (0.956x at B = 1), so the shares stay equal.
//
//   with_team(body)              body runs on the calling thread (the leader); the other threads
//                                of torch's pool serve its parallel_for calls until body returns
//   parallel_for(b, e, grain, f) in a team: [b, e) split as at::parallel_for splits it, one chunk
//                                per member, the leader's chunk on the leader; elsewhere
//                                at::parallel_for itself
//   num_threads()                the team's size in a team, else at::get_num_threads()
//
// The split is at::parallel_for's (chunks of divup(e - b, members)), so every kernel divides its
// work exactly as before; none of them depends on the split for its results anyway (the products
// compute each output column whole, attention each query row whole).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace specplan {

class Team {
 public:
  explicit Team(int64_t size) : size_(size) {}
  Team(const Team&) = delete;
  Team& operator=(const Team&) = delete;

  int64_t size() const { return size_; }

  // Leader only. f(chunk_begin, chunk_end) over [begin, end) on every member.
  template <typename F>
  void run(int64_t begin, int64_t end, int64_t grain, const F& f) {
    const int64_t range = end - begin;
    if (range <= 0) return;
    const int64_t members = std::min(size_, (range + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1));
    if (members <= 1 || busy_) {  // one chunk, or a parallel_for inside a chunk: run it here
      f(begin, end);
      return;
    }
    busy_ = true;
    begin_ = begin;
    end_ = end;
    chunk_ = (range + members - 1) / members;
    members_ = members;
    fn_ = &f;
    call_ = [](const void* fn, int64_t b, int64_t e) { (*static_cast<const F*>(fn))(b, e); };
    acks_.store(0, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);  // the job's fields are visible with it
    std::exception_ptr error;
    try {
      f(begin, std::min(end, begin + chunk_));
    } catch (...) {
      error = std::current_exception();
    }
    wait_until([&] { return acks_.load(std::memory_order_acquire) == size_ - 1; });
    busy_ = false;
    if (!error) {
      std::lock_guard<std::mutex> lock(error_lock_);
      std::swap(error, helper_error_);
    }
    if (error) std::rethrow_exception(error);
  }

  // Helper ``member`` (1 .. size - 1): serve the leader's jobs until ``stop``. Every helper
  // acknowledges every job, run or not, so the leader never posts the next one while a helper
  // may still read this one's fields.
  void serve(int64_t member) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t now = 0;
      wait_until([&] { return (now = generation_.load(std::memory_order_acquire)) != seen; });
      seen = now;
      if (stopped_.load(std::memory_order_acquire)) return;
      if (member < members_) {
        const int64_t b = begin_ + member * chunk_, e = std::min(end_, b + chunk_);
        if (b < e) {
          try {
            call_(fn_, b, e);
          } catch (...) {
            std::lock_guard<std::mutex> lock(error_lock_);
            if (!helper_error_) helper_error_ = std::current_exception();
          }
        }
      }
      acks_.fetch_add(1, std::memory_order_release);
    }
  }

  // Leader only: release the helpers (they return from serve).
  void stop() {
    stopped_.store(true, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }

 private:
  // Spin briefly (the next job or the acknowledgements come within microseconds), then yield the
  // core: on a machine with more runnable threads than cores, a waiter that only spins can keep
  // the thread it waits for off the CPU.
  template <typename Done>
  static void wait_until(const Done& done) {
    for (int spins = 0; !done(); ++spins) {
      if (spins < 4096) {
#if defined(__x86_64__) || defined(__i386__)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

  const int64_t size_;
  bool busy_ = false;  // leader only
  // The job, written by the leader before it bumps generation_ and read by helpers after.
  int64_t begin_ = 0, end_ = 0, chunk_ = 1, members_ = 0;
  const void* fn_ = nullptr;
  void (*call_)(const void*, int64_t, int64_t) = nullptr;
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<int64_t> acks_{0};
  std::atomic<bool> stopped_{false};
  std::mutex error_lock_;
  std::exception_ptr helper_error_;
};

// The team the calling thread leads, if any.
inline Team*& current_team() {
  thread_local Team* team = nullptr;
  return team;
}

inline int64_t num_threads() {
  const Team* team = current_team();
  return team != nullptr ? team->size() : at::get_num_threads();
}

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Team* team = current_team();
  if (team != nullptr) {
    team->run(begin, end, grain, f);
  } else {
    at::parallel_for(begin, end, grain, f);
  }
}

// body() on this thread, with the rest of torch's threads serving its parallel_for calls. Runs
// body() plainly where there is nobody to team with (one thread, or already inside a parallel
// region or a team).
template <typename Body>
void with_team(const Body& body) {
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || at::in_parallel_region() || current_team() != nullptr) {
    body();
    return;
  }
  // at::parallel_for(0, threads, 1) gives each thread of its region a chunk: [0, c) to the
  // calling thread, [c, 2c), ... to the others (c > 1 only when OpenMP granted fewer threads).
  // The members are the threads that actually came: the leader counts them from c.
  std::atomic<int64_t> next_member{1};
  std::atomic<Team*> published{nullptr};
  std::exception_ptr error;
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    if (b == 0) {
      Team team((threads + e - 1) / e);
      published.store(&team, std::memory_order_release);
      current_team() = &team;
      try {
        body();
      } catch (...) {
        error = std::current_exception();
      }
      current_team() = nullptr;
      team.stop();
      // The team lives on this thread's stack: wait for every helper to have left serve().
      while (next_member.load(std::memory_order_acquire) < team.size() + team.size() - 1) std::this_thread::yield();
    } else {
      Team* team = nullptr;
      while ((team = published.load(std::memory_order_acquire)) == nullptr) std::this_thread::yield();
      const int64_t member = next_member.fetch_add(1, std::memory_order_acq_rel);
      team->serve(member);
      next_member.fetch_add(1, std::memory_order_acq_rel);  // left
    }
  });
  if (error) std::rethrow_exception(error);
}

}  // namespace specplan
