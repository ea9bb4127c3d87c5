//! Data-parallel training over several PJRT CPU devices (`XlaBackend::replicated`): the
//! replicas' gradients are averaged with `stablehlo.all_reduce`, so N replicas on batches of
//! B rows train exactly like one device on the N·B-row batch (for a loss that is a mean over
//! the batch); parameters and optimizer state stay resident and donated on every device.
//!
//! Tolerances: the same well-conditioned MLP as `tests/train.rs` (`common::Net`); the only difference between
//! the runs is the summation order of the batch mean (per replica, then across replicas), a
//! few float32 ulps, so 1e-5 relative leaves two orders of magnitude.

mod common;

use common::{batch, donated_per_step, mse, rel_err_l2, sgd_step, store_values, Net, Values};

use kiln::autograd::SavePolicy;
use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::XlaBackend;
use kiln::backend::{Backend, HostTensor};
use kiln::ir::{Graph, InputKind, Op, ReduceKind, TensorType};
use kiln::nn::{Init, Linear, Module, ParamStore};
use kiln::optim::{AdamW, Optimizer, Sgd};
use kiln::train::{TrainMode, TrainStep};
use kiln::{DType, Tensor, TraceMode};

/// A client with 4 CPU devices whatever the machine's CPU count (`XlaBackend::new` makes
/// one per CPU, at most 4; these tests run up to 4 replicas).
fn four_devices() -> kiln::Result<XlaBackend> {
    use kiln::backend::xla::{default_plugin_path, pjrt::NamedValue};
    XlaBackend::from_plugin_with(
        default_plugin_path()?,
        &[("cpu_device_count".to_string(), NamedValue::Int(4))],
    )
}

/// Trains from the same initial parameters on one device (batch of `rows`) and on `replicas`
/// devices (the same batch, `rows / replicas` per replica); returns the largest relative
/// error of the losses and of every variable (parameters and the running buffer) over
/// `steps` steps.
fn compare<B, O>(backend: B, opt: O, mode: TrainMode, rows: usize, steps: u64) -> kiln::Result<f64>
where
    B: Backend,
    O: Optimizer + Copy + 'static,
{
    compare_with(
        backend,
        opt,
        mode,
        rows,
        steps,
        (TraceMode::Once, SavePolicy::SaveAll),
    )
}

/// [`compare`], with both steps' trace mode and save policy set.
fn compare_with<B, O>(
    backend: B,
    opt: O,
    mode: TrainMode,
    rows: usize,
    steps: u64,
    (trace, policy): (TraceMode, SavePolicy),
) -> kiln::Result<f64>
where
    B: Backend,
    O: Optimizer + Copy + 'static,
{
    let one_store = ParamStore::with_seed(7);
    let one_net = Net::new(&one_store, 0.0)?;
    let mut one = TrainStep::new(four_devices()?, &one_store, opt, move |xs| {
        mse(&one_net, xs)
    })?
    .with_mode(mode)
    .with_trace_mode(trace)
    .with_save_policy(policy)
    .with_lr(0.05);
    let dp_store = ParamStore::with_seed(7);
    let dp_net = Net::new(&dp_store, 0.0)?;
    let mut dp = TrainStep::new(backend, &dp_store, opt, move |xs| mse(&dp_net, xs))?
        .with_mode(mode)
        .with_trace_mode(trace)
        .with_save_policy(policy)
        .with_lr(0.05);
    let mut worst: f64 = 0.0;
    for s in 0..steps {
        let b = batch(rows, s)?;
        let (l1, ln) = (one.step(&b)?, dp.step(&b)?);
        worst = worst.max(((l1 - ln) / l1).abs());
        one.sync_to_store()?;
        dp.sync_to_store()?;
        for ((name, a), (_, b)) in store_values(&dp_store)
            .iter()
            .zip(store_values(&one_store).iter())
        {
            let e = rel_err_l2(a, b);
            assert!(e < 1e-5, "{mode:?} step {s}: {name} rel err {e:e}");
            worst = worst.max(e);
        }
    }
    Ok(worst)
}

#[test]
fn n_replicas_train_like_one_device_on_the_whole_batch() -> kiln::Result<()> {
    let xla = four_devices()?;
    for replicas in [2, 4] {
        for mode in [TrainMode::Split, TrainMode::Fused] {
            let sgd = compare(
                xla.replicated(replicas)?,
                Sgd::new().momentum(0.9),
                mode,
                8,
                3,
            )?;
            let adam = compare(xla.replicated(replicas)?, AdamW::default(), mode, 8, 3)?;
            println!("{replicas} replicas {mode:?}: sgd {sgd:e} adamw {adam:e}");
            assert!(sgd < 1e-5 && adam < 1e-5);
        }
    }
    Ok(())
}

/// Per-replica gradients, each from a one-device SGD step (lr 1, no momentum) on the
/// replica's shard: `g_r = p0 - p1_r`. The data-parallel step's update is their mean.
#[test]
fn all_reduced_gradients_are_the_mean_of_the_replicas_gradients() -> kiln::Result<()> {
    let replicas = 2;
    let (rows, shard) = (8, 4);
    let b = batch(rows, 42)?;
    // A sum over the batch: the full batch's gradient would be the replicas' sum, so the mean
    // is what the all-reduce alone makes of it.
    let loss = |net: &Net, xs: &[Tensor]| -> kiln::Result<Tensor> {
        net.forward_t(&xs[0], true)?
            .sub(&xs[1])?
            .square()?
            .sum_all()
    };
    let p0 = store_values(&{
        let s = ParamStore::with_seed(11);
        Net::new(&s, 0.0)?;
        s
    });
    let mut per_replica: Vec<Values> = Vec::new();
    for r in 0..replicas {
        let store = ParamStore::with_seed(11);
        let net = Net::new(&store, 0.0)?;
        let mut step = TrainStep::new(four_devices()?, &store, Sgd::new(), move |xs| {
            loss(&net, xs)
        })?
        .with_lr(1.0);
        let shard_batch: Vec<Tensor> = b
            .iter()
            .map(|t| t.narrow(0, r * shard, shard))
            .collect::<kiln::Result<_>>()?;
        step.step(&shard_batch)?;
        step.sync_to_store()?;
        per_replica.push(store_values(&store));
    }
    for mode in [TrainMode::Split, TrainMode::Fused] {
        let store = ParamStore::with_seed(11);
        let net = Net::new(&store, 0.0)?;
        let mut step = TrainStep::new(
            four_devices()?.replicated(replicas)?,
            &store,
            Sgd::new(),
            move |xs| loss(&net, xs),
        )?
        .with_mode(mode)
        .with_lr(1.0);
        step.step(&b)?;
        step.sync_to_store()?;
        let got = store_values(&store);
        for (k, (name, p0)) in p0.iter().enumerate() {
            if name.ends_with("running") {
                continue;
            }
            let mean_grad: Vec<f64> = (0..p0.len())
                .map(|i| {
                    per_replica.iter().map(|v| p0[i] - v[k].1[i]).sum::<f64>() / replicas as f64
                })
                .collect();
            let dp_grad: Vec<f64> = p0.iter().zip(&got[k].1).map(|(a, b)| a - b).collect();
            let e = rel_err_l2(&dp_grad, &mean_grad);
            assert!(e < 1e-5, "{mode:?}: {name}: rel err {e:e}");
        }
    }
    Ok(())
}

#[test]
fn a_batch_the_replicas_cannot_split_is_an_error() -> kiln::Result<()> {
    let xla = four_devices()?;
    let store = ParamStore::with_seed(0);
    let net = Net::new(&store, 0.0)?;
    let mut step = TrainStep::new(xla.replicated(4)?, &store, Sgd::new(), move |xs| {
        mse(&net, xs)
    })?;
    let err = step.step(&batch(6, 0)?).unwrap_err().to_string();
    assert!(
        err.contains("batch size 6") && err.contains("4 replicas"),
        "{err}"
    );
    // No device count of zero, nor more than the client has.
    assert!(xla.replicated(0).is_err());
    let too_many = xla.client().addressable_device_count() + 1;
    let err = xla.replicated(too_many).err().unwrap().to_string();
    assert!(err.contains("addressable device"), "{err}");
    Ok(())
}

#[test]
fn only_the_batch_shards_move_and_state_is_donated_on_every_device() -> kiln::Result<()> {
    let replicas = 2;
    for mode in [TrainMode::Split, TrainMode::Fused] {
        let store = ParamStore::with_seed(1);
        let net = Net::new(&store, 0.0)?;
        let n_params = store.trainable().len() as u64;
        let backend = four_devices()?.replicated(replicas)?;
        let mut step = sgd_step(backend, &store, net, mode, 0.01)?;
        let b = batch(8, 0)?;
        let batch_bytes: usize = b.iter().map(|t| t.ty().size_in_bytes()).sum();
        step.step(&b)?;
        step.step(&b)?;
        let resident = step.runtime().num_resident();
        let before = step.stats();
        for _ in 0..10 {
            step.step(&b)?;
        }
        let d = step.stats().since(&before);
        let per_step = if mode == TrainMode::Split { 3 } else { 1 };
        // One launch runs every replica.
        assert_eq!(d.executions, 10 * per_step, "{mode:?}");
        // In: one shard of each input per device, nothing else; out: the (averaged) loss.
        assert_eq!(d.h2d_transfers, 10 * 2 * replicas as u64, "{mode:?}: {d}");
        assert_eq!(d.h2d_bytes as usize, 10 * batch_bytes, "{mode:?}: {d}");
        assert_eq!(
            (d.d2h_transfers, d.d2h_bytes),
            (10, 10 * 4),
            "{mode:?}: {d}"
        );
        assert_eq!((d.traces, d.compiles), (0, 0));
        assert_eq!(step.runtime().num_resident(), resident);
        // Donated per step on every device (a buffer donated on some replicas only is an
        // error).
        assert_eq!(
            d.donated,
            10 * donated_per_step(mode, n_params),
            "{mode:?}: {d}"
        );
    }
    Ok(())
}

#[test]
fn inference_shards_the_batch_and_joins_the_results() -> kiln::Result<()> {
    let xla = four_devices()?;
    let store = ParamStore::with_seed(5);
    let net = kiln::nn::Shared::new(Net::new(&store, 0.0)?);
    let x = Tensor::randn(&[8, 6], 9)?;
    let one_net = net.clone();
    let mut one = kiln::compile(xla.clone(), move |xs: &[Tensor]| {
        Ok(vec![one_net.forward_t(&xs[0], false)?])
    });
    let want = one.run(std::slice::from_ref(&x))?[0].to_f64_vec()?;
    for replicas in [2, 4] {
        let dp_net = net.clone();
        let mut f = kiln::compile(xla.replicated(replicas)?, move |xs: &[Tensor]| {
            Ok(vec![dp_net.forward_t(&xs[0], false)?])
        });
        let y = f.run(std::slice::from_ref(&x))?;
        assert_eq!(y[0].ty().shape.dims(), &[8, 3]);
        // Row order too: replica r computes rows r·B/N.. of the batch.
        let e = rel_err_l2(&y[0].to_f64_vec()?, &want);
        assert!(e < 1e-6, "{replicas} replicas: rel err {e:e}");
        // Steady state: the shards go in, the replicas' results come out; the weights stay.
        let before = f.stats();
        f.run(std::slice::from_ref(&x))?;
        let d = f.stats().since(&before);
        assert_eq!(d.h2d_transfers, replicas as u64, "{d}");
        assert_eq!(d.d2h_transfers, replicas as u64, "{d}");
        assert_eq!(d.h2d_bytes as usize, x.ty().size_in_bytes(), "{d}");
    }
    // A scalar result cannot be joined along a batch dimension.
    let mut f = kiln::compile(xla.replicated(2)?, move |xs: &[Tensor]| {
        Ok(vec![xs[0].sum_all()?])
    });
    let err = f.run(&[x]).unwrap_err().to_string();
    assert!(err.contains("scalar"), "{err}");
    Ok(())
}

/// What an all-reduce of `kind` over `shards` gives every replica, elementwise (in f64).
fn combined(kind: ReduceKind, shards: &[HostTensor]) -> Vec<f64> {
    let cols: Vec<Vec<f64>> = shards.iter().map(|s| s.to_f64_vec()).collect();
    (0..cols[0].len())
        .map(|i| {
            let v = cols.iter().map(|c| c[i]);
            match kind {
                ReduceKind::Sum => v.sum(),
                ReduceKind::Max => v.fold(f64::MIN, f64::max),
                ReduceKind::Min => v.fold(f64::MAX, f64::min),
            }
        })
        .collect()
}

/// Two threads run different replicated programs at once, each on its own client (an f32
/// sum and an f64 max, both over 2 replicas): every call gets its own replicas' combination.
/// XLA's CPU client names an execution's collectives by its launch id; when every call used
/// the default id 0, concurrent calls met in one rendezvous and this crashed (SIGSEGV) or
/// mixed their values.
#[test]
fn concurrent_replicated_calls_keep_their_collectives_apart() -> kiln::Result<()> {
    let worker = |dtype: DType, kind: ReduceKind, replicas: usize, len: usize| {
        std::thread::spawn(move || -> kiln::Result<()> {
            let b = four_devices()?.replicated(replicas)?;
            let ty = TensorType::new(dtype, [len]);
            let mut g = Graph::new();
            let x = g.add_input(InputKind::Data, "x", ty);
            let y = g.add(Op::AllReduce(kind), &[x])?;
            g.set_outputs(vec![y])?;
            let exe = b.compile(&g)?;
            for call in 0..400 {
                let shards: Vec<HostTensor> = (0..replicas)
                    .map(|r| {
                        let mut k = 0.0;
                        common::floats(&[len], dtype, || {
                            k += 1.0;
                            (call * 7 + r * 3) as f64 + k
                        })
                    })
                    .collect();
                let input = b.to_device_shards(&shards)?;
                let out = b.execute(&exe, &[&input])?;
                let got = b.to_host_shards(&out[0])?;
                let want = combined(kind, &shards);
                for (r, h) in got.iter().enumerate() {
                    assert_eq!(h.to_f64_vec(), want, "{dtype} call {call} replica {r}");
                }
            }
            Ok(())
        })
    };
    let a = worker(DType::F32, ReduceKind::Sum, 2, 64);
    let b = worker(DType::F64, ReduceKind::Max, 2, 1000);
    a.join().expect("f32 worker")?;
    b.join().expect("f64 worker")?;
    Ok(())
}

/// `Op::AllReduce` against the combination computed on the host: on N replicas each replica
/// gets the sum (max, min) of all replicas' values; on one replica (eager, single device) it
/// is the identity. The values are small integers, so every combination is exact.
#[test]
fn all_reduce_combines_every_replica_and_is_the_identity_on_one() -> kiln::Result<()> {
    let xla = four_devices()?;
    for dtype in [DType::F32, DType::F64, DType::I32] {
        for kind in [ReduceKind::Sum, ReduceKind::Max, ReduceKind::Min] {
            let ty = TensorType::new(dtype, [3, 5]);
            let mut g = Graph::new();
            let x = g.add_input(InputKind::Data, "x", ty.clone());
            let y = g.add(Op::AllReduce(kind), &[x])?;
            g.set_outputs(vec![y])?;
            let mut rng = common::SplitMix64::mixed(7);
            // Integral values: every combination is exact, in any order.
            let shards: Vec<HostTensor> = (0..4)
                .map(|_| {
                    let v: Vec<f64> = (0..15).map(|_| (rng.normal() * 8.0).round()).collect();
                    match dtype {
                        DType::I32 => {
                            common::host(&[3, 5], &v.iter().map(|&x| x as i32).collect::<Vec<_>>())
                        }
                        _ => common::floats(&[3, 5], dtype, {
                            let mut it = v.into_iter();
                            move || it.next().unwrap()
                        }),
                    }
                })
                .collect();
            // One replica: the identity, on the eager interpreter and on one device.
            for out in [
                common::run(&EagerBackend::new(), &g, &shards[..1]),
                common::run(&xla, &g, &shards[..1]),
            ] {
                assert_eq!(out[0].to_f64_vec(), shards[0].to_f64_vec());
            }
            for replicas in [2, 4] {
                let b = xla.replicated(replicas)?;
                let exe = b.compile(&g)?;
                let input = b.to_device_shards(&shards[..replicas])?;
                let out = b.execute(&exe, &[&input])?;
                let got = b.to_host_shards(&out[0])?;
                let want = combined(kind, &shards[..replicas]);
                for (r, h) in got.iter().enumerate() {
                    assert_eq!(
                        h.to_f64_vec(),
                        want,
                        "{dtype} {kind:?} replica {r} of {replicas}"
                    );
                }
            }
        }
    }
    // Bool has no cross-replica combination.
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::Bool, [2]));
    let err = g
        .add(Op::AllReduce(ReduceKind::Sum), &[x])
        .unwrap_err()
        .to_string();
    assert!(err.contains("all_reduce") && err.contains("bool"), "{err}");
    Ok(())
}

/// Client create options reach the plugin: the CPU plugin's `cpu_device_count` sets how many
/// devices (hence replicas) a client has; 8 replicas train like one device too.
#[test]
fn client_options_set_the_device_count() -> kiln::Result<()> {
    use kiln::backend::xla::{default_plugin_path, pjrt::NamedValue};
    let count = |n: i64| -> kiln::Result<XlaBackend> {
        XlaBackend::from_plugin_with(
            default_plugin_path()?,
            &[("cpu_device_count".to_string(), NamedValue::Int(n))],
        )
    };
    let two = count(2)?;
    assert_eq!(two.client().addressable_device_count(), 2);
    assert!(two.replicated(2).is_ok() && two.replicated(4).is_err());
    let eight = count(8)?;
    assert_eq!(eight.client().addressable_device_count(), 8);
    let e = compare(
        eight.replicated(8)?,
        Sgd::new().momentum(0.9),
        TrainMode::Fused,
        16,
        2,
    )?;
    assert!(e < 1e-5, "8 replicas: rel err {e:e}");
    Ok(())
}

/// The device assignment in the compile options is PJRT's: with replicas mapped to devices
/// `[1, 0]`, replica 0's arguments must live on device 1, and arguments on the wrong device are
/// an error, not a silent reorder. The bytes are CompileOptionsProto's encoding.
#[test]
fn compile_options_carry_replicas_and_device_assignment() -> kiln::Result<()> {
    use kiln::backend::xla::pjrt::{compile_options_bytes_for, ElementType};
    assert_eq!(
        compile_options_bytes_for(2, Some(&[0, 1]), &[]),
        [
            0x1a, 0x10, 0x20, 0x02, 0x28, 0x01, 0x4a, 0x0a, 0x08, 0x02, 0x10, 0x01, 0x1a, 0x04,
            0x08, 0x00, 0x08, 0x01
        ]
    );
    assert_eq!(
        compile_options_bytes_for(2, None, &[]),
        [0x1a, 0x04, 0x20, 0x02, 0x28, 0x01]
    );
    let xla = four_devices()?;
    let client = xla.client();
    assert_eq!(
        client.addressable_device_ids()?,
        Some((0..client.addressable_device_count() as i64).collect())
    );
    let mlir = "module @m attributes {mhlo.num_replicas = 2 : i32, mhlo.num_partitions = 1 : i32} {
      func.func public @main(%a: tensor<2xf32>) -> tensor<2xf32> {
        %0 = \"stablehlo.all_reduce\"(%a) ({
        ^bb0(%x: tensor<f32>, %y: tensor<f32>):
          %s = stablehlo.add %x, %y : tensor<f32>
          stablehlo.return %s : tensor<f32>
        }) {replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>} : (tensor<2xf32>) -> tensor<2xf32>
        return %0 : tensor<2xf32>
      }
    }";
    let exe = client.compile(mlir, &compile_options_bytes_for(2, Some(&[1, 0]), &[]))?;
    let bytes = |v: [f32; 2]| -> Vec<u8> { v.iter().flat_map(|x| x.to_ne_bytes()).collect() };
    let on = |v: [f32; 2], device: usize| {
        client.buffer_from_host(&bytes(v), ElementType::F32, &[2], device)
    };
    // Replica 0 on device 1, replica 1 on device 0.
    let (a, b) = (on([1.0, 2.0], 1)?, on([10.0, 20.0], 0)?);
    let outs = exe.execute_replicated(&[&[&a], &[&b]])?;
    for replica in &outs {
        let mut y = [0u8; 8];
        replica[0].to_host(&mut y)?;
        assert_eq!(y, bytes([11.0, 22.0]).as_slice());
    }
    let (a, b) = (on([1.0, 2.0], 0)?, on([10.0, 20.0], 1)?);
    assert!(exe.execute_replicated(&[&[&a], &[&b]]).is_err());
    Ok(())
}

/// A data-parallel step checkpoints and resumes like a single-device one, and its replicated
/// executables load from the on-disk cache (a second step over a fresh cache directory handle
/// compiles nothing).
#[test]
fn checkpoints_and_the_disk_cache_work_on_replicas() -> kiln::Result<()> {
    use kiln::runtime::ExecutableCache;
    let dir = std::env::temp_dir().join(format!("kiln-dp-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| kiln::Error::Invalid(e.to_string()))?;
    let xla = four_devices()?;
    let make = |seed: u64| -> kiln::Result<(TrainStep<_>, ParamStore)> {
        let store = ParamStore::with_seed(seed);
        let net = Net::new(&store, 0.0)?;
        let step = TrainStep::new(xla.replicated(2)?, &store, AdamW::default(), move |xs| {
            mse(&net, xs)
        })?
        .with_cache(ExecutableCache::with_dir(dir.join("cache"))?)
        .with_mode(TrainMode::Fused)
        .with_lr(0.01);
        Ok((step, store))
    };
    let (mut a, a_store) = make(3)?;
    for s in 0..3 {
        a.step(&batch(8, s)?)?;
    }
    let ckpt = dir.join("dp.safetensors");
    a.save_checkpoint(&ckpt)?;
    // Another initialization, then the checkpoint: continues exactly where `a` is.
    let (mut b, b_store) = make(4)?;
    b.load_checkpoint(&ckpt)?;
    for s in 3..5 {
        let (la, lb) = (a.step(&batch(8, s)?)?, b.step(&batch(8, s)?)?);
        assert_eq!(la, lb, "step {s}");
    }
    a.sync_to_store()?;
    b.sync_to_store()?;
    assert_eq!(store_values(&a_store), store_values(&b_store));
    assert_eq!(b.stats().compiles, 0, "{}", b.stats());
    assert!(b.stats().disk_hits > 0, "{}", b.stats());
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A gradient that does not depend on the data (here the bias's: a constant of the graph) is
/// the same on every replica, and its all-reduced mean is that constant, not N times it.
#[test]
fn a_constant_gradient_is_averaged_to_itself() -> kiln::Result<()> {
    let run = |replicas: usize| -> kiln::Result<Values> {
        let store = ParamStore::with_seed(2);
        let w = store
            .root()
            .param("w", &[6, 3], Init::Uniform { lo: -1.0, hi: 1.0 })?;
        let b = store.root().param("b", &[3], Init::Const(0.5))?;
        let loss = move |xs: &[Tensor]| xs[0].matmul(&w)?.mean_all()?.add(&b.sum_all()?);
        let xla = four_devices()?;
        let mut step = TrainStep::new(xla.replicated(replicas)?, &store, Sgd::new(), loss)?
            .with_mode(TrainMode::Fused)
            .with_lr(0.1);
        step.step(&batch(8, 1)?[..1])?;
        step.sync_to_store()?;
        Ok(store_values(&store))
    };
    let one = run(1)?;
    let b = &one.iter().find(|(n, _)| n == "b").unwrap().1;
    // 0.5 - 0.1 * 1 per element, in float32.
    assert!(b.iter().all(|&v| (v - 0.4).abs() < 1e-7), "{b:?}");
    for replicas in [2, 4] {
        for ((name, a), (_, b)) in run(replicas)?.iter().zip(&one) {
            let e = rel_err_l2(a, b);
            assert!(e < 1e-6, "{replicas} replicas: {name}: rel err {e:e}");
        }
    }
    Ok(())
}

/// libtorch kernels inside the executable (`FfiMode::All`: every convolution and dot is a
/// custom call) run on every replica's device thread: a small CNN's data-parallel step still
/// equals one device's on the whole batch.
#[test]
fn replicas_run_the_libtorch_kernels_too() -> kiln::Result<()> {
    use kiln::backend::xla::{FfiMode, XlaOptions};
    use kiln::nn::{Conv2d, Conv2dConfig, Flatten, Relu, Sequential, Shared};
    let xla = four_devices()?.with_options(XlaOptions::default().ffi(FfiMode::All));
    if let Err(why) = xla.ffi_status() {
        eprintln!("skipped: the plugin does not run kiln's kernels: {why}");
        return Ok(());
    }
    let run = |backend_replicas: usize| -> kiln::Result<(f64, Values)> {
        let store = ParamStore::with_seed(8);
        let r = store.root();
        let net = Shared::new(
            Sequential::new()
                .add(Conv2d::new(
                    &r.sub("conv"),
                    2,
                    4,
                    3,
                    Conv2dConfig::default(),
                )?)
                .add(Relu)
                .add(Flatten::default())
                .add(Linear::new(&r.sub("fc"), 4 * 4 * 4, 3, true)?),
        );
        let mut step = TrainStep::new(
            xla.replicated(backend_replicas)?,
            &store,
            Sgd::new().momentum(0.9),
            move |xs: &[Tensor]| {
                net.forward_t(&xs[0], true)?
                    .sub(&xs[1])?
                    .square()?
                    .mean_all()
            },
        )?
        .with_mode(TrainMode::Fused)
        .with_lr(0.05);
        let x = Tensor::randn(&[8, 2, 6, 6], 3)?;
        let y = Tensor::randn(&[8, 3], 4)?;
        let loss = step.step(&[x, y])?;
        step.sync_to_store()?;
        Ok((loss, store_values(&store)))
    };
    let (l1, p1) = run(1)?;
    for replicas in [2, 4] {
        let (ln, pn) = run(replicas)?;
        assert!(
            ((ln - l1) / l1).abs() < 1e-5,
            "{replicas}: loss {ln} vs {l1}"
        );
        for ((name, a), (_, b)) in pn.iter().zip(&p1) {
            let e = rel_err_l2(a, b);
            assert!(e < 1e-5, "{replicas} replicas: {name}: rel err {e:e}");
        }
    }
    Ok(())
}

/// Trace every step and recompute elementwise values in the backward graph: the split step's
/// other configurations are data-parallel too.
#[test]
fn trace_every_step_and_recompute_policy_on_replicas() -> kiln::Result<()> {
    let xla = four_devices()?;
    let e = compare_with(
        xla.replicated(2)?,
        Sgd::new().momentum(0.9),
        TrainMode::Split,
        8,
        3,
        (TraceMode::EveryCall, SavePolicy::RecomputeElementwise),
    )?;
    assert!(e < 1e-5, "rel err {e:e}");
    Ok(())
}
