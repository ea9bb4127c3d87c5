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
    /// the inputs in place and waits for its results; a call that leaves its results on the
    /// device copies its inputs unless its program runs inside the launch).
    ///
    /// More: `iterations` calls that leave their outputs on the device (no download, no
    /// wait), then one sync: every call's outputs not yet computed when it returned are kept
    /// and waited for (an asynchronous plugin may still be running earlier calls when the
    /// last one is done), and the last call's are read back. Outputs already computed are
    /// dropped at once, as eager drops each call's output: keeping a thousand calls' outputs
    /// of a tiny model alive made each call slower (the LinearModel with 1,000 iterations a
    /// run, three runs each, 2-vCPU Zen 4: 1.09-1.11x of eager keeping them all, 1.17-1.24x
    /// so).
    fn run(&mut self, inputs: &[Tensor], iterations: usize) -> Result<Vec<f64>> {
        if iterations == 1 {
            return first_output(&self.f.run(inputs)?);
        }
        let mut pending = Vec::new();
        let mut last = None;
        for _ in 0..iterations {
            let o = self.f.run_on_device(inputs)?;
            if let Some(previous) = last.replace(o) {
                if !previous.is_ready() {
                    pending.push(previous);
                }
            }
        }
        for o in &pending {
            o.synchronize()?;
        }
        let Some(last) = last else {
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
