//! Peak memory of one call, for the table's `compression` column (torchbench.py's
//! `compression_ratio = eager peak memory / compiled peak memory`).
//!
//! torchbench.py reads CUDA's allocator statistics. On the CPU neither side has such a
//! counter (libtorch's CPU allocator and the XLA CPU plugin both allocate with `malloc`), so
//! the harness measures what the operating system sees: the **growth of the resident set
//! during one call** over the resident set just before it. Before the call, `malloc_trim(0)`
//! returns the memory freed by earlier calls to the system (otherwise a second call reuses the
//! first's pages and would measure nothing), and writing `5` to `/proc/self/clear_refs`
//! resets the kernel's high-water mark (`VmHWM`) to the current resident set. After the call,
//! `VmHWM - VmRSS(before)` is the memory the call touched beyond what was already resident:
//! intermediates, workspaces and outputs. Parameters, optimizer state and cached executables
//! were resident before and are counted on neither side.
//!
//! The measure is page-granular (4 KiB) and process-wide: it is taken outside the timed
//! repetitions, one contender at a time. Where the kernel interfaces are missing (not Linux,
//! or `/proc/self/clear_refs` not writable) the column stays empty.

use std::fs;

/// A kernel `/proc/self/status` field in bytes (`VmRSS:   1234 kB`).
fn status_bytes(field: &str) -> Option<u64> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line[field.len()..]
        .trim_start_matches(':')
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Returns freed heap memory to the system (glibc). Other C libraries: nothing to do.
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks and shrinks glibc's own arenas; it takes their locks and
    // is safe to call at any time from any thread.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Runs `f` and returns its result with the peak resident-set growth during it in bytes
/// (`None` where the system cannot measure it; see the module docs).
pub(crate) fn peak_growth<R>(f: impl FnOnce() -> R) -> (R, Option<u64>) {
    trim_heap();
    let reset = fs::write("/proc/self/clear_refs", "5").is_ok();
    let before = status_bytes("VmRSS");
    let out = f();
    let peak = status_bytes("VmHWM");
    let growth = match (reset, before, peak) {
        (true, Some(b), Some(p)) => Some(p.saturating_sub(b)),
        _ => None,
    };
    (out, growth)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sees_a_touched_allocation_and_not_an_untouched_one() {
        let size = 64 << 20;
        let (_, untouched) = peak_growth(|| std::hint::black_box(Vec::<u8>::with_capacity(size)));
        let (_, touched) = peak_growth(|| std::hint::black_box(vec![1u8; size]).len());
        let (Some(untouched), Some(touched)) = (untouched, touched) else {
            eprintln!("peak memory not measurable here (no writable /proc/self/clear_refs)");
            return;
        };
        // 64 MiB written: the growth is at least that (page tables and the allocator's own
        // pages add a little); reserved but untouched pages are not resident.
        assert!(touched >= size as u64, "touched {touched}");
        assert!(touched < 2 * size as u64, "touched {touched}");
        assert!(untouched < (size / 8) as u64, "untouched {untouched}");
    }
}
