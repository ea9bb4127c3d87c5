//! The 8x8 handwritten digits that scikit-learn ships inside its package
//! (`sklearn/datasets/data/digits.csv.gz`: 1797 rows of 64 pixel values 0..16 and a label),
//! read from the copy `scripts/bootstrap.sh` installs, or from `KILN_DIGITS`.

use kiln::{Error, Result, Tensor};
use std::io::Read;
use std::path::PathBuf;

/// Images `[n, 1, 8, 8]` scaled to `[0, 1]` and labels `[n]`.
pub struct Digits {
    pub images: Vec<f32>,
    pub labels: Vec<i64>,
}

impl Digits {
    pub fn load() -> Result<Digits> {
        let path = std::env::var_os("KILN_DIGITS")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".deps/sklearn_data/digits.csv.gz")
            });
        let file = std::fs::File::open(&path).map_err(|e| Error::io(&path, e))?;
        let mut text = String::new();
        flate2::read::GzDecoder::new(file)
            .read_to_string(&mut text)
            .map_err(|e| Error::io(&path, e))?;
        let (mut images, mut labels) = (Vec::new(), Vec::new());
        for (i, line) in text.lines().enumerate() {
            let vals: Vec<f32> = line
                .split(',')
                .map(|v| v.trim().parse::<f32>())
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| Error::Format {
                    path: path.clone(),
                    message: format!("line {}: {e}", i + 1),
                })?;
            if vals.len() != 65 {
                return Err(Error::Format {
                    path: path.clone(),
                    message: format!("line {}: {} values, expected 65", i + 1, vals.len()),
                });
            }
            images.extend(vals[..64].iter().map(|v| v / 16.0));
            labels.push(vals[64] as i64);
        }
        Ok(Digits { images, labels })
    }

    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Rows `idx` as a batch: images `[b, 1, 8, 8]` (f32) and labels `[b]` (i64).
    pub fn batch(&self, idx: &[usize]) -> Result<(Tensor, Tensor)> {
        let mut x = Vec::with_capacity(idx.len() * 64);
        let mut y = Vec::with_capacity(idx.len());
        for &i in idx {
            x.extend_from_slice(&self.images[i * 64..(i + 1) * 64]);
            y.push(self.labels[i]);
        }
        Ok((
            Tensor::from_slice(&[idx.len(), 1, 8, 8], &x)?,
            Tensor::from_slice(&[idx.len()], &y)?,
        ))
    }
}

/// A seeded permutation of `0..n` (Fisher-Yates with splitmix64).
pub fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

/// The digits CNN of the `train` and `data_parallel` examples (and the mixed-precision tests):
/// two 3x3 convolutions with ReLU and 2x2 max pooling, then a linear classifier.
pub fn cnn(store: &kiln::nn::ParamStore) -> Result<kiln::nn::Sequential> {
    use kiln::nn::{Conv2d, Conv2dConfig, Flatten, Linear, MaxPool2d, Relu, Sequential};
    let r = store.root();
    let pad1 = Conv2dConfig {
        padding: [1, 1],
        ..Default::default()
    };
    Ok(Sequential::new()
        .add(Conv2d::new(&r.sub("conv1"), 1, 16, 3, pad1)?)
        .add(Relu)
        .add(MaxPool2d::new(2, 2, 0))
        .add(Conv2d::new(&r.sub("conv2"), 16, 32, 3, pad1)?)
        .add(Relu)
        .add(MaxPool2d::new(2, 2, 0))
        .add(Flatten::default())
        .add(Linear::new(&r.sub("fc"), 32 * 2 * 2, 10, true)?))
}

/// The fraction of the images `idx` of `data` that `model` classifies right.
#[allow(dead_code)] // not every file that includes this module evaluates
pub fn accuracy(model: &impl kiln::nn::Module, data: &Digits, idx: &[usize]) -> Result<f64> {
    let (x, y) = data.batch(idx)?;
    let logits = tch::no_grad(|| model.forward(&x))?;
    let pred = logits.as_tch()?.f_argmax(-1, false)?;
    let correct = pred
        .f_eq_tensor(y.as_tch()?)?
        .f_sum(tch::Kind::Int64)?
        .int64_value(&[]);
    Ok(correct as f64 / idx.len() as f64)
}
