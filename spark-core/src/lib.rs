//! spark-core: the Spark-X2.5 model and engine, with no device code.
//!
//! - [`config`]: `config.json` -> validated [`config::ModelConfig`].
//! - [`dtype`], [`weights`]: memory-mapped safetensors (single or sharded) as named tensor views.
//! - [`backend`]: the op-level `Backend` trait and the step-level `Executor` trait.
//! - [`graph`]: THE hybrid decoder, written once over any `Backend`.
//! - [`kv`]: KV-cache layout (sliding layers a ring of `window`, full layers grow) and accounting.
//! - [`rope`]: per-layer-type rotary tables sized to the served context.
//! - [`sample`]: logits processors and seeded samplers.
//! - [`tokenizer`], [`chat`]: `tokenizer.json` and chat-template rendering.
//! - [`engine`]: a simple generation loop over an `Executor`.
//! - [`error`]: the error type shared by all of the above.

pub mod chat;
pub mod sample;
pub mod tokenizer;
