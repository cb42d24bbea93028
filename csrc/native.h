/*
 * native.h - the private header of genai_ratelimit._native (base.h, the ground floor,
 * is included from here).
 *
 * Layers: py_request.c prepares a decision (GIL held); proto.c is the protocol engine of one
 * connection, with no I/O in it (handshake steps, the request FIFO, NOSCRIPT reload, the
 * replay rule, reply classification); conn.c drives it over blocking sockets for the
 * Limiter (py_limiter.c), py_codec.c wraps it for the asyncio Protocol in aio.py. router.c is the
 * routing of a cluster or a Sentinel set, with no I/O in it either: cluster.c drives it
 * over conn.c's pools, py_routing.c wraps it for aio.py. Calls only go down a floor, never
 * up: cluster.c -> router.c, conn.c -> proto.c -> script.c -> base.c (errors, wipe, clocks),
 * and base.c calls no other room (tests/test_c_source_lint.py checks that the rooms'
 * calls form no circle).
 *
 * Two error conventions that never mix:
 *   - code that runs without the GIL (conn.c, the I/O half of script.c) returns an
 *     rl_status and fills an rl_error; it never touches a Python object;
 *   - code that holds the GIL (py_module.c, the argument half of script.c) raises Python
 *     exceptions, and turns an rl_error into one in exactly one place, rl_raise().
 *
 * Lock order: release the GIL, then take a pool mutex. No thread ever waits for a pool
 * mutex while holding the GIL, and no pool mutex is held across socket I/O.
 */
#ifndef GENAI_RATELIMIT_NATIVE_H
#define GENAI_RATELIMIT_NATIVE_H

/* The Limited API of CPython 3.10 (setup.py defines it): one abi3 wheel serves 3.10 and
   every later CPython. Nothing outside it may be used, and no build may leave it out. */
#if !defined(Py_LIMITED_API) || Py_LIMITED_API != 0x030A0000
#error "genai_ratelimit._native is built with Py_LIMITED_API=0x030A0000 (see setup.py)"
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stddef.h>
#include <sys/types.h>

#include <hiredis.h>
#include <openssl/ssl.h>

#include "base.h" /* errors, wipe, clocks: the floor every room stands on */

#define RL_MAX_WINDOWS 32                    /* windows decided by one check */
#define RL_CLUSTER_SLOTS 16384               /* hash slots of a Redis Cluster */
#define RL_MAX_BUDGETS 16                    /* calendar budgets decided by one hold */
#define RL_MAX_SCOPES 8                      /* scopes (besides the user's own) in one decision */
#define RL_MAX_SHARES_SPEC 8192              /* bytes of a reserved-shares spec */
#define RL_MAX_SCOPE_NAME 256                /* bytes of a scope's name, in UTF-8 */
#define RL_TENANT_LEN 64                     /* a wait queue's tenant: 1 to 64 hex digits */
#define RL_QUEUE_FIELDS 5                    /* lua/wait_queue.lua's numbers */
#define RL_MAX_QUEUE_WEIGHT 10000LL          /* a ticket's class weight: basis points */
#define RL_MAX_QUEUE_CLASS 64LL              /* a ticket's class index (lib/queue.lua) */
#define RL_MAX_QUEUE_WAIT_MS 300000LL        /* a ticket's wait: 5 minutes at most */
#define RL_MAX_QUEUE_LENGTH 100000LL         /* a wait queue's bound */
#define RL_UPSTREAM_FIELDS 8                 /* lua/observe_upstream.lua's numbers */
#define RL_MAX_UPSTREAM_MS 86400000LL        /* an upstream's reset or closure: a day at most */
#define RL_MEMBER_LEN 36                     /* canonical UUID text, without the NUL */
#define RL_MAX_REPLY_BYTES 65536             /* a decision's reply is tiny: more is garbage */
#define RL_MAX_LIMIT 9007199254740991LL      /* 2^53 - 1: exact in Lua's doubles */
#define RL_MAX_THRESHOLDS 999999999999999LL  /* a budget's soft limits packed: 5 percents */
#define RL_MAX_WINDOW_SECONDS 3153600000LL   /* 100 years of 365 days */
#define RL_MAX_TIMEOUT_SECONDS 86400.0       /* timeouts: one day at most (no overflow) */
#define RL_MAX_REPLICA_TIMEOUT_MS 86400000LL /* replica_timeout_ms: one day at most */
#define RL_MAX_REPLICAS 86400000             /* min_replicas: the options' one bound */
#define RL_MAX_CONNECTIONS 4096              /* max_connections of a limiter */

/* What the scripts of lua/ can answer: rl_script_decode holds every integer of a reply to
   these before it computes anything from it; outside them a reply is malformed. A count
   (remaining, held, used, removed) is 0 to RL_MAX_LIMIT (Lua's doubles hold no more
   exactly); a time (now, an expiry, an entry's) a unix ms from 1970 to the end of year 9999
   (as far as Python's datetime goes); a wait at most its window (for a lease: the longest
   lease) plus RL_MAX_CLOCK_SKEW_MS, since an entry may carry a time ahead of the deciding
   clock (clock="client" with app servers apart, or a server clock stepped back); a SCAN
   cursor an unsigned 64-bit number. */
#define RL_MAX_UNIX_MS 253402300799999LL /* 9999-12-31T23:59:59.999Z */
#define RL_MAX_CLOCK_SKEW_MS 86400000LL  /* one day */
#define RL_MAX_CURSOR_DIGITS 20          /* 18446744073709551615 */

/* ---------------------------------------------------------------- decisions */

typedef struct {
    int count;                       /* number of windows */
    long long limit[RL_MAX_WINDOWS]; /* shortest window first (requests before tokens) */
    long long seconds[RL_MAX_WINDOWS];
    long long cost[RL_MAX_WINDOWS];       /* what this decision costs in the window (>= 1) */
    unsigned char tokens[RL_MAX_WINDOWS]; /* 1: a token window (key suffix ":tokens") */
    unsigned char scope[RL_MAX_WINDOWS];  /* 0: the user's own; k: scopes[k - 1] */
} rl_windows;

/* A scope: windows that belong to someone else than the user's own budget. A user's
   scope (shared 0: a route's or a model's budget) keys under the user; a shared scope
   (an upstream's caps) keys under its name, the same for every user (see script.c). */
typedef struct {
    const char *name; /* UTF-8, borrowed from the caller's str: valid until rl_prepare ends */
    size_t name_len;
    int shared;
    int kind; /* metrics: RL_SCOPE_ROUTE, _MODEL, _UPSTREAM or _OTHER (rl_metrics_scope_kind) */
} rl_scope;

typedef struct {
    int allowed; /* 1 allow, 0 reject */
    long long remaining;
    long long retry_after_s;
    long long retry_after_ms; /* the same wait in ms, not rounded up (0 on allow) */
    int window;               /* 0-based index into rl_windows of the deciding window */
    long long now_ms;         /* the time the script decided at (the entry's score) */
    int evaluated; /* windows the script reached: all on allow, up to `window` on reject */
    long long remaining_of[RL_MAX_WINDOWS]; /* per window, the first `evaluated` */
    long long found;                        /* reconcile: windows found; reset: entries removed */
    long long expires_ms; /* leases: the lease's expiry (unix ms), 0 when none was granted */
    long long used_of[RL_MAX_WINDOWS];   /* peek: every window's used cost */
    long long oldest_of[RL_MAX_WINDOWS]; /* peek: its oldest entry's time (ms), or -1 */
    char cursor[24];                     /* reset: the SCAN cursor to go on from ("0": done) */
    long long tie;            /* compact storage: the tie of the entry logged (0 otherwise) */
    int slot;                 /* reserve with in_flight: 1 granted, 0 refused (window -1: no window
                      decided) or nothing held; -1 without in_flight. reconcile with release:
                      1 when the lease was still held */
    long long slot_held;      /* in_flight: the user's holders after the decision */
    long long share_rule;     /* reserve with shares: 0, or the share rule that refused it
                                 (lua/lib/shares.lua: 2j the reserve of class j, 2j + 1
                                 class j's ceiling) */
    long long slot_retry_ms;  /* in_flight refused: the hint (lua/lib/lease.lua), at most: */
    long long retry_bound_ms; /* a refused lease or slot: the wait until the soonest lease
                                 expires (0 otherwise) */
    int kind; /* budget hold: 0 allowed, 1 permanent, 2 until_reset, 3 in_flight; -1: the
                 periods sent do not hold the script's now (now_ms) */
    long long start_of[RL_MAX_BUDGETS]; /* budget hold: each budget's period start (ms) */
    long long end_of[RL_MAX_BUDGETS];   /* and end (ms); remaining_of: each one's remaining */
    int fired_before[RL_MAX_BUDGETS];   /* budget hold or settle: each budget's highest soft */
    int fired_after[RL_MAX_BUDGETS];    /* limit fired before and after it (0..100; differ:
                                         a crossing) */
} rl_result;

/* A calendar budget of a hold or a settle (genai_ratelimit/periods.py computes the numbers;
   lua/lib/budget.lua decides). Key: "{prefix}:{owner}:{period_start_ms}:budget={name}". */
typedef struct {
    const char *owner; /* UTF-8, borrowed from the caller's str: valid until rl_prepare ends */
    size_t owner_len;
    const char *name; /* the same */
    size_t name_len;
    long long limit;      /* the budget's limit (>= 1) */
    long long thresholds; /* its soft limits packed (percents, 3 digits each), 0: none */
    long long amount;     /* hold: the amount to hold; settle: the actual usage (>= 0) */
    long long bounds[4];  /* hold: previous period's start, start, end, next period's end;
                             settle: bounds[0], the admitting period's start */
} rl_budget;

/* What a decision is, and how its result becomes Python (rl_result_object). */
typedef enum {
    RL_SHAPE_CHECK,     /* check(): (allowed, remaining, retry_after_s) */
    RL_SHAPE_WINDOWS,   /* check_windows(): the same and window_seconds */
    RL_SHAPE_DETAILED,  /* check_windows_detailed(): a WindowDecision */
    RL_SHAPE_RESERVE,   /* reserve(): the same, the member, the time, every window's remaining */
    RL_SHAPE_RECONCILE, /* reconcile(): the number of windows whose entry was found */
    RL_SHAPE_PEEK,      /* _peek(): what a reserve would answer, every window's use; no write */
    RL_SHAPE_RESET,     /* _reset(): (entries removed, next SCAN cursor) */
    RL_SHAPE_ACQUIRE,   /* acquire(): (allowed, held, retry_after_s, retry_after_ms, lease id,
                           expires_at_ms, now_ms, retry_bound_ms) */
    RL_SHAPE_RELEASE,   /* release(): whether the lease was still held */
    RL_SHAPE_RENEW,     /* renew(): (renewed, expires_at_ms) */
    RL_SHAPE_GCRA,      /* _check_rate(): (allowed, remaining, retry_after_s, retry_after_ms,
                           now_ms), one GCRA decision (lua/gcra.lua) */
    /* _hold_budgets(): (allowed, refused index, kind, now_ms, hold id, ((remaining, period
       start, period end) per budget)); kind -1: the periods sent do not hold the script's
       now (now_ms), nothing was decided */
    RL_SHAPE_BUDGET_HOLD,
    /* _settle_budgets(): the number of budgets whose hold was found */
    RL_SHAPE_BUDGET_SETTLE,
    /* _observe_upstream(): the upstream's closed-until (unix ms, 0: open),
       lua/observe_upstream.lua */
    RL_SHAPE_OBSERVE,
    /* _wait_queue(): a ticket's rank, -1/-2 queue full, or 1/0 left, lua/wait_queue.lua */
    RL_SHAPE_QUEUE,
} rl_shape;

/* The scripts of lua/, embedded at build time. py_request.c names a decision's script in the
   sorted-set storage; rl_prepare swaps in the same operation built over the compact storage
   (rl_script_of): one file of lua/ per operation, built once per storage by setup.py. */
typedef enum {
    RL_SCRIPT_WINDOW,            /* lua/sliding_window.lua: check, check_windows, reserve */
    RL_SCRIPT_RECONCILE,         /* lua/reconcile.lua */
    RL_SCRIPT_PEEK,              /* lua/peek.lua: read-only */
    RL_SCRIPT_RESET,             /* lua/reset.lua: either storage's windows */
    RL_SCRIPT_LEASE,             /* lua/lease.lua: acquire, release, renew */
    RL_SCRIPT_COMPACT_WINDOW,    /* lua/sliding_window.lua over the compact storage */
    RL_SCRIPT_COMPACT_RECONCILE, /* lua/reconcile.lua over the compact storage */
    RL_SCRIPT_COMPACT_PEEK,      /* lua/peek.lua over the compact storage: read-only */
    RL_SCRIPT_IN_FLIGHT,         /* lua/reserve_in_flight.lua: reserve with an in-flight slot */
    RL_SCRIPT_RECONCILE_RELEASE, /* lua/reconcile_release.lua: reconcile and release */
    RL_SCRIPT_COMPACT_IN_FLIGHT, /* lua/reserve_in_flight.lua over the compact storage */
    RL_SCRIPT_COMPACT_RECONCILE_RELEASE, /* lua/reconcile_release.lua over the compact one */
    RL_SCRIPT_GCRA,                      /* lua/gcra.lua: check_rate, either storage */
    RL_SCRIPT_GCRA_WINDOWS,              /* lua/gcra_windows.lua: check_windows_detailed(gcra=) */
    RL_SCRIPT_COMPACT_GCRA_WINDOWS,      /* lua/gcra_windows.lua over the compact storage */
    RL_SCRIPT_BUDGET_HOLD,               /* lua/budget_hold.lua: calendar budgets, a hold */
    RL_SCRIPT_BUDGET_SETTLE,             /* lua/budget_settle.lua: a hold settled */
    RL_SCRIPT_OBSERVE,                   /* lua/observe_upstream.lua: a provider's word */
    RL_SCRIPT_QUEUE,                     /* lua/wait_queue.lua: a wait queue's ticket */
    RL_SCRIPT_COUNT,
} rl_script_id;

/* Where a limiter keeps its windows: sorted sets (the default, the contract's key shape)
   or one string per window (lua/lib/compact_log.lua). */
typedef enum {
    RL_STORAGE_ZSET,
    RL_STORAGE_COMPACT,
} rl_storage;

/* The script that runs `script` (a sorted-set storage's id) in `storage`. */
rl_script_id rl_script_of(rl_script_id script, rl_storage storage);
/* 1 for a decision that logs a request (check, check_windows, reserve), either storage. */
int rl_script_decides(rl_script_id script);
/* 1 for a decision over a GCRA bucket and windows (lua/gcra_windows.lua), either storage. */
int rl_script_gcra_windows(rl_script_id script);
/* 1 for a peek (read-only), either storage. */
int rl_script_peeks(rl_script_id script);
/* 1 for a reconcile, either storage, with or without a release. */
int rl_script_reconciles(rl_script_id script);
/* 1 for a script that also takes or gives back an in-flight slot (its last key: leases). */
int rl_script_holds_slot(rl_script_id script);
#define RL_MAX_TIE 65535 /* compact storage: an entry's tie is 2 bytes */

/* One decision, prepared with the GIL held (py_request.c), then sent by either driver. */
typedef struct {
    rl_shape shape;
    rl_script_id script;
    rl_windows windows; /* validated, shortest first */
    int nscopes;        /* entries of scopes[] (names cleared by rl_prepare) */
    rl_scope scopes[RL_MAX_SCOPES];
    char member[RL_MEMBER_LEN + 1]; /* the entry: made here, or reconcile's argument */
    long long score_ms;             /* reconcile: the entry's time */
    long long new_cost;             /* reconcile: the entry's cost from now on (>= 0) */
    long long tie;                  /* reconcile, compact storage: the entry's tie */
    rl_storage storage;             /* set before rl_prepare, like hash_tag */
    int scan;                       /* reset: every window of the user, found by SCAN */
    char cursor[24];                /* reset with scan: the SCAN cursor to start from */
    long long lease_limit; /* acquire, reserve with in_flight: the most concurrent holders */
    long long lease_ms;    /* acquire, renew, reserve with in_flight: the lease's length */
    long long gcra_units;  /* GCRA: the emission interval T in units of 1/gcra_scale ms */
    long long gcra_scale;  /* GCRA: rate / gcd(rate, period_ms); windows: burst, period, cost
                              (check_rate: the only window; with gcra=: window 0, the
                              bucket, before the logged windows) */
    int disabled;          /* the kill switch answered: result is final, no I/O */
    rl_result result;      /* the kill switch's answer when disabled */
    char *command;         /* formatted EVALSHA (redisFreeCommand), NULL when disabled */
    long long command_len;
    char *replay; /* the command with the replay marker (malloc), once replayed */
    size_t replay_len;
    double deadline; /* monotonic, fixed when first sent (0 before); replays keep it */
    int hash_tag;    /* cluster: keys carry the user id in a hash tag (set before rl_prepare) */
    int slot;        /* cluster: the keys' hash slot, set by rl_script_format (-1 otherwise) */
    int reloaded;    /* the engine sent it again after NOSCRIPT (proto.c): a WAIT sent right
                        after its first form ran before it */
    /* budget hold and settle: the budgets (owners and names cleared by rl_prepare) */
    int nbudgets;
    rl_budget budgets[RL_MAX_BUDGETS];
    /* budget hold: a key outlives its period's end by this (the longest hold) */
    long long hold_ms;
    /* reserve: a shared scope's reserved shares (lua/lib/shares.lua's spec, built by
       genai_ratelimit/shares.py), UTF-8 borrowed from the caller's str and cleared by
       rl_prepare like the scope names (shares_len stays: the reply's last element is the
       rule that refused, script.c); NULL and 0 without */
    const char *shares;
    size_t shares_len;
    /* reserve: the probes of the shared scopes that follow their provider (lib/upstream.lua's
       spec "P p t ...", built by genai_ratelimit/reservation.py), borrowed and cleared like
       shares; NULL and 0 without */
    const char *probe;
    size_t probe_len;
    /* observe_upstream: requests left, ms to their reset, their limit, the same for tokens,
       ms closed for (-1: not said), the bound in ms (lua/observe_upstream.lua) */
    long long upstream[RL_UPSTREAM_FIELDS];
    /* _wait_queue: the ticket's wait in ms (0: leave), the queue's and the tenant's bound,
       its class's weight in basis points (0: no shares) and index; the tenant (hex digits) */
    long long queue[RL_QUEUE_FIELDS];
    char tenant[RL_TENANT_LEN + 1];
    int member_given; /* reserve(ticket=...), acquire(ticket=...): the member is the wait
                         queue's ticket */
    int queue_leases; /* _wait_queue(leases=True): the queue of an in-flight cap's leases
                         ("{name}:leases:queue"), not of a shared scope's windows */
} rl_prepared;

/* The bytes to send for a decision: its replay form once it was marked for replay. */
const char *rl_prepared_bytes(const rl_prepared *p, size_t *len);

/* ------------------------------------------------- protocol engine (proto.c) */

/* What a queued request is. The handshake steps come first on a new connection. */
typedef enum {
    RL_STEP_AUTH,        /* AUTH [user] password */
    RL_STEP_SELECT,      /* SELECT db */
    RL_STEP_PING,        /* reads a TLS 1.3 server's session tickets */
    RL_STEP_INFO,        /* INFO memory: may Redis evict our keys? Not waited for */
    RL_STEP_SCRIPT_LOAD, /* queued by the engine after NOSCRIPT */
    RL_STEP_DECISION,    /* a rate-limit decision (EVALSHA) */
    RL_STEP_COMMAND,     /* any other command: the raw reply goes to the caller */
    RL_STEP_WAIT,        /* min_replicas: WAIT after an admission, judged by the engine */
} rl_step;

typedef struct {
    rl_step step;
    int reloaded;          /* decisions: NOSCRIPT was answered once already */
    rl_script_id script;   /* SCRIPT LOAD: the script being loaded */
    int last;              /* handshake: the step whose success completes it */
    int large;             /* a CLUSTER command: its reply may list every slot */
    int replicas;          /* WAIT: the replicas that must acknowledge (min_replicas) */
    long long wait_ms;     /* WAIT: its timeout (replica_timeout_ms) */
    double deadline;       /* monotonic seconds by which the reply is due */
    double sent;           /* decisions, commands: monotonic seconds when queued (metrics
                              on), else 0 */
    int op;                /* metrics: the RL_OP_* whose latency the round trip counts in */
    void *token;           /* the driver's handle on the waiter; never dereferenced */
    void *holder;          /* the driver's owner of `decision`; never dereferenced */
    rl_prepared *decision; /* decisions: borrowed, kept alive by the driver */
} rl_entry;

/* One completed request, handed to the driver by rl_proto_next. */
typedef struct {
    rl_entry entry;    /* the request (token, holder, decision) */
    rl_status status;  /* RL_OK, or what went wrong for this request */
    rl_error error;    /* when status != RL_OK */
    rl_result result;  /* decisions answered RL_OK */
    redisReply *reply; /* commands answered RL_OK: owned by the receiver */
    int fatal;         /* the connection is out of step: drop it after this */
} rl_event;

typedef struct {
    const char *username; /* ACL user, or NULL */
    const char *password; /* AUTH password, or NULL */
    long long db;         /* SELECT when not 0 */
    int ping;             /* PING when nothing else is sent (TLS) */
} rl_handshake;

/* ---------------------------------------------------------------- metrics */

#define RL_LATENCY_BUCKETS 16 /* finite upper bounds; one more bucket counts the rest */
#define RL_REJECT_SLOTS 32    /* distinct rejecting windows counted apart; more share "other" */

/* What a round trip was for: the `op` label of the latency histogram. The scripts' ops
   first (a decision's shape, rl_metrics_op), then the plain commands. */
typedef enum {
    RL_OP_CHECK,
    RL_OP_CHECK_WINDOWS,
    RL_OP_CHECK_WINDOWS_DETAILED,
    RL_OP_RESERVE,
    RL_OP_RECONCILE,
    RL_OP_PEEK,
    RL_OP_RESET,
    RL_OP_ACQUIRE,
    RL_OP_RELEASE,
    RL_OP_RENEW,
    RL_OP_PING,    /* PING sent as a command: the first op that runs no script */
    RL_OP_COMMAND, /* any other command: SCAN, CLUSTER SHARDS, ASKING, ... */
    RL_OP_COUNT,
} rl_op;

/* Whose window refused: the `scope` label. A scope's kind is read from its name once, when
   the decision is prepared (names are not kept). */
typedef enum {
    RL_SCOPE_USER,     /* the user's own windows */
    RL_SCOPE_ROUTE,    /* a scope of the user named "route:..." */
    RL_SCOPE_MODEL,    /* a scope of the user named "model:..." */
    RL_SCOPE_UPSTREAM, /* a shared scope (an upstream's caps) */
    RL_SCOPE_OTHER,    /* a scope of the user with any other name */
    RL_SCOPE_KINDS,
} rl_scope_kind;

typedef struct {
    unsigned long long count[RL_LATENCY_BUCKETS + 1]; /* round trips per bucket (not cumulative) */
    unsigned long long sum_ns;                        /* their sum, nanoseconds */
} rl_latency;

/* Counters of one limiter, updated with relaxed atomics from any thread (the blocking
   driver updates them without the GIL) and read with the GIL held (py_metrics.c). */
typedef struct {
    unsigned long long allowed;           /* decisions allowed */
    unsigned long long unavailable;       /* decisions that raised (Redis unreachable, ...) */
    unsigned long long fail_open;         /* the FastAPI layer let a request through */
    unsigned long long shadow;            /* the FastAPI layer let a rejected one through */
    unsigned long long replays;           /* decisions sent again after a broken connection */
    unsigned long long connection_errors; /* connections that failed to open or broke */
    unsigned long long reserved_tokens;   /* token estimates of admitted reservations */
    unsigned long long charged_tokens;    /* tokens reconcile set as used */
    unsigned long long refunded_tokens;   /* estimate - used, when reconcile lowered it */
    unsigned long long leases_acquired;   /* acquire answered: a slot was taken */
    unsigned long long leases_refused;    /* acquire answered: every slot was held */
    unsigned long long leases_released;   /* release answered: the lease was still held */
    unsigned long long releases_not_held; /* release answered: it had expired or gone */
    /* Rejections by window: slot i counts the window whose key is reject_window[i], that
       is ((seconds * 2 + is_token) * RL_SCOPE_KINDS + scope kind) + 1; 0: slot free. */
    long long reject_window[RL_REJECT_SLOTS];
    unsigned long long rejected[RL_REJECT_SLOTS];
    unsigned long long rejected_other[2][RL_SCOPE_KINDS]; /* beyond the slots: [is_token][scope] */
    rl_latency latency[RL_OP_COUNT];                      /* round trips by op */
} rl_metrics;

/* No GIL needed: relaxed atomic increments. */
void rl_metrics_count(unsigned long long *counter);
/* An answered script: a decision allowed or rejected (and by which window), a lease taken
   or refused, released or not held. Other scripts count nothing here. */
void rl_metrics_decision(rl_metrics *m, const rl_prepared *d, const rl_result *r);
/* A round trip of `op` (RL_OP_*) that took `seconds`. */
void rl_metrics_latency(rl_metrics *m, int op, double seconds);
/* The op of a decision's round trip, and of a command's (argv[0]). */
int rl_metrics_op(rl_shape shape);
int rl_metrics_command_op(const char *name, size_t len);
/* The scope label of a scope (rl_scope_kind). */
int rl_metrics_scope_kind(const char *name, size_t len, int shared);
/* GIL held: the counters as a dict (see genai_ratelimit/metrics.py, LimiterMetrics). New
   reference. */
PyObject *rl_metrics_object(rl_metrics *m, int enabled);
/* GIL held: the _record_outcome(kind, count=1) method: adds count to the counter named by
   kind ("fail_open", "shadow", "unavailable", "connection_error", "reserved_tokens",
   "charged_tokens", "refunded_tokens") in m (NULL: metrics off, the arguments are only
   checked). Returns None (a new reference), or NULL with TypeError or ValueError. */
PyObject *rl_metrics_record(rl_metrics *m, PyObject *const *args, Py_ssize_t nargs);

typedef struct {
    const redisReplyObjectFunctions *defaults; /* hiredis's own reply functions */
    size_t max_elements;                       /* the longest array accepted now */
} rl_reader_limits;

typedef struct {
    redisReader *reader;     /* RESP parser, refusing arrays longer than limits allow */
    rl_reader_limits limits; /* the reader's privdata: its bounds for the reply due */
    rl_entry *ring;          /* FIFO of replies due, in send order */
    size_t capacity, head, count;
    size_t unsent; /* trailing entries whose bytes are still in `out` */
    char *out;     /* bytes queued: out[out_start, out_len) are still to be written */
    size_t out_start, out_len, out_capacity;
    size_t out_touched;  /* bytes of out ever written (what rl_check_wiped looks at) */
    int sensitive;       /* out holds a password: wiped once all written, or dropped */
    int fail_allocation; /* debug builds: the n-th allocation from now fails (0: none) */
    int failed;          /* a fatal error was reported: the connection is done */
    long long db;        /* the database the handshake selects, for messages */
    int load_failed;     /* the last SCRIPT LOAD was refused: load_error says why */
    rl_error load_error;
    int info_answered;        /* INFO memory was answered (or refused) */
    char eviction_policy[40]; /* the maxmemory-policy that may evict our keys, or "" */
    long long maxmemory;      /* bytes, from INFO memory */
    rl_metrics *metrics;      /* the limiter's counters, or NULL (metrics off) */
} rl_proto;

/* No GIL needed for any of these: they touch no Python object and do no I/O. */
int rl_proto_init(rl_proto *p);   /* 0, or -1: no memory */
void rl_proto_clear(rl_proto *p); /* frees all; tokens and holders are the driver's */
/* Queues the handshake steps (one write). Returns how many must be answered before the
   connection is used (0: it is ready at once), or -1 with err (no memory). INFO memory is
   queued too but never waited for: its reply, read before the first decision's, tells
   whether Redis may evict the limiter's keys (eviction_policy). The last step carries token:
   its event completes the handshake. An earlier step that fails gives a fatal event
   without a token (the driver then fails what is left, the last step too). */
int rl_proto_handshake(rl_proto *p, const rl_handshake *h, double deadline, void *token,
                       rl_error *err);
/* Queues a decision, or a command (argv words). On failure nothing is queued. */
rl_status rl_proto_push_decision(rl_proto *p, rl_prepared *d, double deadline, void *token,
                                 void *holder, rl_error *err);
rl_status rl_proto_push_command(rl_proto *p, int argc, const char **argv, const size_t *argvlen,
                                double deadline, void *token, rl_error *err);
/* A command whose entry also carries holder (the asyncio router's RouteRead: its reply is
   handed to the read that asked it). */
rl_status rl_proto_push_held_command(rl_proto *p, int argc, const char **argv,
                                     const size_t *argvlen, double deadline, void *token,
                                     void *holder, rl_error *err);
/* min_replicas, the one rule of both drivers: queues WAIT replicas timeout_ms behind the
   admission it covers (same write: WAIT covers every earlier write of the connection). Its
   reply is due by deadline plus WAIT's own time. Its event (RL_STEP_WAIT) is judged by the
   engine: RL_OK when at least `replicas` acknowledged, else RL_ERR_SERVER "not replicated:
   N of the M replicas ..." (an error reply keeps its kind, AUTH or SERVER). On failure
   nothing is queued. */
rl_status rl_proto_push_wait(rl_proto *p, int replicas, long long timeout_ms, double deadline,
                             void *token, rl_error *err);
/* A WAIT whose reply never came: a connection that broke (RL_ERR_IO) or fell out of step
   (RL_ERR_PROTOCOL) leaves the admission unconfirmed: RL_ERR_SERVER "not replicated: the
   connection broke waiting for the replicas (...)" (err rewritten). Any other cause (a
   timeout, a closed limiter, no memory) is returned as it is. The decision ran: it is
   never resent, not elsewhere either. */
rl_status rl_proto_wait_failed(rl_status cause, rl_error *err);
/* The bytes to write now, and how many of them were written. */
const char *rl_proto_output(const rl_proto *p, size_t *len);
void rl_proto_consume(rl_proto *p, size_t written);
/* Bytes read from the connection. RL_OK, or a fatal error. */
rl_status rl_proto_feed(rl_proto *p, const char *data, size_t len, rl_error *err);
/* The next completed request: 1 with *ev filled, 0 when more bytes are needed, -1 when the
   connection is out of step (err filled; the requests still queued are left for
   rl_proto_pop). */
int rl_proto_next(rl_proto *p, rl_event *ev, rl_error *err);
/* Takes the oldest queued request (1), or 0 when none is left: for a broken connection. */
int rl_proto_pop(rl_proto *p, rl_entry *out);
size_t rl_proto_pending(const rl_proto *p);
const rl_entry *rl_proto_entry(const rl_proto *p, size_t i); /* 0 = oldest */
double rl_proto_oldest_deadline(const rl_proto *p);          /* -1 when none pending */
/* 1 when an idle connection must not be reused: bytes nobody asked for are buffered or
   waiting on fd (a stray reply, a server's EOF). fd < 0 skips the poll. */
int rl_proto_idle_is_stale(const rl_proto *p, int fd);
/* The warning to log once when INFO said that Redis may evict our keys, else "". */
void rl_proto_eviction_warning(const rl_proto *p, char *buf, size_t size);
#define RL_WARNING_LEN 360
/* The replay rule, the same for both drivers: after the connection broke (cause
   RL_ERR_IO) a decision is sent once more, marked, on another connection; nothing else
   is replayed. Returns 1 when d was switched to its replay form, 0 when it must fail,
   -1 when out of memory. */
int rl_proto_replay(rl_status cause, rl_prepared *d);

/* ------------------------------------------------------------- connections */

typedef struct {
    char *host;                   /* TCP host, or NULL for a unix socket */
    int port;                     /* TCP port */
    char *unix_path;              /* unix socket path, or NULL */
    long long db;                 /* SELECT db when not 0 */
    char *username;               /* ACL user, or NULL */
    char *password;               /* AUTH password, or NULL; never printed */
    double connect_timeout;       /* seconds, for connect + AUTH + SELECT */
    double socket_timeout;        /* seconds, for one decision's round trip */
    int tls;                      /* rediss://: TLS on the TCP connection */
    int tls_verify;               /* verify the server's certificate and name */
    SSL_CTX *ssl_ctx;             /* shared by every connection of the pool, or NULL */
    int min_replicas;             /* an admission waits (WAIT) for this many replicas; 0: never */
    long long replica_timeout_ms; /* WAIT's timeout */
} rl_config;

typedef struct rl_conn {
    int fd;               /* blocking socket with SO_RCVTIMEO/SO_SNDTIMEO set */
    SSL *ssl;             /* TLS session on fd, or NULL for plain TCP/unix */
    rl_proto proto;       /* the protocol state of this connection */
    double armed_timeout; /* SO_SNDTIMEO/SO_RCVTIMEO now set (seconds), 0 unknown */
    struct rl_conn *next; /* next idle connection in the pool */
} rl_conn;

typedef struct {
    pthread_mutex_t mutex;        /* guards every field below but config */
    pthread_cond_t available;     /* signalled when a connection is returned */
    rl_conn *idle;                /* stack of idle connections */
    int open;                     /* connections that exist (idle or in use) */
    int max_open;                 /* bound on open */
    int closed;                   /* set by close(): no new connections */
    int initialized;              /* mutex and cond are initialised */
    int warning_state;            /* eviction warning: 0 none yet, 1 to log, 2 logged */
    char warning[RL_WARNING_LEN]; /* its text, once warning_state is 1 */
    rl_config config;             /* immutable after init */
    rl_metrics *metrics;          /* the limiter's counters, or NULL; set before any call */
} rl_pool;

int rl_config_init(rl_config *cfg, const char *host, int port, const char *unix_path, long long db,
                   const char *username, const char *password, double connect_timeout,
                   double socket_timeout); /* 0 or -1 (ENOMEM) */
void rl_config_clear(rl_config *cfg);
/* Sets up TLS for the config: a client SSL_CTX that trusts the CA file when one is given,
   else the system's default CAs (the policy both limiters follow), an optional client
   certificate and key, and verification unless verify is 0. Returns RL_OK, or an error
   naming the file or the problem. */
rl_status rl_config_tls(rl_config *cfg, int verify, const char *ca_file, const char *cert_file,
                        const char *key_file, rl_error *err);

/* Pool; all of these run without the GIL, except rl_pool_init/rl_pool_after_fork. */
int rl_pool_init(rl_pool *pool, int max_open); /* 0, or -1 with errno */
void rl_pool_destroy(rl_pool *pool);
void rl_pool_close(rl_pool *pool);
void rl_pool_after_fork(rl_pool *pool);
/* A connection, waiting for a busy pool no longer than deadline. *connecting: the seconds
   spent opening a new one (bounded by connect_timeout), 0 when none was opened. */
rl_status rl_pool_acquire(rl_pool *pool, rl_conn **out, double deadline, double *connecting,
                          rl_error *err);
void rl_pool_release(rl_pool *pool, rl_conn *conn, int reusable);
/* Closes every idle connection: after one broke, its siblings likely did too. */
void rl_pool_drop_idle(rl_pool *pool);
int rl_pool_open_count(rl_pool *pool);
int rl_pool_is_closed(rl_pool *pool);
/* Copies the eviction warning into buf (RL_WARNING_LEN) the first time one is due: 1, else
   0. Cheap when none is due (one atomic load). */
int rl_pool_take_warning(rl_pool *pool, char *buf);

/* A hiredis reader that refuses arrays longer than limits->max_elements (set to a
   decision's bound here; the engine raises it for a CLUSTER command's reply). limits must
   outlive the reader. NULL: no memory. */
redisReader *rl_reader_create(rl_reader_limits *limits);
const char *rl_reader_error(const redisReader *reader); /* the reader's error, for people */

/* A subscriber connection's reader (proto.c, no I/O): the pushes of pub/sub. */
typedef struct {
    redisReader *reader;     /* RESP parser, bounded like the engine's */
    rl_reader_limits limits; /* the reader's privdata */
    int failed;              /* garbage or an error reply came: the connection is done */
} rl_push_reader;

typedef enum {
    RL_PUSH_MESSAGE,     /* "message": channel and payload */
    RL_PUSH_SUBSCRIBE,   /* SUBSCRIBE's confirmation: channel */
    RL_PUSH_UNSUBSCRIBE, /* UNSUBSCRIBE's confirmation: channel */
    RL_PUSH_STATUS,      /* a status reply (the handshake's +OK, PONG): payload */
} rl_push_kind;

typedef struct {
    rl_push_kind kind;   /* what came */
    const char *channel; /* borrowed from reply */
    size_t channel_len;
    const char *payload; /* borrowed from reply */
    size_t payload_len;
    void *reply; /* the hiredis reply that owns the texts: rl_push_done frees it */
} rl_push;

int rl_push_reader_init(rl_push_reader *r); /* 0, or -1: no memory */
void rl_push_reader_clear(rl_push_reader *r);
/* Hands the reader the bytes read (copied). */
rl_status rl_push_feed(rl_push_reader *r, const char *data, size_t len, rl_error *err);
/* The next push: 1 (out filled: rl_push_done it), 0 (none complete yet), -1 (err filled:
   garbage, an error reply or a reply that is no push; the connection is done). */
int rl_push_next(rl_push_reader *r, rl_push *out, rl_error *err);
void rl_push_done(rl_push *p);
/* A command's RESP bytes (*out: free with rl_push_format_free). Its length, or -1. */
long long rl_push_format(int argc, const char **argv, const size_t *argvlen, char **out);
void rl_push_format_free(char *command);

/* One blocking decision on a pool, resumable after a signal: rl_call_run returns
   RL_ERR_INTERRUPTED when a signal interrupted the I/O; the caller (GIL held) runs the
   signal handlers and either calls rl_call_run again (the deadline still holds) or
   rl_call_abandon. Any other status is final; the connection is back in the pool. */
typedef struct {
    rl_pool *pool;
    rl_prepared *decision;
    rl_conn *conn;    /* checked out while the call is under way, or NULL */
    double deadline;  /* of the exchange on conn */
    rl_result result; /* the answer, when rl_call_run returned RL_OK */
    int asking;       /* cluster ASK: send ASKING before the decision */
    int waiting;      /* min_replicas: a WAIT went out in the same write, its reply is due */
    char wait_token;  /* its address tells the WAIT's reply apart */
} rl_call;

void rl_call_init(rl_call *call, rl_pool *pool, rl_prepared *decision);
rl_status rl_call_run(rl_call *call, rl_error *err);
void rl_call_abandon(rl_call *call);
/* One command on a pooled connection, for the cluster's and sentinels' own questions.
   *reply (RL_OK only) is the caller's to free; an error reply is RL_ERR_SERVER. */
rl_status rl_pool_command(rl_pool *pool, int argc, const char **argv, const size_t *argvlen,
                          double deadline, redisReply **reply, rl_error *err);

/* ----------------------------------------------------------- router.c */

#define RL_CLUSTER_MAX_NODES 128

typedef struct {
    char host[256]; /* a name or an address, never longer than DNS allows */
    int port;
} rl_address;

/* What a read asks, and whom. */
typedef enum {
    RL_ASK_SHARDS,          /* CLUSTER SHARDS, to a node (Redis 7) */
    RL_ASK_SLOTS,           /* CLUSTER SLOTS, to a node that does not know SHARDS */
    RL_ASK_SENTINEL_MASTER, /* SENTINEL MASTER <name>, to a sentinel */
    RL_ASK_ROLE,            /* ROLE, to the node the sentinels named */
} rl_ask;

typedef struct {
    rl_ask ask;
    int sentinel; /* 1: target indexes the sentinels, 0: the nodes */
    int target;   /* whom to ask */
    int argc;     /* the command, borrowed from the read and the router */
    const char *argv[3];
    size_t argvlen[3];
    double deadline; /* monotonic: its share of the read's deadline */
} rl_question;

/* The routing of a Redis Cluster or a Sentinel set, with no I/O in it: the nodes met (seeds
   first, never removed), which serves each hash slot or which is the master, the sentinels
   and what they said, and the policy that turns each answer or failure into an action.
   Both limiters drive it: cluster.c with blocking sockets, aio.py through _native.Router.
   Thread-safe: every rl_router_* / rl_route_* / rl_read_* call takes the mutex itself and
   never holds it on return; it runs with or without the GIL. */
typedef struct {
    pthread_mutex_t mutex;                  /* guards every field but the constants */
    int initialized;                        /* the mutex exists */
    int tls;                                /* constant: read the masters' tls-port */
    double socket_timeout;                  /* constant: how long a timed-out call took */
    char *master_name;                      /* constant: the sentinels' name, or NULL */
    rl_address nodes[RL_CLUSTER_MAX_NODES]; /* every node met; the index is the node */
    int node_count;
    rl_address sentinels[RL_CLUSTER_MAX_NODES]; /* constant after the seeds */
    int sentinel_count;
    short slots[RL_CLUSTER_SLOTS]; /* each slot's master (a node), -1 unknown */
    int master;                    /* Sentinel: the master (a node), -1 before asked */
    unsigned long reads;           /* maps read (answers taken) so far */
    double reading_since;          /* the one read under way began (single flight), or 0 */
    double read_at;                /* the last read ended (monotonic), 0 never */
    int moved_since_read;          /* MOVED answers since the last read */
    double stale_until;            /* a call timed out: the map is read again until then */
    double stale_read_at;          /* when a stale map was last read again */
    double asked_at;               /* Sentinel: when the sentinels were last asked, 0 never */
    int last_sentinel;             /* Sentinel: the one that answered last, asked first */
    double suspect_until[RL_CLUSTER_MAX_NODES]; /* Sentinel: one that timed out, asked last */
    double failover_since; /* Sentinel: a sentinel reports a failover under way since, or 0 */
} rl_router;

/* GIL held (set-up): 0, or -1 with errno. */
int rl_router_init(rl_router *r, const char *master_name, int tls, double socket_timeout);
/* A seed: a node (cluster), or a sentinel (Sentinel mode). 0, or -1 when full. */
int rl_router_add_seed(rl_router *r, const char *host, int port);
void rl_router_after_fork(rl_router *r); /* in the child: no read is under way there */
void rl_router_destroy(rl_router *r);
/* The address of a node or a sentinel (copied: nodes are never removed). 0, or -1. */
int rl_router_address(rl_router *r, int sentinel, int index, rl_address *out);
/* Where a decision of slot goes now: a node, or -1 (not known yet). */
int rl_router_destination(rl_router *r, int slot);
/* The masters that serve slots (or the Sentinel master), each once: how many, in out. */
int rl_router_masters(rl_router *r, int *out, int room);

/* One call, routed: what its driver does next. */
typedef enum {
    RL_ROUTE_SEND, /* send it to node (with ASKING first when asking) */
    RL_ROUTE_READ, /* read the map or ask the sentinels (rl_read_*), by read_deadline; this
                      call holds the single flight until rl_read_end */
    RL_ROUTE_WAIT, /* sleep `seconds` (a failover or a migration needs time) */
    RL_ROUTE_FAIL, /* give up with `status` (err filled when it is a new error) */
} rl_route_action;

typedef struct {
    int slot;              /* the decision's hash slot */
    double deadline;       /* of the whole call; the driver extends it by connecting time */
    int moved;             /* MOVED answers so far */
    int ask;               /* ASK: the next try goes to this node with ASKING, or -1 */
    int want_pause;        /* a failure asks for a pause before the next try */
    int want_read;         /* ... and a read of the map */
    int patch_slot;        /* MOVED: point this slot at patch_node once the read is done */
    int patch_node;        /* -1: nothing to patch */
    int read_once;         /* the map was read for an unknown slot */
    rl_status last_status; /* the last failure's kind */
    char busy[128];        /* the cluster's last TRYAGAIN / CLUSTERDOWN text, or "" */
    rl_status read_status; /* the last read this call made (rl_read_end), RL_OK if none */
    rl_error read_error;   /* ... its error */
    /* The action's arguments (out of rl_route_next) */
    int node;
    int asking;
    double seconds;
    double read_deadline;
    rl_status status;
    int own_error; /* rl_route_failed gave up with an error of its own, written into err */
} rl_route;

void rl_route_begin(rl_route *rt, int slot, double deadline);
rl_route_action rl_route_next(rl_router *r, rl_route *rt, rl_error *err);
/* The try on rt->node failed with st (err: its error; a server's text for a redirect).
   1: go on (rl_route_next); 0: give up with rt->status (err rewritten, and rt->own_error
   set, when the router's own error says more). */
int rl_route_failed(rl_router *r, rl_route *rt, rl_status st, rl_error *err);

/* A read of the map or of the sentinels: the questions one after another, each answer
   taken by the router. rl_read_step returns 1 with the next question in rd->q, or 0 when
   the read is over (rd->status, rd->error); rl_read_end releases the single flight. */
typedef struct {
    int node;        /* the node the sentinel named */
    long long epoch; /* its config epoch */
} rl_sentinel_view;

typedef struct {
    int sentinels; /* asking the sentinels (else the nodes for the map) */
    int order[RL_CLUSTER_MAX_NODES];
    int count, next, suspects;
    double deadline;
    int started;
    rl_question q; /* the question under way */
    short *map;    /* cluster: the map being read (malloc'd) */
    rl_sentinel_view views[RL_CLUSTER_MAX_NODES];
    int answered, in_failover, chosen;
    int replaced; /* out: the old master after a switch (close its connections), or -1 */
    rl_status status;
    rl_error error;
} rl_read;

void rl_read_begin(rl_router *r, rl_read *rd, double deadline);
/* The answer to rd->q: st, reply when st is RL_OK (borrowed), err when it is not. The first
   call passes RL_OK and NULL. */
int rl_read_step(rl_router *r, rl_read *rd, rl_status st, const redisReply *reply,
                 const rl_error *err);
/* rt: the call the read was for (it keeps the read's error), or NULL. */
void rl_read_end(rl_router *r, rl_read *rd, rl_route *rt);

/* ---------------------------------------------------------- cluster.c */

typedef struct {
    rl_pool pool; /* connections to this node; pool.config names it */
} rl_node;

/* A Redis Cluster or a Sentinel set for the blocking limiter: the router, and a pool per
   node (made when first needed) and per sentinel, at the router's indexes. */
typedef struct {
    rl_router router;
    pthread_mutex_t mutex;                    /* guards nodes and closed */
    rl_node *nodes[RL_CLUSTER_MAX_NODES];     /* the pool of each node the router knows, or NULL */
    rl_node *sentinels[RL_CLUSTER_MAX_NODES]; /* the URL's sentinels (no credentials) */
    int sentinel_count;
    int closed;          /* close() was called */
    int initialized;     /* the mutex exists */
    int max_open;        /* connections per node */
    rl_config base;      /* credentials, db, timeouts, TLS context: every node's */
    rl_metrics *metrics; /* the limiter's counters (every node's pool), or NULL */
} rl_cluster;

/* GIL held: set up (c->base filled first; master_name for a Sentinel set), the URL's seed
   nodes (the sentinels in sentinel mode), the fork child's reset. */
int rl_cluster_init(rl_cluster *c, int max_open, const char *master_name); /* 0 / -1, errno */
int rl_cluster_add_seed(rl_cluster *c, const char *host, int port);        /* 0, or -1 */
void rl_cluster_after_fork(rl_cluster *c);
void rl_cluster_destroy(rl_cluster *c);
/* GIL released: like the rl_pool_* of the same names, over every node. */
void rl_cluster_close(rl_cluster *c);
int rl_cluster_is_closed(rl_cluster *c);
int rl_cluster_open_count(rl_cluster *c);
int rl_cluster_take_warning(rl_cluster *c, char *buf);

/* One blocking decision on a single node's pool or on a cluster (routed by the decision's
   slot, following MOVED/ASK/TRYAGAIN/CLUSTERDOWN and dead nodes within the deadline).
   Resumable after RL_ERR_INTERRUPTED like rl_call_run. */
typedef struct {
    rl_cluster *cluster; /* NULL: a single node (call.pool) */
    rl_prepared *decision;
    rl_call call;     /* the try under way */
    int under_way;    /* call holds a try that a signal interrupted */
    rl_route route;   /* the router's state of this call */
    double deadline;  /* of the whole call */
    rl_result result; /* the answer, on RL_OK */
} rl_routed_call;

void rl_routed_call_init(rl_routed_call *rc, rl_cluster *cluster, rl_pool *pool, rl_prepared *d);
rl_status rl_routed_call_run(rl_routed_call *rc, rl_error *err);
void rl_routed_call_abandon(rl_routed_call *rc);

/* ------------------------------------------------------------------ script */

/* Formats the EVALSHA of a prepared decision (its script, windows, member and, for
   reconcile, score and cost); returns its length and sets *out (redisFreeCommand), or -1
   when out of memory. now_ms < 0 lets the script read the server's clock. */
long long rl_script_format(const char *prefix, size_t prefix_len, const char *user, size_t user_len,
                           const rl_prepared *d, long long now_ms, char **out);

/* Writes the user's part of a key at out: the user id as it is, or in cluster mode
   (hash_tag) "{" + the id with '%', '{' and '}' percent-encoded + "}", so that all of one
   user's keys share one hash slot and no two ids share a tag. Every key kind goes through
   it. out needs rl_key_user_room(user_len) bytes. Returns the bytes written. */
size_t rl_key_user(char *out, const char *user, size_t user_len, int hash_tag);
#define rl_key_user_room(user_len) (3 * (user_len) + 2)
/* The key grammar read back (the command line's view of the keys rl_script_format and
   rl_key_user write): what one key's name says. Pointers are into the name read; the owner
   (in a hash tag) and the scope name are still percent-encoded (rl_key_unescape). */
typedef enum {
    RL_KEY_WINDOW,
    RL_KEY_SCOPE,
    RL_KEY_SHARED,
    RL_KEY_LEASES,
    RL_KEY_GCRA,
    RL_KEY_BUDGET
} rl_key_kind;
typedef struct {
    rl_key_kind kind;  /* a user's window, a user's scope window, a shared scope's, leases, a
                          GCRA bucket ("{owner}:{seconds}:gcra", seconds its period), a
                          calendar budget ("{owner}:{start_ms}:budget={name}", seconds its
                          period's start in ms, scope its name) */
    const char *owner; /* the user id, or a shared scope's name */
    size_t owner_len;
    long long seconds; /* the window's length (0 for leases) */
    int tokens;        /* a token window (":tokens") */
    const char *scope; /* a user's scope name (after ":scope="), or NULL */
    size_t scope_len;
    char suffix; /* 'w' (the weights), 'c' (the compact string) or 0 (the window's set) */
} rl_key_reading;
/* Reads a key's name "{prefix}:{owner}:..." as written with hash_tag (see window_key and
   write_key_pair in script.c). Returns 0 and fills *out, or -1 for a name that is none of
   the limiter's window or leases keys (a running-totals ":t" or a ":stats" key, say). */
int rl_key_read(const char *name, size_t len, const char *prefix, size_t prefix_len, int hash_tag,
                rl_key_reading *out);
/* Writes text with every "%XX" (uppercase hex, as rl_key_user and window_key escape) decoded
   to its byte; out needs len bytes. Returns the bytes written. */
size_t rl_key_unescape(char *out, const char *text, size_t len);
/* The Redis Cluster hash slot (CRC16-XMODEM mod 16384) of a key whose hash tag is the
   user's part written by rl_key_user(..., 1), computed without building it (cluster.c). */
int rl_user_slot(const char *user, size_t user_len);
/* The hash slot of a whole key, with Redis's hash-tag rule (cluster.c). */
int rl_key_slot(const char *key, size_t len);

/* The command with the script's replay marker appended (malloc'd; NULL when out of memory
   or not a formatted command). A replay never counts a request its first attempt logged. */
char *rl_script_replay_command(const char *command, size_t command_len, size_t *out_len);

/* Decodes a script reply into a result, checked against the request's windows (an allow
   has 0 <= remaining < that window's limit and no retry; a reject has remaining 0 and a
   retry >= 1); PROTOCOL/SERVER/AUTH errors otherwise. No GIL needed. */
rl_status rl_script_decode(const redisReply *reply, const rl_prepared *d, rl_result *out,
                           rl_error *err);
/* 1 when reply is an error reply whose text starts with prefix. */
int rl_reply_is_error(const redisReply *reply, const char *prefix);
/* 1 for a Redis Cluster answer that says "not here, not now": MOVED, ASK, TRYAGAIN or
   CLUSTERDOWN. The command did not run. */
int rl_reply_is_cluster_redirect(const redisReply *reply);
const char *rl_reply_type_name(int type); /* "an integer", ... for messages */

/* A script's SHA1 hex and source, embedded from lua/ at build time, and the pre-encoded
   SCRIPT LOAD command. */
const char *rl_script_sha1(rl_script_id id);
const char *rl_script_source_text(rl_script_id id, size_t *len);
const char *rl_script_load_text(rl_script_id id, size_t *len);

/* ------------------------------------------------------------------ member */

typedef struct rl_random rl_random; /* a page of kernel randomness */
rl_random *rl_random_new(void);     /* NULL with errno on failure */
void rl_random_free(rl_random *page);
/* Bumped once per fork this process descends from (starts at 1). GIL held. */
unsigned long rl_fork_generation(rl_random *r);
/* Canonical lowercase UUID4 text. 0, or -1 with errno when getrandom failed. GIL held. */
int rl_member_uuid4(rl_random *page, char out[RL_MEMBER_LEN + 1]);

/* -------------------------------------------------------- module (GIL held) */

typedef struct {
    PyTypeObject *LimiterType;
    PyTypeObject *CodecType;
    PyTypeObject *RequestType;
    PyTypeObject *PipelineType;
    PyTypeObject *RouterType; /* py_routing.c */
    PyTypeObject *RouteType;
    PyTypeObject *RouteReadType;
    PyTypeObject *PushReaderType; /* py_pushes.c: a subscriber connection's reader */
    /* check_windows_detailed's answer (a struct sequence) */
    PyTypeObject *WindowDecisionType;
    PyObject *Error;           /* RateLimiterError */
    PyObject *Unavailable;     /* RateLimiterUnavailable */
    PyObject *Timeout;         /* RateLimiterTimeout */
    PyObject *AuthError;       /* RateLimiterAuthError */
    int kill_switch_warned;    /* the kill-switch warning was logged */
    long long client_clock_ms; /* tests: what clock="client" reads (_set_client_clock), or -1 */
    rl_random *random;         /* UUID4 randomness, wiped in a fork child */
    PyObject *str_done;        /* interned method names for resolving futures */
    PyObject *str_set_result;
    PyObject *str_set_exception;
} rl_module_state;

/* Raises the Python exception for err. Always returns NULL. */
PyObject *rl_raise(rl_module_state *state, const rl_error *err);
/* The exception instance for err (a new reference), or NULL with an exception set. */
PyObject *rl_exception(rl_module_state *state, const rl_error *err);
/* Its inverse: the rl_error of a failure a driver met (exc, an exception instance) whose
   status the driver names: kind and exc's text (a fixed text when exc's cannot be rendered).
   Never fails: no exception is left set. */
void rl_error_from(PyObject *exc, rl_status kind, rl_error *err);

/* py_routing.c, GIL held: how the Pipeline (py_codec.c) hands C replies and C statuses to the
   router, with no Python object in between. route is a Route, read a RouteRead (checked by
   the caller).
   rl_routing_failed: the try of route failed with st (err) on the connection: 1 the call
   goes on (Route.go_on), 0 it gives up with err, -1 with the router's own error, written
   into err.
   rl_routing_question: the question read asks now, handed out (the Pipeline queues its
   words), or NULL when it asks none or one is out already.
   rl_routing_answer: the reply (st RL_OK) or the failure of the question handed out. */
int rl_routing_failed(PyObject *route, rl_status st, rl_error *err);
const rl_question *rl_routing_question(PyObject *read);
void rl_routing_answer(PyObject *read, rl_status st, const redisReply *reply, const rl_error *err);

/* Parses a method's arguments into d (shape, script, windows with their costs, reconcile's
   entry) and *user_id (borrowed), validating all of it. 0, or -1 with an exception. */
int rl_parse_request(rl_shape shape, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                     rl_prepared *d, PyObject **user_id);
/* Borrowed UTF-8 of a non-empty str user id, or NULL with an exception. */
const char *rl_user_id_utf8(PyObject *user_id, Py_ssize_t *len);
/* Logs message as a warning on the genai_ratelimit logger. 0, or -1 with an exception. */
int rl_log_warning(const char *message);
/* Validates user_id, applies the kill switch, makes the member, formats the command.
   out->windows must be filled first. Returns 0, or -1 with an exception set. */
int rl_prepare(rl_module_state *state, const char *prefix, size_t prefix_len, int client_clock,
               PyObject *user_id, rl_prepared *out);
void rl_prepared_clear(rl_prepared *p);
/* _native.key_owner(owner, hash_tag) -> str and _native.read_key(name, prefix, hash_tag)
   -> (kind, owner, seconds, tokens, scope, suffix) | None: module functions, METH_VARARGS
   (py_keyspace.c, over script.c's rl_key_user and rl_key_read). */
PyObject *rl_key_owner(PyObject *module, PyObject *args);
PyObject *rl_read_key(PyObject *module, PyObject *args);
/* _native._set_client_clock(ms | None): module function, METH_O (py_request.c). */
PyObject *rl_set_client_clock(PyObject *module, PyObject *ms);
/* The storage named `name` ("zset", the default when NULL, or "compact") into *out. 0, or
   -1 with a ValueError. */
int rl_parse_storage(const char *name, rl_storage *out);
/* 0 when seconds is a usable timeout (0 < seconds <= RL_MAX_TIMEOUT_SECONDS), else -1
   with a ValueError naming the parameter. */
int rl_check_timeout(const char *name, double seconds);
/* The options of a limiter, validated once, here, for both limiters: key_prefix not empty
   (also Codec's), timeouts, 1 <= max_connections <= RL_MAX_CONNECTIONS, 0 <= min_replicas
   <= RL_MAX_REPLICAS, 1 <= replica_timeout_ms <= RL_MAX_REPLICA_TIMEOUT_MS. 0, or -1 with
   a ValueError naming the option. */
int rl_check_key_prefix(Py_ssize_t len);
int rl_check_limiter_values(double connect_timeout, double socket_timeout,
                            Py_ssize_t key_prefix_len, long long max_connections,
                            long long min_replicas, long long replica_timeout_ms);
/* _native.check_options(key_prefix, clock, connect_timeout, socket_timeout, max_connections,
   storage, min_replicas, replica_timeout_ms, hash_tag=False): the constructor's options of
   either limiter, their types and values (TypeError / ValueError), before anything is
   made; the values' rules are rl_check_limiter_values's. Module function (py_request.c). */
PyObject *rl_check_options(PyObject *module, PyObject *args, PyObject *kwargs);
/* The Python result of a decision of d's shape (see rl_shape). Returns a new reference. */
PyObject *rl_result_object(rl_module_state *state, const rl_prepared *d, const rl_result *r);
/* Vectorcall argument matching: the first `positional` names may be given by position,
   the first `required` must be given; out[] receives borrowed references (NULL for an
   optional one not given). 0 / -1. */
int rl_parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                  const char *const *names, int n, int positional, int required, PyObject **out);

/* ------------------------------------- the Limited API's gaps (py_limited.c, GIL held) */

/* Raises TypeError: the printf-style text, then the name of obj's type (as tp_name would
   give it), e.g. rl_type_error(v, "%s must be an int, not ", name). Returns NULL. */
PyObject *rl_type_error(PyObject *obj, const char *format, ...);

/* PySequence_Fast_GET_ITEM / _GET_SIZE, which read struct fields the Limited API hides:
   for the list or tuple PySequence_Fast returned (or a list or tuple checked as such).
   The item is borrowed, as the macro's was. */
static inline PyObject *
rl_seq_item(PyObject *list_or_tuple, Py_ssize_t i)
{
    return PyList_Check(list_or_tuple) ? PyList_GetItem(list_or_tuple, i)
                                       : PyTuple_GetItem(list_or_tuple, i);
}

static inline Py_ssize_t
rl_seq_size(PyObject *list_or_tuple)
{
    return PyList_Check(list_or_tuple) ? PyList_Size(list_or_tuple) : PyTuple_Size(list_or_tuple);
}

#endif
