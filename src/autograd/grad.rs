//! The joint forward+backward graph of a scalar loss.

use super::builder::Builder;
use super::rules::vjp;
use crate::error::{Error, Result};
use crate::ir::{Graph, InputKind, NodeId, Op};
use crate::passes::{simplify, Pass, StripStopGradients};
use std::collections::{HashMap, HashSet};

/// Differentiates `graph`'s output `loss` (a scalar, f32/f64) w.r.t. the inputs `wrt`.
///
/// Returns the joint graph: inputs = `graph`'s inputs (same order, kinds and names) ++ one
/// [`InputKind::Cotangent`] input for the loss (bind it to `1.0` for a plain gradient);
/// outputs = `graph`'s outputs (same order) ++ one gradient per `wrt` entry, each of its input's
/// type (zeros if the loss does not depend on it). Donation aliases of `graph` are kept.
///
/// Only float values carry gradients: differentiating w.r.t. an integer or bool input is an
/// error, and integer paths (indices, comparisons, random bits) are not differentiated. The
/// graph is simplified (CSE + DCE) before it is returned.
pub fn joint(graph: &Graph, loss: usize, wrt: &[usize]) -> Result<Graph> {
    let loss_node = *graph.outputs().get(loss).ok_or_else(|| {
        Error::Invalid(format!(
            "joint: loss output {loss} out of range ({} outputs)",
            graph.outputs().len()
        ))
    })?;
    let lty = graph.node(loss_node).ty.clone();
    if !lty.dtype.is_float() || lty.shape.rank() != 0 {
        return Err(Error::Invalid(format!(
            "joint: the loss (output {loss}) must be a float scalar, got {lty}"
        )));
    }
    let mut wrt_nodes = Vec::with_capacity(wrt.len());
    for &i in wrt {
        let inp = graph.inputs().get(i).ok_or_else(|| {
            Error::Invalid(format!(
                "joint: wrt input {i} out of range ({} inputs)",
                graph.inputs().len()
            ))
        })?;
        if !inp.ty.dtype.is_float() {
            return Err(Error::Invalid(format!(
                "joint: cannot differentiate w.r.t. input {i} ({}) of non-float type {}",
                inp.name, inp.ty
            )));
        }
        wrt_nodes.push(inp.node);
    }

    let mut g = graph.clone();
    let ct_in = g.add_input(InputKind::Cotangent, "loss.cotangent", lty);
    let order = graph.topo_order();

    // Active values: float values that depend on a `wrt` input other than through a
    // stop-gradient.
    let mut active: HashSet<NodeId> = wrt_nodes.iter().copied().collect();
    for &id in &order {
        let n = graph.node(id);
        if n.ty.dtype.is_float()
            && n.op != Op::StopGradient
            && n.operands.iter().any(|o| active.contains(o))
        {
            active.insert(id);
        }
    }

    // Reverse sweep: every active node's cotangent is complete once all its users (later in
    // topological order) have been processed.
    let mut cts: HashMap<NodeId, NodeId> = HashMap::new();
    cts.insert(loss_node, ct_in);
    for &id in order.iter().rev() {
        if !active.contains(&id) {
            continue;
        }
        let Some(&ct) = cts.get(&id) else {
            continue;
        };
        let node = graph.node(id);
        if matches!(node.op, Op::Input(_)) {
            continue;
        }
        let operands = node.operands.to_vec();
        let needs: Vec<bool> = operands.iter().map(|o| active.contains(o)).collect();
        if !needs.iter().any(|&x| x) {
            continue;
        }
        let grads = vjp(&mut g, id, ct, &needs)
            .map_err(|e| Error::at_op("differentiating", node.op.name(), &node.ty, e))?;
        for (o, d) in operands.into_iter().zip(grads) {
            let Some(d) = d else { continue };
            if !active.contains(&o) {
                continue;
            }
            let acc = match cts.get(&o) {
                Some(&prev) => Builder::new(&mut g).add(prev, d)?,
                None => d,
            };
            cts.insert(o, acc);
        }
    }

    let mut outputs = g.outputs().to_vec();
    for (k, &node) in wrt_nodes.iter().enumerate() {
        let d = match cts.get(&node) {
            Some(&d) => d,
            None => {
                let ty = graph.inputs()[wrt[k]].ty.clone();
                Builder::new(&mut g).zeros(&ty)?
            }
        };
        outputs.push(d);
    }
    g.set_outputs(outputs)?;
    StripStopGradients.run(&mut g)?;
    simplify(&mut g)?;
    g.verify()?;
    Ok(g)
}
