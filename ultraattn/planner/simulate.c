/* The schedule simulator's inner loop in C: ``schedule.simulate`` without shared compute, and ``bottom_levels``.
 *
 * Built and loaded by ``ultraattn/planner/native.py`` (the system C compiler, ctypes); ``schedule.py`` holds the
 * Python version, which is the definition: this file takes every decision in the same order (streams served in
 * increasing id, ready tasks by (priority, id), events by (end, id)), so both give the same schedule to the last bit
 * (tests/test_native_simulate.py). No global state: calls from several threads at once are safe.
 */
#include <stdlib.h>

typedef struct { double key; long id; } item;          /* heap entry: ordered by (key, id) */
typedef struct { item *a; long n, cap; } heap;
typedef struct { int *v; int n, cap; } intset;          /* a set of small ints: add, swap-remove, iterate */

static int before(item x, item y) { return x.key < y.key || (x.key == y.key && x.id < y.id); }

static int heap_push(heap *h, item x) {
    if (h->n == h->cap) {
        long cap = h->cap ? 2 * h->cap : 8;
        item *a = realloc(h->a, cap * sizeof(item));
        if (!a) return -1;
        h->a = a; h->cap = cap;
    }
    long i = h->n++;
    while (i > 0) {
        long up = (i - 1) / 2;
        if (!before(x, h->a[up])) break;
        h->a[i] = h->a[up]; i = up;
    }
    h->a[i] = x;
    return 0;
}

static item heap_pop(heap *h) {
    item top = h->a[0], x = h->a[--h->n];
    long i = 0, n = h->n;
    for (;;) {
        long c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && before(h->a[c + 1], h->a[c])) c++;
        if (!before(h->a[c], x)) break;
        h->a[i] = h->a[c]; i = c;
    }
    if (n) h->a[i] = x;
    return top;
}

/* the sets' positions: pos[x] is x's index + 1 in s, 0 when x is not in s */
static int set_add(intset *s, int *pos, int x) {
    if (pos[x]) return 0;
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 4;
        int *v = realloc(s->v, cap * sizeof(int));
        if (!v) return -1;
        s->v = v; s->cap = cap;
    }
    s->v[s->n++] = x;
    pos[x] = s->n;
    return 0;
}

static void set_remove(intset *s, int *pos, int x) {
    int at = pos[x] - 1, last = s->v[--s->n];
    s->v[at] = last;
    pos[last] = at + 1;
    pos[x] = 0;
}

static int cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* Longest duration path from each task to the end, inclusive (schedule.bottom_levels): a post-order walk of the
 * successor lists (``succ[off[i]:off[i+1]]``). Returns 0, or -1 when out of memory. A cycle's tasks keep the
 * levels of what was finished when the walk met it (the simulation then reports the stall). */
int ua_bottom_levels(long n, const double *dur, const long *off, const long *succ, double *bl) {
    char *state = calloc(n ? n : 1, 1);             /* 0: not seen, 1: on the walk, 2: done */
    long *stack = malloc((n ? n : 1) * sizeof(long)), *next = malloc((n ? n : 1) * sizeof(long));
    if (!state || !stack || !next) { free(state); free(stack); free(next); return -1; }
    for (long root = 0; root < n; root++) {
        if (state[root]) continue;
        long sp = 0;
        stack[sp++] = root; state[root] = 1; next[root] = off[root];
        while (sp) {
            long v = stack[sp - 1];
            if (next[v] < off[v + 1]) {
                long w = succ[next[v]++];
                if (!state[w]) { state[w] = 1; next[w] = off[w]; stack[sp++] = w; }
                continue;
            }
            if (off[v] < off[v + 1]) {
                double m = bl[succ[off[v]]];
                for (long e = off[v] + 1; e < off[v + 1]; e++)
                    if (bl[succ[e]] > m) m = bl[succ[e]];
                bl[v] = dur[v] + m;
            } else {
                bl[v] = dur[v] + 0.0;
            }
            state[v] = 2; sp--;
        }
    }
    free(state); free(stack); free(next);
    return 0;
}

/* Non-delay list scheduling (schedule.simulate, without ``SharedCompute``). Task i uses stream first[i] and, when
 * second[i] >= 0, second[i] too (streams are 0..nstreams-1); prio: lower runs first; missing: each task's count of
 * unfinished predecessors (consumed). Writes start and end. Returns 0, 1 when the graph has a cycle (the
 * simulation stalled), or -1 when out of memory. */
int ua_simulate(long n, int nstreams, const int *first, const int *second, const double *dur, const double *prio,
                const long *off, const long *succ, int *missing, double *start, double *end) {
    long stride = (long)nstreams + 1;
    long npairs = (long)nstreams * stride;                  /* key = first * stride + second + 1 */
    heap *ready_heaps = calloc(npairs ? npairs : 1, sizeof(heap));
    intset *pending = calloc(nstreams ? nstreams : 1, sizeof(intset));    /* first -> {second + 1} with tasks */
    int *pending_pos = calloc(npairs ? npairs : 1, sizeof(int));
    intset *waiting = calloc(nstreams ? nstreams : 1, sizeof(intset));    /* second -> {first} with tasks for it */
    int *waiting_pos = calloc(nstreams ? (long)nstreams * nstreams : 1, sizeof(int));
    char *busy = calloc(nstreams ? nstreams : 1, 1), *is_dirty = calloc(nstreams ? nstreams : 1, 1);
    int *dirty = malloc((nstreams ? nstreams : 1) * sizeof(int));
    double *ready_time = calloc(n ? n : 1, sizeof(double));
    long *batch = malloc((n ? n : 1) * sizeof(long));
    heap events = {0};
    int rc = 0, ndirty = 0;
    long done = 0;
    double now = 0.0;
    if (!ready_heaps || !pending || !pending_pos || !waiting || !waiting_pos || !busy || !is_dirty || !dirty ||
        !ready_time || !batch) { rc = -1; goto out; }

#define PENDING_POS(s0) (pending_pos + (long)(s0) * stride)       /* positions in pending[s0], by second + 1 */
#define WAITING_POS(s1) (waiting_pos + (long)(s1) * nstreams)     /* positions in waiting[s1], by first */
#define MARK_DIRTY(x) do { if (!is_dirty[x]) { is_dirty[x] = 1; dirty[ndirty++] = (x); } } while (0)
#define MAKE_READY(i) do { \
        int s0_ = first[i], s1_ = second[i]; \
        if (heap_push(&ready_heaps[(long)s0_ * stride + s1_ + 1], (item){prio[i], (i)})) { rc = -1; goto out; } \
        if (set_add(&pending[s0_], PENDING_POS(s0_), s1_ + 1)) { rc = -1; goto out; } \
        if (s1_ >= 0 && set_add(&waiting[s1_], WAITING_POS(s1_), s0_)) { rc = -1; goto out; } \
        MARK_DIRTY(s0_); \
    } while (0)

    for (long i = 0; i < n; i++)
        if (missing[i] == 0) MAKE_READY(i);
    while (done < n) {
        /* freed streams in increasing id: each starts its best ready task whose second stream is free */
        qsort(dirty, ndirty, sizeof(int), cmp_int);
        for (int d = 0; d < ndirty; d++) {
            int s0 = dirty[d];
            intset *todo = &pending[s0];
            if (busy[s0] || !todo->n) continue;
            int best = -1;
            item head = {0.0, 0};
            for (int k = 0; k < todo->n; k++) {
                int s1p = todo->v[k];
                if (s1p > 0 && busy[s1p - 1]) continue;
                item h = ready_heaps[(long)s0 * stride + s1p].a[0];
                if (best < 0 || before(h, head)) { head = h; best = k; }
            }
            if (best < 0) continue;
            int s1p = todo->v[best];
            heap *h = &ready_heaps[(long)s0 * stride + s1p];
            long i = heap_pop(h).id;
            if (!h->n) {
                set_remove(todo, PENDING_POS(s0), s1p);
                if (s1p > 0) set_remove(&waiting[s1p - 1], WAITING_POS(s1p - 1), s0);
            }
            double st = ready_time[i] < now ? now : ready_time[i];
            start[i] = st;
            end[i] = st + dur[i];
            busy[s0] = 1;
            if (s1p > 0) busy[s1p - 1] = 1;
            if (heap_push(&events, (item){end[i], i})) { rc = -1; goto out; }
        }
        for (int d = 0; d < ndirty; d++) is_dirty[dirty[d]] = 0;
        ndirty = 0;
        if (!events.n) { rc = 1; goto out; }
        /* the next end, and every end at the same time */
        item ev = heap_pop(&events);
        now = ev.key;
        long nb = 0;
        batch[nb++] = ev.id;
        while (events.n && events.a[0].key <= now) batch[nb++] = heap_pop(&events).id;
        for (long b = 0; b < nb; b++) {
            long i = batch[b];
            int streams[2] = {first[i], second[i]};
            done++;
            for (int s = 0; s < 2; s++) {
                int x = streams[s];
                if (x < 0) continue;
                busy[x] = 0;
                MARK_DIRTY(x);
                for (int k = 0; k < waiting[x].n; k++) MARK_DIRTY(waiting[x].v[k]);
            }
            for (long e = off[i]; e < off[i + 1]; e++) {
                long j = succ[e];
                missing[j]--;
                if (ready_time[j] < now) ready_time[j] = now;
                if (missing[j] == 0) MAKE_READY(j);
            }
        }
    }
out:
    if (ready_heaps)
        for (long k = 0; k < npairs; k++) free(ready_heaps[k].a);
    for (int s = 0; s < nstreams; s++) {
        if (pending) free(pending[s].v);
        if (waiting) free(waiting[s].v);
    }
    free(ready_heaps); free(pending); free(pending_pos); free(waiting); free(waiting_pos); free(busy);
    free(is_dirty); free(dirty); free(ready_time); free(batch); free(events.a);
    return rc;
}
