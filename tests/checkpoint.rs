//! Training checkpoints: resuming in a fresh process is bit-identical to training on, a process
//! killed while saving leaves the previous checkpoint intact, and bad files are errors naming
//! the file and the key.
//!
//! The fresh processes are this test binary itself, run with `--ignored --exact child` and the
//! environment variable `KILN_CKPT_CHILD` saying what to do.

use kiln::backend::xla::XlaBackend;
use kiln::nn::{BatchNorm2d, Conv2d, Conv2dConfig, Dropout, Linear, Module, ParamStore};
use kiln::optim::{Adam, Sgd};
use kiln::train::{TrainMode, TrainStep};
use kiln::{Error, Tensor};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "KILN_CKPT_CHILD";

/// Conv -> BatchNorm (running statistics) -> ReLU -> Dropout -> Linear.
struct Net {
    conv: Conv2d,
    bn: BatchNorm2d,
    drop: Dropout,
    fc: Linear,
}

impl Net {
    fn new(store: &ParamStore, classes: usize) -> kiln::Result<Net> {
        let r = store.root();
        let cfg = Conv2dConfig {
            padding: [1, 1],
            ..Default::default()
        };
        Ok(Net {
            conv: Conv2d::new(&r.sub("conv"), 2, 4, 3, cfg)?,
            bn: BatchNorm2d::new(&r.sub("bn"), 4)?,
            drop: Dropout::new(0.3),
            fc: Linear::new(&r.sub("fc"), 4 * 6 * 6, classes, true)?,
        })
    }
}

impl Module for Net {
    fn forward_t(&self, x: &Tensor, train: bool) -> kiln::Result<Tensor> {
        let h = self.bn.forward_t(&self.conv.forward(x)?, train)?.relu()?;
        let h = self.drop.forward_t(&h.flatten(1, -1)?, train)?;
        self.fc.forward(&h)
    }
}

fn batch(i: u64) -> Vec<Tensor> {
    vec![
        Tensor::randn(&[4, 2, 6, 6], 1000 + i).unwrap(),
        Tensor::randn(&[4, 3], 2000 + i).unwrap(),
    ]
}

/// A training step of `Net` in `mode` with SGD+momentum (`"sgd"`) or Adam (`"adam"`).
fn make_step(
    mode: TrainMode,
    opt: &str,
    store_seed: u64,
    key_seed: u32,
    lr: f64,
    classes: usize,
) -> TrainStep<XlaBackend> {
    let store = ParamStore::with_seed(store_seed);
    let net = Net::new(&store, classes).unwrap();
    let loss = move |xs: &[Tensor]| -> kiln::Result<Tensor> {
        net.forward_t(&xs[0], true)?
            .sub(&xs[1])?
            .square()?
            .mean_all()
    };
    let be = XlaBackend::new().unwrap();
    let step = match opt {
        "sgd" => TrainStep::new(be, &store, Sgd::new().momentum(0.9), loss),
        "adam" => TrainStep::new(be, &store, Adam::new(), loss),
        other => panic!("unknown optimizer {other}"),
    };
    step.unwrap()
        .with_mode(mode)
        .with_lr(lr)
        .with_seed(key_seed)
        .unwrap()
}

fn mode_name(m: TrainMode) -> &'static str {
    match m {
        TrainMode::Split => "split",
        TrainMode::Fused => "fused",
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs this test binary's `child` test with `KILN_CKPT_CHILD=spec`.
fn child_command(spec: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        "--ignored",
        "--exact",
        "child",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ENV, spec);
    c
}

/// Every tensor of a safetensors file (name -> dtype, shape, bytes) and its metadata.
type Tensors = BTreeMap<String, (String, Vec<usize>, Vec<u8>)>;

fn read_tensors(path: &Path) -> (Tensors, Option<std::collections::HashMap<String, String>>) {
    let bytes = std::fs::read(path).unwrap();
    let f = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = f
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                (
                    format!("{:?}", v.dtype()),
                    v.shape().to_vec(),
                    v.data().to_vec(),
                ),
            )
        })
        .collect();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    (t, meta.metadata().clone())
}

/// The fresh process's side: what `KILN_CKPT_CHILD` asks for.
#[test]
#[ignore = "run by the other tests in a child process"]
fn child() {
    // Run directly (`--ignored`), it has nothing to do.
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        eprintln!("{CHILD_ENV} unset: this is the child side of the other tests");
        return;
    };
    let parts: Vec<&str> = spec.split(';').collect();
    match parts[0] {
        // resume;<mode>;<opt>;<checkpoint>;<out checkpoint>;<out losses>
        "resume" => {
            let mode = if parts[1] == "split" {
                TrainMode::Split
            } else {
                TrainMode::Fused
            };
            // Another initialisation, key and learning rate: all must come from the file.
            let mut step = make_step(mode, parts[2], 99, 12345, 1.0, 3);
            step.load_checkpoint(parts[3]).unwrap();
            assert_eq!(step.steps(), 5);
            assert_eq!(step.lr(), 0.05);
            let mut losses = String::new();
            for i in 5..10 {
                let l = step.step(&batch(i)).unwrap();
                losses.push_str(&format!("{}\n", l.to_bits()));
            }
            step.save_checkpoint(parts[4]).unwrap();
            std::fs::write(parts[5], losses).unwrap();
        }
        // save-loop;<checkpoint>: train and save forever (until killed).
        "save-loop" => {
            let mut step = big_step();
            let x = vec![
                Tensor::randn(&[8, BIG], 1).unwrap(),
                Tensor::randn(&[8, BIG], 2).unwrap(),
            ];
            loop {
                step.step(&x).unwrap();
                step.save_checkpoint(parts[1]).unwrap();
                println!("saved {}", step.steps());
            }
        }
        other => panic!("unknown child mode {other}"),
    }
}

fn resume_is_bit_identical(mode: TrainMode, opt: &str) {
    let dir = scratch(&format!("resume-{}-{opt}", mode_name(mode)));
    let ckpt = dir.join("ckpt.safetensors");
    let mut step = make_step(mode, opt, 1, 7, 0.05, 3);
    for i in 0..5 {
        step.step(&batch(i)).unwrap();
    }
    step.save_checkpoint(&ckpt).unwrap();
    let mut losses = Vec::new();
    for i in 5..10 {
        losses.push(step.step(&batch(i)).unwrap().to_bits());
    }
    let ours = dir.join("ours.safetensors");
    let t = Instant::now();
    step.save_checkpoint(&ours).unwrap();
    eprintln!(
        "{} {opt} checkpoint: {} bytes, saved in {:.2} ms",
        mode_name(mode),
        std::fs::metadata(&ours).unwrap().len(),
        t.elapsed().as_secs_f64() * 1e3
    );

    let theirs = dir.join("theirs.safetensors");
    let their_losses = dir.join("losses.txt");
    let spec = format!(
        "resume;{};{opt};{};{};{}",
        mode_name(mode),
        ckpt.display(),
        theirs.display(),
        their_losses.display()
    );
    let out = child_command(&spec).output().unwrap();
    assert!(
        out.status.success(),
        "child failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let theirs_l: Vec<u64> = std::fs::read_to_string(&their_losses)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(theirs_l, losses, "losses after resuming differ");

    // Every tensor (parameters, BatchNorm statistics, optimizer state, step, lr, key) equal to
    // the bit.
    let (a, meta_a) = read_tensors(&ours);
    let (b, meta_b) = read_tensors(&theirs);
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, ta) in &a {
        assert!(ta == &b[name], "{name} differs after resuming");
    }
    assert_eq!(meta_a, meta_b);
    let slots: &[&str] = if opt == "sgd" {
        &["momentum_buffer"]
    } else {
        &["exp_avg", "exp_avg_sq"]
    };
    for key in [
        "conv.weight",
        "conv.bias",
        "bn.weight",
        "bn.bias",
        "bn.running_mean",
        "bn.running_var",
        "fc.weight",
        "fc.bias",
        "train.step",
        "train.lr",
        "train.rng_key",
    ] {
        assert!(a.contains_key(key), "{key} missing from {:?}", a.keys());
    }
    for p in ["conv.weight", "bn.bias", "fc.weight"] {
        for s in slots {
            assert!(a.contains_key(&format!("optimizer.state.{p}.{s}")));
        }
    }
    // The dropout key advanced once per step from the seed [7, 0].
    let key = &a["train.rng_key"].2;
    assert_eq!(key[..4], 7u32.to_le_bytes());
    assert_eq!(key[4..], 10u32.to_le_bytes());
    let meta = meta_a.unwrap();
    assert_eq!(meta["format"], "kiln.checkpoint");
    assert!(meta["optimizer"].ends_with(if opt == "sgd" { "Sgd" } else { "Adam" }));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_in_a_fresh_process_is_bit_identical_split() {
    resume_is_bit_identical(TrainMode::Split, "sgd");
}

#[test]
fn resume_in_a_fresh_process_is_bit_identical_fused() {
    resume_is_bit_identical(TrainMode::Fused, "adam");
}

/// Features of the model saved in a loop by the crash test: 2048x2048 f32 weights plus their
/// momentum, a 32 MiB checkpoint that takes a while to write.
const BIG: usize = 2048;

fn big_step() -> TrainStep<XlaBackend> {
    let store = ParamStore::with_seed(3);
    let fc = Linear::new(&store.root().sub("fc"), BIG, BIG, true).unwrap();
    TrainStep::new(
        XlaBackend::new().unwrap(),
        &store,
        Sgd::new().momentum(0.9),
        move |xs: &[Tensor]| fc.forward(&xs[0])?.sub(&xs[1])?.square()?.mean_all(),
    )
    .unwrap()
    .with_lr(1e-3)
}

/// A child process killed and waited for when dropped (also when the test fails).
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_process_killed_while_saving_leaves_the_previous_checkpoint_intact() {
    let dir = scratch("killed");
    let ckpt = dir.join("ckpt.safetensors");
    let mut caught = 0;
    for attempt in 0..5 {
        let mut child = Reaped(
            child_command(&format!("save-loop;{}", ckpt.display()))
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let child = &mut child.0;
        let prefix = format!(".ckpt.safetensors.tmp-{}-", child.id());
        // Wait for two complete saves, then for the third one to be under way.
        let t0 = Instant::now();
        let mut saves = 0;
        let killed_mid_write = loop {
            assert!(
                t0.elapsed() < Duration::from_secs(300),
                "the child never saved"
            );
            let temps: Vec<_> = std::fs::read_dir(&dir)
                .unwrap()
                .filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                .map(|e| e.file_name())
                .collect();
            if !temps.is_empty() {
                saves += 1;
                if saves >= 3 {
                    child.kill().unwrap();
                    child.wait().unwrap();
                    // Still there: the kill landed between write and rename.
                    break dir.join(&temps[0]).exists();
                }
                // Wait for this save to finish.
                while dir.join(&temps[0]).exists() {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
            std::thread::sleep(Duration::from_micros(200));
        };
        let mut out = String::new();
        child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        let last_saved: u64 = out
            .lines()
            .filter_map(|l| l.strip_prefix("saved "))
            .map(|n| n.parse().unwrap())
            .max()
            .expect("the child reported no save");
        // The checkpoint is a complete one: it loads, with the step count of the last save.
        let mut step = big_step();
        step.load_checkpoint(&ckpt).unwrap();
        if killed_mid_write {
            assert_eq!(step.steps(), last_saved);
            caught += 1;
            eprintln!(
                "killed during save {} on attempt {}; the checkpoint ({} bytes) holds save {last_saved}",
                last_saved + 1,
                attempt + 1,
                std::fs::metadata(&ckpt).unwrap().len()
            );
            let t = Instant::now();
            step.save_checkpoint(dir.join("again.safetensors")).unwrap();
            let save = t.elapsed();
            let t = Instant::now();
            step.load_checkpoint(dir.join("again.safetensors")).unwrap();
            eprintln!(
                "2048x2048 linear + momentum: save {:.0} ms, load {:.0} ms",
                save.as_secs_f64() * 1e3,
                t.elapsed().as_secs_f64() * 1e3
            );
            // Training goes on from it.
            let x = vec![
                Tensor::randn(&[8, BIG], 1).unwrap(),
                Tensor::randn(&[8, BIG], 2).unwrap(),
            ];
            assert!(step.step(&x).unwrap().is_finite());
            break;
        }
        assert!(step.steps() >= last_saved);
    }
    assert!(caught > 0, "no kill landed during a save in 5 attempts");
    let _ = std::fs::remove_dir_all(&dir);
}

fn format_error(e: Error) -> (PathBuf, String) {
    match e {
        Error::Format { path, message } => (path, message),
        other => panic!("expected a format error, got {other:?}"),
    }
}

#[test]
fn bad_checkpoints_are_errors_naming_the_file_and_the_key() {
    let dir = scratch("bad");
    let good = dir.join("good.safetensors");
    let mut step = make_step(TrainMode::Fused, "sgd", 1, 7, 0.05, 3);
    for i in 0..2 {
        step.step(&batch(i)).unwrap();
    }
    step.save_checkpoint(&good).unwrap();
    let before = step.step(&batch(2)).unwrap();
    let bytes = std::fs::read(&good).unwrap();

    let check = |step: &mut TrainStep<XlaBackend>, file: &Path, key: &str| {
        let (path, msg) = format_error(step.load_checkpoint(file).unwrap_err());
        assert_eq!(path, file);
        assert!(msg.contains(key), "{msg:?} does not name {key}");
        let shown = Error::Format {
            path: path.clone(),
            message: msg,
        }
        .to_string();
        assert!(shown.contains(&file.display().to_string()));
    };

    // Truncated.
    let truncated = dir.join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    check(&mut step, &truncated, "not a valid safetensors file");
    // Not safetensors at all.
    let text = dir.join("text.safetensors");
    std::fs::write(&text, b"hello, this is not a checkpoint").unwrap();
    check(&mut step, &text, "not a valid safetensors file");
    // A model's weights only (ParamStore::save_safetensors): no training state.
    let weights = dir.join("weights.safetensors");
    step.sync_to_store().unwrap();
    step.store().save_safetensors(&weights).unwrap();
    check(&mut step, &weights, "train.step");
    // Another model: fc has 5 outputs.
    let other = dir.join("other.safetensors");
    let mut o = make_step(TrainMode::Fused, "sgd", 1, 7, 0.05, 5);
    o.step(&[batch(0)[0].clone(), Tensor::randn(&[4, 5], 3).unwrap()])
        .unwrap();
    o.save_checkpoint(&other).unwrap();
    check(&mut step, &other, "fc.weight");
    // A key missing: the checkpoint without bn.running_var.
    let missing = dir.join("missing.safetensors");
    {
        let f = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let kept: Vec<_> = f
            .tensors()
            .into_iter()
            .filter(|(n, _)| n != "bn.running_var")
            .collect();
        std::fs::write(
            &missing,
            safetensors::serialize(kept, meta.metadata().clone()).unwrap(),
        )
        .unwrap();
    }
    check(&mut step, &missing, "bn.running_var");
    // Another optimizer's state.
    let adam = dir.join("adam.safetensors");
    let mut a = make_step(TrainMode::Fused, "adam", 1, 7, 0.05, 3);
    a.step(&batch(0)).unwrap();
    a.save_checkpoint(&adam).unwrap();
    check(&mut step, &adam, "optimizer.state.bn.bias.exp_avg");
    // No file.
    let e = step
        .load_checkpoint(dir.join("absent.safetensors"))
        .unwrap_err();
    assert!(e.to_string().contains("absent.safetensors"), "{e}");

    // Failed loads changed nothing: the step goes on as if they had not happened, and loading
    // the good file goes back to step 2.
    assert_eq!(step.steps(), 3);
    let mut twin = make_step(TrainMode::Fused, "sgd", 1, 7, 0.05, 3);
    for i in 0..3 {
        twin.step(&batch(i)).unwrap();
    }
    assert_eq!(
        step.step(&batch(3)).unwrap().to_bits(),
        twin.step(&batch(3)).unwrap().to_bits()
    );
    step.load_checkpoint(&good).unwrap();
    assert_eq!(step.steps(), 2);
    assert_eq!(step.step(&batch(2)).unwrap().to_bits(), before.to_bits());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Size and save/load time of a resnet18 checkpoint (SGD with momentum), and a round trip:
/// a second resnet18, initialised differently, takes the same next step after loading.
#[cfg(feature = "zoo")]
#[test]
fn resnet18_checkpoint_round_trip_size_and_time() {
    use kiln::zoo::{self, Model, SharedModel};
    let make = |seed: u64| {
        let model = SharedModel::new(zoo::build("resnet18", seed).unwrap());
        let m = model.clone();
        let step = TrainStep::new(
            XlaBackend::new().unwrap(),
            model.store(),
            Sgd::new().momentum(0.9),
            move |xs: &[Tensor]| {
                let out = m.forward(xs, true)?;
                m.loss(&out, xs)
            },
        )
        .unwrap()
        .with_mode(TrainMode::Fused)
        .with_lr(0.05);
        (model, step)
    };
    let (model, mut step) = make(0);
    step.step(&model.example_inputs(2, 1).unwrap()).unwrap();
    let dir = scratch("resnet18");
    let path = dir.join("resnet18.safetensors");
    let t = Instant::now();
    step.save_checkpoint(&path).unwrap();
    let save = t.elapsed();
    let size = std::fs::metadata(&path).unwrap().len();
    let (_, mut other) = make(1);
    let t = Instant::now();
    other.load_checkpoint(&path).unwrap();
    let load = t.elapsed();
    let x = model.example_inputs(2, 2).unwrap();
    assert_eq!(
        step.step(&x).unwrap().to_bits(),
        other.step(&x).unwrap().to_bits()
    );
    eprintln!(
        "resnet18 checkpoint: {:.1} MB, save {:.0} ms, load {:.0} ms",
        size as f64 / 1e6,
        save.as_secs_f64() * 1e3,
        load.as_secs_f64() * 1e3
    );
    let _ = std::fs::remove_dir_all(&dir);
}
