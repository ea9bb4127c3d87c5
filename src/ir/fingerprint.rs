//! Stable structural fingerprints of graphs: the compile-cache key.

use super::{Graph, NodeId};
use std::collections::HashMap;
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
pub(crate) struct StableHasher(blake3::Hasher);

impl StableHasher {
    pub(crate) fn new() -> Self {
        StableHasher(blake3::Hasher::new())
    }
    pub(crate) fn finish256(&self) -> [u8; 32] {
        *self.0.finalize().as_bytes()
    }
}

impl Hasher for StableHasher {
    fn finish(&self) -> u64 {
        let b = self.finish256();
        u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
    // Fixed-width encodings: `usize` hashes as 8 bytes everywhere.
    fn write_usize(&mut self, i: usize) {
        self.0.update(&(i as u64).to_le_bytes());
    }
}

impl Graph {
    /// The graph's structural fingerprint.
    pub fn fingerprint(&self) -> Fingerprint {
        let mut h = StableHasher::new();
        "kiln-graph-v1".hash(&mut h);
        let order = self.topo_order();
        // Canonical numbering: position in the deterministic topological order.
        let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        order.len().hash(&mut h);
        for &id in &order {
            let n = self.node(id);
            n.op.hash(&mut h);
            n.ty.hash(&mut h);
            n.operands.len().hash(&mut h);
            for o in &n.operands {
                pos[o].hash(&mut h);
            }
        }
        self.inputs().len().hash(&mut h);
        for i in self.inputs() {
            i.kind.hash(&mut h);
            i.ty.hash(&mut h);
            pos[&i.node].hash(&mut h);
        }
        self.outputs().len().hash(&mut h);
        for o in self.outputs() {
            pos[o].hash(&mut h);
        }
        self.aliases().hash(&mut h);
        Fingerprint(h.finish256())
    }
}
