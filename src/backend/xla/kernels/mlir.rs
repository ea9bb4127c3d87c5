//! The MLIR text of kiln's custom calls: their attributes and whole lines.

use super::{ConvForm, CONV_TARGET, DOT_TARGET};
use crate::backend::xla::lower::tensor_type;
use crate::ir::{ConvAttrs, DotDims, TensorType};

/// `array<i64: ...>` of `v` (`array<i64>` when empty).
pub(super) fn i64_array(v: impl IntoIterator<Item = i64>) -> String {
    let items: Vec<String> = v.into_iter().map(|x| x.to_string()).collect();
    if items.is_empty() {
        "array<i64>".into()
    } else {
        format!("array<i64: {}>", items.join(", "))
    }
}

/// Row-major layout attribute of a rank-`r` array (`minor_to_major = [r-1, ..., 0]`).
pub(super) fn row_major(r: usize) -> String {
    if r == 0 {
        return "dense<> : tensor<0xindex>".into();
    }
    let v: Vec<String> = (0..r).rev().map(|d| d.to_string()).collect();
    format!("dense<[{}]> : tensor<{r}xindex>", v.join(", "))
}

/// `attrs` (a custom call's, from [`custom_call_attrs`]) with [`super::SERIAL_ATTR`] set in its
/// backend config.
pub(crate) fn mark_serial(attrs: &str) -> String {
    const CONFIG: &str = "backend_config = {";
    let Some(i) = attrs.find(CONFIG).map(|i| i + CONFIG.len()) else {
        return attrs.to_string();
    };
    let sep = if attrs[i..].starts_with('}') {
        ""
    } else {
        ", "
    };
    format!(
        "{}{} = 1 : i64{sep}{}",
        &attrs[..i],
        super::SERIAL_ATTR,
        &attrs[i..]
    )
}

pub(crate) fn custom_call_attrs(
    target: &str,
    config: &str,
    operands: &[&TensorType],
    out: &TensorType,
) -> String {
    let ol: Vec<String> = operands.iter().map(|t| row_major(t.shape.rank())).collect();
    format!(
        "call_target_name = \"{target}\", api_version = 4 : i32, backend_config = {{{config}}}, operand_layouts = [{}], result_layouts = [{}]",
        ol.join(", "),
        row_major(out.shape.rank())
    )
}

/// The attributes (inside `{...}`) of a `stablehlo.custom_call` running `Op::Conv(c)` on
/// operands of types `x`, `k` with result type `out` through [`CONV_TARGET`].
pub fn conv_call_attrs(c: &ConvAttrs, x: &TensorType, k: &TensorType, out: &TensorType) -> String {
    conv_call_attrs_form(c, x, k, out, ConvForm::Plain)
}

/// [`conv_call_attrs`] with the kernel operand (of type `k`) in form `form`.
pub fn conv_call_attrs_form(
    c: &ConvAttrs,
    x: &TensorType,
    k: &TensorType,
    out: &TensorType,
    form: ConvForm,
) -> String {
    let config = format!(
        "batch_groups = {} : i64, feature_groups = {} : i64, form = {} : i64, lhs_dilation = {}, padding = {}, rhs_dilation = {}, strides = {}",
        c.batch_groups,
        c.feature_groups,
        form as i64,
        i64_array(c.lhs_dilation.iter().map(|&v| v as i64)),
        i64_array(c.padding.iter().flat_map(|&(l, h)| [l, h])),
        i64_array(c.rhs_dilation.iter().map(|&v| v as i64)),
        i64_array(c.strides.iter().map(|&v| v as i64)),
    );
    custom_call_attrs(CONV_TARGET, &config, &[x, k], out)
}

/// The attributes of a `stablehlo.custom_call` running `Op::DotGeneral(d)` through
/// [`DOT_TARGET`].
pub fn dot_call_attrs(d: &DotDims, a: &TensorType, b: &TensorType, out: &TensorType) -> String {
    let mut dims = vec![d.lhs_batch.len() as i64, d.lhs_contract.len() as i64];
    for v in [&d.lhs_batch, &d.rhs_batch, &d.lhs_contract, &d.rhs_contract] {
        dims.extend(v.iter().map(|&x| x as i64));
    }
    let config = format!("dims = {}", i64_array(dims));
    custom_call_attrs(DOT_TARGET, &config, &[a, b], out)
}

/// One full `stablehlo.custom_call` line (for tests and tools): `%res = ... : (x, k) -> out`.
pub fn conv_call_mlir(
    res: &str,
    args: [&str; 2],
    c: &ConvAttrs,
    x: &TensorType,
    k: &TensorType,
    out: &TensorType,
) -> String {
    call_line(res, args, &conv_call_attrs(c, x, k, out), [x, k], out)
}

/// [`conv_call_mlir`] for a dot.
pub fn dot_call_mlir(
    res: &str,
    args: [&str; 2],
    d: &DotDims,
    a: &TensorType,
    b: &TensorType,
    out: &TensorType,
) -> String {
    call_line(res, args, &dot_call_attrs(d, a, b, out), [a, b], out)
}

/// `%res = "stablehlo.custom_call"(args) {attrs} : (operand types) -> out`.
fn call_line(
    res: &str,
    args: [&str; 2],
    attrs: &str,
    operands: [&TensorType; 2],
    out: &TensorType,
) -> String {
    format!(
        "{res} = \"stablehlo.custom_call\"({}, {}) {{{attrs}}} : ({}, {}) -> {}",
        args[0],
        args[1],
        tensor_type(operands[0]),
        tensor_type(operands[1]),
        tensor_type(out)
    )
}
