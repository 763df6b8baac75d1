/* How fast this machine streams memory into the cores: the sum of a large float32 buffer, read
 * once front to back by every thread of torch's OpenMP team, 8 vectors in flight per thread.
 * It is the read pattern of a single-row matrix product (perf/hardware.py's roofline takes the
 * faster of this and torch's own `x.sum()`, which reaches less on some machines). */
#include <omp.h>

#include "kernels.h"
#include "vec.h"

float pd_read_sum(const float *x, int64_t n) {
    float total = 0;
#pragma omp parallel reduction(+ : total)
    {
        vf acc[8] = {{0}};
        const int64_t per = n / (8 * V);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < per; i++)
            for (int u = 0; u < 8; u++) acc[u] += load_f(x + (i * 8 + u) * V);
        for (int u = 1; u < 8; u++) acc[0] += acc[u];
        total += hsum(acc[0]);
    }
    for (int64_t i = n / (8 * V) * 8 * V; i < n; i++) total += x[i];
    return total;
}
