//! How many threads each side of the comparison runs on, and the process setup that makes
//! those numbers true: OpenMP's wait policy (set before libtorch's OpenMP starts) and the
//! CPU affinity that confines XLA's CPU threads.
//!
//! libtorch's intra-op threads are set directly (`tch::set_num_threads`). The XLA CPU plugin
//! has no thread-count option in its client-create options, and its intra-op pool does not
//! follow the CPU affinity either (xla-cpu-pjrt 0.0.1 starts 4 `tf_XLAEigen` threads on 2 vCPUs
//! with or without `--threads 1`, counted in /proc/PID/task). So `--threads N` restricts the
//! whole process to N CPUs (`sched_setaffinity`, inherited by every thread started later):
//! XLA's threads then share those N CPUs; both sides get N cores' worth of compute. Measured
//! (resnet18 inference, per-thread CPU ticks from /proc over 10 s on a loaded 2-vCPU machine):
//! the process used 0.59-0.71x of the CPU time it used without `--threads 1`, XLA's pool
//! threads included. Compiling with `xla_cpu_multi_thread_eigen=false` does not move XLA's
//! work off its pool on this plugin (its `tf_XLAEigen` threads kept accumulating CPU time), so
//! the harness does not rely on it.

use crate::error::{Error, Result};
use std::ffi::OsString;

/// Set in the environment of the re-executed harness so that it does not re-execute again.
const REEXEC_ENV: &str = "KILN_BENCH_REEXEC";

/// The OpenMP wait policy the harness runs libtorch under unless `OMP_WAIT_POLICY` is set.
///
/// With the default (active, spinning) policy, libtorch's OpenMP workers spin at each barrier
/// and stall whenever XLA's pool (or another process) holds a core: resnet18 eager at 2
/// threads interleaved with XLA on 2 cores measured 838 ms with `ACTIVE`, 22 ms with `PASSIVE`
/// (21 ms with no XLA in the process). Passive waiting sleeps instead of spinning.
pub const OMP_WAIT_POLICY: &str = "PASSIVE";

/// Re-executes the current binary with `OMP_WAIT_POLICY=PASSIVE` in its environment (and the
/// other `env` pairs), unless it was already re-executed or the user set `OMP_WAIT_POLICY`.
///
/// OpenMP runtimes read their environment once, when the library is loaded (libgomp in a
/// constructor), which happens before `main`; setting the variable later has no effect, hence
/// the re-exec. Returns only if no re-exec happened (or it failed, reported on stderr).
pub fn reexec_with_omp_policy(env: &[(&str, OsString)]) {
    if std::env::var_os(REEXEC_ENV).is_some() || std::env::var_os("OMP_WAIT_POLICY").is_some() {
        for (k, v) in env {
            std::env::set_var(k, v);
        }
        return;
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    use std::os::unix::process::CommandExt;
    let mut args = std::env::args_os();
    let mut cmd = std::process::Command::new(exe);
    if let Some(arg0) = args.next() {
        cmd.arg0(arg0);
    }
    cmd.args(args)
        .env("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
        .env(REEXEC_ENV, "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let e = cmd.exec();
    eprintln!("warning: could not re-execute with OMP_WAIT_POLICY={OMP_WAIT_POLICY}: {e}");
    for (k, v) in env {
        std::env::set_var(k, v);
    }
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
