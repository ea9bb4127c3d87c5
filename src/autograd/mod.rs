//! Ahead-of-time reverse-mode differentiation (AOTAutograd's design on kiln's IR).
//!
//! - [`vjp`]: one rule per [`crate::ir::Op`] (exhaustive match) building the operands'
//!   cotangents as graph nodes; [`rules`] documents the decisions (ties, non-differentiable ops).
//! - [`joint`]: the joint forward+backward graph of a scalar loss w.r.t. chosen inputs.
//! - [`partition`]: splits a joint graph into a forward graph (user outputs + saved values) and
//!   a backward graph (saved values, forward inputs and cotangents → gradients) under a
//!   [`SavePolicy`].
//! - [`Builder`]: the small typed graph builder the rules (and [`crate::optim`]) are written in.
//!
//! ```no_run
//! use kiln::autograd::{joint, partition, SavePolicy};
//! use kiln::{trace, DType, TensorType};
//! let t = trace(&[TensorType::new(DType::F32, [4, 3]), TensorType::new(DType::F32, [3])], |xs| {
//!     Ok(vec![xs[0].matmul(&xs[1])?.tanh()?.sum_all()?])
//! })?;
//! let j = joint(&t.graph, 0, &[1])?;          // outputs: loss, d loss / d xs[1]
//! let split = partition(&j, 2, 1, SavePolicy::RecomputeElementwise)?;
//! println!("forward:\n{}\nbackward:\n{}", split.forward, split.backward);
//! # Ok::<(), kiln::Error>(())
//! ```

mod builder;
mod grad;
mod partition;
pub mod rules;

pub use builder::Builder;
pub use grad::joint;
pub use partition::{partition, BackwardInput, SavePolicy, Split};
pub use rules::vjp;
