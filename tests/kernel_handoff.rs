//! kiln's libtorch kernels run on the thread that waits for an execution's results, not on
//! XLA's worker threads, unless they are small (see `kiln::backend::xla::kernels`' thread
//! notes and `set_local_max_flops`). A test binary of its own: the kernel counters and the
//! size threshold are process-wide, so its tests take [`SERIAL`] to count only their own
//! calls.

mod common;

use common::{floats, run, xla, SplitMix64};
use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::kernels::{self, CONV_TARGET, PACKED_CONV_TARGET};
use kiln::backend::xla::{FfiMode, XlaOptions};
use kiln::backend::{Backend, HostTensor};
use kiln::ir::{
    BinaryOp, ConvAttrs, DType, Graph, InputKind, Literal, Op, ReduceKind, TensorType, UnaryOp,
};
use kiln::optim::Sgd;
use kiln::train::{TrainMode, TrainStep};
use kiln::zoo::{self, Model, SharedModel};
use kiln::Tensor;
use std::sync::Mutex;

/// Held by each test while it counts kernel calls.
static SERIAL: Mutex<()> = Mutex::new(());

/// Sets the local-kernel threshold for the life of the guard (then restores it).
struct LocalMaxFlops(f64);

impl LocalMaxFlops {
    fn set(flops: f64) -> Self {
        let old = kernels::local_max_flops();
        kernels::set_local_max_flops(flops);
        LocalMaxFlops(old)
    }
}

impl Drop for LocalMaxFlops {
    fn drop(&mut self) {
        kernels::set_local_max_flops(self.0);
    }
}

/// A chain of 3×3 convolutions, each followed by `y · tanh(y)` in XLA: enough XLA work for
/// its CPU runtime to run the program on its worker threads rather than inside `Execute`
/// (with `tanh` alone it runs inside). Ahead of the chain, XLA sums `tanh` over 2²³ values
/// and adds nothing of it (`0 · sum`) to `x`: milliseconds of XLA work before the first
/// kernel, so that the test's thread waits (serves) by then however it is scheduled (on a
/// loaded machine the first calls of a run otherwise find nobody serving). Frozen weights
/// make packed convolutions, weights updated between calls (as in training) the plain
/// convolution kernel. `ch` channels on `hw`×`hw` images, batch 4: each convolution is
/// 2·4·ch²·hw²·9 flops (75.5 MFLOP at 32, 32).
fn conv_chain(dtype: DType, frozen: bool, ch: usize, hw: usize) -> (Graph, Vec<TensorType>) {
    let xt = TensorType::new(dtype, [4, ch, hw, hw]);
    let pt = TensorType::new(dtype, [1 << 23]);
    let kt = TensorType::new(dtype, [ch, ch, 3, 3]);
    let mut c = ConvAttrs::plain(2);
    c.padding = vec![(1, 1), (1, 1)];
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", xt.clone());
    let p = g.add_input(InputKind::Data, "pad", pt.clone());
    let mut types = vec![xt.clone(), pt];
    let t = g.add(Op::Unary(UnaryOp::Tanh), &[p]).unwrap();
    let kind = ReduceKind::Sum;
    let s = g
        .add(
            Op::Reduce {
                kind,
                axes: vec![0],
            },
            &[t],
        )
        .unwrap();
    let zero = g
        .add(Op::Constant(Literal::scalar(dtype, 0.0)), &[])
        .unwrap();
    let s = g.add(Op::Binary(BinaryOp::Mul), &[s, zero]).unwrap();
    let shape = xt.shape.clone();
    let s = g
        .add(
            Op::Broadcast {
                shape,
                dims: vec![],
            },
            &[s],
        )
        .unwrap();
    let mut h = g.add(Op::Binary(BinaryOp::Add), &[x, s]).unwrap();
    for i in 0..4 {
        let k = g.add_input(InputKind::Parameter, format!("k{i}"), kt.clone());
        g.set_updated_between_calls(i + 2, !frozen).unwrap();
        types.push(kt.clone());
        let y = g.add(Op::Conv(c.clone()), &[h, k]).unwrap();
        let t = g.add(Op::Unary(UnaryOp::Tanh), &[y]).unwrap();
        h = g.add(Op::Binary(BinaryOp::Mul), &[t, y]).unwrap();
    }
    g.set_outputs(vec![h]).unwrap();
    (g, types)
}

#[test]
fn kernels_run_on_the_waiting_thread_and_match_a_float64_reference() {
    for frozen in [false, true] {
        chain_kernels_run_where_their_size_says(frozen, 32, 32);
    }
}

/// Convolutions below the threshold (1.2 MFLOP each here) run on the XLA worker that
/// calls them, with the same results.
#[test]
fn small_kernels_stay_on_xla_workers_and_match_a_float64_reference() {
    for frozen in [false, true] {
        chain_kernels_run_where_their_size_says(frozen, 8, 16);
    }
}

/// Runs [`conv_chain`] five times, checks its result against float64 and where its kernels
/// ran: handed to the waiting thread if at or above [`kernels::local_max_flops`] (the
/// default), else on XLA's workers.
fn chain_kernels_run_where_their_size_says(frozen: bool, ch: usize, hw: usize) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _default = LocalMaxFlops::set(1e7);
    let flops = 2.0 * 4.0 * (ch * ch * hw * hw * 9) as f64;
    let small = flops < kernels::local_max_flops();
    let b = xla().with_options(XlaOptions::plain().ffi(FfiMode::All));
    assert_eq!(b.ffi_status(), Ok(()), "the CPU plugin runs kiln's kernels");
    let (g, types) = conv_chain(DType::F32, frozen, ch, hw);
    let target = if frozen && kernels::packed_conv_enabled() {
        PACKED_CONV_TARGET
    } else {
        CONV_TARGET
    };
    assert_eq!(b.lower(&g).unwrap().matches(target).count(), 4);
    let mut r = SplitMix64::mixed(7);
    // Kernels scaled by 1/√fan-in (as at 32 channels), so that values neither vanish nor
    // blow up through the chain whatever `ch` is.
    let kernel_scale = 0.2 * (32.0 / ch as f64).sqrt();
    let ins: Vec<HostTensor> = types
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let a = if i >= 2 { kernel_scale } else { 0.2 };
            floats(t.shape.dims(), t.dtype, || (r.uniform() * 2.0 - 1.0) * a)
        })
        .collect();
    let (g64, _) = conv_chain(DType::F64, frozen, ch, hw);
    let ins64: Vec<HostTensor> = ins
        .iter()
        .map(|h| HostTensor::from_slice(h.ty().shape.dims(), &h.to_f64_vec()).unwrap())
        .collect();
    let want = run(&EagerBackend::new(), &g64, &ins64)[0].to_f64_vec();
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    assert!(scale > 1e-3, "the reference is not near zero ({scale})");

    let before = kernels::stats();
    let exe = b.compile(&g).unwrap();
    let bufs: Vec<_> = ins.iter().map(|h| b.to_device(h).unwrap()).collect();
    let refs: Vec<_> = bufs.iter().collect();
    for _ in 0..5 {
        let out = b.execute(&exe, &refs).unwrap();
        let got = b.to_host(&out[0]).unwrap().to_f64_vec();
        let err = got
            .iter()
            .zip(&want)
            .fold(0.0f64, |m, (a, w)| m.max((a - w).abs()));
        // Four float32 3×3×ch sums in a row: a few float32 ulps of the largest value.
        assert!(
            err <= 1e-5 * scale,
            "float32 result differs from float64 by {err} (largest value {scale})"
        );
    }
    let after = kernels::stats();
    let calls = after.calls - before.calls;
    let handed = after.handed_over - before.handed_over;
    assert!(
        calls >= 20,
        "{calls} kernel calls for 5 runs of 4 convolutions"
    );
    if small {
        // Small kernels are never handed over, whoever waits.
        assert_eq!(
            handed, 0,
            "{target}: {handed} of {calls} calls of {flops} flops were handed over"
        );
    } else {
        // With the XLA work ahead of the chain every call should be handed over (a plugin
        // that ran this program inside `Execute` would hand none); half leaves room for a
        // thread descheduled for milliseconds on a loaded machine.
        assert!(
            handed * 2 >= calls,
            "{target}: {handed} of {calls} kernel calls ran on the waiting thread"
        );
    }
}

/// A training step replaces its parameters with the updated ones while the step may still
/// run; destroying the replaced buffers blocks in the plugin until it is done, and a thread
/// blocked there cannot serve the step's kernels (they used to run on XLA's workers then).
#[test]
fn a_training_steps_kernels_are_handed_over() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Every kernel, however small (squeezenet's at batch 2 are 0.5-18 MFLOP).
    let _all = LocalMaxFlops::set(0.0);
    let b = xla().with_options(XlaOptions::default().ffi(FfiMode::All));
    let model = SharedModel::new(zoo::build("squeezenet1_1", 0).unwrap());
    let inputs = model.example_inputs(2, 1).unwrap();
    let m = model.clone();
    let mut step = TrainStep::new(
        b,
        model.store(),
        Sgd::new().momentum(0.9),
        move |xs: &[Tensor]| {
            let out = m.forward(xs, true)?;
            m.loss(&out, xs)
        },
    )
    .unwrap()
    .with_mode(TrainMode::Fused)
    .with_lr(1e-3);
    step.step(&inputs).unwrap();
    let before = kernels::stats();
    for _ in 0..3 {
        let loss = step.step(&inputs).unwrap();
        assert!(loss.is_finite());
        step.synchronize().unwrap();
    }
    let after = kernels::stats();
    let (calls, handed) = (
        after.calls - before.calls,
        after.handed_over - before.handed_over,
    );
    assert!(calls > 0);
    assert!(
        handed * 2 >= calls,
        "{handed} of {calls} kernel calls of training steps ran on the waiting thread"
    );
}
