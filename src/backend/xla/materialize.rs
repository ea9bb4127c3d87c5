//! Values XLA would compute again in every consumer, and the lowering keeps written once.
//!
//! XLA's CPU compiler fuses a cheap elementwise producer into each of its consumers, also when
//! another consumer (a product, a convolution, a custom call) makes it write the value to
//! memory anyway. For one value that costs a few operations an element; along a chain of such
//! values it compounds. In a post-LN transformer (bert) each layer norm's output feeds the next
//! product and, through the residual add, the next layer norm: XLA fused every earlier layer
//! norm, back to the embeddings, into each layer norm's fusions (fusions of up to 55 operands,
//! 793 operands over bert's 37 fusions; with the links written once, at most 13 and 163, and
//! bert inference on a 2-vCPU AMD EPYC Zen 2 took 18.6 ms instead of 20.2). Pre-LN
//! transformers (vit) and the zoo's CNNs did not show it (at most 7 operands a fusion).
//!
//! Fusible here means [`Op::is_elementwise_or_layout`]: the ops XLA inlines into consumers
//! (reductions, gathers and products end a chain). [`values_to_materialize`] picks the values
//! that link such chains; the lowering passes each through kiln's identity call
//! (`kiln_after_v1`, which XLA cannot fuse through; the result aliases its operand's buffer, so
//! nothing is copied) and its consumers read the written value.

use crate::ir::{Graph, NodeId, Op};
use std::collections::HashSet;

/// Does a consumer of this op make XLA write its operands to memory (XLA fuses nothing into
/// it)?
fn writes_operands(op: &Op) -> bool {
    matches!(
        op,
        Op::DotGeneral(_)
            | Op::Conv(_)
            | Op::ScatterAdd { .. }
            | Op::SelectAndScatter(_)
            | Op::AllReduce(_)
            | Op::Barrier
    )
}

/// Is `id` a shared value: fusible, written to memory for one consumer (a product, a
/// convolution, another unfusible op, directly or through a reshape) and read by another that
/// XLA would fuse it into (an elementwise op or a reduction)? The program's results are left
/// as XLA writes them: a result donated to an input's buffer (a training step's updated
/// weight) is written into that buffer, which a call in between would prevent (XLA would copy
/// the weight).
fn shared(g: &Graph, id: NodeId, outputs: &HashSet<NodeId>) -> bool {
    if !g.node(id).op.is_elementwise_or_layout()
        || matches!(g.node(id).op, Op::Constant(_) | Op::Iota { .. })
        || outputs.contains(&id)
    {
        return false;
    }
    let users = g.users(id);
    // A reshape read only by unfusible ops is a view XLA gives them (a bitcast).
    let view_for_writer = |u: NodeId| {
        matches!(g.node(u).op, Op::Reshape(_))
            && g.users(u).iter().all(|&v| writes_operands(&g.node(v).op))
    };
    let written = users
        .iter()
        .any(|&u| writes_operands(&g.node(u).op) || view_for_writer(u));
    written
        && users.iter().any(|&u| {
            let op = &g.node(u).op;
            (op.is_elementwise_or_layout() && !view_for_writer(u))
                || matches!(op, Op::Reduce { .. })
        })
}

/// The values of `g` the lowering writes once for all consumers: each shared value (see
/// [`shared`]) whose fusible producers reach another shared value, the links of a chain XLA
/// would recompute from its start in every fusion. A shared value alone, whose producers
/// end at unfusible ops, is left to XLA (recomputing a few operations is cheaper than a
/// read).
pub(crate) fn values_to_materialize(g: &Graph) -> HashSet<NodeId> {
    let outputs: HashSet<NodeId> = g.outputs().iter().copied().collect();
    let is_shared: HashSet<NodeId> = g
        .petgraph()
        .node_indices()
        .filter(|&id| shared(g, id, &outputs))
        .collect();
    is_shared
        .iter()
        .copied()
        .filter(|&id| reaches_shared(g, id, &is_shared))
        .collect()
}

/// Does a walk from `id` up through fusible producers (stopping at the first shared one on
/// each path) meet a shared value other than `id`?
fn reaches_shared(g: &Graph, id: NodeId, is_shared: &HashSet<NodeId>) -> bool {
    let mut seen = HashSet::from([id]);
    let mut stack: Vec<NodeId> = g.node(id).operands.to_vec();
    while let Some(p) = stack.pop() {
        if !seen.insert(p) {
            continue;
        }
        if is_shared.contains(&p) {
            return true;
        }
        if g.node(p).op.is_elementwise_or_layout() {
            stack.extend(g.node(p).operands.iter().copied());
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{BinaryOp, DType, DotDims, InputKind, TensorType, UnaryOp};

    /// `x · w` for `x: [n, k]`, `w: [k, m]`.
    fn matmul(g: &mut Graph, x: NodeId, w: NodeId) -> NodeId {
        let d = DotDims {
            lhs_batch: vec![],
            rhs_batch: vec![],
            lhs_contract: vec![1],
            rhs_contract: vec![0],
        };
        g.add(Op::DotGeneral(d), &[x, w]).unwrap()
    }

    /// A post-LN residual chain of `layers` links: `y = tanh(y + y · w)`, each link's value
    /// read by the next product and the next residual add. Returns the graph and the links.
    fn chain(layers: usize) -> (Graph, Vec<NodeId>) {
        let mut g = Graph::new();
        let t = TensorType::new(DType::F32, [8, 8]);
        let x = g.add_input(InputKind::Data, "x", t.clone());
        let w = g.add_input(InputKind::Parameter, "w", t);
        let mut y = g.add(Op::Unary(UnaryOp::Tanh), &[x]).unwrap();
        let mut links = vec![y];
        for _ in 0..layers {
            let p = matmul(&mut g, y, w);
            let s = g.add(Op::Binary(BinaryOp::Add), &[y, p]).unwrap();
            y = g.add(Op::Unary(UnaryOp::Tanh), &[s]).unwrap();
            links.push(y);
        }
        g.set_outputs(vec![y]).unwrap();
        (g, links)
    }

    #[test]
    fn the_links_of_a_residual_chain_after_the_first_are_written_once() {
        let (g, links) = chain(4);
        let picked = values_to_materialize(&g);
        // The first link's producers end at the input; the last is the result, read by no
        // fusible consumer.
        let want: HashSet<NodeId> = links[1..4].iter().copied().collect();
        assert_eq!(picked, want);
    }

    #[test]
    fn a_shared_value_alone_is_left_to_xla() {
        // `y = exp(x)` read by a product and by an add: one link, no chain.
        let mut g = Graph::new();
        let t = TensorType::new(DType::F32, [4, 4]);
        let x = g.add_input(InputKind::Data, "x", t.clone());
        let w = g.add_input(InputKind::Parameter, "w", t);
        let y = g.add(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
        let p = matmul(&mut g, y, w);
        let s = g.add(Op::Binary(BinaryOp::Add), &[y, p]).unwrap();
        g.set_outputs(vec![s]).unwrap();
        assert!(shared(&g, y, &g.outputs().iter().copied().collect()));
        assert!(values_to_materialize(&g).is_empty());
    }

    #[test]
    fn a_result_is_never_passed_through_the_call() {
        // The chain's links are also results (as a training step's updated state is).
        let (mut g, links) = chain(4);
        g.set_outputs(links.clone()).unwrap();
        assert!(values_to_materialize(&g).is_empty());
    }

    #[test]
    fn a_chain_without_unfusible_readers_is_left_to_xla() {
        // Elementwise links only: XLA fuses the chain into one loop, nothing is recomputed.
        let mut g = Graph::new();
        let t = TensorType::new(DType::F32, [4, 4]);
        let x = g.add_input(InputKind::Data, "x", t);
        let mut y = x;
        for _ in 0..4 {
            let e = g.add(Op::Unary(UnaryOp::Exp), &[y]).unwrap();
            y = g.add(Op::Binary(BinaryOp::Add), &[e, y]).unwrap();
        }
        g.set_outputs(vec![y]).unwrap();
        assert!(values_to_materialize(&g).is_empty());
    }

    #[test]
    fn a_product_read_through_a_reshape_writes_its_operand() {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [2, 4, 8]));
        let w = g.add_input(
            InputKind::Parameter,
            "w",
            TensorType::new(DType::F32, [8, 8]),
        );
        let mut y = g.add(Op::Unary(UnaryOp::Tanh), &[x]).unwrap();
        let mut links = vec![y];
        for _ in 0..3 {
            let flat = g.add(Op::Reshape([8, 8].into()), &[y]).unwrap();
            let p = matmul(&mut g, flat, w);
            let p = g.add(Op::Reshape([2, 4, 8].into()), &[p]).unwrap();
            let s = g.add(Op::Binary(BinaryOp::Add), &[y, p]).unwrap();
            y = g.add(Op::Unary(UnaryOp::Neg), &[s]).unwrap();
            links.push(y);
        }
        g.set_outputs(vec![y]).unwrap();
        let want: HashSet<NodeId> = links[1..3].iter().copied().collect();
        assert_eq!(values_to_materialize(&g), want);
    }
}
