/* A compiled front for one data-plane worker: a measurement of issue 22's plan, not a product path.
 *
 *     _compiled_front.serve(listen_fd, ports, decide=None, release=None)   (bench/_compiled_front.py)
 *
 * One thread, one epoll, edge-triggered: it accepts HTTP/1.1 clients on `listen_fd`, reads a
 * request whole (head + Content-Length body), picks an instance, sends the request's bytes as
 * they came over a pooled keep-alive connection to 127.0.0.1:ports[i], and relays the answer's
 * bytes to the client as they arrive (no buffering: each read is written), following its framing
 * (Content-Length or chunked) to know where it ends, so both connections are kept for the next
 * request. What it asks: how much of NGINX's per-request cost a relay in C reaches, with the
 * decision in C (`decide=None`: least requests in flight, ties in turn, as NGINX's least_conn)
 * and with the product's Python policy called once per request (`decide(body) -> index or -1`,
 * `release(index)` when the answer ended or was cut): bench/README.md, "A compiled front".
 *
 * With `handoff` (start() only), a request whose path is not a hot native route (/v2/models/...
 * ending in one of `hot_suffixes`) is not the front's: its connection and the bytes read so far go to
 * `handoff(fd, bytes)`, the worker's aiohttp side (bench/_compiled_front.py feeds them to it).
 *
 * Left out, as in bench/_min_relay.py: limits, deadlines, the admin surface, hold, header hygiene,
 * metrics, chunked request bodies (answered 411), gRPC and the OpenAI routes. A connect that
 * fails is tried on the next instance (the C decision) or answered 502 (a Python decision); a
 * pooled connection the instance closed before answering is retried once on a new one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_INST 64
#define MAX_REQUEST (1 << 20)
#define HEAD_MAX 8192
#define RELAY_BUF 65536

enum kind { K_LISTEN, K_CLIENT, K_UP };
enum up_state { U_IDLE, U_CONNECTING, U_SENDING, U_HEAD, U_BODY };
enum chunk_state { C_SIZE, C_EXT, C_DATA, C_DATA_END, C_TRAILER_START, C_TRAILER_LINE, C_DONE };

typedef struct up up_t;

typedef struct client {
    int kind, fd;
    char *in;
    size_t in_len, in_cap;
    size_t req_len;  /* the request in flight: in[0, req_len) */
    int busy;        /* a request in flight */
    int close_after; /* Connection: close, or an answer framed by the end of its connection */
    int resp_done;   /* the answer ended; its last bytes wait in `out` */
    char *out;
    size_t out_len, out_off, out_cap;
    up_t *up;
    int tries;
} client_t;

struct up {
    int kind, fd, inst;
    int state;
    int reused, got_bytes, readable_pending;
    client_t *cl;
    size_t send_off;
    char head[HEAD_MAX];
    size_t head_len;
    int chunked, cstate, keep, until_close;
    long long remain;
    up_t *next_idle;
};

static int ep = -1;
static int n_inst;
static struct sockaddr_in addrs[MAX_INST];
static int inflight[MAX_INST];
static unsigned long long last_pick[MAX_INST], picks;
static up_t *idle[MAX_INST];
static PyObject *decide_cb, *release_cb, *inst_objs[MAX_INST];
static int decide_head;  /* decide(head, body) instead of decide(body): the product's rules read the head */
/* Requests the front does not serve go to `handoff_cb(fd, bytes_read)` with their connection: those
 * whose path (before any '?') is not /v2/models/<...><a hot suffix>, where suffixes are given. */
static PyObject *handoff_cb;
static char hot[8][32];
static size_t hot_len[8];
static int n_hot;
static char relay_buf[RELAY_BUF];
/* Closed this turn of the loop: freed after it, as a later event of the same batch may name them. */
static void **dead;
static size_t n_dead, dead_cap;

static const char R502[] = "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n";
static const char R503[] = "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n";
static const char R411[] = "HTTP/1.1 411 Length Required\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
static const char R413[] = "HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

static void client_close(client_t *c);
static void try_request(client_t *c);
static void up_readable(up_t *u);
static void start_upstream(client_t *c, int inst);

static void bury(void *p) {
    if (n_dead == dead_cap) {
        size_t cap = dead_cap ? dead_cap * 2 : 256;
        void **d = realloc(dead, cap * sizeof *d);
        if (d == NULL) return;  /* leaked rather than freed under a pending event */
        dead = d;
        dead_cap = cap;
    }
    dead[n_dead++] = p;
}

static void watch(int fd, void *ptr, unsigned events) {
    struct epoll_event ev = {.events = events, .data.ptr = ptr};
    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
}

/* --- the decision ------------------------------------------------------------------------- */
static int pick_in_c(int skip) {
    int best = -1;
    for (int i = 0; i < n_inst; i++) {
        if (i == skip) continue;
        if (best < 0 || inflight[i] < inflight[best] ||
            (inflight[i] == inflight[best] && last_pick[i] < last_pick[best]))
            best = i;
    }
    return best;
}

static int decide(client_t *c, size_t head_len, int skip) {
    int inst;
    if (decide_cb == NULL) {
        inst = pick_in_c(skip);
    } else {
        if (skip >= 0) return -1;  /* the Python policy retries nothing here */
        PyObject *body = PyBytes_FromStringAndSize(c->in + head_len, (Py_ssize_t)(c->req_len - head_len));
        PyObject *r;
        if (body != NULL && decide_head)
            r = PyObject_CallFunction(decide_cb, "y#O", c->in, (Py_ssize_t)head_len, body);
        else
            r = body ? PyObject_CallOneArg(decide_cb, body) : NULL;
        Py_XDECREF(body);
        inst = r ? (int)PyLong_AsLong(r) : -1;
        Py_XDECREF(r);
        if (PyErr_Occurred()) { PyErr_Print(); inst = -1; }
        if (inst >= n_inst) inst = -1;
    }
    if (inst >= 0) {
        inflight[inst]++;
        last_pick[inst] = ++picks;
    }
    return inst;
}

static void released(int inst) {
    inflight[inst]--;
    if (release_cb != NULL) {
        PyObject *r = PyObject_CallOneArg(release_cb, inst_objs[inst]);
        if (r == NULL) PyErr_Print();
        Py_XDECREF(r);
    }
}

/* --- writing to the client ---------------------------------------------------------------- */
static int out_keep(client_t *c, const char *p, size_t n) {
    if (c->out_len - c->out_off + n > c->out_cap || c->out_off) {
        size_t pending = c->out_len - c->out_off;
        if (c->out_off) memmove(c->out, c->out + c->out_off, pending);
        c->out_len = pending;
        c->out_off = 0;
        if (pending + n > c->out_cap) {
            size_t cap = c->out_cap ? c->out_cap : 16384;
            while (cap < pending + n) cap *= 2;
            char *o = realloc(c->out, cap);
            if (o == NULL) return -1;
            c->out = o;
            c->out_cap = cap;
        }
    }
    memcpy(c->out + c->out_len, p, n);
    c->out_len += n;
    return 0;
}

/* Write what it can now, keep the rest for EPOLLOUT. -1: the client is gone. */
static int to_client(client_t *c, struct iovec *iov, int cnt) {
    size_t total = 0;
    for (int i = 0; i < cnt; i++) total += iov[i].iov_len;
    ssize_t w = 0;
    if (c->out_len == c->out_off) {
        w = writev(c->fd, iov, cnt);
        if (w < 0) {
            if (errno != EAGAIN) return -1;
            w = 0;
        }
    }
    if ((size_t)w == total) return 0;
    for (int i = 0; i < cnt; i++) {
        if ((size_t)w >= iov[i].iov_len) { w -= iov[i].iov_len; continue; }
        if (out_keep(c, (char *)iov[i].iov_base + w, iov[i].iov_len - w) < 0) return -1;
        w = 0;
    }
    return 0;
}

static void answer(client_t *c, const char *msg, size_t len) {
    struct iovec iov = {(void *)msg, len};
    if (to_client(c, &iov, 1) < 0) client_close(c);
}

/* --- the end of a request ------------------------------------------------------------------- */
static void request_done(client_t *c) {
    size_t rest = c->in_len - c->req_len;
    if (rest) memmove(c->in, c->in + c->req_len, rest);
    c->in_len = rest;
    c->req_len = 0;
    c->busy = c->resp_done = 0;
    c->up = NULL;
    c->tries = 0;
    if (c->close_after) { client_close(c); return; }
    if (rest) try_request(c);  /* pipelined */
}

static void up_close(up_t *u) {
    close(u->fd);
    u->fd = -1;
    bury(u);
}

static void answer_ended(up_t *u) {
    client_t *c = u->cl;
    int inst = u->inst;
    u->cl = NULL;
    if (u->keep && !u->until_close) {
        u->state = U_IDLE;
        u->reused = 1;
        u->next_idle = idle[inst];
        idle[inst] = u;
    } else {
        up_close(u);
    }
    released(inst);
    c->up = NULL;
    if (c->out_len > c->out_off) c->resp_done = 1;  /* ends when the last bytes are written */
    else request_done(c);
}

static void idle_remove(up_t *u) {
    for (up_t **p = &idle[u->inst]; *p; p = &(*p)->next_idle)
        if (*p == u) { *p = u->next_idle; return; }
}

/* The instance failed this request before answering: another instance (C decision), or 502. */
static void up_failed(up_t *u) {
    client_t *c = u->cl;
    int inst = u->inst;
    int stale = u->reused && !u->got_bytes;
    up_close(u);
    c->up = NULL;
    if (stale && c->tries < 3) {  /* a kept connection the instance had closed: once more */
        c->tries++;
        start_upstream(c, inst);
        return;
    }
    released(inst);
    if (decide_cb == NULL && c->tries < 3) {
        c->tries++;
        int next = decide(c, 0, inst);
        if (next >= 0) { start_upstream(c, next); return; }
    }
    answer(c, R502, sizeof R502 - 1);
    if (c->fd >= 0) request_done(c);
}

/* --- the instance's side ------------------------------------------------------------------- */
static void up_send(up_t *u) {
    client_t *c = u->cl;
    while (u->send_off < c->req_len) {
        ssize_t w = write(u->fd, c->in + u->send_off, c->req_len - u->send_off);
        if (w < 0) {
            if (errno == EAGAIN) return;
            up_failed(u);
            return;
        }
        u->send_off += (size_t)w;
    }
    u->state = U_HEAD;
    if (u->readable_pending) {
        u->readable_pending = 0;
        up_readable(u);
    }
}

static void start_upstream(client_t *c, int inst) {
    up_t *u = idle[inst];
    if (u != NULL) {
        idle[inst] = u->next_idle;
    } else {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        u = calloc(1, sizeof *u);
        if (fd < 0 || u == NULL) {
            if (fd >= 0) close(fd);
            free(u);
            released(inst);
            answer(c, R502, sizeof R502 - 1);
            if (c->fd >= 0) request_done(c);
            return;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        u->kind = K_UP;
        u->fd = fd;
        u->inst = inst;
        int r = connect(fd, (struct sockaddr *)&addrs[inst], sizeof addrs[inst]);
        u->state = (r == 0) ? U_SENDING : U_CONNECTING;
        watch(fd, u, EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET);
        if (r < 0 && errno != EINPROGRESS) {
            u->cl = c;
            c->up = u;
            up_failed(u);
            return;
        }
    }
    u->cl = c;
    c->up = u;
    u->send_off = 0;
    u->head_len = 0;
    u->got_bytes = u->readable_pending = 0;
    u->chunked = u->until_close = 0;
    u->keep = 1;
    u->remain = 0;
    u->cstate = C_SIZE;
    if (u->state == U_IDLE) u->state = U_SENDING;
    if (u->state == U_SENDING) up_send(u);
}

/* How many of p[0, n) belong to the answer; the state says when it ended. */
static size_t body_feed(up_t *u, const char *p, size_t n) {
    if (u->until_close) return n;
    if (!u->chunked) {
        size_t take = (long long)n < u->remain ? n : (size_t)u->remain;
        u->remain -= (long long)take;
        if (u->remain == 0) u->cstate = C_DONE;
        return take;
    }
    size_t i = 0;
    while (i < n && u->cstate != C_DONE) {
        char ch = p[i];
        switch (u->cstate) {
        case C_SIZE:
            if (ch == '\n') {
                u->cstate = u->remain ? C_DATA : C_TRAILER_START;
            } else if (ch == ';') {
                u->cstate = C_EXT;
            } else if (ch != '\r' && ch != ' ' && ch != '\t') {
                int d = (ch >= '0' && ch <= '9') ? ch - '0' : (ch | 32) >= 'a' && (ch | 32) <= 'f' ? (ch | 32) - 'a' + 10 : -1;
                if (d < 0 || u->remain > (1LL << 40)) { u->keep = 0; u->until_close = 1; return n; }
                u->remain = u->remain * 16 + d;
            }
            i++;
            break;
        case C_EXT:
            if (ch == '\n') u->cstate = u->remain ? C_DATA : C_TRAILER_START;
            i++;
            break;
        case C_DATA: {
            size_t take = (long long)(n - i) < u->remain ? n - i : (size_t)u->remain;
            i += take;
            u->remain -= (long long)take;
            if (u->remain == 0) u->cstate = C_DATA_END;
            break;
        }
        case C_DATA_END:
            if (ch == '\n') { u->cstate = C_SIZE; u->remain = 0; }
            i++;
            break;
        case C_TRAILER_START:
            u->cstate = (ch == '\n') ? C_DONE : (ch == '\r') ? C_TRAILER_START : C_TRAILER_LINE;
            i++;
            break;
        case C_TRAILER_LINE:
            if (ch == '\n') u->cstate = C_TRAILER_START;
            i++;
            break;
        }
    }
    return i;
}

static int header_is(const char *line, size_t len, const char *name) {
    size_t n = strlen(name);
    return len > n && line[n] == ':' && strncasecmp(line, name, n) == 0;
}

static const char *header_value(const char *line, size_t len, size_t *vlen, const char *name) {
    const char *v = line + strlen(name) + 1, *end = line + len;
    while (v < end && (*v == ' ' || *v == '\t')) v++;
    while (end > v && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\r')) end--;
    *vlen = (size_t)(end - v);
    return v;
}

/* The answer's head is whole in u->head[0, len): its framing. */
static void parse_answer_head(up_t *u, size_t len) {
    int status = 0;
    if (len > 12) status = atoi(u->head + 9);
    int has_length = 0;
    const char *p = memchr(u->head, '\n', len) + 1, *end = u->head + len;
    while (p < end) {
        const char *eol = memchr(p, '\n', (size_t)(end - p));
        size_t l = (size_t)(eol - p), vl;
        if (header_is(p, l, "content-length")) {
            u->remain = atoll(header_value(p, l, &vl, "content-length"));
            has_length = 1;
        } else if (header_is(p, l, "transfer-encoding")) {
            const char *v = header_value(p, l, &vl, "transfer-encoding");
            u->chunked = vl >= 7 && strncasecmp(v + vl - 7, "chunked", 7) == 0;
        } else if (header_is(p, l, "connection")) {
            const char *v = header_value(p, l, &vl, "connection");
            if (vl == 5 && strncasecmp(v, "close", 5) == 0) u->keep = 0;
        }
        p = eol + 1;
    }
    if (status == 204 || status == 304 || (status >= 100 && status < 200)) {
        u->chunked = 0;
        u->remain = 0;
        u->cstate = C_DONE;
    } else if (u->chunked) {
        u->cstate = C_SIZE;
        u->remain = 0;
    } else if (has_length) {
        u->cstate = u->remain ? C_DATA : C_DONE;
    } else {
        u->until_close = 1;  /* the answer ends with the connection, and so does the client's */
        u->keep = 0;
        u->cl->close_after = 1;
    }
}

static void up_eof(up_t *u) {
    client_t *c = u->cl;
    if (u->state == U_BODY && u->until_close) {
        u->keep = 0;
        answer_ended(u);
    } else if (!u->got_bytes) {
        up_failed(u);
    } else {  /* cut mid-answer: the client's answer is cut too (client_close drops `u`) */
        client_close(c);
    }
}

static void up_readable(up_t *u) {
    client_t *c = u->cl;
    for (;;) {
        if (c->out_len > c->out_off) return;  /* the client's socket is full: resumed as it drains */
        ssize_t n = read(u->fd, relay_buf, sizeof relay_buf);
        if (n < 0) {
            if (errno == EAGAIN) return;
            up_eof(u);
            return;
        }
        if (n == 0) {
            up_eof(u);
            return;
        }
        u->got_bytes = 1;
        struct iovec iov[2];
        int cnt = 0;
        size_t off = 0;
        if (u->state == U_HEAD) {
            size_t room = HEAD_MAX - u->head_len, take = (size_t)n < room ? (size_t)n : room;
            size_t before = u->head_len;
            memcpy(u->head + u->head_len, relay_buf, take);
            u->head_len += take;
            char *end = memmem(u->head, u->head_len, "\r\n\r\n", 4);
            if (end == NULL) {
                if (u->head_len == HEAD_MAX) { up_eof(u); return; }
                continue;
            }
            size_t hl = (size_t)(end - u->head) + 4;
            parse_answer_head(u, hl);
            u->state = U_BODY;
            iov[cnt++] = (struct iovec){u->head, hl};
            off = hl - before;  /* the body's first byte in relay_buf */
        }
        size_t body = body_feed(u, relay_buf + off, (size_t)n - off);
        if (off + body < (size_t)n) u->keep = 0;  /* bytes past the answer: not a connection to keep */
        if (body) iov[cnt++] = (struct iovec){relay_buf + off, body};
        if (cnt && to_client(c, iov, cnt) < 0) {
            client_close(c);  /* and `u` with it */
            return;
        }
        if (u->cstate == C_DONE && !u->until_close) {
            answer_ended(u);
            return;
        }
        if ((size_t)n < sizeof relay_buf) return;  /* drained (edge-triggered) */
    }
}

static void up_event(up_t *u, unsigned events) {
    if (u->state == U_IDLE) {  /* a kept connection the instance closed (or wrote to unasked) */
        if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
            idle_remove(u);
            up_close(u);
        }
        return;
    }
    if (u->state == U_CONNECTING) {
        if (!(events & (EPOLLOUT | EPOLLERR | EPOLLHUP))) return;
        int err = 0;
        socklen_t l = sizeof err;
        getsockopt(u->fd, SOL_SOCKET, SO_ERROR, &err, &l);
        if (err) { up_failed(u); return; }
        u->state = U_SENDING;
    }
    if (u->state == U_SENDING) {
        if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) u->readable_pending = 1;
        up_send(u);
        return;
    }
    if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) up_readable(u);
}

/* --- the client's side --------------------------------------------------------------------- */
static void client_close(client_t *c) {
    if (c->fd < 0) return;
    if (c->up != NULL) {  /* gone mid-request: the instance's connection cannot be kept */
        up_t *u = c->up;
        int inst = u->inst;
        up_close(u);
        released(inst);
    }
    close(c->fd);
    c->fd = -1;
    free(c->in);
    free(c->out);
    c->in = c->out = NULL;
    bury(c);
}

static int is_hot(const char *head, size_t head_len) {
    const char *path = memchr(head, ' ', head_len);
    if (path == NULL) return 0;
    path++;
    const char *stop = path;
    while (stop < head + head_len && *stop != ' ' && *stop != '?') stop++;
    size_t len = (size_t)(stop - path);
    if (len < 11 || memcmp(path, "/v2/models/", 11) != 0) return 0;
    for (int i = 0; i < n_hot; i++)
        if (len > 11 + hot_len[i] && memcmp(stop - hot_len[i], hot[i], hot_len[i]) == 0) return 1;
    return 0;
}

/* The connection, and what was read of it, to the Python side: it is no longer the front's. */
static void hand_off(client_t *c) {
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    PyObject *r = PyObject_CallFunction(handoff_cb, "iy#", c->fd, c->in, (Py_ssize_t)c->in_len);
    if (r == NULL) {
        PyErr_Print();
        close(c->fd);
    }
    Py_XDECREF(r);
    c->fd = -1;
    free(c->in);
    free(c->out);
    c->in = c->out = NULL;
    bury(c);
}

static void try_request(client_t *c) {
    char *end = memmem(c->in, c->in_len, "\r\n\r\n", 4);
    if (end == NULL) {
        if (c->in_len > HEAD_MAX) {
            answer(c, R413, sizeof R413 - 1);
            client_close(c);
        }
        return;
    }
    size_t head_len = (size_t)(end - c->in) + 4;
    if (handoff_cb != NULL && !is_hot(c->in, head_len)) {
        hand_off(c);
        return;
    }
    long long clen = 0;
    const char *p = memchr(c->in, '\n', head_len) + 1, *hend = c->in + head_len;
    c->close_after = 0;
    while (p < hend) {
        const char *eol = memchr(p, '\n', (size_t)(hend - p));
        size_t l = (size_t)(eol - p), vl;
        if (header_is(p, l, "content-length")) {
            clen = atoll(header_value(p, l, &vl, "content-length"));
        } else if (header_is(p, l, "transfer-encoding")) {
            answer(c, R411, sizeof R411 - 1);
            client_close(c);
            return;
        } else if (header_is(p, l, "connection")) {
            const char *v = header_value(p, l, &vl, "connection");
            if (vl == 5 && strncasecmp(v, "close", 5) == 0) c->close_after = 1;
        }
        p = eol + 1;
    }
    if (clen < 0 || head_len + (size_t)clen > MAX_REQUEST) {
        answer(c, R413, sizeof R413 - 1);
        client_close(c);
        return;
    }
    if (c->in_len < head_len + (size_t)clen) return;  /* the body is still coming */
    c->req_len = head_len + (size_t)clen;
    c->busy = 1;
    int inst = decide(c, head_len, -1);
    if (inst < 0) {
        answer(c, R503, sizeof R503 - 1);
        if (c->fd >= 0) request_done(c);
        return;
    }
    start_upstream(c, inst);
}

static void client_readable(client_t *c) {
    for (;;) {
        if (c->in_cap - c->in_len < 4096) {
            size_t cap = c->in_cap ? c->in_cap * 2 : 8192;
            if (cap > 2 * MAX_REQUEST) { client_close(c); return; }
            char *in = realloc(c->in, cap);
            if (in == NULL) { client_close(c); return; }
            c->in = in;
            c->in_cap = cap;
        }
        size_t room = c->in_cap - c->in_len;
        ssize_t n = read(c->fd, c->in + c->in_len, room);
        if (n == 0 || (n < 0 && errno != EAGAIN)) { client_close(c); return; }
        if (n < 0) break;
        c->in_len += (size_t)n;
        if ((size_t)n < room) break;
    }
    if (!c->busy) try_request(c);
}

static void client_writable(client_t *c) {
    if (c->out_len == c->out_off) return;  /* an edge with nothing kept: no relay to resume */
    while (c->out_len > c->out_off) {
        ssize_t w = write(c->fd, c->out + c->out_off, c->out_len - c->out_off);
        if (w < 0) {
            if (errno == EAGAIN) return;
            client_close(c);
            return;
        }
        c->out_off += (size_t)w;
    }
    c->out_len = c->out_off = 0;
    if (c->resp_done) request_done(c);
    else if (c->up != NULL && c->up->state >= U_HEAD) up_readable(c->up);  /* resume the relay */
}

static void client_event(client_t *c, unsigned events) {
    if (events & EPOLLOUT) {
        client_writable(c);
        if (c->fd < 0) return;  /* closed: freed */
    }
    if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) client_readable(c);
}

static void accept_all(int lfd) {
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) return;  /* EAGAIN, or an error the next wakeup meets again */
        client_t *c = calloc(1, sizeof *c);
        if (c == NULL) { close(fd); continue; }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        c->kind = K_CLIENT;
        c->fd = fd;
        watch(fd, c, EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET);
    }
}

/* --- the module ------------------------------------------------------------------------------ */
static int listen_fd = -1;

/* The arguments of start() and serve(): the instances, the callbacks, the epoll set. */
static PyObject *setup(PyObject *args, PyObject *kw) {
    static char *names[] = {"listen_fd", "ports", "decide", "release", "handoff", "hot_suffixes", "decide_head",
                            NULL};
    int lfd;
    PyObject *ports, *dec = Py_None, *rel = Py_None, *hand = Py_None, *suffixes = Py_None;
    if (ep >= 0) return PyErr_Format(PyExc_RuntimeError, "one front per process: started already");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iO|OOOOp", names, &lfd, &ports, &dec, &rel, &hand, &suffixes,
                                     &decide_head))
        return NULL;
    if (hand != Py_None) {
        PyObject *sfx = PySequence_Fast(suffixes, "hot_suffixes: a sequence of bytes");
        if (sfx == NULL) return NULL;
        n_hot = (int)PySequence_Fast_GET_SIZE(sfx);
        for (int i = 0; i < n_hot; i++) {
            char *b;
            Py_ssize_t l;
            if (i >= 8 || PyBytes_AsStringAndSize(PySequence_Fast_GET_ITEM(sfx, i), &b, &l) < 0 || l >= 32) {
                Py_DECREF(sfx);
                return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "hot_suffixes: 8 of 31 bytes at most");
            }
            memcpy(hot[i], b, (size_t)l);
            hot_len[i] = (size_t)l;
        }
        Py_DECREF(sfx);
        Py_INCREF(hand);
        handoff_cb = hand;
    }
    PyObject *seq = PySequence_Fast(ports, "ports: a sequence of ints");
    if (seq == NULL) return NULL;
    n_inst = (int)PySequence_Fast_GET_SIZE(seq);
    if (n_inst < 1 || n_inst > MAX_INST) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "ports: 1 to %d instances, got %d", MAX_INST, n_inst);
    }
    for (int i = 0; i < n_inst; i++) {
        long port = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (port <= 0 || port > 65535) {
            Py_DECREF(seq);
            return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "ports[%d]: %ld", i, port);
        }
        addrs[i] = (struct sockaddr_in){.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                                         .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        inst_objs[i] = PyLong_FromLong(i);
    }
    Py_DECREF(seq);
    Py_XINCREF(dec == Py_None ? NULL : dec);
    Py_XINCREF(rel == Py_None ? NULL : rel);
    decide_cb = dec == Py_None ? NULL : dec;
    release_cb = rel == Py_None ? NULL : rel;
    ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) return PyErr_SetFromErrno(PyExc_OSError);
    listen_fd = lfd;
    static int listener[2] = {K_LISTEN, 0};
    watch(lfd, listener, EPOLLIN);
    Py_RETURN_NONE;
}

/* One batch of ready events (waiting up to `timeout_ms`); their count, or -1 with errno. */
static int run_batch(int timeout_ms) {
    struct epoll_event evs[512];
    int n = epoll_wait(ep, evs, 512, timeout_ms);
    for (int i = 0; i < n; i++) {
        int *obj = evs[i].data.ptr;  /* kind, then fd: -1 once closed this turn */
        if (obj[0] == K_LISTEN) accept_all(listen_fd);
        else if (obj[1] < 0) continue;
        else if (obj[0] == K_CLIENT) client_event((client_t *)obj, evs[i].events);
        else up_event((up_t *)obj, evs[i].events);
    }
    for (size_t i = 0; i < n_dead; i++) free(dead[i]);
    n_dead = 0;
    return n;
}

static PyObject *serve(PyObject *self, PyObject *args, PyObject *kw) {
    PyObject *r = setup(args, kw);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    for (;;) {
        if (run_batch(500) < 0 && errno != EINTR) return PyErr_SetFromErrno(PyExc_OSError);
        if (PyErr_CheckSignals() < 0) return NULL;
    }
}

/* For an event loop that drives the front: start() once, then poll() whenever the epoll fd it
 * returns is readable (asyncio's add_reader), on the loop's own thread. */
static PyObject *start(PyObject *self, PyObject *args, PyObject *kw) {
    PyObject *r = setup(args, kw);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    return PyLong_FromLong(ep);
}

/* poll(rounds=1): up to `rounds` batches, while events are ready. More than one saves the event
 * loop's own wait and callback between batches that come back to back, at one empty wait. */
static PyObject *poll_ready(PyObject *self, PyObject *args) {
    int rounds = 1, total = 0;
    if (!PyArg_ParseTuple(args, "|i", &rounds)) return NULL;
    if (ep < 0) return PyErr_Format(PyExc_RuntimeError, "start() first");
    for (int i = 0; i < rounds; i++) {
        int n = run_batch(0);
        if (n < 0 && errno != EINTR) return PyErr_SetFromErrno(PyExc_OSError);
        if (n <= 0) break;
        total += n;
    }
    return PyLong_FromLong(total);
}

/* What tests look at: per instance, requests in flight and kept idle connections. */
static PyObject *stats(PyObject *self, PyObject *unused) {
    PyObject *fl = PyList_New(n_inst), *kept = PyList_New(n_inst);
    if (fl == NULL || kept == NULL) { Py_XDECREF(fl); Py_XDECREF(kept); return NULL; }
    for (int i = 0; i < n_inst; i++) {
        int k = 0;
        for (up_t *u = idle[i]; u; u = u->next_idle) k++;
        PyList_SET_ITEM(fl, i, PyLong_FromLong(inflight[i]));
        PyList_SET_ITEM(kept, i, PyLong_FromLong(k));
    }
    return Py_BuildValue("{sNsN}", "inflight", fl, "kept", kept);
}

static PyMethodDef methods[] = {
    {"serve", (PyCFunction)(void (*)(void))serve, METH_VARARGS | METH_KEYWORDS,
     "serve(listen_fd, ports, decide=None, release=None): relay until a signal's handler raises"},
    {"start", (PyCFunction)(void (*)(void))start, METH_VARARGS | METH_KEYWORDS,
     "start(listen_fd, ports, decide=None, release=None, handoff=None, hot_suffixes=None, decide_head=False) -> "
     "the epoll fd to watch; then poll()"},
    {"poll", poll_ready, METH_VARARGS, "poll(rounds=1) -> events handled: the ready ones, without waiting"},
    {"stats", stats, METH_NOARGS, "stats() -> {'inflight': [...], 'kept': [...]} per instance"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_compiled_front", NULL, -1, methods};

PyMODINIT_FUNC PyInit__compiled_front(void) { return PyModule_Create(&module); }
