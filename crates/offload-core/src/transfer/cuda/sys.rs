//! Raw CUDA driver API types, constants and function-pointer signatures, as in `cuda.h`.
//!
//! Nothing here links against CUDA: the backend ([`super`]) resolves these functions at run time from
//! `libcuda.so.1`. Every signature below is the one the named *exported symbol* has. Where
//! `cuda.h` maps a name to a versioned symbol (`#define cuMemHostRegister
//! cuMemHostRegister_v2`), the versioned symbol is the one resolved, because the unversioned
//! export keeps its original ABI forever (e.g. `cuMemHostRegister` took an `unsigned int`
//! size).
//!
//! Sources: CUDA Driver API reference (modules "Memory Management", "Stream Management",
//! "Event Management", "Primary Context Management") and `cuda.h` of CUDA 12.8 and 13.x;
//! the 13.x name mapping matches NVIDIA's `cuda-python` bindings (`cuMemcpyBatchAsync` ->
//! `_cuMemcpyBatchAsync_v2`, `cuEventDestroy` -> `_cuEventDestroy_v2`, ...).

#![allow(non_camel_case_types, non_snake_case, dead_code)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `CUresult`: a C enum, returned in an `int`-sized register.
pub(crate) type CUresult = c_int;
/// `CUdevice`: a device ordinal handle (`int`).
pub(crate) type CUdevice = c_int;
/// `CUdeviceptr`: `unsigned long long` on every 64-bit platform.
pub(crate) type CUdeviceptr = u64;
/// Opaque `struct CUctx_st *`.
pub(crate) type CUcontext = *mut c_void;
/// Opaque `struct CUstream_st *`.
pub(crate) type CUstream = *mut c_void;
/// Opaque `struct CUevent_st *` (interchangeable with the runtime's `cudaEvent_t`).
pub(crate) type CUevent = *mut c_void;

pub(crate) const CUDA_SUCCESS: CUresult = 0;
pub(crate) const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub(crate) const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub(crate) const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub(crate) const CUDA_ERROR_DEINITIALIZED: CUresult = 4;
pub(crate) const CUDA_ERROR_STUB_LIBRARY: CUresult = 34;
pub(crate) const CUDA_ERROR_DEVICE_UNAVAILABLE: CUresult = 46;
pub(crate) const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub(crate) const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub(crate) const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub(crate) const CUDA_ERROR_ECC_UNCORRECTABLE: CUresult = 214;
pub(crate) const CUDA_ERROR_NVLINK_UNCORRECTABLE: CUresult = 220;
pub(crate) const CUDA_ERROR_CONTAINED: CUresult = 226;
pub(crate) const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub(crate) const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub(crate) const CUDA_ERROR_NOT_READY: CUresult = 600;
pub(crate) const CUDA_ERROR_ILLEGAL_ADDRESS: CUresult = 700;
pub(crate) const CUDA_ERROR_LAUNCH_TIMEOUT: CUresult = 702;
pub(crate) const CUDA_ERROR_CONTEXT_IS_DESTROYED: CUresult = 709;
pub(crate) const CUDA_ERROR_ASSERT: CUresult = 710;
pub(crate) const CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: CUresult = 712;
pub(crate) const CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: CUresult = 713;
pub(crate) const CUDA_ERROR_HARDWARE_STACK_ERROR: CUresult = 714;
pub(crate) const CUDA_ERROR_ILLEGAL_INSTRUCTION: CUresult = 715;
pub(crate) const CUDA_ERROR_MISALIGNED_ADDRESS: CUresult = 716;
pub(crate) const CUDA_ERROR_INVALID_ADDRESS_SPACE: CUresult = 717;
pub(crate) const CUDA_ERROR_INVALID_PC: CUresult = 718;
pub(crate) const CUDA_ERROR_LAUNCH_FAILED: CUresult = 719;
pub(crate) const CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE: CUresult = 720;
pub(crate) const CUDA_ERROR_TENSOR_MEMORY_LEAK: CUresult = 721;
pub(crate) const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;
pub(crate) const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub(crate) const CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: CUresult = 803;
pub(crate) const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// `CU_STREAM_NON_BLOCKING`: the stream does not synchronize with the legacy NULL stream.
pub(crate) const CU_STREAM_NON_BLOCKING: c_uint = 0x1;
/// `CU_EVENT_DISABLE_TIMING`: the cheapest event kind, for synchronization only.
pub(crate) const CU_EVENT_DISABLE_TIMING: c_uint = 0x2;
/// `CU_EVENT_WAIT_DEFAULT` flag of `cuStreamWaitEvent`.
pub(crate) const CU_EVENT_WAIT_DEFAULT: c_uint = 0x0;
/// `CU_MEMHOSTREGISTER_PORTABLE`: pinned for every CUDA context, not just the current one.
pub(crate) const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 0x01;

/// `CU_MEMCPY_SRC_ACCESS_ORDER_STREAM`: the source is read in stream order (after the
/// stream's earlier work, including event waits).
pub(crate) const CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: c_uint = 0x1;
/// `CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`: hint to use a copy engine so the copy
/// overlaps kernels.
pub(crate) const CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE: c_uint = 0x1;
/// `CU_MEM_LOCATION_TYPE_INVALID`: no location hint.
pub(crate) const CU_MEM_LOCATION_TYPE_INVALID: c_uint = 0x0;

/// `CUmemLocation { CUmemLocationType type; int id; }`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CUmemLocation {
    pub(crate) type_: c_uint,
    pub(crate) id: c_int,
}

/// `CUmemcpyAttributes` (CUDA 12.8+, unchanged in 13.x): `{ CUmemcpySrcAccessOrder
/// srcAccessOrder; CUmemLocation srcLocHint; CUmemLocation dstLocHint; unsigned int flags; }`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CUmemcpyAttributes {
    pub(crate) srcAccessOrder: c_uint,
    pub(crate) srcLocHint: CUmemLocation,
    pub(crate) dstLocHint: CUmemLocation,
    pub(crate) flags: c_uint,
}

const _: () = assert!(std::mem::size_of::<CUmemcpyAttributes>() == 24);

/// `CUresult cuInit(unsigned int Flags)`.
pub(crate) type cuInit_t = unsafe extern "C" fn(flags: c_uint) -> CUresult;
/// `CUresult cuDriverGetVersion(int *driverVersion)`.
pub(crate) type cuDriverGetVersion_t = unsafe extern "C" fn(version: *mut c_int) -> CUresult;
/// `CUresult cuDeviceGet(CUdevice *device, int ordinal)`.
pub(crate) type cuDeviceGet_t =
    unsafe extern "C" fn(device: *mut CUdevice, ordinal: c_int) -> CUresult;
/// `CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)`.
pub(crate) type cuDevicePrimaryCtxRetain_t =
    unsafe extern "C" fn(pctx: *mut CUcontext, dev: CUdevice) -> CUresult;
/// `CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)` (`cuDevicePrimaryCtxRelease`).
pub(crate) type cuDevicePrimaryCtxRelease_t = unsafe extern "C" fn(dev: CUdevice) -> CUresult;
/// `CUresult cuCtxSetCurrent(CUcontext ctx)`.
pub(crate) type cuCtxSetCurrent_t = unsafe extern "C" fn(ctx: CUcontext) -> CUresult;
/// `CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority)`.
pub(crate) type cuCtxGetStreamPriorityRange_t =
    unsafe extern "C" fn(least: *mut c_int, greatest: *mut c_int) -> CUresult;
/// `CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)`.
pub(crate) type cuStreamCreateWithPriority_t =
    unsafe extern "C" fn(stream: *mut CUstream, flags: c_uint, priority: c_int) -> CUresult;
/// `CUresult cuStreamDestroy_v2(CUstream hStream)` (`cuStreamDestroy`).
pub(crate) type cuStreamDestroy_t = unsafe extern "C" fn(stream: CUstream) -> CUresult;
/// `CUresult cuStreamSynchronize(CUstream hStream)`.
pub(crate) type cuStreamSynchronize_t = unsafe extern "C" fn(stream: CUstream) -> CUresult;
/// `CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)`.
pub(crate) type cuStreamWaitEvent_t =
    unsafe extern "C" fn(stream: CUstream, event: CUevent, flags: c_uint) -> CUresult;
/// `CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)`.
pub(crate) type cuEventCreate_t =
    unsafe extern "C" fn(event: *mut CUevent, flags: c_uint) -> CUresult;
/// `CUresult cuEventRecord(CUevent hEvent, CUstream hStream)`.
pub(crate) type cuEventRecord_t =
    unsafe extern "C" fn(event: CUevent, stream: CUstream) -> CUresult;
/// `CUresult cuEventQuery(CUevent hEvent)`.
pub(crate) type cuEventQuery_t = unsafe extern "C" fn(event: CUevent) -> CUresult;
/// `CUresult cuEventDestroy_v2(CUevent hEvent)` (`cuEventDestroy`).
pub(crate) type cuEventDestroy_t = unsafe extern "C" fn(event: CUevent) -> CUresult;
/// `CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream
/// hStream)`; with unified addressing either side may be a host pointer.
pub(crate) type cuMemcpyAsync_t = unsafe extern "C" fn(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> CUresult;
/// CUDA 12.8 `cuMemcpyBatchAsync` (exported as `cuMemcpyBatchAsync`): `(CUdeviceptr *dsts,
/// CUdeviceptr *srcs, size_t *sizes, size_t count, CUmemcpyAttributes *attrs, size_t
/// *attrsIdxs, size_t numAttrs, size_t *failIdx, CUstream hStream)`.
pub(crate) type cuMemcpyBatchAsync_v1_t = unsafe extern "C" fn(
    dsts: *mut CUdeviceptr,
    srcs: *mut CUdeviceptr,
    sizes: *mut usize,
    count: usize,
    attrs: *mut CUmemcpyAttributes,
    attrs_idxs: *mut usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    stream: CUstream,
) -> CUresult;
/// CUDA 13.x `cuMemcpyBatchAsync` (exported as `cuMemcpyBatchAsync_v2`; `failIdx` removed):
/// `(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, CUmemcpyAttributes
/// *attrs, size_t *attrsIdxs, size_t numAttrs, CUstream hStream)`.
pub(crate) type cuMemcpyBatchAsync_v2_t = unsafe extern "C" fn(
    dsts: *mut CUdeviceptr,
    srcs: *mut CUdeviceptr,
    sizes: *mut usize,
    count: usize,
    attrs: *mut CUmemcpyAttributes,
    attrs_idxs: *mut usize,
    num_attrs: usize,
    stream: CUstream,
) -> CUresult;
/// `CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)`
/// (`cuMemHostRegister`).
pub(crate) type cuMemHostRegister_t =
    unsafe extern "C" fn(p: *mut c_void, bytes: usize, flags: c_uint) -> CUresult;
/// `CUresult cuMemHostUnregister(void *p)`.
pub(crate) type cuMemHostUnregister_t = unsafe extern "C" fn(p: *mut c_void) -> CUresult;
/// `CUresult cuGetErrorName(CUresult error, const char **pStr)`.
pub(crate) type cuGetErrorName_t =
    unsafe extern "C" fn(error: CUresult, out: *mut *const c_char) -> CUresult;
/// `CUresult cuGetErrorString(CUresult error, const char **pStr)`.
pub(crate) type cuGetErrorString_t =
    unsafe extern "C" fn(error: CUresult, out: *mut *const c_char) -> CUresult;

/// Names of the codes this crate reacts to, for drivers without `cuGetErrorName`.
pub(crate) fn known_error_name(code: CUresult) -> Option<&'static str> {
    Some(match code {
        CUDA_SUCCESS => "CUDA_SUCCESS",
        CUDA_ERROR_INVALID_VALUE => "CUDA_ERROR_INVALID_VALUE",
        CUDA_ERROR_OUT_OF_MEMORY => "CUDA_ERROR_OUT_OF_MEMORY",
        CUDA_ERROR_NOT_INITIALIZED => "CUDA_ERROR_NOT_INITIALIZED",
        CUDA_ERROR_DEINITIALIZED => "CUDA_ERROR_DEINITIALIZED",
        CUDA_ERROR_STUB_LIBRARY => "CUDA_ERROR_STUB_LIBRARY",
        CUDA_ERROR_DEVICE_UNAVAILABLE => "CUDA_ERROR_DEVICE_UNAVAILABLE",
        CUDA_ERROR_NO_DEVICE => "CUDA_ERROR_NO_DEVICE",
        CUDA_ERROR_INVALID_DEVICE => "CUDA_ERROR_INVALID_DEVICE",
        CUDA_ERROR_INVALID_CONTEXT => "CUDA_ERROR_INVALID_CONTEXT",
        CUDA_ERROR_ECC_UNCORRECTABLE => "CUDA_ERROR_ECC_UNCORRECTABLE",
        CUDA_ERROR_NVLINK_UNCORRECTABLE => "CUDA_ERROR_NVLINK_UNCORRECTABLE",
        CUDA_ERROR_CONTAINED => "CUDA_ERROR_CONTAINED",
        CUDA_ERROR_INVALID_HANDLE => "CUDA_ERROR_INVALID_HANDLE",
        CUDA_ERROR_NOT_FOUND => "CUDA_ERROR_NOT_FOUND",
        CUDA_ERROR_NOT_READY => "CUDA_ERROR_NOT_READY",
        CUDA_ERROR_ILLEGAL_ADDRESS => "CUDA_ERROR_ILLEGAL_ADDRESS",
        CUDA_ERROR_LAUNCH_TIMEOUT => "CUDA_ERROR_LAUNCH_TIMEOUT",
        CUDA_ERROR_CONTEXT_IS_DESTROYED => "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        CUDA_ERROR_ASSERT => "CUDA_ERROR_ASSERT",
        CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED => "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        CUDA_ERROR_HARDWARE_STACK_ERROR => "CUDA_ERROR_HARDWARE_STACK_ERROR",
        CUDA_ERROR_ILLEGAL_INSTRUCTION => "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        CUDA_ERROR_MISALIGNED_ADDRESS => "CUDA_ERROR_MISALIGNED_ADDRESS",
        CUDA_ERROR_INVALID_ADDRESS_SPACE => "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        CUDA_ERROR_INVALID_PC => "CUDA_ERROR_INVALID_PC",
        CUDA_ERROR_LAUNCH_FAILED => "CUDA_ERROR_LAUNCH_FAILED",
        CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE => "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
        CUDA_ERROR_TENSOR_MEMORY_LEAK => "CUDA_ERROR_TENSOR_MEMORY_LEAK",
        CUDA_ERROR_NOT_PERMITTED => "CUDA_ERROR_NOT_PERMITTED",
        CUDA_ERROR_NOT_SUPPORTED => "CUDA_ERROR_NOT_SUPPORTED",
        CUDA_ERROR_SYSTEM_DRIVER_MISMATCH => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        CUDA_ERROR_UNKNOWN => "CUDA_ERROR_UNKNOWN",
        _ => return None,
    })
}

/// Whether `code` leaves the CUDA context unusable ("sticky" errors: the context must be
/// destroyed, every later call in it fails), so the engine must stop using the device.
pub(crate) fn is_sticky(code: CUresult) -> bool {
    matches!(
        code,
        CUDA_ERROR_NOT_INITIALIZED
            | CUDA_ERROR_DEINITIALIZED
            | CUDA_ERROR_STUB_LIBRARY
            | CUDA_ERROR_DEVICE_UNAVAILABLE
            | CUDA_ERROR_NO_DEVICE
            | CUDA_ERROR_INVALID_CONTEXT
            | CUDA_ERROR_ECC_UNCORRECTABLE
            | CUDA_ERROR_NVLINK_UNCORRECTABLE
            | CUDA_ERROR_CONTAINED
            | CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_LAUNCH_TIMEOUT
            | CUDA_ERROR_CONTEXT_IS_DESTROYED
            | CUDA_ERROR_ASSERT
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_TENSOR_MEMORY_LEAK
            | CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
            | CUDA_ERROR_UNKNOWN
    )
}
