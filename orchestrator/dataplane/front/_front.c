/* The compiled front of a data-plane worker (issue 22): the native generations relayed in C.
 *
 *     start(listen_fd, ports, decide=, release=, retry=, answered=, first=, handoff=, ...) -> epoll fd
 *     poll(rounds=1), sweep(), adopt(fd), instance(host, port), abort(slot, answering), drain(),
 *     configure(...), stats(), open_count(), shutdown()        (front/compiled.py; bench/_compiled_front.py)
 *     serve(listen_fd, ports, ...)             (the same on its own blocking loop: the bench)
 *
 * One thread, one epoll, edge-triggered: it takes HTTP/1.1 clients (accepted on `listen_fd`, or
 * handed over with adopt()), reads a request whole (head + Content-Length body), asks where it goes,
 * sends it over a pooled keep-alive connection to that instance, and relays the answer's bytes to
 * the client as they arrive (each read is written), following its framing (Content-Length or
 * chunked) to know where it ends, so both connections are kept.
 *
 * Where a request goes, and what happens to it, is Python's (front/path.py), called on the thread
 * that runs poll():
 *     decide(head, body) -> (slot, ctx[, want_first]) | bytes (the answer to send) | None (hand off)
 *     retry(ctx, reason) -> (slot, ctx) | bytes | False (hand off)   after an attempt that reached no
 *                                                  client byte
 *     answered(ctx, status, body) -> (slot, ctx) | bytes | False | None (relay it)   an error held back
 *     first(ctx)                                      the first SSE event, where decide wanted it
 *     release(ctx, status, outcome, events, head_at, first_at)               once per request
 * Without decide, the bench's bare relay: least requests in flight in C, ties in turn.
 *
 * What it keeps of the product's rules, each given by the Python side from its one definition:
 * - which requests are its own (`handoff`): a POST over HTTP/1.1 to /v2/models/... ending in one of
 *   `hot_suffixes`, with a Content-Length body of at most `max_body`, without Expect or
 *   Transfer-Encoding, from a peer `trusted(peer)` does not name. Every other request's connection
 *   goes with the bytes read so far to `handoff(fd, bytes)`, the worker's aiohttp side, which answers
 *   it and every edge case (413, 400, 100-continue, chunked bodies, trusted forwarding headers) as
 *   the embedded proxy always has;
 * - header hygiene (`request_drop`, `response_drop`: headers.py's tables): the hop-by-hop headers and
 *   those Connection names are dropped both ways; the instance gets Host, Content-Length and
 *   X-Forwarded-For/-Proto/-Host rebuilt from the socket; the client gets a Date, and an SSE or
 *   unframed answer X-Accel-Buffering: no and Cache-Control: no-cache where the instance set none;
 * - slow clients cut (`limits`: client_guard.py's): a request head must be whole `head` seconds after
 *   the connect or its first byte (else `head_answer`, 408, and close), its body `body` seconds after
 *   the head (else `body_answer`), and a kept connection waits `keepalive` seconds for the next one.
 *   Deadlines are checked every SWEEP_MS by poll(), or by sweep() on a timer of the loop's.
 *
 * The instance's deadlines are kept too (`upstream`: connect, silence between its bytes, and the
 * answer's head after the attempt began: --first-byte-timeout-s, retried elsewhere as the embedded
 * path's wait_for is, within a sweep's period: SWEEP_MS or the loop's timer); a pooled connection
 * the instance closed before answering is retried once on a new one. Metrics are Python's, from
 * release()'s numbers (issue 22's next step: counted here instead).
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
#include <time.h>
#include <unistd.h>

#define MAX_INST 64
#define MAX_REQUEST (1 << 20) /* head + body the front buffers; a larger request is handed off */
#define HEAD_MAX 8192
#define CLIENT_HEAD_MAX (HEAD_MAX + 512) /* the instance's head, filtered, plus what the front adds */
#define RELAY_BUF 65536
#define SWEEP_MS 100
#define MAX_DROP 32
#define MAX_TOKENS 16
#define MAX_ITL 32 /* inter-token histogram bounds */

enum kind { K_LISTEN, K_CLIENT, K_UP };
enum up_state { U_IDLE, U_CONNECTING, U_SENDING, U_HEAD, U_BODY };
enum chunk_state { C_SIZE, C_EXT, C_DATA, C_DATA_END, C_TRAILER_START, C_TRAILER_LINE, C_DONE };
/* What a client connection waits for, and so which deadline applies. */
enum phase { P_HEAD, P_BODY, P_BUSY, P_IDLE };

typedef struct up up_t;

typedef struct client {
    int kind, fd;
    char *in;
    size_t in_len, in_cap;
    size_t req_len;  /* the request in flight: in[0, req_len) */
    size_t head_len; /* its head's */
    int busy;        /* a request in flight */
    int close_after; /* Connection: close, or an answer framed by the end of its connection */
    int resp_done;   /* the answer ended; its last bytes wait in `out` */
    char *out;
    size_t out_len, out_off, out_cap;
    up_t *up;
    int tries;
    int phase;
    long long deadline_ms; /* of the phase; 0: none */
    long long head_due_ms; /* the attempt's answer head is due (--first-byte-timeout-s); 0: none */
    int trust_checked;
    char peer[64];
    /* The request as the instance gets it (with hygiene): fwd[0, fwd_base) is the head without
     * Host and the blank line, built once; each attempt appends its instance's Host and the body. */
    char *fwd;
    size_t fwd_len, fwd_base, fwd_cap;
    struct client *prev, *next; /* every open client, for the sweep */
    PyObject *ctx; /* the request's, from decide(): handed to retry(), answered() and release() */
    int status;    /* of the answer the client gets */
    /* An error answer held back (answered()): its head for the client, then its body. */
    int peek;
    char *pk;
    size_t pk_len, pk_cap, pk_body;
    long events; /* SSE events relayed in this answer (first() at the first) */
    int nl;      /* the last data relayed ended in one newline of an event's two */
    int wants_first;         /* decide() asked for first() (a routing model learns from it at once) */
    double head_at, first_at; /* when the answer's head came, when its first event went (0: not yet) */
    double last_event_at;     /* the latest event's, for the gap to the next (inter-token time) */
    double itl_sum;           /* the stream's inter-token times, as the histogram's sum and buckets */
    long itl[MAX_ITL + 1];
} client_t;

struct up {
    int kind, fd, inst;
    int state;
    int reused, got_bytes, readable_pending;
    client_t *cl;
    size_t send_off;
    char head[HEAD_MAX];
    size_t head_len;
    char chead[CLIENT_HEAD_MAX]; /* the head the client gets */
    size_t chead_len;
    int chunked, cstate, keep, until_close, status, sse;
    long long remain;
    long long deadline_ms; /* connecting, or waiting for the instance's next bytes; 0: none */
    up_t *next_idle;
};

static int ep = -1;
static int n_inst;
static struct sockaddr_storage addrs[MAX_INST];
static socklen_t addr_len[MAX_INST];
static char inst_host[MAX_INST][64];
static int inst_port[MAX_INST];
static char host_line[MAX_INST][96];
static int inflight[MAX_INST];
static unsigned long long last_pick[MAX_INST], picks;
static up_t *idle[MAX_INST];
/* The Python decision (see the top of this file); without decide_cb, least in flight in C. */
static PyObject *decide_cb, *release_cb, *retry_cb, *answered_cb, *first_cb;
/* Requests the front does not serve go to `handoff_cb(fd, bytes_read)` with their connection (see
 * the top of this file for which). */
static PyObject *handoff_cb, *trusted_cb;
static char hot[8][32];
static size_t hot_len[8];
static int n_hot;
static size_t body_max = MAX_REQUEST;
/* Header hygiene: lower-case names dropped each way; hygiene is off (bytes as they came) without. */
static char req_drop[MAX_DROP][32], resp_drop[MAX_DROP][32];
static int n_req_drop, n_resp_drop, hygiene;
/* Slow clients: deadlines in ms (0: none), and what a cut client is answered. */
static long long head_ms, body_ms, keepalive_ms;
static PyObject *head_answer, *body_answer;
static long long now_ms, last_sweep_ms;
static long long connect_ms, idle_ms; /* the instance's: to connect, and between its bytes */
static long long first_byte_ms;       /* the instance's answer head after the attempt began; 0: none */
static double itl_bounds[MAX_ITL];    /* the inter-token histogram's upper bounds (metrics.py's), +Inf after */
static int n_itl;
static int draining;                  /* stopping: a request parsed from now on is answered with close */
static client_t *clients; /* every open client */
static long n_open;       /* their number */
static int in_batch;      /* handling events or a sweep: abort() and the like would act under it */
static unsigned long long cut_head, cut_body, closed_idle, served;
static char relay_buf[RELAY_BUF];
/* Closed this turn of the loop: freed after it, as a later event of the same batch may name them. */
static void **dead;
static size_t n_dead, dead_cap;

/* Why an attempt failed before any byte reached the client (retry()'s `reason`, as the embedded
 * path counts them), and how a request ended (release()'s `outcome`). */
enum reason { R_REFUSED, R_CONNECT_TIMEOUT, R_DISCONNECTED, R_BAD_RESPONSE, R_HEADER_TIMEOUT, R_ABORTED,
              R_FIRST_BYTE_TIMEOUT };
static const char *reason_names[] = {"connect_refused", "connect_timeout", "disconnected", "bad_response",
                                     "header_timeout", "aborted", "first_byte_timeout"};
enum outcome { O_DONE, O_CLIENT_GONE, O_CUT, O_IDLE, O_FAILED, O_HANDED };
#define PEEK_MAX 65536 /* an error answer up to this size is held back and shown to answered() */

static const char R502[] = "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n";
static const char R503[] = "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n";
static const char R411[] = "HTTP/1.1 411 Length Required\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
static const char R413[] = "HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

static void client_close(client_t *c);
static void client_close_as(client_t *c, int outcome);
static void try_request(client_t *c);
static void up_readable(up_t *u);
static void start_upstream(client_t *c, int inst);
static void hand_off(client_t *c);

static double clock_s(void) {  /* CLOCK_MONOTONIC, as Python's time.monotonic() */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static long long clock_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void set_phase(client_t *c, int phase) {
    long long span = phase == P_HEAD ? head_ms : phase == P_BODY ? body_ms : phase == P_IDLE ? keepalive_ms : 0;
    c->phase = phase;
    c->deadline_ms = span ? now_ms + span : 0;
}

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

static void slot_taken(int slot) {
    inflight[slot]++;
    last_pick[slot] = ++picks;
}

/* Python's word on where a request goes: (slot, ctx) -> the slot (ctx kept for the request); bytes ->
 * -2 and the answer to send instead in *answer_out (a new reference); None -> -3 (decide(): hand it
 * off; answered(): relay the answer); False -> -4 (hand it off); anything else, or an error -> -1.
 * Takes `r` (a new reference, or NULL with an exception). */
static int route_reply(client_t *c, PyObject *r, PyObject **answer_out) {
    int slot = -1;
    *answer_out = NULL;
    if (r == NULL) {
        PyErr_Print();
        return -1;
    }
    if (r == Py_None) {
        slot = -3;
    } else if (r == Py_False) {
        slot = -4;
    } else if (PyBytes_Check(r) && PyBytes_GET_SIZE(r) > 12) {
        *answer_out = r;
        return -2;
    } else if (PyTuple_Check(r) && (PyTuple_GET_SIZE(r) == 2 || PyTuple_GET_SIZE(r) == 3)) {
        c->wants_first = PyTuple_GET_SIZE(r) == 3 && PyObject_IsTrue(PyTuple_GET_ITEM(r, 2)) == 1;
        slot = (int)PyLong_AsLong(PyTuple_GET_ITEM(r, 0));
        if (PyErr_Occurred()) {
            PyErr_Print();
            slot = -1;
        } else if (slot < 0 || slot >= n_inst) {
            slot = -1;
        } else {
            PyObject *ctx = PyTuple_GET_ITEM(r, 1);
            Py_INCREF(ctx);
            Py_XSETREF(c->ctx, ctx);
        }
    }
    Py_DECREF(r);
    return slot;
}

/* The request is over: release(ctx, status, outcome), once. */
static void finish(client_t *c, int outcome) {
    PyObject *ctx = c->ctx;
    if (ctx == NULL) return;
    c->ctx = NULL;
    served++;
    if (release_cb != NULL) {
        PyObject *itl = Py_None;  /* (sum, counts per bucket) where the stream had gaps to count */
        Py_INCREF(itl);
        if (c->events > 1 && n_itl) {
            PyObject *counts = PyTuple_New(n_itl + 1);
            for (int i = 0; counts != NULL && i <= n_itl; i++) PyTuple_SET_ITEM(counts, i, PyLong_FromLong(c->itl[i]));
            if (counts != NULL) {
                Py_DECREF(itl);
                itl = Py_BuildValue("(dN)", c->itl_sum, counts);
            }
        }
        PyObject *r = itl == NULL ? NULL : PyObject_CallFunction(release_cb, "OiilddO", ctx, c->status, outcome,
                                                                 c->events, c->head_at, c->first_at, itl);
        Py_XDECREF(itl);
        if (r == NULL) PyErr_Print();
        Py_XDECREF(r);
    }
    Py_DECREF(ctx);
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
    c->fwd_len = c->fwd_base = 0;
    if (c->close_after) { client_close(c); return; }
    /* Draining, and this answer's head went out before the drain as kept alive: the client may be
       sending its next request already. Closed now, that request would fail (a broken pipe or a
       reset: the keep-alive race a graceful NGINX stop leaves; bench/chaos_soak.py found it at a
       reload that stopped a worker). It waits as a fresh connection does (stop's first-request
       grace) and its next request is answered, with Connection: close (try_request). */
    set_phase(c, rest || draining ? P_HEAD : P_IDLE);
    if (rest) try_request(c);  /* pipelined */
}

static void up_close(up_t *u) {
    close(u->fd);
    u->fd = -1;
    bury(u);
}

/* The instance's connection after its answer ended: kept for the next request, or closed. */
static void up_detach(up_t *u) {
    int inst = u->inst;
    u->cl = NULL;
    u->deadline_ms = 0;
    if (u->keep && !u->until_close) {
        u->state = U_IDLE;
        u->reused = 1;
        u->next_idle = idle[inst];
        idle[inst] = u;
    } else {
        up_close(u);
    }
}

/* The client's answer is written, or waits in `out` (then it ends when that is written). */
static void answer_sent(client_t *c) {
    finish(c, O_DONE);
    if (c->out_len > c->out_off) c->resp_done = 1;
    else request_done(c);
}

static void answer_ended(up_t *u) {
    client_t *c = u->cl;
    inflight[u->inst]--;
    up_detach(u);
    c->up = NULL;
    answer_sent(c);
}

/* An answer of the front's own is written (or waits in `out`: then the request ends when it is). */
static void own_answer_sent(client_t *c) {
    finish(c, O_FAILED);
    if (c->fd < 0) return;
    if (c->out_len > c->out_off) c->resp_done = 1;
    else request_done(c);
}

/* An answer Python gave instead of the instance's (bytes from decide(), retry() or answered()). */
static void give_up(client_t *c, PyObject *ans) {
    c->status = atoi(PyBytes_AS_STRING(ans) + 9);
    answer(c, PyBytes_AS_STRING(ans), (size_t)PyBytes_GET_SIZE(ans));
    Py_DECREF(ans);
    own_answer_sent(c);
}

static void fail_request(client_t *c) {
    c->status = 502;
    answer(c, R502, sizeof R502 - 1);
    own_answer_sent(c);
}

/* No byte of its answer reached the client, and Python says aiohttp carries the request from here
 * (no other instance: it holds until one is ready): the connection goes with the request's bytes. */
static void handed_over(client_t *c) {
    finish(c, O_HANDED);
    hand_off(c);
}

/* Where to go after an attempt that reached no client byte: retry()'s answer (Python decision), the
 * next instance (C decision), or 502. */
static void next_attempt(client_t *c, int failed, int reason) {
    int next = -1;
    if (retry_cb != NULL) {
        PyObject *ans;
        next = route_reply(c, PyObject_CallFunction(retry_cb, "Os", c->ctx ? c->ctx : Py_None, reason_names[reason]),
                           &ans);
        if (next == -2) { give_up(c, ans); return; }
        if (next <= -3 && handoff_cb != NULL) { handed_over(c); return; }
    } else if (decide_cb == NULL && c->tries < 3) {
        c->tries++;
        next = pick_in_c(failed);
    }
    if (next < 0) { fail_request(c); return; }
    slot_taken(next);
    start_upstream(c, next);
}

/* The instance failed this request before any byte of its answer reached the client. */
static void up_failed(up_t *u, int reason) {
    client_t *c = u->cl;
    int inst = u->inst;
    int stale = reason == R_DISCONNECTED && u->reused && !u->got_bytes;
    up_close(u);
    c->up = NULL;
    if (stale && c->tries < 3) {  /* a kept connection the instance had closed: once more */
        c->tries++;
        start_upstream(c, inst);
        return;
    }
    inflight[inst]--;
    next_attempt(c, inst, reason);
}

/* An error answer held back has ended: answered(ctx, status, body) says whether another instance
 * tries the request (a 503, a full queue: nothing reached the client), else it is relayed. */
static void peek_done(up_t *u) {
    client_t *c = u->cl;
    int status = u->status;
    inflight[u->inst]--;
    up_detach(u);
    c->up = NULL;
    c->peek = 0;
    PyObject *ans;
    int next = route_reply(c, PyObject_CallFunction(answered_cb, "Oiy#", c->ctx ? c->ctx : Py_None, status,
                                                    c->pk + c->pk_body, (Py_ssize_t)(c->pk_len - c->pk_body)),
                           &ans);
    if (next == -2) { give_up(c, ans); return; }
    if (next == -4 && handoff_cb != NULL) { handed_over(c); return; }
    if (next >= 0) {
        slot_taken(next);
        start_upstream(c, next);
        return;
    }
    struct iovec iov = {c->pk, c->pk_len};
    c->pk_len = 0;
    if (to_client(c, &iov, 1) < 0) { client_close(c); return; }
    answer_sent(c);
}

/* p[0, n) appended to a buffer that grows as needed (doubling from 4 KiB); -1: out of memory. */
static int buf_put(char **buf, size_t *len, size_t *cap, const char *p, size_t n) {
    if (*len + n > *cap) {
        size_t want = *cap ? *cap : 4096;
        while (want < *len + n) want *= 2;
        char *grown = realloc(*buf, want);
        if (grown == NULL) return -1;
        *buf = grown;
        *cap = want;
    }
    memcpy(*buf + *len, p, n);
    *len += n;
    return 0;
}

static int pk_put(client_t *c, const char *p, size_t n) { return buf_put(&c->pk, &c->pk_len, &c->pk_cap, p, n); }

static void idle_remove(up_t *u) {
    for (up_t **p = &idle[u->inst]; *p; p = &(*p)->next_idle)
        if (*p == u) { *p = u->next_idle; return; }
}

/* --- the instance's side ------------------------------------------------------------------- */
static void up_send(up_t *u) {
    client_t *c = u->cl;
    const char *req = hygiene ? c->fwd : c->in;
    size_t total = hygiene ? c->fwd_len : c->req_len;
    while (u->send_off < total) {
        ssize_t w = write(u->fd, req + u->send_off, total - u->send_off);
        if (w < 0) {
            if (errno == EAGAIN) return;
            up_failed(u, R_DISCONNECTED);
            return;
        }
        u->send_off += (size_t)w;
    }
    u->state = U_HEAD;
    u->deadline_ms = idle_ms ? now_ms + idle_ms : 0;  /* for the answer's head */
    if (u->readable_pending) {
        u->readable_pending = 0;
        up_readable(u);
    }
}

static int fwd_put(client_t *c, const char *p, size_t n);

static void start_upstream(client_t *c, int inst) {
    if (hygiene) {  /* this attempt's request: the head built once, its instance's Host, the body */
        c->fwd_len = c->fwd_base;
        if (fwd_put(c, host_line[inst], strlen(host_line[inst])) < 0 || fwd_put(c, "\r\n", 2) < 0 ||
            fwd_put(c, c->in + c->head_len, c->req_len - c->head_len) < 0) {
            inflight[inst]--;
            fail_request(c);
            return;
        }
    }
    c->peek = 0;
    c->pk_len = 0;
    c->head_due_ms = first_byte_ms ? now_ms + first_byte_ms : 0;
    c->events = c->nl = 0;
    c->head_at = c->first_at = c->itl_sum = 0;
    memset(c->itl, 0, sizeof c->itl);
    up_t *u = idle[inst];
    if (u != NULL) {
        idle[inst] = u->next_idle;
    } else {
        int fd = socket(addrs[inst].ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        u = calloc(1, sizeof *u);
        if (fd < 0 || u == NULL) {
            if (fd >= 0) close(fd);
            free(u);
            inflight[inst]--;
            fail_request(c);
            return;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        u->kind = K_UP;
        u->fd = fd;
        u->inst = inst;
        int r = connect(fd, (struct sockaddr *)&addrs[inst], addr_len[inst]);
        u->state = (r == 0) ? U_SENDING : U_CONNECTING;
        u->deadline_ms = connect_ms ? now_ms + connect_ms : 0;
        watch(fd, u, EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET);
        if (r < 0 && errno != EINPROGRESS) {
            u->cl = c;
            c->up = u;
            up_failed(u, R_REFUSED);
            return;
        }
    }
    u->cl = c;
    c->up = u;
    u->send_off = 0;
    u->head_len = 0;
    u->got_bytes = u->readable_pending = 0;
    u->chunked = u->until_close = u->status = 0;
    u->keep = 1;
    u->remain = 0;
    u->cstate = C_SIZE;
    if (u->state == U_IDLE) u->state = U_SENDING;
    if (u->state == U_SENDING) up_send(u);
}

/* An SSE answer's data as it is relayed: its complete events counted across reads (metrics.py's
 * SseCounter), first(ctx) called at the first one (the time to first token is taken there). */
static void sse_feed(client_t *c, const char *p, size_t n) {
    if (n == 0) return;
    long k = (c->nl && p[0] == '\n') ? 1 : 0;
    for (const char *q = p, *end = p + n - 1; q < end && (q = memchr(q, '\n', (size_t)(end - q))) != NULL; q++)
        if (q[1] == '\n') k++, q++;  /* non-overlapping, as bytes.count */
    c->nl = p[n - 1] == '\n' && !(n >= 2 && p[n - 2] == '\n');
    if (k && n_itl) {  /* the gap since the stream's last event, then those that came with it: 0 */
        double now = clock_s();
        if (c->events > 0) {
            double gap = now - c->last_event_at;
            int b = 0;
            while (b < n_itl && gap > itl_bounds[b]) b++;
            c->itl[b]++;
            c->itl_sum += gap;
        }
        int zero = 0;
        while (zero < n_itl && 0.0 > itl_bounds[zero]) zero++;
        c->itl[zero] += k - 1;
        c->last_event_at = now;
        if (c->events == 0) c->first_at = now;
    } else if (k && c->events == 0) {
        c->first_at = clock_s();
    }
    if (k && c->events == 0 && c->wants_first && first_cb != NULL && c->ctx != NULL) {
        PyObject *r = PyObject_CallOneArg(first_cb, c->ctx);
        if (r == NULL) PyErr_Print();
        Py_XDECREF(r);
    }
    c->events += k;
}

/* How many of p[0, n) belong to the answer; the state says when it ended. */
static size_t body_feed(up_t *u, const char *p, size_t n) {
    if (u->until_close) {
        if (u->sse) sse_feed(u->cl, p, n);
        return n;
    }
    if (!u->chunked) {
        size_t take = (long long)n < u->remain ? n : (size_t)u->remain;
        if (u->sse) sse_feed(u->cl, p, take);
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
                int lower = ch | 32;
                int d = (ch >= '0' && ch <= '9') ? ch - '0' : lower >= 'a' && lower <= 'f' ? lower - 'a' + 10 : -1;
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
            if (u->sse) sse_feed(u->cl, p + i, take);
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

typedef struct {
    const char *name, *value, *line;
    size_t name_len, value_len, line_len;
} hline_t;
static int next_header(const char **p, const char *end, hline_t *h);
static int name_in(const char *name, size_t len, const void *names, int n);
typedef struct {
    char names[MAX_TOKENS][32];
    int n, close, overflow;
} tokens_t;
static void tokens_add(tokens_t *t, const char *v, size_t len);

static int is_name(const hline_t *h, const char *name) {
    size_t n = strlen(name);
    return h->name_len == n && strncasecmp(h->name, name, n) == 0;
}

/* `Date:` as RFC 9110 wants it, formatted once a second (response_head.py's _date_line). */
static size_t date_line(char *out, size_t n) {
    static time_t at;
    static char line[64];
    static size_t len;
    time_t now = time(NULL);
    if (now != at) {
        struct tm tm;
        gmtime_r(&now, &tm);
        len = strftime(line, sizeof line, "Date: %a, %d %b %Y %H:%M:%S GMT\r\n", &tm);
        at = now;
    }
    if (len > n) return 0;
    memcpy(out, line, len);
    return len;
}

static int chead_put(up_t *u, const char *p, size_t n) {
    if (u->chead_len + n > sizeof u->chead) return -1;
    memcpy(u->chead + u->chead_len, p, n);
    u->chead_len += n;
    return 0;
}

/* The answer's head is whole in u->head[0, len): its framing, and (with hygiene) the head the client
 * gets in u->chead: the instance's without the hop-by-hop headers, as the embedded path's
 * client_response_headers and response_head build it. -1: a head the front cannot relay. */
static int parse_answer_head(up_t *u, size_t len) {
    int status = 0, has_length = 0, has_te = 0, has_date = 0, has_cc = 0, has_xab = 0, sse = 0, r;
    tokens_t conn;
    hline_t h;
    memset(&conn, 0, sizeof conn);
    if (len > 12) status = atoi(u->head + 9);
    u->status = u->cl->status = status;
    u->cl->head_at = clock_s();
    const char *first = memchr(u->head, '\n', len) + 1, *end = u->head + len, *p = first;
    while ((r = next_header(&p, end, &h)) != 0) {
        if (r < 0) return -1;
        if (is_name(&h, "content-length")) {
            u->remain = atoll(h.value);
            has_length = 1;
        } else if (is_name(&h, "transfer-encoding")) {
            has_te = 1;
            u->chunked = h.value_len >= 7 && strncasecmp(h.value + h.value_len - 7, "chunked", 7) == 0;
        } else if (is_name(&h, "connection")) {
            tokens_add(&conn, h.value, h.value_len);
            if (conn.close) u->keep = 0;
        } else if (is_name(&h, "date")) {
            has_date = 1;
        } else if (is_name(&h, "cache-control")) {
            has_cc = 1;
        } else if (is_name(&h, "x-accel-buffering")) {
            has_xab = 1;
        } else if (is_name(&h, "content-type")) {
            sse = h.value_len >= 17 && strncasecmp(h.value, "text/event-stream", 17) == 0;
        }
    }
    u->sse = sse && status >= 200 && status < 300;  /* an error is no generation */
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
    if (!hygiene) return 0;
    char date[64];
    size_t dl = has_date ? 0 : date_line(date, sizeof date);
    u->chead_len = 0;
    if (chead_put(u, u->head, (size_t)(first - u->head)) < 0 || chead_put(u, date, dl) < 0) return -1;
    for (p = first; next_header(&p, end, &h) > 0;) {
        if (name_in(h.name, h.name_len, resp_drop, n_resp_drop) || name_in(h.name, h.name_len, conn.names, conn.n) ||
            (has_te && is_name(&h, "content-length")))
            continue;
        if (chead_put(u, h.line, h.line_len) < 0) return -1;
    }
    if ((u->chunked && chead_put(u, "Transfer-Encoding: chunked\r\n", 28) < 0) ||
        ((sse || !has_length) && ((!has_xab && chead_put(u, "X-Accel-Buffering: no\r\n", 23) < 0) ||
                                  (!has_cc && chead_put(u, "Cache-Control: no-cache\r\n", 25) < 0))) ||
        (u->cl->close_after && chead_put(u, "Connection: close\r\n", 19) < 0) || chead_put(u, "\r\n", 2) < 0)
        return -1;
    return 0;
}

static void up_eof(up_t *u) {
    client_t *c = u->cl;
    if (u->state == U_BODY && u->until_close) {
        u->keep = 0;
        c->peek ? peek_done(u) : answer_ended(u);
    } else if (!u->got_bytes || c->peek) {  /* nothing reached the client yet */
        up_failed(u, R_DISCONNECTED);
    } else {  /* cut mid-answer: the client's answer is cut too (client_close_as drops `u`) */
        client_close_as(c, O_CUT);
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
        if (idle_ms) u->deadline_ms = now_ms + idle_ms;
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
                if (u->head_len == HEAD_MAX) { up_failed(u, R_BAD_RESPONSE); return; }
                continue;
            }
            size_t hl = (size_t)(end - u->head) + 4;
            if (parse_answer_head(u, hl) < 0) { up_failed(u, R_BAD_RESPONSE); return; }  /* nothing sent yet */
            u->state = U_BODY;
            iov[cnt++] = hygiene ? (struct iovec){u->chead, u->chead_len} : (struct iovec){u->head, hl};
            off = hl - before;  /* the body's first byte in relay_buf */
            if (answered_cb != NULL && u->status >= 400) {  /* held back: answered() may retry it */
                c->peek = 1;
                c->pk_len = 0;
                if (pk_put(c, iov[0].iov_base, iov[0].iov_len) < 0) { client_close(c); return; }
                c->pk_body = c->pk_len;
                cnt = 0;
            }
        }
        size_t body = body_feed(u, relay_buf + off, (size_t)n - off);
        if (off + body < (size_t)n) u->keep = 0;  /* bytes past the answer: not a connection to keep */
        if (c->peek) {
            if (pk_put(c, relay_buf + off, body) < 0) { client_close(c); return; }
            if (c->pk_len - c->pk_body > PEEK_MAX) {  /* too large to be a rejection: relayed as it comes */
                c->peek = 0;
                iov[cnt++] = (struct iovec){c->pk, c->pk_len};
            }
        } else if (body) {
            iov[cnt++] = (struct iovec){relay_buf + off, body};
        }
        if (cnt && to_client(c, iov, cnt) < 0) {
            client_close(c);  /* and `u` with it */
            return;
        }
        if (u->cstate == C_DONE && !u->until_close) {
            c->peek ? peek_done(u) : answer_ended(u);
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
        if (err) { up_failed(u, R_REFUSED); return; }
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
static void client_unlink(client_t *c) {
    if (c->prev) c->prev->next = c->next;
    else clients = c->next;
    if (c->next) c->next->prev = c->prev;
    c->prev = c->next = NULL;
}

static void client_free(client_t *c) {
    client_unlink(c);
    n_open--;
    c->fd = -1;
    free(c->in);
    free(c->out);
    free(c->fwd);
    free(c->pk);
    c->in = c->out = c->fwd = c->pk = NULL;
    Py_CLEAR(c->ctx);
    bury(c);
}

/* The client's connection closes (`outcome`: why, for release()). */
static void client_close_as(client_t *c, int outcome) {
    if (c->fd < 0) return;
    if (c->up != NULL) {  /* mid-request: the instance's connection cannot be kept */
        up_t *u = c->up;
        inflight[u->inst]--;
        up_close(u);
        c->up = NULL;
    }
    finish(c, outcome);
    close(c->fd);
    client_free(c);
}

static void client_close(client_t *c) { client_close_as(c, O_CLIENT_GONE); }

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
    client_free(c);
}

/* One header line of a head (hline_t): its name, its value trimmed, and the line as it came. */
/* The next header line from *p (the head ends at `end`, past its blank line): 1, 0 at the blank line,
 * -1 for a line the front does not take (no colon, a space before it, a folded line). */
static int next_header(const char **p, const char *end, hline_t *h) {
    const char *line = *p;
    const char *eol = memchr(line, '\n', (size_t)(end - line));
    if (eol == NULL) return 0;
    *p = eol + 1;
    size_t l = (size_t)(eol - line);
    if (l && line[l - 1] == '\r') l--;
    if (l == 0) return 0;
    if (line[0] == ' ' || line[0] == '\t') return -1;
    const char *colon = memchr(line, ':', l);
    if (colon == NULL || colon == line || colon[-1] == ' ' || colon[-1] == '\t') return -1;
    const char *v = colon + 1, *vend = line + l;
    while (v < vend && (*v == ' ' || *v == '\t')) v++;
    while (vend > v && (vend[-1] == ' ' || vend[-1] == '\t')) vend--;
    *h = (hline_t){line, v, line, (size_t)(colon - line), (size_t)(vend - v), (size_t)(eol + 1 - line)};
    return 1;
}

static int name_in(const char *name, size_t len, const void *names, int n) {
    const char (*table)[32] = names;
    for (int i = 0; i < n; i++)
        if (strlen(table[i]) == len && strncasecmp(name, table[i], len) == 0) return 1;
    return 0;
}

/* The names a Connection header lists (tokens_t; RFC 9110 7.6.1: those are hop-by-hop too). */
static void tokens_add(tokens_t *t, const char *v, size_t len) {
    size_t i = 0;
    while (i < len) {
        while (i < len && (v[i] == ',' || v[i] == ' ' || v[i] == '\t')) i++;
        size_t s = i;
        while (i < len && v[i] != ',') i++;
        size_t e = i;
        while (e > s && (v[e - 1] == ' ' || v[e - 1] == '\t')) e--;
        if (e == s) continue;
        if (e - s == 5 && strncasecmp(v + s, "close", 5) == 0) t->close = 1;
        if (t->n == MAX_TOKENS || e - s >= 32) { t->overflow = 1; continue; }
        memcpy(t->names[t->n], v + s, e - s);
        t->names[t->n][e - s] = 0;
        t->n++;
    }
}

/* What the front reads of a request's head. */
typedef struct {
    int post, http11, bad, chunked, expect;
    long long clen; /* -1: none */
    const char *host;
    size_t host_len;
    tokens_t conn;
} request_t;

static void parse_request(const char *head, size_t head_len, request_t *rq) {
    memset(rq, 0, sizeof *rq);
    rq->clen = -1;
    const char *end = head + head_len, *eol = memchr(head, '\n', head_len);
    size_t l = (size_t)(eol - head);
    if (l && head[l - 1] == '\r') l--;
    rq->post = l > 5 && memcmp(head, "POST ", 5) == 0;
    rq->http11 = l > 9 && memcmp(head + l - 9, " HTTP/1.1", 9) == 0;
    const char *p = eol + 1;
    hline_t h;
    int r;
    while ((r = next_header(&p, end, &h)) != 0) {
        if (r < 0) { rq->bad = 1; return; }
        if (h.name_len == 14 && strncasecmp(h.name, "content-length", 14) == 0) {
            long long v = 0;
            if (rq->clen >= 0 || h.value_len == 0 || h.value_len > 15) { rq->bad = 1; return; }
            for (size_t i = 0; i < h.value_len; i++) {
                if (h.value[i] < '0' || h.value[i] > '9') { rq->bad = 1; return; }
                v = v * 10 + (h.value[i] - '0');
            }
            rq->clen = v;
        } else if (h.name_len == 17 && strncasecmp(h.name, "transfer-encoding", 17) == 0) {
            rq->chunked = 1;
        } else if (h.name_len == 6 && strncasecmp(h.name, "expect", 6) == 0) {
            rq->expect = 1;
        } else if (h.name_len == 10 && strncasecmp(h.name, "connection", 10) == 0) {
            tokens_add(&rq->conn, h.value, h.value_len);
        } else if (h.name_len == 4 && strncasecmp(h.name, "host", 4) == 0) {
            rq->host = h.value;
            rq->host_len = h.value_len;
        }
    }
}

static int fwd_put(client_t *c, const char *p, size_t n) { return buf_put(&c->fwd, &c->fwd_len, &c->fwd_cap, p, n); }

/* The head the instance gets, without Host and the blank line (start_upstream adds them with the
 * body): the request line as it came, the headers but those dropped, the forwarding headers rebuilt
 * from the socket (headers.upstream_request_headers, for a peer that is not a trusted proxy). */
static int forward_head(client_t *c, size_t head_len, const request_t *rq) {
    const char *end = c->in + head_len, *eol = memchr(c->in, '\n', head_len), *p = eol + 1;
    char line[256];
    hline_t h;
    c->fwd_len = 0;
    if (fwd_put(c, c->in, (size_t)(p - c->in)) < 0) return -1;
    while (next_header(&p, end, &h) > 0) {
        if (name_in(h.name, h.name_len, req_drop, n_req_drop) ||
            name_in(h.name, h.name_len, rq->conn.names, rq->conn.n))
            continue;
        if (fwd_put(c, h.line, h.line_len) < 0) return -1;
    }
    /* Copied, not formatted: snprintf was 0.4% of a worker's samples (perf, tiny answers) */
    static const char xff[] = "X-Forwarded-For: ", mid[] = "\r\nX-Forwarded-Proto: http\r\nContent-Length: ";
    char digits[24];
    size_t peer_len = strlen(c->peer), n_digits = 0;
    /* none sent (-1: only without aiohttp to hand off to): the body read is none, as client_readable reads it */
    unsigned long long clen = rq->clen < 0 ? 0 : (unsigned long long)rq->clen;
    do {
        digits[sizeof digits - 1 - n_digits++] = (char)('0' + clen % 10);
        clen /= 10;
    } while (clen);
    char *w = line;
    memcpy(w, xff, sizeof xff - 1);
    w += sizeof xff - 1;
    memcpy(w, c->peer, peer_len);  /* < sizeof c->peer: the line has room (256) */
    w += peer_len;
    memcpy(w, mid, sizeof mid - 1);
    w += sizeof mid - 1;
    memcpy(w, digits + sizeof digits - n_digits, n_digits);
    w += n_digits;
    *w++ = '\r';
    *w++ = '\n';
    if (fwd_put(c, line, (size_t)(w - line)) < 0) return -1;
    if (rq->host_len && (fwd_put(c, "X-Forwarded-Host: ", 18) < 0 || fwd_put(c, rq->host, rq->host_len) < 0 ||
                         fwd_put(c, "\r\n", 2) < 0))
        return -1;
    c->fwd_base = c->fwd_len;
    return 0;
}

/* Whether the front serves this request itself (see the top of this file); else it is handed off. */
static int front_serves(client_t *c, size_t head_len, const request_t *rq) {
    if (!rq->post || !rq->http11 || rq->bad || rq->chunked || rq->expect || rq->clen < 0 ||
        (size_t)rq->clen > body_max || rq->conn.overflow || !is_hot(c->in, head_len))
        return 0;
    if (trusted_cb != NULL && !c->trust_checked) {  /* its forwarding headers are kept: aiohttp's rules */
        PyObject *r = PyObject_CallFunction(trusted_cb, "s", c->peer);
        int t = r ? PyObject_IsTrue(r) : 1;
        Py_XDECREF(r);
        if (PyErr_Occurred()) PyErr_Print();
        if (t) return 0;
        c->trust_checked = 1;
    }
    return 1;
}

static void try_request(client_t *c) {
    char *end = memmem(c->in, c->in_len, "\r\n\r\n", 4);
    if (end == NULL) {
        if (handoff_cb != NULL && memmem(c->in, c->in_len, "\n\n", 2) != NULL) {
            hand_off(c);  /* a head with bare line feeds: aiohttp reads it as it always has */
            return;
        }
        if (c->in_len > HEAD_MAX) {
            if (handoff_cb != NULL) { hand_off(c); return; }  /* aiohttp answers an oversized head */
            answer(c, R413, sizeof R413 - 1);
            client_close(c);
        }
        return;
    }
    size_t head_len = (size_t)(end - c->in) + 4;
    request_t rq;
    parse_request(c->in, head_len, &rq);
    if (handoff_cb != NULL && !front_serves(c, head_len, &rq)) {
        hand_off(c);
        return;
    }
    if (rq.chunked) {
        answer(c, R411, sizeof R411 - 1);
        client_close(c);
        return;
    }
    long long clen = rq.clen < 0 ? 0 : rq.clen;
    if (rq.bad || head_len + (size_t)clen > MAX_REQUEST) {
        answer(c, R413, sizeof R413 - 1);
        client_close(c);
        return;
    }
    c->close_after = rq.conn.close || draining;
    if (c->in_len < head_len + (size_t)clen) {  /* the body is still coming */
        if (c->phase != P_BODY) set_phase(c, P_BODY);
        return;
    }
    c->req_len = head_len + (size_t)clen;
    c->head_len = head_len;
    c->busy = 1;
    set_phase(c, P_BUSY);
    if (hygiene && forward_head(c, head_len, &rq) < 0) {
        client_close(c);
        return;
    }
    int slot;
    if (decide_cb != NULL) {
        PyObject *ans;
        slot = route_reply(c, PyObject_CallFunction(decide_cb, "y#y#", c->in, (Py_ssize_t)head_len, c->in + head_len,
                                                    (Py_ssize_t)(c->req_len - head_len)), &ans);
        if (slot == -2) { give_up(c, ans); return; }
        if (slot <= -3 && handoff_cb != NULL) { hand_off(c); return; }  /* aiohttp's: hold, or not a route of ours */
    } else {
        slot = pick_in_c(-1);
    }
    if (slot < 0) {
        c->status = 503;
        answer(c, R503, sizeof R503 - 1);
        own_answer_sent(c);
        return;
    }
    slot_taken(slot);
    start_upstream(c, slot);
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
        if (c->phase == P_IDLE) set_phase(c, P_HEAD);  /* the next request began: its head's deadline */
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
    if (c->resp_done) {
        request_done(c);
    } else if (c->up != NULL && c->up->state >= U_HEAD) {  /* resume the relay, the instance's clock anew */
        if (idle_ms) c->up->deadline_ms = now_ms + idle_ms;
        up_readable(c->up);
    }
}

static void client_event(client_t *c, unsigned events) {
    if (events & EPOLLOUT) {
        client_writable(c);
        if (c->fd < 0) return;  /* closed: freed */
    }
    if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) client_readable(c);
}

/* The client's address as X-Forwarded-For names it ("unknown" where the socket does not say). */
static void peer_name(int fd, char *out, size_t n) {
    struct sockaddr_storage sa;
    socklen_t l = sizeof sa;
    const char *r = NULL;
    if (getpeername(fd, (struct sockaddr *)&sa, &l) == 0) {
        if (sa.ss_family == AF_INET)
            r = inet_ntop(AF_INET, &((struct sockaddr_in *)&sa)->sin_addr, out, (socklen_t)n);
        else if (sa.ss_family == AF_INET6)
            r = inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&sa)->sin6_addr, out, (socklen_t)n);
    }
    if (r == NULL) snprintf(out, n, "unknown");
}

/* A client's connection becomes the front's: its request head is due within the head deadline. */
static int client_new(int fd) {
    client_t *c = calloc(1, sizeof *c);
    if (c == NULL) return -1;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->kind = K_CLIENT;
    c->fd = fd;
    peer_name(fd, c->peer, sizeof c->peer);
    c->next = clients;
    if (clients) clients->prev = c;
    clients = c;
    n_open++;
    set_phase(c, P_HEAD);
    watch(fd, c, EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET);  /* a request already there is read at once */
    return 0;
}

static void accept_all(int lfd) {
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) return;  /* EAGAIN, or an error the next wakeup meets again */
        if (client_new(fd) < 0) close(fd);
    }
}

/* --- the module ------------------------------------------------------------------------------ */
static int listen_fd = -1;

/* The slot of the instance at host:port (an IPv4 or IPv6 literal), added on first sight; -1 when
 * the host is not a literal or the table is full. */
static int slot_of(const char *host, int port) {
    for (int i = 0; i < n_inst; i++)
        if (inst_port[i] == port && strcmp(inst_host[i], host) == 0) return i;
    if (n_inst == MAX_INST || strlen(host) >= sizeof inst_host[0]) return -1;
    struct sockaddr_storage *sa = &addrs[n_inst];
    memset(sa, 0, sizeof *sa);
    struct sockaddr_in *v4 = (struct sockaddr_in *)sa;
    struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)sa;
    if (inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons((uint16_t)port);
        addr_len[n_inst] = sizeof *v4;
        snprintf(host_line[n_inst], sizeof host_line[0], "Host: %s:%d\r\n", host, port);
    } else if (inet_pton(AF_INET6, host, &v6->sin6_addr) == 1) {
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons((uint16_t)port);
        addr_len[n_inst] = sizeof *v6;
        snprintf(host_line[n_inst], sizeof host_line[0], "Host: [%s]:%d\r\n", host, port);
    } else {
        return -1;
    }
    strcpy(inst_host[n_inst], host);
    inst_port[n_inst] = port;
    return n_inst++;
}

/* A sequence of lower-case header names (bytes) into `table`; its length, or -1 with an exception. */
static int names_into(PyObject *names, char table[][32], const char *what) {
    if (names == Py_None) return 0;
    PyObject *seq = PySequence_Fast(names, what);
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        char *b;
        Py_ssize_t l;
        if (i >= MAX_DROP || PyBytes_AsStringAndSize(PySequence_Fast_GET_ITEM(seq, i), &b, &l) < 0 || l >= 32) {
            Py_DECREF(seq);
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: %d names of 31 bytes at most", what, MAX_DROP);
            return -1;
        }
        memcpy(table[i], b, (size_t)l);
        table[i][l] = 0;
    }
    Py_DECREF(seq);
    return (int)n;
}

/* The arguments of start() and serve(): the instances, the callbacks, the rules, the epoll set. */
static PyObject *setup(PyObject *args, PyObject *kw) {
    static char *names[] = {"listen_fd", "ports", "decide", "release", "handoff", "hot_suffixes", "max_body",
                            "request_drop", "response_drop", "limits", "head_answer", "body_answer", "trusted",
                            "retry", "answered", "upstream", "first", "itl_bounds", NULL};
    int lfd;
    long long mb = MAX_REQUEST;
    double lim[3] = {0, 0, 0}, ups[3] = {0, 0, 0};
    PyObject *ports, *dec = Py_None, *rel = Py_None, *hand = Py_None, *suffixes = Py_None, *rqd = Py_None,
             *rsd = Py_None, *limits = Py_None, *ha = Py_None, *ba = Py_None, *tr = Py_None, *rt = Py_None,
             *an = Py_None, *upstream = Py_None, *fi = Py_None, *bounds = Py_None;
    if (ep >= 0) return PyErr_Format(PyExc_RuntimeError, "one front per process: started already");
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iO|OOOOLOOOSSOOOOOO", names, &lfd, &ports, &dec, &rel, &hand,
                                     &suffixes, &mb, &rqd, &rsd, &limits, &ha, &ba, &tr, &rt, &an, &upstream, &fi,
                                     &bounds))
        return NULL;
    n_itl = 0;
    if (bounds != Py_None) {
        PyObject *seq = PySequence_Fast(bounds, "itl_bounds: a sequence of floats");
        if (seq == NULL) return NULL;
        Py_ssize_t nb = PySequence_Fast_GET_SIZE(seq);
        for (Py_ssize_t i = 0; i < nb && i < MAX_ITL; i++)
            itl_bounds[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
        Py_DECREF(seq);
        if (PyErr_Occurred()) return NULL;
        if (nb > MAX_ITL) return PyErr_Format(PyExc_ValueError, "itl_bounds: %d at most", MAX_ITL);
        n_itl = (int)nb;
    }
    if (limits != Py_None && !PyArg_ParseTuple(limits, "ddd", &lim[0], &lim[1], &lim[2]))
        return NULL;
    if (upstream != Py_None && !PyArg_ParseTuple(upstream, "dd|d", &ups[0], &ups[1], &ups[2]))
        return NULL;
    connect_ms = (long long)(ups[0] * 1000);
    idle_ms = (long long)(ups[1] * 1000);
    first_byte_ms = (long long)(ups[2] * 1000);
    Py_XINCREF(rt == Py_None ? NULL : rt);
    Py_XINCREF(an == Py_None ? NULL : an);
    retry_cb = rt == Py_None ? NULL : rt;
    Py_XINCREF(fi == Py_None ? NULL : fi);
    first_cb = fi == Py_None ? NULL : fi;
    answered_cb = an == Py_None ? NULL : an;
    head_ms = (long long)(lim[0] * 1000);
    body_ms = (long long)(lim[1] * 1000);
    keepalive_ms = (long long)(lim[2] * 1000);
    if (mb < 0) return PyErr_Format(PyExc_ValueError, "max_body: %lld", mb);
    body_max = (size_t)mb < MAX_REQUEST - HEAD_MAX ? (size_t)mb : MAX_REQUEST - HEAD_MAX;
    if ((n_req_drop = names_into(rqd, req_drop, "request_drop")) < 0 ||
        (n_resp_drop = names_into(rsd, resp_drop, "response_drop")) < 0)
        return NULL;
    hygiene = rqd != Py_None && rsd != Py_None;
    Py_XINCREF(ha == Py_None ? NULL : ha);
    Py_XINCREF(ba == Py_None ? NULL : ba);
    head_answer = ha == Py_None ? NULL : ha;
    body_answer = ba == Py_None ? NULL : ba;
    Py_XINCREF(tr == Py_None ? NULL : tr);
    trusted_cb = tr == Py_None ? NULL : tr;
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
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_INST) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "ports: %d instances at most, got %zd", MAX_INST, n);
    }
    for (Py_ssize_t i = 0; i < n; i++) {  /* slots 0..n-1 on 127.0.0.1 (instance() adds more) */
        long port = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (port <= 0 || port > 65535 || slot_of("127.0.0.1", (int)port) != (int)i) {
            Py_DECREF(seq);
            return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "ports[%zd]: %ld", i, port);
        }
    }
    Py_DECREF(seq);
    Py_XINCREF(dec == Py_None ? NULL : dec);
    Py_XINCREF(rel == Py_None ? NULL : rel);
    decide_cb = dec == Py_None ? NULL : dec;
    release_cb = rel == Py_None ? NULL : rel;
    ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) return PyErr_SetFromErrno(PyExc_OSError);
    listen_fd = lfd;
    now_ms = last_sweep_ms = clock_ms();
    static int listener[2] = {K_LISTEN, 0};
    if (lfd >= 0) watch(lfd, listener, EPOLLIN);  /* else the worker's acceptor adopt()s connections */
    Py_RETURN_NONE;
}

/* Slow clients cut: a head or a body past its deadline is answered (client_guard.py's 408s) and its
 * connection closed; a kept connection idle past its keep-alive is closed. */
static void sweep_clients(void) {
    client_t *c = clients;
    last_sweep_ms = now_ms;
    while (c != NULL) {
        client_t *next = c->next;  /* closing unlinks `c` */
        if (c->deadline_ms && now_ms >= c->deadline_ms) {
            PyObject *msg = c->phase == P_HEAD ? head_answer : c->phase == P_BODY ? body_answer : NULL;
            unsigned long long *count = c->phase == P_HEAD ? &cut_head : c->phase == P_BODY ? &cut_body : &closed_idle;
            ++*count;
            if (msg != NULL) {
                struct iovec iov = {PyBytes_AS_STRING(msg), (size_t)PyBytes_GET_SIZE(msg)};
                (void)to_client(c, &iov, 1);  /* best effort: the connection closes either way */
            }
            client_close(c);
        } else if (c->up != NULL && c->up->state != U_BODY && c->head_due_ms && now_ms >= c->head_due_ms &&
                   (!c->up->deadline_ms || c->head_due_ms <= c->up->deadline_ms)) {
            /* No answer head within --first-byte-timeout-s: nothing reached the client, another
             * instance tries it (the embedded path's first_byte_timeout). */
            up_failed(c->up, R_FIRST_BYTE_TIMEOUT);
        } else if (c->up != NULL && c->up->deadline_ms && now_ms >= c->up->deadline_ms && c->out_len == c->out_off) {
            /* The instance is silent: connect, head or next bytes overdue (not while the relay waits
             * for a slow client to read: the instance is not read then, and not to blame). */
            up_t *u = c->up;
            if (u->state == U_CONNECTING) up_failed(u, R_CONNECT_TIMEOUT);
            else if (u->state != U_BODY) up_failed(u, R_HEADER_TIMEOUT);
            else if (c->peek) up_failed(u, R_DISCONNECTED);  /* as the embedded path's error peek */
            else client_close_as(c, O_IDLE);                /* committed: cut, so the client can tell */
        }
        c = next;
    }
}

static void flush_dead(void) {
    for (size_t i = 0; i < n_dead; i++) free(dead[i]);
    n_dead = 0;
}

/* The calls that change connections refuse to run inside the front's own callbacks (a Python rule
 * that called them would act on a client the front is in the middle of). */
static int outside_batch(void) {
    if (!in_batch) return 1;
    PyErr_SetString(PyExc_RuntimeError, "called from inside the front's callbacks");
    return 0;
}

/* One batch of ready events (waiting up to `timeout_ms`); their count, or -1 with errno. */
static int run_batch(int timeout_ms) {
    struct epoll_event evs[512];
    int n = epoll_wait(ep, evs, 512, timeout_ms);
    now_ms = clock_ms();
    in_batch = 1;
    for (int i = 0; i < n; i++) {
        int *obj = evs[i].data.ptr;  /* kind, then fd: -1 once closed this turn */
        if (obj[0] == K_LISTEN) accept_all(listen_fd);
        else if (obj[1] < 0) continue;
        else if (obj[0] == K_CLIENT) client_event((client_t *)obj, evs[i].events);
        else up_event((up_t *)obj, evs[i].events);
    }
    if (now_ms - last_sweep_ms >= SWEEP_MS) sweep_clients();
    in_batch = 0;
    flush_dead();
    return n;
}

static PyObject *serve(PyObject *self, PyObject *args, PyObject *kw) {
    PyObject *r = setup(args, kw);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    for (;;) {
        if (run_batch(SWEEP_MS) < 0 && errno != EINTR) return PyErr_SetFromErrno(PyExc_OSError);
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

/* sweep(): the deadlines checked now (a loop-driven front calls it on a timer: poll() runs only
 * when events come, and a silent client brings none). */
static PyObject *sweep(PyObject *self, PyObject *unused) {
    if (ep < 0) return PyErr_Format(PyExc_RuntimeError, "start() first");
    if (!outside_batch()) return NULL;
    now_ms = clock_ms();
    in_batch = 1;
    sweep_clients();
    in_batch = 0;
    flush_dead();
    Py_RETURN_NONE;
}

/* configure(limits=, upstream=, max_body=, body_answer=): a reload's numbers, for what starts next. */
static PyObject *configure(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"limits", "upstream", "max_body", "body_answer", NULL};
    double lim[3], ups[3];
    long long mb;
    PyObject *ba;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "(ddd)(ddd)LS", names, &lim[0], &lim[1], &lim[2], &ups[0], &ups[1],
                                     &ups[2], &mb, &ba))
        return NULL;
    if (mb < 0) return PyErr_Format(PyExc_ValueError, "max_body: %lld", mb);
    head_ms = (long long)(lim[0] * 1000);
    body_ms = (long long)(lim[1] * 1000);
    keepalive_ms = (long long)(lim[2] * 1000);
    connect_ms = (long long)(ups[0] * 1000);
    idle_ms = (long long)(ups[1] * 1000);
    first_byte_ms = (long long)(ups[2] * 1000);
    body_max = (size_t)mb < MAX_REQUEST - HEAD_MAX ? (size_t)mb : MAX_REQUEST - HEAD_MAX;
    Py_INCREF(ba);
    Py_XSETREF(body_answer, ba);
    Py_RETURN_NONE;
}

/* instance(host, port) -> its slot, the number decide() and retry() name it by (-1: the host is not
 * an IP literal, or 64 instances are known already: the request goes to aiohttp). */
static PyObject *instance(PyObject *self, PyObject *args) {
    const char *host;
    int port;
    if (!PyArg_ParseTuple(args, "si", &host, &port)) return NULL;
    if (port <= 0 || port > 65535) return PyErr_Format(PyExc_ValueError, "port: %d", port);
    return PyLong_FromLong(slot_of(host, port));
}

/* adopt(fd): a client connection the worker accepted becomes the front's (the fd is the front's to
 * close from then on). */
static PyObject *adopt(PyObject *self, PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd)) return NULL;
    if (ep < 0) return PyErr_Format(PyExc_RuntimeError, "start() first");
    now_ms = clock_ms();
    if (client_new(fd) < 0) {
        close(fd);
        return PyErr_NoMemory();
    }
    Py_RETURN_NONE;
}

/* abort(slot, answering) -> requests ended: the instance stopped answering (it is out of the ready
 * set). Those still waiting for its answer go to retry() ("aborted"); with `answering`, the answers
 * it is streaming are cut too. Its kept connections close. */
static PyObject *abort_instance(PyObject *self, PyObject *args) {
    int slot, answering, n = 0;
    if (!PyArg_ParseTuple(args, "ip", &slot, &answering)) return NULL;
    if (slot < 0 || slot >= n_inst) return PyErr_Format(PyExc_ValueError, "slot: %d", slot);
    if (!outside_batch()) return NULL;
    now_ms = clock_ms();
    in_batch = 1;
    for (client_t *c = clients, *next; c != NULL; c = next) {
        next = c->next;
        up_t *u = c->up;
        if (u == NULL || u->inst != slot) continue;
        if (u->state != U_BODY || c->peek) {
            up_failed(u, R_ABORTED);
            n++;
        } else if (answering) {
            client_close_as(c, O_CUT);
            n++;
        }
    }
    while (idle[slot] != NULL) {
        up_t *u = idle[slot];
        idle[slot] = u->next_idle;
        up_close(u);
    }
    in_batch = 0;
    flush_dead();
    return PyLong_FromLong(n);
}

/* drain(): stopping. Every connection closes after its next answer, which says Connection: close
 * where its head is still to come; an idle kept one waits for that request as a fresh one does (its
 * client may be sending it now: closed, it would fail), and stop() closes what stays silent. */
static PyObject *drain(PyObject *self, PyObject *unused) {
    if (!outside_batch()) return NULL;
    draining = 1;
    for (client_t *c = clients; c != NULL; c = c->next)
        if (c->phase == P_IDLE) set_phase(c, P_HEAD);
    Py_RETURN_NONE;
}

/* close_all(): the end of a stop's grace. Every client connection closes, its answer cut where one
 * was on the way (release(): outcome cut), and every kept instance connection. */
static PyObject *close_all(PyObject *self, PyObject *unused) {
    if (!outside_batch()) return NULL;
    while (clients != NULL) client_close_as(clients, O_CUT);
    for (int i = 0; i < n_inst; i++) {
        while (idle[i] != NULL) {
            up_t *u = idle[i];
            idle[i] = u->next_idle;
            up_close(u);
        }
    }
    flush_dead();
    Py_RETURN_NONE;
}

/* What tests and the worker's log look at: per instance, requests in flight and kept idle
 * connections; the clients cut for a slow head or body, and kept ones closed idle. */
static PyObject *stats(PyObject *self, PyObject *unused) {
    PyObject *fl = PyList_New(n_inst), *kept = PyList_New(n_inst);
    if (fl == NULL || kept == NULL) { Py_XDECREF(fl); Py_XDECREF(kept); return NULL; }
    for (int i = 0; i < n_inst; i++) {
        int k = 0;
        for (up_t *u = idle[i]; u; u = u->next_idle) k++;
        PyList_SET_ITEM(fl, i, PyLong_FromLong(inflight[i]));
        PyList_SET_ITEM(kept, i, PyLong_FromLong(k));
    }
    long busy = 0, fresh = 0;
    for (client_t *c = clients; c != NULL; c = c->next) {
        busy += c->busy;
        fresh += !c->busy && c->phase == P_HEAD && c->in_len == 0;  /* no byte of a request yet */
    }
    return Py_BuildValue("{sNsNsKsKsKsKslslsl}", "inflight", fl, "kept", kept, "cut_head", cut_head, "cut_body",
                         cut_body, "closed_idle", closed_idle, "served", served, "open", n_open, "busy", busy,
                         "fresh", fresh);
}

/* open_count(): the client connections open now (the acceptor asks at every connection). */
static PyObject *open_count(PyObject *self, PyObject *unused) {
    return PyLong_FromLong(n_open);
}

/* shutdown(): close_all(), then the front is gone (its epoll, instances and callbacks): start() may
 * run again in this process (a worker's next proxy, a test's next front). */
static PyObject *front_shutdown(PyObject *self, PyObject *unused) {
    PyObject *r = close_all(self, NULL);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    if (ep >= 0) close(ep);
    ep = listen_fd = -1;
    for (int i = 0; i < n_inst; i++) inflight[i] = 0, last_pick[i] = 0;
    n_inst = n_hot = n_req_drop = n_resp_drop = hygiene = draining = n_itl = 0;
    picks = cut_head = cut_body = closed_idle = served = 0;
    body_max = MAX_REQUEST;
    head_ms = body_ms = keepalive_ms = connect_ms = idle_ms = first_byte_ms = 0;
    Py_CLEAR(decide_cb);
    Py_CLEAR(release_cb);
    Py_CLEAR(retry_cb);
    Py_CLEAR(answered_cb);
    Py_CLEAR(first_cb);
    Py_CLEAR(handoff_cb);
    Py_CLEAR(trusted_cb);
    Py_CLEAR(head_answer);
    Py_CLEAR(body_answer);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"serve", (PyCFunction)(void (*)(void))serve, METH_VARARGS | METH_KEYWORDS,
     "serve(listen_fd, ports, decide=None, release=None): relay until a signal's handler raises"},
    {"start", (PyCFunction)(void (*)(void))start, METH_VARARGS | METH_KEYWORDS,
     "start(listen_fd, ports, decide=None, release=None, handoff=None, hot_suffixes=None, max_body=1M, "
     "request_drop=None, response_drop=None, limits=None, head_answer=None, body_answer=None, trusted=None, "
     "retry=None, answered=None, upstream=None (connect, idle[, first_byte]), first=None) -> the epoll fd "
     "to watch; then poll(), and sweep() on a timer (the top of _front.c says what each is)"},
    {"poll", poll_ready, METH_VARARGS, "poll(rounds=1) -> events handled: the ready ones, without waiting"},
    {"sweep", sweep, METH_NOARGS, "sweep(): cut the clients past their deadlines now"},
    {"open_count", open_count, METH_NOARGS, "open_count() -> client connections open now"},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "configure(limits=(head, body, keepalive), upstream=(connect, idle, first_byte), max_body=, body_answer=)"},
    {"instance", instance, METH_VARARGS, "instance(host, port) -> slot (-1: not an IP literal, or full)"},
    {"adopt", adopt, METH_VARARGS, "adopt(fd): an accepted client connection becomes the front's"},
    {"abort", abort_instance, METH_VARARGS, "abort(slot, answering) -> requests ended there"},
    {"drain", drain, METH_NOARGS, "drain(): idle connections close now, the others after their answer"},
    {"close_all", close_all, METH_NOARGS, "close_all(): every connection closes now"},
    {"shutdown", front_shutdown, METH_NOARGS, "shutdown(): close_all(), and start() may run again"},
    {"stats", stats, METH_NOARGS, "stats() -> {'inflight': [...], 'kept': [...]} per instance"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_front", NULL, -1, methods};

PyMODINIT_FUNC PyInit__front(void) { return PyModule_Create(&module); }
