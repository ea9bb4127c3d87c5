//! Human-readable text form and Graphviz DOT export.

use super::{Graph, InputKind, NodeId, Op};
use std::collections::HashMap;
use std::fmt::{self, Write};

fn kind_name(k: &InputKind) -> &'static str {
    match k {
        InputKind::Data => "data",
        InputKind::Parameter => "param",
        InputKind::Buffer => "buffer",
        InputKind::OptimizerState => "opt_state",
        InputKind::Scalar => "scalar",
        InputKind::RngKey => "rng_key",
        InputKind::Cotangent => "cotangent",
        InputKind::Saved => "saved",
    }
}

/// The attributes of an op, rendered for the text form (empty when there are none).
pub fn op_attrs(op: &Op) -> String {
    match op {
        Op::Input(i) => format!("{i}"),
        Op::Constant(l) => format!("{l:?}"),
        Op::Iota { dim, .. } => format!("dim={dim}"),
        Op::Unary(_) | Op::Binary(_) | Op::Select => String::new(),
        Op::Compare(c) => c.name().to_string(),
        Op::Convert(d) => d.to_string(),
        Op::Broadcast { dims, .. } => format!("dims={dims:?}"),
        Op::Reshape(_) => String::new(),
        Op::Transpose(p) => format!("perm={p:?}"),
        Op::Slice {
            start,
            limit,
            stride,
        } => format!("start={start:?} limit={limit:?} stride={stride:?}"),
        Op::Concat { axis } => format!("axis={axis}"),
        Op::Pad {
            low,
            high,
            interior,
        } => format!("low={low:?} high={high:?} interior={interior:?}"),
        Op::Reverse(d) => format!("dims={d:?}"),
        Op::DotGeneral(d) => format!(
            "batch={:?}x{:?} contract={:?}x{:?}",
            d.lhs_batch, d.rhs_batch, d.lhs_contract, d.rhs_contract
        ),
        Op::Reduce { kind, axes } => format!("{} axes={axes:?}", kind.name()),
        Op::ReduceWindow { kind, attrs } => format!(
            "{} window={:?} strides={:?} pad={:?}",
            kind.name(),
            attrs.window,
            attrs.strides,
            attrs.padding
        ),
        Op::SelectAndScatter(a) => {
            format!(
                "window={:?} strides={:?} pad={:?}",
                a.window, a.strides, a.padding
            )
        }
        Op::Conv(c) => format!(
            "strides={:?} pad={:?} lhs_dil={:?} rhs_dil={:?} groups={} batch_groups={}",
            c.strides, c.padding, c.lhs_dilation, c.rhs_dilation, c.feature_groups, c.batch_groups
        ),
        Op::Take { axis } | Op::ScatterAdd { axis } => format!("axis={axis}"),
        Op::AllReduce(kind) => kind.name().to_string(),
        Op::Barrier | Op::StopGradient => String::new(),
    }
}

impl fmt::Display for Graph {
    /// The text form:
    /// ```text
    /// graph(%0: f32[2,10] data "x0", %1: f32[10,10] param "0.weight") {
    ///   %2 = dot_general(%0, %1) {batch=[]x[] contract=[1]x[1]} : f32[2,10]
    ///   return %2
    /// }
    /// ```
    /// (a training step's variables read `param updated "0.weight"`, see
    /// [`crate::ir::Input::updated_between_calls`]).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let order = self.topo_order();
        let num: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        f.write_str("graph(")?;
        for (i, inp) in self.inputs().iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            let updated = if inp.updated_between_calls {
                " updated"
            } else {
                ""
            };
            write!(
                f,
                "%{}: {} {}{updated} {:?}",
                num[&inp.node],
                inp.ty,
                kind_name(&inp.kind),
                inp.name
            )?;
        }
        f.write_str(") {\n")?;
        for &id in &order {
            let n = self.node(id);
            if matches!(n.op, Op::Input(_)) {
                continue;
            }
            let args: Vec<String> = n.operands.iter().map(|o| format!("%{}", num[o])).collect();
            let attrs = op_attrs(&n.op);
            let attrs = if attrs.is_empty() {
                String::new()
            } else {
                format!(" {{{attrs}}}")
            };
            writeln!(
                f,
                "  %{} = {}({}){} : {}",
                num[&id],
                n.op.name(),
                args.join(", "),
                attrs,
                n.ty
            )?;
        }
        let outs: Vec<String> = self
            .outputs()
            .iter()
            .map(|o| format!("%{}", num[o]))
            .collect();
        writeln!(f, "  return {}", outs.join(", "))?;
        if !self.aliases().is_empty() {
            writeln!(f, "  // donated (input, output): {:?}", self.aliases())?;
        }
        f.write_str("}")
    }
}

impl Graph {
    /// Graphviz DOT source: one box per node labelled with op, attributes and type; edges
    /// labelled with operand positions; outputs marked.
    pub fn to_dot(&self) -> String {
        let mut s = String::from("digraph kiln {\n  node [shape=box, fontname=monospace];\n");
        let order = self.topo_order();
        for &id in &order {
            let n = self.node(id);
            let label = match &n.op {
                Op::Input(i) => {
                    let inp = &self.inputs()[*i];
                    format!("{} {}\\n{}", kind_name(&inp.kind), inp.name, n.ty)
                }
                op => {
                    let a = op_attrs(op);
                    if a.is_empty() {
                        format!("{}\\n{}", op.name(), n.ty)
                    } else {
                        format!("{} {}\\n{}", op.name(), a.replace('"', "'"), n.ty)
                    }
                }
            };
            let style = if matches!(n.op, Op::Input(_)) {
                ", style=filled, fillcolor=lightblue"
            } else {
                ""
            };
            let _ = writeln!(s, "  n{} [label=\"{}\"{}];", id.index(), label, style);
            for (p, o) in n.operands.iter().enumerate() {
                let _ = writeln!(s, "  n{} -> n{} [label=\"{}\"];", o.index(), id.index(), p);
            }
        }
        for (i, o) in self.outputs().iter().enumerate() {
            let _ = writeln!(
                s,
                "  out{i} [label=\"output {i}\", shape=oval];\n  n{} -> out{i};",
                o.index()
            );
        }
        s.push_str("}\n");
        s
    }
}
