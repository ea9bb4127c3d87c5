//! Training: one step = forward in training mode, the model's loss (torchbench's
//! `reduce_to_scalar_loss`, the mean of the output, unless the model says otherwise), backward,
//! SGD update. Eager steps are [`EagerTrainStep`] (libtorch autograd); compiled steps are
//! [`kiln::train::TrainStep`]s, split (forward, backward, optimizer executables) or fused (one).
//!
//! The accuracy check compares the first step from the same initial parameters: its loss and
//! its parameter update (see [`super::UPDATE_RTOL`] for why only the first).
//!
//! Timed runs of `n` iterations: eager syncs every step (libtorch runs them in order anyway);
//! compiled runs `n` asynchronous steps, then waits for all of the last step's device work
//! ([`kiln::train::TrainStep::synchronize`]: updated parameters and optimizer state, not just
//! the loss) and reads the loss back.

use super::runner::{Contender, Workload};
use super::{BenchOptions, TrainGraphs, Variant};
use crate::error::Result;
use kiln::backend::eager::EagerBackend;
use kiln::backend::registry::{BackendEntry, DynBackend, DynTrainStep};
use kiln::backend::HostTensor;
use kiln::compile::TraceMode;
use kiln::optim::Sgd;
use kiln::runtime::Stats;
use kiln::train::{EagerTrainStep, TrainMode};
use kiln::zoo::Model;
use kiln::zoo::SharedModel;
use kiln::Tensor;

pub(crate) struct TrainWorkload {
    model: SharedModel,
    lr: f64,
    /// The initial value of every variable, restored before each contender's warm-up.
    snapshot: Vec<(String, HostTensor)>,
}

impl TrainWorkload {
    pub(crate) fn new(model: SharedModel, opts: &BenchOptions) -> Result<Self> {
        let snapshot = model
            .store()
            .vars()
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_host()?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(TrainWorkload {
            model,
            lr: opts.lr,
            snapshot,
        })
    }
}

impl Workload for TrainWorkload {
    fn eager(&self) -> Result<Box<dyn Contender>> {
        TrainFactory::eager(self.model.clone(), self.lr)
    }

    fn compiled(&self, backend: &BackendEntry, variant: &Variant) -> Result<Box<dyn Contender>> {
        let graphs = variant.graphs.unwrap_or(TrainGraphs::Split);
        TrainFactory::compiled(backend, self.model.clone(), graphs, variant.mode, self.lr)
    }

    fn reset(&self) -> Result<()> {
        let store = self.model.store();
        for (name, value) in &self.snapshot {
            store.set(name, value)?;
        }
        Ok(())
    }

    fn compare_each_call(&self) -> bool {
        false
    }

    fn check_eager_determinism(&self) -> bool {
        true
    }

    /// Each trainable parameter's change since the snapshot.
    fn update(&self) -> Result<Option<Vec<tch::Tensor>>> {
        let _guard = tch::no_grad_guard();
        let mut out = Vec::new();
        for p in self.model.store().trainable() {
            let Some(name) = p.variable().map(|v| v.name.clone()) else {
                continue;
            };
            let Some((_, initial)) = self.snapshot.iter().find(|(n, _)| *n == name) else {
                continue;
            };
            let initial = Tensor::from_host(initial)?;
            out.push(p.as_tch()?.f_sub(initial.as_tch()?)?);
        }
        Ok(Some(out))
    }

    fn has_deterministic_reference(&self) -> bool {
        true
    }

    fn deterministic_reference(&self) -> Result<Box<dyn Contender>> {
        // kiln's graph interpreter draws dropout masks from the same threefry key as every
        // compiled backend, so it is a reference for models that libtorch cannot repeat.
        TrainFactory::compiled(
            &EagerBackend::new(),
            self.model.clone(),
            TrainGraphs::Split,
            TraceMode::Once,
            self.lr,
        )
    }
}

fn loss_fn(model: SharedModel) -> impl Fn(&[Tensor]) -> kiln::Result<Tensor> + 'static {
    move |xs: &[Tensor]| {
        let out = model.forward(xs, true)?;
        model.loss(&out, xs)
    }
}

/// Builds training contenders.
pub(crate) struct TrainFactory;

impl TrainFactory {
    pub(crate) fn eager(model: SharedModel, lr: f64) -> Result<Box<dyn Contender>> {
        let store = model.store().clone();
        let step = EagerTrainStep::new(&store, Sgd::new(), loss_fn(model))?.with_lr(lr);
        Ok(Box::new(EagerTraining { step }))
    }

    pub(crate) fn compiled(
        backend: &dyn DynBackend,
        model: SharedModel,
        graphs: TrainGraphs,
        mode: TraceMode,
        lr: f64,
    ) -> Result<Box<dyn Contender>> {
        let store = model.store().clone();
        let mut step = backend.train_step(
            &store,
            Box::new(Sgd::new()),
            Box::new(loss_fn(model)),
            match graphs {
                TrainGraphs::Split => TrainMode::Split,
                TrainGraphs::Fused => TrainMode::Fused,
            },
            mode,
        )?;
        step.set_lr(lr);
        Ok(Box::new(CompiledTraining { step }))
    }
}

struct EagerTraining {
    step: EagerTrainStep,
}

impl Contender for EagerTraining {
    fn run(&mut self, inputs: &[Tensor], iterations: usize) -> Result<Vec<f64>> {
        let mut loss = f64::NAN;
        for _ in 0..iterations {
            loss = self.step.step(inputs)?;
        }
        Ok(vec![loss])
    }
}

struct CompiledTraining {
    step: Box<dyn DynTrainStep>,
}

impl Contender for CompiledTraining {
    fn run(&mut self, inputs: &[Tensor], iterations: usize) -> Result<Vec<f64>> {
        if iterations == 0 {
            return Ok(Vec::new());
        }
        for _ in 0..iterations {
            self.step.step_async(inputs)?;
        }
        // Stop the clock only when all of the step's device work is done: in split mode the
        // loss comes out of the forward executable, before backward and optimizer finish.
        self.step.synchronize()?;
        Ok(vec![self.step.last_loss()?])
    }

    fn stats(&self) -> Option<Stats> {
        Some(self.step.stats())
    }

    fn sync_to_store(&mut self) -> Result<()> {
        Ok(self.step.sync_to_store()?)
    }
}
