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

/* Reading ahead while the host works. Between two decode steps the interpreter samples the
 * token, updates the requests and lays out the next step (about a millisecond), and the memory
 * system idles. pd_warm_start reads the first bytes of the next step's weights (one load per
 * 64-byte line, eight lines in flight) on a thread of its own, which the spare core runs, so
 * that the next step finds them in the last-level cache. One read at a time: a new one waits for
 * the last (long finished by then). */
#include <pthread.h>

#define WARM_MAX 64

static struct {
    const uint8_t *ptr[WARM_MAX];
    int64_t bytes[WARM_MAX];
    int64_t count;
} warm_job;
static pthread_t warm_thread;
static int warm_running;
static volatile uint64_t warm_sink;

static void *warm_run(void *arg) {
    (void)arg;
    uint64_t acc[8] = {0};
    for (int64_t b = 0; b < warm_job.count; b++) {
        const uint8_t *p = warm_job.ptr[b];
        const int64_t lines = warm_job.bytes[b] / 64;
        int64_t i = 0;
        for (; i + 8 <= lines; i += 8)
            for (int u = 0; u < 8; u++) acc[u] += p[(i + u) * 64];
        for (; i < lines; i++) acc[0] += p[i * 64];
    }
    uint64_t total = 0;
    for (int u = 0; u < 8; u++) total += acc[u];
    warm_sink = total;
    return NULL;
}

void pd_warm_join(void) {
    if (warm_running) pthread_join(warm_thread, NULL);
    warm_running = 0;
}

int pd_warm_start(const void *const *ptrs, const int64_t *bytes, int64_t count) {
    pd_warm_join();
    if (count < 0 || count > WARM_MAX) return -2;
    for (int64_t b = 0; b < count; b++) {
        warm_job.ptr[b] = (const uint8_t *)ptrs[b];
        warm_job.bytes[b] = bytes[b];
    }
    warm_job.count = count;
    if (pthread_create(&warm_thread, NULL, warm_run, NULL) != 0) return -1;
    warm_running = 1;
    return 0;
}
