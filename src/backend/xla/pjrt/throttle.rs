//! Tells libgomp that XLA's workers share the CPUs while an execution with kernels runs.
//!
//! Why: a handed-over kernel runs in the serving thread's OpenMP team (see
//! [`handoff`](super::handoff)). After each parallel region the team's threads spin for the
//! next one, for milliseconds (libgomp's default spin count), on the CPUs that XLA's workers
//! need for the fusions between kernels. libgomp shortens that spin to ~100 rounds once it
//! manages more threads than there are CPUs, but XLA's workers are not its threads, so it
//! never sees the machine as oversubscribed. While an execution with kernels is served, a
//! kiln-owned thread holds a second, idle OpenMP team of two, which makes libgomp count one
//! thread more than the CPUs: every team's spin is then throttled. When the last such
//! execution's wait ends, the team is released (synchronously: the process's own libtorch
//! code after kiln's call gets libgomp's full spin back, as if kiln were not linked).
//!
//! The cost: inside a kernel, the team's other thread now sleeps between the kernel's
//! parallel regions (oneDNN's reorders, the convolution, the copy into XLA's buffer), and each
//! region wakes it. Where the kernels are fast (oneDNN with AVX-512) that cost outweighs the
//! CPU time the throttle frees for XLA, so the throttle is on by default only without
//! AVX-512 ([`default_wanted`]; measurements at `kernels::set_spin_throttle`).

use super::handoff::{omp_pause_resource_all, PauseAll};
use crate::backend::xla::kernels::onednn_avx512;
use parking_lot::{Condvar, Mutex};
use std::ffi::{c_uint, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// libgomp's entry points used here.
struct Gomp {
    /// `void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags)`
    parallel: unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint),
    /// `omp_pause_resource_all`, which ends the team.
    pause_all: PauseAll,
}

fn gomp() -> Option<&'static Gomp> {
    static GOMP: OnceLock<Option<Gomp>> = OnceLock::new();
    GOMP.get_or_init(|| {
        let this = libloading::os::unix::Library::this();
        // SAFETY: the symbol, if present, is libgomp's with the signature of `Gomp::parallel`
        // (its ABI entry for `#pragma omp parallel` since GCC 4.9); the library is linked
        // into the process and never unloaded.
        let parallel = unsafe { *this.get(b"GOMP_parallel\0").ok()? };
        Some(Gomp {
            parallel,
            pause_all: omp_pause_resource_all()?,
        })
    })
    .as_ref()
}

extern "C" fn nothing(_: *mut c_void) {}

/// The holders of the throttle and the state of the idle team.
struct State {
    /// Serving waits that want the throttle now.
    holders: usize,
    /// Whether the idle team exists.
    team: bool,
    /// Whether the throttle thread is making or ending the team (the lock released).
    changing: bool,
    /// Whether the thread that owns the team was started.
    started: bool,
}

struct Throttle {
    state: Mutex<State>,
    /// Signalled on every change of `holders` or `team`.
    changed: Condvar,
}

static THROTTLE: Throttle = Throttle {
    state: Mutex::new(State {
        holders: 0,
        team: false,
        changing: false,
        started: false,
    }),
    changed: Condvar::new(),
};

/// Whether [`hold`] throttles: initially as the environment says (`KILN_OMP_THROTTLE=on` or
/// `off`, also `1` / `0`), else [`default_wanted`].
static WANTED: OnceLock<AtomicBool> = OnceLock::new();

fn wanted() -> &'static AtomicBool {
    WANTED.get_or_init(|| {
        let env = std::env::var("KILN_OMP_THROTTLE").ok();
        AtomicBool::new(setting(env.as_deref()).unwrap_or_else(default_wanted))
    })
}

/// A `KILN_OMP_THROTTLE` value: `Some(on)`, or `None` (unset or not understood: the default).
fn setting(value: Option<&str>) -> Option<bool> {
    match value? {
        "off" | "0" => Some(false),
        "on" | "1" => Some(true),
        _ => None,
    }
}

/// The throttle's default: on unless oneDNN runs its AVX-512 kernels here
/// ([`onednn_avx512`]), where the wake-ups it adds inside each kernel cost more than it
/// frees (see the module notes).
fn default_wanted() -> bool {
    !onednn_avx512()
}

/// Turns the throttle on or off for the process (see `kernels::set_spin_throttle`).
pub(crate) fn set_wanted(on: bool) {
    wanted().store(on, Ordering::Relaxed);
}

/// Whether [`hold`] throttles.
pub(crate) fn is_wanted() -> bool {
    wanted().load(Ordering::Relaxed)
}

/// Holds the throttle until dropped ([`hold`]).
pub(crate) struct Hold(bool);

/// Throttles libgomp's spinning until the returned guard drops; nothing where libgomp is
/// not in the process or the throttle is off.
pub(crate) fn hold() -> Hold {
    if !is_wanted() {
        return Hold(false);
    }
    hold_team()
}

/// [`hold`], whatever [`is_wanted`] says.
fn hold_team() -> Hold {
    if gomp().is_none() {
        return Hold(false);
    }
    let mut s = THROTTLE.state.lock();
    s.holders += 1;
    if !s.started {
        s.started = true;
        let spawned = std::thread::Builder::new()
            .name("kiln-omp-throttle".into())
            .spawn(own_team);
        if spawned.is_err() {
            s.holders -= 1;
            s.started = false;
            return Hold(false);
        }
    }
    THROTTLE.changed.notify_all();
    Hold(true)
}

impl Drop for Hold {
    fn drop(&mut self) {
        if !self.0 {
            return;
        }
        let mut s = THROTTLE.state.lock();
        s.holders -= 1;
        THROTTLE.changed.notify_all();
        // Wait for the team's end, so that whatever this thread runs next spins in full.
        while s.holders == 0 && (s.team || s.changing) {
            THROTTLE.changed.wait(&mut s);
        }
    }
}

/// The throttle thread: makes its idle team while anyone holds the throttle, ends it when
/// nobody does.
fn own_team() {
    let Some(g) = gomp() else { return };
    let mut s = THROTTLE.state.lock();
    loop {
        if s.holders > 0 && !s.team {
            s.changing = true;
            drop(s);
            // SAFETY: a parallel region of two threads running an empty function: libgomp
            // makes this thread's team (one more thread), which stays docked afterwards.
            unsafe { (g.parallel)(nothing, std::ptr::null_mut(), 2, 0) };
            s = THROTTLE.state.lock();
            s.team = true;
            s.changing = false;
            THROTTLE.changed.notify_all();
        } else if s.holders == 0 && s.team {
            s.changing = true;
            drop(s);
            // SAFETY: called outside any parallel region; `omp_pause_soft` (1) ends this
            // thread's team only.
            unsafe { (g.pause_all)(1) };
            s = THROTTLE.state.lock();
            s.team = false;
            s.changing = false;
            THROTTLE.changed.notify_all();
        } else {
            THROTTLE.changed.wait(&mut s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_hold_makes_the_idle_team_and_its_release_ends_it() {
        if gomp().is_none() {
            return; // no libgomp in this process: nothing to throttle
        }
        let h = hold_team();
        assert!(h.0);
        let start = Instant::now();
        while !THROTTLE.state.lock().team {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the idle team was not made"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(h);
        // Other tests may hold it too; without holders the team must be gone already.
        let s = THROTTLE.state.lock();
        assert!(s.holders > 0 || (!s.team && !s.changing));
    }

    #[test]
    fn the_environment_overrides_the_default() {
        assert_eq!(setting(Some("off")), Some(false));
        assert_eq!(setting(Some("0")), Some(false));
        assert_eq!(setting(Some("on")), Some(true));
        assert_eq!(setting(Some("1")), Some(true));
        assert_eq!(setting(Some("maybe")), None);
        assert_eq!(setting(None), None);
        assert_eq!(default_wanted(), !onednn_avx512());
    }
}
