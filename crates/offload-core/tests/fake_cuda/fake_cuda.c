/*
 * A fake CUDA driver (libcuda.so.1 stand-in) for kvoffload's tests on machines without a
 * GPU. It implements the driver functions the CUDA backend uses, with host memcpy:
 * "device pointers" are host pointers.
 *
 * Streams are modelled faithfully enough to test ordering: every stream holds a FIFO of
 * operations (wait on an event, copy, record an event) that run in order; a wait blocks
 * the stream until the awaited record has run. Events recorded with nothing blocking them
 * complete at once, or after `fake_set_query_delay(n)` NOT_READY answers.
 *
 * Built by the test at run time (cc -shared -fPIC). Compile-time switches omit symbols:
 *   -DNO_BATCH_V1 (cuMemcpyBatchAsync), -DNO_BATCH_V2 (cuMemcpyBatchAsync_v2),
 *   -DNO_EVENT_QUERY (cuEventQuery, a required symbol), -DNO_ERROR_NAME (cuGetErrorName
 *   and cuGetErrorString), -DNO_PRIORITY_RANGE (cuCtxGetStreamPriorityRange).
 * Run-time behaviour is set through the exported fake_* functions; tests call them through
 * the same dlopen handle the backend uses.
 *
 * Signatures follow cuda.h (CUDA 12.8 / 13.x); see crates/offload-core/src/transfer/cuda/sys.rs.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;

typedef struct {
    unsigned int type;
    int id;
} CUmemLocation;

typedef struct {
    unsigned int srcAccessOrder;
    CUmemLocation srcLocHint;
    CUmemLocation dstLocHint;
    unsigned int flags;
} CUmemcpyAttributes;

_Static_assert(sizeof(CUmemcpyAttributes) == 24, "CUmemcpyAttributes layout");

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_ILLEGAL_ADDRESS 700
#define CUDA_ERROR_LAUNCH_TIMEOUT 702
#define CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED 712
#define CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED 713
#define CUDA_ERROR_LAUNCH_FAILED 719

#define EXPORT __attribute__((visibility("default")))

#define EVENT_MAGIC 0x45564e54u
#define STREAM_MAGIC 0x5354524du
#define MAX_STREAMS 16
#define MAX_REGISTRATIONS 256

enum { OP_WAIT, OP_COPY, OP_RECORD };

typedef struct Event {
    unsigned magic;
    unsigned long long recorded; /* generation of the latest record */
    unsigned long long done;     /* generation of the latest record that ran */
    int delay_left;              /* NOT_READY answers still owed after completion */
    int user;
} Event;

typedef struct {
    int kind;
    Event *event;
    unsigned long long generation;
    void *dst;
    const void *src;
    size_t len;
} Op;

typedef struct {
    unsigned magic;
    unsigned flags;
    int priority;
    Op *ops;
    size_t head, len, cap;
} Stream;

typedef struct {
    uintptr_t base;
    size_t len;
} Registration;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int g_version = 13000;
static int g_init_result = CUDA_SUCCESS;
static int g_device_count = 1;
static int g_sticky = 0;
static long g_copy_calls = 0;
static long g_fail_copy_at = -1;
static int g_fail_copy_code = CUDA_ERROR_INVALID_VALUE;
static int g_fail_query_code = 0;
static int g_fail_record_code = 0;
static int g_query_delay = 0;
static int g_register_delay_ms = 0;
static int g_ctx_refs = 0;
static int g_ctx_token;
static int g_last_stream_flags = -1;
static int g_last_stream_priority = 12345;
static int g_live_events = 0;
static long g_unpinned_copies = 0;
static long g_batch_calls = 0;
static long g_memcpy_calls = 0;
static long g_last_batch_count = 0;
static unsigned g_last_batch_order = 0;
static Stream *g_streams[MAX_STREAMS];
static Registration g_regs[MAX_REGISTRATIONS];
static int g_nregs = 0;
static char g_log[1 << 16];
static size_t g_log_len = 0;
static __thread void *t_ctx = NULL;

static void log_op(const char *fmt, long arg) {
    char buf[64];
    int n = snprintf(buf, sizeof buf, fmt, arg);
    if (n <= 0) return;
    if (g_log_len + (size_t)n + 1 >= sizeof g_log) return;
    memcpy(g_log + g_log_len, buf, (size_t)n);
    g_log_len += (size_t)n;
    g_log[g_log_len++] = ' ';
    g_log[g_log_len] = 0;
}

static int is_sticky(int code) {
    return code == CUDA_ERROR_ILLEGAL_ADDRESS || code == CUDA_ERROR_LAUNCH_FAILED;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int valid_stream(Stream *s) {
    if (s == NULL) return 0;
    for (int i = 0; i < MAX_STREAMS; i++)
        if (g_streams[i] == s) return s->magic == STREAM_MAGIC;
    return 0;
}

static int valid_event(Event *e) { return e != NULL && e->magic == EVENT_MAGIC; }

/* Runs every stream's operations until each is empty or blocked on a wait. */
static void progress(void) {
    for (int i = 0; i < MAX_STREAMS; i++) {
        Stream *s = g_streams[i];
        if (s == NULL) continue;
        while (s->head < s->len) {
            Op *op = &s->ops[s->head];
            if (op->kind == OP_WAIT) {
                if (op->event->done < op->generation) break;
            } else if (op->kind == OP_COPY) {
                memcpy(op->dst, op->src, op->len);
            } else if (op->event->done < op->generation) {
                op->event->done = op->generation;
            }
            s->head++;
        }
        if (s->head == s->len) s->head = s->len = 0;
    }
}

static int push(Stream *s, Op op) {
    if (s->len == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 64;
        Op *ops = realloc(s->ops, cap * sizeof(Op));
        if (ops == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
        s->ops = ops;
        s->cap = cap;
    }
    s->ops[s->len++] = op;
    progress();
    return CUDA_SUCCESS;
}

static int find_registration(uintptr_t p) {
    for (int i = 0; i < g_nregs; i++)
        if (p >= g_regs[i].base && p - g_regs[i].base < g_regs[i].len) return i;
    return -1;
}

/* A copy touching pinned memory must stay inside one registration. */
static int check_pinned(const void *p, size_t len, int *pinned) {
    int r = find_registration((uintptr_t)p);
    if (r < 0) return CUDA_SUCCESS;
    *pinned = 1;
    if ((uintptr_t)p + len - g_regs[r].base > g_regs[r].len) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

static int enqueue_copy(Stream *s, CUdeviceptr dst, CUdeviceptr src, size_t len) {
    int pinned = 0;
    int rc = check_pinned((const void *)(uintptr_t)src, len, &pinned);
    if (rc == CUDA_SUCCESS) rc = check_pinned((const void *)(uintptr_t)dst, len, &pinned);
    if (rc != CUDA_SUCCESS) return rc;
    if (!pinned) g_unpinned_copies++;
    Op op = {OP_COPY, NULL, 0, (void *)(uintptr_t)dst, (const void *)(uintptr_t)src, len};
    return push(s, op);
}

/* The scripted failure of the current copy call, if any. */
static int scripted_copy_failure(void) {
    long n = g_copy_calls++;
    if (n != g_fail_copy_at) return CUDA_SUCCESS;
    if (is_sticky(g_fail_copy_code)) g_sticky = g_fail_copy_code;
    return g_fail_copy_code;
}

#define ENTER()                  \
    pthread_mutex_lock(&mu);     \
    if (g_sticky) {              \
        int sticky_ = g_sticky;  \
        pthread_mutex_unlock(&mu); \
        return sticky_;          \
    }
#define LEAVE(rc)                \
    do {                         \
        int rc_ = (rc);          \
        pthread_mutex_unlock(&mu); \
        return rc_;              \
    } while (0)
#define NEED_CONTEXT()                                     \
    if (t_ctx == NULL) LEAVE(CUDA_ERROR_INVALID_CONTEXT)

/* ---- driver API ---------------------------------------------------------------------- */

EXPORT CUresult cuInit(unsigned int flags) {
    pthread_mutex_lock(&mu);
    int rc = flags != 0 ? CUDA_ERROR_INVALID_VALUE : g_init_result;
    LEAVE(rc);
}

EXPORT CUresult cuDriverGetVersion(int *version) {
    pthread_mutex_lock(&mu);
    if (version == NULL) LEAVE(CUDA_ERROR_INVALID_VALUE);
    *version = g_version;
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    ENTER();
    if (device == NULL) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (ordinal < 0 || ordinal >= g_device_count) LEAVE(CUDA_ERROR_INVALID_DEVICE);
    *device = ordinal;
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    ENTER();
    if (pctx == NULL) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (dev < 0 || dev >= g_device_count) LEAVE(CUDA_ERROR_INVALID_DEVICE);
    *pctx = &g_ctx_token;
    g_ctx_refs++;
    log_op("retain", 0);
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    pthread_mutex_lock(&mu);
    if (dev < 0 || dev >= g_device_count || g_ctx_refs == 0) LEAVE(CUDA_ERROR_INVALID_DEVICE);
    g_ctx_refs--;
    log_op("release", 0);
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    ENTER();
    t_ctx = ctx;
    LEAVE(CUDA_SUCCESS);
}

#ifndef NO_PRIORITY_RANGE
EXPORT CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) {
    ENTER();
    NEED_CONTEXT();
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    LEAVE(CUDA_SUCCESS);
}
#endif

EXPORT CUresult cuStreamCreateWithPriority(void **phStream, unsigned int flags, int priority) {
    ENTER();
    NEED_CONTEXT();
    if (phStream == NULL) LEAVE(CUDA_ERROR_INVALID_VALUE);
    int slot = -1;
    for (int i = 0; i < MAX_STREAMS; i++)
        if (g_streams[i] == NULL) { slot = i; break; }
    if (slot < 0) LEAVE(CUDA_ERROR_OUT_OF_MEMORY);
    Stream *s = calloc(1, sizeof(Stream));
    if (s == NULL) LEAVE(CUDA_ERROR_OUT_OF_MEMORY);
    s->magic = STREAM_MAGIC;
    s->flags = flags;
    s->priority = priority;
    g_streams[slot] = s;
    g_last_stream_flags = (int)flags;
    g_last_stream_priority = priority;
    *phStream = s;
    log_op("stream:%ld", priority);
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamDestroy_v2(void *hStream) {
    ENTER();
    Stream *s = hStream;
    if (!valid_stream(s)) LEAVE(CUDA_ERROR_INVALID_HANDLE);
    for (int i = 0; i < MAX_STREAMS; i++)
        if (g_streams[i] == s) g_streams[i] = NULL;
    s->magic = 0;
    free(s->ops);
    free(s);
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamSynchronize(void *hStream) {
    ENTER();
    Stream *s = hStream;
    if (!valid_stream(s)) LEAVE(CUDA_ERROR_INVALID_HANDLE);
    log_op("sync", 0);
    for (int waited = 0;; waited++) {
        progress();
        if (s->len == 0) LEAVE(CUDA_SUCCESS);
        if (waited >= 5000) LEAVE(CUDA_ERROR_LAUNCH_TIMEOUT);
        pthread_mutex_unlock(&mu);
        sleep_ms(1);
        pthread_mutex_lock(&mu);
    }
}

EXPORT CUresult cuStreamWaitEvent(void *hStream, void *hEvent, unsigned int flags) {
    ENTER();
    NEED_CONTEXT();
    Stream *s = hStream;
    Event *e = hEvent;
    if (!valid_stream(s) || !valid_event(e)) LEAVE(CUDA_ERROR_INVALID_HANDLE);
    if (flags != 0) LEAVE(CUDA_ERROR_INVALID_VALUE);
    log_op("wait", 0);
    Op op = {OP_WAIT, e, e->recorded, NULL, NULL, 0};
    LEAVE(push(s, op));
}

EXPORT CUresult cuEventCreate(void **phEvent, unsigned int flags) {
    ENTER();
    NEED_CONTEXT();
    (void)flags;
    if (phEvent == NULL) LEAVE(CUDA_ERROR_INVALID_VALUE);
    Event *e = calloc(1, sizeof(Event));
    if (e == NULL) LEAVE(CUDA_ERROR_OUT_OF_MEMORY);
    e->magic = EVENT_MAGIC;
    g_live_events++;
    *phEvent = e;
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuEventRecord(void *hEvent, void *hStream) {
    ENTER();
    NEED_CONTEXT();
    Stream *s = hStream;
    Event *e = hEvent;
    if (!valid_stream(s) || !valid_event(e)) LEAVE(CUDA_ERROR_INVALID_HANDLE);
    if (g_fail_record_code) {
        int code = g_fail_record_code;
        g_fail_record_code = 0;
        LEAVE(code);
    }
    log_op("record", 0);
    e->recorded++;
    e->delay_left = g_query_delay;
    Op op = {OP_RECORD, e, e->recorded, NULL, NULL, 0};
    LEAVE(push(s, op));
}

#ifndef NO_EVENT_QUERY
EXPORT CUresult cuEventQuery(void *hEvent) {
    ENTER();
    Event *e = hEvent;
    if (!valid_event(e)) LEAVE(CUDA_ERROR_INVALID_HANDLE);
    if (g_fail_query_code) {
        int code = g_fail_query_code;
        g_fail_query_code = 0;
        if (is_sticky(code)) g_sticky = code;
        LEAVE(code);
    }
    progress();
    if (e->done < e->recorded) LEAVE(CUDA_ERROR_NOT_READY);
    if (e->delay_left > 0) {
        e->delay_left--;
        LEAVE(CUDA_ERROR_NOT_READY);
    }
    LEAVE(CUDA_SUCCESS);
}
#endif

EXPORT CUresult cuEventDestroy_v2(void *hEvent) {
    ENTER();
    Event *e = hEvent;
    if (!valid_event(e)) LEAVE(CUDA_ERROR_INVALID_HANDLE);
    e->magic = 0;
    if (!e->user) g_live_events--;
    free(e);
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, void *hStream) {
    ENTER();
    NEED_CONTEXT();
    Stream *s = hStream;
    if (!valid_stream(s)) LEAVE(CUDA_ERROR_INVALID_HANDLE);
    int rc = scripted_copy_failure();
    if (rc != CUDA_SUCCESS) LEAVE(rc);
    g_memcpy_calls++;
    log_op("copy", 0);
    LEAVE(enqueue_copy(s, dst, src, bytes));
}

__attribute__((unused)) static int batch(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                 CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
                 size_t *failIdx, void *hStream, int variant) {
    Stream *s = hStream;
    if (failIdx) *failIdx = (size_t)-1;
    if (!valid_stream(s)) return CUDA_ERROR_INVALID_VALUE; /* the legacy NULL stream too */
    if (count == 0 || dsts == NULL || srcs == NULL || sizes == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (numAttrs == 0 || numAttrs > count || attrs == NULL || attrsIdxs == NULL ||
        attrsIdxs[0] != 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < numAttrs; i++)
        if (attrs[i].srcAccessOrder < 1 || attrs[i].srcAccessOrder > 3)
            return CUDA_ERROR_INVALID_VALUE;
    int rc = scripted_copy_failure();
    if (rc != CUDA_SUCCESS) {
        if (failIdx) *failIdx = 0;
        return rc;
    }
    g_batch_calls++;
    g_last_batch_count = (long)count;
    g_last_batch_order = attrs[0].srcAccessOrder;
    log_op(variant == 1 ? "batch1:%ld" : "batch2:%ld", (long)count);
    for (size_t i = 0; i < count; i++) {
        rc = enqueue_copy(s, dsts[i], srcs[i], sizes[i]);
        if (rc != CUDA_SUCCESS) {
            if (failIdx) *failIdx = i;
            return rc;
        }
    }
    return CUDA_SUCCESS;
}

#ifndef NO_BATCH_V1
/* CUDA 12.8 signature. */
EXPORT CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                   size_t count, CUmemcpyAttributes *attrs, size_t *attrsIdxs,
                                   size_t numAttrs, size_t *failIdx, void *hStream) {
    ENTER();
    NEED_CONTEXT();
    LEAVE(batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, hStream, 1));
}
#endif

#ifndef NO_BATCH_V2
/* CUDA 13 signature (no failIdx). */
EXPORT CUresult cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                      size_t count, CUmemcpyAttributes *attrs,
                                      size_t *attrsIdxs, size_t numAttrs, void *hStream) {
    ENTER();
    NEED_CONTEXT();
    LEAVE(batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, NULL, hStream, 2));
}
#endif

EXPORT CUresult cuMemHostRegister_v2(void *p, size_t bytes, unsigned int flags) {
    int delay;
    pthread_mutex_lock(&mu);
    delay = g_register_delay_ms;
    pthread_mutex_unlock(&mu);
    if (delay > 0) sleep_ms(delay);
    ENTER();
    NEED_CONTEXT();
    (void)flags;
    if (p == NULL || bytes == 0) LEAVE(CUDA_ERROR_INVALID_VALUE);
    uintptr_t base = (uintptr_t)p;
    for (int i = 0; i < g_nregs; i++)
        if (base < g_regs[i].base + g_regs[i].len && g_regs[i].base < base + bytes)
            LEAVE(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    if (g_nregs == MAX_REGISTRATIONS) LEAVE(CUDA_ERROR_OUT_OF_MEMORY);
    g_regs[g_nregs].base = base;
    g_regs[g_nregs].len = bytes;
    g_nregs++;
    log_op("register", 0);
    LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuMemHostUnregister(void *p) {
    ENTER();
    for (int i = 0; i < g_nregs; i++) {
        if (g_regs[i].base == (uintptr_t)p) {
            g_regs[i] = g_regs[--g_nregs];
            log_op("unregister", 0);
            LEAVE(CUDA_SUCCESS);
        }
    }
    LEAVE(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
}

#ifndef NO_ERROR_NAME
static const char *error_name(CUresult code) {
    switch (code) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CUDA_ERROR_ILLEGAL_ADDRESS: return "CUDA_ERROR_ILLEGAL_ADDRESS";
    case CUDA_ERROR_LAUNCH_TIMEOUT: return "CUDA_ERROR_LAUNCH_TIMEOUT";
    case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED";
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
    case CUDA_ERROR_LAUNCH_FAILED: return "CUDA_ERROR_LAUNCH_FAILED";
    default: return NULL;
    }
}

EXPORT CUresult cuGetErrorName(CUresult error, const char **pStr) {
    if (pStr == NULL) return CUDA_ERROR_INVALID_VALUE;
    *pStr = error_name(error);
    return *pStr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr) {
    if (pStr == NULL) return CUDA_ERROR_INVALID_VALUE;
    *pStr = error_name(error) ? "fake driver error" : NULL;
    return *pStr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
#endif

/* ---- test controls ------------------------------------------------------------------- */

EXPORT void fake_set_version(int v) { pthread_mutex_lock(&mu); g_version = v; pthread_mutex_unlock(&mu); }
EXPORT void fake_set_init_result(int rc) { pthread_mutex_lock(&mu); g_init_result = rc; pthread_mutex_unlock(&mu); }
EXPORT void fake_set_device_count(int n) { pthread_mutex_lock(&mu); g_device_count = n; pthread_mutex_unlock(&mu); }
EXPORT void fake_set_query_delay(int n) { pthread_mutex_lock(&mu); g_query_delay = n; pthread_mutex_unlock(&mu); }
EXPORT void fake_set_register_delay_ms(int ms) { pthread_mutex_lock(&mu); g_register_delay_ms = ms; pthread_mutex_unlock(&mu); }
EXPORT void fake_set_sticky(int code) { pthread_mutex_lock(&mu); g_sticky = code; pthread_mutex_unlock(&mu); }
EXPORT void fake_fail_next_query(int code) { pthread_mutex_lock(&mu); g_fail_query_code = code; pthread_mutex_unlock(&mu); }
/* Fails the next cuEventRecord with `code`, after the job's copies were enqueued. */
EXPORT void fake_fail_next_record(int code) { pthread_mutex_lock(&mu); g_fail_record_code = code; pthread_mutex_unlock(&mu); }

/* Fails the copy call number `index` (counting from 0 over cuMemcpyAsync and batch calls
 * made from now on) with `code`. */
EXPORT void fake_fail_copy_at(long index, int code) {
    pthread_mutex_lock(&mu);
    g_fail_copy_at = g_copy_calls + index;
    g_fail_copy_code = code;
    pthread_mutex_unlock(&mu);
}

#define GETTER(type, name, expr) \
    EXPORT type name(void) { pthread_mutex_lock(&mu); type v_ = (expr); pthread_mutex_unlock(&mu); return v_; }
GETTER(int, fake_ctx_refs, g_ctx_refs)
GETTER(int, fake_live_events, g_live_events)
GETTER(int, fake_registrations, g_nregs)
GETTER(long, fake_unpinned_copies, g_unpinned_copies)
GETTER(long, fake_batch_calls, g_batch_calls)
GETTER(long, fake_memcpy_calls, g_memcpy_calls)
GETTER(long, fake_last_batch_count, g_last_batch_count)
GETTER(int, fake_last_batch_src_order, (int)g_last_batch_order)
GETTER(int, fake_last_stream_flags, g_last_stream_flags)
GETTER(int, fake_last_stream_priority, g_last_stream_priority)

EXPORT int fake_live_streams(void) {
    pthread_mutex_lock(&mu);
    int n = 0;
    for (int i = 0; i < MAX_STREAMS; i++) n += g_streams[i] != NULL;
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT unsigned long long fake_registered_bytes(void) {
    pthread_mutex_lock(&mu);
    unsigned long long n = 0;
    for (int i = 0; i < g_nregs; i++) n += g_regs[i].len;
    pthread_mutex_unlock(&mu);
    return n;
}

/* Copies the call log ("retain stream register wait copy record ...") into buf. */
EXPORT size_t fake_log(char *buf, size_t cap) {
    pthread_mutex_lock(&mu);
    size_t n = g_log_len < cap ? g_log_len : cap;
    memcpy(buf, g_log, n);
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT void fake_log_clear(void) {
    pthread_mutex_lock(&mu);
    g_log_len = 0;
    g_log[0] = 0;
    pthread_mutex_unlock(&mu);
}

/* An event "recorded on another stream" that stays incomplete until
 * fake_user_event_complete: stands in for PyTorch's compute-stream event. */
EXPORT void *fake_user_event_create(void) {
    Event *e = calloc(1, sizeof(Event));
    if (e == NULL) return NULL;
    e->magic = EVENT_MAGIC;
    e->user = 1;
    e->recorded = 1;
    return e;
}

EXPORT void fake_user_event_complete(void *hEvent) {
    pthread_mutex_lock(&mu);
    Event *e = hEvent;
    if (valid_event(e)) {
        e->done = e->recorded;
        progress();
    }
    pthread_mutex_unlock(&mu);
}

EXPORT void fake_user_event_destroy(void *hEvent) {
    pthread_mutex_lock(&mu);
    Event *e = hEvent;
    if (valid_event(e)) {
        e->magic = 0;
        free(e);
    }
    pthread_mutex_unlock(&mu);
}
