//! Inference: eager = `tch::no_grad(|| model.forward(inputs, false))`; compiled = the same
//! closure through [`crate::compile`]. Both results are read back to the host (the sync).

use super::registry::BackendEntry;
use super::runner::{Contender, Workload};
use super::SharedModel;
use super::Variant;
use crate::backend::Backend;
use crate::compile::CompiledFn;
use crate::error::{Error, Result};
use crate::runtime::Stats;
use crate::trace::Tensor;
use crate::zoo::Model;

pub(crate) struct InferenceWorkload {
    model: SharedModel,
}

impl InferenceWorkload {
    pub(crate) fn new(model: SharedModel) -> Self {
        InferenceWorkload { model }
    }
}

impl Workload for InferenceWorkload {
    fn eager(&self) -> Result<Box<dyn Contender>> {
        Ok(Box::new(EagerInference {
            model: self.model.clone(),
        }))
    }

    fn compiled(&self, backend: &BackendEntry, variant: &Variant) -> Result<Box<dyn Contender>> {
        let m = self.model.clone();
        backend.imp().inference(
            Box::new(move |xs: &[Tensor]| Ok(vec![m.forward(xs, false)?])),
            variant.mode,
        )
    }

    fn compare_each_call(&self) -> bool {
        true
    }
}

struct EagerInference {
    model: SharedModel,
}

impl Contender for EagerInference {
    fn run(&mut self, inputs: &[Tensor], iterations: usize) -> Result<Vec<f64>> {
        let mut out = None;
        for _ in 0..iterations {
            out = Some(tch::no_grad(|| self.model.forward(inputs, false))?);
        }
        match out {
            Some(t) => t.to_f64_vec(),
            None => Ok(Vec::new()),
        }
    }
}

/// A compiled function as an inference contender.
pub(crate) struct InferenceContender<B: Backend> {
    f: CompiledFn<B>,
}

impl<B: Backend> InferenceContender<B> {
    pub(crate) fn new(f: CompiledFn<B>) -> Self {
        InferenceContender { f }
    }
}

impl<B: Backend> Contender for InferenceContender<B> {
    fn run(&mut self, inputs: &[Tensor], iterations: usize) -> Result<Vec<f64>> {
        let mut out = Vec::new();
        for _ in 0..iterations {
            out = self.f.run(inputs)?;
        }
        match out.first() {
            Some(t) => t.to_f64_vec(),
            None if iterations == 0 => Ok(Vec::new()),
            None => Err(Error::Invalid(
                "compiled function returned no output".into(),
            )),
        }
    }

    fn stats(&self) -> Option<Stats> {
        Some(self.f.stats())
    }
}
