//! # kiln
//!
//! Trace a model's tensor operations into a typed graph, differentiate it ahead of time,
//! compile each graph once to XLA (through the PJRT C API) and replay the cached executable.
//!
//! The pipeline, one module per stage:
//!
//! - [`mod@trace`]: [`Tensor`] runs eagerly on libtorch, or records into a graph inside [`trace()`].
//! - [`ir`]: the typed graph ([`ir::Graph`]) over a closed op set ([`ir::Op`]).
//! - [`passes`]: graph rewrites (CSE, DCE, output dedup).
//! - [`autograd`]: VJP rules, the joint forward+backward graph, forward/backward partition.
//! - [`optim`]: SGD, Adam, AdamW as optimizer graphs (and eager updates).
//! - [`backend`]: the [`backend::Backend`] trait; `eager` (tch interpreter) and `xla` (PJRT);
//!   [`backend::registry`] picks one by name (from configuration).
//! - [`compile()`]: the entry point: trace once per input signature, compile, replay.
//! - [`inspect`]: every stage of a compiled program as text (graph, DOT, StableHLO, optimized
//!   HLO); `KILN_DUMP=DIR` writes them for every compile.
//! - [`nn`]: modules, functional ops ([`nn::functional`]), the [`nn::ParamStore`] and
//!   safetensors weights.
//! - [`zoo`]: the benchmark's models (torchvision CNNs, BERT, ViT, LinearModel); the default
//!   cargo feature `zoo` (leave it out with `default-features = false` to get only the
//!   compiler).
//!
//! The benchmark harness is the workspace's other crate, `kiln-bench`
//! (`cargo run --release -p kiln-bench -- --help`).
//!
//! ```no_run
//! use kiln::backend::xla::XlaBackend;
//! use kiln::nn::{Linear, Module, ParamStore, Relu, Sequential};
//! use kiln::{compile, Tensor};
//!
//! let store = ParamStore::with_seed(0);
//! let root = store.root();
//! let model = Sequential::new()
//!     .add(Linear::new(&root.sub("0"), 10, 10, true)?)
//!     .add(Relu)
//!     .add(Linear::new(&root.sub("2"), 10, 10, true)?);
//! let x = Tensor::randn(&[2, 10], 1)?;
//! let eager = model.forward(&x)?;                       // runs on libtorch
//! let mut f = compile(XlaBackend::new()?, move |xs: &[Tensor]| Ok(vec![model.forward(&xs[0])?]));
//! let compiled = f.run(&[x])?;                          // traced, compiled once, replayed
//! # Ok::<(), kiln::Error>(())
//! ```
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod autograd;
pub mod backend;
pub mod compile;
pub mod error;
pub mod inspect;
pub mod ir;
pub mod nn;
pub mod optim;
pub mod passes;
pub mod runtime;
pub mod trace;
pub mod train;
#[cfg(feature = "zoo")]
pub mod zoo;

pub use compile::{compile, compile_with, CompiledFn, Program, SharedFn, TraceMode};
pub use error::{Error, Result};
pub use ir::{DType, Shape, TensorType};
pub use runtime::{Runtime, Stats};
pub use trace::{trace, Tensor};
