//! Which memory a region may name: each region given to the engine must lie inside the
//! storage of one of the tensors registered with it, on the device its backend copies on,
//! since a region is a raw address that the copy thread writes to.

use offload_core::transfer::{BackendKind, RegionSpec};
use pyo3::prelude::*;

use crate::errors::INVALID_INPUT_ERROR;

/// Where a tensor's memory is: its storage's bytes and its device.
#[derive(Debug)]
struct Allocation {
    start: u64,
    len: usize,
    device_type: String,
    device_index: Option<i32>,
}

/// Reads a torch tensor's storage extent and device.
fn allocation(tensor: &Bound<'_, PyAny>) -> PyResult<Allocation> {
    let not_a_tensor =
        |e: PyErr| INVALID_INPUT_ERROR.err(format!("tensors: expected torch tensors ({e})"));
    let storage = tensor
        .call_method0("untyped_storage")
        .map_err(not_a_tensor)?;
    let device = tensor.getattr("device").map_err(not_a_tensor)?;
    Ok(Allocation {
        start: storage.call_method0("data_ptr")?.extract()?,
        len: storage.call_method0("nbytes")?.extract()?,
        device_type: device.getattr("type")?.extract()?,
        device_index: device.getattr("index")?.extract()?,
    })
}

/// Each region checked to lie inside the storage of one of `tensors`, on the backend's
/// device.
pub(super) fn checked_regions(
    regions: Vec<(u64, u32, usize, usize)>,
    tensors: &[Bound<'_, PyAny>],
    kind: &BackendKind,
) -> PyResult<Vec<RegionSpec>> {
    let allocations = tensors
        .iter()
        .map(allocation)
        .collect::<PyResult<Vec<_>>>()?;
    regions
        .into_iter()
        .map(|region| checked_region(region, &allocations, kind))
        .collect()
}

/// A region that lies inside one of `allocations`, on the backend's device.
fn checked_region(
    (base, n, bytes, stride): (u64, u32, usize, usize),
    allocations: &[Allocation],
    kind: &BackendKind,
) -> PyResult<RegionSpec> {
    let on_device = |a: &Allocation| match kind {
        BackendKind::Cuda(options) => {
            a.device_type == "cuda" && a.device_index.unwrap_or(0) == options.device
        }
        _ => a.device_type == "cpu",
    };
    // SAFETY: the spec is used only for the bounds check below until one of `allocations`
    // is shown to contain it.
    let spec = unsafe { RegionSpec::new(base, n, bytes, stride) }
        .map_err(|e| INVALID_INPUT_ERROR.err(e.to_string()))?;
    let Some(home) = allocations
        .iter()
        .find(|a| spec.lies_within(a.start, a.len))
    else {
        return Err(INVALID_INPUT_ERROR.err(format!(
            "region at {base:#x} ({n} blocks of {bytes} bytes, stride {stride}) lies in none of \
             the given tensors' storage"
        )));
    };
    if !on_device(home) {
        return Err(INVALID_INPUT_ERROR.err(format!(
            "region at {base:#x} lies in a tensor on {}{}, which the {kind:?} backend cannot copy",
            home.device_type,
            home.device_index
                .map(|i| format!(":{i}"))
                .unwrap_or_default()
        )));
    }
    Ok(spec)
}
