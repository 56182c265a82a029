/* How the package's C kernels split their work over threads: one contiguous slice of items (rows, or elements) per
 * thread, the calling thread taking the first. A kernel's result never depends on the split.
 *
 * Built with OpenMP (-fopenmp, native.py), the slices run in an OpenMP parallel region: the dynamic linker resolves
 * libgomp.so.1 to the runtime torch has loaded, so they run on torch's own team, whose workers wait for its next
 * region anyway (threads of their own would compete with those spinning workers for the cores). Without OpenMP, on
 * POSIX threads started for the call.
 *
 * Included by error_kernels.c, code_kernels.c, and rotation_kernels.c; native.py keys each built
 * library on this file too, so a change here rebuilds them all.
 */
#ifndef HF_CPT_NATIVE_THREADS_H
#define HF_CPT_NATIVE_THREADS_H

#include <pthread.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Whether this library splits its work on an OpenMP team (native.py reads it to choose the default thread count). */
int hf_cpt_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

#define MAX_THREADS 64

/* A kernel's work on items first..last of its arguments; nonzero when it failed (e.g. no memory). */
typedef int (*slice_body)(const void *args, int64_t first, int64_t last);

typedef struct {
    slice_body body;
    const void *args;
    int64_t first, last;
    int failed;
} slice_t;

static void *run_slice(void *slice) {
    slice_t *s = (slice_t *)slice;
    s->failed = s->body(s->args, s->first, s->last);
    return 0;
}

/* `body` over items 0..items on at most `threads` threads, fewer where a thread would get under `min_values` of the
 * `values` the items hold in all (starting a thread costs more than a memory-bound pass over less). Returns the
 * number of threads used, or -1 when a slice failed. */
static int split_items(slice_body body, const void *args, int64_t items, int64_t values, int64_t min_values,
                       int threads) {
    slice_t slices[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    const int64_t most = values / min_values + 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > most) threads = (int)most;
    if (threads > items) threads = (int)items;
    if (threads < 1) threads = 1;
    for (int t = 0; t < threads; t++) {
        slice_t slice = {body, args, items * t / threads, items * (t + 1) / threads, 0};
        slices[t] = slice;
    }
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int t = 0; t < threads; t++) run_slice(&slices[t]);
        int failed = 0;
        for (int t = 0; t < threads; t++) failed |= slices[t].failed;
        return failed ? -1 : threads;
    }
#endif
    int started = 1;
    for (; started < threads; started++) {
        if (pthread_create(&ids[started], 0, run_slice, &slices[started]) != 0) break;
    }
    for (int t = started; t < threads; t++) run_slice(&slices[t]); /* threads that could not start */
    run_slice(&slices[0]);
    for (int t = 1; t < started; t++) pthread_join(ids[t], 0);
    int failed = 0;
    for (int t = 0; t < threads; t++) failed |= slices[t].failed;
    return failed ? -1 : threads;
}

#endif
