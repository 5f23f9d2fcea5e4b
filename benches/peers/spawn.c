/*
 * spawn.c - Open MPI comparison peer for the ductile resize benchmark.
 *
 * Usage (any number P >= 1 of parent ranks):
 *   mpirun -n P ./spawn CHILDREN
 *
 *   CHILDREN  number C of ranks to add (integer >= 0)
 *
 * C > 0: all P parents MPI_Barrier, then collectively MPI_Comm_spawn C copies
 *        of this executable (found via /proc/self/exe, started with the single
 *        argument "--child") and MPI_Intercomm_merge the resulting
 *        intercommunicator (parents low, children high); parents and children
 *        then MPI_Barrier on the merged communicator. Rank 0 times from just
 *        after the first barrier until it leaves the merged barrier and
 *        prints exactly one line to stdout:
 *          elapsed_ns=N
 *        where N is the wall time (CLOCK_MONOTONIC) of spawn + merge +
 *        barrier. The merged communicator must have P + C ranks, otherwise
 *        the job is aborted with exit code 2.
 * C = 0: MPI_Init, MPI_Barrier, MPI_Finalize and nothing else (no output);
 *        used to time a whole "mpirun -n K" relaunch from outside.
 *
 * Child side (argv[1] == "--child", only started by MPI_Comm_spawn):
 *   MPI_Comm_get_parent, MPI_Intercomm_merge(parent, high = 1), MPI_Barrier
 *   on the merged communicator, free, MPI_Finalize.
 *
 * Bad arguments: one "spawn: ..." line on stderr, exit code 2 (via
 * MPI_Abort).
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "peer_util.h"

#define CHILD_FLAG "--child"
#define EXE_PATH_MAX 4096

/* Fail the whole job with exit code `code`. Only rank 0 of `comm` prints the
 * message and calls MPI_Abort; other ranks park in a barrier that rank 0
 * never enters, so mpirun kills them. (Letting every rank call MPI_Abort at
 * once makes Open MPI 4.1's mpirun print spurious ORTE_ERROR_LOG lines.) */
static void fail(MPI_Comm comm, int rank, int code, const char *msg)
{
    peer_fail("spawn", comm, rank, code, msg);
}

/* Child side: join the parents and take part in the merged barrier. */
static int run_child(void)
{
    MPI_Comm parent, merged;

    MPI_Comm_get_parent(&parent);
    if (parent == MPI_COMM_NULL) {
        int rank;
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        fail(MPI_COMM_WORLD, rank, 2,
             CHILD_FLAG " given but there is no parent communicator "
             "(" CHILD_FLAG " is only for ranks started by MPI_Comm_spawn)");
    }
    MPI_Intercomm_merge(parent, 1, &merged);
    MPI_Barrier(merged);
    MPI_Comm_free(&merged);
    MPI_Comm_disconnect(&parent);
    MPI_Finalize();
    return 0;
}

/* Parent side: spawn `children` ranks, merge, barrier; rank 0 reports. */
static void run_parent(int rank, int nranks, int children, const char *exe)
{
    char *child_argv[] = {CHILD_FLAG, NULL};
    MPI_Comm inter, merged;
    uint64_t t0 = 0, t1;
    int merged_size;

    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0)
        t0 = now_ns();

    /* Cast: MPI-3 prototypes take a non-const char *. */
    MPI_Comm_spawn((char *)exe, child_argv, children, MPI_INFO_NULL, 0,
                   MPI_COMM_WORLD, &inter, MPI_ERRCODES_IGNORE);
    MPI_Intercomm_merge(inter, 0, &merged);
    MPI_Barrier(merged);

    if (rank == 0) {
        t1 = now_ns();
        MPI_Comm_size(merged, &merged_size);
        if (merged_size != nranks + children) {
            fprintf(stderr,
                    "spawn: merged communicator has %d ranks, expected "
                    "%d parents + %d children = %d\n",
                    merged_size, nranks, children, nranks + children);
            fflush(stderr);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        printf("elapsed_ns=%" PRIu64 "\n", t1 - t0);
        fflush(stdout);
    }

    MPI_Comm_free(&merged);
    MPI_Comm_disconnect(&inter);
}

int main(int argc, char **argv)
{
    int rank, nranks;
    const char *prog = argc > 0 ? argv[0] : "spawn";
    long children = 0;
    char exe[EXE_PATH_MAX];
    char msg[400] = "";
    ssize_t n;

    MPI_Init(&argc, &argv);

    if (argc == 2 && strcmp(argv[1], CHILD_FLAG) == 0)
        return run_child();

    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);

    if (argc != 2)
        snprintf(msg, sizeof msg,
                 "expected 1 argument, got %d (usage: %.64s CHILDREN)",
                 argc - 1, prog);
    else if (parse_count(argv[1], &children) != 0)
        snprintf(msg, sizeof msg,
                 "CHILDREN must be an integer in [0, %d], got '%.64s' "
                 "(usage: %.64s CHILDREN)",
                 INT_MAX, argv[1], prog);
    else if (children > (long)INT_MAX - nranks)
        snprintf(msg, sizeof msg,
                 "CHILDREN + parents (%ld + %d) does not fit in an int",
                 children, nranks);
    if (msg[0] != '\0')
        fail(MPI_COMM_WORLD, rank, 2, msg);

    if (children == 0) {
        MPI_Barrier(MPI_COMM_WORLD);
        MPI_Finalize();
        return 0;
    }

    /* Spawn by absolute path so the children are found regardless of the
     * working directory and PATH (argv[0] may be relative or bare). */
    n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0 || (size_t)n >= sizeof exe - 1) {
        fprintf(stderr, "spawn: rank %d: cannot resolve /proc/self/exe: %s\n",
                rank, n < 0 ? strerror(errno) : "path too long");
        fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
        return 1;
    }
    exe[n] = '\0';

    run_parent(rank, nranks, (int)children, exe);
    MPI_Finalize();
    return 0;
}
