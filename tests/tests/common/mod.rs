//! Helpers shared by the cross-crate tests: repository paths, golden tensors and comparisons,
//! all from the spark-tests library (src/lib.rs), which the backend crates' suites use too.
#![allow(unused_imports)]

pub use spark_tests::{
    argmax, gguf_metadata, gguf_tensor_name, load_golden, max_abs_diff, mean_abs_diff, repo, Gold, Golden,
};
