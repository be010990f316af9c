/* A token source for the streaming relay benchmark (bench/proxy_bench.py --wrk).
 *
 *     sse_source PORT EVENTS EVENT_GAP_US
 *
 * Answers every HTTP/1.1 request on 127.0.0.1:PORT (any method and path; the body is
 * read by its Content-Length and ignored) with a text/event-stream of EVENTS events
 * shaped like Triton's generate_stream ones, each in its own chunk and its own write(),
 * EVENT_GAP_US apart per stream (0: as fast as the socket takes them), then the last
 * chunk; the connection stays open for the next request. One thread, epoll. It prints
 * "listening" once its socket listens. The socket has SO_REUSEPORT: several processes on one
 * PORT share its connections (the kernel spreads them), one instance with many cores' worth of
 * capacity, for a relay with many workers (bench/dataplane_bench.py --source-procs).
 *
 * Why C: the relay under test (a Python proxy, or NGINX) must be the bottleneck, not the
 * source; the twin model is Python in tritonserver and shares the same two cores.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAXC 4096
#define RBUF 65536

struct conn {
    int fd;
    int streaming;     /* 1 while answering */
    int sent;          /* events written */
    int blocked;       /* waiting for EPOLLOUT */
    long long due_us;  /* next event not before */
    size_t rlen;
    char rbuf[RBUF];
    const char *pend;  /* unwritten rest of the current write */
    size_t pend_len;
};

static struct conn *conns[MAXC];
static int top_fd;  /* conns[] scans stop here: one past the highest fd ever accepted */
static int events_per_stream;
static long long gap_us;
static int ep;

static const char HEAD[] =
    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
static char event_chunk[512];
static size_t event_chunk_len;
static const char LAST[] = "0\r\n\r\n";

static long long now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

static void drop(struct conn *c) {
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    conns[c->fd] = NULL;
    free(c);
}

static void want_out(struct conn *c, int on) {
    struct epoll_event ev = {.events = EPOLLIN | (on ? EPOLLOUT : 0), .data.fd = c->fd};
    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
    c->blocked = on;
}

/* 1: all written; 0: blocked (rest pending); -1: dead */
static int put(struct conn *c, const char *p, size_t n) {
    while (n) {
        ssize_t w = write(c->fd, p, n);
        if (w < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                c->pend = p;
                c->pend_len = n;
                want_out(c, 1);
                return 0;
            }
            if (errno == EINTR) continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 1;
}

/* A complete request head (+ body) in rbuf starts a stream. */
static int try_request(struct conn *c) {
    char *end = memmem(c->rbuf, c->rlen, "\r\n\r\n", 4);
    if (!end) return c->rlen < RBUF ? 0 : -1;
    size_t head = (size_t)(end - c->rbuf) + 4;
    size_t body = 0;
    for (char *l = c->rbuf; l < end; l++) {
        if ((l == c->rbuf || l[-1] == '\n') && strncasecmp(l, "content-length:", 15) == 0) {
            body = strtoul(l + 15, NULL, 10);
        }
    }
    if (c->rlen < head + body) return 0;
    memmove(c->rbuf, c->rbuf + head + body, c->rlen - head - body);
    c->rlen -= head + body;
    c->streaming = 1;
    c->sent = 0;
    c->due_us = now_us();
    return put(c, HEAD, sizeof HEAD - 1) < 0 ? -1 : 1;
}

/* Write the next event (or the end) of a stream that is due and not blocked. */
static int step(struct conn *c, long long now) {
    if (c->blocked || !c->streaming || c->due_us > now) return 1;
    int r;
    if (c->sent < events_per_stream) {
        r = put(c, event_chunk, event_chunk_len);
        c->sent++;
        c->due_us = now + gap_us;
    } else {
        r = put(c, LAST, sizeof LAST - 1);
        c->streaming = 0;
    }
    if (r < 0) return -1;
    if (!c->streaming && c->rlen) return try_request(c) < 0 ? -1 : 1; /* a pipelined next one */
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s PORT EVENTS EVENT_GAP_US\n", argv[0]);
        return 2;
    }
    /* A relay that drops a stream mid-way (its client left) makes the next write() raise
     * SIGPIPE, whose default kills the process: the source vanished and every later
     * connect to it was refused (the 502s once blamed on the relays at 12 workers). A
     * closed peer is a dropped connection here, as in any server. */
    signal(SIGPIPE, SIG_IGN);
    int port = atoi(argv[1]);
    events_per_stream = atoi(argv[2]);
    gap_us = atoll(argv[3]);
    const char *payload =
        "data: {\"model_name\":\"ensemble\",\"model_version\":\"1\",\"sequence_end\":false,"
        "\"sequence_id\":0,\"sequence_start\":false,\"text_output\":\" token\"}\n\n";
    event_chunk_len = (size_t)snprintf(event_chunk, sizeof event_chunk, "%zx\r\n%s\r\n", strlen(payload), payload);

    int ls = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    setsockopt(ls, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1024)) {
        perror("bind/listen");
        return 1;
    }
    printf("listening\n");
    fflush(stdout);
    ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = ls};
    epoll_ctl(ep, EPOLL_CTL_ADD, ls, &ev);
    struct epoll_event evs[256];
    for (;;) {
        /* Wait no longer than the next due event of a stream. */
        long long now = now_us(), next = -1;
        for (int fd = 0; fd < top_fd; fd++) {
            struct conn *c = conns[fd];
            if (c && c->streaming && !c->blocked) {
                long long d = c->due_us - now;
                if (d < 0) d = 0;
                if (next < 0 || d < next) next = d;
            }
        }
        int timeout = next < 0 ? -1 : (int)((next + 999) / 1000);
        int n = epoll_wait(ep, evs, 256, timeout);
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == ls) {
                int cfd;
                while ((cfd = accept4(ls, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    if (cfd >= MAXC) { close(cfd); continue; }
                    if (cfd >= top_fd) top_fd = cfd + 1;
                    setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    struct conn *c = calloc(1, sizeof *c);
                    c->fd = cfd;
                    conns[cfd] = c;
                    struct epoll_event e = {.events = EPOLLIN, .data.fd = cfd};
                    epoll_ctl(ep, EPOLL_CTL_ADD, cfd, &e);
                }
                continue;
            }
            struct conn *c = conns[fd];
            if (!c) continue;
            if (evs[i].events & EPOLLOUT) {
                want_out(c, 0);
                if (c->pend_len) {
                    const char *p = c->pend;
                    size_t len = c->pend_len;
                    c->pend_len = 0;
                    if (put(c, p, len) < 0) { drop(c); continue; }
                }
            }
            if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
                ssize_t r = read(fd, c->rbuf + c->rlen, RBUF - c->rlen);
                if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) { drop(c); continue; }
                if (r > 0) c->rlen += (size_t)r;
                if (!c->streaming && try_request(c) < 0) { drop(c); continue; }
            }
        }
        now = now_us();
        for (int fd = 0; fd < top_fd; fd++) {
            struct conn *c = conns[fd];
            if (c && step(c, now) < 0) drop(c);
        }
    }
}
