// All-reduce (sum) and all-gather between the tensor-parallel ranks of one host through a
// shared memory segment, for the small per-layer reductions and the logits of decode steps,
// where gloo's loopback TCP costs process wake-ups per call (worker/distributed/shm_all_reduce.py).
//
// Segment layout (every rank maps the same bytes; a fresh segment is all zeros):
//   flags  [world] 64-byte lines: at +0 uint64, the last sequence number rank r published;
//          at +8 uint32, how many peers sleep waiting for it (their futex word is the low 32
//          bits of that sequence number, which every publish changes)
//   slots  [world][2][slot_bytes]: rank r's input for calls of sequence parity 0 and 1
// A call with sequence number seq (1, 2, ... in call order, the same on every rank):
//   1. copy the input into its own slot of parity seq % 2; publish flags[rank] = seq (release)
//   2. wait until every flags[r] >= seq (acquire)
//   3. sum the world slots of parity seq % 2 in rank order, in float32, rounded once into the
//      caller's tensor: every rank computes the same bits (an all-gather instead reads the
//      slots as they are: shm_exchange is steps 1 and 2).
// Reuse is safe with two parities: a rank overwrites its parity-p slot at seq + 2 only after
// every peer published seq + 1, which a peer does only after it finished reading seq.
// Waiting spins briefly (~0.1 ms: a peer on another core arrives within that on a quiet host),
// then sleeps on a futex until the peer publishes: a peer descheduled by a neighbour on a
// busy host gets the core back instead of a rank spinning or yielding beside it (yielding
// keeps the core busy, so the scheduler has no idle core to move the late peer to). A
// publisher wakes only when someone sleeps (no syscall on a quiet host). After timeout_s
// it gives up with status 1 (a peer died or hung).
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "cpu_dtypes.h"

namespace {

constexpr int64_t FLAG_STRIDE = 64 / sizeof(uint64_t);  // one cache line per flag
constexpr int SPINS_BEFORE_SLEEP = 4000;
constexpr int MAX_WORLD = 64;

int64_t header_bytes(int world) { return world * 64; }

std::atomic<uint64_t>* flag(void* base, int r) {
    return reinterpret_cast<std::atomic<uint64_t>*>(static_cast<uint64_t*>(base) +
                                                     r * FLAG_STRIDE);
}

std::atomic<uint32_t>* sleepers(void* base, int r) {
    return reinterpret_cast<std::atomic<uint32_t>*>(static_cast<char*>(base) + r * 64 + 8);
}

// FUTEX_WAIT/WAKE on a word of the shared segment (not FUTEX_PRIVATE: other processes).
long futex(void* word, int op, uint32_t value, const timespec* timeout) {
    return syscall(SYS_futex, word, op, value, timeout, nullptr, 0);
}

// Sleep until rank r's sequence number is no longer `seen` (or 1 ms passed: the caller
// rechecks its deadline). Registering as a sleeper before rereading the flag pairs with the
// publisher's store before reading the sleepers (both sequentially consistent), so either
// this thread sees the new number or the publisher sees a sleeper and wakes it.
void sleep_on(void* base, int r, uint64_t seq) {
    static const timespec slice{0, 1000000};
    sleepers(base, r)->fetch_add(1, std::memory_order_seq_cst);
    const uint64_t seen = flag(base, r)->load(std::memory_order_seq_cst);
    if (seen < seq) futex(flag(base, r), FUTEX_WAIT, static_cast<uint32_t>(seen), &slice);
    sleepers(base, r)->fetch_sub(1, std::memory_order_seq_cst);
}

void publish(void* base, int rank, uint64_t seq) {
    flag(base, rank)->store(seq, std::memory_order_seq_cst);
    if (sleepers(base, rank)->load(std::memory_order_seq_cst))
        futex(flag(base, rank), FUTEX_WAKE, INT32_MAX, nullptr);
}

char* slot(void* base, int world, int64_t slot_bytes, int r, uint64_t seq) {
    return static_cast<char*>(base) + header_bytes(world) + (2 * r + (seq & 1)) * slot_bytes;
}

double now_s() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

bool wait_for_peers(void* base, int world, uint64_t seq, double timeout_s) {
    double deadline = 0.0;
    for (int r = 0; r < world; ++r) {
        for (int spins = 0; flag(base, r)->load(std::memory_order_acquire) < seq; ++spins) {
            if (spins < SPINS_BEFORE_SLEEP) {
                __builtin_ia32_pause();
                continue;
            }
            if (deadline == 0.0) deadline = now_s() + timeout_s;
            if (now_s() > deadline) return false;
            sleep_on(base, r, seq);
        }
    }
    return true;
}

template <class T>
void sum_slots(void* base, int world, int64_t slot_bytes, uint64_t seq, T* out, int64_t n) {
    const T* src[MAX_WORLD];
    for (int r = 0; r < world; ++r)
        src[r] = reinterpret_cast<const T*>(slot(base, world, slot_bytes, r, seq));
    for (int64_t i = 0; i < n; ++i) {
        float acc = to_float(src[0][i]);
        for (int r = 1; r < world; ++r) acc += to_float(src[r][i]);
        out[i] = from_float<T>(acc);
    }
}

// Steps 1 and 2 of a call: this rank's `bytes` of input published, every peer's awaited.
// 0, or 1 when a peer did not publish within timeout_s, 2/3 for bad arguments.
int exchange(void* base, int64_t slot_bytes, int rank, int world, uint64_t seq,
             const void* data, int64_t bytes, double timeout_s) {
    if (world < 1 || world > MAX_WORLD || rank < 0 || rank >= world || seq == 0) return 2;
    if (bytes < 0 || bytes > slot_bytes) return 3;
    std::memcpy(slot(base, world, slot_bytes, rank, seq), data, bytes);
    publish(base, rank, seq);
    return wait_for_peers(base, world, seq, timeout_s) ? 0 : 1;
}

}  // namespace

extern "C" __attribute__((visibility("default")))
int shm_all_reduce(void* base, int64_t slot_bytes, int rank, int world, uint64_t seq,
                   int dtype, void* data, int64_t numel, double timeout_s) {
    static const int64_t sizes[] = {4, 2, 2};
    if (dtype < 0 || dtype > 2) return 2;
    const int status = exchange(base, slot_bytes, rank, world, seq, data,
                                numel * sizes[dtype], timeout_s);
    if (status) return status;
    switch (dtype) {
        case 0: sum_slots(base, world, slot_bytes, seq, static_cast<float*>(data), numel); break;
        case 1: sum_slots(base, world, slot_bytes, seq, static_cast<bf16*>(data), numel); break;
        default: sum_slots(base, world, slot_bytes, seq, static_cast<half_t*>(data), numel);
    }
    return 0;
}

// All-gather: steps 1 and 2 only; the caller reads the world slots of parity seq % 2 before
// its next call (a peer rewrites them only after this rank's next publish).
extern "C" __attribute__((visibility("default")))
int shm_exchange(void* base, int64_t slot_bytes, int rank, int world, uint64_t seq,
                 const void* data, int64_t bytes, double timeout_s) {
    return exchange(base, slot_bytes, rank, world, seq, data, bytes, timeout_s);
}
