/* How the package's C kernels split their work over threads: one contiguous slice of items (rows, or elements) per
 * thread, the calling thread taking the first. A kernel's result never depends on the split.
 *
 * The threads are torch's own OpenMP team when native.py hands this library the OpenMP runtime torch runs on
 * (hf_cpt_use_openmp: its GOMP_parallel entry point, the one every GCC-compatible runtime exports): inside a
 * training step that team's workers are already spinning, waiting for torch's next parallel region, so a kernel's
 * slices start at once on every core. Without it, POSIX threads are started per call (a start costs tens of
 * microseconds, and inside a step each new thread waits for a core that a spinning OpenMP worker holds).
 *
 * Included by error_kernels.c, code_kernels.c, rotation_kernels.c and mask_kernels.c; native.py keys each built
 * library on this file too, so a change here rebuilds them all.
 */
#ifndef HF_CPT_NATIVE_THREADS_H
#define HF_CPT_NATIVE_THREADS_H

#include <pthread.h>
#include <stdint.h>

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

/* torch's OpenMP runtime, when handed over: GOMP_parallel(fn, data, threads, flags) runs fn(data) on a team of
 * `threads` (the caller among them), and each member asks its place in the team. */
typedef void (*team_runner)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*team_query)(void);
static team_runner run_team;
static team_query team_member, team_size;

/* Called once by native.py with the runtime's GOMP_parallel, omp_get_thread_num and omp_get_num_threads (or nulls:
 * POSIX threads again). */
void hf_cpt_use_openmp(void *runner, void *member, void *size) {
    team_member = (team_query)member;
    team_size = (team_query)size;
    run_team = runner && member && size ? (team_runner)runner : 0;
}

/* A team member's slice needs far less than a new thread, as a warm team is waiting. Restoring codes on a 2-core
 * machine, a team of two was a few tenths of a microsecond slower than one thread at this many values in all, about
 * as fast at twice as many, and faster above. */
#define MIN_VALUES_PER_TEAM_MEMBER (1 << 14)

typedef struct {
    slice_body body;
    const void *args;
    int64_t items;
    int members, failed; /* the team's real size (a nested region gets one), any member's failure */
} team_t;

static void run_member(void *data) {
    team_t *team = (team_t *)data;
    const int64_t size = team_size(), member = team_member();
    if (member == 0) team->members = (int)size;
    if (team->body(team->args, team->items * member / size, team->items * (member + 1) / size))
        __atomic_store_n(&team->failed, 1, __ATOMIC_RELAXED);
}

/* `body` over items 0..items on at most `threads` threads, fewer where a thread would get under `min_values` of the
 * `values` the items hold in all (starting a thread costs more than a memory-bound pass over less; a member of a
 * waiting team needs only MIN_VALUES_PER_TEAM_MEMBER). Returns the number of threads used, or -1 when a slice
 * failed. */
static int split_items(slice_body body, const void *args, int64_t items, int64_t values, int64_t min_values,
                       int threads) {
    slice_t slices[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    const int64_t most = values / (run_team ? MIN_VALUES_PER_TEAM_MEMBER : min_values) + 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > most) threads = (int)most;
    if (threads > items) threads = (int)items;
    if (threads < 1) threads = 1;
    if (run_team && threads > 1) {
        team_t team = {body, args, items, 1, 0};
        run_team(run_member, &team, (unsigned)threads, 0);
        return team.failed ? -1 : team.members;
    }
    for (int t = 0; t < threads; t++) {
        slice_t slice = {body, args, items * t / threads, items * (t + 1) / threads, 0};
        slices[t] = slice;
    }
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
