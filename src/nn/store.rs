//! `ParamStore`: named parameters and buffers, tch `VarStore`-style.

use crate::backend::HostTensor;
use crate::error::{Error, Result};
use crate::ir::DType;
use crate::trace::{is_tracing, SplitMix, Tensor, VarInfo, VarKind};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

static NEXT_VAR: AtomicU64 = AtomicU64::new(1);

/// How a new variable is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// All elements equal.
    Const(f64),
    /// Uniform in `[lo, hi)`.
    Uniform {
        /// Lower bound.
        lo: f64,
        /// Upper bound.
        hi: f64,
    },
    /// Normal with `mean` and `std`.
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
    /// PyTorch's default for `Linear`/`Conv` weights: `kaiming_uniform_(a = sqrt(5))`, i.e.
    /// uniform in `±1/sqrt(fan_in)`; `fan_in` is the product of all dims but the first.
    KaimingUniform,
    /// `kaiming_normal_(mode="fan_out", nonlinearity="relu")`, torchvision's conv init for
    /// ResNets: normal with std `sqrt(2 / fan_out)`, `fan_out = dims[0] * prod(dims[2..])`.
    KaimingNormalFanOut,
}

struct Entry {
    info: Arc<VarInfo>,
    tensor: tch::Tensor,
    dtype: DType,
}

struct Inner {
    vars: Vec<Entry>,
    by_name: HashMap<String, usize>,
    rng: SplitMix,
    /// The dtype of parameters and of float buffers created through [`Path::float_buffer`].
    float_dtype: DType,
}

/// A set of named variables (parameters and buffers), shared by the modules built from it.
///
/// Names are hierarchical, built with [`Path`]s: `store.root().sub("layer1").sub("0")`. The
/// tensors handed to modules share storage with the store, so updates through the store
/// (optimizer steps, loading weights, [`Tensor::assign`]) are seen by the modules.
///
/// Cloning a `ParamStore` gives another handle to the same variables.
#[derive(Clone)]
pub struct ParamStore {
    inner: Arc<Mutex<Inner>>,
}

impl Default for ParamStore {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for ParamStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = self.inner.lock();
        write!(f, "ParamStore({} vars)", g.vars.len())
    }
}

impl ParamStore {
    /// An empty store whose initialisers are seeded with 0.
    pub fn new() -> Self {
        Self::with_seed(0)
    }

    /// An empty store whose random initialisers draw from `seed`.
    pub fn with_seed(seed: u64) -> Self {
        ParamStore {
            inner: Arc::new(Mutex::new(Inner {
                vars: Vec::new(),
                by_name: HashMap::new(),
                rng: SplitMix(seed),
                float_dtype: DType::F32,
            })),
        }
    }

    /// Makes parameters (and float buffers created with [`Path::float_buffer`]) of this store
    /// `dtype` instead of `f32`: e.g. `f64` for a reference model whose gradients serve as the
    /// numerical truth for `f32` runs. Call before building modules.
    ///
    /// Random initialisers draw the same numbers whatever the dtype, rounded to it; to give an
    /// `f64` model exactly the values of an `f32` one, build both and
    /// [`copy_from`](ParamStore::copy_from) the `f32` store.
    pub fn with_float_dtype(self, dtype: DType) -> Result<Self> {
        if !dtype.is_float() {
            return Err(Error::Invalid(format!(
                "with_float_dtype: {dtype} is not a floating-point dtype"
            )));
        }
        self.inner.lock().float_dtype = dtype;
        Ok(self)
    }

    /// The dtype of this store's parameters (`f32` unless set by
    /// [`with_float_dtype`](ParamStore::with_float_dtype)).
    pub fn float_dtype(&self) -> DType {
        self.inner.lock().float_dtype
    }

    /// The root path (empty prefix).
    pub fn root(&self) -> Path {
        Path {
            store: self.clone(),
            prefix: String::new(),
        }
    }

    fn create(
        &self,
        name: String,
        shape: &[usize],
        init: Init,
        kind: VarKind,
        dtype: DType,
    ) -> Result<Tensor> {
        if is_tracing() {
            return Err(Error::Trace(format!(
                "variable {name} created inside a trace: build modules before tracing them"
            )));
        }
        if !dtype.is_float() && !matches!(init, Init::Const(_)) {
            return Err(Error::Invalid(format!("{name}: random init of {dtype}")));
        }
        let mut g = self.inner.lock();
        if g.by_name.contains_key(&name) {
            return Err(Error::Invalid(format!("variable {name} already exists")));
        }
        let n: usize = shape.iter().product();
        let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let fan_in: usize = shape.iter().skip(1).product::<usize>().max(1);
        let t = match init {
            Init::Const(v) => tch::Tensor::f_full(
                &dims,
                v,
                (crate::backend::eager::kind_of(dtype), tch::Device::Cpu),
            )?,
            Init::Uniform { lo, hi } => uniform_tensor(n, lo, hi, &mut g.rng, dtype)?,
            Init::KaimingUniform => {
                let b = 1.0 / (fan_in as f64).sqrt();
                uniform_tensor(n, -b, b, &mut g.rng, dtype)?
            }
            Init::Normal { mean, std } => {
                let seed = g.rng.next();
                normal_tensor(n, mean, std, seed, dtype)?
            }
            Init::KaimingNormalFanOut => {
                let fan_out =
                    shape.first().copied().unwrap_or(1) * shape.iter().skip(2).product::<usize>();
                let std = (2.0 / fan_out.max(1) as f64).sqrt();
                let seed = g.rng.next();
                normal_tensor(n, 0.0, std, seed, dtype)?
            }
        }
        .f_reshape(&dims)?;
        let t = if kind == VarKind::Parameter {
            t.set_requires_grad(true)
        } else {
            t
        };
        let info = Arc::new(VarInfo {
            id: NEXT_VAR.fetch_add(1, Ordering::Relaxed),
            name: name.clone(),
            kind,
        });
        let idx = g.vars.len();
        g.vars.push(Entry {
            info: info.clone(),
            tensor: t.shallow_clone(),
            dtype,
        });
        g.by_name.insert(name, idx);
        Ok(Tensor::new_var(t, dtype, info))
    }

    /// All variables in creation order, as `(name, tensor)`.
    pub fn vars(&self) -> Vec<(String, Tensor)> {
        let g = self.inner.lock();
        g.vars
            .iter()
            .map(|e| {
                (
                    e.info.name.clone(),
                    Tensor::new_var(e.tensor.shallow_clone(), e.dtype, e.info.clone()),
                )
            })
            .collect()
    }

    /// The trainable parameters in creation order.
    pub fn trainable(&self) -> Vec<Tensor> {
        self.vars()
            .into_iter()
            .filter(|(_, t)| t.variable().map(|v| v.kind) == Some(VarKind::Parameter))
            .map(|(_, t)| t)
            .collect()
    }

    /// The variable called `name`.
    pub fn get(&self, name: &str) -> Option<Tensor> {
        let g = self.inner.lock();
        g.by_name.get(name).map(|&i| {
            let e = &g.vars[i];
            Tensor::new_var(e.tensor.shallow_clone(), e.dtype, e.info.clone())
        })
    }

    /// Number of variables.
    pub fn len(&self) -> usize {
        self.inner.lock().vars.len()
    }

    /// No variables?
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Total number of elements in trainable parameters (PyTorch's parameter count).
    pub fn num_parameters(&self) -> usize {
        self.trainable().iter().map(|t| t.shape().numel()).sum()
    }

    /// Overwrites the value of variable `name` (outside autograd). Shapes and dtypes must match.
    pub fn set(&self, name: &str, value: &HostTensor) -> Result<()> {
        let t = self
            .get(name)
            .ok_or_else(|| Error::Invalid(format!("no variable named {name}")))?;
        if value.ty() != t.ty() {
            return Err(Error::Invalid(format!(
                "set {name}: expected {}, got {}",
                t.ty(),
                value.ty()
            )));
        }
        t.assign(&Tensor::from_host(value)?)
    }

    /// Copies every variable's value from `other` (same names and shapes). Floating-point
    /// values are converted to this store's dtype (e.g. an `f32` model's parameters into its
    /// `f64` twin); other dtypes must match.
    pub fn copy_from(&self, other: &ParamStore) -> Result<()> {
        for (name, t) in other.vars() {
            let mine = self
                .get(&name)
                .ok_or_else(|| Error::Invalid(format!("copy_from: no variable named {name}")))?;
            let t = if mine.dtype() != t.dtype() && mine.dtype().is_float() && t.dtype().is_float()
            {
                t.detach()?.to_dtype(mine.dtype())?
            } else {
                t
            };
            self.set(&name, &t.to_host()?)?;
        }
        Ok(())
    }

    /// Every variable's value as a host tensor, in creation order (a PyTorch `state_dict`).
    pub fn state_dict(&self) -> Result<Vec<(String, HostTensor)>> {
        self.vars()
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_host()?)))
            .collect()
    }

    /// Saves every variable (parameters and buffers) to a safetensors file, keyed by its
    /// hierarchical name (for the zoo's CNNs: torchvision's `state_dict` keys).
    pub fn save_safetensors(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        let fmt = |message: String| Error::Format {
            path: path.to_path_buf(),
            message,
        };
        let tensors = self.state_dict()?;
        let views = safetensors_views(path, &tensors)?;
        let bytes = safetensors::serialize(views, None).map_err(|e| fmt(e.to_string()))?;
        std::fs::write(path, bytes).map_err(|e| Error::io(path, e))
    }

    /// Loads every variable from a safetensors file (e.g. a PyTorch `state_dict` saved with
    /// `safetensors.torch.save_file`).
    ///
    /// Strict: every variable must be present with the same shape and dtype, and the file must
    /// hold no other tensors; otherwise an [`Error::Format`] names the file and the offending
    /// keys or shapes, and no variable is changed. Compiled functions that already hold device
    /// copies of the variables must be told with `CompiledFn::refresh_from_store`.
    pub fn load_safetensors(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        let fmt = |message: String| Error::Format {
            path: path.to_path_buf(),
            message,
        };
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let file = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| fmt(format!("not a valid safetensors file: {e}")))?;
        let vars = self.vars();
        let mut missing = Vec::new();
        let mut values = Vec::with_capacity(vars.len());
        for (name, t) in &vars {
            let view = match file.tensor(name) {
                Ok(v) => v,
                Err(_) => {
                    missing.push(name.clone());
                    continue;
                }
            };
            let want = st_dtype(t.dtype());
            if view.dtype() != want || view.shape() != t.dims() {
                return Err(fmt(format!(
                    "tensor {name}: expected {:?}{:?}, the file has {:?}{:?}",
                    want,
                    t.dims(),
                    view.dtype(),
                    view.shape()
                )));
            }
            let h = HostTensor::from_bytes(t.ty().clone(), view.data().to_vec())
                .map_err(|e| fmt(format!("tensor {name}: {e}")))?;
            values.push((name.clone(), h));
        }
        if !missing.is_empty() {
            return Err(fmt(format!(
                "{} variable(s) missing from the file: {}",
                missing.len(),
                summarize(&missing)
            )));
        }
        let known: std::collections::HashSet<&str> = vars.iter().map(|(n, _)| n.as_str()).collect();
        let mut unexpected: Vec<String> = file
            .names()
            .into_iter()
            .filter(|n| !known.contains(n))
            .map(|n| n.to_string())
            .collect();
        if !unexpected.is_empty() {
            unexpected.sort();
            return Err(fmt(format!(
                "{} unexpected tensor(s) in the file: {}",
                unexpected.len(),
                summarize(&unexpected)
            )));
        }
        for (name, h) in values {
            self.set(&name, &h)?;
        }
        Ok(())
    }
}

/// `n` values uniform in `[lo, hi)`, drawn in sequence from `rng` (computed in `f64`, stored
/// in `dtype`).
fn uniform_tensor(
    n: usize,
    lo: f64,
    hi: f64,
    rng: &mut SplitMix,
    dtype: DType,
) -> Result<tch::Tensor> {
    let w = hi - lo;
    let t = if dtype == DType::F64 {
        let v: Vec<f64> = (0..n).map(|_| lo + w * rng.uniform()).collect();
        tch::Tensor::f_from_slice(&v)?
    } else {
        let v: Vec<f32> = (0..n).map(|_| (lo + w * rng.uniform()) as f32).collect();
        tch::Tensor::f_from_slice(&v)?
    };
    Ok(t.f_to_kind(crate::backend::eager::kind_of(dtype))?)
}

/// `n` normal values with `mean` and `std` from `seed` (Marsaglia's polar method on a private
/// generator: no trigonometry, so VGG16's 138M parameters initialise in about a second).
fn normal_tensor(n: usize, mean: f64, std: f64, seed: u64, dtype: DType) -> Result<tch::Tensor> {
    let mut s = SplitMix(seed ^ 0x6B69_6C6E);
    let mut next_pair = || loop {
        let u = 2.0 * s.uniform() - 1.0;
        let v = 2.0 * s.uniform() - 1.0;
        let r = u * u + v * v;
        if r > 0.0 && r < 1.0 {
            let f = (-2.0 * r.ln() / r).sqrt();
            return (mean + std * u * f, mean + std * v * f);
        }
    };
    let t = if dtype == DType::F64 {
        let mut v: Vec<f64> = Vec::with_capacity(n + 1);
        while v.len() < n {
            let (a, b) = next_pair();
            v.push(a);
            v.push(b);
        }
        v.truncate(n);
        tch::Tensor::f_from_slice(&v)?
    } else {
        let mut v: Vec<f32> = Vec::with_capacity(n + 1);
        while v.len() < n {
            let (a, b) = next_pair();
            v.push(a as f32);
            v.push(b as f32);
        }
        v.truncate(n);
        tch::Tensor::f_from_slice(&v)?
    };
    Ok(t.f_to_kind(crate::backend::eager::kind_of(dtype))?)
}

/// Safetensors views of named host tensors, for writing a file at `path` (named in errors).
pub(crate) fn safetensors_views<'a>(
    path: &std::path::Path,
    tensors: &'a [(String, HostTensor)],
) -> Result<Vec<(&'a str, safetensors::tensor::TensorView<'a>)>> {
    tensors
        .iter()
        .map(|(name, h)| {
            let v = safetensors::tensor::TensorView::new(
                st_dtype(h.ty().dtype),
                h.ty().shape.dims().to_vec(),
                h.bytes(),
            )
            .map_err(|e| Error::Format {
                path: path.to_path_buf(),
                message: format!("tensor {name}: {e}"),
            })?;
            Ok((name.as_str(), v))
        })
        .collect()
}

/// The safetensors dtype of a kiln dtype.
pub(crate) fn st_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::Bool => safetensors::Dtype::BOOL,
        DType::U32 => safetensors::Dtype::U32,
        DType::I32 => safetensors::Dtype::I32,
        DType::I64 => safetensors::Dtype::I64,
        DType::F32 => safetensors::Dtype::F32,
        DType::F64 => safetensors::Dtype::F64,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::F16 => safetensors::Dtype::F16,
    }
}

/// The first few names of a list, for error messages.
fn summarize(names: &[String]) -> String {
    const SHOWN: usize = 8;
    let mut s = names
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > SHOWN {
        s.push_str(&format!(", ... ({} more)", names.len() - SHOWN));
    }
    s
}

/// A position in a [`ParamStore`]'s name hierarchy.
#[derive(Clone, Debug)]
pub struct Path {
    store: ParamStore,
    prefix: String,
}

impl Path {
    /// The child path `self.name`.
    pub fn sub(&self, name: impl std::fmt::Display) -> Path {
        Path {
            store: self.store.clone(),
            prefix: self.join(&name.to_string()),
        }
    }

    fn join(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// The store.
    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    /// The dotted prefix of this path.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A new trainable parameter, of the store's float dtype (`f32` by default).
    pub fn param(&self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        let dtype = self.store.float_dtype();
        self.store
            .create(self.join(name), shape, init, VarKind::Parameter, dtype)
    }

    /// A new non-trainable variable of the store's float dtype (e.g. BatchNorm's running
    /// statistics, which follow the parameters' precision).
    pub fn float_buffer(&self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        let dtype = self.store.float_dtype();
        self.buffer(name, shape, init, dtype)
    }

    /// A new non-trainable variable (a buffer, e.g. running statistics).
    pub fn buffer(&self, name: &str, shape: &[usize], init: Init, dtype: DType) -> Result<Tensor> {
        self.store
            .create(self.join(name), shape, init, VarKind::Buffer, dtype)
    }
}

impl<T: std::fmt::Display> std::ops::Div<T> for &Path {
    type Output = Path;
    fn div(self, rhs: T) -> Path {
        self.sub(rhs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moments(t: &Tensor) -> (f64, f64) {
        let v = t.to_f64_vec().unwrap();
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
        (mean, var.sqrt())
    }

    #[test]
    fn initialisers_have_the_right_moments_and_are_seeded() {
        let s = ParamStore::with_seed(5);
        let r = s.root();
        let n = r
            .param(
                "n",
                &[200, 500],
                Init::Normal {
                    mean: 1.0,
                    std: 2.0,
                },
            )
            .unwrap();
        let (m, sd) = moments(&n);
        assert!(
            (m - 1.0).abs() < 0.02 && (sd - 2.0).abs() < 0.02,
            "{m} {sd}"
        );
        // fan_out = 64 * 3 * 3 -> std sqrt(2 / 576).
        let k = r
            .param("k", &[64, 32, 3, 3], Init::KaimingNormalFanOut)
            .unwrap();
        let (m, sd) = moments(&k);
        let want = (2.0f64 / 576.0).sqrt();
        assert!(m.abs() < 0.01 && (sd / want - 1.0).abs() < 0.03, "{m} {sd}");
        let u = r.param("u", &[100, 300], Init::KaimingUniform).unwrap();
        let b = 1.0 / 300f64.sqrt();
        let v = u.to_f64_vec().unwrap();
        assert!(v.iter().all(|x| x.abs() <= b));
        let (_, sd) = moments(&u);
        assert!((sd / (b / 3f64.sqrt()) - 1.0).abs() < 0.03, "{sd}");
        // Same seed, same values.
        let s2 = ParamStore::with_seed(5);
        let n2 = s2
            .root()
            .param(
                "n",
                &[200, 500],
                Init::Normal {
                    mean: 1.0,
                    std: 2.0,
                },
            )
            .unwrap();
        assert_eq!(n.to_f64_vec().unwrap(), n2.to_f64_vec().unwrap());
    }
}
