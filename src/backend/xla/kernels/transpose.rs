//! The block transpose ([`TRANSPOSE_TARGET`]): the operand of a product that XLA would
//! re-lay out with a strided copy, transposed by kiln instead where XLA's copy is slowest.
//!
//! XLA's CPU compiler brings each `dot_general` operand into its canonical layout first (the
//! left one `[batch, free, contracting]`, the right one `[batch, contracting, free]`) and
//! copies an operand that is not: a training step's weight gradient `dyᵀ · x` (the left
//! operand contracts its leading dims) and the forward product `x · Wᵀ` of a `Linear` weight
//! (the right one contracts its trailing dim). That copy reads rows of the operand one
//! element at a time; when a row is a multiple of 4 KiB long, every read of a column falls
//! into the same L1 cache set and the copy runs ~10× slower than a copy of the same size
//! with other rows. xla-cpu-pjrt 0.0.1 on a 2-vCPU Zen 2, µs, XLA's copy / libtorch's
//! `permute().contiguous()`: `[260, 1024]` → `[1024, 260]` 975 / 206, `[256, 1024]` →
//! `[1024, 256]` 964 / 185, but `[1024, 256]` → `[256, 1024]` 254 / 179, `[260, 768]` →
//! `[768, 260]` 132 / 138, `[256, 1000]` → `[1000, 256]` 54 / 173. vit's and bert's training
//! steps have two such copies per encoder layer (the feed-forward's 1024-wide activations
//! and weight).
//!
//! So the lowering hands exactly those operands ([`dot_operand_transposes`]: a two-block
//! permutation, 4 KiB rows, at least [`MIN_TRANSPOSE_BYTES`]) to this kernel and gives XLA
//! the product on the canonical layout. The kernel moves 8×8 tiles through a local array
//! (8 source rows at a time: no more than the L1 cache's ways, so they stay cached together
//! even when they share a set); it is plain Rust on the XLA worker that calls it (no
//! libtorch, no kernel lock, no hand-over). `[4, 65, 1024]ᵀ · [4, 65, 256]` alone: 2,139 µs
//! with XLA's copy, 1,119–1,370 µs with the kernel's. Fused training steps, alternating
//! processes of 10–12 steps, ms with / without: vit 59.1–74.4 / 62.6–76.6 (split 58.4–69.0
//! / 63.4–75.8), bert 61.3–78.6 / 68.3–79.3 (split 64.3–74.0 / 70.7–81.4); eager 54–63
//! and 80–87.

use super::TRANSPOSE_TARGET;
use crate::backend::xla::pjrt::ffi::{Call, FfiKernel};
use crate::error::{Error, Result};
use crate::ir::{DType, DotDims, Graph, NodeId, Op, TensorType};

/// The handler of [`TRANSPOSE_TARGET`]: operand `[batch..., p..., q...]` (attribute `split =
/// array<i64: nb, np>`: the number of batch and `p` dims), result `[batch..., q..., p...]`.
pub(crate) struct TransposeKernel;

impl FfiKernel for TransposeKernel {
    const TARGET: &'static str = TRANSPOSE_TARGET;

    fn run(call: &Call<'_>) -> Result<()> {
        call.expect_arity(1, 1)?;
        let split = call.attr_ints("split")?;
        let (x, y) = (call.arg(0)?, call.ret(0)?);
        let ([b, p, q], want) = block_dims(x.dims, split)?;
        if y.dims != want.as_slice() || y.dtype != x.dtype {
            return Err(Error::Invalid(format!(
                "transposing {:?} with split {split:?} gives {want:?}, the result buffer is {:?} ({:?} from {:?})",
                x.dims, y.dims, y.dtype, x.dtype
            )));
        }
        match x.dtype {
            DType::F32 => transpose_blocks(x.as_slice::<f32>()?, call.ret_slice_mut(0)?, b, p, q),
            _ => transpose_blocks(x.as_slice::<f64>()?, call.ret_slice_mut(0)?, b, p, q),
        }
        Ok(())
    }
}

/// `[batch, p, q]` element counts of `dims` split as `split = [nb, np]`, and the dims of the
/// result (`dims` with its `p` and `q` blocks swapped).
fn block_dims(dims: &[i64], split: &[i64]) -> Result<([usize; 3], Vec<i64>)> {
    let bad = || {
        Error::Invalid(format!(
            "split {split:?} does not divide dims {dims:?} into batch, p and q"
        ))
    };
    let &[nb, np] = split else {
        return Err(bad());
    };
    let (nb, np) = (
        usize::try_from(nb).map_err(|_| bad())?,
        usize::try_from(np).map_err(|_| bad())?,
    );
    if nb + np > dims.len() {
        return Err(bad());
    }
    let (batch, p, q) = (&dims[..nb], &dims[nb..nb + np], &dims[nb + np..]);
    let prod = |s: &[i64]| s.iter().map(|&d| d as usize).product::<usize>();
    Ok(([prod(batch), prod(p), prod(q)], [batch, q, p].concat()))
}

/// The side of the square tiles the transpose moves through a local array: 8 rows of the
/// source (at most the L1 cache's associativity on the x86 cores kiln runs on, so the rows
/// stay cached together even when they all map to one cache set) by 8 columns.
const TILE: usize = 8;

/// `y[b][j][i] = x[b][i][j]` for `x` of `[b, p, q]`.
fn transpose_blocks<T: Copy + Default>(x: &[T], y: &mut [T], b: usize, p: usize, q: usize) {
    for k in 0..b {
        let n = p * q;
        transpose_2d(&x[k * n..(k + 1) * n], &mut y[k * n..(k + 1) * n], p, q);
    }
}

/// `y[j][i] = x[i][j]` for `x` of `[p, q]`: whole 8×8 tiles through a local array (whole
/// rows read, whole rows written), then the edges element by element.
fn transpose_2d<T: Copy + Default>(x: &[T], y: &mut [T], p: usize, q: usize) {
    let (pt, qt) = (p - p % TILE, q - q % TILE);
    for i0 in (0..pt).step_by(TILE) {
        for j0 in (0..qt).step_by(TILE) {
            let mut tile = [[T::default(); TILE]; TILE];
            for (r, row) in tile.iter_mut().enumerate() {
                row.copy_from_slice(&x[(i0 + r) * q + j0..][..TILE]);
            }
            for c in 0..TILE {
                let out = &mut y[(j0 + c) * p + i0..][..TILE];
                for (o, row) in out.iter_mut().zip(&tile) {
                    *o = row[c];
                }
            }
        }
        for j in qt..q {
            for r in 0..TILE {
                y[j * p + i0 + r] = x[(i0 + r) * q + j];
            }
        }
    }
    for i in pt..p {
        for j in 0..q {
            y[j * p + i] = x[i * q + j];
        }
    }
}

/// Operands smaller than this stay with XLA's copy (its cost is small there).
pub const MIN_TRANSPOSE_BYTES: usize = 64 * 1024;

/// The row length (bytes) from which XLA's copy is slow: a multiple of this.
const ALIASED_ROW_BYTES: usize = 4096;

/// One operand of a product to transpose with [`TRANSPOSE_TARGET`] before XLA sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OperandTranspose {
    /// The kernel's `split` attribute: `[nb, np]`.
    pub split: [usize; 2],
    /// The transposed operand's type.
    pub ty: TensorType,
}

/// How a `dot_general` is lowered with its operands transposed by kiln first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DotOperandTransposes {
    /// The left operand's transpose, if it gets one.
    pub lhs: Option<OperandTranspose>,
    /// The right operand's transpose, if it gets one.
    pub rhs: Option<OperandTranspose>,
    /// The product's dims on the (possibly transposed) operands; same result.
    pub dims: DotDims,
}

/// Which operands of `dot_general(a, b)` with dims `d` XLA would copy slowly into their
/// canonical layouts (see the module notes), and the product on kiln-transposed operands
/// instead; `None` when neither would be.
///
/// An operand qualifies when its batch dims lead in order, its other dims form two blocks in
/// the wrong order (the left operand's contracting dims before its free ones, the right
/// operand's free dims before its contracting ones, each block in increasing order), its
/// rows (the second block) are a multiple of 4 KiB, and it has at least
/// [`MIN_TRANSPOSE_BYTES`]; f32 and f64 only.
pub fn dot_operand_transposes(
    d: &DotDims,
    a: &TensorType,
    b: &TensorType,
) -> Option<DotOperandTransposes> {
    let nb = d.lhs_batch.len();
    let lhs = misplaced(a, &d.lhs_batch, &d.lhs_contract, true);
    let rhs = misplaced(b, &d.rhs_batch, &d.rhs_contract, false);
    if lhs.is_none() && rhs.is_none() {
        return None;
    }
    let mut dims = d.clone();
    if let Some(t) = &lhs {
        // [batch, contract, free] → [batch, free, contract]: contracting dim c moves to
        // nb + nf + (c - nb).
        let nf = a.shape.rank() - nb - t.split[1];
        dims.lhs_contract = d.lhs_contract.iter().map(|&c| c + nf).collect();
    }
    if let Some(t) = &rhs {
        // [batch, free, contract] → [batch, contract, free]: c moves to nb + (c - nb - nf).
        dims.rhs_contract = d.rhs_contract.iter().map(|&c| c - t.split[1]).collect();
    }
    Some(DotOperandTransposes { lhs, rhs, dims })
}

/// [`dot_operand_transposes`] for dot node `id` of `g` as XLA sees it: XLA folds a
/// transpose that feeds a product into the product's dims (a compiled function's `Linear`
/// weight stored `[in, out]` reaches its product as such a transpose), so each operand is
/// followed back through transposes first. Returns the nodes the product then reads (the
/// operands, or the values under their transposes) with the plan on them; `None` when no
/// operand qualifies, or when a transpose reorders an operand's free dims (XLA would permute
/// the result; such products are left to it).
pub(crate) fn dot_operand_transposes_in(
    g: &Graph,
    id: NodeId,
) -> Option<([NodeId; 2], DotOperandTransposes)> {
    let n = g.node(id);
    let (Op::DotGeneral(d), [a, b]) = (&n.op, n.operands.as_slice()) else {
        return None;
    };
    let (a, lhs_batch, lhs_contract) = through_transposes(g, *a, &d.lhs_batch, &d.lhs_contract)?;
    let (b, rhs_batch, rhs_contract) = through_transposes(g, *b, &d.rhs_batch, &d.rhs_contract)?;
    let dims = DotDims {
        lhs_batch,
        rhs_batch,
        lhs_contract,
        rhs_contract,
    };
    let plan = dot_operand_transposes(&dims, &g.node(a).ty, &g.node(b).ty)?;
    Some(([a, b], plan))
}

/// Follows operand `x` of a product (with `batch` and `contract` dims) back through
/// transposes: the first node that is not one, and the dims numbers on it; `None` if a
/// transpose changes the order of the free dims.
fn through_transposes(
    g: &Graph,
    mut x: NodeId,
    batch: &[usize],
    contract: &[usize],
) -> Option<(NodeId, Vec<usize>, Vec<usize>)> {
    let (mut batch, mut contract) = (batch.to_vec(), contract.to_vec());
    while let Op::Transpose(perm) = &g.node(x).op {
        // Dim i of the transpose is dim perm[i] of its operand.
        let free: Vec<usize> = (0..perm.len())
            .filter(|i| !batch.contains(i) && !contract.contains(i))
            .map(|i| perm[i])
            .collect();
        if free.windows(2).any(|w| w[0] > w[1]) {
            return None;
        }
        batch = batch.iter().map(|&i| perm[i]).collect();
        contract = contract.iter().map(|&i| perm[i]).collect();
        x = g.node(x).operands[0];
    }
    Some((x, batch, contract))
}

/// The transpose of one operand (its `split[1]` the length of its first non-batch block), if
/// it qualifies (see [`dot_operand_transposes`]). `left`: the left operand (canonical
/// `[batch, free, contract]`), else the right one (`[batch, contract, free]`).
fn misplaced(
    t: &TensorType,
    batch: &[usize],
    contract: &[usize],
    left: bool,
) -> Option<OperandTranspose> {
    if !matches!(t.dtype, DType::F32 | DType::F64) || contract.is_empty() {
        return None;
    }
    let (r, nb, nc) = (t.shape.rank(), batch.len(), contract.len());
    if batch.iter().enumerate().any(|(i, &d)| d != i) || nb + nc >= r {
        return None;
    }
    let mut sorted = contract.to_vec();
    sorted.sort_unstable();
    // The contracting block: first after the batch dims (left operand) or last (right).
    let start = if left { nb } else { r - nc };
    if sorted.iter().enumerate().any(|(i, &c)| c != start + i) {
        return None;
    }
    // Its position must be the wrong one: the left operand's canonical contracting block is
    // last, the right one's first (after batch); a rank with no free dims is canonical.
    let first = if left { nc } else { r - nb - nc };
    let dims = t.shape.dims();
    let row: usize = dims[nb + first..].iter().product::<usize>() * t.dtype.size_in_bytes();
    let rows: usize = dims[nb..nb + first].iter().product();
    if row == 0 || row % ALIASED_ROW_BYTES != 0 || rows < TILE {
        return None;
    }
    if t.shape.numel() * t.dtype.size_in_bytes() < MIN_TRANSPOSE_BYTES {
        return None;
    }
    let mut out: Vec<usize> = dims[..nb].to_vec();
    out.extend_from_slice(&dims[nb + first..]);
    out.extend_from_slice(&dims[nb..nb + first]);
    Some(OperandTranspose {
        split: [nb, first],
        ty: TensorType::new(t.dtype, crate::ir::Shape::new(&out)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Shape;

    fn f32_ty(dims: &[usize]) -> TensorType {
        TensorType::new(DType::F32, Shape::new(dims))
    }

    fn dims(lb: &[usize], rb: &[usize], lc: &[usize], rc: &[usize]) -> DotDims {
        DotDims::new(lb, rb, lc, rc)
    }

    #[test]
    fn blocks_transpose_in_every_batch() {
        let (b, p, q) = (3, 13, 70);
        let x: Vec<f64> = (0..b * p * q).map(|v| v as f64).collect();
        let mut y = vec![0.0; x.len()];
        transpose_blocks(&x, &mut y, b, p, q);
        for k in 0..b {
            for i in 0..p {
                for j in 0..q {
                    assert_eq!(y[k * p * q + j * p + i], x[k * p * q + i * q + j]);
                }
            }
        }
    }

    #[test]
    fn a_weight_gradient_transposes_its_left_operand() {
        // dW1 = dhᵀ · x of a 1024-wide feed-forward layer (vit's, bert's).
        let d = dims(&[], &[], &[0, 1], &[0, 1]);
        let t = dot_operand_transposes(&d, &f32_ty(&[4, 65, 1024]), &f32_ty(&[4, 65, 256]))
            .expect("the left operand has 4 KiB rows");
        let lhs = t.lhs.expect("left");
        assert_eq!(lhs.split, [0, 2]);
        assert_eq!(lhs.ty.shape.dims(), &[1024, 4, 65]);
        assert!(t.rhs.is_none());
        assert_eq!(t.dims, dims(&[], &[], &[1, 2], &[0, 1]));
        // The result is the same: [1024, 256] either way.
        let before = crate::ir::Op::DotGeneral(d)
            .infer(&[&f32_ty(&[4, 65, 1024]), &f32_ty(&[4, 65, 256])])
            .unwrap();
        let after = crate::ir::Op::DotGeneral(t.dims)
            .infer(&[&lhs.ty, &f32_ty(&[4, 65, 256])])
            .unwrap();
        assert_eq!(before, after);
    }

    #[test]
    fn a_linear_weight_read_transposed_is_transposed_first() {
        // x · W2ᵀ, W2 [256, 1024].
        let d = dims(&[], &[], &[2], &[1]);
        let t = dot_operand_transposes(&d, &f32_ty(&[4, 65, 1024]), &f32_ty(&[256, 1024]))
            .expect("the right operand has 4 KiB rows");
        assert!(t.lhs.is_none());
        let rhs = t.rhs.expect("right");
        assert_eq!((rhs.split, rhs.ty.shape.dims()), ([0, 1], &[1024, 256][..]));
        assert_eq!(t.dims, dims(&[], &[], &[2], &[0]));
    }

    #[test]
    fn canonical_narrow_or_small_operands_stay_with_xla() {
        // Canonical operands.
        let d = dims(&[], &[], &[2], &[0]);
        assert!(
            dot_operand_transposes(&d, &f32_ty(&[4, 65, 1024]), &f32_ty(&[1024, 256])).is_none()
        );
        // Rows of 1 KiB ([1024, 256]ᵀ) and of 3 KiB.
        let d = dims(&[], &[], &[2], &[1]);
        assert!(
            dot_operand_transposes(&d, &f32_ty(&[4, 65, 256]), &f32_ty(&[1024, 256])).is_none()
        );
        assert!(dot_operand_transposes(&d, &f32_ty(&[4, 65, 768]), &f32_ty(&[256, 768])).is_none());
        // 4 KiB rows but only 32 KiB.
        assert!(dot_operand_transposes(&d, &f32_ty(&[4, 1024]), &f32_ty(&[8, 1024])).is_none());
        // Batched attention products keep their layout (rows of 256 bytes).
        let d = dims(&[0, 1], &[0, 1], &[3], &[3]);
        assert!(
            dot_operand_transposes(&d, &f32_ty(&[4, 4, 65, 64]), &f32_ty(&[4, 4, 65, 64]))
                .is_none()
        );
        // Integer operands.
        let d = dims(&[], &[], &[2], &[1]);
        let i = TensorType::new(DType::I32, Shape::new(&[256, 1024]));
        assert!(dot_operand_transposes(&d, &f32_ty(&[4, 65, 1024]), &i).is_none());
    }

    #[test]
    fn both_operands_can_be_transposed() {
        // f64 [2, K=512, M=512] contracting K with [2, N=8, K=512].
        let t64 = |d: &[usize]| TensorType::new(DType::F64, Shape::new(d));
        let d = dims(&[0], &[0], &[1], &[2]);
        let t = dot_operand_transposes(&d, &t64(&[2, 512, 512]), &t64(&[2, 8, 512])).unwrap();
        assert_eq!(t.lhs.unwrap().ty.shape.dims(), &[2, 512, 512]);
        assert_eq!(t.rhs.unwrap().ty.shape.dims(), &[2, 512, 8]);
        assert_eq!(t.dims, dims(&[0], &[0], &[2], &[1]));
    }

    #[test]
    fn transposes_feeding_a_product_are_looked_through() {
        use crate::ir::InputKind;
        // A compiled function's Linear weight stored [in, out] reaches its product as a
        // transpose, which XLA folds: the product is canonical, nothing to do.
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", f32_ty(&[4, 65, 1024]));
        let wt = g.add_input(InputKind::Parameter, "wt", f32_ty(&[1024, 256]));
        let w = g.add(Op::Transpose(vec![1, 0]), &[wt]).unwrap();
        let y = g
            .add(Op::DotGeneral(dims(&[], &[], &[2], &[1])), &[x, w])
            .unwrap();
        assert!(dot_operand_transposes_in(&g, y).is_none());
        // The other way round: a transposed weight whose fold leaves the slow layout gets
        // the kernel on the weight itself.
        let w2 = g.add_input(InputKind::Parameter, "w2", f32_ty(&[256, 1024]));
        let t2 = g.add(Op::Transpose(vec![1, 0]), &[w2]).unwrap();
        let z = g
            .add(Op::DotGeneral(dims(&[], &[], &[2], &[0])), &[x, t2])
            .unwrap();
        let ([a, b], plan) = dot_operand_transposes_in(&g, z).expect("rows of 4 KiB");
        assert_eq!((a, b), (x, w2));
        assert_eq!(plan.rhs.unwrap().ty.shape.dims(), &[1024, 256]);
        assert_eq!(plan.dims, dims(&[], &[], &[2], &[0]));
        // A transpose that reorders free dims is left to XLA.
        let h = g.add_input(InputKind::Data, "h", f32_ty(&[8, 16, 1024]));
        let ht = g.add(Op::Transpose(vec![1, 0, 2]), &[h]).unwrap();
        let v = g.add_input(InputKind::Data, "v", f32_ty(&[1024, 8]));
        let u = g
            .add(Op::DotGeneral(dims(&[], &[], &[2], &[0])), &[ht, v])
            .unwrap();
        assert!(dot_operand_transposes_in(&g, u).is_none());
    }

    #[test]
    fn batch_dims_stay_in_front() {
        // [B, K, M]ᵀ · [B, K, N] with M = 1024.
        let d = dims(&[0], &[0], &[1], &[1]);
        let t = dot_operand_transposes(&d, &f32_ty(&[2, 64, 1024]), &f32_ty(&[2, 64, 32]))
            .expect("left");
        let lhs = t.lhs.unwrap();
        assert_eq!(
            (lhs.split, lhs.ty.shape.dims()),
            ([1, 1], &[2, 1024, 64][..])
        );
        assert_eq!(t.dims, dims(&[0], &[0], &[2], &[1]));
    }
}
