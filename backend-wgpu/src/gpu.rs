//! The device context: adapter discovery, the device and queue, cached pipelines and bind
//! groups, pooled buffers, and the recorder that batches a whole step into one submit.
//!
//! Every op is recorded as one compute pass into a pending command encoder; its parameters go
//! into a host-side uniform arena and its index data (ids, positions, rows) into a host-side
//! storage arena, both uploaded with one `write_buffer` each just before the encoder is
//! submitted. Submission happens only when the host needs results ([`Gpu::read`]) or an arena
//! is full, so a decode step is one submit. Activation buffers come from a size-class pool and
//! bind groups are cached by the identity of the buffers they bind, so a steady decode loop
//! creates neither.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use spark_core::{Error, ErrorKind, Result};

use crate::shaders::{Access, Kernel};

/// Bytes of one op's uniform parameter block (16 words).
pub const PARAM_BYTES: u64 = 64;
/// Uniform arena: this many op slots per submit at most.
const PARAM_SLOTS: u64 = 2048;
/// Initial size of the index-data arena.
const DATA_INITIAL: u64 = 64 * 1024;
/// Free activation buffers kept per size class (a step needs a few of each).
const POOL_PER_CLASS: usize = 8;
/// Bind groups kept before the cache is cleared.
const BIND_CACHE_MAX: usize = 8192;

/// An adapter found by [`adapters`].
pub struct Found {
    pub adapter: wgpu::Adapter,
    pub info: wgpu::AdapterInfo,
}

/// The Vulkan/Metal/DX12 adapters of this machine (GL is not used), in enumeration order.
pub fn adapters() -> Vec<Found> {
    let backends = wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12;
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = backends;
    let instance = wgpu::Instance::new(desc);
    pollster::block_on(instance.enumerate_adapters(backends))
        .into_iter()
        .map(|adapter| {
            let info = adapter.get_info();
            Found { adapter, info }
        })
        .collect()
}

fn backend_error(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::Backend, format!("wgpu: {}", what.into()))
}

/// A GPU buffer with a process-unique id (the bind-group cache key). Pooled buffers go back to
/// the pool when dropped; others are forgotten by the bind-group cache.
pub struct GpuBuf {
    pub id: u64,
    pub buf: wgpu::Buffer,
    pub size: u64,
    pooled: bool,
    released: Arc<Mutex<Vec<Released>>>,
}

impl Drop for GpuBuf {
    fn drop(&mut self) {
        let r =
            if self.pooled { Released::Pool(self.id, self.size, self.buf.clone()) } else { Released::Gone(self.id) };
        if let Ok(mut v) = self.released.lock() {
            v.push(r);
        }
    }
}

enum Released {
    Pool(u64, u64, wgpu::Buffer),
    Gone(u64),
}

struct Pipe {
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
    has_data: bool,
}

#[derive(Clone, Copy, Hash, PartialEq, Eq)]
struct BindKey {
    kernel: Kernel,
    params: u64,
    data: (u64, u64),
    bufs: [u64; 5],
}

/// A host-side staging area uploaded to one device buffer before each submit.
struct Arena {
    buf: wgpu::Buffer,
    id: u64,
    cap: u64,
    host: Vec<u8>,
}

struct Recorder {
    encoder: Option<wgpu::CommandEncoder>,
    params: Arena,
    data: Arena,
    binds: HashMap<BindKey, wgpu::BindGroup>,
    pool: HashMap<u64, Vec<(u64, wgpu::Buffer)>>,
    readback: Option<(wgpu::Buffer, u64)>,
}

/// The device and everything cached on it.
pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    pub subgroups: bool,
    pub shader_f16: bool,
    pipes: Mutex<HashMap<Kernel, Arc<Pipe>>>,
    rec: Mutex<Recorder>,
    released: Arc<Mutex<Vec<Released>>>,
    next_id: AtomicU64,
    error: Arc<Mutex<Option<String>>>,
    align_uniform: u64,
    align_storage: u64,
    /// `SPARK_WGPU_PROFILE=1`: wait for each kernel and total the time per kernel (printed when
    /// the device is dropped). Serialises everything: for finding hot kernels only.
    profile: Option<Mutex<HashMap<String, (u64, std::time::Duration)>>>,
}

impl Gpu {
    /// Open adapter `index` of [`adapters`]. `subgroups`: use subgroup reductions where the
    /// adapter has them (`false` forces the shared-memory fallback).
    pub fn open(index: usize, subgroups: bool) -> Result<Gpu> {
        let mut found = adapters();
        if found.is_empty() {
            return Err(Error::unsupported(
                "wgpu backend: no Vulkan/Metal/DX12 adapter found (on Linux, install a Vulkan driver, e.g. mesa-vulkan-drivers)",
            ));
        }
        if index >= found.len() {
            return Err(Error::invalid(format!(
                "wgpu backend: device {index} does not exist ({} adapter(s): 0..{})",
                found.len(),
                found.len() - 1
            )));
        }
        let Found { adapter, info } = found.swap_remove(index);
        let have = adapter.features();
        let mut want = wgpu::Features::empty();
        let subgroups = subgroups && have.contains(wgpu::Features::SUBGROUP);
        if subgroups {
            want |= wgpu::Features::SUBGROUP;
        }
        let shader_f16 = have.contains(wgpu::Features::SHADER_F16);
        // Ask for everything the adapter offers, so big weights and activations fit one binding.
        let limits = adapter.limits();
        let desc = wgpu::DeviceDescriptor {
            label: Some("spark"),
            required_features: want,
            required_limits: limits.clone(),
            ..Default::default()
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&desc))
            .map_err(|e| backend_error(format!("cannot open {} ({:?}): {e}", info.name, info.backend)))?;
        let error: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
        let slot = error.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            if let Ok(mut s) = slot.lock() {
                s.get_or_insert_with(|| e.to_string());
            }
        }));
        let align_uniform = u64::from(limits.min_uniform_buffer_offset_alignment).max(PARAM_BYTES);
        let align_storage = u64::from(limits.min_storage_buffer_offset_alignment).max(4);
        let next_id = AtomicU64::new(1);
        let arena = |usage, cap: u64, label| {
            let buf = device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: cap,
                usage: usage | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            Arena { buf, id: next_id.fetch_add(1, Ordering::Relaxed), cap, host: Vec::new() }
        };
        let params = arena(wgpu::BufferUsages::UNIFORM, align_uniform * PARAM_SLOTS, "spark params");
        let data = arena(wgpu::BufferUsages::STORAGE, DATA_INITIAL, "spark index data");
        Ok(Gpu {
            rec: Mutex::new(Recorder {
                encoder: None,
                params,
                data,
                binds: HashMap::new(),
                pool: HashMap::new(),
                readback: None,
            }),
            device,
            queue,
            info,
            limits,
            subgroups,
            shader_f16,
            pipes: Mutex::new(HashMap::new()),
            released: Arc::new(Mutex::new(Vec::new())),
            next_id,
            error,
            align_uniform,
            align_storage,
            profile: std::env::var("SPARK_WGPU_PROFILE").is_ok_and(|v| v == "1").then(|| Mutex::new(HashMap::new())),
        })
    }

    /// Largest byte size one storage binding may have.
    pub fn max_binding(&self) -> u64 {
        self.limits.max_storage_buffer_binding_size.min(self.limits.max_buffer_size)
    }

    fn lock(&self) -> Result<MutexGuard<'_, Recorder>> {
        self.rec.lock().map_err(|_| backend_error("recorder lock poisoned by an earlier panic"))
    }

    /// The first device error since the last check, as an error.
    pub fn check_error(&self) -> Result<()> {
        match self.error.lock().ok().and_then(|mut e| e.take()) {
            Some(msg) => Err(backend_error(msg)),
            None => Ok(()),
        }
    }

    fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// A buffer (not pooled) of `len` bytes (padded to a multiple of 4), filled by `fill`, which
    /// is given a writer `(offset, bytes)` into the mapped buffer.
    pub fn buffer_init(
        &self,
        label: &str,
        len: u64,
        fill: impl FnOnce(&mut dyn FnMut(usize, &[u8])),
    ) -> Result<GpuBuf> {
        let size = len.max(4).div_ceil(4) * 4;
        if size > self.limits.max_buffer_size {
            return Err(Error::new(
                ErrorKind::OutOfMemory,
                format!(
                    "wgpu: {label} needs {size} bytes, more than the adapter's largest buffer ({})",
                    self.limits.max_buffer_size
                ),
            ));
        }
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: true,
        });
        {
            let mut view = buf
                .slice(..)
                .get_mapped_range_mut()
                .map_err(|e| backend_error(format!("cannot map the upload buffer of {label}: {e}")))?;
            let mut write = |off: usize, bytes: &[u8]| view.slice(off..off + bytes.len()).copy_from_slice(bytes);
            fill(&mut write);
        }
        buf.unmap();
        Ok(GpuBuf { id: self.new_id(), buf, size, pooled: false, released: self.released.clone() })
    }

    /// A zeroed buffer of at least `bytes` (not pooled: KV caches).
    pub fn buffer_zeroed(&self, label: &str, bytes: u64) -> Result<GpuBuf> {
        let size = bytes.max(4).div_ceil(4) * 4;
        if size > self.max_binding() {
            return Err(Error::new(
                ErrorKind::OutOfMemory,
                format!("wgpu: {label} needs {size} bytes, more than one binding may hold ({})", self.max_binding()),
            ));
        }
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        Ok(GpuBuf { id: self.new_id(), buf, size, pooled: false, released: self.released.clone() })
    }

    /// A pooled activation buffer of at least `bytes`, zeroed (by a recorded clear when reused).
    pub fn buffer_pooled(&self, bytes: u64) -> Result<GpuBuf> {
        let size = bytes.max(256).next_power_of_two();
        if size > self.max_binding() {
            return Err(Error::new(
                ErrorKind::OutOfMemory,
                format!(
                    "wgpu: an activation of {bytes} bytes is larger than one binding may hold ({}); use a smaller batch",
                    self.max_binding()
                ),
            ));
        }
        let mut rec = self.lock()?;
        self.reclaim(&mut rec);
        if let Some((id, buf)) = rec.pool.get_mut(&size).and_then(|v| v.pop()) {
            let enc = self.encoder(&mut rec);
            enc.clear_buffer(&buf, 0, None);
            return Ok(GpuBuf { id, buf, size, pooled: true, released: self.released.clone() });
        }
        drop(rec);
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("spark activation"),
            size,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        Ok(GpuBuf { id: self.new_id(), buf, size, pooled: true, released: self.released.clone() })
    }

    /// Take back dropped buffers: pooled ones into the pool, others out of the bind cache.
    fn reclaim(&self, rec: &mut Recorder) {
        let gone: Vec<Released> = match self.released.lock() {
            Ok(mut v) => std::mem::take(&mut *v),
            Err(_) => return,
        };
        for r in gone {
            match r {
                Released::Pool(id, size, buf) => {
                    let free = rec.pool.entry(size).or_default();
                    if free.len() < POOL_PER_CLASS {
                        free.push((id, buf));
                    } else {
                        rec.binds.retain(|k, _| !k.bufs.contains(&id));
                    }
                }
                Released::Gone(id) => rec.binds.retain(|k, _| !k.bufs.contains(&id)),
            }
        }
    }

    fn encoder<'a>(&self, rec: &'a mut Recorder) -> &'a mut wgpu::CommandEncoder {
        rec.encoder.get_or_insert_with(|| {
            self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("spark step") })
        })
    }

    /// Record a buffer-to-buffer copy.
    pub fn copy(&self, src: &GpuBuf, src_off: u64, dst: &GpuBuf, dst_off: u64, bytes: u64) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let mut rec = self.lock()?;
        self.encoder(&mut rec).copy_buffer_to_buffer(&src.buf, src_off, &dst.buf, dst_off, bytes);
        Ok(())
    }

    fn pipe(&self, kernel: Kernel) -> Result<Arc<Pipe>> {
        let mut pipes = self.pipes.lock().map_err(|_| backend_error("pipeline cache lock poisoned"))?;
        if let Some(p) = pipes.get(&kernel) {
            return Ok(p.clone());
        }
        let layout = kernel.layout();
        let mut entries = vec![wgpu::BindGroupLayoutEntry {
            binding: 0,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                has_dynamic_offset: true,
                min_binding_size: None,
            },
            count: None,
        }];
        let storage = |binding, read_only, dynamic| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only },
                has_dynamic_offset: dynamic,
                min_binding_size: None,
            },
            count: None,
        };
        let mut next = 1;
        if layout.data {
            entries.push(storage(1, true, true));
            next = 2;
        }
        for (i, a) in layout.bufs.iter().enumerate() {
            entries.push(storage(next + i as u32, *a == Access::Read, false));
        }
        let bgl =
            self.device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: None, entries: &entries });
        let pl = self.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: None,
            bind_group_layouts: &[Some(&bgl)],
            immediate_size: 0,
        });
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(&format!("{kernel:?}")),
            source: wgpu::ShaderSource::Wgsl(kernel.source().into()),
        });
        let pipeline = self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(&format!("{kernel:?}")),
            layout: Some(&pl),
            module: &module,
            entry_point: Some("main"),
            // Every kernel writes its workgroup memory before reading it.
            compilation_options: wgpu::PipelineCompilationOptions {
                zero_initialize_workgroup_memory: false,
                ..Default::default()
            },
            cache: None,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(backend_error(format!("kernel {kernel:?} does not compile: {e}")));
        }
        let p = Arc::new(Pipe { pipeline, layout: bgl, has_data: layout.data });
        pipes.insert(kernel, p.clone());
        Ok(p)
    }

    /// Record one dispatch of `kernel` over `groups` workgroups (split into 2-D when needed),
    /// or over an explicit `(x, y)` grid.
    pub fn dispatch(
        &self,
        kernel: Kernel,
        params: &[u32],
        data: Option<&[u32]>,
        bufs: &[&GpuBuf],
        grid: Grid,
    ) -> Result<()> {
        let pipe = self.pipe(kernel)?;
        debug_assert_eq!(pipe.has_data, data.is_some());
        let mut rec = self.lock()?;
        self.reclaim(&mut rec);
        // Room for the parameters and the index data, else submit what is pending first.
        let data_bytes = data.map_or(0, |d| (d.len().max(1) * 4) as u64);
        let data_need = data_bytes.div_ceil(self.align_storage) * self.align_storage;
        let params_full = rec.params.host.len() as u64 + self.align_uniform > rec.params.cap;
        let data_full = rec.data.host.len() as u64 + data_need > rec.data.cap;
        if params_full || data_full {
            self.submit(&mut rec)?;
        }
        if data_need > rec.data.cap {
            let cap = data_need.next_power_of_two();
            if cap > self.max_binding() {
                return Err(Error::invalid(format!("wgpu: {} indices in one op are too many", data_bytes / 4)));
            }
            let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("spark index data"),
                size: cap,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let old = rec.data.id;
            rec.binds.retain(|k, _| k.data.0 != old);
            rec.data = Arena { buf, id: self.new_id(), cap, host: Vec::new() };
        }
        let poff = rec.params.host.len() as u64;
        let mut block = [0u8; PARAM_BYTES as usize];
        block[..params.len() * 4].copy_from_slice(bytemuck::cast_slice(params));
        rec.params.host.extend_from_slice(&block);
        rec.params.host.resize((poff + self.align_uniform) as usize, 0);
        let mut offsets = vec![poff as u32];
        let mut data_key = (0, 0);
        if let Some(d) = data {
            let doff = rec.data.host.len() as u64;
            rec.data.host.extend_from_slice(bytemuck::cast_slice(d));
            rec.data.host.resize((doff + data_need) as usize, 0);
            offsets.push(doff as u32);
            data_key = (rec.data.id, data_bytes);
        }
        let mut ids = [0u64; 5];
        for (slot, b) in ids.iter_mut().zip(bufs) {
            *slot = b.id;
        }
        let key = BindKey { kernel, params: rec.params.id, data: data_key, bufs: ids };
        if !rec.binds.contains_key(&key) {
            if rec.binds.len() >= BIND_CACHE_MAX {
                rec.binds.clear();
            }
            let mut entries = vec![wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &rec.params.buf,
                    offset: 0,
                    size: wgpu::BufferSize::new(PARAM_BYTES),
                }),
            }];
            let mut next = 1;
            if data.is_some() {
                entries.push(wgpu::BindGroupEntry {
                    binding: 1,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &rec.data.buf,
                        offset: 0,
                        size: wgpu::BufferSize::new(data_bytes),
                    }),
                });
                next = 2;
            }
            for (i, b) in bufs.iter().enumerate() {
                entries.push(wgpu::BindGroupEntry { binding: next + i as u32, resource: b.buf.as_entire_binding() });
            }
            let bg = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &pipe.layout,
                entries: &entries,
            });
            rec.binds.insert(key, bg);
        }
        let (x, y) = match grid {
            Grid::Groups(n) => {
                let maxd = self.limits.max_compute_workgroups_per_dimension.max(1);
                if n <= maxd {
                    (n, 1)
                } else {
                    (maxd, n.div_ceil(maxd))
                }
            }
            Grid::Xy(x, y) => (x, y),
        };
        if x == 0 || y == 0 {
            return Ok(());
        }
        let Recorder { encoder, binds, .. } = &mut *rec;
        let bg = binds.get(&key).ok_or_else(|| Error::internal("wgpu: bind group vanished"))?;
        let enc = encoder.get_or_insert_with(|| {
            self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("spark step") })
        });
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
        pass.set_pipeline(&pipe.pipeline);
        pass.set_bind_group(0, bg, &offsets);
        pass.dispatch_workgroups(x, y, 1);
        drop(pass);
        if let Some(prof) = &self.profile {
            // Profiling submits every dispatch at once, so the encoder holds this kernel (and any
            // buffer clear or copy recorded just before it): upload the parameters, wait, then
            // time the submission alone.
            let Some(enc) = rec.encoder.take() else { return Ok(()) };
            self.submit_parts(&mut rec, None)?;
            self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| backend_error(format!("poll: {e}")))?;
            let t0 = std::time::Instant::now();
            self.submit_parts(&mut rec, Some(enc))?;
            self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| backend_error(format!("poll: {e}")))?;
            if let Ok(mut p) = prof.lock() {
                let e = p.entry(format!("{kernel:?}")).or_default();
                e.0 += 1;
                e.1 += t0.elapsed();
            }
        }
        Ok(())
    }

    /// Upload the arenas, then submit `enc` (and empty the arenas) or, with `None`, an empty
    /// submission that only carries the uploads.
    fn submit_parts(&self, rec: &mut Recorder, enc: Option<wgpu::CommandEncoder>) -> Result<()> {
        if !rec.params.host.is_empty() {
            self.queue.write_buffer(&rec.params.buf, 0, &rec.params.host);
        }
        if !rec.data.host.is_empty() {
            self.queue.write_buffer(&rec.data.buf, 0, &rec.data.host);
        }
        match enc {
            Some(e) => {
                self.queue.submit([e.finish()]);
                rec.params.host.clear();
                rec.data.host.clear();
            }
            None => {
                self.queue.submit([]);
            }
        }
        Ok(())
    }

    /// Upload the arenas and submit the pending encoder, if any.
    fn submit(&self, rec: &mut Recorder) -> Result<()> {
        if let Some(enc) = rec.encoder.take() {
            self.submit_parts(rec, Some(enc))?;
        }
        rec.params.host.clear();
        rec.data.host.clear();
        Ok(())
    }

    /// Submit what is pending and wait for the device to finish it.
    pub fn sync(&self) -> Result<()> {
        let mut rec = self.lock()?;
        self.submit(&mut rec)?;
        drop(rec);
        self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| backend_error(format!("poll: {e}")))?;
        self.check_error()
    }

    /// Copy the first `out.len()` floats of `src` to the host (one submit for the whole step).
    pub fn read(&self, src: &GpuBuf, out: &mut [f32]) -> Result<()> {
        let bytes = (out.len() * 4) as u64;
        if bytes == 0 {
            return self.sync();
        }
        let mut rec = self.lock()?;
        if rec.readback.as_ref().is_none_or(|(_, s)| *s < bytes) {
            let size = bytes.next_power_of_two().max(4096);
            let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("spark readback"),
                size,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            rec.readback = Some((buf, size));
        }
        let Some((rb, _)) = rec.readback.clone() else { return Err(Error::internal("wgpu: no readback buffer")) };
        self.encoder(&mut rec).copy_buffer_to_buffer(&src.buf, 0, &rb, 0, bytes);
        self.submit(&mut rec)?;
        drop(rec);
        let (tx, rx) = std::sync::mpsc::channel();
        rb.map_async(wgpu::MapMode::Read, 0..bytes, move |r| {
            let _ = tx.send(r);
        });
        self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| backend_error(format!("poll: {e}")))?;
        self.check_error()?;
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(backend_error(format!("mapping the readback buffer failed: {e}"))),
            Err(_) => return Err(backend_error("mapping the readback buffer never completed")),
        }
        {
            let view = rb.get_mapped_range(0..bytes).map_err(|e| backend_error(format!("readback: {e}")))?;
            out.copy_from_slice(bytemuck::cast_slice(&view[..]));
        }
        rb.unmap();
        Ok(())
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let Some(prof) = &self.profile else { return };
        let Ok(p) = prof.lock() else { return };
        let mut rows: Vec<_> = p.iter().collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.1 .1));
        eprintln!("SPARK_WGPU_PROFILE: kernel, dispatches, total ms, us per dispatch");
        for (k, (n, t)) in rows {
            eprintln!("  {k:<28} {n:>8} {:>10.1} {:>10.1}", t.as_secs_f64() * 1e3, t.as_secs_f64() * 1e6 / *n as f64);
        }
    }
}

/// The shape of a dispatch.
pub enum Grid {
    /// This many workgroups, flattened (the kernel uses `wid`).
    Groups(u32),
    /// An explicit 2-D grid.
    Xy(u32, u32),
}
