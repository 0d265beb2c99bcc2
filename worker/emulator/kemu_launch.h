// kemu_launch.h: the block scheduler, grid launches and the C entry points of an emulator
// library (included by kemu.h; the generated library source names its kernel table with
// KEMU_DEFINE_API).
#pragma once

#include <exception>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>

namespace kemu {

inline std::string describe_thread(const Worker& w) {
  char buf[96];
  int n = std::snprintf(buf, sizeof buf, "block (%u,%u,%u)", blockIdx.x, blockIdx.y, blockIdx.z);
  if (w.current)
    std::snprintf(buf + n, sizeof buf - size_t(n), " thread (%u,%u,%u)", w.current->tid.x,
                  w.current->tid.y, w.current->tid.z);
  return std::string(buf) + ": ";
}

[[noreturn]] inline void fail(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  W->failed = true;
  W->error = describe_thread(*W) + buf;
  switch_context(W->current->fiber.context, W->scheduler);  // never resumed
  __builtin_unreachable();
}

inline void yield_to_scheduler() { switch_context(W->current->fiber.context, W->scheduler); }

// A thread leaves its warp's and block's barriers; a full-mask collective naming it is a bug.
[[noreturn]] inline void thread_exit() {
  Thread* me = W->current;
  Warp& warp = my_warp();
  if (warp.barrier.arrived > 0)
    fail("exited while lanes of its warp wait at %s at %s:%d", warp.barrier.kind,
         base_name(warp.barrier.file), warp.barrier.line);
  if (W->block.arrived > 0)
    fail("exited while other threads wait at __syncthreads at %s:%d",
         base_name(W->block.file), W->block.line);
  me->done = true;
  ++W->exited;
  warp.live &= ~(1u << me->lane);
  --warp.barrier.expected;
  --W->block.expected;
  switch_context(me->fiber.context, W->scheduler);  // never resumed
  __builtin_unreachable();
}

inline void fiber_main() {
  W->body(W->body_arg);
  thread_exit();
}

// "threads 0-15 wait at __shfl_xor_sync (line 12); threads 16-127 wait at ..."
inline std::string deadlock_report(const Worker& w) {
  std::string out = "deadlock: no thread can run:";
  size_t i = 0;
  while (i < w.threads.size()) {
    const Thread& t = w.threads[i];
    if (t.done) { ++i; continue; }
    size_t j = i + 1;
    while (j < w.threads.size() && !w.threads[j].done && w.threads[j].waiting == t.waiting &&
           t.waiting && w.threads[j].waiting->line == t.waiting->line)
      ++j;
    char buf[200];
    std::snprintf(buf, sizeof buf, "%s threads %zu-%zu wait at %s (%s:%d)",
                  out.back() == ':' ? "" : ";", i, j - 1, t.waiting ? t.waiting->kind : "?",
                  t.waiting ? base_name(t.waiting->file) : "?", t.waiting ? t.waiting->line : 0);
    out += buf;
    i = j;
  }
  return out;
}

// Runs every fiber of the current block (blockIdx is set) to completion, or until an error.
inline void run_block(Worker& w, dim3 block) {
  const unsigned n = unsigned(w.threads.size());
  w.block = Barrier{int(n)};
  for (unsigned i = 0; i < w.warps.size(); i++) {
    const unsigned lanes = std::min(32u, n - 32 * i);
    w.warps[i].barrier = Barrier{int(lanes)};
    w.warps[i].full = w.warps[i].live = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
  }
  std::fill(w.smem.begin(), w.smem.end(), 0xff);  // NaN in fp32, fp16 and bf16
  w.exited = 0;
  for (unsigned i = 0; i < n; i++) {
    Thread& t = w.threads[i];
    t.tid = {i % block.x, i / block.x % block.y, i / (block.x * block.y)};
    t.index = i, t.lane = i % 32, t.warp = i / 32, t.parity = 0;
    t.waiting = nullptr, t.done = false;
    t.fiber.start(fiber_main);
  }
  for (;;) {  // round robin: run each fiber until it sleeps in a barrier or exits
    bool pending = false, ran = false;
    for (Thread& t : w.threads) {
      if (t.done) continue;
      pending = true;
      if (t.waiting && t.waiting->generation == t.wait_generation) continue;
      t.waiting = nullptr;
      w.current = &t;
      threadIdx = t.tid;
      switch_context(w.scheduler, t.fiber.context);
      if (w.failed) return;
      ran = true;
    }
    if (!pending) return;
    if (!ran) {
      w.current = nullptr;
      w.failed = true;
      w.error = describe_thread(w) + deadlock_report(w);
      return;
    }
  }
}

struct Grid {
  dim3 grid, block;
  size_t smem;
  void (*body)(void*);
  void* arg;
};

inline std::vector<std::unique_ptr<Worker>>& worker_pool() {
  static std::vector<std::unique_ptr<Worker>> pool;
  return pool;
}

// Blocks are handed out in order to `num_workers` OS threads; returns the first error or "".
inline std::string run_grid(const Grid& g, unsigned num_workers) {
  gridDim = g.grid;
  blockDim = g.block;
  const unsigned long long total = 1ull * g.grid.x * g.grid.y * g.grid.z;
  const unsigned n = g.block.x * g.block.y * g.block.z;
  num_workers = unsigned(std::max(1ull, std::min<unsigned long long>(num_workers, total)));
  auto& pool = worker_pool();
  while (pool.size() < num_workers) pool.push_back(std::make_unique<Worker>());
  std::atomic<unsigned long long> next{0};
  std::atomic<bool> stop{false};
  auto work = [&](Worker* w) {
    W = w;
    w->threads.resize(n);
    w->warps.resize((n + 31) / 32);
    w->smem.assign(g.smem, 0);
    w->smem_bytes = g.smem;
    w->failed = false;
    w->error.clear();
    w->body = g.body;
    w->body_arg = g.arg;
    for (unsigned long long i; !stop && (i = next++) < total;) {
      blockIdx = {unsigned(i % g.grid.x), unsigned(i / g.grid.x % g.grid.y),
                  unsigned(i / (1ull * g.grid.x * g.grid.y))};
      run_block(*w, g.block);
      if (w->failed) stop = true;
    }
    W = nullptr;
  };
  std::vector<std::thread> threads;
  for (unsigned i = 1; i < num_workers; i++) threads.emplace_back(work, pool[i].get());
  work(pool[0].get());
  for (auto& t : threads) t.join();
  for (unsigned i = 0; i < num_workers; i++)
    if (pool[i]->failed) return pool[i]->error;
  return "";
}

// A kernel of the library: its name expression, address, and a type-erased caller.
struct KernelEntry {
  const char* name;
  void (*fn)();
  void (*invoke)(void (*fn)(), void** args);
  std::string signature;  // per parameter: "p" pointer, "i4"/"i8" integer, "f4"/"f8" float
};

template <class P> std::string param_code() {
  if constexpr (std::is_pointer_v<P>) return "p";
  else if constexpr (std::is_floating_point_v<P>) return "f" + std::to_string(sizeof(P));
  else return "i" + std::to_string(sizeof(P));
}

template <class... P> struct Caller {
  template <size_t... I> static void call(void (*fn)(), void** args, std::index_sequence<I...>) {
    reinterpret_cast<void (*)(P...)>(fn)(*static_cast<std::remove_cv_t<P>*>(args[I])...);
  }
  static void invoke(void (*fn)(), void** args) {
    call(fn, args, std::index_sequence_for<P...>{});
  }
};

template <class... P> KernelEntry entry(const char* name, void (*kernel)(P...)) {
  std::string signature;
  ((signature += param_code<std::remove_cv_t<P>>() + ","), ...);
  return {name, reinterpret_cast<void (*)()>(kernel), &Caller<P...>::invoke, signature};
}

struct Call {
  const KernelEntry* kernel;
  void** args;
};
inline void call_kernel(void* arg) {
  const Call* c = static_cast<const Call*>(arg);
  c->kernel->invoke(c->kernel->fn, c->args);
}

inline int launch(const std::vector<KernelEntry>& table, const char* name, const unsigned* grid,
                  const unsigned* block, unsigned long long smem, const char* signature,
                  void** args, int workers, char* error, int error_len) {
  static std::mutex one_launch_at_a_time;
  std::lock_guard<std::mutex> lock(one_launch_at_a_time);
  std::string message;
  const KernelEntry* kernel = nullptr;
  for (const KernelEntry& e : table)
    if (std::strcmp(e.name, name) == 0) kernel = &e;
  if (!kernel) message = std::string("no kernel ") + name + " in this emulator library";
  else if (kernel->signature != signature)
    message = std::string(name) + " takes (" + kernel->signature + ") but was given (" +
              signature + ")";
  if (message.empty()) {
    Call call{kernel, args};
    try {
      message = run_grid({dim3(grid[0], grid[1], grid[2]), dim3(block[0], block[1], block[2]),
                          size_t(smem), call_kernel, &call},
                         unsigned(std::max(1, workers)));
    } catch (const std::exception& e) {
      message = std::string("emulator failure: ") + e.what();
    }
  }
  std::snprintf(error, size_t(error_len), "%s", message.c_str());
  return message.empty() ? 0 : 1;
}

}  // namespace kemu

#define KEMU_EXPORT extern "C" __attribute__((visibility("default")))
// Defines the library's C entry points over `table`, a std::vector<kemu::KernelEntry>.
#define KEMU_DEFINE_API(table)                                                               \
  KEMU_EXPORT int kemu_num_kernels() { return int(table.size()); }                           \
  KEMU_EXPORT const char* kemu_kernel_name(int i) { return table[size_t(i)].name; }          \
  KEMU_EXPORT int kemu_launch(const char* name, const unsigned* grid, const unsigned* block, \
                              unsigned long long smem, const char* signature, void** args,   \
                              int workers, char* error, int error_len) {                     \
    return kemu::launch(table, name, grid, block, smem, signature, args, workers, error,     \
                        error_len);                                                          \
  }
