// kemu_fiber.h: the fibers under kemu: a guarded stack, a saved context and a switch.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <utility>

#if defined(__x86_64__) && !defined(KEMU_UCONTEXT)
#define KEMU_FAST_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace kemu {

#if KEMU_FAST_SWITCH
// x86-64 SysV: push the callee-saved registers, store rsp into *save, load rsp from `load`,
// pop the other context's registers and return into it. Caller-saved state is the caller's
// business, and nothing here changes MXCSR or the x87 control word.
extern "C" void kemu_context_switch(void** save, void* load);
asm(R"(
  .text
  .p2align 4
  .hidden kemu_context_switch
  .type kemu_context_switch, @function
kemu_context_switch:
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
  .size kemu_context_switch, .-kemu_context_switch
)");

struct Context {
  void* sp = nullptr;
};
inline void switch_context(Context& from, Context& to) { kemu_context_switch(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
};
inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

// One fiber's stack (a PROT_NONE guard page below it turns an overflow into a crash rather
// than silent corruption) and its saved context.
class Fiber {
 public:
  static constexpr size_t kStackBytes = 128 << 10;

  Fiber() = default;
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;
  Fiber(Fiber&& other) noexcept { *this = std::move(other); }
  Fiber& operator=(Fiber&& other) noexcept {
    std::swap(base_, other.base_);
    std::swap(context, other.context);
    return *this;
  }
  ~Fiber() {
    if (base_) munmap(base_, kStackBytes + guard_bytes());
  }

  // Make the next switch into this fiber run `entry()` from the top of the stack.
  // `entry` must never return.
  void start(void (*entry)()) {
    if (!base_) allocate();
    char* top = static_cast<char*>(base_) + guard_bytes() + kStackBytes;
#if KEMU_FAST_SWITCH
    auto* sp = reinterpret_cast<void**>(reinterpret_cast<uintptr_t>(top) & ~uintptr_t(15));
    *--sp = nullptr;                             // entry's return address: rsp % 16 == 8
    *--sp = reinterpret_cast<void*>(entry);      // popped by `ret`
    for (int i = 0; i < 6; i++) *--sp = nullptr;  // rbp rbx r12 r13 r14 r15
    context.sp = sp;
#else
    getcontext(&context.uc);
    context.uc.uc_stack.ss_sp = static_cast<char*>(base_) + guard_bytes();
    context.uc.uc_stack.ss_size = kStackBytes;
    context.uc.uc_link = nullptr;
    makecontext(&context.uc, entry, 0);
#endif
  }

  Context context;

 private:
  static size_t guard_bytes() { return size_t(sysconf(_SC_PAGESIZE)); }
  void allocate() {
    void* p = mmap(nullptr, kStackBytes + guard_bytes(), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    mprotect(p, guard_bytes(), PROT_NONE);
    base_ = p;
  }
  void* base_ = nullptr;
};

}  // namespace kemu
