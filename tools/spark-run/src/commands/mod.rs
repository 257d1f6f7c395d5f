//! One module per `spark-run` subcommand.

pub mod bench;
pub mod chat;
pub mod gen_random;
pub mod generate;
pub mod info;
pub mod logits;
pub mod quantize;
pub mod serve;
