/* Helpers shared by the Open MPI comparison peers. */
#ifndef DUCTILE_PEER_UTIL_H
#define DUCTILE_PEER_UTIL_H

#include <errno.h>
#include <limits.h>
#include <mpi.h>
#include <stdio.h>
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

/* Fail the whole job with exit code `code`: rank 0 of `comm` prints
 * "<who>: <msg>" and calls MPI_Abort; the other ranks park in a barrier that
 * rank 0 never enters, so mpirun kills them. (Letting every rank call
 * MPI_Abort at once makes Open MPI 4.1's mpirun print spurious ORTE_ERROR_LOG
 * lines.) */
static inline void peer_fail(const char *who, MPI_Comm comm, int rank, int code, const char *msg)
{
    if (rank == 0) {
        fprintf(stderr, "%s: %s\n", who, msg);
        fflush(stderr);
        MPI_Abort(comm, code);
    } else {
        MPI_Barrier(comm);
        MPI_Abort(comm, code); /* not reached */
    }
    exit(code); /* not reached */
}

#endif
