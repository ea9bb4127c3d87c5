//! Optimizers: five steps of the optimizer graph (XLA, parameters and state kept on the device
//! and donated every step; also on the eager interpreter) against the eager update, a
//! hand-written float64 reference of PyTorch's formulas, and libtorch's own optimizers.
//!
//! Measured errors are printed (`cargo test --release --test optim -- --nocapture`).

mod common;

use common::{host, xla, SplitMix64};
use kiln::backend::eager::EagerBackend;
use kiln::backend::{Backend, HostTensor};
use kiln::ir::{DType, InputKind, TensorType};
use kiln::optim::{optimizer_graph, Adam, AdamW, Optimizer, Sgd};
use tch::nn::OptimizerConfig;

const STEPS: usize = 5;
const LRS: [f64; STEPS] = [0.1, 0.05, 0.08, 0.02, 0.04];

/// `n` standard normals, rounded to f32.
fn normals(r: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.normal() as f32).collect()
}

fn shapes() -> Vec<Vec<usize>> {
    vec![vec![4, 3], vec![5], vec![2, 3, 2]]
}

/// Initial parameters and the gradient of every step, per parameter.
fn data() -> (Vec<Vec<f32>>, Vec<Vec<Vec<f32>>>) {
    let mut r = SplitMix64::raw(7);
    let params = shapes()
        .iter()
        .map(|s| normals(&mut r, s.iter().product()))
        .collect();
    let grads = (0..STEPS)
        .map(|_| {
            shapes()
                .iter()
                .map(|s| normals(&mut r, s.iter().product()))
                .collect()
        })
        .collect();
    (params, grads)
}

/// `max |a - b| / max |b|`.
fn rel(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(1e-12f64, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
        / scale
}

/// Runs the optimizer graph for all steps on a backend, keeping parameters and state as device
/// buffers (donated to the next step's outputs). Returns the final parameters.
fn run_graph<B: Backend>(b: &B, opt: &dyn Optimizer) -> Vec<Vec<f64>> {
    let types: Vec<TensorType> = shapes()
        .iter()
        .map(|s| TensorType::new(DType::F32, s.as_slice()))
        .collect();
    let g = optimizer_graph(opt, &types).unwrap();
    let exe = b.compile(&g).unwrap();
    let (params, grads) = data();
    let n = types.len();
    let mut p: Vec<B::Buffer> = params
        .iter()
        .zip(shapes())
        .map(|(v, s)| b.to_device(&host(&s, v)).unwrap())
        .collect();
    let mut st: Vec<B::Buffer> = Vec::new();
    for t in &types {
        for (_, sty) in opt.state_shapes(t) {
            let z = vec![0.0f32; sty.shape.numel()];
            st.push(b.to_device(&host(sty.shape.dims(), &z)).unwrap());
        }
    }
    for (step, gs) in grads.iter().enumerate() {
        let gb: Vec<B::Buffer> = gs
            .iter()
            .zip(shapes())
            .map(|(v, s)| b.to_device(&host(&s, v)).unwrap())
            .collect();
        let lr = b
            .to_device(&HostTensor::from_slice(&[], &[LRS[step]]).unwrap())
            .unwrap();
        let stp = b
            .to_device(&HostTensor::from_slice(&[], &[(step + 1) as f64]).unwrap())
            .unwrap();
        let mut ins: Vec<&B::Buffer> = p.iter().collect();
        ins.extend(gb.iter());
        ins.extend(st.iter());
        ins.push(&lr);
        ins.push(&stp);
        let mut outs = b.execute(&exe, &ins).unwrap();
        st = outs.split_off(n);
        p = outs;
    }
    p.iter()
        .map(|x| b.to_host(x).unwrap().to_f64_vec())
        .collect()
}

/// The eager update (`Optimizer::update_eager`) on tch tensors.
fn run_eager(opt: &dyn Optimizer) -> Vec<Vec<f64>> {
    let (params, grads) = data();
    let ps: Vec<tch::Tensor> = params
        .iter()
        .zip(shapes())
        .map(|(v, s)| host(&s, v).to_tch().unwrap().set_requires_grad(true))
        .collect();
    let mut states: Vec<Vec<tch::Tensor>> = ps
        .iter()
        .zip(shapes())
        .map(|(p, s)| {
            opt.state_shapes(&TensorType::new(DType::F32, s.as_slice()))
                .iter()
                .map(|_| p.zeros_like())
                .collect()
        })
        .collect();
    for (step, gs) in grads.iter().enumerate() {
        for (k, p) in ps.iter().enumerate() {
            let g = host(&shapes()[k], &gs[k]).to_tch().unwrap();
            opt.update_eager(p, &g, &mut states[k], LRS[step], step as u64 + 1)
                .unwrap();
        }
    }
    ps.iter()
        .map(|p| HostTensor::from_tch(p, DType::F32).unwrap().to_f64_vec())
        .collect()
}

/// libtorch's own optimizer (through tch's `VarStore`), with the gradient set by the loss
/// `sum(p * g)`.
fn run_libtorch(cfg: impl OptimizerConfig) -> Vec<Vec<f64>> {
    let (params, grads) = data();
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let ps: Vec<tch::Tensor> = params
        .iter()
        .zip(shapes())
        .enumerate()
        .map(|(k, (v, s))| {
            vs.root()
                .var_copy(&format!("p{k}"), &host(&s, v).to_tch().unwrap())
        })
        .collect();
    let mut opt = cfg.build(&vs, LRS[0]).unwrap();
    for (step, gs) in grads.iter().enumerate() {
        opt.set_lr(LRS[step]);
        let mut loss = tch::Tensor::zeros([], (tch::Kind::Float, tch::Device::Cpu));
        for (k, p) in ps.iter().enumerate() {
            let g = host(&shapes()[k], &gs[k]).to_tch().unwrap();
            loss += (p * g).sum(None);
        }
        opt.backward_step(&loss);
    }
    ps.iter()
        .map(|p| HostTensor::from_tch(p, DType::F32).unwrap().to_f64_vec())
        .collect()
}

/// PyTorch's formulas in float64, element by element.
enum Reference {
    Sgd {
        momentum: f64,
        dampening: f64,
        wd: f64,
        nesterov: bool,
    },
    Adam {
        b1: f64,
        b2: f64,
        eps: f64,
        wd: f64,
        amsgrad: bool,
        decoupled: bool,
    },
}

fn run_reference(r: &Reference) -> Vec<Vec<f64>> {
    let (params, grads) = data();
    let mut out = Vec::new();
    for (k, p0) in params.iter().enumerate() {
        let mut p: Vec<f64> = p0.iter().map(|&x| x as f64).collect();
        let n = p.len();
        let (mut s0, mut s1, mut s2) = (vec![0.0f64; n], vec![0.0f64; n], vec![0.0f64; n]);
        for (step, gs) in grads.iter().enumerate() {
            let lr = LRS[step];
            let t = (step + 1) as f64;
            for i in 0..n {
                let mut g = gs[k][i] as f64;
                match *r {
                    Reference::Sgd {
                        momentum,
                        dampening,
                        wd,
                        nesterov,
                    } => {
                        g += wd * p[i];
                        if momentum != 0.0 {
                            s0[i] = if step == 0 {
                                g
                            } else {
                                momentum * s0[i] + (1.0 - dampening) * g
                            };
                            g = if nesterov {
                                g + momentum * s0[i]
                            } else {
                                s0[i]
                            };
                        }
                        p[i] -= lr * g;
                    }
                    Reference::Adam {
                        b1,
                        b2,
                        eps,
                        wd,
                        amsgrad,
                        decoupled,
                    } => {
                        if decoupled {
                            p[i] *= 1.0 - lr * wd;
                        } else {
                            g += wd * p[i];
                        }
                        s0[i] = b1 * s0[i] + (1.0 - b1) * g;
                        s1[i] = b2 * s1[i] + (1.0 - b2) * g * g;
                        let v = if amsgrad {
                            s2[i] = s2[i].max(s1[i]);
                            s2[i]
                        } else {
                            s1[i]
                        };
                        let bc1 = 1.0 - b1.powf(t);
                        let bc2 = 1.0 - b2.powf(t);
                        let denom = v.sqrt() / bc2.sqrt() + eps;
                        p[i] -= lr / bc1 * s0[i] / denom;
                    }
                }
            }
        }
        out.push(p);
    }
    out
}

fn max_rel(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    a.iter().zip(b).map(|(x, y)| rel(x, y)).fold(0.0, f64::max)
}

fn check(name: &str, opt: &dyn Optimizer, reference: Reference, libtorch: Vec<Vec<f64>>) {
    let xla = run_graph(xla(), opt);
    let interp = run_graph(&EagerBackend::new(), opt);
    let eager = run_eager(opt);
    let refv = run_reference(&reference);
    let (mut init, _) = data();
    let moved = max_rel(
        &refv,
        &init
            .drain(..)
            .map(|v| v.into_iter().map(|x| x as f64).collect())
            .collect::<Vec<_>>(),
    );
    assert!(
        moved > 1e-3,
        "{name}: parameters barely moved ({moved:.2e})"
    );
    let errs = [
        ("xla graph vs f64 reference", max_rel(&xla, &refv)),
        (
            "eager-interpreted graph vs f64 reference",
            max_rel(&interp, &refv),
        ),
        ("eager update vs f64 reference", max_rel(&eager, &refv)),
        ("xla graph vs eager update", max_rel(&xla, &eager)),
        ("xla graph vs libtorch optimizer", max_rel(&xla, &libtorch)),
        (
            "eager update vs libtorch optimizer",
            max_rel(&eager, &libtorch),
        ),
    ];
    for (what, e) in errs {
        assert!(e <= 1e-5, "{name}: {what}: rel err {e:.3e}");
    }
    eprintln!(
        "[{name}] {STEPS} steps: {}",
        errs.iter()
            .map(|(w, e)| format!("{w} {e:.1e}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

#[test]
fn sgd_momentum_nesterov_weight_decay() {
    let opt = Sgd::new().momentum(0.9).nesterov(true).weight_decay(0.01);
    check(
        "SGD momentum 0.9 nesterov wd 0.01",
        &opt,
        Reference::Sgd {
            momentum: 0.9,
            dampening: 0.0,
            wd: 0.01,
            nesterov: true,
        },
        run_libtorch(tch::nn::Sgd {
            momentum: 0.9,
            dampening: 0.0,
            wd: 0.01,
            nesterov: true,
        }),
    );
}

#[test]
fn sgd_momentum_dampening_and_plain() {
    let opt = Sgd::new().momentum(0.8).dampening(0.3);
    check(
        "SGD momentum 0.8 dampening 0.3",
        &opt,
        Reference::Sgd {
            momentum: 0.8,
            dampening: 0.3,
            wd: 0.0,
            nesterov: false,
        },
        run_libtorch(tch::nn::Sgd {
            momentum: 0.8,
            dampening: 0.3,
            wd: 0.0,
            nesterov: false,
        }),
    );
    check(
        "SGD plain",
        &Sgd::new(),
        Reference::Sgd {
            momentum: 0.0,
            dampening: 0.0,
            wd: 0.0,
            nesterov: false,
        },
        run_libtorch(tch::nn::Sgd::default()),
    );
}

#[test]
fn adam_with_l2_weight_decay() {
    let opt = Adam::new().weight_decay(0.01);
    check(
        "Adam wd 0.01",
        &opt,
        Reference::Adam {
            b1: 0.9,
            b2: 0.999,
            eps: 1e-8,
            wd: 0.01,
            amsgrad: false,
            decoupled: false,
        },
        run_libtorch(tch::nn::Adam::default().wd(0.01)),
    );
}

#[test]
fn adam_amsgrad() {
    let opt = Adam::new().betas(0.8, 0.95).amsgrad(true);
    check(
        "Adam amsgrad betas (0.8, 0.95)",
        &opt,
        Reference::Adam {
            b1: 0.8,
            b2: 0.95,
            eps: 1e-8,
            wd: 0.0,
            amsgrad: true,
            decoupled: false,
        },
        run_libtorch(
            tch::nn::Adam::default()
                .beta1(0.8)
                .beta2(0.95)
                .amsgrad(true),
        ),
    );
}

#[test]
fn adamw() {
    let opt = AdamW::new().weight_decay(0.05);
    check(
        "AdamW wd 0.05",
        &opt,
        Reference::Adam {
            b1: 0.9,
            b2: 0.999,
            eps: 1e-8,
            wd: 0.05,
            amsgrad: false,
            decoupled: true,
        },
        run_libtorch(tch::nn::AdamW::default().wd(0.05)),
    );
}

#[test]
fn optimizer_graph_layout() {
    let types = vec![
        TensorType::new(DType::F32, [3, 2]),
        TensorType::new(DType::F32, [4]),
    ];
    let g = optimizer_graph(&Adam::new().amsgrad(true), &types).unwrap();
    // params ++ grads ++ 3 states per param ++ [lr, step]
    assert_eq!(g.inputs().len(), 2 + 2 + 6 + 2);
    assert_eq!(g.outputs().len(), 2 + 6);
    let kinds: Vec<&InputKind> = g.inputs().iter().map(|i| &i.kind).collect();
    assert_eq!(kinds[0], &InputKind::Parameter);
    assert_eq!(kinds[4], &InputKind::OptimizerState);
    assert_eq!(kinds[10], &InputKind::Scalar);
    assert_eq!(g.inputs()[5].name, "param0.exp_avg_sq");
    assert_eq!(g.inputs()[7].name, "param1.exp_avg");
    assert_eq!(g.inputs()[11].name, "step");
    let want: Vec<(usize, usize)> = vec![
        (0, 0),
        (1, 1),
        (4, 2),
        (5, 3),
        (6, 4),
        (7, 5),
        (8, 6),
        (9, 7),
    ];
    assert_eq!(g.aliases(), want.as_slice());
    // Plain SGD has no state; bad hyper-parameters are errors, not panics.
    assert!(Sgd::new().state_shapes(&types[0]).is_empty());
    let e = optimizer_graph(&Sgd::new().nesterov(true), &types).unwrap_err();
    assert!(e.to_string().contains("Nesterov"), "{e}");
    let e = optimizer_graph(&Adam::new().betas(1.5, 0.9), &types).unwrap_err();
    assert!(e.to_string().contains("beta"), "{e}");
    let e = optimizer_graph(&Sgd::new(), &[TensorType::new(DType::I64, [2])]).unwrap_err();
    assert!(e.to_string().contains("non-float"), "{e}");
    // A learning-rate change is a new input value, not a new graph.
    let a = optimizer_graph(&AdamW::new(), &types).unwrap();
    let b = optimizer_graph(&AdamW::new(), &types).unwrap();
    assert_eq!(a.fingerprint(), b.fingerprint());
}
