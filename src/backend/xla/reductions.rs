//! Whether the CPU compiler splits a graph's reductions into trees.
//!
//! XLA's CPU compiler rewrites every reduction longer than its window (32 elements) into a
//! `reduce-window` of 32-element windows followed by a reduction of the partial results
//! (its `tree_reduction_rewriter` pass), for accuracy. Each half becomes a fusion of its
//! own, and the producer of the reduced values is fused into neither, so a `LayerNorm`
//! (two reductions) becomes five or six fusions where one or two would do; on the CPU
//! plugin each fusion is a separately dispatched task. Where every reduction of a graph
//! runs along the last dims over a few thousand elements (layer norms, softmaxes, pooled
//! means), the tree buys no accuracy worth its cost, and kiln compiles the graph with the
//! pass disabled ([`flat_reductions_pay`]).
//!
//! Measured on a 2-vCPU Xeon (AVX-512), xla-cpu-pjrt 0.0.1, one process alternating the
//! two executables: bert inference 9.75 → 9.32 ms, vit 9.89 → 9.55 ms (20 and 16 rounds
//! of 5 calls, medians); resnet18, mobilenet_v2 and squeezenet1_1 inference unchanged
//! within noise. A sum of squares over `[260, 256]` by rows: 165 → 87 µs, largest error
//! against float64 1.65e-7 → 1.74e-7. Where the pass matters it stays: summing `[260,
//! 1024]` over its rows' dim 0 took 413 µs with it and 544 without, and bert's and vit's
//! training steps (bias gradients reduce over the leading dims) 51 → 130 ms and 49 → 85 ms
//! without it; one sum over 2^20 elements has an error of 6.8e-8 with the tree and 3.0e-6
//! without. (Float sums over leading dims, those bias gradients, now run as kiln's column sum
//! wherever the kernels are registered, the `kernels::colsum` module; their graphs keep the
//! pass for the rest, which measured no better without it.)

use super::pjrt::OptionValue;
use super::XlaOptions;
use crate::ir::{Graph, Op};
use std::sync::Arc;

/// The name of XLA's tree-reduction pass (for `xla_disable_hlo_passes`).
pub const TREE_REDUCTION_PASS: &str = "tree_reduction_rewriter";

/// The most elements one output of a reduction may combine for [`flat_reductions_pay`].
pub const FLAT_REDUCTION_MAX: usize = 4096;

/// Does `g` gain from compiling without XLA's tree reductions ([`TREE_REDUCTION_PASS`])?
/// Yes when it has a reduction and every one reduces the trailing dims of its operand
/// (contiguous rows in XLA's default layout) over at most [`FLAT_REDUCTION_MAX`] elements
/// per output. Any other reduction (over leading dims, or longer) keeps the pass for the
/// whole graph: it is one setting per compilation.
pub fn flat_reductions_pay(g: &Graph) -> bool {
    let mut any = false;
    for id in g.petgraph().node_indices() {
        let n = g.node(id);
        let Op::Reduce { axes, .. } = &n.op else {
            continue;
        };
        let Some(&x) = n.operands.first() else {
            return false;
        };
        let dims = g.node(x).ty.shape.dims();
        // An unverified graph may name dims it lacks: then it keeps the pass.
        let Some(first) = dims.len().checked_sub(axes.len()) else {
            return false;
        };
        let trailing = axes.iter().enumerate().all(|(i, &a)| a == first + i);
        if !trailing || axes.iter().map(|&a| dims[a]).product::<usize>() > FLAT_REDUCTION_MAX {
            return false;
        }
        any = true;
    }
    any
}

/// Does `g` compile without tree reductions on a plugin of `platform`: on the CPU plugin
/// (whose compiler the measurements are of) where [`flat_reductions_pay`].
pub fn compiles_flat(platform: &str, g: &Graph) -> bool {
    platform == "cpu" && flat_reductions_pay(g)
}

/// A backend's serialized compile options, as given and with [`TREE_REDUCTION_PASS`]
/// disabled ([`XlaOptions::flat_reduction_options`]): [`CompileOptionBytes::for_graph`] picks
/// the ones a graph compiles with. Serialized once, when the backend is made.
#[derive(Clone)]
pub(crate) struct CompileOptionBytes {
    usual: Arc<Vec<u8>>,
    flat: Arc<Vec<u8>>,
}

impl CompileOptionBytes {
    /// `options`' debug options serialized by `serialize` (which adds what else the backend
    /// compiles with, e.g. its replicas), both ways.
    pub(crate) fn new(
        options: &XlaOptions,
        serialize: impl Fn(&[(String, OptionValue)]) -> Vec<u8>,
    ) -> Self {
        CompileOptionBytes {
            usual: Arc::new(serialize(&options.debug_options)),
            flat: Arc::new(serialize(&options.flat_reduction_options().debug_options)),
        }
    }

    /// The options as given.
    pub(crate) fn usual(&self) -> &[u8] {
        &self.usual
    }

    /// The options `g` compiles with on a plugin of `platform` (see [`compiles_flat`]).
    pub(crate) fn for_graph(&self, platform: &str, g: &Graph) -> &[u8] {
        if compiles_flat(platform, g) {
            &self.flat
        } else {
            &self.usual
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, TensorType};
    use crate::trace::{trace, Tensor};

    fn graph(dims: &[usize], f: impl Fn(&Tensor) -> crate::Result<Tensor>) -> Graph {
        let ty = TensorType::new(DType::F32, dims.to_vec());
        trace(&[ty], |xs| Ok(vec![f(&xs[0])?])).unwrap().graph
    }

    #[test]
    fn row_reductions_of_a_few_thousand_elements_compile_flat() {
        let ln = graph(&[4, 64, 256], |x| x.layer_norm(&[256], None, None, 1e-5));
        assert!(flat_reductions_pay(&ln));
        let softmax = graph(&[4, 4, 65, 65], |x| x.softmax(-1));
        assert!(flat_reductions_pay(&softmax));
        let pooled = graph(&[4, 512, 7, 7], |x| x.mean(&[2, 3], false));
        assert!(flat_reductions_pay(&pooled));
    }

    #[test]
    fn other_reductions_keep_the_tree() {
        let columns = graph(&[260, 1024], |x| x.sum(&[0], false));
        assert!(!flat_reductions_pay(&columns));
        let middle = graph(&[4, 64, 32, 32], |x| x.sum(&[0, 2, 3], false));
        assert!(!flat_reductions_pay(&middle));
        let long = graph(&[2, 8192], |x| x.sum(&[1], false));
        assert!(!flat_reductions_pay(&long));
        // One reduction over the leading dims decides for the whole graph.
        let mixed = graph(&[260, 256], |x| x.softmax(-1)?.sum(&[0], false));
        assert!(!flat_reductions_pay(&mixed));
        let none = graph(&[4, 4], |x| x.relu());
        assert!(!flat_reductions_pay(&none));
    }
}
