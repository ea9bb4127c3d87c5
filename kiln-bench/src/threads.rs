//! How many threads each side of the comparison runs on, and the process setup that makes
//! those numbers true: OpenMP's wait policy (set before libtorch's OpenMP starts) and the
//! CPU affinity that confines XLA's CPU threads.
//!
//! libtorch's intra-op threads are set directly (`tch::set_num_threads`). The XLA CPU plugin
//! has no thread-count option in its client-create options: its intra-op pool gets one thread
//! per CPU the process may use or per device, whichever is more, and kiln's `XlaBackend` asks
//! for at most one device per CPU (before that, xla-cpu-pjrt 0.0.1's default 4 devices meant 4
//! `tf_XLAEigen` threads on 2 vCPUs, with or without `--threads 1`). So `--threads N`
//! restricts the whole process to N CPUs (`sched_setaffinity`, inherited by every thread
//! started later) before the client exists: XLA's pool then has N threads on those N CPUs;
//! both sides get N cores' worth of compute. Measured, with the 4-thread pool
//! (resnet18 inference, per-thread CPU ticks from /proc over 10 s on a loaded 2-vCPU machine):
//! the process used 0.59-0.71x of the CPU time it used without `--threads 1`, XLA's pool
//! threads included. Compiling with `xla_cpu_multi_thread_eigen=false` does not move XLA's
//! work off its pool on this plugin (its `tf_XLAEigen` threads kept accumulating CPU time), so
//! the harness does not rely on it.

use crate::error::{Error, Result};

// OpenMP's wait policy is left as libtorch's users run it (libgomp's default: spin a while
// at a barrier, then sleep) unless `OMP_WAIT_POLICY` is set. An earlier harness forced
// `PASSIVE` to keep eager's spinning workers from stalling XLA when the two alternated; on a
// 2-vCPU Zen 4 that made eager itself 1.5–3× slower (resnet18 18.0 vs 12.4 ms, mobilenet_v2
// 24.5 vs 7.8 ms, bert 16.9 vs 11.3 ms, batch 4), and the default policy's bounded spinning
// did not stall XLA (compiled resnet18 13.6 ms under `PASSIVE`, 13.9–15.6 ms under the
// default). Eager is timed both alone, before any compiled run, and interleaved with the
// compiled runs (see `runner::run`).

/// How many threads of this process are XLA CPU intra-op pool threads (named `tf_XLAEigen`
/// by TSL), counted in /proc/self/task; `None` where that cannot be read. Threads inherit
/// their creator's name, so with `KILN_KERNEL_HANDOFF=off` the OpenMP threads that kernels
/// start from XLA's workers count too.
pub fn xla_pool_threads() -> Option<usize> {
    let tasks = std::fs::read_dir("/proc/self/task").ok()?;
    let n = tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.contains("XLAEigen"))
        .count();
    Some(n)
}

/// The CPUs this thread may run on (new threads inherit the set).
pub fn allowed_cpus() -> Result<Vec<usize>> {
    // SAFETY: `cpu_set_t` is plain data for which all-zero is the empty set; the pointer is
    // valid for the call and the size is the set's.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(Error::Invalid(format!(
                "sched_getaffinity: {}",
                std::io::Error::last_os_error()
            )));
        }
        set
    };
    // SAFETY: `set` is an initialised cpu_set_t; the index is below CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Restricts this thread (and every thread it starts later: libtorch's OpenMP workers, XLA's
/// pool) to the first `n` of the CPUs it may run on. Call before libtorch runs a parallel op
/// and before the PJRT client is created.
pub fn limit_cpus(n: usize) -> Result<Vec<usize>> {
    let allowed = allowed_cpus()?;
    if n == 0 || n > allowed.len() {
        return Err(Error::Invalid(format!(
            "--threads {n}: this process may run on {} CPU(s) ({allowed:?})",
            allowed.len()
        )));
    }
    let keep = allowed[..n].to_vec();
    // SAFETY: as in `allowed_cpus`; every index is below CPU_SETSIZE.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in &keep {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(Error::Invalid(format!(
            "sched_setaffinity: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(keep)
}

/// The threads each side ran on, for the table header and the CSV.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Threads {
    /// libtorch's intra-op threads during the run.
    pub eager: usize,
    /// Was `eager` libtorch's own default (no `--threads`)?
    pub eager_default: bool,
    /// CPUs the process could run on when the run started (XLA's threads are confined to
    /// them).
    pub cpus: usize,
    /// `OMP_WAIT_POLICY` in the environment (libtorch's OpenMP barrier waiting), if set.
    pub omp_wait_policy: Option<String>,
}

impl Threads {
    /// The current process's state.
    pub fn current(eager_default: bool) -> Threads {
        Threads {
            eager: usize::try_from(tch::get_num_threads()).unwrap_or(0),
            eager_default,
            cpus: allowed_cpus().map(|c| c.len()).unwrap_or(0),
            omp_wait_policy: std::env::var("OMP_WAIT_POLICY").ok(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limiting_cpus_in_a_thread_is_inherited_and_reported() {
        let all = allowed_cpus().unwrap();
        assert!(!all.is_empty());
        std::thread::spawn(move || {
            let kept = limit_cpus(1).unwrap();
            assert_eq!(kept, all[..1]);
            let child = std::thread::spawn(allowed_cpus).join().unwrap().unwrap();
            assert_eq!(child, kept);
            assert!(limit_cpus(0).is_err());
            assert!(limit_cpus(all.len() + 1).is_err());
        })
        .join()
        .unwrap();
    }
}
