/*
 * pingpong.c - Open MPI comparison peer for the ductile transport benchmark.
 *
 * Usage (exactly 2 ranks):
 *   mpirun -n 2 ./pingpong MODE ITERS SIZE
 *
 *   MODE   latency | bandwidth
 *   ITERS  positive integer
 *   SIZE   message size in bytes (>= 0)
 *
 * latency:   ITERS timed round trips of SIZE-byte messages (MPI_Send /
 *            MPI_Recv; rank 0 sends first, rank 1 echoes).
 * bandwidth: rank 0 streams ITERS messages of SIZE bytes to rank 1 with a
 *            window of up to WINDOW outstanding MPI_Isend requests; rank 1
 *            receives them into one reused buffer and answers with a 1-byte
 *            ack. The timing covers first send .. ack received.
 *
 * Both modes do min(ITERS, 100) untimed warm-up iterations followed by an
 * MPI_Barrier. Rank 0 prints exactly one line to stdout:
 *   elapsed_ns=N
 * where N is the wall time (CLOCK_MONOTONIC) of the timed part.
 *
 * Bad arguments: one line on stderr, exit code 2 (via MPI_Abort).
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
#include "peer_util.h"

#define WINDOW 8
#define WARMUP_MAX 100
#define TAG_DATA 1
#define TAG_ACK 2

enum mode { MODE_LATENCY, MODE_BANDWIDTH };

/* Fail the whole job with exit code `code`. Only rank 0 prints the message
 * and calls MPI_Abort; other ranks park in a barrier that rank 0 never
 * enters, so mpirun kills them. (Letting every rank call MPI_Abort at once
 * makes Open MPI 4.1's mpirun print spurious ORTE_ERROR_LOG lines.) */
static void fail(int rank, int code, const char *msg)
{
    if (rank == 0) {
        fprintf(stderr, "pingpong: %s\n", msg);
        fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, code);
    } else {
        MPI_Barrier(MPI_COMM_WORLD);
        MPI_Abort(MPI_COMM_WORLD, code); /* not reached */
    }
    exit(code); /* not reached */
}

static void run_latency(int rank, long iters, int size, char *buf)
{
    long warm = iters < WARMUP_MAX ? iters : WARMUP_MAX;
    int peer = 1 - rank;

    for (long i = 0; i < warm; i++) {
        if (rank == 0) {
            MPI_Send(buf, size, MPI_BYTE, peer, TAG_DATA, MPI_COMM_WORLD);
            MPI_Recv(buf, size, MPI_BYTE, peer, TAG_DATA, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
        } else {
            MPI_Recv(buf, size, MPI_BYTE, peer, TAG_DATA, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
            MPI_Send(buf, size, MPI_BYTE, peer, TAG_DATA, MPI_COMM_WORLD);
        }
    }
    MPI_Barrier(MPI_COMM_WORLD);

    if (rank == 0) {
        uint64_t t0 = now_ns();
        for (long i = 0; i < iters; i++) {
            MPI_Send(buf, size, MPI_BYTE, peer, TAG_DATA, MPI_COMM_WORLD);
            MPI_Recv(buf, size, MPI_BYTE, peer, TAG_DATA, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
        }
        uint64_t t1 = now_ns();
        printf("elapsed_ns=%" PRIu64 "\n", t1 - t0);
        fflush(stdout);
    } else {
        for (long i = 0; i < iters; i++) {
            MPI_Recv(buf, size, MPI_BYTE, peer, TAG_DATA, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
            MPI_Send(buf, size, MPI_BYTE, peer, TAG_DATA, MPI_COMM_WORLD);
        }
    }
}

/* One stream of n messages rank 0 -> rank 1, then a 1-byte ack 1 -> 0.
 * Returns the elapsed time on rank 0 (0 on rank 1). */
static uint64_t stream(int rank, long n, int size, char *buf, char *ack)
{
    MPI_Request req[WINDOW];
    uint64_t t0 = 0, t1 = 0;

    if (rank == 0) {
        t0 = now_ns();
        for (long i = 0; i < n; i += WINDOW) {
            int k = (n - i) < WINDOW ? (int)(n - i) : WINDOW;
            for (int j = 0; j < k; j++)
                MPI_Isend(buf, size, MPI_BYTE, 1, TAG_DATA, MPI_COMM_WORLD,
                          &req[j]);
            MPI_Waitall(k, req, MPI_STATUSES_IGNORE);
        }
        MPI_Recv(ack, 1, MPI_BYTE, 1, TAG_ACK, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
        t1 = now_ns();
    } else {
        for (long i = 0; i < n; i += WINDOW) {
            int k = (n - i) < WINDOW ? (int)(n - i) : WINDOW;
            for (int j = 0; j < k; j++)
                MPI_Irecv(buf, size, MPI_BYTE, 0, TAG_DATA, MPI_COMM_WORLD,
                          &req[j]);
            MPI_Waitall(k, req, MPI_STATUSES_IGNORE);
        }
        MPI_Send(ack, 1, MPI_BYTE, 0, TAG_ACK, MPI_COMM_WORLD);
    }
    return t1 - t0;
}

static void run_bandwidth(int rank, long iters, int size, char *buf)
{
    long warm = iters < WARMUP_MAX ? iters : WARMUP_MAX;
    char ack = 0;

    (void)stream(rank, warm, size, buf, &ack);
    MPI_Barrier(MPI_COMM_WORLD);

    uint64_t elapsed = stream(rank, iters, size, buf, &ack);
    if (rank == 0) {
        printf("elapsed_ns=%" PRIu64 "\n", elapsed);
        fflush(stdout);
    }
}

int main(int argc, char **argv)
{
    int rank, nranks;
    const char *prog = argc > 0 ? argv[0] : "pingpong";
    enum mode mode = MODE_LATENCY;
    long iters = 0, size = 0;
    char *buf;
    char msg[256] = "";

    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);

    if (nranks != 2) {
        snprintf(msg, sizeof msg,
                 "must be run with exactly 2 ranks, got %d (mpirun -n 2 ...)",
                 nranks);
        fail(rank, 2, msg);
    }
    if (argc != 4)
        snprintf(msg, sizeof msg, "expected 3 arguments, got %d", argc - 1);
    else if (strcmp(argv[1], "latency") == 0)
        mode = MODE_LATENCY;
    else if (strcmp(argv[1], "bandwidth") == 0)
        mode = MODE_BANDWIDTH;
    else
        snprintf(msg, sizeof msg,
                 "MODE must be 'latency' or 'bandwidth', got '%.64s'",
                 argv[1]);
    if (msg[0] == '\0' && (parse_count(argv[2], &iters) != 0 || iters < 1))
        snprintf(msg, sizeof msg,
                 "ITERS must be a positive integer <= %d, got '%.64s'",
                 INT_MAX, argv[2]);
    if (msg[0] == '\0' && parse_count(argv[3], &size) != 0)
        snprintf(msg, sizeof msg,
                 "SIZE must be an integer in [0, %d], got '%.64s'", INT_MAX,
                 argv[3]);
    if (msg[0] != '\0') {
        char line[400];
        snprintf(line, sizeof line,
                 "%s (usage: %.64s latency|bandwidth ITERS SIZE)", msg, prog);
        fail(rank, 2, line);
    }

    /* Allocate at least 1 byte so SIZE=0 still gives a valid pointer, and
     * touch every page before timing. */
    buf = malloc(size > 0 ? (size_t)size : 1);
    if (buf == NULL) {
        fprintf(stderr, "pingpong: rank %d: cannot allocate %ld bytes\n",
                rank, size);
        fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
        return 1;
    }
    memset(buf, rank == 0 ? 0xA5 : 0x5A, size > 0 ? (size_t)size : 1);

    if (mode == MODE_LATENCY)
        run_latency(rank, iters, (int)size, buf);
    else
        run_bandwidth(rank, iters, (int)size, buf);

    free(buf);
    MPI_Finalize();
    return 0;
}
