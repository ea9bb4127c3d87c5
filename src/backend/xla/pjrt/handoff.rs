//! Kernel work handed from XLA's worker threads to the thread waiting for the results.
//!
//! Why: kiln's FFI kernels call libtorch, whose OpenMP parallel regions start a thread team
//! per calling thread. Called from XLA's worker threads, each worker gets its own team, and
//! once libgomp manages more threads than there are CPUs it throttles every team's spinning
//! (about 100 spins instead of ~3 ms before sleeping): each parallel region then pays futex
//! wake-ups, inside the executable and in eager libtorch on the user's thread alike
//! (`examples/eager_interference.rs`). A thread that waits for an execution's results
//! ([`super::api::Event::wait`]) is idle anyway, and it already owns a team (the one eager
//! libtorch uses), so kernels run there: no extra teams, no throttling.
//!
//! How: while a thread waits for an event it *serves* ([`Handoff::serve_until`]): it runs
//! the jobs that handlers queue ([`Handoff::run`]) until the event's ready callback fires. A
//! handler hands its job over only if some thread is serving at that moment, and blocks until
//! that thread ran it; otherwise (the program runs on the caller's thread inside `Execute`,
//! or nobody waits) it runs the job itself. A serving thread leaves only with the queue
//! empty, checked under the same lock, so no job is stranded. A serving thread that ran jobs
//! and then waits longer than its idle pause for the next ends its OpenMP team, whose
//! threads would otherwise spin on the CPUs XLA's workers use (`kernels::set_idle_pause`; off
//! by default, or only while it waits for training programs, [`TeamUse`]).
//!
//! Small kernels are not handed over ([`run_kernel`]): they run where XLA calls them, with
//! libtorch on one thread, as the two wake-ups of a handover cost more than a second
//! libtorch thread gains them.

use parking_lot::{Condvar, Mutex, MutexGuard};
use std::any::Any;
use std::cell::Cell;
use std::collections::VecDeque;
use std::ffi::c_int;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::thread::{self, Thread};

/// One handed-over job: a closure on the handing thread's stack, and how its end is reported.
struct Job {
    /// The closure, its lifetime erased (see [`Handoff::run`]).
    task: NonNull<dyn FnMut() + 'static>,
    /// A panic of the closure, re-raised on the handing thread.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Set (release) once the closure has returned; the job may be freed right after.
    done: AtomicBool,
    /// The handing thread, unparked when `done` is set.
    waiter: Thread,
}

/// A queued job (a pointer to a [`Job`] on a blocked handler's stack).
struct JobRef(NonNull<Job>);

// SAFETY: the `Job` behind a `JobRef` stays alive and untouched by its owner (which is
// blocked in `run`) until `done` is set, and exactly one serving thread takes it from the
// queue and runs it; so moving the reference to that thread is sound.
unsafe impl Send for JobRef {}

struct Queue {
    /// Threads inside [`Handoff::serve_until`].
    serving: usize,
    jobs: VecDeque<JobRef>,
}

/// A queue of handed-over jobs and the threads serving it ([`HANDOFF`] is the process's).
pub(crate) struct Handoff {
    queue: Mutex<Queue>,
    /// Signalled when a job is queued or a served event becomes ready.
    wake: Condvar,
    /// Jobs run by a thread other than the one that queued them (for tests and profiles).
    handed: AtomicU64,
}

/// The process's handoff, served by waits on PJRT events once [`enable`] was called.
pub(crate) static HANDOFF: Handoff = Handoff::new();

/// Whether kiln's kernels are registered with a plugin (waits serve only then: without
/// them a plain await is the same and one call cheaper).
static REGISTERED: AtomicBool = AtomicBool::new(false);

/// Whether handing over is wanted ([`set_wanted`]; initially on unless the environment says
/// `KILN_KERNEL_HANDOFF=off`).
static WANTED: OnceLock<AtomicBool> = OnceLock::new();

fn wanted() -> &'static AtomicBool {
    WANTED.get_or_init(|| {
        let off = std::env::var("KILN_KERNEL_HANDOFF").is_ok_and(|v| v == "off" || v == "0");
        AtomicBool::new(!off)
    })
}

/// Notes that kernels are registered with a plugin: waits now serve (if wanted).
pub(crate) fn enable() {
    idle_pause_from_env();
    REGISTERED.store(true, Ordering::Relaxed);
}

/// Turns handing over on or off for the process (off: kernels run on XLA's worker threads,
/// each with libtorch's default threads, as before handing over existed; for comparisons).
pub(crate) fn set_wanted(on: bool) {
    wanted().store(on, Ordering::Relaxed);
}

/// Whether kernel jobs are handed to waiting threads (kernels registered, and wanted).
pub(crate) fn enabled() -> bool {
    REGISTERED.load(Ordering::Relaxed) && wanted().load(Ordering::Relaxed)
}

/// Runs a kernel job of about `flops` floating-point operations: a small one (below
/// [`local_max_flops`]) right here with libtorch on one thread ([`serial`]); a larger one
/// through [`HANDOFF`] when handing over is [`enabled`], else right here; on one thread if
/// `serial` (the program marked its kernels so, see `kernels::serial_kernels`).
///
/// Why small ones stay: handing a job over and back costs two thread wake-ups, which on a
/// busy 2-vCPU machine took ~70 µs a call (mobilenet_v2's fused training step: 52 kernel
/// calls, 18.8 ms in their bodies, 22.4 ms from call to return), and small convolutions gain
/// nothing from a second libtorch thread (a 144-channel depthwise 3×3 on 16×16: ~600 µs on
/// one thread or two).
pub(crate) fn run_kernel<R>(serial: bool, flops: f64, f: impl FnOnce() -> R) -> R {
    if flops < local_max_flops() {
        return self::serial(f);
    }
    let job = || if serial { self::serial(f) } else { f() };
    if enabled() {
        HANDOFF.run(job)
    } else {
        job()
    }
}

impl Handoff {
    pub(crate) const fn new() -> Handoff {
        Handoff {
            queue: Mutex::new(Queue {
                serving: 0,
                jobs: VecDeque::new(),
            }),
            wake: Condvar::new(),
            handed: AtomicU64::new(0),
        }
    }

    /// Jobs handed to a serving thread so far.
    pub(crate) fn handed_over(&self) -> u64 {
        self.handed.load(Ordering::Relaxed)
    }

    /// Runs `f` on a thread that is waiting in [`Handoff::serve_until`] if there is one, else
    /// on this thread; returns its result either way (a panic of `f` resumes here).
    ///
    /// On the thread that launched the execution (inside `PJRT_LoadedExecutable_Execute`,
    /// which runs small programs in place) `f` runs at once, with that thread's own libtorch
    /// threads. On another thread (one of XLA's workers) with nobody serving, `f` runs there
    /// with libtorch confined to that one thread ([`serial_libtorch_here`]), so that no
    /// OpenMP team is started for it.
    pub(crate) fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        if LAUNCHING.get() {
            return f();
        }
        let mut queue = self.queue.lock();
        if queue.serving == 0 {
            drop(queue);
            serial_libtorch_here();
            return f();
        }
        let mut f = Some(f);
        let mut out = None;
        let mut call = || {
            if let Some(f) = f.take() {
                out = Some(f());
            }
        };
        let task: NonNull<dyn FnMut() + '_> = NonNull::from(&mut call);
        // SAFETY: only the lifetime is changed. The closure is called at most once, by the
        // serving thread, before it sets `job.done`; this function does not return before
        // `done` is set, so everything the closure borrows outlives that call, and nothing
        // else touches the closure meanwhile (this thread is parked).
        let task: NonNull<dyn FnMut() + 'static> = unsafe { std::mem::transmute(task) };
        let job = Job {
            task,
            panic: Mutex::new(None),
            done: AtomicBool::new(false),
            waiter: thread::current(),
        };
        queue.jobs.push_back(JobRef(NonNull::from(&job)));
        drop(queue);
        self.wake.notify_all();
        while !job.done.load(Ordering::Acquire) {
            thread::park();
        }
        if let Some(p) = job.panic.lock().take() {
            resume_unwind(p);
        }
        self.handed.fetch_add(1, Ordering::Relaxed);
        match out {
            Some(r) => r,
            // `done` without a panic means the closure ran and wrote `out`.
            None => resume_unwind(Box::new("kiln: a handed-over kernel job did not run")),
        }
    }

    /// Serves queued jobs on this thread until `ready()` holds (checked under the queue's
    /// lock; whoever makes it true must call [`Handoff::notify`] afterwards).
    pub(crate) fn serve_until(&self, ready: impl Fn() -> bool) {
        let mut queue = self.queue.lock();
        queue.serving += 1;
        let mut ran = false;
        let mut throttle = None;
        loop {
            if let Some(job) = queue.jobs.pop_front() {
                if throttle.is_none() && TRAINING_LAUNCHED.get() && openmp_team_here() {
                    // Between a training program's kernels XLA's fusions need the CPUs
                    // (see `throttle`); taken at the first job, so programs whose kernels
                    // all stay on XLA's workers do not pay for the idle team, and only
                    // where this thread's kernels start a team (none on one thread: with
                    // `--threads 1` the throttle made mobilenet_v2's steps 1.35x -> 0.90x
                    // of eager, the release waiting for the throttle thread on the one CPU).
                    throttle = Some(super::throttle::hold());
                }
                MutexGuard::unlocked(&mut queue, || execute(job));
                ran = true;
                continue;
            }
            if ready() {
                break;
            }
            if ran {
                let us = idle_pause_us();
                if us < u64::MAX {
                    let timed_out = us == 0
                        || self
                            .wake
                            .wait_for(&mut queue, std::time::Duration::from_micros(us))
                            .timed_out();
                    if timed_out && queue.jobs.is_empty() && !ready() {
                        // Idle after kernels: stop this thread's OpenMP team spinning on the
                        // CPUs XLA's workers need (see `kernels::set_idle_pause`).
                        MutexGuard::unlocked(&mut queue, pause_openmp);
                        ran = false;
                    }
                    continue;
                }
            }
            self.wake.wait(&mut queue);
        }
        queue.serving -= 1;
        drop(queue);
        drop(throttle);
    }

    /// Wakes the serving threads to re-check their `ready` condition.
    pub(crate) fn notify(&self) {
        // Taking the lock orders this after a waiter's check-then-wait: no lost wake-up.
        drop(self.queue.lock());
        self.wake.notify_all();
    }

    #[cfg(test)]
    fn serving(&self) -> usize {
        self.queue.lock().serving
    }
}

thread_local! {
    /// Whether this thread is inside [`launching`].
    static LAUNCHING: Cell<bool> = const { Cell::new(false) };
    /// Whether [`serial_libtorch_here`] already ran on this thread.
    static SERIAL: Cell<bool> = const { Cell::new(false) };
    /// Whether the latest launch on this thread with convolutions or products was a training
    /// program's ([`TeamUse`]).
    static TRAINING_LAUNCHED: Cell<bool> = const { Cell::new(false) };
}

/// How an executable's kernels use the serving thread's OpenMP team, for the idle pause of
/// training programs ([`IdlePause::Training`](crate::backend::xla::kernels::IdlePause::Training)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TeamUse {
    /// No convolution or product: no kernel the launch could hand over; the thread keeps
    /// what its earlier launches said (a split training step's optimizer program).
    None,
    /// Kernels that follow each other closely (inference): the team keeps spinning.
    Spinning,
    /// A training program's kernels, between which XLA's fusions need the CPUs: the team
    /// pauses when idle.
    Pausing,
}

/// Runs `f` (a `PJRT_LoadedExecutable_Execute` call) with this thread marked as the one
/// launching executions: kernels XLA runs in place during the call run directly. `team`
/// (the executable's) sets whether this thread, serving afterwards, pauses its OpenMP team
/// when idle under `IdlePause::Training`.
pub(crate) fn launching<R>(team: TeamUse, f: impl FnOnce() -> R) -> R {
    match team {
        TeamUse::None => {}
        TeamUse::Spinning => TRAINING_LAUNCHED.set(false),
        TeamUse::Pausing => TRAINING_LAUNCHED.set(true),
    }
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            LAUNCHING.set(self.0);
        }
    }
    let _reset = Reset(LAUNCHING.replace(true));
    f()
}

/// Confines libtorch on this thread to one thread, once per thread: OpenMP's thread count
/// for parallel regions started here (`omp_set_num_threads`, a per-thread setting) and MKL's
/// (`MKL_Set_Num_Threads_Local`). libtorch first initialises a thread's count lazily on its
/// first parallel region, which would override the setting; asking for the count
/// (`at::get_num_threads`) does that initialisation first. Either function may be missing
/// (a libtorch without OpenMP or MKL); then nothing is set for it.
fn serial_libtorch_here() {
    if SERIAL.replace(true) {
        return;
    }
    let _ = tch::get_num_threads();
    let s = thread_setters();
    // SAFETY: the C functions of `thread_setters`; they only change this thread's settings.
    unsafe {
        if let Some(set) = s.omp_set {
            set(1);
        }
        if let Some(m) = s.mkl_local {
            m(1);
        }
    }
}

/// Do OpenMP parallel regions started on this thread run more than one thread?
fn openmp_team_here() -> bool {
    // SAFETY: libgomp's `omp_get_max_threads`, which reads only this thread's setting.
    thread_setters()
        .omp_get
        .is_some_and(|get| unsafe { get() } > 1)
}

/// libgomp's and MKL's per-thread thread-count setters, if this process has them.
struct ThreadSetters {
    omp_set: Option<unsafe extern "C" fn(c_int)>,
    omp_get: Option<unsafe extern "C" fn() -> c_int>,
    mkl_local: Option<unsafe extern "C" fn(c_int) -> c_int>,
}

fn thread_setters() -> &'static ThreadSetters {
    static SETTERS: OnceLock<ThreadSetters> = OnceLock::new();
    SETTERS.get_or_init(|| {
        let this = libloading::os::unix::Library::this();
        // SAFETY: the symbols, if present, are libgomp's `void omp_set_num_threads(int)` and
        // `int omp_get_max_threads(void)` and MKL's `int MKL_Set_Num_Threads_Local(int)`
        // (the C-style name; the lower-case `mkl_set_num_threads_local` is MKL's Fortran
        // entry, which takes a pointer); the pointers stay valid as the libraries are never
        // unloaded (they are linked into the process).
        unsafe {
            ThreadSetters {
                omp_set: this.get(b"omp_set_num_threads\0").ok().map(|f| *f),
                omp_get: this.get(b"omp_get_max_threads\0").ok().map(|f| *f),
                mkl_local: this.get(b"MKL_Set_Num_Threads_Local\0").ok().map(|f| *f),
            }
        }
    })
}

/// Runs `f` with libtorch confined to this thread (OpenMP and MKL), then restores this
/// thread's settings: the kernel then does not wake this thread's OpenMP team, whose threads
/// would spin for milliseconds afterwards on the CPUs XLA's workers need.
pub(crate) fn serial<R>(f: impl FnOnce() -> R) -> R {
    let _ = tch::get_num_threads();
    let s = thread_setters();
    // SAFETY: the C functions of `thread_setters`; they read only this thread's settings.
    let omp_prev = s.omp_get.map(|g| unsafe { g() });
    // SAFETY: as above; they change only this thread's settings (restored below).
    let mkl_prev = unsafe {
        if let Some(set) = s.omp_set {
            set(1);
        }
        s.mkl_local.map(|m| m(1))
    };
    struct Restore(Option<c_int>, Option<c_int>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let s = thread_setters();
            // SAFETY: as above.
            unsafe {
                if let (Some(set), Some(n)) = (s.omp_set, self.0) {
                    set(n);
                }
                if let (Some(m), Some(n)) = (s.mkl_local, self.1) {
                    m(n);
                }
            }
        }
    }
    let _restore = Restore(omp_prev, mkl_prev);
    f()
}

/// Kernels of fewer floating-point operations than this run where XLA calls them, on one
/// libtorch thread ([`run_kernel`]); `f64` bits. See `kernels::set_local_max_flops`.
static LOCAL_MAX_FLOPS: OnceLock<AtomicU64> = OnceLock::new();

fn local_max_flops_cell() -> &'static AtomicU64 {
    LOCAL_MAX_FLOPS.get_or_init(|| {
        let from_env = std::env::var("KILN_LOCAL_KERNEL_FLOPS")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| *v >= 0.0);
        AtomicU64::new(from_env.unwrap_or(DEFAULT_LOCAL_MAX_FLOPS).to_bits())
    })
}

/// The default of [`local_max_flops`]: 10 MFLOP. Measured on a 2-vCPU Xeon (AVX-512), the
/// harness with `--mode once`, two alternating runs each, speedup over eager at its default
/// threads, every kernel handed over / below 10 MFLOP local: training split / fused,
/// geomean of mobilenet_v2, mnasnet1_0, squeezenet1_1 and resnet18 0.75 / 0.79 and 0.71 /
/// 0.74 against 0.88 / 0.93 and 0.85 / 0.88 (mobilenet_v2 fused 0.71 and 0.67 against 0.87
/// and 0.86); inference, those four with bert and vit, 0.90 and 1.01 against 1.01 and 1.07
/// (squeezenet1_1 0.91 and 1.10 against 1.26 and 1.43). At 30 MFLOP instead of 10
/// (resnet50 added, two alternating runs): training 0.86 / 0.89 and 0.81 / 0.85 against
/// 0.88 / 0.91 and 0.85 / 0.88 (resnet18's and resnet50's 3×3 convolutions, 30-230 MFLOP,
/// gain from the second thread); inference of the five CNNs 1.28 and 1.23 against 1.10
/// and 1.12, with bert and vit 1.06 and 1.04 against 0.98 and 1.04 (bert's and vit's
/// attention calls, ~17 MFLOP, did worse local). 10 keeps training ahead; at 100 MFLOP
/// resnet18 and resnet50 inference fell to 0.63-0.71.
pub(crate) const DEFAULT_LOCAL_MAX_FLOPS: f64 = 1e7;

/// See [`LOCAL_MAX_FLOPS`].
pub(crate) fn local_max_flops() -> f64 {
    f64::from_bits(local_max_flops_cell().load(Ordering::Relaxed))
}

/// See [`LOCAL_MAX_FLOPS`].
pub(crate) fn set_local_max_flops(flops: f64) {
    local_max_flops_cell().store(flops.max(0.0).to_bits(), Ordering::Relaxed);
}

/// After how many µs without a job a serving thread that ran kernels stops its OpenMP team
/// (`u64::MAX`: never, the default; [`PAUSE_TRAINING`]: after [`TRAINING_PAUSE_US`] where the
/// thread's latest launch was a training program's, else never); see
/// `kernels::set_idle_pause`.
pub(crate) static IDLE_PAUSE_US: AtomicU64 = AtomicU64::new(u64::MAX);

/// [`IDLE_PAUSE_US`]'s value for a pause while serving training programs only.
pub(crate) const PAUSE_TRAINING: u64 = u64::MAX - 1;

/// The idle pause of a thread serving a training program's kernels under [`PAUSE_TRAINING`], µs.
pub(crate) const TRAINING_PAUSE_US: u64 = 200;

/// This thread's idle pause now, µs (`u64::MAX`: never).
fn idle_pause_us() -> u64 {
    pause_us(
        IDLE_PAUSE_US.load(Ordering::Relaxed),
        TRAINING_LAUNCHED.get(),
    )
}

/// The idle pause under `setting` (an [`IDLE_PAUSE_US`] value) of a thread whose latest launch
/// with products was a training program's (`training`) or not.
fn pause_us(setting: u64, training: bool) -> u64 {
    match setting {
        PAUSE_TRAINING if training => TRAINING_PAUSE_US,
        PAUSE_TRAINING => u64::MAX,
        us => us,
    }
}

/// Reads `KILN_OMP_PAUSE_US` (µs, `off`, the default, or `training`), once.
fn idle_pause_from_env() {
    static READ: OnceLock<()> = OnceLock::new();
    READ.get_or_init(|| {
        if let Ok(v) = std::env::var("KILN_OMP_PAUSE_US") {
            let us = if v.eq_ignore_ascii_case("off") {
                Some(u64::MAX)
            } else if v.eq_ignore_ascii_case("training") {
                Some(PAUSE_TRAINING)
            } else {
                v.parse::<u64>().ok().map(|u| u.min(PAUSE_TRAINING - 1))
            };
            if let Some(us) = us {
                IDLE_PAUSE_US.store(us, Ordering::Relaxed);
            }
        }
    });
}

/// libgomp's `int omp_pause_resource_all(omp_pause_resource_t kind)`.
pub(crate) type PauseAll = unsafe extern "C" fn(c_int) -> c_int;

/// [`PauseAll`], if libgomp is in the process (looked up once).
pub(crate) fn omp_pause_resource_all() -> Option<PauseAll> {
    static PAUSE: OnceLock<Option<PauseAll>> = OnceLock::new();
    *PAUSE.get_or_init(|| {
        let this = libloading::os::unix::Library::this();
        // SAFETY: the symbol, if present, is libgomp's `omp_pause_resource_all`, of type
        // `PauseAll`; the library is linked into the process and never unloaded.
        unsafe {
            this.get::<PauseAll>(b"omp_pause_resource_all\0")
                .ok()
                .map(|s| *s)
        }
    })
}

/// Ends this thread's OpenMP team (libgomp's `omp_pause_resource_all(omp_pause_soft)`),
/// so that its threads stop spinning; nothing if libgomp is not in the process.
fn pause_openmp() {
    if let Some(pause) = omp_pause_resource_all() {
        // SAFETY: `omp_pause_soft` is 1; the call is made outside any parallel region (a
        // serving thread between jobs), where it only releases this thread's thread pool.
        unsafe { pause(1) };
    }
}

/// Runs one queued job and reports its end to the thread that queued it.
fn execute(job: JobRef) {
    // SAFETY: see `JobRef`: the job is alive until `done` is set below, and this thread is
    // the only one running it.
    let job = unsafe { job.0.as_ref() };
    // SAFETY: the task pointer is valid until `done` is set (see `run`), and it is called
    // from this thread only.
    let r = catch_unwind(AssertUnwindSafe(|| unsafe { (*job.task.as_ptr())() }));
    if let Err(p) = r {
        *job.panic.lock() = Some(p);
    }
    let waiter = job.waiter.clone();
    // After this store the job may be freed: only the cloned handle is used below.
    job.done.store(true, Ordering::Release);
    waiter.unpark();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    /// A handoff with one thread serving it until the returned flag is set.
    fn served() -> (
        Arc<Handoff>,
        Arc<AtomicBool>,
        thread::JoinHandle<thread::ThreadId>,
    ) {
        let h = Arc::new(Handoff::new());
        let ready = Arc::new(AtomicBool::new(false));
        let (h2, r) = (h.clone(), ready.clone());
        let server = thread::spawn(move || {
            h2.serve_until(|| r.load(Ordering::Relaxed));
            thread::current().id()
        });
        while h.serving() == 0 {
            thread::sleep(Duration::from_millis(1));
        }
        (h, ready, server)
    }

    #[test]
    fn without_a_serving_thread_jobs_run_in_place() {
        let h = Handoff::new();
        let me = thread::current().id();
        assert_eq!(h.run(|| thread::current().id()), me);
        assert_eq!(h.handed_over(), 0);
    }

    #[test]
    fn jobs_run_on_the_serving_thread_and_return_their_results() {
        let (h, ready, server) = served();
        let workers: Vec<_> = (0..4)
            .map(|i| {
                let h = h.clone();
                thread::spawn(move || {
                    // The job borrows from this thread's stack.
                    let local = [1.5f64, 2.5, i as f64];
                    h.run(|| (thread::current().id(), local.iter().sum::<f64>()))
                })
            })
            .collect();
        let results: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
        ready.store(true, Ordering::Relaxed);
        h.notify();
        let server_id = server.join().unwrap();
        for (i, (id, v)) in results.iter().enumerate() {
            assert_eq!(*id, server_id);
            assert_eq!(*v, 4.0 + i as f64);
        }
        assert_eq!(h.handed_over(), 4);
    }

    #[test]
    fn jobs_after_a_long_wait_still_run_on_the_serving_thread() {
        let (h, ready, server) = served();
        let first = h.run(|| thread::current().id());
        // Longer than a training program's idle pause (which this server, having launched
        // nothing, would not take anyway): it keeps serving.
        thread::sleep(Duration::from_millis(5));
        let second = h.run(|| (0..1000).map(f64::from).sum::<f64>());
        ready.store(true, Ordering::Relaxed);
        h.notify();
        assert_eq!(server.join().unwrap(), first);
        assert_eq!(second, 499_500.0);
        assert_eq!(h.handed_over(), 2);
    }

    #[test]
    fn the_training_pause_follows_the_latest_launch_with_products() {
        // A thread of its own: the launch marks are per thread.
        thread::spawn(|| {
            let pause = || pause_us(PAUSE_TRAINING, TRAINING_LAUNCHED.get());
            assert_eq!(pause(), u64::MAX, "nothing launched yet");
            launching(TeamUse::Pausing, || ());
            assert_eq!(pause(), TRAINING_PAUSE_US);
            // A split step's optimizer program (no products) keeps the training mark.
            launching(TeamUse::None, || ());
            assert_eq!(pause(), TRAINING_PAUSE_US);
            launching(TeamUse::Spinning, || ());
            assert_eq!(pause(), u64::MAX);
            launching(TeamUse::None, || ());
            assert_eq!(pause(), u64::MAX);
            // The other settings hold whatever was launched.
            launching(TeamUse::Pausing, || ());
            assert_eq!(pause_us(u64::MAX, TRAINING_LAUNCHED.get()), u64::MAX);
            assert_eq!(pause_us(300, false), 300);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_panicking_job_resumes_on_the_handing_thread() {
        let (h, ready, server) = served();
        let h2 = h.clone();
        let worker =
            thread::spawn(move || catch_unwind(AssertUnwindSafe(|| h2.run(|| panic!("boom")))));
        let err = worker.join().unwrap().unwrap_err();
        assert_eq!(err.downcast_ref::<&str>(), Some(&"boom"));
        ready.store(true, Ordering::Relaxed);
        h.notify();
        server.join().unwrap();
        assert_eq!(h.serving(), 0);
    }
}
