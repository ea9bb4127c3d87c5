//! Lowering of a [`Graph`] to StableHLO text (an MLIR module with one `@main` function).
//!
//! Ops are written in MLIR's generic form (`"stablehlo.add"(%a, %b) : (..) -> ..`), which every
//! StableHLO parser accepts regardless of pretty-printing changes between versions. Donated
//! inputs carry `tf.aliasing_output`, the attribute PJRT reads for input/output aliasing.

use crate::error::{Error, Result};
use crate::ir::{
    BinaryOp, CompareOp, ConvAttrs, DType, Graph, Literal, NodeId, Op, ReduceKind, TensorType,
    UnaryOp, WindowAttrs,
};
use std::collections::HashMap;
use std::fmt::Write;

/// The MLIR element type of `d`.
pub fn element_type(d: DType) -> &'static str {
    match d {
        DType::Bool => "i1",
        DType::U32 => "ui32",
        DType::I32 => "i32",
        DType::I64 => "i64",
        DType::F32 => "f32",
        DType::F64 => "f64",
    }
}

/// The MLIR tensor type of `t`, e.g. `tensor<2x3xf32>`.
pub fn tensor_type(t: &TensorType) -> String {
    let mut s = String::from("tensor<");
    for d in t.shape.dims() {
        let _ = write!(s, "{d}x");
    }
    s.push_str(element_type(t.dtype));
    s.push('>');
    s
}

fn i64_array(v: impl IntoIterator<Item = i64>) -> String {
    let items: Vec<String> = v.into_iter().map(|x| x.to_string()).collect();
    if items.is_empty() {
        return "array<i64>".to_string();
    }
    format!("array<i64: {}>", items.join(", "))
}

fn usize_array(v: &[usize]) -> String {
    i64_array(v.iter().map(|&x| x as i64))
}

fn list(v: &[usize]) -> String {
    let items: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    format!("[{}]", items.join(", "))
}

/// One element of a literal as an MLIR attribute value. Floats are written as their exact bit
/// pattern in hex, so constants survive the round trip bit for bit.
fn scalar_value(d: DType, bytes: &[u8]) -> String {
    match d {
        DType::Bool => if bytes[0] != 0 { "true" } else { "false" }.to_string(),
        DType::U32 => u32::from_le_bytes(bytes.try_into().unwrap_or_default()).to_string(),
        DType::I32 => i32::from_le_bytes(bytes.try_into().unwrap_or_default()).to_string(),
        DType::I64 => i64::from_le_bytes(bytes.try_into().unwrap_or_default()).to_string(),
        DType::F32 => format!(
            "0x{:08X}",
            u32::from_le_bytes(bytes.try_into().unwrap_or_default())
        ),
        DType::F64 => format!(
            "0x{:016X}",
            u64::from_le_bytes(bytes.try_into().unwrap_or_default())
        ),
    }
}

fn dense(lit: &Literal) -> String {
    let d = lit.ty().dtype;
    let s = d.size_in_bytes();
    let b = lit.bytes();
    let splat = b.len() >= s && b.chunks(s).all(|c| c == &b[..s]);
    if splat && !b.is_empty() {
        return format!("dense<{}>", scalar_value(d, &b[..s]));
    }
    if d == DType::Bool {
        // i1 has no portable raw-hex layout: write the elements out, nested by shape.
        let vals: Vec<&str> = b
            .iter()
            .map(|&x| if x != 0 { "true" } else { "false" })
            .collect();
        return format!("dense<{}>", nest(&vals, lit.ty().shape.dims()));
    }
    let mut hex = String::with_capacity(2 + 2 * b.len());
    hex.push_str("0x");
    for byte in b {
        let _ = write!(hex, "{byte:02X}");
    }
    format!("dense<\"{hex}\">")
}

fn nest(vals: &[&str], dims: &[usize]) -> String {
    match dims.split_first() {
        None => vals.first().copied().unwrap_or("false").to_string(),
        Some((&n, rest)) => {
            let chunk = rest.iter().product::<usize>().max(1);
            let parts: Vec<String> = (0..n)
                .map(|i| nest(&vals[i * chunk..(i + 1) * chunk], rest))
                .collect();
            format!("[{}]", parts.join(", "))
        }
    }
}

fn identity_literal(kind: ReduceKind, d: DType) -> Literal {
    match (kind, d) {
        (ReduceKind::Sum, _) => Literal::scalar(d, 0.0),
        (ReduceKind::Max, DType::F32 | DType::F64) => Literal::scalar(d, f64::NEG_INFINITY),
        (ReduceKind::Min, DType::F32 | DType::F64) => Literal::scalar(d, f64::INFINITY),
        (ReduceKind::Max, DType::I32) => Literal::scalar(d, i32::MIN as f64),
        (ReduceKind::Min, DType::I32) => Literal::scalar(d, i32::MAX as f64),
        (ReduceKind::Max, DType::I64) => Literal::scalar(d, i64::MIN as f64),
        (ReduceKind::Min, DType::I64) => Literal::scalar(d, i64::MAX as f64),
        (ReduceKind::Max, _) => Literal::scalar(d, 0.0),
        (ReduceKind::Min, _) => Literal::scalar(d, u32::MAX as f64),
    }
}

fn reducer_op(kind: ReduceKind) -> &'static str {
    match kind {
        ReduceKind::Sum => "stablehlo.add",
        ReduceKind::Max => "stablehlo.maximum",
        ReduceKind::Min => "stablehlo.minimum",
    }
}

fn unary_name(u: UnaryOp) -> &'static str {
    match u {
        UnaryOp::Neg => "stablehlo.negate",
        UnaryOp::Abs => "stablehlo.abs",
        UnaryOp::Exp => "stablehlo.exponential",
        UnaryOp::Log => "stablehlo.log",
        UnaryOp::Log1p => "stablehlo.log_plus_one",
        UnaryOp::Sqrt => "stablehlo.sqrt",
        UnaryOp::Rsqrt => "stablehlo.rsqrt",
        UnaryOp::Tanh => "stablehlo.tanh",
        UnaryOp::Logistic => "stablehlo.logistic",
        UnaryOp::Erf => "chlo.erf",
        UnaryOp::Sin => "stablehlo.sine",
        UnaryOp::Cos => "stablehlo.cosine",
        UnaryOp::Floor => "stablehlo.floor",
        UnaryOp::Ceil => "stablehlo.ceil",
        UnaryOp::Sign => "stablehlo.sign",
        UnaryOp::Not => "stablehlo.not",
    }
}

fn binary_name(b: BinaryOp) -> &'static str {
    match b {
        BinaryOp::Add => "stablehlo.add",
        BinaryOp::Sub => "stablehlo.subtract",
        BinaryOp::Mul => "stablehlo.multiply",
        BinaryOp::Div => "stablehlo.divide",
        BinaryOp::Rem => "stablehlo.remainder",
        BinaryOp::Pow => "stablehlo.power",
        BinaryOp::Max => "stablehlo.maximum",
        BinaryOp::Min => "stablehlo.minimum",
        BinaryOp::And => "stablehlo.and",
        BinaryOp::Or => "stablehlo.or",
        BinaryOp::Xor => "stablehlo.xor",
        BinaryOp::ShiftLeft => "stablehlo.shift_left",
        BinaryOp::ShiftRightLogical => "stablehlo.shift_right_logical",
    }
}

fn compare_dir(c: CompareOp) -> &'static str {
    match c {
        CompareOp::Eq => "EQ",
        CompareOp::Ne => "NE",
        CompareOp::Lt => "LT",
        CompareOp::Le => "LE",
        CompareOp::Gt => "GT",
        CompareOp::Ge => "GE",
    }
}

fn compare_type(d: DType) -> &'static str {
    match d {
        DType::F32 | DType::F64 => "FLOAT",
        DType::Bool | DType::U32 => "UNSIGNED",
        DType::I32 | DType::I64 => "SIGNED",
    }
}

fn padding_attr(p: &[(i64, i64)]) -> String {
    let rows: Vec<String> = p.iter().map(|(l, h)| format!("[{l}, {h}]")).collect();
    format!("dense<[{}]> : tensor<{}x2xi64>", rows.join(", "), p.len())
}

/// Emits the module text.
struct Emitter<'g> {
    g: &'g Graph,
    out: String,
    names: HashMap<NodeId, String>,
}

impl<'g> Emitter<'g> {
    fn name(&self, id: NodeId) -> &str {
        &self.names[&id]
    }

    fn ty(&self, id: NodeId) -> String {
        tensor_type(&self.g.node(id).ty)
    }

    /// `  %res = "op"(args) {attrs} : (arg types) -> result type`
    fn generic(
        &mut self,
        res: &str,
        op: &str,
        args: &[&str],
        arg_tys: &[String],
        attrs: &str,
        out_ty: &str,
    ) {
        let attrs = if attrs.is_empty() {
            String::new()
        } else {
            format!(" {{{attrs}}}")
        };
        let _ = writeln!(
            self.out,
            "    {res} = \"{op}\"({}){attrs} : ({}) -> {out_ty}",
            args.join(", "),
            arg_tys.join(", ")
        );
    }

    fn constant(&mut self, res: &str, lit: &Literal) {
        let _ = writeln!(
            self.out,
            "    {res} = \"stablehlo.constant\"() {{value = {} : {ty}}} : () -> {ty}",
            dense(lit),
            ty = tensor_type(lit.ty())
        );
    }

    /// A reduction body region combining two scalars of `d` with `op`.
    fn region(&self, prefix: &str, d: DType, op: &str) -> String {
        let s = tensor_type(&TensorType::scalar(d));
        format!(
            "{{\n    ^bb0({prefix}_a: {s}, {prefix}_b: {s}):\n      {prefix}_r = \"{op}\"({prefix}_a, {prefix}_b) : ({s}, {s}) -> {s}\n      \"stablehlo.return\"({prefix}_r) : ({s}) -> ()\n    }}"
        )
    }

    fn node(&mut self, id: NodeId) -> Result<()> {
        let n = self.g.node(id);
        let res = format!("%v{}", id.index());
        let out_ty = tensor_type(&n.ty);
        let args: Vec<String> = n
            .operands
            .iter()
            .map(|&o| self.name(o).to_string())
            .collect();
        let arg_refs: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let arg_tys: Vec<String> = n.operands.iter().map(|&o| self.ty(o)).collect();
        match &n.op {
            Op::Input(i) => {
                self.names.insert(id, format!("%arg{i}"));
                return Ok(());
            }
            Op::Constant(lit) => self.constant(&res, lit),
            Op::Iota { dim, .. } => self.generic(
                &res,
                "stablehlo.iota",
                &[],
                &[],
                &format!("iota_dimension = {dim} : i64"),
                &out_ty,
            ),
            Op::Unary(u) => self.generic(&res, unary_name(*u), &arg_refs, &arg_tys, "", &out_ty),
            Op::Binary(b) => self.generic(&res, binary_name(*b), &arg_refs, &arg_tys, "", &out_ty),
            Op::Compare(c) => {
                let d = self.g.node(n.operands[0]).ty.dtype;
                let attrs = format!(
                    "comparison_direction = #stablehlo<comparison_direction {}>, compare_type = #stablehlo<comparison_type {}>",
                    compare_dir(*c),
                    compare_type(d)
                );
                self.generic(
                    &res,
                    "stablehlo.compare",
                    &arg_refs,
                    &arg_tys,
                    &attrs,
                    &out_ty,
                )
            }
            Op::Select => self.generic(&res, "stablehlo.select", &arg_refs, &arg_tys, "", &out_ty),
            Op::Convert(_) => {
                self.generic(&res, "stablehlo.convert", &arg_refs, &arg_tys, "", &out_ty)
            }
            Op::Broadcast { dims, .. } => {
                let attrs = format!("broadcast_dimensions = {}", usize_array(dims));
                self.generic(
                    &res,
                    "stablehlo.broadcast_in_dim",
                    &arg_refs,
                    &arg_tys,
                    &attrs,
                    &out_ty,
                )
            }
            Op::Reshape(_) => {
                self.generic(&res, "stablehlo.reshape", &arg_refs, &arg_tys, "", &out_ty)
            }
            Op::Transpose(perm) => {
                let attrs = format!("permutation = {}", usize_array(perm));
                self.generic(
                    &res,
                    "stablehlo.transpose",
                    &arg_refs,
                    &arg_tys,
                    &attrs,
                    &out_ty,
                )
            }
            Op::Slice {
                start,
                limit,
                stride,
            } => {
                let attrs = format!(
                    "start_indices = {}, limit_indices = {}, strides = {}",
                    usize_array(start),
                    usize_array(limit),
                    usize_array(stride)
                );
                self.generic(
                    &res,
                    "stablehlo.slice",
                    &arg_refs,
                    &arg_tys,
                    &attrs,
                    &out_ty,
                )
            }
            Op::Concat { axis } => {
                let attrs = format!("dimension = {axis} : i64");
                self.generic(
                    &res,
                    "stablehlo.concatenate",
                    &arg_refs,
                    &arg_tys,
                    &attrs,
                    &out_ty,
                )
            }
            Op::Pad {
                low,
                high,
                interior,
            } => {
                let attrs = format!(
                    "edge_padding_low = {}, edge_padding_high = {}, interior_padding = {}",
                    i64_array(low.iter().copied()),
                    i64_array(high.iter().copied()),
                    usize_array(interior)
                );
                self.generic(&res, "stablehlo.pad", &arg_refs, &arg_tys, &attrs, &out_ty)
            }
            Op::Reverse(dims) => {
                let attrs = format!("dimensions = {}", usize_array(dims));
                self.generic(
                    &res,
                    "stablehlo.reverse",
                    &arg_refs,
                    &arg_tys,
                    &attrs,
                    &out_ty,
                )
            }
            Op::DotGeneral(d) => {
                let mut parts = Vec::new();
                if !d.lhs_batch.is_empty() {
                    parts.push(format!("lhs_batching_dimensions = {}", list(&d.lhs_batch)));
                    parts.push(format!("rhs_batching_dimensions = {}", list(&d.rhs_batch)));
                }
                if !d.lhs_contract.is_empty() {
                    parts.push(format!(
                        "lhs_contracting_dimensions = {}",
                        list(&d.lhs_contract)
                    ));
                    parts.push(format!(
                        "rhs_contracting_dimensions = {}",
                        list(&d.rhs_contract)
                    ));
                }
                let attrs = format!(
                    "dot_dimension_numbers = #stablehlo.dot<{}>",
                    parts.join(", ")
                );
                self.generic(
                    &res,
                    "stablehlo.dot_general",
                    &arg_refs,
                    &arg_tys,
                    &attrs,
                    &out_ty,
                )
            }
            Op::Reduce { kind, axes } => {
                let d = n.ty.dtype;
                let init = format!("{res}_init");
                self.constant(&init, &identity_literal(*kind, d));
                let region = self.region(&format!("{res}_body"), d, reducer_op(*kind));
                let st = tensor_type(&TensorType::scalar(d));
                let _ = writeln!(
                    self.out,
                    "    {res} = \"stablehlo.reduce\"({}, {init}) ({region}) {{dimensions = {}}} : ({}, {st}) -> {out_ty}",
                    args[0],
                    usize_array(axes),
                    arg_tys[0]
                );
            }
            Op::ReduceWindow { kind, attrs } => {
                let d = n.ty.dtype;
                let init = format!("{res}_init");
                self.constant(&init, &identity_literal(*kind, d));
                let region = self.region(&format!("{res}_body"), d, reducer_op(*kind));
                let st = tensor_type(&TensorType::scalar(d));
                let _ = writeln!(
                    self.out,
                    "    {res} = \"stablehlo.reduce_window\"({}, {init}) ({region}) {{{}}} : ({}, {st}) -> {out_ty}",
                    args[0],
                    window_attrs(attrs),
                    arg_tys[0]
                );
            }
            Op::SelectAndScatter(attrs) => {
                let d = n.ty.dtype;
                let init = format!("{res}_init");
                self.constant(&init, &Literal::scalar(d, 0.0));
                let st = tensor_type(&TensorType::scalar(d));
                let p = format!("{res}_sel");
                let select = format!(
                    "{{\n    ^bb0({p}_a: {st}, {p}_b: {st}):\n      {p}_r = \"stablehlo.compare\"({p}_a, {p}_b) {{comparison_direction = #stablehlo<comparison_direction GE>, compare_type = #stablehlo<comparison_type {}>}} : ({st}, {st}) -> tensor<i1>\n      \"stablehlo.return\"({p}_r) : (tensor<i1>) -> ()\n    }}",
                    compare_type(d)
                );
                let scatter = self.region(&format!("{res}_sca"), d, "stablehlo.add");
                let _ = writeln!(
                    self.out,
                    "    {res} = \"stablehlo.select_and_scatter\"({}, {}, {init}) ({select}, {scatter}) {{{}}} : ({}, {}, {st}) -> {out_ty}",
                    args[0],
                    args[1],
                    window_attrs(attrs),
                    arg_tys[0],
                    arg_tys[1]
                );
            }
            Op::Conv(c) => {
                let attrs = conv_attrs(c);
                self.generic(
                    &res,
                    "stablehlo.convolution",
                    &arg_refs,
                    &arg_tys,
                    &attrs,
                    &out_ty,
                )
            }
            Op::Take { axis } => {
                let xt = &self.g.node(n.operands[0]).ty;
                let it = &self.g.node(n.operands[1]).ty;
                let r = it.shape.rank();
                let rest = xt.shape.rank() - axis - 1;
                let offset: Vec<usize> = (0..*axis).chain(axis + r..axis + r + rest).collect();
                let mut sizes: Vec<usize> = xt.shape.dims().to_vec();
                sizes[*axis] = 1;
                let mut dn = Vec::new();
                if !offset.is_empty() {
                    dn.push(format!("offset_dims = {}", list(&offset)));
                }
                dn.push(format!("collapsed_slice_dims = [{axis}]"));
                dn.push(format!("start_index_map = [{axis}]"));
                dn.push(format!("index_vector_dim = {r}"));
                let attrs = format!(
                    "dimension_numbers = #stablehlo.gather<{}>, slice_sizes = {}, indices_are_sorted = false",
                    dn.join(", "),
                    usize_array(&sizes)
                );
                self.generic(
                    &res,
                    "stablehlo.gather",
                    &arg_refs,
                    &arg_tys,
                    &attrs,
                    &out_ty,
                )
            }
            Op::ScatterAdd { axis } => {
                let bt = self.g.node(n.operands[0]).ty.clone();
                let it = self.g.node(n.operands[1]).ty.clone();
                let r = it.shape.rank();
                // Clamp indices into range, matching Take (XLA's scatter would drop them).
                let lo = format!("{res}_lo");
                let hi = format!("{res}_hi");
                let clamped = format!("{res}_idx");
                self.constant(&lo, &Literal::scalar(it.dtype, 0.0));
                self.constant(
                    &hi,
                    &Literal::scalar(it.dtype, (bt.shape.dim(*axis) as f64 - 1.0).max(0.0)),
                );
                let its = tensor_type(&it);
                let ss = tensor_type(&TensorType::scalar(it.dtype));
                self.generic(
                    &clamped,
                    "stablehlo.clamp",
                    &[&lo, args[1].as_str(), &hi],
                    &[ss.clone(), its.clone(), ss],
                    "",
                    &its,
                );
                let rest = bt.shape.rank() - axis - 1;
                let window: Vec<usize> = (0..*axis).chain(axis + r..axis + r + rest).collect();
                let mut dn = Vec::new();
                if !window.is_empty() {
                    dn.push(format!("update_window_dims = {}", list(&window)));
                }
                dn.push(format!("inserted_window_dims = [{axis}]"));
                dn.push(format!("scatter_dims_to_operand_dims = [{axis}]"));
                dn.push(format!("index_vector_dim = {r}"));
                let region = self.region(&format!("{res}_body"), bt.dtype, "stablehlo.add");
                let _ = writeln!(
                    self.out,
                    "    {res} = \"stablehlo.scatter\"({}, {clamped}, {}) ({region}) {{scatter_dimension_numbers = #stablehlo.scatter<{}>, indices_are_sorted = false, unique_indices = false}} : ({}, {}, {}) -> {out_ty}",
                    args[0],
                    args[2],
                    dn.join(", "),
                    arg_tys[0],
                    arg_tys[1],
                    arg_tys[2]
                );
            }
        }
        self.names.insert(id, res);
        Ok(())
    }
}

fn window_attrs(w: &WindowAttrs) -> String {
    let mut win = vec![1usize, 1];
    win.extend_from_slice(&w.window);
    let mut strides = vec![1usize, 1];
    strides.extend_from_slice(&w.strides);
    let mut pad = vec![(0i64, 0i64), (0, 0)];
    pad.extend(w.padding.iter().map(|&(l, h)| (l as i64, h as i64)));
    format!(
        "window_dimensions = {}, window_strides = {}, padding = {}",
        usize_array(&win),
        usize_array(&strides),
        padding_attr(&pad)
    )
}

fn conv_attrs(c: &ConvAttrs) -> String {
    let n = c.strides.len();
    let sp: Vec<String> = (0..n).map(|i| i.to_string()).collect();
    let sp = sp.join(", ");
    format!(
        "dimension_numbers = #stablehlo.conv<[b, f, {sp}]x[o, i, {sp}]->[b, f, {sp}]>, window_strides = {}, padding = {}, lhs_dilation = {}, rhs_dilation = {}, feature_group_count = {} : i64, batch_group_count = {} : i64",
        usize_array(&c.strides),
        padding_attr(&c.padding),
        usize_array(&c.lhs_dilation),
        usize_array(&c.rhs_dilation),
        c.feature_groups,
        c.batch_groups
    )
}

/// Lowers `graph` to a StableHLO module whose `@main` takes the graph inputs in order and
/// returns the outputs in order.
pub fn lower(graph: &Graph) -> Result<String> {
    let mut e = Emitter {
        g: graph,
        out: String::new(),
        names: HashMap::new(),
    };
    let alias_of: HashMap<usize, usize> = graph.aliases().iter().copied().collect();
    let mut params = Vec::new();
    for (i, inp) in graph.inputs().iter().enumerate() {
        let alias = match alias_of.get(&i) {
            Some(o) => format!(" {{tf.aliasing_output = {o} : i32}}"),
            None => String::new(),
        };
        params.push(format!("%arg{i}: {}{alias}", tensor_type(&inp.ty)));
    }
    let out_tys: Vec<String> = graph.output_types().iter().map(tensor_type).collect();
    let _ = writeln!(
        e.out,
        "module @kiln attributes {{mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32}} {{\n  func.func public @main({}) -> ({}) {{",
        params.join(", "),
        out_tys.join(", ")
    );
    for id in graph.topo_order() {
        e.node(id)?;
    }
    let outs: Vec<String> = graph
        .outputs()
        .iter()
        .map(|o| {
            e.names
                .get(o)
                .cloned()
                .ok_or_else(|| Error::Graph(format!("output {o:?} was not lowered")))
        })
        .collect::<Result<_>>()?;
    if outs.is_empty() {
        e.out.push_str("    \"func.return\"() : () -> ()\n");
    } else {
        let _ = writeln!(
            e.out,
            "    \"func.return\"({}) : ({}) -> ()",
            outs.join(", "),
            out_tys.join(", ")
        );
    }
    e.out.push_str("  }\n}\n");
    Ok(e.out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DotDims, InputKind, Shape};

    #[test]
    fn lowers_matmul_with_alias_and_constants() {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [2, 3]));
        let w = g.add_input(
            InputKind::Parameter,
            "w",
            TensorType::new(DType::F32, [3, 4]),
        );
        let d = DotDims {
            lhs_contract: vec![1],
            rhs_contract: vec![0],
            ..Default::default()
        };
        let y = g.add(Op::DotGeneral(d), &[x, w]).unwrap();
        let one = g
            .add(Op::Constant(Literal::scalar(DType::F32, 1.0)), &[])
            .unwrap();
        let ob = g
            .add(
                Op::Broadcast {
                    shape: Shape::new(&[3, 4]),
                    dims: vec![],
                },
                &[one],
            )
            .unwrap();
        let w2 = g.add(Op::Binary(BinaryOp::Add), &[w, ob]).unwrap();
        g.set_outputs(vec![y, w2]).unwrap();
        g.add_alias(1, 1).unwrap();
        let text = lower(&g).unwrap();
        assert!(
            text.contains("%arg1: tensor<3x4xf32> {tf.aliasing_output = 1 : i32}"),
            "{text}"
        );
        assert!(text.contains("lhs_contracting_dimensions = [1]"), "{text}");
        assert!(text.contains("dense<0x3F800000>"), "{text}");
        assert!(
            text.contains("-> (tensor<2x4xf32>, tensor<3x4xf32>)"),
            "{text}"
        );
    }

    #[test]
    fn non_splat_constants_are_hex_bytes() {
        let lit = Literal::from_bytes(
            TensorType::new(DType::I32, [2]),
            [1u8, 0, 0, 0, 2, 0, 0, 0].to_vec(),
        )
        .unwrap();
        assert_eq!(dense(&lit), "dense<\"0x0100000002000000\">");
        let b =
            Literal::from_bytes(TensorType::new(DType::Bool, [2, 2]), vec![1, 0, 0, 1]).unwrap();
        assert_eq!(dense(&b), "dense<[[true, false], [false, true]]>");
    }
}
