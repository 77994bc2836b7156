"""The CUDA C kernels of the signal/wait protocol (:data:`CUDA_SOURCE`) and the status-record words they share
with the host.

Device code that CuPy compiles at run time (``RawModule``): the host side, ``ep_comm.transport.signals``,
compiles and launches the kernels ``signal_and_wait``, ``send_signal`` and ``wait_signals``
(their parameters: ``PARAMS`` there) and decodes the status record. Rank ``me``'s signal for step ``seq`` is
``signal[me] = seq << 2 | kind`` in every rank's buffer, stored with ``st.release.sys`` after a system-scope
fence and polled with ``ld.acquire.sys``; a wait is bounded by a ``%globaltimer`` deadline. The status record
(int64 ``[2 + 2R]``): the signal value of the last wait that finished (:data:`STATUS_SEQ`), the missing total
(:data:`STATUS_MISSING`, sticky), one missing flag per rank from :data:`STATUS_FLAGS` on (sticky), then word 0
of every rank's abort record. Plain Python: importing it needs neither Numba nor CuPy.

Wait statistics (``ep_comm.transport.wait_stats``): given an int64 ``[R, WAIT_WORDS]`` table (``waits``, device
memory; NULL: not measured), every wait adds, per peer ``s != me`` that arrived, its delay: 0 when its signal was
there at this wait's first poll, else the ``%globaltimer`` nanoseconds from the first poll of the wait's thread that
found a signal absent to the poll that saw it (at least 1). A wait whose peers had all arrived reads no clock. Row
``s``: :data:`WAIT_STEPS` waits that saw ``s`` arrive, :data:`WAIT_LAST` waits in which ``s``'s delay was the
longest and not 0 (ties all count), :data:`WAIT_TOTAL` and :data:`WAIT_MAX` ns, :data:`WAIT_RECENT` the last wait's
delay, then :data:`WAIT_BUCKETS` histogram counts from :data:`WAIT_HIST` on
(bucket 0: delay 0; 1: below 1024 ns; then two per octave, ``2 (e - 10) + 2 + the bit below the top one`` for
``e = floor(log2 delay)``; the last bucket takes everything above). One thread owns a peer's row, so graph replays
count with no atomics but one shared-memory maximum.
"""
from __future__ import annotations

STATUS_SEQ, STATUS_MISSING, STATUS_FLAGS = 0, 1, 2  # int64 words of the status record
# int64 words of one peer's row of the wait statistics (module docstring)
WAIT_STEPS, WAIT_LAST, WAIT_TOTAL, WAIT_MAX, WAIT_RECENT, WAIT_HIST = 0, 1, 2, 3, 4, 5
WAIT_BUCKETS = 48
WAIT_WORDS = WAIT_HIST + WAIT_BUCKETS
SPIN_POLLS = 64  # a wait polls this often without a pause before it backs off

CUDA_SOURCE = f"""
#define WAIT_STEPS {WAIT_STEPS}
#define WAIT_LAST {WAIT_LAST}
#define WAIT_TOTAL {WAIT_TOTAL}
#define WAIT_MAX {WAIT_MAX}
#define WAIT_RECENT {WAIT_RECENT}
#define WAIT_HIST {WAIT_HIST}
#define WAIT_BUCKETS {WAIT_BUCKETS}
#define WAIT_WORDS {WAIT_WORDS}
#define SPIN_POLLS {SPIN_POLLS}
""" + r"""
typedef unsigned long long u64;
typedef long long i64;

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ i64 load_acquire_sys(const i64* p) {
    i64 v;
    asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release_sys(i64* p, i64 v) {
    asm volatile("st.release.sys.global.b64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}

// The step number this launch signals, step[0] + 1, read by every thread of the CTA; thread 0 stores it
// back only after all have read it. counts (or NULL, int32 [R][count_words]): row r goes to block me of the
// step's parity of the int64 [2][R][count_words] count words at counts_offset of rank r, before the signal.
// A rank whose peers[r] is 0 (NULL: reached through NVSHMEM puts, which signal it themselves) is skipped.
__device__ i64 signal_step(const u64* peers, int num_ranks, int me, i64 signal_offset, i64* step, int kind,
                           const int* counts, i64 counts_offset, int count_words) {
    const i64 seq = step[0] + 1;
    __syncthreads();
    if (threadIdx.x == 0) step[0] = seq;
    if (counts)
        for (int i = threadIdx.x; i < num_ranks * count_words; i += blockDim.x) {
            const int r = i / count_words;
            if (!peers[r]) continue;
            volatile i64* block = (volatile i64*)(peers[r] + counts_offset) + ((seq & 1) * num_ranks + me) * count_words;
            block[i - r * count_words] = counts[i];
        }
    // every thread's count words before the barrier, so that the fence after it (cumulative) orders them before each
    // signal: a rank's words are stored by many threads, its signal by one
    __syncthreads();
    __threadfence_system();
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x)
        if (peers[r]) store_release_sys((i64*)(peers[r] + signal_offset) + me, seq << 2 | kind);
    return seq;
}

// The status record's sticky missing total, in thread 0 (0 elsewhere: only thread 0 uses it).
__device__ __forceinline__ i64 read_missing(const i64* status) {
    return threadIdx.x == 0 ? ((const volatile i64*)status)[1] : 0;
}
// The histogram bucket of a delay (module docstring): 0 for 0, 1 below 1024 ns, then two per octave.
__device__ __forceinline__ int wait_bucket(u64 delay) {
    if (delay == 0) return 0;
    const int e = 63 - __clzll((i64)delay);
    if (e < 10) return 1;
    const int b = 2 * (e - 10) + 2 + (int)((delay >> (e - 1)) & 1);
    return b < WAIT_BUCKETS - 1 ? b : WAIT_BUCKETS - 1;
}

// Rank s arrived when signal[s] == seq << 2 | kind (this step) or >= (seq + 1) << 2 (its next); it gave up
// when word 0 of its abort record (aborts, int64 [R][abort_words], or NULL) is set: then it is not waited for.
// status: [want, missing total (sticky), missing flag per rank (sticky), abort word 0 per rank]; the count
// words (counts_by_parity, or NULL: int64 [2][R][count_words], the step's parity) of a rank that did not
// arrive are zeroed so that later kernels see an empty, well-formed block. missing_before: in thread 0, the status
// record's missing total as read at the kernel's start (read_missing: a load over PCIe, issued before the signal so
// that its round trip overlaps the signal's stores and fence; only the end of a wait writes it, and waits run in
// stream order). A wait that starts with ranks missing (poisoned: an earlier wait of the step, e.g. a forwarded
// step's inbox wait, or of a step given up) waits for no one and zeroes every rank's count words, but flags no rank:
// the ranks named stay those that did not come. A poll loop spins SPIN_POLLS times, then backs off; the missing
// total (a read-modify-write of mapped host memory) and its system fence are paid only when a rank is missing. The
// clock (%globaltimer: a slow read) starts at a thread's first poll that finds a signal absent, so a wait whose peers
// all arrived reads none; the timeout counts from there. waits (int64 [R][WAIT_WORDS] or NULL): the per-peer delays
// (module docstring).
__device__ void wait_step(const i64* signals, int num_ranks, int me, i64 seq, int kind, u64 timeout_ns,
                          i64* status, i64 missing_before, i64* counts_by_parity, int count_words,
                          const i64* aborts, int abort_words, i64* waits) {
    const i64 want = seq << 2 | kind, ahead = (seq + 1) << 2;
    i64* counts = counts_by_parity ? counts_by_parity + (seq & 1) * num_ranks * count_words : 0;
    __shared__ int missing;
    __shared__ int poisoned;
    __shared__ u64 longest;  // the longest non-zero delay of this wait
    if (threadIdx.x == 0) {
        missing = 0;
        poisoned = missing_before > 0;
        longest = 0;
    }
    __syncthreads();
    u64 start = 0;  // this thread's first poll that found a signal absent (0: none yet)
    for (int s = threadIdx.x; s < num_ranks; s += blockDim.x) {
        bool arrived = false;
        int polls = 0;
        unsigned pause = 32;
        while (!poisoned) {
            const i64 v = load_acquire_sys(signals + s);
            if (v == want || v >= ahead) { arrived = true; break; }
            if (aborts && load_acquire_sys(aborts + (i64)s * abort_words) != 0) break;
            const u64 now = global_ns();
            if (!start) start = now;
            else if (now - start > timeout_ns) break;
            if (++polls > SPIN_POLLS) {  // most peers arrive within a few microseconds: spin first
                __nanosleep(pause);
                if (pause < 256) pause *= 2;  // a signal is seen within ~0.3 us: decode steps last tens of us
            }
        }
        if (waits && s != me) {
            i64* row = waits + (i64)s * WAIT_WORDS;
            if (arrived) {
                u64 delay = 0;
                if (polls) {
                    delay = global_ns() - start;
                    if (delay == 0) delay = 1;
                    atomicMax(&longest, delay);
                }
                row[WAIT_STEPS] += 1;
                row[WAIT_TOTAL] += (i64)delay;
                if ((i64)delay > row[WAIT_MAX]) row[WAIT_MAX] = (i64)delay;
                row[WAIT_HIST + wait_bucket(delay)] += 1;
                row[WAIT_RECENT] = (i64)delay;
            } else {
                row[WAIT_RECENT] = 0;
            }
        }
        if (!arrived) {
            if (!poisoned) {  // a poisoned wait waited for no one: the wait that found a rank missing flagged it
                atomicAdd(&missing, 1);
                ((volatile i64*)status)[2 + s] = 1;
            }
            if (counts)
                for (int w = 0; w < count_words; ++w) ((volatile i64*)counts)[s * count_words + w] = 0;
        }
        if (aborts) ((volatile i64*)status)[2 + num_ranks + s] = load_acquire_sys(aborts + (i64)s * abort_words);
    }
    __syncthreads();
    if (waits && longest)  // the peers this wait waited for longest (each thread its own rows, as above)
        for (int s = threadIdx.x; s < num_ranks; s += blockDim.x)
            if (s != me && waits[(i64)s * WAIT_WORDS + WAIT_RECENT] == (i64)longest)
                waits[(i64)s * WAIT_WORDS + WAIT_LAST] += 1;
    if (threadIdx.x == 0) {
        if (missing) {
            ((volatile i64*)status)[1] += missing;
            __threadfence_system();
        }
        ((volatile i64*)status)[0] = want;
    }
}

// One CTA: the step's signal to every rank (peer stores), then the bounded wait for every rank's signal.
extern "C" __global__ void signal_and_wait(const u64* peers, int num_ranks, int me, i64 signal_offset, i64* step,
                                           int kind, const int* counts, i64 counts_offset, int count_words,
                                           const i64* signals, u64 timeout_ns, i64* status, i64* counts_by_parity,
                                           const i64* aborts, int abort_words, i64* waits) {
    const i64 missing_before = read_missing(status);
    const i64 seq = signal_step(peers, num_ranks, me, signal_offset, step, kind, counts, counts_offset, count_words);
    wait_step(signals, num_ranks, me, seq, kind, timeout_ns, status, missing_before, counts_by_parity, count_words,
              aborts, abort_words, waits);
}

// One CTA: the step's signal to every rank (peer stores) without a wait: the send half of a split step, whose
// receive half launches wait_signals.
extern "C" __global__ void send_signal(const u64* peers, int num_ranks, int me, i64 signal_offset, i64* step,
                                       int kind, const int* counts, i64 counts_offset, int count_words) {
    signal_step(peers, num_ranks, me, signal_offset, step, kind, counts, counts_offset, count_words);
}

// One CTA: the bounded wait alone, for the step the counter holds (after send_signal: a split step, or puts).
extern "C" __global__ void wait_signals(const i64* signals, int num_ranks, int me, const i64* step, int kind,
                                        u64 timeout_ns, i64* status, i64* counts_by_parity, int count_words,
                                        const i64* aborts, int abort_words, i64* waits) {
    wait_step(signals, num_ranks, me, step[0], kind, timeout_ns, status, read_missing(status), counts_by_parity,
              count_words, aborts, abort_words, waits);
}
"""
