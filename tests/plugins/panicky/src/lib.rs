//! A test plugin whose executor panics inside `forward` (and whose `fork` fails normally), built
//! with spark-core's export macro. The host must get an error code and a message, never an
//! unwind across the C ABI, and carry on.

use std::path::Path;

use spark_core::backend::ExecutorInfo;
use spark_core::plugin::{BackendFactory, DeviceInfo, OpenOptions};
use spark_core::{DType, Error, Executor, Result, SeqStep};

/// The test backend.
pub const FACTORY: BackendFactory = BackendFactory { name: c"panicky", probe, open };

spark_core::export_backend!(FACTORY);

fn probe() -> Vec<DeviceInfo> {
    vec![DeviceInfo {
        index: 0,
        name: "nothing".into(),
        capabilities: "panics".into(),
        score: 1,
        usable: true,
        ..Default::default()
    }]
}

fn open(_dir: &Path, _o: &OpenOptions) -> Result<Box<dyn Executor>> {
    Ok(Box::new(Panicky))
}

struct Panicky;

impl Executor for Panicky {
    fn info(&self) -> ExecutorInfo {
        ExecutorInfo { backend: "panicky".into(), vocab: 4, ctx: 16, dtype: DType::F32 }
    }
    fn forward(&mut self, batch: &[SeqStep<'_>], _out: &mut [f32]) -> Result<()> {
        panic!("deliberate panic in forward ({} sequences)", batch.len())
    }
    fn release(&mut self, _seq_id: u64) {}
    fn fork(&mut self, src: u64, _dst: u64) -> Result<()> {
        Err(Error::invalid(format!("fork: no sequence {src}")))
    }
    fn seq_len(&self, _seq_id: u64) -> Option<usize> {
        None
    }
    fn kv_bytes(&self) -> usize {
        0
    }
}
