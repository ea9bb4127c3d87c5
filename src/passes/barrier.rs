//! Removing ordering barriers ([`Op::Barrier`]) for backends that cannot keep them.

use super::Pass;
use crate::error::Result;
use crate::ir::{Graph, Op};

/// Replaces every [`Op::Barrier`] by its first operand: the values are unchanged, only the
/// order the barrier stated is dropped. The XLA backend runs it where kiln's kernels (which
/// carry the ordering call) are not in the plugin.
pub struct StripBarriers;

impl Pass for StripBarriers {
    fn name(&self) -> &'static str {
        "strip-barriers"
    }

    fn run(&self, graph: &mut Graph) -> Result<bool> {
        super::bypass(graph, |op| matches!(op, Op::Barrier))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, InputKind, TensorType, UnaryOp};

    #[test]
    fn a_barrier_becomes_its_first_operand() {
        let mut g = Graph::new();
        let t = TensorType::new(DType::F32, [3]);
        let p = g.add_input(InputKind::Parameter, "p", t.clone());
        let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F64, [2]));
        let e = g.add(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
        let b = g.add(Op::Barrier, &[p, e]).unwrap();
        let y = g.add(Op::Unary(UnaryOp::Neg), &[b]).unwrap();
        g.set_outputs(vec![y, e]).unwrap();
        assert!(StripBarriers.run(&mut g).unwrap());
        assert_eq!(g.node(y).operands.as_slice(), &[p]);
        assert!(!g
            .petgraph()
            .node_indices()
            .any(|n| g.node(n).op == Op::Barrier));
        assert!(!StripBarriers.run(&mut g).unwrap());
        g.verify().unwrap();
    }
}
