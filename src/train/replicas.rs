//! Data-parallel training steps: what the step graphs add on a backend of several replicas.

use crate::error::Result;
use crate::ir::{BinaryOp, Graph, Literal, NodeId, Op, ReduceKind};

/// `node` averaged over `replicas` data-parallel replicas (`all_reduce` sum, divided by the
/// count); `node` itself on one replica or when it is not float (integer state such as a
/// step counter is the same on every replica).
pub(super) fn replica_mean(g: &mut Graph, node: NodeId, replicas: usize) -> Result<NodeId> {
    let ty = g.node(node).ty.clone();
    if replicas == 1 || !ty.dtype.is_float() {
        return Ok(node);
    }
    let sum = g.add(Op::AllReduce(ReduceKind::Sum), &[node])?;
    let mut count = g.add(
        Op::Constant(Literal::scalar(ty.dtype, replicas as f64)),
        &[],
    )?;
    if ty.shape.rank() > 0 {
        count = g.add(
            Op::Broadcast {
                shape: ty.shape.clone(),
                dims: Vec::new(),
            },
            &[count],
        )?;
    }
    g.add(Op::Binary(BinaryOp::Div), &[sum, count])
}
