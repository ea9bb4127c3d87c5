//! Widening of 16-bit float arithmetic that XLA would otherwise carry out in the narrow type.
//!
//! XLA:CPU runs some `bf16`/`f16` ops in the narrow type itself: a `reduce` (sum) accumulates
//! in bf16, so a sum of a few hundred terms loses most of its digits (measured: a bf16 sum of
//! 768 standard-normal values gave -1.0 against -1.77), and some transcendental functions
//! (`log_plus_one` in f16) are evaluated to less than the format's precision. libtorch computes
//! them in f32 and rounds once, as JAX does for its reductions, and mixed-precision training
//! depends on it (loss means, normalisation statistics). [`WidenHalf`] rewrites each such node
//! into convert → the op in f32 → convert back, which XLA fuses into one loop.

use super::Pass;
use crate::error::Result;
use crate::ir::{BinaryOp, DType, Graph, NodeId, Op, ReduceKind, UnaryOp};

/// Rewrites the 16-bit float sums, window sums and transcendental functions of a graph to
/// compute in `f32` and round the result once. Types, inputs and outputs are unchanged.
///
/// ```
/// use kiln::ir::{DType, Graph, InputKind, Op, ReduceKind, TensorType};
/// use kiln::passes::{Pass, WidenHalf};
///
/// let mut g = Graph::new();
/// let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::BF16, [4, 64]));
/// let s = g.add(Op::Reduce { kind: ReduceKind::Sum, axes: vec![1] }, &[x])?;
/// g.set_outputs(vec![s])?;
/// assert!(WidenHalf.run(&mut g)?);
/// g.verify()?;
/// assert_eq!(g.output_types()[0].dtype, DType::BF16);
/// assert!(!WidenHalf.run(&mut g)?); // idempotent
/// # Ok::<(), kiln::Error>(())
/// ```
pub struct WidenHalf;

impl WidenHalf {
    /// Is `id` a node this pass rewrites?
    pub fn picks(graph: &Graph, id: NodeId) -> bool {
        let n = graph.node(id);
        if !n.ty.dtype.is_half() {
            return false;
        }
        match &n.op {
            Op::Reduce { kind, .. } | Op::ReduceWindow { kind, .. } => *kind == ReduceKind::Sum,
            Op::Unary(u) => matches!(
                u,
                UnaryOp::Exp
                    | UnaryOp::Log
                    | UnaryOp::Log1p
                    | UnaryOp::Sqrt
                    | UnaryOp::Rsqrt
                    | UnaryOp::Tanh
                    | UnaryOp::Logistic
                    | UnaryOp::Erf
                    | UnaryOp::Sin
                    | UnaryOp::Cos
            ),
            Op::Binary(b) => matches!(b, BinaryOp::Pow),
            _ => false,
        }
    }
}

impl Pass for WidenHalf {
    fn name(&self) -> &'static str {
        "widen-half"
    }

    fn run(&self, graph: &mut Graph) -> Result<bool> {
        let picked: Vec<NodeId> = graph
            .topo_order()
            .into_iter()
            .filter(|&id| WidenHalf::picks(graph, id))
            .collect();
        for &id in &picked {
            let n = graph.node(id).clone();
            let wide: Vec<NodeId> = n
                .operands
                .iter()
                .map(|&o| graph.add(Op::Convert(DType::F32), &[o]))
                .collect::<Result<_>>()?;
            let y = graph.add(n.op.clone(), &wide)?;
            let back = graph.add(Op::Convert(n.ty.dtype), &[y])?;
            graph.replace_uses(id, back)?;
            graph.remove_unused(id);
        }
        Ok(!picked.is_empty())
    }
}
