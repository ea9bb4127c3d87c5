//! The plugin's optimized program as text: a decoder for the `xla.HloModuleProto` that
//! `PJRT_Executable_OptimizedProgram` returns, and a printer in XLA's HLO text syntax.
//!
//! XLA plugins answer `PJRT_Executable_OptimizedProgram` with a serialized
//! `HloModuleProtoWithConfig` (format `hlo_with_config`), not text; printing it needs XLA's
//! C++ printer, which the C API does not expose. So kiln decodes the fields that carry the
//! program (computations, instructions, shapes with layouts, operands, called computations,
//! fusion kinds, the attributes of the ops XLA emits on CPU) with `prost` and prints them the
//! way XLA does (`%name = f32[2,3]{1,0} add(%a, %b), ...`). Attributes kiln does not decode
//! (sharding, frontend attributes, most metadata) are left out, so the text is a faithful
//! view of the optimized program's structure rather than a byte-for-byte copy of XLA's own
//! dump; [`super::XlaExecutable::optimized_hlo_proto`] gives the exact proto for XLA's tools.
//!
//! The message and field numbers follow `xla/service/hlo.proto` and `xla/xla_data.proto`
//! (protobuf field numbers never change; fields unknown here are skipped when decoding).

use crate::error::{Error, Result};
use prost::Message;
use std::collections::HashMap;
use std::fmt::Write;

/// `xla.HloModuleProtoWithConfig`: only the module, kept as bytes (its exact encoding).
#[derive(Clone, PartialEq, Message)]
struct ModuleWithConfig {
    #[prost(bytes = "vec", tag = "1")]
    hlo_module: Vec<u8>,
}

/// `xla.HloModuleProto`.
#[derive(Clone, PartialEq, Message)]
pub(crate) struct Module {
    #[prost(string, tag = "1")]
    pub(crate) name: String,
    #[prost(string, tag = "2")]
    entry_computation_name: String,
    #[prost(message, repeated, tag = "3")]
    pub(crate) computations: Vec<Computation>,
    #[prost(int64, tag = "6")]
    entry_computation_id: i64,
    /// Present when the module is scheduled (its contents are not printed).
    #[prost(message, optional, tag = "7")]
    schedule: Option<Empty>,
    #[prost(message, optional, tag = "8")]
    input_output_alias: Option<AliasConfig>,
}

/// A message whose fields are not needed (only its presence).
#[derive(Clone, PartialEq, Message)]
struct Empty {}

/// `xla.HloInputOutputAliasProto`.
#[derive(Clone, PartialEq, Message)]
struct AliasConfig {
    #[prost(message, repeated, tag = "1")]
    entries: Vec<AliasEntry>,
}

/// `xla.HloInputOutputAliasProto.AliasEntryProto`.
#[derive(Clone, PartialEq, Message)]
struct AliasEntry {
    #[prost(int64, repeated, tag = "1")]
    output_shape_index: Vec<i64>,
    #[prost(int64, tag = "2")]
    parameter_number: i64,
    #[prost(int64, repeated, tag = "3")]
    parameter_shape_index: Vec<i64>,
    /// `xla.Kind`: 1 may-alias, 2 must-alias.
    #[prost(int32, tag = "4")]
    kind: i32,
}

/// `xla.HloComputationProto`.
#[derive(Clone, PartialEq, Message)]
pub(crate) struct Computation {
    #[prost(string, tag = "1")]
    pub(crate) name: String,
    #[prost(message, repeated, tag = "2")]
    pub(crate) instructions: Vec<Instruction>,
    #[prost(int64, tag = "5")]
    id: i64,
    #[prost(int64, tag = "6")]
    root_id: i64,
}

/// `xla.ShapeProto`.
#[derive(Clone, PartialEq, Message)]
struct Shape {
    /// `xla.PrimitiveType`.
    #[prost(int32, tag = "2")]
    element_type: i32,
    #[prost(int64, repeated, tag = "3")]
    dimensions: Vec<i64>,
    #[prost(message, repeated, tag = "4")]
    tuple_shapes: Vec<Shape>,
    #[prost(message, optional, tag = "5")]
    layout: Option<Layout>,
}

/// `xla.LayoutProto`.
#[derive(Clone, PartialEq, Message)]
struct Layout {
    #[prost(int64, repeated, tag = "1")]
    minor_to_major: Vec<i64>,
}

/// `xla.OpMetadata`.
#[derive(Clone, PartialEq, Message)]
struct Metadata {
    #[prost(string, tag = "1")]
    op_type: String,
    #[prost(string, tag = "2")]
    op_name: String,
    #[prost(string, tag = "3")]
    source_file: String,
    #[prost(int32, tag = "4")]
    source_line: i32,
}

/// `xla.LiteralProto` (the array types kiln's graphs use).
#[derive(Clone, PartialEq, Message)]
struct Literal {
    #[prost(bool, repeated, tag = "2")]
    preds: Vec<bool>,
    #[prost(int32, repeated, tag = "4")]
    s32s: Vec<i32>,
    #[prost(int64, repeated, tag = "5")]
    s64s: Vec<i64>,
    #[prost(uint32, repeated, tag = "6")]
    u32s: Vec<u32>,
    #[prost(uint64, repeated, tag = "7")]
    u64s: Vec<u64>,
    #[prost(float, repeated, tag = "8")]
    f32s: Vec<f32>,
    #[prost(double, repeated, tag = "9")]
    f64s: Vec<f64>,
}

/// `xla.WindowDimension`.
#[derive(Clone, PartialEq, Message)]
struct WindowDim {
    #[prost(int64, tag = "1")]
    size: i64,
    #[prost(int64, tag = "2")]
    stride: i64,
    #[prost(int64, tag = "3")]
    padding_low: i64,
    #[prost(int64, tag = "4")]
    padding_high: i64,
    #[prost(int64, tag = "5")]
    window_dilation: i64,
    #[prost(int64, tag = "6")]
    base_dilation: i64,
    #[prost(bool, tag = "7")]
    window_reversal: bool,
}

/// `xla.Window`.
#[derive(Clone, PartialEq, Message)]
struct Window {
    #[prost(message, repeated, tag = "1")]
    dimensions: Vec<WindowDim>,
}

/// `xla.ConvolutionDimensionNumbers`.
#[derive(Clone, PartialEq, Message)]
struct ConvDims {
    #[prost(int64, tag = "7")]
    input_batch_dimension: i64,
    #[prost(int64, tag = "8")]
    input_feature_dimension: i64,
    #[prost(int64, repeated, tag = "11")]
    input_spatial_dimensions: Vec<i64>,
    #[prost(int64, tag = "3")]
    kernel_input_feature_dimension: i64,
    #[prost(int64, tag = "4")]
    kernel_output_feature_dimension: i64,
    #[prost(int64, repeated, tag = "6")]
    kernel_spatial_dimensions: Vec<i64>,
    #[prost(int64, tag = "9")]
    output_batch_dimension: i64,
    #[prost(int64, tag = "10")]
    output_feature_dimension: i64,
    #[prost(int64, repeated, tag = "12")]
    output_spatial_dimensions: Vec<i64>,
}

/// `xla.DotDimensionNumbers`.
#[derive(Clone, PartialEq, Message)]
struct DotDims {
    #[prost(int64, repeated, tag = "1")]
    lhs_contracting_dimensions: Vec<i64>,
    #[prost(int64, repeated, tag = "2")]
    rhs_contracting_dimensions: Vec<i64>,
    #[prost(int64, repeated, tag = "3")]
    lhs_batch_dimensions: Vec<i64>,
    #[prost(int64, repeated, tag = "4")]
    rhs_batch_dimensions: Vec<i64>,
}

/// `xla.HloInstructionProto.SliceDimensions`.
#[derive(Clone, PartialEq, Message)]
struct SliceDim {
    #[prost(int64, tag = "1")]
    start: i64,
    #[prost(int64, tag = "2")]
    limit: i64,
    #[prost(int64, tag = "3")]
    stride: i64,
}

/// `xla.PaddingConfig.PaddingConfigDimension`.
#[derive(Clone, PartialEq, Message)]
struct PadDim {
    #[prost(int64, tag = "1")]
    low: i64,
    #[prost(int64, tag = "2")]
    high: i64,
    #[prost(int64, tag = "3")]
    interior: i64,
}

/// `xla.PaddingConfig`.
#[derive(Clone, PartialEq, Message)]
struct PaddingConfig {
    #[prost(message, repeated, tag = "1")]
    dimensions: Vec<PadDim>,
}

/// `xla.GatherDimensionNumbers`.
#[derive(Clone, PartialEq, Message)]
struct GatherDims {
    #[prost(int64, repeated, tag = "1")]
    offset_dims: Vec<i64>,
    #[prost(int64, repeated, tag = "2")]
    collapsed_slice_dims: Vec<i64>,
    #[prost(int64, repeated, tag = "3")]
    start_index_map: Vec<i64>,
    #[prost(int64, tag = "4")]
    index_vector_dim: i64,
}

/// `xla.ScatterDimensionNumbers`.
#[derive(Clone, PartialEq, Message)]
struct ScatterDims {
    #[prost(int64, repeated, tag = "1")]
    update_window_dims: Vec<i64>,
    #[prost(int64, repeated, tag = "2")]
    inserted_window_dims: Vec<i64>,
    #[prost(int64, repeated, tag = "3")]
    scatter_dims_to_operand_dims: Vec<i64>,
    #[prost(int64, tag = "4")]
    index_vector_dim: i64,
}

/// `xla.HloInstructionProto` (the fields the printer shows).
#[derive(Clone, PartialEq, Message)]
pub(crate) struct Instruction {
    #[prost(string, tag = "1")]
    pub(crate) name: String,
    #[prost(string, tag = "2")]
    pub(crate) opcode: String,
    #[prost(message, optional, tag = "3")]
    shape: Option<Shape>,
    #[prost(message, optional, tag = "7")]
    metadata: Option<Metadata>,
    #[prost(message, optional, tag = "8")]
    literal: Option<Literal>,
    #[prost(int64, tag = "9")]
    parameter_number: i64,
    #[prost(string, tag = "11")]
    fusion_kind: String,
    #[prost(int64, tag = "13")]
    tuple_index: i64,
    #[prost(int64, repeated, tag = "14")]
    dimensions: Vec<i64>,
    #[prost(message, optional, tag = "15")]
    window: Option<Window>,
    #[prost(message, optional, tag = "16")]
    convolution_dimension_numbers: Option<ConvDims>,
    #[prost(message, repeated, tag = "17")]
    slice_dimensions: Vec<SliceDim>,
    #[prost(int64, repeated, tag = "20")]
    dynamic_slice_sizes: Vec<i64>,
    #[prost(message, optional, tag = "21")]
    padding_config: Option<PaddingConfig>,
    #[prost(string, tag = "28")]
    pub(crate) custom_call_target: String,
    #[prost(message, optional, tag = "30")]
    dot_dimension_numbers: Option<DotDims>,
    #[prost(message, optional, tag = "33")]
    gather_dimension_numbers: Option<GatherDims>,
    #[prost(int64, repeated, tag = "34")]
    gather_slice_sizes: Vec<i64>,
    #[prost(int64, tag = "35")]
    id: i64,
    #[prost(int64, repeated, tag = "36")]
    operand_ids: Vec<i64>,
    #[prost(int64, repeated, tag = "37")]
    control_predecessor_ids: Vec<i64>,
    #[prost(int64, repeated, tag = "38")]
    called_computation_ids: Vec<i64>,
    #[prost(bytes = "vec", tag = "43")]
    backend_config: Vec<u8>,
    #[prost(message, optional, tag = "48")]
    scatter_dimension_numbers: Option<ScatterDims>,
    #[prost(int64, tag = "50")]
    feature_group_count: i64,
    #[prost(int64, tag = "58")]
    batch_group_count: i64,
    #[prost(bool, tag = "60")]
    is_stable: bool,
    #[prost(string, tag = "63")]
    comparison_direction: String,
    #[prost(bool, tag = "67")]
    indices_are_sorted: bool,
    #[prost(bool, tag = "69")]
    unique_indices: bool,
    #[prost(string, tag = "72")]
    comparison_type: String,
    /// `xla.CustomCallApiVersion`.
    #[prost(int32, tag = "77")]
    custom_call_api_version: i32,
}

/// The `xla.HloModuleProto` bytes inside an optimized program of `format`.
pub(crate) fn module_bytes(format: &str, code: &[u8]) -> Result<Vec<u8>> {
    match format {
        "hlo_with_config" => ModuleWithConfig::decode(code)
            .map(|m| m.hlo_module)
            .map_err(|e| decode_error(format, e)),
        "hlo" => Ok(code.to_vec()),
        other => Err(Error::Unsupported {
            backend: "xla".into(),
            what: format!(
                "the plugin returned its optimized program as {other:?}; kiln reads \
                 \"hlo_with_config\" and \"hlo\""
            ),
        }),
    }
}

fn decode_error(format: &str, e: prost::DecodeError) -> Error {
    Error::Invalid(format!(
        "the plugin's optimized program (format {format:?}) is not a valid HLO module proto: {e}"
    ))
}

/// Decodes an `xla.HloModuleProto`.
pub(crate) fn decode_module(bytes: &[u8]) -> Result<Module> {
    Module::decode(bytes).map_err(|e| decode_error("hlo", e))
}

/// The HLO text of an `xla.HloModuleProto`.
pub(crate) fn module_text(bytes: &[u8]) -> Result<String> {
    Ok(print_module(&decode_module(bytes)?))
}

fn type_name(t: i32) -> &'static str {
    match t {
        1 => "pred",
        2 => "s8",
        3 => "s16",
        4 => "s32",
        5 => "s64",
        6 => "u8",
        7 => "u16",
        8 => "u32",
        9 => "u64",
        10 => "f16",
        11 => "f32",
        12 => "f64",
        13 => "tuple",
        14 => "opaque",
        15 => "c64",
        16 => "bf16",
        17 => "token",
        18 => "c128",
        _ => "unknown_type",
    }
}

fn list(v: &[i64]) -> String {
    let s: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    format!("{{{}}}", s.join(","))
}

/// `f32[2,3]{1,0}`, `(f32[2]{0}, s32[])`, `token[]`; without the layout if `layout` is false.
fn shape_text(s: &Shape, layout: bool) -> String {
    match s.element_type {
        13 => {
            let parts: Vec<String> = s
                .tuple_shapes
                .iter()
                .map(|t| shape_text(t, layout))
                .collect();
            format!("({})", parts.join(", "))
        }
        14 | 17 => format!("{}[]", type_name(s.element_type)),
        t => {
            let dims: Vec<String> = s.dimensions.iter().map(|d| d.to_string()).collect();
            let mut out = format!("{}[{}]", type_name(t), dims.join(","));
            if layout && !s.dimensions.is_empty() {
                if let Some(l) = &s.layout {
                    out.push_str(&list(&l.minor_to_major));
                }
            }
            out
        }
    }
}

/// Literal values, nested by dimension as XLA prints them; `{...}` past 16 elements.
fn literal_text(lit: &Literal, shape: &Shape) -> String {
    let values: Vec<String> = if !lit.f32s.is_empty() {
        lit.f32s.iter().map(|v| v.to_string()).collect()
    } else if !lit.f64s.is_empty() {
        lit.f64s.iter().map(|v| v.to_string()).collect()
    } else if !lit.s32s.is_empty() {
        lit.s32s.iter().map(|v| v.to_string()).collect()
    } else if !lit.s64s.is_empty() {
        lit.s64s.iter().map(|v| v.to_string()).collect()
    } else if !lit.u32s.is_empty() {
        lit.u32s.iter().map(|v| v.to_string()).collect()
    } else if !lit.u64s.is_empty() {
        lit.u64s.iter().map(|v| v.to_string()).collect()
    } else if !lit.preds.is_empty() {
        lit.preds.iter().map(|v| v.to_string()).collect()
    } else {
        Vec::new()
    };
    let dims = &shape.dimensions;
    let count: i64 = dims.iter().product();
    if dims.is_empty() {
        return values.first().cloned().unwrap_or_else(|| "{...}".into());
    }
    if count > 16 || values.len() as i64 != count {
        return "{...}".into();
    }
    fn nest(values: &[String], dims: &[i64]) -> String {
        if dims.len() == 1 {
            return format!("{{{}}}", values.join(", "));
        }
        let inner: i64 = dims[1..].iter().product();
        let parts: Vec<String> = values
            .chunks(inner.max(1) as usize)
            .map(|c| nest(c, &dims[1..]))
            .collect();
        format!("{{{}}}", parts.join(", "))
    }
    nest(&values, dims)
}

/// `size=3x3 stride=2x2 pad=1_1x1_1 lhs_dilate=... rhs_dilate=... rhs_reversal=...`, leaving
/// out the parts that are all defaults (as XLA does).
fn window_text(w: &Window) -> String {
    let d = &w.dimensions;
    let join = |f: &dyn Fn(&WindowDim) -> String| -> String {
        d.iter().map(f).collect::<Vec<_>>().join("x")
    };
    let mut parts = vec![format!("size={}", join(&|x| x.size.to_string()))];
    if d.iter().any(|x| x.stride != 1) {
        parts.push(format!("stride={}", join(&|x| x.stride.to_string())));
    }
    if d.iter().any(|x| x.padding_low != 0 || x.padding_high != 0) {
        parts.push(format!(
            "pad={}",
            join(&|x| format!("{}_{}", x.padding_low, x.padding_high))
        ));
    }
    if d.iter().any(|x| x.base_dilation != 1) {
        parts.push(format!(
            "lhs_dilate={}",
            join(&|x| x.base_dilation.to_string())
        ));
    }
    if d.iter().any(|x| x.window_dilation != 1) {
        parts.push(format!(
            "rhs_dilate={}",
            join(&|x| x.window_dilation.to_string())
        ));
    }
    if d.iter().any(|x| x.window_reversal) {
        parts.push(format!(
            "rhs_reversal={}",
            join(&|x| u8::from(x.window_reversal).to_string())
        ));
    }
    parts.join(" ")
}

/// `b01f_01io->b01f`: the letters of each dimension in order.
fn dim_labels(c: &ConvDims) -> String {
    fn labels(rank: usize, pairs: &[(i64, char)], spatial: &[i64]) -> String {
        let mut out = vec!['?'; rank];
        for &(d, ch) in pairs {
            if let Some(slot) = out.get_mut(d as usize) {
                *slot = ch;
            }
        }
        for (i, &d) in spatial.iter().enumerate() {
            if let Some(slot) = out.get_mut(d as usize) {
                *slot = char::from_digit(i as u32, 36).unwrap_or('?');
            }
        }
        out.into_iter().collect()
    }
    let n = c.input_spatial_dimensions.len() + 2;
    format!(
        "{}_{}->{}",
        labels(
            n,
            &[
                (c.input_batch_dimension, 'b'),
                (c.input_feature_dimension, 'f')
            ],
            &c.input_spatial_dimensions
        ),
        labels(
            n,
            &[
                (c.kernel_input_feature_dimension, 'i'),
                (c.kernel_output_feature_dimension, 'o')
            ],
            &c.kernel_spatial_dimensions
        ),
        labels(
            n,
            &[
                (c.output_batch_dimension, 'b'),
                (c.output_feature_dimension, 'f')
            ],
            &c.output_spatial_dimensions
        ),
    )
}

fn quoted(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The attributes after the operand list, in XLA's spelling.
fn attributes(
    i: &Instruction,
    comp_name: &HashMap<i64, &str>,
    inst_name: &HashMap<i64, &str>,
) -> Vec<String> {
    let mut a = Vec::new();
    let called: Vec<String> = i
        .called_computation_ids
        .iter()
        .map(|c| format!("%{}", comp_name.get(c).copied().unwrap_or("?")))
        .collect();
    let op = i.opcode.as_str();
    if op == "iota" {
        if let Some(d) = i.dimensions.first() {
            a.push(format!("iota_dimension={d}"));
        }
    } else if !i.dimensions.is_empty() || op == "broadcast" {
        // A broadcast of a scalar has `dimensions={}`; XLA prints it anyway.
        a.push(format!("dimensions={}", list(&i.dimensions)));
    }
    if op == "get-tuple-element" {
        a.push(format!("index={}", i.tuple_index));
    }
    if !i.slice_dimensions.is_empty() {
        let s: Vec<String> = i
            .slice_dimensions
            .iter()
            .map(|d| {
                if d.stride == 1 {
                    format!("[{}:{}]", d.start, d.limit)
                } else {
                    format!("[{}:{}:{}]", d.start, d.limit, d.stride)
                }
            })
            .collect();
        a.push(format!("slice={{{}}}", s.join(", ")));
    }
    if !i.dynamic_slice_sizes.is_empty() {
        a.push(format!(
            "dynamic_slice_sizes={}",
            list(&i.dynamic_slice_sizes)
        ));
    }
    if let Some(p) = &i.padding_config {
        let s: Vec<String> = p
            .dimensions
            .iter()
            .map(|d| {
                if d.interior == 0 {
                    format!("{}_{}", d.low, d.high)
                } else {
                    format!("{}_{}_{}", d.low, d.high, d.interior)
                }
            })
            .collect();
        a.push(format!("padding={}", s.join("x")));
    }
    if let Some(w) = &i.window {
        if !w.dimensions.is_empty() {
            a.push(format!("window={{{}}}", window_text(w)));
        }
    }
    if let Some(c) = &i.convolution_dimension_numbers {
        a.push(format!("dim_labels={}", dim_labels(c)));
    }
    if i.feature_group_count > 1 {
        a.push(format!("feature_group_count={}", i.feature_group_count));
    }
    if i.batch_group_count > 1 {
        a.push(format!("batch_group_count={}", i.batch_group_count));
    }
    if let Some(d) = &i.dot_dimension_numbers {
        if !d.lhs_batch_dimensions.is_empty() {
            a.push(format!("lhs_batch_dims={}", list(&d.lhs_batch_dimensions)));
        }
        a.push(format!(
            "lhs_contracting_dims={}",
            list(&d.lhs_contracting_dimensions)
        ));
        if !d.rhs_batch_dimensions.is_empty() {
            a.push(format!("rhs_batch_dims={}", list(&d.rhs_batch_dimensions)));
        }
        a.push(format!(
            "rhs_contracting_dims={}",
            list(&d.rhs_contracting_dimensions)
        ));
    }
    if let Some(g) = &i.gather_dimension_numbers {
        a.push(format!("offset_dims={}", list(&g.offset_dims)));
        a.push(format!(
            "collapsed_slice_dims={}",
            list(&g.collapsed_slice_dims)
        ));
        a.push(format!("start_index_map={}", list(&g.start_index_map)));
        a.push(format!("index_vector_dim={}", g.index_vector_dim));
        a.push(format!("slice_sizes={}", list(&i.gather_slice_sizes)));
    }
    if let Some(s) = &i.scatter_dimension_numbers {
        a.push(format!(
            "update_window_dims={}",
            list(&s.update_window_dims)
        ));
        a.push(format!(
            "inserted_window_dims={}",
            list(&s.inserted_window_dims)
        ));
        a.push(format!(
            "scatter_dims_to_operand_dims={}",
            list(&s.scatter_dims_to_operand_dims)
        ));
        a.push(format!("index_vector_dim={}", s.index_vector_dim));
    }
    if !i.comparison_direction.is_empty() {
        a.push(format!("direction={}", i.comparison_direction));
    }
    if !i.comparison_type.is_empty() {
        a.push(format!("type={}", i.comparison_type));
    }
    if i.is_stable {
        a.push("is_stable=true".into());
    }
    if i.indices_are_sorted {
        a.push("indices_are_sorted=true".into());
    }
    if i.unique_indices {
        a.push("unique_indices=true".into());
    }
    if !called.is_empty() {
        match op {
            "fusion" => {
                if !i.fusion_kind.is_empty() {
                    a.push(format!("kind={}", i.fusion_kind));
                }
                a.push(format!("calls={}", called.join(", ")));
            }
            "while" if called.len() == 2 => {
                a.push(format!("condition={}", called[0]));
                a.push(format!("body={}", called[1]));
            }
            "select-and-scatter" if called.len() == 2 => {
                a.push(format!("select={}", called[0]));
                a.push(format!("scatter={}", called[1]));
            }
            "conditional" => a.push(format!("branch_computations={{{}}}", called.join(", "))),
            "custom-call" => a.push(format!("called_computations={{{}}}", called.join(", "))),
            _ if called.len() == 1 => a.push(format!("to_apply={}", called[0])),
            _ => a.push(format!("calls={{{}}}", called.join(", "))),
        }
    }
    if !i.custom_call_target.is_empty() {
        a.push(format!(
            "custom_call_target={}",
            quoted(&i.custom_call_target)
        ));
        let version = match i.custom_call_api_version {
            1 => Some("API_VERSION_ORIGINAL"),
            2 => Some("API_VERSION_STATUS_RETURNING"),
            3 => Some("API_VERSION_STATUS_RETURNING_UNIFIED"),
            4 => Some("API_VERSION_TYPED_FFI"),
            _ => None,
        };
        if let Some(v) = version {
            a.push(format!("api_version={v}"));
        }
    }
    if !i.control_predecessor_ids.is_empty() {
        let preds: Vec<String> = i
            .control_predecessor_ids
            .iter()
            .map(|p| format!("%{}", inst_name.get(p).copied().unwrap_or("?")))
            .collect();
        a.push(format!("control-predecessors={{{}}}", preds.join(", ")));
    }
    if let Some(m) = &i.metadata {
        let mut parts = Vec::new();
        if !m.op_type.is_empty() {
            parts.push(format!("op_type={}", quoted(&m.op_type)));
        }
        if !m.op_name.is_empty() {
            parts.push(format!("op_name={}", quoted(&m.op_name)));
        }
        if !m.source_file.is_empty() {
            parts.push(format!("source_file={}", quoted(&m.source_file)));
            parts.push(format!("source_line={}", m.source_line));
        }
        if !parts.is_empty() {
            a.push(format!("metadata={{{}}}", parts.join(" ")));
        }
    }
    if !i.backend_config.is_empty() {
        match std::str::from_utf8(&i.backend_config) {
            Ok(s) if s.starts_with('{') => a.push(format!("backend_config={s}")),
            Ok(s) => a.push(format!("backend_config={}", quoted(s))),
            Err(_) => a.push(format!("backend_config=<{} bytes>", i.backend_config.len())),
        }
    }
    a
}

/// The module in XLA's HLO text syntax.
pub(crate) fn print_module(m: &Module) -> String {
    let comp_name: HashMap<i64, &str> = m
        .computations
        .iter()
        .map(|c| (c.id, c.name.as_str()))
        .collect();
    let entry = m
        .computations
        .iter()
        .find(|c| c.id == m.entry_computation_id)
        .or_else(|| {
            m.computations
                .iter()
                .find(|c| c.name == m.entry_computation_name)
        });
    let mut out = format!("HloModule {}", m.name);
    if m.schedule.is_some() {
        out.push_str(", is_scheduled=true");
    }
    if let Some(alias) = &m.input_output_alias {
        if !alias.entries.is_empty() {
            let entries: Vec<String> = alias
                .entries
                .iter()
                .map(|e| {
                    format!(
                        "{}: ({}, {}, {})",
                        list(&e.output_shape_index),
                        e.parameter_number,
                        list(&e.parameter_shape_index),
                        if e.kind == 2 {
                            "must-alias"
                        } else {
                            "may-alias"
                        }
                    )
                })
                .collect();
            let _ = write!(out, ", input_output_alias={{ {} }}", entries.join(", "));
        }
    }
    out.push_str("\n\n");
    for c in &m.computations {
        let inst_name: HashMap<i64, &str> = c
            .instructions
            .iter()
            .map(|i| (i.id, i.name.as_str()))
            .collect();
        let mut params: Vec<&Instruction> = c
            .instructions
            .iter()
            .filter(|i| i.opcode == "parameter")
            .collect();
        params.sort_by_key(|i| i.parameter_number);
        let sig: Vec<String> = params
            .iter()
            .map(|p| {
                let s = p.shape.as_ref().map(|s| shape_text(s, false));
                format!("{}: {}", p.name, s.unwrap_or_default())
            })
            .collect();
        let result = c
            .instructions
            .iter()
            .find(|i| i.id == c.root_id)
            .and_then(|r| r.shape.as_ref())
            .map(|s| shape_text(s, false))
            .unwrap_or_default();
        let is_entry = entry.is_some_and(|e| e.id == c.id);
        let _ = writeln!(
            out,
            "{}%{} ({}) -> {} {{",
            if is_entry { "ENTRY " } else { "" },
            c.name,
            sig.join(", "),
            result
        );
        for i in &c.instructions {
            let shape = i
                .shape
                .as_ref()
                .map(|s| shape_text(s, true))
                .unwrap_or_default();
            let operands: Vec<String> = i
                .operand_ids
                .iter()
                .map(|o| format!("%{}", inst_name.get(o).copied().unwrap_or("?")))
                .collect();
            let args = match i.opcode.as_str() {
                "parameter" => i.parameter_number.to_string(),
                "constant" => match (&i.literal, &i.shape) {
                    (Some(l), Some(s)) => literal_text(l, s),
                    _ => String::new(),
                },
                _ => operands.join(", "),
            };
            let mut line = format!(
                "  {}%{} = {} {}({})",
                if i.id == c.root_id { "ROOT " } else { "" },
                i.name,
                shape,
                i.opcode,
                args
            );
            for attr in attributes(i, &comp_name, &inst_name) {
                line.push_str(", ");
                line.push_str(&attr);
            }
            out.push_str(&line);
            out.push('\n');
        }
        out.push_str("}\n\n");
    }
    out.truncate(out.trim_end().len());
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(t: i32, dims: &[i64]) -> Shape {
        Shape {
            element_type: t,
            dimensions: dims.to_vec(),
            tuple_shapes: Vec::new(),
            layout: Some(Layout {
                minor_to_major: (0..dims.len() as i64).rev().collect(),
            }),
        }
    }

    fn inst(id: i64, name: &str, opcode: &str, s: Shape, operands: &[i64]) -> Instruction {
        Instruction {
            id,
            name: name.into(),
            opcode: opcode.into(),
            shape: Some(s),
            operand_ids: operands.to_vec(),
            ..Default::default()
        }
    }

    /// A module as XLA's CPU compiler leaves `dot(x, w) + b` (a fusion calling a computation),
    /// encoded and decoded through the wire format.
    #[test]
    fn prints_a_module_in_hlo_syntax() {
        let mut p0 = inst(1, "param_0", "parameter", shape(11, &[2, 3]), &[]);
        p0.parameter_number = 0;
        let mut p1 = inst(2, "param_1", "parameter", shape(11, &[2, 3]), &[]);
        p1.parameter_number = 1;
        let add = inst(3, "add.1", "add", shape(11, &[2, 3]), &[1, 2]);
        let fused = Computation {
            name: "fused_add".into(),
            instructions: vec![p0, p1, add],
            id: 10,
            root_id: 3,
        };
        let mut x = inst(4, "x", "parameter", shape(11, &[2, 4]), &[]);
        x.parameter_number = 0;
        let mut w = inst(5, "w", "parameter", shape(11, &[3, 4]), &[]);
        w.parameter_number = 1;
        let mut dot = inst(6, "dot.2", "dot", shape(11, &[2, 3]), &[4, 5]);
        dot.dot_dimension_numbers = Some(DotDims {
            lhs_contracting_dimensions: vec![1],
            rhs_contracting_dimensions: vec![1],
            ..Default::default()
        });
        let mut c = inst(7, "c", "constant", shape(11, &[]), &[]);
        c.literal = Some(Literal {
            f32s: vec![0.5],
            ..Default::default()
        });
        let mut b = inst(8, "b", "broadcast", shape(11, &[2, 3]), &[7]);
        b.dimensions = vec![];
        let mut fusion = inst(9, "fusion", "fusion", shape(11, &[2, 3]), &[6, 8]);
        fusion.fusion_kind = "kLoop".into();
        fusion.called_computation_ids = vec![10];
        let main = Computation {
            name: "main.3".into(),
            instructions: vec![x, w, dot, c, b, fusion],
            id: 11,
            root_id: 9,
        };
        let module = Module {
            name: "jit_f".into(),
            entry_computation_name: "main.3".into(),
            computations: vec![fused, main],
            entry_computation_id: 11,
            schedule: Some(Empty {}),
            input_output_alias: Some(AliasConfig {
                entries: vec![AliasEntry {
                    output_shape_index: vec![],
                    parameter_number: 1,
                    parameter_shape_index: vec![],
                    kind: 1,
                }],
            }),
        };
        let wrapped = ModuleWithConfig {
            hlo_module: module.encode_to_vec(),
        };
        let bytes = module_bytes("hlo_with_config", &wrapped.encode_to_vec()).unwrap();
        let text = module_text(&bytes).unwrap();
        println!("{text}");
        assert!(text.starts_with(
            "HloModule jit_f, is_scheduled=true, input_output_alias={ {}: (1, {}, may-alias) }\n"
        ));
        assert!(text.contains(
            "%fused_add (param_0: f32[2,3], param_1: f32[2,3]) -> f32[2,3] {\n  \
             %param_0 = f32[2,3]{1,0} parameter(0)\n"
        ));
        assert!(text.contains("  ROOT %add.1 = f32[2,3]{1,0} add(%param_0, %param_1)\n"));
        assert!(text.contains("ENTRY %main.3 (x: f32[2,4], w: f32[3,4]) -> f32[2,3] {"));
        assert!(text.contains(
            "  %dot.2 = f32[2,3]{1,0} dot(%x, %w), lhs_contracting_dims={1}, \
             rhs_contracting_dims={1}\n"
        ));
        assert!(text.contains("  %c = f32[] constant(0.5)\n"));
        assert!(text.contains("  %b = f32[2,3]{1,0} broadcast(%c), dimensions={}\n"));
        assert!(text.contains(
            "  ROOT %fusion = f32[2,3]{1,0} fusion(%dot.2, %b), kind=kLoop, calls=%fused_add\n"
        ));
        // The format is checked, and garbage is an error rather than a panic.
        assert!(module_bytes("mlir", &[]).is_err());
        assert!(module_text(&[0xff, 0xff, 0xff]).is_err());
    }

    #[test]
    fn convolution_attributes_read_as_xla_writes_them() {
        let mut conv = inst(1, "conv", "convolution", shape(11, &[1, 8, 8, 16]), &[]);
        conv.window = Some(Window {
            dimensions: vec![
                WindowDim {
                    size: 3,
                    stride: 2,
                    padding_low: 1,
                    padding_high: 1,
                    window_dilation: 1,
                    base_dilation: 1,
                    window_reversal: false,
                };
                2
            ],
        });
        conv.convolution_dimension_numbers = Some(ConvDims {
            input_batch_dimension: 0,
            input_feature_dimension: 3,
            input_spatial_dimensions: vec![1, 2],
            kernel_input_feature_dimension: 2,
            kernel_output_feature_dimension: 3,
            kernel_spatial_dimensions: vec![0, 1],
            output_batch_dimension: 0,
            output_feature_dimension: 3,
            output_spatial_dimensions: vec![1, 2],
        });
        conv.feature_group_count = 16;
        let a = attributes(&conv, &HashMap::new(), &HashMap::new());
        assert_eq!(
            a,
            vec![
                "window={size=3x3 stride=2x2 pad=1_1x1_1}",
                "dim_labels=b01f_01io->b01f",
                "feature_group_count=16"
            ]
        );
    }
}
