//! How kernels share the cores: the kernel lock, libtorch's thread count inside kernels, and
//! counters of the kernels' time.
//!
//! Measured (`examples/ffi_profile.rs --e2e`, 2 vCPUs; [`stats`] gives the time inside the
//! kernels): with the lock and libtorch's default threads (2), with `--no-lock`, with
//! `--threads 1` and with `OMP_WAIT_POLICY=PASSIVE`, whole-model times of resnet18,
//! squeezenet1_1 and vit stayed within this machine's noise (~15 %) of each other; the lock
//! made kernels wait for each other for 4–15 % of resnet18's training step (its input and
//! weight gradients are independent, and XLA starts them together) without making the step
//! slower than running them at once. Under load from other processes, libtorch's OpenMP
//! teams of 2 stall at their barriers (a 100 µs kernel taking 14 ms), where 1 thread per
//! kernel stays stable: [`set_threads`]`(1)` is the setting for a shared machine.
//!
//! Inside an executable a kernel used to run 1.5–3× slower than the same kernel alone
//! (squeezenet's 1×1 512→1000: 0.33 ms alone, 1.1–1.4 ms inside): called on XLA's worker
//! threads, each kernel's OpenMP regions started a team per worker, and with more OpenMP
//! threads than CPUs libgomp throttles the spinning of every team. Kernels now run on the
//! thread that waits for the execution's results (the `pjrt::handoff` module), in its
//! existing team: resnet18 inference with every convolution a kernel ([`FfiMode::All`]),
//! 2-vCPU Xeon, three alternating runs of 40 calls: 21.6 / 15.9 / 17.0 ms a call in kernels
//! against 29.3 / 25.9 / 26.8 ms with `KILN_KERNEL_HANDOFF=off`.
//!
//! Kernels below [`local_max_flops`] (10 MFLOP) are not handed over: they run on the XLA
//! worker that calls them, with libtorch on one thread (handing over costs two thread
//! wake-ups, ~70 µs a call on a busy 2-vCPU machine; see `pjrt::handoff::run_kernel`).
//!
//! [`FfiMode::All`]: super::FfiMode::All

use crate::backend::xla::pjrt::handoff::{self, HANDOFF};
use crate::backend::xla::pjrt::throttle;
use parking_lot::{Mutex, MutexGuard};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

static THREADS: AtomicUsize = AtomicUsize::new(0);
static SERIALIZED: AtomicBool = AtomicBool::new(true);

thread_local! {
    /// The libtorch thread count last applied on this (XLA worker) thread; 0 = none.
    static APPLIED: Cell<usize> = const { Cell::new(0) };
}

/// Sets libtorch's intra-op thread count inside the kernels (0: libtorch's default, one per
/// core). Applied by each XLA worker thread before its next kernel, with
/// `at::set_num_threads`, which also changes the default of threads libtorch has not used
/// yet (process-wide).
pub fn set_threads(n: usize) {
    THREADS.store(n, Ordering::Relaxed);
}

/// The thread count set by [`set_threads`] (`None`: libtorch's default).
pub fn threads() -> Option<usize> {
    match THREADS.load(Ordering::Relaxed) {
        0 => None,
        n => Some(n),
    }
}

/// Whether XLA's worker threads hand kernel calls to the thread waiting for the execution's
/// results (default `true`, or `false` if the environment says `KILN_KERNEL_HANDOFF=off`;
/// see the module notes). `false` runs each kernel on the worker XLA called it from, with
/// libtorch's threads.
///
/// `false` can make kiln's own programs faster, at the cost of the process's other libtorch
/// work: each worker that runs a kernel starts an OpenMP team, and with more OpenMP threads
/// than CPUs libgomp shortens every team's spinning (its throttled spin count), eager's
/// too. Measured on a 2-vCPU Zen 2 with XLA's pool at 2 threads (one per CPU), harness
/// `--all`, two runs of each setting against three: inference 1.41× / 1.37× of eager against
/// 1.31–1.34× (bert 1.26× / 1.11×, vit 1.23× / 1.07×), training 1.34× / 1.36× split and
/// 1.41× / 1.48× fused against 1.24–1.30× and 1.34–1.39× (resnet50's split step 179–181
/// against 190–202 ms; bert's and vit's steps level or slower); eager timed alone, before any
/// compiled run, in both. But eager in the same process after compiled runs: mobilenet_v2
/// inference 12.7 ms alone, 17.1 ms after (14.2 ms with handing over;
/// `examples/eager_interference.rs`), and the harness's interleaved eager training steps
/// 70 / 72 ms geomean against 58 / 59 ms alone (with handing over 63–65 against 56–57;
/// inference 13.1 / 13.4 against 12.3 / 12.5, with handing over level). On by default so
/// that linking kiln does not slow a program's own libtorch code; a process that runs little
/// else may turn it off.
pub fn set_handoff(on: bool) {
    handoff::set_wanted(on);
}

/// Whether a thread serving a training program's kernels throttles libgomp's spinning
/// while it waits. The default: on where oneDNN has no AVX-512
/// ([`onednn_avx512`](super::onednn_avx512)), off where it has; `KILN_OMP_THROTTLE=on` or
/// `off` in the environment sets it either way.
///
/// Why: after each kernel the serving thread's OpenMP team spins for milliseconds waiting
/// for the next parallel region, on the CPUs XLA's workers need for the fusions between a
/// training program's kernels. libgomp cuts that spin to ~100 rounds once it manages more
/// threads than there are CPUs, but XLA's workers are not its threads. From the first kernel
/// a training program hands over until its results are ready, a kiln-owned thread holds an
/// idle OpenMP team of two, so libgomp counts one thread more than the CPUs; at the end the
/// team is ended before the wait returns, and the process's own libtorch code spins in full
/// again. Inference programs, whose kernels follow each other closely, are left alone, and
/// so is a serving thread whose kernels run on one OpenMP thread (`--threads 1`: no team to
/// throttle, and on one CPU the release would wait for the throttle thread).
///
/// Measured on a 2-vCPU Zen 2, harness `--training --all --mode once`, two alternating runs
/// each, geomean over eager (eager timed alone before any compiled run, 2 threads each
/// side), throttled / not: split 1.30 / 1.31 against 1.27 / 1.29, fused 1.41 / 1.45 against
/// 1.37 / 1.34; resnet18 split 1.17 / 1.22 against 1.10 / 1.12, resnet50 fused 0.94 / 0.94
/// against 0.86 / 0.86, resnext50_32x4d fused 0.87 / 0.88 against 0.81 / 0.83; bert level
/// (1.27 / 1.32 against 1.33 / 1.33 split). The harness's eager steps interleaved with the
/// compiled ones were level (resnet50 187 / 187 against 181 / 186 ms alone 166-176). With
/// every program throttled, inference `--all` was 1.30× / 1.30× against 1.33× / 1.34×.
///
/// The price is paid inside the kernels: the team's other thread sleeps after ~100 rounds,
/// so each of a kernel's parallel regions (a libtorch convolution runs four or five:
/// oneDNN's reorders, the convolution, the copy into XLA's buffer) wakes it. On a 2-vCPU
/// AMD EPYC Zen 4 (AVX-512) a libtorch parallel region took 23 µs back to back and 189 µs
/// after its team had slept 20 ms, and resnet18's 64-channel 3×3 convolution took ~700 µs
/// in the fused training step throttled against ~490 µs not (eager's own, cache flushed:
/// 495 µs). There the throttle made the CNNs' steps slower; same process, the two settings
/// alternated every 4 steps over 8–10 rounds, medians, throttled / not, split and fused,
/// ms: resnet18 60.0 / 59.1 and 57.0 / 49.9 (again: 56.3 / 50.0, 55.9 / 49.4), resnet50
/// in five processes 153.5 / 150.6 and 149.9 / 169.3, 154.8 / 137.9 and 150.7 / 139.0,
/// 144.9 / 132.1 and 146.6 / 130.5, 147.0 / 131.2 and 133.0 / 132.9, 149.2 / 137.4 and
/// 139.1 / 135.8, resnext50_32x4d 137.2 / 135.1 and 144.7 / 137.6, mobilenet_v2 29.8 /
/// 28.3 and 27.9 / 26.5, squeezenet1_1 13.4 / 13.0 and 12.3 / 12.6, mnasnet1_0 33.9 / 33.1
/// and 28.9 / 28.7; bert and vit level (51.2 / 51.0, 51.8 / 52.0; 44.7 / 44.8, 48.7 /
/// 48.7). Hence off where oneDNN runs its AVX-512 kernels, whose faster convolutions leave
/// less time for the CPU the throttle frees; the AVX2 default rests on the Zen 2 figures
/// above.
pub fn set_spin_throttle(on: bool) {
    throttle::set_wanted(on);
}

/// See [`set_spin_throttle`].
pub fn spin_throttle() -> bool {
    throttle::is_wanted()
}

/// Whether kernel calls are handed over (see [`set_handoff`]); `false` also while no
/// kernels are registered with a plugin.
pub fn handoff() -> bool {
    handoff::enabled()
}

/// When a thread waiting for an execution's results, having run kernels handed to it, stops
/// its OpenMP team ([`set_idle_pause`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdlePause {
    /// Never. The default.
    Never,
    /// After 200 µs without a kernel job where the thread's latest launch with convolutions or
    /// products was a training program's (one that computes gradients); never for the others
    /// (inference, whose kernels follow each other closely).
    Training,
    /// After this long without a kernel job, whatever the program.
    After(std::time::Duration),
}

/// Sets when a waiting thread stops its OpenMP team after running kernels (default
/// [`IdlePause::Never`]; `KILN_OMP_PAUSE_US` sets it too: µs, `off` or `training`).
///
/// Why: after a kernel, libgomp's team threads spin for milliseconds waiting for the next
/// parallel region (OpenMP's default wait policy), on the CPUs XLA's workers need for the
/// elementwise work between kernels (perf of a mobilenet_v2 training loop on 2 vCPUs: 34 % of
/// samples in libgomp's spin; of vit's fused step with every product a kernel, on a Zen 2,
/// 20 % in the team thread's spin). A waiting thread that has run kernels and then gets no job
/// for this long calls `omp_pause_resource_all`, which ends its team's threads; the next kernel
/// starts new ones, whose per-thread state (oneDNN's scratchpads among it) is made anew.
/// Measured on a 2-vCPU Zen 5, interleaved in one process, never / after 300 µs: fused
/// training steps of squeezenet1_1 18.6 / 17.5 and 19.9 / 16.2 ms, mobilenet_v2 75.2 / 66.7
/// and 70.8 / 64.2, resnet18 64.5 / 67.2 and 68.7 / 67.6; but inference, where kernels
/// follow each other closely (the harness, two runs each): geomean over squeezenet1_1,
/// mnasnet1_0 and vit 1.38× / 0.86× and 1.33× / 0.96× of eager; hence [`IdlePause::Training`].
/// Not the default, as the measurements disagree: on a 2-vCPU Zen 2, alternating processes
/// of 10 steps, split / fused ms, never against after 200 µs: resnet18 89.1 / 91.5 and
/// 92.7 / 101.8 against 84.2 / 80.6 and 85.8 / 84.0; resnet50 186.6 / 200.3 and 197.2 /
/// 213.2 against 184.1 / 192.0 and 190.1 / 196.5; resnext50_32x4d 214.2 / 237.0 and 227.5 /
/// 250.5 against 201.1 / 212.1 and 203.9 / 210.9; mobilenet_v2 and squeezenet1_1 level; but
/// two alternating harness runs of four training models there, [`IdlePause::Training`] /
/// never, geomean split / fused: 0.85 / 0.83 against 0.92 / 0.93, then 0.97 / 0.94 against
/// 0.90 / 0.90 (each model moving up to 30 % between runs either way), and on a Xeon a
/// 300 µs pause in training, harness, six models: 0.90 / 0.87 against 0.93 / 0.91. Later on
/// the Zen 2 (grouped convolutions as kiln's own loops), [`IdlePause::Training`] / never:
/// `--training --all`, two runs against three, geomean split 1.24, 1.20 against 1.19, 1.23,
/// 1.22, fused 1.33, 1.32 against 1.29, 1.31, 1.31; five CNNs in two alternating pairs,
/// fused: resnet50 0.85, 0.83 against 0.76, 0.81, resnext50_32x4d 0.79, 0.88 against 0.76,
/// 0.78, resnet18 1.12, 1.12 against 1.05, 1.08, mobilenet_v2 and mnasnet1_0 level. Still
/// not the default: the gain is within what this machine moves between runs but for the
/// two ResNet-50s, and the Xeon's figures went the other way.
pub fn set_idle_pause(pause: IdlePause) {
    let us = match pause {
        IdlePause::Never => u64::MAX,
        IdlePause::Training => handoff::PAUSE_TRAINING,
        IdlePause::After(d) => d.as_micros().min(handoff::PAUSE_TRAINING as u128 - 1) as u64,
    };
    handoff::IDLE_PAUSE_US.store(us, Ordering::Relaxed);
}

/// See [`set_idle_pause`].
pub fn idle_pause() -> IdlePause {
    match handoff::IDLE_PAUSE_US.load(Ordering::Relaxed) {
        u64::MAX => IdlePause::Never,
        handoff::PAUSE_TRAINING => IdlePause::Training,
        us => IdlePause::After(std::time::Duration::from_micros(us)),
    }
}

/// How many CPUs this process may run on, as [`std::thread::available_parallelism`] first
/// reported it in the process (its CPU affinity and cgroup quota); `None` if it cannot tell.
/// Read once: the XLA backend's CPU client gets at most this many devices, hence this many
/// XLA worker threads (`XlaBackend::new`). kiln-bench's `--threads N` restricts the affinity
/// before any backend exists; a program that restricts its own should do so before creating
/// the XLA backend too.
pub fn process_cpus() -> Option<usize> {
    static CPUS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().ok().map(|n| n.get()))
}

/// Sets the size below which a kernel runs on the XLA worker thread that calls it, with
/// libtorch on one thread, instead of being handed to the thread waiting for the results
/// (floating-point operations, multiply-adds × 2; default 10 MFLOP, or
/// `KILN_LOCAL_KERNEL_FLOPS`; 0 hands every kernel over). Handing over costs two thread
/// wake-ups a call, which small kernels (depthwise convolutions, most of the mobile nets')
/// do not earn back from a second libtorch thread.
pub fn set_local_max_flops(flops: f64) {
    handoff::set_local_max_flops(flops);
}

/// See [`set_local_max_flops`].
pub fn local_max_flops() -> f64 {
    handoff::local_max_flops()
}

/// Whether kernels run one at a time (default `true`; see [`torch_lock`]).
pub fn set_serialized(on: bool) {
    SERIALIZED.store(on, Ordering::Relaxed);
}

/// See [`set_serialized`].
pub fn serialized() -> bool {
    SERIALIZED.load(Ordering::Relaxed)
}

/// Counters of the kernels' work since the process started (or [`reset_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelStats {
    /// Kernel calls.
    pub calls: u64,
    /// Nanoseconds spent running kernel bodies (libtorch work, lock held, and kiln's own
    /// depthwise convolutions).
    pub run_ns: u64,
    /// Nanoseconds spent waiting for the kernel lock.
    pub wait_ns: u64,
    /// Calls that XLA's worker threads handed to the thread waiting for the results (see
    /// the module docs).
    pub handed_over: u64,
}

static CALLS: AtomicU64 = AtomicU64::new(0);
static RUN_NS: AtomicU64 = AtomicU64::new(0);
static WAIT_NS: AtomicU64 = AtomicU64::new(0);
/// The handoff's count at the last [`reset_stats`].
static HANDED_BASE: AtomicU64 = AtomicU64::new(0);

/// The kernels' counters (for profiling: how much of an executable's time libtorch takes).
pub fn stats() -> KernelStats {
    KernelStats {
        calls: CALLS.load(Ordering::Relaxed),
        run_ns: RUN_NS.load(Ordering::Relaxed),
        wait_ns: WAIT_NS.load(Ordering::Relaxed),
        handed_over: HANDOFF.handed_over() - HANDED_BASE.load(Ordering::Relaxed),
    }
}

/// Zeroes the counters of [`stats`].
pub fn reset_stats() {
    CALLS.store(0, Ordering::Relaxed);
    RUN_NS.store(0, Ordering::Relaxed);
    WAIT_NS.store(0, Ordering::Relaxed);
    HANDED_BASE.store(HANDOFF.handed_over(), Ordering::Relaxed);
}

/// Held while one kernel runs: the kernel lock (when [`serialized`]) and the start time.
pub struct KernelGuard {
    _lock: Option<MutexGuard<'static, ()>>,
    start: Instant,
}

impl Drop for KernelGuard {
    fn drop(&mut self) {
        CALLS.fetch_add(1, Ordering::Relaxed);
        RUN_NS.fetch_add(self.start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// Counts one kernel that runs without libtorch (kiln's own loops: no thread setting, no
/// kernel lock) into [`stats`] when dropped.
pub(crate) fn own_kernel_guard() -> KernelGuard {
    KernelGuard {
        _lock: None,
        start: Instant::now(),
    }
}

/// Prepares the calling thread to run one kernel: applies [`set_threads`] and, when
/// [`serialized`], takes the process-wide kernel lock; the guard also counts the kernel's
/// time into [`stats`].
///
/// XLA's CPU runtime runs independent thunks concurrently on its worker threads (one per
/// core, see `XlaBackend::new`), so two custom calls can start at once. Each libtorch kernel
/// already spreads over all cores (OpenMP, one thread per core by default); two at once
/// would oversubscribe them with two OpenMP teams. With the lock, at most one libtorch kernel runs at a time.
pub fn torch_lock() -> KernelGuard {
    static LOCK: Mutex<()> = Mutex::new(());
    let n = THREADS.load(Ordering::Relaxed);
    if n != 0 && APPLIED.get() != n {
        tch::set_num_threads(n as i32);
        APPLIED.set(n);
    }
    let t = Instant::now();
    let lock = SERIALIZED.load(Ordering::Relaxed).then(|| LOCK.lock());
    let start = Instant::now();
    WAIT_NS.fetch_add((start - t).as_nanos() as u64, Ordering::Relaxed);
    KernelGuard { _lock: lock, start }
}
