/* Helpers shared by the Open MPI comparison peers. */
#ifndef DUCTILE_PEER_UTIL_H
#define DUCTILE_PEER_UTIL_H

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

/* Monotonic clock in nanoseconds. */
static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

/* Parse a non-negative decimal integer that fits in an int (MPI counts are
 * ints). Returns 0 on success, -1 on error. */
static inline int parse_count(const char *s, long *out)
{
    char *end = NULL;
    long v;

    if (s == NULL || *s == '\0' || *s == '-' || *s == '+')
        return -1;
    errno = 0;
    v = strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < 0 || v > INT_MAX)
        return -1;
    *out = v;
    return 0;
}

#endif
