//! Scaling a scatter's updates instead of its result.

use super::Pass;
use crate::autograd::Builder;
use crate::error::Result;
use crate::ir::{BinaryOp, Graph, NodeId, Op};

/// Rewrites `ScatterAdd(0, i, u) * splat(s)` into `ScatterAdd(0, i, u * splat(s))` where the
/// scatter has no other user: the same sum, scaled slice by slice before it is added up
/// (rounding may differ in the last bit where indices repeat). For a finite `s`; with an
/// infinite or NaN `s` the rows no index touches stay 0 where `0 * s` would have made them NaN.
///
/// Why: an embedding's gradient is such a scatter (the VJP of `Take`), and plain SGD updates
/// its weight as `p + g * splat(-lr)`. After the rewrite that reads `p + ScatterAdd(0, ...)`,
/// which XLA turns into a scatter into `p` itself, in place in the donated weight; before it,
/// XLA materialised the dense gradient. bert's fused SGD step (embedding `[30522, 256]`, 30 MB)
/// had a 56 MB temporary allocation, which the CPU plugin allocates afresh every execution,
/// above glibc's 32 MB mmap limit, so every step faulted it in again.
pub struct ScaleScatterUpdates;

impl Pass for ScaleScatterUpdates {
    fn name(&self) -> &'static str {
        "scale-scatter-updates"
    }

    fn run(&self, graph: &mut Graph) -> Result<bool> {
        // Every traced graph comes through here (trace-every-time calls included): most have no
        // scatter, and a scan is cheaper than a topological order.
        if !graph
            .petgraph()
            .node_indices()
            .any(|n| matches!(graph.node(n).op, Op::ScatterAdd { .. }))
        {
            return Ok(false);
        }
        let mut changed = false;
        for id in graph.topo_order() {
            let n = graph.node(id);
            if n.op != Op::Binary(BinaryOp::Mul) || n.operands.len() != 2 {
                continue;
            }
            let (a, b) = (n.operands[0], n.operands[1]);
            let found = [(a, b), (b, a)].into_iter().find_map(|(sc, other)| {
                let axis = sole_scatter_of_zeros(graph, id, sc)?;
                Some((sc, axis, splat_source(graph, other)?))
            });
            let Some((scatter, axis, scalar)) = found else {
                continue;
            };
            let ops = graph.node(scatter).operands.clone();
            let (zeros, indices, updates) = (ops[0], ops[1], ops[2]);
            let mut b = Builder::new(graph);
            let shape = b.ty(updates).shape;
            let s = b.splat(scalar, &shape)?;
            let scaled = b.mul(updates, s)?;
            let new = b.op(Op::ScatterAdd { axis }, &[zeros, indices, scaled])?;
            graph.replace_uses(id, new)?;
            graph.remove_unused(id);
            graph.remove_unused(scatter);
            changed = true;
        }
        Ok(changed)
    }
}

/// The axis of `sc` if it is a `ScatterAdd` into zeros whose only use is `user` (once), and not
/// a graph output.
fn sole_scatter_of_zeros(g: &Graph, user: NodeId, sc: NodeId) -> Option<usize> {
    let n = g.node(sc);
    let Op::ScatterAdd { axis } = n.op else {
        return None;
    };
    let once = g.node(user).operands.iter().filter(|&&o| o == sc).count() == 1;
    (once && !g.outputs().contains(&sc) && g.users(sc) == [user] && is_zeros(g, n.operands[0]))
        .then_some(axis)
}

/// Is `id` a constant zero (+0.0 in every element), or a broadcast of one?
fn is_zeros(g: &Graph, id: NodeId) -> bool {
    match &g.node(id).op {
        Op::Constant(lit) => lit.bytes().iter().all(|&b| b == 0),
        Op::Broadcast { .. } => is_zeros(g, g.node(id).operands[0]),
        _ => false,
    }
}

/// The scalar node that `id` broadcasts to every element (`id` a `Broadcast` of a rank-0
/// node), if it is one.
fn splat_source(g: &Graph, id: NodeId) -> Option<NodeId> {
    let n = g.node(id);
    match &n.op {
        Op::Broadcast { dims, .. } if dims.is_empty() => {
            let s = n.operands[0];
            (g.node(s).ty.shape.rank() == 0).then_some(s)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::eager::EagerBackend;
    use crate::backend::{Backend, HostTensor};
    use crate::ir::{DType, InputKind, TensorType};

    /// `p + ScatterAdd(0, ids, u) * splat(-lr)`, an embedding's SGD update.
    fn sgd_update(lr_first: bool) -> (Graph, NodeId) {
        let mut g = Graph::new();
        let pt = TensorType::new(DType::F32, [6, 3]);
        let p = g.add_input(InputKind::Parameter, "p", pt.clone());
        let ids = g.add_input(InputKind::Data, "ids", TensorType::new(DType::I64, [4]));
        let u = g.add_input(InputKind::Data, "u", TensorType::new(DType::F32, [4, 3]));
        let mut b = Builder::new(&mut g);
        let zeros = b.zeros(&pt).unwrap();
        let grad = b.op(Op::ScatterAdd { axis: 0 }, &[zeros, ids, u]).unwrap();
        let lr = b.scalar(DType::F32, -0.5).unwrap();
        let s = b.splat(lr, &pt.shape).unwrap();
        let ops = if lr_first { [s, grad] } else { [grad, s] };
        let step = b.op(Op::Binary(BinaryOp::Mul), &ops).unwrap();
        let out = b.add(p, step).unwrap();
        g.set_outputs(vec![out]).unwrap();
        (g, out)
    }

    fn run(g: &Graph) -> Vec<f64> {
        let b = EagerBackend::new();
        let exe = b.compile(g).unwrap();
        let pv: Vec<f32> = (0..18).map(|i| i as f32 * 0.25 - 2.0).collect();
        let uv: Vec<f32> = (0..12).map(|i| (i as f32 - 5.5) / 3.0).collect();
        let p = HostTensor::from_slice(&[6, 3], &pv).unwrap();
        let ids = HostTensor::from_slice(&[4], &[1i64, 4, 1, 5]).unwrap();
        let u = HostTensor::from_slice(&[4, 3], &uv).unwrap();
        let args = [&p, &ids, &u].map(|t| b.to_device(t).unwrap());
        let out = b.execute(&exe, &args.iter().collect::<Vec<_>>()).unwrap();
        b.to_host(&out[0]).unwrap().to_f64_vec()
    }

    #[test]
    fn the_scale_moves_into_the_updates_and_the_values_stay() {
        for lr_first in [false, true] {
            let (mut g, out) = sgd_update(lr_first);
            let want = run(&g);
            assert!(ScaleScatterUpdates.run(&mut g).unwrap());
            g.verify().unwrap();
            // The update now adds a scatter into zeros straight to the parameter.
            let add = g.node(g.outputs()[0]);
            assert_eq!(g.outputs()[0], out);
            let scatter = add.operands[1];
            assert!(matches!(g.node(scatter).op, Op::ScatterAdd { .. }));
            let scaled = g.node(scatter).operands[2];
            assert_eq!(g.node(scaled).op, Op::Binary(BinaryOp::Mul));
            let got = run(&g);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{a} vs {b}");
            }
            assert!(!ScaleScatterUpdates.run(&mut g).unwrap());
        }
    }

    #[test]
    fn a_scatter_read_elsewhere_or_not_into_zeros_is_left_alone() {
        // Read twice: the gradient is also an output.
        let scatter_of = |g: &Graph| {
            g.petgraph()
                .node_indices()
                .find(|&n| matches!(g.node(n).op, Op::ScatterAdd { .. }))
                .unwrap()
        };
        let (mut g, out) = sgd_update(false);
        let scatter = scatter_of(&g);
        g.set_outputs(vec![out, scatter]).unwrap();
        assert!(!ScaleScatterUpdates.run(&mut g).unwrap());
        // Into a base that is not zero.
        let (mut g, _) = sgd_update(false);
        let scatter = scatter_of(&g);
        let p = g.inputs()[0].node;
        let ops = g.node(scatter).operands.clone();
        let other = g
            .add(Op::ScatterAdd { axis: 0 }, &[p, ops[1], ops[2]])
            .unwrap();
        g.replace_uses(scatter, other).unwrap();
        g.remove_unused(scatter);
        assert!(!ScaleScatterUpdates.run(&mut g).unwrap());
    }
}
