//! Dead-code elimination.

use super::Pass;
use crate::error::Result;
use crate::ir::{Graph, NodeId, Op};
use std::collections::HashSet;

/// Removes nodes that no output depends on. Inputs are kept (their positions are part of the
/// graph's signature); removing unused inputs is the caller's decision
/// (`Graph::retain_inputs`, crate-internal).
pub struct Dce;

impl Dce {
    /// The nodes some output depends on.
    pub fn live(graph: &Graph) -> HashSet<NodeId> {
        let mut live = HashSet::new();
        let mut stack: Vec<NodeId> = graph.outputs().to_vec();
        while let Some(n) = stack.pop() {
            if live.insert(n) {
                stack.extend(graph.node(n).operands.iter().copied());
            }
        }
        live
    }
}

impl Pass for Dce {
    fn name(&self) -> &'static str {
        "dce"
    }

    fn run(&self, graph: &mut Graph) -> Result<bool> {
        let live = Self::live(graph);
        let mut changed = false;
        // Reverse topological order: users go before their operands.
        for id in graph.topo_order().into_iter().rev() {
            if !live.contains(&id) && !matches!(graph.node(id).op, Op::Input(_)) {
                changed |= graph.remove_unused(id);
            }
        }
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, InputKind, TensorType, UnaryOp};

    #[test]
    fn removes_dead_chain_keeps_inputs() {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [3]));
        let a = g.add(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
        let b = g.add(Op::Unary(UnaryOp::Log), &[a]).unwrap();
        let _dead = g.add(Op::Unary(UnaryOp::Sin), &[b]).unwrap();
        g.set_outputs(vec![a]).unwrap();
        assert!(Dce.run(&mut g).unwrap());
        assert_eq!(g.len(), 2);
        g.verify().unwrap();
        assert!(!Dce.run(&mut g).unwrap());
    }
}
