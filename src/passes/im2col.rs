//! The im2col rewrite of convolutions: each selected `Op::Conv` becomes pad + strided slices +
//! concat + one `dot_general`, ordinary graph ops that every backend runs.
//!
//! A convolution written as one matrix product over gathered patches runs through a backend's
//! matmul path. XLA:CPU's own convolution kernels are slow at many channels on small images,
//! so the XLA backend applies this pass to the convolutions its
//! [`ConvStrategy`](crate::backend::xla::ConvStrategy) selects, in
//! [`Backend::rewrite`](crate::backend::Backend::rewrite), before the graph is fingerprinted
//! and compiled. Any other backend can do the same with its own rule.

use super::Pass;
use crate::error::{Error, Result};
use crate::ir::{
    ConvAttrs, DotDims, Graph, InputKind, Literal, NodeId, Op, ReduceKind, Shape, TensorType,
};

/// Rewrites the `Op::Conv` nodes that `select(attributes, input type, kernel type)` picks
/// into their [`im2col`] expansion; the other convolutions stay as they are.
///
/// The expansion has exactly the convolution's type, so users and outputs are rewired to it
/// and the graph keeps its signature (inputs, outputs, aliases).
///
/// ```
/// use kiln::ir::{ConvAttrs, DType, Graph, InputKind, Op, TensorType};
/// use kiln::passes::{Im2col, Pass};
///
/// let mut g = Graph::new();
/// let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [1, 8, 4, 4]));
/// let w = g.add_input(InputKind::Parameter, "w", TensorType::new(DType::F32, [8, 8, 3, 3]));
/// let y = g.add(Op::Conv(ConvAttrs::plain(2)), &[x, w])?;
/// g.set_outputs(vec![y])?;
/// // Rewrite convolutions with at least 8 input channels.
/// let changed = Im2col::new(|_, x: &TensorType, _: &TensorType| x.shape.dim(1) >= 8).run(&mut g)?;
/// assert!(changed);
/// g.verify()?;
/// # Ok::<(), kiln::Error>(())
/// ```
pub struct Im2col<F> {
    select: F,
}

impl<F> Im2col<F>
where
    F: Fn(&ConvAttrs, &TensorType, &TensorType) -> bool,
{
    /// The pass rewriting the convolutions `select` picks.
    pub fn new(select: F) -> Self {
        Im2col { select }
    }
}

impl<F> Pass for Im2col<F>
where
    F: Fn(&ConvAttrs, &TensorType, &TensorType) -> bool,
{
    fn name(&self) -> &'static str {
        "im2col"
    }

    fn run(&self, graph: &mut Graph) -> Result<bool> {
        let picked: Vec<(NodeId, ConvAttrs, NodeId, NodeId)> = graph
            .topo_order()
            .into_iter()
            .filter_map(|id| {
                let n = graph.node(id);
                let Op::Conv(c) = &n.op else { return None };
                let (x, w) = (n.operands[0], n.operands[1]);
                (self.select)(c, &graph.node(x).ty, &graph.node(w).ty)
                    .then(|| (id, c.clone(), x, w))
            })
            .collect();
        for (id, c, x, w) in &picked {
            let y = im2col(graph, c, *x, *w)?;
            graph.replace_uses(*id, y)?;
            graph.remove_unused(*id);
        }
        Ok(!picked.is_empty())
    }
}

/// Rewrites the convolution nodes `nodes` of `graph` (chosen node by node, e.g. by the XLA
/// backend's autotuner) into their [`im2col`] expansions, users and outputs rewired to them.
/// Returns whether anything changed. A node that is not a two-operand `Op::Conv` is an
/// [`Error::Graph`].
pub fn im2col_nodes(graph: &mut Graph, nodes: &[NodeId]) -> Result<bool> {
    for &id in nodes {
        let n = graph
            .get(id)
            .ok_or_else(|| Error::Graph(format!("im2col: node {id:?} is not in the graph")))?;
        let Op::Conv(c) = &n.op else {
            return Err(Error::Graph(format!(
                "im2col: node {id:?} is a {}, not a convolution",
                n.op.name()
            )));
        };
        if n.operands.len() != 2 {
            return Err(Error::Graph(format!(
                "im2col: convolution {id:?} has {} operands",
                n.operands.len()
            )));
        }
        let (c, x, w) = (c.clone(), n.operands[0], n.operands[1]);
        let y = im2col(graph, &c, x, w)?;
        graph.replace_uses(id, y)?;
        graph.remove_unused(id);
    }
    Ok(!nodes.is_empty())
}

fn reshape(g: &mut Graph, x: NodeId, dims: &[usize]) -> Result<NodeId> {
    g.add(Op::Reshape(Shape::new(dims)), &[x])
}

/// Adds to `g` the im2col expansion of `Op::Conv(c)` on input `x` `[N, C, *spatial]` and
/// kernel `w` `[O, C/groups, *k]`, and returns the node holding the result, of exactly the
/// type `Op::Conv(c)` would have.
///
/// The expansion, for `n` spatial dims, `T = prod(k)` kernel taps and `Y` output positions:
///
/// 1. the input goes channels-first, `[C, N, *spatial]`, and is padded (edges, possibly
///    negative, and interior zeros for `lhs_dilation`);
/// 2. patches `[C, T, N, Y]` are cut out with strided slices and concatenated: one slice per
///    kernel tap (each covers every output position) or one per output position (each covers
///    the whole window), whichever are fewer (the weight gradient's convolution has a large
///    "kernel" and few outputs);
/// 3. one `dot_general` multiplies the kernel as it lies in memory, `[O, C * T]`, with the
///    patches `[C * T, N * Y]` (no copy of the kernel; feature groups and batch groups become
///    a batch dimension of the product);
/// 4. the result `[O, N, Y]` goes back to `[N, O, *Y]`.
///
/// A full-window convolution ([`is_full_window`], such as autograd's weight gradient of a 1×1
/// stride-1 convolution) has no patches to cut: it becomes one product on `x` and `w` as they
/// lie instead (see `full_window_product`).
pub fn im2col(g: &mut Graph, c: &ConvAttrs, x: NodeId, w: NodeId) -> Result<NodeId> {
    let xt = g.node(x).ty.clone();
    let wt = g.node(w).ty.clone();
    let out_ty = {
        // Type check up front, so errors name the convolution.
        let mut probe = Graph::new();
        let a = probe.add_input(InputKind::Data, "x", xt.clone());
        let b = probe.add_input(InputKind::Data, "w", wt.clone());
        let r = probe.add(Op::Conv(c.clone()), &[a, b])?;
        probe.node(r).ty.clone()
    };
    let n = c.strides.len();
    let xd = xt.shape.dims().to_vec();
    let wd = wt.shape.dims().to_vec();
    let (batch, cin) = (xd[0], xd[1]);
    let (cout, cin_g) = (wd[0], wd[1]);
    let ksp: Vec<usize> = wd[2..].to_vec();
    let ysp: Vec<usize> = out_ty.shape.dims()[2..].to_vec();
    let taps: usize = ksp.iter().product();
    let npos: usize = ysp.iter().product();
    let (fg, bg) = (c.feature_groups, c.batch_groups);
    if fg > 1 && bg > 1 {
        return Err(Error::Invalid(
            "im2col: feature and batch groups both > 1".into(),
        ));
    }

    if is_full_window(c, &xt, &wt) {
        return full_window_product(g, x, w, &out_ty);
    }

    // 1. Channels first, padded: [C, N, *P].
    let mut perm = vec![1, 0];
    perm.extend(2..n + 2);
    let mut xc = g.add(Op::Transpose(perm), &[x])?;
    let needs_pad =
        c.lhs_dilation.iter().any(|&d| d > 1) || c.padding.iter().any(|&(l, h)| l != 0 || h != 0);
    if needs_pad {
        let zero = g.add(Op::Constant(Literal::scalar(xt.dtype, 0.0)), &[])?;
        let mut low = vec![0i64, 0];
        let mut high = vec![0i64, 0];
        let mut interior = vec![0usize, 0];
        for i in 0..n {
            low.push(c.padding[i].0);
            high.push(c.padding[i].1);
            interior.push(c.lhs_dilation[i] - 1);
        }
        xc = g.add(
            Op::Pad {
                low,
                high,
                interior,
            },
            &[xc, zero],
        )?;
    }
    let pd = g.node(xc).ty.shape.dims().to_vec();

    // 2. Patches [C, T, N, Y].
    let slice = |g: &mut Graph, start: Vec<usize>, limit: Vec<usize>, stride: Vec<usize>| {
        let mut st = vec![0, 0];
        st.extend(start);
        let mut li = vec![cin, batch];
        li.extend(limit);
        let mut sd = vec![1, 1];
        sd.extend(stride);
        g.add(
            Op::Slice {
                start: st,
                limit: li,
                stride: sd,
            },
            &[xc],
        )
    };
    let patches = if taps == 1 && (0..n).all(|i| ysp[i] == pd[i + 2]) {
        // 1x1 kernel, stride 1, nothing cropped: the padded input is the patch tensor.
        xc
    } else if taps <= npos {
        let mut parts = Vec::with_capacity(taps);
        for t in 0..taps {
            let tap = unravel(t, &ksp);
            let start: Vec<usize> = (0..n).map(|i| tap[i] * c.rhs_dilation[i]).collect();
            let limit: Vec<usize> = (0..n)
                .map(|i| start[i] + (ysp[i] - 1) * c.strides[i] + 1)
                .collect();
            let s = slice(g, start, limit, c.strides.clone())?;
            parts.push(reshape(g, s, &[cin, 1, batch * npos])?);
        }
        if parts.len() == 1 {
            parts[0]
        } else {
            g.add(Op::Concat { axis: 1 }, &parts)?
        }
    } else {
        let mut parts = Vec::with_capacity(npos);
        let mut to_last = vec![0];
        to_last.extend(2..n + 2);
        to_last.push(1);
        for p in 0..npos {
            let pos = unravel(p, &ysp);
            let start: Vec<usize> = (0..n).map(|i| pos[i] * c.strides[i]).collect();
            let limit: Vec<usize> = (0..n)
                .map(|i| start[i] + (ksp[i] - 1) * c.rhs_dilation[i] + 1)
                .collect();
            // [C, N, *k] -> [C, *k, N] -> [C, T, N, 1]
            let s = slice(g, start, limit, c.rhs_dilation.clone())?;
            let s = g.add(Op::Transpose(to_last.clone()), &[s])?;
            parts.push(reshape(g, s, &[cin, taps, batch, 1])?);
        }
        if parts.len() == 1 {
            parts[0]
        } else {
            g.add(Op::Concat { axis: 3 }, &parts)?
        }
    };

    // 3. The product, 4. back to [N, O, *Y].
    let mut out_dims = vec![batch / bg, cout];
    out_dims.extend_from_slice(&ysp);
    if fg == 1 && bg == 1 {
        // [O, C * T] x [C * T, N * Y]: a plain matrix product.
        let lhs = reshape(g, w, &[cout, cin * taps])?;
        let rhs = reshape(g, patches, &[cin * taps, batch * npos])?;
        let dims = DotDims {
            lhs_contract: vec![1],
            rhs_contract: vec![0],
            ..Default::default()
        };
        let y = g.add(Op::DotGeneral(dims), &[lhs, rhs])?;
        let y = reshape(g, y, &[cout, batch, npos])?;
        let y = g.add(Op::Transpose(vec![1, 0, 2]), &[y])?;
        return reshape(g, y, &out_dims);
    }
    // Groups: G blocks of the product. Feature groups split the channels, batch groups split
    // the batch; both split the kernel's output features.
    let groups = fg.max(bg);
    let og = cout / groups;
    // Kernel [G, O/G, C/G, T].
    let lhs = reshape(g, w, &[groups, og, cin_g, taps])?;
    let (rhs, dims) = if fg > 1 {
        // [G, C/G, T, N, Y]
        let rhs = reshape(g, patches, &[fg, cin_g, taps, batch, npos])?;
        let dims = DotDims {
            lhs_batch: vec![0],
            rhs_batch: vec![0],
            lhs_contract: vec![2, 3],
            rhs_contract: vec![1, 2],
        };
        (rhs, dims)
    } else {
        // [C, T, G, N/G, Y]
        let rhs = reshape(g, patches, &[cin, taps, bg, batch / bg, npos])?;
        let dims = DotDims {
            lhs_batch: vec![0],
            rhs_batch: vec![2],
            lhs_contract: vec![2, 3],
            rhs_contract: vec![0, 1],
        };
        (rhs, dims)
    };
    // [G, O/G, N', Y] -> [N', G, O/G, Y] -> [N', O, *Y].
    let y = g.add(Op::DotGeneral(dims), &[lhs, rhs])?;
    let y = g.add(Op::Transpose(vec![2, 0, 1, 3]), &[y])?;
    reshape(g, y, &out_dims)
}

/// Is `Op::Conv(c)` of an input `x` by a kernel `k` a *full-window* convolution: one output
/// position, its window the whole (unpadded, undilated) input, no groups? Then every output
/// is a dot product of an input row with a kernel row, and [`im2col`] needs no patches.
///
/// Autograd's weight gradient of every 1×1 stride-1 convolution has this form: its input is
/// the forward input with batch and channels swapped, `[C, N, H, W]`, its kernel the
/// cotangent likewise, `[O, N, H, W]`, its result `[C, O, 1, 1]`.
pub fn is_full_window(c: &ConvAttrs, x: &TensorType, k: &TensorType) -> bool {
    let n = c.strides.len();
    x.shape.rank() == n + 2
        && k.shape.rank() == n + 2
        && c.feature_groups == 1
        && c.batch_groups == 1
        && c.padding.iter().all(|&(l, h)| l == 0 && h == 0)
        && c.lhs_dilation.iter().all(|&d| d == 1)
        && c.rhs_dilation.iter().all(|&d| d == 1)
        && x.shape.dims()[2..] == k.shape.dims()[2..]
        && x.shape.dim(1) == k.shape.dim(1)
}

/// The full-window convolution ([`is_full_window`]) of `x` `[B, C, *S]` by `w` `[F, C, *S]`
/// as one `dot_general` on the operands as they lie, `[B, F]`, reshaped to `out` (`[B, F,
/// 1, ...]`).
///
/// With few channels over many positions (the weight gradient's channels are the forward
/// batch) the product is batched over the channels and summed after: XLA then reads the
/// operands in place, where contracting channels and positions together makes it copy both
/// into a canonical `[B, C·S]` layout first. Measured on the 1×1 weight gradients of
/// mobilenet_v2's training step alone (2-vCPU Zen 3, xla-cpu-pjrt 0.0.1, µs, the 34 of them
/// weighted by count): `stablehlo.convolution` 21,284, one product contracting all 15,167
/// when batched over channels wherever positions ≥ 4 × channels, else 16,264 when never
/// batched (at 2×2 positions the batched form was the slower one: 852 vs 583 µs for
/// `[4, 160, 2, 2]` by `[4, 960, 2, 2]`).
fn full_window_product(g: &mut Graph, x: NodeId, w: NodeId, out: &TensorType) -> Result<NodeId> {
    let xd = g.node(x).ty.shape.dims().to_vec();
    let (batch, chans) = (xd[0], xd[1]);
    let positions: usize = xd[2..].iter().product();
    let feats = g.node(w).ty.shape.dim(0);
    let xr = reshape(g, x, &[batch, chans, positions])?;
    let wr = reshape(g, w, &[feats, chans, positions])?;
    let y = if positions >= 4 * chans {
        // [C, B, F], summed over C.
        let dims = DotDims {
            lhs_batch: vec![1],
            rhs_batch: vec![1],
            lhs_contract: vec![2],
            rhs_contract: vec![2],
        };
        let p = g.add(Op::DotGeneral(dims), &[xr, wr])?;
        g.add(
            Op::Reduce {
                kind: ReduceKind::Sum,
                axes: vec![0],
            },
            &[p],
        )?
    } else {
        let dims = DotDims {
            lhs_contract: vec![1, 2],
            rhs_contract: vec![1, 2],
            ..Default::default()
        };
        g.add(Op::DotGeneral(dims), &[xr, wr])?
    };
    reshape(g, y, out.shape.dims())
}

/// Row-major multi-index of the flat index `i` in `dims`.
fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for d in (0..dims.len()).rev() {
        idx[d] = i % dims[d];
        i /= dims[d];
    }
    idx
}

/// A graph of one convolution written as im2col: inputs `x`, `w`; one output. For tests and
/// measurements.
pub fn im2col_graph(c: &ConvAttrs, x: &TensorType, w: &TensorType) -> Result<Graph> {
    let mut g = Graph::new();
    let a = g.add_input(InputKind::Data, "x", x.clone());
    let b = g.add_input(InputKind::Data, "w", w.clone());
    let y = im2col(&mut g, c, a, b)?;
    g.set_outputs(vec![y])?;
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::eager::EagerBackend;
    use crate::backend::{Backend, HostTensor};
    use crate::ir::{DType, UnaryOp};

    /// Seeded uniform data in [-1, 1) (SplitMix64).
    fn random(ty: &TensorType, seed: u64) -> HostTensor {
        let mut s = seed;
        let v: Vec<f64> = (0..ty.shape.numel())
            .map(|_| {
                s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
            })
            .collect();
        HostTensor::from_slice(ty.shape.dims(), &v).unwrap()
    }

    fn run(g: &Graph, inputs: &[HostTensor]) -> Vec<HostTensor> {
        let b = EagerBackend::new();
        let exe = b.compile(g).unwrap();
        let bufs: Vec<_> = inputs.iter().map(|h| b.to_device(h).unwrap()).collect();
        let refs: Vec<_> = bufs.iter().collect();
        let outs = b.execute(&exe, &refs).unwrap();
        outs.iter().map(|o| b.to_host(o).unwrap()).collect()
    }

    fn convs(g: &Graph) -> Vec<ConvAttrs> {
        g.topo_order()
            .into_iter()
            .filter_map(|id| match &g.node(id).op {
                Op::Conv(c) => Some(c.clone()),
                _ => None,
            })
            .collect()
    }

    /// `x -> conv3x3(stride 2, pad 1) -> tanh -> conv1x1` plus a grouped 3x3 conv of `x`;
    /// outputs: the 1x1 result (aliased to the input `state`), the grouped result, the 3x3
    /// result. Float64 data.
    fn net() -> (Graph, Vec<HostTensor>) {
        let t = |s: &[usize]| TensorType::new(DType::F64, s);
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", t(&[2, 4, 7, 6]));
        let w1 = g.add_input(InputKind::Parameter, "w1", t(&[6, 4, 3, 3]));
        let w2 = g.add_input(InputKind::Parameter, "w2", t(&[5, 6, 1, 1]));
        let wg = g.add_input(InputKind::Parameter, "wg", t(&[4, 2, 3, 3]));
        g.add_input(InputKind::Buffer, "state", t(&[2, 5, 4, 3]));
        let mut c1 = ConvAttrs::plain(2);
        c1.strides = vec![2, 2];
        c1.padding = vec![(1, 1), (1, 1)];
        let y1 = g.add(Op::Conv(c1), &[x, w1]).unwrap();
        let a = g.add(Op::Unary(UnaryOp::Tanh), &[y1]).unwrap();
        let y2 = g.add(Op::Conv(ConvAttrs::plain(2)), &[a, w2]).unwrap();
        let mut cg = ConvAttrs::plain(2);
        cg.feature_groups = 2;
        let yg = g.add(Op::Conv(cg), &[x, wg]).unwrap();
        g.set_outputs(vec![y2, yg, y1]).unwrap();
        g.add_alias(4, 0).unwrap();
        let inputs = g
            .inputs()
            .iter()
            .enumerate()
            .map(|(i, inp)| random(&inp.ty, 17 + i as u64))
            .collect();
        (g, inputs)
    }

    fn assert_close(got: &[HostTensor], want: &[HostTensor]) {
        assert_eq!(got.len(), want.len());
        for (k, (a, b)) in got.iter().zip(want).enumerate() {
            assert_eq!(a.ty(), b.ty(), "output {k}");
            for (i, (x, y)) in a.to_f64_vec().iter().zip(b.to_f64_vec()).enumerate() {
                assert!((x - y).abs() <= 1e-12, "output {k} element {i}: {x} vs {y}");
            }
        }
    }

    #[test]
    fn rewrites_every_selected_conv_and_keeps_values() {
        let (g, inputs) = net();
        let want = run(&g, &inputs);
        let mut r = g.clone();
        assert!(
            Im2col::new(|_: &ConvAttrs, _: &TensorType, _: &TensorType| true)
                .run(&mut r)
                .unwrap()
        );
        r.verify().unwrap();
        assert!(convs(&r).is_empty());
        assert_eq!(r.output_types(), g.output_types());
        assert_eq!(r.aliases(), g.aliases());
        assert_eq!(r.inputs().len(), g.inputs().len());
        assert_close(&run(&r, &inputs), &want);
        // Nothing left to rewrite.
        assert!(
            !Im2col::new(|_: &ConvAttrs, _: &TensorType, _: &TensorType| true)
                .run(&mut r)
                .unwrap()
        );
    }

    #[test]
    fn rewrites_only_what_the_rule_selects() {
        let (g, inputs) = net();
        let want = run(&g, &inputs);
        let mut r = g.clone();
        let ungrouped_3x3 = |c: &ConvAttrs, _: &TensorType, k: &TensorType| {
            c.feature_groups == 1 && k.shape.dim(2) == 3
        };
        assert!(Im2col::new(ungrouped_3x3).run(&mut r).unwrap());
        r.verify().unwrap();
        let left = convs(&r);
        assert_eq!(left.len(), 2, "{left:?}");
        assert!(left.iter().all(|c| c.strides == [1, 1]));
        assert_close(&run(&r, &inputs), &want);
        // The rule is a function of the node: a second run changes nothing.
        let before = r.fingerprint();
        assert!(!Im2col::new(ungrouped_3x3).run(&mut r).unwrap());
        assert_eq!(r.fingerprint(), before);
    }

    #[test]
    fn rewrites_chosen_nodes_and_rejects_other_nodes() {
        let (g, inputs) = net();
        let want = run(&g, &inputs);
        let mut r = g.clone();
        let grouped = r
            .topo_order()
            .into_iter()
            .find(|&id| matches!(&r.node(id).op, Op::Conv(c) if c.feature_groups == 2))
            .unwrap();
        assert!(im2col_nodes(&mut r, &[grouped]).unwrap());
        r.verify().unwrap();
        let left = convs(&r);
        assert_eq!(left.len(), 2, "{left:?}");
        assert!(left.iter().all(|c| c.feature_groups == 1));
        assert_close(&run(&r, &inputs), &want);
        assert!(!im2col_nodes(&mut r, &[]).unwrap());
        let tanh = r
            .topo_order()
            .into_iter()
            .find(|&id| matches!(r.node(id).op, Op::Unary(_)))
            .unwrap();
        let e = im2col_nodes(&mut r, &[tanh]).unwrap_err().to_string();
        assert!(e.contains("not a convolution"), "{e}");
    }

    /// The weight gradient autograd builds for a 1×1 stride-1 convolution is a full-window
    /// convolution; its expansion is one product (batched over the forward batch where the
    /// positions outnumber it 4 to 1, else contracting everything) and keeps the values, as
    /// does a plain full-window convolution. A strided 1×1 forward convolution's weight
    /// gradient (kernel dilation 2) is not one.
    #[test]
    fn full_window_convolutions_become_one_product() {
        let t = |s: &[usize]| TensorType::new(DType::F64, s);
        for (x_dims, out_ch, stride, batched) in [
            ([2, 3, 4, 4], 5, 1, Some(true)),
            ([5, 3, 2, 2], 4, 1, Some(false)),
            ([2, 3, 4, 4], 5, 2, None),
        ] {
            let mut g = Graph::new();
            let x = g.add_input(InputKind::Data, "x", t(&x_dims));
            let w = g.add_input(InputKind::Parameter, "w", t(&[out_ch, x_dims[1], 1, 1]));
            let mut c = ConvAttrs::plain(2);
            c.strides = vec![stride, stride];
            let y = g.add(Op::Conv(c), &[x, w]).unwrap();
            let ct_ty = g.node(y).ty.clone();
            let ct = g.add_input(InputKind::Data, "ct", ct_ty);
            let dw = crate::autograd::vjp(&mut g, y, ct, &[false, true]).unwrap()[1].unwrap();
            g.set_outputs(vec![dw]).unwrap();
            let (wgrad, wc) = g
                .topo_order()
                .into_iter()
                .find_map(|id| match &g.node(id).op {
                    Op::Conv(c) if id != y => Some((id, c.clone())),
                    _ => None,
                })
                .unwrap();
            let (a, b) = (g.node(wgrad).operands[0], g.node(wgrad).operands[1]);
            let full = is_full_window(&wc, &g.node(a).ty, &g.node(b).ty);
            assert_eq!(full, batched.is_some(), "{x_dims:?} stride {stride}");
            let inputs: Vec<HostTensor> = g
                .inputs()
                .iter()
                .enumerate()
                .map(|(i, inp)| random(&inp.ty, 5 + i as u64))
                .collect();
            let want = run(&g, &inputs);
            let mut r = g.clone();
            assert!(im2col_nodes(&mut r, &[wgrad]).unwrap());
            r.verify().unwrap();
            let reduces = r
                .topo_order()
                .into_iter()
                .filter(|&id| matches!(r.node(id).op, Op::Reduce { .. }))
                .count();
            if let Some(batched) = batched {
                let dots: Vec<DotDims> = r
                    .topo_order()
                    .into_iter()
                    .filter_map(|id| match &r.node(id).op {
                        Op::DotGeneral(d) => Some(d.clone()),
                        _ => None,
                    })
                    .collect();
                assert_eq!(dots.len(), 1, "{x_dims:?}");
                assert_eq!(!dots[0].lhs_batch.is_empty(), batched, "{x_dims:?}");
                assert_eq!(reduces, usize::from(batched));
                // Nothing is cut out of the input: no slices, pads or concatenations.
                assert!(r.topo_order().into_iter().all(|id| !matches!(
                    r.node(id).op,
                    Op::Slice { .. } | Op::Pad { .. } | Op::Concat { .. }
                )));
            }
            assert_close(&run(&r, &inputs), &want);
        }
        // A plain full-window convolution (a classifier over the whole map), batch 2.
        let c = ConvAttrs::plain(2);
        let (xt, wt) = (t(&[2, 6, 3, 3]), t(&[4, 6, 3, 3]));
        assert!(is_full_window(&c, &xt, &wt));
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", xt.clone());
        let w = g.add_input(InputKind::Parameter, "w", wt.clone());
        let y = g.add(Op::Conv(c.clone()), &[x, w]).unwrap();
        g.set_outputs(vec![y]).unwrap();
        let inputs = vec![random(&xt, 1), random(&wt, 2)];
        assert_close(
            &run(&im2col_graph(&c, &xt, &wt).unwrap(), &inputs),
            &run(&g, &inputs),
        );
        // Padding or groups: not full-window.
        let mut padded = c.clone();
        padded.padding = vec![(1, 1), (0, 0)];
        assert!(!is_full_window(&padded, &xt, &wt));
        let mut grouped = c;
        grouped.feature_groups = 2;
        assert!(!is_full_window(&grouped, &xt, &t(&[4, 3, 3, 3])));
    }
}
