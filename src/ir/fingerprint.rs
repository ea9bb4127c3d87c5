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

/// Feeds `std::hash::Hash` impls into BLAKE3. Derived `Hash` impls write fixed-width
/// little-endian integers on every platform we target, so the result is stable across runs.
///
/// The many small writes of a graph (a few bytes each) are gathered and handed to BLAKE3 in
/// large blocks: per-call overhead of `blake3::Hasher::update` made up most of a fingerprint,
/// which trace-every-call pays on every call. The digest is that of the same byte stream.
pub(crate) struct StableHasher {
    hasher: blake3::Hasher,
    pending: Vec<u8>,
}

/// Bytes gathered before they are hashed.
const PENDING_BYTES: usize = 16 << 10;

impl StableHasher {
    pub(crate) fn new() -> Self {
        StableHasher {
            hasher: blake3::Hasher::new(),
            pending: Vec::with_capacity(PENDING_BYTES),
        }
    }
    pub(crate) fn finish256(&self) -> [u8; 32] {
        let mut h = self.hasher.clone();
        h.update(&self.pending);
        *h.finalize().as_bytes()
    }
}

impl Hasher for StableHasher {
    fn finish(&self) -> u64 {
        let b = self.finish256();
        u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
    }
    fn write(&mut self, bytes: &[u8]) {
        if self.pending.len() + bytes.len() > PENDING_BYTES {
            self.hasher.update(&self.pending);
            self.pending.clear();
            if bytes.len() > PENDING_BYTES {
                self.hasher.update(bytes);
                return;
            }
        }
        self.pending.extend_from_slice(bytes);
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

    /// Gathering writes does not change the digest: it is BLAKE3 of the written bytes,
    /// whether they arrive in small pieces, straddle the gathering buffer or exceed it.
    #[test]
    fn gathered_writes_hash_like_one_update() {
        let bytes: Vec<u8> = (0..3 * PENDING_BYTES + 7)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let whole = *blake3::hash(&bytes).as_bytes();
        for piece in [
            1,
            8,
            1000,
            PENDING_BYTES - 1,
            PENDING_BYTES + 1,
            bytes.len(),
        ] {
            let mut h = StableHasher::new();
            for chunk in bytes.chunks(piece) {
                h.write(chunk);
            }
            assert_eq!(h.finish256(), whole, "pieces of {piece} bytes");
        }
        let mut h = StableHasher::new();
        h.write_usize(7);
        assert_eq!(h.finish256(), *blake3::hash(&7u64.to_le_bytes()).as_bytes());
    }
}
