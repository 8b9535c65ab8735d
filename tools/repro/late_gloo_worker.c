/* LD_PRELOAD amplifier for tools/repro/gloo_exit.py: a gloo worker thread comes late to the GIL.
 *
 * torch's gloo worker threads (named "pt_gloo_runloop") take the GIL when they drop the last
 * reference of a tensor whose Python object the caller already dropped ([Note: gloo threads at
 * exit] in packages/core/src/shardbridge/_distributed.py). They take it through pybind11's
 * gil_scoped_acquire -> PyEval_AcquireThread, after torch checked Py_IsInitialized(). This shim
 * wraps PyEval_AcquireThread: in a "pt_gloo_runloop" thread it first stays runnable for
 * LATE_GLOO_WORKER_US microseconds (sched_yield in a loop: the thread is preempted, as on a loaded
 * machine), then takes the GIL. Nothing else changes: the job's collectives, their order and the
 * main thread are untouched; the race the CI jobs lost (the worker asking for the GIL while the
 * interpreter finalizes) only gets a wider window.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct _ts PyThreadState;

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

void PyEval_AcquireThread(PyThreadState *tstate) {
    static void (*real)(PyThreadState *) = NULL;
    static long late_us = -1;
    if (real == NULL) real = (void (*)(PyThreadState *))dlsym(RTLD_NEXT, "PyEval_AcquireThread");
    if (late_us < 0) {
        const char *v = getenv("LATE_GLOO_WORKER_US");
        late_us = v ? atol(v) : 0;
    }
    char name[16] = {0};
    pthread_getname_np(pthread_self(), name, sizeof name);
    if (late_us > 0 && strcmp(name, "pt_gloo_runloop") == 0) {
        double until = now_us() + late_us;
        while (now_us() < until) sched_yield();
    }
    real(tstate);
}
