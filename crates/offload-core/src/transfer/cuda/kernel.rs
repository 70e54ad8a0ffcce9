//! The copy kernel: a job's copies done by a few thread blocks instead of the copy engines.
//!
//! The copy engines pay a fixed driver and engine cost per copy, and the copy thread is
//! blocked inside the driver while it enqueues them, so jobs made of many small runs (vLLM's
//! per-layer layout: one 32 KiB run per layer and block) reach only part of PCIe's
//! bandwidth and hold loads up behind stores. One launch takes the whole job: the runs go to
//! the device as a table (one upload), and [`BLOCKS`] thread blocks stream 16-byte words
//! between device memory and the pinned host memory, which is mapped into the device's
//! address space. The price is compute: those loads and stores over PCIe occupy SMs and
//! the memory system while the model runs, which is why [`CopyPath::Dma`] is the default
//! (`docs/gpu_check.md` has both measured).
//!
//! [`CopyPath::Dma`]: super::CopyPath::Dma
//!
//! The kernel ships as PTX (`copy_kernel.ptx`, generated from `copy_kernel.cu` by
//! `scripts/build_copy_kernel.py`; its first line records the source's SHA-256, which a
//! test checks) that the driver compiles when the backend attaches.

use std::ffi::{c_uint, c_void, CString};

use super::super::cuda_sys as sys;
use super::backend::Handle;
use super::driver::{Api, CudaDriver};
use super::enqueue::Descriptor;
use super::CudaError;

/// The kernel's PTX.
const PTX: &str = include_str!("copy_kernel.ptx");

/// The kernel's entry point in [`PTX`].
const ENTRY: &str = "kvoffload_copy";

/// Threads per block: the kernel's `__launch_bounds__`.
const THREADS: c_uint = 256;

/// Thread blocks per launch: enough reads in flight to fill a PCIe 5 x16 link (half as
/// many already did on an H200), few SMs taken from compute.
pub(super) const BLOCKS: c_uint = 16;

/// Smallest table allocated, in runs: small jobs share buffers instead of each growing one.
const MIN_TABLE_RUNS: usize = 1024;

/// Free tables kept for reuse; beyond that the smallest are freed.
const MAX_FREE_TABLES: usize = 16;

/// The driver functions the kernel needs; all optional in [`Api`], required together here.
#[derive(Clone, Copy)]
struct KernelApi {
    module_load_data: sys::cuModuleLoadData_t,
    module_unload: sys::cuModuleUnload_t,
    module_get_function: sys::cuModuleGetFunction_t,
    launch_kernel: sys::cuLaunchKernel_t,
    mem_alloc: sys::cuMemAlloc_t,
    mem_free: sys::cuMemFree_t,
    memcpy_htod_async: sys::cuMemcpyHtoDAsync_t,
}

impl KernelApi {
    fn from_api(api: &Api) -> Result<Self, Vec<&'static str>> {
        let mut missing = Vec::new();
        macro_rules! need {
            ($field:ident, $name:literal) => {{
                if api.$field.is_none() {
                    missing.push($name);
                }
                api.$field
            }};
        }
        let parts = (
            need!(module_load_data, "cuModuleLoadData"),
            need!(module_unload, "cuModuleUnload"),
            need!(module_get_function, "cuModuleGetFunction"),
            need!(launch_kernel, "cuLaunchKernel"),
            need!(mem_alloc, "cuMemAlloc_v2"),
            need!(mem_free, "cuMemFree_v2"),
            need!(memcpy_htod_async, "cuMemcpyHtoDAsync_v2"),
        );
        match parts {
            (Some(a), Some(b), Some(c), Some(d), Some(e), Some(f), Some(g)) => Ok(Self {
                module_load_data: a,
                module_unload: b,
                module_get_function: c,
                launch_kernel: d,
                mem_alloc: e,
                mem_free: f,
                memcpy_htod_async: g,
            }),
            _ => Err(missing),
        }
    }
}

/// A device buffer holding one launch's run table; owned by the job until its event fired.
#[derive(Debug)]
pub(super) struct Table {
    ptr: sys::CUdeviceptr,
    runs: usize,
}

/// The loaded kernel and its table buffers. Lives on the copy thread, in the context the
/// backend made current there.
pub(super) struct CopyKernel {
    api: KernelApi,
    module: Handle,
    function: Handle,
    free: Vec<Table>,
    /// Every table allocated and not yet freed, in use or not: all are freed on release.
    allocated: Vec<sys::CUdeviceptr>,
    /// The table being built, as `(src, dst, len)` words.
    staging: Vec<u64>,
}

impl std::fmt::Debug for CopyKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyKernel")
            .field("free_tables", &self.free.len())
            .field("allocated_tables", &self.allocated.len())
            .finish_non_exhaustive()
    }
}

impl CopyKernel {
    /// Loads the PTX and finds the entry point, in the current context.
    pub(super) fn load(driver: &CudaDriver) -> Result<Self, CudaError> {
        let api = KernelApi::from_api(&driver.api).map_err(|symbols| CudaError::MissingSymbol {
            path: driver.path().to_owned(),
            symbols,
        })?;
        let image = CString::new(PTX).map_err(|_| CudaError::InvalidOption {
            field: "copy kernel",
            value: "copy_kernel.ptx".into(),
            reason: "the PTX contains a NUL byte",
        })?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: `image` is a NUL-terminated PTX string alive for the call; `module` is a
        // valid out-pointer.
        let rc = unsafe { (api.module_load_data)(&mut module, image.as_ptr().cast()) };
        driver.check("cuModuleLoadData(copy kernel PTX)", rc)?;
        let module = Handle::from_ptr(module);
        let name = CString::new(ENTRY).map_err(|_| CudaError::InvalidOption {
            field: "copy kernel",
            value: ENTRY.into(),
            reason: "the entry name contains a NUL byte",
        })?;
        let mut function: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: `module` was just loaded; `name` is NUL-terminated; `function` is a valid
        // out-pointer.
        let rc = unsafe { (api.module_get_function)(&mut function, module.ptr(), name.as_ptr()) };
        if let Err(err) = driver.check(&format!("cuModuleGetFunction({ENTRY})"), rc) {
            // SAFETY: the module loaded above, unloaded once.
            unsafe { (api.module_unload)(module.ptr()) };
            return Err(err);
        }
        Ok(Self {
            api,
            module,
            function: Handle::from_ptr(function),
            free: Vec::new(),
            allocated: Vec::new(),
            staging: Vec::new(),
        })
    }

    /// Enqueues on `stream` the upload of `descriptors` as a table and one launch that copies
    /// them. The returned table must stay with the job until the stream has passed it
    /// ([`recycle`](Self::recycle) it then). On error, part of this may be on the stream.
    ///
    /// # Safety
    ///
    /// Every descriptor's source and destination must be device memory or host memory
    /// mapped into the device (registered with `CU_MEMHOSTREGISTER_DEVICEMAP` in this
    /// context), valid for `len` bytes until the stream has passed the launch.
    pub(super) unsafe fn enqueue(
        &mut self,
        driver: &CudaDriver,
        stream: Handle,
        descriptors: &[Descriptor],
    ) -> Result<Table, (CudaError, Option<Table>)> {
        let table = self
            .take_table(driver, descriptors.len())
            .map_err(|e| (e, None))?;
        self.staging.clear();
        for d in descriptors {
            self.staging
                .extend_from_slice(&[d.src, d.dst, d.len as u64]);
        }
        let bytes = self.staging.len() * std::mem::size_of::<u64>();
        // SAFETY: the table holds at least `descriptors.len()` runs of 24 bytes; the source
        // is pageable, so the driver stages it before returning and `staging` may be reused.
        let rc = unsafe {
            (self.api.memcpy_htod_async)(
                table.ptr,
                self.staging.as_ptr().cast(),
                bytes,
                stream.ptr(),
            )
        };
        if let Err(err) = driver.check(&format!("cuMemcpyHtoDAsync(copy table, {bytes} bytes)"), rc)
        {
            return Err((err, Some(table)));
        }
        let mut table_ptr = table.ptr;
        let mut count = descriptors.len() as u64;
        let mut params = [
            std::ptr::addr_of_mut!(table_ptr).cast::<c_void>(),
            std::ptr::addr_of_mut!(count).cast::<c_void>(),
        ];
        let blocks = BLOCKS.min(c_uint::try_from(descriptors.len()).unwrap_or(BLOCKS));
        // SAFETY: `function` takes exactly (const Run*, unsigned long long), pointed to by
        // `params`, which the driver reads before returning; the caller vouches for every
        // address in the table.
        let rc = unsafe {
            (self.api.launch_kernel)(
                self.function.ptr(),
                blocks,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream.ptr(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        match driver.check(
            &format!("cuLaunchKernel(copy kernel, {} runs)", descriptors.len()),
            rc,
        ) {
            Ok(()) => Ok(table),
            Err(err) => Err((err, Some(table))),
        }
    }

    /// A table the stream has passed, back for reuse.
    pub(super) fn recycle(&mut self, driver: &CudaDriver, table: Table) {
        self.free.push(table);
        if self.free.len() > MAX_FREE_TABLES {
            self.free
                .sort_unstable_by_key(|t| std::cmp::Reverse(t.runs));
            if let Some(smallest) = self.free.pop() {
                self.free_table(driver, smallest.ptr);
            }
        }
    }

    /// Frees every table and unloads the module. Only once no stream can still use them.
    pub(super) fn release(&mut self, driver: &CudaDriver) {
        self.free.clear();
        for ptr in std::mem::take(&mut self.allocated) {
            self.free_table(driver, ptr);
        }
        // SAFETY: the module loaded in `load`, unloaded once (`release` runs once, in drop).
        let rc = unsafe { (self.api.module_unload)(self.module.ptr()) };
        if let Err(err) = driver.check("cuModuleUnload(copy kernel)", rc) {
            log::debug!("{err}");
        }
    }

    fn take_table(&mut self, driver: &CudaDriver, runs: usize) -> Result<Table, CudaError> {
        if let Some(i) = self.free.iter().position(|t| t.runs >= runs) {
            return Ok(self.free.swap_remove(i));
        }
        let runs = runs.max(MIN_TABLE_RUNS).next_power_of_two();
        let bytes = runs * 3 * std::mem::size_of::<u64>();
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer.
        let rc = unsafe { (self.api.mem_alloc)(&mut ptr, bytes) };
        driver.check(&format!("cuMemAlloc(copy table, {bytes} bytes)"), rc)?;
        self.allocated.push(ptr);
        Ok(Table { ptr, runs })
    }

    fn free_table(&mut self, driver: &CudaDriver, ptr: sys::CUdeviceptr) {
        self.allocated.retain(|&p| p != ptr);
        // SAFETY: `ptr` came from `cuMemAlloc` and no stream uses it any more (the callers'
        // contract), freed once since it left `allocated` above.
        let rc = unsafe { (self.api.mem_free)(ptr) };
        if let Err(err) = driver.check("cuMemFree(copy table)", rc) {
            log::debug!("{err}");
        }
    }
}
