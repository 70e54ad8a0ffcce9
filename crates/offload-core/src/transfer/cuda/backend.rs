//! The [`CudaCopyBackend`]: context, stream, pinned host memory and events on the copy
//! thread; job submission and completion polling.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::Instant;

use super::super::{BackendError, CopyBackend, CopyRun, Direction, Ticket};
use super::driver::{Api, CudaDriver};
use super::enqueue::Copies;
use super::options::CudaOptions;
use super::sys::{self, CUresult};
use super::{version_text, BatchApi, CudaError};

/// A driver handle (context, stream, event) stored as an address so the backend is `Send`:
/// the handles are opaque tokens the driver accepts from any thread whose current context
/// owns them (the copy thread, once attached).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Handle(usize);

impl Handle {
    fn from_ptr(p: *mut c_void) -> Self {
        Self(p as usize)
    }

    fn ptr(self) -> *mut c_void {
        self.0 as *mut c_void
    }
}

/// What `attach` set up; torn down in `Drop`.
#[derive(Debug, Default)]
struct Attached {
    context_retained: bool,
    /// The load stream and the store stream (in lane order, see `Direction::lane`).
    streams: Option<[Handle; 2]>,
    /// `(base, len)` of every successful `cuMemHostRegister`.
    pinned: Vec<(u64, usize)>,
}

/// A job on a stream.
#[derive(Debug)]
struct InFlight {
    event: Handle,
    stream: Handle,
    /// A copy failed after part of the job was enqueued: report it once the stream has
    /// finished with the job's memory.
    deferred: Option<BackendError>,
}

/// A [`CopyBackend`] over the CUDA driver. See the [module docs](super).
#[derive(Debug)]
pub struct CudaCopyBackend {
    driver: Arc<CudaDriver>,
    options: CudaOptions,
    device: sys::CUdevice,
    batch: BatchApi,
    attached: Attached,
    /// `(base, len)` of the engine's host memory, once attached.
    host: Option<(u64, usize)>,
    in_flight: HashMap<u64, InFlight>,
    free_events: Vec<Handle>,
    /// The event the next `submit` waits for (see `wait_event`).
    pending_wait: Option<Handle>,
    next_ticket: u64,
    copies: Copies,
}

impl CudaCopyBackend {
    /// A backend for device `options.device`. Validates the options and the ordinal
    /// (`cuDeviceGet`) now, so a bad device fails at start; touches no context until
    /// `attach` runs on the copy thread.
    pub fn new(driver: Arc<CudaDriver>, options: CudaOptions) -> Result<Self, CudaError> {
        options.validate()?;
        let mut device: sys::CUdevice = 0;
        // SAFETY: `device` is a valid out-pointer; the ordinal is passed by value.
        let rc = unsafe { (driver.api.device_get)(&mut device, options.device) };
        driver.check(&format!("cuDeviceGet(ordinal {})", options.device), rc)?;
        let batch = if options.allow_batch {
            driver.batch_api()
        } else {
            BatchApi::Unavailable
        };
        Ok(Self {
            driver,
            options,
            device,
            batch,
            attached: Attached::default(),
            host: None,
            in_flight: HashMap::new(),
            free_events: Vec::new(),
            pending_wait: None,
            next_ticket: 0,
            copies: Copies::default(),
        })
    }

    /// Loads the driver ([`CudaDriver::load`]) and builds a backend on it.
    pub fn open(options: CudaOptions) -> Result<Self, CudaError> {
        Self::new(Arc::new(CudaDriver::load()?), options)
    }

    /// The copy path jobs use.
    pub fn batch_api(&self) -> BatchApi {
        self.batch
    }

    /// The driver.
    pub fn driver(&self) -> &Arc<CudaDriver> {
        &self.driver
    }

    fn api(&self) -> &Api {
        &self.driver.api
    }

    fn check(&self, call: &str, code: CUresult) -> Result<(), CudaError> {
        self.driver.check(call, code)
    }

    fn stream(&self, direction: Direction) -> Result<Handle, BackendError> {
        self.attached
            .streams
            .map(|streams| streams[direction.lane()])
            .ok_or_else(|| BackendError::job("cuda backend used before attach succeeded"))
    }

    fn attach_inner(&mut self, host_base: u64, host_len: usize) -> Result<(), CudaError> {
        let api = *self.api();
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; `device` came from `cuDeviceGet`.
        let rc = unsafe { (api.primary_ctx_retain)(&mut ctx, self.device) };
        self.check(
            &format!("cuDevicePrimaryCtxRetain(device {})", self.options.device),
            rc,
        )?;
        self.attached.context_retained = true;
        // SAFETY: `ctx` is the retained primary context, valid until we release it.
        let rc = unsafe { (api.ctx_set_current)(ctx) };
        self.check("cuCtxSetCurrent", rc)?;

        // Numerically greatest is lowest priority: stores yield to compute kernels, and
        // loads, which a request is waiting for, one step less (where the device has steps).
        let (mut least, mut greatest): (c_int, c_int) = (0, 0);
        if let Some(range) = api.ctx_get_stream_priority_range {
            // SAFETY: both are valid out-pointers.
            let rc = unsafe { range(&mut least, &mut greatest) };
            self.check("cuCtxGetStreamPriorityRange", rc)?;
        }
        let load_priority = if least > greatest { least - 1 } else { least };
        let mut created = Vec::with_capacity(2);
        for priority in [load_priority, least] {
            let mut stream: sys::CUstream = std::ptr::null_mut();
            // SAFETY: `stream` is a valid out-pointer; flags and priority are by value.
            let rc = unsafe {
                (api.stream_create_with_priority)(
                    &mut stream,
                    sys::CU_STREAM_NON_BLOCKING,
                    priority,
                )
            };
            let made = self.check(
                &format!("cuStreamCreateWithPriority(CU_STREAM_NON_BLOCKING, priority {priority})"),
                rc,
            );
            if let Err(err) = made {
                for stream in created {
                    self.destroy_stream(stream);
                }
                return Err(err);
            }
            created.push(Handle::from_ptr(stream));
        }
        self.attached.streams = Some([created[0], created[1]]);

        let started = Instant::now();
        let chunk = self.options.pin_chunk_bytes;
        let mut offset = 0usize;
        while offset < host_len {
            let len = chunk.min(host_len - offset);
            let base = host_base.wrapping_add(offset as u64);
            // SAFETY: `base..base+len` lies inside the engine's host mapping (`attach`'s
            // contract), which outlives this backend; registration only pins the pages.
            let rc = unsafe {
                (api.mem_host_register)(
                    base as usize as *mut c_void,
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            };
            self.check(
                &format!(
                    "cuMemHostRegister(bytes {offset}..{} of {host_len})",
                    offset + len
                ),
                rc,
            )?;
            self.attached.pinned.push((base, len));
            offset += len;
        }
        self.host = Some((host_base, host_len));
        log::info!(
            "kvoffload: pinned {:.2} GiB of host memory in {} chunk(s) in {:.2} s; {}",
            host_len as f64 / f64::from(1u32 << 30),
            self.attached.pinned.len(),
            started.elapsed().as_secs_f64(),
            self.describe()
        );
        Ok(())
    }

    fn take_event(&mut self) -> Result<Handle, CudaError> {
        if let Some(event) = self.free_events.pop() {
            return Ok(event);
        }
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: `event` is a valid out-pointer.
        let rc = unsafe { (self.api().event_create)(&mut event, sys::CU_EVENT_DISABLE_TIMING) };
        self.check("cuEventCreate(CU_EVENT_DISABLE_TIMING)", rc)?;
        Ok(Handle::from_ptr(event))
    }

    /// Waits until nothing on `stream` runs any more (when `enqueued`, i.e. some of a failing
    /// job's copies may be on it), then returns `err` for the job. If the stream cannot be
    /// drained, whether the copies still run is unknown: the failure becomes fatal, so the
    /// engine stops and nobody is told the memory is free to reuse by a later success.
    fn drain_before_failing(
        &self,
        stream: Handle,
        enqueued: bool,
        err: BackendError,
    ) -> BackendError {
        if !enqueued {
            return err;
        }
        // SAFETY: our stream, alive until drop.
        let rc = unsafe { (self.api().stream_synchronize)(stream.ptr()) };
        match self.check("cuStreamSynchronize", rc) {
            Ok(()) => err,
            Err(sync) => BackendError::fatal(format!("{}; then {sync}", err.message())),
        }
    }

    fn destroy_stream(&self, stream: Handle) {
        // SAFETY: a stream we created, destroyed once.
        let rc = unsafe { (self.api().stream_destroy)(stream.ptr()) };
        if let Err(err) = self.check("cuStreamDestroy", rc) {
            log::debug!("{err}");
        }
    }

    fn destroy_event(&self, event: Handle) {
        // SAFETY: `event` was created by `cuEventCreate` and is destroyed once.
        let rc = unsafe { (self.api().event_destroy)(event.ptr()) };
        if let Err(err) = self.check("cuEventDestroy", rc) {
            log::debug!("{err}");
        }
    }
}

/// A sticky error poisons the context, so it stops the engine; any other fails its job.
impl From<CudaError> for BackendError {
    fn from(err: CudaError) -> Self {
        if err.is_sticky() {
            BackendError::fatal(err.to_string())
        } else {
            BackendError::job(err.to_string())
        }
    }
}

impl CopyBackend for CudaCopyBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn describe(&self) -> String {
        format!(
            "cuda (driver {}, device {}, {})",
            version_text(self.driver.version()),
            self.options.device,
            self.batch.symbol()
        )
    }

    fn attach(&mut self, host_base: u64, host_len: usize) -> Result<(), BackendError> {
        // Any failure here is fatal to the engine anyway; keep the driver's words.
        self.attach_inner(host_base, host_len)
            .map_err(|e| BackendError::fatal(e.to_string()))
    }

    fn wait_event(&mut self, event: u64) -> Result<(), BackendError> {
        let handle = usize::try_from(event)
            .map_err(|_| BackendError::job(format!("event handle {event:#x} exceeds usize")))?;
        if handle == 0 {
            return Err(BackendError::job("wait event handle is null"));
        }
        // Which stream waits depends on the next job's direction: `submit` enqueues it.
        self.pending_wait = Some(Handle(handle));
        Ok(())
    }

    unsafe fn submit(
        &mut self,
        direction: Direction,
        runs: &[CopyRun],
    ) -> Result<Ticket, BackendError> {
        let wait = self.pending_wait.take();
        let stream = self.stream(direction)?;
        if let Some(event) = wait {
            // SAFETY: the caller passed a live event handle (`TransferJob::wait_event`'s
            // contract); the driver validates it and fails with INVALID_HANDLE otherwise.
            let rc = unsafe {
                (self.api().stream_wait_event)(
                    stream.ptr(),
                    event.ptr(),
                    sys::CU_EVENT_WAIT_DEFAULT,
                )
            };
            self.check(&format!("cuStreamWaitEvent(event {:#x})", event.0), rc)?;
        }
        let host = self
            .host
            .map(|(base, len)| (base, len, self.options.pin_chunk_bytes));
        self.copies.build(runs, direction, host);
        let copied = if self.copies.is_empty() {
            Ok(())
        } else {
            // SAFETY: the copies cover exactly the bytes of `runs`, for which our caller
            // upholds `submit`'s contract; the stream is ours, in our current context.
            unsafe { self.copies.enqueue(&self.driver, self.batch, stream.ptr()) }
        };
        // From here on some of the job's copies may be on the stream. The engine reports a
        // job (failed or not) as soon as this returns an error, and its caller then reuses
        // the blocks, so every error path below first waits for the stream to drain.
        let enqueued = !self.copies.is_empty();
        let deferred = match copied {
            Ok(()) => None,
            Err(err) if err.is_sticky() => {
                return Err(self.drain_before_failing(stream, enqueued, err.into()));
            }
            // A copy after the first failed: record the event anyway and report the error
            // once it fired, without blocking the copy thread.
            Err(err) => Some(BackendError::from(err)),
        };
        let event = match self.take_event() {
            Ok(event) => event,
            Err(err) => {
                let err = deferred.unwrap_or_else(|| err.into());
                return Err(self.drain_before_failing(stream, enqueued, err));
            }
        };
        // SAFETY: both handles are ours and alive.
        let rc = unsafe { (self.api().event_record)(event.ptr(), stream.ptr()) };
        if let Err(err) = self.check("cuEventRecord", rc) {
            self.destroy_event(event);
            let err = deferred.unwrap_or_else(|| err.into());
            return Err(self.drain_before_failing(stream, enqueued, err));
        }
        let ticket = self.next_ticket;
        self.next_ticket = self.next_ticket.wrapping_add(1);
        self.in_flight.insert(
            ticket,
            InFlight {
                event,
                stream,
                deferred,
            },
        );
        Ok(Ticket(ticket))
    }

    fn query(&mut self, ticket: Ticket) -> Result<bool, BackendError> {
        let Some(job) = self.in_flight.get(&ticket.0) else {
            return Err(BackendError::job(format!(
                "unknown cuda ticket {}",
                ticket.0
            )));
        };
        let (event, stream) = (job.event, job.stream);
        // SAFETY: a live event of ours.
        let rc = unsafe { (self.api().event_query)(event.ptr()) };
        match rc {
            sys::CUDA_ERROR_NOT_READY => Ok(false),
            sys::CUDA_SUCCESS => {
                let deferred = self.in_flight.remove(&ticket.0).and_then(|j| j.deferred);
                self.free_events.push(event);
                match deferred {
                    Some(err) => Err(err),
                    None => Ok(true),
                }
            }
            code => {
                self.in_flight.remove(&ticket.0);
                self.destroy_event(event);
                let err = self.driver.error("cuEventQuery".into(), code).into();
                // The query failing says nothing about the copies: they may still run.
                Err(self.drain_before_failing(stream, true, err))
            }
        }
    }
}

impl Drop for CudaCopyBackend {
    fn drop(&mut self) {
        let api = *self.api();
        if let Some(streams) = self.attached.streams.take() {
            for stream in streams {
                // Nothing may still be copying into memory we are about to unpin.
                // SAFETY: our stream.
                let rc = unsafe { (api.stream_synchronize)(stream.ptr()) };
                if let Err(err) = self.check("cuStreamSynchronize", rc) {
                    log::warn!("cuda backend shutdown: {err}");
                }
            }
            let events: Vec<Handle> = self
                .in_flight
                .drain()
                .map(|(_, job)| job.event)
                .chain(self.free_events.drain(..))
                .collect();
            for event in events {
                self.destroy_event(event);
            }
            for stream in streams {
                self.destroy_stream(stream);
            }
        }
        for (base, len) in std::mem::take(&mut self.attached.pinned) {
            // SAFETY: `base` is the start of a range we registered and have not unregistered.
            let rc = unsafe { (api.mem_host_unregister)(base as usize as *mut c_void) };
            if let Err(err) = self.check(&format!("cuMemHostUnregister({len} bytes)"), rc) {
                log::warn!("cuda backend shutdown: {err}");
            }
        }
        if std::mem::take(&mut self.attached.context_retained) {
            // SAFETY: balances the successful retain in `attach`.
            let rc = unsafe { (api.primary_ctx_release)(self.device) };
            if let Err(err) = self.check("cuDevicePrimaryCtxRelease", rc) {
                log::debug!("{err}");
            }
        }
    }
}
