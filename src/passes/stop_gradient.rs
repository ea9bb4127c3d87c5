//! Removing [`Op::StopGradient`] once a graph is differentiated.

use super::Pass;
use crate::error::Result;
use crate::ir::{Graph, Op};

/// Replaces every [`Op::StopGradient`] by its operand. Run after autograd (which needs them)
/// and on graphs that are not differentiated, so that backends and the XLA backend's pattern
/// matchers (a softmax's detached maximum, for one) see the plain ops.
pub struct StripStopGradients;

impl Pass for StripStopGradients {
    fn name(&self) -> &'static str {
        "strip-stop-gradients"
    }

    fn run(&self, graph: &mut Graph) -> Result<bool> {
        super::bypass(graph, |op| matches!(op, Op::StopGradient))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, InputKind, TensorType, UnaryOp};

    #[test]
    fn a_stop_gradient_becomes_its_operand() {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [2]));
        let e = g.add(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
        let s = g.add(Op::StopGradient, &[e]).unwrap();
        let y = g.add(Op::Unary(UnaryOp::Neg), &[s]).unwrap();
        // Also a graph output itself.
        g.set_outputs(vec![y, s]).unwrap();
        assert!(StripStopGradients.run(&mut g).unwrap());
        assert_eq!(g.node(y).operands.as_slice(), &[e]);
        assert_eq!(g.outputs(), &[y, e]);
        assert!(!g
            .petgraph()
            .node_indices()
            .any(|n| g.node(n).op == Op::StopGradient));
        assert!(!StripStopGradients.run(&mut g).unwrap());
        g.verify().unwrap();
    }
}
