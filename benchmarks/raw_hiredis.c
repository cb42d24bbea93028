/*
 * raw_hiredis.c - the physical limit of one Redis connection for this package's workload.
 *
 * A plain C client on hiredis that sends the package's script as built (the text the extension
 * embeds: lua/sliding_window.lua with the lua/lib files it includes prepended; benchlib.py
 * writes it from genai_ratelimit._native.SCRIPT_SOURCE), loaded once with SCRIPT LOAD, as
 * EVALSHA, one fresh UUID4 member (libuuid, canonical 36-char text) per call, with the same
 * keys and arguments RateLimiter.check / check_windows send:
 *
 *   EVALSHA <sha> <3n> <prefix>:<user>:<window_s>... <each key>:w... <each key>:t...
 *           <uuid> <now_ms|""> (<window_ms> <limit> 1)...
 *
 * Modes:
 *   seq    one command, wait for its reply, repeat: the latency floor of one connection.
 *   pipe   D commands written together, then D replies read: the throughput of one connection.
 *
 * It runs for --duration seconds or --calls calls, whichever ends first (after --warmup calls
 * that are not measured), and prints one JSON object on stdout (with --serve: one run per
 * "run <duration_s> <max_calls> <warmup>" line read from stdin, on the same connection): calls/s, p50/p99 latency (per
 * call for seq, per batch for pipe, with the batch figures also divided by the depth), client
 * CPU (user+sys from getrusage over the measured loop) per call, and how many calls were
 * allowed / rejected. Every reply is checked: an error reply or a malformed one stops the run
 * with exit status 2, so a "fast" run can never be a run of errors.
 *
 * Credentials, when the server needs them, come from RAW_HIREDIS_USERNAME / RAW_HIREDIS_PASSWORD
 * in the environment (never argv, which any user can read in ps).
 *
 * Single-threaded, no locks, no globals that outlive main().
 */

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>

#include <hiredis.h>
#include <uuid.h>

#define MAX_WINDOWS 8
#define UUID_TEXT_LEN 36
/* The sorted-set storage's keys of one window, in the order the script takes them
 * (csrc/script.c's RL_STORAGE_ZSET row): the log, its weights, their running totals. */
#define KEYS_PER_WINDOW 3
static const char *const KEY_SUFFIXES[KEYS_PER_WINDOW] = {"", ":w", ":t"};

struct window {
    long long seconds;   /* window length, seconds (the key's suffix) */
    long long limit;     /* budget of this window */
};

struct options {
    const char *host;            /* Redis host (TCP) */
    int port;                    /* Redis port */
    const char *unix_path;       /* unix socket path, overrides host/port when set */
    int db;                      /* SELECT this db first when non-zero */
    const char *script_path;     /* the built script (see the top of this file) */
    const char *prefix;          /* key prefix */
    int pipelined;               /* 0: seq, 1: pipe */
    int depth;                   /* commands per batch in pipe mode */
    double duration;             /* seconds of measured run, upper bound */
    long long max_calls;         /* measured calls, upper bound */
    long long warmup;            /* unmeasured calls first */
    int users;                   /* distinct user ids, cycled */
    int client_clock;            /* 1: send our own ms time, 0: "" (server TIME) */
    int serve;                   /* 1: take "run ..." lines on stdin (see main) */
    int nwindows;                /* entries used in windows[] */
    struct window windows[MAX_WINDOWS];
};

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static long long unix_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static double cpu_seconds(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
}

static void usage(const char *argv0) {
    fprintf(stderr,
            "usage: %s --script BUILT_SCRIPT.lua [--host H] [--port P] [--unix PATH] [--db N]\n"
            "          [--mode seq|pipe] [--depth D] [--duration S] [--calls N] [--warmup N]\n"
            "          [--users U] [--prefix P] [--clock server|client] [--serve]\n"
            "          [--window SECONDS:LIMIT]...   (shortest first; default 60:1000000000)\n",
            argv0);
}

static int parse_options(int argc, char **argv, struct options *o) {
    memset(o, 0, sizeof *o);
    o->host = "127.0.0.1";
    o->port = 6379;
    o->prefix = "bench:raw";
    o->depth = 16;
    o->duration = 2.0;
    o->max_calls = 100000000LL;
    o->warmup = 200;
    o->users = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--serve")) { o->serve = 1; continue; }
        if (!v) { usage(argv[0]); return -1; }
        if (!strcmp(a, "--host")) o->host = v;
        else if (!strcmp(a, "--port")) o->port = atoi(v);
        else if (!strcmp(a, "--unix")) o->unix_path = v;
        else if (!strcmp(a, "--db")) o->db = atoi(v);
        else if (!strcmp(a, "--script")) o->script_path = v;
        else if (!strcmp(a, "--prefix")) o->prefix = v;
        else if (!strcmp(a, "--mode")) {
            if (!strcmp(v, "seq")) o->pipelined = 0;
            else if (!strcmp(v, "pipe")) o->pipelined = 1;
            else { usage(argv[0]); return -1; }
        }
        else if (!strcmp(a, "--depth")) o->depth = atoi(v);
        else if (!strcmp(a, "--duration")) o->duration = atof(v);
        else if (!strcmp(a, "--calls")) o->max_calls = atoll(v);
        else if (!strcmp(a, "--warmup")) o->warmup = atoll(v);
        else if (!strcmp(a, "--users")) o->users = atoi(v);
        else if (!strcmp(a, "--clock")) o->client_clock = !strcmp(v, "client");
        else if (!strcmp(a, "--window")) {
            if (o->nwindows == MAX_WINDOWS) { fprintf(stderr, "too many windows\n"); return -1; }
            struct window *w = &o->windows[o->nwindows];
            if (sscanf(v, "%lld:%lld", &w->seconds, &w->limit) != 2 || w->seconds < 1 || w->limit < 1) {
                fprintf(stderr, "bad --window %s (want SECONDS:LIMIT)\n", v);
                return -1;
            }
            o->nwindows++;
        }
        else { usage(argv[0]); return -1; }
        i++;
    }
    if (!o->script_path || o->depth < 1 || o->users < 1 || o->duration <= 0 || o->max_calls < 1) {
        usage(argv[0]);
        return -1;
    }
    if (o->nwindows == 0) {
        o->windows[0].seconds = 60;
        o->windows[0].limit = 1000000000LL;
        o->nwindows = 1;
    }
    return 0;
}

/* Returns the file's contents, NUL-terminated, malloc'd (caller frees), or NULL. */
static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "cannot open %s: %s\n", path, strerror(errno)); return NULL; }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) { fclose(f); free(buf); return NULL; }
    buf[n] = '\0';
    fclose(f);
    *len = (size_t)n;
    return buf;
}

/* The per-call argument vector. Keys are built once per user; only the member and (with the
 * client clock) the time change per call, written in place into fixed buffers. */
struct command {
    int argc;
    const char **argv;
    size_t *argvlen;
    char member[UUID_TEXT_LEN + 1];
    char now[24];
    int member_index;
    int now_index;
    int key_index;               /* argv index of KEYS[1] */
    char **keys;                 /* users * nwindows key strings */
    size_t *key_lens;
};

static int command_init(struct command *c, const struct options *o, const char *sha) {
    int nw = o->nwindows;
    c->argc = 3 + KEYS_PER_WINDOW * nw + 2 + 3 * nw; /* KEYS: windows, weights, totals */
    c->argv = calloc((size_t)c->argc, sizeof *c->argv);
    c->argvlen = calloc((size_t)c->argc, sizeof *c->argvlen);
    size_t nkeys_all = (size_t)o->users * KEYS_PER_WINDOW * (size_t)nw;
    c->keys = calloc(nkeys_all, sizeof *c->keys);
    c->key_lens = calloc(nkeys_all, sizeof *c->key_lens);
    if (!c->argv || !c->argvlen || !c->keys || !c->key_lens) return -1;
    static char nkeys[16];
    snprintf(nkeys, sizeof nkeys, "%d", KEYS_PER_WINDOW * nw);
    int i = 0;
    c->argv[i] = "EVALSHA"; c->argvlen[i++] = 7;
    c->argv[i] = sha; c->argvlen[i++] = strlen(sha);
    c->argv[i] = nkeys; c->argvlen[i++] = strlen(nkeys);
    c->key_index = i;
    i += KEYS_PER_WINDOW * nw;
    c->member_index = i;
    c->argv[i] = c->member; c->argvlen[i++] = UUID_TEXT_LEN;
    c->now_index = i;
    c->argv[i] = c->now; c->argvlen[i++] = 0;
    for (int w = 0; w < nw; w++) {
        char *ms = malloc(24), *lim = malloc(24);
        if (!ms || !lim) return -1;
        snprintf(ms, 24, "%lld", o->windows[w].seconds * 1000);
        snprintf(lim, 24, "%lld", o->windows[w].limit);
        c->argv[i] = ms; c->argvlen[i++] = strlen(ms);
        c->argv[i] = lim; c->argvlen[i++] = strlen(lim);
        c->argv[i] = "1"; c->argvlen[i++] = 1; /* cost */
    }
    for (int u = 0; u < o->users; u++) {
        for (int w = 0; w < nw; w++) {
            for (int k = 0; k < KEYS_PER_WINDOW; k++) {
                char buf[256];
                int n = snprintf(buf, sizeof buf, "%s:user_%d:%lld%s", o->prefix, u,
                                 o->windows[w].seconds, KEY_SUFFIXES[k]);
                size_t at = (size_t)u * KEYS_PER_WINDOW * (size_t)nw + (size_t)k * (size_t)nw + (size_t)w;
                c->keys[at] = strdup(buf);
                if (!c->keys[at]) return -1;
                c->key_lens[at] = (size_t)n;
            }
        }
    }
    return 0;
}

/* Fills in the next call's user, member and time. */
static void command_next(struct command *c, const struct options *o, long long seq) {
    int u = (int)(seq % o->users);
    for (int k = 0; k < KEYS_PER_WINDOW * o->nwindows; k++) {
        c->argv[c->key_index + k] = c->keys[u * KEYS_PER_WINDOW * o->nwindows + k];
        c->argvlen[c->key_index + k] = c->key_lens[u * KEYS_PER_WINDOW * o->nwindows + k];
    }
    uuid_t id;
    uuid_generate_random(id);
    uuid_unparse_lower(id, c->member);
    if (o->client_clock) {
        int n = snprintf(c->now, sizeof c->now, "%lld", unix_ms());
        c->argvlen[c->now_index] = (size_t)n;
    }
}

/* Checks one script reply. Returns 1 allowed, 0 rejected, -1 bad reply (message printed). */
static int check_reply(const redisReply *r) {
    if (!r) return -1;
    if (r->type == REDIS_REPLY_ERROR) {
        fprintf(stderr, "error reply: %s\n", r->str);
        return -1;
    }
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 7) {
        fprintf(stderr, "unexpected reply type %d (%zu elements)\n", r->type, (size_t)r->elements);
        return -1;
    }
    for (size_t i = 0; i < 7; i++) {
        if (r->element[i]->type != (i == 5 ? REDIS_REPLY_ARRAY : REDIS_REPLY_INTEGER)) {
            fprintf(stderr, "unexpected element type %d\n", r->element[i]->type);
            return -1;
        }
    }
    return r->element[0]->integer == 1;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double percentile(double *sorted, long long n, double p) {
    if (n == 0) return 0.0;
    long long i = (long long)(p * (double)(n - 1) + 0.5);
    if (i >= n) i = n - 1;
    return sorted[i];
}

/* One measured run: `warmup` unmeasured calls, then calls until `duration` seconds or
 * `max_calls`; prints one JSON line on stdout. Returns 0, or 2 after a failed or bad reply. */
static int measure(redisContext *ctx, struct command *cmd, const struct options *o,
                   double duration, long long max_calls, long long warmup, long long *seq) {
    /* Warm-up: connection, server-side script cache, page faults; not measured. */
    for (long long i = 0; i < warmup; i++) {
        command_next(cmd, o, (*seq)++);
        redisReply *r = redisCommandArgv(ctx, cmd->argc, cmd->argv, cmd->argvlen);
        int verdict = check_reply(r);
        if (r) freeReplyObject(r);
        if (verdict < 0) {
            if (!r) fprintf(stderr, "reply: %s\n", ctx->errstr);
            return 2;
        }
    }

    int per = o->pipelined ? o->depth : 1;
    long long max_samples = max_calls / per + 1;
    /* Cap the sample buffer by what the duration can plausibly hold (10M calls/s). */
    long long cap = (long long)(duration * 1e7) / per + 16;
    if (max_samples > cap) max_samples = cap;
    double *lat = malloc((size_t)max_samples * sizeof *lat);
    if (!lat) { fprintf(stderr, "out of memory\n"); return 2; }

    long long calls = 0, samples = 0, allowed = 0, rejected = 0;
    int status = 0;
    double cpu0 = cpu_seconds();
    double t0 = now_seconds();
    double deadline = t0 + duration;
    double t = t0;
    while (status == 0 && calls + per <= max_calls && samples < max_samples && t < deadline) {
        double start = t;
        for (int k = 0; k < per && status == 0; k++) {
            command_next(cmd, o, (*seq)++);
            if (redisAppendCommandArgv(ctx, cmd->argc, cmd->argv, cmd->argvlen) != REDIS_OK) {
                fprintf(stderr, "append: %s\n", ctx->errstr);
                status = 2;
            }
        }
        for (int k = 0; k < per && status == 0; k++) {
            void *reply = NULL;
            if (redisGetReply(ctx, &reply) != REDIS_OK) {
                fprintf(stderr, "reply: %s\n", ctx->errstr);
                status = 2;
                break;
            }
            int verdict = check_reply(reply);
            freeReplyObject(reply);
            if (verdict < 0) { status = 2; break; }
            if (verdict) allowed++; else rejected++;
        }
        t = now_seconds();
        lat[samples++] = (t - start) * 1e6;
        calls += per;
    }
    double elapsed = now_seconds() - t0;
    double cpu = cpu_seconds() - cpu0;
    if (status == 0) {
        qsort(lat, (size_t)samples, sizeof *lat, cmp_double);
        double p50 = percentile(lat, samples, 0.50), p99 = percentile(lat, samples, 0.99);
        printf("{\"mode\": \"%s\", \"depth\": %d, \"calls\": %lld, \"elapsed_s\": %.6f, "
               "\"calls_per_s\": %.1f, \"p50_us\": %.2f, \"p99_us\": %.2f, "
               "\"p50_per_call_us\": %.3f, \"p99_per_call_us\": %.3f, "
               "\"cpu_us_per_call\": %.3f, \"allowed\": %lld, \"rejected\": %lld}\n",
               o->pipelined ? "pipe" : "seq", per, calls, elapsed,
               elapsed > 0 ? (double)calls / elapsed : 0.0, p50, p99, p50 / per, p99 / per,
               calls ? cpu * 1e6 / (double)calls : 0.0, allowed, rejected);
        fflush(stdout);
    }
    free(lat);
    return status;
}

int main(int argc, char **argv) {
    struct options o;
    if (parse_options(argc, argv, &o) != 0) return 64;

    size_t script_len = 0;
    char *script = read_file(o.script_path, &script_len);
    if (!script) return 66;

    struct timeval tv = {5, 0};
    redisContext *ctx = o.unix_path ? redisConnectUnixWithTimeout(o.unix_path, tv)
                                    : redisConnectWithTimeout(o.host, o.port, tv);
    if (!ctx || ctx->err) {
        fprintf(stderr, "connect: %s\n", ctx ? ctx->errstr : "out of memory");
        return 69;
    }
    redisSetTimeout(ctx, tv);
    if (!o.unix_path) {
        int one = 1;  /* hiredis sets it too; say it explicitly so the floor is honest */
        setsockopt(ctx->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    const char *password = getenv("RAW_HIREDIS_PASSWORD");  /* not argv: ps shows argv */
    if (password && *password) {
        const char *user = getenv("RAW_HIREDIS_USERNAME");
        redisReply *r = user && *user ? redisCommand(ctx, "AUTH %s %s", user, password)
                                      : redisCommand(ctx, "AUTH %s", password);
        if (!r || r->type == REDIS_REPLY_ERROR) { fprintf(stderr, "AUTH failed\n"); return 69; }
        freeReplyObject(r);
    }
    if (o.db) {
        redisReply *r = redisCommand(ctx, "SELECT %d", o.db);
        if (!r || r->type == REDIS_REPLY_ERROR) { fprintf(stderr, "SELECT failed\n"); return 69; }
        freeReplyObject(r);
    }

    redisReply *loaded = redisCommand(ctx, "SCRIPT LOAD %b", script, script_len);
    if (!loaded || loaded->type != REDIS_REPLY_STRING) {
        fprintf(stderr, "SCRIPT LOAD failed: %s\n", loaded && loaded->str ? loaded->str : ctx->errstr);
        return 69;
    }
    char sha[41];
    snprintf(sha, sizeof sha, "%s", loaded->str);
    freeReplyObject(loaded);
    free(script);

    struct command cmd;
    memset(&cmd, 0, sizeof cmd);
    if (command_init(&cmd, &o, sha) != 0) { fprintf(stderr, "out of memory\n"); return 70; }

    long long seq = 0;
    int status = 0;
    if (!o.serve) {
        status = measure(ctx, &cmd, &o, o.duration, o.max_calls, o.warmup, &seq);
    } else {
        /* One line per run on stdin, "run <duration_s> <max_calls> <warmup>", one JSON line
         * back; "quit" or EOF ends. The connection and the loaded script stay up between runs,
         * so a caller can interleave short runs with other contenders at no start-up cost. */
        char line[256];
        while (status == 0 && fgets(line, sizeof line, stdin)) {
            double duration;
            long long max_calls, warmup;
            if (!strncmp(line, "quit", 4)) break;
            if (sscanf(line, "run %lf %lld %lld", &duration, &max_calls, &warmup) != 3 ||
                duration <= 0 || max_calls < 1 || warmup < 0) {
                fprintf(stderr, "bad command: %s", line);
                status = 64;
                break;
            }
            status = measure(ctx, &cmd, &o, duration, max_calls, warmup, &seq);
        }
    }
    redisFree(ctx);
    return status;
}
