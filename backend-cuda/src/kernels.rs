//! The CUDA C kernels (`kernels.cu`): compiled once per process by NVRTC for the device's
//! architecture, or, where libnvrtc is missing, loaded from the bundled PTX (`kernels.ptx`,
//! generated from the same source for compute_80 by NVRTC 13.0; a test checks it is current).
//! Also the one place kernels are launched ([`launch_now`]; the backend records launches and
//! runs them through it, see `step`).

use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig};
use cudarc::nvrtc::{CompileOptions, Ptx};
use spark_core::Result;

use crate::device::{err, guard};

/// The kernel source.
pub const SOURCE: &str = include_str!("kernels.cu");
/// PTX of [`SOURCE`] for compute_80, used when NVRTC is not available.
pub const BUNDLED_PTX: &str = include_str!("kernels.ptx");
/// NVRTC options (no fused multiply-add contraction, so the elementwise ops round exactly as
/// backend-cpu's scalar code does).
pub const NVRTC_FLAGS: &[&str] = &["--fmad=false", "-default-device"];
/// [`Kernels::source`] when NVRTC compiled the kernels for the device.
pub const NVRTC_SOURCE: &str = "NVRTC";
/// The architecture of the bundled PTX.
pub const BUNDLED_ARCH: &str = "compute_80";

/// Threads per block of the row and elementwise kernels.
pub const THREADS: u32 = 256;
/// Threads per block of the GEMV kernels (`GEMV_WARPS` warps in kernels.cu).
pub const GEMV_THREADS: u32 = 128;
/// Threads per block of the attention kernels (`ATTN_THREADS` in kernels.cu).
pub const ATTN_THREADS: u32 = 128;
/// Words of one chunk's entry in a batched attention launch (`ATTN_ENTRY` in kernels.cu).
pub const ATTN_ENTRY: usize = 16;
/// Threads per block of `attn_flash` (`FLASH_THREADS` in kernels.cu).
pub const FLASH_THREADS: u32 = 256;
/// Query rows per block of `attn_flash` (`FLASH_ROWS` in kernels.cu).
pub const FLASH_ROWS: usize = 32;
/// Keys per tile of `attn_flash` (`FLASH_KEYS` in kernels.cu).
pub const FLASH_KEYS: usize = 32;

/// Bytes of dynamic shared memory `attn_flash` takes at `head_dim` (`FLASH_SHARED_FLOATS`).
pub fn flash_shared_bytes(head_dim: usize) -> usize {
    4 * ((FLASH_ROWS + FLASH_KEYS) * (head_dim + 1) + FLASH_ROWS * (FLASH_KEYS + 1) + 2 * FLASH_ROWS)
}

/// Largest head_dim the attention kernels take (`ATTN_MAX_D` in kernels.cu).
pub const ATTN_MAX_D: usize = 512;

/// One kernel argument. Every value is passed through a 64-bit slot: the driver copies as many
/// bytes as the kernel's parameter declares, which on this little-endian target are the low
/// bytes holding a u32/i32/f32.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    /// A device pointer.
    Ptr(u64),
    /// A pointer to element `.0` (u32) of the step's staged host data (see `step`).
    Stage(u32),
    U32(u32),
    I32(i32),
    U64(u64),
    F32(f32),
}

impl Arg {
    /// The slot's value, with staged pointers resolved against the staging buffer's address.
    pub fn slot(self, stage_base: u64) -> u64 {
        match self {
            Arg::Ptr(p) | Arg::U64(p) => p,
            Arg::Stage(off) => stage_base + 4 * off as u64,
            Arg::U32(v) => v as u64,
            Arg::I32(v) => v as u32 as u64,
            Arg::F32(v) => v.to_bits() as u64,
        }
    }
}

/// Compile `SOURCE` with NVRTC for `arch` (`compute_90`, ...) and return the PTX text.
pub fn compile(arch: &'static str) -> Result<String> {
    guard("NVRTC", || {
        let opts = CompileOptions {
            arch: Some(arch),
            options: NVRTC_FLAGS.iter().map(|s| s.to_string()).collect(),
            name: Some("kernels.cu".into()),
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| err("compiling kernels.cu", e))?;
        Ok(ptx.to_src())
    })
}

/// The `compute_XY` name NVRTC takes for a compute capability (capped at what NVRTC 13 knows).
pub fn arch_name(cc: (i32, i32)) -> &'static str {
    match cc {
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 7) => "compute_87",
        (8, 9) => "compute_89",
        (9, _) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        (m, _) if m >= 10 => "compute_100",
        _ => "compute_80",
    }
}

/// PTX compiled by NVRTC once per process and architecture.
fn ptx_for(arch: &'static str) -> Result<String> {
    static CACHE: OnceLock<Mutex<Vec<(&'static str, String)>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
    let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, p)) = c.iter().find(|(a, _)| *a == arch) {
        return Ok(p.clone());
    }
    let p = compile(arch)?;
    c.push((arch, p.clone()));
    Ok(p)
}

macro_rules! kernels {
    ($($name:ident),* $(,)?) => {
        /// Every kernel of kernels.cu, loaded into one context.
        pub struct Kernels {
            _module: Arc<CudaModule>,
            /// How the PTX was obtained (NVRTC or bundled).
            pub source: &'static str,
            $(pub $name: CudaFunction,)*
        }

        impl Kernels {
            /// Load the kernels into `ctx`: the NVRTC build for the device when `nvrtc`, falling
            /// back to the bundled PTX where NVRTC fails or its PTX does not load (a toolkit newer
            /// than the driver makes PTX the driver cannot read).
            pub fn load(ctx: &Arc<CudaContext>, cc: (i32, i32), nvrtc: bool) -> Result<Kernels> {
                if nvrtc {
                    match ptx_for(arch_name(cc)).and_then(|ptx| Self::load_ptx(ctx, ptx, NVRTC_SOURCE)) {
                        Ok(k) => return Ok(k),
                        Err(e) => eprintln!("warning: {e}; using the bundled PTX"),
                    }
                }
                let source = if nvrtc { "bundled PTX (NVRTC failed)" } else { "bundled PTX (libnvrtc not found)" };
                Self::load_ptx(ctx, BUNDLED_PTX.to_string(), source)
            }

            fn load_ptx(ctx: &Arc<CudaContext>, ptx: String, source: &'static str) -> Result<Kernels> {
                guard("loading the kernels", || {
                    let module = ctx
                        .load_module(Ptx::from_src(ptx))
                        .map_err(|e| err(&format!("loading the kernel module ({source})"), e))?;
                    Ok(Kernels {
                        $($name: module.load_function(stringify!($name)).map_err(|e| err(concat!("kernel ", stringify!($name)), e))?,)*
                        _module: module,
                        source,
                    })
                })
            }
        }
    };
}

kernels!(
    embed_f32,
    embed_bf16,
    rms_norm,
    add_rms_norm,
    rms_norm_vec,
    add_rms_norm_vec,
    rope,
    head_gate,
    gather_rows,
    geglu,
    add_inplace,
    round_inplace,
    f32_to_bf16_kernel,
    matmul_f32w,
    matmul_bf16w,
    gemv_bf16w,
    gemv_geglu_bf16w,
    gemv_qkv_rope,
    kv_append,
    attn_stats,
    attn_accum,
    attn_scores,
    attn_pv,
    attn_reduce,
    attn_scores_batch,
    attn_pv_batch,
    attn_reduce_batch,
    attn_softmax,
    attn_flash,
);

/// A launch shape.
pub fn cfg(grid: (u32, u32), block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid.0, grid.1, 1), block_dim: (block, 1, 1), shared_mem_bytes: shared }
}

/// Blocks for a grid-stride loop over `n` elements.
pub fn blocks_for(n: usize) -> u32 {
    n.div_ceil(THREADS as usize).clamp(1, 1 << 16) as u32
}

/// Launch `f` on `stream` now with `args` (which must match the kernel's parameter list),
/// staged pointers resolved against `stage_base`; with profiling, between two events. With
/// `pdl`, as a programmatic dependent launch: the kernel's blocks may be scheduled before the
/// kernel before it has finished, and wait for it in `PDL_ENTER` (kernels.cu); only for PTX
/// built for compute_90 or newer, where every kernel has that wait.
pub fn launch_now(
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    what: &str,
    c: LaunchConfig,
    args: &[Arg],
    stage_base: u64,
    pdl: bool,
) -> Result<()> {
    let mut slots: Vec<u64> = args.iter().map(|a| a.slot(stage_base)).collect();
    let mut params: Vec<*mut c_void> = slots.iter_mut().map(|s| s as *mut u64 as *mut c_void).collect();
    let t0 = crate::profile::start(stream);
    if pdl {
        use cudarc::driver::sys;
        // SAFETY: a zeroed attribute value is valid (plain integers and structs of them).
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let config = sys::CUlaunchConfig {
            gridDimX: c.grid_dim.0,
            gridDimY: c.grid_dim.1,
            gridDimZ: c.grid_dim.2,
            blockDimX: c.block_dim.0,
            blockDimY: c.block_dim.1,
            blockDimZ: c.block_dim.2,
            sharedMemBytes: c.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as for the launch below; `config` and the attribute it points to live until
        // the call returns, and the kernel (PTX for compute_90+) begins with PDL_ENTER, so no
        // block reads what the kernel before it writes until that kernel has completed.
        unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| err(&format!("launching {what}"), e))?;
    } else {
        // SAFETY: the callers pass, in order, one argument per parameter of the kernel named
        // `what` (each signature is written next to its call in lib.rs), with device pointers to
        // live buffers of the sizes the kernel indexes (checked by the callers' shape checks, and
        // kept alive until the step has run); each value is read by the driver from its 64-bit
        // slot in `slots`, alive until this call returns.
        unsafe {
            cudarc::driver::result::launch_kernel(
                f.cu_function(),
                c.grid_dim,
                c.block_dim,
                c.shared_mem_bytes,
                stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(|e| err(&format!("launching {what}"), e))?;
    }
    crate::profile::end(stream, t0, || format!("{what} [{}x{}]", c.grid_dim.0, c.grid_dim.1));
    if debug_sync() {
        stream.synchronize().map_err(|e| err(&format!("running {what} (SPARK_CUDA_DEBUG_SYNC)"), e))?;
    }
    Ok(())
}

/// `SPARK_CUDA_DEBUG_SYNC=1`: wait for every kernel, so that a fault names its kernel.
pub fn debug_sync() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPARK_CUDA_DEBUG_SYNC").is_ok_and(|v| v == "1"))
}
