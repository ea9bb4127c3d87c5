//! Strided views through the graph's data-movement ops, so that a kernel reads an operand
//! (or writes its result) where it lies instead of XLA copying it into place first.
//!
//! A [`StridedView`] is what libtorch calls a view: element `i` of a tensor of `sizes` lives
//! at `offset + Σ i[d]·strides[d]` of a row-major buffer. `Reshape` (where the dims it merges
//! are contiguous in the view), `Transpose` and `Slice` map a view to a view, as
//! `Tensor::view`, `permute` and slicing do in libtorch; so a chain of them ending at a
//! kernel's operand is a view of the chain's first node's buffer ([`source_view`]), and a
//! transpose (and reshape) after a kernel's result is a view of the final node's buffer
//! ([`result_view`]).
//!
//! Why: the attention in bert and vit reads q, k and v out of the fused input projection
//! (`reshape → transpose → slice → reshape`) and its result goes back through `transpose →
//! reshape` to the output projection. XLA materialises each of those as a copy fusion
//! between the kernel calls (three slices and a transpose per layer: bert inference on a
//! 2-vCPU Xeon spent 92–147 µs between the projection and the attention call and 59–93 µs
//! between the attention and the output projection; through views, 2–5 µs each), where
//! libtorch's attention reads strided inputs and writes its result through a permuted view
//! at no extra cost.

use super::packed::single_user;
use crate::ir::{Graph, NodeId, Op};

/// A strided view of a row-major buffer (element units).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StridedView {
    pub offset: i64,
    pub sizes: Vec<i64>,
    pub strides: Vec<i64>,
}

impl StridedView {
    /// The whole row-major buffer of `dims`.
    pub fn contiguous(dims: &[usize]) -> StridedView {
        let sizes: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        StridedView {
            offset: 0,
            strides: row_major_strides(&sizes),
            sizes,
        }
    }

    /// Is this the whole row-major buffer of its sizes (so no view is needed)?
    pub fn is_contiguous(&self) -> bool {
        self.offset == 0 && self.strides == row_major_strides(&self.sizes)
    }

    /// Result dim `i` is dim `perm[i]`.
    pub fn transpose(&self, perm: &[usize]) -> StridedView {
        StridedView {
            offset: self.offset,
            sizes: perm.iter().map(|&p| self.sizes[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
        }
    }

    /// Elements `start, start + stride, ..` below `limit` of each dim.
    pub fn slice(&self, start: &[usize], limit: &[usize], stride: &[usize]) -> StridedView {
        let mut v = self.clone();
        for d in 0..self.sizes.len() {
            let (s, l, k) = (start[d] as i64, limit[d] as i64, stride[d] as i64);
            v.offset += s * self.strides[d];
            v.sizes[d] = if l > s { (l - s + k - 1) / k } else { 0 };
            v.strides[d] = self.strides[d] * k;
        }
        v
    }

    /// The same elements in row-major order with `dims`, if that is a view: libtorch's
    /// `computeStride` (each run of old dims that the new shape merges or splits must be
    /// contiguous within itself; size-1 dims take any stride).
    pub fn reshape(&self, dims: &[usize]) -> Option<StridedView> {
        let new: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        let (old, old_strides) = (&self.sizes, &self.strides);
        let numel: i64 = old.iter().product();
        if new.iter().product::<i64>() != numel {
            return None;
        }
        if numel == 0 || old.is_empty() {
            return Some(StridedView {
                offset: self.offset,
                strides: row_major_strides(&new),
                sizes: new,
            });
        }
        let mut strides = vec![0i64; new.len()];
        let mut view_d = new.len() as isize - 1;
        let mut chunk_base_stride = *old_strides.last()?;
        let (mut tensor_numel, mut view_numel) = (1i64, 1i64);
        for d in (0..old.len()).rev() {
            tensor_numel *= old[d];
            // The end of a contiguous run of old dims: the new dims must cover it exactly.
            let run_ends = d == 0
                || (old[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_base_stride);
            if run_ends {
                while view_d >= 0 && (view_numel < tensor_numel || new[view_d as usize] == 1) {
                    strides[view_d as usize] = view_numel * chunk_base_stride;
                    view_numel *= new[view_d as usize];
                    view_d -= 1;
                }
                if view_numel != tensor_numel {
                    return None;
                }
                if d > 0 {
                    chunk_base_stride = old_strides[d - 1];
                    tensor_numel = 1;
                    view_numel = 1;
                }
            }
        }
        (view_d == -1).then_some(StridedView {
            offset: self.offset,
            sizes: new,
            strides,
        })
    }

    /// The view as a kernel attribute: `array<i64: offset, sizes.., strides..>`.
    pub fn attr(&self) -> String {
        let items: Vec<String> = std::iter::once(self.offset)
            .chain(self.sizes.iter().copied())
            .chain(self.strides.iter().copied())
            .map(|v| v.to_string())
            .collect();
        format!("array<i64: {}>", items.join(", "))
    }

    /// Reads [`StridedView::attr`]'s encoding back.
    pub fn from_attr(items: &[i64]) -> Option<StridedView> {
        let (&offset, rest) = items.split_first()?;
        if rest.len() % 2 != 0 {
            return None;
        }
        let (sizes, strides) = rest.split_at(rest.len() / 2);
        Some(StridedView {
            offset,
            sizes: sizes.to_vec(),
            strides: strides.to_vec(),
        })
    }
}

fn row_major_strides(sizes: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; sizes.len()];
    for d in (0..sizes.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * sizes[d + 1].max(1);
    }
    strides
}

/// The chain's step from node `id`'s operand to `id` applied to `v` (a view of the operand).
fn step(g: &Graph, id: NodeId, v: &StridedView) -> Option<StridedView> {
    let n = g.node(id);
    match &n.op {
        Op::Reshape(shape) => v.reshape(shape.dims()),
        Op::Transpose(perm) => Some(v.transpose(perm)),
        Op::Slice {
            start,
            limit,
            stride,
        } => Some(v.slice(start, limit, stride)),
        _ => None,
    }
}

/// The deepest node of `g` whose buffer holds node `id`'s elements as a strided view,
/// through a chain of `Reshape`, `Transpose` and `Slice` nodes ending at `id`, and that view;
/// `None` if the chain has no transpose or slice (reshapes alone cost XLA nothing) or the
/// view is the source's whole buffer.
pub(crate) fn source_view(g: &Graph, id: NodeId) -> Option<(NodeId, StridedView)> {
    // The chain back from `id`, `id` first (bounded: the attention's chains have four).
    let mut chain = vec![id];
    let mut cur = id;
    while chain.len() < 8 {
        let n = g.node(cur);
        if !matches!(n.op, Op::Reshape(_) | Op::Transpose(_) | Op::Slice { .. }) {
            break;
        }
        cur = n.operands[0];
        chain.push(cur);
    }
    // From the deepest source that gives a view of `id`.
    for s in (1..chain.len()).rev() {
        let src = chain[s];
        let moves = chain[..s]
            .iter()
            .any(|&c| !matches!(g.node(c).op, Op::Reshape(_)));
        if !moves {
            return None;
        }
        let mut v = StridedView::contiguous(g.node(src).ty.shape.dims());
        let ok = chain[..s].iter().rev().all(|&c| match step(g, c, &v) {
            Some(next) => {
                v = next;
                true
            }
            None => false,
        });
        if ok && !v.is_contiguous() {
            return Some((src, v));
        }
    }
    None
}

/// If node `tail`'s only user is a transpose that is not a graph output, optionally
/// followed by a reshape (the transpose's only user), the nodes `[transpose, (reshape)]` and
/// `tail`'s elements as a view of the last one's buffer.
pub(crate) fn result_view(g: &Graph, tail: NodeId) -> Option<(Vec<NodeId>, StridedView)> {
    let t = single_user(g, tail)?;
    let Op::Transpose(perm) = &g.node(t).op else {
        return None;
    };
    // The transpose's row-major buffer, seen as `tail`: tail dim perm[k] has the stride of
    // the transpose's dim k.
    let tv = StridedView::contiguous(g.node(t).ty.shape.dims());
    let mut v = tv.clone();
    for (k, &p) in perm.iter().enumerate() {
        v.sizes[p] = tv.sizes[k];
        v.strides[p] = tv.strides[k];
    }
    let mut nodes = vec![t];
    // A reshape after it keeps the buffer (row-major both).
    if let Some(r) = single_user(g, t).filter(|&r| matches!(g.node(r).op, Op::Reshape(_))) {
        nodes.push(r);
    }
    Some((nodes, v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, TensorType};
    use crate::trace::trace;

    fn t(d: &[usize]) -> TensorType {
        TensorType::new(DType::F32, d.to_vec())
    }

    /// Reads element `idx` of view `v` of `buf`.
    fn at(buf: &[f32], v: &StridedView, idx: &[i64]) -> f32 {
        let o = v.offset + idx.iter().zip(&v.strides).map(|(i, s)| i * s).sum::<i64>();
        buf[o as usize]
    }

    /// Every index of `sizes`, row-major.
    fn indices(sizes: &[i64]) -> Vec<Vec<i64>> {
        let mut out = vec![vec![]];
        for &s in sizes {
            out = out
                .into_iter()
                .flat_map(|p| {
                    (0..s).map(move |i| {
                        let mut q = p.clone();
                        q.push(i);
                        q
                    })
                })
                .collect();
        }
        out
    }

    /// The chain bert's and vit's attention read q, k and v through: each view reads the
    /// same elements as libtorch's reshape / permute / slice of the same buffer.
    #[test]
    fn the_attention_input_chain_is_a_view() {
        let (b, l, h, d) = (2usize, 5usize, 3usize, 4usize);
        let n = b * l * 3 * h * d;
        let buf: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let src = tch::Tensor::from_slice(&buf).reshape([b as i64, l as i64, (3 * h * d) as i64]);
        let g = trace(&[t(&[b, l, 3 * h * d])], |xs| {
            let x = xs[0]
                .reshape(&[b as isize, l as isize, 3, h as isize, d as isize])?
                .permute(&[2, 0, 3, 1, 4])?;
            let parts = (0..3)
                .map(|i| {
                    x.narrow(0, i, 1)?
                        .reshape(&[b as isize, h as isize, l as isize, d as isize])
                })
                .collect::<crate::Result<Vec<_>>>()?;
            Ok(parts)
        })
        .unwrap()
        .graph;
        let expect = src
            .reshape([b as i64, l as i64, 3, h as i64, d as i64])
            .permute([2, 0, 3, 1, 4]);
        for (i, &o) in g.outputs().iter().enumerate() {
            let (s, v) = source_view(&g, o).unwrap_or_else(|| panic!("output {i}:\n{g}"));
            assert_eq!(g.node(s).op, Op::Input(0), "{g}");
            assert_eq!(v.sizes, [b, h, l, d].map(|x| x as i64));
            let e = expect.get(i as i64).contiguous();
            let e: Vec<f32> = Vec::try_from(e.view([-1])).unwrap();
            let got: Vec<f32> = indices(&v.sizes)
                .iter()
                .map(|ix| at(&buf, &v, ix))
                .collect();
            assert_eq!(got, e, "output {i}: {v:?}");
        }
    }

    /// The transpose and reshape after the attention: the result written through the view
    /// lands where the transpose would have put it.
    #[test]
    fn a_transpose_then_reshape_after_a_result_is_a_view_of_the_final_buffer() {
        let (b, h, l, d) = (2usize, 3usize, 5usize, 4usize);
        let g = trace(&[t(&[b, h, l, d])], |xs| {
            let y = xs[0].exp()?;
            Ok(vec![y.permute(&[0, 2, 1, 3])?.reshape(&[
                b as isize,
                l as isize,
                (h * d) as isize,
            ])?])
        })
        .unwrap()
        .graph;
        let tail = g
            .petgraph()
            .node_indices()
            .find(|&n| matches!(g.node(n).op, Op::Unary(_)))
            .unwrap();
        let (nodes, v) = result_view(&g, tail).expect("a view");
        assert_eq!(nodes.len(), 2);
        assert_eq!(*nodes.last().unwrap(), g.outputs()[0]);
        let y = tch::Tensor::randn(
            [b as i64, h as i64, l as i64, d as i64],
            tch::kind::FLOAT_CPU,
        );
        let expect = y
            .permute([0, 2, 1, 3])
            .reshape([b as i64, l as i64, (h * d) as i64]);
        let out = tch::Tensor::zeros([b as i64, l as i64, (h * d) as i64], tch::kind::FLOAT_CPU);
        out.as_strided(&v.sizes, &v.strides, Some(v.offset))
            .copy_(&y);
        assert!(out.equal(&expect));
    }

    #[test]
    fn reshapes_follow_libtorch_view_rules() {
        let base = StridedView::contiguous(&[4, 6]);
        // Splitting and merging contiguous dims.
        let v = base.reshape(&[2, 2, 3, 2]).unwrap();
        assert_eq!(v.strides, [12, 6, 2, 1]);
        assert_eq!(v.reshape(&[4, 6]).unwrap(), base);
        // A transposed view cannot merge its dims.
        let tr = base.transpose(&[1, 0]);
        assert!(tr.reshape(&[24]).is_none());
        // But it can split one and add size-1 dims.
        let s = tr.reshape(&[3, 2, 1, 4]).unwrap();
        assert_eq!((s.strides[0], s.strides[1], s.strides[3]), (2, 1, 6));
        // Slicing a dim to size 1 then dropping it keeps the offset.
        let sl = base.slice(&[1, 0], &[2, 6], &[1, 1]).reshape(&[6]).unwrap();
        assert_eq!((sl.offset, sl.strides.clone()), (6, vec![1]));
        assert!(StridedView::contiguous(&[2, 3]).is_contiguous());
        assert!(!sl.is_contiguous());
        assert_eq!(StridedView::from_attr(&[6, 6, 1]), Some(sl.clone()));
        assert_eq!(sl.attr(), "array<i64: 6, 6, 1>");
        assert!(base.reshape(&[5, 5]).is_none());
    }

    /// Reshapes alone are not worth a view (XLA's reshapes of row-major arrays are free).
    #[test]
    fn reshapes_alone_are_no_view() {
        let g = trace(&[t(&[2, 6])], |xs| Ok(vec![xs[0].reshape(&[3, 4])?]))
            .unwrap()
            .graph;
        assert!(source_view(&g, g.outputs()[0]).is_none());
    }
}
