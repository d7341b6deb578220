// tfclip's CUDA emulation: the runtime behind cuda/emulation/cuda_runtime.h (see there for the
// model). Fibers for the threads of a block and the schedules that order them, the __shared__
// race detector, a worker thread per stream, registered memory.
#include "cuda/emulation/cuda_runtime.h"

#include <dlfcn.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_THREAD__)
#define TFCLIP_EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TFCLIP_EMU_TSAN 1
#endif
#endif

#if TFCLIP_EMU_TSAN
// ThreadSanitizer's fiber API: each emulated thread is a fiber TSan knows, switched without
// implied synchronization, so two threads of a block that touch the same memory with no
// __syncthreads (or shuffle) between them are reported as a race.
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
void __tsan_ignore_thread_begin(void);
void __tsan_ignore_thread_end(void);
}
#define TSAN_NO_SYNC 1u
// The emulation's own bookkeeping (run queues, barrier counts, the warp exchange) is touched by
// every fiber of a block in turn on one OS thread: hidden from TSan, so that what it checks is
// the kernels' own memory accesses, ordered only by __syncthreads.
#define EMU_IGNORE_BEGIN() __tsan_ignore_thread_begin()
#define EMU_IGNORE_END() __tsan_ignore_thread_end()
#else
#define EMU_IGNORE_BEGIN() ((void)0)
#define EMU_IGNORE_END() ((void)0)
#endif

#if !defined(__x86_64__)
#error "the CUDA emulation's fibers switch stacks with x86-64 code (cuda/emulation/emulation.cc)"
#endif

// Saves the callee-saved registers and the SSE/x87 control words on the current stack, stores
// the stack pointer in *from, and resumes the context whose stack pointer is `to`.
extern "C" void tfclip_emu_switch(void** from, void* to);
asm(R"(
  .pushsection .text
  .globl tfclip_emu_switch
  .type tfclip_emu_switch,@function
tfclip_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size tfclip_emu_switch, .-tfclip_emu_switch
  .popsection
)");

namespace tfclip_emu {
namespace {

// ---------------------------------------------------------------- errors
std::mutex g_err_mu;
cudaError_t g_last_error = cudaSuccess;     // cudaGetLastError (per process: a test tool)
cudaError_t g_sticky_error = cudaSuccess;   // a failed kernel: every later sync reports it
std::string g_sticky_what;

cudaError_t SetLast(cudaError_t e) {
  if (e != cudaSuccess) {
    std::lock_guard<std::mutex> l(g_err_mu);
    g_last_error = e;
  }
  return e;
}

void KernelFailed(const std::string& what) {
  std::fprintf(stderr, "tfclip CUDA emulation: %s\n", what.c_str());
  std::lock_guard<std::mutex> l(g_err_mu);
  if (g_sticky_error == cudaSuccess) {
    g_sticky_error = cudaErrorLaunchFailure;
    g_sticky_what = what;
  }
}

cudaError_t Sticky() {
  std::lock_guard<std::mutex> l(g_err_mu);
  return g_sticky_error;
}

// ---------------------------------------------------------------- memory registry
enum class Kind { kDevice, kPinned };
std::mutex g_mem_mu;
std::map<uintptr_t, std::pair<size_t, Kind>> g_mem;  // base -> (bytes, kind)

void* Register(size_t bytes, Kind kind) {
  const size_t n = bytes == 0 ? 1 : bytes;
  void* p = std::aligned_alloc(256, (n + 255) & ~size_t{255});
  if (p == nullptr) return nullptr;
  std::lock_guard<std::mutex> l(g_mem_mu);
  g_mem[reinterpret_cast<uintptr_t>(p)] = {n, kind};
  return p;
}

bool Unregister(void* p, Kind kind) {
  std::lock_guard<std::mutex> l(g_mem_mu);
  auto it = g_mem.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_mem.end() || it->second.second != kind) return false;
  g_mem.erase(it);
  std::free(p);
  return true;
}

// The registered allocation holding [p, p + bytes), if any.
bool Lookup(const void* p, size_t bytes, Kind* kind) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> l(g_mem_mu);
  auto it = g_mem.upper_bound(a);
  if (it == g_mem.begin()) return false;
  --it;
  if (a < it->first || a + bytes > it->first + it->second.first) return false;
  *kind = it->second.second;
  return true;
}

bool IsDevice(const void* p, size_t bytes) {
  Kind k;
  return Lookup(p, bytes, &k) && k == Kind::kDevice;
}
bool IsPinned(const void* p, size_t bytes) {
  Kind k;
  return Lookup(p, bytes, &k) && k == Kind::kPinned;
}

// ---------------------------------------------------------------- fibers and blocks
constexpr size_t kStackBytes = size_t{256} << 10;
constexpr int kMaxThreadsPerBlock = 1024;
constexpr int kWarp = 32;

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;  // mmap'd, a guard page at the low end
  ThreadState state;
  int lane = 0, warp = 0;
  bool done = false;
#if TFCLIP_EMU_TSAN
  void* tsan = nullptr;
#endif
};

enum class Wait { kNone, kBarrier, kShuffle, kSyncWarp };

struct WarpExchange {
  unsigned arrived = 0;  // lanes (bit mask) that have deposited
  unsigned mask = 0;
  uint64_t in[kWarp] = {};
  uint64_t out[kWarp] = {};
  unsigned at_syncwarp = 0;  // lanes waiting at __syncwarp
  uint32_t syncs = 0;        // __syncwarp()s completed (the race detector's order within a warp)
};

// ---------------------------------------------------------------- schedules
enum Policy { kRandom, kWarpDesc, kWarpAsc, kThreadGreedy, kNumPolicies };
const char* const kPolicyNames[kNumPolicies] = {"random", "warp-desc", "warp-asc", "thread"};

// One block's run, on one worker thread.
struct BlockRun {
  std::vector<Fiber*> fibers;
  std::vector<Wait> waiting;
  // The runnable fibers: any order under kRandom, else a max-heap on key (the policy's
  // priorities, fixed for the block).
  std::vector<int> runnable;
  std::vector<uint32_t> key;
  Policy policy = kRandom;
  int alive = 0;
  int at_barrier = 0;
  std::vector<WarpExchange> warps;
  const std::function<void()>* body = nullptr;
  std::string failure;
  std::string race;  // the first race the detector found in this block
  uint64_t rng = 0;
  uint64_t interval = 0;  // the current barrier interval's id (unique on this worker thread)
};

uint64_t NextRand(uint64_t* s) {
  uint64_t x = *s;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  *s = x;
  return x;
}

uint64_t Seed() {
  static const uint64_t seed = [] {
    const char* s = std::getenv("TFCLIP_EMU_SEED");
    return s != nullptr ? std::strtoull(s, nullptr, 0) : 0x9e3779b97f4a7c15ull;
  }();
  return seed;
}

// Per worker thread: the fiber pool, the scheduler's context, the block being run.
struct Worker {
  std::vector<Fiber> pool;
  void* sched_sp = nullptr;
  BlockRun* run = nullptr;
  Fiber* current = nullptr;
  ThreadState host_state{};  // what threadIdx reads outside a kernel
  uint64_t intervals = 0;    // barrier intervals begun on this thread (ShadowCell::interval)
#if TFCLIP_EMU_TSAN
  void* sched_tsan = nullptr;
#endif
  ~Worker() {
    for (Fiber& f : pool) {
      if (f.stack != nullptr) munmap(f.stack, kStackBytes);
#if TFCLIP_EMU_TSAN
      if (f.tsan != nullptr) __tsan_destroy_fiber(f.tsan);
#endif
    }
  }
};
thread_local Worker t_worker;

// Called from a fiber, outside EMU_IGNORE.
void SwitchToScheduler() {
  EMU_IGNORE_BEGIN();
  Worker& w = t_worker;
  void** from = &w.current->sp;
  void* to = w.sched_sp;
#if TFCLIP_EMU_TSAN
  void* sched = w.sched_tsan;
#endif
  EMU_IGNORE_END();
#if TFCLIP_EMU_TSAN
  __tsan_switch_to_fiber(sched, TSAN_NO_SYNC);
#endif
  tfclip_emu_switch(from, to);
}

[[noreturn]] void FiberMain() {
  EMU_IGNORE_BEGIN();
  Worker& w = t_worker;
  BlockRun* run = w.run;
  const std::function<void()>* body = run->body;
  EMU_IGNORE_END();
#if TFCLIP_EMU_TSAN
  __tsan_acquire(run);  // the launch's parameters, written before the block started
#endif
  (*body)();
#if TFCLIP_EMU_TSAN
  __tsan_release(run);
#endif
  EMU_IGNORE_BEGIN();
  w.current->done = true;
  run->alive--;
  EMU_IGNORE_END();
  SwitchToScheduler();
  std::abort();  // a finished fiber is never resumed
}

extern "C" void tfclip_emu_fiber_entry() { FiberMain(); }

void PrepareFiber(Fiber* f) {
  if (f->stack == nullptr) {
    void* m = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      std::fprintf(stderr, "tfclip CUDA emulation: cannot map a fiber stack\n");
      std::abort();
    }
    mprotect(m, 4096, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting
    f->stack = static_cast<char*>(m);
#if TFCLIP_EMU_TSAN
    f->tsan = __tsan_create_fiber(0);
#endif
  }
  // Initial frame, as tfclip_emu_switch leaves one: control words, r15..r12, rbx, rbp, then the
  // return address (the entry) and a zero "return address" of the entry itself, which finds
  // the stack 16-byte aligned minus 8, as after a call.
  uintptr_t top = reinterpret_cast<uintptr_t>(f->stack + kStackBytes) & ~uintptr_t{15};
  uint64_t* s = reinterpret_cast<uint64_t*>(top);
  *--s = 0;
  *--s = reinterpret_cast<uint64_t>(&tfclip_emu_fiber_entry);
  for (int i = 0; i < 6; ++i) *--s = 0;  // rbp, rbx, r12..r15
  uint32_t csr[2] = {0x1f80u, 0x037fu};  // MXCSR default, x87 control word default
  std::memcpy(--s, csr, 8);
  f->sp = s;
  f->done = false;
}

void MakeRunnable(BlockRun* r, int i) {
  r->waiting[i] = Wait::kNone;
  r->runnable.push_back(i);
  if (r->policy != kRandom) {
    std::push_heap(r->runnable.begin(), r->runnable.end(),
                   [r](int a, int b) { return r->key[a] < r->key[b]; });
  }
}

// The next fiber to run, taken off the runnable set (which must not be empty).
int PickNext(BlockRun* r) {
  if (r->policy == kRandom) {
    const size_t k = NextRand(&r->rng) % r->runnable.size();
    const int i = r->runnable[k];
    r->runnable[k] = r->runnable.back();
    r->runnable.pop_back();
    return i;
  }
  std::pop_heap(r->runnable.begin(), r->runnable.end(),
                [r](int a, int b) { return r->key[a] < r->key[b]; });
  const int i = r->runnable.back();
  r->runnable.pop_back();
  return i;
}

// The policy's fixed priorities for a block of n threads (the higher key runs first).
void Priorities(BlockRun* r, int n) {
  r->key.assign(n, 0);
  if (r->policy == kRandom) return;
  const int nwarps = (n + kWarp - 1) / kWarp;
  for (int i = 0; i < n; ++i) {
    const uint32_t rnd = static_cast<uint32_t>(NextRand(&r->rng) >> 40);  // 24 bits
    switch (r->policy) {
      case kWarpDesc:  // warps high to low, the lanes of one warp in a random order
        r->key[i] = static_cast<uint32_t>(i / kWarp) << 16 | (rnd & 0xffff);
        break;
      case kWarpAsc:
        r->key[i] = static_cast<uint32_t>(nwarps - 1 - i / kWarp) << 16 | (rnd & 0xffff);
        break;
      default:  // kThreadGreedy: a random order of threads
        r->key[i] = rnd;
        break;
    }
  }
  if (r->policy == kThreadGreedy) {  // the greedy thread: thread 0, the last, or any
    const uint64_t pick = NextRand(&r->rng);
    const int hero = pick % 3 == 0 ? 0 : pick % 3 == 1 ? n - 1 : static_cast<int>((pick >> 8) % n);
    r->key[hero] = 0xffffffffu;
  }
}

void NewInterval(Worker* w, BlockRun* r) { r->interval = ++w->intervals; }

// Runs one block to completion; returns "" or what went wrong.
std::string RunBlock(const std::function<void()>& body, Policy policy, dim3 grid, dim3 block,
                     uint3 bidx, uint64_t seed) {
  EMU_IGNORE_BEGIN();
  Worker& w = t_worker;
  const int n = static_cast<int>(block.x * block.y * block.z);
  if (static_cast<int>(w.pool.size()) < n) w.pool.resize(n);
  BlockRun r;
  r.body = &body;
  r.policy = policy;
  r.alive = n;
  r.rng = seed | 1;
  r.waiting.assign(n, Wait::kNone);
  r.warps.resize((n + kWarp - 1) / kWarp);
  Priorities(&r, n);
  NewInterval(&w, &r);
  for (int i = 0; i < n; ++i) {
    Fiber* f = &w.pool[i];
    PrepareFiber(f);
    f->state.thread_idx = uint3{static_cast<unsigned>(i % block.x),
                                static_cast<unsigned>((i / block.x) % block.y),
                                static_cast<unsigned>(i / (block.x * block.y))};
    f->state.block_idx = bidx;
    f->state.block_dim = block;
    f->state.grid_dim = grid;
    f->lane = i % kWarp;
    f->warp = i / kWarp;
    r.fibers.push_back(f);
    MakeRunnable(&r, i);
  }
  w.run = &r;
#if TFCLIP_EMU_TSAN
  if (w.sched_tsan == nullptr) w.sched_tsan = __tsan_get_current_fiber();
  __tsan_release(&r);
#endif
  while (r.alive > 0) {
    if (r.runnable.empty()) {
      int barrier = 0, shuffle = 0, syncwarp = 0;
      for (Wait x : r.waiting) {
        barrier += x == Wait::kBarrier;
        shuffle += x == Wait::kShuffle;
        syncwarp += x == Wait::kSyncWarp;
      }
      r.failure = "deadlock: " + std::to_string(barrier) + " threads wait at __syncthreads, " +
                  std::to_string(shuffle) + " at a warp shuffle, " + std::to_string(syncwarp) +
                  " at __syncwarp, " + std::to_string(n - r.alive) +
                  " have exited (a barrier or shuffle not reached by every thread it names)";
      break;
    }
    const int i = PickNext(&r);
    Fiber* f = r.fibers[i];
    w.current = f;
    void* to = f->sp;
#if TFCLIP_EMU_TSAN
    void* fiber = f->tsan;
#endif
    EMU_IGNORE_END();
#if TFCLIP_EMU_TSAN
    __tsan_switch_to_fiber(fiber, TSAN_NO_SYNC);
#endif
    tfclip_emu_switch(&w.sched_sp, to);
    EMU_IGNORE_BEGIN();
  }
  w.current = nullptr;
  w.run = nullptr;
  std::string failure = r.failure.empty() ? r.race : r.failure;
  EMU_IGNORE_END();
#if TFCLIP_EMU_TSAN
  __tsan_acquire(&r);
#endif
  return failure;
}

// ---------------------------------------------------------------- streams and events
struct Op {
  std::function<void()> fn;
  uint64_t seq;
};

}  // namespace

struct Stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Op> queue;
  uint64_t issued = 0;  // ops queued so far
  uint64_t done = 0;    // ops finished
  bool stop = false;
  std::thread worker;

  Stream() : worker([this] { Loop(); }) {}
  ~Stream() {
    {
      std::lock_guard<std::mutex> l(mu);
      stop = true;
    }
    cv.notify_all();
    worker.join();
  }
  uint64_t Enqueue(std::function<void()> fn) {
    uint64_t seq;
    {
      std::lock_guard<std::mutex> l(mu);
      seq = ++issued;
      queue.push_back(Op{std::move(fn), seq});
    }
    cv.notify_all();
    return seq;
  }
  void WaitFor(uint64_t seq) {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return done >= seq; });
  }
  // Waits for everything queued so far.
  void Drain() {
    uint64_t last;
    {
      std::lock_guard<std::mutex> l(mu);
      last = issued;
    }
    WaitFor(last);
  }
  bool Reached(uint64_t seq) {
    std::lock_guard<std::mutex> l(mu);
    return done >= seq;
  }
  void Loop() {
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> l(mu);
        cv.wait(l, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        op = std::move(queue.front());
        queue.pop_front();
      }
      op.fn();
      {
        std::lock_guard<std::mutex> l(mu);
        done = op.seq;
      }
      cv.notify_all();
    }
  }
};

// An event holds the stream it was recorded on: as in CUDA, it still completes after that
// stream is destroyed (the workspace ring's events outlive the callers' streams).
struct Event {
  std::mutex mu;
  std::shared_ptr<Stream> stream;  // where it was last recorded (null: never)
  uint64_t seq = 0;
  void Snapshot(std::shared_ptr<Stream>* s, uint64_t* q) {
    std::lock_guard<std::mutex> l(mu);
    *s = stream;
    *q = seq;
  }
};

namespace {

std::mutex g_streams_mu;
std::map<Stream*, std::shared_ptr<Stream>>& Streams() {
  static auto* m = new std::map<Stream*, std::shared_ptr<Stream>>();  // outlives static dtors
  return *m;
}
std::map<Event*, std::unique_ptr<Event>>& Events() {
  static auto* m = new std::map<Event*, std::unique_ptr<Event>>();
  return *m;
}

const std::shared_ptr<Stream>& DefaultStreamPtr() {
  // Never destroyed: its worker runs to process exit.
  static auto* s = new std::shared_ptr<Stream>(std::make_shared<Stream>());
  return *s;
}
Stream* DefaultStream() { return DefaultStreamPtr().get(); }

// The stream a handle names (0, legacy and per-thread all mean the default stream), or null.
std::shared_ptr<Stream> ResolveShared(cudaStream_t s) {
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return DefaultStreamPtr();
  std::lock_guard<std::mutex> l(g_streams_mu);
  auto it = Streams().find(s);
  return it == Streams().end() ? nullptr : it->second;
}
Stream* Resolve(cudaStream_t s) { return ResolveShared(s).get(); }

Event* ResolveEvent(cudaEvent_t e) {
  std::lock_guard<std::mutex> l(g_streams_mu);
  auto it = Events().find(e);
  return it == Events().end() ? nullptr : it->second.get();
}

std::atomic<uint64_t> g_launches{0};

}  // namespace

ThreadState& Current() {
  Worker& w = t_worker;
  return w.current != nullptr ? w.current->state : w.host_state;
}

void SyncThreads() {
  Worker& w = t_worker;
  BlockRun* r = w.run;
  Fiber* f = w.current;
  if (r == nullptr || f == nullptr) {
    std::fprintf(stderr, "tfclip CUDA emulation: __syncthreads() outside a kernel\n");
    std::abort();
  }
#if TFCLIP_EMU_TSAN
  __tsan_release(&r->at_barrier);
#endif
  EMU_IGNORE_BEGIN();
  const int i = static_cast<int>(f - w.pool.data());
  r->waiting[i] = Wait::kBarrier;
  if (++r->at_barrier == static_cast<int>(r->fibers.size())) {
    r->at_barrier = 0;
    NewInterval(&w, r);
    for (int j = 0; j < static_cast<int>(r->fibers.size()); ++j) MakeRunnable(r, j);
  }
  EMU_IGNORE_END();
  SwitchToScheduler();
#if TFCLIP_EMU_TSAN
  __tsan_acquire(&r->at_barrier);
#endif
}

void ShuffleXor(unsigned mask, void* v, size_t bytes, int lane_mask) {
  Worker& w = t_worker;
  BlockRun* r = w.run;
  Fiber* f = w.current;
  if (r == nullptr || f == nullptr) {
    std::fprintf(stderr, "tfclip CUDA emulation: a warp shuffle outside a kernel\n");
    std::abort();
  }
  EMU_IGNORE_BEGIN();
  WarpExchange& x = r->warps[f->warp];
  const unsigned bit = 1u << f->lane;
  if ((mask & bit) == 0) {
    EMU_IGNORE_END();
    KernelFailed("a warp shuffle by a lane outside its own mask");
    return;
  }
  // Lanes past the block's last thread do not exist: a full mask there can never complete.
  uint64_t val = 0;
  std::memcpy(&val, v, bytes);
  x.in[f->lane] = val;
  x.mask = mask;
  x.arrived |= bit;
  const int i = static_cast<int>(f - w.pool.data());
  r->waiting[i] = Wait::kShuffle;
  // A shuffle orders no memory (as on the GPU): no release/acquire for TSan here.
  if ((x.arrived & mask) == mask) {
    for (int l = 0; l < kWarp; ++l) {
      if ((mask >> l) & 1u) {
        const int src = l ^ lane_mask;
        x.out[l] = src < kWarp && ((mask >> src) & 1u) ? x.in[src] : x.in[l];
        MakeRunnable(r, f->warp * kWarp + l);
      }
    }
    x.arrived &= ~mask;
  }
  EMU_IGNORE_END();
  SwitchToScheduler();
  EMU_IGNORE_BEGIN();
  std::memcpy(v, &x.out[f->lane], bytes);
  EMU_IGNORE_END();
}

void SyncWarp(unsigned mask) {
  Worker& w = t_worker;
  BlockRun* r = w.run;
  Fiber* f = w.current;
  if (r == nullptr || f == nullptr) {
    std::fprintf(stderr, "tfclip CUDA emulation: __syncwarp() outside a kernel\n");
    std::abort();
  }
  EMU_IGNORE_BEGIN();
  WarpExchange& x = r->warps[f->warp];
  const unsigned bit = 1u << f->lane;
  if ((mask & bit) == 0) {
    EMU_IGNORE_END();
    KernelFailed("a __syncwarp by a lane outside its own mask");
    return;
  }
  x.at_syncwarp |= bit;
  r->waiting[static_cast<int>(f - w.pool.data())] = Wait::kSyncWarp;
  if ((x.at_syncwarp & mask) == mask) {
    x.syncs++;
    for (int l = 0; l < kWarp; ++l) {
      if ((mask >> l) & 1u) MakeRunnable(r, f->warp * kWarp + l);
    }
    x.at_syncwarp &= ~mask;
  }
  EMU_IGNORE_END();
#if TFCLIP_EMU_TSAN
  __tsan_release(&x.at_syncwarp);
#endif
  SwitchToScheduler();
#if TFCLIP_EMU_TSAN
  __tsan_acquire(&x.at_syncwarp);
#endif
}

static bool RaceCheckOn() {
  static const bool on = [] {
    const char* s = std::getenv("TFCLIP_EMU_RACECHECK");
    return s == nullptr || std::strcmp(s, "0") != 0;
  }();
  return on;
}

namespace {
std::string ThreadName(const BlockRun& r, int i) {
  const Fiber& f = *r.fibers[i];
  const uint3 t = f.state.thread_idx;
  std::string s = "thread " + std::to_string(i);
  if (f.state.block_dim.y > 1 || f.state.block_dim.z > 1) {
    s += " (" + std::to_string(t.x) + "," + std::to_string(t.y) + "," + std::to_string(t.z) + ")";
  }
  return s + " (warp " + std::to_string(f.warp) + ", lane " + std::to_string(f.lane) + ")";
}
}  // namespace

void SharedAccess(const char* array, size_t index, ShadowCell* c, bool write) {
  Worker& w = t_worker;
  if (w.run == nullptr || w.current == nullptr || !RaceCheckOn()) return;
  EMU_IGNORE_BEGIN();
  BlockRun& r = *w.run;
  const int t = static_cast<int>(w.current - w.pool.data());
  const int warp = w.current->warp;
  const uint32_t wsync = r.warps[warp].syncs;
  if (c->interval != r.interval) {
    *c = ShadowCell{};
    c->interval = r.interval;
  }
  // Another thread's access in this interval is unordered with this one unless both are lanes
  // of one warp with a __syncwarp() between them.
  auto unordered = [&](int32_t o, uint32_t o_wsync) {
    return o >= 0 && o != t && (r.fibers[o]->warp != warp || o_wsync == wsync);
  };
  int other = -1;
  const char* what = nullptr;
  if (unordered(c->writer, c->writer_wsync)) {
    other = c->writer;
    what = "wrote it";
  } else if (write) {
    for (int k = 0; k < 2; ++k) {
      if (unordered(c->reader[k], c->reader_wsync[k])) {
        other = c->reader[k];
        what = "read it";
        break;
      }
    }
  }
  if (other >= 0 && r.race.empty()) {
    std::string el = index == SIZE_MAX ? std::string(array) : std::string(array) + "[" + std::to_string(index) + "]";
    // The launch's failure names the kernel, the block and the schedule before this.
    r.race = std::string("race on __shared__ ") + el + ": " + ThreadName(r, other) + " " + what + ", " +
             ThreadName(r, t) + (write ? " wrote it" : " read it") +
             ", with no __syncthreads() between them" +
             (r.fibers[other]->warp == warp ? " (nor __syncwarp(): one warp)" : "");
  }
  if (write) {
    c->writer = t;
    c->writer_wsync = wsync;
    c->reader[0] = c->reader[1] = -1;
  } else if (c->reader[0] < 0 || c->reader[0] == t) {
    c->reader[0] = t;
    c->reader_wsync[0] = wsync;
  } else {
    c->reader[1] = t;  // two distinct readers: whoever writes next differs from one of them
    c->reader_wsync[1] = wsync;
  }
  EMU_IGNORE_END();
}

namespace {
// The schedule list (TFCLIP_EMU_SCHEDULE) and, per kernel, its launches so far per policy.
struct Schedules {
  std::vector<Policy> list;
  std::mutex mu;
  std::map<const void*, std::pair<std::string, std::vector<uint64_t>>> kernels;
  const char* stats = nullptr;
};

Schedules& Sched() {
  static Schedules* s = [] {
    auto* x = new Schedules();  // never destroyed: launches may come from static destructors
    const char* e = std::getenv("TFCLIP_EMU_SCHEDULE");
    std::string spec = e != nullptr && *e != '\0' ? e : "cycle";
    if (spec == "cycle") spec = "random,warp-desc,warp-asc,thread";
    size_t b = 0;
    while (b <= spec.size()) {
      size_t e2 = spec.find(',', b);
      if (e2 == std::string::npos) e2 = spec.size();
      const std::string name = spec.substr(b, e2 - b);
      int p = 0;
      while (p < kNumPolicies && name != kPolicyNames[p]) ++p;
      if (p == kNumPolicies) {
        std::fprintf(stderr,
                     "tfclip CUDA emulation: TFCLIP_EMU_SCHEDULE=%s: no policy '%s' (random, "
                     "warp-desc, warp-asc, thread, or cycle for all)\n",
                     spec.c_str(), name.c_str());
        std::abort();
      }
      x->list.push_back(static_cast<Policy>(p));
      b = e2 + 1;
    }
    x->stats = std::getenv("TFCLIP_EMU_STATS");
    if (x->stats != nullptr && *x->stats != '\0') {
      std::atexit([] {
        Schedules& s = Sched();
        std::lock_guard<std::mutex> l(s.mu);
        FILE* f = std::fopen(s.stats, "w");
        if (f == nullptr) return;
        std::fprintf(f, "# kernel, its offset in the module, then its launches under each policy:");
        for (const char* n : kPolicyNames) std::fprintf(f, " %s", n);
        std::fprintf(f, "\n");
        for (const auto& kv : s.kernels) {
          // Where the kernel is in its module: `nm -C` on the module names the instantiation.
          Dl_info info{};
          const uintptr_t base = dladdr(kv.first, &info) != 0 ? reinterpret_cast<uintptr_t>(info.dli_fbase) : 0;
          std::fprintf(f, "%s 0x%llx", kv.second.first.c_str(),
                       static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(kv.first) - base));
          for (uint64_t c : kv.second.second) std::fprintf(f, " %llu", static_cast<unsigned long long>(c));
          std::fprintf(f, "\n");
        }
        std::fclose(f);
      });
    }
    return x;
  }();
  return *s;
}

Policy NextPolicy(const void* kernel, const char* name) {
  Schedules& s = Sched();
  std::lock_guard<std::mutex> l(s.mu);
  auto& k = s.kernels[kernel];
  if (k.second.empty()) {
    k.first = name;
    k.second.assign(kNumPolicies, 0);
  }
  uint64_t n = 0;
  for (uint64_t c : k.second) n += c;
  const Policy p = s.list[n % s.list.size()];
  k.second[p]++;
  return p;
}
}  // namespace

void EnqueueLaunch(const void* kernel, const char* name, dim3 grid, dim3 block, size_t smem,
                   cudaStream_t s, std::function<void()> body) {
  // Fault injection for tests: a launch whose kernel name contains $TFCLIP_EMU_FAIL_LAUNCH fails
  // as a real launch can (cudaGetLastError reports it), so error paths run in CI.
  const char* fail = std::getenv("TFCLIP_EMU_FAIL_LAUNCH");
  if (fail != nullptr && *fail != '\0' && std::strstr(name, fail) != nullptr) {
    SetLast(cudaErrorLaunchFailure);
    return;
  }
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0 || threads > kMaxThreadsPerBlock ||
      smem > (size_t{48} << 10)) {
    SetLast(cudaErrorInvalidConfiguration);
    return;
  }
  Stream* st = Resolve(s);
  if (st == nullptr) {
    SetLast(cudaErrorInvalidResourceHandle);
    return;
  }
  const uint64_t seed = Seed() + 0x9e3779b97f4a7c15ull * (++g_launches);
  const Policy policy = NextPolicy(kernel, name);
  st->Enqueue([name, policy, grid, block, seed, body = std::move(body)] {
    if (Sticky() != cudaSuccess) return;  // a failed context runs nothing more
    uint64_t b = 0;
    for (unsigned z = 0; z < grid.z; ++z) {
      for (unsigned y = 0; y < grid.y; ++y) {
        for (unsigned x = 0; x < grid.x; ++x, ++b) {
          const std::string e = RunBlock(body, policy, grid, block, uint3{x, y, z}, seed + b);
          if (!e.empty()) {
            KernelFailed(std::string(name) + ", block (" + std::to_string(x) + "," +
                         std::to_string(y) + "," + std::to_string(z) + ") [schedule " +
                         kPolicyNames[policy] + "]: " + e);
            return;
          }
        }
      }
    }
  });
}

}  // namespace tfclip_emu

// ---------------------------------------------------------------- the runtime API
using tfclip_emu::Event;
using tfclip_emu::Stream;

namespace {
using namespace tfclip_emu;

cudaError_t SyncResult() {
  const cudaError_t e = Sticky();
  return e == cudaSuccess ? cudaSuccess : SetLast(e);
}

// Queues a copy; reads pageable host memory now (as CUDA stages it), pinned memory later.
cudaError_t QueueCopy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, Stream* st,
                      bool wait) {
  if (bytes == 0) return cudaSuccess;
  const bool src_dev = IsDevice(src, bytes), dst_dev = IsDevice(dst, bytes);
  const bool src_pinned = IsPinned(src, bytes), dst_pinned = IsPinned(dst, bytes);
  switch (kind) {
    case cudaMemcpyHostToDevice:
      if (!dst_dev || src_dev) return SetLast(cudaErrorInvalidValue);
      break;
    case cudaMemcpyDeviceToHost:
      if (!src_dev || dst_dev) return SetLast(cudaErrorInvalidValue);
      break;
    case cudaMemcpyDeviceToDevice:
      if (!src_dev || !dst_dev) return SetLast(cudaErrorInvalidValue);
      break;
    case cudaMemcpyHostToHost:
    case cudaMemcpyDefault:
      break;
    default:
      return SetLast(cudaErrorInvalidMemcpyDirection);
  }
  const bool host_src = !src_dev;
  if (host_src && !src_pinned) {
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                      static_cast<const char*>(src) + bytes);
    const uint64_t seq = st->Enqueue([dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
    if (wait) st->WaitFor(seq);
    return SyncResult();
  }
  const uint64_t seq = st->Enqueue([dst, src, bytes] { std::memcpy(dst, src, bytes); });
  // A copy into pageable host memory returns only when it is done, as in CUDA.
  if (wait || (!dst_dev && !dst_pinned)) st->WaitFor(seq);
  return SyncResult();
}

char g_error_text[512];
}  // namespace

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t e) {
  if (e == cudaErrorLaunchFailure) {
    std::lock_guard<std::mutex> l(g_err_mu);
    std::snprintf(g_error_text, sizeof(g_error_text), "unspecified launch failure (emulation: %s)",
                  g_sticky_what.c_str());
    return g_error_text;
  }
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    default: return cudaGetErrorName(e);
  }
}

cudaError_t cudaGetLastError() {
  std::lock_guard<std::mutex> l(g_err_mu);
  const cudaError_t e = g_last_error != cudaSuccess ? g_last_error : g_sticky_error;
  g_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError() {
  std::lock_guard<std::mutex> l(g_err_mu);
  return g_last_error != cudaSuccess ? g_last_error : g_sticky_error;
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = Register(bytes, Kind::kDevice);
  return *p != nullptr ? cudaSuccess : SetLast(cudaErrorMemoryAllocation);
}

cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  cudaDeviceSynchronize();  // as CUDA's cudaFree, it waits for the device
  return Unregister(p, Kind::kDevice) ? cudaSuccess : SetLast(cudaErrorInvalidDevicePointer);
}

cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t s) {
  if (Resolve(s) == nullptr) return SetLast(cudaErrorInvalidResourceHandle);
  return cudaMalloc(p, bytes);
}

cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  Stream* st = Resolve(s);
  if (st == nullptr) return SetLast(cudaErrorInvalidResourceHandle);
  if (p == nullptr) return cudaSuccess;
  if (!IsDevice(p, 1)) return SetLast(cudaErrorInvalidDevicePointer);
  st->Enqueue([p] { Unregister(p, Kind::kDevice); });  // freed in stream order
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** p, size_t bytes) {
  *p = Register(bytes, Kind::kPinned);
  return *p != nullptr ? cudaSuccess : SetLast(cudaErrorMemoryAllocation);
}

cudaError_t cudaFreeHost(void* p) {
  if (p == nullptr) return cudaSuccess;
  return Unregister(p, Kind::kPinned) ? cudaSuccess : SetLast(cudaErrorInvalidValue);
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return QueueCopy(dst, src, bytes, kind, DefaultStream(), true);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s) {
  Stream* st = Resolve(s);
  if (st == nullptr) return SetLast(cudaErrorInvalidResourceHandle);
  return QueueCopy(dst, src, bytes, kind, st, false);
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s) {
  Stream* st = Resolve(s);
  if (st == nullptr) return SetLast(cudaErrorInvalidResourceHandle);
  if (bytes > 0 && !IsDevice(p, bytes)) return SetLast(cudaErrorInvalidValue);
  st->Enqueue([p, value, bytes] { std::memset(p, value, bytes); });
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  std::memset(a, 0, sizeof(*a));
  a->device = -1;
  Kind k;
  if (Lookup(p, 1, &k)) {
    a->type = k == Kind::kDevice ? cudaMemoryTypeDevice : cudaMemoryTypeHost;
    a->device = 0;
    a->devicePointer = k == Kind::kDevice ? const_cast<void*>(p) : nullptr;
    a->hostPointer = k == Kind::kPinned ? const_cast<void*>(p) : nullptr;
  } else {
    a->type = cudaMemoryTypeUnregistered;
    a->hostPointer = const_cast<void*>(p);
  }
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  auto st = std::make_shared<Stream>();
  Stream* raw = st.get();
  std::lock_guard<std::mutex> l(g_streams_mu);
  Streams()[raw] = std::move(st);
  *s = raw;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  std::shared_ptr<Stream> st;
  {
    std::lock_guard<std::mutex> l(g_streams_mu);
    auto it = Streams().find(s);
    if (it == Streams().end()) return SetLast(cudaErrorInvalidResourceHandle);
    st = std::move(it->second);
    Streams().erase(it);
  }
  st->Drain();  // CUDA lets queued work finish
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  Stream* st = Resolve(s);
  if (st == nullptr) return SetLast(cudaErrorInvalidResourceHandle);
  st->Drain();
  return SyncResult();
}

cudaError_t cudaStreamQuery(cudaStream_t s) {
  Stream* st = Resolve(s);
  if (st == nullptr) return SetLast(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::mutex> l(st->mu);
  return st->done >= st->issued ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
  Stream* st = Resolve(s);
  Event* ev = ResolveEvent(e);
  if (st == nullptr || ev == nullptr) return SetLast(cudaErrorInvalidResourceHandle);
  std::shared_ptr<Stream> other;
  uint64_t seq;
  ev->Snapshot(&other, &seq);
  if (other == nullptr || other.get() == st) return cudaSuccess;
  st->Enqueue([other, seq] { other->WaitFor(seq); });
  return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void* arg) {
  Stream* st = Resolve(s);
  if (st == nullptr) return SetLast(cudaErrorInvalidResourceHandle);
  st->Enqueue([fn, arg] { fn(arg); });
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  auto ev = std::make_unique<Event>();
  Event* raw = ev.get();
  std::lock_guard<std::mutex> l(g_streams_mu);
  Events()[raw] = std::move(ev);
  *e = raw;
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  std::lock_guard<std::mutex> l(g_streams_mu);
  return Events().erase(e) == 1 ? cudaSuccess : SetLast(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  std::shared_ptr<Stream> st = ResolveShared(s);
  Event* ev = ResolveEvent(e);
  if (st == nullptr || ev == nullptr) return SetLast(cudaErrorInvalidResourceHandle);
  uint64_t seq;
  {
    std::lock_guard<std::mutex> l(st->mu);
    seq = st->issued;  // everything queued so far
  }
  std::lock_guard<std::mutex> l(ev->mu);
  ev->stream = st;
  ev->seq = seq;
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  Event* ev = ResolveEvent(e);
  if (ev == nullptr) return SetLast(cudaErrorInvalidResourceHandle);
  std::shared_ptr<Stream> st;
  uint64_t seq;
  ev->Snapshot(&st, &seq);
  if (st != nullptr) st->WaitFor(seq);
  return SyncResult();
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  Event* ev = ResolveEvent(e);
  if (ev == nullptr) return SetLast(cudaErrorInvalidResourceHandle);
  std::shared_ptr<Stream> st;
  uint64_t seq;
  ev->Snapshot(&st, &seq);
  return st == nullptr || st->Reached(seq) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaDeviceSynchronize() {
  std::vector<std::shared_ptr<Stream>> all{DefaultStreamPtr()};
  {
    std::lock_guard<std::mutex> l(g_streams_mu);
    for (auto& kv : Streams()) all.push_back(kv.second);
  }
  for (const auto& st : all) st->Drain();
  return SyncResult();
}

cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : SetLast(cudaErrorInvalidDevice); }

cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
  if (d != 0) return SetLast(cudaErrorInvalidDevice);
  std::memset(p, 0, sizeof(*p));
  std::snprintf(p->name, sizeof(p->name), "tfclip CUDA emulation (host CPU)");
  p->major = 9;
  p->minor = 0;
  p->multiProcessorCount = 1;
  p->maxThreadsPerBlock = tfclip_emu::kMaxThreadsPerBlock;
  p->totalGlobalMem = size_t{1} << 34;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
