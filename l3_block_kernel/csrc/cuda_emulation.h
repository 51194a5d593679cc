// CUDA on a CPU: just enough of CUDA's execution model to run paged_attention.cu with g++ or
// clang++ (C++20), no CUDA toolkit needed. The shim headers in emulation/ (cuda_runtime.h,
// cuda_fp16.h, cuda_bf16.h) include this file in place of the real ones.
//
// What it models
//   grid      blocks run one after another on a host thread (several host threads take blocks
//             from a shared counter); `__shared__` is a static (thread_local) variable, so a block
//             sees the shared memory of the blocks that ran before it on that host thread, as a
//             GPU's shared memory is also never cleared between blocks.
//   block     one fiber (a small stack and a saved register set) per CUDA thread. A fiber runs
//             until it reaches a synchronisation point, then hands control back to the scheduler.
//   warp      __shfl_xor_sync: every lane posts its value, the scheduler runs the warp's other
//             lanes to the same point, then each lane reads its partner's value. __syncwarp is a
//             shuffle whose value nobody reads: the warp's lanes meet there.
//   barrier   __syncthreads: the scheduler runs every warp until all its lanes wait there, then
//             lets the whole block go on. A block whose threads disagree (some at a barrier, some
//             at a shuffle or finished) is reported as an error, as a GPU would hang or misbehave.
//   numbers   __half and __nv_bfloat16 are 16-bit storage types with round-to-nearest-even
//             conversions; arithmetic happens in float, as in the kernel.
//
// What it cannot see: warps do not run in lock-step, so code that relies on implicit warp
// synchronisation passes here; there is no timing, no register limit, no misaligned-access fault
// and no race detection (blocks never overlap in time).
#pragma once

#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700  // macOS hides its (deprecated, still working) ucontext calls without it
#endif
#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#define CUDA_EMULATION 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// static: one copy for the block; thread_local: host threads that run blocks side by side each
// own one, like two SMs.
#define __shared__ static thread_local

using std::max;
using std::min;

// ---------------------------------------------------------------- runtime types

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};

using cudaStream_t = void*;
enum cudaError_t { cudaSuccess = 0, cudaErrorLaunchFailure = 4 };

namespace cuda_emulation {

// The CUDA thread the current host thread is running (set by the scheduler at each switch).
struct ThreadState {
  uint3 thread_idx{0, 0, 0};
  uint3 block_idx{0, 0, 0};
  dim3 block_dim;
  dim3 grid_dim;
};
inline thread_local ThreadState current;
inline std::atomic<const char*> last_error{nullptr};  // set by any host thread of a launch
inline const char* last_message = "no error";         // what cudaGetErrorString reports

inline void fail(const char* message) {
  const char* expected = nullptr;
  last_error.compare_exchange_strong(expected, message);
}

}  // namespace cuda_emulation

#define threadIdx (cuda_emulation::current.thread_idx)
#define blockIdx (cuda_emulation::current.block_idx)
#define blockDim (cuda_emulation::current.block_dim)
#define gridDim (cuda_emulation::current.grid_dim)

inline cudaError_t cudaGetLastError() {
  const char* message = cuda_emulation::last_error.exchange(nullptr);
  if (message == nullptr) return cudaSuccess;
  cuda_emulation::last_message = message;
  return cudaErrorLaunchFailure;
}
inline const char* cudaGetErrorString(cudaError_t error) {
  return error == cudaSuccess ? "no error" : cuda_emulation::last_message;
}

// ---------------------------------------------------------------- 16-bit floats

namespace cuda_emulation {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float -> bfloat16: keep the top 16 bits, rounding the dropped 16 to nearest, ties to even.
inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays a quiet NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// float -> IEEE half (1 sign, 5 exponent, 10 mantissa bits), round to nearest even, with
// subnormals, overflow to inf, and NaN kept a NaN.
inline uint16_t float_to_half_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;                // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;               // rounds to >= 65536: inf
  if (a < 0x38800000u) {                                     // below 2^-14: subnormal half
    // Scale so that the half's last subnormal bit (2^-24) is the float's unit, then let the
    // FPU round to nearest even: adding 0.5 (2^-1) aligns the value to an integer.
    const float scaled = bits_float(a) + 0.5f;               // exact align, FPU rounds (RNE)
    return sign | uint16_t(float_bits(scaled) - float_bits(0.5f));
  }
  const uint32_t mant_odd = (a >> 13) & 1u;
  const uint32_t rounded = a + 0xfffu + mant_odd;            // round the 13 dropped bits
  return sign | uint16_t((rounded - 0x38000000u) >> 13);     // rebias exponent 127 -> 15
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float value = std::ldexp(float(mant), -24);
    return bits_float(float_bits(value) | sign);
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf or NaN
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

}  // namespace cuda_emulation

struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};

inline float __half2float(__half h) { return cuda_emulation::half_bits_to_float(h.bits); }
inline __half __float2half_rn(float f) { return __half{cuda_emulation::float_to_half_bits(f)}; }
inline float __bfloat162float(__nv_bfloat16 b) { return cuda_emulation::bits_float(uint32_t(b.bits) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  return __nv_bfloat16{cuda_emulation::float_to_bf16_bits(f)};
}

// ---------------------------------------------------------------- fibers and the block scheduler

namespace cuda_emulation {

constexpr int kWarpSize = 32;
constexpr size_t kStackBytes = 64 * 1024;

enum class Stop { kRunning, kShuffle, kBarrier, kDone };

// A fiber's stack, with an inaccessible page below it: a kernel that overflows its stack (deep
// recursion, a huge local array) stops with a segmentation fault instead of corrupting a neighbour.
struct Stack {
  char* base = nullptr;  // the guard page, then the usable bytes
  size_t guard = 0;
  size_t usable = 0;
  Stack() = default;
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  Stack(Stack&& other) noexcept : base(other.base), guard(other.guard), usable(other.usable) { other.base = nullptr; }
  ~Stack() {
    if (base) munmap(base, guard + usable);
  }
  void allocate(size_t bytes) {
    guard = size_t(sysconf(_SC_PAGESIZE));
    usable = bytes;
    void* p = mmap(nullptr, guard + usable, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANON, -1, 0);
    if (p == MAP_FAILED) {
      std::fprintf(stderr, "cuda_emulation: cannot map a fiber stack\n");
      std::abort();
    }
    base = static_cast<char*>(p);
    mprotect(base, guard, PROT_NONE);  // stacks grow down: the guard is the lowest page
  }
};

struct Fiber {
  ucontext_t context;  // only to start the fiber on its own stack
  jmp_buf resume;      // where it stopped; _setjmp/_longjmp switch without a system call
  bool started = false;
  Stack stack;
  uint3 thread_idx;
  Stop stop = Stop::kRunning;
  int shuffle_parity = 0;
};

// One per host thread: runs one block at a time.
struct BlockRunner {
  jmp_buf scheduler;
  std::vector<Fiber> fibers;
  Fiber* running = nullptr;
  const void* body = nullptr;  // the launch's std::function-free entry, see run_block
  void (*entry)(const void*) = nullptr;
  // Shuffle mailboxes: [warp][parity][lane] of 8 bytes; two parities so that a fast lane can
  // post its next value while a slow lane still reads the previous one.
  std::vector<uint64_t> mailbox;
  bool broken = false;

  static void fiber_main(unsigned hi, unsigned lo);
  void yield(Stop why);
  void resume(Fiber& f);
  void start_fibers(int threads, dim3 block_dim);
  void run_block(dim3 block_dim);
  bool run_warp(int first, int count);
};

inline thread_local BlockRunner* runner = nullptr;

// A fiber runs the kernel once per block: after each run it stops as done, and the next block
// resumes it here with its new threadIdx.
inline void BlockRunner::fiber_main(unsigned hi, unsigned lo) {
  BlockRunner* self = reinterpret_cast<BlockRunner*>((uintptr_t(hi) << 32) | uintptr_t(lo));
  for (;;) {
    self->entry(self->body);
    self->yield(Stop::kDone);
  }
}

inline void BlockRunner::yield(Stop why) {
  Fiber* f = running;
  f->stop = why;
  if (!_setjmp(f->resume)) _longjmp(scheduler, 1);
}

inline void BlockRunner::resume(Fiber& f) {
  running = &f;
  current.thread_idx = f.thread_idx;
  if (_setjmp(scheduler)) return;  // the fiber stopped
  if (f.started) _longjmp(f.resume, 1);
  f.started = true;
  ucontext_t here;
  swapcontext(&here, &f.context);  // never returns: the fiber comes back through _longjmp
}

// Resumes each lane of a warp in turn until every lane stops at a barrier or finishes.
// Returns false when the lanes disagree.
inline bool BlockRunner::run_warp(int first, int count) {
  for (;;) {
    for (int i = first; i < first + count; ++i) {
      Fiber& f = fibers[i];
      if (f.stop != Stop::kRunning) continue;
      resume(f);
    }
    const Stop first_stop = fibers[first].stop;
    for (int i = first; i < first + count; ++i) {
      if (fibers[i].stop != first_stop) return false;
    }
    if (first_stop != Stop::kShuffle) return true;
    for (int i = first; i < first + count; ++i) fibers[i].stop = Stop::kRunning;
  }
}

inline void BlockRunner::start_fibers(int threads, dim3 block_dim) {
  if (int(fibers.size()) < threads) fibers.resize(threads);
  const uintptr_t self = reinterpret_cast<uintptr_t>(this);
  for (int t = 0; t < threads; ++t) {
    Fiber& f = fibers[t];
    if (!f.started || broken) {
      if (!f.stack.base) f.stack.allocate(kStackBytes);
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack.base + f.stack.guard;
      f.context.uc_stack.ss_size = f.stack.usable;
      f.context.uc_link = nullptr;
      makecontext(&f.context, reinterpret_cast<void (*)()>(&fiber_main), 2, unsigned(self >> 32),
                  unsigned(self & 0xffffffffu));
      f.started = false;
    }
    f.thread_idx = uint3{unsigned(t % block_dim.x), unsigned(t / block_dim.x % block_dim.y),
                         unsigned(t / (block_dim.x * block_dim.y))};
    f.stop = Stop::kRunning;
    f.shuffle_parity = 0;
  }
  broken = false;
}

inline void BlockRunner::run_block(dim3 block_dim) {
  const int threads = int(block_dim.x * block_dim.y * block_dim.z);
  mailbox.assign(size_t((threads + kWarpSize - 1) / kWarpSize) * 2 * kWarpSize, 0);
  start_fibers(threads, block_dim);
  for (;;) {
    for (int w = 0; w < threads; w += kWarpSize) {
      if (!run_warp(w, std::min(kWarpSize, threads - w))) {
        fail("emulated launch failed: the lanes of a warp disagree on a shuffle or barrier");
        broken = true;  // the fibers are abandoned mid-way; a fresh context is made next block
        return;
      }
    }
    int done = 0;
    for (int t = 0; t < threads; ++t) done += fibers[t].stop == Stop::kDone;
    if (done == threads) return;
    if (done != 0) {
      fail("emulated launch failed: some threads finished while others wait at __syncthreads");
      broken = true;
      return;
    }
    for (int t = 0; t < threads; ++t) fibers[t].stop = Stop::kRunning;
  }
}

template <typename Body>
void run_body(const void* body) {
  (*static_cast<const Body*>(body))();
}

inline int host_threads() {
  if (const char* env = std::getenv("L3_EMULATION_THREADS")) return std::max(1, std::atoi(env));
  return std::max(1u, std::min(4u, std::thread::hardware_concurrency()));
}

// Runs `body` (the kernel call with its arguments bound) once per CUDA thread of every block.
template <typename Body>
void launch_grid(dim3 grid, dim3 block, const Body& body) {
  const long num_blocks = long(grid.x) * grid.y * grid.z;
  std::atomic<long> next{0};
  auto worker = [&] {
    BlockRunner local;
    runner = &local;
    local.entry = &run_body<Body>;
    local.body = &body;
    current.block_dim = block;
    current.grid_dim = grid;
    for (long b = next++; b < num_blocks && !local.broken; b = next++) {
      current.block_idx = uint3{unsigned(b % grid.x), unsigned(b / grid.x % grid.y),
                                unsigned(b / (long(grid.x) * grid.y))};
      local.run_block(block);
    }
    runner = nullptr;
  };
  const int workers = int(std::min<long>(host_threads(), num_blocks));
  std::vector<std::thread> pool;
  for (int i = 1; i < workers; ++i) pool.emplace_back(worker);
  if (workers > 0) worker();
  for (auto& t : pool) t.join();
}

// `kernel<<<grid, block, 0, stream>>>(args...)` becomes LAUNCH_KERNEL(kernel, grid, block, stream)(args...).
template <typename... Params>
auto launcher(void (*kernel)(Params...), dim3 grid, dim3 block) {
  return [=](auto... args) {
    auto body = [&] { kernel(args...); };
    launch_grid(grid, block, body);
  };
}

}  // namespace cuda_emulation

#define LAUNCH_KERNEL(kernel, grid, block, stream) \
  (static_cast<void>(stream), cuda_emulation::launcher(kernel, dim3(grid), dim3(block)))

// ---------------------------------------------------------------- device intrinsics

inline void __syncthreads() { cuda_emulation::runner->yield(cuda_emulation::Stop::kBarrier); }

// Every lane of the warp must call it (the kernel only uses the full mask 0xffffffff).
template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  static_assert(sizeof(T) <= 8, "emulated shuffles carry at most 8 bytes");
  using namespace cuda_emulation;
  if (mask != 0xffffffffu) fail("emulated __shfl_xor_sync supports only the full mask 0xffffffff");
  BlockRunner& r = *runner;
  Fiber& f = *r.running;
  const int linear = int(f.thread_idx.x + blockDim.x * (f.thread_idx.y + blockDim.y * f.thread_idx.z));
  const int lane = linear % kWarpSize;
  uint64_t* box = &r.mailbox[(size_t(linear / kWarpSize) * 2 + f.shuffle_parity) * kWarpSize];
  f.shuffle_parity ^= 1;
  std::memcpy(&box[lane], &value, sizeof(T));
  r.yield(Stop::kShuffle);
  T out;
  std::memcpy(&out, &box[(lane ^ lane_mask) % kWarpSize], sizeof(T));
  return out;
}

// The warp's lanes meet here: what one lane wrote to shared memory before it, every lane reads after.
inline void __syncwarp(unsigned mask = 0xffffffffu) { static_cast<void>(__shfl_xor_sync(mask, 0, 0)); }
