//! `spark-run bench`: prefill (ppN) and decode (tgN) throughput, in llama-bench's spirit:
//! each test repeated `-r` times, mean and standard deviation of tokens/s reported; for decode
//! the weight bytes one step reads and the share of the machine's measured read-bandwidth
//! roofline; load time, peak and settled anonymous memory (RssAnon), how much of it and of the
//! mapped files sit on transparent huge pages; and, with `--snr`, the logit
//! SNR and greedy agreement of this (quantized) model against f32 on a fixed prompt, both as one
//! prefill step and fed one token per step (the decode path, whose kernels differ).
//! `--roofline` measures and prints the machine's read bandwidth and f32 FMA peak.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use spark_core::gguf::{is_gguf, GgufFile};
use spark_core::quant::{snr_db, QFormat, QPlan, QuantSpec};
use spark_core::sample::Xoshiro256;
use spark_core::weights::{NamedRef, Weight};
use spark_core::{Executor, LogitsMode, SeqStep};

use crate::load;
use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length of the prefill test (0 = skip).
    #[arg(short = 'p', long, default_value_t = 512)]
    pub prompt: usize,
    /// Prefill the prompt in steps of at most this many tokens, each after the cached ones (0: the
    /// whole prompt in one step). llama-bench's n_ubatch (512 by default there).
    #[arg(long, default_value_t = 0)]
    pub ubatch: usize,
    /// Tokens of the decode test (0 = skip).
    #[arg(short = 'n', long, default_value_t = 128)]
    pub n_gen: usize,
    /// Run both tests after this many tokens already in the cache (prefilled untimed, in steps
    /// of --ubatch or 512): llama-bench's -d; the tests are then named "pp512 @ d4096". The
    /// bytes-per-token and roofline columns still count the weights only, not the cache read.
    #[arg(short = 'd', long, default_value_t = 0)]
    pub depth: usize,
    /// Repetitions.
    #[arg(short = 'r', long, default_value_t = 3)]
    pub reps: usize,
    /// Untimed runs of each test before the timed ones (first-use costs: lazily loaded GPU
    /// kernels, library heuristics, page faults).
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Sequences decoded together in the decode test (total tokens/s is reported).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// One JSON object per test instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Only measure the machine: read bandwidth and f32 FMA peak on --threads.
    #[arg(long)]
    pub roofline: bool,
    /// Also report the logit SNR (dB) and greedy agreement against an f32 reference on a fixed
    /// 64-token prompt: the same checkpoint unquantized in f32 (with --quant), or --reference.
    /// Twice: the prompt as one prefill step, and fed one token per step (the decode kernels).
    #[arg(long)]
    pub snr: bool,
    /// The f32 reference checkpoint for --snr (default: --model itself, without --quant).
    #[arg(long)]
    pub reference: Option<String>,
}

/// Prefills `depth` random tokens into each of `seqs` (new sequences), untimed, in steps of
/// `ubatch` tokens (512 when 0), all sequences in each step.
fn fill(
    exec: &mut dyn Executor,
    seqs: &[u64],
    depth: usize,
    ubatch: usize,
    tok: &mut dyn FnMut() -> u32,
) -> anyhow::Result<()> {
    let step = if ubatch == 0 { 512 } else { ubatch };
    let ids: Vec<Vec<u32>> = seqs.iter().map(|_| (0..depth).map(|_| tok()).collect()).collect();
    let mut logits = vec![];
    for start in (0..depth).step_by(step) {
        let end = (start + step).min(depth);
        let steps: Vec<SeqStep> = seqs
            .iter()
            .zip(&ids)
            .map(|(&s, t)| SeqStep {
                seq_id: s,
                tokens: &t[start..end],
                start_pos: start as u32,
                logits: LogitsMode::None,
            })
            .collect();
        exec.forward(&steps, &mut logits)?;
    }
    Ok(())
}

fn stats(v: &[f64]) -> (f64, f64) {
    let m = v.iter().sum::<f64>() / v.len() as f64;
    let var = if v.len() > 1 { v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len() - 1) as f64 } else { 0.0 };
    (m, var.sqrt())
}

/// The `name:` line of a `/proc` text in `kB`, in bytes (`None` where it is missing).
fn proc_kb(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|k| k * 1024)
}

/// `MemAvailable` of this machine in bytes (`None` where /proc is missing).
fn mem_available() -> Option<u64> {
    proc_kb(&std::fs::read_to_string("/proc/meminfo").ok()?, "MemAvailable")
}

/// `RssAnon` of this process in bytes (0 where /proc is missing).
pub fn rss_anon() -> u64 {
    std::fs::read_to_string("/proc/self/status").ok().and_then(|s| proc_kb(&s, "RssAnon")).unwrap_or(0)
}

/// Bytes of this process's memory on huge pages: anonymous (`AnonHugePages`: the repacked
/// quantized weights) and file-backed mapped whole (`FilePmdMapped`: a mapped checkpoint), from
/// `/proc/self/smaps_rollup` (zeros where it is missing).
pub fn huge_page_bytes() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    (proc_kb(&s, "AnonHugePages").unwrap_or(0), proc_kb(&s, "FilePmdMapped").unwrap_or(0))
}

/// Resident bytes of this process's file mappings (`RssFile`: the mapped checkpoint, the
/// binary and its libraries; 0 where /proc is missing).
pub fn rss_file() -> u64 {
    std::fs::read_to_string("/proc/self/status").ok().and_then(|s| proc_kb(&s, "RssFile")).unwrap_or(0)
}

/// The note `bench` prints when a checkpoint served from its mapping sits mostly on small
/// pages: `served` bytes per decode step read from the mapping (the step's bytes less the
/// repacked anonymous weights), `small` resident file bytes not mapped in 2 MiB pages. With the
/// huge-page advice on, a file read into the page cache by this mapping comes in 2 MiB folios;
/// one already cached in small folios (written or copied just before: `gen-random`, a
/// download, a conversion) stays so, and decode then streams it through 4 KiB pages (bf16
/// 1.7B shape, 2 threads of an Emerald Rapids VM, tg96: a fresh copy of the checkpoint, 0 GB on
/// huge pages, median 6.05 tok/s against 6.56 for the same weights on 3.3 GB of huge pages,
/// slower in 7 of 8 alternations; docs/BENCHMARKS.md, session 48).
pub fn small_page_note(served: u64, small: u64) -> Option<String> {
    const MIN_SERVED: u64 = 256 << 20;
    (spark_core::memory::huge_pages_enabled() && !thp_disabled() && served >= MIN_SERVED && small >= served / 4).then(
        || {
            format!(
                "note: {:.2} GB of the mapped files sit on small pages, so decode reads them through 4 KiB pages, \
                 slower than it can. If the page cache held the checkpoint in small folios before it was mapped \
                 (as right after the file was written or copied), evicting it (`vmtouch -e FILE`, or `echo 1 > \
                 /proc/sys/vm/drop_caches` as root) lets the next run read it back in 2 MiB pages, where the kernel \
                 and file system keep files in huge pages.",
                small as f64 / 1e9
            )
        },
    )
}

/// Whether transparent huge pages are off system-wide (`never` in
/// `/sys/kernel/mm/transparent_hugepage/enabled`; false where the file is missing): then no
/// eviction brings them and the small-page note would mislead.
fn thp_disabled() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").is_ok_and(|s| s.contains("[never]"))
}

/// Samples RssAnon every few milliseconds in a background thread and keeps the peak.
struct PeakRss {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PeakRss {
    fn start() -> PeakRss {
        let peak = Arc::new(AtomicU64::new(rss_anon()));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (peak.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(rss_anon(), Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        });
        PeakRss { peak, stop, thread: Some(thread) }
    }
    fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.peak.load(Ordering::Relaxed).max(rss_anon())
    }
}

/// How the serving backend holds quantized matrices, for the bytes one decode step reads.
#[derive(Debug, Clone, Copy)]
pub struct Holding {
    /// Group scales and biases held as f16 where they fit.
    pub f16_sides: bool,
    /// int4 in groups of 32 whose scales are integer multiples of one unit per super-block read
    /// as those integers (a byte per group, an f32 unit per super-block) and the biases, never
    /// the scales (the CPU backend's AVX2 level: `QMat::for_level`).
    pub sub_scales: bool,
    /// int4 in groups of 32 whose scales and biases lie on power-of-two grids (what `spark-run
    /// quantize` writes), rows a multiple of 256 columns, read as a byte per group for each and
    /// a byte per super-block for each unit (the CPU backend's VNNI level: `QMat::for_level`).
    pub grid_sides: bool,
}

/// How a backend that holds f16 sides and no sub-scales or grids holds quantized matrices.
pub const PLAIN_HOLDING: Holding = Holding { f16_sides: true, sub_scales: false, grid_sides: false };

/// Bytes of a `[rows, cols]` int4 matrix in groups of 32 with its sides on grids
/// ([`Holding::grid_sides`]): the values, `k` of the scales and of the biases, and an exponent
/// per super-block for each.
fn grid_bytes(rows: usize, cols: usize, bias: bool) -> usize {
    let (ng, sides) = (cols / 32, 1 + usize::from(bias));
    rows * (cols / 2 + sides * (ng + ng / 8))
}

/// Bytes of a `[rows, cols]` int4 matrix in groups of 32 read through its sub-scales
/// ([`Holding::sub_scales`]): the values, `k`, the units and the biases (`side_bytes` each);
/// and the bytes of its scales, held (for the dequantizing paths) but not read.
fn sub_scaled_bytes(rows: usize, cols: usize, side_bytes: usize) -> (usize, usize) {
    let ng = cols / 32;
    (rows * (cols / 2 + ng + 4 * ng.div_ceil(8) + side_bytes * ng), rows * ng * side_bytes)
}

/// What serving a checkpoint takes: [`weight_plan`].
pub struct WeightPlan {
    /// Weight bytes one decode step reads.
    pub read: f64,
    /// Weight bytes held (`read` and scales the kernels do not read).
    pub held: f64,
    /// `int6-g32+int4-g32+bias (act bf16)`, `bf16`, ...
    pub precision: String,
}

/// Weight bytes one decode step reads (every matrix once, the tied embedding once as the head;
/// norms included) and held, and a precision label, from the checkpoint as it will be served
/// (`hold`).
///
/// A GGUF file is counted from its tensor headers ([`spark_core::gguf::GgmlType::served_plan`]), without
/// converting its blocks; its K-quants' group scales count as f16 when `f16_sides`, as the
/// backend holds them when they fit an f16 (`QTensor::sides_fit_f16`, true of real files), and
/// Q4_K through its sub-scales with f32 biases when `sub_scales`
/// ([`spark_core::gguf::GgmlType::integer_sub_scales`]). The int4 that `spark-run quantize` writes, or that
/// `--quant` makes while loading, in groups of 32 has sub-scales by construction (and f16
/// sides); other int4 files are checked.
pub fn weight_plan(path: &Path, quant: Option<QuantSpec>, compute: &str, hold: Holding) -> Result<WeightPlan> {
    let f16_sides = hold.f16_sides;
    // int4 in groups of 32 with biases, rows a multiple of 64 columns (no padding).
    let sub_plan = |p: &QPlan, cols: usize| {
        hold.sub_scales && p.format == QFormat::I4 && p.group == 32 && p.bias && cols.is_multiple_of(64)
    };
    // The same with grids: whole super-blocks.
    let grid_plan = |p: &QPlan, cols: usize| {
        hold.grid_sides && p.format == QFormat::I4 && p.group == 32 && p.bias && cols.is_multiple_of(256)
    };
    let gguf = if is_gguf(path) { Some(GgufFile::open(path)?) } else { None };
    let (n_layers, weights) = match &gguf {
        Some(f) => (f.config()?.n_layers, None),
        None => {
            let (cfg, w) = load::open_weights(path)?;
            (cfg.n_layers, Some(w))
        }
    };
    let quant = quant.map(|s| s.for_layers(n_layers));
    let (mut bytes, mut unread) = (0usize, 0usize);
    let mut kinds: Vec<String> = vec![];
    let mut note = |k: String| {
        if !kinds.contains(&k) {
            kinds.push(k);
        }
    };
    // A float matrix or vector: `stored` bytes as they are, or quantized while loading.
    let float = |name: &str, shape: &[usize], stored: usize, note: &mut dyn FnMut(String)| -> Result<(usize, usize)> {
        let matrix = shape.len() == 2 && !name.ends_with("g_proj.weight");
        Ok(match quant {
            Some(spec) if matrix => {
                let (rows, cols) = (shape[0], shape[1]);
                let plan = spec.plan(name, cols)?;
                note(plan.label(cols));
                if sub_plan(&plan, cols) {
                    sub_scaled_bytes(rows, cols, 2)
                } else if grid_plan(&plan, cols) {
                    (grid_bytes(rows, cols, true), 0)
                } else {
                    (plan.nbytes_served(rows, cols, f16_sides), 0)
                }
            }
            _ => {
                if matrix {
                    note(compute.to_string());
                }
                (stored, 0)
            }
        })
    };
    if let Some(f) = &gguf {
        for (name, t) in f.checkpoint_tensors(n_layers) {
            let shape = t.shape();
            let (read, held_only) = match t.kind.served_plan() {
                Some(plan) if shape.len() == 2 => {
                    note(plan.label(shape[1]));
                    if t.kind.integer_sub_scales() && sub_plan(&plan, shape[1]) {
                        // Q4_K's scales and biases (`d * sc`, `-dmin * m`) are not f16 values:
                        // held as f32.
                        sub_scaled_bytes(shape[0], shape[1], 4)
                    } else {
                        (plan.nbytes_served(shape[0], shape[1], f16_sides), 0)
                    }
                }
                _ => float(&name, &shape, t.nbytes(), &mut note)?,
            };
            bytes += read;
            unread += held_only;
        }
    }
    if let Some(w) = &weights {
        for (name, r) in w.named() {
            let (read, held_only) = match r {
                NamedRef::T(t) => (t.bytes().len(), 0),
                NamedRef::W(Weight::Quant(q)) => {
                    let plan = QPlan { format: q.format, group: q.group, bias: q.bias.is_some() };
                    note(plan.label(q.cols));
                    if sub_plan(&plan, q.cols) && cpu_compact_form(q, false) {
                        sub_scaled_bytes(q.rows, q.cols, if q.half_sides() { 2 } else { 4 })
                    } else if grid_plan(&plan, q.cols) && cpu_compact_form(q, true) {
                        (grid_bytes(q.rows, q.cols, true), 0)
                    } else {
                        (q.nbytes_served(f16_sides), 0)
                    }
                }
                NamedRef::W(Weight::Float(t)) => float(&name, &t.shape, t.bytes().len(), &mut note)?,
            };
            bytes += read;
            unread += held_only;
        }
    }
    let act = if kinds.iter().any(|k| k.starts_with("int")) { format!(" (act {compute})") } else { String::new() };
    Ok(WeightPlan { read: bytes as f64, held: (bytes + unread) as f64, precision: format!("{}{act}", kinds.join("+")) })
}

/// Logits over a fixed prompt for every position.
fn all_logits(exec: &mut dyn spark_core::Executor, ids: &[u32]) -> Result<Vec<f32>> {
    let mut out = vec![0.0f32; ids.len() * exec.info().vocab];
    exec.forward(&[SeqStep { seq_id: 9_000_001, tokens: ids, start_pos: 0, logits: LogitsMode::All }], &mut out)?;
    exec.release(9_000_001);
    Ok(out)
}

/// The logits of `ids` fed one token per step (cached attention and the decode kernels: on the
/// CPU the GEMVs with their own activation quantization), one row per token.
fn step_logits(exec: &mut dyn spark_core::Executor, ids: &[u32]) -> Result<Vec<f32>> {
    const SEQ: u64 = 9_000_002;
    let v = exec.info().vocab;
    let mut out = vec![0.0f32; ids.len() * v];
    let r = ids.iter().zip(out.chunks_mut(v)).enumerate().try_for_each(|(i, (id, o))| {
        let step =
            SeqStep { seq_id: SEQ, tokens: std::slice::from_ref(id), start_pos: i as u32, logits: LogitsMode::Last };
        exec.forward(&[step], o)
    });
    exec.release(SEQ);
    r?;
    Ok(out)
}

/// Logit SNR (dB) of `test` against `reference` and how many of their `n` rows agree on the
/// top token.
fn fidelity(reference: &[f32], test: &[f32], v: usize) -> (f64, usize) {
    let agree = reference.chunks(v).zip(test.chunks(v)).filter(|(r, t)| argmax(r) == argmax(t)).count();
    (snr_db(reference, test), agree)
}

/// Tokens of the fixed `--snr` prompt.
const SNR_TOKENS: usize = 64;

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0
}

/// How the CPU backend holds quantized matrices on this CPU.
#[cfg(feature = "cpu")]
pub fn cpu_holding() -> Holding {
    use backend_cpu::kernels::{qmatmul::QMat, QSimd};
    let qs = QSimd::detect();
    Holding {
        f16_sides: QMat::f16_sides_pay(),
        sub_scales: QMat::sub_scales_at(qs),
        grid_sides: QMat::grid_sides_at(qs),
    }
}

#[cfg(not(feature = "cpu"))]
pub fn cpu_holding() -> Holding {
    PLAIN_HOLDING
}

/// Whether the CPU backend would read `q`'s sides in a compact form: on grids (`grid`: its VNNI
/// and AMX INT8 levels) or through integer sub-scales (its AVX2 level).
#[cfg(feature = "cpu")]
fn cpu_compact_form(q: &spark_core::quant::QTensor, grid: bool) -> bool {
    use backend_cpu::kernels::qmatmul::QMat;
    if grid {
        QMat::has_grid_form(q)
    } else {
        QMat::has_sub_scale_form(q)
    }
}

#[cfg(not(feature = "cpu"))]
fn cpu_compact_form(_q: &spark_core::quant::QTensor, _grid: bool) -> bool {
    false
}

#[cfg(feature = "cpu")]
fn roofline(threads: usize) -> (f64, f64) {
    (backend_cpu::roofline::read_bandwidth(threads, 1 << 30, 3), backend_cpu::roofline::fma_peak(threads))
}

#[cfg(not(feature = "cpu"))]
fn roofline(_threads: usize) -> (f64, f64) {
    (0.0, 0.0)
}

struct Row {
    test: String,
    mean: f64,
    sd: f64,
    batch: usize,
    bytes_per_token: Option<f64>,
    roofline_pct: Option<f64>,
}

pub fn run(a: BenchArgs) -> Result<()> {
    anyhow::ensure!(a.reps > 0, "-r must be at least 1");
    anyhow::ensure!(a.batch > 0, "--batch must be at least 1");
    let threads = a.model.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if a.roofline {
        let (bw, peak) = roofline(threads);
        anyhow::ensure!(bw > 0.0, "--roofline needs the CPU backend linked in (feature cpu)");
        if a.json {
            println!(
                "{}",
                serde_json::json!({"test": "roofline", "threads": threads, "read_bw_gb_s": bw / 1e9, "fma_peak_gflop_s": peak / 1e9})
            );
        } else {
            println!("threads {threads}: read bandwidth {:.1} GB/s, f32 FMA peak {:.1} GFLOP/s", bw / 1e9, peak / 1e9);
        }
        return Ok(());
    }
    let rss0 = rss_anon();
    let sampler = PeakRss::start();
    let mut l = load::load(&a.model)?;
    let load_peak = sampler.stop();
    let cfg = l.config.clone();
    let info = l.exec.info();
    let need = a.n_gen.checked_add(1).and_then(|g| a.depth.checked_add(a.prompt.max(g)));
    anyhow::ensure!(need.is_some_and(|n| n < info.ctx), "-d plus -p or -n must fit in --ctx-size {}", info.ctx);
    anyhow::ensure!(
        a.warmup.checked_add(a.reps).is_some_and(|n| n <= 1_000_000),
        "--warmup plus -r ({} + {}) must be at most 1000000",
        a.warmup,
        a.reps
    );
    anyhow::ensure!(
        !a.snr || info.ctx >= SNR_TOKENS,
        "--snr feeds a {SNR_TOKENS}-token prompt: it needs --ctx-size {SNR_TOKENS} or more (got {})",
        info.ctx
    );
    // The decode test's sequences hold their KV together: refuse a batch the memory cannot hold
    // (it was killed by the kernel's OOM killer, with no message).
    if a.n_gen > 0 {
        let kv_dtype =
            if info.dtype == spark_core::DType::F32 { spark_core::DType::F32 } else { spark_core::DType::BF16 };
        // KV grows in blocks of 256 positions on the CPU; a step's f32 buffers per row: the
        // logits and the layer's activations (a few of hidden, intermediate and QKV width).
        let len = (a.depth + a.n_gen + 1).div_ceil(256).saturating_mul(256).min(info.ctx);
        let rows = 4 * (cfg.vocab + 3 * cfg.intermediate + 4 * cfg.hidden + cfg.qkv_dim());
        let per = spark_core::kv::sequence_kv_bytes(&cfg, info.ctx, kv_dtype, len) + rows;
        let want = (per as u128) * (a.batch as u128);
        if let Some(avail) = mem_available() {
            anyhow::ensure!(
                want <= avail as u128,
                "--batch {} needs about {:.1} GiB for its sequences' KV cache and step buffers ({:.2} MiB per \
                 sequence at {} tokens); {:.1} GiB of memory is available",
                a.batch,
                want as f64 / (1u64 << 30) as f64,
                per as f64 / (1u64 << 20) as f64,
                len,
                avail as f64 / (1u64 << 30) as f64
            );
        }
    }
    let mut rng = Xoshiro256::new(42);
    let mut tok = || 3 + (rng.next_u64() % (cfg.vocab as u64 - 3)) as u32;
    let model_name = l.dir.file_name().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    let quant = load::quant(&a.model)?;
    let hold = if info.backend == "cpu" { cpu_holding() } else { PLAIN_HOLDING };
    let WeightPlan { read: bytes_per_token, precision, .. } = weight_plan(&l.dir, quant, info.dtype.name(), hold)?;
    // The measured ceiling is host memory: meaningful for the CPU backend only (a GPU's HBM
    // roofline comes from its specification; see docs/BENCHMARKS.md).
    let (bw, _) = if a.n_gen > 0 && info.backend == "cpu" { roofline(l.threads) } else { (0.0, 0.0) };

    let mut rows = vec![];
    let mut seq = 100u64;
    let at = if a.depth > 0 { format!(" @ d{}", a.depth) } else { String::new() };
    if a.prompt > 0 {
        let mut logits = vec![0.0f32; cfg.vocab];
        let mut v = vec![];
        for rep in 0..a.warmup + a.reps {
            let ids: Vec<u32> = (0..a.prompt).map(|_| tok()).collect();
            seq += 1;
            fill(l.exec.as_mut(), &[seq], a.depth, a.ubatch, &mut tok)?;
            let t = Instant::now();
            let step = if a.ubatch == 0 { ids.len() } else { a.ubatch };
            for (c, part) in ids.chunks(step).enumerate() {
                let start_pos = u32::try_from(a.depth + c * step)?;
                l.exec.forward(
                    &[SeqStep { seq_id: seq, tokens: part, start_pos, logits: LogitsMode::Last }],
                    &mut logits,
                )?;
            }
            if rep >= a.warmup {
                v.push(a.prompt as f64 / t.elapsed().as_secs_f64());
            }
            l.exec.release(seq);
        }
        let (mean, sd) = stats(&v);
        rows.push(Row {
            test: format!("pp{}{at}", a.prompt),
            mean,
            sd,
            batch: 1,
            bytes_per_token: None,
            roofline_pct: None,
        });
    }
    if a.n_gen > 0 {
        let b = a.batch;
        let mut logits = vec![0.0f32; cfg.vocab * b];
        let mut v = vec![];
        for rep in 0..a.warmup + a.reps {
            // A warm-up run decodes a few steps only.
            let n_gen = if rep < a.warmup { a.n_gen.min(8) } else { a.n_gen };
            let seqs: Vec<u64> = (0..b as u64).map(|i| seq + 1 + i).collect();
            seq += b as u64;
            fill(l.exec.as_mut(), &seqs, a.depth, a.ubatch, &mut tok)?;
            let d = u32::try_from(a.depth)?;
            let firsts: Vec<[u32; 1]> = (0..b).map(|_| [tok()]).collect();
            let steps: Vec<SeqStep> = seqs
                .iter()
                .zip(&firsts)
                .map(|(&s, f)| SeqStep { seq_id: s, tokens: f, start_pos: d, logits: LogitsMode::Last })
                .collect();
            l.exec.forward(&steps, &mut logits)?;
            let t = Instant::now();
            for i in 0..n_gen {
                let ids: Vec<[u32; 1]> = (0..b).map(|_| [tok()]).collect();
                let steps: Vec<SeqStep> = seqs
                    .iter()
                    .zip(&ids)
                    .map(|(&s, id)| SeqStep {
                        seq_id: s,
                        tokens: id,
                        start_pos: d + (i + 1) as u32,
                        logits: LogitsMode::Last,
                    })
                    .collect();
                l.exec.forward(&steps, &mut logits)?;
            }
            if rep >= a.warmup {
                v.push((a.n_gen * b) as f64 / t.elapsed().as_secs_f64());
            }
            for s in seqs {
                l.exec.release(s);
            }
        }
        let (mean, sd) = stats(&v);
        // A step reads the weights once for the whole batch.
        let pct = (bw > 0.0).then(|| 100.0 * bytes_per_token * (mean / b as f64) / bw);
        rows.push(Row {
            test: format!("tg{}{at}", a.n_gen),
            mean,
            sd,
            batch: b,
            bytes_per_token: Some(bytes_per_token),
            roofline_pct: pct,
        });
    }
    let settled = rss_anon();
    let (huge_anon, huge_file) = huge_page_bytes();
    let file_small = rss_file().saturating_sub(huge_file);
    let served_mapped = (bytes_per_token as u64).saturating_sub(settled.saturating_sub(rss0));

    // Fidelity against f32.
    let mut snr = None;
    if a.snr {
        let mut r = Xoshiro256::new(7);
        let ids: Vec<u32> = (0..SNR_TOKENS).map(|_| 3 + (r.next_u64() % (cfg.vocab as u64 - 3)) as u32).collect();
        let test = all_logits(l.exec.as_mut(), &ids)?;
        let test_steps = step_logits(l.exec.as_mut(), &ids)?;
        drop(l.exec);
        let mut ref_args = a.model.clone();
        ref_args.quant = None;
        ref_args.quant_group = None;
        ref_args.dtype = Some("f32".into());
        if let Some(p) = &a.reference {
            ref_args.model = Some(p.clone());
        } else {
            anyhow::ensure!(
                quant.is_some(),
                "--snr needs --quant (compare against the same checkpoint in f32) or --reference PATH"
            );
        }
        let mut rl = load::load(&ref_args).context("loading the f32 reference for --snr")?;
        // One f32 reference for both: its prefill and its decode path differ by the order of
        // f32 sums only.
        let reference = all_logits(rl.exec.as_mut(), &ids)?;
        let v = cfg.vocab;
        snr = Some((fidelity(&reference, &test, v), fidelity(&reference, &test_steps, v), ids.len()));
    }

    let gb = |b: u64| b as f64 / 1e9;
    if a.json {
        if let Some(note) = small_page_note(served_mapped, file_small) {
            eprintln!("{note}");
        }
        for r in &rows {
            let mut o = serde_json::json!({"model": model_name, "backend": info.backend, "simd": l.simd,
                "precision": precision, "dtype": info.dtype.name(), "threads": l.threads, "test": r.test,
                "batch": r.batch, "tok_s_mean": r.mean, "tok_s_sd": r.sd, "reps": a.reps,
                "bytes_per_token": r.bytes_per_token, "roofline_pct": r.roofline_pct,
                "ubatch": (r.test.starts_with("pp") && a.ubatch > 0).then_some(a.ubatch), "depth": a.depth,
                "read_bw_gb_s": (bw > 0.0).then_some(bw / 1e9), "load_s": l.load_time.as_secs_f64(),
                "rss_anon_peak_gb": gb(load_peak.saturating_sub(rss0)), "rss_anon_settled_gb": gb(settled.saturating_sub(rss0)),
                "huge_pages_anon_gb": gb(huge_anon), "huge_pages_file_gb": gb(huge_file),
                "file_small_pages_gb": gb(file_small)});
            if let Some(((s, ag), (sd, agd), n)) = snr {
                o["logit_snr_db"] = serde_json::json!(s);
                o["greedy_agree"] = serde_json::json!(ag as f64 / n as f64);
                o["logit_snr_db_decode"] = serde_json::json!(sd);
                o["greedy_agree_decode"] = serde_json::json!(agd as f64 / n as f64);
            }
            println!("{o}");
        }
    } else {
        println!("| model | backend | precision | threads | test | tok/s | GB/s of weights | roofline |");
        println!("| --- | --- | --- | ---: | --- | ---: | ---: | ---: |");
        for r in &rows {
            let bw_s =
                r.bytes_per_token.map(|b| format!("{:.1}", b * r.mean / r.batch as f64 / 1e9)).unwrap_or("-".into());
            let pct = r.roofline_pct.map(|p| format!("{p:.0}%")).unwrap_or("-".into());
            let test = if r.batch > 1 { format!("{} x{}", r.test, r.batch) } else { r.test.clone() };
            let test =
                if r.test.starts_with("pp") && a.ubatch > 0 { format!("{test} (ub {})", a.ubatch) } else { test };
            println!(
                "| {model_name} | {} ({}) | {precision} | {} | {test} | {:.2} ± {:.2} | {bw_s} | {pct} |",
                info.backend, l.simd, l.threads, r.mean, r.sd
            );
        }
        println!(
            "\nload {:.2} s; RssAnon peak {:.2} GB, settled {:.2} GB; weights read per decode step {:.2} GB{}",
            l.load_time.as_secs_f64(),
            gb(load_peak.saturating_sub(rss0)),
            gb(settled.saturating_sub(rss0)),
            bytes_per_token / 1e9,
            if bw > 0.0 { format!("; measured read bandwidth {:.1} GB/s", bw / 1e9) } else { String::new() }
        );
        if huge_anon + huge_file > 0 {
            println!(
                "on transparent huge pages: {:.2} GB anonymous (repacked weights), {:.2} GB of mapped files \
                 (SPARK_HUGE_PAGES=0 turns the advice off)",
                gb(huge_anon),
                gb(huge_file)
            );
        }
        if let Some(note) = small_page_note(served_mapped, file_small) {
            println!("{note}");
        }
        if let Some(((s, ag), (sd, agd), n)) = snr {
            println!(
                "fidelity vs f32 on a fixed {n}-token prompt: logit SNR {s:.1} dB, greedy agreement {ag}/{n} \
                 (one prefill step); {sd:.1} dB, {agd}/{n} (one token per step: the decode path)"
            );
        }
    }
    Ok(())
}

#[cfg(all(test, feature = "cpu"))]
mod tests {
    use backend_cpu::kernels::{qmatmul::QMat, QSimd};
    use spark_core::quant::{quantize, QFormat, QuantSpec};

    /// The small-page note: for a checkpoint served from its mapping with a quarter or more of
    /// it on small pages, not for a mostly huge mapping, nor for weights repacked into anonymous
    /// memory (little served from the mapping), nor with the advice or the kernel's huge pages off.
    #[test]
    fn small_page_note_names_only_mappings_served_on_small_pages() {
        const GB: u64 = 1_000_000_000;
        if spark_core::memory::huge_pages_enabled() && !super::thp_disabled() {
            let note = super::small_page_note(3 * GB, 3 * GB).expect("all on small pages");
            assert!(note.contains("3.00 GB"), "{note}");
            assert!(super::small_page_note(3 * GB, GB).is_some());
            assert!(super::small_page_note(3 * GB, GB / 10).is_none(), "mostly on huge pages");
            assert!(super::small_page_note(GB / 10, GB).is_none(), "weights repacked, little served mapped");
        } else {
            assert!(super::small_page_note(3 * GB, 3 * GB).is_none(), "no huge pages asked or given: no note");
        }
    }

    /// The bytes counted for int4 read through sub-scales (AVX2 level) or on grids (VNNI, AMX INT8)
    /// are what those levels hold and read of a matrix `spark-run quantize` writes.
    #[test]
    fn compact_side_bytes_are_what_the_levels_read() {
        let (rows, cols) = (24, 2048);
        let vals: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.4) * 0.04).collect();
        let q = quantize("w", rows, cols, &vals, QuantSpec::new(QFormat::I4, Some(32))).unwrap();
        assert!(QMat::has_sub_scale_form(&q) && QMat::has_grid_form(&q));
        let m = QMat::for_level(&q, QSimd::Avx2);
        assert!(m.sub_scales().is_some() && m.half_sides());
        assert_eq!(super::sub_scaled_bytes(rows, cols, 2), (m.decode_bytes(), m.scales().nbytes()));
        // 4.875 bits per weight, against 6 with f32 scales and biases.
        assert_eq!(8 * m.decode_bytes(), rows * cols * 39 / 8);
        let m = QMat::for_level(&q, QSimd::Avx512Vnni);
        assert!(m.scales().grid().is_some());
        assert_eq!(super::grid_bytes(rows, cols, true), m.decode_bytes());
        // 4.5625 bits per weight.
        assert_eq!(16 * m.decode_bytes(), rows * cols * 73 / 8);
    }
}
