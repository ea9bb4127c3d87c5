//! Runtime counters and timers.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Live counters of a [`super::Runtime`] (atomic: readable from any thread while it runs).
#[derive(Debug, Default)]
pub struct Metrics {
    traces: AtomicU64,
    trace_nanos: AtomicU64,
    compiles: AtomicU64,
    compile_nanos: AtomicU64,
    cache_hits: AtomicU64,
    cache_misses: AtomicU64,
    disk_hits: AtomicU64,
    disk_writes: AtomicU64,
    disk_rejected: AtomicU64,
    executions: AtomicU64,
    h2d_transfers: AtomicU64,
    h2d_bytes: AtomicU64,
    h2d_reused: AtomicU64,
    d2h_transfers: AtomicU64,
    d2h_bytes: AtomicU64,
    syncs: AtomicU64,
    donated: AtomicU64,
}

/// A snapshot of [`Metrics`]. Counts are totals since the runtime was created; subtract two
/// snapshots ([`Stats::since`]) to measure an interval, e.g. one training step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Times Rust code was traced into a graph.
    pub traces: u64,
    /// Time spent tracing (and preparing the traced graph).
    pub trace_time: Duration,
    /// Backend compilations (cache misses everywhere).
    pub compiles: u64,
    /// Time spent compiling.
    pub compile_time: Duration,
    /// Executable lookups served from memory.
    pub cache_hits: u64,
    /// Executable lookups not in memory (then served from disk or compiled).
    pub cache_misses: u64,
    /// Executables loaded from the on-disk cache.
    pub disk_hits: u64,
    /// Executables written to the on-disk cache.
    pub disk_writes: u64,
    /// On-disk entries found corrupt or stale (then recompiled and rewritten).
    pub disk_rejected: u64,
    /// Executable runs.
    pub executions: u64,
    /// Host→device transfers.
    pub h2d_transfers: u64,
    /// Bytes moved host→device.
    pub h2d_bytes: u64,
    /// Of `h2d_transfers`, those served by the device buffer kept from the previous call
    /// with the same tensor, which reads the tensor's memory in place (no copy, no new
    /// buffer; see [`crate::CompiledFn::run`]).
    pub h2d_reused: u64,
    /// Device→host transfers.
    pub d2h_transfers: u64,
    /// Bytes moved device→host.
    pub d2h_bytes: u64,
    /// Times the host waited for the device (each device→host read is one).
    pub syncs: u64,
    /// Variable buffers that an execution consumed by donation (updated in place), as the
    /// backend reports it.
    pub donated: u64,
}

impl Stats {
    /// The difference `self - earlier`, counter by counter.
    pub fn since(&self, earlier: &Stats) -> Stats {
        Stats {
            traces: self.traces - earlier.traces,
            trace_time: self.trace_time.saturating_sub(earlier.trace_time),
            compiles: self.compiles - earlier.compiles,
            compile_time: self.compile_time.saturating_sub(earlier.compile_time),
            cache_hits: self.cache_hits - earlier.cache_hits,
            cache_misses: self.cache_misses - earlier.cache_misses,
            disk_hits: self.disk_hits - earlier.disk_hits,
            disk_writes: self.disk_writes - earlier.disk_writes,
            disk_rejected: self.disk_rejected - earlier.disk_rejected,
            executions: self.executions - earlier.executions,
            h2d_transfers: self.h2d_transfers - earlier.h2d_transfers,
            h2d_bytes: self.h2d_bytes - earlier.h2d_bytes,
            h2d_reused: self.h2d_reused - earlier.h2d_reused,
            d2h_transfers: self.d2h_transfers - earlier.d2h_transfers,
            d2h_bytes: self.d2h_bytes - earlier.d2h_bytes,
            syncs: self.syncs - earlier.syncs,
            donated: self.donated - earlier.donated,
        }
    }
}

impl std::fmt::Display for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "traces {} ({:.1} ms), compiles {} ({:.2} s), cache hits {} / misses {}, disk hits {} / writes {} / rejected {}, executions {}, h2d {} ({} B, {} reused), d2h {} ({} B), syncs {}, donated {}",
            self.traces,
            self.trace_time.as_secs_f64() * 1e3,
            self.compiles,
            self.compile_time.as_secs_f64(),
            self.cache_hits,
            self.cache_misses,
            self.disk_hits,
            self.disk_writes,
            self.disk_rejected,
            self.executions,
            self.h2d_transfers,
            self.h2d_bytes,
            self.h2d_reused,
            self.d2h_transfers,
            self.d2h_bytes,
            self.syncs,
            self.donated
        )
    }
}

fn add(c: &AtomicU64, v: u64) {
    c.fetch_add(v, Ordering::Relaxed);
}

impl Metrics {
    pub(crate) fn traced(&self, d: Duration) {
        add(&self.traces, 1);
        add(&self.trace_nanos, d.as_nanos() as u64);
    }
    pub(crate) fn compiled(&self, d: Duration) {
        add(&self.compiles, 1);
        add(&self.compile_nanos, d.as_nanos() as u64);
    }
    pub(crate) fn cache_hit(&self) {
        add(&self.cache_hits, 1);
    }
    pub(crate) fn cache_miss(&self) {
        add(&self.cache_misses, 1);
    }
    pub(crate) fn disk_hit(&self) {
        add(&self.disk_hits, 1);
    }
    pub(crate) fn disk_write(&self) {
        add(&self.disk_writes, 1);
    }
    pub(crate) fn disk_reject(&self) {
        add(&self.disk_rejected, 1);
    }
    pub(crate) fn executed(&self) {
        add(&self.executions, 1);
    }
    pub(crate) fn h2d(&self, bytes: usize) {
        add(&self.h2d_transfers, 1);
        add(&self.h2d_bytes, bytes as u64);
    }
    pub(crate) fn h2d_reused(&self) {
        add(&self.h2d_reused, 1);
    }
    pub(crate) fn d2h(&self, bytes: usize) {
        add(&self.d2h_transfers, 1);
        add(&self.d2h_bytes, bytes as u64);
        add(&self.syncs, 1);
    }
    pub(crate) fn synced(&self) {
        add(&self.syncs, 1);
    }
    pub(crate) fn donation(&self) {
        add(&self.donated, 1);
    }

    /// A consistent-enough snapshot of all counters.
    pub fn snapshot(&self) -> Stats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            traces: g(&self.traces),
            trace_time: Duration::from_nanos(g(&self.trace_nanos)),
            compiles: g(&self.compiles),
            compile_time: Duration::from_nanos(g(&self.compile_nanos)),
            cache_hits: g(&self.cache_hits),
            cache_misses: g(&self.cache_misses),
            disk_hits: g(&self.disk_hits),
            disk_writes: g(&self.disk_writes),
            disk_rejected: g(&self.disk_rejected),
            executions: g(&self.executions),
            h2d_transfers: g(&self.h2d_transfers),
            h2d_bytes: g(&self.h2d_bytes),
            h2d_reused: g(&self.h2d_reused),
            d2h_transfers: g(&self.d2h_transfers),
            d2h_bytes: g(&self.d2h_bytes),
            syncs: g(&self.syncs),
            donated: g(&self.donated),
        }
    }
}
