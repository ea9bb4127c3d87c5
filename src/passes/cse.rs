//! Common-subexpression elimination.

use super::Pass;
use crate::error::Result;
use crate::ir::{Graph, NodeId, Op, TensorType};
use std::collections::HashMap;

/// Merges nodes with the same op, attributes, type and operands (all ops are pure).
pub struct Cse;

impl Pass for Cse {
    fn name(&self) -> &'static str {
        "cse"
    }

    fn run(&self, graph: &mut Graph) -> Result<bool> {
        let mut seen: HashMap<(Op, TensorType, Vec<NodeId>), NodeId> = HashMap::new();
        let mut changed = false;
        for id in graph.topo_order() {
            let n = graph.node(id);
            if matches!(n.op, Op::Input(_)) || !n.op.is_pure() {
                continue;
            }
            let key = (n.op.clone(), n.ty.clone(), n.operands.to_vec());
            match seen.get(&key) {
                Some(&first) => {
                    graph.replace_uses(id, first)?;
                    graph.remove_unused(id);
                    changed = true;
                }
                None => {
                    seen.insert(key, id);
                }
            }
        }
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{BinaryOp, DType, InputKind, UnaryOp};

    #[test]
    fn merges_duplicates_transitively() {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [3]));
        let a1 = g.add(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
        let a2 = g.add(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
        let b1 = g.add(Op::Binary(BinaryOp::Add), &[a1, x]).unwrap();
        let b2 = g.add(Op::Binary(BinaryOp::Add), &[a2, x]).unwrap();
        let c = g.add(Op::Binary(BinaryOp::Mul), &[b1, b2]).unwrap();
        g.set_outputs(vec![c]).unwrap();
        assert!(Cse.run(&mut g).unwrap());
        g.verify().unwrap();
        assert_eq!(g.len(), 4, "{g}");
        let c = g.node(g.outputs()[0]);
        assert_eq!(c.operands[0], c.operands[1]);
    }
}
