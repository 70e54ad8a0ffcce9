//! The CUDA driver's and backend's errors. They name the library, symbol, version or call at
//! fault, and depend on nothing of the engine, so the engine's own errors can carry them.

use super::sys;
use super::{version_text, LIBRARY_ENV};

/// Errors of the CUDA driver and backend. Each message names the library, symbol, version
/// or call at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// `dlopen` failed: no NVIDIA driver installed, or the path is wrong.
    #[error(
        "cannot load the CUDA driver library {path}: {reason} (is the NVIDIA driver \
         installed? set {LIBRARY_ENV} to its path if it is not on the loader path)"
    )]
    LibraryNotFound {
        /// The path or name given to `dlopen`.
        path: String,
        /// The loader's message.
        reason: String,
    },
    /// The library lacks functions the backend cannot work without.
    #[error("the CUDA driver library {path} lacks required symbol(s) {}", .symbols.join(", "))]
    MissingSymbol {
        /// The library.
        path: String,
        /// Every missing required symbol.
        symbols: Vec<&'static str>,
    },
    /// The driver is older than [`MIN_DRIVER_VERSION`](super::MIN_DRIVER_VERSION).
    #[error(
        "CUDA driver version {} is too old: kvoffload needs {} or newer; upgrade the NVIDIA \
         driver",
        version_text(*.version),
        version_text(*.minimum)
    )]
    DriverTooOld {
        /// What `cuDriverGetVersion` reported (e.g. 12040 for 12.4).
        version: i32,
        /// The minimum.
        minimum: i32,
    },
    /// A driver call returned an error.
    #[error("{call} failed: {name} ({code}): {description}")]
    Call {
        /// The call, with its arguments where they help.
        call: String,
        /// The `CUresult`.
        code: i32,
        /// Its name from `cuGetErrorName` (e.g. `CUDA_ERROR_ILLEGAL_ADDRESS`).
        name: String,
        /// Its description from `cuGetErrorString`.
        description: String,
    },
    /// A [`CudaOptions`](super::CudaOptions) value is invalid.
    #[error("invalid CUDA option {field} = {value}: {reason}")]
    InvalidOption {
        /// The option.
        field: &'static str,
        /// Its value.
        value: String,
        /// Why it is refused.
        reason: &'static str,
    },
}

impl CudaError {
    /// The `CUresult` of a failed call, if this is one.
    pub fn code(&self) -> Option<i32> {
        match self {
            Self::Call { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether the error leaves the CUDA context unusable (a "sticky" error such as
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`): the engine must stop using the device.
    pub fn is_sticky(&self) -> bool {
        self.code().is_some_and(sys::is_sticky)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::driver::describe_error;
    use super::super::MIN_DRIVER_VERSION;
    use super::*;
    use crate::transfer::BackendError;

    #[test]
    fn errors_name_what_is_wrong() {
        let err = CudaError::DriverTooOld {
            version: 11040,
            minimum: MIN_DRIVER_VERSION,
        };
        assert!(err.to_string().contains("11.4 is too old"), "{err}");
        assert!(err.to_string().contains("11.8"), "{err}");
        let err = describe_error(
            None,
            None,
            "cuEventQuery".into(),
            sys::CUDA_ERROR_ILLEGAL_ADDRESS,
        );
        assert!(err.is_sticky());
        assert!(
            err.to_string().contains("CUDA_ERROR_ILLEGAL_ADDRESS (700)"),
            "{err}"
        );
        assert!(BackendError::from(err).is_fatal());
        let err = describe_error(None, None, "x".into(), 12345);
        assert!(err.to_string().contains("CUDA_ERROR_12345"), "{err}");
        assert!(!BackendError::from(err).is_fatal());
    }
}
