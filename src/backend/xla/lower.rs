//! Lowering of a [`Graph`] to StableHLO text (an MLIR module with one `@main` function).
//!
//! Ops are written in MLIR's generic form (`"stablehlo.add"(%a, %b) : (..) -> ..`), which every
//! StableHLO parser accepts regardless of pretty-printing changes between versions. Donated
//! inputs carry `tf.aliasing_output`, the attribute PJRT reads for input/output aliasing.
//!
//! Each node is written as its `Lowering`, looked up in one table (`fn lowering`): most ops
//! are one StableHLO op with attributes; a few are hand-written expansions (reductions with
//! regions, NaN-propagating float min/max, the deterministic select-and-scatter, the clamped
//! scatter-add). Graph-level rewrites (the im2col convolutions) are not done here but on the
//! graph beforehand ([`crate::backend::Backend::rewrite`]).

use super::kernels::{self, FfiLowering, FfiMode, FfiSelect};
use crate::error::{Error, Result};
use crate::ir::{
    BinaryOp, CompareOp, ConvAttrs, DType, DotDims, Graph, Literal, Node, NodeId, Op, ReduceKind,
    Shape, TensorType, UnaryOp, WindowAttrs,
};
use std::collections::HashMap;
use std::fmt::Write;

/// The custom-call attribute that gives the result operand 0's buffer (kiln's ordering and
/// identity calls).
const ALIASES_OPERAND_0: &str = "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [], operand_index = 0, operand_tuple_indices = []>]";

/// The MLIR element type of `d`.
pub fn element_type(d: DType) -> &'static str {
    match d {
        DType::Bool => "i1",
        DType::U32 => "ui32",
        DType::I32 => "i32",
        DType::I64 => "i64",
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
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
        // `array<i64: >` does not parse.
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

/// Element `i` of a literal as an MLIR attribute value. Floats are written as their exact bit
/// pattern in hex, so constants survive the round trip bit for bit.
fn scalar_value(lit: &Literal, i: usize) -> String {
    match lit.ty().dtype {
        DType::Bool => if lit.bytes()[i] != 0 { "true" } else { "false" }.to_string(),
        DType::U32 => u32::from_le_bytes(lit.element_bytes(i)).to_string(),
        DType::I32 => i32::from_le_bytes(lit.element_bytes(i)).to_string(),
        DType::I64 => i64::from_le_bytes(lit.element_bytes(i)).to_string(),
        DType::F32 => format!("0x{:08X}", u32::from_le_bytes(lit.element_bytes(i))),
        DType::F64 => format!("0x{:016X}", u64::from_le_bytes(lit.element_bytes(i))),
        DType::BF16 | DType::F16 => format!("0x{:04X}", u16::from_le_bytes(lit.element_bytes(i))),
    }
}

fn dense(lit: &Literal) -> String {
    let d = lit.ty().dtype;
    let s = d.size_in_bytes();
    let b = lit.bytes();
    if b.is_empty() {
        // An empty tensor: nested brackets would imply a shape (`[]` is `[0]`).
        return "dense<>".to_string();
    }
    if b.chunks(s).all(|c| c == &b[..s]) {
        return format!("dense<{}>", scalar_value(lit, 0));
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
        // Rank 0: exactly one element (the literal's length is checked when it is built).
        None => vals[0].to_string(),
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
        (ReduceKind::Max, d) if d.is_float() => Literal::scalar(d, f64::NEG_INFINITY),
        (ReduceKind::Min, d) if d.is_float() => Literal::scalar(d, f64::INFINITY),
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
        DType::BF16 | DType::F16 | DType::F32 | DType::F64 => "FLOAT",
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
    /// The SSA name of each node written so far.
    names: HashMap<NodeId, String>,
    /// Which convolutions and dots become libtorch custom calls (none when the plugin cannot
    /// run them).
    ffi: &'g dyn FfiSelect,
    /// Replicas the module is compiled for (the groups of `Op::AllReduce`).
    replicas: usize,
    /// Cross-replica ops written so far (each gets its own channel).
    channels: usize,
    /// Whether the kernel calls are marked to run on one libtorch thread
    /// ([`kernels::serial_kernels`]).
    serial: bool,
}

impl<'g> Emitter<'g> {
    fn name(&self, id: NodeId) -> &str {
        &self.names[&id]
    }

    fn ty(&self, id: NodeId) -> String {
        tensor_type(&self.g.node(id).ty)
    }

    /// A kernel call's attributes, marked serial if the program's kernels are.
    fn call_attrs(&self, attrs: String) -> String {
        if self.serial {
            kernels::mark_serial(&attrs)
        } else {
            attrs
        }
    }

    /// Emits node `id` as a custom call to one of kiln's libtorch kernels if the FFI mode
    /// picks it (see [`kernels::ffi_lowering`]); returns whether it did.
    fn ffi_call(&mut self, id: NodeId, res: &str, out_ty: &str) -> bool {
        match kernels::ffi_lowering(self.g, id, self.ffi) {
            None => false,
            Some(FfiLowering::Absorbed) => {
                // Every user reads this node's operands itself: nothing to emit. The name is
                // never referenced (an MLIR parse error if it were).
                self.names.insert(id, res.to_string());
                true
            }
            Some(FfiLowering::Call { operands, attrs }) => {
                let attrs = self.call_attrs(attrs);
                let args: Vec<String> =
                    operands.iter().map(|&o| self.name(o).to_string()).collect();
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                let tys: Vec<String> = operands.iter().map(|&o| self.ty(o)).collect();
                self.generic(res, "stablehlo.custom_call", &args, &tys, &attrs, out_ty);
                self.names.insert(id, res.to_string());
                true
            }
            Some(FfiLowering::Nhwc {
                operands,
                nhwc,
                attrs,
                result,
            }) => {
                let mut args = Vec::with_capacity(operands.len());
                let mut tys = Vec::with_capacity(operands.len());
                for (i, (&o, &t)) in operands.iter().zip(&nhwc).enumerate() {
                    let ty = &self.g.node(o).ty;
                    if t && ty.shape.rank() == 4 {
                        let d = ty.shape.dims();
                        let to = TensorType::new(ty.dtype, Shape::new(&[d[0], d[2], d[3], d[1]]));
                        let name = format!("{res}_x{i}");
                        let from = tensor_type(ty);
                        let to = tensor_type(&to);
                        let arg = self.name(o).to_string();
                        self.generic(
                            &name,
                            "stablehlo.transpose",
                            &[&arg],
                            &[from],
                            "permutation = array<i64: 0, 2, 3, 1>",
                            &to,
                        );
                        args.push(name);
                        tys.push(to);
                    } else {
                        args.push(self.name(o).to_string());
                        tys.push(self.ty(o));
                    }
                }
                let call = format!("{res}_call");
                let attrs = self.call_attrs(attrs);
                let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
                self.generic(
                    &call,
                    "stablehlo.custom_call",
                    &arg_refs,
                    &tys,
                    &attrs,
                    &result,
                );
                self.generic(
                    res,
                    "stablehlo.transpose",
                    &[&call],
                    &[result],
                    "permutation = array<i64: 0, 3, 1, 2>",
                    out_ty,
                );
                self.names.insert(id, res.to_string());
                true
            }
        }
    }

    /// Passes node `id`'s value through kiln's identity call (the ordering call with no other
    /// operand), which XLA cannot fuse through: its consumers read the value written once
    /// instead of computing it again (see the `materialize` module). The call's result is the
    /// operand's buffer, so nothing is copied.
    fn written_once(&mut self, id: NodeId) {
        let Some(value) = self.names.get(&id).cloned() else {
            return;
        };
        let ty = &self.g.node(id).ty;
        let res = format!("%w{}", id.index());
        self.after_call(&res, &[&value], &[ty], &[tensor_type(ty)], ty);
        self.names.insert(id, res);
    }

    /// `res = kiln_after_v1(args)`: kiln's ordering call, whose result is operand 0 in operand
    /// 0's buffer (an ordering barrier, or with one operand the identity `written_once` uses).
    fn after_call(
        &mut self,
        res: &str,
        args: &[&str],
        operands: &[&TensorType],
        arg_tys: &[String],
        out: &TensorType,
    ) {
        let attrs = format!(
            "{}, {ALIASES_OPERAND_0}",
            kernels::custom_call_attrs(kernels::AFTER_TARGET, "", operands, out)
        );
        let out_ty = tensor_type(out);
        self.generic(res, "stablehlo.custom_call", args, arg_tys, &attrs, &out_ty);
    }

    /// Writes dot node `id` as a product of operands transposed by kiln's block transpose
    /// where XLA would copy them slowly ([`kernels::dot_operand_transposes`]); `false` (nothing
    /// written) for any other node, or when the kernels are not available.
    fn dot_on_transposed(&mut self, id: NodeId, res: &str, out_ty: &str) -> bool {
        if !self.ffi.own_kernels() || self.g.node(id).ty.shape.numel() == 0 {
            return false;
        }
        let Some(([a, b], t)) = kernels::dot_operand_transposes_in(self.g, id) else {
            return false;
        };
        let mut args = Vec::with_capacity(2);
        let mut tys = Vec::with_capacity(2);
        for (side, (operand, tr)) in [(a, &t.lhs), (b, &t.rhs)].into_iter().enumerate() {
            let (name, ty) = (self.name(operand).to_string(), self.ty(operand));
            let Some(tr) = tr else {
                args.push(name);
                tys.push(ty);
                continue;
            };
            let out = tensor_type(&tr.ty);
            let config = format!("split = array<i64: {}, {}>", tr.split[0], tr.split[1]);
            let attrs = kernels::custom_call_attrs(
                kernels::TRANSPOSE_TARGET,
                &config,
                &[&self.g.node(operand).ty],
                &tr.ty,
            );
            let t_res = format!("{res}_t{side}");
            self.generic(
                &t_res,
                "stablehlo.custom_call",
                &[&name],
                &[ty],
                &attrs,
                &out,
            );
            args.push(t_res);
            tys.push(out);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.generic(
            res,
            "stablehlo.dot_general",
            &args,
            &tys,
            &dot_attrs(&t.dims),
            out_ty,
        );
        self.names.insert(id, res.to_string());
        true
    }

    /// Writes reduce node `id` as kiln's column sum where it sums over leading dims
    /// ([`kernels::column_sum_lead`]); `false` (nothing written) for any other node, or when
    /// the kernels are not available.
    fn column_sum(&mut self, id: NodeId, res: &str, out_ty: &str) -> bool {
        if !self.ffi.own_kernels() {
            return false;
        }
        let Some(lead) = kernels::column_sum_lead(self.g, id) else {
            return false;
        };
        let config = format!("lead = {lead} : i64");
        self.own_kernel_call(id, res, out_ty, kernels::COLUMN_SUM_TARGET, &config);
        true
    }

    /// Writes select-and-scatter node `id` as kiln's kernel where it runs it
    /// ([`kernels::runs_select_scatter`]); `false` (nothing written) for any other node, or
    /// when the kernels are not available.
    fn select_scatter_call(&mut self, id: NodeId, res: &str, out_ty: &str) -> bool {
        if !self.ffi.own_kernels() || !kernels::runs_select_scatter(self.g, id) {
            return false;
        }
        let Op::SelectAndScatter(w) = &self.g.node(id).op else {
            return false;
        };
        let config = kernels::select_scatter_config(w);
        self.own_kernel_call(id, res, out_ty, kernels::SELECT_SCATTER_TARGET, &config);
        true
    }

    /// Writes node `id` as a custom call to one of kiln's own kernels, `target`, on the
    /// node's operands, with `config` as its backend config.
    fn own_kernel_call(&mut self, id: NodeId, res: &str, out_ty: &str, target: &str, config: &str) {
        let g = self.g;
        let n = g.node(id);
        let operand_tys: Vec<&TensorType> = n.operands.iter().map(|&o| &g.node(o).ty).collect();
        let attrs = kernels::custom_call_attrs(target, config, &operand_tys, &n.ty);
        let names: Vec<String> = n
            .operands
            .iter()
            .map(|&o| self.name(o).to_string())
            .collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let tys: Vec<String> = n.operands.iter().map(|&o| self.ty(o)).collect();
        self.generic(res, "stablehlo.custom_call", &names, &tys, &attrs, out_ty);
        self.names.insert(id, res.to_string());
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
        let body = combine(
            &format!("{prefix}_r"),
            op,
            &format!("{prefix}_a"),
            &format!("{prefix}_b"),
            d,
            &s,
            "      ",
        );
        format!(
            "{{\n    ^bb0({prefix}_a: {s}, {prefix}_b: {s}):\n{body}      \"stablehlo.return\"({prefix}_r) : ({s}) -> ()\n    }}"
        )
    }

    /// `SelectAndScatter` with the IR's deterministic selection (first maximum, NaN largest,
    /// padding never selected).
    ///
    /// StableHLO's `select_and_scatter` leaves the order in which a window's elements meet
    /// `select` to the implementation, and XLA:CPU does not always scan windows in row-major
    /// order, so ties (common after ReLU) were broken differently from the eager interpreter.
    /// Instead, each element is paired with its linear index, a variadic `reduce_window` picks
    /// the winner under a total order (NaN > larger value > smaller index; padding carries the
    /// index `i64::MAX`, so it loses every tie), and the source is scatter-added at the winners.
    fn select_and_scatter(
        &mut self,
        res: &str,
        w: &WindowAttrs,
        x: &str,
        xt: &TensorType,
        src: &str,
        st: &TensorType,
    ) {
        let d = xt.dtype;
        let numel = xt.shape.numel();
        let m = st.shape.numel();
        let xty = tensor_type(xt);
        let sty = tensor_type(st);
        let ity = tensor_type(&xt.with_dtype(DType::I64));
        let flat_i = tensor_type(&TensorType::new(DType::I64, [numel]));
        let flat_x = tensor_type(&TensorType::new(d, [numel]));
        let win_i = tensor_type(&st.with_dtype(DType::I64));
        let m_i = tensor_type(&TensorType::new(DType::I64, [m]));
        let m_d = tensor_type(&TensorType::new(d, [m]));
        let m_p = tensor_type(&TensorType::new(DType::Bool, [m]));
        let sd = tensor_type(&TensorType::scalar(d));
        let si = tensor_type(&TensorType::scalar(DType::I64));
        let sp = "tensor<i1>";
        // Linear indices of the operand's elements.
        let iota = format!("{res}_iota");
        self.generic(
            &iota,
            "stablehlo.iota",
            &[],
            &[],
            "iota_dimension = 0 : i64",
            &flat_i,
        );
        let idx = format!("{res}_idx");
        self.generic(
            &idx,
            "stablehlo.reshape",
            &[&iota],
            std::slice::from_ref(&flat_i),
            "",
            &ity,
        );
        let init_v = format!("{res}_initv");
        self.constant(&init_v, &identity_literal(ReduceKind::Max, d));
        let init_i = format!("{res}_initi");
        self.constant(&init_i, &Literal::scalar(DType::I64, i64::MAX as f64));
        // The combiner: does (a, ai) beat (b, bi)?
        let p = format!("{res}_s");
        let cmp = |out: &str, dir: &str, l: &str, r: &str, ty: &str, ct: &str| {
            format!(
                "      {out} = \"stablehlo.compare\"({l}, {r}) {{comparison_direction = #stablehlo<comparison_direction {dir}>, compare_type = #stablehlo<comparison_type {ct}>}} : ({ty}, {ty}) -> {sp}\n"
            )
        };
        let bin = |out: &str, op: &str, l: &str, r: &str| {
            format!("      {out} = \"stablehlo.{op}\"({l}, {r}) : ({sp}, {sp}) -> {sp}\n")
        };
        let ct = compare_type(d);
        let (a, ai, b, bi) = (
            format!("{p}_a"),
            format!("{p}_ai"),
            format!("{p}_b"),
            format!("{p}_bi"),
        );
        let mut body = String::new();
        body += &cmp(&format!("{p}_gt"), "GT", &a, &b, &sd, ct);
        body += &cmp(&format!("{p}_eq"), "EQ", &a, &b, &sd, ct);
        body += &cmp(&format!("{p}_lt"), "LT", &ai, &bi, &si, "SIGNED");
        body += &bin(
            &format!("{p}_tie"),
            "and",
            &format!("{p}_eq"),
            &format!("{p}_lt"),
        );
        body += &bin(
            &format!("{p}_w0"),
            "or",
            &format!("{p}_gt"),
            &format!("{p}_tie"),
        );
        let win = if d.is_float() {
            body += &cmp(&format!("{p}_an"), "NE", &a, &a, &sd, ct);
            body += &cmp(&format!("{p}_bn"), "NE", &b, &b, &sd, ct);
            // Both NaN: the index decides. Only a NaN: it wins.
            body += &bin(
                &format!("{p}_nn"),
                "and",
                &format!("{p}_an"),
                &format!("{p}_bn"),
            );
            body += &bin(
                &format!("{p}_nt"),
                "and",
                &format!("{p}_nn"),
                &format!("{p}_lt"),
            );
            body += &bin(
                &format!("{p}_w1"),
                "or",
                &format!("{p}_w0"),
                &format!("{p}_nt"),
            );
            body += &format!("      {p}_bok = \"stablehlo.not\"({p}_bn) : ({sp}) -> {sp}\n");
            body += &bin(
                &format!("{p}_na"),
                "and",
                &format!("{p}_an"),
                &format!("{p}_bok"),
            );
            body += &bin(
                &format!("{p}_w"),
                "or",
                &format!("{p}_w1"),
                &format!("{p}_na"),
            );
            format!("{p}_w")
        } else {
            format!("{p}_w0")
        };
        body += &format!(
            "      {p}_v = \"stablehlo.select\"({win}, {a}, {b}) : ({sp}, {sd}, {sd}) -> {sd}\n      {p}_i = \"stablehlo.select\"({win}, {ai}, {bi}) : ({sp}, {si}, {si}) -> {si}\n      \"stablehlo.return\"({p}_v, {p}_i) : ({sd}, {si}) -> ()\n"
        );
        let _ = writeln!(
            self.out,
            "    {res}_rw:2 = \"stablehlo.reduce_window\"({x}, {idx}, {init_v}, {init_i}) ({{\n    ^bb0({a}: {sd}, {ai}: {si}, {b}: {sd}, {bi}: {si}):\n{body}    }}) {{{}}} : ({xty}, {ity}, {sd}, {si}) -> ({sty}, {win_i})",
            window_attrs(w)
        );
        // Scatter-add the source at the winners; windows of pure padding add nothing.
        let sel = format!("{res}_sel");
        self.generic(
            &sel,
            "stablehlo.reshape",
            &[&format!("{res}_rw#1")],
            std::slice::from_ref(&win_i),
            "",
            &m_i,
        );
        let flat_src = format!("{res}_src");
        self.generic(
            &flat_src,
            "stablehlo.reshape",
            &[src],
            std::slice::from_ref(&sty),
            "",
            &m_d,
        );
        let big = format!("{res}_big");
        self.generic(
            &big,
            "stablehlo.broadcast_in_dim",
            &[&init_i],
            std::slice::from_ref(&si),
            "broadcast_dimensions = array<i64>",
            &m_i,
        );
        let pad_win = format!("{res}_padwin");
        let _ = writeln!(
            self.out,
            "    {pad_win} = \"stablehlo.compare\"({sel}, {big}) {{comparison_direction = #stablehlo<comparison_direction EQ>, compare_type = #stablehlo<comparison_type SIGNED>}} : ({m_i}, {m_i}) -> {m_p}"
        );
        let zero = format!("{res}_zero");
        self.constant(&zero, &Literal::scalar(d, 0.0));
        let zeros_m = format!("{res}_zm");
        self.generic(
            &zeros_m,
            "stablehlo.broadcast_in_dim",
            &[&zero],
            std::slice::from_ref(&sd),
            "broadcast_dimensions = array<i64>",
            &m_d,
        );
        let upd = format!("{res}_upd");
        self.generic(
            &upd,
            "stablehlo.select",
            &[&pad_win, &zeros_m, &flat_src],
            &[m_p.clone(), m_d.clone(), m_d.clone()],
            "",
            &m_d,
        );
        let lo = format!("{res}_lo");
        self.constant(&lo, &Literal::scalar(DType::I64, 0.0));
        let hi = format!("{res}_hi");
        self.constant(
            &hi,
            &Literal::scalar(DType::I64, numel.saturating_sub(1) as f64),
        );
        let safe = format!("{res}_safe");
        self.generic(
            &safe,
            "stablehlo.clamp",
            &[&lo, &sel, &hi],
            &[si.clone(), m_i.clone(), si.clone()],
            "",
            &m_i,
        );
        let zeros = format!("{res}_zeros");
        self.generic(
            &zeros,
            "stablehlo.broadcast_in_dim",
            &[&zero],
            std::slice::from_ref(&sd),
            "broadcast_dimensions = array<i64>",
            &flat_x,
        );
        let region = self.region(&format!("{res}_add"), d, "stablehlo.add");
        let scat = format!("{res}_sc");
        let _ = writeln!(
            self.out,
            "    {scat} = \"stablehlo.scatter\"({zeros}, {safe}, {upd}) ({region}) {{scatter_dimension_numbers = #stablehlo.scatter<inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, indices_are_sorted = false, unique_indices = false}} : ({flat_x}, {m_i}, {m_d}) -> {flat_x}"
        );
        self.generic(
            res,
            "stablehlo.reshape",
            &[&scat],
            std::slice::from_ref(&flat_x),
            "",
            &xty,
        );
    }

    /// `stablehlo.reduce` or `stablehlo.reduce_window` (`op`, with attributes `attrs`) for
    /// node `n` reducing its operand `x` by `kind`.
    fn reduce(&mut self, res: &str, n: &Node, x: &str, op: &str, kind: ReduceKind, attrs: &str) {
        let d = n.ty.dtype;
        let init = format!("{res}_init");
        self.constant(&init, &identity_literal(kind, d));
        let region = self.region(&format!("{res}_body"), d, reducer_op(kind));
        let st = tensor_type(&TensorType::scalar(d));
        let _ = writeln!(
            self.out,
            "    {res} = \"{op}\"({x}, {init}) ({region}) {{{attrs}}} : ({}, {st}) -> {}",
            self.ty(n.operands[0]),
            tensor_type(&n.ty)
        );
    }

    /// `ScatterAdd` along `axis`: `stablehlo.scatter` with an add region, indices clamped
    /// into range first, as `Take` clamps them (XLA's scatter would drop them).
    fn scatter_add(&mut self, res: &str, axis: usize, args: &[String], n: &Node) {
        let bt = &self.g.node(n.operands[0]).ty;
        let it = &self.g.node(n.operands[1]).ty;
        let r = it.shape.rank();
        let lo = format!("{res}_lo");
        let hi = format!("{res}_hi");
        let clamped = format!("{res}_idx");
        self.constant(&lo, &Literal::scalar(it.dtype, 0.0));
        self.constant(
            &hi,
            &Literal::scalar(it.dtype, (bt.shape.dim(axis) as f64 - 1.0).max(0.0)),
        );
        let its = tensor_type(it);
        let ss = tensor_type(&TensorType::scalar(it.dtype));
        self.generic(
            &clamped,
            "stablehlo.clamp",
            &[&lo, &args[1], &hi],
            &[ss.clone(), its.clone(), ss],
            "",
            &its,
        );
        let rest = bt.shape.rank() - axis - 1;
        let window: Vec<usize> = (0..axis).chain(axis + r..axis + r + rest).collect();
        let mut dn = Vec::new();
        if !window.is_empty() {
            dn.push(format!("update_window_dims = {}", list(&window)));
        }
        dn.push(format!("inserted_window_dims = [{axis}]"));
        dn.push(format!("scatter_dims_to_operand_dims = [{axis}]"));
        dn.push(format!("index_vector_dim = {r}"));
        let region = self.region(&format!("{res}_body"), bt.dtype, "stablehlo.add");
        let ut = self.ty(n.operands[2]);
        let _ = writeln!(
            self.out,
            "    {res} = \"stablehlo.scatter\"({}, {clamped}, {}) ({region}) {{scatter_dimension_numbers = #stablehlo.scatter<{}>, indices_are_sorted = false, unique_indices = false}} : ({}, {its}, {ut}) -> {}",
            args[0],
            args[2],
            dn.join(", "),
            tensor_type(bt),
            tensor_type(&n.ty),
        );
    }

    /// `AllReduce`: one `stablehlo.all_reduce` over a single group of every replica.
    fn all_reduce(&mut self, res: &str, kind: ReduceKind, x: &str, n: &Node) {
        // The plain combiner: XLA's collectives accept only a single add/max/min as their
        // computation, not the NaN-propagating select chain `region` writes for float max/min.
        let s = tensor_type(&TensorType::scalar(n.ty.dtype));
        let (op, p) = (reducer_op(kind), format!("{res}_body"));
        let region = format!(
            "{{\n    ^bb0({p}_a: {s}, {p}_b: {s}):\n      {p}_r = \"{op}\"({p}_a, {p}_b) : ({s}, {s}) -> {s}\n      \"stablehlo.return\"({p}_r) : ({s}) -> ()\n    }}"
        );
        let group: Vec<String> = (0..self.replicas).map(|r| r.to_string()).collect();
        self.channels += 1;
        let ty = tensor_type(&n.ty);
        let _ = writeln!(
            self.out,
            "    {res} = \"stablehlo.all_reduce\"({x}) ({region}) {{replica_groups = dense<[[{}]]> : tensor<1x{}xi64>, channel_handle = #stablehlo.channel_handle<handle = {}, type = 0>}} : ({ty}) -> {ty}",
            group.join(", "),
            self.replicas,
            self.channels,
        );
    }

    /// Writes node `id` (its operands are written already).
    fn node(&mut self, id: NodeId) {
        let n = self.g.node(id);
        let res = format!("%v{}", id.index());
        let out_ty = tensor_type(&n.ty);
        let args: Vec<String> = n
            .operands
            .iter()
            .map(|&o| self.name(o).to_string())
            .collect();
        let arg_tys: Vec<String> = n.operands.iter().map(|&o| self.ty(o)).collect();
        if self.ffi_call(id, &res, &out_ty)
            || self.dot_on_transposed(id, &res, &out_ty)
            || self.column_sum(id, &res, &out_ty)
            || self.select_scatter_call(id, &res, &out_ty)
        {
            return;
        }
        match lowering(self.g, n) {
            Lowering::Argument(i) => {
                self.names.insert(id, format!("%arg{i}"));
                return;
            }
            Lowering::Constant(lit) => self.constant(&res, lit),
            Lowering::Empty => {
                let _ = writeln!(
                    self.out,
                    "    {res} = \"stablehlo.constant\"() {{value = dense<> : {out_ty}}} : () -> {out_ty}"
                );
            }
            Lowering::Op(op, attrs) => {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                self.generic(&res, op, &args, &arg_tys, &attrs, &out_ty)
            }
            Lowering::NanMinMax(op) => {
                let d = n.ty.dtype;
                let text = combine(&res, op, &args[0], &args[1], d, &out_ty, "    ");
                self.out.push_str(&text);
            }
            Lowering::Reduce(kind, axes) => {
                let attrs = format!("dimensions = {}", usize_array(axes));
                self.reduce(&res, n, &args[0], "stablehlo.reduce", kind, &attrs)
            }
            Lowering::ReduceWindow(kind, w) => {
                let attrs = window_attrs(w);
                self.reduce(&res, n, &args[0], "stablehlo.reduce_window", kind, &attrs)
            }
            Lowering::SelectAndScatter(w) => {
                let xt = &self.g.node(n.operands[0]).ty;
                let st = &self.g.node(n.operands[1]).ty;
                self.select_and_scatter(&res, w, &args[0], xt, &args[1], st);
            }
            Lowering::ScatterAdd(axis) => self.scatter_add(&res, axis, &args, n),
            Lowering::AllReduce(kind) => self.all_reduce(&res, kind, &args[0], n),
            Lowering::Identity => {
                let value = self.name(n.operands[0]).to_string();
                self.names.insert(id, value);
                return;
            }
            Lowering::Barrier if !self.ffi.orders() => {
                let value = self.name(n.operands[0]).to_string();
                self.names.insert(id, value);
                return;
            }
            Lowering::Barrier => {
                // kiln's ordering call (XLA's CPU compiler drops optimization barriers before
                // copy insertion): the result is operand 0, in operand 0's buffer.
                let operands: Vec<&TensorType> =
                    n.operands.iter().map(|&o| &self.g.node(o).ty).collect();
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                self.after_call(&res, &args, &operands, &arg_tys, &n.ty)
            }
        }
        self.names.insert(id, res);
    }
}

/// How one node is written. Another way to lower a node (say a `stablehlo.custom_call` into
/// a host kernel) is another variant, chosen per node in [`lowering`].
enum Lowering<'g> {
    /// A graph input: the function's parameter `%arg{i}`; nothing is emitted.
    Argument(usize),
    /// A `stablehlo.constant`.
    Constant(&'g Literal),
    /// A result without elements: an empty constant. Nothing needs computing, and some ops
    /// cannot be emitted then (a gather from an empty axis has no valid slice size).
    Empty,
    /// One StableHLO op applied to the node's operands, with these attributes (`key = value`
    /// pairs, empty for none), yielding the node's type.
    Op(&'static str, String),
    /// `stablehlo.maximum` / `minimum` on floats, made NaN-propagating ([`combine`]).
    NanMinMax(&'static str),
    /// `stablehlo.reduce` with a combiner region.
    Reduce(ReduceKind, &'g [usize]),
    /// `stablehlo.reduce_window` with a combiner region.
    ReduceWindow(ReduceKind, &'g WindowAttrs),
    /// The deterministic select-and-scatter ([`Emitter::select_and_scatter`]).
    SelectAndScatter(&'g WindowAttrs),
    /// A clamped scatter-add ([`Emitter::scatter_add`]).
    ScatterAdd(usize),
    /// A cross-replica reduction ([`Emitter::all_reduce`]).
    AllReduce(ReduceKind),
    /// `stablehlo.optimization_barrier` over all operands; the node is its first result.
    Barrier,
    /// The operand's value itself: nothing is emitted.
    Identity,
}

/// The lowering table: for each op, the StableHLO op and attributes it becomes, or which
/// hand-written expansion writes it. Every op that is one StableHLO op is one row here.
fn lowering<'g>(g: &Graph, n: &'g Node) -> Lowering<'g> {
    let operand = |i: usize| &g.node(n.operands[i]).ty;
    let one = |op, attrs: String| Lowering::Op(op, attrs);
    match &n.op {
        Op::Input(i) => Lowering::Argument(*i),
        _ if n.ty.shape.numel() == 0 => Lowering::Empty,
        Op::Constant(lit) => Lowering::Constant(lit),
        Op::Iota { dim, .. } => one("stablehlo.iota", format!("iota_dimension = {dim} : i64")),
        Op::Unary(u) => one(unary_name(*u), String::new()),
        Op::Binary(b @ (BinaryOp::Max | BinaryOp::Min)) if n.ty.dtype.is_float() => {
            Lowering::NanMinMax(binary_name(*b))
        }
        Op::Binary(b) => one(binary_name(*b), String::new()),
        Op::Compare(c) => one(
            "stablehlo.compare",
            format!(
                "comparison_direction = #stablehlo<comparison_direction {}>, compare_type = #stablehlo<comparison_type {}>",
                compare_dir(*c),
                compare_type(operand(0).dtype)
            ),
        ),
        Op::Select => one("stablehlo.select", String::new()),
        Op::Convert(_) => one("stablehlo.convert", String::new()),
        Op::Broadcast { dims, .. } => one(
            "stablehlo.broadcast_in_dim",
            format!("broadcast_dimensions = {}", usize_array(dims)),
        ),
        Op::Reshape(_) => one("stablehlo.reshape", String::new()),
        Op::Transpose(perm) => one(
            "stablehlo.transpose",
            format!("permutation = {}", usize_array(perm)),
        ),
        Op::Slice {
            start,
            limit,
            stride,
        } => one(
            "stablehlo.slice",
            format!(
                "start_indices = {}, limit_indices = {}, strides = {}",
                usize_array(start),
                usize_array(limit),
                usize_array(stride)
            ),
        ),
        Op::Concat { axis } => one(
            "stablehlo.concatenate",
            format!("dimension = {axis} : i64"),
        ),
        Op::Pad {
            low,
            high,
            interior,
        } => one(
            "stablehlo.pad",
            format!(
                "edge_padding_low = {}, edge_padding_high = {}, interior_padding = {}",
                i64_array(low.iter().copied()),
                i64_array(high.iter().copied()),
                usize_array(interior)
            ),
        ),
        Op::Reverse(dims) => one(
            "stablehlo.reverse",
            format!("dimensions = {}", usize_array(dims)),
        ),
        Op::DotGeneral(d) => one("stablehlo.dot_general", dot_attrs(d)),
        Op::Conv(c) => one("stablehlo.convolution", conv_attrs(c)),
        Op::Take { axis } => one("stablehlo.gather", gather_attrs(*axis, operand(0), operand(1))),
        Op::Reduce { kind, axes } => Lowering::Reduce(*kind, axes),
        Op::ReduceWindow { kind, attrs } => Lowering::ReduceWindow(*kind, attrs),
        Op::SelectAndScatter(attrs) => Lowering::SelectAndScatter(attrs),
        Op::ScatterAdd { axis } => Lowering::ScatterAdd(*axis),
        Op::AllReduce(kind) => Lowering::AllReduce(*kind),
        Op::Barrier => Lowering::Barrier,
        Op::StopGradient => Lowering::Identity,
    }
}

fn dot_attrs(d: &DotDims) -> String {
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
    format!(
        "dot_dimension_numbers = #stablehlo.dot<{}>, {FULL_PRECISION}",
        parts.join(", ")
    )
}

/// Products and convolutions at their operands' full precision. XLA's GPU compilers
/// otherwise run f32 ones in TF32 (10-bit mantissas; measured on an H200 with
/// `jax-cuda13-pjrt` 0.11.2: the `linear` example 3.3e-4 off eager, resnet18's training step
/// outside the harness's tolerance), where PyTorch's matrix products stay in f32 by default;
/// XLA's CPU compiler computes f32 either way.
const FULL_PRECISION: &str =
    "precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]";

/// `Take` along `axis` of `x` at indices `it`: a gather of one slice per index.
fn gather_attrs(axis: usize, xt: &TensorType, it: &TensorType) -> String {
    let r = it.shape.rank();
    let rest = xt.shape.rank() - axis - 1;
    let offset: Vec<usize> = (0..axis).chain(axis + r..axis + r + rest).collect();
    let mut sizes: Vec<usize> = xt.shape.dims().to_vec();
    sizes[axis] = 1;
    let mut dn = Vec::new();
    if !offset.is_empty() {
        dn.push(format!("offset_dims = {}", list(&offset)));
    }
    dn.push(format!("collapsed_slice_dims = [{axis}]"));
    dn.push(format!("start_index_map = [{axis}]"));
    dn.push(format!("index_vector_dim = {r}"));
    format!(
        "dimension_numbers = #stablehlo.gather<{}>, slice_sizes = {}, indices_are_sorted = false",
        dn.join(", "),
        usize_array(&sizes)
    )
}

/// `res = op(a, b)` on values of type `ty` (element type `d`), as lines of text.
///
/// StableHLO's `maximum`/`minimum` propagate NaN, but XLA:CPU compiles them to "fast" min/max
/// that return the other operand (`xla_cpu_enable_fast_min_max`). For floats they are therefore
/// written as `select(a != a, a, select(b != b, b, max(a, b)))`, which every backend computes
/// exactly.
fn combine(res: &str, op: &str, a: &str, b: &str, d: DType, ty: &str, indent: &str) -> String {
    let minmax = op == "stablehlo.maximum" || op == "stablehlo.minimum";
    if !(minmax && d.is_float()) {
        return format!("{indent}{res} = \"{op}\"({a}, {b}) : ({ty}, {ty}) -> {ty}\n");
    }
    let pred = ty.replace(element_type(d), "i1");
    let ne = "comparison_direction = #stablehlo<comparison_direction NE>, compare_type = #stablehlo<comparison_type FLOAT>";
    format!(
        "{indent}{res}_m = \"{op}\"({a}, {b}) : ({ty}, {ty}) -> {ty}\n\
         {indent}{res}_an = \"stablehlo.compare\"({a}, {a}) {{{ne}}} : ({ty}, {ty}) -> {pred}\n\
         {indent}{res}_bn = \"stablehlo.compare\"({b}, {b}) {{{ne}}} : ({ty}, {ty}) -> {pred}\n\
         {indent}{res}_mb = \"stablehlo.select\"({res}_bn, {b}, {res}_m) : ({pred}, {ty}, {ty}) -> {ty}\n\
         {indent}{res} = \"stablehlo.select\"({res}_an, {a}, {res}_mb) : ({pred}, {ty}, {ty}) -> {ty}\n"
    )
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
        "dimension_numbers = #stablehlo.conv<[b, f, {sp}]x[o, i, {sp}]->[b, f, {sp}]>, window_strides = {}, padding = {}, lhs_dilation = {}, rhs_dilation = {}, feature_group_count = {} : i64, batch_group_count = {} : i64, {FULL_PRECISION}",
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
///
/// Every op is written as it is; in particular every `Op::Conv` becomes one
/// `stablehlo.convolution`. Graph rewrites (such as the XLA backend's im2col choice,
/// [`Backend::rewrite`](crate::backend::Backend::rewrite)) happen before, on the graph;
/// [`super::XlaBackend::lower`] applies its backend's rewrite and then this.
pub fn lower(graph: &Graph) -> Result<String> {
    lower_with_ffi(graph, FfiMode::Off)
}

/// Lowers `graph` like [`lower`], with `ffi`'s rule choosing which `Op::Conv`,
/// `Op::DotGeneral` (and the transposes they absorb) become custom calls to kiln's libtorch
/// kernels ([`kernels::rule_selection`]); the caller must have checked that the plugin runs
/// them.
pub fn lower_with_ffi(graph: &Graph, ffi: FfiMode) -> Result<String> {
    match ffi {
        // No kernels, and no ordering call either (`FfiSelect::orders`).
        FfiMode::Off => lower_with(graph, &ffi),
        _ => lower_with(graph, &kernels::rule_selection(graph, ffi)),
    }
}

/// Lowers `graph` like [`lower`], with `ffi` choosing which convolutions and dots (and the
/// transposes they absorb) become custom calls to kiln's libtorch kernels: an [`FfiMode`]'s
/// rule or an explicit set of nodes. The caller must have checked that the plugin runs them.
pub fn lower_with(graph: &Graph, ffi: &dyn FfiSelect) -> Result<String> {
    lower_replicated(graph, ffi, 1)
}

/// Lowers `graph` like [`lower_with`] for a program run by `replicas` data-parallel
/// replicas (`mhlo.num_replicas`; every `Op::AllReduce` combines all of them). Compile the
/// text with the same replica count in the compile options
/// ([`super::pjrt::compile_options_bytes_for`]).
pub fn lower_replicated(graph: &Graph, ffi: &dyn FfiSelect, replicas: usize) -> Result<String> {
    if replicas == 0 {
        return Err(Error::Invalid(
            "a program needs at least one replica".into(),
        ));
    }
    let mut e = Emitter {
        g: graph,
        out: String::new(),
        names: HashMap::new(),
        ffi,
        replicas,
        channels: 0,
        serial: kernels::serial_kernels(graph, ffi),
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
        "module @kiln attributes {{mhlo.num_partitions = 1 : i32, mhlo.num_replicas = {replicas} : i32}} {{\n  func.func public @main({}) -> ({}) {{",
        params.join(", "),
        out_tys.join(", ")
    );
    let written_once = if ffi.orders() {
        super::materialize::values_to_materialize(graph)
    } else {
        Default::default()
    };
    for id in graph.topo_order() {
        e.node(id);
        if written_once.contains(&id) {
            e.written_once(id);
        }
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
    use crate::ir::{InputKind, Shape};

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

    /// Without the attribute XLA's GPU compilers compute f32 products in TF32.
    #[test]
    fn products_and_convolutions_ask_for_full_precision() {
        let mut g = Graph::new();
        let t = |d: &[usize]| TensorType::new(DType::F32, d);
        let x = g.add_input(InputKind::Data, "x", t(&[1, 2, 5, 5]));
        let k = g.add_input(InputKind::Parameter, "k", t(&[3, 2, 3, 3]));
        let c = ConvAttrs {
            strides: vec![1, 1],
            padding: vec![(1, 1), (1, 1)],
            lhs_dilation: vec![1, 1],
            rhs_dilation: vec![1, 1],
            feature_groups: 1,
            batch_groups: 1,
        };
        let y = g.add(Op::Conv(c), &[x, k]).unwrap();
        let d = DotDims {
            lhs_contract: vec![3],
            rhs_contract: vec![2],
            ..Default::default()
        };
        let z = g.add(Op::DotGeneral(d), &[y, x]).unwrap();
        g.set_outputs(vec![z]).unwrap();
        let text = lower(&g).unwrap();
        assert_eq!(text.matches(FULL_PRECISION).count(), 2, "{text}");
    }

    #[test]
    fn all_reduce_spans_every_replica_with_its_own_channel() {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [2]));
        let a = g.add(Op::AllReduce(ReduceKind::Sum), &[x]).unwrap();
        let b = g.add(Op::AllReduce(ReduceKind::Max), &[a]).unwrap();
        g.set_outputs(vec![b]).unwrap();
        let text = lower_replicated(&g, &FfiMode::Off, 4).unwrap();
        assert!(text.contains("mhlo.num_replicas = 4 : i32"), "{text}");
        assert_eq!(
            text.matches("replica_groups = dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>")
                .count(),
            2,
            "{text}"
        );
        assert!(
            text.contains("handle = 1,") && text.contains("handle = 2,"),
            "{text}"
        );
        assert!(lower(&g).unwrap().contains("mhlo.num_replicas = 1 : i32"));
        assert!(lower_replicated(&g, &FfiMode::Off, 0).is_err());
    }

    #[test]
    fn chain_links_are_read_through_the_identity_call_with_the_kernels() {
        // `y1 = tanh(y0 + y0 · w)`, `y2 = tanh(y1 + y1 · w)`: y1 links a chain.
        let mut g = Graph::new();
        let t = TensorType::new(DType::F32, [4, 4]);
        let x = g.add_input(InputKind::Data, "x", t.clone());
        let w = g.add_input(InputKind::Parameter, "w", t);
        let d = DotDims {
            lhs_batch: vec![],
            rhs_batch: vec![],
            lhs_contract: vec![1],
            rhs_contract: vec![0],
        };
        let mut y = g.add(Op::Unary(UnaryOp::Tanh), &[x]).unwrap();
        let mut links = vec![y];
        for _ in 0..2 {
            let p = g.add(Op::DotGeneral(d.clone()), &[y, w]).unwrap();
            let s = g.add(Op::Binary(BinaryOp::Add), &[y, p]).unwrap();
            y = g.add(Op::Unary(UnaryOp::Tanh), &[s]).unwrap();
            links.push(y);
        }
        g.set_outputs(vec![y]).unwrap();
        let y1 = links[1].index();
        let text = lower_with_ffi(&g, FfiMode::Auto).unwrap();
        assert!(
            text.contains(&format!("%w{y1} = \"stablehlo.custom_call\"(%v{y1})"))
                && text.matches(kernels::AFTER_TARGET).count() == 1
                && text.matches(&format!("(%w{y1}, ")).count() == 2,
            "{text}"
        );
        assert!(!lower(&g).unwrap().contains("custom_call"));
    }

    #[test]
    fn a_barrier_is_the_ordering_call_with_the_kernels_and_its_operand_without() {
        let mut g = Graph::new();
        let t = |d: &[usize]| TensorType::new(DType::F32, d);
        let p = g.add_input(InputKind::Parameter, "p", t(&[2, 3]));
        let x = g.add_input(InputKind::Data, "x", t(&[4]));
        let b = g.add(Op::Barrier, &[p, x]).unwrap();
        let y = g.add(Op::Unary(UnaryOp::Neg), &[b]).unwrap();
        g.set_outputs(vec![y]).unwrap();
        let text = lower_with_ffi(&g, FfiMode::Auto).unwrap();
        assert!(
            text.contains("\"stablehlo.custom_call\"(%arg0, %arg1)")
                && text.contains(kernels::AFTER_TARGET)
                && text.contains("operand_index = 0"),
            "{text}"
        );
        let text = lower(&g).unwrap();
        assert!(!text.contains("custom_call"), "{text}");
        assert!(text.contains("stablehlo.negate\"(%arg0)"), "{text}");
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
