//! Inference: eager = `tch::no_grad(|| model.forward(inputs, false))`; compiled = the same
//! closure through [`kiln::compile`], called with [`kiln::CompiledFn::run`] for one iteration,
//! and for more its outputs left on the device ([`kiln::CompiledFn::run_on_device`]) until
//! the run's one sync, where the last result is read back to the host.

use super::runner::{Contender, Workload};
use super::Variant;
use crate::error::{Error, Result};
use kiln::backend::registry::{BackendEntry, DynBackend, DynCompiledFn};
use kiln::runtime::Stats;
use kiln::zoo::Model;
use kiln::zoo::SharedModel;
use kiln::Tensor;

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
        let f = backend.compile(
            Box::new(move |xs: &[Tensor]| Ok(vec![m.forward(xs, false)?])),
            variant.mode,
        )?;
        Ok(Box::new(InferenceContender { f }))
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
            Some(t) => Ok(t.to_f64_vec()?),
            None => Ok(Vec::new()),
        }
    }
}

/// A compiled function as an inference contender.
struct InferenceContender {
    f: Box<dyn DynCompiledFn>,
}

impl Contender for InferenceContender {
    /// One call: [`kiln::CompiledFn::run`], as a caller of one inference runs it (it reads
    /// the inputs in place and waits for its results, where a call that leaves its results
    /// on the device must copy its inputs and track the execution's completion: the
    /// LinearModel's call took 9.7 µs against 11.0 µs that way, 2-vCPU Zen 2).
    ///
    /// More: `iterations` calls that leave their outputs on the device (no download, no
    /// wait), then one sync: every call's outputs are waited for (an asynchronous plugin may
    /// still be running earlier calls when the last one is done) and the last call's are
    /// read back.
    fn run(&mut self, inputs: &[Tensor], iterations: usize) -> Result<Vec<f64>> {
        if iterations == 1 {
            return first_output(&self.f.run(inputs)?);
        }
        let mut outs = Vec::with_capacity(iterations);
        for _ in 0..iterations {
            outs.push(self.f.run_on_device(inputs)?);
        }
        for o in &outs {
            o.synchronize()?;
        }
        let Some(last) = outs.last() else {
            return Ok(Vec::new());
        };
        first_output(&last.to_host()?)
    }

    fn stats(&self) -> Option<Stats> {
        Some(self.f.stats())
    }
}

/// The values of a compiled call's first output (the one the harness compares with eager).
fn first_output(outputs: &[Tensor]) -> Result<Vec<f64>> {
    match outputs.first() {
        Some(t) => Ok(t.to_f64_vec()?),
        None => Err(Error::Invalid(
            "compiled function returned no output".into(),
        )),
    }
}
