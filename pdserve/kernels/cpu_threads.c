/* Where the OpenMP threads that torch and these kernels share run.
 *
 * pd_bind_threads puts team thread i (i >= 1) on cpus[i] alone; thread 0, the caller, is left
 * as it is (the engine binds it for each step, `engine/thread_binding.py`). libgomp hands team
 * slot i to the same pooled thread in every team of the same size, so the binding holds for
 * every later parallel region of that size. pd_thread_cpus reports, for each team slot, the CPU it
 * runs on and how many CPUs it may run on (for tests and checks).
 */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>

/* Returns -1 when the team is not n threads wide, else how many threads could not be bound. */
int pd_bind_threads(const int *cpus, int n) {
    int failed = 0, width = 0;
#pragma omp parallel reduction(+ : failed)
    {
        int i = omp_get_thread_num();
#pragma omp single
        width = omp_get_num_threads();
        if (width == n && i > 0) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(cpus[i], &set);
            failed += sched_setaffinity(0, sizeof set, &set) != 0;
        }
    }
    return width == n ? failed : -1;
}

/* For each of the team's threads (at most n): the CPU it runs on and the size of its CPU set.
 * Returns the team's width. */
int pd_thread_cpus(int *cpu, int *allowed, int n) {
    int width = 0;
#pragma omp parallel
    {
        int i = omp_get_thread_num();
#pragma omp single
        width = omp_get_num_threads();
        if (i < n) {
            cpu_set_t set;
            CPU_ZERO(&set);
            sched_getaffinity(0, sizeof set, &set);
            cpu[i] = sched_getcpu();
            allowed[i] = CPU_COUNT(&set);
        }
    }
    return width;
}
