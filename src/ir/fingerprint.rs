//! Stable structural fingerprints of graphs: the compile-cache key.

use super::Graph;
use std::fmt;
use std::hash::{Hash, Hasher};

/// A 256-bit structural hash of a graph: ops, attributes, types, edges, input kinds and
/// order, outputs and aliases. Node ids and input names do not enter it, so two graphs built
/// the same way in two processes have the same fingerprint.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Lowercase hex.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Feeds `std::hash::Hash` impls into a 256-bit digest: XXH3-128 of the written bytes under
/// two seeds. Derived `Hash` impls write fixed-width little-endian integers on every platform
/// we target, and XXH3's output is specified, so the result is stable across runs.
///
/// The many small writes of a graph (a few bytes each) are gathered and hashed once at the
/// end. Trace-every-call fingerprints its graph on every call; BLAKE3 (the hash before) took
/// 8 % of the LinearModel's trace-every call in `perf`. The key needs no cryptographic
/// strength (graphs are not adversarial), only a negligible chance of collision: at least
/// that of one 128-bit XXH3; the second, differently seeded half fills the 256-bit
/// [`Fingerprint`] the caches are keyed by.
pub(crate) struct StableHasher {
    bytes: Vec<u8>,
}

/// The seeds of the digest's two halves.
const SEEDS: [u64; 2] = [0, 0x6b69_6c6e_2d66_7031]; // "kiln-fp1"

impl StableHasher {
    pub(crate) fn new() -> Self {
        StableHasher {
            bytes: Vec::with_capacity(4 << 10),
        }
    }
    pub(crate) fn finish256(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        for (half, seed) in out.chunks_exact_mut(16).zip(SEEDS) {
            let h = xxhash_rust::xxh3::xxh3_128_with_seed(&self.bytes, seed);
            half.copy_from_slice(&h.to_le_bytes());
        }
        out
    }
}

impl Hasher for StableHasher {
    fn finish(&self) -> u64 {
        let b = self.finish256();
        u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
    }
    fn write(&mut self, bytes: &[u8]) {
        self.bytes.extend_from_slice(bytes);
    }
    // Fixed-width encodings: `usize` hashes as 8 bytes everywhere.
    fn write_usize(&mut self, i: usize) {
        self.write(&(i as u64).to_le_bytes());
    }
}

impl Graph {
    /// The graph's structural fingerprint.
    pub fn fingerprint(&self) -> Fingerprint {
        let mut h = StableHasher::new();
        "kiln-graph-v1".hash(&mut h);
        let order = self.topo_order();
        // Canonical numbering: position in the deterministic topological order.
        let mut pos = vec![0usize; order.iter().map(|n| n.index() + 1).max().unwrap_or(0)];
        for (i, n) in order.iter().enumerate() {
            pos[n.index()] = i;
        }
        order.len().hash(&mut h);
        for &id in &order {
            let n = self.node(id);
            n.op.hash(&mut h);
            n.ty.hash(&mut h);
            n.operands.len().hash(&mut h);
            for o in &n.operands {
                pos[o.index()].hash(&mut h);
            }
        }
        self.inputs().len().hash(&mut h);
        for i in self.inputs() {
            i.kind.hash(&mut h);
            i.updated_between_calls.hash(&mut h);
            i.ty.hash(&mut h);
            pos[i.node.index()].hash(&mut h);
        }
        self.outputs().len().hash(&mut h);
        for o in self.outputs() {
            pos[o.index()].hash(&mut h);
        }
        self.aliases().hash(&mut h);
        Fingerprint(h.finish256())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The digest is that of the written byte stream (however it was split into writes):
    /// XXH3-128 of it under each seed, little-endian.
    #[test]
    fn digest_is_xxh3_of_the_byte_stream() {
        let bytes: Vec<u8> = (0..20_000).map(|i| (i * 31 % 251) as u8).collect();
        let mut whole = [0u8; 32];
        whole[..16].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(&bytes).to_le_bytes());
        whole[16..].copy_from_slice(
            &xxhash_rust::xxh3::xxh3_128_with_seed(&bytes, SEEDS[1]).to_le_bytes(),
        );
        for piece in [1, 8, 1000, bytes.len()] {
            let mut h = StableHasher::new();
            for chunk in bytes.chunks(piece) {
                h.write(chunk);
            }
            assert_eq!(h.finish256(), whole, "pieces of {piece} bytes");
        }
        let mut h = StableHasher::new();
        h.write_usize(7);
        let mut one = StableHasher::new();
        one.write(&7u64.to_le_bytes());
        assert_eq!(h.finish256(), one.finish256());
        assert_ne!(
            h.finish256()[..16],
            h.finish256()[16..],
            "the halves are seeded apart"
        );
    }
}
