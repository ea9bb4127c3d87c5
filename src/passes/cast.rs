//! Casting a graph's float computation to another dtype (mixed precision).

use crate::error::{Error, Result};
use crate::ir::{DType, Graph, Literal, NodeId, Op, TensorType};
use std::collections::HashMap;

/// A copy of `graph` whose `from` computation runs in `to`: every `from` input is converted to
/// `to` where it enters, constants, iotas and conversions of type `from` become `to`, every
/// other op follows its operands' types, and every `from` output is converted back. Inputs
/// (names, kinds, types), outputs' types and aliases are those of `graph`.
///
/// This is what mixed-precision training runs: with `from = F32, to = BF16` a model whose
/// parameters are `f32` computes its forward pass in bf16, and its reverse-mode derivative
/// (the VJP of a conversion converts the cotangent back) arrives at the `f32` parameters as
/// `f32` gradients. Values of other dtypes (`f64`, integers, bools) are left alone.
///
/// ```
/// use kiln::ir::{DType, Graph, InputKind, Op, BinaryOp, TensorType};
/// use kiln::passes::cast_graph;
///
/// let mut g = Graph::new();
/// let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [3]));
/// let y = g.add(Op::Binary(BinaryOp::Mul), &[x, x])?;
/// g.set_outputs(vec![y])?;
/// let h = cast_graph(&g, DType::F32, DType::BF16)?;
/// h.verify()?;
/// assert_eq!(h.output_types(), g.output_types()); // f32 out, bf16 inside
/// assert!(h.petgraph().node_weights().any(|n| n.ty.dtype == DType::BF16));
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn cast_graph(graph: &Graph, from: DType, to: DType) -> Result<Graph> {
    if !from.is_float() || !to.is_float() {
        return Err(Error::Invalid(format!(
            "cast_graph: {from} -> {to}: both dtypes must be floating point"
        )));
    }
    let mut g = Graph::new();
    let mut map: HashMap<NodeId, NodeId> = HashMap::new();
    // Inputs first, in order, so that their indices are kept.
    for inp in graph.inputs() {
        let n = g.add_input(inp.kind.clone(), inp.name.clone(), inp.ty.clone());
        let n = if inp.ty.dtype == from {
            g.add(Op::Convert(to), &[n])?
        } else {
            n
        };
        map.insert(inp.node, n);
    }
    for id in graph.topo_order() {
        let node = graph.node(id);
        if matches!(node.op, Op::Input(_)) {
            continue;
        }
        let operands: Vec<NodeId> = node.operands.iter().map(|o| map[o]).collect();
        let op = match &node.op {
            Op::Constant(lit) if lit.ty().dtype == from => {
                let ty = lit.ty().with_dtype(to);
                let mut bytes = Vec::with_capacity(ty.size_in_bytes());
                for i in 0..lit.ty().shape.numel() {
                    bytes.extend_from_slice(Literal::scalar(to, lit.get_f64(i)).bytes());
                }
                Op::Constant(Literal::from_bytes(ty, bytes)?)
            }
            Op::Iota { ty, dim } if ty.dtype == from => Op::Iota {
                ty: TensorType::new(to, ty.shape.dims()),
                dim: *dim,
            },
            Op::Convert(d) if *d == from => Op::Convert(to),
            op => op.clone(),
        };
        let new = g.add(op, &operands).map_err(|e| {
            Error::Graph(format!(
                "cast_graph {from} -> {to}: {} no longer type-checks: {e}",
                node.op.name()
            ))
        })?;
        map.insert(id, new);
    }
    finish(graph, g, |o| map[&o])
}

/// How [`autocast_graph`] types an op.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Policy {
    /// Matrix products and convolutions: in the narrow dtype.
    Narrow,
    /// Sums and the functions whose range or conditioning needs more than 16 bits: in the wide
    /// dtype (PyTorch autocast's float32 list: `sum`, `exp`, `log`, `log1p`, `rsqrt`, `pow`,
    /// and through them softmax, log-softmax, cross-entropy, normalisation statistics).
    Wide,
    /// Everything else: the widest of its operands' dtypes, ignoring constants.
    Follow,
}

fn policy(op: &Op) -> Policy {
    use crate::ir::{BinaryOp, ReduceKind, UnaryOp};
    match op {
        Op::DotGeneral(_) | Op::Conv(_) => Policy::Narrow,
        Op::Reduce {
            kind: ReduceKind::Sum,
            ..
        }
        | Op::Unary(UnaryOp::Exp | UnaryOp::Log | UnaryOp::Log1p | UnaryOp::Rsqrt)
        | Op::Binary(BinaryOp::Pow) => Policy::Wide,
        _ => Policy::Follow,
    }
}

/// A copy of `graph` under PyTorch-autocast-style mixed precision: matrix products and
/// convolutions run in `narrow` (their `wide` operands, parameters among them, are converted
/// where they are read), sums, `exp`, `log`, `log1p`, `rsqrt` and `pow` run in `wide`, and every
/// other op runs in the widest dtype among its operands (constants, iotas and values converted
/// from integers or bools adopt the dtype of the other operands, as Python scalars do in
/// PyTorch). Inputs and output types are those of `graph`.
///
/// This is the cast mixed-precision training uses ([`crate::train::TrainStep::with_mixed_precision`]):
/// the loss and its cotangent stay in `wide` down to the last matrix product, so a loss scale
/// larger than f16's largest value (65504) does not overflow at the loss itself, and a sum of
/// many narrow terms is not rounded to 16 bits along the way.
///
/// ```
/// use kiln::ir::{DType, DotDims, Graph, InputKind, Op, TensorType};
/// use kiln::passes::autocast_graph;
///
/// let mut g = Graph::new();
/// let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [2, 3]));
/// let w = g.add_input(InputKind::Parameter, "w", TensorType::new(DType::F32, [3, 4]));
/// let dims = DotDims { lhs_batch: vec![], rhs_batch: vec![], lhs_contract: vec![1], rhs_contract: vec![0] };
/// let y = g.add(Op::DotGeneral(dims), &[x, w])?;
/// g.set_outputs(vec![y])?;
/// let h = autocast_graph(&g, DType::F32, DType::BF16)?;
/// h.verify()?;
/// let dot = h.petgraph().node_weights().find(|n| matches!(n.op, Op::DotGeneral(_))).unwrap();
/// assert_eq!(dot.ty.dtype, DType::BF16);
/// assert_eq!(h.output_types(), g.output_types());
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn autocast_graph(graph: &Graph, wide: DType, narrow: DType) -> Result<Graph> {
    if !wide.is_float() || !narrow.is_float() {
        return Err(Error::Invalid(format!(
            "autocast_graph: {wide} / {narrow}: both dtypes must be floating point"
        )));
    }
    let mut g = Graph::new();
    // Old node -> (new node, weak: a constant-like value that adopts its users' dtype).
    let mut map: HashMap<NodeId, (NodeId, bool)> = HashMap::new();
    for inp in graph.inputs() {
        let n = g.add_input(inp.kind.clone(), inp.name.clone(), inp.ty.clone());
        map.insert(inp.node, (n, false));
    }
    let is_cast = |d: DType| d == wide || d == narrow;
    for id in graph.topo_order() {
        let node = graph.node(id);
        if matches!(node.op, Op::Input(_)) {
            continue;
        }
        let ops: Vec<(NodeId, bool)> = node.operands.iter().map(|o| map[o]).collect();
        let (op_dtype, weak) = match &node.op {
            Op::Constant(_) | Op::Iota { .. } => (None, true),
            Op::Convert(d) => {
                let from = graph.node(node.operands[0]).ty.dtype;
                (None, *d == wide && !from.is_float())
            }
            op => {
                let float: Vec<(DType, bool)> = ops
                    .iter()
                    .map(|&(n, w)| (g.node(n).ty.dtype, w))
                    .filter(|(d, _)| is_cast(*d))
                    .collect();
                let target = match policy(op) {
                    Policy::Narrow => narrow,
                    Policy::Wide => wide,
                    Policy::Follow => {
                        if float.iter().any(|&(d, w)| d == wide && !w) {
                            wide
                        } else if float.iter().any(|&(d, _)| d == narrow) {
                            narrow
                        } else {
                            wide
                        }
                    }
                };
                let weak = !float.is_empty() && float.iter().all(|&(_, w)| w);
                (Some(target), weak)
            }
        };
        let operands: Vec<NodeId> = ops
            .iter()
            .map(|&(n, _)| {
                let d = g.node(n).ty.dtype;
                match op_dtype {
                    Some(t) if is_cast(d) && d != t => g.add(Op::Convert(t), &[n]),
                    _ => Ok(n),
                }
            })
            .collect::<Result<_>>()?;
        let new = g.add(node.op.clone(), &operands).map_err(|e| {
            Error::Graph(format!(
                "autocast_graph {wide}/{narrow}: {} no longer type-checks: {e}",
                node.op.name()
            ))
        })?;
        map.insert(id, (new, weak));
    }
    finish(graph, g, |o| map[&o].0)
}

/// Completes a rewritten copy `g` of `graph`: each output (`node_of` maps an original node to
/// its copy) converted back to the dtype `graph` declares for it, and `graph`'s aliases, so the
/// copy keeps the original's signature.
fn finish(graph: &Graph, mut g: Graph, node_of: impl Fn(NodeId) -> NodeId) -> Result<Graph> {
    let outputs = graph
        .outputs()
        .iter()
        .map(|&o| {
            let (want, n) = (&graph.node(o).ty, node_of(o));
            if g.node(n).ty.dtype != want.dtype {
                g.add(Op::Convert(want.dtype), &[n])
            } else {
                Ok(n)
            }
        })
        .collect::<Result<Vec<_>>>()?;
    g.set_outputs(outputs)?;
    for &(i, o) in graph.aliases() {
        g.add_alias(i, o)?;
    }
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{BinaryOp, DotDims, InputKind, ReduceKind, UnaryOp};

    fn dims() -> DotDims {
        DotDims {
            lhs_batch: vec![],
            rhs_batch: vec![],
            lhs_contract: vec![1],
            rhs_contract: vec![0],
        }
    }

    fn dtype_of(g: &Graph, pred: impl Fn(&Op) -> bool) -> Vec<DType> {
        g.topo_order()
            .into_iter()
            .map(|id| g.node(id))
            .filter(|n| pred(&n.op))
            .map(|n| n.ty.dtype)
            .collect()
    }

    /// x·w + b, relu, a second product, exp and a sum: products narrow, the bias add (an f32
    /// parameter) and everything after it wide until the next product; the constant of the
    /// relu adopts its other operand's dtype; exp and sum wide; the output keeps its type.
    #[test]
    fn autocast_follows_the_policy() -> Result<()> {
        let f = |s: &[usize]| TensorType::new(DType::F32, s);
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", f(&[2, 3]));
        let w = g.add_input(InputKind::Parameter, "w", f(&[3, 4]));
        let b = g.add_input(InputKind::Parameter, "b", f(&[2, 4]));
        let v = g.add_input(InputKind::Parameter, "v", f(&[4, 4]));
        let y = g.add(Op::DotGeneral(dims()), &[x, w])?;
        // A narrow product's output with a constant: stays narrow.
        let zero = g.add(Op::Constant(Literal::scalar(DType::F32, 0.0)), &[])?;
        let zero = g.add(
            Op::Broadcast {
                shape: crate::ir::Shape::new(&[2, 4]),
                dims: vec![],
            },
            &[zero],
        )?;
        let r = g.add(Op::Binary(BinaryOp::Max), &[y, zero])?;
        let h = g.add(Op::Binary(BinaryOp::Add), &[r, b])?;
        let z = g.add(Op::DotGeneral(dims()), &[h, v])?;
        let e = g.add(Op::Unary(UnaryOp::Exp), &[z])?;
        let s = g.add(
            Op::Reduce {
                kind: ReduceKind::Sum,
                axes: vec![0, 1],
            },
            &[e],
        )?;
        g.set_outputs(vec![s, z])?;
        let c = autocast_graph(&g, DType::F32, DType::BF16)?;
        c.verify()?;
        assert_eq!(c.output_types(), g.output_types());
        assert_eq!(c.inputs().len(), 4);
        assert!(c.inputs().iter().all(|i| i.ty.dtype == DType::F32));
        let dots = dtype_of(&c, |op| matches!(op, Op::DotGeneral(_)));
        assert_eq!(dots, [DType::BF16, DType::BF16]);
        let max = dtype_of(&c, |op| matches!(op, Op::Binary(BinaryOp::Max)));
        assert_eq!(max, [DType::BF16], "relu after a product stays narrow");
        let add = dtype_of(&c, |op| matches!(op, Op::Binary(BinaryOp::Add)));
        assert_eq!(add, [DType::F32], "adding an f32 parameter widens");
        assert_eq!(dtype_of(&c, |op| matches!(op, Op::Unary(_))), [DType::F32]);
        assert_eq!(
            dtype_of(&c, |op| matches!(op, Op::Reduce { .. })),
            [DType::F32]
        );
        Ok(())
    }

    /// `cast_graph` moves every f32 value to the narrow dtype and leaves others alone.
    #[test]
    fn cast_graph_casts_f32_only() -> Result<()> {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [3]));
        let i = g.add_input(InputKind::Data, "i", TensorType::new(DType::I32, [3]));
        let d = g.add_input(InputKind::Data, "d", TensorType::new(DType::F64, [3]));
        let fi = g.add(Op::Convert(DType::F32), &[i])?;
        let y = g.add(Op::Binary(BinaryOp::Mul), &[x, fi])?;
        let k = g.add(Op::Constant(Literal::scalar(DType::F32, 0.1)), &[])?;
        let k = g.add(
            Op::Broadcast {
                shape: crate::ir::Shape::new(&[3]),
                dims: vec![],
            },
            &[k],
        )?;
        let y = g.add(Op::Binary(BinaryOp::Add), &[y, k])?;
        let dd = g.add(Op::Binary(BinaryOp::Add), &[d, d])?;
        g.set_outputs(vec![y, dd])?;
        let c = cast_graph(&g, DType::F32, DType::F16)?;
        c.verify()?;
        assert_eq!(c.output_types(), g.output_types());
        let muls = dtype_of(&c, |op| matches!(op, Op::Binary(BinaryOp::Mul)));
        assert_eq!(muls, [DType::F16]);
        let adds = dtype_of(&c, |op| matches!(op, Op::Binary(BinaryOp::Add)));
        assert!(adds.contains(&DType::F16) && adds.contains(&DType::F64));
        let consts: Vec<DType> = dtype_of(&c, |op| matches!(op, Op::Constant(_)));
        assert_eq!(consts, [DType::F16]);
        assert!(cast_graph(&g, DType::F32, DType::I32).is_err());
        Ok(())
    }
}
