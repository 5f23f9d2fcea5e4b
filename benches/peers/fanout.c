/*
 * fanout.c - 1 source -> K targets, 64 MiB each, over libfabric shm (FI_EP_RDM).
 *
 *   usage: ./fanout MODE K FRESH [RUNS]
 *     MODE  : pull   (targets fi_read 8 MiB chunks from source MR, <=4 in flight)
 *             tagged (source fi_tsend 8 MiB chunks, interleaved over targets,
 *                     <=INFLIGHT per target; targets pre-post fi_trecv)
 *     K     : number of target processes
 *     FRESH : 1 = target buffer freshly mmap'd (first touch during transfer)
 *             0 = target buffer pre-touched (memset before the start barrier)
 *     RUNS  : timed runs (default 5); one untimed warm-up run precedes them.
 *   env:
 *     FANOUT_RMA_ORDER=1  request RMA ordering in tx_attr->msg_order
 *                         (disables shm "fast RMA": the source's progress
 *                         then does the copy instead of the reader)
 *     FANOUT_INFLIGHT=n   max in-flight ops per target (default 4)
 *     FANOUT_YIELD=1      sched_yield() when fi_cq_read returns -FI_EAGAIN
 *
 * Data correctness is verified on the warm-up run and on the first timed run.
 * Timing: t0 = source clock just before it releases the targets (pipe "barrier");
 * end = latest CLOCK_MONOTONIC completion time reported by a target.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <errno.h>
#include <time.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>
#include <rdma/fi_errno.h>

#define PER_TGT   (64ul << 20)
#define CHUNK     (8ul << 20)
#define NCHUNK    (PER_TGT / CHUNK)
#define MAXK      16
#define PAT(j)    ((uint64_t)(j) * 0x9E3779B97F4A7C15ull + 1)

#define CHK(x) do { int _r = (int)(x); if (_r) { fprintf(stderr, "[%d] %s:%d %s = %d (%s)\n", \
        getpid(), __FILE__, __LINE__, #x, _r, fi_strerror(-_r)); exit(1); } } while (0)

static struct fi_info *info;
static struct fid_fabric *fabric;
static struct fid_domain *domain;
static struct fid_ep *ep;
static struct fid_av *av;
static struct fid_cq *cq;
static int do_yield, inflight_max = 4;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static void xwrite(int fd, const void *b, size_t n) {
    const char *p = b;
    while (n) { ssize_t r = write(fd, p, n); if (r < 0) { if (errno == EINTR) continue; perror("write"); exit(1); } p += r; n -= r; }
}
static void xread(int fd, void *b, size_t n) {
    char *p = b;
    while (n) { ssize_t r = read(fd, p, n); if (r < 0) { if (errno == EINTR || errno == EAGAIN) continue; perror("read"); exit(1); }
        if (r == 0) { fprintf(stderr, "[%d] pipe EOF\n", getpid()); exit(1); } p += r; n -= r; }
}

static void fab_init(void) {
    struct fi_info *hints = fi_allocinfo();
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_TAGGED | FI_RMA | FI_READ | FI_REMOTE_READ;
    hints->fabric_attr->prov_name = strdup("shm");
    hints->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_PROV_KEY | FI_MR_LOCAL | FI_MR_ALLOCATED;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->domain_attr->data_progress = FI_PROGRESS_MANUAL;
    if (getenv("FANOUT_RMA_ORDER") && atoi(getenv("FANOUT_RMA_ORDER")))
        hints->tx_attr->msg_order = FI_ORDER_RAR | FI_ORDER_RAW | FI_ORDER_WAR | FI_ORDER_WAW | FI_ORDER_SAS;
    CHK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &info));
    fi_freeinfo(hints);
    CHK(fi_fabric(info->fabric_attr, &fabric, NULL));
    CHK(fi_domain(fabric, info, &domain, NULL));
    struct fi_cq_attr cqa = { .format = FI_CQ_FORMAT_TAGGED, .size = 0, .wait_obj = FI_WAIT_NONE };
    CHK(fi_cq_open(domain, &cqa, &cq, NULL));
    struct fi_av_attr ava = { .type = FI_AV_TABLE };
    CHK(fi_av_open(domain, &ava, &av, NULL));
    CHK(fi_endpoint(domain, info, &ep, NULL));
    CHK(fi_ep_bind(ep, &av->fid, 0));
    CHK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
    CHK(fi_enable(ep));
}

static void fab_fini(void) {
    fi_close(&ep->fid); fi_close(&av->fid); fi_close(&cq->fid);
    fi_close(&domain->fid); fi_close(&fabric->fid); fi_freeinfo(info);
}

static void send_name(int fd) {
    char name[256]; size_t len = sizeof(name);
    CHK(fi_getname(&ep->fid, name, &len));
    uint32_t l = len; xwrite(fd, &l, 4); xwrite(fd, name, len);
}
static fi_addr_t recv_name(int fd) {
    char name[256]; uint32_t l; xread(fd, &l, 4); xread(fd, name, l);
    fi_addr_t a;
    if (fi_av_insert(av, name, 1, &a, 0, NULL) != 1) { fprintf(stderr, "av_insert failed\n"); exit(1); }
    return a;
}

/* returns number of completions; fills ctx pointers */
static int poll_cq(void **ctxs, int max) {
    struct fi_cq_tagged_entry e[16];
    if (max > 16) max = 16;
    ssize_t n = fi_cq_read(cq, e, max);
    if (n == -FI_EAGAIN) { if (do_yield) sched_yield(); return 0; }
    if (n < 0) {
        if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry err = {0};
            fi_cq_readerr(cq, &err, 0);
            fprintf(stderr, "[%d] cq error: %s (prov_errno %d) len %zu\n", getpid(),
                    fi_strerror(err.err), err.prov_errno, err.len);
        } else fprintf(stderr, "[%d] fi_cq_read: %s\n", getpid(), fi_strerror((int)-n));
        exit(1);
    }
    for (int i = 0; i < n; i++) if (ctxs) ctxs[i] = e[i].op_context;
    return (int)n;
}

struct go_msg { char op; uint64_t addr, key; };
struct done_msg { double t_end; int ok; };

static int cmpd(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return x < y ? -1 : x > y; }

/* ------------------------------------------------------------------ target */
static void target(int idx, int K, int pull, int fresh, int nruns, int rfd, int wfd) {
    fab_init();
    send_name(wfd);
    fi_addr_t src = recv_name(rfd);
    int need_local = (info->domain_attr->mr_mode & FI_MR_LOCAL) != 0;
    struct fi_context ctx[NCHUNK];

    for (int run = 0; run < nruns; run++) {
        char *buf = mmap(NULL, PER_TGT, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (buf == MAP_FAILED) { perror("mmap"); exit(1); }
        if (!fresh) memset(buf, 0, PER_TGT);
        struct fid_mr *lmr = NULL; void *desc = NULL;
        if (need_local) {
            CHK(fi_mr_reg(domain, buf, PER_TGT, pull ? FI_READ : FI_RECV, 0, 0, 0, &lmr, NULL));
            desc = fi_mr_desc(lmr);
        }
        if (!pull) { /* pre-post all receives */
            for (size_t c = 0; c < NCHUNK; c++) {
                ssize_t r;
                while ((r = fi_trecv(ep, buf + c * CHUNK, CHUNK, desc, FI_ADDR_UNSPEC, c, 0, &ctx[c])) == -FI_EAGAIN)
                    poll_cq(NULL, 0);
                CHK(r);
            }
        }
        xwrite(wfd, "R", 1);
        struct go_msg g; xread(rfd, &g, sizeof g);
        int done = 0;
        if (pull) {
            size_t next = 0; int infl = 0;
            while (done < (int)NCHUNK) {
                while (infl < inflight_max && next < NCHUNK) {
                    ssize_t r = fi_read(ep, buf + next * CHUNK, CHUNK, desc, src,
                                        g.addr + idx * PER_TGT + next * CHUNK, g.key, &ctx[next]);
                    if (r == -FI_EAGAIN) break;
                    CHK(r);
                    next++; infl++;
                }
                int n = poll_cq(NULL, 16); done += n; infl -= n;
            }
        } else {
            while (done < (int)NCHUNK) done += poll_cq(NULL, 16);
        }
        struct done_msg d = { now(), 1 };
        if (run <= 1) { /* verify */
            uint64_t *w = (uint64_t *)buf; size_t nw = PER_TGT / 8, base = (size_t)idx * nw;
            for (size_t j = 0; j < nw; j++) if (w[j] != PAT(base + j)) {
                fprintf(stderr, "[tgt %d] MISMATCH run %d word %zu: %lx != %lx\n", idx, run, j,
                        (unsigned long)w[j], (unsigned long)PAT(base + j));
                d.ok = 0; break;
            }
        }
        xwrite(wfd, &d, sizeof d);
        if (lmr) fi_close(&lmr->fid);
        munmap(buf, PER_TGT);
    }
    char q; xread(rfd, &q, 1);
    fab_fini();
}

/* ------------------------------------------------------------------ source */
int main(int argc, char **argv) {
    if (argc < 4) { fprintf(stderr, "usage: %s pull|tagged K FRESH [RUNS]\n", argv[0]); return 2; }
    int pull = !strcmp(argv[1], "pull");
    if (!pull && strcmp(argv[1], "tagged")) { fprintf(stderr, "bad mode\n"); return 2; }
    int K = atoi(argv[2]), fresh = atoi(argv[3]), truns = argc > 4 ? atoi(argv[4]) : 5;
    if (K < 1 || K > MAXK) return 2;
    int nruns = truns + 1;
    do_yield = getenv("FANOUT_YIELD") && atoi(getenv("FANOUT_YIELD"));
    if (getenv("FANOUT_INFLIGHT")) inflight_max = atoi(getenv("FANOUT_INFLIGHT"));

    int to_t[MAXK][2], from_t[MAXK][2]; pid_t pids[MAXK];
    for (int i = 0; i < K; i++) {
        if (pipe(to_t[i]) || pipe(from_t[i])) { perror("pipe"); return 1; }
    }
    for (int i = 0; i < K; i++) {
        pid_t p = fork();
        if (p == 0) {
            for (int j = 0; j < K; j++) {
                close(to_t[j][1]); close(from_t[j][0]);
                if (j != i) { close(to_t[j][0]); close(from_t[j][1]); }
            }
            target(i, K, pull, fresh, nruns, to_t[i][0], from_t[i][1]);
            _exit(0);
        }
        pids[i] = p;
        close(to_t[i][0]); close(from_t[i][1]);
    }

    /* source data: K * 64 MiB, pre-filled (warm) */
    size_t total = (size_t)K * PER_TGT;
    uint64_t *sbuf = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    for (size_t j = 0; j < total / 8; j++) sbuf[j] = PAT(j);

    fab_init();
    if (getenv("FANOUT_VERBOSE")) fprintf(stderr, "%s", fi_tostr(info, FI_TYPE_INFO));
    uint64_t mrm = info->domain_attr->mr_mode;
    fprintf(stderr, "# provider %s mr_mode=0x%lx (VIRT_ADDR=%d PROV_KEY=%d LOCAL=%d) msg_order=0x%lx "
            "inject=%zu max_msg=%zu tx_size=%zu rx_size=%zu\n",
            info->fabric_attr->prov_name, (unsigned long)mrm, !!(mrm & FI_MR_VIRT_ADDR), !!(mrm & FI_MR_PROV_KEY),
            !!(mrm & FI_MR_LOCAL), (unsigned long)info->tx_attr->msg_order, info->tx_attr->inject_size,
            info->ep_attr->max_msg_size, info->tx_attr->size, info->rx_attr->size);
    fi_addr_t taddr[MAXK];
    for (int i = 0; i < K; i++) taddr[i] = recv_name(from_t[i][0]);
    for (int i = 0; i < K; i++) send_name(to_t[i][1]);
    for (int i = 0; i < K; i++) fcntl(from_t[i][0], F_SETFL, O_NONBLOCK);

    double gbs[64]; int ok_all = 1;
    struct fi_context sctx[MAXK][NCHUNK];
    for (int run = 0; run < nruns; run++) {
        struct fid_mr *mr = NULL; void *sdesc = NULL;
        uint64_t raddr = 0, key = 0;
        uint64_t acc = pull ? FI_REMOTE_READ : FI_SEND;
        if (pull || (mrm & FI_MR_LOCAL)) {
            CHK(fi_mr_reg(domain, sbuf, total, acc, 0, 0x1234, 0, &mr, NULL));
            if (mrm & FI_MR_ENDPOINT) { CHK(fi_mr_bind(mr, &ep->fid, 0)); CHK(fi_mr_enable(mr)); }
            key = fi_mr_key(mr); sdesc = fi_mr_desc(mr);
            raddr = (mrm & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)sbuf : 0;
        }
        for (int i = 0; i < K; i++) { char c; xread(from_t[i][0], &c, 1); }   /* all targets ready */
        double t0 = now();
        struct go_msg g = { 'G', raddr, key };
        for (int i = 0; i < K; i++) xwrite(to_t[i][1], &g, sizeof g);

        int ndone = 0; double t_end = 0; struct done_msg dm[MAXK]; size_t dgot[MAXK] = {0};
        size_t next[MAXK] = {0}; int infl[MAXK] = {0}; int sends_left = pull ? 0 : K * (int)NCHUNK;
        long eagain = 0;
        while (ndone < K || sends_left > 0) {
            if (!pull) { /* interleave: one chunk per target per round */
                for (int i = 0; i < K; i++) {
                    if (infl[i] < inflight_max && next[i] < NCHUNK) {
                        size_t c = next[i];
                        ssize_t r = fi_tsend(ep, (char *)sbuf + i * PER_TGT + c * CHUNK, CHUNK, sdesc,
                                             taddr[i], c, &sctx[i][c]);
                        if (r == -FI_EAGAIN) { eagain++; continue; }
                        CHK(r);
                        next[i]++; infl[i]++;
                    }
                }
            }
            void *ctxs[16];
            int n = poll_cq(ctxs, 16);
            for (int k = 0; k < n; k++) {
                for (int i = 0; i < K; i++)
                    if ((char *)ctxs[k] >= (char *)sctx[i] && (char *)ctxs[k] < (char *)sctx[i + 1]) { infl[i]--; sends_left--; }
            }
            for (int i = 0; i < K; i++) {   /* non-blocking check for target completion */
                if (dgot[i] == sizeof(struct done_msg)) continue;
                ssize_t r = read(from_t[i][0], (char *)&dm[i] + dgot[i], sizeof(struct done_msg) - dgot[i]);
                if (r > 0) {
                    dgot[i] += r;
                    if (dgot[i] == sizeof(struct done_msg)) {
                        ndone++; if (dm[i].t_end > t_end) t_end = dm[i].t_end;
                        if (!dm[i].ok) ok_all = 0;
                    }
                }
            }
        }
        double dt = t_end - t0;
        if (mr) fi_close(&mr->fid);
        double rate = total / dt / 1e9;
        fprintf(stderr, "#  run %d%s: %.3f ms  %.2f GB/s%s\n", run, run == 0 ? " (warm-up)" : "",
                dt * 1e3, rate, eagain ? " (tsend EAGAINs)" : "");
        if (run > 0) gbs[run - 1] = rate;
    }
    for (int i = 0; i < K; i++) xwrite(to_t[i][1], "Q", 1);
    for (int i = 0; i < K; i++) waitpid(pids[i], NULL, 0);
    fab_fini();
    qsort(gbs, truns, sizeof(double), cmpd);
    printf("mode=%s K=%d %s runs=%d median=%.2f GB/s min=%.2f max=%.2f verify=%s\n",
           pull ? "pull" : "tagged", K, fresh ? "fresh" : "warm", truns, gbs[truns / 2], gbs[0], gbs[truns - 1],
           ok_all ? "OK" : "FAILED");
    return ok_all ? 0 : 1;
}
