//! spark-core: the Spark-X2.5 model and engine, with no device code.
//!
//! - [`config`]: `config.json` -> validated [`config::ModelConfig`].
//! - [`dtype`], [`weights`]: memory-mapped safetensors (single or sharded) as named tensor views.
//! - [`quant`]: int8/int4 quantized matrices, their reference (de)quantization and storage.
//! - [`gguf`]: llama.cpp GGUF files (`spark2_5`): config, weights (quantized kinds converted
//!   losslessly to [`quant`] matrices), tokenizer and chat template.
//! - [`backend`]: the op-level `Backend` trait and the step-level `Executor` trait.
//! - [`graph`]: THE hybrid decoder, written once over any `Backend`.
//! - [`memory`]: giving freed heap memory back to the OS while a model loads.
//! - [`kv`]: KV-cache layout (sliding layers a ring of `window`, full layers grow) and accounting.
//! - [`rope`]: per-layer-type rotary tables sized to the served context.
//! - [`sample`]: logits processors and seeded samplers.
//! - [`constraint`]: constrained generation (JSON mode): which tokens may come next.
//! - [`tokenizer`], [`chat`]: `tokenizer.json` and chat-template rendering.
//! - [`engine`]: the generation loop over an `Executor`.
//! - [`plugin`]: the backend plugin C ABI, its export macro and the loader.
//! - [`error`]: the error type shared by all of the above.

pub mod backend;
pub mod chat;
pub mod config;
pub mod constraint;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod graph;
pub mod kv;
pub mod memory;
pub mod plugin;
pub mod quant;
pub mod rope;
pub mod sample;
pub mod scheduler;
pub mod tokenizer;
pub mod weights;

pub use backend::{Backend, Executor, LogitsMode, SeqStep};
pub use config::ModelConfig;
pub use dtype::DType;
pub use error::{Error, ErrorKind, Result};
pub use graph::{Model, ModelOptions};
