/* kvguard test instrument: shifts a process's WALL clock (CLOCK_REALTIME,
 * gettimeofday, time) by an offset read from the file named by
 * $KVGUARD_CLOCK_OFFSET_FILE (signed seconds, re-read at most every 50 ms of
 * monotonic time), so a test can step the clock of a running Envoy. Monotonic
 * clocks are left alone. Every call goes to the raw syscall (no dlsym, no vDSO),
 * which is safe at any point of start-up. Loaded with LD_PRELOAD; see
 * integration/src/clock_shim.rs. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static _Atomic long long offset_s;
static _Atomic long long checked_ns = -1;

static long raw_clock(clockid_t id, struct timespec *ts) {
    return syscall(SYS_clock_gettime, id, ts);
}

static long long current_offset(void) {
    struct timespec m;
    if (raw_clock(CLOCK_MONOTONIC, &m) != 0) return atomic_load(&offset_s);
    long long now = (long long)m.tv_sec * 1000000000LL + m.tv_nsec;
    long long last = atomic_load(&checked_ns);
    if (last >= 0 && now - last < 50000000LL) return atomic_load(&offset_s);
    atomic_store(&checked_ns, now);
    const char *path = getenv("KVGUARD_CLOCK_OFFSET_FILE");
    if (!path) return 0;
    int fd = (int)syscall(SYS_openat, AT_FDCWD, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return atomic_load(&offset_s);
    char buf[32];
    long n = syscall(SYS_read, fd, buf, sizeof buf - 1);
    syscall(SYS_close, fd);
    if (n > 0) {
        buf[n] = 0;
        atomic_store(&offset_s, strtoll(buf, NULL, 10));
    }
    return atomic_load(&offset_s);
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    long r = raw_clock(id, ts);
    if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
        ts->tv_sec += current_offset();
    }
    return (int)r;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return -1;
    if (tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return (time_t)-1;
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}
