//! Training checkpoints: everything a [`TrainStep`] needs to resume training exactly, as one
//! safetensors file written atomically.
//!
//! Layout (tensor names):
//!
//! - the model: every variable of the step's [`ParamStore`](crate::nn::ParamStore) under its
//!   own name (`layer1.0.conv1.weight`, `bn1.running_mean`: PyTorch's `state_dict` keys), so
//!   the model part loads with [`ParamStore::load_safetensors`]-style tools after dropping the
//!   other keys;
//! - `optimizer.state.<parameter name>.<slot>`: the optimizer state of each trained parameter
//!   (`momentum_buffer`, `exp_avg`, `exp_avg_sq`, ...), for the parameters that have state;
//! - `train.step` (`i64[]`): steps taken; `train.lr` (`f64[]`): the learning rate;
//!   `train.rng_key` (`u32[2]`): the random-number key of the next step (dropout masks);
//! - with loss scaling ([`TrainStep::with_loss_scaling`]): `train.loss_scaling` (`f32[3]`):
//!   the scale, the good steps since the last change and the steps skipped (the optimizer's
//!   step count is `train.step` minus the skipped steps).
//!
//! The header's metadata holds `format` (`kiln.checkpoint`), `format_version`, `kiln_version`,
//! `optimizer` (the optimizer's Rust type) and `mode` (the mode that wrote it; a checkpoint
//! loads in either mode).
//!
//! [`ParamStore::load_safetensors`]: crate::nn::ParamStore::load_safetensors

use super::TrainStep;
use crate::backend::{Backend, HostTensor};
use crate::error::{Error, Result};
use crate::ir::{DType, TensorType};
use crate::nn::store::{safetensors_views, st_dtype};
use crate::trace::Tensor;
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

const FORMAT: &str = "kiln.checkpoint";
const FORMAT_VERSION: &str = "1";
const OPT_PREFIX: &str = "optimizer.state.";
const STEP: &str = "train.step";
const LR: &str = "train.lr";
const RNG_KEY: &str = "train.rng_key";
const LOSS_SCALING: &str = "train.loss_scaling";

fn is_reserved(name: &str) -> bool {
    name.starts_with("optimizer.") || name.starts_with("train.")
}

impl<B: Backend> TrainStep<B> {
    /// Saves everything needed to resume training: the parameters and buffers of the step's
    /// store, the optimizer state, the step count, the learning rate and the random-number key
    /// (see [`TrainStep::load_checkpoint`] and the file layout in the module docs of
    /// `train::checkpoint`).
    ///
    /// The file is replaced atomically: the checkpoint is written to a temporary file in the
    /// same directory, flushed to disk, renamed over `path`, and the directory is flushed, so a
    /// crash at any point leaves either the previous file or the new one, never a partial one
    /// (a crash before the rename may leave the temporary file, `.<name>.tmp-<pid>-<n>`, behind;
    /// nothing reads it, and it can be deleted).
    /// Device values are synced to the stores first (as [`TrainStep::sync_to_store`]).
    pub fn save_checkpoint(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let fmt = |message: String| Error::Format {
            path: path.to_path_buf(),
            message,
        };
        self.rt.sync_to_store()?;
        let mut tensors: Vec<(String, HostTensor)> = Vec::new();
        for (name, t) in self.store.vars() {
            if is_reserved(&name) {
                return Err(fmt(format!(
                    "variable {name}: names starting with `optimizer.` or `train.` are reserved \
                     in checkpoints"
                )));
            }
            tensors.push((name, t.to_host()?));
        }
        for p in self.store.trainable() {
            let Some(info) = p.variable() else { continue };
            let Some(states) = self.opt_state.get(&info.id) else {
                continue;
            };
            for ((slot, _), st) in self.opt.state_shapes(p.ty()).iter().zip(states) {
                tensors.push((format!("{OPT_PREFIX}{}.{slot}", info.name), st.to_host()?));
            }
        }
        let steps = i64::try_from(self.steps)
            .map_err(|_| fmt(format!("{STEP}: {} does not fit an i64", self.steps)))?;
        tensors.push((STEP.into(), HostTensor::from_slice(&[], &[steps])?));
        tensors.push((LR.into(), HostTensor::from_slice(&[], &[self.lr])?));
        tensors.push((RNG_KEY.into(), self.key_var.to_host()?));
        if let Some(sc) = &self.scaler {
            let mut v = Vec::with_capacity(3);
            for t in [&sc.scale, &sc.good, &sc.skipped] {
                v.push(t.to_host()?.to_vec::<f32>()?[0]);
            }
            tensors.push((LOSS_SCALING.into(), HostTensor::from_slice(&[3], &v)?));
        }

        let views = safetensors_views(path, &tensors)?;
        let meta: HashMap<String, String> = [
            ("format", FORMAT.to_string()),
            ("format_version", FORMAT_VERSION.to_string()),
            ("kiln_version", env!("CARGO_PKG_VERSION").to_string()),
            ("optimizer", self.opt_kind.to_string()),
            ("mode", format!("{:?}", self.mode)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let bytes = safetensors::serialize(views, Some(meta)).map_err(|e| fmt(e.to_string()))?;
        write_atomic(path, &bytes)
    }

    /// Restores a checkpoint written by [`TrainStep::save_checkpoint`] into this step: the
    /// parameters and buffers of its store, the optimizer state, the step count, the learning
    /// rate and the random-number key. The step must train the same model (same variable
    /// names, shapes and dtypes) with the same optimizer; the mode may differ.
    ///
    /// The whole file is checked before anything changes: a file that is not safetensors, is
    /// truncated, lacks a key, has a tensor of another shape or dtype, holds unexpected
    /// tensors or was written for another optimizer is an [`Error::Format`] naming the file
    /// and the key, and leaves the step as it was. Device copies of the variables are dropped,
    /// so the next step runs on the loaded values.
    pub fn load_checkpoint(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let fmt = |message: String| Error::Format {
            path: path.to_path_buf(),
            message,
        };
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let file = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| fmt(format!("not a valid safetensors file: {e}")))?;
        let mut used: HashSet<String> = HashSet::new();
        let mut take = |name: &str, want: &TensorType| -> Result<HostTensor> {
            let view = file
                .tensor(name)
                .map_err(|_| fmt(format!("tensor {name} is missing")))?;
            if view.dtype() != st_dtype(want.dtype) || view.shape() != want.shape.dims() {
                return Err(fmt(format!(
                    "tensor {name}: expected {want}, the file has {:?}{:?}",
                    view.dtype(),
                    view.shape()
                )));
            }
            used.insert(name.to_string());
            HostTensor::from_bytes(want.clone(), view.data().to_vec())
                .map_err(|e| fmt(format!("tensor {name}: {e}")))
        };

        // Read and check everything before changing anything.
        let mut model = Vec::new();
        for (name, t) in self.store.vars() {
            let h = take(&name, t.ty())?;
            model.push((t, h));
        }
        // Per trained parameter: its state, or `None` when the file has none for it (a
        // parameter the loss never read before the save).
        let mut opt_states: Vec<(Tensor, Option<Vec<HostTensor>>)> = Vec::new();
        for p in self.store.trainable() {
            let name = p.variable().map(|v| v.name.clone()).unwrap_or_default();
            let slots = self.opt.state_shapes(p.ty());
            let present: Vec<bool> = slots
                .iter()
                .map(|(slot, _)| file.tensor(&format!("{OPT_PREFIX}{name}.{slot}")).is_ok())
                .collect();
            let state = if present.iter().any(|&b| b) {
                let mut v = Vec::with_capacity(slots.len());
                for (slot, ty) in &slots {
                    v.push(take(&format!("{OPT_PREFIX}{name}.{slot}"), ty)?);
                }
                Some(v)
            } else {
                None
            };
            opt_states.push((p, state));
        }
        let step = take(STEP, &TensorType::scalar(DType::I64))?.to_vec::<i64>()?[0];
        let steps = u64::try_from(step).map_err(|_| fmt(format!("{STEP}: negative ({step})")))?;
        let lr = take(LR, &TensorType::scalar(DType::F64))?.to_vec::<f64>()?[0];
        let key = take(RNG_KEY, &TensorType::new(DType::U32, [2]))?;
        // Loss-scaling state, if the checkpoint has it (a step without loss scaling ignores
        // it, but still counts the skipped steps out of the optimizer's step count).
        let scaling = if file.tensor(LOSS_SCALING).is_ok() {
            Some(take(LOSS_SCALING, &TensorType::new(DType::F32, [3]))?.to_vec::<f32>()?)
        } else {
            None
        };
        let skipped = scaling.as_ref().map_or(0, |v| v[2] as u64);
        if skipped > steps {
            return Err(fmt(format!(
                "{LOSS_SCALING}: {skipped} skipped steps of {steps} taken"
            )));
        }
        let mut unexpected: Vec<&str> = file
            .names()
            .into_iter()
            .filter(|n| !used.contains(*n))
            .collect();
        if !unexpected.is_empty() {
            unexpected.sort_unstable();
            let shown: Vec<&str> = unexpected.iter().take(8).copied().collect();
            return Err(fmt(format!(
                "{} unexpected tensor(s): {}{}",
                unexpected.len(),
                shown.join(", "),
                if unexpected.len() > shown.len() {
                    ", ..."
                } else {
                    ""
                }
            )));
        }
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| fmt(format!("not a valid safetensors file: {e}")))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let field = |k: &str| meta.get(k).map(String::as_str);
        if field("format") != Some(FORMAT) {
            return Err(fmt(format!(
                "metadata format: expected {FORMAT:?}, found {:?}",
                field("format")
            )));
        }
        if field("format_version") != Some(FORMAT_VERSION) {
            return Err(fmt(format!(
                "metadata format_version: expected {FORMAT_VERSION:?}, found {:?}",
                field("format_version")
            )));
        }
        if field("optimizer") != Some(self.opt_kind) {
            return Err(fmt(format!(
                "metadata optimizer: the checkpoint was written with {:?}, this step uses {:?}",
                field("optimizer"),
                self.opt_kind
            )));
        }

        // Drop the device copies (syncing pending updates first, so that variables of other
        // stores keep their values), then write the stores: the next step uploads them.
        self.rt.refresh_from_store()?;
        self.last = None;
        for (t, h) in &model {
            t.assign(&Tensor::from_host(h)?)?;
        }
        for (p, state) in opt_states {
            match state {
                Some(values) => {
                    for (st, h) in self.state_for(&p)?.iter().zip(&values) {
                        st.assign(&Tensor::from_host(h)?)?;
                    }
                }
                None => {
                    // No state saved: the optimizer starts afresh for this parameter.
                    let id = p.variable().map(|v| v.id).unwrap_or(0);
                    if let Some(states) = self.opt_state.get(&id) {
                        for st in states {
                            st.assign(&Tensor::zeros(st.dims(), st.dtype())?)?;
                        }
                    }
                }
            }
        }
        self.steps = steps;
        self.step_var
            .assign(&Tensor::from_host(&HostTensor::from_slice(
                &[],
                &[(steps - skipped) as f64],
            )?)?)?;
        if let (Some(sc), Some(v)) = (&self.scaler, &scaling) {
            for (t, &x) in [&sc.scale, &sc.good, &sc.skipped].into_iter().zip(v) {
                t.assign(&Tensor::from_host(&HostTensor::from_slice(&[], &[x])?)?)?;
            }
        }
        self.key_var.assign(&Tensor::from_host(&key)?)?;
        self.lr = lr;
        self.lr_uploaded = None;
        Ok(())
    }
}

/// A process-wide counter, so that concurrent saves to one path use distinct temporary files.
static NEXT_TMP: AtomicU64 = AtomicU64::new(0);

/// The temporary file a save to `path` writes before renaming it: `.<name>.tmp-<pid>-<n>` in
/// the same directory (a rename is atomic only within one file system).
fn temp_path(path: &Path) -> Result<PathBuf> {
    let name = path.file_name().ok_or_else(|| Error::Format {
        path: path.to_path_buf(),
        message: "a checkpoint path must name a file".into(),
    })?;
    let n = NEXT_TMP.fetch_add(1, Ordering::Relaxed);
    Ok(path.with_file_name(format!(
        ".{}.tmp-{}-{n}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// Replaces `path` by `bytes` atomically: write a temporary file, fsync it, rename it over
/// `path`, fsync the directory (so the rename itself survives a power loss).
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_path(path)?;
    let written = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(&tmp, e));
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(path, e));
    }
    #[cfg(unix)]
    {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| Error::io(dir, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_atomic_replaces_the_file_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("kiln-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.bin");
        write_atomic(&path, b"first").unwrap();
        write_atomic(&path, b"second, longer").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second, longer");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("f.bin")]);
        // A save that cannot write keeps the old file and names the file it failed on.
        let missing_dir = dir.join("no-such-dir").join("f.bin");
        let e = write_atomic(&missing_dir, b"x").unwrap_err();
        assert!(e.to_string().contains("no-such-dir"), "{e}");
        assert!(matches!(
            write_atomic(Path::new("/"), b"x"),
            Err(Error::Format { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn temporary_files_are_distinct_and_in_the_same_directory() {
        let p = Path::new("/some/dir/ckpt.safetensors");
        let (a, b) = (temp_path(p).unwrap(), temp_path(p).unwrap());
        assert_ne!(a, b);
        assert_eq!(a.parent(), p.parent());
        let name = a.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            name.starts_with(&format!(".ckpt.safetensors.tmp-{}-", std::process::id())),
            "{name}"
        );
    }
}
