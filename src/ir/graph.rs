//! The graph: typed nodes in a petgraph `StableDiGraph`, ordered inputs and outputs.

use super::{Op, TensorType};
use crate::error::{Error, Result};
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use smallvec::SmallVec;

/// Identifies a node (and its value) in a [`Graph`].
pub type NodeId = NodeIndex<u32>;

/// One operation and the value it produces.
#[derive(Clone, Debug)]
pub struct Node {
    /// The operation.
    pub op: Op,
    /// The type of the produced value.
    pub ty: TensorType,
    /// Operands, in order. Mirrored by the graph's edges (edge weight = operand position, a
    /// `usize`: an op such as `Concat` may have any number of operands).
    pub operands: SmallVec<[NodeId; 3]>,
}

/// What a graph input is bound to when the graph runs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum InputKind {
    /// A value the caller passes on every call (a batch).
    Data,
    /// A trainable parameter (lifted from a [`crate::nn::ParamStore`]).
    Parameter,
    /// A non-trainable variable: a frozen parameter or a buffer such as BatchNorm's running mean.
    Buffer,
    /// Optimizer state (moments, momentum buffers).
    OptimizerState,
    /// A scalar hyper-parameter that may change between calls (learning rate, step count).
    Scalar,
    /// The random-number key, advanced by the runtime on every call.
    RngKey,
    /// A cotangent (gradient of a loss with respect to a forward output), for backward graphs.
    Cotangent,
    /// A value saved by a forward graph for its backward graph.
    Saved,
}

/// A declared graph input.
#[derive(Clone, Debug)]
pub struct Input {
    /// The `Input` node.
    pub node: NodeId,
    /// What the input is bound to.
    pub kind: InputKind,
    /// A readable name (parameter path, `x0`, ...). Not part of the fingerprint.
    pub name: String,
    /// Its type.
    pub ty: TensorType,
    /// Whether the caller updates this variable between calls of the program, through other
    /// programs (a training step's parameters, which its optimizer replaces every step): a
    /// backend must then not keep values it derived from the input across calls (see the XLA
    /// backend's packed convolutions). Data inputs are new on every call anyway; set by
    /// [`Graph::set_updated_between_calls`].
    pub updated_between_calls: bool,
}

/// The node, edge and input counts of a graph ([`Graph::size`], [`Graph::with_capacity`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphSize {
    /// Nodes.
    pub nodes: usize,
    /// Edges (operand uses).
    pub edges: usize,
    /// Inputs.
    pub inputs: usize,
}

/// A typed dataflow graph with ordered inputs and outputs.
///
/// Nodes are only added through [`Graph::add`], which infers and checks the result type, so
/// every node in a graph is well typed. Node ids grow in insertion order, and a node's operands
/// always exist before it, so insertion order is a topological order until a pass rewires uses.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    g: StableDiGraph<Node, usize>,
    inputs: Vec<Input>,
    outputs: Vec<NodeId>,
    /// `(input, output)` pairs whose buffers may be shared: the input is donated.
    aliases: Vec<(usize, usize)>,
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty graph with room for `size`'s nodes, edges and inputs (a repeated trace
    /// builds the same graph again without growing its storage step by step).
    pub fn with_capacity(size: GraphSize) -> Self {
        Graph {
            g: StableDiGraph::with_capacity(size.nodes, size.edges),
            inputs: Vec::with_capacity(size.inputs),
            ..Self::default()
        }
    }

    /// How many nodes, edges and inputs the graph has room for without allocating.
    pub(crate) fn capacity(&self) -> GraphSize {
        let (nodes, edges) = self.g.capacity();
        GraphSize {
            nodes,
            edges,
            inputs: self.inputs.capacity(),
        }
    }

    /// How many nodes, edges and inputs the graph has.
    pub fn size(&self) -> GraphSize {
        GraphSize {
            nodes: self.g.node_count(),
            edges: self.g.edge_count(),
            inputs: self.inputs.len(),
        }
    }

    /// Declares a new input and returns its node.
    pub fn add_input(
        &mut self,
        kind: InputKind,
        name: impl Into<String>,
        ty: TensorType,
    ) -> NodeId {
        let index = self.inputs.len();
        let node = self.g.add_node(Node {
            op: Op::Input(index),
            ty: ty.clone(),
            operands: SmallVec::new(),
        });
        self.inputs.push(Input {
            node,
            kind,
            name: name.into(),
            ty,
            updated_between_calls: false,
        });
        node
    }

    /// Adds `op` applied to `operands`, inferring its type. Fails with a type error naming the
    /// op and the operand types.
    pub fn add(&mut self, op: Op, operands: &[NodeId]) -> Result<NodeId> {
        let mut types = SmallVec::<[&TensorType; 3]>::new();
        for &o in operands {
            let n = self.g.node_weight(o).ok_or_else(|| {
                Error::Graph(format!("{}: operand {o:?} is not in the graph", op.name()))
            })?;
            types.push(&n.ty);
        }
        let ty = op.infer(&types)?;
        drop(types);
        Ok(self.add_typed(op, ty, operands))
    }

    /// Adds a node whose type is already known (used by passes that copy checked nodes).
    pub(crate) fn add_typed(&mut self, op: Op, ty: TensorType, operands: &[NodeId]) -> NodeId {
        let id = self.g.add_node(Node {
            op,
            ty,
            operands: SmallVec::from_slice(operands),
        });
        for (i, &o) in operands.iter().enumerate() {
            self.g.add_edge(o, id, i);
        }
        id
    }

    /// Sets the ordered outputs.
    pub fn set_outputs(&mut self, outputs: Vec<NodeId>) -> Result<()> {
        for &o in &outputs {
            if !self.g.contains_node(o) {
                return Err(Error::Graph(format!("output {o:?} is not in the graph")));
            }
        }
        self.outputs = outputs;
        Ok(())
    }

    /// Declares that `input` may be donated to produce `output` (in-place update).
    pub fn add_alias(&mut self, input: usize, output: usize) -> Result<()> {
        let (Some(i), Some(&o)) = (self.inputs.get(input), self.outputs.get(output)) else {
            return Err(Error::Graph(format!(
                "alias ({input}, {output}) out of range"
            )));
        };
        if i.ty != self.g[o].ty {
            return Err(Error::Graph(format!(
                "alias of input {input} ({}) to output {output} ({}) needs equal types",
                i.ty, self.g[o].ty
            )));
        }
        if self.aliases.iter().any(|&(a, b)| a == input || b == output) {
            return Err(Error::Graph(format!(
                "input {input} or output {output} is already aliased"
            )));
        }
        self.aliases.push((input, output));
        Ok(())
    }

    /// Declares whether input `input` is updated between calls by other programs (see
    /// [`Input::updated_between_calls`]).
    pub fn set_updated_between_calls(&mut self, input: usize, updated: bool) -> Result<()> {
        let n = self.inputs.len();
        let inp = self
            .inputs
            .get_mut(input)
            .ok_or_else(|| Error::Graph(format!("input {input} out of range ({n} inputs)")))?;
        inp.updated_between_calls = updated;
        Ok(())
    }

    /// The `(input, output)` donation pairs.
    pub fn aliases(&self) -> &[(usize, usize)] {
        &self.aliases
    }

    /// Replaces the donation pairs (used by passes that renumber inputs or outputs).
    pub(crate) fn set_aliases(&mut self, aliases: Vec<(usize, usize)>) {
        self.aliases = aliases;
    }

    /// The declared inputs, in order.
    pub fn inputs(&self) -> &[Input] {
        &self.inputs
    }

    /// The outputs, in order.
    pub fn outputs(&self) -> &[NodeId] {
        &self.outputs
    }

    /// Types of the outputs, in order.
    pub fn output_types(&self) -> Vec<TensorType> {
        self.outputs.iter().map(|&o| self.g[o].ty.clone()).collect()
    }

    /// The node `id`.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.g[id]
    }

    /// The node `id`, if it exists.
    pub fn get(&self, id: NodeId) -> Option<&Node> {
        self.g.node_weight(id)
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.g.node_count()
    }

    /// No nodes?
    pub fn is_empty(&self) -> bool {
        self.g.node_count() == 0
    }

    /// Is `other` the same graph built the same way: the same node ids holding the same ops
    /// and operands (hence the same types), and the same inputs (kind, type, node, update
    /// flag; names aside), outputs and aliases? Stricter than equal [`Graph::fingerprint`]s
    /// (which ignore node ids), and one pass without sorting or hashing: what
    /// [`crate::trace::Traced::same_program`] compares graphs with (a trace every time is checked
    /// op by op while it is recorded instead, to the same standard).
    pub fn same_structure(&self, other: &Graph) -> bool {
        if self.g.node_count() != other.g.node_count()
            || self.outputs != other.outputs
            || self.aliases != other.aliases
            || self.inputs.len() != other.inputs.len()
        {
            return false;
        }
        let inputs_match = self.inputs.iter().zip(&other.inputs).all(|(a, b)| {
            a.node == b.node
                && a.kind == b.kind
                && a.updated_between_calls == b.updated_between_calls
                && a.ty == b.ty
        });
        // A node's type follows from its op and its operands' types (every node is typed by
        // `Op::infer` or copied from a typed node), so nodes compare without their types.
        inputs_match
            && self
                .g
                .node_indices()
                .zip(other.g.node_indices())
                .all(|(a, b)| {
                    let (x, y) = (&self.g[a], &other.g[b]);
                    a == b && x.operands == y.operands && x.op.same_as(&y.op)
                })
    }

    /// The underlying petgraph graph (read-only), e.g. for petgraph's algorithms.
    pub fn petgraph(&self) -> &StableDiGraph<Node, usize> {
        &self.g
    }

    /// Nodes that use `id` as an operand (each user once).
    pub fn users(&self, id: NodeId) -> Vec<NodeId> {
        let mut u: Vec<NodeId> = self
            .g
            .edges_directed(id, Direction::Outgoing)
            .map(|e| e.target())
            .collect();
        u.sort();
        u.dedup();
        u
    }

    /// `roots` and every node they depend on, transitively (their operands, theirs, ...).
    pub fn ancestors(&self, roots: &[NodeId]) -> std::collections::HashSet<NodeId> {
        let mut seen = std::collections::HashSet::new();
        let mut stack: Vec<NodeId> = roots.to_vec();
        while let Some(n) = stack.pop() {
            if seen.insert(n) {
                stack.extend(self.node(n).operands.iter().copied());
            }
        }
        seen
    }

    /// All node ids in a deterministic topological order (operands before users; ties broken
    /// by insertion order).
    pub fn topo_order(&self) -> Vec<NodeId> {
        // Kahn's algorithm with a min-heap on the index, so the order depends only on structure
        // and insertion order, never on hash iteration.
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        let bound = self
            .g
            .node_indices()
            .map(|i| i.index() + 1)
            .max()
            .unwrap_or(0);
        let mut indeg: Vec<usize> = vec![0; bound];
        for id in self.g.node_indices() {
            indeg[id.index()] = self.g[id].operands.len();
        }
        let mut ready: BinaryHeap<Reverse<u32>> = self
            .g
            .node_indices()
            .filter(|id| indeg[id.index()] == 0)
            .map(|id| Reverse(id.index() as u32))
            .collect();
        let mut order = Vec::with_capacity(self.g.node_count());
        while let Some(Reverse(i)) = ready.pop() {
            let id = NodeId::new(i as usize);
            order.push(id);
            for e in self.g.edges_directed(id, Direction::Outgoing) {
                let t = e.target().index();
                indeg[t] -= 1;
                if indeg[t] == 0 {
                    ready.push(Reverse(t as u32));
                }
            }
        }
        order
    }

    /// Replaces every use of `old` (as an operand or output) by `new`. Types must match.
    pub fn replace_uses(&mut self, old: NodeId, new: NodeId) -> Result<()> {
        if old == new {
            return Ok(());
        }
        if self.g[old].ty != self.g[new].ty {
            return Err(Error::Graph(format!(
                "cannot replace {} by {}: types differ",
                self.g[old].ty, self.g[new].ty
            )));
        }
        self.move_uses(old, new);
        Ok(())
    }

    /// Moves every use of `old` (as an operand or output) to `new`, except `new`'s own use of
    /// `old`. Types are the caller's business.
    fn move_uses(&mut self, old: NodeId, new: NodeId) {
        let uses: Vec<(petgraph::stable_graph::EdgeIndex<u32>, NodeId, usize)> = self
            .g
            .edges_directed(old, Direction::Outgoing)
            .filter(|e| e.target() != new)
            .map(|e| (e.id(), e.target(), *e.weight()))
            .collect();
        for (e, user, pos) in uses {
            self.g.remove_edge(e);
            self.g.add_edge(new, user, pos);
            self.g[user].operands[pos] = new;
        }
        for o in &mut self.outputs {
            if *o == old {
                *o = new;
            }
        }
    }

    /// Removes a node that has no users and is not an input or output.
    pub(crate) fn remove_unused(&mut self, id: NodeId) -> bool {
        let used = self
            .g
            .edges_directed(id, Direction::Outgoing)
            .next()
            .is_some();
        let is_input = matches!(self.g[id].op, Op::Input(_));
        if used || is_input || self.outputs.contains(&id) {
            return false;
        }
        self.g.remove_node(id).is_some()
    }

    /// Removes inputs for which `keep` is false (they must be unused), renumbering the rest.
    /// Returns, for each new input position, its old position.
    pub(crate) fn retain_inputs(
        &mut self,
        keep: impl Fn(usize, &Input) -> bool,
    ) -> Result<Vec<usize>> {
        let mut kept = Vec::new();
        let old = std::mem::take(&mut self.inputs);
        for (i, inp) in old.into_iter().enumerate() {
            if keep(i, &inp) {
                let new_index = kept.len();
                self.g[inp.node].op = Op::Input(new_index);
                kept.push(i);
                self.inputs.push(inp);
            } else {
                if self
                    .g
                    .edges_directed(inp.node, Direction::Outgoing)
                    .next()
                    .is_some()
                    || self.outputs.contains(&inp.node)
                {
                    return Err(Error::Graph(format!(
                        "input {i} ({}) is still used",
                        inp.name
                    )));
                }
                self.g.remove_node(inp.node);
            }
        }
        let remap = |old: usize| kept.iter().position(|&k| k == old);
        self.aliases = self
            .aliases
            .iter()
            .filter_map(|&(i, o)| remap(i).map(|n| (n, o)))
            .collect();
        Ok(kept)
    }

    /// Makes rank-2 input `index` arrive transposed: its type becomes `[d1, d0]` and a
    /// `Transpose([1, 0])` of it takes its place for every user and output. Returns that
    /// transpose. (A device layout change: XLA folds the transpose into the consuming dots.)
    pub(crate) fn transpose_input(&mut self, index: usize) -> Result<NodeId> {
        let node = self
            .inputs
            .get(index)
            .ok_or_else(|| Error::Graph(format!("no input {index}")))?
            .node;
        let ty = self.g[node].ty.clone();
        let [d0, d1] = ty.shape.dims()[..] else {
            return Err(Error::Graph(format!(
                "input {index} of type {ty} is not rank 2: cannot transpose it"
            )));
        };
        let transposed = TensorType::new(ty.dtype, [d1, d0]);
        self.g[node].ty = transposed.clone();
        self.inputs[index].ty = transposed;
        let t = self.add_typed(Op::Transpose(vec![1, 0]), ty, &[node]);
        self.move_uses(node, t);
        Ok(t)
    }

    /// Makes rank-2 output `index` leave transposed (a `Transpose([1, 0])` of it becomes the
    /// output): the counterpart of [`Graph::transpose_input`] for a variable's new value.
    pub(crate) fn transpose_output(&mut self, index: usize) -> Result<NodeId> {
        let node = *self
            .outputs
            .get(index)
            .ok_or_else(|| Error::Graph(format!("no output {index}")))?;
        let t = self.add(Op::Transpose(vec![1, 0]), &[node])?;
        self.outputs[index] = t;
        Ok(t)
    }

    /// Checks the invariants: operands exist and match the edges, types re-infer to the stored
    /// types, inputs and outputs exist, the graph is acyclic.
    pub fn verify(&self) -> Result<()> {
        for id in self.g.node_indices() {
            let n = &self.g[id];
            let mut edges: Vec<(usize, NodeId)> = self
                .g
                .edges_directed(id, Direction::Incoming)
                .map(|e| (*e.weight(), e.source()))
                .collect();
            edges.sort();
            let from_edges: Vec<NodeId> = edges.iter().map(|e| e.1).collect();
            if from_edges.as_slice() != n.operands.as_slice() {
                return Err(Error::Graph(format!(
                    "node {id:?}: edges disagree with operands"
                )));
            }
            if let Op::Input(i) = n.op {
                match self.inputs.get(i) {
                    Some(inp) if inp.node == id && inp.ty == n.ty => {}
                    _ => return Err(Error::Graph(format!("node {id:?}: bad input index {i}"))),
                }
            } else {
                let types: Vec<&TensorType> = n.operands.iter().map(|&o| &self.g[o].ty).collect();
                let ty = n.op.infer(&types)?;
                if ty != n.ty {
                    return Err(Error::Graph(format!(
                        "node {id:?} ({}): stored type {} but infers {ty}",
                        n.op.name(),
                        n.ty
                    )));
                }
            }
        }
        if self.topo_order().len() != self.g.node_count() {
            return Err(Error::Graph("cycle".into()));
        }
        for &o in &self.outputs {
            if !self.g.contains_node(o) {
                return Err(Error::Graph(format!("output {o:?} missing")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;

    /// A `Concat` of 300 inputs: more operands than a `u8` position can number.
    fn wide_concat() -> (Graph, Vec<NodeId>, NodeId) {
        wide_concat_into(Graph::new())
    }

    /// [`wide_concat`] built into `g` (an empty graph).
    fn wide_concat_into(mut g: Graph) -> (Graph, Vec<NodeId>, NodeId) {
        let xs: Vec<NodeId> = (0..300)
            .map(|i| {
                g.add_input(
                    InputKind::Data,
                    format!("x{i}"),
                    TensorType::new(DType::F32, [1]),
                )
            })
            .collect();
        let y = g.add(Op::Concat { axis: 0 }, &xs).unwrap();
        g.set_outputs(vec![y]).unwrap();
        (g, xs, y)
    }

    /// `size` counts nodes, edges (one per operand use) and inputs; a graph built again with
    /// room for that size is the same graph.
    #[test]
    fn a_graph_built_with_capacity_is_the_same_graph() {
        let (g, _, _) = wide_concat();
        let size = g.size();
        assert_eq!(
            size,
            GraphSize {
                nodes: 301,
                edges: 300,
                inputs: 300
            }
        );
        let (again, _, _) = wide_concat_into(Graph::with_capacity(size));
        assert_eq!(again.size(), size);
        assert_eq!(again.fingerprint(), g.fingerprint());
    }

    /// `x * c + x` over `[2, 3]`, its input named `name`, of kind `kind`.
    fn scaled(c: f64, name: &str, kind: InputKind) -> Graph {
        use crate::ir::{BinaryOp, Literal};
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, [2, 3]);
        let x = g.add_input(kind, name, ty);
        let c = g
            .add(Op::Constant(Literal::scalar(DType::F32, c)), &[])
            .unwrap();
        let c = g
            .add(
                Op::Broadcast {
                    shape: crate::ir::Shape::new(&[2, 3]),
                    dims: vec![],
                },
                &[c],
            )
            .unwrap();
        let y = g.add(Op::Binary(BinaryOp::Mul), &[x, c]).unwrap();
        let z = g.add(Op::Binary(BinaryOp::Add), &[y, x]).unwrap();
        g.set_outputs(vec![z]).unwrap();
        g
    }

    /// Two graphs built the same way have the same structure whatever their inputs' names;
    /// a different constant, input kind, output list, alias, update flag or node order does not.
    #[test]
    fn same_structure_compares_nodes_inputs_and_outputs() {
        let g = scaled(2.0, "x", InputKind::Data);
        assert!(g.same_structure(&scaled(2.0, "renamed", InputKind::Data)));
        assert!(!g.same_structure(&scaled(3.0, "x", InputKind::Data)));
        assert!(!g.same_structure(&scaled(2.0, "x", InputKind::Parameter)));
        let mut two_outputs = scaled(2.0, "x", InputKind::Data);
        let out = two_outputs.outputs()[0];
        two_outputs.set_outputs(vec![out, out]).unwrap();
        assert!(!g.same_structure(&two_outputs));
        let mut aliased = scaled(2.0, "x", InputKind::Data);
        aliased.add_alias(0, 0).unwrap();
        assert!(!g.same_structure(&aliased));
        let mut updated = scaled(2.0, "x", InputKind::Data);
        updated.set_updated_between_calls(0, true).unwrap();
        assert!(!g.same_structure(&updated));
        // The same ops added in another order.
        let b = {
            let mut g = Graph::new();
            let ty = TensorType::new(DType::F32, [1]);
            let x = g.add_input(InputKind::Data, "x", ty.clone());
            let e = g.add(Op::Unary(crate::ir::UnaryOp::Exp), &[x]).unwrap();
            let n = g.add(Op::Unary(crate::ir::UnaryOp::Neg), &[x]).unwrap();
            let y = g.add(Op::Concat { axis: 0 }, &[e, n]).unwrap();
            g.set_outputs(vec![y]).unwrap();
            g
        };
        let mut swapped = Graph::new();
        let ty = TensorType::new(DType::F32, [1]);
        let x = swapped.add_input(InputKind::Data, "x", ty);
        let n = swapped
            .add(Op::Unary(crate::ir::UnaryOp::Neg), &[x])
            .unwrap();
        let e = swapped
            .add(Op::Unary(crate::ir::UnaryOp::Exp), &[x])
            .unwrap();
        let y = swapped.add(Op::Concat { axis: 0 }, &[e, n]).unwrap();
        swapped.set_outputs(vec![y]).unwrap();
        assert!(!swapped.same_structure(&b));
        assert!(b.same_structure(&b.clone()));
    }

    /// A transposed input keeps the graph well typed: users and outputs read a transpose of
    /// it, of the old type; a transposed output has the new type.
    #[test]
    fn transpose_input_and_output_keep_the_graph_well_typed() {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [4, 2]));
        let w = g.add_input(
            InputKind::Parameter,
            "w",
            TensorType::new(DType::F32, [3, 2]),
        );
        let dims = crate::ir::DotDims {
            lhs_batch: vec![],
            rhs_batch: vec![],
            lhs_contract: vec![1],
            rhs_contract: vec![1],
        };
        let y = g.add(Op::DotGeneral(dims), &[x, w]).unwrap();
        let w2 = g.add(Op::Unary(crate::ir::UnaryOp::Neg), &[w]).unwrap();
        g.set_outputs(vec![y, w, w2]).unwrap();
        let t = g.transpose_input(1).unwrap();
        g.verify().unwrap();
        assert_eq!(g.inputs()[1].ty.shape.dims(), &[2, 3]);
        assert_eq!(g.node(w).ty.shape.dims(), &[2, 3]);
        assert_eq!(g.node(t).ty.shape.dims(), &[3, 2]);
        assert_eq!(g.node(y).operands[1], t);
        assert_eq!(g.node(w2).operands[0], t);
        assert_eq!(g.outputs()[1], t);
        assert_eq!(g.users(w), vec![t]);
        let o = g.transpose_output(2).unwrap();
        g.verify().unwrap();
        assert_eq!(g.node(o).ty.shape.dims(), &[2, 3]);
        assert!(g.transpose_input(0).is_ok());
        assert!(g.transpose_input(5).is_err());
        let mut v = Graph::new();
        v.add_input(InputKind::Data, "v", TensorType::new(DType::F32, [3]));
        assert!(v.transpose_input(0).is_err());
    }

    #[test]
    fn more_than_255_operands_verify() {
        let (g, _, y) = wide_concat();
        g.verify().unwrap();
        assert_eq!(g.node(y).operands.len(), 300);
    }

    #[test]
    fn replace_uses_rewrites_the_operand_at_a_high_position() {
        let (mut g, xs, y) = wide_concat();
        let z = g.add_input(InputKind::Data, "z", TensorType::new(DType::F32, [1]));
        g.replace_uses(xs[260], z).unwrap();
        g.verify().unwrap();
        let ops = &g.node(y).operands;
        assert_eq!(ops[260], z);
        assert!(ops.iter().enumerate().all(|(i, &o)| i == 260 || o == xs[i]));
    }
}
