// The worker's OpenMP team, as torch's runtime holds it (this library binds to torch's
// libgomp, worker/native/library.py): pinning each thread to one CPU.
#include <omp.h>
#include <sched.h>

extern "C" {

// Thread i of a team of n (torch's intra-op threads, reused by every later region of that
// size) is pinned to cpus[i]. Status: 0, or 1 if a thread could not be pinned.
__attribute__((visibility("default")))
int cpu_bind_threads(const int* cpus, int n) {
    if (n <= 0) return 1;
    int failed = 0;
#pragma omp parallel num_threads(n) reduction(+ : failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[omp_get_thread_num()], &set);
        failed += sched_setaffinity(0, sizeof(set), &set) != 0;
    }
    return failed ? 1 : 0;
}

}  // extern "C"
