/*
 * redist.c - Open MPI comparison peer for the ductile redistribution benchmark
 * (benches/redistribution.rs).
 *
 * Usage:
 *   mpirun -n NS        ./redist spawn-alltoallv NS NT GLOBAL_ELEMS
 *   mpirun -n NS        ./redist spawn-rma       NS NT GLOBAL_ELEMS
 *   mpirun -n max(NS,NT) ./redist injob-alltoallv NS NT GLOBAL_ELEMS
 *
 *   NS, NT        old and new number of blocks (integers >= 1)
 *   GLOBAL_ELEMS  elements (MPI_DOUBLE) of the global array, 0 .. INT_MAX
 *
 * Block rule (the same as ductile's `ductile_redistrib::block_range`): block r
 * of n holds the global indices [floor(r*G/n), floor((r+1)*G/n)). Element g
 * holds the value g + 0.5 (exact in a double for every g < 2^52).
 *
 * spawn-alltoallv: the NS processes of MPI_COMM_WORLD hold the old blocks
 *   (malloc'ed and filled before timing, so their pages are warm). They call
 *   MPI_Comm_spawn for NT children (this executable with "--child MODE NS NT
 *   G"), every new block lives in a child (paper 003's "baseline" method:
 *   all new processes are fresh), and MPI_Intercomm_merge the
 *   intercommunicator (parents low: merged ranks 0..NS-1 are the parents,
 *   NS..NS+NT-1 the children). Each child mallocs its destination block
 *   (fresh pages, never touched before the transfer). Timing: from leaving an
 *   MPI_Barrier on the merged communicator to leaving a second MPI_Barrier
 *   after one MPI_Alltoallv over it (counts in elements of MPI_DOUBLE; parents
 *   send their overlaps with each child's block and receive nothing).
 * spawn-rma: the same spawn and merge; timed from the same barrier:
 *   MPI_Win_create over each parent's old block (children expose 0 bytes),
 *   MPI_Win_lock_all, one MPI_Get per non-empty overlap by each child,
 *   MPI_Win_unlock_all, MPI_Win_free, MPI_Barrier. Window creation and
 *   release are inside the time. Needs an osc component that works between
 *   a job and its spawned children: run with `--mca osc sm,rdma,pt2pt`
 *   (Debian's /etc/openmpi/openmpi-mca-params.conf disables pt2pt).
 * injob-alltoallv: one job of max(NS,NT) processes; ranks 0..NS-1 hold the
 *   old blocks (warm), ranks 0..NT-1 malloc their new block (fresh pages);
 *   timed from a barrier to a barrier after one MPI_Alltoallv over
 *   MPI_COMM_WORLD. A rank that holds an old and a new block sends its own
 *   overlap to itself, as ductile's surviving ranks do.
 *
 * After timing, every destination block is checked element by element; a
 * wrong element aborts the job (exit code 3) naming it.
 *
 * Output: rank 0 (a parent) prints exactly one line on stdout:
 *   elapsed_ns=N dest_minflt=F dest_pages=P
 * N: the timed interval (CLOCK_MONOTONIC on rank 0); F: minor page faults
 * the destination processes took inside the timed interval (getrusage,
 * summed); P: 4 KiB pages of all destination blocks (so F >= P means every
 * destination page was faulted in fresh during the transfer).
 *
 * Bad arguments or a process count that does not match the mode: one
 * "redist: ..." line on stderr, then MPI_Abort with exit code 2.
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
#include <sys/resource.h>
#include <unistd.h>
#include "peer_util.h"

#define CHILD_FLAG "--child"
#define EXE_PATH_MAX 4096
#define PAGE 4096

enum mode { SPAWN_ALLTOALLV, SPAWN_RMA, INJOB_ALLTOALLV };

static const char *const MODE_NAMES[] = {"spawn-alltoallv", "spawn-rma", "injob-alltoallv"};

struct args {
    enum mode mode;
    long ns, nt, global;
};

/* Fail the whole job with exit code `code`: rank 0 of `comm` prints and
 * aborts; the others wait in a barrier rank 0 never enters (as in spawn.c). */
static void fail(MPI_Comm comm, int rank, int code, const char *msg)
{
    peer_fail("redist", comm, rank, code, msg);
}

/* First index of block r of n over `global` elements (the block rule). */
static uint64_t block_start(uint64_t global, uint64_t n, uint64_t r)
{
    /* global <= INT_MAX and r <= n <= INT_MAX: the product fits in 64 bits. */
    return r * global / n;
}

static double value_of(uint64_t g)
{
    return (double)g + 0.5;
}

/* Elements of old block `o` (of ns) that go to new block `t` (of nt), and
 * where they start in the global array. */
static uint64_t overlap(const struct args *a, uint64_t o, uint64_t t, uint64_t *first)
{
    uint64_t g = (uint64_t)a->global;
    uint64_t lo = block_start(g, a->ns, o), hi = block_start(g, a->ns, o + 1);
    uint64_t tlo = block_start(g, a->nt, t), thi = block_start(g, a->nt, t + 1);
    uint64_t s = lo > tlo ? lo : tlo, e = hi < thi ? hi : thi;
    *first = s;
    return e > s ? e - s : 0;
}

static long minflt(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_minflt;
}

/* Parses "MODE NS NT G" from argv[0..3]; returns NULL or a message. */
static const char *parse(char **argv, struct args *a, char *msg, size_t len)
{
    size_t i;
    for (i = 0; i < sizeof MODE_NAMES / sizeof *MODE_NAMES; i++)
        if (strcmp(argv[0], MODE_NAMES[i]) == 0)
            break;
    if (i == sizeof MODE_NAMES / sizeof *MODE_NAMES) {
        snprintf(msg, len, "unknown mode '%.64s' (known: spawn-alltoallv, spawn-rma, injob-alltoallv)", argv[0]);
        return msg;
    }
    a->mode = (enum mode)i;
    if (parse_count(argv[1], &a->ns) != 0 || a->ns < 1 || parse_count(argv[2], &a->nt) != 0 || a->nt < 1) {
        snprintf(msg, len, "NS and NT must be integers in [1, %d], got '%.32s' and '%.32s'", INT_MAX, argv[1],
                 argv[2]);
        return msg;
    }
    if (parse_count(argv[3], &a->global) != 0) {
        snprintf(msg, len, "GLOBAL_ELEMS must be an integer in [0, %d], got '%.32s'", INT_MAX, argv[3]);
        return msg;
    }
    if (a->mode != INJOB_ALLTOALLV && a->ns > (long)INT_MAX - a->nt) {
        snprintf(msg, len, "NS + NT (%ld + %ld) does not fit in an int", a->ns, a->nt);
        return msg;
    }
    return NULL;
}

/* An old block, malloc'ed and filled (warm pages). */
static double *old_block(const struct args *a, uint64_t o, uint64_t *len)
{
    uint64_t lo = block_start((uint64_t)a->global, a->ns, o), hi = block_start((uint64_t)a->global, a->ns, o + 1);
    double *b = malloc((hi - lo) * sizeof(double) + 1);
    if (b == NULL) {
        fprintf(stderr, "redist: out of memory for an old block of %" PRIu64 " elements\n", hi - lo);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (uint64_t g = lo; g < hi; g++)
        b[g - lo] = value_of(g);
    *len = hi - lo;
    return b;
}

/* A new block, malloc'ed and not touched (fresh pages). */
static double *new_block(const struct args *a, uint64_t t, uint64_t *len)
{
    uint64_t lo = block_start((uint64_t)a->global, a->nt, t), hi = block_start((uint64_t)a->global, a->nt, t + 1);
    double *b = malloc((hi - lo) * sizeof(double) + 1);
    if (b == NULL) {
        fprintf(stderr, "redist: out of memory for a new block of %" PRIu64 " elements\n", hi - lo);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    *len = hi - lo;
    return b;
}

/* Index + 1 of the first wrong element of new block t, or 0. */
static uint64_t check(const struct args *a, uint64_t t, const double *b, uint64_t len)
{
    uint64_t lo = block_start((uint64_t)a->global, a->nt, t);
    for (uint64_t i = 0; i < len; i++)
        if (b[i] != value_of(lo + i))
            return lo + i + 1;
    return 0;
}

/* Alltoallv counts and displacements (elements) for a member of `comm` that
 * holds old block `o` (or none: -1) and new block `t` (or none: -1), where old
 * block k is member old_at + k and new block k is member new_at + k. */
static void counts(const struct args *a, int size, long o, long t, int old_at, int new_at, int *sc, int *sd, int *rc,
                   int *rd)
{
    uint64_t first;
    memset(sc, 0, sizeof(int) * (size_t)size);
    memset(sd, 0, sizeof(int) * (size_t)size);
    memset(rc, 0, sizeof(int) * (size_t)size);
    memset(rd, 0, sizeof(int) * (size_t)size);
    if (o >= 0) {
        uint64_t lo = block_start((uint64_t)a->global, a->ns, (uint64_t)o);
        for (long k = 0; k < a->nt; k++) {
            uint64_t n = overlap(a, (uint64_t)o, (uint64_t)k, &first);
            if (n > 0) {
                sc[new_at + k] = (int)n;
                sd[new_at + k] = (int)(first - lo);
            }
        }
    }
    if (t >= 0) {
        uint64_t lo = block_start((uint64_t)a->global, a->nt, (uint64_t)t);
        for (long k = 0; k < a->ns; k++) {
            uint64_t n = overlap(a, (uint64_t)k, (uint64_t)t, &first);
            if (n > 0) {
                rc[old_at + k] = (int)n;
                rd[old_at + k] = (int)(first - lo);
            }
        }
    }
}

/* The timed part over `comm`, for a member with old block o / new block t
 * (-1: none). Returns the elapsed ns (meaningful on the member that reports)
 * and adds this member's minor faults inside the interval to *faults. */
static uint64_t transfer(const struct args *a, MPI_Comm comm, long o, long t, int old_at, int new_at,
                         const double *src, double *dst, long *faults)
{
    int size;
    MPI_Comm_size(comm, &size);
    uint64_t t0, t1;
    long f0;

    if (a->mode == SPAWN_RMA) {
        MPI_Win win;
        uint64_t first, src_len = 0;
        if (o >= 0)
            src_len = block_start((uint64_t)a->global, a->ns, (uint64_t)o + 1) -
                      block_start((uint64_t)a->global, a->ns, (uint64_t)o);
        MPI_Barrier(comm);
        f0 = minflt();
        t0 = now_ns();
        MPI_Win_create(o >= 0 ? (void *)src : NULL, (MPI_Aint)(src_len * sizeof(double)), sizeof(double),
                       MPI_INFO_NULL, comm, &win);
        MPI_Win_lock_all(0, win);
        if (t >= 0) {
            uint64_t lo = block_start((uint64_t)a->global, a->nt, (uint64_t)t);
            for (long k = 0; k < a->ns; k++) {
                uint64_t n = overlap(a, (uint64_t)k, (uint64_t)t, &first);
                if (n == 0)
                    continue;
                MPI_Aint disp = (MPI_Aint)(first - block_start((uint64_t)a->global, a->ns, (uint64_t)k));
                MPI_Get(dst + (first - lo), (int)n, MPI_DOUBLE, old_at + (int)k, disp, (int)n, MPI_DOUBLE, win);
            }
        }
        MPI_Win_unlock_all(win);
        MPI_Win_free(&win);
        MPI_Barrier(comm);
        t1 = now_ns();
    } else {
        int *c = malloc(sizeof(int) * 4 * (size_t)size);
        if (c == NULL)
            MPI_Abort(MPI_COMM_WORLD, 1);
        counts(a, size, o, t, old_at, new_at, c, c + size, c + 2 * size, c + 3 * size);
        MPI_Barrier(comm);
        f0 = minflt();
        t0 = now_ns();
        MPI_Alltoallv(src, c, c + size, MPI_DOUBLE, dst, c + 2 * size, c + 3 * size, MPI_DOUBLE, comm);
        MPI_Barrier(comm);
        t1 = now_ns();
        free(c);
    }
    if (t >= 0)
        *faults += minflt() - f0;
    return t1 - t0;
}

/* After timing: check the new block, gather the figures on member 0 of
 * `comm`, which prints them (or aborts on a wrong element). */
static void report(const struct args *a, MPI_Comm comm, int rank, long t, const double *dst, uint64_t dst_len,
                   uint64_t elapsed, long faults)
{
    uint64_t bad = t >= 0 ? check(a, (uint64_t)t, dst, dst_len) : 0, worst = 0;
    long pages = t >= 0 ? (long)((dst_len * sizeof(double) + PAGE - 1) / PAGE) : 0;
    long mine[2] = {faults, pages}, sum[2] = {0, 0};
    MPI_Reduce(&bad, &worst, 1, MPI_UINT64_T, MPI_MAX, 0, comm);
    MPI_Reduce(mine, sum, 2, MPI_LONG, MPI_SUM, 0, comm);
    if (rank == 0) {
        if (worst != 0) {
            fprintf(stderr, "redist: %s %ld -> %ld: element %" PRIu64 " arrived wrong\n", MODE_NAMES[a->mode],
                    a->ns, a->nt, worst - 1);
            fflush(stderr);
            MPI_Abort(comm, 3);
        }
        printf("elapsed_ns=%" PRIu64 " dest_minflt=%ld dest_pages=%ld\n", elapsed, sum[0], sum[1]);
        fflush(stdout);
    }
}

/* Child side of the spawn modes: argv = MODE NS NT G. */
static int run_child(char **argv)
{
    MPI_Comm parent, merged;
    struct args a;
    char msg[300];
    int rank;
    uint64_t len;
    long faults = 0;

    MPI_Comm_get_parent(&parent);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (parent == MPI_COMM_NULL)
        fail(MPI_COMM_WORLD, rank, 2,
             CHILD_FLAG " given but there is no parent communicator "
             "(" CHILD_FLAG " is only for ranks started by MPI_Comm_spawn)");
    if (parse(argv, &a, msg, sizeof msg) != NULL)
        fail(MPI_COMM_WORLD, rank, 2, msg);
    MPI_Intercomm_merge(parent, 1, &merged);
    double *dst = new_block(&a, (uint64_t)rank, &len);
    uint64_t elapsed = transfer(&a, merged, -1, rank, 0, (int)a.ns, NULL, dst, &faults);
    int mrank;
    MPI_Comm_rank(merged, &mrank);
    report(&a, merged, mrank, rank, dst, len, elapsed, faults);
    free(dst);
    MPI_Comm_free(&merged);
    MPI_Comm_disconnect(&parent);
    MPI_Finalize();
    return 0;
}

static void run_spawn(const struct args *a, int rank, char **argv)
{
    char exe[EXE_PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0 || (size_t)n >= sizeof exe - 1) {
        fprintf(stderr, "redist: rank %d: cannot resolve /proc/self/exe: %s\n", rank,
                n < 0 ? strerror(errno) : "path too long");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    exe[n] = '\0';
    char *child_argv[] = {CHILD_FLAG, argv[1], argv[2], argv[3], argv[4], NULL};
    MPI_Comm inter, merged;
    uint64_t len;
    long faults = 0;

    double *src = old_block(a, (uint64_t)rank, &len);
    MPI_Comm_spawn(exe, child_argv, (int)a->nt, MPI_INFO_NULL, 0, MPI_COMM_WORLD, &inter, MPI_ERRCODES_IGNORE);
    MPI_Intercomm_merge(inter, 0, &merged);
    uint64_t elapsed = transfer(a, merged, rank, -1, 0, (int)a->ns, src, NULL, &faults);
    report(a, merged, rank, -1, NULL, 0, elapsed, faults);
    free(src);
    MPI_Comm_free(&merged);
    MPI_Comm_disconnect(&inter);
}

static void run_injob(const struct args *a, int rank)
{
    uint64_t src_len = 0, dst_len = 0;
    long faults = 0;
    long o = rank < a->ns ? rank : -1, t = rank < a->nt ? rank : -1;
    double *src = o >= 0 ? old_block(a, (uint64_t)o, &src_len) : NULL;
    double *dst = t >= 0 ? new_block(a, (uint64_t)t, &dst_len) : NULL;
    uint64_t elapsed = transfer(a, MPI_COMM_WORLD, o, t, 0, 0, src, dst, &faults);
    report(a, MPI_COMM_WORLD, rank, t, dst, dst_len, elapsed, faults);
    free(src);
    free(dst);
}

int main(int argc, char **argv)
{
    int rank, nranks;
    const char *prog = argc > 0 ? argv[0] : "redist";
    struct args a;
    char msg[400];

    MPI_Init(&argc, &argv);
    if (argc == 6 && strcmp(argv[1], CHILD_FLAG) == 0)
        return run_child(argv + 2);

    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    if (argc != 5) {
        snprintf(msg, sizeof msg,
                 "expected 4 arguments, got %d (usage: %.64s spawn-alltoallv|spawn-rma|injob-alltoallv NS NT "
                 "GLOBAL_ELEMS)",
                 argc - 1, prog);
        fail(MPI_COMM_WORLD, rank, 2, msg);
    }
    if (parse(argv + 1, &a, msg, sizeof msg) != NULL)
        fail(MPI_COMM_WORLD, rank, 2, msg);
    long want = a.mode == INJOB_ALLTOALLV ? (a.ns > a.nt ? a.ns : a.nt) : a.ns;
    if (nranks != want) {
        snprintf(msg, sizeof msg, "%s %ld -> %ld must run with mpirun -n %ld, not %d", MODE_NAMES[a.mode], a.ns,
                 a.nt, want, nranks);
        fail(MPI_COMM_WORLD, rank, 2, msg);
    }
    if (a.mode == INJOB_ALLTOALLV)
        run_injob(&a, rank);
    else
        run_spawn(&a, rank, argv);
    MPI_Finalize();
    return 0;
}
