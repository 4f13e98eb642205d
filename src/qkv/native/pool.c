/* The threads of qkv's native kernels: a pool kept for the process, its workers spinning on a
 * counter for a while after each task, then sleeping on a futex until the next. Decoding
 * calls a product every few microseconds: waking a sleeping thread for each would cost more
 * than the product. While a decoder runs (qkv_pool_linger), they spin longer: between two
 * tokens Python picks the token and starts the next step, longer than SPIN_NS, and a worker
 * slept and was woken once a token (63-66 futex wakes in 64 tokens on a Zen 4 VM; 1-2 with
 * LINGER_NS). */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "qkv_native.h"

#define MAX_THREADS 256
#define SPIN_NS 50000L     /* how long a worker spins before it sleeps: 50 us */
#define LINGER_NS 1000000L /* and while a decoder runs: 1 ms */

static _Atomic int decoders; /* qkv_pool_linger's count */

static struct {
    pthread_mutex_t lock; /* one task at a time: callers from several Python threads queue */
    int started;          /* workers running (threads 1..started) */
    _Atomic unsigned generation; /* bumped for each task; workers wait for it to change */
    _Atomic int remaining;       /* workers still busy with the current task */
    _Atomic int sleepers;        /* workers asleep on `generation` */
    qkv_task fn;
    void *arg;
    int nth;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static unsigned born[MAX_THREADS]; /* each worker's first generation, set before it starts */

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void relax(void) {
#if defined(QKV_X86)
    __builtin_ia32_pause();
#endif
}

static void *worker(void *p) {
    int ith = (int)(intptr_t)p;
    /* the generation when it was made, not when it first runs: a task posted in between
     * (by the very call that made it) is still its to do, or that call waits for ever */
    unsigned seen = born[ith];
    for (;;) {
        unsigned g;
        long until = 0;
        int spins = 0;
        while ((g = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen) {
            relax();
            if (++spins < 4096) continue;
            spins = 0;
            long t = now_ns();
            if (!until) until = t + (atomic_load(&decoders) > 0 ? LINGER_NS : SPIN_NS);
            if (t < until) continue;
            atomic_fetch_add(&pool.sleepers, 1);
            syscall(SYS_futex, &pool.generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&pool.sleepers, 1);
            until = 0;
        }
        seen = g;
        if (ith < pool.nth) pool.fn(pool.arg, ith, pool.nth);
        atomic_fetch_sub_explicit(&pool.remaining, 1, memory_order_release);
    }
    return NULL;
}

/* A forked child has none of its parent's threads: it starts its own when it needs them. */
static void forget_workers(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pool.started = 0;
    atomic_store(&pool.remaining, 0);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&decoders, 0); /* the child's own decoders count from none */
}

static int start_workers(int n) {
    static int registered;
    if (!registered) {
        pthread_atfork(NULL, NULL, forget_workers);
        registered = 1;
    }
    while (pool.started < n - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        born[pool.started + 1] = atomic_load(&pool.generation);
        int failed = pthread_create(&t, &attr, worker, (void *)(intptr_t)(pool.started + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.started++;
    }
    return pool.started + 1;
}

void qkv_parallel(qkv_task fn, void *arg, int nth) {
    if (nth > MAX_THREADS) nth = MAX_THREADS;
    if (nth <= 1) {
        fn(arg, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool.lock);
    nth = start_workers(nth) < nth ? pool.started + 1 : nth;
    if (nth <= 1) {
        pthread_mutex_unlock(&pool.lock);
        fn(arg, 0, 1);
        return;
    }
    pool.fn = fn;
    pool.arg = arg;
    pool.nth = nth;
    /* every started worker answers each task (those past nth do nothing): one count for all */
    atomic_store(&pool.remaining, pool.started);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    if (atomic_load(&pool.sleepers))
        syscall(SYS_futex, &pool.generation, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
    fn(arg, 0, nth);
    while (atomic_load_explicit(&pool.remaining, memory_order_acquire) > 0) relax();
    pthread_mutex_unlock(&pool.lock);
}

/* A decoder starts (delta 1) or ends (-1): while any runs, workers spin LINGER_NS after a task
 * before they sleep, not SPIN_NS. Returns the count of decoders running now. */
int qkv_pool_linger(int delta) {
    return atomic_fetch_add(&decoders, delta) + delta;
}

/* ctypes' probe that the pool works: out[i] = i + 1 written by thread i of nth. */
static void mark(void *arg, int ith, int nth) {
    (void)nth;
    ((int *)arg)[ith] = ith + 1;
}

int qkv_pool_check(int *out, int nth) {
    qkv_parallel(mark, out, nth);
    return pool.started;
}

/* ctypes' probe of how a task's panels are shared (qkv_runs in qkv_native.h): total panels
 * for nth threads, taken by the pool's threads at once (present 0) or, one thread after
 * another, by the first `present` of them, at most those it was cut for (a pool that runs
 * fewer than asked for); count[p] is how many times panel p was taken. Returns the threads
 * the panels were cut for. */
typedef struct {
    qkv_runs runs;
    _Atomic int32_t *count;
} runs_probe;

static void take_all(void *arg, int ith, int nth) {
    (void)nth;
    runs_probe *probe = arg;
    int64_t from, to;
    for (int taken = 0; qkv_runs_next(&probe->runs, ith, taken, &from, &to); taken++)
        for (int64_t p = from; p < to; p++) atomic_fetch_add(&probe->count[p], 1);
}

int qkv_runs_check(int64_t total, int nth, int present, int32_t *count) {
    runs_probe probe = {.count = (_Atomic int32_t *)count};
    qkv_runs_start(&probe.runs, total, &nth);
    if (!present) qkv_parallel(take_all, &probe, nth);
    for (int ith = 0; ith < present && ith < nth; ith++) take_all(&probe, ith, nth);
    return nth;
}
