//! Partition of a joint graph into a forward graph and a backward graph (AOTAutograd's
//! `default_partition`, plus an optional recompute policy).

use crate::error::{Error, Result};
use crate::ir::{Graph, InputKind, NodeId, Op};
use crate::passes::{Dce, Pass};
use std::collections::{HashMap, HashSet};

/// What the forward graph saves for the backward graph. `TrainStep` uses
/// [`SavePolicy::RecomputeElementwise`] unless told otherwise (see its `with_save_policy`);
/// `Default` is [`SavePolicy::SaveAll`], AOTAutograd's default partition.
///
/// Under both policies:
/// - values that depend on no graph input at all (constants, iotas and anything computed only
///   from them) are never saved: the backward graph recomputes them (XLA folds them);
/// - forward *inputs* (parameters, the data batch) are never returned by the forward graph:
///   the backward graph takes them directly ([`BackwardInput::ForwardInput`]);
/// - a value that already is a forward output is not returned a second time
///   ([`BackwardInput::Saved`] points at the existing output);
/// - everything else the backward graph needs from the forward graph is saved once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SavePolicy {
    /// Save every forward value the backward graph uses (AOTAutograd's default partition).
    #[default]
    SaveAll,
    /// Start from `SaveAll`, then recompute cheap ops in the backward graph instead of saving
    /// them: elementwise ops (unary, binary, compare, select, convert) and layout ops (broadcast,
    /// reshape, transpose, reverse, slice, pad, concat). A saved value is recomputed from its
    /// operands (each of them saved, or recomputed in turn where that is cheaper) when this
    /// strictly reduces the bytes saved or needs nothing new, repeated to a fixpoint, so
    /// elementwise chains collapse onto the values they start from (a matrix product, a forward
    /// input or output, ...). Matrix products, convolutions,
    /// reductions, pooling, gathers and scatters are never recomputed, and neither is anything
    /// that depends on an [`InputKind::RngKey`] input (random bits and dropout masks).
    RecomputeElementwise,
}

/// Where one input of the backward graph comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackwardInput {
    /// The forward graph's output at this index (a saved value, or a user output that the
    /// backward graph also needs).
    Saved(usize),
    /// The buffer that was passed as the forward graph's input at this index (a parameter or
    /// the data batch). It must still be alive when the backward graph runs: `partition` drops
    /// the forward graph's donation of any such input.
    ForwardInput(usize),
    /// The joint graph's cotangent input `num_inputs + k` (for a [`super::joint`] graph, `k = 0`
    /// is the loss cotangent).
    Cotangent(usize),
}

/// A joint graph split into forward and backward graphs.
///
/// The runtime contract:
/// 1. run `forward` on the original inputs; its outputs are the original outputs followed by
///    `num_saved` saved values;
/// 2. run `backward` with input `j` bound as `backward_inputs[j]` says;
/// 3. `backward`'s outputs are the joint graph's outputs after the first `num_outputs` (the
///    gradients), in order.
#[derive(Clone, Debug)]
pub struct Split {
    /// Inputs = the joint graph's first `num_inputs` inputs; outputs = its first `num_outputs`
    /// outputs ++ `num_saved` saved values.
    pub forward: Graph,
    /// Inputs as described by `backward_inputs` (saved values first, in forward-output order,
    /// then forward inputs by index, then every cotangent); outputs = the gradients.
    pub backward: Graph,
    /// How many values the forward graph returns for the backward graph, after the user's
    /// outputs.
    pub num_saved: usize,
    /// One entry per input of `backward`, in order.
    pub backward_inputs: Vec<BackwardInput>,
}

impl Split {
    /// The forward inputs the backward graph reads ([`BackwardInput::ForwardInput`]), in
    /// increasing order. A runtime must keep these buffers alive until the backward graph has run
    /// and must not donate them to the forward graph.
    pub fn needed_forward_inputs(&self) -> Vec<usize> {
        self.backward_inputs
            .iter()
            .filter_map(|b| match b {
                BackwardInput::ForwardInput(i) => Some(*i),
                _ => None,
            })
            .collect()
    }

    /// Bytes of the values the forward graph saves for the backward graph (its extra outputs).
    pub fn saved_bytes(&self) -> usize {
        let outs = self.forward.output_types();
        outs[outs.len().saturating_sub(self.num_saved)..]
            .iter()
            .map(|t| t.size_in_bytes())
            .sum()
    }
}

/// The recompute planner of [`SavePolicy::RecomputeElementwise`].
struct Recompute<'a> {
    joint: &'a Graph,
    num_inputs: usize,
    fwd_outputs: &'a HashSet<NodeId>,
    input_dep: &'a HashSet<NodeId>,
    rng_dep: &'a HashSet<NodeId>,
}

impl Recompute<'_> {
    fn bytes(&self, v: NodeId) -> usize {
        self.joint.node(v).ty.size_in_bytes()
    }

    /// Is `v` free in the backward graph (a forward input or output, a constant, or already
    /// saved or recomputed)?
    fn avail(&self, v: NodeId, saved: &HashSet<NodeId>, recomputed: &HashSet<NodeId>) -> bool {
        matches!(self.joint.node(v).op, Op::Input(i) if i < self.num_inputs)
            || self.fwd_outputs.contains(&v)
            || !self.input_dep.contains(&v)
            || saved.contains(&v)
            || recomputed.contains(&v)
    }

    fn recomputable(&self, v: NodeId) -> bool {
        self.joint.node(v).op.is_elementwise_or_layout()
            && !self.rng_dep.contains(&v)
            && !self.fwd_outputs.contains(&v)
    }

    fn unique_operands(&self, v: NodeId) -> Vec<NodeId> {
        let mut ops: Vec<NodeId> = Vec::new();
        for &o in &self.joint.node(v).operands {
            if !ops.contains(&o) {
                ops.push(o);
            }
        }
        ops
    }

    /// Bytes that must be saved to make `v` available: 0 if it is, else the cheaper of saving it
    /// and (if recomputable) making its operands available.
    fn cost(
        &self,
        v: NodeId,
        saved: &HashSet<NodeId>,
        recomputed: &HashSet<NodeId>,
        memo: &mut HashMap<NodeId, usize>,
    ) -> usize {
        if self.avail(v, saved, recomputed) {
            return 0;
        }
        if let Some(&c) = memo.get(&v) {
            return c;
        }
        let own = self.bytes(v);
        let c = if self.recomputable(v) {
            own.min(self.operands_cost(v, saved, recomputed, memo))
        } else {
            own
        };
        memo.insert(v, c);
        c
    }

    fn operands_cost(
        &self,
        v: NodeId,
        saved: &HashSet<NodeId>,
        recomputed: &HashSet<NodeId>,
        memo: &mut HashMap<NodeId, usize>,
    ) -> usize {
        self.unique_operands(v)
            .into_iter()
            .map(|o| self.cost(o, saved, recomputed, memo))
            .sum()
    }

    /// Recomputes `v` in the backward graph: its operands are recomputed where that is strictly
    /// cheaper than saving them, and saved otherwise.
    fn materialize(
        &self,
        v: NodeId,
        saved: &mut HashSet<NodeId>,
        recomputed: &mut HashSet<NodeId>,
        memo: &mut HashMap<NodeId, usize>,
    ) {
        saved.remove(&v);
        recomputed.insert(v);
        memo.clear();
        for o in self.unique_operands(v) {
            if self.avail(o, saved, recomputed) {
                continue;
            }
            let via_ops = if self.recomputable(o) {
                Some(self.operands_cost(o, saved, recomputed, memo))
            } else {
                None
            };
            match via_ops {
                Some(c) if c == 0 || c < self.bytes(o) => {
                    self.materialize(o, saved, recomputed, memo)
                }
                _ => {
                    saved.insert(o);
                    memo.clear();
                }
            }
        }
    }
}

/// Splits `joint` into a forward and a backward graph.
///
/// `joint`'s first `num_inputs` inputs are forward inputs and the rest are cotangents; its first
/// `num_outputs` outputs are forward outputs and the rest are gradients (the layout
/// [`super::joint`] produces, with `num_inputs = graph.inputs().len()` and
/// `num_outputs = graph.outputs().len()`). The forward outputs must not depend on a cotangent.
///
/// Both graphs are dead-code free: every node of `forward` feeds one of its outputs, every node
/// and input of `backward` (except possibly a cotangent) feeds a gradient. See [`SavePolicy`]
/// for what is saved, and [`Split`] for how the runtime binds the backward graph.
pub fn partition(
    joint: &Graph,
    num_inputs: usize,
    num_outputs: usize,
    policy: SavePolicy,
) -> Result<Split> {
    let inputs = joint.inputs();
    let outputs = joint.outputs();
    if num_inputs > inputs.len() || num_outputs > outputs.len() {
        return Err(Error::Invalid(format!(
            "partition: {num_inputs} forward inputs / {num_outputs} forward outputs, but the joint \
             graph has {} inputs and {} outputs",
            inputs.len(),
            outputs.len()
        )));
    }
    let order = joint.topo_order();
    let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();

    // Dependence on cotangents, on any input, on the random key.
    let mut tangent: HashSet<NodeId> = HashSet::new();
    let mut input_dep: HashSet<NodeId> = HashSet::new();
    let mut rng_dep: HashSet<NodeId> = HashSet::new();
    for &id in &order {
        let n = joint.node(id);
        if let Op::Input(i) = n.op {
            input_dep.insert(id);
            if i >= num_inputs {
                tangent.insert(id);
            }
            if inputs[i].kind == InputKind::RngKey {
                rng_dep.insert(id);
            }
            continue;
        }
        let any = |s: &HashSet<NodeId>| n.operands.iter().any(|o| s.contains(o));
        if any(&tangent) {
            tangent.insert(id);
        }
        if any(&input_dep) {
            input_dep.insert(id);
        }
        if any(&rng_dep) {
            rng_dep.insert(id);
        }
    }
    let is_primal_input = |id: NodeId| matches!(joint.node(id).op, Op::Input(i) if i < num_inputs);
    let fwd_outputs: HashSet<NodeId> = outputs[..num_outputs].iter().copied().collect();

    // The forward graph: everything the forward outputs need.
    let fwd = joint.ancestors(&outputs[..num_outputs]);
    if let Some(bad) = fwd.iter().find(|n| tangent.contains(n)) {
        return Err(Error::Invalid(format!(
            "partition: a forward output depends on a cotangent input (node {} {})",
            joint.node(*bad).op.name(),
            joint.node(*bad).ty
        )));
    }
    // Forward values the backward graph uses directly: the save candidates.
    let grads = &outputs[num_outputs..];
    let mut saved: HashSet<NodeId> = HashSet::new();
    {
        let mut seen = HashSet::new();
        let mut stack: Vec<NodeId> = grads.to_vec();
        while let Some(v) = stack.pop() {
            if !seen.insert(v) || is_primal_input(v) {
                continue;
            }
            if fwd.contains(&v) && input_dep.contains(&v) {
                saved.insert(v);
                continue;
            }
            stack.extend(joint.node(v).operands.iter().copied());
        }
    }
    let mut recomputed: HashSet<NodeId> = HashSet::new();
    if policy == SavePolicy::RecomputeElementwise {
        let r = Recompute {
            joint,
            num_inputs,
            fwd_outputs: &fwd_outputs,
            input_dep: &input_dep,
            rng_dep: &rng_dep,
        };
        loop {
            let mut changed = false;
            let mut cands: Vec<NodeId> = saved.iter().copied().collect();
            cands.sort_by_key(|n| std::cmp::Reverse(pos[n]));
            for v in cands {
                if !saved.contains(&v) || !r.recomputable(v) {
                    continue;
                }
                let mut memo = HashMap::new();
                let cost = r.operands_cost(v, &saved, &recomputed, &mut memo);
                if cost == 0 || cost < r.bytes(v) {
                    r.materialize(v, &mut saved, &mut recomputed, &mut memo);
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
    }

    // Backward nodes: everything from the gradients back to saved values and forward inputs.
    let mut bnodes: HashSet<NodeId> = HashSet::new();
    let mut used_inputs: HashSet<usize> = HashSet::new();
    {
        let mut stack: Vec<NodeId> = grads.to_vec();
        while let Some(v) = stack.pop() {
            if saved.contains(&v) || bnodes.contains(&v) {
                continue;
            }
            if let Op::Input(i) = joint.node(v).op {
                if i < num_inputs {
                    used_inputs.insert(i);
                }
                continue;
            }
            if fwd.contains(&v) && input_dep.contains(&v) && !recomputed.contains(&v) {
                return Err(Error::Graph(format!(
                    "partition: forward value {} {} reached by the backward graph but neither \
                     saved nor recomputed",
                    joint.node(v).op.name(),
                    joint.node(v).ty
                )));
            }
            bnodes.insert(v);
            stack.extend(joint.node(v).operands.iter().copied());
        }
    }
    let mut saved_list: Vec<NodeId> = saved.into_iter().collect();
    saved_list.sort_by_key(|n| pos[n]);

    // ----- forward graph -----
    let mut forward = Graph::new();
    let mut fmap: HashMap<NodeId, NodeId> = HashMap::new();
    for inp in &inputs[..num_inputs] {
        let n = forward.add_input(inp.kind.clone(), inp.name.clone(), inp.ty.clone());
        fmap.insert(inp.node, n);
    }
    for &id in &order {
        if !fwd.contains(&id) || matches!(joint.node(id).op, Op::Input(_)) {
            continue;
        }
        let n = joint.node(id);
        let ops: Vec<NodeId> = n.operands.iter().map(|o| fmap[o]).collect();
        let new = forward.add_typed(n.op.clone(), n.ty.clone(), &ops);
        fmap.insert(id, new);
    }
    let mut fouts: Vec<NodeId> = outputs[..num_outputs].iter().map(|o| fmap[o]).collect();
    let mut backward_inputs = Vec::new();
    let mut num_saved = 0;
    for &s in &saved_list {
        let idx = match outputs[..num_outputs].iter().position(|&o| o == s) {
            Some(j) => j,
            None => {
                fouts.push(fmap[&s]);
                num_saved += 1;
                fouts.len() - 1
            }
        };
        backward_inputs.push(BackwardInput::Saved(idx));
    }
    forward.set_outputs(fouts)?;
    for &(i, o) in joint.aliases() {
        if i < num_inputs && o < num_outputs && !used_inputs.contains(&i) {
            forward.add_alias(i, o)?;
        }
    }

    // ----- backward graph -----
    let mut backward = Graph::new();
    let mut bmap: HashMap<NodeId, NodeId> = HashMap::new();
    for (k, &s) in saved_list.iter().enumerate() {
        let ty = joint.node(s).ty.clone();
        let n = backward.add_input(InputKind::Saved, format!("saved{k}"), ty);
        bmap.insert(s, n);
    }
    let mut used: Vec<usize> = used_inputs.into_iter().collect();
    used.sort_unstable();
    for i in used {
        let inp = &inputs[i];
        let n = backward.add_input(inp.kind.clone(), inp.name.clone(), inp.ty.clone());
        bmap.insert(inp.node, n);
        backward_inputs.push(BackwardInput::ForwardInput(i));
    }
    for (k, inp) in inputs[num_inputs..].iter().enumerate() {
        let n = backward.add_input(inp.kind.clone(), inp.name.clone(), inp.ty.clone());
        bmap.insert(inp.node, n);
        backward_inputs.push(BackwardInput::Cotangent(k));
    }
    for &id in &order {
        if !bnodes.contains(&id) || matches!(joint.node(id).op, Op::Input(_)) {
            continue;
        }
        let n = joint.node(id);
        let ops: Vec<NodeId> = n
            .operands
            .iter()
            .map(|o| {
                bmap.get(o).copied().ok_or_else(|| {
                    Error::Graph(format!("partition: operand {o:?} missing in backward"))
                })
            })
            .collect::<Result<_>>()?;
        let new = backward.add_typed(n.op.clone(), n.ty.clone(), &ops);
        bmap.insert(id, new);
    }
    let bouts: Vec<NodeId> = grads
        .iter()
        .map(|o| {
            bmap.get(o)
                .copied()
                .ok_or_else(|| Error::Graph(format!("partition: gradient {o:?} missing")))
        })
        .collect::<Result<_>>()?;
    backward.set_outputs(bouts)?;
    // Both graphs are dead-code free by construction; DCE is a cheap safety net.
    Dce.run(&mut forward)?;
    Dce.run(&mut backward)?;
    forward.verify()?;
    backward.verify()?;
    Ok(Split {
        forward,
        backward,
        num_saved,
        backward_inputs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::{joint, Builder};
    use crate::ir::{BinaryOp, DType, Shape, TensorType, UnaryOp};

    /// `loss = sum(exp(tanh(x * w) + 1))`, `w` broadcast from `[4]`; also returns `y = tanh(..)`.
    fn chain() -> Graph {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [8, 4]));
        let w = g.add_input(InputKind::Parameter, "w", TensorType::new(DType::F32, [4]));
        let mut b = Builder::new(&mut g);
        let wb = b.broadcast(w, &Shape::new(&[8, 4]), vec![1]).unwrap();
        let a = b.binary(BinaryOp::Mul, x, wb).unwrap();
        let y = b.unary(UnaryOp::Tanh, a).unwrap();
        let z = b.add_scalar(y, 1.0).unwrap();
        let e = b.unary(UnaryOp::Exp, z).unwrap();
        let l = b.sum_all(e).unwrap();
        g.set_outputs(vec![l, y]).unwrap();
        g
    }

    #[test]
    fn backward_inputs_layout_and_saving() {
        let j = joint(&chain(), 0, &[1]).unwrap();
        let s = partition(&j, 2, 2, SavePolicy::SaveAll).unwrap();
        // Saved values first, then forward inputs, then the cotangent.
        let kinds: Vec<u8> = s
            .backward_inputs
            .iter()
            .map(|b| match b {
                BackwardInput::Saved(_) => 0,
                BackwardInput::ForwardInput(_) => 1,
                BackwardInput::Cotangent(_) => 2,
            })
            .collect();
        assert!(kinds.windows(2).all(|w| w[0] <= w[1]), "{kinds:?}");
        assert_eq!(s.backward_inputs.last(), Some(&BackwardInput::Cotangent(0)));
        // The user output y is needed by the backward graph (tanh's rule) and referenced, not
        // returned a second time; `exp(..)` is saved; x comes in as a forward input.
        assert!(s.backward_inputs.contains(&BackwardInput::Saved(1)));
        assert!(s.backward_inputs.contains(&BackwardInput::ForwardInput(0)));
        assert_eq!(s.needed_forward_inputs(), vec![0]);
        assert_eq!(s.num_saved, 1);
        assert_eq!(s.saved_bytes(), 8 * 4 * 4);
        assert_eq!(s.backward.outputs().len(), 1);
        // Recompute: exp(y + 1) is recomputed from the user output y, so nothing extra is saved.
        let r = partition(&j, 2, 2, SavePolicy::RecomputeElementwise).unwrap();
        assert_eq!(r.num_saved, 0);
        assert_eq!(r.saved_bytes(), 0);
        assert!(r.backward_inputs.contains(&BackwardInput::Saved(1)));
    }

    #[test]
    fn rejects_bad_counts_and_tangent_dependent_outputs() {
        let j = joint(&chain(), 0, &[1]).unwrap();
        assert!(partition(&j, 5, 2, SavePolicy::SaveAll).is_err());
        // Declaring a gradient as a forward output makes it depend on the cotangent.
        let e = partition(&j, 2, 3, SavePolicy::SaveAll).unwrap_err();
        assert!(e.to_string().contains("cotangent"), "{e}");
    }

    #[test]
    fn donation_of_inputs_the_backward_needs_is_dropped() {
        let mut g = chain();
        // Pretend the forward donates x to the output y; the backward graph needs x (the
        // gradient of x * w w.r.t. w), so the donation must go.
        g.add_alias(0, 1).unwrap();
        let j = joint(&g, 0, &[1]).unwrap();
        assert_eq!(j.aliases(), &[(0, 1)]);
        let s = partition(&j, 2, 2, SavePolicy::SaveAll).unwrap();
        assert!(s.backward_inputs.contains(&BackwardInput::ForwardInput(0)));
        assert!(s.forward.aliases().is_empty());
        // Without a gradient w.r.t. w, x is not needed and the donation stays.
        let j = joint(&g, 0, &[]).unwrap();
        let s = partition(&j, 2, 2, SavePolicy::SaveAll).unwrap();
        assert_eq!(s.forward.aliases(), &[(0, 1)]);
    }
}
