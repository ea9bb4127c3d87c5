//! Packed weights kept across calls, and when they may be reused.
//!
//! The packed convolution ([`super::packed`]) needs its weight in oneDNN's blocked layout,
//! which takes longer to make than the convolution itself. Its weight is a function of
//! variables only (a frozen parameter, maybe scaled by BatchNorm's frozen statistics), so
//! the packed copy stays right for as long as those variables' device buffers hold the same
//! values. A kernel sees buffers only as addresses, so this module keys packed weights by the
//! addresses of the *source* buffers (the graph inputs the weight is computed from) plus a
//! digest of how it is computed from them, and it forgets a key as soon as one of its
//! addresses may come to hold something else.
//!
//! Why that is sound: the memory of a live PJRT buffer changes in two ways only, by donation
//! to an execution (which writes its output there) or by being freed and reused. So:
//!
//! - an address is *registered* by the buffer that owns it ([`register`], from
//!   `pjrt::Buffer::mark_weight_source`, before an execution that reads it as a variable);
//!   a kernel caches only under registered addresses, and packs afresh (uncached) otherwise;
//! - an address is *forgotten*, with every packed weight keyed by it, before its buffer is
//!   donated to an execution and before its buffer is destroyed ([`forget`]; the buffer
//!   records that it registered), so no packed weight outlives the values it was made from,
//!   and none can meet a later buffer at the same address;
//! - a registration carries a generation: a weight packed while its sources were forgotten
//!   (and maybe registered again, by a new buffer at the same address) is not stored.
//!
//! Cached weights take memory besides the variables themselves (one packed copy per weight
//! and convolution shape); they are freed with their source buffers, or by [`clear`].

use parking_lot::Mutex;
use smallvec::SmallVec;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use tch::Tensor;

/// What a packed weight is keyed by: a digest of the computation from the sources to the
/// packed weight (the graph's nodes, the convolution geometry, the input dims) and the
/// addresses of the sources, in the kernel's operand order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct WeightKey {
    pub digest: u64,
    pub sources: SmallVec<[usize; 4]>,
}

#[derive(Default)]
struct Registry {
    /// Registered addresses and the generation they were registered in.
    sources: HashMap<usize, u64>,
    packed: HashMap<WeightKey, Tensor>,
    /// The keys that name each address.
    by_source: HashMap<usize, Vec<WeightKey>>,
    next_generation: u64,
}

static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);
static UNCACHED: AtomicU64 = AtomicU64::new(0);
static PACKS: AtomicU64 = AtomicU64::new(0);

fn with<R>(f: impl FnOnce(&mut Registry) -> R) -> R {
    f(REGISTRY.lock().get_or_insert_with(Registry::default))
}

/// Registers `address` as the memory of a live buffer read as a variable.
pub(crate) fn register(address: usize) {
    with(|r| {
        if !r.sources.contains_key(&address) {
            r.next_generation += 1;
            let g = r.next_generation;
            r.sources.insert(address, g);
        }
    });
}

/// Forgets `address` and every packed weight keyed by it: its buffer is about to be donated
/// or destroyed.
pub(crate) fn forget(address: usize) {
    with(|r| {
        r.sources.remove(&address);
        for key in r.by_source.remove(&address).unwrap_or_default() {
            r.packed.remove(&key);
        }
    });
}

/// The generations of `key`'s sources, if all are registered.
fn generations(r: &Registry, key: &WeightKey) -> Option<SmallVec<[u64; 4]>> {
    key.sources
        .iter()
        .map(|a| r.sources.get(a).copied())
        .collect()
}

/// The packed weight for `key`: the cached one, or `pack()`'s, stored if every source address
/// is registered (and stayed so while packing).
pub(crate) fn get_or_pack(
    key: &WeightKey,
    pack: impl FnOnce() -> crate::Result<Tensor>,
) -> crate::Result<Tensor> {
    let before = with(|r| match r.packed.get(key) {
        Some(t) => Err(t.shallow_clone()),
        None => Ok(generations(r, key)),
    });
    let gens = match before {
        Err(hit) => return Ok(hit),
        Ok(g) => g,
    };
    let t = pack()?;
    PACKS.fetch_add(1, Ordering::Relaxed);
    let Some(gens) = gens else {
        UNCACHED.fetch_add(1, Ordering::Relaxed);
        return Ok(t);
    };
    with(|r| {
        if generations(r, key).as_ref() == Some(&gens) {
            for &a in &key.sources {
                let keys = r.by_source.entry(a).or_default();
                if !keys.contains(key) {
                    keys.push(key.clone());
                }
            }
            r.packed.insert(key.clone(), t.shallow_clone());
        } else {
            UNCACHED.fetch_add(1, Ordering::Relaxed);
        }
    });
    Ok(t)
}

/// Counters of the packed-weight cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WeightCacheStats {
    /// Packed weights held now.
    pub cached: usize,
    /// Source addresses registered now.
    pub sources: usize,
    /// Weights packed since the process started.
    pub packs: u64,
    /// Of those, the ones not kept (a source not registered, or forgotten while packing).
    pub uncached: u64,
}

/// The packed-weight cache's counters (see the module notes).
pub fn weight_cache_stats() -> WeightCacheStats {
    with(|r| WeightCacheStats {
        cached: r.packed.len(),
        sources: r.sources.len(),
        packs: PACKS.load(Ordering::Relaxed),
        uncached: UNCACHED.load(Ordering::Relaxed),
    })
}

/// Drops every packed weight (they are packed again on their next use); registrations stay.
pub fn clear_weight_cache() {
    with(|r| {
        r.packed.clear();
        r.by_source.clear();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(digest: u64, sources: &[usize]) -> WeightKey {
        WeightKey {
            digest,
            sources: sources.iter().copied().collect(),
        }
    }

    fn packed(v: f64) -> crate::Result<Tensor> {
        Ok(Tensor::from_slice(&[v]))
    }

    fn value(t: &Tensor) -> f64 {
        t.double_value(&[0])
    }

    // Addresses no buffer of the tests in this process has (the registry is process-wide).
    const A: usize = 0x7000_0000_0010;
    const B: usize = 0x7000_0000_0020;

    #[test]
    fn weights_are_kept_only_under_registered_sources_and_forgotten_with_them() {
        let k = key(1, &[A, B]);
        // Unregistered: packed every time.
        assert_eq!(value(&get_or_pack(&k, || packed(1.0)).unwrap()), 1.0);
        assert_eq!(value(&get_or_pack(&k, || packed(2.0)).unwrap()), 2.0);
        register(A);
        assert_eq!(value(&get_or_pack(&k, || packed(3.0)).unwrap()), 3.0);
        register(B);
        assert_eq!(value(&get_or_pack(&k, || packed(4.0)).unwrap()), 4.0);
        // Kept now.
        assert_eq!(value(&get_or_pack(&k, || packed(5.0)).unwrap()), 4.0);
        // Another digest over the same sources is another weight.
        assert_eq!(
            value(&get_or_pack(&key(2, &[A, B]), || packed(6.0)).unwrap()),
            6.0
        );
        // Forgetting one source drops both, and the source must be registered again.
        forget(B);
        assert_eq!(value(&get_or_pack(&k, || packed(7.0)).unwrap()), 7.0);
        assert_eq!(value(&get_or_pack(&k, || packed(8.0)).unwrap()), 8.0);
        register(B);
        assert_eq!(value(&get_or_pack(&k, || packed(9.0)).unwrap()), 9.0);
        assert_eq!(value(&get_or_pack(&k, || packed(10.0)).unwrap()), 9.0);
        forget(A);
        forget(B);
        assert_eq!(value(&get_or_pack(&k, || packed(11.0)).unwrap()), 11.0);
    }

    #[test]
    fn a_weight_packed_across_a_forget_is_not_kept() {
        const C: usize = 0x7000_0000_0030;
        let k = key(3, &[C]);
        register(C);
        let v = get_or_pack(&k, || {
            // The source's buffer is donated (and a new one registered at the same address)
            // while the old values are being packed.
            forget(C);
            register(C);
            packed(1.0)
        })
        .unwrap();
        assert_eq!(value(&v), 1.0);
        assert_eq!(value(&get_or_pack(&k, || packed(2.0)).unwrap()), 2.0);
        assert_eq!(value(&get_or_pack(&k, || packed(3.0)).unwrap()), 2.0);
        forget(C);
    }
}
